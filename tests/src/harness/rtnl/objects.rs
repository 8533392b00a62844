//! The links, addresses and routes the harness makes and reads, as
//! netlink-packet-route messages: what `ip link`, `ip addr` and `ip route`
//! send, and the fields of their answers the tests assert on.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::RawFd,
};

use netlink_packet_core::{NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE};
use netlink_packet_route::{
    address::{AddressAttribute, AddressHeaderFlags, AddressMessage, AddressProtocol},
    link::{InfoData, InfoKind, InfoVeth, LinkAttribute, LinkFlags, LinkInfo, LinkMessage},
    route::{
        RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteProtocol,
        RouteScope, RouteType,
    },
    rule::{RuleAttribute, RuleMessage},
    AddressFamily, RouteNetlinkMessage,
};

use super::{Rtnl, RtnlError};

/// The main routing table (`RT_TABLE_MAIN`), where `ip route` adds and shows.
const RT_TABLE_MAIN: u32 = 254;

/// A policy rule as RTM_GETRULE reports it (`ip rule`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub priority: u32,
    pub table: u32,
    /// FRA_PROTOCOL: who added it (157: vnat).
    pub protocol: u8,
    /// Its "from" address, if it has one.
    pub src: Option<IpAddr>,
}

/// A link as RTM_GETLINK reports it (what the tests and benchmarks read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    pub index: u32,
    pub name: String,
    pub up: bool,
    /// IFLA_GSO_MAX_SIZE and IFLA_GRO_MAX_SIZE.
    pub gso_max_size: Option<u32>,
    pub gro_max_size: Option<u32>,
    /// Packets received (IFLA_STATS64).
    pub rx_packets: Option<u64>,
}

/// An address of a link as RTM_GETADDR reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Address {
    /// IFA_LOCAL if there is one (the local end of a point-to-point
    /// address), else IFA_ADDRESS: what `ip addr` shows first.
    pub addr: IpAddr,
    pub prefix: u8,
    /// IFA_PROTO: who added the address, when they said.
    pub protocol: Option<AddressProtocol>,
}

/// A route as RTM_GETROUTE reports it. `dst` is the unspecified address of
/// the family, with `prefix` 0, for a default route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub dst: IpAddr,
    pub prefix: u8,
    pub gateway: Option<IpAddr>,
    /// The output interface's index.
    pub oif: Option<u32>,
    pub protocol: RouteProtocol,
    pub table: u32,
    pub scope: RouteScope,
    pub kind: RouteType,
    pub metric: Option<u32>,
    pub flags: RouteFlags,
}

impl Route {
    pub fn in_main_table(&self) -> bool {
        self.table == RT_TABLE_MAIN
    }
}

/// A unicast route to add to the main table: `dst/prefix via gateway dev
/// oif proto protocol`.
pub(crate) struct NewRoute {
    pub dst: IpAddr,
    pub prefix: u8,
    pub gateway: IpAddr,
    pub oif: u32,
    pub protocol: RouteProtocol,
    /// The route's metric (RTA_PRIORITY); the kernel's default 0 if None.
    pub metric: Option<u32>,
}

impl Rtnl {
    /// The index of the link called `name`.
    pub(crate) fn index(&mut self, name: &str) -> Result<u32, RtnlError> {
        self.get_link(name).map(|link| link.header.index)
    }

    /// The link called `name`, or None if there is none.
    pub(crate) fn link(&mut self, name: &str) -> Result<Option<Link>, RtnlError> {
        match self.get_link(name) {
            Ok(link) => Ok(Some(link_of(link))),
            Err(RtnlError::Refused { errno, .. }) if errno == libc::ENODEV => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// RTM_GETLINK by name (rtnl_getlink looks IFLA_IFNAME up when the
    /// index is 0).
    fn get_link(&mut self, name: &str) -> Result<LinkMessage, RtnlError> {
        let mut msg = LinkMessage::default();
        msg.attributes.push(LinkAttribute::IfName(name.into()));
        match self.get(RouteNetlinkMessage::GetLink(msg))? {
            RouteNetlinkMessage::NewLink(link) => Ok(link),
            _ => Err(RtnlError::NoAnswer),
        }
    }

    /// Sets IFF_UP of link `index` on or off.
    pub(crate) fn set_up(&mut self, index: u32, up: bool) -> Result<(), RtnlError> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        msg.header.change_mask = LinkFlags::Up;
        if up {
            msg.header.flags = LinkFlags::Up;
        }
        self.request(RouteNetlinkMessage::SetLink(msg), 0)
    }

    /// Moves link `index` to the namespace open as `netns_fd`.
    pub(crate) fn set_netns(&mut self, index: u32, netns_fd: RawFd) -> Result<(), RtnlError> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        msg.attributes.push(LinkAttribute::NetNsFd(netns_fd));
        self.request(RouteNetlinkMessage::SetLink(msg), 0)
    }

