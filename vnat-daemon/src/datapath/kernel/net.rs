//! Routes and addresses, through rtnetlink ([`super::rtnl`]).
//!
//! Every route and every `lo` address vnat adds carries [`ROUTE_PROTO`], so
//! cleanup removes exactly what vnat added, also after a crash, and a route
//! or address someone else made is never replaced or removed. (The first version ran iproute2 for each of these; a
//! process start per call made a move take tens of milliseconds.)

use std::net::IpAddr;

use super::{policy, rtnl};
use crate::datapath::{DatapathError, Proto, VirtualFlow};

/// Protocol number of vnat's host routes (`ip route show proto 157`) and
/// of the addresses it keeps on `lo` (`IFA_PROTO`).
pub const ROUTE_PROTO: u8 = 157;

/// Where the kernel would send a packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteInfo {
    pub dev: String,
    pub ifindex: u32,
    pub gateway: Option<IpAddr>,
    /// The source address the kernel picks for this route.
    pub prefsrc: Option<IpAddr>,
}

fn kernel(what: String) -> impl FnOnce(std::io::Error) -> DatapathError {
    move |source| DatapathError::Kernel { what, source }
}

pub fn ifindex(name: &str) -> Result<u32, DatapathError> {
    nix::net::if_::if_nametoindex(name).map_err(|e| DatapathError::Kernel {
        what: format!("looking up interface {name}"),
        source: std::io::Error::from(e),
    })
}

