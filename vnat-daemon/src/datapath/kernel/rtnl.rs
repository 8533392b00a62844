//! A minimal rtnetlink client: the few requests the datapath makes about
//! routes, addresses and links, sent straight to the kernel.
//!
//! Moving a connection used to run `ip` several times, each a process start
//! of 3 to 10 ms; one request here takes tens of microseconds, which is what
//! lets a move finish within a round trip (issue 4, the handover target).
//! Requests go over one socket per thread, opened in (and reopened for a
//! change of) the calling thread's network namespace, so they act where the
//! thread is ([`with_kept`]).
//!
//! Messages are built and read with netlink-packet-route, the socket is
//! netlink-sys's; this module only chooses what to ask and keeps the socket.

use std::{
    io,
    net::IpAddr,
    sync::atomic::{AtomicU32, Ordering},
};

use netlink_packet_core::{
    NetlinkBuffer, NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK,
    NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REQUEST,
};
use netlink_packet_route::{
    address::{AddressAttribute, AddressHeaderFlags, AddressMessage, AddressProtocol},
    link::{LinkAttribute, LinkMessage},
    neighbour::{NeighbourAttribute, NeighbourFlags, NeighbourMessage},
    route::{
        RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteProtocol,
        RouteVia,
    },
    RouteNetlinkMessage,
};
pub use netlink_packet_route::{route::RouteType, AddressFamily};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

pub const RT_TABLE_MAIN: u8 = RouteHeader::RT_TABLE_MAIN;
const RT_TABLE_LOCAL: u32 = 255;

