//! tc translators: rewrite a moved flow's addresses and ports between its
//! virtual and physical endpoints (DESIGN.md §3).
//!
//! Egress: key = the packet as the local TCP/UDP stack sent it (virtual
//! endpoints), value = the physical endpoints to put on the wire.
//! Ingress: key = the packet as it arrived (physical endpoints), value = the
//! virtual endpoints the local stack expects.
//!
//! A packet that matches no entry costs one map lookup and is passed
//! untouched; nothing is counted for it. While nothing is translated at all
//! (`CFG_F_NAT_EMPTY`), a packet costs one load from the config array and
//! is not even parsed.

use aya_ebpf::{
    bindings::{TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_ktime_get_ns, bpf_redirect_neigh},
    macros::{classifier, map},
    maps::{HashMap, LruHashMap},
    programs::TcContext,
};
use vnat_common::{
    FlowKey, NatRewrite, RebindKey, AF_INET, AF_INET6, BIND_HEAD, BIND_LEN, BIND_MAGIC, NAT_F_HOLD,
    NAT_F_REDIRECT, PROTO_TCP, PROTO_UDP, REBIND_SLOTS, STAT_BIND_DIVERTED, STAT_DROP_BIND_DIRECT,
    STAT_DROP_CSUM_FAILED, STAT_DROP_HELD, STAT_DROP_REBINDING, STAT_DROP_REDIRECT_FAILED,
    STAT_DROP_REWRITE_FAILED, STAT_EGRESS_REDIRECTED, STAT_EGRESS_TRANSLATED,
    STAT_FRAGMENT_TRANSLATED, STAT_INGRESS_TRANSLATED, STAT_PASS_FRAGMENT, STAT_PASS_IPV6_EXTHDR,
    STAT_PASS_TRUNCATED, STAT_REBIND_LEARNED, STAT_REBIND_REFUSED,
};

use crate::maps::{
    bind_divert_port, count, nat_is_empty, rebinding, VNAT_CONNS, VNAT_EGRESS_NAT,
    VNAT_INGRESS_NAT, VNAT_REBIND,
};

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
/// Offsets inside the IPv4 header.
const IP4_ID_OFF: usize = 4;
const IP4_FRAG_OFF: usize = 6;
const IP4_PROTO_OFF: usize = 9;
const IP4_CSUM_OFF: usize = 10;
const IP4_SADDR_OFF: usize = 12;
const IP4_DADDR_OFF: usize = 16;
/// Offsets inside the IPv6 header.
const IP6_NEXTHDR_OFF: usize = 6;
const IP6_SADDR_OFF: usize = 8;
const IP6_DADDR_OFF: usize = 24;
const IP6_HLEN: usize = 40;
/// The IPv6 fragment extension header: its number and length.
const IP6_NEXTHDR_FRAGMENT: u8 = 44;
const IP6_FRAGHDR_LEN: usize = 8;
/// Offsets of the checksum inside the L4 header.
const TCP_CSUM_OFF: usize = 16;
const UDP_CSUM_OFF: usize = 6;

/// bpf_l4_csum_replace flags (include/uapi/linux/bpf.h).
const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

/// The verdict for a packet that goes on its way, translated or not:
/// "next" (TC_ACT_UNSPEC, TCX_NEXT), not "OK". OK would end the hook there,
/// so a program after vnat's on the same hook (Cilium's, a firewall's,
/// another clsact filter) would never see the packet; next lets it run,
/// and a hook with nothing after vnat passes the packet all the same.
const PASS: i32 = TC_ACT_UNSPEC;

/// Why a packet was not simply passed: every such verdict is counted under
/// one of these (the `STAT_*` index), never returned as a bare integer.
#[derive(Clone, Copy)]
pub struct Drop(u32);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    Egress,
    Ingress,
}

#[classifier]
pub fn vnat_tc_egress(ctx: TcContext) -> i32 {
    verdict(try_translate(&ctx, Dir::Egress, ETH_HLEN))
}

#[classifier]
pub fn vnat_tc_ingress(ctx: TcContext) -> i32 {
    verdict(try_translate(&ctx, Dir::Ingress, ETH_HLEN))
}

