//! Flows as VCMP and the datapath name them: a transport protocol and the
//! two virtual endpoints, and their kernel key (`vnat_common::FlowKey`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use serde::{Deserialize, Serialize};
use vnat_common::{FlowKey, AF_INET, AF_INET6, PROTO_TCP, PROTO_UDP};

/// Transport protocol of a flow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    Tcp,
    Udp,
}

impl Proto {
    pub fn number(self) -> u8 {
        match self {
            Proto::Tcp => PROTO_TCP,
            Proto::Udp => PROTO_UDP,
        }
    }
    pub fn from_number(n: u8) -> Option<Proto> {
        match n {
            PROTO_TCP => Some(Proto::Tcp),
            PROTO_UDP => Some(Proto::Udp),
            _ => None,
        }
    }
}

impl std::fmt::Display for Proto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        })
    }
}

/// A flow named by its virtual endpoints, from the local host's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct VirtualFlow {
    pub proto: Proto,
    pub local: SocketAddr,
    pub remote: SocketAddr,
}

/// `tcp 10.0.0.1:40000 -> 10.0.0.2:443`, for logs and spans.
impl std::fmt::Display for VirtualFlow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let proto = match self.proto {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
        };
        write!(f, "{proto} {} -> {}", self.local, self.remote)
    }
}

impl VirtualFlow {
    /// The stable connection id shown by `vnatctl ls`: derived from the
    /// virtual endpoints, so it survives daemon restarts and moves.
    pub fn id(&self) -> u64 {
        vnat_common_flow_id(&self.to_key())
    }

    /// The kernel key (`src` = local, `dst` = remote). Both endpoints must be
    /// of one family; a mixed pair is mapped with IPv4 addresses as
    /// IPv4-mapped IPv6, which never matches a packet.
    pub fn to_key(&self) -> FlowKey {
        flow_key(self.proto, self.local, self.remote)
    }

    pub fn from_key(key: &FlowKey) -> Option<VirtualFlow> {
        let proto = Proto::from_number(key.proto)?;
        let (local, remote) = key_endpoints(key)?;
        Some(VirtualFlow {
            proto,
            local,
            remote,
        })
    }
}

/// Build a [`FlowKey`] for a packet from `src` to `dst`.
pub fn flow_key(proto: Proto, src: SocketAddr, dst: SocketAddr) -> FlowKey {
    let (family, s, d) = match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => (AF_INET, v4_words(s), v4_words(d)),
        (s, d) => (AF_INET6, v6_words(to_v6(s)), v6_words(to_v6(d))),
    };
    FlowKey {
        src_addr_be: s,
        dst_addr_be: d,
        src_port_be: src.port().to_be(),
        dst_port_be: dst.port().to_be(),
        family,
        proto: proto.number(),
        _pad: [0; 2],
    }
}

/// The (src, dst) endpoints of a key, or `None` for an unknown family.
pub fn key_endpoints(key: &FlowKey) -> Option<(SocketAddr, SocketAddr)> {
    let ip = |w: &[u32; 4]| -> Option<IpAddr> {
        match key.family {
            AF_INET => Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(w[0])))),
            AF_INET6 => {
                let mut b = [0u8; 16];
                for (i, word) in w.iter().enumerate() {
                    b[i * 4..i * 4 + 4].copy_from_slice(&word.to_ne_bytes());
                }
                Some(IpAddr::V6(Ipv6Addr::from(b)))
            }
            _ => None,
        }
    };
    Some((
        SocketAddr::new(ip(&key.src_addr_be)?, u16::from_be(key.src_port_be)),
        SocketAddr::new(ip(&key.dst_addr_be)?, u16::from_be(key.dst_port_be)),
    ))
}

fn to_v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// IPv4 address as the kernel stores it: network order in word 0.
pub fn v4_words(ip: Ipv4Addr) -> [u32; 4] {
    [u32::from_ne_bytes(ip.octets()), 0, 0, 0]
}

/// IPv6 address as four network-order words.
pub fn v6_words(ip: Ipv6Addr) -> [u32; 4] {
    let o = ip.octets();
    let w = |i: usize| u32::from_ne_bytes([o[i], o[i + 1], o[i + 2], o[i + 3]]);
    [w(0), w(4), w(8), w(12)]
}

/// FNV-1a over the key's bytes, folded to 48 bits so ids stay short enough
/// to type.
fn vnat_common_flow_id(key: &FlowKey) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for w in key.src_addr_be.iter().chain(key.dst_addr_be.iter()) {
        feed(&w.to_ne_bytes());
    }
    feed(&key.src_port_be.to_ne_bytes());
    feed(&key.dst_port_be.to_ne_bytes());
    feed(&[key.family, key.proto]);
    (h ^ (h >> 48)) & 0xffff_ffff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_roundtrip_v4_v6() {
        for (l, r) in [
            ("198.18.1.2:40000", "198.18.3.2:5001"),
            ("[fd00:1::2]:40000", "[fd00:3::2]:22"),
        ] {
            let f = VirtualFlow {
                proto: Proto::Tcp,
                local: l.parse().unwrap(),
                remote: r.parse().unwrap(),
            };
            let k = f.to_key();
            assert_eq!(VirtualFlow::from_key(&k), Some(f));
            assert_eq!(k.reversed().reversed(), k);
        }
    }

    #[test]
    fn v4_key_is_network_order() {
        let k = flow_key(
            Proto::Udp,
            "1.2.3.4:258".parse().unwrap(),
            "5.6.7.8:1".parse().unwrap(),
        );
        assert_eq!(k.src_addr_be[0].to_ne_bytes(), [1, 2, 3, 4]);
        assert_eq!(k.src_port_be.to_ne_bytes(), [1, 2]);
        assert_eq!(k.src_addr_be[1..], [0, 0, 0]);
    }

    #[test]
    fn ids_differ_by_direction_and_are_48_bits() {
        let a = VirtualFlow {
            proto: Proto::Tcp,
            local: "10.0.0.1:1".parse().unwrap(),
            remote: "10.0.0.2:2".parse().unwrap(),
        };
        let b = VirtualFlow {
            proto: Proto::Tcp,
            local: a.remote,
            remote: a.local,
        };
        assert_ne!(a.id(), b.id());
        assert!(a.id() < (1 << 48));
        assert_eq!(a.id(), a.id());
    }
}