pub(super) fn family(a: IpAddr) -> AddressFamily {
    match a {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

pub(super) fn bits(a: IpAddr) -> u8 {
    match a {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

fn route_ip(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

/// The messages of one datagram, each with its sequence number; a message
/// the crate cannot read is `Err` (its sequence number still given), and a
/// malformed length ends the walk.
pub(super) fn messages<T: NetlinkDeserializable>(
    buf: &[u8],
) -> Vec<(u32, Result<NetlinkMessage<T>, String>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let Ok(nl) = NetlinkBuffer::new_checked(&buf[at..]) else {
            break;
        };
        let len = nl.length() as usize;
        let seq = nl.sequence_number();
        let one = &buf[at..at + len];
        out.push((
            seq,
            NetlinkMessage::<T>::deserialize(one).map_err(|e| e.to_string()),
        ));
        // Messages are 4-byte aligned; `len` is at least the header's 16.
        at += (len + 3) & !3;
    }
    out
}

static SEQ: AtomicU32 = AtomicU32::new(1);

/// Send `msg` (with `flags`, besides NLM_F_REQUEST) and collect the
/// answer: the data messages of a dump, the one message of a get, or an
/// empty list after the kernel's acknowledgement. A negative error code in
/// the answer becomes that errno.
pub fn call(msg: RouteNetlinkMessage, flags: u16) -> io::Result<Answer> {
    // A socket that failed (as opposed to an error answer) may hold half an
    // answer: `with_kept` does not keep it, and the next call opens another.
    let answer = with_kept(
        &SOCKET,
        |e| e,
        || {
            Ok(Kernel {
                socket: request_socket(NETLINK_ROUTE)?,
                buf: Vec::with_capacity(RECV_BUF),
            })
        },
        |k| exchange(k, msg, flags),
    )?;
    answer.map_err(io::Error::from_raw_os_error)
}

/// What one read takes: a dump's datagrams are at most a page or two.
const RECV_BUF: usize = 64 * 1024;

/// How long a request socket waits for the kernel's next answer datagram.
/// The kernel answers within microseconds, but it may drop an answer (no
/// memory for the skb), and a blocking read would then wait for ever: the
/// datapath thread, and with it every move, would hang without a word.
pub(crate) const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A netlink socket of `protocol` for requests and their answers: reads
/// give up after [`ANSWER_TIMEOUT`] (see [`recv_answer`]).
pub(crate) fn request_socket(protocol: isize) -> io::Result<Socket> {
    request_socket_waiting(protocol, ANSWER_TIMEOUT)
}

fn request_socket_waiting(protocol: isize, wait: std::time::Duration) -> io::Result<Socket> {
    let socket = Socket::new(protocol)?;
    set_receive_timeout(std::os::fd::AsFd::as_fd(&socket), wait)?;
    Ok(socket)
}

/// Make reads of `fd` give up after `wait` (SO_RCVTIMEO): for request
/// sockets whose answer may never come.
pub fn set_receive_timeout(
    fd: std::os::fd::BorrowedFd<'_>,
    wait: std::time::Duration,
) -> io::Result<()> {
    let timeout = libc::timeval {
        tv_sec: wait.as_secs() as libc::time_t,
        tv_usec: wait.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: `fd` is open for the borrow; `timeout` is a live timeval and
    // its size is passed.
    let rc = unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&timeout as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Read the next answer datagram from a [`request_socket`] into `buf`
/// (retrying after a signal); no answer within [`ANSWER_TIMEOUT`] is an
/// error of kind `TimedOut` that says so.
pub(crate) fn recv_answer(socket: &Socket, buf: &mut Vec<u8>) -> io::Result<usize> {
    loop {
        match socket.recv(buf, 0) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the kernel sent no answer within {} s (netlink)",
                        ANSWER_TIMEOUT.as_secs()
                    ),
                ))
            }
            Err(e) => return Err(e),
        }
    }
}

thread_local! {
    /// This thread's request socket. A socket per request cost more than
    /// the request in a move of thousands of connections.
    static SOCKET: Kept<Kernel> = const { std::cell::RefCell::new(None) };
}

struct Kernel {
    socket: Socket,
    buf: Vec<u8>,
}

/// A value a thread keeps for the network namespace it was made in.
pub(crate) type Kept<T> = std::cell::RefCell<Option<((u64, u64), T)>>;

/// Run `f` with this thread's value from `kept`, made by `open` when there
/// is none or the thread is in another namespace now (the tests run hosts
/// as threads in other namespaces), so a kept socket always acts where the
/// thread is. The value is kept again only if `f` succeeded: a socket that
/// saw an error may still hold an unread answer. `netns_err` converts a
/// failure to find the thread's namespace.
pub(crate) fn with_kept<T: 'static, R, E>(
    kept: &'static std::thread::LocalKey<Kept<T>>,
    netns_err: impl FnOnce(io::Error) -> E,
    open: impl FnOnce() -> Result<T, E>,
    f: impl FnOnce(&mut T) -> Result<R, E>,
) -> Result<R, E> {
    let netns = current_netns().map_err(netns_err)?;
    let taken = kept.with(|cell| cell.borrow_mut().take());
    let mut value = match taken {
        Some((ns, v)) if ns == netns => v,
        _ => open()?,
    };
    let r = f(&mut value)?;
    kept.with(|cell| *cell.borrow_mut() = Some((netns, value)));
    Ok(r)
}

/// The calling thread's network namespace, as (device, inode).
pub(crate) fn current_netns() -> io::Result<(u64, u64)> {
    if let Some(ns) = PINNED_NETNS.get() {
        return Ok(ns);
    }
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata("/proc/thread-self/ns/net")?;
    Ok((m.dev(), m.ino()))
}

thread_local! {
    /// Set by [`pin_netns`]: the namespace this thread stays in for now.
    static PINNED_NETNS: std::cell::Cell<Option<(u64, u64)>> = const { std::cell::Cell::new(None) };
}

/// Look the calling thread's namespace up once and answer
/// [`current_netns`] from that until [`unpin_netns`]: for a batch of work
/// that does not change namespace, where a lookup per request (a path walk
/// in /proc) cost as much as the request. Nothing in vnat changes the
/// namespace of a thread in the middle of a batch.
pub(crate) fn pin_netns() {
    PINNED_NETNS.set(None);
    PINNED_NETNS.set(current_netns().ok());
}