/// The translators of an interface without a link-layer header (tun,
/// wireguard: packets start with their IP header). vnatd attaches these
/// where the interface's type says so (`ARPHRD_NONE` and the like).
#[classifier]
pub fn vnat_tc_egress_l3(ctx: TcContext) -> i32 {
    verdict(try_translate(&ctx, Dir::Egress, 0))
}

#[classifier]
pub fn vnat_tc_ingress_l3(ctx: TcContext) -> i32 {
    verdict(try_translate(&ctx, Dir::Ingress, 0))
}

/// The one place a result becomes a verdict, so no path can compute a
/// verdict and then lose it.
#[inline(always)]
fn verdict(r: Result<i32, Drop>) -> i32 {
    match r {
        Ok(v) => v,
        Err(Drop(stat)) => {
            count(stat);
            TC_ACT_SHOT
        }
    }
}

/// Where the interesting fields of a parsed packet are.
struct Parsed {
    key: FlowKey,
    /// Offset of the L3 header and of the L4 header (0 for a fragment
    /// after the first, which has none: its key has no ports).
    l3: usize,
    l4: usize,
    /// A fragment: its IP identification, whether it is the first (the one
    /// with the L4 header), and whether more follow (not the last).
    frag: Frag,
}

/// A fragment's facts, `Frag::NONE` for a whole datagram.
///
/// Not an `Option<Frag>`: a `None` leaves the payload's bytes unwritten,
/// LLVM copies the whole value through the stack, and verifiers before
/// Linux 6.3 refuse a read of stack never written ("invalid read from
/// stack R10 off=-328 size=8" on 6.1). Every field here is always written.
#[derive(Clone, Copy)]
struct Frag {
    id: u32,
    is_fragment: bool,
    first: bool,
    more: bool,
}

impl Frag {
    const NONE: Frag = Frag {
        id: 0,
        is_fragment: false,
        first: false,
        more: false,
    };

    #[inline(always)]
    fn new(id: u32, first: bool, more: bool) -> Frag {
        Frag {
            id,
            is_fragment: true,
            first,
            more,
        }
    }
}

/// A fragmented datagram's flow, and when its first fragment was seen.
#[repr(C)]
#[derive(Clone, Copy)]
struct FragFlow {
    key: FlowKey,
    seen_ns: u64,
}

/// Longer than any reassembly waits (Linux: 30 s): an entry older than this
/// belongs to a datagram long gone, and its identification may be reused.
const FRAG_TTL_NS: u64 = 30_000_000_000;

/// bpf_skb_store_bytes: update skb->csum for what is written (an IPv6
/// address has no header checksum to absorb the change, and a receive
/// checksum the NIC computed would otherwise go stale).
const BPF_F_RECOMPUTE_CSUM: u64 = 1;

/// One fragmented datagram in one direction, as its fragments carry it:
/// addresses, protocol and IP identification.
#[repr(C)]
#[derive(Clone, Copy)]
struct FragKey {
    src_addr_be: [u32; 4],
    dst_addr_be: [u32; 4],
    id: u32,
    family: u8,
    proto: u8,
    egress: u8,
    _pad: u8,
}

/// The flows of fragmented datagrams whose first fragment was translated:
/// the later fragments, which carry no ports, are translated by their
/// datagram's flow; the last one removes the entry. Fragments that come
/// before the first are passed as they are (`pass_fragment`): their
/// datagram is lost, as with no translation of its first fragment the
/// receiver could not reassemble it anyway.
#[map]
static VNAT_FRAGS: LruHashMap<FragKey, FragFlow> = LruHashMap::with_max_entries(8192, 0);

#[inline(always)]
fn frag_key(p: &Parsed, id: u32, dir: Dir) -> FragKey {
    FragKey {
        src_addr_be: p.key.src_addr_be,
        dst_addr_be: p.key.dst_addr_be,
        id,
        family: p.key.family,
        proto: p.key.proto,
        egress: u8::from(dir == Dir::Egress),
        _pad: 0,
    }
}

