//! Hide location in the kernel: which cgroups hide (`VNAT_HIDE_CGROUPS`),
//! and what their applications see (`VNAT_HIDE_ADDRS`, `VNAT_HIDE_FLOWS`),
//! for the sock_addr programs of `vnat-ebpf/src/hide.rs`.

use std::{
    collections::{HashMap as StdHashMap, HashSet},
    net::{IpAddr, SocketAddr},
    path::Path,
};

use vnat_common::{
    FlowKey, HideKey, HideValue, HIDE_ADDRS_MAX_ENTRIES, HIDE_FLOWS_MAX_ENTRIES, HIDE_F_REACH,
    HIDE_F_SHOW, HIDE_SIDE_LOCAL, HIDE_SIDE_REMOTE, MAP_HIDE_ADDRS, MAP_HIDE_CGROUPS,
    MAP_HIDE_FLOWS,
};

use super::{attach, flow_key, map_err, object, DatapathError, KernelDatapath, Proto};
use crate::datapath::HideTable;

/// The address words and family of `ip`, as the programs key them.
fn words(ip: IpAddr) -> ([u32; 4], u8) {
    let sa = SocketAddr::new(ip, 0);
    let k = flow_key(Proto::Tcp, sa, sa);
    (k.src_addr_be, k.family)
}

/// The entries of `t`, as the maps hold them.
pub(super) fn entries(t: &HideTable) -> (StdHashMap<HideKey, HideValue>, HashSet<FlowKey>) {
    let mut addrs: StdHashMap<HideKey, HideValue> = StdHashMap::new();
    let mut put = |side: u8, from: IpAddr, to: IpAddr, flag: u32| {
        if from.is_ipv4() != to.is_ipv4() {
            return;
        }
        let (addr_be, family) = words(from);
        let v = addrs
            .entry(HideKey {
                addr_be,
                family,
                side,
                _pad: [0; 2],
            })
            .or_default();
        if flag == HIDE_F_SHOW {
            v.show_be = words(to).0;
        } else {
            v.reach_be = words(to).0;
        }
        v.flags |= flag;
    };
    for (side, shows, reaches) in [
        (HIDE_SIDE_REMOTE, &t.remote_show, &t.remote_reach),
        (HIDE_SIDE_LOCAL, &t.local_show, &t.local_reach),
    ] {
        for (from, to) in shows {
            put(side, *from, *to, HIDE_F_SHOW);
        }
        for (from, to) in reaches {
            put(side, *from, *to, HIDE_F_REACH);
        }
    }
    let flows = t
        .translated
        .iter()
        .map(|(proto, port, remote)| {
            let local = SocketAddr::new(
                match remote {
                    SocketAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                    SocketAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
                },
                *port,
            );
            flow_key(*proto, local, *remote)
        })
        .collect();
    (addrs, flows)
}

/// What this process last wrote to the two maps (read from the pins at
/// the first write).
#[derive(Default)]
pub(super) struct HideMirror {
    addrs: StdHashMap<HideKey, HideValue>,
    flows: HashSet<FlowKey>,
}

impl KernelDatapath {
    /// Turn hide location on or off for the cgroup at `path`: returns
    /// whether that changed anything.
    pub(super) fn hide_cgroup(&mut self, path: &Path, on: bool) -> Result<bool, DatapathError> {
        let id = attach::cgroup_id(path)?;
        self.hide_cgroup_id(id, on)
    }

    pub(super) fn hide_cgroup_id(&mut self, id: u64, on: bool) -> Result<bool, DatapathError> {
        let maps = &mut self.loaded.maps;
        let was = maps.hide_cgroups.get(&id, 0).is_ok();
        if was == on {
            return Ok(false);
        }
        if on {
            maps.hide_cgroups
                .insert(id, 1, 0)
                .map_err(map_err(MAP_HIDE_CGROUPS))?;
        } else {
            match maps.hide_cgroups.remove(&id) {
                Ok(()) => {}
                Err(e) if super::is_not_found(&e) => {}
                Err(e) => return Err(map_err(MAP_HIDE_CGROUPS)(e)),
            }
        }
        let any = self.loaded.maps.hide_cgroups.keys().next().is_some();
        if any != self.loaded.hide {
            self.loaded.hide = any;
            if let Err(e) = object::set_config(
                &mut self.loaded,
                self.nat_empty,
                self.rebinding,
                self.bind_divert_port,
            ) {
                // All or nothing: the cgroup goes back to what it was.
                self.loaded.hide = !any;
                let m = &mut self.loaded.maps.hide_cgroups;
                let _ = if on {
                    m.remove(&id)
                } else {
                    m.insert(id, 1, 0)
                };
                return Err(e);
            }
        }
        Ok(true)
    }

    /// The ids of the hiding cgroups and of every cgroup below them.
    pub(super) fn hiding_tree(&self) -> HashSet<u64> {
        let mut out = HashSet::new();
        for id in self.hiding_ids() {
            out.insert(id);
            if let Some(dir) = attach::cgroup_path(id) {
                attach::cgroup_tree_ids(&dir, &mut out);
            }
        }
        out
    }