pub(crate) fn unpin_netns() {
    PINNED_NETNS.set(None);
}

/// The data messages of an answer.
type Answer = Vec<RouteNetlinkMessage>;

/// One request and its answer. Messages of other sequence numbers (the
/// rest of an answer an earlier call stopped reading) are skipped, and so
/// is a message of a dump the crate cannot read (logged). The outer error
/// is the socket's, the inner one the kernel's answer.
fn exchange(
    k: &mut Kernel,
    msg: RouteNetlinkMessage,
    flags: u16,
) -> io::Result<Result<Answer, i32>> {
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let dump = flags & NLM_F_DUMP == NLM_F_DUMP;
    let mut header = NetlinkHeader::default();
    header.flags = flags | NLM_F_REQUEST;
    header.sequence_number = seq;
    let mut req = NetlinkMessage::new(header, NetlinkPayload::from(msg));
    req.finalize();
    let mut bytes = vec![0u8; req.buffer_len()];
    req.serialize(&mut bytes);
    k.socket.send_to(&bytes, &SocketAddr::new(0, 0), 0)?;
    let mut out = Vec::new();
    loop {
        k.buf.clear();
        k.buf.reserve(RECV_BUF);
        recv_answer(&k.socket, &mut k.buf)?;
        for (s, m) in messages::<RouteNetlinkMessage>(&k.buf) {
            if s != seq {
                continue;
            }
            let m = match m {
                Ok(m) => m,
                Err(e) if dump => {
                    tracing::debug!(error = %e, "skipping an rtnetlink message vnat cannot read");
                    continue;
                }
                Err(e) => return Err(io::Error::new(io::ErrorKind::InvalidData, e)),
            };
            match m.payload {
                NetlinkPayload::Done(_) => return Ok(Ok(out)),
                NetlinkPayload::Error(e) => {
                    if let Some(code) = e.code {
                        return Ok(Err(code.get().wrapping_neg()));
                    }
                    if !dump {
                        return Ok(Ok(out));
                    }
                }
                NetlinkPayload::InnerMessage(m) => {
                    out.push(m);
                    if !dump {
                        // A get answers with one message and no ack.
                        return Ok(Ok(out));
                    }
                }
                _ => {}
            }
        }
    }
}

/// The link-layer type of interface `ifindex` (`ifi_type`, an `ARPHRD_*`
/// value).
pub fn link_type(ifindex: u32) -> io::Result<u16> {
    let mut m = LinkMessage::default();
    m.header.index = ifindex;
    call(RouteNetlinkMessage::GetLink(m), 0)?
        .into_iter()
        .find_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => Some(u16::from(l.header.link_layer_type)),
            _ => None,
        })
        .ok_or_else(|| io::Error::other("the kernel answered a link query with no link"))
}

/// The MTU of interface `ifindex`.
pub fn link_mtu(ifindex: u32) -> io::Result<u32> {
    let mut m = LinkMessage::default();
    m.header.index = ifindex;
    call(RouteNetlinkMessage::GetLink(m), 0)?
        .into_iter()
        .find_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => l.attributes.into_iter().find_map(|a| match a {
                netlink_packet_route::link::LinkAttribute::Mtu(mtu) => Some(mtu),
                _ => None,
            }),
            _ => None,
        })
        .ok_or_else(|| io::Error::other("the kernel answered a link query with no MTU"))
}

/// `VNAT_KERNEL_LACKS=ifa-proto`: read addresses as a kernel before 6.1
/// gives them, without who added them.
static NO_IFA_PROTO: std::sync::LazyLock<bool> = std::sync::LazyLock::new(|| {
    super::features::simulated_missing(super::features::Feature::IfaProto)
});

/// An address of an interface, from an RTM_NEWADDR message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addr {
    pub addr: IpAddr,
    pub ifindex: u32,
    pub scope: u8,
    /// Who added it (`IFA_PROTO`); 0 when not given.
    pub protocol: u8,
}

