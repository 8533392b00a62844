//! A minimal rtnetlink client: the few requests the datapath makes about
//! routes and addresses, sent straight to the kernel.
//!
//! Moving a connection used to run `ip` several times, each a process start
//! of 3 to 10 ms; one request here takes tens of microseconds, which is what
//! lets a move finish within a round trip (issue 4, the handover target).
//! Requests go over one socket per thread, opened in (and reopened for a
//! change of) the calling thread's network namespace, so they act where the
//! thread is ([`with_kept`]).
//!
//! Message layouts are those of `linux/netlink.h`, `linux/rtnetlink.h` and
//! `linux/if_addr.h`; everything is native-endian except addresses.

use std::{
    io,
    mem::size_of,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::atomic::{AtomicU32, Ordering},
};

const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_REPLACE: u16 = 0x100;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;

const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_GETLINK: u16 = 18;
const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;
const RTM_GETADDR: u16 = 22;
const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
const RTM_GETROUTE: u16 = 26;

const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
/// The address's protocol (who added it; Linux 5.18+), as routes have.
const IFA_PROTO: u16 = 11;
const IFA_F_NODAD: u8 = 0x02;

const RTA_DST: u16 = 1;
const RTA_SRC: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_GATEWAY: u16 = 5;
const RTA_PREFSRC: u16 = 7;
const RTA_TABLE: u16 = 15;
const RTA_VIA: u16 = 18;

pub const RT_TABLE_MAIN: u8 = 254;
const RT_TABLE_LOCAL: u32 = 255;
pub const RTN_UNICAST: u8 = 1;
const RT_SCOPE_UNIVERSE: u8 = 0;
const IFADDRMSG_LEN: usize = 8;
const RTMSG_LEN: usize = 12;

fn family(a: IpAddr) -> u8 {
    match a {
        IpAddr::V4(_) => libc::AF_INET as u8,
        IpAddr::V6(_) => libc::AF_INET6 as u8,
    }
}

fn bits(a: IpAddr) -> u8 {
    match a {
        IpAddr::V4(_) => 32,
        IpAddr::V6(_) => 128,
    }
}

fn octets(a: IpAddr) -> Vec<u8> {
    match a {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// One request: the netlink header is filled in by [`Request::finish`].
pub struct Request {
    buf: Vec<u8>,
}

impl Request {
    pub fn new(kind: u16, flags: u16, body: &[u8]) -> Request {
        let mut buf = vec![0u8; NLMSG_HDRLEN];
        buf[4..6].copy_from_slice(&kind.to_ne_bytes());
        buf[6..8].copy_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        buf.extend_from_slice(body);
        buf.resize(align4(buf.len()), 0);
        Request { buf }
    }

    pub fn attr(mut self, kind: u16, value: &[u8]) -> Request {
        let len = 4 + value.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(value);
        self.buf.resize(align4(self.buf.len()), 0);
        self
    }

    fn finish(mut self, seq: u32) -> Vec<u8> {
        let len = self.buf.len() as u32;
        self.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        self.buf[8..12].copy_from_slice(&seq.to_ne_bytes());
        self.buf
    }
}

/// One message of an answer: its type and the bytes after the header.
pub struct Message<'a> {
    pub kind: u16,
    pub body: &'a [u8],
}

/// Split a datagram into messages; a malformed length ends the walk.
pub fn messages(mut buf: &[u8]) -> Vec<(u32, Message<'_>)> {
    let mut out = Vec::new();
    while buf.len() >= NLMSG_HDRLEN {
        let len = u32::from_ne_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
        if len < NLMSG_HDRLEN || len > buf.len() {
            break;
        }
        let kind = u16::from_ne_bytes([buf[4], buf[5]]);
        let seq = u32::from_ne_bytes([buf[8], buf[9], buf[10], buf[11]]);
        out.push((
            seq,
            Message {
                kind,
                body: &buf[NLMSG_HDRLEN..len],
            },
        ));
        buf = &buf[align4(len).min(buf.len())..];
    }
    out
}

/// The attributes after a fixed-size header of `fixed` bytes.
pub fn attrs(body: &[u8], fixed: usize) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    let mut rest = body.get(align4(fixed)..).unwrap_or(&[]);
    while rest.len() >= 4 {
        let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
        if len < 4 || len > rest.len() {
            break;
        }
        let kind = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
        out.push((kind, &rest[4..len]));
        rest = &rest[align4(len).min(rest.len())..];
    }
    out
}