pub fn ifname(index: u32) -> Result<String, DatapathError> {
    let mut buf = [0u8; libc::IF_NAMESIZE];
    // SAFETY: if_indextoname writes at most IF_NAMESIZE bytes (the name and
    // its NUL) into `buf`, which is exactly that long.
    let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr().cast()) };
    if p.is_null() {
        return Err(DatapathError::Kernel {
            what: format!("looking up interface index {index}"),
            source: std::io::Error::last_os_error(),
        });
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// `ip route get DST [from SRC]`: the interface and gateway the kernel uses.
pub fn route_get(dst: IpAddr, from: Option<IpAddr>) -> Result<RouteInfo, DatapathError> {
    let r = rtnl::route_get(dst, from).map_err(|_| DatapathError::NoRoute { addr: dst })?;
    if r.kind != rtnl::RouteType::Unicast {
        return Err(DatapathError::NoRoute { addr: dst });
    }
    let ifindex = r.oif.ok_or(DatapathError::NoRoute { addr: dst })?;
    Ok(RouteInfo {
        dev: ifname(ifindex)?,
        ifindex,
        gateway: r.gateway,
        prefsrc: r.prefsrc,
    })
}

/// See [`rtnl::neighbour_resolved`].
pub fn neighbour_resolved(addr: IpAddr, ifindex: u32) -> Result<bool, DatapathError> {
    rtnl::neighbour_resolved(addr, ifindex).map_err(kernel(format!(
        "reading the neighbour entry of {addr} on interface {ifindex}"
    )))
}

/// See [`rtnl::resolve_neighbour`].
pub fn resolve_neighbour(addr: IpAddr, ifindex: u32) -> Result<(), DatapathError> {
    rtnl::resolve_neighbour(addr, ifindex)
        .map_err(kernel(format!("resolving {addr} on interface {ifindex}")))
}

/// The route for packets from `from` to `dst` that leave through interface
/// `oif`: `ip route get DST from SRC oif DEV`, but None where no route of
/// the tables leaves through `oif` (see [`rtnl::route_get_via`]).
pub fn route_get_via(
    dst: IpAddr,
    from: IpAddr,
    oif: u32,
) -> Result<Option<RouteInfo>, DatapathError> {
    let r = rtnl::route_get_via(dst, from, oif).map_err(kernel(format!(
        "looking up the route to {dst} from {from} through interface {oif}"
    )))?;
    // An answer through another interface is no route through this one.
    let Some(r) =
        r.filter(|r| r.kind == rtnl::RouteType::Unicast && r.oif.is_none_or(|i| i == oif))
    else {
        return Ok(None);
    };
    Ok(Some(RouteInfo {
        dev: ifname(oif)?,
        ifindex: oif,
        gateway: r.gateway,
        prefsrc: r.prefsrc,
    }))
}

/// vnat's routing table for connections that leave through interface
/// `ifindex` while the host's main table would send them elsewhere (or to
/// another next hop): `VIA_TABLE_BASE + ifindex` (`ip route show table N`).
pub const VIA_TABLE_BASE: u32 = 0x766e_0000;

/// Priority of vnat's per-connection rules (`ip rule`): after `local` (0),
/// before `main` (32766) and the rules VPN clients add above 5000.
pub const VIA_RULE_PRIORITY: u32 = 1000;

/// How much longer an IPv4 packet is as IPv6 (40-byte header for 20).
pub const FAMILY_GROWTH: u32 = 20;

fn via_rule(flow: &VirtualFlow, ifindex: u32) -> policy::FlowRule {
    policy::FlowRule {
        tcp: flow.proto == Proto::Tcp,
        src: flow.local,
        dst: flow.remote,
        table: VIA_TABLE_BASE + ifindex,
        priority: VIA_RULE_PRIORITY,
    }
}

/// Route `flow`'s packets (by its virtual endpoints, as its socket sends
/// them) by `route` instead of the main table: a host route for its remote
/// address in the table of `route`'s interface (via `route.gateway`, or on
/// the link), and a rule for exactly this flow (protocol, both addresses,
/// both ports), so that no other traffic follows it. For a connection
/// moved to a second link's address while the first stays up (`vnatctl
/// migrate`): routed by the main table, its packets would leave by the
/// first link's default route, where tc could rewrite them but not make
/// them leave by the second link once the first one's router is gone (the
/// neighbour lookup for it fails before tc sees a packet). For a
/// connection whose peer moved where the peer's old address is not routed
/// (`KernelDatapath::flow_route`): its packets would die in an unresolved
/// neighbour entry for the old address, or leave by the wrong link.
///
/// The table's route for an address is shared by the flows to it through
/// that interface and follows the latest one installed: flows to one
/// address are one peer's, which moves them together. (Two hosts behind
/// one address that both moved onto this host's link at different
/// addresses would share the last one's next hop.)
///
/// A flow carried in the other family (`route.gateway` is an IPv6 next hop
/// for an IPv4 connection) gets an RFC 5549 route, and its MTU: the link's
/// less the 20 bytes the IPv6 header adds in tc, so that TCP sizes its
/// segments and the kernel its datagrams to fit once translated (TCP
/// rereads the route's MTU at its next send, `tcp_current_mss`).
pub fn add_via_route(flow: &VirtualFlow, route: &RouteInfo) -> Result<(), DatapathError> {
    let rule = via_rule(flow, route.ifindex);
    let mtu = match route.gateway {
        Some(g) if g.is_ipv4() != flow.remote.is_ipv4() => Some(
            rtnl::link_mtu(route.ifindex)
                .map_err(kernel(format!("reading the MTU of {}", route.dev)))?
                .saturating_sub(FAMILY_GROWTH),
        ),
        _ => None,
    };
    policy::set_table_route(
        flow.remote.ip(),
        route.gateway,
        route.ifindex,
        rule.table,
        ROUTE_PROTO,
        mtu,
    )
    .map_err(kernel(format!(
        "adding the route to {} through {} in table {}",
        flow.remote.ip(),
        route.dev,
        rule.table
    )))?;
    policy::add_flow_rule(&rule, ROUTE_PROTO).map_err(kernel(format!(
        "adding the routing rule for {flow:?} (table {})",
        rule.table
    )))
}

/// Undo [`add_via_route`] for `flow` through `ifindex`; the table's route
/// for its remote address too unless `route_still_used` (another flow to
/// that address through that interface).
pub fn del_via_route(
    flow: &VirtualFlow,
    ifindex: u32,
    route_still_used: bool,
) -> Result<(), DatapathError> {
    let rule = via_rule(flow, ifindex);
    policy::del_flow_rule(&rule, ROUTE_PROTO)
        .map_err(kernel(format!("removing the routing rule for {flow:?}")))?;
    if !route_still_used {
        // Gone with its interface, or never added: nothing to undo.
        let _ = policy::del_table_route(flow.remote.ip(), rule.table, ROUTE_PROTO);
    }
    Ok(())
}

/// The flows vnat routes by a per-connection rule, with the interface.
pub fn via_routes() -> Result<Vec<(VirtualFlow, u32)>, DatapathError> {
    let rules =
        policy::flow_rules(ROUTE_PROTO).map_err(kernel("listing vnat's routing rules".into()))?;
    Ok(rules
        .into_iter()
        .filter(|r| r.priority == VIA_RULE_PRIORITY && r.table > VIA_TABLE_BASE)
        .map(|r| {
            let flow = VirtualFlow {
                proto: if r.tcp { Proto::Tcp } else { Proto::Udp },
                local: r.src,
                remote: r.dst,
            };
            (flow, r.table - VIA_TABLE_BASE)
        })
        .collect())
}

/// The sink for packets from a kept address that have no route (see
/// [`keep_local`](super::KernelDatapath)): a veth pair in this namespace,
/// `vnat-sink` without ARP, so that a packet routed there leaves at once,
/// and its peer, where it arrives with a local source address and is
/// dropped as a martian, never forwarded or answered. Both ends up, so
/// that IPv6 uses the route (it skips routes over links without carrier),
/// and without IPv6 addresses of their own (no link-local address, so no
/// traffic of the pair's own and no address changes that would wake the
/// address watch while a move is under way).
pub const SINK_DEV: &str = "vnat-sink";
pub const SINK_PEER: &str = "vnat-sinkp";

/// vnat's table of last-resort routes (one default route per family, to
/// the sink), and the priority of its rules "from ADDR lookup" it: after
/// `main` (32766) and `default` (32767), so consulted only when the host
/// has no route at all.
pub const FALLBACK_TABLE: u32 = 0x766e_ffff;
pub const FALLBACK_PRIORITY: u32 = 32800;

/// Make sure the sink and its routes are there; whether it was created.
pub fn ensure_sink() -> Result<bool, DatapathError> {
    let what = |s: &str| kernel(format!("{s} {SINK_DEV}"));
    let created = nix::net::if_::if_nametoindex(SINK_DEV).is_err();
    if created {
        policy::add_veth(SINK_DEV, SINK_PEER).map_err(what("creating"))?;
    }
    let (sink, peer) = match sink_indexes()? {
        Some(ours) => ours,
        None => return Err(foreign_sink()),
    };
    if created {
        // Before they come up. A kernel without IPv6 refuses it, and has
        // nothing to generate anyway.
        for i in [sink, peer] {
            if let Err(e) = policy::set_no_ipv6_addr_gen(i) {
                tracing::debug!(error = %e, "cannot turn off IPv6 address generation on the sink");
            }
        }
    }
    policy::set_link_up(sink, true).map_err(what("setting up"))?;
    policy::set_link_up(peer, false).map_err(what("setting up the peer of"))?;
    for v6 in [false, true] {
        policy::set_default_route_dev(v6, sink, FALLBACK_TABLE, ROUTE_PROTO)
            .map_err(what("adding the last-resort route through"))?;
    }
    Ok(created)
}

/// Write the IPv6 last-resort route again. An IPv6 socket that sent
/// while the host had no route caches the route to the sink, and keeps it
/// until something changes in the sink's table: routes added to the main
/// table since (the new network's) do not make it look again, as they do
/// for IPv4.
pub fn refresh_sink_v6() -> Result<(), DatapathError> {
    let sink = ifindex(SINK_DEV)?;
    policy::set_default_route_dev(true, sink, FALLBACK_TABLE, ROUTE_PROTO).map_err(kernel(format!(
        "renewing the last-resort route through {SINK_DEV}"
    )))
}

/// What [`remove_sink`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SinkRemoval {
    /// vnat's sink was there and is gone (its routes with it).
    Removed,
    /// No link of that name.
    Absent,
    /// A link of that name someone else made: left alone.
    Foreign,
}

