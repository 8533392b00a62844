//! Translating a flow's packets between IPv4 and IPv6 (`NAT_F_FAMILY`): an
//! IPv4 connection whose host moved to a network where it has only IPv6
//! keeps its AF_INET sockets and virtual IPv4 endpoints, and is carried
//! over IPv6 between the two hosts' IPv6 addresses.
//!
//! The key's family says which way: an IPv4 packet (a socket's, at
//! egress) becomes IPv6, an IPv6 packet (the peer's, at ingress) becomes
//! IPv4. The header is rebuilt field by field as RFC 7915 (section 4.1,
//! section 5.1) maps them: traffic class and TOS, hop limit and TTL, the
//! payload length; no options, extension headers or fragments (counted and
//! dropped: sockets send none, and vnatd gives the flow a route MTU 20
//! bytes lower so that nothing needs fragmenting after the header grew).
//! The TCP or UDP checksum follows the pseudo-header's new addresses (its
//! length and protocol sum the same in both families); an IPv4 UDP
//! datagram without a checksum cannot go over IPv6 (RFC 8200 section 8.1)
//! and is dropped and counted.
//!
//! `bpf_skb_change_proto` (Linux 4.8) grows or shrinks the room for the
//! header by 20 bytes behind the link-layer header, moves a TCP GSO
//! packet's type to the other family and, since Linux 5.14, leaves its
//! segment size alone (each segment grows by 20 bytes on the wire, which
//! the route MTU allows for). The L4 header does not move, so a
//! CHECKSUM_PARTIAL packet's checksum start stays right.

use aya_ebpf::{helpers::bpf_csum_diff, maps::HashMap, programs::TcContext};
use vnat_common::{
    FlowKey, NatRewrite, AF_INET, PROTO_TCP, STAT_DROP_CSUM_FAILED, STAT_DROP_FAMILY_FAILED,
    STAT_DROP_FAMILY_UNTRANSLATABLE, STAT_DROP_REWRITE_FAILED, STAT_DROP_UDP_ZERO_CSUM,
    STAT_FAMILY_TRANSLATED,
};

use super::parse::{Parsed, IP6_HLEN, TCP_CSUM_OFF, UDP_CSUM_OFF};
use super::rewrite::{port, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, BPF_F_RECOMPUTE_CSUM};
use super::{finish, Dir, Drop, PASS};
use crate::maps::{count, VNAT_EGRESS_NAT, VNAT_INGRESS_NAT};

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
const IP4_HLEN: usize = 20;
/// Where the Ethernet header keeps the ethertype.
const ETH_TYPE_OFF: usize = 12;
/// IPv4 flags and fragment offset of a translated packet: "don't
/// fragment" (RFC 7915 section 5.1: the IPv6 packet was not fragmented,
/// and the route MTU is what PMTU discovery would have found).
const IP4_DF: u16 = 0x4000;

/// Translate `p` (the key's family) into its entry's family, ports and
/// addresses, and let it go on as `finish` says.
///
/// A function of its own (a BPF-to-BPF call) for the stack: see
/// `translate_flow`.
#[inline(never)]
pub(super) fn translate_family(ctx: &TcContext, p: &Parsed, dir: Dir) -> Result<i32, Drop> {
    let map: &HashMap<FlowKey, NatRewrite> = match dir {
        Dir::Egress => &VNAT_EGRESS_NAT,
        Dir::Ingress => &VNAT_INGRESS_NAT,
    };
    // SAFETY: as in `translate_flow`: the value is copied out at once. A
    // second lookup (the first was `translate_flow`'s), paid only by the
    // packets of flows carried in the other family.
    let Some(nat) = (unsafe { map.get(&p.key) }).copied() else {
        return Ok(PASS);
    };
    rebuild(ctx, p, &nat)?;
    count(STAT_FAMILY_TRANSLATED);
    finish(ctx, dir, &nat, p.l3)
}

