//! Hide location (paper section 3.4.1; `vnatctl enable --hide-location`).
//!
//! The applications of a hiding cgroup keep seeing a host that moved at
//! its virtual address, also in connections and datagrams that start after
//! the move: getpeername() and accept() (the getpeername hooks) and
//! recvmsg() report a moved peer's physical address as its virtual one,
//! getsockname() this host's; a connect() or sendmsg() to a moved peer's
//! virtual address goes to where it is now, and a bind() to this host's
//! moved-away address binds where its connections went. vnatd writes which
//! address stands for which (`VNAT_HIDE_ADDRS`) from its moved connections.
//!
//! A connect() or sendmsg() to a moved peer's old address is redirected
//! only for the endpoints (address and port) the peer held there
//! (`VNAT_HIDE_REACH`, from vnatd; `VNAT_HIDE_SEEN`, the endpoints these
//! programs showed in place of the peer's new ones), never for the whole
//! address: another host may answer there now (see `vnat_common`'s
//! `hidereach`).
//!
//! Existing connections need none of this: their sockets keep their
//! virtual endpoints and tc translates their packets. So an address is
//! looked up only when some cgroup hides (`CFG_F_HIDE`), and the cgroup
//! only when the address has an entry.

use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_addr},
    helpers::{bpf_get_current_ancestor_cgroup_id, bpf_get_netns_cookie},
    macros::{cgroup_sock_addr, map},
    maps::{HashMap, LruHashMap},
    programs::SockAddrContext,
};
use vnat_common::{
    v4_of_mapped, FlowKey, HideKey, HideReachKey, HideReachValue, HideValue, AF_INET, AF_INET6,
    CFG_F_HIDE, HIDE_ADDRS_MAX_ENTRIES, HIDE_CGROUPS_MAX_ENTRIES, HIDE_FLOWS_MAX_ENTRIES,
    HIDE_F_REACH, HIDE_F_SHOW, HIDE_MAX_LEVEL, HIDE_REACH_MAX_ENTRIES, HIDE_SEEN_MAX_ENTRIES,
    HIDE_SIDE_LOCAL, HIDE_SIDE_REMOTE, PROTO_TCP, PROTO_UDP, STAT_HIDE_REDIRECTED, STAT_HIDE_SHOWN,
    V4_MAPPED_WORD2_BE,
};

use crate::maps::{count, netns_is_ours, VNAT_CONFIG};

/// BPF_F_NO_PREALLOC, as in `maps`.
const NO_PREALLOC: u32 = 1;
/// sock_addr programs return 1 ("proceed"); getpeername, getsockname and
/// recvmsg programs may return nothing else.
const PROCEED: i32 = 1;

#[map]
pub static VNAT_HIDE_CGROUPS: HashMap<u64, u32> =
    HashMap::pinned(HIDE_CGROUPS_MAX_ENTRIES, NO_PREALLOC);

#[map]
pub static VNAT_HIDE_ADDRS: HashMap<HideKey, HideValue> =
    HashMap::pinned(HIDE_ADDRS_MAX_ENTRIES, NO_PREALLOC);

#[map]
pub static VNAT_HIDE_FLOWS: HashMap<FlowKey, u32> =
    HashMap::pinned(HIDE_FLOWS_MAX_ENTRIES, NO_PREALLOC);

#[map]
pub static VNAT_HIDE_REACH: HashMap<HideReachKey, HideReachValue> =
    HashMap::pinned(HIDE_REACH_MAX_ENTRIES, NO_PREALLOC);

#[map]
pub static VNAT_HIDE_SEEN: LruHashMap<HideReachKey, HideReachValue> =
    LruHashMap::pinned(HIDE_SEEN_MAX_ENTRIES, 0);

/// The address in the context (`user_ip4` or `user_ip6`), as the key of
/// `VNAT_HIDE_ADDRS` names it: an IPv4 address that a dual-stack socket
/// shows mapped is looked up as IPv4.
struct UserAddr {
    family: u8,
    addr: [u32; 4],
    /// Shown as `::ffff:a.b.c.d` by an AF_INET6 socket.
    mapped: bool,
}

#[inline(always)]
fn user_addr(sa: *mut bpf_sock_addr, family: u8) -> UserAddr {
    let mut addr = [0u32; 4];
    // SAFETY: `sa` is this sock_addr program's context; 4-byte loads of
    // `user_ip4` and of each word of `user_ip6` are what the verifier allows
    // every sock_addr hook (it checks them at load time).
    unsafe {
        if family == AF_INET {
            addr[0] = core::ptr::read_volatile(core::ptr::addr_of!((*sa).user_ip4));
        } else {
            let p = core::ptr::addr_of!((*sa).user_ip6) as *const u32;
            addr[0] = core::ptr::read_volatile(p);
            addr[1] = core::ptr::read_volatile(p.add(1));
            addr[2] = core::ptr::read_volatile(p.add(2));
            addr[3] = core::ptr::read_volatile(p.add(3));
        }
    }
    if family == AF_INET6 {
        if let Some(v4) = v4_of_mapped(&addr) {
            return UserAddr {
                family: AF_INET,
                addr: [v4, 0, 0, 0],
                mapped: true,
            };
        }
    }
    UserAddr {
        family,
        addr,
        mapped: false,
    }
}