/// `l2`: the length of the link-layer header before the IP header (14 for
/// Ethernet, 0 for an L3 interface).
#[inline(always)]
fn try_translate(ctx: &TcContext, dir: Dir, l2: usize) -> Result<i32, Drop> {
    let divert = match dir {
        Dir::Ingress => bind_divert_port(),
        Dir::Egress => None,
    };
    if divert.is_none() && nat_is_empty() {
        return Ok(PASS);
    }
    let Some(p) = parse(ctx, l2) else {
        return Ok(PASS);
    };
    if p.frag.is_fragment && !p.frag.first {
        return translate_fragment(ctx, &p, p.frag, dir);
    }
    if let Some(vcmp_port_be) = divert {
        if divert_bind(ctx, &p, vcmp_port_be)? {
            return Ok(PASS);
        }
        // Parsed only for the divert: with nothing translated, that is all
        // (no lookup per packet for a host that once diverted a BIND).
        if nat_is_empty() {
            return Ok(PASS);
        }
    }
    let map: &HashMap<FlowKey, NatRewrite> = match dir {
        Dir::Egress => &VNAT_EGRESS_NAT,
        Dir::Ingress => &VNAT_INGRESS_NAT,
    };
    // SAFETY: aya marks `get` unsafe because an entry can be deleted and its
    // memory reused for another key while we hold the reference. Both NAT
    // maps are BPF_F_NO_PREALLOC, the case aya documents as safe, and the
    // value is copied out at once. Since Linux 6.1 such a map may reuse a
    // freed element at once too: a packet racing the deletion of its own
    // entry could then be rewritten with another flow's value. The
    // reference stays inside the map's memory, which the verifier checked,
    // so nothing is read out of bounds.
    let Some(nat) = (unsafe { map.get(&p.key) }) else {
        if dir == Dir::Ingress && rebinding() {
            if let Some(nat) = learn(ctx, &p)? {
                rewrite(ctx, &p, &nat)?;
                count(STAT_INGRESS_TRANSLATED);
            }
        }
        return Ok(PASS);
    };
    let nat = *nat;
    if nat.flags & NAT_F_HOLD != 0 {
        // Egress: the socket sees a failed transmission and keeps the data.
        // Ingress: a container's replies while vnatd pins its NAT entry;
        // the peer sends them again.
        count(STAT_DROP_HELD);
        return Ok(TC_ACT_SHOT);
    }
    if p.frag.is_fragment && p.frag.more {
        let f = p.frag;
        // The later fragments follow this one's flow.
        let flow = FragFlow {
            key: p.key,
            // SAFETY: a helper without arguments or preconditions.
            seen_ns: unsafe { bpf_ktime_get_ns() },
        };
        let _ = VNAT_FRAGS.insert(&frag_key(&p, f.id, dir), &flow, 0);
    }
    rewrite(ctx, &p, &nat)?;
    finish(ctx, dir, &nat, p.l3)
}

/// What is left after a translated packet's rewrite: count it, and send an
/// egress packet whose destination changed out again with L2 resolved.
/// `l2`: the link-layer header's length (the packet's L3 offset).
#[inline(always)]
fn finish(ctx: &TcContext, dir: Dir, nat: &NatRewrite, l2: usize) -> Result<i32, Drop> {
    if dir == Dir::Ingress {
        count(STAT_INGRESS_TRANSLATED);
        return Ok(PASS);
    }
    count(STAT_EGRESS_TRANSLATED);
    if nat.flags & NAT_F_REDIRECT != 0 && l2 == 0 {
        // An interface without a link layer has no neighbour to resolve:
        // leaving through it is all a redirect to it would do. To another
        // interface the packet would need an Ethernet header it does not
        // have (bpf_redirect_neigh drops such a packet without a word),
        // so it is refused and counted instead.
        // SAFETY: reading a field of the context the verifier checked.
        let here = unsafe { (*ctx.skb.skb).ifindex };
        if nat.redirect_ifindex == here {
            return Ok(PASS);
        }
        return Err(Drop(STAT_DROP_REDIRECT_FAILED));
    }
    if nat.flags & NAT_F_REDIRECT != 0 {
        // tc egress runs after neighbour resolution for the *old*
        // destination; send the packet out again with L2 resolved for the new
        // one (bpf_redirect_neigh does the FIB lookup on the rewritten daddr).
        // SAFETY: a helper call; the verifier checks its arguments at load
        // time. A null `params` with length 0 is the documented way to let
        // the helper do the FIB lookup itself.
        let r = unsafe { bpf_redirect_neigh(nat.redirect_ifindex, core::ptr::null_mut(), 0, 0) };
        if r as i32 != TC_ACT_REDIRECT {
            return Err(Drop(STAT_DROP_REDIRECT_FAILED));
        }
        count(STAT_EGRESS_REDIRECTED);
        return Ok(TC_ACT_REDIRECT);
    }
    Ok(PASS)
}