fn ip_from(bytes: &[u8]) -> Option<IpAddr> {
    match bytes.len() {
        4 => Some(IpAddr::V4(Ipv4Addr::new(
            bytes[0], bytes[1], bytes[2], bytes[3],
        ))),
        16 => {
            let a: [u8; 16] = bytes.try_into().ok()?;
            Some(IpAddr::V6(Ipv6Addr::from(a)))
        }
        _ => None,
    }
}

static SEQ: AtomicU32 = AtomicU32::new(1);

/// Send `req` and collect the answer: the data messages of a dump, or an
/// empty list after the kernel's acknowledgement. A negative error code in
/// the answer becomes that errno.
pub fn call(req: Request) -> io::Result<Answer> {
    // A socket that failed (as opposed to an error answer) may hold half an
    // answer: `with_kept` does not keep it, and the next call opens another.
    let answer = with_kept(
        &SOCKET,
        |e| e,
        || {
            Ok(Socket {
                fd: open_socket()?,
                buf: vec![0u8; 64 * 1024],
            })
        },
        |s| exchange(&s.fd, &mut s.buf, req),
    )?;
    answer.map_err(io::Error::from_raw_os_error)
}

thread_local! {
    /// This thread's request socket. A socket per request cost more than
    /// the request in a move of thousands of connections.
    static SOCKET: Kept<Socket> = const { std::cell::RefCell::new(None) };
}

struct Socket {
    fd: OwnedFd,
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

fn open_socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned at once.
    let raw = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// The data messages of an answer, as (type, body).
type Answer = Vec<(u16, Vec<u8>)>;

/// One request and its answer on `fd`. Messages of other sequence numbers
/// (the rest of an answer an earlier call stopped reading) are skipped.
/// The outer error is the socket's, the inner one the kernel's answer.
fn exchange(fd: &OwnedFd, buf: &mut [u8], req: Request) -> io::Result<Result<Answer, i32>> {
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    let dump = u16::from_ne_bytes([req.buf[6], req.buf[7]]) & NLM_F_DUMP == NLM_F_DUMP;
    let msg = req.finish(seq);
    // SAFETY: sockaddr_nl is plain integers, for which all-zero is valid
    // (pid 0 is the kernel).
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as u16;
    // SAFETY: `fd` is borrowed, so open for the call; `msg` and `sa` are live
    // for the call and their sizes are passed.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&sa as *const libc::sockaddr_nl).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out = Vec::new();
    loop {
        // SAFETY: `fd` is borrowed, so open; recv writes at most buf.len()
        // bytes into `buf`, which is writable for its whole length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        for (s, m) in messages(&buf[..n as usize]) {
            if s != seq {
                continue;
            }
            match m.kind {
                NLMSG_DONE => return Ok(Ok(out)),
                NLMSG_ERROR => {
                    let code = m
                        .body
                        .get(0..4)
                        .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                        .unwrap_or(-libc::EIO);
                    if code != 0 {
                        return Ok(Err(-code));
                    }
                    if !dump {
                        return Ok(Ok(out));
                    }
                }
                kind => {
                    out.push((kind, m.body.to_vec()));
                    if !dump {
                        // A get answers with one message and no ack.
                        return Ok(Ok(out));
                    }
                }
            }
        }
    }
}

