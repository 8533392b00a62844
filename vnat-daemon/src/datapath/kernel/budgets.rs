//! Each owner's budget in the maps the recorders fill (see
//! `vnat_common::owners`): written at load from the maps' real sizes, and
//! every owner's count recounted at each housekeeping pass from the
//! records themselves, which sets right what concurrent updates in the
//! programs lost and gives back what vnatd's own removals held.

use std::collections::HashMap;

use aya::maps::Map;
use vnat_common::{
    Budgets, ConnRecord, OwnerCounts, CONNS_MAX_ENTRIES, GUESTS_MAX_ENTRIES, MAP_BUDGETS,
    MAP_OWNERS, OWNER_ROOT, PROTO_TCP,
};

use super::{map_err, object::Maps, KernelDatapath};
use crate::datapath::DatapathError;

/// The sizes of the connection and guests' maps as the kernel made them
/// (a pinned map keeps the size it was made with).
pub(super) fn sizes(conns: &Map, guests: &Map) -> (u32, u32) {
    let entries = |m: &Map, default: u32| match m {
        Map::HashMap(d) => d.info().map_or(default, |i| i.max_entries()),
        _ => default,
    };
    (
        entries(conns, CONNS_MAX_ENTRIES),
        entries(guests, GUESTS_MAX_ENTRIES),
    )
}

/// Write the budgets for maps of these sizes.
pub(super) fn set(maps: &mut Maps, (conns, guests): (u32, u32)) -> Result<(), DatapathError> {
    let b = Budgets::for_sizes(conns, guests);
    tracing::debug!(conns, guests, budgets = ?b, "budgets per owner");
    maps.budgets.set(0, b, 0).map_err(map_err(MAP_BUDGETS))
}

/// What each owner holds, counted from the records (the connection map's
/// with their protocol) and from the owners of sockets still connecting
/// (their uids); root, charged to nothing, is left out.
pub(super) fn count_records<'a>(
    conns: impl IntoIterator<Item = (u8, &'a ConnRecord)>,
    guests: impl IntoIterator<Item = &'a ConnRecord>,
    connecting: impl IntoIterator<Item = u32>,
) -> HashMap<u32, OwnerCounts> {
    let mut out: HashMap<u32, OwnerCounts> = HashMap::new();
    for (proto, r) in conns {
        if r.owner_uid == OWNER_ROOT {
            continue;
        }
        let c = out.entry(r.owner_uid).or_default();
        if proto == PROTO_TCP {
            c.tcp += 1;
        } else {
            c.udp += 1;
        }
    }
    for r in guests {
        if r.owner_uid != OWNER_ROOT {
            out.entry(r.owner_uid).or_default().guests += 1;
        }
    }
    for uid in connecting {
        if uid != OWNER_ROOT {
            out.entry(uid).or_default().connecting += 1;
        }
    }
    out
}

impl KernelDatapath {
    /// The budget left to `owner` in the map `guest` says (the guests' or
    /// the connection map's UDP share), as counted there: for records
    /// vnatd completes on the programs' behalf.
    pub(super) fn udp_room(&self, owner: u32, guest: bool) -> u32 {
        if owner == OWNER_ROOT {
            return u32::MAX;
        }
        let b = self
            .loaded
            .maps
            .budgets
            .get(&0, 0)
            .ok()
            .filter(|b| b.tcp_per_owner != 0)
            .unwrap_or(Budgets::DEFAULT);
        let held = self.loaded.maps.owners.get(&owner, 0).unwrap_or_default();
        if guest {
            b.guests_per_owner.saturating_sub(held.guests)
        } else {
            b.udp_per_owner.saturating_sub(held.udp)
        }
    }

    /// Write `counts` as every owner's count: changed ones updated, owners
    /// who hold nothing any more removed.
    pub(super) fn write_owner_counts(
        &mut self,
        counts: &HashMap<u32, OwnerCounts>,
    ) -> Result<(), DatapathError> {
        let map = &mut self.loaded.maps.owners;
        let old: Vec<(u32, OwnerCounts)> = map
            .iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(MAP_OWNERS))?;
        for (owner, was) in &old {
            match counts.get(owner) {
                Some(now) if now == was => {}
                Some(now) => {
                    let _ = map.insert(owner, now, 0);
                }
                None => {
                    let _ = map.remove(owner);
                }
            }
        }
        let known: std::collections::HashSet<u32> = old.iter().map(|(o, _)| *o).collect();
        for (owner, now) in counts {
            if !known.contains(owner) {
                let _ = map.insert(owner, now, 0);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vnat_common::{OWNER_ACCEPTED, PROTO_UDP};

    fn rec(owner: u32, proto: u8) -> ConnRecord {
        ConnRecord {
            owner_uid: owner,
            // The test's stand-in for the key's protocol.
            origin: proto,
            ..ConnRecord::default()
        }
    }

    #[test]
    fn owners_are_counted_per_map_and_root_is_not() {
        let conns = [
            rec(1000, PROTO_TCP),
            rec(1000, PROTO_UDP),
            rec(1000, PROTO_UDP),
            rec(0, PROTO_TCP),
            rec(OWNER_ACCEPTED, PROTO_TCP),
        ];
        let guests = [rec(1000, PROTO_UDP), rec(65534, PROTO_TCP)];
        let connecting = [1000, 1000, 0, 4242];
        let c = count_records(
            conns.iter().map(|r| (r.origin, r)),
            guests.iter(),
            connecting,
        );
        assert_eq!(c.len(), 4);
        assert_eq!(
            c[&1000],
            OwnerCounts {
                tcp: 1,
                udp: 2,
                guests: 1,
                connecting: 2,
            }
        );
        assert_eq!(c[&4242].connecting, 1);
        assert_eq!(c[&OWNER_ACCEPTED].tcp, 1);
        assert_eq!(c[&65534].guests, 1);
        assert!(!c.contains_key(&0));
    }
}