/// A fragment after the first of its datagram: translated (addresses only;
/// it has no L4 header) by the flow of the datagram's first fragment, if
/// that one was translated; passed as it is otherwise.
#[inline(always)]
fn translate_fragment(ctx: &TcContext, p: &Parsed, f: Frag, dir: Dir) -> Result<i32, Drop> {
    let fk = frag_key(p, f.id, dir);
    // SAFETY: an LRU map's element can be reused for another key while we
    // hold the reference: the value is copied out at once, and a reused
    // element only sends this fragment through another flow's lookup,
    // whose addresses must then match the fragment's for it to be used.
    let Some(entry) = (unsafe { VNAT_FRAGS.get(&fk) }).copied() else {
        count(STAT_PASS_FRAGMENT);
        return Ok(PASS);
    };
    // SAFETY: a helper without arguments or preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let flow = entry.key;
    if now.wrapping_sub(entry.seen_ns) > FRAG_TTL_NS
        || flow.src_addr_be != p.key.src_addr_be
        || flow.dst_addr_be != p.key.dst_addr_be
    {
        // Another datagram's, long gone (its identification reused).
        let _ = VNAT_FRAGS.remove(&fk);
        count(STAT_PASS_FRAGMENT);
        return Ok(PASS);
    }
    if !f.more {
        // The last fragment: the datagram is complete.
        let _ = VNAT_FRAGS.remove(&fk);
    }
    let map: &HashMap<FlowKey, NatRewrite> = match dir {
        Dir::Egress => &VNAT_EGRESS_NAT,
        Dir::Ingress => &VNAT_INGRESS_NAT,
    };
    // SAFETY: as in `try_translate`.
    let Some(nat) = (unsafe { map.get(&flow) }).copied() else {
        count(STAT_PASS_FRAGMENT);
        return Ok(PASS);
    };
    if dir == Dir::Egress && nat.flags & NAT_F_HOLD != 0 {
        count(STAT_DROP_HELD);
        return Ok(TC_ACT_SHOT);
    }
    if p.key.family == AF_INET {
        for (off, old, new) in [
            (IP4_SADDR_OFF, p.key.src_addr_be[0], nat.src_addr_be[0]),
            (IP4_DADDR_OFF, p.key.dst_addr_be[0], nat.dst_addr_be[0]),
        ] {
            if old != new {
                ctx.l3_csum_replace(p.l3 + IP4_CSUM_OFF, old as u64, new as u64, 4)
                    .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
                ctx.store(p.l3 + off, &new, 0)
                    .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))?;
            }
        }
    } else {
        ctx.store(p.l3 + IP6_SADDR_OFF, &nat.src_addr_be, BPF_F_RECOMPUTE_CSUM)
            .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))?;
        ctx.store(p.l3 + IP6_DADDR_OFF, &nat.dst_addr_be, BPF_F_RECOMPUTE_CSUM)
            .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))?;
    }
    count(STAT_FRAGMENT_TRANSLATED);
    finish(ctx, dir, &nat, p.l3)
}

