//! Real NAT in front of the laptop of a [`LaptopRouterServer`]: nftables
//! source NAT on the router towards the server's subnet C, as a home
//! router, a café or carrier-grade NAT does it.
use std::net::Ipv4Addr;

use super::LaptopRouterServer;

/// The laptop's two networks behind their NATs: subnet A (home) and B
/// (café), each with its own public address on subnet C.
pub const NAT_PUBLIC_A: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 101);
pub const NAT_PUBLIC_B: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 102);

/// Source NAT for the laptop's subnets A and B (`fully-random` ports, one
/// public address each, added to the router's subnet-C interface so the
/// server reaches them), and nothing opened from subnet C inwards. Returns
/// nft's complaint if it refuses the ruleset.
pub fn nat_router(topo: &LaptopRouterServer) -> Result<(), String> {
    nat_router_with(topo, NatPorts::FullyRandom)
}

/// How the NAT picks a connection's public port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NatPorts {
    /// Keep the private port when it is free (a home router, Linux's
    /// default).
    Preserving,
    /// A random port for every connection (`fully-random`, as carrier-grade
    /// NATs do).
    FullyRandom,
}

/// [`nat_router`] with the port policy `ports`.
pub fn nat_router_with(topo: &LaptopRouterServer, ports: NatPorts) -> Result<(), String> {
    let how = match ports {
        NatPorts::Preserving => "",
        NatPorts::FullyRandom => " fully-random",
    };
    let r = &topo.router;
    let c = &topo.router_if_c;
    r.add_addr(c, NAT_PUBLIC_A.into(), 24);
    r.add_addr(c, NAT_PUBLIC_B.into(), 24);
    let ruleset = format!(
        "table ip vnatnat {{
            chain vnat_post {{
                type nat hook postrouting priority srcnat;
                oifname \"{c}\" ip saddr 198.18.1.0/24 snat to {NAT_PUBLIC_A}{how}
                oifname \"{c}\" ip saddr 198.18.2.0/24 snat to {NAT_PUBLIC_B}{how}
            }}
            chain vnat_forward {{
                type filter hook forward priority filter;
                iifname \"{c}\" ct state new drop
            }}
        }}"
    );
    load_ruleset(r, "nat", &ruleset)
}

/// Source NAT for the laptop's subnet B only ([`NAT_PUBLIC_B`], nothing
/// opened from subnet C towards it); subnet A stays routed, its addresses
/// public: a campus or office network with routed addresses, and a home
/// or café behind a NAT (issue 32, item 2).
pub fn nat_router_b_only(topo: &LaptopRouterServer, ports: NatPorts) -> Result<(), String> {
    let how = match ports {
        NatPorts::Preserving => "",
        NatPorts::FullyRandom => " fully-random",
    };
    let r = &topo.router;
    let c = &topo.router_if_c;
    r.add_addr(c, NAT_PUBLIC_B.into(), 24);
    let ruleset = format!(
        "table ip vnatnat {{
            chain vnat_post {{
                type nat hook postrouting priority srcnat;
                oifname \"{c}\" ip saddr 198.18.2.0/24 snat to {NAT_PUBLIC_B}{how}
            }}
            chain vnat_forward {{
                type filter hook forward priority filter;
                iifname \"{c}\" ip daddr 198.18.2.0/24 ct state new drop
            }}
        }}"
    );
    load_ruleset(r, "natb", &ruleset)
}

/// Put the attacker's subnet D (`attach_attacker`) behind the same NAT as
/// subnet A: its hosts share the public address [`NAT_PUBLIC_A`] with the
/// laptop's home network (after [`nat_router`]).
pub fn nat_subnet_d_as_a(topo: &LaptopRouterServer) -> Result<(), String> {
    let c = &topo.router_if_c;
    let rule = format!(
        "add rule ip vnatnat vnat_post oifname \"{c}\" ip saddr 198.18.4.0/24 snat to {NAT_PUBLIC_A} fully-random\n"
    );
    load_ruleset(&topo.router, "natd", &rule)
}

/// The server's public address behind the router's port forwarding
/// ([`port_forward`]).
pub const SERVER_PUBLIC: Ipv4Addr = Ipv4Addr::new(198, 18, 5, 1);

/// A port-forwarding router in front of the server: [`SERVER_PUBLIC`]
/// (an address of the router) forwards `tcp_ports` and `udp_ports` to the
/// server's own address (destination NAT), as a home or office router
/// exposes a server. The server's sockets see their private address; the
/// laptop knows only the public one.
pub fn port_forward(
    topo: &LaptopRouterServer,
    tcp_ports: &[u16],
    udp_ports: &[u16],
) -> Result<(), String> {
    let same = |ports: &[u16]| ports.iter().map(|p| (*p, *p)).collect::<Vec<_>>();
    port_forward_mapped(topo, &same(tcp_ports), &same(udp_ports))
}

/// [`port_forward`] with the port changed on the way: each `(public,
/// private)` pair forwards [`SERVER_PUBLIC`]`:public` to the server's own
/// address at `private` (public 8053 to a DNS server's 53, say), so the
/// two ends of a forwarded flow name the server's end by different ports.
pub fn port_forward_mapped(
    topo: &LaptopRouterServer,
    tcp: &[(u16, u16)],
    udp: &[(u16, u16)],
) -> Result<(), String> {
    let r = &topo.router;
    r.add_addr(&topo.router_if_c, SERVER_PUBLIC.into(), 32);
    let server = topo.server_addr.v4;
    let rule = |proto: &str, (public, private): &(u16, u16)| {
        format!("ip daddr {SERVER_PUBLIC} {proto} dport {public} dnat to {server}:{private}\n")
    };
    let rules: String = tcp
        .iter()
        .map(|p| rule("tcp", p))
        .chain(udp.iter().map(|p| rule("udp", p)))
        .collect();
    let ruleset = format!(
        "table ip vnatdnat {{
            chain vnat_pre {{
                type nat hook prerouting priority dstnat;
                {rules}
            }}
        }}"
    );
    load_ruleset(r, "dnat", &ruleset)
}

pub(crate) fn load_ruleset(r: &super::Netns, what: &str, ruleset: &str) -> Result<(), String> {
    let file = std::env::temp_dir().join(format!("vnat-{what}-{}.nft", r.name()));
    std::fs::write(&file, ruleset).map_err(|e| format!("writing the nft ruleset: {e}"))?;
    let out = r.try_run(&["nft", "-f", &file.display().to_string()]);
    let _ = std::fs::remove_file(&file);
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "nft refused the {what} ruleset: {}",
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
