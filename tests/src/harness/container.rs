//! A container as Docker's default bridge network makes one: its own
//! network namespace on a veth to its host, an address of a private
//! subnet, the host as its default gateway, the host's nftables
//! masquerading whatever it sends out, and `-p HOST:CTR` publishing a port
//! with destination NAT. Nothing of vnat's runs inside it: only its cgroup
//! can be enabled on the host's vnatd.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::{nat::load_ruleset, veth, Cgroup, Netns};

pub struct Container {
    pub ns: Netns,
    pub cgroup: Cgroup,
    /// Its private address (10.S.0.2/24, the host being 10.S.0.1).
    pub addr: Ipv4Addr,
    /// Its private IPv6 address (fd00:S::2/64, the host being fd00:S::1),
    /// masqueraded too (NAT66, as Docker does with `ip6tables` on).
    pub addr6: Ipv6Addr,
    host_if: String,
    table: String,
}

impl Container {
    /// A container behind `host` on subnet 10.`subnet`.0.0/24, its veth
    /// named `host_if` on the host's side, masqueraded by the host towards
    /// every other interface. `tag` names its namespace, cgroup and nft
    /// table (keep it short).
    pub fn behind(host: &Netns, tag: &str, subnet: u8, host_if: &str) -> Container {
        let ns = Netns::new(tag);
        veth(host, host_if, &ns, "eth0");
        let gw = Ipv4Addr::new(10, subnet, 0, 1);
        let addr = Ipv4Addr::new(10, subnet, 0, 2);
        host.add_addr(host_if, gw.into(), 24);
        ns.add_addr("eth0", addr.into(), 24);
        ns.default_route(gw.into(), "eth0");
        let gw6 = Ipv6Addr::new(0xfd00, u16::from(subnet), 0, 0, 0, 0, 0, 1);
        let addr6 = Ipv6Addr::new(0xfd00, u16::from(subnet), 0, 0, 0, 0, 0, 2);
        host.add_addr(host_if, gw6.into(), 64);
        ns.add_addr("eth0", addr6.into(), 64);
        ns.default_route(gw6.into(), "eth0");
        host.enable_forwarding();
        let table = format!("vnatctr_{}", tag.replace('-', "_"));
        let ruleset = format!(
            "table ip {table} {{
                chain post {{
                    type nat hook postrouting priority srcnat;
                    ip saddr 10.{subnet}.0.0/24 oifname != \"{host_if}\" masquerade
                }}
            }}
            table ip6 {table} {{
                chain post {{
                    type nat hook postrouting priority srcnat;
                    ip6 saddr fd00:{subnet:x}::/64 oifname != \"{host_if}\" masquerade
                }}
            }}"
        );
        load_ruleset(host, &table, &ruleset).unwrap_or_else(|e| panic!("{e}"));
        Container {
            ns,
            cgroup: Cgroup::new(tag),
            addr,
            addr6,
            host_if: host_if.to_string(),
            table,
        }
    }

    /// A container whose IPv6 prefix its host routes, with no NAT (an
    /// IPv6 deployment with a routed or delegated prefix): its own
    /// 2001:db8:`subnet`::2/64 on a veth to `host` (2001:db8:`subnet`::1),
    /// reached from everywhere else through the network that routes the
    /// prefix to the host (see [`Container::route_prefix`]). It has no IPv4
    /// address (`addr` is 0.0.0.0). The host forwards it through a stateful
    /// firewall (conntrack), as Docker's and podman's hosts and routers do.
    pub fn routed(host: &Netns, tag: &str, subnet: u8, host_if: &str) -> Container {
        let ns = Netns::new(tag);
        veth(host, host_if, &ns, "eth0");
        let gw6 = Ipv6Addr::new(0x2001, 0xdb8, u16::from(subnet), 0, 0, 0, 0, 1);
        let addr6 = Ipv6Addr::new(0x2001, 0xdb8, u16::from(subnet), 0, 0, 0, 0, 2);
        host.add_addr(host_if, gw6.into(), 64);
        ns.add_addr("eth0", addr6.into(), 64);
        ns.default_route(gw6.into(), "eth0");
        host.enable_forwarding();
        let table = format!("vnatctr_{}", tag.replace('-', "_"));
        let ruleset = format!(
            "table ip6 {table} {{
                chain forward {{
                    type filter hook forward priority filter; policy accept;
                    ct state established,related accept
                    ip6 daddr {addr6} ct state invalid drop
                }}
            }}"
        );
        load_ruleset(host, &table, &ruleset).unwrap_or_else(|e| panic!("{e}"));
        Container {
            ns,
            cgroup: Cgroup::new(tag),
            addr: Ipv4Addr::UNSPECIFIED,
            addr6,
            host_if: host_if.to_string(),
            table,
        }
    }

    /// The container's /64, for a route on the network's router.
    pub fn prefix6(&self) -> String {
        let s = self.addr6.segments();
        format!("{:x}:{:x}:{:x}::/64", s[0], s[1], s[2])
    }

    /// `router` routes the container's prefix to its host at `host_addr`
    /// through `router_if` (what the network that delegated the prefix
    /// does).
    pub fn route_prefix(&self, router: &Netns, host_addr: IpAddr, router_if: &str) {
        router.route_via(&self.prefix6(), host_addr, router_if);
    }

    /// `docker run -p host_port:port`: TCP to any of `host`'s addresses on
    /// `host_port` goes to the container's `port`.
    pub fn publish(&self, host: &Netns, host_port: u16, port: u16) {
        self.publish_proto(host, "tcp", host_port, port);
    }

    /// `docker run -p host_port:port/udp`.
    pub fn publish_udp(&self, host: &Netns, host_port: u16, port: u16) {
        self.publish_proto(host, "udp", host_port, port);
    }

    fn publish_proto(&self, host: &Netns, proto: &str, host_port: u16, port: u16) {
        let rule = format!(
            "table ip {t} {{
                chain pre {{
                    type nat hook prerouting priority dstnat;
                    iifname != \"{i}\" {proto} dport {host_port} dnat to {a}:{port}
                }}
            }}",
            t = self.table,
            i = self.host_if,
            a = self.addr,
        );
        let what = format!("{}_pub_{proto}_{host_port}", self.table);
        load_ruleset(host, &what, &rule).unwrap_or_else(|e| panic!("{e}"));
    }

    /// `addr`'s IP with `port`.
    pub fn endpoint(&self, port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.addr), port)
    }
}
