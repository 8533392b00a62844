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

use netlink_packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::{
    route::{RouteAttribute, RouteHeader, RouteProtocol, RouteScope, RouteType},
    rule::{RuleAction, RuleAttribute, RuleMessage, RulePortRange},
    AddressFamily, IpProtocol, RouteNetlinkMessage,
};

use super::net::ROUTE_PROTO;
use super::rtnl::{bits, call, family, host_route};

/// vnat's table of the `local` routes of intercepted guest addresses (in
/// the range `--cleanup` treats as vnat's).
pub const INTERCEPT_TABLE: u32 = 0x766e_fffe;
/// Priority of the intercept rules: before the per-connection ones
/// (`net::VIA_RULE_PRIORITY`, 1000) and `main`.
pub const INTERCEPT_PRIORITY: u32 = 999;

fn rule(addr: IpAddr, port: u16) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = family(addr);
    m.header.dst_len = bits(addr);
    m.header.action = RuleAction::ToTable;
    m.attributes.extend([
        RuleAttribute::Destination(addr),
        RuleAttribute::IpProtocol(IpProtocol::Udp),
        RuleAttribute::DestinationPortRange(RulePortRange {
            start: port,
            end: port,
        }),
        RuleAttribute::Table(INTERCEPT_TABLE),
        RuleAttribute::Priority(INTERCEPT_PRIORITY),
        RuleAttribute::Protocol(RouteProtocol::from(ROUTE_PROTO)),
    ]);
    m
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
    match call(
        RouteNetlinkMessage::NewRule(rule(addr, port)),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        other => other.map(|_| ()),
    }
}

/// Stop intercepting for `addr` (its rule with `port`, and its route).
pub fn remove(addr: IpAddr, port: u16) -> io::Result<()> {
    match call(RouteNetlinkMessage::DelRule(rule(addr, port)), NLM_F_ACK) {
        Err(e) if e.raw_os_error() != Some(libc::ENOENT) => return Err(e),
        _ => {}
    }
    let mut m = local_route(addr);
    m.header.scope = RouteScope::NoWhere;
    match call(RouteNetlinkMessage::DelRoute(m), NLM_F_ACK) {
        Err(e) if !matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOENT)) => Err(e),
        _ => Ok(()),
    }
}

/// The intercept rules there are: (address, port).
pub fn intercepted() -> io::Result<Vec<(IpAddr, u16)>> {
    let mut out = Vec::new();
    for fam in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut m = RuleMessage::default();
        m.header.family = fam;
        let answer = match call(RouteNetlinkMessage::GetRule(m), NLM_F_DUMP) {
            Ok(a) => a,
            Err(_) if fam == AddressFamily::Inet6 => continue,
            Err(e) => return Err(e),
        };
        for msg in answer {
            let RouteNetlinkMessage::NewRule(r) = msg else {
                continue;
            };
            let (mut dst, mut port, mut ours, mut table) = (None, None, false, 0);
            for a in &r.attributes {
                match a {
                    RuleAttribute::Destination(ip) => dst = Some(*ip),
                    RuleAttribute::DestinationPortRange(p) => port = Some(p.start),
                    RuleAttribute::Protocol(p) => ours = u8::from(*p) == ROUTE_PROTO,
                    RuleAttribute::Table(t) => table = *t,
                    _ => {}
                }
            }
            if let (true, INTERCEPT_TABLE, Some(d), Some(p)) = (ours, table, dst, port) {
                out.push((d, p));
            }
        }
    }
    Ok(out)
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
