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
            seg.extend([0x50, 0x18]); // data offset 5, PSH|ACK
            seg.extend(502u16.to_be_bytes()); // window
            seg.extend([0, 0, 0, 0]); // csum, urg
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
                f.extend((l4.len() as u16).to_be_bytes());
                f.extend([self.proto, 64]);
                f.extend(s.octets());
                f.extend(d.octets());
            }
            _ => panic!("mixed families in a test packet"),
        }
        f.extend(l4);
        f
    }
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
            (IpAddr::from(s), IpAddr::from(d), h[6], &f[ETH_HLEN + 40..])
        }
        other => panic!("unexpected ethertype {other:#x}"),
    };
    let sport = u16::from_be_bytes([l4[0], l4[1]]);
    let dport = u16::from_be_bytes([l4[2], l4[3]]);
    let (payload_off, csum) = if proto == 6 {
        (20, [l4[16], l4[17]])
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