    pub(crate) fn del_link(&mut self, index: u32) -> Result<(), RtnlError> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        self.request(RouteNetlinkMessage::DelLink(msg), 0)
    }

    /// Creates a veth pair, end `a` in the namespace open as `a_fd` and end
    /// `b` in `b_fd`'s: veth_newlink creates each end directly there.
    pub(crate) fn add_veth(
        &mut self,
        (a, a_fd): (&str, RawFd),
        (b, b_fd): (&str, RawFd),
    ) -> Result<(), RtnlError> {
        let mut peer = LinkMessage::default();
        peer.attributes = vec![
            LinkAttribute::IfName(b.into()),
            LinkAttribute::NetNsFd(b_fd),
        ];
        let mut msg = LinkMessage::default();
        msg.attributes = vec![
            LinkAttribute::IfName(a.into()),
            LinkAttribute::NetNsFd(a_fd),
            LinkAttribute::LinkInfo(vec![
                LinkInfo::Kind(InfoKind::Veth),
                LinkInfo::Data(InfoData::Veth(InfoVeth::Peer(peer))),
            ]),
        ];
        self.request(RouteNetlinkMessage::NewLink(msg), NLM_F_CREATE | NLM_F_EXCL)
    }

    /// Adds `addr/prefix` to link `index`; IPv6 addresses skip duplicate
    /// address detection (IFA_F_NODAD), so they are usable at once.
    pub(crate) fn add_address(
        &mut self,
        index: u32,
        addr: IpAddr,
        prefix: u8,
    ) -> Result<(), RtnlError> {
        let mut msg = address_message(index, addr, prefix);
        if addr.is_ipv6() {
            msg.header.flags = AddressHeaderFlags::Nodad;
        }
        self.request(
            RouteNetlinkMessage::NewAddress(msg),
            NLM_F_CREATE | NLM_F_EXCL,
        )
    }

    pub(crate) fn del_address(
        &mut self,
        index: u32,
        addr: IpAddr,
        prefix: u8,
    ) -> Result<(), RtnlError> {
        let msg = address_message(index, addr, prefix);
        self.request(RouteNetlinkMessage::DelAddress(msg), 0)
    }

    /// The addresses of link `index`, both families.
    pub(crate) fn addresses(&mut self, index: u32) -> Result<Vec<Address>, RtnlError> {
        let all = self.dump(RouteNetlinkMessage::GetAddress(AddressMessage::default()))?;
        Ok(all
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewAddress(a) if a.header.index == index => address_of(a),
                _ => None,
            })
            .collect())
    }

    /// Adds `route` to the main table; with `replace`, in place of a route
    /// to the same destination (`ip route replace`), else only if there is
    /// none (`ip route add`).
    pub(crate) fn add_route(&mut self, route: &NewRoute, replace: bool) -> Result<(), RtnlError> {
        let mut msg = RouteMessage::default();
        msg.header.address_family = family(route.dst);
        msg.header.destination_prefix_length = route.prefix;
        msg.header.table = RouteHeader::RT_TABLE_MAIN;
        msg.header.protocol = route.protocol;
        msg.header.scope = RouteScope::Universe;
        msg.header.kind = RouteType::Unicast;
        if route.prefix > 0 {
            let dst = RouteAddress::from(route.dst);
            msg.attributes.push(RouteAttribute::Destination(dst));
        }
        let gateway = RouteAddress::from(route.gateway);
        msg.attributes.push(RouteAttribute::Gateway(gateway));
        msg.attributes.push(RouteAttribute::Oif(route.oif));
        if let Some(m) = route.metric {
            msg.attributes.push(RouteAttribute::Priority(m));
        }
        let how = if replace { NLM_F_REPLACE } else { NLM_F_EXCL };
        self.request(RouteNetlinkMessage::NewRoute(msg), NLM_F_CREATE | how)
    }

    /// Every policy rule of both families (`ip rule`).
    pub(crate) fn rules(&mut self) -> Result<Vec<Rule>, RtnlError> {
        let mut rules = Vec::new();
        for fam in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut msg = RuleMessage::default();
            msg.header.family = fam;
            for m in self.dump(RouteNetlinkMessage::GetRule(msg))? {
                let RouteNetlinkMessage::NewRule(r) = m else {
                    continue;
                };
                let mut rule = Rule {
                    priority: 0,
                    table: u32::from(r.header.table),
                    protocol: 0,
                    src: None,
                };
                for a in &r.attributes {
                    match a {
                        RuleAttribute::Priority(p) => rule.priority = *p,
                        RuleAttribute::Table(t) => rule.table = *t,
                        RuleAttribute::Protocol(p) => rule.protocol = u8::from(*p),
                        RuleAttribute::Source(s) => rule.src = Some(*s),
                        _ => {}
                    }
                }
                rules.push(rule);
            }
        }
        Ok(rules)
    }

    /// Every route of both families, in every table.
    pub(crate) fn routes(&mut self) -> Result<Vec<Route>, RtnlError> {
        let mut routes = Vec::new();
        for fam in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut msg = RouteMessage::default();
            msg.header.address_family = fam;
            for m in self.dump(RouteNetlinkMessage::GetRoute(msg))? {
                if let RouteNetlinkMessage::NewRoute(r) = m {
                    routes.push(route_of(r));
                }
            }
        }
        Ok(routes)
    }
}

