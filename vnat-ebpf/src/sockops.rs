//! sock_ops: record every TCP connection of an enabled cgroup when it is
//! established (but those that stay on this host, and beyond its owner's
//! budget), note its retransmission timeouts, forget it when it closes.

use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB, BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB,
        BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB,
        BPF_SOCK_OPS_STATE_CB_FLAG,
    },
    helpers::{bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_boot_ns},
    macros::sock_ops,
    programs::SockOpsContext,
};
use vnat_common::{
    ConnRecord, FlowKey, GuestKey, AF_INET, AF_INET6, ORIGIN_TCP_ACTIVE, ORIGIN_TCP_PASSIVE,
    OWNER_ACCEPTED, OWNER_UNSEEN, PROTO_TCP, STAT_CONNS_MAP_FULL, STAT_GUESTS_MAP_FULL,
    STAT_GUEST_RECORDED, STAT_LOCAL_PAIR_IGNORED, STAT_LOOPBACK_IGNORED, STAT_SOCKOPS_RECORDED,
    STAT_SOCKOPS_REMOVED, STAT_SOCKOPS_RTO,
};

use crate::maps::{count, netns_is_ours, Owner, VNAT_CONNECTING, VNAT_CONNS, VNAT_GUESTS};
use crate::owners::{charge, uncharge, Charge, VNAT_REFUSED_LOCAL};

/// `TCP_CLOSE` from include/net/tcp_states.h.
const TCP_CLOSE: u32 = 7;
const KERNEL_AF_INET: u32 = 2;
const KERNEL_AF_INET6: u32 = 10;

#[sock_ops]
pub fn vnat_sockops(ctx: SockOpsContext) -> u32 {
    match ctx.op() {
        BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB => on_established(&ctx, ORIGIN_TCP_ACTIVE),
        BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB => on_established(&ctx, ORIGIN_TCP_PASSIVE),
        BPF_SOCK_OPS_STATE_CB => on_state(&ctx),
        BPF_SOCK_OPS_RTO_CB => on_rto(&ctx),
        _ => {}
    }
    // sock_ops return value is ignored by the kernel for these callbacks.
    1
}

/// Read the connection's 4-tuple from the context, local side first.
/// The remote port is big-endian in the upper 16 bits, the local port is in
/// host order (see DESIGN.md §3, sock_ops context quirks).
#[inline(always)]
fn key_of(ctx: &SockOpsContext) -> Option<FlowKey> {
    let ops = ctx.ops;
    let mut key = FlowKey {
        proto: PROTO_TCP,
        ..FlowKey::default()
    };
    match ctx.family() {
        KERNEL_AF_INET => {
            key.family = AF_INET;
            // SAFETY (this and every read through `ops` below): `ops` is the
            // sock_ops context the kernel passed to this run. The verifier
            // checks each load from it against the fields and sizes sock_ops
            // may read (sock_ops_is_valid_access) and rewrites it into a
            // read of the kernel's socket, so a read it would not allow is
            // refused at load time, never executed.
            key.src_addr_be[0] = unsafe { (*ops).local_ip4 };
            // SAFETY: as above, a 4-byte context field.
            key.dst_addr_be[0] = unsafe { (*ops).remote_ip4 };
        }
        KERNEL_AF_INET6 => {
            key.family = AF_INET6;
            // The verifier only allows 4-byte reads of these arrays: a plain
            // array copy becomes a wider load and is rejected
            // ("invalid bpf_context access off=... size=8").
            // SAFETY: `ops` is the sock_ops context (see above); each read is
            // one aligned u32 inside local_ip6 or remote_ip6 (index 0 to 3 of
            // a [u32; 4]), the access the verifier allows on these fields.
            unsafe {
                let l = core::ptr::addr_of!((*ops).local_ip6) as *const u32;
                let r = core::ptr::addr_of!((*ops).remote_ip6) as *const u32;
                key.src_addr_be[0] = core::ptr::read_volatile(l);
                key.src_addr_be[1] = core::ptr::read_volatile(l.add(1));
                key.src_addr_be[2] = core::ptr::read_volatile(l.add(2));
                key.src_addr_be[3] = core::ptr::read_volatile(l.add(3));
                key.dst_addr_be[0] = core::ptr::read_volatile(r);
                key.dst_addr_be[1] = core::ptr::read_volatile(r.add(1));
                key.dst_addr_be[2] = core::ptr::read_volatile(r.add(2));
                key.dst_addr_be[3] = core::ptr::read_volatile(r.add(3));
            }
        }
        _ => return None,
    }
    // SAFETY: a 4-byte read of a context field, checked as above.
    let local_port = unsafe { (*ops).local_port } as u16;
    key.src_port_be = local_port.to_be();
    // The kernel loads skc_dport (already network order) as a 16-bit value and
    // shifts it into the upper half, so the upper half *is* the be16 port.
    // SAFETY: a 4-byte read of a context field, checked as above.
    key.dst_port_be = (unsafe { (*ops).remote_port } >> 16) as u16;
    // An AF_INET6 socket carrying IPv4 (a dual-stack listener's child, a
    // client connected to ::ffff:a.b.c.d) is recorded as the IPv4 flow its
    // packets and its peer show (DESIGN.md section 3, dual-stack sockets).
    Some(key.unmapped())
}

