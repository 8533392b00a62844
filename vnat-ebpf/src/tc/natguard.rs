//! The NAT guard (`vnat_common::natguard`): for a packet coming in from a
//! peer's NAT address to one of our ports where that peer has a connection,
//! which no translation, rebind or record owns, keep from our kernel what
//! it would get wrong if the NAT re-mapped the connection: a TCP segment
//! it would reset, a UDP datagram it would give the application as a new
//! peer's. Counted in the guard's entry, which vnatd watches.

use aya_ebpf::{
    bindings::bpf_sock_tuple,
    helpers::{bpf_ktime_get_boot_ns, bpf_sk_release, bpf_skc_lookup_tcp},
    programs::TcContext,
};
use vnat_common::{
    GuardValue, AF_INET, GUARD_TCP_SUSPECT_NS, GUARD_UDP_ALL_NS, GUARD_UDP_HOLD_NS, PROTO_TCP,
    STAT_DROP_NAT_GUARD, STAT_NAT_GUARD_RELEASED,
};

use super::parse::Parsed;
use super::rebind::{rebind_key, rebinding, recorded, TCP_ACK, TCP_FLAGS_OFF, TCP_RST, TCP_SYN};
use super::{opaque_zero, Drop};
use crate::maps::{count, VNAT_GUARD};

/// `BPF_F_CURRENT_NETNS`: the namespace of the packet's device.
const CURRENT_NETNS: u64 = u64::MAX;
/// The size of `bpf_sock_tuple`'s IPv4 and IPv6 forms.
const TUPLE4_LEN: u32 = 12;
const TUPLE6_LEN: u32 = 36;
const TCP_LISTEN: u32 = 10;

/// `Err`: the packet is dropped (counted in the entry and as
/// `drop_nat_guard`). A call of its own, for the stack (see
/// `translate_flow`).
#[inline(never)]
pub(super) fn guard(ctx: &TcContext, p: &Parsed) -> Result<(), Drop> {
    let key = rebind_key(p);
    let Some(g) = VNAT_GUARD.get_ptr_mut(&key) else {
        return Ok(());
    };
    // SAFETY: a helper without arguments.
    let now = unsafe { bpf_ktime_get_boot_ns() };
    if p.key.proto == PROTO_TCP {
        let Ok(flags) = ctx.load::<u8>(p.l4 + TCP_FLAGS_OFF) else {
            return Ok(());
        };
        if recorded(p) {
            // The NAT's own reset for our socket's segment to the mapping
            // it forgot (see `natguard`): dropped while the guard is
            // suspicious. Our segments can reach the NAT before the peer's
            // re-mapped ones reach us, so a reset while it is not starts
            // the suspicion itself (and makes vnatd ask the peer), once:
            // after that window, the next reset goes on (a peer whose
            // socket is gone resets the connection 5 s late).
            if flags & (TCP_RST | TCP_ACK) != TCP_RST {
                return Ok(());
            }
            // SAFETY: as below.
            let (last, by_reset) = unsafe { ((*g).since_ns, (*g).held_port_be) };
            if now.wrapping_sub(last) >= GUARD_TCP_SUSPECT_NS && !rebinding(p) {
                if by_reset != 0 {
                    // SAFETY: as below.
                    unsafe { (*g).held_port_be = 0 };
                    return Ok(());
                }
                // SAFETY: as below.
                unsafe {
                    (*g).since_ns = now;
                    (*g).held_port_be = 1;
                }
            }
        } else if flags & (TCP_SYN | TCP_RST) != 0 || kernel_has_socket(ctx, p) {
            // A SYN opens a connection (another host's behind the NAT), a
            // reset closes nothing we have: the kernel's business.
            return Ok(());
        } else {
            // SAFETY: as below.
            unsafe {
                (*g).since_ns = now;
                (*g).held_port_be = 0;
            }
        }
    } else if recorded(p) || !hold_udp(g, p.key.src_port_be, now) {
        return Ok(());
    }
    // SAFETY: a pointer a lookup just returned, into the map's memory
    // (BPF_F_NO_PREALLOC: an entry deleted meanwhile is freed after an RCU
    // grace period, which this program's run is inside). Two CPUs may lose
    // one count between them: vnatd looks for a change, not a number.
    unsafe { (*g).drops = (*g).drops.wrapping_add(1) };
    Err(Drop(STAT_DROP_NAT_GUARD))
}