impl Addr {
    fn from_message(m: &AddressMessage) -> Option<Addr> {
        let mut local = None;
        let mut address = None;
        let mut protocol = 0;
        for a in &m.attributes {
            match a {
                AddressAttribute::Local(ip) => local = Some(*ip),
                AddressAttribute::Address(ip) => address = Some(*ip),
                AddressAttribute::Protocol(p) if !*NO_IFA_PROTO => protocol = u8::from(*p),
                _ => {}
            }
        }
        // IPv4 gives the interface's own address in IFA_LOCAL (IFA_ADDRESS
        // is the peer on point-to-point links); IPv6 gives it in IFA_ADDRESS.
        Some(Addr {
            addr: local.or(address)?,
            ifindex: m.header.index,
            scope: u8::from(m.header.scope),
            protocol,
        })
    }
}

/// Every address of every interface, both families.
pub fn addresses() -> io::Result<Vec<Addr>> {
    let answer = call(
        RouteNetlinkMessage::GetAddress(AddressMessage::default()),
        NLM_F_DUMP,
    )?;
    Ok(answer
        .iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewAddress(a) => Addr::from_message(a),
            _ => None,
        })
        .collect())
}

/// A host address (/32 or /128, no DAD, universe scope) on `ifindex`.
fn host_address(a: IpAddr, ifindex: u32) -> AddressMessage {
    let mut m = AddressMessage::default();
    m.header.family = family(a);
    m.header.prefix_len = bits(a);
    if a.is_ipv6() {
        m.header.flags = AddressHeaderFlags::Nodad;
    }
    m.header.index = ifindex;
    m.attributes.push(AddressAttribute::Local(a));
    m.attributes.push(AddressAttribute::Address(a));
    m
}

/// Add `a` as a host address (/32 or /128, no DAD) on interface `ifindex`,
/// tagged with `protocol` so that its owner can tell it apart later (a
/// vnatd started after a crash, or an address someone else added).
/// Fails with `EEXIST` if the interface has it already.
pub fn add_address(a: IpAddr, ifindex: u32, protocol: u8) -> io::Result<()> {
    let mut m = host_address(a, ifindex);
    m.attributes
        .push(AddressAttribute::Protocol(AddressProtocol::from(protocol)));
    call(
        RouteNetlinkMessage::NewAddress(m),
        NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
    )
    .map(|_| ())
}

pub fn del_address(a: IpAddr, ifindex: u32) -> io::Result<()> {
    call(
        RouteNetlinkMessage::DelAddress(host_address(a, ifindex)),
        NLM_F_ACK,
    )
    .map(|_| ())
}

/// The neighbour states in which the kernel sends at once (NUD_VALID in
/// `include/net/neighbour.h`): REACHABLE, STALE, DELAY, PROBE, NOARP and
/// PERMANENT. In the others (none, INCOMPLETE, FAILED) a packet waits in
/// the entry for an answer, or is dropped.
const NUD_VALID: u16 = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80;

fn neighbour_message(addr: IpAddr, ifindex: u32) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = family(addr);
    m.header.ifindex = ifindex;
    m.attributes
        .push(NeighbourAttribute::Destination(addr.into()));
    m
}

