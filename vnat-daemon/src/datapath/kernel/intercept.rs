//! VCMP datagrams to a routed container's address reach vnatd.
//!
//! A peer's vnatd binds a connection of a container whose address this
//! host routes (no NAT) only once this host shows it receives at that
//! address: the peer sends a token (a PROVE, `vnat_vcmp` `proof`) to the
//! container's address at the VCMP port, which this host would forward
//! to the container, where nothing answers. So for each such address
//! vnatd adds the rule "to ADDR ipproto udp dport PORT lookup
//! [`INTERCEPT_TABLE`]" and, in that table, the route "local ADDR dev lo":
//! exactly those datagrams are delivered here (to vnatd's socket, bound to
//! the wildcard), everything else still goes to the container. The
//! address is never put on an interface, so the host does not answer for
//! it otherwise (ARP, neighbour discovery, other ports).

use std::collections::BTreeSet;
use std::io;
use std::net::IpAddr;

use netlink_packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE};
use netlink_packet_route::{
    route::{RouteAttribute, RouteHeader, RouteProtocol, RouteScope, RouteType},
    rule::RuleMessage,
    IpProtocol, RouteNetlinkMessage,
};

use super::net::ROUTE_PROTO;
use super::policy::{add_rule, del_rule, rules_tagged, table_rule};
use super::rtnl::{call, host_route};

/// vnat's table of the `local` routes of intercepted guest addresses (in
/// the range `--cleanup` treats as vnat's).
pub const INTERCEPT_TABLE: u32 = 0x766e_fffe;
/// Priority of the intercept rules: before the per-connection ones
/// (`net::VIA_RULE_PRIORITY`, 1000) and `main`.
pub const INTERCEPT_PRIORITY: u32 = 999;

fn rule(addr: IpAddr, port: u16) -> RuleMessage {
    table_rule(
        None,
        Some((addr, Some(port))),
        IpProtocol::Udp,
        INTERCEPT_TABLE,
        INTERCEPT_PRIORITY,
        ROUTE_PROTO,
    )
}

fn local_route(addr: IpAddr) -> netlink_packet_route::route::RouteMessage {
    let mut m = host_route(addr);
    m.header.table = RouteHeader::RT_TABLE_UNSPEC;
    m.header.protocol = RouteProtocol::from(ROUTE_PROTO);
    m.header.kind = RouteType::Local;
    m.header.scope = RouteScope::Host;
    m.attributes.push(RouteAttribute::Table(INTERCEPT_TABLE));
    m.attributes.push(RouteAttribute::Oif(1));
    m
}

/// Intercept VCMP datagrams (UDP `port`) to `addr`.
fn add(addr: IpAddr, port: u16) -> io::Result<()> {
    call(
        RouteNetlinkMessage::NewRoute(local_route(addr)),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
    )?;
    add_rule(rule(addr, port))
}

/// Stop intercepting for `addr` (its rule with `port`, and its route).
pub fn remove(addr: IpAddr, port: u16) -> io::Result<()> {
    del_rule(rule(addr, port))?;
    let mut m = local_route(addr);
    m.header.scope = RouteScope::NoWhere;
    match call(RouteNetlinkMessage::DelRoute(m), NLM_F_ACK) {
        Err(e) if !matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOENT)) => Err(e),
        _ => Ok(()),
    }
}

/// The intercept rules there are: (address, port).
pub fn intercepted() -> io::Result<Vec<(IpAddr, u16)>> {
    Ok(rules_tagged(ROUTE_PROTO)?
        .into_iter()
        .filter(|r| r.table == INTERCEPT_TABLE)
        .filter_map(|r| Some((r.dst?, r.dport?)))
        .collect())
}

/// Intercept exactly for `addrs` at `port`: add what is missing, remove
/// the others.
pub fn sync(addrs: &BTreeSet<IpAddr>, port: u16) -> io::Result<()> {
    let there = intercepted()?;
    for (a, p) in &there {
        if *p != port || !addrs.contains(a) {
            remove(*a, *p)?;
        }
    }
    for a in addrs {
        if !there.contains(&(*a, port)) {
            add(*a, port)?;
        }
    }
    Ok(())
}
