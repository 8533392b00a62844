//! The real datapath: eBPF programs loaded into the kernel, attached to
//! cgroups and interfaces, with maps and links pinned under a bpffs
//! directory so that translation survives the process (DESIGN.md §3).

mod attach;
mod nat;
mod net;
mod object;
mod procfs;
mod restart;
pub mod testrun;

use std::{
    collections::{BTreeMap, HashMap as StdHashMap},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use aya::maps::MapError;
use vnat_common::{
    ConnRecord, FlowKey, NatRewrite, MAP_CONNS, MAP_EGRESS_NAT, MAP_INGRESS_NAT, MAP_STATS,
    NAT_F_LO_ADDR_OURS, NAT_F_REDIRECT, PROTO_UDP, STAT_COUNT, STAT_NAMES,
};

pub use attach::{cgroup2_mount, cgroup_id};
pub use nat::{pair_for, translation_of, NatPair};
pub use net::ROUTE_PROTO;
pub use object::{own_netns_cookie, EBPF_OBJECT};

use super::{
    key_endpoints, validate_translation, CgroupAttachment, ConnState, ConnectionInfo, Datapath,
    DatapathError, DatapathStatus, Proto, TcAttachment, Translation, VirtualFlow,
};

/// How to open the kernel datapath.
#[derive(Clone, Debug)]
pub struct KernelOptions {
    /// Directory on bpffs for this instance's pins (`--bpffs`).
    pub bpffs: PathBuf,
    /// cgroup v2 directories to record connections of (`--cgroup`). Cgroups
    /// enabled earlier (pinned) stay enabled.
    pub cgroups: Vec<PathBuf>,
}

pub struct KernelDatapath {
    bpffs: PathBuf,
    loaded: object::Loaded,
    /// Interfaces whose tc links run this process's programs.
    tc_current: std::collections::BTreeSet<u32>,
}

fn map_err(map: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |e| DatapathError::Map { map, source: Box::new(e) }
}

fn is_not_found(e: &MapError) -> bool {
    matches!(e, MapError::KeyNotFound)
}

impl KernelDatapath {
    /// Load the programs (reusing pinned maps), attach the recorders to the
    /// requested and the previously enabled cgroups, take over pinned tc
    /// links, and check that what the pinned translations need is in place.
    pub fn open(opts: &KernelOptions) -> Result<KernelDatapath, DatapathError> {
        let loaded = object::load(&opts.bpffs)?;
        let mut dp = KernelDatapath { bpffs: opts.bpffs.clone(), loaded, tc_current: Default::default() };
        let mut cgroups: Vec<PathBuf> = opts.cgroups.clone();
        for id in attach::pinned_cgroups(&dp.bpffs) {
            match attach::cgroup_path(id) {
                Some(p) if !cgroups.contains(&p) => cgroups.push(p),
                Some(_) => {}
                // The cgroup is gone: its links are defunct, drop the pins.
                None => {
                    let _ = attach::detach_cgroup(&dp.bpffs, id);
                }
            }
        }
        for cg in &cgroups {
            attach::attach_cgroup(&mut dp.loaded.ebpf, &dp.bpffs, cg)?;
        }
        dp.reconcile()?;
        Ok(dp)
    }

    /// The pin directory.
    pub fn bpffs(&self) -> &Path {
        &self.bpffs
    }

    /// Bring tc links and the per-translation kernel state (addresses on lo,
    /// host routes) in line with the pinned translations.
    fn reconcile(&mut self) -> Result<(), DatapathError> {
        let translations = self.egress_entries()?;
        let mut needed: std::collections::BTreeSet<u32> = translations.iter().map(|(_, v)| v.redirect_ifindex).collect();
        needed.extend(self.ingress_entries()?.iter().map(|(_, v)| v.redirect_ifindex));
        needed.remove(&0);
        for ifindex in attach::pinned_tc(&self.bpffs) {
            if !needed.contains(&ifindex) || net::ifname(ifindex).is_err() {
                attach::detach_tc(&self.bpffs, ifindex);
            }
        }
        for ifindex in needed {
            if net::ifname(ifindex).is_ok() {
                attach::attach_tc(&mut self.loaded.ebpf, &self.bpffs, ifindex)?;
                self.tc_current.insert(ifindex);
            }
        }
        let lo = net::lo_addrs()?;
        let routes = net::host_routes()?;
        for (k, v) in &translations {
            let Some(t) = translation_of(k, v) else { continue };
            if t.local_moved() && !lo.contains(&t.flow.local.ip()) {
                net::add_lo_addr(t.flow.local.ip())?;
            }
            if t.remote_moved() && !routes.contains(&t.flow.remote.ip()) {
                let via = net::route_get(t.physical_remote.ip(), None)?;
                net::add_host_route(t.flow.remote.ip(), t.physical_remote.ip(), &via)?;
            }
        }
        Ok(())
    }

    fn egress_entries(&self) -> Result<Vec<(FlowKey, NatRewrite)>, DatapathError> {
        self.loaded.maps.egress.iter().collect::<Result<Vec<_>, _>>().map_err(map_err(MAP_EGRESS_NAT))
    }

    fn ingress_entries(&self) -> Result<Vec<(FlowKey, NatRewrite)>, DatapathError> {
        self.loaded.maps.ingress.iter().collect::<Result<Vec<_>, _>>().map_err(map_err(MAP_INGRESS_NAT))
    }

    fn egress_get(&self, key: &FlowKey) -> Result<Option<NatRewrite>, DatapathError> {
        match self.loaded.maps.egress.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(map_err(MAP_EGRESS_NAT)(e)),
        }
    }

    fn ingress_get(&self, key: &FlowKey) -> Result<Option<NatRewrite>, DatapathError> {
        match self.loaded.maps.ingress.get(key, 0) {
            Ok(v) => Ok(Some(v)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(map_err(MAP_INGRESS_NAT)(e)),
        }
    }

    /// Write a pair, ingress first (so the reply path exists before the
    /// first rewritten packet leaves). On failure the previous entries are
    /// put back.
    fn write_pair(&mut self, p: &NatPair, old: Option<&NatPair>) -> Result<(), DatapathError> {
        let maps = &mut self.loaded.maps;
        maps.ingress.insert(p.ingress_key, p.ingress, 0).map_err(map_err(MAP_INGRESS_NAT))?;
        if let Err(e) = maps.egress.insert(p.egress_key, p.egress, 0) {
            match old {
                Some(o) if o.ingress_key == p.ingress_key => {
                    let _ = maps.ingress.insert(o.ingress_key, o.ingress, 0);
                }
                _ => {
                    let _ = maps.ingress.remove(&p.ingress_key);
                }
            }
            return Err(map_err(MAP_EGRESS_NAT)(e));
        }
        if let Some(o) = old {
            if o.ingress_key != p.ingress_key {
                let _ = maps.ingress.remove(&o.ingress_key);
            }
        }
        Ok(())
    }

    /// Remove what a translation needed and nothing else still needs.
    fn release(&mut self, t: &Translation, v: &NatRewrite) -> Result<(), DatapathError> {
        let rest: Vec<Translation> = self
            .egress_entries()?
            .iter()
            .filter_map(|(k, v)| translation_of(k, v))
            .collect();
        if t.local_moved() && v.flags & NAT_F_LO_ADDR_OURS != 0 {
            let ip = t.flow.local.ip();
            let local_words = super::flow_key(t.flow.proto, t.flow.local, t.flow.remote).src_addr_be;
            let prepared_use = self.ingress_entries()?.iter().any(|(k, v)| {
                v.flags & NAT_F_LO_ADDR_OURS != 0 && restored_key(k, v).dst_addr_be == local_words
            });
            if !prepared_use && !rest.iter().any(|o| o.local_moved() && o.flow.local.ip() == ip) {
                net::del_lo_addr(ip)?;
            }
        }
        if t.remote_moved() {
            let ip = t.flow.remote.ip();
            if !rest.iter().any(|o| o.remote_moved() && o.flow.remote.ip() == ip) {
                let _ = net::del_host_route(ip);
            }
        }
        let ifindex = v.redirect_ifindex;
        let still_used = self.egress_entries()?.iter().chain(self.ingress_entries()?.iter()).any(|(_, o)| o.redirect_ifindex == ifindex);
        if ifindex != 0 && !still_used {
            attach::detach_tc(&self.bpffs, ifindex);
            self.tc_current.remove(&ifindex);
        }
        Ok(())
    }

    /// Summed per-CPU counters in `STAT_NAMES` order.
    pub fn counters(&self) -> Result<Vec<(String, u64)>, DatapathError> {
        (0..STAT_COUNT)
            .map(|i| {
                let per_cpu = self.loaded.maps.stats.get(&i, 0).map_err(map_err(MAP_STATS))?;
                Ok((STAT_NAMES[i as usize].to_string(), per_cpu.iter().sum()))
            })
            .collect()
    }

    /// Raw program fd of a tc translator, for BPF_PROG_TEST_RUN.
    pub fn tc_program_fd(&self, egress: bool) -> Result<std::os::fd::RawFd, DatapathError> {
        use std::os::fd::{AsFd, AsRawFd};
        let name = if egress { vnat_common::PROG_TC_EGRESS } else { vnat_common::PROG_TC_INGRESS };
        let p: &aya::programs::SchedClassifier = self
            .loaded
            .ebpf
            .program(name)
            .ok_or_else(|| DatapathError::Load { source: format!("program {name} missing").into() })?
            .try_into()
            .map_err(|e: aya::programs::ProgramError| DatapathError::Load { source: Box::new(e) })?;
        let fd = p.fd().map_err(|e| DatapathError::Load { source: Box::new(e) })?;
        Ok(fd.as_fd().as_raw_fd())
    }

    /// Write NAT entries directly, without routes, addresses or tc
    /// attachment (for tests of the tc programs with BPF_PROG_TEST_RUN).
    pub fn insert_nat_pair(&mut self, p: &NatPair) -> Result<(), DatapathError> {
        self.write_pair(p, None)
    }

    /// Complete UDP flows whose connect() ran before the socket had a local
    /// port, and drop UDP records whose socket is gone. The daemon calls this
    /// periodically; `connections()` shows pending flows either way.
    pub fn sync_udp(&mut self) -> Result<(), DatapathError> {
        let completed = self.completed_udp();
        for (cookie, key, rec) in completed {
            let _ = self.loaded.maps.conns.insert(key, rec, 0);
            let _ = self.loaded.maps.udp_pending.remove(&cookie);
        }
        let sockets = procfs::socket_inodes();
        let stale: Vec<FlowKey> = self
            .loaded
            .maps
            .conns
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, _)| k.proto == PROTO_UDP)
            .filter_map(|(k, _)| {
                let (local, remote) = key_endpoints(&k)?;
                let alive = sockets.keys().any(|(p, l, r)| {
                    *p == Proto::Udp
                        && l.port() == local.port()
                        && (l.ip() == local.ip() || l.ip().is_unspecified())
                        && (r.port() == 0 || *r == remote)
                });
                (!alive).then_some(k)
            })
            .collect();
        for k in stale {
            let _ = self.loaded.maps.conns.remove(&k);
        }
        Ok(())
    }

    /// Pending UDP connects matched to their now-bound socket: the socket in
    /// /proc/net/udp* connected to the same peer and held by the same process.
    fn completed_udp(&self) -> Vec<(u64, FlowKey, ConnRecord)> {
        let pending: Vec<_> = self.loaded.maps.udp_pending.iter().filter_map(Result::ok).collect();
        if pending.is_empty() {
            return Vec::new();
        }
        let sockets = procfs::socket_inodes();
        let owners = procfs::inode_owners();
        let mut out = Vec::new();
        for (cookie, p) in pending {
            let Some((_, remote)) = key_endpoints(&p.key) else { continue };
            let matches: Vec<SocketAddr> = sockets
                .iter()
                .filter(|((proto, _, r), inode)| {
                    *proto == Proto::Udp && *r == remote && owners.get(inode) == Some(&p.record.pid)
                })
                .map(|((_, l, _), _)| *l)
                .collect();
            if let [local] = matches[..] {
                let key = super::flow_key(Proto::Udp, local, remote);
                out.push((cookie, key, p.record));
            }
        }
        out
    }
}

