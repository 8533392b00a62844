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

mod family;
mod frag;
mod icmp;
mod natguard;
mod parse;
mod rebind;
mod rewrite;

use aya_ebpf::{
    bindings::{TC_ACT_REDIRECT, TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_ktime_get_boot_ns, bpf_redirect, bpf_redirect_neigh},
    macros::classifier,
    maps::HashMap,
    programs::TcContext,
};
use vnat_common::{
    hold_in_force, FlowKey, NatRewrite, AF_INET, AF_INET6, AMPLIFICATION_FACTOR, NAT_F_BUDGET,
    NAT_F_FALLBACK, NAT_F_FAMILY, NAT_F_HOLD, NAT_F_REDIRECT, STAT_DROP_HELD,
    STAT_DROP_IPV6_EXTHDR, STAT_DROP_REDIRECT_FAILED, STAT_DROP_UNVALIDATED,
    STAT_EGRESS_REDIRECTED, STAT_EGRESS_TRANSLATED, STAT_GONE_DISCARDED, STAT_HOLD_EXPIRED,
    STAT_INGRESS_TRANSLATED, STAT_PASS_IPV6_EXTHDR, STAT_UNVALIDATED_FALLBACK,
};

use crate::maps::{
    bind_divert_port, count, nat_is_empty, rebinding, some_gone, VNAT_EGRESS_NAT, VNAT_GONE,
    VNAT_INGRESS_NAT, VNAT_UNVALIDATED,
};
use family::translate_family;
use frag::{remember_fragment, translate_fragment};
use icmp::translate_error;
use natguard::guard;
use parse::{parse, Parsed, PROTO_ICMP, PROTO_ICMPV6};
use rebind::{divert_bind, learn};
use rewrite::rewrite;

const ETH_HLEN: usize = 14;

/// The verdict for a packet that goes on its way, translated or not:
/// "next" (TC_ACT_UNSPEC, TCX_NEXT), not "OK". OK would end the hook there,
/// so a program after vnat's on the same hook (Cilium's, a firewall's,
/// another clsact filter) would never see the packet; next lets it run,
/// and a hook with nothing after vnat passes the packet all the same.
pub(super) const PASS: i32 = TC_ACT_UNSPEC;