/// Remove the sink (its routes go with it). A link of that name someone
/// else made is left alone; saying so is the caller's (the datapath tries
/// at every change of its kept addresses, `vnatd --cleanup` once).
pub fn remove_sink() -> Result<SinkRemoval, DatapathError> {
    if nix::net::if_::if_nametoindex(SINK_DEV).is_err() {
        return Ok(SinkRemoval::Absent);
    }
    match sink_indexes()? {
        Some((sink, _)) => policy::del_link(sink)
            .map(|()| SinkRemoval::Removed)
            .map_err(kernel(format!("removing {SINK_DEV}"))),
        None => Ok(SinkRemoval::Foreign),
    }
}

/// Why a link named like the sink is not used (nor removed).
pub fn foreign_sink_warning() -> String {
    foreign_sink().to_string()
}

/// The indexes of the sink and its peer if `SINK_DEV` is vnat's: a veth
/// whose peer is `SINK_PEER` (None: a link of that name that is not).
fn sink_indexes() -> Result<Option<(u32, u32)>, DatapathError> {
    let sink = ifindex(SINK_DEV)?;
    let Ok(peer) = nix::net::if_::if_nametoindex(SINK_PEER) else {
        return Ok(None);
    };
    let link =
        super::peerns::link(sink).map_err(kernel(format!("reading interface {SINK_DEV}")))?;
    let ours =
        link.kind == Some(netlink_packet_route::link::InfoKind::Veth) && link.lower == Some(peer);
    Ok(ours.then_some((sink, peer)))
}

