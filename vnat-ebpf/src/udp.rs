//! cgroup sock_addr hooks that record UDP flows, so that UDP is virtualized
//! and translated like TCP (DESIGN.md §3). UDP has no connection events, so
//! flows are recorded where the kernel tells us about a peer: connect(),
//! sendmsg() with a destination, recvmsg() asking for the source. Records
//! are removed when the socket is released.
//!
//! The connect, sendmsg and recvmsg hooks also hide location (`hide`), for
//! TCP's connect too: one program per hook, so that the flow recorded is
//! always the one on the wire, whatever order the kernel runs programs in.

use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_addr},
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_comm, bpf_get_current_pid_tgid,
        bpf_get_current_uid_gid, bpf_get_netns_cookie, bpf_get_socket_cookie,
        bpf_ktime_get_boot_ns,
    },
    macros::{cgroup_sock, cgroup_sock_addr, map},
    maps::{Array, HashMap, LruHashMap},
    programs::{SockAddrContext, SockContext},
};
use vnat_common::{
    v4_of_mapped, v4_of_mapped_or_any, ConnRecord, FlowKey, GuestKey, UdpPending, AF_INET,
    AF_INET6, ORIGIN_UDP_CONNECT, ORIGIN_UDP_RECVMSG, ORIGIN_UDP_SENDMSG, PROTO_UDP,
    STAT_CONNS_MAP_FULL, STAT_GUESTS_MAP_FULL, STAT_GUEST_RECORDED, STAT_LOOPBACK_IGNORED,
    STAT_OTHER_NETNS, STAT_UDP_BUDGET_FULL, STAT_UDP_RECORDED, STAT_UDP_SOCKET_FULL, UDP_DIR_RECV,
    UDP_DIR_SEND, UDP_PENDING_MAX_ENTRIES, UDP_PER_SOCKET_MAX, UDP_REFRESH_NS,
};

use crate::maps::{
    count, netns_is_ours, Owner, NO_PREALLOC, VNAT_CONNECTING, VNAT_CONNS, VNAT_GUESTS,
};
use crate::owners::{charge, udp_total, uncharge, Charge};

const IPPROTO_UDP: u32 = 17;
const IPPROTO_TCP: u32 = 6;
/// BPF_NOEXIST: insert only if absent.
const NOEXIST: u64 = 1;
/// sock_addr programs must return 1 ("proceed"); 0 would fail the syscall.
const PROCEED: i32 = 1;

/// UDP sockets that called connect() before they had a local port
/// (`vnat_common::MAP_UDP_PENDING`). Each entry is charged to its owner like
/// a TCP socket still connecting (`Charge::Connecting`), and given back when
/// the socket is released first; vnatd completes the entry into a record
/// and its recount gives the charge back. A plain hash map: an LRU one would
/// let one user's unbound sockets evict everyone else's.
#[map]
pub static VNAT_UDP_PENDING: HashMap<u64, UdpPending> =
    HashMap::pinned(UDP_PENDING_MAX_ENTRIES, NO_PREALLOC);

/// Socket cookie to the last flow recorded for it. The release hook cannot
/// read a socket's addresses (the verifier allows src_* only in post_bind
/// programs), so it finds the record to remove through this.
#[map]
static VNAT_UDP_SOCKS: LruHashMap<u64, FlowKey> = LruHashMap::with_max_entries(65_536, 0);

/// How many UDP records VNAT_CONNS holds (one slot), against
/// UDP's share (`owners::udp_total`); vnatd recounts it at every housekeeping pass, which
/// also corrects what concurrent updates here may miss.
#[map]
pub static VNAT_UDP_COUNT: Array<u64> = Array::pinned(1, 0);

/// UDP records per socket cookie, against `UDP_PER_SOCKET_MAX`.
#[map]
pub static VNAT_UDP_PER_SOCK: LruHashMap<u64, u32> = LruHashMap::pinned(65_536, 0);

/// Add `delta` (wrapping: `u64::MAX` takes one away) to the UDP record count.
#[inline(always)]
fn udp_count_add(delta: u64) {
    if let Some(slot) = VNAT_UDP_COUNT.get_ptr_mut(0) {
        // SAFETY: `slot` is the non-null pointer the lookup in a one-slot
        // array map just returned: an aligned u64 inside the map's memory,
        // which lives as long as the map. The update is a plain load and
        // store (the BPF target has no atomic fetch-add in Rust): programs
        // on two CPUs at once may lose one update, which only moves the
        // budget by one until vnatd's next recount (every 5 s) sets it
        // right.
        unsafe {
            let n = core::ptr::read_volatile(slot);
            core::ptr::write_volatile(slot, n.wrapping_add(delta));
        }
    }
}