impl Datapath for KernelDatapath {
    fn status(&self) -> Result<DatapathStatus, DatapathError> {
        let egress = self.egress_entries()?;
        let mut users: BTreeMap<u32, u32> = BTreeMap::new();
        for (_, v) in &egress {
            *users.entry(v.redirect_ifindex).or_default() += 1;
        }
        let tc = attach::pinned_tc(&self.bpffs)
            .into_iter()
            .map(|ifindex| TcAttachment {
                ifname: net::ifname(ifindex).unwrap_or_else(|_| format!("(gone, index {ifindex})")),
                ifindex,
                mode: "tcx".into(),
                users: users.get(&ifindex).copied().unwrap_or(0),
            })
            .collect();
        let cgroups = attach::pinned_cgroups(&self.bpffs)
            .into_iter()
            .map(|id| CgroupAttachment {
                path: attach::cgroup_path(id).unwrap_or_else(|| PathBuf::from(format!("(gone, id {id})"))),
                id,
            })
            .collect();
        let connections = self.loaded.maps.conns.keys().filter(Result::is_ok).count() as u64;
        Ok(DatapathStatus {
            bpffs: self.bpffs.clone(),
            netns_cookie: self.loaded.netns_cookie,
            programs_loaded: self.loaded.ebpf.programs().map(|(n, _)| n.to_string()).collect(),
            cgroups,
            tc,
            connections,
            translations: egress.len() as u64,
            counters: self.counters()?,
        })
    }