/// Write `to` (of `at`'s family) where `at` was read from.
#[inline(always)]
fn set_user_addr(sa: *mut bpf_sock_addr, at: &UserAddr, to: &[u32; 4]) {
    // SAFETY: `sa` is this program's context; the getpeername, getsockname,
    // recvmsg, connect, sendmsg and bind hooks (the only callers) may store
    // 4 bytes to `user_ip4` and to each word of `user_ip6`, which the
    // verifier checks at load time.
    unsafe {
        if at.family == AF_INET && !at.mapped {
            core::ptr::write_volatile(core::ptr::addr_of_mut!((*sa).user_ip4), to[0]);
        } else {
            let p = core::ptr::addr_of_mut!((*sa).user_ip6) as *mut u32;
            if at.mapped {
                core::ptr::write_volatile(p, 0);
                core::ptr::write_volatile(p.add(1), 0);
                core::ptr::write_volatile(p.add(2), V4_MAPPED_WORD2_BE);
                core::ptr::write_volatile(p.add(3), to[0]);
            } else {
                core::ptr::write_volatile(p, to[0]);
                core::ptr::write_volatile(p.add(1), to[1]);
                core::ptr::write_volatile(p.add(2), to[2]);
                core::ptr::write_volatile(p.add(3), to[3]);
            }
        }
    }
}

/// The entry for an address, if some cgroup hides at all and the socket
/// is in this vnatd's network namespace (the table is about this
/// namespace's connections; a container's socket in a hiding cgroup is
/// left alone).
#[inline(always)]
fn entry(sa: *mut bpf_sock_addr, at: &UserAddr, side: u8) -> Option<HideValue> {
    if !hiding_here(sa) {
        return None;
    }
    let key = HideKey {
        addr_be: at.addr,
        family: at.family,
        side,
        _pad: [0; 2],
    };
    // SAFETY: aya marks `get` unsafe because another CPU may delete the
    // entry and its memory be reused while the reference is held; the value
    // is copied out at once, and a reused element yields another entry's
    // (whole, aligned) value, which only mis-hides one call.
    unsafe { VNAT_HIDE_ADDRS.get(&key) }.copied()
}

/// Some cgroup hides, and the socket is in this vnatd's network namespace.
#[inline(always)]
fn hiding_here(sa: *mut bpf_sock_addr) -> bool {
    match VNAT_CONFIG.get(0) {
        Some(cfg) if cfg.flags & CFG_F_HIDE != 0 => {}
        _ => return false,
    }
    // SAFETY: the context pointer is the argument this helper takes; the
    // verifier checks it at load time.
    netns_is_ours(unsafe { bpf_get_netns_cookie(sa as *mut _) })
}

/// The endpoint `at`:`port_be` (`proto`) as the reach maps key it.
#[inline(always)]
fn reach_key(at: &UserAddr, port_be: u16, proto: u8) -> HideReachKey {
    HideReachKey {
        addr_be: at.addr,
        port_be,
        family: at.family,
        proto,
    }
}

/// The context's `user_port` (network order in the low 16 bits).
#[inline(always)]
fn user_port(sa: *mut bpf_sock_addr) -> u16 {
    // SAFETY: a 4-byte load of `user_port`, which every sock_addr hook may
    // read (checked at load time).
    unsafe { (*sa).user_port as u16 }
}

/// Whether the calling process's cgroup, or one of its ancestors, hides.
#[inline(always)]
fn caller_hides() -> bool {
    let mut level: u32 = 0;
    while level <= HIDE_MAX_LEVEL {
        // SAFETY: a helper with one integer argument and no precondition:
        // it returns 0 when the caller's cgroup is not that deep.
        let id = unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
        if id == 0 {
            return false;
        }
        if VNAT_HIDE_CGROUPS.get_ptr(&id).is_some() {
            return true;
        }
        level += 1;
    }
    false
}

/// Report the virtual address of a moved host instead of its physical one
/// (getpeername, accept, recvmsg: `HIDE_SIDE_REMOTE`; getsockname:
/// `HIDE_SIDE_LOCAL`).
#[inline(always)]
pub fn show(ctx: &SockAddrContext, family: u8, side: u8) {
    let sa = ctx.sock_addr;
    let at = user_addr(sa, family);
    let Some(v) = entry(sa, &at, side) else {
        return;
    };
    if v.flags & HIDE_F_SHOW == 0 || !caller_hides() {
        return;
    }
    set_user_addr(sa, &at, &v.show_be);
    count(STAT_HIDE_SHOWN);
    if side == HIDE_SIDE_REMOTE {
        // The application now knows this endpoint by the shown address:
        // what it sends there goes back to where the packets came from.
        // SAFETY: 4-byte load of `protocol`, which every sock_addr hook
        // may read (checked at load time).
        let proto = unsafe { (*sa).protocol } as u8;
        let port = user_port(sa);
        let shown = UserAddr {
            family: at.family,
            addr: v.show_be,
            mapped: at.mapped,
        };
        let to = HideReachValue {
            addr_be: at.addr,
            port_be: port,
            _pad: [0; 2],
        };
        // A full LRU map drops its oldest entry; a failed update only
        // leaves this endpoint unreached, as it was before the show.
        let _ = VNAT_HIDE_SEEN.insert(&reach_key(&shown, port, proto), &to, 0);
    }
}