/// The link-layer type of interface `ifindex` (`ifi_type`, an `ARPHRD_*`
/// value).
pub fn link_type(ifindex: u32) -> io::Result<u16> {
    let mut body = [0u8; 16];
    body[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    let answer = call(Request::new(RTM_GETLINK, 0, &body))?;
    answer
        .iter()
        .find(|(k, b)| *k == RTM_NEWLINK && b.len() >= 16)
        .map(|(_, b)| u16::from_ne_bytes([b[2], b[3]]))
        .ok_or_else(|| io::Error::other("the kernel answered a link query with no link"))
}

/// An address of an interface, from an RTM_NEWADDR message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Addr {
    pub addr: IpAddr,
    pub ifindex: u32,
    pub scope: u8,
    /// Who added it (`IFA_PROTO`); 0 when not given.
    pub protocol: u8,
}

pub fn parse_addr(body: &[u8]) -> Option<Addr> {
    if body.len() < IFADDRMSG_LEN {
        return None;
    }
    let scope = body[3];
    let ifindex = u32::from_ne_bytes([body[4], body[5], body[6], body[7]]);
    let mut local = None;
    let mut address = None;
    let mut protocol = 0;
    for (kind, v) in attrs(body, IFADDRMSG_LEN) {
        match kind {
            IFA_LOCAL => local = ip_from(v),
            IFA_ADDRESS => address = ip_from(v),
            IFA_PROTO if v.len() == 1 => protocol = v[0],
            _ => {}
        }
    }
    // IPv4 gives the interface's own address in IFA_LOCAL (IFA_ADDRESS is the
    // peer on point-to-point links); IPv6 gives it in IFA_ADDRESS.
    Some(Addr {
        addr: local.or(address)?,
        ifindex,
        scope,
        protocol,
    })
}

/// Every address of every interface, both families.
pub fn addresses() -> io::Result<Vec<Addr>> {
    let body = [0u8; IFADDRMSG_LEN];
    let answer = call(Request::new(RTM_GETADDR, NLM_F_DUMP, &body))?;
    Ok(answer
        .iter()
        .filter(|(k, _)| *k == RTM_NEWADDR)
        .filter_map(|(_, b)| parse_addr(b))
        .collect())
}

fn addr_request(kind: u16, flags: u16, a: IpAddr, ifindex: u32) -> Request {
    let mut body = [0u8; IFADDRMSG_LEN];
    body[0] = family(a);
    body[1] = bits(a);
    body[2] = if a.is_ipv6() { IFA_F_NODAD } else { 0 };
    body[3] = RT_SCOPE_UNIVERSE;
    body[4..8].copy_from_slice(&ifindex.to_ne_bytes());
    let o = octets(a);
    Request::new(kind, flags, &body)
        .attr(IFA_LOCAL, &o)
        .attr(IFA_ADDRESS, &o)
}

/// Add `a` as a host address (/32 or /128, no DAD) on interface `ifindex`,
/// tagged with `protocol` so that its owner can tell it apart later (a
/// vnatd started after a crash, or an address someone else added).
/// Fails with `EEXIST` if the interface has it already.
pub fn add_address(a: IpAddr, ifindex: u32, protocol: u8) -> io::Result<()> {
    call(
        addr_request(
            RTM_NEWADDR,
            NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            a,
            ifindex,
        )
        .attr(IFA_PROTO, &[protocol]),
    )
    .map(|_| ())
}

pub fn del_address(a: IpAddr, ifindex: u32) -> io::Result<()> {
    call(addr_request(RTM_DELADDR, NLM_F_ACK, a, ifindex)).map(|_| ())
}

/// A route from an RTM_NEWROUTE message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub kind: u8,
    pub table: u32,
    pub protocol: u8,
    pub dst: Option<IpAddr>,
    pub dst_len: u8,
    pub oif: Option<u32>,
    pub gateway: Option<IpAddr>,
    pub prefsrc: Option<IpAddr>,
}