    fn connections(&self) -> Result<Vec<ConnectionInfo>, DatapathError> {
        let mut records: Vec<(FlowKey, ConnRecord)> =
            self.loaded.maps.conns.iter().collect::<Result<_, _>>().map_err(map_err(MAP_CONNS))?;
        records.extend(self.completed_udp().into_iter().map(|(_, k, r)| (k, r)));
        let translations: StdHashMap<FlowKey, Translation> = self
            .egress_entries()?
            .iter()
            .filter_map(|(k, v)| Some((*k, translation_of(k, v)?)))
            .collect();
        let now_ns = boottime_ns();
        // The /proc scans are only done when some record lacks an owner.
        let mut sockets: Option<StdHashMap<(Proto, SocketAddr, SocketAddr), u64>> = None;
        let mut owners: Option<StdHashMap<u64, u32>> = None;
        let mut out = Vec::with_capacity(records.len());
        // A UDP socket bound to the wildcard address records 0.0.0.0 / :: as
        // its local address; its packets carry the source the kernel routes
        // from, which is what a translation must match.
        let mut sources: StdHashMap<IpAddr, Option<IpAddr>> = StdHashMap::new();
        for (key, rec) in records {
            let Some(mut flow) = VirtualFlow::from_key(&key) else { continue };
            if flow.local.ip().is_unspecified() {
                let remote = flow.remote.ip();
                let src = *sources
                    .entry(remote)
                    .or_insert_with(|| net::route_get(remote, None).ok().and_then(|r| r.prefsrc));
                match src {
                    Some(ip) => flow.local = SocketAddr::new(ip, flow.local.port()),
                    None => continue,
                }
            }
            let key = flow.to_key();
            let t = translations.get(&key);
            let mut pid = (rec.pid != 0).then_some(rec.pid);
            if pid.is_none() {
                let s = sockets.get_or_insert_with(procfs::socket_inodes);
                let o = owners.get_or_insert_with(procfs::inode_owners);
                pid = s.get(&(flow.proto, flow.local, flow.remote)).and_then(|i| o.get(i)).copied();
            }
            let command = pid.and_then(procfs::comm).or_else(|| {
                let end = rec.comm.iter().position(|b| *b == 0).unwrap_or(rec.comm.len());
                (end > 0).then(|| String::from_utf8_lossy(&rec.comm[..end]).into_owned())
            });
            out.push(ConnectionInfo {
                id: flow.id(),
                proto: flow.proto,
                virtual_local: flow.local,
                virtual_remote: flow.remote,
                physical_local: t.map_or(flow.local, |t| t.physical_local),
                physical_remote: t.map_or(flow.remote, |t| t.physical_remote),
                state: if t.is_some() { ConnState::Translated } else { ConnState::Native },
                cookie: rec.cookie,
                cgroup_id: rec.cgroup_id,
                cgroup: pid.and_then(procfs::cgroup_of),
                pid,
                command,
                age_secs: now_ns.saturating_sub(rec.first_seen_ns) / 1_000_000_000,
            });
        }
        out.sort_by_key(|c| (c.proto, c.virtual_local, c.virtual_remote));
        Ok(out)
    }

