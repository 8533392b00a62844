//! Sending a datagram on one of our UDP flows' own 5-tuple (an in-band
//! BIND, `vcmp::bind`): the flow's socket belongs to the application, so
//! vnatd builds the IP and UDP headers itself and sends through a raw
//! socket. The packet then crosses a NAT exactly as the flow's own do.

use std::io;
use std::net::{IpAddr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use nix::sys::socket::{sendto, MsgFlags, SockaddrIn, SockaddrIn6};

const TTL: u8 = 64;
const UDP: u8 = 17;

/// Send `payload` from `local` to `remote` (one family) as one UDP datagram.
pub fn send_udp_from(local: SocketAddr, remote: SocketAddr, payload: &[u8]) -> io::Result<()> {
    let packet = udp_packet(local, remote, payload).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "endpoints of two address families",
        )
    })?;
    let family = if remote.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: socket(2) with constant arguments; it returns a new
    // descriptor or -1, checked before use. IPPROTO_RAW sockets only send,
    // and carry our own IP header (IP_HDRINCL / IPV6_HDRINCL implied).
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by socket(2) and is owned by nothing
    // else; the OwnedFd closes it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let sent = match remote.ip() {
        IpAddr::V4(ip) => sendto(
            fd.as_raw_fd(),
            &packet,
            &SockaddrIn::from(SocketAddrV4::new(ip, 0)),
            MsgFlags::empty(),
        ),
        IpAddr::V6(ip) => sendto(
            fd.as_raw_fd(),
            &packet,
            &SockaddrIn6::from(SocketAddrV6::new(ip, 0, 0, 0)),
            MsgFlags::empty(),
        ),
    }
    .map_err(io::Error::from)?;
    if sent != packet.len() {
        return Err(io::Error::other("short send on the raw socket"));
    }
    Ok(())
}

/// The IPv4 or IPv6 packet carrying `payload` from `local` to `remote`, with
/// its UDP checksum (the kernel fills the IPv4 header checksum and id).
pub fn udp_packet(local: SocketAddr, remote: SocketAddr, payload: &[u8]) -> Option<Vec<u8>> {
    let udp_len = 8 + payload.len();
    let mut udp = Vec::with_capacity(udp_len);
    udp.extend_from_slice(&local.port().to_be_bytes());
    udp.extend_from_slice(&remote.port().to_be_bytes());
    udp.extend_from_slice(&(udp_len as u16).to_be_bytes());
    udp.extend_from_slice(&[0, 0]);
    udp.extend_from_slice(payload);
    let mut pseudo = Vec::with_capacity(40);
    let mut out = Vec::with_capacity(40 + udp_len);
    match (local.ip(), remote.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&[0, UDP]);
            pseudo.extend_from_slice(&(udp_len as u16).to_be_bytes());
            out.extend_from_slice(&[0x45, 0]);
            out.extend_from_slice(&((20 + udp_len) as u16).to_be_bytes());
            out.extend_from_slice(&[0, 0, 0x40, 0, TTL, UDP, 0, 0]);
            out.extend_from_slice(&s.octets());
            out.extend_from_slice(&d.octets());
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&(udp_len as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, UDP]);
            out.extend_from_slice(&[0x60, 0, 0, 0]);
            out.extend_from_slice(&(udp_len as u16).to_be_bytes());
            out.extend_from_slice(&[UDP, TTL]);
            out.extend_from_slice(&s.octets());
            out.extend_from_slice(&d.octets());
        }
        _ => return None,
    }
    let mut sum = checksum(&[&pseudo, &udp]);
    if sum == 0 {
        // 0 means "no checksum" in UDP over IPv4, and is not allowed over
        // IPv6: a computed 0 is sent as all ones.
        sum = 0xffff;
    }
    udp[6..8].copy_from_slice(&sum.to_be_bytes());
    out.extend_from_slice(&udp);
    Some(out)
}

/// The Internet checksum (RFC 1071) of the concatenation of `parts`, each
/// of even length except possibly the last.
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for part in parts {
        let mut words = part.chunks_exact(2);
        for w in &mut words {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        if let [last] = words.remainder() {
            sum += u32::from(*last) << 8;
        }
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A receiver's check: the one's complement sum over the pseudo-header
    /// and the whole UDP datagram, checksum included, is all ones.
    fn verifies(packet: &[u8], v6: bool) -> bool {
        let (l3, src, dst) = if v6 { (40, 8, 24) } else { (20, 12, 16) };
        let alen = if v6 { 16 } else { 4 };
        let udp = &packet[l3..];
        let mut pseudo = Vec::new();
        pseudo.extend_from_slice(&packet[src..src + alen]);
        pseudo.extend_from_slice(&packet[dst..dst + alen]);
        if v6 {
            pseudo.extend_from_slice(&(udp.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, UDP]);
        } else {
            pseudo.extend_from_slice(&[0, UDP]);
            pseudo.extend_from_slice(&(udp.len() as u16).to_be_bytes());
        }
        checksum(&[&pseudo, udp]) == 0
    }

    #[test]
    fn packets_carry_valid_headers_and_checksums() {
        for (l, r) in [
            ("192.168.1.10:40000", "198.18.3.2:5001"),
            ("[fd00::10]:40000", "[2001:db8::2]:53"),
        ] {
            let (l, r): (SocketAddr, SocketAddr) = (l.parse().unwrap(), r.parse().unwrap());
            for payload in [&b"odd"[..], &[0u8; 134][..], &[0xff; 7][..]] {
                let p = udp_packet(l, r, payload).unwrap();
                let v6 = l.is_ipv6();
                let l3 = if v6 { 40 } else { 20 };
                assert_eq!(p.len(), l3 + 8 + payload.len());
                assert_eq!(&p[l3..l3 + 2], &l.port().to_be_bytes());
                assert_eq!(&p[l3 + 2..l3 + 4], &r.port().to_be_bytes());
                assert_eq!(&p[l3 + 8..], payload);
                assert!(verifies(&p, v6), "{l} -> {r}, {} bytes", payload.len());
            }
        }
        let mixed = udp_packet(
            "10.0.0.1:1".parse().unwrap(),
            "[::1]:2".parse().unwrap(),
            b"x",
        );
        assert!(mixed.is_none());
    }
}