// Each callback is a function of its own, not inlined into the entry
// point: inlined, their frames added up beyond the verifier's 512 bytes
// ("combined stack size of 3 calls is 608. Too large").
#[inline(never)]
fn on_established(ctx: &SockOpsContext, origin: u8) {
    // SAFETY: the context pointer is the argument the helper takes; the
    // verifier checks it at load time.
    let netns = unsafe { bpf_get_netns_cookie(ctx.ops as *mut _) };
    let ours = netns_is_ours(netns);
    let Some(key) = key_of(ctx) else { return };
    // SAFETY: as above, the context pointer is the argument.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.ops as *mut _) };
    // Who connected (nobody for an accepted connection), taken out of the
    // map whatever becomes of the connection, and its charge given back.
    // Looked up for a passive establishment too: a socket that called
    // connect() and met its peer's SYN (a simultaneous open, as TCP hole
    // punching does) is established through SYN_RECV, by the passive
    // callback, and its entry must not stay behind.
    // SAFETY: the map is not preallocated: an element deleted while we hold
    // the reference is freed only after an RCU grace period, which this
    // program's run is inside. Keyed by this socket's cookie, written only
    // by this socket's connect hook (before the handshake that ends here),
    // and copied out at once.
    let owner = unsafe { VNAT_CONNECTING.get(&cookie) }.copied();
    if let Some(o) = owner {
        if VNAT_CONNECTING.remove(&cookie).is_ok() {
            uncharge(o.uid, Charge::Connecting);
        }
    }
    // Nothing that stays on this host is a connection to move: loopback
    // (at either end, in any form), and the accepting end of a connection
    // whose connecting end is a socket of this very namespace (whose own
    // record goes too).
    if key.is_loopback() {
        count(STAT_LOOPBACK_IGNORED);
        return;
    }
    if origin == ORIGIN_TCP_PASSIVE && local_pair(netns, ours, &key) {
        count(STAT_LOCAL_PAIR_IGNORED);
        return;
    }
    // A connection made here whose connect() left no owner (over its
    // user's budget of sockets connecting) is charged apart from those
    // accepted from other hosts, whose room it must not take.
    let uid = match owner {
        Some(o) => o.uid,
        None if origin == ORIGIN_TCP_ACTIVE => OWNER_UNSEEN,
        None => OWNER_ACCEPTED,
    };
    let what = if ours { Charge::Tcp } else { Charge::Guest };
    if !charge(uid, what) {
        if origin == ORIGIN_TCP_ACTIVE {
            note_refused(netns, &key);
        }
        return;
    }
    let seen = Seen {
        netns,
        cookie,
        uid,
        origin,
        ours: ours as u8,
        _pad: [0; 2],
    };
    if !store(ctx, &key, owner.as_ref(), &seen) {
        uncharge(uid, what);
        return;
    }
    // Ask for state-change callbacks so the record goes away on close, and
    // for retransmission-timeout callbacks so that the daemon knows the
    // sequence number to quote when it restarts the connection after an
    // outage (see `on_rto`). Both cost nothing until they fire.
    // A guest's RTO is no use to vnatd (its levers cannot reach it).
    let rto = if ours { BPF_SOCK_OPS_RTO_CB_FLAG } else { 0 };
    let flags = ctx.cb_flags() | BPF_SOCK_OPS_STATE_CB_FLAG | rto;
    let _ = ctx.set_cb_flags(flags as i32);
}

/// What `on_established` learnt of a connection, for `store`.
struct Seen {
    netns: u64,
    cookie: u64,
    uid: u32,
    origin: u8,
    ours: u8,
    _pad: [u8; 2],
}