/// Whether the kernel's neighbour entry for `addr` on `ifindex` sends at
/// once (resolved, or a link without neighbours); false when there is no
/// entry or it is still being resolved (or failed).
pub fn neighbour_resolved(addr: IpAddr, ifindex: u32) -> io::Result<bool> {
    match call(
        RouteNetlinkMessage::GetNeighbour(neighbour_message(addr, ifindex)),
        0,
    ) {
        Ok(answer) => Ok(answer.iter().any(|m| {
            matches!(m, RouteNetlinkMessage::NewNeighbour(n)
                if u16::from(n.header.state) & NUD_VALID != 0)
        })),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Have the kernel resolve `addr` on `ifindex` as the first packet to it
/// would (NTF_USE: the entry is created if missing and a solicitation
/// sent; an entry already resolved is left as it is). The entry is the
/// kernel's own, aged out like any other.
pub fn resolve_neighbour(addr: IpAddr, ifindex: u32) -> io::Result<()> {
    let mut m = neighbour_message(addr, ifindex);
    m.header.flags = NeighbourFlags::Use;
    call(
        RouteNetlinkMessage::NewNeighbour(m),
        NLM_F_ACK | NLM_F_CREATE,
    )
    .map(|_| ())
}

/// A route from an RTM_NEWROUTE message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub kind: RouteType,
    pub table: u32,
    pub protocol: u8,
    pub dst: Option<IpAddr>,
    pub dst_len: u8,
    pub oif: Option<u32>,
    pub gateway: Option<IpAddr>,
    pub prefsrc: Option<IpAddr>,
}

impl Route {
    fn from_message(m: &RouteMessage) -> Route {
        let mut r = Route {
            kind: m.header.kind,
            table: u32::from(m.header.table),
            protocol: u8::from(m.header.protocol),
            dst: None,
            dst_len: m.header.destination_prefix_length,
            oif: None,
            gateway: None,
            prefsrc: None,
        };
        for a in &m.attributes {
            match a {
                RouteAttribute::Destination(d) => r.dst = route_ip(d),
                RouteAttribute::Oif(i) => r.oif = Some(*i),
                RouteAttribute::Gateway(g) => r.gateway = route_ip(g),
                RouteAttribute::Via(RouteVia::Inet(v4)) => r.gateway = Some(IpAddr::V4(*v4)),
                RouteAttribute::Via(RouteVia::Inet6(v6)) => r.gateway = Some(IpAddr::V6(*v6)),
                RouteAttribute::PrefSource(p) => r.prefsrc = route_ip(p),
                // Tables above 255 are only in RTA_TABLE.
                RouteAttribute::Table(t) => r.table = *t,
                _ => {}
            }
        }
        r
    }
}

/// A route message for exactly `dst` (a /32 or /128) of `dst`'s family.
pub(super) fn host_route(dst: IpAddr) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = family(dst);
    m.header.destination_prefix_length = bits(dst);
    m.attributes
        .push(RouteAttribute::Destination(RouteAddress::from(dst)));
    m
}

fn first_route(answer: Answer) -> Option<Route> {
    answer.iter().find_map(|m| match m {
        RouteNetlinkMessage::NewRoute(r) => Some(Route::from_message(r)),
        _ => None,
    })
}

/// The route the kernel would use for a packet to `dst` (from `from`).
pub fn route_get(dst: IpAddr, from: Option<IpAddr>) -> io::Result<Route> {
    let mut m = host_route(dst);
    if let Some(f) = from {
        m.header.source_prefix_length = bits(f);
        m.attributes
            .push(RouteAttribute::Source(RouteAddress::from(f)));
    }
    first_route(call(RouteNetlinkMessage::GetRoute(m), 0)?)
        .ok_or_else(|| io::Error::other("the kernel answered a route query with no route"))
}

/// The route the kernel would use for a packet from `from` to `dst` that
/// must leave through interface `oif`, or None when no route of the tables
/// leaves there. (Asked with an interface and no route, the kernel guesses
/// that `dst` is on that link, which is wrong for anything behind a router:
/// a FIB_MATCH query first tells a real route from that guess.)
pub fn route_get_via(dst: IpAddr, from: IpAddr, oif: u32) -> io::Result<Option<Route>> {
    let query = |fib_match: bool| {
        let mut m = host_route(dst);
        // IPv6 keeps to the interface only for a query without a source
        // (with one, the interface is a mere preference).
        if from.is_ipv4() {
            m.header.source_prefix_length = bits(from);
            m.attributes
                .push(RouteAttribute::Source(RouteAddress::from(from)));
        }
        m.attributes.push(RouteAttribute::Oif(oif));
        if fib_match {
            m.header.flags = RouteFlags::FibMatch;
        }
        RouteNetlinkMessage::GetRoute(m)
    };
    match call(query(true), 0) {
        Ok(_) => {}
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENETUNREACH) | Some(libc::EHOSTUNREACH) | Some(libc::ESRCH)
            ) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(e),
    }
    first_route(call(query(false), 0)?)
        .map(Some)
        .ok_or_else(|| io::Error::other("the kernel answered a route query with no route"))
}

