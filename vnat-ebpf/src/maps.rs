//! Maps shared by every program. All are pinned by name, so a restarted
//! vnatd (and every program instance it loads) reuses the same maps and
//! translation survives the process that loaded them.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, PerCpuArray},
};
pub use vnat_common::Owner;
use vnat_common::{
    ConnRecord, DatapathConfig, FlowKey, GuestKey, NatRewrite, RebindKey, RebindValue,
    UnvalidatedBudget, CFG_F_BIND_DIVERT, CFG_F_NAT_EMPTY, CFG_F_NETNS_FILTER, CFG_F_REBINDING,
    CONNECTING_MAX_ENTRIES, CONNS_MAX_ENTRIES, GUESTS_MAX_ENTRIES, NAT_MAX_ENTRIES,
    REBIND_MAX_ENTRIES, STAT_COUNT, UNVALIDATED_MAX_ENTRIES,
};

/// BPF_F_NO_PREALLOC: entries are allocated on insert, so the capacity costs
/// nothing until used.
pub(crate) const NO_PREALLOC: u32 = 1;

#[map]
pub static VNAT_CONNS: HashMap<FlowKey, ConnRecord> =
    HashMap::pinned(CONNS_MAX_ENTRIES, NO_PREALLOC);

/// Connections of sockets in other network namespaces (containers behind
/// this host); vnatd decides from the host's NAT whether one is its own.
#[map]
pub static VNAT_GUESTS: HashMap<GuestKey, ConnRecord> =
    HashMap::pinned(GUESTS_MAX_ENTRIES, NO_PREALLOC);

#[map]
pub static VNAT_EGRESS_NAT: HashMap<FlowKey, NatRewrite> =
    HashMap::pinned(NAT_MAX_ENTRIES, NO_PREALLOC);

#[map]
pub static VNAT_INGRESS_NAT: HashMap<FlowKey, NatRewrite> =
    HashMap::pinned(NAT_MAX_ENTRIES, NO_PREALLOC);

/// Addresses this host has only on `lo` now (`vnat_common::MAP_GONE`).
#[map]
pub static VNAT_GONE: HashMap<FlowKey, u32> =
    HashMap::pinned(vnat_common::GONE_MAX_ENTRIES, NO_PREALLOC);

/// What flows sending to a peer address not validated yet may still send
/// there (`vnat_common::NAT_F_BUDGET`), by egress key.
#[map]
pub static VNAT_UNVALIDATED: HashMap<FlowKey, UnvalidatedBudget> =
    HashMap::pinned(UNVALIDATED_MAX_ENTRIES, NO_PREALLOC);

#[map]
pub static VNAT_REBIND: HashMap<RebindKey, RebindValue> =
    HashMap::pinned(REBIND_MAX_ENTRIES, NO_PREALLOC);

/// NAT guards (`vnat_common::MAP_GUARD`), keyed like `VNAT_REBIND` with slot
/// 0: one per NAT address and port of ours where a peer behind that NAT has
/// a connection.
#[map]
pub static VNAT_GUARD: HashMap<RebindKey, vnat_common::GuardValue> =
    HashMap::pinned(vnat_common::GUARD_MAX_ENTRIES, NO_PREALLOC);

/// Who called connect() on a TCP socket (`vnat_common::MAP_CONNECTING`).
///
/// Written by the connect4/connect6 hooks (`udp.rs`), not by sock_ops'
/// TCP_CONNECT_CB: sock_ops may not call bpf_get_current_cgroup_id before
/// Linux 6.5 ("unknown func bpf_get_current_cgroup_id#80" on 6.1) nor
/// bpf_get_current_comm at all up to 6.12 at least ("program of this type
/// cannot use helper bpf_get_current_comm#16"), while the cgroup sock_addr
/// hooks run in the connecting process and may call both. Each entry is
/// charged to its owner (`owners::Charge::Connecting`) and given back by
/// whoever removes it: sock_ops at establishment, the release hook when the
/// socket goes first.
#[map]
pub static VNAT_CONNECTING: HashMap<u64, Owner> =
    HashMap::pinned(CONNECTING_MAX_ENTRIES, NO_PREALLOC);

#[map]
pub static VNAT_STATS: PerCpuArray<u64> = PerCpuArray::pinned(STAT_COUNT, 0);

#[map]
pub static VNAT_CONFIG: Array<DatapathConfig> = Array::pinned(1, 0);

#[inline(always)]
pub fn count(stat: u32) {
    if let Some(slot) = VNAT_STATS.get_ptr_mut(stat) {
        // SAFETY: `slot` is the non-null pointer a lookup in VNAT_STATS just
        // returned: this CPU's u64 for `stat`, inside the map's memory, which
        // the verifier has checked for an 8-byte access. Per-CPU slots have
        // no writer on another CPU, so a plain add is enough. A program that
        // interrupts this one on the same CPU (tc in softirq while sock_ops
        // runs in process context) can add to the same slot between our
        // load and store and lose one count, which a statistic tolerates.
        unsafe { *slot += 1 };
    }
}

/// Whether a socket in the namespace with this cookie belongs to us.
#[inline(always)]
pub fn netns_is_ours(netns_cookie: u64) -> bool {
    match VNAT_CONFIG.get(0) {
        Some(cfg) if cfg.flags & CFG_F_NETNS_FILTER != 0 => cfg.netns_cookie == netns_cookie,
        _ => true,
    }
}

/// Whether userspace has said that nothing is translated (CFG_F_NAT_EMPTY).
/// The verifier inlines a lookup in a one-slot array into a load, so a tc
/// translator kept attached with nothing to translate costs a few
/// instructions per packet, not a parse and a hash of the flow key.
#[inline(always)]
pub fn nat_is_empty() -> bool {
    matches!(VNAT_CONFIG.get(0), Some(cfg) if cfg.flags & CFG_F_NAT_EMPTY != 0)
}

/// Whether userspace has said that some address is gone (CFG_F_GONE).
#[inline(always)]
pub fn some_gone() -> bool {
    matches!(VNAT_CONFIG.get(0), Some(cfg) if cfg.flags & vnat_common::CFG_F_GONE != 0)
}

/// Whether userspace has said that some flow is rebinding
/// (CFG_F_REBINDING): only then does an ingress miss look further.
#[inline(always)]
pub fn rebinding() -> bool {
    matches!(VNAT_CONFIG.get(0), Some(cfg) if cfg.flags & CFG_F_REBINDING != 0)
}

/// vnatd's VCMP port (big endian) if userspace asked for in-band BINDs to
/// be diverted to it (CFG_F_BIND_DIVERT).
#[inline(always)]
pub fn bind_divert_port() -> Option<u16> {
    match VNAT_CONFIG.get(0) {
        Some(cfg) if cfg.flags & CFG_F_BIND_DIVERT != 0 && cfg.vcmp_port_be != 0 => {
            Some(cfg.vcmp_port_be)
        }
        _ => None,
    }
}