pub fn parse_route(body: &[u8]) -> Option<Route> {
    if body.len() < RTMSG_LEN {
        return None;
    }
    let mut r = Route {
        kind: body[7],
        table: u32::from(body[4]),
        protocol: body[5],
        dst: None,
        dst_len: body[1],
        oif: None,
        gateway: None,
        prefsrc: None,
    };
    for (kind, v) in attrs(body, RTMSG_LEN) {
        match kind {
            RTA_DST => r.dst = ip_from(v),
            RTA_OIF if v.len() == 4 => r.oif = Some(u32::from_ne_bytes([v[0], v[1], v[2], v[3]])),
            RTA_GATEWAY => r.gateway = ip_from(v),
            RTA_VIA if v.len() >= 2 => r.gateway = ip_from(&v[2..]),
            RTA_PREFSRC => r.prefsrc = ip_from(v),
            RTA_TABLE if v.len() == 4 => r.table = u32::from_ne_bytes([v[0], v[1], v[2], v[3]]),
            _ => {}
        }
    }
    Some(r)
}

fn rtmsg(fam: u8, dst_len: u8, src_len: u8, table: u8, protocol: u8, kind: u8) -> [u8; RTMSG_LEN] {
    let mut b = [0u8; RTMSG_LEN];
    b[0] = fam;
    b[1] = dst_len;
    b[2] = src_len;
    b[4] = table;
    b[5] = protocol;
    b[6] = RT_SCOPE_UNIVERSE;
    b[7] = kind;
    b
}

/// The route the kernel would use for a packet to `dst` (from `from`).
pub fn route_get(dst: IpAddr, from: Option<IpAddr>) -> io::Result<Route> {
    let src_len = from.map_or(0, bits);
    let body = rtmsg(family(dst), bits(dst), src_len, 0, 0, 0);
    let mut req = Request::new(RTM_GETROUTE, 0, &body).attr(RTA_DST, &octets(dst));
    if let Some(f) = from {
        req = req.attr(RTA_SRC, &octets(f));
    }
    let answer = call(req)?;
    answer
        .iter()
        .find(|(k, _)| *k == RTM_NEWROUTE)
        .and_then(|(_, b)| parse_route(b))
        .ok_or_else(|| io::Error::other("the kernel answered a route query with no route"))
}

/// `RTM_F_FIB_MATCH`: answer a route query with the routing-table entry
/// that matched instead of the resolved result.
const RTM_F_FIB_MATCH: u32 = 0x2000;