/// The packet's new header, ports and checksums.
#[inline(always)]
fn rebuild(ctx: &TcContext, p: &Parsed, nat: &NatRewrite) -> Result<(), Drop> {
    let v4 = p.key.family == AF_INET;
    let hlen = if v4 { IP4_HLEN } else { IP6_HLEN };
    if p.frag.is_fragment || p.l4 != p.l3 + hlen {
        return Err(Drop(STAT_DROP_FAMILY_UNTRANSLATABLE));
    }
    let tcp = p.key.proto == PROTO_TCP;
    let (csum_off, mangled) = if tcp {
        (p.l4 + TCP_CSUM_OFF, 0)
    } else {
        (p.l4 + UDP_CSUM_OFF, BPF_F_MARK_MANGLED_0)
    };
    if !tcp && v4 {
        let csum: u16 = ctx
            .load(csum_off)
            .map_err(|_| Drop(STAT_DROP_FAMILY_UNTRANSLATABLE))?;
        if csum == 0 {
            return Err(Drop(STAT_DROP_UDP_ZERO_CSUM));
        }
    }
    // The fields the new header keeps: traffic class or TOS, hop limit or
    // TTL, and the length of what follows the header.
    let (tos, ttl, payload_len) = if v4 {
        let h: [u8; 12] = ctx
            .load(p.l3)
            .map_err(|_| Drop(STAT_DROP_FAMILY_UNTRANSLATABLE))?;
        let total = u16::from_be_bytes([h[2], h[3]]);
        (h[1], h[8], total.wrapping_sub(IP4_HLEN as u16))
    } else {
        let h: [u8; 8] = ctx
            .load(p.l3)
            .map_err(|_| Drop(STAT_DROP_FAMILY_UNTRANSLATABLE))?;
        (
            (h[0] << 4) | (h[1] >> 4),
            h[7],
            u16::from_be_bytes([h[4], h[5]]),
        )
    };
    // A length field of 0 (or an IPv4 one shorter than its header) is a
    // BIG TCP packet's (over 64 kB, its length in the skb alone, Linux
    // 6.3), and an IPv6 payload over 65,515 bytes makes no IPv4 packet:
    // the other header could not say their length.
    if payload_len == 0 || payload_len > u16::MAX - IP4_HLEN as u16 {
        return Err(Drop(STAT_DROP_FAMILY_UNTRANSLATABLE));
    }
    port(
        ctx,
        p.l4,
        csum_off,
        mangled,
        p.key.src_port_be,
        nat.src_port_be,
    )?;
    port(
        ctx,
        p.l4 + 2,
        csum_off,
        mangled,
        p.key.dst_port_be,
        nat.dst_port_be,
    )?;
    // The pseudo-header: old addresses out, new ones in (one difference,
    // applied as such: size 0 in the flags). Arrays built whole from their
    // values, never zeroed first (see `opaque_zero`).
    let mut four = if v4 {
        [p.key.src_addr_be[0], p.key.dst_addr_be[0]]
    } else {
        [nat.src_addr_be[0], nat.dst_addr_be[0]]
    };
    let (s6, d6) = if v4 {
        (&nat.src_addr_be, &nat.dst_addr_be)
    } else {
        (&p.key.src_addr_be, &p.key.dst_addr_be)
    };
    let mut six = [s6[0], s6[1], s6[2], s6[3], d6[0], d6[1], d6[2], d6[3]];
    // SAFETY: a helper call on two stack buffers of the sizes given
    // (multiples of 4, as the helper requires); the verifier checks them.
    let diff = unsafe {
        if v4 {
            bpf_csum_diff(four.as_mut_ptr(), 8, six.as_mut_ptr(), 32, 0)
        } else {
            bpf_csum_diff(six.as_mut_ptr(), 32, four.as_mut_ptr(), 8, 0)
        }
    };
    if diff < 0 {
        return Err(Drop(STAT_DROP_CSUM_FAILED));
    }
    ctx.l4_csum_replace(csum_off, 0, diff as u32 as u64, BPF_F_PSEUDO_HDR | mangled)
        .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
    let new_proto = if v4 { ETH_P_IPV6 } else { ETH_P_IP };
    ctx.change_proto(new_proto.to_be(), 0)
        .map_err(|_| Drop(STAT_DROP_FAMILY_FAILED))?;
    if v4 {
        // Version, traffic class, no flow label; payload length, next
        // header, hop limit; the addresses.
        let word1 = (u32::from(payload_len) << 16) | (u32::from(p.key.proto) << 8) | u32::from(ttl);
        let h: [u32; 10] = [
            (0x6000_0000 | (u32::from(tos) << 20)).to_be(),
            word1.to_be(),
            s6[0],
            s6[1],
            s6[2],
            s6[3],
            d6[0],
            d6[1],
            d6[2],
            d6[3],
        ];
        ctx.store(p.l3, &h, BPF_F_RECOMPUTE_CSUM)
            .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))?;
    } else {
        let total = payload_len.wrapping_add(IP4_HLEN as u16);
        let mut w: [u16; 10] = [
            0x4500 | u16::from(tos),
            total,
            0,
            IP4_DF,
            (u16::from(ttl) << 8) | u16::from(p.key.proto),
            0,
            0,
            0,
            0,
            0,
        ];
        let (s, d) = (u32::from_be(four[0]), u32::from_be(four[1]));
        w[6] = (s >> 16) as u16;
        w[7] = s as u16;
        w[8] = (d >> 16) as u16;
        w[9] = d as u16;
        let mut sum = 0u32;
        for x in w {
            sum += u32::from(x);
        }
        sum = (sum & 0xffff) + (sum >> 16);
        sum = (sum & 0xffff) + (sum >> 16);
        w[5] = !(sum as u16);
        for x in w.iter_mut() {
            *x = x.to_be();
        }
        ctx.store(p.l3, &w, BPF_F_RECOMPUTE_CSUM)
            .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))?;
    }
    if p.l3 != 0 {
        ctx.store(ETH_TYPE_OFF, &new_proto.to_be(), 0)
            .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))?;
    }
    Ok(())
}