/// An ICMP "port unreachable" from a peer's NAT itself (`nat`, the
/// quoted datagram's destination and the error's source) about a UDP
/// datagram we sent from `ours`:`our_port_be` to it, where a guard stands:
/// `Err` (dropped, and counted in the guard's entry, so that vnatd asks the
/// peers there for their BINDs).
///
/// A NAT that forgot the flow's mapping (a reboot, a carrier-grade NAT
/// re-mapping it) answers what our socket sends to the old mapping so, and
/// a connected UDP socket would end with ECONNREFUSED before the peer's
/// next datagram, through the new mapping, lets vnatd learn it. The UDP
/// counterpart of the NAT's reset that a TCP guard drops. An error from
/// any other host (a router on the path), of another kind (a path MTU's),
/// or about a port without a guard goes on.
#[inline(always)]
pub(super) fn guard_error(
    p: &Parsed,
    ours: [u32; 4],
    nat: [u32; 4],
    our_port_be: u16,
) -> Result<(), Drop> {
    let key = vnat_common::RebindKey {
        src_addr_be: nat,
        dst_addr_be: ours,
        dst_port_be: our_port_be,
        family: p.key.family,
        proto: vnat_common::PROTO_UDP,
        slot: 0,
        _pad: [opaque_zero(), opaque_zero(), opaque_zero()],
    };
    let Some(g) = VNAT_GUARD.get_ptr_mut(&key) else {
        return Ok(());
    };
    // SAFETY: as in `guard`.
    unsafe { (*g).drops = (*g).drops.wrapping_add(1) };
    Err(Drop(STAT_DROP_NAT_GUARD))
}

/// Whether the kernel has a socket for this segment other than a listener
/// (an established connection, one being accepted, a TIME_WAIT): then it
/// is someone's, and goes on. A listener alone would answer a segment that
/// is no SYN with a reset (`tcp_v4_rcv`, `tcp_rcv_state_process` in
/// TCP_LISTEN). `bpf_skc_lookup_tcp` (Linux 5.2), not `bpf_sk_lookup_tcp`:
/// the latter returns a connection being accepted as its listener.
#[inline(always)]
pub(super) fn kernel_has_socket(ctx: &TcContext, p: &Parsed) -> bool {
    // SAFETY: bpf_sock_tuple is a union of plain integers: all zeroes is a
    // valid value of either form.
    let mut t: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    let v4 = p.key.family == AF_INET;
    // SAFETY: writing the fields of one union member, plain integers; the
    // lookup is given the size of the member written; a non-null socket it
    // returns is released exactly once, after its state is read (the
    // verifier allows `state` on a sock_common).
    unsafe {
        if v4 {
            let a = &mut t.__bindgen_anon_1.ipv4;
            a.saddr = p.key.src_addr_be[0];
            a.daddr = p.key.dst_addr_be[0];
            a.sport = p.key.src_port_be;
            a.dport = p.key.dst_port_be;
        } else {
            let a = &mut t.__bindgen_anon_1.ipv6;
            a.saddr = p.key.src_addr_be;
            a.daddr = p.key.dst_addr_be;
            a.sport = p.key.src_port_be;
            a.dport = p.key.dst_port_be;
        }
        let len = if v4 { TUPLE4_LEN } else { TUPLE6_LEN };
        let sk = bpf_skc_lookup_tcp(ctx.skb.skb.cast(), &mut t, len, CURRENT_NETNS, 0);
        if sk.is_null() {
            return false;
        }
        let state = (*sk).state;
        bpf_sk_release(sk.cast());
        state != TCP_LISTEN
    }
}

/// A UDP datagram from an unknown port: true to hold (drop) it. The first
/// such port is held for `GUARD_UDP_HOLD_NS`, then let through for good
/// (until another is held). Other ports' datagrams are held only within
/// the hold's first `GUARD_UDP_ALL_NS`, and go on after it: were they held
/// for as long, each waiting its turn, a spoofer sending from a fresh port
/// as each hold ends would keep every other host's new flow from that NAT
/// out, and two hosts' new flows would take turns in blackouts
/// (`shared_nat`'s rogue flow was never bound within 30 s).
#[inline(always)]
fn hold_udp(g: *mut GuardValue, port_be: u16, now: u64) -> bool {
    // SAFETY: see `guard`; a race between CPUs costs at most one more
    // datagram held or let through, never a hold without end (the time
    // bounds it).
    unsafe {
        if (*g).released_port_be == port_be {
            return false;
        }
        let held = (*g).held_port_be;
        let holding = held != 0 && now.wrapping_sub((*g).since_ns) < GUARD_UDP_HOLD_NS;
        if held == port_be {
            if holding {
                return true;
            }
            (*g).released_port_be = port_be;
            (*g).held_port_be = 0;
            count(STAT_NAT_GUARD_RELEASED);
            return false;
        }
        if holding {
            // Another unknown port while one is held: within the hold's
            // first `GUARD_UDP_ALL_NS`, held too (a NAT that forgets its
            // mappings re-maps every flow at once, and two racing
            // datagrams of one flow can get a mapping each); after that
            // it goes on, for the reason above.
            return now.wrapping_sub((*g).since_ns) < GUARD_UDP_ALL_NS;
        }
        (*g).held_port_be = port_be;
        (*g).since_ns = now;
        true
    }
}