/// Record the connection `key` (charged already): false if its map is
/// full. A function of its own, not inlined, so that its record does not
/// sit on the stack beside `on_established`'s and `local_pair`'s: the
/// verifier refused the inlined form with "combined stack size of 2 calls
/// is 528. Too large".
#[inline(never)]
fn store(ctx: &SockOpsContext, key: &FlowKey, owner: Option<&Owner>, seen: &Seen) -> bool {
    // SAFETY: a helper without arguments or preconditions.
    let now = unsafe { bpf_ktime_get_boot_ns() };
    let mut rec = ConnRecord {
        cookie: seen.cookie,
        netns_cookie: seen.netns,
        first_seen_ns: now,
        last_seen_ns: now,
        // SAFETY: 4-byte reads of sock_ops context fields, checked by the
        // verifier like those in `key_of`. They are tcp_sock fields, which
        // the kernel's rewrite reads only from a full socket (0 otherwise);
        // an ESTABLISHED callback always has one.
        snd_nxt: unsafe { (*ctx.ops).snd_nxt },
        // SAFETY: as for snd_nxt.
        rcv_nxt: unsafe { (*ctx.ops).rcv_nxt },
        origin: seen.origin,
        owner_uid: seen.uid,
        ..ConnRecord::default()
    };
    // Only the low 32 bits of the byte counters matter: sequence numbers
    // wrap at 2^32 too.
    // SAFETY: reads of the context fields snd_una and rcv_nxt (4 bytes) and
    // bytes_acked and bytes_received (8 bytes), each at its own size, which
    // is what the verifier allows; full-socket fields, as above.
    unsafe {
        let ops = ctx.ops;
        rec.snd_una_base = (*ops).snd_una.wrapping_sub((*ops).bytes_acked as u32);
        rec.rcv_nxt_base = (*ops).rcv_nxt.wrapping_sub((*ops).bytes_received as u32);
    }
    if let Some(o) = owner {
        rec.cgroup_id = o.cgroup_id;
        rec.pid = o.pid;
        rec.comm = o.comm;
    }
    if seen.ours == 0 {
        // Another namespace's socket in an enabled cgroup: a container's,
        // or a namespace that is no guest of this host's at all (vnatd
        // tells them apart by the host's NAT). Kept apart by namespace.
        let guest = GuestKey {
            netns_cookie: seen.netns,
            flow: *key,
        };
        if VNAT_GUESTS.insert(&guest, &rec, 0).is_err() {
            count(STAT_GUESTS_MAP_FULL);
            return false;
        }
        count(STAT_GUEST_RECORDED);
    } else if VNAT_CONNS.insert(key, &rec, 0).is_err() {
        count(STAT_CONNS_MAP_FULL);
        return false;
    } else {
        count(STAT_SOCKOPS_RECORDED);
    }
    true
}

/// Remember that this host's connection `key` went unrecorded for its
/// owner's budget (see `VNAT_REFUSED_LOCAL`). Not inlined, for the stack,
/// as `store`.
#[inline(never)]
fn note_refused(netns: u64, key: &FlowKey) {
    let mine = GuestKey {
        netns_cookie: netns,
        flow: *key,
    };
    let _ = VNAT_REFUSED_LOCAL.insert(&mine, &1, 0);
}