#[cgroup_sock_addr(connect4)]
pub fn vnat_udp_connect4(ctx: SockAddrContext) -> i32 {
    // First: the flow recorded is the one the kernel then uses.
    crate::hide::reach(&ctx, AF_INET);
    record(&ctx, AF_INET, ORIGIN_UDP_CONNECT);
    note_tcp_owner(&ctx);
    PROCEED
}

#[cgroup_sock_addr(connect6)]
pub fn vnat_udp_connect6(ctx: SockAddrContext) -> i32 {
    // First: the flow recorded is the one the kernel then uses.
    crate::hide::reach(&ctx, AF_INET6);
    record(&ctx, AF_INET6, ORIGIN_UDP_CONNECT);
    note_tcp_owner(&ctx);
    PROCEED
}

#[cgroup_sock_addr(sendmsg4)]
pub fn vnat_udp_sendmsg4(ctx: SockAddrContext) -> i32 {
    // First: the flow recorded is the one the kernel then uses.
    crate::hide::reach(&ctx, AF_INET);
    record(&ctx, AF_INET, ORIGIN_UDP_SENDMSG);
    PROCEED
}

#[cgroup_sock_addr(sendmsg6)]
pub fn vnat_udp_sendmsg6(ctx: SockAddrContext) -> i32 {
    // First: the flow recorded is the one the kernel then uses.
    crate::hide::reach(&ctx, AF_INET6);
    record(&ctx, AF_INET6, ORIGIN_UDP_SENDMSG);
    PROCEED
}

#[cgroup_sock_addr(recvmsg4)]
pub fn vnat_udp_recvmsg4(ctx: SockAddrContext) -> i32 {
    record(&ctx, AF_INET, ORIGIN_UDP_RECVMSG);
    // Last: the flow is recorded by the source it really has.
    crate::hide::show(&ctx, AF_INET, vnat_common::HIDE_SIDE_REMOTE);
    PROCEED
}

#[cgroup_sock_addr(recvmsg6)]
pub fn vnat_udp_recvmsg6(ctx: SockAddrContext) -> i32 {
    record(&ctx, AF_INET6, ORIGIN_UDP_RECVMSG);
    // Last: the flow is recorded by the source it really has.
    crate::hide::show(&ctx, AF_INET6, vnat_common::HIDE_SIDE_REMOTE);
    PROCEED
}

/// A TCP connect(): remember who made it, by socket cookie, for sock_ops
/// to put in the connection's record once it is established (see
/// `maps::Owner` for why this is not done in sock_ops). Kept for sockets of
/// every namespace: a container's connection is recorded as a guest.
#[inline(always)]
fn note_tcp_owner(ctx: &SockAddrContext) {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: `protocol` is a 4-byte field every sock_addr hook may read;
    // the verifier checks the access at load time.
    if unsafe { (*sa).protocol } != IPPROTO_TCP {
        return;
    }
    // SAFETY: the context pointer is the argument this helper requires
    // (ARG_PTR_TO_CTX); the verifier checks it at load time.
    let cookie = unsafe { bpf_get_socket_cookie(sa as *mut _) };
    let owner = Owner {
        // SAFETY: no arguments; sock_addr hooks run in the calling process.
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        pid: (bpf_get_current_pid_tgid() >> 32) as u32,
        // The low half is the uid (in the initial user namespace, so a
        // user namespace gives no new one).
        uid: bpf_get_current_uid_gid() as u32,
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
    };
    // A second connect() of the same socket (EALREADY, or again after a
    // failure; maybe by another process the socket was passed to) replaces
    // its entry, charged once, to the uid first charged: whoever removes
    // the entry gives the charge back to the uid it names.
    // SAFETY: not preallocated (see `maps`); the uid is copied out at once.
    if let Some(first) = unsafe { VNAT_CONNECTING.get(&cookie) }.map(|o| o.uid) {
        let owner = Owner {
            uid: first,
            ..owner
        };
        let _ = VNAT_CONNECTING.insert(&cookie, &owner, 0);
        return;
    }
    // Within its user's budget of sockets connecting at once, so that one
    // user's sockets that never connect cannot crowd out everyone's owners
    // (its connections beyond it are charged to `OWNER_UNSEEN`).
    if !charge(owner.uid, Charge::Connecting) {
        return;
    }
    if VNAT_CONNECTING.insert(&cookie, &owner, NOEXIST).is_err() {
        uncharge(owner.uid, Charge::Connecting);
    }
}

