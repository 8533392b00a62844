//! The standard hosts of the integration tests and the demo.
//!
//! Address plan (all inside namespaces; never any other address):
//!
//! | subnet | IPv4            | IPv6            | who                                   |
//! |--------|-----------------|-----------------|---------------------------------------|
//! | A      | 198.18.1.0/24   | fd00:5e:1::/64  | laptop .2 / ::2, router .1 / ::1      |
//! | B      | 198.18.2.0/24   | fd00:5e:2::/64  | laptop .2 / ::2 (after a move), router .1 / ::1 |
//! | C      | 198.18.3.0/24   | fd00:5e:3::/64  | server .2 / ::2, router .1 / ::1      |
//!
//! `SameLink` uses subnet A only: laptop .2 (moves to .9), server .3.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::OnceLock,
    time::Duration,
};

use super::{veth, Dual, Netns};

fn dual(v4: [u8; 4], v6: Option<[u16; 8]>) -> Dual {
    Dual {
        v4: Ipv4Addr::from(v4),
        v6: v6.map(Ipv6Addr::from),
    }
}

fn v6(ipv6: bool, subnet: u16, host: u16) -> Option<[u16; 8]> {
    ipv6.then_some([0xfd00, 0x5e, subnet, 0, 0, 0, 0, host])
}

/// True if this kernel has the netem qdisc (CONFIG_NET_SCH_NETEM). Some
/// kernels, such as the 6.18 one vnat is developed on, do not: delay-based
/// tests and benchmarks should skip with a message rather than fail.
pub fn netem_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let ns = Netns::new("netem");
        ns.try_run(&[
            "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
        ])
        .status
        .success()
    })
}

/// A laptop with two links to a router (subnets A and B) and a server behind
/// the router (subnet C). The laptop starts on A; B's link is down and has no
/// address until [`LaptopRouterServer::move_laptop_to_b`].
pub struct LaptopRouterServer {
    pub laptop: Netns,
    pub router: Netns,
    pub server: Netns,
    /// The laptop's interface on subnet A (`wa`) and on subnet B (`wb`).
    pub laptop_if_a: String,
    pub laptop_if_b: String,
    /// The router's interfaces on A, B and C (`ra`, `rb`, `rc`).
    pub router_if_a: String,
    pub router_if_b: String,
    pub router_if_c: String,
    /// The server's interface (`eth0`).
    pub server_if: String,
    pub laptop_a_addr: Dual,
    pub laptop_b_addr: Dual,
    pub router_a_addr: Dual,
    pub router_b_addr: Dual,
    pub router_c_addr: Dual,
    pub server_addr: Dual,
    pub ipv6: bool,
    /// The netem delay on the router's egress on A, B and C, if any. Each
    /// direction crosses one router egress, so the laptop-server round trip
    /// grows by 2 x this.
    pub delay: Option<Duration>,
}

/// Options for [`LaptopRouterServer`]: `LaptopRouterServer::builder().ipv6(true).build()`.
#[derive(Default)]
pub struct LaptopRouterServerBuilder {
    tag: Option<String>,
    ipv6: bool,
    delay: Option<Duration>,
}

impl LaptopRouterServerBuilder {
    /// Short tag in the namespace names (default `lrs`), to tell tests apart
    /// in `ip netns list`.
    pub fn tag(mut self, tag: &str) -> Self {
        self.tag = Some(tag.to_string());
        self
    }

    /// Also configure IPv6 (dual stack).
    pub fn ipv6(mut self, on: bool) -> Self {
        self.ipv6 = on;
        self
    }

