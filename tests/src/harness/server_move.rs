//! Moving the *server* of a [`LaptopRouterServer`] too, for the cases where
//! both ends of a connection move (VNAT paper, section 4.2, and the location
//! chain of section 3.3.2.1).
//!
//! Address plan, added to the one in `topology.rs` (all inside namespaces):
//!
//! | subnet | IPv4            | IPv6            | who                                          |
//! |--------|-----------------|-----------------|----------------------------------------------|
//! | E      | 198.18.5.0/24   | fd00:5e:5::/64  | server .2 / ::2 (after a move), router .1 / ::1 |
//! | F      | 198.18.6.0/24   | fd00:5e:6::/64  | location-server host .2 / ::2, router .1 / ::1 |
//!
//! The server's link to E (`eth1`, router side `re`) is down and has no
//! address on the server until [`move_server_to_e`]. The location-server host
//! ([`LocationHost`]) is a namespace of its own behind the router's `rf`; the
//! test runs a vnatd there (with an empty cgroup: it serves locations, it
//! records no connections).

use std::net::IpAddr;

use super::{topology::LaptopRouterServer, veth, Dual, Netns};

fn dual(v4: [u8; 4], ipv6: bool, subnet: u16, host: u16) -> Dual {
    Dual {
        v4: v4.into(),
        v6: ipv6.then(|| [0xfd00, 0x5e, subnet, 0, 0, 0, 0, host].into()),
    }
}

/// The server's second link, to subnet E.
pub struct ServerLinkE {
    /// The server's interface on E (`eth1`) and the router's (`re`).
    pub server_if: String,
    pub router_if: String,
    /// 198.18.5.2 (fd00:5e:5::2): the server after [`move_server_to_e`].
    pub server_addr: Dual,
    /// 198.18.5.1 (fd00:5e:5::1).
    pub router_addr: Dual,
}

/// What happens to the server's old address (subnet C) when it moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OldServerAddress {
    /// Gone from the network: removed from its link, which goes down. Only
    /// the server's vnatd keeps it (on `lo`, as every mover does), and no
    /// packet to it reaches anybody: like a host that moved whole.
    Gone,
    /// Removed from its link (so the server's vnatd sees it vanish and moves
    /// the connection) but kept as a /32 on the server's `lo`, and the
    /// router routes it to the server's new link: the old location still
    /// answers, as the original host does when only a process migrated
    /// (paper section 4.2, step 2).
    StillAnswers,
}

/// Give the server of `topo` a second, unplugged link to the router on
/// subnet E. The router's side is up with its addresses; the server's side
/// is down without any.
pub fn add_server_link_e(topo: &LaptopRouterServer) -> ServerLinkE {
    let e = ServerLinkE {
        server_if: "eth1".into(),
        router_if: "re".into(),
        server_addr: dual([198, 18, 5, 2], topo.ipv6, 5, 2),
        router_addr: dual([198, 18, 5, 1], topo.ipv6, 5, 1),
    };
    veth(&topo.server, &e.server_if, &topo.router, &e.router_if);
    for (a, p) in e.router_addr.with_prefixes() {
        topo.router.add_addr(&e.router_if, a, p);
    }
    topo.server.link_down(&e.server_if);
    e
}

/// What a real move does to the server: subnet C's addresses leave its link
/// (see [`OldServerAddress`] for what becomes of them), E's link comes up
/// with E's addresses, and the default routes point at E's router.
pub fn move_server_to_e(topo: &LaptopRouterServer, e: &ServerLinkE, old: OldServerAddress) {
    let s = &topo.server;
    // The /32 goes on lo before the address leaves the link, so there is no
    // moment in which the old address is not local (a TCP segment arriving
    // then would be answered with a reset).
    if old == OldServerAddress::StillAnswers {
        // vnatd may keep it there already (it keeps the addresses of
        // mobile connections local).
        let on_lo: Vec<IpAddr> = s.addresses("lo").iter().map(|a| a.addr).collect();
        for a in addrs(&topo.server_addr) {
            if !on_lo.contains(&a) {
                s.add_addr("lo", a, if a.is_ipv4() { 32 } else { 128 });
            }
        }
    }
    unplug_server_c(topo);
    plug_server_e(topo, e);
    if old == OldServerAddress::StillAnswers {
        // The router still has C's connected route, but C's link is down:
        // a host route sends the old address to the server's new link.
        for (a, via) in addrs(&topo.server_addr)
            .into_iter()
            .zip(addrs(&e.server_addr))
        {
            topo.router.route_via(&host_cidr(a), via, &e.router_if);
        }
    }
}

/// The first half of [`move_server_to_e`] with [`OldServerAddress::Gone`]:
/// subnet C's addresses leave the server's link, which goes down. Until
/// [`plug_server_e`] the server has no network (an outage).
pub fn unplug_server_c(topo: &LaptopRouterServer) {
    let s = &topo.server;
    for (a, p) in topo.server_addr.with_prefixes() {
        s.del_addr(&topo.server_if, a, p);
    }
    s.link_down(&topo.server_if);
}

/// The second half: E's link comes up with E's addresses, and the default
/// routes point at E's router.
pub fn plug_server_e(topo: &LaptopRouterServer, e: &ServerLinkE) {
    let s = &topo.server;
    s.link_up(&e.server_if);
    for (a, p) in e.server_addr.with_prefixes() {
        s.add_addr(&e.server_if, a, p);
    }
    s.default_route(e.router_addr.v4.into(), &e.server_if);
    if topo.ipv6 {
        s.default_route(e.router_addr.v6().into(), &e.server_if);
    }
}

fn addrs(d: &Dual) -> Vec<IpAddr> {
    d.with_prefixes().into_iter().map(|(a, _)| a).collect()
}

fn host_cidr(a: IpAddr) -> String {
    match a {
        IpAddr::V4(_) => format!("{a}/32"),
        IpAddr::V6(_) => format!("{a}/128"),
    }
}

/// A host on subnet F behind the router, for a vnatd that serves as the
/// configured location server (paper 3.3.2.1, P(3)/S(3)).
pub struct LocationHost {
    pub ns: Netns,
    /// `eth0` here, `rf` on the router.
    pub ns_if: String,
    pub router_if: String,
    /// 198.18.6.2 (fd00:5e:6::2).
    pub addr: Dual,
    /// 198.18.6.1 (fd00:5e:6::1).
    pub router_addr: Dual,
}

/// Create the location-server host on subnet F, wired to `topo`'s router.
/// `tag` goes into the namespace's name.
pub fn add_location_host(topo: &LaptopRouterServer, tag: &str) -> LocationHost {
    let h = LocationHost {
        ns: Netns::new(&format!("{tag}-ls")),
        ns_if: "eth0".into(),
        router_if: "rf".into(),
        addr: dual([198, 18, 6, 2], topo.ipv6, 6, 2),
        router_addr: dual([198, 18, 6, 1], topo.ipv6, 6, 1),
    };
    veth(&h.ns, &h.ns_if, &topo.router, &h.router_if);
    for (a, p) in h.router_addr.with_prefixes() {
        topo.router.add_addr(&h.router_if, a, p);
    }
    for (a, p) in h.addr.with_prefixes() {
        h.ns.add_addr(&h.ns_if, a, p);
    }
    h.ns.default_route(h.router_addr.v4.into(), &h.ns_if);
    if topo.ipv6 {
        h.ns.default_route(h.router_addr.v6().into(), &h.ns_if);
    }
    h
}
