//! Build Ethernet/IPv4/IPv6/TCP/UDP frames and check every checksum by
//! recomputing it from scratch (never incrementally), so that a wrong
//! incremental update in the tc programs cannot go unnoticed.

use std::net::{IpAddr, SocketAddr};

pub const ETH_HLEN: usize = 14;

fn sum16(data: &[u8], mut acc: u32) -> u32 {
    let mut chunks = data.chunks_exact(2);
    for c in &mut chunks {
        acc += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        acc += u32::from(*last) << 8;
    }
    acc
}

fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    !(acc as u16)
}

fn ip_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v) => v.octets().to_vec(),
        IpAddr::V6(v) => v.octets().to_vec(),
    }
}

fn pseudo_sum(src: IpAddr, dst: IpAddr, proto: u8, len: usize) -> u32 {
    let mut acc = sum16(&ip_bytes(src), 0);
    acc = sum16(&ip_bytes(dst), acc);
    acc += u32::from(proto);
    acc += len as u32;
    acc
}

/// A flow's packet description.
#[derive(Clone, Debug)]
pub struct Spec {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    /// 6 or 17.
    pub proto: u8,
    pub payload: Vec<u8>,
    /// IPv4 options bytes (multiple of 4, at most 40).
    pub ip_options: Vec<u8>,
    /// UDP over IPv4 with checksum 0 ("none").
    pub udp_zero_csum: bool,
    /// IPv4 fragment offset in 8-byte units (non-zero: non-first fragment).
    pub frag_offset: u16,
    /// IPv6 extension headers between the fixed header and TCP/UDP, in
    /// order: (header type, its bytes; the first byte, its next header, is
    /// filled in by `frame`).
    pub ip6_ext: Vec<(u8, Vec<u8>)>,
    /// TCP flags (PSH|ACK unless set).
    pub tcp_flags: u8,
    /// TCP options (a multiple of 4 bytes, at most 40), after the fixed
    /// header; the data offset counts them.
    pub tcp_options: Vec<u8>,
}

/// An IPv6 extension header of `len8` 8-byte units (hop-by-hop, routing,
/// destination options: padded with PadN), for `Spec::ip6_ext`.
pub fn ip6_opts(len8: usize) -> Vec<u8> {
    let mut h = vec![0u8; len8 * 8];
    h[1] = (len8 - 1) as u8;
    // PadN over the rest.
    h[2] = 1;
    h[3] = (len8 * 8 - 4) as u8;
    h
}

impl Spec {
    pub fn tcp(src: &str, dst: &str) -> Spec {
        Spec::new(src, dst, 6)
    }
    pub fn udp(src: &str, dst: &str) -> Spec {
        Spec::new(src, dst, 17)
    }
    fn new(src: &str, dst: &str, proto: u8) -> Spec {
        Spec {
            src: src.parse().expect("bad src"),
            dst: dst.parse().expect("bad dst"),
            proto,
            payload: (0..=255u8).cycle().take(301).collect(),
            ip_options: Vec::new(),
            udp_zero_csum: false,
            frag_offset: 0,
            ip6_ext: Vec::new(),
            tcp_flags: 0x18,
            tcp_options: Vec::new(),
        }
    }

    /// The L4 segment with a correct checksum.
    fn l4(&self) -> Vec<u8> {
        let mut seg = Vec::new();
        seg.extend(self.src.port().to_be_bytes());
        seg.extend(self.dst.port().to_be_bytes());
        let csum_off = if self.proto == 6 {
            seg.extend(0x1234_5678u32.to_be_bytes()); // seq
            seg.extend(0x9abc_def0u32.to_be_bytes()); // ack
            let doff = 5 + self.tcp_options.len() / 4;
            seg.extend([(doff as u8) << 4, self.tcp_flags]);
            seg.extend(502u16.to_be_bytes()); // window
            seg.extend([0, 0, 0, 0]); // csum, urg
            seg.extend(&self.tcp_options);
            16
        } else {
            let len = (8 + self.payload.len()) as u16;
            seg.extend(len.to_be_bytes());
            seg.extend([0, 0]);
            6
        };
        seg.extend(&self.payload);
        if !(self.proto == 17 && self.udp_zero_csum) {
            let acc = pseudo_sum(self.src.ip(), self.dst.ip(), self.proto, seg.len());
            let mut c = fold(sum16(&seg, acc));
            if self.proto == 17 && c == 0 {
                c = 0xffff;
            }
            seg[csum_off..csum_off + 2].copy_from_slice(&c.to_be_bytes());
        }
        seg
    }