/// The routing-table entry the kernel would use for `dst` (its prefix,
/// protocol and table), or None when nothing routes it.
pub fn fib_match(dst: IpAddr) -> io::Result<Option<Route>> {
    let mut body = rtmsg(family(dst), bits(dst), 0, 0, 0, 0);
    body[8..12].copy_from_slice(&RTM_F_FIB_MATCH.to_ne_bytes());
    match call(Request::new(RTM_GETROUTE, 0, &body).attr(RTA_DST, &octets(dst))) {
        Ok(answer) => Ok(answer
            .iter()
            .find(|(k, _)| *k == RTM_NEWROUTE)
            .and_then(|(_, b)| parse_route(b))),
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
pub fn routes(fam: u8) -> io::Result<Vec<Route>> {
    let body = rtmsg(fam, 0, 0, 0, 0, 0);
    let answer = call(Request::new(RTM_GETROUTE, NLM_F_DUMP, &body))?;
    Ok(answer
        .iter()
        .filter(|(k, _)| *k == RTM_NEWROUTE)
        .filter_map(|(_, b)| parse_route(b))
        .filter(|r| r.table == u32::from(RT_TABLE_MAIN))
        .collect())
}

/// Add the host route `dst` via `gateway` on `oif`, tagged with
/// `protocol`: with `replace`, in place of the route for `dst` there is
/// (the caller checked it is its own); without, only if there is none
/// (`EEXIST` otherwise), so a route someone else added meanwhile is never
/// overwritten.
pub fn set_host_route(
    dst: IpAddr,
    gateway: IpAddr,
    oif: u32,
    protocol: u8,
    replace: bool,
) -> io::Result<()> {
    let body = rtmsg(
        family(dst),
        bits(dst),
        0,
        RT_TABLE_MAIN,
        protocol,
        RTN_UNICAST,
    );
    let how = if replace { NLM_F_REPLACE } else { NLM_F_EXCL };
    let mut req = Request::new(RTM_NEWROUTE, NLM_F_ACK | NLM_F_CREATE | how, &body)
        .attr(RTA_DST, &octets(dst));
    req = if gateway.is_ipv4() == dst.is_ipv4() {
        req.attr(RTA_GATEWAY, &octets(gateway))
    } else {
        // An IPv4 route through an IPv6 next hop (RFC 5549).
        let mut via = u16::from(family(gateway)).to_ne_bytes().to_vec();
        via.extend_from_slice(&octets(gateway));
        req.attr(RTA_VIA, &via)
    };
    call(req.attr(RTA_OIF, &oif.to_ne_bytes())).map(|_| ())
}

/// Delete the host route `dst` if it carries `protocol`.
pub fn del_host_route(dst: IpAddr, protocol: u8) -> io::Result<()> {
    let body = rtmsg(family(dst), bits(dst), 0, RT_TABLE_MAIN, protocol, 0);
    call(Request::new(RTM_DELROUTE, NLM_F_ACK, &body).attr(RTA_DST, &octets(dst))).map(|_| ())
}

/// Whether a datagram of change notifications (links, addresses, routes)
/// can matter for mobility. Not: an address on `lo` (`lo_ifindex`), a route
/// of the local table (it follows an address, whose own message comes too),
/// and a route carrying `own_protocol`: vnat's own host routes and the
/// addresses it keeps on `lo`, which a move of thousands of connections
/// changes over and over. Anything else, and anything unreadable, matters.
pub fn notifications_matter(buf: &[u8], lo_ifindex: u32, own_protocol: u8) -> bool {
    let msgs = messages(buf);
    msgs.is_empty()
        || msgs.iter().any(|(_, m)| match m.kind {
            RTM_NEWLINK | RTM_DELLINK => true,
            RTM_NEWADDR | RTM_DELADDR => parse_addr(m.body).is_none_or(|a| a.ifindex != lo_ifindex),
            RTM_NEWROUTE | RTM_DELROUTE => parse_route(m.body)
                .is_none_or(|r| r.protocol != own_protocol && r.table != RT_TABLE_LOCAL),
            _ => true,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_layout_is_aligned_and_sized() {
        let r = Request::new(RTM_GETROUTE, 0, &[1, 2, 3]).attr(RTA_DST, &[10, 0, 0, 1]);
        let b = r.finish(7);
        // 16 header + 3 body padded to 4 + 8 attribute.
        assert_eq!(b.len(), 28);
        assert_eq!(u32::from_ne_bytes(b[0..4].try_into().unwrap()), 28);
        assert_eq!(
            u16::from_ne_bytes(b[4..6].try_into().unwrap()),
            RTM_GETROUTE
        );
        assert_eq!(
            u16::from_ne_bytes(b[6..8].try_into().unwrap()),
            NLM_F_REQUEST
        );
        assert_eq!(u32::from_ne_bytes(b[8..12].try_into().unwrap()), 7);
        assert_eq!(&b[16..20], &[1, 2, 3, 0]);
        assert_eq!(u16::from_ne_bytes(b[20..22].try_into().unwrap()), 8);
        assert_eq!(u16::from_ne_bytes(b[22..24].try_into().unwrap()), RTA_DST);
        assert_eq!(&b[24..28], &[10, 0, 0, 1]);
    }

    #[test]
    fn route_and_address_messages_parse_back() {
        let r = Request::new(
            RTM_NEWROUTE,
            0,
            &rtmsg(2, 32, 0, RT_TABLE_MAIN, 157, RTN_UNICAST),
        )
        .attr(RTA_DST, &[198, 18, 1, 2])
        .attr(RTA_GATEWAY, &[198, 18, 3, 1])
        .attr(RTA_OIF, &7u32.to_ne_bytes())
        .finish(1);
        let msgs = messages(&r);
        assert_eq!(msgs.len(), 1);
        let route = parse_route(msgs[0].1.body).unwrap();
        assert_eq!(route.dst, Some("198.18.1.2".parse().unwrap()));
        assert_eq!(route.gateway, Some("198.18.3.1".parse().unwrap()));
        assert_eq!(route.oif, Some(7));
        assert_eq!(
            (route.protocol, route.kind, route.table),
            (157, RTN_UNICAST, 254)
        );

        let a: IpAddr = "2001:db8::5".parse().unwrap();
        let m = addr_request(RTM_NEWADDR, 0, a, 3)
            .attr(IFA_PROTO, &[157])
            .finish(2);
        let parsed = parse_addr(messages(&m)[0].1.body).unwrap();
        assert_eq!(
            parsed,
            Addr {
                addr: a,
                ifindex: 3,
                scope: 0,
                protocol: 157,
            }
        );
    }

    #[test]
    fn malformed_answers_end_the_walk_without_panicking() {
        // A length beyond the buffer, a length below the header, garbage.
        let mut b = vec![0u8; 20];
        b[0..4].copy_from_slice(&100u32.to_ne_bytes());
        assert!(messages(&b).is_empty());
        b[0..4].copy_from_slice(&3u32.to_ne_bytes());
        assert!(messages(&b).is_empty());
        assert!(attrs(&[0xff; 3], 12).is_empty());
        assert!(parse_route(&[0; 5]).is_none());
        assert!(parse_addr(&[0; 7]).is_none());
        // An attribute whose length overruns the body is dropped.
        let mut body = vec![0u8; RTMSG_LEN];
        body.extend_from_slice(&[40, 0, 1, 0, 1, 2]);
        assert!(attrs(&body, RTMSG_LEN).is_empty());
    }

    #[test]
    fn own_and_loopback_changes_do_not_matter() {
        let lo = 1;
        let route = |protocol: u8, table: u8| {
            Request::new(
                RTM_NEWROUTE,
                0,
                &rtmsg(2, 32, 0, table, protocol, RTN_UNICAST),
            )
            .attr(RTA_DST, &[198, 18, 1, 2])
            .finish(0)
        };
        let addr = |ifindex| {
            addr_request(RTM_DELADDR, 0, "198.18.1.2".parse().unwrap(), ifindex).finish(0)
        };
        // vnat's host route, a local-table route, an address on lo: no.
        assert!(!notifications_matter(&route(157, RT_TABLE_MAIN), lo, 157));
        assert!(!notifications_matter(&route(2, 255), lo, 157));
        assert!(!notifications_matter(&addr(lo), lo, 157));
        let mut both = route(157, RT_TABLE_MAIN);
        both.extend(addr(lo));
        assert!(!notifications_matter(&both, lo, 157));
        // A kernel route of the main table, an address of a real link, a
        // link message, one relevant message among ours: yes.
        assert!(notifications_matter(&route(2, RT_TABLE_MAIN), lo, 157));
        assert!(notifications_matter(&addr(3), lo, 157));
        assert!(notifications_matter(
            &Request::new(RTM_NEWLINK, 0, &[0; 16]).finish(0),
            lo,
            157
        ));
        both.extend(addr(3));
        assert!(notifications_matter(&both, lo, 157));
        // Unreadable input counts as a change (a resync is always safe).
        assert!(notifications_matter(&[1, 2, 3], lo, 157));
        assert!(notifications_matter(
            &Request::new(RTM_NEWROUTE, 0, &[0; 4]).finish(0),
            lo,
            157
        ));
    }
}