/// A connect() or sendmsg() to an endpoint a moved peer held goes to where
/// that endpoint is now, unless the flow is one of the translated ones (tc
/// translates those, from the virtual endpoints the socket has). Another
/// port of the same address is left alone: it may be another host's.
#[inline(always)]
pub fn reach(ctx: &SockAddrContext, family: u8) {
    let sa = ctx.sock_addr;
    // SAFETY: 4-byte load of `protocol`, which every sock_addr hook may
    // read (checked at load time).
    let proto = unsafe { (*sa).protocol };
    if proto != PROTO_TCP as u32 && proto != PROTO_UDP as u32 {
        return;
    }
    if !hiding_here(sa) {
        return;
    }
    let at = user_addr(sa, family);
    let port = user_port(sa);
    let key = reach_key(&at, port, proto as u8);
    // SAFETY: as in `entry`: the value is copied out at once; a reused
    // element yields another entry's whole value, which only misdirects
    // one call to another endpoint the peer held.
    let Some(to) = (unsafe { VNAT_HIDE_REACH.get(&key) })
        .or_else(|| unsafe { VNAT_HIDE_SEEN.get(&key) })
        .copied()
    else {
        return;
    };
    // SAFETY: an 8-byte read of the context's `sk` field, the one access
    // the verifier allows on it; the pointer is checked for null below.
    let sk: *mut bpf_sock = unsafe { (*sa).__bindgen_anon_1.sk };
    if !sk.is_null() {
        let mut flow = FlowKey {
            dst_addr_be: at.addr,
            family: at.family,
            proto: proto as u8,
            ..FlowKey::default()
        };
        // SAFETY: `sk` is the non-null socket of the context; a 4-byte
        // load of `src_port` (host order) is allowed and checked at load
        // time.
        unsafe {
            flow.src_port_be = ((*sk).src_port as u16).to_be();
        }
        flow.dst_port_be = port;
        if VNAT_HIDE_FLOWS.get_ptr(&flow).is_some() {
            return;
        }
    }
    if !caller_hides() {
        return;
    }
    set_user_addr(sa, &at, &to.addr_be);
    // SAFETY: connect and sendmsg hooks (the only callers) may store 4
    // bytes to `user_port` (checked at load time).
    unsafe {
        core::ptr::write_volatile(
            core::ptr::addr_of_mut!((*sa).user_port),
            u32::from(to.port_be),
        );
    }
    count(STAT_HIDE_REDIRECTED);
}

/// A bind() to an address this host moved away from binds where its
/// connections went instead (and getsockname() shows the old one).
#[inline(always)]
fn rebind(ctx: &SockAddrContext, family: u8) {
    let sa = ctx.sock_addr;
    let at = user_addr(sa, family);
    let Some(v) = entry(sa, &at, HIDE_SIDE_LOCAL) else {
        return;
    };
    if v.flags & HIDE_F_REACH == 0 || !caller_hides() {
        return;
    }
    set_user_addr(sa, &at, &v.reach_be);
    count(STAT_HIDE_REDIRECTED);
}

#[cgroup_sock_addr(getpeername4)]
pub fn vnat_hide_getpeername4(ctx: SockAddrContext) -> i32 {
    show(&ctx, AF_INET, HIDE_SIDE_REMOTE);
    PROCEED
}

#[cgroup_sock_addr(getpeername6)]
pub fn vnat_hide_getpeername6(ctx: SockAddrContext) -> i32 {
    show(&ctx, AF_INET6, HIDE_SIDE_REMOTE);
    PROCEED
}

#[cgroup_sock_addr(getsockname4)]
pub fn vnat_hide_getsockname4(ctx: SockAddrContext) -> i32 {
    show(&ctx, AF_INET, HIDE_SIDE_LOCAL);
    PROCEED
}

#[cgroup_sock_addr(getsockname6)]
pub fn vnat_hide_getsockname6(ctx: SockAddrContext) -> i32 {
    show(&ctx, AF_INET6, HIDE_SIDE_LOCAL);
    PROCEED
}

#[cgroup_sock_addr(bind4)]
pub fn vnat_hide_bind4(ctx: SockAddrContext) -> i32 {
    rebind(&ctx, AF_INET);
    PROCEED
}

#[cgroup_sock_addr(bind6)]
pub fn vnat_hide_bind6(ctx: SockAddrContext) -> i32 {
    rebind(&ctx, AF_INET6);
    PROCEED
}
