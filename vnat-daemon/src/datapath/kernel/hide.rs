//! Hide location in the kernel: which cgroups hide (`VNAT_HIDE_CGROUPS`),
//! and what their applications see and reach (`VNAT_HIDE_ADDRS`,
//! `VNAT_HIDE_FLOWS`, `VNAT_HIDE_REACH`), for the sock_addr programs of
//! `vnat-ebpf/src/hide.rs`, which note in `VNAT_HIDE_SEEN` what they showed.

use std::{
    collections::{HashMap as StdHashMap, HashSet},
    net::{IpAddr, SocketAddr},
    path::Path,
};

use vnat_common::{
    FlowKey, HideKey, HideReachKey, HideReachValue, HideValue, HIDE_ADDRS_MAX_ENTRIES,
    HIDE_FLOWS_MAX_ENTRIES, HIDE_F_REACH, HIDE_F_SHOW, HIDE_MAX_LEVEL, HIDE_REACH_MAX_ENTRIES,
    HIDE_SIDE_LOCAL, HIDE_SIDE_REMOTE, MAP_HIDE_ADDRS, MAP_HIDE_CGROUPS, MAP_HIDE_FLOWS,
    MAP_HIDE_REACH, MAP_HIDE_SEEN, PROTO_TCP, PROTO_UDP,
};

use super::{attach, flow_key, map_err, object, DatapathError, KernelDatapath, Proto};
use crate::datapath::HideTable;

/// The address words and family of `ip`, as the programs key them.
fn words(ip: IpAddr) -> ([u32; 4], u8) {
    let sa = SocketAddr::new(ip, 0);
    let k = flow_key(Proto::Tcp, sa, sa);
    (k.src_addr_be, k.family)
}