    /// The whole Ethernet frame.
    pub fn frame(&self) -> Vec<u8> {
        let l4 = self.l4();
        let mut f = vec![0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01];
        match (self.src.ip(), self.dst.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                f.extend(0x0800u16.to_be_bytes());
                let ihl = 5 + self.ip_options.len() / 4;
                let total = ihl * 4 + l4.len();
                let mut h = vec![(4 << 4) | ihl as u8, 0];
                h.extend((total as u16).to_be_bytes());
                h.extend([0xbe, 0xef]);
                h.extend(self.frag_offset.to_be_bytes());
                h.extend([64, self.proto, 0, 0]);
                h.extend(s.octets());
                h.extend(d.octets());
                h.extend(&self.ip_options);
                let c = fold(sum16(&h, 0));
                h[10..12].copy_from_slice(&c.to_be_bytes());
                f.extend(h);
            }
            (IpAddr::V6(s), IpAddr::V6(d)) => {
                f.extend(0x86DDu16.to_be_bytes());
                f.extend([0x60, 0, 0, 0]);
                let ext_len: usize = self.ip6_ext.iter().map(|(_, b)| b.len()).sum();
                f.extend(((ext_len + l4.len()) as u16).to_be_bytes());
                let first = self.ip6_ext.first().map_or(self.proto, |(t, _)| *t);
                f.extend([first, 64]);
                f.extend(s.octets());
                f.extend(d.octets());
                for (i, (_, b)) in self.ip6_ext.iter().enumerate() {
                    let next = self.ip6_ext.get(i + 1).map_or(self.proto, |(t, _)| *t);
                    let mut b = b.clone();
                    b[0] = next;
                    f.extend(b);
                }
            }
            _ => panic!("mixed families in a test packet"),
        }
        f.extend(l4);
        f
    }
}

/// Past IPv6 extension headers (hop-by-hop, routing, destination options,
/// fragment): the upper-layer protocol and its bytes.
fn skip_ip6_ext(mut nh: u8, mut rest: &[u8]) -> (u8, &[u8]) {
    while matches!(nh, 0 | 43 | 44 | 60) {
        let len = if nh == 44 {
            8
        } else {
            (usize::from(rest[1]) + 1) * 8
        };
        nh = rest[0];
        rest = &rest[len..];
    }
    (nh, rest)
}

/// What a frame carries, after checking every checksum from scratch.
#[derive(Debug, PartialEq, Eq)]
pub struct Parsed {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    pub proto: u8,
    pub payload: Vec<u8>,
    pub udp_csum_zero: bool,
}

/// Parse a frame and panic with a message if any checksum is wrong.
pub fn parse_checked(f: &[u8]) -> Parsed {
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    let (src_ip, dst_ip, proto, l4) = match ethertype {
        0x0800 => {
            let ihl = usize::from(f[ETH_HLEN] & 0x0f) * 4;
            let h = &f[ETH_HLEN..ETH_HLEN + ihl];
            assert_eq!(fold(sum16(h, 0)), 0, "IPv4 header checksum is wrong");
            let s: [u8; 4] = h[12..16].try_into().unwrap();
            let d: [u8; 4] = h[16..20].try_into().unwrap();
            (IpAddr::from(s), IpAddr::from(d), h[9], &f[ETH_HLEN + ihl..])
        }
        0x86DD => {
            let h = &f[ETH_HLEN..ETH_HLEN + 40];
            let s: [u8; 16] = h[8..24].try_into().unwrap();
            let d: [u8; 16] = h[24..40].try_into().unwrap();
            let (proto, l4) = skip_ip6_ext(h[6], &f[ETH_HLEN + 40..]);
            (IpAddr::from(s), IpAddr::from(d), proto, l4)
        }
        other => panic!("unexpected ethertype {other:#x}"),
    };
    let sport = u16::from_be_bytes([l4[0], l4[1]]);
    let dport = u16::from_be_bytes([l4[2], l4[3]]);
    let (payload_off, csum) = if proto == 6 {
        (usize::from(l4[12] >> 4) * 4, [l4[16], l4[17]])
    } else {
        (8, [l4[6], l4[7]])
    };
    let udp_csum_zero = proto == 17 && csum == [0, 0];
    if !udp_csum_zero {
        let acc = pseudo_sum(src_ip, dst_ip, proto, l4.len());
        assert_eq!(
            fold(sum16(l4, acc)),
            0,
            "L4 checksum is wrong (proto {proto})"
        );
    }
    Parsed {
        src: SocketAddr::new(src_ip, sport),
        dst: SocketAddr::new(dst_ip, dport),
        proto,
        payload: l4[payload_off..].to_vec(),
        udp_csum_zero,
    }
}

