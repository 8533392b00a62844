//! The VCMP socket's I/O: its buffers, each datagram's destination on
//! receipt (IP_PKTINFO) and its source on sending, and the address forms
//! of a dual-stack socket.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
};

use tokio::net::UdpSocket;

/// Room for the VCMP bursts of a mass move: restoring 10,000 connections
/// sends over a thousand datagrams within milliseconds (UPD, LOOKUP and
/// STORE records, 30 to a datagram), far beyond the default 208 KiB, and
/// every one the kernel drops costs a retransmission timeout. 100,000
/// connections send 3,400 full datagrams (about 2.3 KiB of buffer each) at
/// once, which overflowed 8 MiB: 38,000 datagrams dropped with the
/// retransmissions, and 5% of the migrations given up. The memory is taken
/// only while datagrams wait. The FORCE
/// variants (CAP_NET_ADMIN, which vnatd has) pass net.core.rmem_max; on
/// failure the plain ones give what the sysctl allows.
pub(super) fn enlarge_buffers(sock: &UdpSocket) {
    use std::os::fd::AsRawFd;
    const BYTES: libc::c_int = 32 << 20;
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        let set = |opt| {
            // SAFETY: setsockopt on our own socket with a live c_int.
            unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&BYTES as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            }
        };
        if set(force) != 0 && set(plain) != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "cannot enlarge the VCMP socket buffers");
        }
    }
}

/// Ask the kernel for each datagram's destination (IP_PKTINFO, and on the
/// dual-stack socket IPV6_RECVPKTINFO too): which of this host's addresses
/// a peer sent to, which tells whether a peer that moved too knows where
/// our own move took us (`Endpoint::handle_datagram_at`). Without it vnatd
/// works as before, a round trip slower when both ends move.
pub(super) fn ask_destinations(sock: &UdpSocket, dual: bool) {
    use nix::sys::socket::{setsockopt, sockopt};
    let mut r = setsockopt(sock, sockopt::Ipv4PacketInfo, &true);
    if dual {
        r = r.and(setsockopt(sock, sockopt::Ipv6RecvPacketInfo, &true));
    }
    if let Err(e) = r {
        tracing::debug!(error = %e, "cannot learn where VCMP datagrams were sent to");
    }
}

/// Receive one datagram without blocking: its length, its source and, when
/// the kernel tells it ([`ask_destinations`]), the local address it was
/// sent to (an IPv4 one unmapped).
pub(super) fn recv_datagram(
    sock: &UdpSocket,
    buf: &mut [u8],
) -> std::io::Result<(usize, SocketAddr, Option<IpAddr>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, SockaddrLike, SockaddrStorage};
    use std::os::fd::AsRawFd;
    let mut space = nix::cmsg_space!(libc::in6_pktinfo, libc::in_pktinfo);
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let msg = recvmsg::<SockaddrStorage>(
        sock.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_DONTWAIT,
    )?;
    let from = msg
        .address
        .and_then(|a| match a.family() {
            Some(nix::sys::socket::AddressFamily::Inet6) => a
                .as_sockaddr_in6()
                .map(|s| SocketAddr::V6(std::net::SocketAddrV6::from(*s))),
            Some(nix::sys::socket::AddressFamily::Inet) => a
                .as_sockaddr_in()
                .map(|s| SocketAddr::V4(std::net::SocketAddrV4::from(*s))),
            _ => None,
        })
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EAFNOSUPPORT))?;
    let mut to = None;
    for c in msg.cmsgs()? {
        match c {
            ControlMessageOwned::Ipv6PacketInfo(i) => {
                let ip = std::net::Ipv6Addr::from(i.ipi6_addr.s6_addr);
                to = Some(ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4));
            }
            ControlMessageOwned::Ipv4PacketInfo(i) => {
                to = Some(IpAddr::V4(std::net::Ipv4Addr::from(u32::from_be(
                    i.ipi_addr.s_addr,
                ))));
            }
            _ => {}
        }
    }
    Ok((msg.bytes, from, to))
}

/// [`recv_datagram`], waiting for one.
pub(super) async fn recv_next(
    sock: &UdpSocket,
    buf: &mut [u8],
) -> std::io::Result<(usize, SocketAddr, Option<IpAddr>)> {
    loop {
        sock.readable().await?;
        match sock.try_io(tokio::io::Interest::READABLE, || recv_datagram(sock, buf)) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

/// An IPv4 peer seen through the dual-stack socket arrives as `::ffff:a.b.c.d`.
pub(super) fn unmap(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

pub(super) fn to_socket_family(a: SocketAddr, dual: bool) -> SocketAddr {
    match (a, dual) {
        (SocketAddr::V4(v4), true) => {
            SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())
        }
        _ => a,
    }
}

/// The interface of each address of this host (`lo` only for addresses on
/// no other: vnatd keeps the addresses of mobile connections there too).
pub(super) fn address_owners() -> HashMap<IpAddr, u32> {
    let mut out = HashMap::new();
    let Ok(list) = nix::ifaddrs::getifaddrs() else {
        return out;
    };
    for ifa in list {
        let Some(a) = ifa.address else { continue };
        let ip = match (a.as_sockaddr_in(), a.as_sockaddr_in6()) {
            (Some(v4), _) => IpAddr::V4(v4.ip()),
            (_, Some(v6)) => IpAddr::V6(v6.ip()),
            _ => continue,
        };
        let Ok(index) = nix::net::if_::if_nametoindex(ifa.interface_name.as_str()) else {
            continue;
        };
        if ifa.interface_name == "lo" {
            out.entry(ip).or_insert(index);
        } else {
            out.insert(ip, index);
        }
    }
    out
}

/// Send `payload` to `dst` from the local address `src` out of interface
/// `oif` (0: any), with IP_PKTINFO or IPV6_PKTINFO (on a dual-stack socket
/// an IPv4 source is given mapped, as the kernel takes it there), without
/// blocking.
pub(super) fn send_from(
    sock: &UdpSocket,
    payload: &[u8],
    dst: SocketAddr,
    src: IpAddr,
    oif: u32,
) -> std::io::Result<usize> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags, SockaddrIn, SockaddrIn6};
    use std::os::fd::AsRawFd;
    let fd = sock.as_raw_fd();
    let iov = [std::io::IoSlice::new(payload)];
    let flags = MsgFlags::MSG_DONTWAIT;
    let r = match (dst, src) {
        (SocketAddr::V6(d), IpAddr::V6(s)) => {
            let info = libc::in6_pktinfo {
                ipi6_addr: libc::in6_addr {
                    s6_addr: s.octets(),
                },
                ipi6_ifindex: oif,
            };
            let cmsg = [ControlMessage::Ipv6PacketInfo(&info)];
            sendmsg(fd, &iov, &cmsg, flags, Some(&SockaddrIn6::from(d)))
        }
        (SocketAddr::V4(d), IpAddr::V4(s)) => {
            let info = libc::in_pktinfo {
                ipi_ifindex: oif as i32,
                ipi_spec_dst: libc::in_addr {
                    s_addr: u32::from(s).to_be(),
                },
                ipi_addr: libc::in_addr { s_addr: 0 },
            };
            let cmsg = [ControlMessage::Ipv4PacketInfo(&info)];
            sendmsg(fd, &iov, &cmsg, flags, Some(&SockaddrIn::from(d)))
        }
        _ => return Err(std::io::Error::from_raw_os_error(libc::EAFNOSUPPORT)),
    };
    r.map_err(std::io::Error::from)
}
