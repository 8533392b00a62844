//! Each owner's budget in the maps the recorders fill (see
//! `vnat_common::owners`): a record is inserted only once its owner has
//! been charged for it, and whoever removes it gives the charge back.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LruHashMap},
};
use vnat_common::{
    Budgets, GuestKey, OwnerCounts, OWNERS_MAX_ENTRIES, OWNER_ACCEPTED, OWNER_ROOT,
    STAT_OWNER_BUDGET_FULL,
};

use crate::maps::count;

/// BPF_F_NO_PREALLOC, as in `maps`.
const NO_PREALLOC: u32 = 1;
/// BPF_NOEXIST: insert only if absent.
const NOEXIST: u64 = 1;

#[map]
pub static VNAT_OWNERS: HashMap<u32, OwnerCounts> =
    HashMap::pinned(OWNERS_MAX_ENTRIES, NO_PREALLOC);

#[map]
pub static VNAT_BUDGETS: Array<Budgets> = Array::pinned(1, 0);

/// TCP connections this host made whose record was refused for their
/// owner's budget, by their tuple (a [`GuestKey`] with this socket's
/// namespace): when the other end turns out to be a socket of this host
/// too, its accepting end must not be charged to the connections accepted
/// from other hosts instead. Only read between the two ends' callbacks
/// (microseconds apart), so an LRU map of this size never loses one in
/// time.
#[map]
pub static VNAT_REFUSED_LOCAL: LruHashMap<GuestKey, u8> = LruHashMap::with_max_entries(16_384, 0);

/// Which map a record is charged in.
#[derive(Clone, Copy)]
pub enum Charge {
    Tcp,
    Udp,
    Guest,
    /// An entry of `VNAT_CONNECTING`.
    Connecting,
}

/// The budget of `owner` for `what`; the programs' defaults until vnatd
/// has written those of the maps' real sizes.
#[inline(always)]
fn budget(owner: u32, what: Charge) -> u32 {
    let b = match VNAT_BUDGETS.get(0) {
        Some(b) if b.tcp_per_owner != 0 => *b,
        _ => Budgets::DEFAULT,
    };
    match what {
        Charge::Tcp if owner == OWNER_ACCEPTED => b.tcp_accepted,
        Charge::Tcp => b.tcp_per_owner,
        Charge::Udp => b.udp_per_owner,
        Charge::Guest => b.guests_per_owner,
        Charge::Connecting => b.connecting_per_owner,
    }
}

/// UDP's share of the connection map, for everyone.
#[inline(always)]
pub fn udp_total() -> u64 {
    match VNAT_BUDGETS.get(0) {
        Some(b) if b.udp_total != 0 => b.udp_total as u64,
        _ => Budgets::DEFAULT.udp_total as u64,
    }
}

/// Charge one record of `what` to `owner`: false (and counted) if the
/// owner holds its budget already, or the owners' map has no room for it.
/// Concurrent charges of one owner may let one or two more in; vnatd's
/// recount sets the counts right.
#[inline(always)]
pub fn charge(owner: u32, what: Charge) -> bool {
    if owner == OWNER_ROOT {
        return true;
    }
    let limit = budget(owner, what);
    if let Some(c) = VNAT_OWNERS.get_ptr_mut(&owner) {
        // SAFETY: `c` is the non-null pointer a lookup just returned, to a
        // whole OwnerCounts in the map; map elements outlive this run (RCU).
        // Plain loads and stores: a racing update loses at most one count,
        // which the recount corrects.
        unsafe {
            let slot = match what {
                Charge::Tcp => &mut (*c).tcp,
                Charge::Udp => &mut (*c).udp,
                Charge::Guest => &mut (*c).guests,
                Charge::Connecting => &mut (*c).connecting,
            };
            if *slot >= limit {
                count(STAT_OWNER_BUDGET_FULL);
                return false;
            }
            *slot += 1;
        }
        return true;
    }
    let mut c = OwnerCounts::default();
    match what {
        Charge::Tcp => c.tcp = 1,
        Charge::Udp => c.udp = 1,
        Charge::Guest => c.guests = 1,
        Charge::Connecting => c.connecting = 1,
    }
    if limit == 0 || VNAT_OWNERS.insert(&owner, &c, NOEXIST).is_err() {
        count(STAT_OWNER_BUDGET_FULL);
        return false;
    }
    true
}

/// Give back one record of `what` charged to `owner`.
#[inline(always)]
pub fn uncharge(owner: u32, what: Charge) {
    if owner == OWNER_ROOT {
        return;
    }
    if let Some(c) = VNAT_OWNERS.get_ptr_mut(&owner) {
        // SAFETY: as in `charge`.
        unsafe {
            let slot = match what {
                Charge::Tcp => &mut (*c).tcp,
                Charge::Udp => &mut (*c).udp,
                Charge::Guest => &mut (*c).guests,
                Charge::Connecting => &mut (*c).connecting,
            };
            *slot = slot.saturating_sub(1);
        }
    }
}