/// An ICMP error from `from` to `to` (ICMPv4 or ICMPv6 by the addresses'
/// family) of `typ` and `code`, with `rest` in its second word (the MTU of
/// a "fragmentation needed" or "packet too big"), quoting the whole of
/// `inner`'s IP packet: small enough in the tests that every checksum in the
/// quote can be checked from scratch too.
pub fn icmp_error(from: IpAddr, to: IpAddr, typ: u8, code: u8, rest: u32, inner: &Spec) -> Vec<u8> {
    let quoted = &inner.frame()[ETH_HLEN..];
    let mut msg = vec![typ, code, 0, 0];
    msg.extend(rest.to_be_bytes());
    msg.extend(quoted);
    let mut f = vec![0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01];
    match (from, to) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let c = fold(sum16(&msg, 0));
            msg[2..4].copy_from_slice(&c.to_be_bytes());
            f.extend(0x0800u16.to_be_bytes());
            let mut h = vec![0x45, 0];
            h.extend(((20 + msg.len()) as u16).to_be_bytes());
            h.extend([0, 0, 0, 0, 64, 1, 0, 0]);
            h.extend(s.octets());
            h.extend(d.octets());
            let c = fold(sum16(&h, 0));
            h[10..12].copy_from_slice(&c.to_be_bytes());
            f.extend(h);
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let c = fold(sum16(&msg, pseudo_sum(from, to, 58, msg.len())));
            msg[2..4].copy_from_slice(&c.to_be_bytes());
            f.extend(0x86DDu16.to_be_bytes());
            f.extend([0x60, 0, 0, 0]);
            f.extend((msg.len() as u16).to_be_bytes());
            f.extend([58, 64]);
            f.extend(s.octets());
            f.extend(d.octets());
        }
        _ => panic!("mixed families in a test packet"),
    }
    f.extend(msg);
    f
}

/// What an ICMP error carries, after checking every checksum from scratch:
/// the outer IP header's, the ICMP message's, and the quoted packet's own
/// (its IP header's and, the quote being whole, its TCP or UDP checksum).
#[derive(Debug, PartialEq, Eq)]
pub struct IcmpParsed {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub typ: u8,
    pub code: u8,
    pub rest: u32,
    pub inner: Parsed,
}

/// Parse a frame made by [`icmp_error`] (and translated) and panic with a
/// message if any checksum is wrong.
pub fn parse_icmp_checked(f: &[u8]) -> IcmpParsed {
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    let (src, dst, msg) = match ethertype {
        0x0800 => {
            let h = &f[ETH_HLEN..ETH_HLEN + 20];
            assert_eq!(fold(sum16(h, 0)), 0, "outer IPv4 header checksum is wrong");
            assert_eq!(h[9], 1, "not ICMP");
            let s: [u8; 4] = h[12..16].try_into().unwrap();
            let d: [u8; 4] = h[16..20].try_into().unwrap();
            let msg = &f[ETH_HLEN + 20..];
            assert_eq!(fold(sum16(msg, 0)), 0, "ICMP checksum is wrong");
            (IpAddr::from(s), IpAddr::from(d), msg)
        }
        0x86DD => {
            let h = &f[ETH_HLEN..ETH_HLEN + 40];
            assert_eq!(h[6], 58, "not ICMPv6");
            let s: [u8; 16] = h[8..24].try_into().unwrap();
            let d: [u8; 16] = h[24..40].try_into().unwrap();
            let (src, dst) = (IpAddr::from(s), IpAddr::from(d));
            let msg = &f[ETH_HLEN + 40..];
            let acc = pseudo_sum(src, dst, 58, msg.len());
            assert_eq!(fold(sum16(msg, acc)), 0, "ICMPv6 checksum is wrong");
            (src, dst, msg)
        }
        other => panic!("unexpected ethertype {other:#x}"),
    };
    let mut inner = f[..ETH_HLEN].to_vec();
    inner[12..14].copy_from_slice(&ethertype.to_be_bytes());
    inner.extend(&msg[8..]);
    IcmpParsed {
        src,
        dst,
        typ: msg[0],
        code: msg[1],
        rest: u32::from_be_bytes(msg[4..8].try_into().unwrap()),
        inner: parse_checked(&inner),
    }
}