/// A packet with no translation, coming in: if it is the first of a
/// rebinding flow (its peer moved behind a NAT whose port we cannot know
/// until the peer's packets cross it), install the flow's translations for
/// the port it came from and return the ingress one. The key is the NAT's
/// public address from the peer's authenticated update and our end; a TCP
/// packet must also carry sequence and acknowledgment numbers in the
/// flow's window, so an off-path host that cannot inject into the TCP
/// connection cannot steer it either.
///
/// A UDP datagram proves nothing (anyone behind the same NAT can send one
/// to the port), so a UDP flow learns its port only from its authenticated
/// BIND, through vnatd; meanwhile a datagram from that address to that
/// port that belongs to no recorded flow is dropped, so that no
/// application takes it for a new peer's.
#[inline(always)]
fn learn(ctx: &TcContext, p: &Parsed) -> Result<Option<NatRewrite>, Drop> {
    if p.key.proto == PROTO_UDP {
        return udp_rebinding(p);
    }
    Ok(learn_tcp(ctx, p))
}

/// See [`learn`]: a UDP datagram for a rebinding flow's port is dropped
/// unless a recorded flow owns it.
#[inline(always)]
fn udp_rebinding(p: &Parsed) -> Result<Option<NatRewrite>, Drop> {
    let mut rk = rebind_key(p);
    let mut rebinding = false;
    for slot in 0..REBIND_SLOTS {
        rk.slot = slot;
        if VNAT_REBIND.get_ptr(&rk).is_some() {
            rebinding = true;
            break;
        }
    }
    if !rebinding {
        return Ok(None);
    }
    // Recorded flows are keyed as the local stack names them: our end
    // first.
    let own = FlowKey {
        src_addr_be: p.key.dst_addr_be,
        dst_addr_be: p.key.src_addr_be,
        src_port_be: p.key.dst_port_be,
        dst_port_be: p.key.src_port_be,
        family: p.key.family,
        proto: p.key.proto,
        _pad: [0; 2],
    };
    if VNAT_CONNS.get_ptr(&own).is_some() {
        return Ok(None);
    }
    // A socket bound to the wildcard address is recorded under it.
    let wildcard = FlowKey {
        src_addr_be: [opaque_zero(), opaque_zero(), opaque_zero(), opaque_zero()],
        ..own
    };
    if VNAT_CONNS.get_ptr(&wildcard).is_some() {
        return Ok(None);
    }
    Err(Drop(STAT_DROP_REBINDING))
}

#[inline(always)]
fn learn_tcp(ctx: &TcContext, p: &Parsed) -> Option<NatRewrite> {
    let mut rk = rebind_key(p);
    let seq = u32::from_be(ctx.load::<u32>(p.l4 + 4).ok()?);
    let ack = u32::from_be(ctx.load::<u32>(p.l4 + 8).ok()?);
    for slot in 0..REBIND_SLOTS {
        rk.slot = slot;
        // SAFETY: as for the NAT maps in `try_translate`: a
        // BPF_F_NO_PREALLOC map, the value copied out at once.
        let Some(v) = (unsafe { VNAT_REBIND.get(&rk) }) else {
            continue;
        };
        let v = *v;
        if seq.wrapping_sub(v.seq_lo) >= v.seq_span || ack.wrapping_sub(v.ack_lo) >= v.ack_span {
            count(STAT_REBIND_REFUSED);
            continue;
        }
        let ingress = NatRewrite {
            src_addr_be: v.virt_remote_addr_be,
            dst_addr_be: v.virt_local_addr_be,
            src_port_be: v.virt_remote_port_be,
            dst_port_be: v.virt_local_port_be,
            redirect_ifindex: 0,
            flags: 0,
            _pad: 0,
        };
        let egress_key = FlowKey {
            src_addr_be: v.virt_local_addr_be,
            dst_addr_be: v.virt_remote_addr_be,
            src_port_be: v.virt_local_port_be,
            dst_port_be: v.virt_remote_port_be,
            family: p.key.family,
            proto: p.key.proto,
            _pad: [0; 2],
        };
        let egress = NatRewrite {
            src_addr_be: p.key.dst_addr_be,
            dst_addr_be: p.key.src_addr_be,
            src_port_be: p.key.dst_port_be,
            dst_port_be: p.key.src_port_be,
            redirect_ifindex: v.redirect_ifindex,
            flags: v.flags,
            _pad: 0,
        };
        if VNAT_INGRESS_NAT.insert(&p.key, &ingress, 0).is_err()
            || VNAT_EGRESS_NAT.insert(&egress_key, &egress, 0).is_err()
        {
            let _ = VNAT_INGRESS_NAT.remove(&p.key);
            return None;
        }
        let _ = VNAT_REBIND.remove(&rk);
        count(STAT_REBIND_LEARNED);
        return Some(ingress);
    }
    None
}

