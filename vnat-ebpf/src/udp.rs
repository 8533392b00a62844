//! cgroup sock_addr hooks that record UDP flows, so that UDP is virtualized
//! and translated like TCP (DESIGN.md §3). UDP has no connection events, so
//! flows are recorded where the kernel tells us about a peer: connect(),
//! sendmsg() with a destination, recvmsg() asking for the source. Records are
//! removed when the socket is released.

use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_addr},
    helpers::{
        bpf_get_current_cgroup_id, bpf_get_current_comm, bpf_get_current_pid_tgid,
        bpf_get_netns_cookie, bpf_get_socket_cookie, bpf_ktime_get_boot_ns,
    },
    macros::{cgroup_sock, cgroup_sock_addr, map},
    maps::LruHashMap,
    programs::{SockAddrContext, SockContext},
};
use vnat_common::{
    v4_of_mapped, v4_of_mapped_or_any, ConnRecord, FlowKey, UdpPending, AF_INET, AF_INET6,
    ORIGIN_UDP_CONNECT, ORIGIN_UDP_RECVMSG, ORIGIN_UDP_SENDMSG, PROTO_UDP, STAT_CONNS_MAP_FULL,
    STAT_OTHER_NETNS, STAT_UDP_RECORDED, UDP_PENDING_MAX_ENTRIES, UDP_REFRESH_NS,
};

use crate::maps::{count, netns_is_ours, VNAT_CONNS};

const IPPROTO_UDP: u32 = 17;
/// sock_addr programs must return 1 ("proceed"); 0 would fail the syscall.
const PROCEED: i32 = 1;

#[map]
pub static VNAT_UDP_PENDING: LruHashMap<u64, UdpPending> =
    LruHashMap::pinned(UDP_PENDING_MAX_ENTRIES, 0);

/// Socket cookie to the last flow recorded for it. The release hook cannot
/// read a socket's addresses (the verifier allows src_* only in post_bind
/// programs), so it finds the record to remove through this.
#[map]
static VNAT_UDP_SOCKS: LruHashMap<u64, FlowKey> = LruHashMap::with_max_entries(65_536, 0);

#[cgroup_sock_addr(connect4)]
pub fn vnat_udp_connect4(ctx: SockAddrContext) -> i32 {
    record(&ctx, AF_INET, ORIGIN_UDP_CONNECT);
    PROCEED
}

#[cgroup_sock_addr(connect6)]
pub fn vnat_udp_connect6(ctx: SockAddrContext) -> i32 {
    record(&ctx, AF_INET6, ORIGIN_UDP_CONNECT);
    PROCEED
}

#[cgroup_sock_addr(sendmsg4)]
pub fn vnat_udp_sendmsg4(ctx: SockAddrContext) -> i32 {
    record(&ctx, AF_INET, ORIGIN_UDP_SENDMSG);
    PROCEED
}

#[cgroup_sock_addr(sendmsg6)]
pub fn vnat_udp_sendmsg6(ctx: SockAddrContext) -> i32 {
    record(&ctx, AF_INET6, ORIGIN_UDP_SENDMSG);
    PROCEED
}

#[cgroup_sock_addr(recvmsg4)]
pub fn vnat_udp_recvmsg4(ctx: SockAddrContext) -> i32 {
    record(&ctx, AF_INET, ORIGIN_UDP_RECVMSG);
    PROCEED
}

#[cgroup_sock_addr(recvmsg6)]
pub fn vnat_udp_recvmsg6(ctx: SockAddrContext) -> i32 {
    record(&ctx, AF_INET6, ORIGIN_UDP_RECVMSG);
    PROCEED
}

/// Forget a UDP socket's (last) flow when it is closed. Older flows of an
/// unconnected socket that talked to many peers are garbage-collected by the
/// daemon.
#[cgroup_sock(sock_release)]
pub fn vnat_udp_release(ctx: SockContext) -> i32 {
    let sk = ctx.sock;
    if unsafe { (*sk).protocol } != IPPROTO_UDP {
        return PROCEED;
    }
    let cookie = unsafe { bpf_get_socket_cookie(sk as *mut _) };
    let _ = VNAT_UDP_PENDING.remove(&cookie);
    if let Some(key) = unsafe { VNAT_UDP_SOCKS.get(&cookie) } {
        let key = *key;
        let _ = VNAT_CONNS.remove(&key);
        let _ = VNAT_UDP_SOCKS.remove(&cookie);
    }
    PROCEED
}

/// The socket's own 4-tuple (`src` = local). `dst` is zero if unconnected.
#[inline(always)]
fn sock_key(sk: *mut bpf_sock) -> Option<FlowKey> {
    let mut key = FlowKey {
        proto: PROTO_UDP,
        ..FlowKey::default()
    };
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
#[inline(always)]
unsafe fn read_words(p: *const u32, out: &mut [u32; 4]) {
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
    if unsafe { (*sa).protocol } != IPPROTO_UDP {
        return;
    }
    let netns = unsafe { bpf_get_netns_cookie(sa as *mut _) };
    if !netns_is_ours(netns) {
        count(STAT_OTHER_NETNS);
        return;
    }
    let sk = unsafe { (*sa).__bindgen_anon_1.sk };
    if sk.is_null() {
        return;
    }
    let Some(mut key) = sock_key(sk) else { return };
    // The peer is the address the application named (user_ip*, user_port),
    // not the socket's current destination (unconnected sockets have none).
    let mut peer = [0u32; 4];
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
    let now = unsafe { bpf_ktime_get_boot_ns() };
    if let Some(existing) = VNAT_CONNS.get_ptr_mut(&key) {
        // Refresh at most once a second: a busy sender must not write the
        // map on every datagram.
        unsafe {
            if now.wrapping_sub((*existing).last_seen_ns) > UDP_REFRESH_NS {
                (*existing).last_seen_ns = now;
            }
        }
        return;
    }
    let cookie = unsafe { bpf_get_socket_cookie(sa as *mut _) };
    let rec = ConnRecord {
        cookie,
        cgroup_id: unsafe { bpf_get_current_cgroup_id() },
        netns_cookie: netns,
        first_seen_ns: now,
        last_seen_ns: now,
        pid: (bpf_get_current_pid_tgid() >> 32) as u32,
        origin,
        comm: bpf_get_current_comm().unwrap_or([0; 16]),
        ..ConnRecord::default()
    };
    if key.src_port_be == 0 {
        // connect() on an unbound socket: the kernel picks the local port
        // after this hook. Userspace completes the record by cookie.
        let pending = UdpPending { key, record: rec };
        let _ = VNAT_UDP_PENDING.insert(&cookie, &pending, 0);
        return;
    }
    if VNAT_CONNS.insert(&key, &rec, 0).is_err() {
        count(STAT_CONNS_MAP_FULL);
        return;
    }
    let _ = VNAT_UDP_SOCKS.insert(&cookie, &key, 0);
    count(STAT_UDP_RECORDED);
}
