//! vnat's own routing, through rtnetlink: the per-connection rules and
//! tables that send a migrated connection out of its new link, and the
//! sink with its last-resort routes for the addresses kept local for
//! mobile connections (`net.rs` says what each is for).

use std::{io, net::IpAddr};

use netlink_packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::{
    link::{
        AfSpecInet6, AfSpecUnspec, In6AddrGenMode, InfoData, InfoKind, InfoVeth, LinkAttribute,
        LinkFlags, LinkInfo, LinkMessage,
    },
    route::{
        RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteMetric, RouteProtocol,
        RouteScope, RouteType, RouteVia,
    },
    rule::{RuleAction, RuleAttribute, RuleMessage, RulePortRange},
    AddressFamily, IpProtocol, RouteNetlinkMessage,
};

use super::rtnl::{bits, call, family, host_route};

/// The host route `dst` via `gateway` (None: on the link) on `oif` in
/// routing table `table`, tagged with `protocol`, in place of the one there
/// is (the table is vnat's own). A gateway of the other family than `dst`
/// is an RFC 5549 next hop (`RTA_VIA`, Linux 5.2); `mtu`, where given, is
/// the route's.
pub fn set_table_route(
    dst: IpAddr,
    gateway: Option<IpAddr>,
    oif: u32,
    table: u32,
    protocol: u8,
    mtu: Option<u32>,
) -> io::Result<()> {
    let mut m = host_route(dst);
    m.header.table = RouteHeader::RT_TABLE_UNSPEC;
    m.attributes.push(RouteAttribute::Table(table));
    m.header.protocol = RouteProtocol::from(protocol);
    m.header.kind = RouteType::Unicast;
    match gateway {
        Some(g) if g.is_ipv4() == dst.is_ipv4() => m
            .attributes
            .push(RouteAttribute::Gateway(RouteAddress::from(g))),
        Some(IpAddr::V4(v4)) => m.attributes.push(RouteAttribute::Via(RouteVia::Inet(v4))),
        Some(IpAddr::V6(v6)) => m.attributes.push(RouteAttribute::Via(RouteVia::Inet6(v6))),
        None => m.header.scope = RouteScope::Link,
    }
    m.attributes.push(RouteAttribute::Oif(oif));
    if let Some(mtu) = mtu {
        m.attributes
            .push(RouteAttribute::Metrics(vec![RouteMetric::Mtu(mtu)]));
    }
    call(
        RouteNetlinkMessage::NewRoute(m),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
    )
    .map(|_| ())
}

/// Delete the host route `dst` of table `table` if it carries `protocol`.
pub fn del_table_route(dst: IpAddr, table: u32, protocol: u8) -> io::Result<()> {
    let mut m = host_route(dst);
    // Any scope (`ip route del` asks so too): the IPv4 FIB deletes only a
    // route of the scope asked for, unless it is RT_SCOPE_NOWHERE
    // (`fib_table_delete`), and a route without a gateway is on-link.
    m.header.scope = RouteScope::NoWhere;
    m.header.table = RouteHeader::RT_TABLE_UNSPEC;
    m.attributes.push(RouteAttribute::Table(table));
    m.header.protocol = RouteProtocol::from(protocol);
    call(RouteNetlinkMessage::DelRoute(m), NLM_F_ACK).map(|_| ())
}

/// Delete the route to `dst`/`dst_len` (None: the default route of
/// the family `v6` says) of table `table` if it carries `protocol`.
pub fn del_route(
    v6: bool,
    dst: Option<IpAddr>,
    dst_len: u8,
    table: u32,
    protocol: u8,
) -> io::Result<()> {
    let mut m = RouteMessage::default();
    m.header.address_family = if v6 {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    m.header.destination_prefix_length = dst_len;
    // Any scope, as in `del_table_route`.
    m.header.scope = RouteScope::NoWhere;
    m.header.table = RouteHeader::RT_TABLE_UNSPEC;
    m.header.protocol = RouteProtocol::from(protocol);
    if let Some(d) = dst {
        m.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(d)));
    }
    m.attributes.push(RouteAttribute::Table(table));
    call(RouteNetlinkMessage::DelRoute(m), NLM_F_ACK).map(|_| ())
}

/// A policy rule for one flow: its packets, by protocol and both
/// endpoints, are routed by table `table`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlowRule {
    pub tcp: bool,
    pub src: std::net::SocketAddr,
    pub dst: std::net::SocketAddr,
    pub table: u32,
    pub priority: u32,
}

fn rule_message(r: &FlowRule, protocol: u8) -> RuleMessage {
    let ip_protocol = if r.tcp {
        IpProtocol::Tcp
    } else {
        IpProtocol::Udp
    };
    let (from, to) = (
        Some((r.src.ip(), Some(r.src.port()))),
        Some((r.dst.ip(), Some(r.dst.port()))),
    );
    table_rule(from, to, ip_protocol, r.table, r.priority, protocol)
}