/// The routing-table entry the kernel would use for `dst` (its prefix,
/// protocol and table), or None when nothing routes it.
pub fn fib_match(dst: IpAddr) -> io::Result<Option<Route>> {
    let mut m = host_route(dst);
    // Answer with the entry that matched, not the resolved result.
    m.header.flags = RouteFlags::FibMatch;
    match call(RouteNetlinkMessage::GetRoute(m), 0) {
        Ok(answer) => Ok(first_route(answer)),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENETUNREACH) | Some(libc::EHOSTUNREACH) | Some(libc::ESRCH)
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Every route of the main table of one family.
pub fn routes(fam: AddressFamily) -> io::Result<Vec<Route>> {
    Ok(routes_of_every_table(fam)?
        .into_iter()
        .filter(|r| r.table == u32::from(RT_TABLE_MAIN))
        .collect())
}

/// Every route of family `fam`, of every table.
pub fn routes_of_every_table(fam: AddressFamily) -> io::Result<Vec<Route>> {
    let mut m = RouteMessage::default();
    m.header.address_family = fam;
    let answer = call(RouteNetlinkMessage::GetRoute(m), NLM_F_DUMP)?;
    Ok(answer
        .iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewRoute(r) => Some(Route::from_message(r)),
            _ => None,
        })
        .collect())
}

/// Delete the host route `dst` if it carries `protocol`.
pub fn del_host_route(dst: IpAddr, protocol: u8) -> io::Result<()> {
    let mut m = host_route(dst);
    m.header.table = RT_TABLE_MAIN;
    m.header.protocol = RouteProtocol::from(protocol);
    call(RouteNetlinkMessage::DelRoute(m), NLM_F_ACK).map(|_| ())
}