    /// Add `netem delay` on the router's egress on A, B and C, so every
    /// packet between laptop and server is delayed once by the router: the
    /// round trip grows by 2 x `delay`. Panics at build time on kernels
    /// without netem; check [`netem_available`] first.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = Some(delay);
        self
    }

    pub fn build(self) -> LaptopRouterServer {
        let tag = self.tag.unwrap_or_else(|| "lrs".to_string());
        let ipv6 = self.ipv6;
        // Fields are filled in as resources are created, so a panic half-way
        // still drops (and deletes) the namespaces made so far.
        let laptop = Netns::new(&format!("{tag}-l"));
        let router = Netns::new(&format!("{tag}-r"));
        let server = Netns::new(&format!("{tag}-s"));
        let topo = LaptopRouterServer {
            laptop,
            router,
            server,
            laptop_if_a: "wa".into(),
            laptop_if_b: "wb".into(),
            router_if_a: "ra".into(),
            router_if_b: "rb".into(),
            router_if_c: "rc".into(),
            server_if: "eth0".into(),
            laptop_a_addr: dual([198, 18, 1, 2], v6(ipv6, 1, 2)),
            laptop_b_addr: dual([198, 18, 2, 2], v6(ipv6, 2, 2)),
            router_a_addr: dual([198, 18, 1, 1], v6(ipv6, 1, 1)),
            router_b_addr: dual([198, 18, 2, 1], v6(ipv6, 2, 1)),
            router_c_addr: dual([198, 18, 3, 1], v6(ipv6, 3, 1)),
            server_addr: dual([198, 18, 3, 2], v6(ipv6, 3, 2)),
            ipv6,
            delay: self.delay,
        };
        topo.wire();
        topo
    }
}

impl LaptopRouterServer {
    /// IPv4 only, no delay.
    pub fn new() -> LaptopRouterServer {
        Self::builder().build()
    }

    pub fn builder() -> LaptopRouterServerBuilder {
        LaptopRouterServerBuilder::default()
    }

