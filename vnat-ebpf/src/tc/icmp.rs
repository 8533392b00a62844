//! ICMP errors about translated flows (issue 31): translated like the
//! flow's own packets, so that path-MTU discovery keeps working after a
//! move and the kernel's errors do not name the old address.
//!
//! An error quotes the packet it is about (RFC 792; RFC 4443 section 2.4):
//! its IP header and the first bytes after it, the ports among them.
//!
//! * Coming in, an error about a packet we sent quotes it as it was on the
//!   wire: physical endpoints, from us to the peer. Reversed, that is the
//!   key of the flow's ingress entry, whose value holds the virtual
//!   endpoints the socket knows; the quote gets them (reversed again), the
//!   outer destination (our physical address) becomes our virtual one, and
//!   an outer source that is the peer itself becomes its virtual address.
//!   A router's address stays.
//! * Going out, the kernel's error about a packet it received translated
//!   quotes it as the stack saw it: virtual endpoints, from the peer to us.
//!   Reversed, that is the key of the flow's egress entry; the quote and the
//!   outer addresses get the physical endpoints the same way.
//!
//! Checksums (RFC 1624 incremental updates): the quoted IPv4 header's, the
//! quoted TCP or UDP checksum if the quote holds it (a UDP checksum of 0
//! stays 0), the ICMP checksum over all of that (and, for ICMPv6, over the
//! outer addresses in its pseudo-header), and the outer IPv4 header's.

use aya_ebpf::{maps::HashMap, programs::TcContext};
use vnat_common::{
    FlowKey, NatRewrite, AF_INET, NAT_F_FAMILY, PROTO_TCP, PROTO_UDP, STAT_DROP_CSUM_FAILED,
    STAT_DROP_ICMP_FAMILY, STAT_DROP_REWRITE_FAILED, STAT_ICMP_TRANSLATED,
};

use super::parse::{
    Parsed, IP4_CSUM_OFF, IP4_DADDR_OFF, IP4_FRAG_OFF, IP4_PROTO_OFF, IP4_SADDR_OFF, IP6_DADDR_OFF,
    IP6_NEXTHDR_OFF, IP6_SADDR_OFF, TCP_CSUM_OFF, UDP_CSUM_OFF,
};
use super::rewrite::addr6;
use super::{leave, natguard, Dir, Drop, PASS};
use crate::maps::{count, VNAT_EGRESS_NAT, VNAT_INGRESS_NAT};

/// ICMP types that quote a packet: destination unreachable (fragmentation
/// needed among them) and time exceeded (RFC 792); ICMPv6 destination
/// unreachable, packet too big, time exceeded (RFC 4443).
const ICMP_UNREACHABLE: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP6_UNREACHABLE: u8 = 1;
const ICMP6_PACKET_TOO_BIG: u8 = 2;
const ICMP6_TIME_EXCEEDED: u8 = 3;
/// Destination unreachable's "port unreachable" code (RFC 792; RFC 4443
/// section 3.1).
const ICMP_PORT_UNREACHABLE: u8 = 3;
const ICMP6_PORT_UNREACHABLE: u8 = 4;
/// The ICMP header: type, code, checksum, a word (unused, or the MTU).
const ICMP_CSUM_OFF: usize = 2;
const ICMP_HLEN: usize = 8;
const IP6_HLEN: usize = 40;

/// One's complement arithmetic on 16-bit words as they lie in the packet
/// (RFC 1071: the sum does not depend on byte order, so the words are
/// summed as loaded and the result stored the same way).
#[derive(Clone, Copy)]
struct Sum(u32);

impl Sum {
    /// A 16-bit word changed from `old` to `new`: add `~old + new`.
    #[inline(always)]
    fn word(self, old: u16, new: u16) -> Sum {
        Sum(self.0 + u32::from(!old) + u32::from(new))
    }

    /// A 32-bit word (two 16-bit ones) changed.
    #[inline(always)]
    fn dword(self, old: u32, new: u32) -> Sum {
        self.word(old as u16, new as u16)
            .word((old >> 16) as u16, (new >> 16) as u16)
    }

    /// The change folded to 16 bits.
    #[inline(always)]
    fn fold(self) -> u16 {
        let mut s = self.0;
        s = (s & 0xffff) + (s >> 16);
        s = (s & 0xffff) + (s >> 16);
        s as u16
    }

    /// A checksum field after the words it covers changed by this sum
    /// (RFC 1624, eqn. 3: HC' = ~(~HC + ~m + m')).
    #[inline(always)]
    fn apply(self, csum: u16) -> u16 {
        !Sum(u32::from(!csum) + u32::from(self.fold())).fold()
    }
}