/// The rule "[from SRC [sport PORT]] [to DST [dport PORT]] ipproto
/// `ip_protocol` lookup `table`" at `priority`, tagged with `protocol`;
/// `from` and `to` are full addresses.
pub(super) fn table_rule(
    from: Option<(IpAddr, Option<u16>)>,
    to: Option<(IpAddr, Option<u16>)>,
    ip_protocol: IpProtocol,
    table: u32,
    priority: u32,
    protocol: u8,
) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.action = RuleAction::ToTable;
    let ports = |p: u16| RulePortRange { start: p, end: p };
    if let Some((ip, port)) = from {
        m.header.family = family(ip);
        m.header.src_len = bits(ip);
        m.attributes.push(RuleAttribute::Source(ip));
        m.attributes
            .extend(port.map(|p| RuleAttribute::SourcePortRange(ports(p))));
    }
    if let Some((ip, port)) = to {
        m.header.family = family(ip);
        m.header.dst_len = bits(ip);
        m.attributes.push(RuleAttribute::Destination(ip));
        m.attributes
            .extend(port.map(|p| RuleAttribute::DestinationPortRange(ports(p))));
    }
    m.attributes.extend([
        RuleAttribute::IpProtocol(ip_protocol),
        RuleAttribute::Table(table),
        RuleAttribute::Priority(priority),
        RuleAttribute::Protocol(RouteProtocol::from(protocol)),
    ]);
    m
}

/// Add the rule `m`; one that exists already is kept.
pub(super) fn add_rule(m: RuleMessage) -> io::Result<()> {
    match call(
        RouteNetlinkMessage::NewRule(m),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
    ) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        other => other.map(|_| ()),
    }
}

/// Delete the rule `m`; one that is not there is no error.
pub(super) fn del_rule(m: RuleMessage) -> io::Result<()> {
    match call(RouteNetlinkMessage::DelRule(m), NLM_F_ACK) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        other => other.map(|_| ()),
    }
}

/// Add `rule`, tagged with `protocol`; one that exists already is kept.
pub fn add_flow_rule(rule: &FlowRule, protocol: u8) -> io::Result<()> {
    add_rule(rule_message(rule, protocol))
}

/// Delete `rule`; one that is not there is no error.
pub fn del_flow_rule(rule: &FlowRule, protocol: u8) -> io::Result<()> {
    del_rule(rule_message(rule, protocol))
}

/// A rule of ours as the kernel lists it: the fields vnat's rules use.
pub(super) struct ListedRule {
    pub src: Option<IpAddr>,
    pub dst: Option<IpAddr>,
    pub tcp: Option<bool>,
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    pub table: u32,
    pub priority: u32,
}

/// Every rule of both families tagged with `protocol`.
pub(super) fn rules_tagged(protocol: u8) -> io::Result<Vec<ListedRule>> {
    let mut out = Vec::new();
    for fam in [AddressFamily::Inet, AddressFamily::Inet6] {
        let mut m = RuleMessage::default();
        m.header.family = fam;
        let answer = match call(RouteNetlinkMessage::GetRule(m), NLM_F_DUMP) {
            Ok(a) => a,
            // A kernel without IPv6 policy routing has no IPv6 rules.
            Err(_) if fam == AddressFamily::Inet6 => continue,
            Err(e) => return Err(e),
        };
        for msg in answer {
            let RouteNetlinkMessage::NewRule(r) = msg else {
                continue;
            };
            let mut rule = ListedRule {
                src: None,
                dst: None,
                tcp: None,
                sport: None,
                dport: None,
                table: u32::from(r.header.table),
                priority: 0,
            };
            let mut ours = false;
            for a in &r.attributes {
                match a {
                    RuleAttribute::Source(ip) => rule.src = Some(*ip),
                    RuleAttribute::Destination(ip) => rule.dst = Some(*ip),
                    RuleAttribute::IpProtocol(IpProtocol::Tcp) => rule.tcp = Some(true),
                    RuleAttribute::IpProtocol(IpProtocol::Udp) => rule.tcp = Some(false),
                    RuleAttribute::SourcePortRange(p) => rule.sport = Some(p.start),
                    RuleAttribute::DestinationPortRange(p) => rule.dport = Some(p.start),
                    RuleAttribute::Table(t) => rule.table = *t,
                    RuleAttribute::Priority(p) => rule.priority = *p,
                    RuleAttribute::Protocol(p) => ours = u8::from(*p) == protocol,
                    _ => {}
                }
            }
            if ours {
                out.push(rule);
            }
        }
    }
    Ok(out)
}