    fn wire(&self) {
        let t = self;
        veth(&t.laptop, &t.laptop_if_a, &t.router, &t.router_if_a);
        veth(&t.laptop, &t.laptop_if_b, &t.router, &t.router_if_b);
        veth(&t.server, &t.server_if, &t.router, &t.router_if_c);
        t.router.enable_forwarding();

        for (dev, addr) in [
            (&t.router_if_a, t.router_a_addr),
            (&t.router_if_b, t.router_b_addr),
            (&t.router_if_c, t.router_c_addr),
        ] {
            for (a, p) in addr.with_prefixes() {
                t.router.add_addr(dev, a, p);
            }
        }
        for (a, p) in t.laptop_a_addr.with_prefixes() {
            t.laptop.add_addr(&t.laptop_if_a, a, p);
        }
        for (a, p) in t.server_addr.with_prefixes() {
            t.server.add_addr(&t.server_if, a, p);
        }
        // B exists but is unplugged until the laptop moves there.
        t.laptop.link_down(&t.laptop_if_b);

        t.laptop
            .default_route(t.router_a_addr.v4.into(), &t.laptop_if_a);
        t.server
            .default_route(t.router_c_addr.v4.into(), &t.server_if);
        if t.ipv6 {
            t.laptop
                .default_route(t.router_a_addr.v6().into(), &t.laptop_if_a);
            t.server
                .default_route(t.router_c_addr.v6().into(), &t.server_if);
        }

        if let Some(delay) = t.delay {
            let ms = format!("{}ms", delay.as_millis());
            for dev in [&t.router_if_a, &t.router_if_b, &t.router_if_c] {
                let out = t.router.try_run(&[
                    "tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", &ms,
                ]);
                assert!(
                    out.status.success(),
                    "adding netem delay {ms} on the router's {dev} failed ({}); this kernel may lack \
                     netem (CONFIG_NET_SCH_NETEM): check harness::netem_available() and skip",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
    }

    /// What a real roam does to the laptop: subnet A's addresses are removed
    /// and its link goes down; B's link comes up with B's addresses and the
    /// default routes point at B's router. (Keeping the old address on `lo`
    /// is vnat's job, not the harness's.)
    pub fn move_laptop_to_b(&self) {
        let l = &self.laptop;
        for (a, p) in self.laptop_a_addr.with_prefixes() {
            l.del_addr(&self.laptop_if_a, a, p);
        }
        l.link_down(&self.laptop_if_a);
        self.plug_laptop_b();
        l.default_route(self.router_b_addr.v4.into(), &self.laptop_if_b);
        if self.ipv6 {
            l.default_route(self.router_b_addr.v6().into(), &self.laptop_if_b);
        }
    }

    /// The laptop leaves A for B, where it gets only B's IPv6 address and
    /// an IPv6 default route: no IPv4 at all (an IPv6-only network). Needs
    /// the builder's `.ipv6(true)`.
    pub fn move_laptop_to_b_v6_only(&self) {
        let l = &self.laptop;
        for (a, p) in self.laptop_a_addr.with_prefixes() {
            l.del_addr(&self.laptop_if_a, a, p);
        }
        l.link_down(&self.laptop_if_a);
        l.link_up(&self.laptop_if_b);
        l.add_addr(&self.laptop_if_b, self.laptop_b_addr.v6().into(), 64);
        l.default_route(self.router_b_addr.v6().into(), &self.laptop_if_b);
    }

    /// The reverse move, from B back to A.
    pub fn move_laptop_to_a(&self) {
        let l = &self.laptop;
        // (Those B gave it: both families, or IPv6 only.)
        let on_b: Vec<IpAddr> = l
            .addresses(&self.laptop_if_b)
            .iter()
            .map(|a| a.addr)
            .collect();
        for (a, p) in self.laptop_b_addr.with_prefixes() {
            if on_b.contains(&a) {
                l.del_addr(&self.laptop_if_b, a, p);
            }
        }
        l.link_down(&self.laptop_if_b);
        l.link_up(&self.laptop_if_a);
        for (a, p) in self.laptop_a_addr.with_prefixes() {
            l.add_addr(&self.laptop_if_a, a, p);
        }
        l.default_route(self.router_a_addr.v4.into(), &self.laptop_if_a);
        if self.ipv6 {
            l.default_route(self.router_a_addr.v6().into(), &self.laptop_if_a);
        }
    }

    /// Brings B up with its addresses while A stays as it is (a multi-homed
    /// laptop, e.g. for migrating one connection to another interface). The
    /// default routes are not changed.
    pub fn plug_laptop_b(&self) {
        self.laptop.link_up(&self.laptop_if_b);
        for (a, p) in self.laptop_b_addr.with_prefixes() {
            self.laptop.add_addr(&self.laptop_if_b, a, p);
        }
    }
}

impl Default for LaptopRouterServer {
    fn default() -> Self {
        Self::new()
    }
}

/// A laptop and a server on one link (one veth, subnet A): the laptop's
/// address changes within the link, as after a DHCP renumbering.
pub struct SameLink {
    pub laptop: Netns,
    pub server: Netns,
    /// Both ends are `eth0` (in their own namespaces).
    pub laptop_if: String,
    pub server_if: String,
    /// 198.18.1.2 (fd00:5e:1::2) before the move.
    pub laptop_addr: Dual,
    /// 198.18.1.9 (fd00:5e:1::9) after [`SameLink::move_laptop`].
    pub laptop_new_addr: Dual,
    /// 198.18.1.3 (fd00:5e:1::3).
    pub server_addr: Dual,
    pub ipv6: bool,
}

impl SameLink {
    /// `tag` goes into the namespace names; `ipv6` adds IPv6 (dual stack).
    pub fn new(tag: &str, ipv6: bool) -> SameLink {
        let topo = SameLink {
            laptop: Netns::new(&format!("{tag}-l")),
            server: Netns::new(&format!("{tag}-s")),
            laptop_if: "eth0".into(),
            server_if: "eth0".into(),
            laptop_addr: dual([198, 18, 1, 2], v6(ipv6, 1, 2)),
            laptop_new_addr: dual([198, 18, 1, 9], v6(ipv6, 1, 9)),
            server_addr: dual([198, 18, 1, 3], v6(ipv6, 1, 3)),
            ipv6,
        };
        veth(&topo.laptop, &topo.laptop_if, &topo.server, &topo.server_if);
        for (a, p) in topo.laptop_addr.with_prefixes() {
            topo.laptop.add_addr(&topo.laptop_if, a, p);
        }
        for (a, p) in topo.server_addr.with_prefixes() {
            topo.server.add_addr(&topo.server_if, a, p);
        }
        topo
    }

    /// Renumbers the laptop: the old address is removed, then the new one
    /// added (in that order, as a DHCP client does).
    pub fn move_laptop(&self) {
        for (a, p) in self.laptop_addr.with_prefixes() {
            self.laptop.del_addr(&self.laptop_if, a, p);
        }
        for (a, p) in self.laptop_new_addr.with_prefixes() {
            self.laptop.add_addr(&self.laptop_if, a, p);
        }
    }
}
