//! A raw socket bound to a flow's local virtual address, and the libc
//! plumbing it needs.

use super::*;
use crate::datapath::kernel::rtnl::{with_kept, Kept};

pub(super) fn kernel_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> DatapathError {
    let what = what.into();
    move |source| DatapathError::Kernel { what, source }
}

pub(super) fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

pub(super) fn setsockopt<T>(
    fd: &OwnedFd,
    level: libc::c_int,
    name: libc::c_int,
    value: &T,
) -> io::Result<()> {
    // SAFETY: `fd` is borrowed, so open for the call; `value` points to a
    // live T and exactly size_of::<T>() bytes are passed, so the kernel
    // reads only within it. (It reads the bytes, padding included, and
    // interprets them as the option's C type; callers pass that type.)
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (value as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// An int-valued socket option of `fd`.
pub(super) fn getsockopt_int(
    fd: &OwnedFd,
    level: libc::c_int,
    name: libc::c_int,
) -> io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `fd` is borrowed, so open for the call; `v` and `len` are
    // live locals and `len` says how many bytes `v` has, which the kernel
    // writes at most.
    cvt(unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    Ok(v)
}

/// sockaddr_in / sockaddr_in6 for `ip`, port 0 (raw sockets have none).
pub(super) fn sockaddr(ip: IpAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match ip {
        IpAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            let sin = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>()
            };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_addr.s_addr = u32::from_ne_bytes(v4.octets());
            size_of::<libc::sockaddr_in>()
        }
        IpAddr::V6(v6) => {
            // SAFETY: as above.
            let sin6 = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_addr.s6_addr = v6.octets();
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum RawKind {
    /// ICMP (v4) or ICMPv6 messages, sent to the local virtual address.
    Icmp,
    /// TCP segments (we build the header), sent to the peer.
    Tcp,
}

/// A raw socket bound to the flow's local virtual address.
pub(super) struct RawSocket {
    pub(super) fd: OwnedFd,
}

impl RawSocket {
    pub(super) fn open(local: IpAddr, kind: RawKind) -> Result<RawSocket, DatapathError> {
        let (family, proto) = match (local, kind) {
            (IpAddr::V4(_), RawKind::Icmp) => (libc::AF_INET, libc::IPPROTO_ICMP),
            (IpAddr::V6(_), RawKind::Icmp) => (libc::AF_INET6, libc::IPPROTO_ICMPV6),
            (IpAddr::V4(_), RawKind::Tcp) => (libc::AF_INET, libc::IPPROTO_TCP),
            (IpAddr::V6(_), RawKind::Tcp) => (libc::AF_INET6, libc::IPPROTO_TCP),
        };
        // SAFETY: socket(2) takes no pointers; it returns a new descriptor,
        // owned at once below, or -1 (which `cvt` turns into an error).
        let raw = cvt(unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) })
            .map_err(kernel_err("opening a raw socket (needs CAP_NET_RAW)"))?;
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        if kind == RawKind::Icmp {
            // Hop limit 255: a socket protected with IP_MINTTL /
            // IPV6_MINHOPCOUNT (RFC 5082) drops ICMP with a lower one
            // (tcp_v4_err, tcp_v6_err). Receive nothing: a raw ICMP socket
            // gets a copy of every ICMP message of the namespace.
            let hops: libc::c_int = 255;
            let opts = match local {
                IpAddr::V4(_) => setsockopt(&fd, libc::IPPROTO_IP, libc::IP_TTL, &hops)
                    .and_then(|_| setsockopt(&fd, libc::SOL_RAW, ICMP_FILTER, &u32::MAX)),
                IpAddr::V6(_) => {
                    setsockopt(&fd, libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, &hops).and_then(
                        |_| setsockopt(&fd, libc::IPPROTO_ICMPV6, ICMP6_FILTER, &[u32::MAX; 8]),
                    )
                }
            };
            opts.map_err(kernel_err("setting up the raw ICMP socket"))?;
        }
        // Bound to the local virtual address: the bind fails unless the
        // address is local (raw_bind, rawv6_bind), so an ICMP message sent
        // to it is routed over loopback and comes back in as incoming ICMP
        // (it can never leave the host), and a probe leaves with the
        // socket's own source address, which tc then translates.
        let (sa, len) = sockaddr(local);
        // SAFETY: `fd` is owned here, so open; `sa` is a live
        // sockaddr_storage and `len` (the size of the sockaddr_in or
        // sockaddr_in6 inside it) is no more than its size.
        cvt(unsafe { libc::bind(fd.as_raw_fd(), (&sa as *const libc::sockaddr_storage).cast(), len) }).map_err(
            kernel_err(format!(
                "binding a raw socket to {local} (the flow's local virtual address must be on this host: install the translation first)"
            )),
        )?;
        Ok(RawSocket { fd })
    }

    pub(super) fn send(&self, message: &[u8], to: IpAddr) -> Result<(), DatapathError> {
        // For IPPROTO_TCP the kernel adds only the IP header (no IP_HDRINCL),
        // with the bound source; the TCP checksum is ours.
        let (sa, len) = sockaddr(to);
        // SAFETY: `self.fd` is open while `self` lives; `message` and `sa`
        // are live for the call, with their lengths (`len` no more than the
        // size of `sa`).
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                message.as_ptr().cast(),
                message.len(),
                0,
                (&sa as *const libc::sockaddr_storage).cast(),
                len,
            )
        };
        if n < 0 {
            return Err(kernel_err(format!("sending a restart message to {to}"))(
                io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// `ICMP_FILTER` (linux/icmp.h) at SOL_RAW: a bit mask of ICMP types to drop.
pub(super) const ICMP_FILTER: libc::c_int = 1;
/// `ICMP6_FILTER` (linux/icmpv6.h) at IPPROTO_ICMPV6: a set bit blocks a type.
pub(super) const ICMP6_FILTER: libc::c_int = 1;

/// `IPV6_HDRINCL` (linux/in6.h, Linux 4.5): the caller writes the IPv6 header.
const IPV6_HDRINCL: libc::c_int = 36;

/// Deliver `tcp` (a TCP header with its checksum over the flow's remote ->
/// local virtual endpoints) to the flow's local socket as if the peer had
/// sent it. A raw socket with a caller-written IP header may use a source
/// address that is not local; the destination, the flow's local virtual
/// address, is, so the packet is routed over loopback and never leaves the
/// host.
pub(super) fn inject_from_peer(flow: &VirtualFlow, tcp: &[u8]) -> Result<(), DatapathError> {
    send_ip(
        flow.remote.ip(),
        flow.local.ip(),
        libc::IPPROTO_TCP as u8,
        tcp,
        || {
            format!(
                "injecting an ACK request into the socket of {} -> {}",
                flow.local, flow.remote
            )
        },
    )
}

/// Send `payload` as one UDP datagram from `local` to `remote` (of one
/// family), with our own IP and UDP headers: on one of our UDP flows' own
/// 5-tuple, whose socket belongs to the application (an in-band BIND).
pub fn send_udp(
    local: SocketAddr,
    remote: SocketAddr,
    payload: &[u8],
) -> Result<(), DatapathError> {
    let udp = udp_datagram(local, remote, payload).ok_or(DatapathError::InvalidTranslation {
        flow: VirtualFlow {
            proto: crate::datapath::Proto::Udp,
            local,
            remote,
        },
        reason: "endpoints of two address families",
    })?;
    send_ip(
        local.ip(),
        remote.ip(),
        libc::IPPROTO_UDP as u8,
        &udp,
        || format!("sending a datagram from {local} to {remote} on a raw socket"),
    )
}

/// A UDP header and `payload`, with the checksum over the pseudo-header of
/// `local` -> `remote`; `None` if they are of two families.
pub(super) fn udp_datagram(
    local: SocketAddr,
    remote: SocketAddr,
    payload: &[u8],
) -> Option<Vec<u8>> {
    if local.is_ipv4() != remote.is_ipv4() {
        return None;
    }
    let len = 8 + payload.len();
    let mut u = Vec::with_capacity(len);
    u.extend_from_slice(&local.port().to_be_bytes());
    u.extend_from_slice(&remote.port().to_be_bytes());
    u.extend_from_slice(&(len as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(payload);
    let mut pseudo = pseudo_header(local.ip(), remote.ip(), libc::IPPROTO_UDP as u8, len);
    pseudo.extend_from_slice(&u);
    // 0 means "no checksum" over IPv4 and is not allowed over IPv6: a
    // computed 0 is sent as all ones.
    let c = match checksum(&pseudo) {
        0 => 0xffff,
        c => c,
    };
    u[6..8].copy_from_slice(&c.to_be_bytes());
    Some(u)
}

/// The pseudo-header an L4 checksum covers (RFC 768, RFC 8200 8.1).
pub(super) fn pseudo_header(src: IpAddr, dst: IpAddr, proto: u8, l4_len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(40 + l4_len);
    match (src, dst) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            p.extend_from_slice(&s.octets());
            p.extend_from_slice(&d.octets());
            p.extend_from_slice(&[0, proto]);
            p.extend_from_slice(&(l4_len as u16).to_be_bytes());
        }
        (s, d) => {
            p.extend_from_slice(&to_v6(s).octets());
            p.extend_from_slice(&to_v6(d).octets());
            p.extend_from_slice(&(l4_len as u32).to_be_bytes());
            p.extend_from_slice(&[0, 0, 0, proto]);
        }
    }
    p
}

/// Send `l4` from `src` to `dst` with an IP header of our own. A socket with
/// IPPROTO_RAW only sends (it is never given incoming packets), so one is
/// kept per thread and family: a mass move injects one segment per
/// connection.
pub(super) fn send_ip(
    src: IpAddr,
    dst: IpAddr,
    proto: u8,
    l4: &[u8],
    what: impl FnOnce() -> String,
) -> Result<(), DatapathError> {
    thread_local! {
        static KEPT_V4: Kept<OwnedFd> = const { std::cell::RefCell::new(None) };
        static KEPT_V6: Kept<OwnedFd> = const { std::cell::RefCell::new(None) };
    }
    let v4 = dst.is_ipv4();
    with_kept(
        if v4 { &KEPT_V4 } else { &KEPT_V6 },
        kernel_err("finding this thread's network namespace"),
        || open_injector(v4),
        |fd| send_packet(fd, src, dst, proto, l4).map_err(kernel_err(what())),
    )
}

fn open_injector(v4: bool) -> Result<OwnedFd, DatapathError> {
    let (family, level, opt) = if v4 {
        (libc::AF_INET, libc::IPPROTO_IP, libc::IP_HDRINCL)
    } else {
        (libc::AF_INET6, libc::IPPROTO_IPV6, IPV6_HDRINCL)
    };
    // SAFETY: socket(2) takes no pointers; it returns a new descriptor,
    // owned at once below, or -1 (which `cvt` turns into an error).
    let raw = cvt(unsafe {
        libc::socket(
            family,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        )
    })
    .map_err(kernel_err("opening a raw socket (needs CAP_NET_RAW)"))?;
    // SAFETY: `raw` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    setsockopt(&fd, level, opt, &(1 as libc::c_int))
        .map_err(kernel_err("asking to write the IP header of a raw socket"))?;
    Ok(fd)
}

fn send_packet(fd: &OwnedFd, src: IpAddr, dst: IpAddr, proto: u8, l4: &[u8]) -> io::Result<()> {
    let packet = match (src, dst) {
        (IpAddr::V4(src), IpAddr::V4(dst)) => {
            let mut p = vec![0u8; 20];
            p[0] = 0x45;
            p[2..4].copy_from_slice(&((20 + l4.len()) as u16).to_be_bytes());
            p[6] = 0x40; // DF
            p[8] = 64;
            p[9] = proto;
            p[12..16].copy_from_slice(&src.octets());
            p[16..20].copy_from_slice(&dst.octets());
            let c = checksum(&p);
            p[10..12].copy_from_slice(&c.to_be_bytes());
            p.extend_from_slice(l4);
            p
        }
        (src, dst) => {
            let mut p = vec![0x60, 0, 0, 0];
            p.extend_from_slice(&(l4.len() as u16).to_be_bytes());
            p.push(proto);
            p.push(64);
            p.extend_from_slice(&to_v6(src).octets());
            p.extend_from_slice(&to_v6(dst).octets());
            p.extend_from_slice(l4);
            p
        }
    };
    let (sa, len) = sockaddr(dst);
    // SAFETY: `fd` is borrowed, so open for the call; `packet` and `sa` are
    // live, with their lengths (`len` no more than the size of `sa`).
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            packet.as_ptr().cast(),
            packet.len(),
            0,
            (&sa as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
