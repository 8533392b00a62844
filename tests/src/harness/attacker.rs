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