/// `TCP_SYN_SENT` and `TCP_CLOSE` from include/net/tcp_states.h, as
/// struct bpf_sock's `state` gives them.
const TCP_SYN_SENT: u32 = 2;
const TCP_CLOSE: u32 = 7;

/// Forget a UDP socket's (last) flow when it is closed. Older flows of an
/// unconnected socket that talked to many peers are garbage-collected by the
/// daemon.
#[cgroup_sock(sock_release)]
pub fn vnat_udp_release(ctx: SockContext) -> i32 {
    let sk = ctx.sock;
    // SAFETY: `sk` is this cgroup_sock program's context (struct bpf_sock),
    // and `protocol` is a field the verifier lets every such program read at
    // 4 bytes (it rejects any other access at load time).
    let protocol = unsafe { (*sk).protocol };
    if protocol == IPPROTO_TCP {
        // Only a socket that never reached ESTABLISHED can still have an
        // owner entry (sock_ops takes it out there): one closed while its
        // SYN was out, or whose connect failed. Every other TCP socket (an
        // accepted one, a listener, one closed after its exchange) is let
        // go without a map lookup, which on a host making thousands of
        // connections a second is a cache miss each.
        // SAFETY: as for `protocol`, a 4-byte field (struct bpf_sock's
        // `state`, Linux 5.1) every cgroup_sock program may read.
        let state = unsafe { (*sk).state };
        if state == TCP_SYN_SENT || state == TCP_CLOSE {
            release_connecting(sk);
        }
        return PROCEED;
    }
    if protocol != IPPROTO_UDP {
        return PROCEED;
    }
    // SAFETY: the context pointer is the argument this helper requires
    // (ARG_PTR_TO_CTX); the verifier checks it at load time.
    let cookie = unsafe { bpf_get_socket_cookie(sk as *mut _) };
    // SAFETY: not preallocated (see `maps`); the uid is copied out at once.
    let pending_uid = unsafe { VNAT_UDP_PENDING.get(&cookie) }.map(|p| p.record.owner_uid);
    if let Some(uid) = pending_uid {
        if VNAT_UDP_PENDING.remove(&cookie).is_ok() {
            uncharge(uid, Charge::Connecting);
        }
    }
    // SAFETY: aya marks `get` unsafe because the entry of a preallocated map
    // (an LRU map always is) can be deleted and its memory reused for
    // another key while we hold the reference. The key is copied out at
    // once. The socket is being released, so no sendmsg or connect of it
    // can rewrite the entry now; an insert on another CPU that evicts it
    // from a full map could still reuse it under us, and then the record
    // removed below is another flow's. The reference stays inside the map's
    // memory in any case, so nothing is read out of bounds.
    if let Some(key) = unsafe { VNAT_UDP_SOCKS.get(&cookie) } {
        let key = *key;
        // SAFETY: VNAT_CONNS is not preallocated; the owner is copied out
        // at once (a record replaced meanwhile only gives the charge back
        // to another owner, which vnatd's recount corrects).
        let owner = unsafe { VNAT_CONNS.get(&key) }.map(|r| r.owner_uid);
        if let Some(owner) = owner {
            if VNAT_CONNS.remove(&key).is_ok() {
                udp_count_add(u64::MAX);
                uncharge(owner, Charge::Udp);
            }
        }
        let _ = VNAT_UDP_SOCKS.remove(&cookie);
    }
    // Its other records (an unconnected socket's other peers) go at vnatd's
    // next housekeeping, which recounts.
    let _ = VNAT_UDP_PER_SOCK.remove(&cookie);
    PROCEED
}