    /// The ids of the hiding cgroups.
    pub(super) fn hiding_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self
            .loaded
            .maps
            .hide_cgroups
            .keys()
            .filter_map(Result::ok)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// Bring both maps in line with `t`: removals first, then the new and
    /// changed entries. Entries beyond the maps' capacity are left out
    /// (with a warning): those addresses or flows are then not hidden.
    pub(super) fn write_hidden(&mut self, t: &HideTable) -> Result<(), DatapathError> {
        let (mut addrs, mut flows) = entries(t);
        if addrs.len() > HIDE_ADDRS_MAX_ENTRIES as usize
            || flows.len() > HIDE_FLOWS_MAX_ENTRIES as usize
        {
            tracing::warn!(
                addresses = addrs.len(),
                flows = flows.len(),
                "more moved addresses or flows than hide location can hold; some are not hidden"
            );
            let mut keep: Vec<HideKey> = addrs.keys().copied().collect();
            keep.sort_unstable();
            keep.truncate(HIDE_ADDRS_MAX_ENTRIES as usize);
            let keep: HashSet<HideKey> = keep.into_iter().collect();
            addrs.retain(|k, _| keep.contains(k));
            let mut fl: Vec<FlowKey> = flows.into_iter().collect();
            fl.sort_unstable();
            fl.truncate(HIDE_FLOWS_MAX_ENTRIES as usize);
            flows = fl.into_iter().collect();
        }
        if self.hide_mirror.is_none() {
            let m = &self.loaded.maps;
            self.hide_mirror = Some(HideMirror {
                addrs: m.hide_addrs.iter().filter_map(Result::ok).collect(),
                flows: m.hide_flows.keys().filter_map(Result::ok).collect(),
            });
        }
        let Some(mirror) = self.hide_mirror.as_mut() else {
            return Ok(());
        };
        let maps = &mut self.loaded.maps;
        let gone = |e: &aya::maps::MapError| super::is_not_found(e);
        // Flows first: a flow to leave alone must be there before the
        // address that would redirect it, and stay until that is gone.
        let new: Vec<FlowKey> = flows.difference(&mirror.flows).copied().collect();
        for k in new {
            maps.hide_flows
                .insert(k, 1, 0)
                .map_err(map_err(MAP_HIDE_FLOWS))?;
            mirror.flows.insert(k);
        }
        let stale: Vec<HideKey> = mirror
            .addrs
            .keys()
            .filter(|k| !addrs.contains_key(k))
            .copied()
            .collect();
        for k in stale {
            match maps.hide_addrs.remove(&k) {
                Ok(()) => {}
                Err(e) if gone(&e) => {}
                Err(e) => return Err(map_err(MAP_HIDE_ADDRS)(e)),
            }
            mirror.addrs.remove(&k);
        }
        for (k, v) in &addrs {
            if mirror.addrs.get(k) != Some(v) {
                maps.hide_addrs
                    .insert(*k, *v, 0)
                    .map_err(map_err(MAP_HIDE_ADDRS))?;
                mirror.addrs.insert(*k, *v);
            }
        }
        let stale: Vec<FlowKey> = mirror.flows.difference(&flows).copied().collect();
        for k in stale {
            match maps.hide_flows.remove(&k) {
                Ok(()) => {}
                Err(e) if gone(&e) => {}
                Err(e) => return Err(map_err(MAP_HIDE_FLOWS)(e)),
            }
            mirror.flows.remove(&k);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_can_be_shown_and_reached_and_families_stay_apart() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let mut t = HideTable::default();
        // B (where the peer is now) is shown as A; A reaches B.
        t.remote_show.insert(ip("10.0.2.5"), ip("10.0.1.5"));
        t.remote_reach.insert(ip("10.0.1.5"), ip("10.0.2.5"));
        // Another peer that left B: B reaches it at C.
        t.remote_reach.insert(ip("10.0.2.5"), ip("10.0.3.5"));
        // A family mismatch is never written.
        t.local_show.insert(ip("10.0.2.9"), ip("fd00::9"));
        t.translated.insert((
            Proto::Udp,
            5000,
            "10.0.1.5:6000".parse::<SocketAddr>().unwrap(),
        ));
        let (addrs, flows) = entries(&t);
        assert_eq!(addrs.len(), 2, "{addrs:?}");
        let b = addrs
            .get(&HideKey {
                addr_be: words(ip("10.0.2.5")).0,
                family: vnat_common::AF_INET,
                side: HIDE_SIDE_REMOTE,
                _pad: [0; 2],
            })
            .expect("B");
        assert_eq!(b.flags, HIDE_F_SHOW | HIDE_F_REACH);
        assert_eq!(b.show_be, words(ip("10.0.1.5")).0);
        assert_eq!(b.reach_be, words(ip("10.0.3.5")).0);
        let f = flows.iter().next().expect("one flow");
        assert_eq!(f.src_addr_be, [0; 4]);
        assert_eq!(u16::from_be(f.src_port_be), 5000);
        assert_eq!(u16::from_be(f.dst_port_be), 6000);
        assert_eq!(f.proto, vnat_common::PROTO_UDP);
    }
}