/// An in-band BIND (see `vnat_common::BIND_LEN`) coming in on a UDP flow:
/// send it to vnatd's VCMP port instead of the flow's, with the flow's port
/// written into the datagram (bytes 2..4, zero as sent) so that vnatd knows
/// which of its flows the BIND names. Only the exact length, head and magic
/// qualify, so an application datagram is never taken by mistake; a forged
/// BIND reaches vnatd, which checks its tag like any VCMP datagram.
#[inline(always)]
fn divert_bind(ctx: &TcContext, p: &Parsed, vcmp_port_be: u16) -> Result<bool, Drop> {
    if p.key.proto != PROTO_UDP {
        return Ok(false);
    }
    let Ok(udp_len) = ctx.load::<u16>(p.l4 + 4) else {
        return Ok(false);
    };
    if usize::from(u16::from_be(udp_len)) != 8 + BIND_LEN {
        return Ok(false);
    }
    let Ok(head) = ctx.load::<[u8; 8]>(p.l4 + 8) else {
        return Ok(false);
    };
    if head[0] != BIND_HEAD[0] || head[1] != BIND_HEAD[1] || head[4..8] != BIND_MAGIC {
        return Ok(false);
    }
    if p.key.dst_port_be == vcmp_port_be {
        // Sent to the VCMP port directly, whatever its bytes 2..4 say:
        // the flow port in a BIND that reaches vnatd is the divert's, never
        // the sender's word.
        return Err(Drop(STAT_DROP_BIND_DIRECT));
    }
    if head[2] != 0 || head[3] != 0 {
        return Ok(false);
    }
    let (csum_off, mangled) = (p.l4 + UDP_CSUM_OFF, BPF_F_MARK_MANGLED_0);
    // Payload byte 2 is at an even offset from the UDP header, so the
    // 16-bit checksum update lines up with the words it sums.
    port(ctx, p.l4 + 8 + 2, csum_off, mangled, 0, p.key.dst_port_be)?;
    port(
        ctx,
        p.l4 + 2,
        csum_off,
        mangled,
        p.key.dst_port_be,
        vcmp_port_be,
    )?;
    count(STAT_BIND_DIVERTED);
    Ok(true)
}

/// The rebind map's key for an incoming packet (slot 0): who it comes
/// from and where it goes, not the port it comes from (the unknown).
#[inline(always)]
fn rebind_key(p: &Parsed) -> RebindKey {
    RebindKey {
        src_addr_be: p.key.src_addr_be,
        dst_addr_be: p.key.dst_addr_be,
        dst_port_be: p.key.dst_port_be,
        family: p.key.family,
        proto: p.key.proto,
        slot: 0,
        _pad: [opaque_zero(), opaque_zero(), opaque_zero()],
    }
}

/// A zero the compiler cannot see through.
///
/// LLVM turns zero bytes it cannot merge into aligned stores (3 bytes of
/// padding at an odd offset, an address array in a struct update) into a
/// call to `memset`, a BPF function of its own. Before Linux 6.9 or so the
/// verifier rounds every frame of a call chain up to 32 bytes (a frameless
/// memset too) and refuses more than 512 in all: the translators' frame of
/// 488 bytes plus that call made 544 ("combined stack size of 2 calls is
/// 544. Too large" on 6.1). Zeros written from a value LLVM cannot know
/// are plain stores (one read each: a repeated value is a memset again),
/// and the translators call no function at all.
#[inline(always)]
fn opaque_zero<T: Copy + Default>() -> T {
    let zero = T::default();
    // SAFETY: a read of a live, initialized local through a reference to it.
    unsafe { core::ptr::read_volatile(&zero) }
}