/// A TCP socket released before its connection was established (refused,
/// timed out, closed while connecting): its owner entry goes, and its
/// charge is given back.
#[inline(always)]
fn release_connecting(sk: *mut bpf_sock) {
    // SAFETY: the context pointer is the argument this helper requires
    // (ARG_PTR_TO_CTX); the verifier checks it at load time.
    let cookie = unsafe { bpf_get_socket_cookie(sk as *mut _) };
    // SAFETY: not preallocated (see `maps`); the uid is copied out at once.
    let Some(uid) = (unsafe { VNAT_CONNECTING.get(&cookie) }).map(|o| o.uid) else {
        return;
    };
    if VNAT_CONNECTING.remove(&cookie).is_ok() {
        uncharge(uid, Charge::Connecting);
    }
}

/// The socket's own 4-tuple (`src` = local). `dst` is zero if unconnected.
#[inline(always)]
fn sock_key(sk: *mut bpf_sock) -> Option<FlowKey> {
    let mut key = FlowKey {
        proto: PROTO_UDP,
        ..FlowKey::default()
    };
    // SAFETY: `sk` is the non-null socket pointer of the sock_addr context
    // (checked by the caller); the verifier types it as a socket and checks
    // every load from it against struct bpf_sock's readable fields and
    // sizes. The reads are 4-byte loads of family, src_ip4, dst_ip4 and
    // src_port, a 2-byte load of dst_port (a __be16), and `read_words` over
    // src_ip6 and dst_ip6, each four u32 long, which is its precondition.
    unsafe {
        match (*sk).family {
            2 => {
                key.family = AF_INET;
                key.src_addr_be[0] = (*sk).src_ip4;
                key.dst_addr_be[0] = (*sk).dst_ip4;
            }
            10 => {
                key.family = AF_INET6;
                read_words(
                    core::ptr::addr_of!((*sk).src_ip6) as *const u32,
                    &mut key.src_addr_be,
                );
                read_words(
                    core::ptr::addr_of!((*sk).dst_ip6) as *const u32,
                    &mut key.dst_addr_be,
                );
            }
            _ => return None,
        }
        // src_port is host order; dst_port is network order (bpf.h).
        key.src_port_be = ((*sk).src_port as u16).to_be();
        key.dst_port_be = core::ptr::read_volatile(core::ptr::addr_of!((*sk).dst_port));
    }
    Some(key)
}

/// Context arrays of addresses may only be read one 32-bit word at a time.
///
/// # Safety
///
/// `p` must point to four consecutive u32 that the program may read one
/// at a time: an IPv6 address field of a context or socket structure that
/// the verifier allows 4-byte loads from (the verifier refuses the program
/// otherwise).
#[inline(always)]
unsafe fn read_words(p: *const u32, out: &mut [u32; 4]) {
    // SAFETY: the caller guarantees that `p` points to four readable u32,
    // so `p` to `p.add(3)` are all in bounds.
    unsafe {
        out[0] = core::ptr::read_volatile(p);
        out[1] = core::ptr::read_volatile(p.add(1));
        out[2] = core::ptr::read_volatile(p.add(2));
        out[3] = core::ptr::read_volatile(p.add(3));
    }
}