/// Why a packet was not simply passed: every such verdict is counted under
/// one of these (the `STAT_*` index), never returned as a bare integer.
#[derive(Clone, Copy)]
pub struct Drop(pub(super) u32);

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Dir {
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

/// `l2`: the length of the link-layer header before the IP header (14 for
/// Ethernet, 0 for an L3 interface).
#[inline(always)]
fn try_translate(ctx: &TcContext, dir: Dir, l2: usize) -> Result<i32, Drop> {
    let divert = match dir {
        Dir::Ingress => bind_divert_port(),
        Dir::Egress => None,
    };
    if divert.is_none() && nat_is_empty() && !(dir == Dir::Egress && some_gone()) {
        return Ok(PASS);
    }
    let Some(p) = parse(ctx, l2) else {
        return Ok(PASS);
    };
    if p.unparsed != 0 {
        // More extension headers than the parser walks: coming in, it may
        // be a BIND sent straight to vnatd or a rebinding flow's datagram,
        // so it is dropped; going out, it is the host's own and passed.
        if dir == Dir::Ingress {
            return Err(Drop(STAT_DROP_IPV6_EXTHDR));
        }
        count(STAT_PASS_IPV6_EXTHDR);
        return Ok(PASS);
    }
    if p.frag.is_fragment && !p.frag.first() {
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
    if p.key.proto == PROTO_ICMP || p.key.proto == PROTO_ICMPV6 {
        if dir == Dir::Ingress && rebinding() {
            // What a peer's NAT that forgot a mapping answers us.
            icmp::guard_error(ctx, &p)?;
        }
        return translate_error(ctx, &p, dir);
    }
    if let Some(verdict) = flow(ctx, &p, dir)? {
        return Ok(verdict);
    }
    if dir == Dir::Egress && some_gone() {
        if let Some(verdict) = gone(&p) {
            return Ok(verdict);
        }
    }
    if dir == Dir::Ingress && rebinding() {
        // A rebinding flow's first packet through its peer's new NAT: its
        // translations are installed, then it is translated by them.
        if learn(ctx, &p)? {
            if let Some(verdict) = flow(ctx, &p, dir)? {
                return Ok(verdict);
            }
        }
        // What a peer's NAT that re-mapped a connection sends us now.
        guard(ctx, &p)?;
    }
    Ok(PASS)
}

/// An outgoing packet without translation from an address this host has
/// only on `lo` now (`vnat_common::MAP_GONE`): redirected to the device
/// whose index the entry holds (vnatd writes none), where it is lost as on
/// a link that went dark (`None`: its address is not gone). A redirect,
/// not TC_ACT_STOLEN, which TCX takes for "next"; the socket sees a
/// transmission either way.
#[inline(always)]
fn gone(p: &Parsed) -> Option<i32> {
    // SAFETY: as in `translate_flow`: a non-preallocated map, the value
    // copied out at once.
    let sink = *unsafe { VNAT_GONE.get(&p.key.gone_key()) }?;
    count(STAT_GONE_DISCARDED);
    // SAFETY: a helper taking plain integers. It only records the target;
    // the kernel drops the packet after this program if the index names
    // no device that is up, and the socket sees it sent all the same.
    Some(unsafe { bpf_redirect(sink, 0) } as i32)
}

/// What `translate_flow` answers for a flow carried in the other address
/// family (`NAT_F_FAMILY`): not a verdict, and never returned by
/// `flow`, which translates such a packet with `translate_family`.
const FAMILY: i32 = i32::MIN;

/// A TCP or UDP packet's verdict by its flow's entry (`None`: it has
/// none).
///
/// A flow carried in the other family is translated by a call from here,
/// not from `translate_flow`: a call from there would add
/// `translate_family`'s frame to that one's, 576 bytes with the entry
/// point's (the verifier allows 512), while from here the chain is 416.
#[inline(always)]
fn flow(ctx: &TcContext, p: &Parsed, dir: Dir) -> Result<Option<i32>, Drop> {
    match translate_flow(ctx, p, dir)? {
        Some(FAMILY) => translate_family(ctx, p, dir).map(Some),
        other => Ok(other),
    }
}

/// A TCP or UDP packet: translated by its flow's entry, if it has one
/// (`None`: it has none).
///
/// The translators' work is split into functions of their own (BPF-to-BPF
/// calls: this one, `parse`, `learn`, `translate_fragment`,
/// `translate_error`), each called from the entry point, which keeps only
/// the parsed packet: the verifier refuses more than 512 bytes of stack
/// along a call chain (each frame rounded up to 32 bytes before Linux 6.9
/// or so), and one inlined frame had reached 488 bytes before ICMP and
/// IPv6 extension headers came in.
#[inline(never)]
fn translate_flow(ctx: &TcContext, p: &Parsed, dir: Dir) -> Result<Option<i32>, Drop> {
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
        return Ok(None);
    };
    let mut nat = *nat;
    if nat.flags & NAT_F_HOLD != 0 {
        if held(&nat) {
            // Egress: the socket sees a failed transmission and keeps the
            // data. Ingress: a container's replies while vnatd pins its NAT
            // entry; the peer sends them again.
            count(STAT_DROP_HELD);
            return Ok(Some(TC_ACT_SHOT));
        }
        // Held too long: as if vnatd had released it, which it has not
        // done in time. An entry that only held the flow is no translation.
        count(STAT_HOLD_EXPIRED);
        if rewrites_nothing(&nat, &p.key) {
            return Ok(None);
        }
    }
    if nat.flags & NAT_F_BUDGET != 0 {
        match within_budget(ctx, p, dir, &mut nat) {
            Budget::Within => {}
            Budget::Over => return Err(Drop(STAT_DROP_UNVALIDATED)),
            // `nat` is the last validated placement now.
            Budget::Fallback => {
                count(STAT_UNVALIDATED_FALLBACK);
                if rewrites_nothing(&nat, &p.key) {
                    // That placement is the flow's own endpoints.
                    return Ok(None);
                }
            }
        }
    }
    if nat.flags & NAT_F_FAMILY != 0 {
        // Carried in the other address family: done by the caller, in a
        // frame of its own (no fragments: nothing to remember for later
        // ones).
        return Ok(Some(FAMILY));
    }
    if p.frag.is_fragment && p.frag.more() {
        // The later fragments follow this one's flow.
        remember_fragment(p, dir);
    }
    rewrite(ctx, p, &nat)?;
    finish(ctx, dir, &nat, p.l3).map(Some)
}

/// Whether `nat` would rewrite a packet of `key` to itself (an entry that
/// only holds the flow, a fallback to its own endpoints).
#[inline(always)]
fn rewrites_nothing(nat: &NatRewrite, key: &FlowKey) -> bool {
    nat.src_addr_be == key.src_addr_be
        && nat.dst_addr_be == key.dst_addr_be
        && nat.src_port_be == key.src_port_be
        && nat.dst_port_be == key.dst_port_be
}

/// What [`within_budget`] found for a packet.
enum Budget {
    /// It may go where its entry says (or come in).
    Within,
    /// Over the allowance, and nowhere else to send it (no fallback, or
    /// not yet): drop it.
    Over,
    /// Over the allowance: it goes to the flow's last validated placement,
    /// which was written over the caller's entry.
    Fallback,
}

/// A packet of a flow whose peer address is not validated yet
/// (`NAT_F_BUDGET`): coming in (from that address: the ingress key is the
/// physical tuple), it adds three times its length to what the flow may
/// send there; going out, it may leave only within that, or else to the
/// last validated placement when the allowance names one in the same
/// family (`UnvalidatedBudget::fallback`), which replaces `nat`, once the
/// fallback's wait is over.
/// The allowance is keyed by the flow's egress key, which an ingress
/// entry's value (the virtual tuple, reversed) gives. A frame of its own
/// (a call from `translate_flow`), so the key built here is not added to
/// the translators' deepest chain.
#[inline(never)]
fn within_budget(ctx: &TcContext, p: &Parsed, dir: Dir, nat: &mut NatRewrite) -> Budget {
    let len = (ctx.len() as u64).saturating_sub(p.l3 as u64);
    let key = match dir {
        Dir::Egress => p.key,
        Dir::Ingress => FlowKey {
            src_addr_be: nat.dst_addr_be,
            dst_addr_be: nat.src_addr_be,
            src_port_be: nat.dst_port_be,
            dst_port_be: nat.src_port_be,
            // The value's family: the other one for a flow carried in the
            // other family.
            family: match (nat.flags & NAT_F_FAMILY != 0, p.key.family) {
                (false, f) => f,
                (true, AF_INET) => AF_INET6,
                (true, _) => AF_INET,
            },
            proto: p.key.proto,
            _pad: opaque_zero(),
        },
    };
    let Some(b) = VNAT_UNVALIDATED.get_ptr_mut(&key) else {
        // No allowance written (vnatd failed between the two writes, or
        // removed it first): nothing may leave, anything may come in.
        return match dir {
            Dir::Ingress => Budget::Within,
            Dir::Egress => Budget::Over,
        };
    };
    // SAFETY: `b` is the non-null pointer the lookup just returned, an
    // aligned value inside the map's memory (BPF_F_NO_PREALLOC: aya's
    // documented safe case; see `translate_flow` on reuse after a delete).
    // Plain loads and stores: see `UnvalidatedBudget`. The clock is a helper
    // without arguments.
    unsafe {
        match dir {
            Dir::Ingress => {
                let allowed = core::ptr::read_volatile(&(*b).allowed);
                core::ptr::write_volatile(
                    &mut (*b).allowed,
                    allowed.saturating_add(len.saturating_mul(AMPLIFICATION_FACTOR)),
                );
                Budget::Within
            }
            Dir::Egress => {
                let sent = core::ptr::read_volatile(&(*b).sent).saturating_add(len);
                if sent <= core::ptr::read_volatile(&(*b).allowed) {
                    core::ptr::write_volatile(&mut (*b).sent, sent);
                    return Budget::Within;
                }
                // Fields, not the whole fallback: one more copy of it does
                // not fit the translators' stack.
                let flags = core::ptr::read_volatile(&(*b).fallback.flags);
                // Not one carried in the other family (`translate_family`
                // would read the flow's entry again), nor a hold.
                if flags & NAT_F_FALLBACK == 0
                    || flags & (NAT_F_FAMILY | NAT_F_HOLD | NAT_F_BUDGET) != 0
                {
                    return Budget::Over;
                }
                // Not yet, for a TCP flow (`held_until` set): its packets
                // stay in the socket while a validation takes its round
                // trip, as in a hold.
                let until = core::ptr::read_volatile(&(*b).fallback.held_until);
                if until != 0 && hold_in_force(until, bpf_ktime_get_boot_ns()) {
                    return Budget::Over;
                }
                let diverted = core::ptr::read_volatile(&(*b).diverted);
                core::ptr::write_volatile(&mut (*b).diverted, diverted.wrapping_add(1));
                *nat = core::ptr::read_volatile(&(*b).fallback);
                nat.held_until = 0;
                Budget::Fallback
            }
        }
    }
}

/// Whether a [`NAT_F_HOLD`] entry still holds: one stamped with its end (an
/// egress hold) until then, one without (an ingress hold) until vnatd
/// releases it.
#[inline(always)]
pub(super) fn held(nat: &NatRewrite) -> bool {
    // SAFETY: a helper without arguments.
    hold_in_force(nat.held_until, unsafe { bpf_ktime_get_boot_ns() })
}

/// What is left after a translated packet's rewrite: count it, and send an
/// egress packet whose destination changed out again with L2 resolved.
/// `l2`: the link-layer header's length (the packet's L3 offset).
#[inline(always)]
pub(super) fn finish(ctx: &TcContext, dir: Dir, nat: &NatRewrite, l2: usize) -> Result<i32, Drop> {
    count(match dir {
        Dir::Ingress => STAT_INGRESS_TRANSLATED,
        Dir::Egress => STAT_EGRESS_TRANSLATED,
    });
    leave(ctx, dir, nat, l2)
}

/// A translated packet's way on: an egress packet whose destination
/// changed goes out again with L2 resolved for it (`NAT_F_REDIRECT`).
#[inline(always)]
pub(super) fn leave(ctx: &TcContext, dir: Dir, nat: &NatRewrite, l2: usize) -> Result<i32, Drop> {
    if dir == Dir::Ingress {
        return Ok(PASS);
    }
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
/// and the translators call only their own functions, whose frames are
/// sized for that (see `translate_flow`: the deepest chain, through
/// `translate_error`, is 480 bytes on 6.1; check with `llvm-objdump -d` on
/// the object, the largest `r10 - N` of each function, before adding to
/// one).
#[inline(always)]
pub(super) fn opaque_zero<T: Copy + Default>() -> T {
    let zero = T::default();
    // SAFETY: a read of a live, initialized local through a reference to it.
    unsafe { core::ptr::read_volatile(&zero) }
}