/// An ICMP or ICMPv6 packet coming in while some flow is rebinding or
/// guarded: `Err` (dropped) if it is a peer's NAT saying "port
/// unreachable" itself about a UDP datagram we sent to it where a NAT
/// guard stands ([`natguard::guard_error`]). A NAT that forgot the flow's
/// mapping answers our datagrams to the old one so (as a Linux router
/// does), and the flow's connected socket would end with ECONNREFUSED.
///
/// A call of its own, before [`translate_error`] and not from it: inside
/// that one it took its frame from 288 to 312 bytes, and the call chain on
/// Linux 6.1 to the verifier's limit of 512 (see `tc::opaque_zero`).
#[inline(never)]
pub(super) fn guard_error(ctx: &TcContext, p: &Parsed) -> Result<(), Drop> {
    let v4 = p.key.family == AF_INET;
    let (Ok(typ), Ok(code)) = (ctx.load::<u8>(p.l4), ctx.load::<u8>(p.l4 + 1)) else {
        return Ok(());
    };
    let port_unreachable = if v4 {
        typ == ICMP_UNREACHABLE && code == ICMP_PORT_UNREACHABLE
    } else {
        typ == ICMP6_UNREACHABLE && code == ICMP6_PORT_UNREACHABLE
    };
    if !port_unreachable {
        return Ok(());
    }
    let Some(q) = quote(ctx, p.l4 + ICMP_HLEN, v4) else {
        return Ok(());
    };
    // From the address the datagram went to: the NAT itself, not a router
    // on the path.
    if q.proto != PROTO_UDP || p.key.src_addr_be != q.dst {
        return Ok(());
    }
    natguard::guard_error(p, q.src, q.dst, q.sport)
}

/// Where the quoted packet's fields are, and what they hold.
struct Quote {
    /// Offsets of the quoted IP header and of its TCP/UDP header.
    ip: usize,
    l4: usize,
    src: [u32; 4],
    dst: [u32; 4],
    sport: u16,
    dport: u16,
    proto: u8,
}

/// An ICMP or ICMPv6 packet (`p.l4` is its header): if it is an error
/// quoting a packet of a translated flow, translate it.
///
/// A function of its own (a BPF-to-BPF call), so that its stack is not
/// added to the translators' frame: the verifier refuses more than 512
/// bytes in one frame, and counts the deepest call chain's frames together
/// (each rounded up to 32 bytes before Linux 6.9 or so).
#[inline(never)]
pub(super) fn translate_error(ctx: &TcContext, p: &Parsed, dir: Dir) -> Result<i32, Drop> {
    let v4 = p.key.family == AF_INET;
    let Ok(typ) = ctx.load::<u8>(p.l4) else {
        return Ok(PASS);
    };
    let error = if v4 {
        typ == ICMP_UNREACHABLE || typ == ICMP_TIME_EXCEEDED
    } else {
        typ == ICMP6_UNREACHABLE || typ == ICMP6_PACKET_TOO_BIG || typ == ICMP6_TIME_EXCEEDED
    };
    if !error {
        return Ok(PASS);
    }
    let Some(q) = quote(ctx, p.l4 + ICMP_HLEN, v4) else {
        return Ok(PASS);
    };
    // The quoted packet reversed: the flow's packets in the error's own
    // direction, as the map for that direction keys them.
    let key = FlowKey {
        src_addr_be: q.dst,
        dst_addr_be: q.src,
        src_port_be: q.dport,
        dst_port_be: q.sport,
        family: p.key.family,
        proto: q.proto,
        _pad: [0; 2],
    };
    let map: &HashMap<FlowKey, NatRewrite> = match dir {
        Dir::Egress => &VNAT_EGRESS_NAT,
        Dir::Ingress => &VNAT_INGRESS_NAT,
    };
    // SAFETY: as in `try_translate`: the value is copied out at once.
    let Some(nat) = (unsafe { map.get(&key) }).copied() else {
        return Ok(PASS);
    };
    if nat.flags & NAT_F_FAMILY != 0 {
        // An error about a flow carried in the other family would have to
        // become an error of the other ICMP (RFC 7915 section 4.2, 5.2);
        // not done: its kernel could not match it to the flow's socket
        // as it is, and the flow's route MTU makes room for the header.
        return Err(Drop(STAT_DROP_ICMP_FAMILY));
    }
    rewrite_quote(ctx, p, &q, &nat, v4)?;
    // The outer addresses that are the flow's own: the destination (the
    // quoted packet's source), and the source if the error comes from the
    // flow's other end itself.
    let src = if p.key.src_addr_be == key.src_addr_be {
        nat.src_addr_be
    } else {
        p.key.src_addr_be
    };
    let dst = if p.key.dst_addr_be == key.dst_addr_be {
        nat.dst_addr_be
    } else {
        p.key.dst_addr_be
    };
    if v4 {
        outer4(
            ctx,
            p.l3 + IP4_SADDR_OFF,
            p.l3,
            p.key.src_addr_be[0],
            src[0],
        )?;
        outer4(
            ctx,
            p.l3 + IP4_DADDR_OFF,
            p.l3,
            p.key.dst_addr_be[0],
            dst[0],
        )?;
    } else {
        // ICMPv6's checksum covers the addresses (its pseudo-header).
        let csum = p.l4 + ICMP_CSUM_OFF;
        addr6(ctx, p.l3 + IP6_SADDR_OFF, csum, 0, &p.key.src_addr_be, &src)?;
        addr6(ctx, p.l3 + IP6_DADDR_OFF, csum, 0, &p.key.dst_addr_be, &dst)?;
    }
    count(STAT_ICMP_TRANSLATED);
    leave(ctx, dir, &nat, p.l3)
}