/// Parse Ethernet (`l2` = 14) or nothing (`l2` = 0, an L3 interface, where
/// the skb's protocol says which IP version follows) + IPv4/IPv6 + TCP/UDP
/// ports. `None` means "not ours".
#[inline(always)]
fn parse(ctx: &TcContext, l2: usize) -> Option<Parsed> {
    let proto = if l2 == 0 {
        // skb->protocol holds the ethertype in network byte order.
        u16::from_be(ctx.skb.protocol() as u16)
    } else {
        u16::from_be(ctx.load::<u16>(12).ok()?)
    };
    let l3 = l2;
    let mut key = FlowKey::default();
    let mut frag = Frag::NONE;
    let l4 = match proto {
        ETH_P_IP => {
            let vihl: u8 = ctx.load(l3).ok()?;
            // Honour IHL: options move the L4 header.
            let ihl = (vihl & 0x0f) as usize;
            if vihl >> 4 != 4 || ihl < 5 {
                count(STAT_PASS_TRUNCATED);
                return None;
            }
            key.proto = ctx.load(l3 + IP4_PROTO_OFF).ok()?;
            if key.proto != PROTO_TCP && key.proto != PROTO_UDP {
                return None;
            }
            let frag_field = u16::from_be(ctx.load::<u16>(l3 + IP4_FRAG_OFF).ok()?);
            key.family = AF_INET;
            key.src_addr_be[0] = ctx.load(l3 + IP4_SADDR_OFF).ok()?;
            key.dst_addr_be[0] = ctx.load(l3 + IP4_DADDR_OFF).ok()?;
            // Offset and "more fragments": either makes it a fragment.
            if frag_field & 0x3fff != 0 {
                let id = u32::from(u16::from_be(ctx.load::<u16>(l3 + IP4_ID_OFF).ok()?));
                let more = frag_field & 0x2000 != 0;
                if frag_field & 0x1fff != 0 {
                    // Not the first: no ports, matched by its datagram.
                    return Some(later_fragment(key, l3, id, more));
                }
                frag = Frag::new(id, true, more);
            }
            l3 + ihl * 4
        }
        ETH_P_IPV6 => {
            key.proto = ctx.load(l3 + IP6_NEXTHDR_OFF).ok()?;
            let mut l4 = l3 + IP6_HLEN;
            if key.proto == IP6_NEXTHDR_FRAGMENT {
                // A fragment header right after the fixed header (the only
                // place a sender puts it on a datagram without other
                // extension headers): next header, offset and M flag, id.
                let fh = l3 + IP6_HLEN;
                key.proto = ctx.load(fh).ok()?;
                if key.proto != PROTO_TCP && key.proto != PROTO_UDP {
                    return None;
                }
                let offset_m = u16::from_be(ctx.load::<u16>(fh + 2).ok()?);
                let id = u32::from_be(ctx.load::<u32>(fh + 4).ok()?);
                key.family = AF_INET6;
                key.src_addr_be = ctx.load(l3 + IP6_SADDR_OFF).ok()?;
                key.dst_addr_be = ctx.load(l3 + IP6_DADDR_OFF).ok()?;
                let more = offset_m & 1 != 0;
                if offset_m >> 3 != 0 {
                    return Some(later_fragment(key, l3, id, more));
                }
                frag = Frag::new(id, true, more);
                l4 = fh + IP6_FRAGHDR_LEN;
            }
            if key.proto != PROTO_TCP && key.proto != PROTO_UDP {
                // Extension headers (or ICMPv6, ...): not a flow we translate.
                if is_ipv6_exthdr(key.proto) {
                    count(STAT_PASS_IPV6_EXTHDR);
                }
                return None;
            }
            key.family = AF_INET6;
            key.src_addr_be = ctx.load(l3 + IP6_SADDR_OFF).ok()?;
            key.dst_addr_be = ctx.load(l3 + IP6_DADDR_OFF).ok()?;
            l4
        }
        _ => return None,
    };
    let Ok(ports) = ctx.load::<[u16; 2]>(l4) else {
        count(STAT_PASS_TRUNCATED);
        return None;
    };
    key.src_port_be = ports[0];
    key.dst_port_be = ports[1];
    Some(Parsed { key, l3, l4, frag })
}

