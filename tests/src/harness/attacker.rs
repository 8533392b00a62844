//! An off-path attacker: a fourth host on its own subnet behind the router
//! of a [`LaptopRouterServer`], which can reach both hosts (and their
//! vnatd's VCMP port) but sees none of their traffic.
//!
//! | subnet | IPv4           | who                           |
//! |--------|----------------|-------------------------------|
//! | D      | 198.18.4.0/24  | attacker .2, router .1 (`rk`) |
use std::net::{IpAddr, Ipv4Addr};

use super::{veth, LaptopRouterServer, Netns};

/// The attacker's address on subnet D.
pub const ATTACKER_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 4, 2);
/// The router's address on subnet D.
pub const ROUTER_D_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 4, 1);
/// The router's interface towards the attacker.
pub const ROUTER_IF_D: &str = "rk";
/// [`attach_attacker_beside_server`]: the attacker's and the server's
/// addresses on their own link (subnet F), and the server's interface.
pub const ATTACKER_F_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 2);
pub const SERVER_F_ADDR: Ipv4Addr = Ipv4Addr::new(198, 18, 9, 1);
pub const SERVER_IF_F: &str = "atk0";

/// Creates the attacker's namespace (`vt-<tag>-...`), links it to
/// `topo.router` (attacker `eth0` 198.18.4.2/24, router `rk` 198.18.4.1/24)
/// and routes it through the router. Returns the namespace (deleted on
/// drop) and the attacker's address. One attacker per topology.
pub fn attach_attacker(topo: &LaptopRouterServer, tag: &str) -> (Netns, IpAddr) {
    let ns = Netns::new(tag);
    veth(&ns, "eth0", &topo.router, ROUTER_IF_D);
    ns.add_addr("eth0", ATTACKER_ADDR.into(), 24);
    topo.router.add_addr(ROUTER_IF_D, ROUTER_D_ADDR.into(), 24);
    ns.default_route(ROUTER_D_ADDR.into(), "eth0");
    (ns, IpAddr::V4(ATTACKER_ADDR))
}

/// An attacker linked straight to `topo.server` (attacker `eth0`
/// 198.18.9.2/24, server `atk0` 198.18.9.1/24), routed through the server,
/// whose reverse-path filter is off so that it accepts sources spoofed as
/// other hosts there. For floods that must reach the server whatever sits
/// between router and server (a benchmark's userspace delay line, which a
/// flood would saturate before the server saw it). Returns the namespace
/// and the attacker's address.
pub fn attach_attacker_beside_server(topo: &LaptopRouterServer, tag: &str) -> (Netns, IpAddr) {
    let ns = Netns::new(tag);
    veth(&ns, "eth0", &topo.server, SERVER_IF_F);
    ns.add_addr("eth0", ATTACKER_F_ADDR.into(), 24);
    topo.server.add_addr(SERVER_IF_F, SERVER_F_ADDR.into(), 24);
    ns.default_route(SERVER_F_ADDR.into(), "eth0");
    for k in ["all", "default", SERVER_IF_F] {
        topo.server
            .set_sysctl(&format!("net/ipv4/conf/{k}/rp_filter"), "0");
    }
    (ns, IpAddr::V4(ATTACKER_F_ADDR))
}