/// The packet an error quotes at `ip`: a TCP or UDP packet's addresses and
/// ports (a quoted fragment after the first, or an IPv6 quote with
/// extension headers, is not translated).
#[inline(always)]
fn quote(ctx: &TcContext, ip: usize, v4: bool) -> Option<Quote> {
    let mut src = [0u32; 4];
    let mut dst = [0u32; 4];
    let (proto, l4) = if v4 {
        let vihl: u8 = ctx.load(ip).ok()?;
        let ihl = usize::from(vihl & 0x0f);
        if vihl >> 4 != 4 || ihl < 5 {
            return None;
        }
        if u16::from_be(ctx.load::<u16>(ip + IP4_FRAG_OFF).ok()?) & 0x1fff != 0 {
            return None;
        }
        src[0] = ctx.load(ip + IP4_SADDR_OFF).ok()?;
        dst[0] = ctx.load(ip + IP4_DADDR_OFF).ok()?;
        (ctx.load::<u8>(ip + IP4_PROTO_OFF).ok()?, ip + ihl * 4)
    } else {
        src = ctx.load(ip + IP6_SADDR_OFF).ok()?;
        dst = ctx.load(ip + IP6_DADDR_OFF).ok()?;
        (ctx.load::<u8>(ip + IP6_NEXTHDR_OFF).ok()?, ip + IP6_HLEN)
    };
    if proto != PROTO_TCP && proto != PROTO_UDP {
        return None;
    }
    let ports = ctx.load::<[u16; 2]>(l4).ok()?;
    Some(Quote {
        ip,
        l4,
        src,
        dst,
        sport: ports[0],
        dport: ports[1],
        proto,
    })
}

/// Give the quoted packet the endpoints `nat` holds for its reverse (its
/// source is the flow's destination), with the quoted checksums and the
/// ICMP checksum updated.
#[inline(always)]
fn rewrite_quote(
    ctx: &TcContext,
    p: &Parsed,
    q: &Quote,
    nat: &NatRewrite,
    v4: bool,
) -> Result<(), Drop> {
    let (src, dst) = (nat.dst_addr_be, nat.src_addr_be);
    let (sport, dport) = (nat.dst_port_be, nat.src_port_be);
    let words = if v4 { 1 } else { 4 };
    let mut addrs = Sum(0);
    for i in 0..4 {
        if i < words {
            addrs = addrs.dword(q.src[i], src[i]).dword(q.dst[i], dst[i]);
        }
    }
    let ports = Sum(0).word(q.sport, sport).word(q.dport, dport);
    // What the ICMP checksum covers changes by the addresses, the ports,
    // and the two quoted checksums' own changes.
    let mut icmp = Sum(addrs.0 + ports.0);
    if v4 {
        let at = q.ip + IP4_CSUM_OFF;
        let old: u16 = ctx.load(at).map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))?;
        let new = addrs.apply(old);
        store(ctx, at, &new)?;
        icmp = icmp.word(old, new);
    }
    let l4_csum = q.l4
        + if q.proto == PROTO_TCP {
            TCP_CSUM_OFF
        } else {
            UDP_CSUM_OFF
        };
    // Not in a short quote (TCP's is 16 bytes in; RFC 792 quotes 8).
    if let Ok(old) = ctx.load::<u16>(l4_csum) {
        if !(v4 && q.proto == PROTO_UDP && old == 0) {
            let mut new = Sum(addrs.0 + ports.0).apply(old);
            if q.proto == PROTO_UDP && new == 0 {
                new = 0xffff;
            }
            store(ctx, l4_csum, &new)?;
            icmp = icmp.word(old, new);
        }
    }
    if v4 {
        store(ctx, q.ip + IP4_SADDR_OFF, &src[0])?;
        store(ctx, q.ip + IP4_DADDR_OFF, &dst[0])?;
    } else {
        store(ctx, q.ip + IP6_SADDR_OFF, &src)?;
        store(ctx, q.ip + IP6_DADDR_OFF, &dst)?;
    }
    store(ctx, q.l4, &sport)?;
    store(ctx, q.l4 + 2, &dport)?;
    let at = p.l4 + ICMP_CSUM_OFF;
    let old: u16 = ctx.load(at).map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
    store(ctx, at, &icmp.apply(old))
}

/// An outer IPv4 address changed, with the header checksum (ICMPv4's own
/// does not cover it).
#[inline(always)]
fn outer4(ctx: &TcContext, off: usize, l3: usize, old: u32, new: u32) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    ctx.l3_csum_replace(l3 + IP4_CSUM_OFF, old as u64, new as u64, 4)
        .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
    store(ctx, off, &new)
}

/// Bytes written in place. Every change is balanced by a checksum field
/// written beside it, inside what a receive checksum (CHECKSUM_COMPLETE)
/// covers, so that one stays right without `BPF_F_RECOMPUTE_CSUM`.
#[inline(always)]
fn store<T>(ctx: &TcContext, off: usize, v: &T) -> Result<(), Drop> {
    ctx.store(off, v, 0)
        .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))
}
