//! The pair of NAT entries that translate one flow, built from a
//! [`Translation`] and read back into one (the pinned egress map is the
//! record of every installed translation).

use vnat_common::{
    FlowKey, NatRewrite, AF_INET, AF_INET6, NAT_F_BUDGET, NAT_F_FAMILY, NAT_F_LO_ADDR_OURS,
};

use crate::datapath::{flow_key, key_endpoints, Translation, VirtualFlow};

/// Forward (egress) and reverse (ingress) entries of one translation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NatPair {
    pub egress_key: FlowKey,
    pub egress: NatRewrite,
    pub ingress_key: FlowKey,
    pub ingress: NatRewrite,
}

fn rewrite(
    src: std::net::SocketAddr,
    dst: std::net::SocketAddr,
    ifindex: u32,
    flags: u32,
) -> NatRewrite {
    let k = flow_key(crate::datapath::Proto::Tcp, src, dst);
    NatRewrite {
        src_addr_be: k.src_addr_be,
        dst_addr_be: k.dst_addr_be,
        src_port_be: k.src_port_be,
        dst_port_be: k.dst_port_be,
        redirect_ifindex: ifindex,
        flags,
        held_until: 0,
    }
}

/// Egress: virtual (as the local stack sends) to physical (on the wire).
/// Ingress: physical (as received) to virtual (as the local stack expects).
///
/// A translation whose physical endpoints are of the other family than its
/// virtual ones (an IPv4 connection carried over IPv6) gets
/// `NAT_F_FAMILY` on both entries: the packets change IP version.
pub fn pair_for(t: &Translation, ifindex: u32, flags: u32) -> NatPair {
    let f = &t.flow;
    let flags = if t.physical_local.is_ipv4() != f.local.is_ipv4() {
        flags | NAT_F_FAMILY
    } else {
        flags
    };
    NatPair {
        egress_key: flow_key(f.proto, f.local, f.remote),
        egress: rewrite(t.physical_local, t.physical_remote, ifindex, flags),
        ingress_key: flow_key(f.proto, t.physical_remote, t.physical_local),
        // The reverse entry carries the ownership bit too, so a move that was
        // only prepared still knows what it added; and the budget bit, so
        // that what comes from an unvalidated address adds to what may be
        // sent there.
        ingress: rewrite(
            f.remote,
            f.local,
            ifindex,
            flags & (NAT_F_LO_ADDR_OURS | NAT_F_FAMILY | NAT_F_BUDGET),
        ),
    }
}

/// The family of the addresses in `v`, the value of `key`: the key's own,
/// or the other one for a flow carried in the other family
/// (`NAT_F_FAMILY`).
pub fn value_family(key: &FlowKey, v: &NatRewrite) -> u8 {
    match (v.flags & NAT_F_FAMILY != 0, key.family) {
        (false, f) => f,
        (true, AF_INET) => AF_INET6,
        (true, _) => AF_INET,
    }
}

/// The translation an egress entry describes.
pub fn translation_of(key: &FlowKey, v: &NatRewrite) -> Option<Translation> {
    let flow = VirtualFlow::from_key(key)?;
    let family = value_family(key, v);
    let phys = FlowKey {
        src_addr_be: v.src_addr_be,
        dst_addr_be: v.dst_addr_be,
        src_port_be: v.src_port_be,
        dst_port_be: v.dst_port_be,
        family,
        ..*key
    };
    let (physical_local, physical_remote) = key_endpoints(&phys)?;
    Some(Translation {
        flow,
        physical_local,
        physical_remote,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::Proto;

    #[test]
    fn a_connection_carried_in_the_other_family_reads_back() {
        let t = Translation {
            flow: VirtualFlow {
                proto: Proto::Tcp,
                local: "198.18.1.2:40000".parse().unwrap(),
                remote: "198.18.3.2:5001".parse().unwrap(),
            },
            physical_local: "[fd00:5e:2::2]:40000".parse().unwrap(),
            physical_remote: "[fd00:5e:3::2]:5001".parse().unwrap(),
        };
        let p = pair_for(&t, 3, 0);
        assert_eq!(p.egress.flags & NAT_F_FAMILY, NAT_F_FAMILY);
        assert_eq!(p.ingress.flags & NAT_F_FAMILY, NAT_F_FAMILY);
        assert_eq!(p.egress_key.family, AF_INET);
        assert_eq!(p.ingress_key.family, AF_INET6);
        assert_eq!(translation_of(&p.egress_key, &p.egress), Some(t));
        let same = Translation {
            physical_local: "198.18.2.2:40000".parse().unwrap(),
            physical_remote: "198.18.3.2:5001".parse().unwrap(),
            ..t
        };
        assert_eq!(pair_for(&same, 3, 0).egress.flags & NAT_F_FAMILY, 0);
    }

    #[test]
    fn pair_is_symmetric_and_reads_back() {
        let t = Translation {
            flow: VirtualFlow {
                proto: Proto::Udp,
                local: "198.18.1.2:4000".parse().unwrap(),
                remote: "198.18.3.2:53".parse().unwrap(),
            },
            physical_local: "198.18.2.2:4001".parse().unwrap(),
            physical_remote: "198.18.3.2:53".parse().unwrap(),
        };
        let p = pair_for(&t, 7, 0);
        // A packet rewritten by egress, seen from the peer and sent back, is
        // exactly the ingress key.
        let on_wire = FlowKey {
            src_addr_be: p.egress.src_addr_be,
            dst_addr_be: p.egress.dst_addr_be,
            src_port_be: p.egress.src_port_be,
            dst_port_be: p.egress.dst_port_be,
            ..p.egress_key
        };
        assert_eq!(on_wire.reversed(), p.ingress_key);
        let restored = FlowKey {
            src_addr_be: p.ingress.src_addr_be,
            dst_addr_be: p.ingress.dst_addr_be,
            src_port_be: p.ingress.src_port_be,
            dst_port_be: p.ingress.dst_port_be,
            ..p.ingress_key
        };
        assert_eq!(restored, p.egress_key.reversed());
        assert_eq!(translation_of(&p.egress_key, &p.egress), Some(t));
        assert_eq!(p.egress_key.proto, vnat_common::PROTO_UDP);
    }
}