#[inline(always)]
fn record(ctx: &SockAddrContext, family: u8, origin: u8) {
    let sa: *mut bpf_sock_addr = ctx.sock_addr;
    // SAFETY: `sa` is this sock_addr program's context; the verifier checks
    // every load from it against the fields and sizes it allows
    // (sock_addr_is_valid_access) at load time. `protocol` is a 4-byte field
    // every sock_addr hook may read.
    if unsafe { (*sa).protocol } != IPPROTO_UDP {
        return;
    }
    // SAFETY: the context pointer is the argument this helper takes; the
    // verifier checks it at load time.
    let netns = unsafe { bpf_get_netns_cookie(sa as *mut _) };
    let ours = netns_is_ours(netns);
    // Another namespace's socket (a container's) is recorded as a guest
    // only when it sends: a datagram it merely receives may come from a
    // spoofed source, and guests have no budget of their own per socket.
    if !ours && origin == ORIGIN_UDP_RECVMSG {
        count(STAT_OTHER_NETNS);
        return;
    }
    // SAFETY: an 8-byte read of the context's `sk` field, the one access
    // the verifier allows on it; it yields the socket pointer, checked for
    // null below.
    let sk = unsafe { (*sa).__bindgen_anon_1.sk };
    if sk.is_null() {
        return;
    }
    let Some(mut key) = sock_key(sk) else { return };
    // The peer is the address the application named (user_ip*, user_port),
    // not the socket's current destination (unconnected sockets have none).
    let mut peer = [0u32; 4];
    // SAFETY: 4-byte reads of the context fields user_ip4 and user_port, and
    // `read_words` over user_ip6 (four u32, read one at a time as the
    // verifier requires); all checked against the context at load time.
    unsafe {
        if family == AF_INET {
            peer[0] = (*sa).user_ip4;
        } else {
            read_words(core::ptr::addr_of!((*sa).user_ip6) as *const u32, &mut peer);
        }
        key.dst_port_be = (*sa).user_port as u16;
    }
    // An IPv4 peer of an AF_INET6 socket (dual-stack): sendmsg4 runs for it
    // (udpv6_sendmsg hands a v4-mapped destination to udp_sendmsg), while
    // connect6 and recvmsg6 show the peer as ::ffff:a.b.c.d.
    let peer_v4 = if family == AF_INET {
        Some(peer[0])
    } else {
        v4_of_mapped(&peer)
    };
    match (key.family, peer_v4) {
        (AF_INET, Some(dst)) => key.dst_addr_be = [dst, 0, 0, 0],
        (AF_INET6, None) => key.dst_addr_be = peer,
        (AF_INET6, Some(dst)) => {
            // Recorded as the IPv4 flow it is on the wire, as the peer
            // names it (DESIGN.md section 3, dual-stack sockets).
            let Some(src) = v4_of_mapped_or_any(&key.src_addr_be) else {
                return;
            };
            key.family = AF_INET;
            key.src_addr_be = [src, 0, 0, 0];
            key.dst_addr_be = [dst, 0, 0, 0];
        }
        // An AF_INET socket with an IPv6 peer: the kernel refuses it anyway.
        _ => return,
    }
    // Loopback never leaves the host: nothing to move (and a local user
    // once filled the map with it).
    if key.is_loopback() {
        count(STAT_LOOPBACK_IGNORED);
        return;
    }
    // SAFETY: a helper without arguments or preconditions.
    let now = unsafe { bpf_ktime_get_boot_ns() };
    let dir = if origin == ORIGIN_UDP_RECVMSG {
        UDP_DIR_RECV
    } else {
        UDP_DIR_SEND
    };
    if !ours && key.src_port_be != 0 {
        record_guest(sa, netns, key, now, origin);
        return;
    }
    if let Some(existing) = VNAT_CONNS.get_ptr_mut(&key) {
        // Refresh at most once a second: a busy sender must not write the
        // map on every datagram.
        // SAFETY: `existing` is the non-null pointer the lookup returned, to
        // a whole ConnRecord in the map. Elements go back to the allocator
        // only after an RCU grace period and this program runs under RCU,
        // so the memory stays valid for the run. Senders of the flow on
        // other CPUs may store the same field at once: aligned 8-byte
        // stores do not tear, and any of the timestamps will do. If the
        // record was deleted meanwhile and its element reused for another
        // flow, that flow's timestamp is refreshed instead, which only
        // delays its garbage collection.
        // The same holds for `udp_dirs`, a byte only ever or-ed with a bit
        // (written only when the bit is missing: once per flow and way).
        unsafe {
            if now.wrapping_sub((*existing).last_seen_ns) > UDP_REFRESH_NS {
                (*existing).last_seen_ns = now;
            }
            if (*existing).udp_dirs & dir == 0 {
                (*existing).udp_dirs |= dir;
            }
        }
        return;
    }
    let rec = new_record(sa, netns, now, origin, dir);
    let cookie = rec.cookie;
    if key.src_port_be == 0 {
        // connect() on an unbound socket: the kernel picks the local port
        // after this hook. Userspace completes the record by cookie (a
        // guest's too: the record's namespace tells it apart).
        // A second connect() of the same socket replaces its entry, charged
        // once, to the uid first charged (as for TCP's, `note_tcp_owner`).
        // SAFETY: not preallocated (see `maps`); the uid is copied out at
        // once.
        let first = unsafe { VNAT_UDP_PENDING.get(&cookie) }.map(|p| p.record.owner_uid);
        let mut pending = UdpPending { key, record: rec };
        if let Some(uid) = first {
            pending.record.owner_uid = uid;
            let _ = VNAT_UDP_PENDING.insert(&cookie, &pending, 0);
            return;
        }
        // Within its user's budget of sockets connecting at once (shared
        // with TCP's), so that one user's unbound sockets cannot crowd out
        // everyone's. Beyond it the flow is not recorded here; vnatd's
        // listing adopts a connected socket it finds without a record.
        let uid = pending.record.owner_uid;
        if !charge(uid, Charge::Connecting) {
            return;
        }
        if VNAT_UDP_PENDING.insert(&cookie, &pending, NOEXIST).is_err() {
            uncharge(uid, Charge::Connecting);
        }
        return;
    }
    // Separate budgets: UDP records never take the room TCP's need, and
    // one socket (a server receiving from spoofed sources) never takes all
    // of UDP's. Both checks may let a few more in under concurrent inserts.
    if VNAT_UDP_COUNT.get(0).is_some_and(|n| *n >= udp_total()) {
        count(STAT_UDP_BUDGET_FULL);
        return;
    }
    // SAFETY: as in `vnat_udp_release`: the value is copied out at once,
    // and a reused element only makes the cap count another socket's.
    let on_socket = unsafe { VNAT_UDP_PER_SOCK.get(&cookie) }
        .copied()
        .unwrap_or(0);
    if on_socket >= UDP_PER_SOCKET_MAX {
        count(STAT_UDP_SOCKET_FULL);
        return;
    }
    // And one user never takes all of UDP's (`owners`).
    if !charge(rec.owner_uid, Charge::Udp) {
        return;
    }
    if VNAT_CONNS.insert(&key, &rec, 0).is_err() {
        uncharge(rec.owner_uid, Charge::Udp);
        count(STAT_CONNS_MAP_FULL);
        return;
    }
    udp_count_add(1);
    let _ = VNAT_UDP_PER_SOCK.insert(&cookie, &(on_socket + 1), 0);
    let _ = VNAT_UDP_SOCKS.insert(&cookie, &key, 0);
    count(STAT_UDP_RECORDED);
}