fn family(addr: IpAddr) -> AddressFamily {
    match addr {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

/// The message `ip addr add|del ADDR/PREFIX dev DEV` sends: IFA_LOCAL and
/// IFA_ADDRESS both `addr` (no peer), scope global.
fn address_message(index: u32, addr: IpAddr, prefix: u8) -> AddressMessage {
    let mut msg = AddressMessage::default();
    msg.header.family = family(addr);
    msg.header.prefix_len = prefix;
    msg.header.index = index;
    msg.attributes = vec![
        AddressAttribute::Local(addr),
        AddressAttribute::Address(addr),
    ];
    msg
}

fn link_of(msg: LinkMessage) -> Link {
    let mut link = Link {
        index: msg.header.index,
        name: String::new(),
        up: msg.header.flags.contains(LinkFlags::Up),
        gso_max_size: None,
        gro_max_size: None,
        rx_packets: None,
    };
    for attr in msg.attributes {
        match attr {
            LinkAttribute::IfName(n) => link.name = n,
            LinkAttribute::GsoMaxSize(n) => link.gso_max_size = Some(n),
            LinkAttribute::GroMaxSize(n) => link.gro_max_size = Some(n),
            LinkAttribute::Stats64(s) => link.rx_packets = Some(s.rx_packets),
            _ => {}
        }
    }
    link
}

fn address_of(msg: AddressMessage) -> Option<Address> {
    let (mut local, mut address, mut protocol) = (None, None, None);
    for attr in msg.attributes {
        match attr {
            AddressAttribute::Local(a) => local = Some(a),
            AddressAttribute::Address(a) => address = Some(a),
            AddressAttribute::Protocol(p) => protocol = Some(p),
            _ => {}
        }
    }
    Some(Address {
        addr: local.or(address)?,
        prefix: msg.header.prefix_len,
        protocol,
    })
}

fn route_of(msg: RouteMessage) -> Route {
    let h = &msg.header;
    let unspecified = match h.address_family {
        AddressFamily::Inet6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    let mut route = Route {
        dst: unspecified,
        prefix: h.destination_prefix_length,
        gateway: None,
        oif: None,
        protocol: h.protocol,
        table: u32::from(h.table),
        scope: h.scope,
        kind: h.kind,
        metric: None,
        flags: h.flags,
    };
    for attr in msg.attributes {
        match attr {
            RouteAttribute::Destination(a) => route.dst = ip_of(a).unwrap_or(route.dst),
            RouteAttribute::Gateway(a) => route.gateway = ip_of(a),
            RouteAttribute::Oif(i) => route.oif = Some(i),
            RouteAttribute::Table(t) => route.table = t,
            RouteAttribute::Priority(m) => route.metric = Some(m),
            _ => {}
        }
    }
    route
}

fn ip_of(a: RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(a) => Some(a.into()),
        RouteAddress::Inet6(a) => Some(a.into()),
        _ => None,
    }
}