    fn enable_cgroup(&mut self, path: &Path) -> Result<(), DatapathError> {
        attach::attach_cgroup(&mut self.loaded.ebpf, &self.bpffs, path).map(|_| ())
    }

    fn disable_cgroup(&mut self, path: &Path) -> Result<(), DatapathError> {
        let id = cgroup_id(path)?;
        attach::detach_cgroup(&self.bpffs, id)
    }

    fn restart_flow(&mut self, flow: &VirtualFlow) -> Result<super::RestartOutcome, DatapathError> {
        let key = flow.to_key();
        let record = match self.loaded.maps.conns.get(&key, 0) {
            Ok(r) => Some(r),
            Err(e) if is_not_found(&e) => None,
            Err(e) => return Err(map_err(MAP_CONNS)(e)),
        };
        restart::restart_flow(flow, record.as_ref())
    }

    fn install_translation(&mut self, t: &Translation) -> Result<(), DatapathError> {
        self.apply(t, true)
    }

    fn prepare_translation(&mut self, t: &Translation) -> Result<(), DatapathError> {
        self.apply(t, false)
    }

    fn remove_translation(&mut self, flow: &VirtualFlow) -> Result<(), DatapathError> {
        let key = flow.to_key();
        // Every reverse entry of the flow: during a move there may be two
        // (old and new placement), and a prepared-only move has no egress.
        let reverse: Vec<(FlowKey, NatRewrite)> = self
            .ingress_entries()?
            .into_iter()
            .filter(|(k, v)| restored_key(k, v).reversed() == key)
            .collect();
        let egress = self.egress_get(&key)?;
        let (t, v) = match (egress, reverse.first()) {
            (Some(v), _) => (translation_of(&key, &v), v),
            (None, Some((k, v))) => {
                // Rebuild the translation from the reverse entry: the packet
                // it matches is (physical remote -> physical local).
                let t = key_endpoints(k).map(|(pr, pl)| Translation { flow: *flow, physical_local: pl, physical_remote: pr });
                (t, *v)
            }
            (None, None) => return Err(DatapathError::NoSuchTranslation { flow: *flow }),
        };
        let t = t.ok_or(DatapathError::NoSuchTranslation { flow: *flow })?;
        if egress.is_some() {
            self.loaded.maps.egress.remove(&key).map_err(map_err(MAP_EGRESS_NAT))?;
        }
        for (k, _) in &reverse {
            let _ = self.loaded.maps.ingress.remove(k);
        }
        self.release(&t, &v)
    }