/// A guest's UDP flow (a container's socket that sends to `key`'s peer):
/// recorded in VNAT_GUESTS once, refreshed at most once a second. vnatd
/// drops it when the host's NAT has forgotten the flow.
#[inline(always)]
fn record_guest(sa: *mut bpf_sock_addr, netns: u64, key: FlowKey, now: u64, origin: u8) {
    let guest = GuestKey {
        netns_cookie: netns,
        flow: key,
    };
    if let Some(existing) = VNAT_GUESTS.get_ptr_mut(&guest) {
        // SAFETY: as for the host's records in `record`: a pointer the
        // lookup just returned, valid under RCU for this run; a racing or
        // reused element only gets a timestamp.
        unsafe {
            if now.wrapping_sub((*existing).last_seen_ns) > UDP_REFRESH_NS {
                (*existing).last_seen_ns = now;
            }
        }
        return;
    }
    let rec = new_record(sa, netns, now, origin, UDP_DIR_SEND);
    if !charge(rec.owner_uid, Charge::Guest) {
        return;
    }
    if VNAT_GUESTS.insert(&guest, &rec, 0).is_err() {
        uncharge(rec.owner_uid, Charge::Guest);
        count(STAT_GUESTS_MAP_FULL);
        return;
    }
    count(STAT_GUEST_RECORDED);
}

/// A new UDP flow's record: the socket, the process sending or receiving,
/// and which way (`dir`) it used the flow.
#[inline(always)]
fn new_record(sa: *mut bpf_sock_addr, netns: u64, now: u64, origin: u8, dir: u8) -> ConnRecord {
    ConnRecord {
        // SAFETY: the context pointer is the argument this helper requires
        // (ARG_PTR_TO_CTX); the verifier checks it at load time.
        cookie: unsafe { bpf_get_socket_cookie(sa as *mut _) },
        // SAFETY: no arguments; sock_addr hooks run in the calling process.
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        netns_cookie: netns,
        first_seen_ns: now,
        last_seen_ns: now,
        pid: (bpf_get_current_pid_tgid() >> 32) as u32,
        origin,
        udp_dirs: dir,
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
        // The low half is the uid, in the initial user namespace.
        owner_uid: bpf_get_current_uid_gid() as u32,
        ..ConnRecord::default()
    }
}