/// Every per-flow rule of both families tagged with `protocol`.
pub fn flow_rules(protocol: u8) -> io::Result<Vec<FlowRule>> {
    Ok(rules_tagged(protocol)?
        .into_iter()
        .filter_map(|r| {
            Some(FlowRule {
                tcp: r.tcp?,
                src: std::net::SocketAddr::new(r.src?, r.sport?),
                dst: std::net::SocketAddr::new(r.dst?, r.dport?),
                table: r.table,
                priority: r.priority,
            })
        })
        .collect())
}

/// Create the veth pair `name` - `peer` in this namespace.
pub fn add_veth(name: &str, peer: &str) -> io::Result<()> {
    let mut p = LinkMessage::default();
    p.attributes.push(LinkAttribute::IfName(peer.into()));
    let mut m = LinkMessage::default();
    m.attributes.extend([
        LinkAttribute::IfName(name.into()),
        LinkAttribute::LinkInfo(vec![
            LinkInfo::Kind(InfoKind::Veth),
            LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(p))),
        ]),
    ]);
    call(
        RouteNetlinkMessage::NewLink(m),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
    )
    .map(|_| ())
}

/// No IPv6 address generated for link `ifindex` when it comes up (address
/// generation mode "none"): no link-local address, no duplicate address
/// detection, router solicitations or MLD reports, and none of the address
/// and route notifications they cause.
pub fn set_no_ipv6_addr_gen(ifindex: u32) -> io::Result<()> {
    let mut m = LinkMessage::default();
    m.header.index = ifindex;
    m.attributes
        .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
            vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
        )]));
    call(RouteNetlinkMessage::SetLink(m), NLM_F_ACK).map(|_| ())
}

/// Set link `ifindex` up, and without ARP (`noarp`: its neighbours are
/// never resolved, packets leave at once).
pub fn set_link_up(ifindex: u32, noarp: bool) -> io::Result<()> {
    let mut m = LinkMessage::default();
    m.header.index = ifindex;
    m.header.change_mask = LinkFlags::Up | LinkFlags::Noarp;
    m.header.flags = LinkFlags::Up;
    if noarp {
        m.header.flags |= LinkFlags::Noarp;
    }
    call(RouteNetlinkMessage::SetLink(m), NLM_F_ACK).map(|_| ())
}

/// Delete link `ifindex` (a veth takes its peer with it).
pub fn del_link(ifindex: u32) -> io::Result<()> {
    let mut m = LinkMessage::default();
    m.header.index = ifindex;
    call(RouteNetlinkMessage::DelLink(m), NLM_F_ACK).map(|_| ())
}

/// The default route of `dst`'s family through `oif` (on the link) in
/// table `table`, tagged with `protocol`, in place of the one there is.
pub fn set_default_route_dev(v6: bool, oif: u32, table: u32, protocol: u8) -> io::Result<()> {
    let mut m = RouteMessage::default();
    m.header.address_family = if v6 {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    m.header.table = RouteHeader::RT_TABLE_UNSPEC;
    m.header.protocol = RouteProtocol::from(protocol);
    m.header.kind = RouteType::Unicast;
    m.header.scope = RouteScope::Link;
    m.attributes.push(RouteAttribute::Table(table));
    m.attributes.push(RouteAttribute::Oif(oif));
    call(
        RouteNetlinkMessage::NewRoute(m),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
    )
    .map(|_| ())
}

fn source_rule_message(src: IpAddr, table: u32, priority: u32, protocol: u8) -> RuleMessage {
    // UDP only: a TCP segment sent into the sink is lost where a failed
    // send would be retried as soon as there is a route again, and TCP
    // never shows its application a failed send.
    table_rule(
        Some((src, None)),
        None,
        IpProtocol::Udp,
        table,
        priority,
        protocol,
    )
}

/// Add the rule "from `src` ipproto udp lookup `table`" at `priority`, tagged with
/// `protocol`; one that exists already is kept.
pub fn add_source_rule(src: IpAddr, table: u32, priority: u32, protocol: u8) -> io::Result<()> {
    add_rule(source_rule_message(src, table, priority, protocol))
}

/// Delete that rule; one that is not there is no error.
pub fn del_source_rule(src: IpAddr, table: u32, priority: u32, protocol: u8) -> io::Result<()> {
    del_rule(source_rule_message(src, table, priority, protocol))
}

/// The sources of the rules of both families that look up `table` and
/// carry `protocol`, without ports of their own.
pub fn source_rules(table: u32, protocol: u8) -> io::Result<Vec<IpAddr>> {
    Ok(rules_tagged(protocol)?
        .into_iter()
        .filter(|r| r.table == table && r.sport.is_none())
        .filter_map(|r| r.src)
        .collect())
}