    fn translations(&self) -> Result<Vec<Translation>, DatapathError> {
        Ok(self.egress_entries()?.iter().filter_map(|(k, v)| translation_of(k, v)).collect())
    }

    fn maintain(&mut self) -> Result<(), DatapathError> {
        self.sync_udp()
    }

    fn interface_addresses(&self) -> Result<Vec<(IpAddr, u32)>, DatapathError> {
        net::interface_addrs()
    }

    fn source_address_for(&self, dst: IpAddr) -> Result<Option<IpAddr>, DatapathError> {
        match net::route_get(dst, None) {
            Ok(r) => Ok(r.prefsrc),
            Err(DatapathError::NoRoute { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

impl KernelDatapath {
    /// Install a translation; with `complete == false` only its receive side
    /// (see [`Datapath::prepare_translation`]).
    fn apply(&mut self, t: &Translation, complete: bool) -> Result<(), DatapathError> {
        validate_translation(t)?;
        let route = net::route_get(t.physical_remote.ip(), Some(t.physical_local.ip()))?;
        let egress_key = t.flow.to_key();
        let old_val = self.egress_get(&egress_key)?;
        let old = old_val.and_then(|v| translation_of(&egress_key, &v)).map(|o| (pair_for(&o, v_ifindex(&old_val), v_flags(&old_val)), o));
        let probe = pair_for(t, route.ifindex, 0);
        if let Some(other) = self.ingress_get(&probe.ingress_key)? {
            // The entry restores (remote virtual -> local virtual); reversed,
            // that is the egress key of the translation that owns it.
            if restored_key(&probe.ingress_key, &other).reversed() != egress_key {
                return Err(DatapathError::InvalidTranslation {
                    flow: t.flow,
                    reason: "another translation already uses these physical endpoints",
                });
            }
        }

        let mut flags = 0;
        let mut added_lo: Option<IpAddr> = None;
        let mut added_route: Option<IpAddr> = None;
        let undo = |added_lo: Option<IpAddr>, added_route: Option<IpAddr>| {
            if let Some(ip) = added_lo {
                let _ = net::del_lo_addr(ip);
            }
            if let Some(ip) = added_route {
                let _ = net::del_host_route(ip);
            }
        };
        if t.local_moved() {
            let ip = t.flow.local.ip();
            let ours_already = self.egress_entries()?.iter().any(|(k, v)| {
                v.flags & NAT_F_LO_ADDR_OURS != 0 && translation_of(k, v).is_some_and(|o| o.flow.local.ip() == ip)
            }) || self.ingress_entries()?.iter().any(|(k, v)| {
                v.flags & NAT_F_LO_ADDR_OURS != 0 && restored_key(k, v).dst_addr_be == super::flow_key(t.flow.proto, t.flow.local, t.flow.remote).src_addr_be
            });
            if ours_already {
                flags |= NAT_F_LO_ADDR_OURS;
            } else if !net::lo_addrs()?.contains(&ip) {
                net::add_lo_addr(ip)?;
                added_lo = Some(ip);
                flags |= NAT_F_LO_ADDR_OURS;
            }
        }
        if t.remote_moved() {
            let ip = t.flow.remote.ip();
            let existed = net::host_routes()?.contains(&ip);
            if let Err(e) = net::add_host_route(ip, t.physical_remote.ip(), &route) {
                undo(added_lo, None);
                return Err(e);
            }
            if !existed {
                added_route = Some(ip);
            }
            // With the host route in place the old address leaves where the
            // new one does; if not (a conflicting route), re-resolve the next
            // hop per packet in tc.
            let next_hop = route.gateway.unwrap_or(t.physical_remote.ip());
            match net::route_get(ip, None) {
                Ok(r) if r.ifindex == route.ifindex && r.gateway.unwrap_or(ip) == next_hop => {}
                _ => flags |= NAT_F_REDIRECT,
            }
        }
        if !self.tc_current.contains(&route.ifindex) {
            if let Err(e) = attach::attach_tc(&mut self.loaded.ebpf, &self.bpffs, route.ifindex) {
                undo(added_lo, added_route);
                return Err(e);
            }
            self.tc_current.insert(route.ifindex);
        }
        let pair = pair_for(t, route.ifindex, flags);
        if !complete {
            // Receive side only; an earlier placement keeps working until
            // install_translation switches the send side over.
            if let Err(e) = self.loaded.maps.ingress.insert(pair.ingress_key, pair.ingress, 0) {
                undo(added_lo, added_route);
                return Err(map_err(MAP_INGRESS_NAT)(e));
            }
            return Ok(());
        }
        if let Err(e) = self.write_pair(&pair, old.as_ref().map(|(p, _)| p)) {
            undo(added_lo, added_route);
            return Err(e);
        }
        if let Some((old_pair, old_t)) = old {
            // Moving again: release what only the previous placement needed.
            if old_pair.egress.redirect_ifindex != route.ifindex || old_t.remote_moved() != t.remote_moved() {
                let _ = self.release(&old_t, &NatRewrite { flags: 0, ..old_pair.egress });
            }
        }
        Ok(())
    }

}

fn v_ifindex(v: &Option<NatRewrite>) -> u32 {
    v.map_or(0, |v| v.redirect_ifindex)
}
fn v_flags(v: &Option<NatRewrite>) -> u32 {
    v.map_or(0, |v| v.flags)
}

/// The packet an ingress entry produces: (remote virtual -> local virtual).
fn restored_key(key: &FlowKey, v: &NatRewrite) -> FlowKey {
    FlowKey {
        src_addr_be: v.src_addr_be,
        dst_addr_be: v.dst_addr_be,
        src_port_be: v.src_port_be,
        dst_port_be: v.dst_port_be,
        ..*key
    }
}

/// CLOCK_BOOTTIME in ns, the clock the eBPF side stamps records with.
fn boottime_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