/// A fragment after the first of its datagram: no L4 header, so no ports;
/// it is matched by its datagram (`translate_fragment`).
#[inline(always)]
fn later_fragment(key: FlowKey, l3: usize, id: u32, more: bool) -> Parsed {
    Parsed {
        key,
        l3,
        l4: 0,
        frag: Frag::new(id, false, more),
    }
}

#[inline(always)]
fn is_ipv6_exthdr(nh: u8) -> bool {
    matches!(nh, 0 | 43 | 44 | 50 | 51 | 60 | 135 | 139 | 140)
}

/// Rewrite addresses and ports with incremental checksum updates.
#[inline(always)]
fn rewrite(ctx: &TcContext, p: &Parsed, nat: &NatRewrite) -> Result<(), Drop> {
    let (csum_off, mangled) = if p.key.proto == PROTO_TCP {
        (p.l4 + TCP_CSUM_OFF, 0)
    } else {
        // UDPv4 may carry a zero ("no") checksum: MARK_MANGLED_0 leaves it
        // zero, and turns a computed 0 into 0xffff.
        (p.l4 + UDP_CSUM_OFF, BPF_F_MARK_MANGLED_0)
    };
    if p.key.family == AF_INET {
        let (sa, da) = (p.l3 + IP4_SADDR_OFF, p.l3 + IP4_DADDR_OFF);
        addr4(
            ctx,
            p.l3,
            sa,
            csum_off,
            mangled,
            p.key.src_addr_be[0],
            nat.src_addr_be[0],
        )?;
        addr4(
            ctx,
            p.l3,
            da,
            csum_off,
            mangled,
            p.key.dst_addr_be[0],
            nat.dst_addr_be[0],
        )?;
    } else {
        addr6(
            ctx,
            p.l3 + IP6_SADDR_OFF,
            csum_off,
            mangled,
            &p.key.src_addr_be,
            &nat.src_addr_be,
        )?;
        addr6(
            ctx,
            p.l3 + IP6_DADDR_OFF,
            csum_off,
            mangled,
            &p.key.dst_addr_be,
            &nat.dst_addr_be,
        )?;
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
    Ok(())
}

#[inline(always)]
fn addr4(
    ctx: &TcContext,
    l3: usize,
    off: usize,
    csum_off: usize,
    mangled: u64,
    old: u32,
    new: u32,
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    ctx.l4_csum_replace(
        csum_off,
        old as u64,
        new as u64,
        BPF_F_PSEUDO_HDR | mangled | 4,
    )
    .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
    ctx.l3_csum_replace(l3 + IP4_CSUM_OFF, old as u64, new as u64, 4)
        .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
    ctx.store(off, &new, 0)
        .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))
}

#[inline(always)]
fn addr6(
    ctx: &TcContext,
    off: usize,
    csum_off: usize,
    mangled: u64,
    old: &[u32; 4],
    new: &[u32; 4],
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    // IPv6 has no header checksum; the address is part of the L4
    // pseudo-header. The helper takes 2 or 4 bytes at a time, so update word
    // by word.
    for i in 0..4 {
        if old[i] != new[i] {
            ctx.l4_csum_replace(
                csum_off,
                old[i] as u64,
                new[i] as u64,
                BPF_F_PSEUDO_HDR | mangled | 4,
            )
            .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
        }
    }
    ctx.store(off, new, 0)
        .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))
}

#[inline(always)]
fn port(
    ctx: &TcContext,
    off: usize,
    csum_off: usize,
    mangled: u64,
    old: u16,
    new: u16,
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    ctx.l4_csum_replace(csum_off, old as u64, new as u64, mangled | 2)
        .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
    ctx.store(off, &new, 0)
        .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))
}
