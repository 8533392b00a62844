//! Fragments of translated flows: the later fragments of a datagram carry
//! no ports, and follow the flow of their datagram's first fragment.

use aya_ebpf::{
    bindings::TC_ACT_SHOT,
    helpers::bpf_ktime_get_ns,
    macros::map,
    maps::{HashMap, LruHashMap},
    programs::TcContext,
};
use vnat_common::{
    FlowKey, NatRewrite, AF_INET, NAT_F_BUDGET, NAT_F_FAMILY, NAT_F_HOLD, STAT_DROP_CSUM_FAILED,
    STAT_DROP_FAMILY_UNTRANSLATABLE, STAT_DROP_HELD, STAT_DROP_REWRITE_FAILED,
    STAT_DROP_UNVALIDATED, STAT_FRAGMENT_COLLISION, STAT_FRAGMENT_TRANSLATED, STAT_PASS_FRAGMENT,
};

use super::parse::{
    Frag, Parsed, IP4_CSUM_OFF, IP4_DADDR_OFF, IP4_SADDR_OFF, IP6_DADDR_OFF, IP6_SADDR_OFF,
};
use super::rewrite::BPF_F_RECOMPUTE_CSUM;
use super::{finish, Dir, Drop, PASS};
use crate::maps::{count, VNAT_EGRESS_NAT, VNAT_INGRESS_NAT};

/// A fragmented datagram's flow, its identification, and when its first
/// fragment was seen.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct FragFlow {
    key: FlowKey,
    seen_ns: u64,
    id: u32,
    _pad: u32,
}

/// Longer than any reassembly waits (Linux: 30 s): an entry older than this
/// belongs to a datagram long gone, and its identification may be reused.
pub(super) const FRAG_TTL_NS: u64 = 30_000_000_000;

/// Entries one address pair (in one direction, one protocol) may hold: a
/// datagram's place is its identification modulo this. Senders number one
/// pair's datagrams in sequence (Linux: a counter per address pair and
/// protocol), so datagrams in flight at once take different places.
const FRAG_SLOTS: u32 = 16;

/// Where one fragmented datagram in one direction is remembered, as its
/// fragments carry it: addresses, protocol, and the identification's place
/// among the pair's [`FRAG_SLOTS`].
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct FragKey {
    src_addr_be: [u32; 4],
    dst_addr_be: [u32; 4],
    slot: u32,
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
///
/// Spoofed first fragments (issue 31): an address pair has at most
/// [`FRAG_SLOTS`] keys here, so no flood of identifications between one
/// pair (a peer's own flow, or a spoofer who knows one flow's ports) can
/// push another pair's entries out of the LRU; and a first fragment never
/// takes the place of another flow's entry still live, so one spoofed
/// with a real datagram's identification and other ports cannot send that
/// datagram's later fragments through its flow. Within one pair a spoofer
/// can still spoil its victims' datagrams (as overlapping fragments at the
/// receiver would anyway), not another pair's.
#[map]
pub(super) static VNAT_FRAGS: LruHashMap<FragKey, FragFlow> =
    LruHashMap::with_max_entries(16_384, 0);

#[inline(always)]
pub(super) fn frag_key(p: &Parsed, id: u32, dir: Dir) -> FragKey {
    FragKey {
        src_addr_be: p.key.src_addr_be,
        dst_addr_be: p.key.dst_addr_be,
        slot: id % FRAG_SLOTS,
        family: p.key.family,
        proto: p.key.proto,
        egress: u8::from(dir == Dir::Egress),
        _pad: 0,
    }
}

/// A fragment after the first of its datagram: translated (addresses only;
/// it has no L4 header) by the flow of the datagram's first fragment, if
/// that one was translated; passed as it is otherwise.
#[inline(never)]
pub(super) fn translate_fragment(
    ctx: &TcContext,
    p: &Parsed,
    f: Frag,
    dir: Dir,
) -> Result<i32, Drop> {
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
    if entry.id != f.id {
        // Another datagram of the pair in the same place: not this one's.
        count(STAT_PASS_FRAGMENT);
        return Ok(PASS);
    }
    if now.wrapping_sub(entry.seen_ns) > FRAG_TTL_NS
        || flow.src_addr_be != p.key.src_addr_be
        || flow.dst_addr_be != p.key.dst_addr_be
    {
        // Another datagram's, long gone (its identification reused).
        let _ = VNAT_FRAGS.remove(&fk);
        count(STAT_PASS_FRAGMENT);
        return Ok(PASS);
    }
    if !f.more() {
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
    if dir == Dir::Egress && nat.flags & NAT_F_HOLD != 0 && super::held(&nat) {
        count(STAT_DROP_HELD);
        return Ok(TC_ACT_SHOT);
    }
    if dir == Dir::Egress && nat.flags & NAT_F_BUDGET != 0 {
        // To an address not validated yet, whose budget counts whole
        // packets by their flow's ports, which a later fragment lacks:
        // dropped, so that a large datagram cannot carry more than the
        // budget there (the datagram is lost, as one over the budget is).
        count(STAT_DROP_UNVALIDATED);
        return Ok(TC_ACT_SHOT);
    }
    if nat.flags & NAT_F_FAMILY != 0 {
        // A datagram that was fragmented before its flow moved to the
        // other family: not translated between families (`family.rs`).
        count(STAT_DROP_FAMILY_UNTRANSLATABLE);
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

/// A translated first fragment with more to follow: remember its flow for
/// them, unless its place holds another flow's datagram still live.
#[inline(always)]
pub(super) fn remember_fragment(p: &Parsed, dir: Dir) {
    let fk = frag_key(p, p.frag.id, dir);
    // SAFETY: a helper without arguments or preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    // SAFETY: as in `translate_fragment`: the value is copied out at once.
    if let Some(old) = (unsafe { VNAT_FRAGS.get(&fk) }).copied() {
        // The key holds the addresses and protocol: the ports tell the flow.
        let other_flow =
            old.key.src_port_be != p.key.src_port_be || old.key.dst_port_be != p.key.dst_port_be;
        if other_flow && now.wrapping_sub(old.seen_ns) <= FRAG_TTL_NS {
            count(STAT_FRAGMENT_COLLISION);
            return;
        }
    }
    let flow = FragFlow {
        key: p.key,
        seen_ns: now,
        id: p.frag.id,
        _pad: 0,
    };
    let _ = VNAT_FRAGS.insert(&fk, &flow, 0);
}