/// Whether a datagram of change notifications (links, addresses, routes)
/// can matter for mobility. Not: an address on `lo` (`lo_ifindex`), a route
/// of the local table (it follows an address, whose own message comes too),
/// a route carrying `own_protocol` (vnat's own host routes and the
/// addresses it keeps on `lo`, which a move of thousands of connections
/// changes over and over), and a link named in `own_links` appearing or
/// changing (the sink, which the first move off a network creates: a resync
/// for it would run while that move's updates are answered). A link of
/// vnat's going away still matters: a resync puts back what it carried.
/// Anything else, and anything unreadable, matters.
pub fn notifications_matter(
    buf: &[u8],
    lo_ifindex: u32,
    own_protocol: u8,
    own_links: &[&str],
) -> bool {
    let own_link = |l: &LinkMessage| {
        l.attributes.iter().any(|a| match a {
            LinkAttribute::IfName(n) => own_links.contains(&n.as_str()),
            _ => false,
        })
    };
    let msgs = messages::<RouteNetlinkMessage>(buf);
    msgs.is_empty()
        || msgs.iter().any(|(_, m)| match m {
            Err(_) => true,
            Ok(m) => match &m.payload {
                NetlinkPayload::InnerMessage(m) => match m {
                    RouteNetlinkMessage::NewAddress(a) | RouteNetlinkMessage::DelAddress(a) => {
                        a.header.index != lo_ifindex
                    }
                    RouteNetlinkMessage::NewRoute(r) | RouteNetlinkMessage::DelRoute(r) => {
                        let r = Route::from_message(r);
                        r.protocol != own_protocol && r.table != RT_TABLE_LOCAL
                    }
                    RouteNetlinkMessage::NewLink(l) => !own_link(l),
                    _ => true,
                },
                _ => true,
            },
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request whose answer never comes (the kernel dropped it) is an
    /// error that says so, not a thread blocked for ever.
    #[test]
    fn a_missing_answer_is_an_error_after_the_wait() {
        let socket = request_socket_waiting(NETLINK_ROUTE, std::time::Duration::from_millis(50))
            .expect("a netlink socket");
        let mut buf = Vec::with_capacity(RECV_BUF);
        let t = std::time::Instant::now();
        let e = recv_answer(&socket, &mut buf).expect_err("nothing was asked");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("no answer"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
    }

    /// `msg` as the kernel would send it: one netlink message.
    fn datagram(msg: RouteNetlinkMessage) -> Vec<u8> {
        let mut m = NetlinkMessage::new(NetlinkHeader::default(), NetlinkPayload::from(msg));
        m.finalize();
        let mut b = vec![0u8; m.buffer_len()];
        m.serialize(&mut b);
        b
    }

    fn only(buf: &[u8]) -> RouteNetlinkMessage {
        let mut msgs = messages::<RouteNetlinkMessage>(buf);
        assert_eq!(msgs.len(), 1);
        match msgs.remove(0).1.expect("readable").payload {
            NetlinkPayload::InnerMessage(m) => m,
            other => panic!("not a route message: {other:?}"),
        }
    }

    fn vnat_route(table: u8, protocol: u8) -> RouteMessage {
        let mut m = host_route("198.18.1.2".parse().unwrap());
        m.header.table = table;
        m.header.protocol = RouteProtocol::from(protocol);
        m.header.kind = RouteType::Unicast;
        m
    }

    #[test]
    fn route_and_address_messages_parse_back() {
        let mut m = vnat_route(RT_TABLE_MAIN, 157);
        m.attributes
            .push(RouteAttribute::Gateway(RouteAddress::from(
                "198.18.3.1".parse::<IpAddr>().unwrap(),
            )));
        m.attributes.push(RouteAttribute::Oif(7));
        let RouteNetlinkMessage::NewRoute(r) = only(&datagram(RouteNetlinkMessage::NewRoute(m)))
        else {
            panic!("not a route");
        };
        let route = Route::from_message(&r);
        assert_eq!(route.dst, Some("198.18.1.2".parse().unwrap()));
        assert_eq!((route.dst_len, route.oif), (32, Some(7)));
        assert_eq!(route.gateway, Some("198.18.3.1".parse().unwrap()));
        assert_eq!(
            (route.protocol, route.kind, route.table),
            (157, RouteType::Unicast, 254)
        );

        // An IPv4 route through an IPv6 next hop names it in RTA_VIA.
        let mut m = vnat_route(RT_TABLE_MAIN, 157);
        m.attributes.push(RouteAttribute::Via(RouteVia::Inet6(
            "fe80::1".parse().unwrap(),
        )));
        let RouteNetlinkMessage::NewRoute(r) = only(&datagram(RouteNetlinkMessage::NewRoute(m)))
        else {
            panic!("not a route");
        };
        assert_eq!(
            Route::from_message(&r).gateway,
            Some("fe80::1".parse().unwrap())
        );

        let a: IpAddr = "2001:db8::5".parse().unwrap();
        let mut m = host_address(a, 3);
        m.attributes
            .push(AddressAttribute::Protocol(AddressProtocol::from(157)));
        let RouteNetlinkMessage::NewAddress(parsed) =
            only(&datagram(RouteNetlinkMessage::NewAddress(m)))
        else {
            panic!("not an address");
        };
        assert_eq!(
            Addr::from_message(&parsed),
            Some(Addr {
                addr: a,
                ifindex: 3,
                scope: 0,
                protocol: 157,
            })
        );
    }

    #[test]
    fn malformed_answers_end_the_walk_without_panicking() {
        // A length beyond the buffer, a length below the header, garbage.
        let mut b = vec![0u8; 20];
        b[0..4].copy_from_slice(&100u32.to_ne_bytes());
        assert!(messages::<RouteNetlinkMessage>(&b).is_empty());
        b[0..4].copy_from_slice(&3u32.to_ne_bytes());
        assert!(messages::<RouteNetlinkMessage>(&b).is_empty());
        assert!(messages::<RouteNetlinkMessage>(&[0xff; 3]).is_empty());
        // A route message whose body is too short for its header: read as
        // unreadable, not as a route.
        let mut b = datagram(RouteNetlinkMessage::NewRoute(vnat_route(254, 157)));
        b.truncate(20);
        b[0..4].copy_from_slice(&20u32.to_ne_bytes());
        assert!(messages::<RouteNetlinkMessage>(&b)[0].1.is_err());
        // An attribute whose length overruns the message.
        let mut b = datagram(RouteNetlinkMessage::NewRoute(vnat_route(254, 157)));
        let at = 16 + 12;
        b[at..at + 2].copy_from_slice(&200u16.to_ne_bytes());
        assert!(messages::<RouteNetlinkMessage>(&b)[0].1.is_err());
    }

    const OWN: &[&str] = &["vnat-sink", "vnat-sinkp"];

    #[test]
    fn own_and_loopback_changes_do_not_matter() {
        let lo = 1;
        let route = |protocol: u8, table: u8| {
            datagram(RouteNetlinkMessage::NewRoute(vnat_route(table, protocol)))
        };
        let addr = |ifindex| {
            datagram(RouteNetlinkMessage::DelAddress(host_address(
                "198.18.1.2".parse().unwrap(),
                ifindex,
            )))
        };
        // vnat's host route, a local-table route, an address on lo: no.
        assert!(!notifications_matter(
            &route(157, RT_TABLE_MAIN),
            lo,
            157,
            OWN
        ));
        assert!(!notifications_matter(&route(2, 255), lo, 157, OWN));
        assert!(!notifications_matter(&addr(lo), lo, 157, OWN));
        let mut both = route(157, RT_TABLE_MAIN);
        both.extend(addr(lo));
        assert!(!notifications_matter(&both, lo, 157, OWN));
        // A kernel route of the main table, an address of a real link, a
        // link message, one relevant message among ours: yes.
        assert!(notifications_matter(&route(2, RT_TABLE_MAIN), lo, 157, OWN));
        assert!(notifications_matter(&addr(3), lo, 157, OWN));
        assert!(notifications_matter(
            &datagram(RouteNetlinkMessage::NewLink(LinkMessage::default())),
            lo,
            157,
            OWN
        ));
        both.extend(addr(3));
        assert!(notifications_matter(&both, lo, 157, OWN));
        // vnat's sink appearing or coming up: no; going away, or another
        // link: yes.
        let link = |name: &str, gone: bool| {
            let mut l = LinkMessage::default();
            l.header.index = 7;
            l.attributes.push(LinkAttribute::IfName(name.into()));
            datagram(if gone {
                RouteNetlinkMessage::DelLink(l)
            } else {
                RouteNetlinkMessage::NewLink(l)
            })
        };
        assert!(!notifications_matter(
            &link("vnat-sink", false),
            lo,
            157,
            OWN
        ));
        assert!(!notifications_matter(
            &link("vnat-sinkp", false),
            lo,
            157,
            OWN
        ));
        assert!(notifications_matter(&link("vnat-sink", true), lo, 157, OWN));
        assert!(notifications_matter(&link("wlan0", false), lo, 157, OWN));
        assert!(notifications_matter(
            &link("vnat-sink2", false),
            lo,
            157,
            OWN
        ));
        // Unreadable input counts as a change (a resync is always safe).
        assert!(notifications_matter(&[1, 2, 3], lo, 157, OWN));
        let mut cut = route(157, RT_TABLE_MAIN);
        cut.truncate(20);
        cut[0..4].copy_from_slice(&20u32.to_ne_bytes());
        assert!(notifications_matter(&cut, lo, 157, OWN));
    }
}