fn foreign_sink() -> DatapathError {
    DatapathError::Kernel {
        what: format!(
            "using {SINK_DEV}: an interface of that name is there that vnat did not make \
             (not a veth pair with {SINK_PEER}); vnatd neither uses nor removes it: rename it"
        ),
        source: std::io::Error::from_raw_os_error(libc::EEXIST),
    }
}

/// Packets from `src` that have no route go to the sink.
pub fn add_fallback_rule(src: IpAddr) -> Result<(), DatapathError> {
    policy::add_source_rule(src, FALLBACK_TABLE, FALLBACK_PRIORITY, ROUTE_PROTO)
        .map_err(kernel(format!("adding the last-resort rule for {src}")))
}

pub fn del_fallback_rule(src: IpAddr) -> Result<(), DatapathError> {
    policy::del_source_rule(src, FALLBACK_TABLE, FALLBACK_PRIORITY, ROUTE_PROTO)
        .map_err(kernel(format!("removing the last-resort rule for {src}")))
}

/// The addresses with a last-resort rule (what a previous vnatd kept).
pub fn fallback_rules() -> Result<Vec<IpAddr>, DatapathError> {
    policy::source_rules(FALLBACK_TABLE, ROUTE_PROTO)
        .map_err(kernel("listing vnat's last-resort rules".into()))
}

/// What comes before the IP header of a packet on an interface, as tc
/// sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// An Ethernet header (Ethernet, veth, bridges, loopback).
    Ethernet,
    /// Nothing: the packet starts with its IP header (tun, wireguard, PPP,
    /// IP tunnels).
    None,
}

/// The link layer of interface `ifindex`, from its `ARPHRD_*` type; an
/// error for a type vnat does not translate on.
pub fn link_layer(ifindex: u32) -> Result<LinkLayer, DatapathError> {
    let kind = rtnl::link_type(ifindex).map_err(kernel(format!(
        "looking up the type of interface {ifindex}"
    )))?;
    match kind {
        // ARPHRD_ETHER, ARPHRD_LOOPBACK.
        1 | 772 => Ok(LinkLayer::Ethernet),
        // ARPHRD_PPP, ARPHRD_RAWIP, ARPHRD_TUNNEL, ARPHRD_TUNNEL6,
        // ARPHRD_SIT, ARPHRD_IPGRE, ARPHRD_IP6GRE, ARPHRD_NONE (tun,
        // wireguard).
        512 | 519 | 768 | 769 | 776 | 778 | 823 | 65534 => Ok(LinkLayer::None),
        other => Err(DatapathError::Kernel {
            what: format!(
                "attaching tc to interface {} (link type {other}: neither Ethernet nor IP without a link-layer header, which vnat cannot translate on)",
                ifname(ifindex).unwrap_or_else(|_| ifindex.to_string())
            ),
            source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
        }),
    }
}