/// A retransmission timeout (tcp_write_timeout, called by
/// tcp_retransmit_timer before it retransmits the oldest segment): remember
/// `snd_una`, the sequence number of that segment.
///
/// After an outage TCP has backed its timer off to tens of seconds. The
/// daemon restarts the flow by injecting an ICMP unreachable quoting this
/// sequence number (RFC 6069; the kernel's tcp_ld_RTO_revert only reverts a
/// backoff step when the quoted sequence number equals snd_una). During an
/// outage nothing is acknowledged, so the value recorded at the last timeout
/// is still snd_una when the daemon reads it; if an ACK advanced it since,
/// the socket is out of backoff (icsk_retransmits is 0) or has timed out
/// again and this ran again.
#[inline(never)]
fn on_rto(ctx: &SockOpsContext) {
    // A guest's socket is restarted by its own TCP (vnatd cannot reach it
    // from this namespace), and its tuple must not touch a host record.
    // SAFETY: the context pointer is the argument the helper takes.
    let netns = unsafe { bpf_get_netns_cookie(ctx.ops as *mut _) };
    if !netns_is_ours(netns) {
        return;
    }
    let Some(key) = key_of(ctx) else { return };
    let Some(rec) = VNAT_CONNS.get_ptr_mut(&key) else {
        return;
    };
    // SAFETY: a 4-byte read of a context field, checked by the verifier as
    // in `key_of`; an RTO callback runs on a full socket.
    let snd_una = unsafe { (*ctx.ops).snd_una };
    // SAFETY: a helper without arguments or preconditions.
    let now = unsafe { bpf_ktime_get_boot_ns() };
    // The callbacks of one socket run under its lock, so these plain
    // stores do not race with each other.
    // SAFETY: `rec` is the non-null pointer a VNAT_CONNS lookup just
    // returned, to a value the verifier knows to be a whole ConnRecord. Map
    // elements go back to the allocator only after an RCU grace period and
    // this program runs under RCU, so the memory stays valid for the run.
    // If the daemon deleted the record meanwhile, the element may already
    // hold another flow (since Linux 6.1 a map without preallocation reuses
    // freed elements at once too), and these stores would land in that
    // record: wrong RTO data for one flow, never a write outside the map.
    unsafe {
        (*rec).rto_snd_una = snd_una;
        (*rec).rto_count = (*rec).rto_count.wrapping_add(1);
        (*rec).rto_last_ns = now;
    }
    count(STAT_SOCKOPS_RTO);
}

#[inline(never)]
fn on_state(ctx: &SockOpsContext) {
    // arg(1) is the new state.
    if ctx.arg(1) != TCP_CLOSE {
        return;
    }
    let Some(key) = key_of(ctx) else { return };
    // SAFETY: the context pointer is the argument the helper takes.
    let netns = unsafe { bpf_get_netns_cookie(ctx.ops as *mut _) };
    if !netns_is_ours(netns) {
        let guest = GuestKey {
            netns_cookie: netns,
            flow: key,
        };
        // SAFETY: VNAT_GUESTS is not preallocated; the owner is copied out
        // at once (a record replaced meanwhile only gives the charge back
        // to another owner, which the recount corrects).
        let uid = unsafe { VNAT_GUESTS.get(&guest) }.map(|r| r.owner_uid);
        if let Some(uid) = uid {
            if VNAT_GUESTS.remove(&guest).is_ok() {
                uncharge(uid, Charge::Guest);
            }
        }
        return;
    }
    // SAFETY: as above, for VNAT_CONNS.
    let uid = unsafe { VNAT_CONNS.get(&key) }.map(|r| r.owner_uid);
    if let Some(uid) = uid {
        if VNAT_CONNS.remove(&key).is_ok() {
            uncharge(uid, Charge::Tcp);
            count(STAT_SOCKOPS_REMOVED);
        }
    }
}

/// Whether the connection just accepted (`key`, from the accepting end)
/// was made by a socket of the same namespace: its connecting end's
/// record, or its refusal, is there under the reversed tuple (the
/// connecting end's callback runs before it sends the ACK that completes
/// the accepting end). That record goes, its charge given back. Not
/// inlined, for the stack, as `store`.
#[inline(never)]
fn local_pair(netns: u64, ours: bool, key: &FlowKey) -> bool {
    let theirs = GuestKey {
        netns_cookie: netns,
        flow: key.reversed(),
    };
    // Looked up before it is removed: a removal takes the bucket's lock
    // even when the key is absent, as it nearly always is.
    // SAFETY: only whether the key is there is read, nothing through the
    // reference.
    if unsafe { VNAT_REFUSED_LOCAL.get(&theirs) }.is_some()
        && VNAT_REFUSED_LOCAL.remove(&theirs).is_ok()
    {
        return true;
    }
    if ours {
        // SAFETY: as in `on_state`: copied out at once.
        let Some(uid) = (unsafe { VNAT_CONNS.get(&theirs.flow) }).map(|r| r.owner_uid) else {
            return false;
        };
        if VNAT_CONNS.remove(&theirs.flow).is_ok() {
            uncharge(uid, Charge::Tcp);
        }
    } else {
        // SAFETY: as above.
        let Some(uid) = (unsafe { VNAT_GUESTS.get(&theirs) }).map(|r| r.owner_uid) else {
            return false;
        };
        if VNAT_GUESTS.remove(&theirs).is_ok() {
            uncharge(uid, Charge::Guest);
        }
    }
    true
}