/// The endpoints of `t.remote_reach`, as `VNAT_HIDE_REACH` holds them
/// (an endpoint and its target of different families are left out).
pub(super) fn reach_entries(t: &HideTable) -> StdHashMap<HideReachKey, HideReachValue> {
    t.remote_reach
        .iter()
        .filter(|((_, from), to)| from.is_ipv4() == to.is_ipv4())
        .map(|((proto, from), to)| {
            let (addr_be, family) = words(from.ip());
            let key = HideReachKey {
                addr_be,
                port_be: from.port().to_be(),
                family,
                proto: match proto {
                    Proto::Tcp => PROTO_TCP,
                    Proto::Udp => PROTO_UDP,
                },
            };
            let value = HideReachValue {
                addr_be: words(to.ip()).0,
                port_be: to.port().to_be(),
                _pad: [0; 2],
            };
            (key, value)
        })
        .collect()
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
    for (from, to) in &t.remote_show {
        put(HIDE_SIDE_REMOTE, *from, *to, HIDE_F_SHOW);
    }
    for (from, to) in &t.local_show {
        put(HIDE_SIDE_LOCAL, *from, *to, HIDE_F_SHOW);
    }
    // This host's own addresses: a bind() to one it moved away from.
    for (from, to) in &t.local_reach {
        put(HIDE_SIDE_LOCAL, *from, *to, HIDE_F_REACH);
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

/// Refuse to hide location for a cgroup that holds vnatd itself (its own
/// VCMP socket would be shown and sent to the wrong addresses), or that is
/// deeper than the programs look ([`HIDE_MAX_LEVEL`]).
fn may_hide(path: &Path) -> Result<(), DatapathError> {
    let refuse = |reason: String| DatapathError::CannotHide {
        path: path.to_path_buf(),
        reason,
    };
    let mount = attach::cgroup2_mount().ok_or_else(|| refuse("no cgroup2 mount".into()))?;
    let canonical = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let dir = canonical(path);
    let mount = canonical(&mount);
    let depth = dir
        .strip_prefix(&mount)
        .map(|rel| rel.components().count())
        .map_err(|_| {
            refuse(format!(
                "it is not under the cgroup2 mount {}",
                mount.display()
            ))
        })?;
    if depth > HIDE_MAX_LEVEL as usize {
        return Err(refuse(format!(
            "it is {depth} levels below the cgroup2 mount, and hide location looks {HIDE_MAX_LEVEL} deep; choose a cgroup above it"
        )));
    }
    if let Some(own) = super::procfs::cgroup_of(std::process::id()) {
        let own = mount.join(own.trim_start_matches('/'));
        if own.starts_with(&dir) {
            return Err(refuse(format!(
                "vnatd itself runs in {}, below it, and its own VCMP socket must see true addresses; choose a cgroup that does not hold vnatd (such as the application's own service)",
                own.display()
            )));
        }
    }
    Ok(())
}

/// Cut `addrs`, `flows` and `reach` to the maps' capacity without ever
/// keeping a redirection whose translated flows are not all exempt: a flow
/// left out takes its endpoint's redirection with it.
pub(super) fn fit(
    addrs: &mut StdHashMap<HideKey, HideValue>,
    flows: &mut HashSet<FlowKey>,
    reach: &mut StdHashMap<HideReachKey, HideReachValue>,
) {
    let endpoint = |f: &FlowKey| HideReachKey {
        addr_be: f.dst_addr_be,
        port_be: f.dst_port_be,
        family: f.family,
        proto: f.proto,
    };
    let mut fl: Vec<FlowKey> = flows.drain().collect();
    fl.sort_unstable();
    for dropped in fl.split_off(fl.len().min(HIDE_FLOWS_MAX_ENTRIES as usize)) {
        reach.remove(&endpoint(&dropped));
    }
    if reach.len() > HIDE_REACH_MAX_ENTRIES as usize {
        // Dropping an endpoint takes away a redirection, never an
        // exemption: safe in any order.
        let mut keys: Vec<HideReachKey> = reach.keys().copied().collect();
        keys.sort_unstable();
        for k in keys.split_off(HIDE_REACH_MAX_ENTRIES as usize) {
            reach.remove(&k);
        }
    }
    // Flows whose endpoint lost its redirection need no exemption.
    *flows = fl
        .into_iter()
        .filter(|f| reach.contains_key(&endpoint(f)))
        .collect();
    if addrs.len() > HIDE_ADDRS_MAX_ENTRIES as usize {
        // Shown addresses and this host's own: dropping one shows or binds
        // the truth, which is safe in any order.
        let mut keys: Vec<HideKey> = addrs.keys().copied().collect();
        keys.sort_unstable();
        for k in keys.split_off(HIDE_ADDRS_MAX_ENTRIES as usize) {
            addrs.remove(&k);
        }
    }
}

/// What this process last wrote to the maps (read from the pins at the
/// first write).
#[derive(Default)]
pub(super) struct HideMirror {
    addrs: StdHashMap<HideKey, HideValue>,
    flows: HashSet<FlowKey>,
    reach: StdHashMap<HideReachKey, HideReachValue>,
}

impl KernelDatapath {
    /// Turn hide location on or off for the cgroup at `path`: returns
    /// whether that changed anything.
    pub(super) fn hide_cgroup(&mut self, path: &Path, on: bool) -> Result<bool, DatapathError> {
        let id = attach::cgroup_id(path)?;
        if on {
            if let Some(why) = &self.loaded.hide_unavailable {
                return Err(DatapathError::Unsupported {
                    what: format!("hiding location for {}", path.display()),
                    needs: super::features::Feature::SockAddrNameHooks.needs().into(),
                    kernel: super::object::kernel_release(),
                    instead: format!("hide location is off on this machine ({why}); connections still move, but applications see moved peers at their new addresses"),
                });
            }
            may_hide(path)?;
        }
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

    /// Bring the maps in line with `t`: removals first, then the new and
    /// changed entries. Entries beyond the maps' capacity are left out
    /// (with a warning): those addresses or endpoints are then not hidden.
    pub(super) fn write_hidden(&mut self, t: &HideTable) -> Result<(), DatapathError> {
        let (mut addrs, mut flows) = entries(t);
        let mut reach = reach_entries(t);
        if addrs.len() > HIDE_ADDRS_MAX_ENTRIES as usize
            || flows.len() > HIDE_FLOWS_MAX_ENTRIES as usize
            || reach.len() > HIDE_REACH_MAX_ENTRIES as usize
        {
            tracing::warn!(
                addresses = addrs.len(),
                flows = flows.len(),
                endpoints = reach.len(),
                "more moved addresses, endpoints or flows than hide location can hold; some are not hidden"
            );
            fit(&mut addrs, &mut flows, &mut reach);
        }
        if self.hide_mirror.is_none() {
            let m = &self.loaded.maps;
            self.hide_mirror = Some(HideMirror {
                addrs: m.hide_addrs.iter().filter_map(Result::ok).collect(),
                flows: m.hide_flows.keys().filter_map(Result::ok).collect(),
                reach: m.hide_reach.iter().filter_map(Result::ok).collect(),
            });
        }
        let Some(mirror) = self.hide_mirror.as_mut() else {
            return Ok(());
        };
        let maps = &mut self.loaded.maps;
        let gone = |e: &aya::maps::MapError| super::is_not_found(e);
        // Flows first: a flow to leave alone must be there before the
        // endpoint that would redirect it, and stay until that is gone.
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
        let stale: Vec<HideReachKey> = mirror
            .reach
            .keys()
            .filter(|k| !reach.contains_key(k))
            .copied()
            .collect();
        for k in stale {
            match maps.hide_reach.remove(&k) {
                Ok(()) => {}
                Err(e) if gone(&e) => {}
                Err(e) => return Err(map_err(MAP_HIDE_REACH)(e)),
            }
            mirror.reach.remove(&k);
        }
        for (k, v) in &addrs {
            if mirror.addrs.get(k) != Some(v) {
                maps.hide_addrs
                    .insert(*k, *v, 0)
                    .map_err(map_err(MAP_HIDE_ADDRS))?;
                mirror.addrs.insert(*k, *v);
            }
        }
        for (k, v) in &reach {
            if mirror.reach.get(k) != Some(v) {
                maps.hide_reach
                    .insert(*k, *v, 0)
                    .map_err(map_err(MAP_HIDE_REACH))?;
                mirror.reach.insert(*k, *v);
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
        // What the programs showed stays reachable only while its address
        // is still shown as the one the application was given.
        let stale: Vec<HideReachKey> = maps
            .hide_seen
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, v)| !still_shown(&addrs, k, v))
            .map(|(k, _)| k)
            .collect();
        for k in stale {
            match maps.hide_seen.remove(&k) {
                Ok(()) => {}
                Err(e) if gone(&e) => {}
                Err(e) => return Err(map_err(MAP_HIDE_SEEN)(e)),
            }
        }
        Ok(())
    }
}

/// Whether `addrs` still shows the address a program noted in
/// `VNAT_HIDE_SEEN` (the value's) as the one it gave the application (the
/// key's).
fn still_shown(
    addrs: &StdHashMap<HideKey, HideValue>,
    k: &HideReachKey,
    v: &HideReachValue,
) -> bool {
    addrs
        .get(&HideKey {
            addr_be: v.addr_be,
            family: k.family,
            side: HIDE_SIDE_REMOTE,
            _pad: [0; 2],
        })
        .is_some_and(|e| e.flags & HIDE_F_SHOW != 0 && e.show_be == k.addr_be)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cgroup_that_holds_vnatd_or_lies_too_deep_is_refused() {
        let mount = attach::cgroup2_mount().expect("this platform has a cgroup2 mount");
        // This process stands for vnatd: the root holds it.
        let e = may_hide(&mount).expect_err("the root holds this process");
        assert!(e.to_string().contains("vnatd itself runs in"), "{e}");
        let deep: std::path::PathBuf =
            (0..=HIDE_MAX_LEVEL).fold(mount.clone(), |p, i| p.join(format!("l{i}")));
        let e = may_hide(&deep).expect_err("too deep");
        assert!(e.to_string().contains("levels below"), "{e}");
        let e = may_hide(Path::new("/tmp")).expect_err("not a cgroup");
        assert!(e.to_string().contains("not under the cgroup2 mount"), "{e}");
    }

    #[test]
    fn cutting_to_capacity_never_keeps_a_redirection_without_its_exemptions() {
        let sa = |s: &str| s.parse::<SocketAddr>().unwrap();
        let mut t = HideTable::default();
        t.remote_show
            .insert("10.0.2.5".parse().unwrap(), "10.0.1.5".parse().unwrap());
        for port in 0..=HIDE_FLOWS_MAX_ENTRIES {
            // All but the last sort before the other endpoint's one flow.
            let (peer, port) = if port == HIDE_FLOWS_MAX_ENTRIES {
                ("10.0.1.6", 1)
            } else {
                ("10.0.1.5", port as u16)
            };
            let proto = if port % 2 == 0 {
                Proto::Udp
            } else {
                Proto::Tcp
            };
            let remote = SocketAddr::new(peer.parse().unwrap(), 7000 + (port % 3));
            t.remote_reach.insert(
                (proto, remote),
                SocketAddr::new("10.0.2.5".parse().unwrap(), remote.port()),
            );
            t.translated.insert((proto, port, remote));
        }
        t.remote_reach
            .insert((Proto::Tcp, sa("10.0.1.7:22")), sa("10.0.2.7:22"));
        let (mut addrs, mut flows) = entries(&t);
        let mut reach = reach_entries(&t);
        assert!(flows.len() > HIDE_FLOWS_MAX_ENTRIES as usize);
        fit(&mut addrs, &mut flows, &mut reach);
        assert!(flows.len() <= HIDE_FLOWS_MAX_ENTRIES as usize);
        assert!(reach.len() <= HIDE_REACH_MAX_ENTRIES as usize);
        let all = entries(&t).1;
        for k in reach.keys() {
            // Every translated flow to a redirected endpoint is exempt.
            for f in all.iter().filter(|f| {
                f.dst_addr_be == k.addr_be && f.dst_port_be == k.port_be && f.proto == k.proto
            }) {
                assert!(
                    flows.contains(f),
                    "{f:?} lost its exemption but {k:?} still redirects"
                );
            }
        }
        // Some endpoint lost its redirection; the one without flows and
        // the shown address stay.
        assert!(reach.len() < t.remote_reach.len());
        assert!(reach.keys().any(|k| u16::from_be(k.port_be) == 22));
        assert_eq!(addrs.len(), 1);
    }

    #[test]
    fn one_address_can_be_shown_and_its_endpoints_reached_and_families_stay_apart() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let sa = |s: &str| s.parse::<SocketAddr>().unwrap();
        let mut t = HideTable::default();
        // B (where the peer is now) is shown as A; A:6000, which it held,
        // reaches B:6001.
        t.remote_show.insert(ip("10.0.2.5"), ip("10.0.1.5"));
        t.remote_reach
            .insert((Proto::Udp, sa("10.0.1.5:6000")), sa("10.0.2.5:6001"));
        // This host moved from C to D: a bind() to C binds D.
        t.local_reach.insert(ip("10.0.3.5"), ip("10.0.4.5"));
        // A family mismatch is never written.
        t.local_show.insert(ip("10.0.2.9"), ip("fd00::9"));
        t.remote_reach
            .insert((Proto::Tcp, sa("10.0.1.5:7000")), sa("[fd00::5]:7000"));
        t.translated.insert((Proto::Udp, 5000, sa("10.0.1.5:6000")));
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
        assert_eq!(
            b.flags, HIDE_F_SHOW,
            "a peer's whole address is never reached"
        );
        assert_eq!(b.show_be, words(ip("10.0.1.5")).0);
        let c = addrs
            .get(&HideKey {
                addr_be: words(ip("10.0.3.5")).0,
                family: vnat_common::AF_INET,
                side: HIDE_SIDE_LOCAL,
                _pad: [0; 2],
            })
            .expect("C");
        assert_eq!(c.flags, HIDE_F_REACH);
        let reach = reach_entries(&t);
        assert_eq!(reach.len(), 1, "{reach:?}");
        let (k, v) = reach.iter().next().expect("one endpoint");
        assert_eq!(k.addr_be, words(ip("10.0.1.5")).0);
        assert_eq!(u16::from_be(k.port_be), 6000);
        assert_eq!(k.proto, PROTO_UDP);
        assert_eq!(v.addr_be, words(ip("10.0.2.5")).0);
        assert_eq!(u16::from_be(v.port_be), 6001);
        let f = flows.iter().next().expect("one flow");
        assert_eq!(f.src_addr_be, [0; 4]);
        assert_eq!(u16::from_be(f.src_port_be), 5000);
        assert_eq!(u16::from_be(f.dst_port_be), 6000);
        assert_eq!(f.proto, vnat_common::PROTO_UDP);
    }
}