/// Whether this namespace has an interface without a link-layer header
/// (see [`super::object::TC_L3`]); false if the interfaces cannot be listed
/// (the programs are then loaded at their first attachment).
pub fn has_l3_interface() -> bool {
    nix::net::if_::if_nameindex().is_ok_and(|list| {
        list.iter()
            .any(|i| matches!(link_layer(i.index()), Ok(LinkLayer::None)))
    })
}

fn lo_index() -> Result<u32, DatapathError> {
    ifindex("lo")
}

fn addresses() -> Result<Vec<rtnl::Addr>, DatapathError> {
    rtnl::addresses().map_err(kernel("listing this host's addresses (rtnetlink)".into()))
}

/// Every address currently assigned to `lo`, and whether vnat added it.
pub fn lo_addrs() -> Result<Vec<(IpAddr, bool)>, DatapathError> {
    let lo = lo_index()?;
    Ok(addresses()?
        .into_iter()
        .filter(|a| a.ifindex == lo)
        .map(|a| (a.addr, a.protocol == ROUTE_PROTO))
        .collect())
}

/// Global-scope addresses of every interface but `lo`, with the ifindex.
pub fn interface_addrs() -> Result<Vec<(IpAddr, u32)>, DatapathError> {
    let lo = lo_index()?;
    Ok(addresses()?
        .into_iter()
        .filter(|a| a.ifindex != lo && a.scope == 0)
        .map(|a| (a.addr, a.ifindex))
        .collect())
}

/// Keep a moved-away address local (DESIGN.md §3): as a host address on
/// `lo`. The datapath adds it with the ARP settings that keep it from being
/// answered for or announced on other links (`sysctls.rs`).
pub fn add_lo_addr(a: IpAddr) -> Result<(), DatapathError> {
    // IPv6 without duplicate address detection: the address is the
    // connection's own and must be usable at once.
    rtnl::add_address(a, lo_index()?, ROUTE_PROTO).map_err(kernel(format!("adding {a} to lo")))
}

/// Remove `a` from `lo` if vnat put it there: it carries our tag, or
/// `added_by_us` (a translation's own record that it added it, for the
/// untagged addresses of a vnatd from before the tags). An address someone
/// else added stays. Returns whether it was removed.
pub fn del_lo_addr(a: IpAddr, added_by_us: bool) -> Result<bool, DatapathError> {
    match lo_addrs()?.into_iter().find(|(x, _)| *x == a) {
        None => Ok(false),
        Some((_, false)) if !added_by_us => {
            tracing::warn!(address = %a, "not removing an address on lo that vnat did not add");
            Ok(false)
        }
        Some(_) => {
            rtnl::del_address(a, lo_index()?).map_err(kernel(format!("removing {a} from lo")))?;
            Ok(true)
        }
    }
}

/// Remove vnat's host route for `virt` from the main table: vnat makes
/// none any more (a moved flow's packets are routed by a rule of their own,
/// [`add_via_route`]), but a vnatd before it did, for every application's
/// traffic to a moved peer's old address.
pub fn del_host_route(virt: IpAddr) -> Result<(), DatapathError> {
    rtnl::del_host_route(virt, ROUTE_PROTO)
        .map_err(kernel(format!("removing the host route {virt}")))
}

/// Host routes of the main table carrying vnat's protocol number (what a
/// vnatd before per-flow routes left).
pub fn host_routes() -> Result<Vec<IpAddr>, DatapathError> {
    let mut all = Vec::new();
    for fam in [rtnl::AddressFamily::Inet, rtnl::AddressFamily::Inet6] {
        let routes = rtnl::routes(fam).map_err(kernel("listing routes (rtnetlink)".into()))?;
        all.extend(
            routes
                .into_iter()
                .filter(|r| r.protocol == ROUTE_PROTO)
                // Host routes only: vnat makes no other.
                .filter(|r| {
                    r.dst
                        .is_some_and(|d| r.dst_len == if d.is_ipv4() { 32 } else { 128 })
                })
                .filter_map(|r| r.dst),
        );
    }
    Ok(all)
}
