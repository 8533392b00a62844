//! The real datapath: eBPF programs loaded into the kernel, attached to
//! cgroups and interfaces, with maps and links pinned under a bpffs
//! directory so that translation survives the process (DESIGN.md §3).

mod adopt;
mod attach;
pub mod batch;
mod budgets;
pub mod check;
pub mod cleanup;
mod clsact;
mod conntrack;
pub mod fault;
pub mod features;
mod gone;
mod guests;
mod hide;
mod intercept;
mod kept;
mod levers;
mod listing;
mod mirror;
mod nat;
mod natguard;
mod net;
mod object;
mod open;
mod peerns;
pub mod pinlock;
mod policy;
pub mod procfs;
mod rebind;
mod reconcile;
mod restart;
mod routing;
mod rtnl;
pub use rtnl::set_receive_timeout;
mod sizes;
pub mod sysctls;
pub mod testrun;
mod translate;

use std::{
    collections::{BTreeMap, HashMap as StdHashMap},
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
};

use aya::maps::MapError;
use vnat_common::{
    ConnRecord, FlowKey, NatRewrite, RebindKey, UnvalidatedBudget, MAP_CONNS, MAP_EGRESS_NAT,
    MAP_INGRESS_NAT, MAP_STATS, MAP_UNVALIDATED, NAT_F_BUDGET, NAT_F_FALLBACK, NAT_F_FAMILY,
    NAT_F_HOLD, NAT_F_LO_ADDR_OURS, NAT_F_ROUTED, PROTO_UDP, STAT_COUNT, STAT_NAMES,
};

pub use attach::{cgroup2_mount, cgroup_id, cgroup_tree_ids};
use mirror::Mirror;
pub use nat::{pair_for, translation_of, NatPair};
pub use net::{ROUTE_PROTO, SINK_DEV, SINK_PEER};
pub use object::{own_netns_cookie, EBPF_OBJECT};
pub use rtnl::notifications_matter;

use super::{
    flow_key, key_endpoints, validate_translation, CgroupAttachment, ConnState, ConnectionInfo,
    Datapath, DatapathError, DatapathStatus, Proto, TcAttach, TcAttachment, TcMode, Translation,
    VirtualFlow,
};

/// How long a TCP flow's packets over an unvalidated address's allowance
/// are held in the socket (dropped at tc, a local failure) before they go
/// to the flow's last validated placement (`UnvalidatedBudget::fallback`):
/// a validation takes a round trip, and a packet held is sent again as
/// soon as it can be, where one sent to a placement the peer left is a
/// loss at best, and a reset at worst when that address still reaches the
/// peer's host and its vnatd no longer receives there (both ends moving,
/// the server's old address still routed to it). So the fallback is only
/// for validations that take seconds (a mass move). Not longer: a socket
/// whose sends fail locally tries every 500 ms and gives up after
/// `tcp_retries2` tries (7.5 s by default), and a move may have held its
/// packets for up to `HOLD_LIMIT` (2 s) already: 4 s of the 7.5.
pub const FALLBACK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How to open the kernel datapath.
#[derive(Clone, Debug)]
pub struct KernelOptions {
    /// Directory on bpffs for this instance's pins (`--bpffs`).
    pub bpffs: PathBuf,
    /// cgroup v2 directories to record connections of (`--cgroup`). Cgroups
    /// enabled earlier (pinned) stay enabled.
    pub cgroups: Vec<PathBuf>,
    /// How to attach the tc translators (`tc_attach`).
    pub tc_attach: TcAttach,
    /// Where to record the sysctls' values before vnat first changes them,
    /// so that they can be put back ([`sysctls::record_path`] of vnatd's
    /// state directory); None changes them without a record (tools,
    /// tests).
    pub sysctl_record: Option<PathBuf>,
    /// When the Ethernet tc translators go through the verifier.
    pub tc_load: TcLoad,
}

/// When an opening loads the Ethernet tc translators, the verifier's
/// longest work (about 0.45 s of an opening's 0.6 s here, 5 s of 8 in an
/// emulated VM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcLoad {
    /// At open (vnatd): a move onto an interface never waits for the
    /// verifier, even with `standby_tc` off.
    AtOpen,
    /// At their first attachment or test run, as the L3 translators are:
    /// for openings that may attach nothing (the test harness, which opens
    /// a host's datapath for every step it takes).
    OnFirstUse,
}

pub struct KernelDatapath {
    bpffs: PathBuf,
    loaded: object::Loaded,
    /// How new tc attachments are made (`tc_attach` resolved at open).
    tc_mode: TcMode,
    /// Capabilities this kernel weakens or turns off, found at open.
    degraded: Vec<super::Degraded>,
    /// Interfaces whose tc links run this process's programs.
    tc_current: std::collections::BTreeSet<u32>,
    /// Interfaces kept attached without a translation (`standby_tc`).
    standby: std::collections::BTreeSet<u32>,
    /// Interfaces kept attached to divert in-band BINDs (`divert_binds`)
    /// or for NAT guards (`guard_nat`).
    bind_ifaces: std::collections::BTreeSet<u32>,
    /// Addresses on `lo` that a translation entry marks as vnat's
    /// (NAT_F_LO_ADDR_OURS), as far as this process has seen: saves a scan
    /// of both NAT maps per moved connection.
    lo_ours: std::collections::HashSet<IpAddr>,
    /// Between `begin_batch` and `end_batch`: route lookups made in this
    /// batch.
    memo: std::cell::RefCell<Option<RouteMemo>>,
    /// Translations whose socket's packets the main table would not take
    /// to their new next hop (`flow_route`: `vnatctl migrate` while the old
    /// address stays up; a peer that moved where its old address is not
    /// routed), so that a rule of their own routes them
    /// (`net::add_via_route`): egress key -> (flow, the interface).
    egress_via: StdHashMap<FlowKey, (VirtualFlow, u32)>,
    /// Addresses kept local for mobile connections (`kept.rs`).
    kept: std::collections::BTreeSet<IpAddr>,
    /// Containers' connections: which NAT entries are pinned, which public
    /// flows are guests' (`guests.rs`).
    guests: std::cell::RefCell<guests::GuestState>,
    /// What listings keep between them (`listing.rs`).
    listing: std::cell::RefCell<listing::ListingCache>,
    /// This process's copy of the two NAT maps, read from the pins at open
    /// and kept in step with every write (only this process writes them;
    /// the programs only read). Deciding whether anything else still needs
    /// an address, route or attachment reads it instead of walking the
    /// maps with two syscalls per entry, which made closing or moving each
    /// of 100,000 connections cost a walk of 100,000 entries.
    mirror: Mirror,
    /// Whether the config map says both NAT maps are empty
    /// (`CFG_F_NAT_EMPTY`), as this process last wrote it.
    nat_empty: bool,
    /// Whether the config map says some flow is rebinding
    /// (`CFG_F_REBINDING`), as this process last wrote it.
    rebinding: bool,
    /// The VCMP port in-band BINDs are diverted to (`CFG_F_BIND_DIVERT`),
    /// 0 while none are.
    bind_divert_port: u16,
    /// Rebinding entries this process wrote that the tc program has not
    /// completed yet (see `rebind`).
    rebinds: std::collections::HashSet<RebindKey>,
    /// When each rebind was written: one whose BIND never came is given up
    /// after [`rebind_limit`] (while it waits, packets from that address to
    /// that port that no recorded flow owns are dropped).
    rebinds_since: StdHashMap<RebindKey, std::time::Instant>,
    /// NAT guards this process wrote (`natguard.rs`).
    guards: natguard::Guards,
    /// Flows whose next install sends to a peer address not validated yet,
    /// with the bytes it may send there to begin with
    /// ([`Datapath::limit_until_validated`]), by egress key.
    budget_next: StdHashMap<FlowKey, u32>,
    /// When connections were last looked for to adopt (`adopt.rs`).
    last_adoption: Option<std::time::Instant>,
    /// Sockets whose sequence numbers could not be read yet: tries, and
    /// when to try again (`adopt.rs`).
    adopt_backoff: StdHashMap<u64, (u32, std::time::Instant)>,
    /// What this process last wrote for hide location (`hide.rs`).
    hide_mirror: Option<hide::HideMirror>,
    /// [`KernelOptions::sysctl_record`].
    sysctl_record: Option<PathBuf>,
}

/// How long a flow waits for its peer's BIND after a move behind a new NAT
/// before the wait (and the drop it brings) is given up: a UDP flow 10 s;
/// a TCP connection 60 s, as long as its peer's vnatd answers our BIND
/// requests (`Config::max_tries` of them, backing off) and its TCP keeps
/// sending.
fn rebind_limit(proto: u8) -> std::time::Duration {
    if proto == vnat_common::PROTO_TCP {
        std::time::Duration::from_secs(60)
    } else {
        std::time::Duration::from_secs(10)
    }
}

#[derive(Default)]
struct RouteMemo {
    /// (destination, source) -> the kernel's answer. Cleared whenever this
    /// datapath changes a route or an address.
    routes: StdHashMap<(IpAddr, Option<IpAddr>), net::RouteInfo>,
    /// This host's addresses with their interfaces, once listed.
    addrs: Option<Vec<(IpAddr, u32)>>,
    /// The IPv6 last-resort route was renewed in this batch.
    sink_renewed: bool,
}

fn map_err(map: &'static str) -> impl FnOnce(MapError) -> DatapathError {
    move |e| DatapathError::Map {
        map,
        source: Box::new(e),
    }
}

fn is_not_found(e: &MapError) -> bool {
    matches!(e, MapError::KeyNotFound)
}

impl KernelDatapath {
    /// How new tc attachments are made.
    pub fn tc_mode(&self) -> TcMode {
        self.tc_mode
    }

    /// The pin directory.
    pub fn bpffs(&self) -> &Path {
        &self.bpffs
    }

    /// Every entry of the egress (`egress`) or ingress NAT map, read from
    /// the kernel.
    fn read_map(&self, egress: bool) -> Result<Vec<(FlowKey, NatRewrite)>, DatapathError> {
        let (map, name) = if egress {
            (&self.loaded.maps.egress, MAP_EGRESS_NAT)
        } else {
            (&self.loaded.maps.ingress, MAP_INGRESS_NAT)
        };
        batch::read_all(map).map_err(map_err(name))
    }

    /// The translations' egress entries: not those that only hold a flow
    /// during its move (`NAT_F_HOLD`), which translate nothing.
    ///
    /// While some flow is rebinding, the tc program may have installed its
    /// translation since this process last looked (`begin_batch` takes it
    /// into the copy): read the map itself then, so that a listing never
    /// shows a connection that already moved as not translated.
    fn egress_entries(&self) -> Result<Vec<(FlowKey, NatRewrite)>, DatapathError> {
        let keep =
            |(k, v): (&FlowKey, &NatRewrite)| (!translate::is_hold_only(k, v)).then_some((*k, *v));
        if !self.rebinds.is_empty() {
            return Ok(self
                .read_map(true)?
                .iter()
                .filter_map(|(k, v)| keep((k, v)))
                .collect());
        }
        Ok(self.mirror.egress.iter().filter_map(keep).collect())
    }

    fn ingress_entries(&self) -> Result<Vec<(FlowKey, NatRewrite)>, DatapathError> {
        Ok(self.mirror.ingress.iter().map(|(k, v)| (*k, *v)).collect())
    }

    /// The endpoints on the wire of a flow carried in the other address
    /// family (an IPv4 connection over IPv6), `None` for any other flow:
    /// a message the levers send toward the peer goes out in that form,
    /// since no IPv4 route may lead there (`restart::send_probe`).
    fn wire_of_other_family(
        &self,
        flow: &VirtualFlow,
    ) -> Result<Option<VirtualFlow>, DatapathError> {
        let key = flow.to_key();
        Ok(self
            .egress_get(&key)?
            .filter(|v| v.flags & vnat_common::NAT_F_FAMILY != 0)
            .and_then(|v| nat::translation_of(&key, &v))
            .map(|t| VirtualFlow {
                proto: flow.proto,
                local: t.physical_local,
                remote: t.physical_remote,
            }))
    }

    fn egress_get(&self, key: &FlowKey) -> Result<Option<NatRewrite>, DatapathError> {
        Ok(self.mirror.egress.get(key).copied())
    }

    fn ingress_get(&self, key: &FlowKey) -> Result<Option<NatRewrite>, DatapathError> {
        Ok(self.mirror.ingress.get(key).copied())
    }

    /// Write one NAT entry, to the kernel and the mirror.
    fn nat_insert(
        &mut self,
        egress: bool,
        key: FlowKey,
        value: NatRewrite,
    ) -> Result<(), DatapathError> {
        // Open the gate before the first entry exists, so that no packet
        // of the flow passes untranslated once its entry is in place.
        self.set_nat_empty(false)?;
        let (map, name) = if egress {
            (&mut self.loaded.maps.egress, MAP_EGRESS_NAT)
        } else {
            (&mut self.loaded.maps.ingress, MAP_INGRESS_NAT)
        };
        map.insert(key, value, 0).map_err(map_err(name))?;
        self.mirror.insert(egress, key, value);
        Ok(())
    }

    /// Say in the config map whether both NAT maps are empty, if that
    /// changed.
    fn set_nat_empty(&mut self, empty: bool) -> Result<(), DatapathError> {
        if self.nat_empty != empty {
            object::set_config(
                &mut self.loaded,
                empty,
                self.rebinding,
                self.bind_divert_port,
            )?;
            self.nat_empty = empty;
        }
        Ok(())
    }

    /// Whether the tc ingress program must look past a miss
    /// (`CFG_F_REBINDING`): a flow rebinding, or a NAT guard standing. The
    /// flag may go off only when neither is left: a guard without it drops
    /// nothing.
    pub(super) fn looking_past_misses(&self) -> bool {
        !self.rebinds.is_empty() || !self.guards.is_empty()
    }

    /// Say in the config map whether some flow is rebinding, if that
    /// changed (ingress misses look in the rebind map only then).
    fn set_rebinding(&mut self, on: bool) -> Result<(), DatapathError> {
        if self.rebinding != on {
            object::set_config(&mut self.loaded, self.nat_empty, on, self.bind_divert_port)?;
            self.rebinding = on;
        }
        Ok(())
    }

    /// Delete one NAT entry (absent already is fine), from the kernel and
    /// the mirror.
    fn nat_remove(&mut self, egress: bool, key: &FlowKey) -> Result<(), DatapathError> {
        let (r, name) = if egress {
            (self.loaded.maps.egress.remove(key), MAP_EGRESS_NAT)
        } else {
            (self.loaded.maps.ingress.remove(key), MAP_INGRESS_NAT)
        };
        match r {
            Ok(()) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => return Err(map_err(name)(e)),
        }
        self.mirror.remove(egress, key);
        // Not while a flow rebinds or a guard stands: the translators would
        // pass their packets unparsed.
        if self.mirror.is_empty() && !self.looking_past_misses() {
            // Closing the gate is only a saving: the removal stands if
            // it cannot be written, and the next removal tries again.
            if let Err(e) = self.set_nat_empty(true) {
                tracing::debug!(error = %e, "cannot mark the NAT maps empty");
            }
        }
        Ok(())
    }

    /// Summed per-CPU counters in `STAT_NAMES` order.
    pub fn counters(&self) -> Result<Vec<(String, u64)>, DatapathError> {
        (0..STAT_COUNT)
            .map(|i| {
                let per_cpu = self
                    .loaded
                    .maps
                    .stats
                    .get(&i, 0)
                    .map_err(map_err(MAP_STATS))?;
                Ok((STAT_NAMES[i as usize].to_string(), per_cpu.iter().sum()))
            })
            .collect()
    }

    /// Raw program fd of a tc translator, for BPF_PROG_TEST_RUN: loaded
    /// once opened with [`TcLoad::AtOpen`] or attached somewhere.
    pub fn tc_program_fd(&self, egress: bool) -> Result<std::os::fd::RawFd, DatapathError> {
        use std::os::fd::{AsFd, AsRawFd};
        let name = if egress {
            vnat_common::PROG_TC_EGRESS
        } else {
            vnat_common::PROG_TC_INGRESS
        };
        let p: &aya::programs::SchedClassifier = self
            .loaded
            .ebpf
            .program(name)
            .ok_or_else(|| DatapathError::Load {
                source: format!("program {name} missing").into(),
            })?
            .try_into()
            .map_err(|e: aya::programs::ProgramError| DatapathError::Load {
                source: Box::new(e),
            })?;
        let fd = p.fd().map_err(|e| DatapathError::Load {
            source: Box::new(e),
        })?;
        Ok(fd.as_fd().as_raw_fd())
    }
}

impl Datapath for KernelDatapath {
    fn divert_binds(&mut self, toward: IpAddr, vcmp_port: u16) -> Result<(), DatapathError> {
        self.divert_binds_toward(toward, vcmp_port)
    }

    fn send_in_band(
        &mut self,
        local: std::net::SocketAddr,
        remote: std::net::SocketAddr,
        payload: &[u8],
    ) -> Result<(), DatapathError> {
        restart::send_udp(local, remote, payload)
    }
    fn expect_tcp_bind(
        &mut self,
        flow: &VirtualFlow,
        token: [u8; 8],
    ) -> Result<bool, DatapathError> {
        self.set_rebind_token(flow, token)
    }
    fn send_tcp_bind(
        &mut self,
        flow: &VirtualFlow,
        local: std::net::SocketAddr,
        remote: std::net::SocketAddr,
        token: [u8; 8],
    ) -> Result<(), DatapathError> {
        let Some(record) = self.record(flow)? else {
            return Err(DatapathError::InvalidTranslation {
                flow: *flow,
                reason: "no recorded connection to send a TCP BIND for",
            });
        };
        if !restart::send_tcp_bind(flow, &record, local, remote, token)? {
            return Err(DatapathError::InvalidTranslation {
                flow: *flow,
                reason: "the connection's socket is gone",
            });
        }
        Ok(())
    }
    fn receive_vcmp_at(
        &mut self,
        addrs: &std::collections::BTreeSet<std::net::IpAddr>,
        vcmp_port: u16,
    ) -> Result<(), DatapathError> {
        intercept::sync(addrs, vcmp_port).map_err(|source| DatapathError::Kernel {
            what: "setting the rules that take VCMP datagrams to routed containers' addresses"
                .into(),
            source,
        })
    }
    fn status(&self) -> Result<DatapathStatus, DatapathError> {
        let egress = self.egress_entries()?;
        let mut users: BTreeMap<u32, u32> = BTreeMap::new();
        for (_, v) in &egress {
            *users.entry(v.redirect_ifindex).or_default() += 1;
        }
        let tc = attach::tc_attachments(&self.bpffs)
            .into_iter()
            .map(|(ifindex, mode)| TcAttachment {
                ifname: net::ifname(ifindex).unwrap_or_else(|_| format!("(gone, index {ifindex})")),
                ifindex,
                mode,
                users: users.get(&ifindex).copied().unwrap_or(0),
            })
            .collect();
        let hiding = self.hiding_ids();
        let mut ids = attach::pinned_cgroups(&self.bpffs);
        // Hiding cgroups that an enabled one above covers are listed too.
        ids.extend(
            hiding
                .iter()
                .filter(|h| !ids.contains(h))
                .collect::<Vec<_>>(),
        );
        let cgroups = ids
            .into_iter()
            .map(|id| CgroupAttachment {
                path: attach::cgroup_path(id)
                    .unwrap_or_else(|| PathBuf::from(format!("(gone, id {id})"))),
                id,
                hide_location: hiding.contains(&id),
            })
            .collect();
        let connections = batch::read_all(&self.loaded.maps.conns)
            .map_err(map_err(MAP_CONNS))?
            .len() as u64;
        Ok(DatapathStatus {
            kernel: object::kernel_release(),
            tc_mode: self.tc_mode,
            degraded: self.degraded.clone(),
            bpffs: self.bpffs.clone(),
            netns_cookie: self.loaded.netns_cookie,
            programs_loaded: self
                .loaded
                .ebpf
                .programs()
                .filter(|(_, p)| p.fd().is_ok())
                .map(|(n, _)| n.to_string())
                .collect(),
            cgroups,
            tc,
            connections,
            translations: egress.len() as u64,
            counters: self.counters()?,
        })
    }

    fn enable_cgroup(&mut self, path: &Path) -> Result<(), DatapathError> {
        attach::attach_cgroup(&mut self.loaded.ebpf, &self.bpffs, path)?;
        // The cgroup's connections opened before now.
        self.adopt_logged();
        Ok(())
    }

    fn disable_cgroup(&mut self, path: &Path) -> Result<(), DatapathError> {
        let id = cgroup_id(path)?;
        match attach::detach_cgroup(&self.bpffs, id) {
            Ok(()) => {}
            // A hiding cgroup that an enabled one above covers has no
            // programs of its own: disabling it stops its hiding.
            Err(DatapathError::CgroupNotEnabled { .. }) if self.hiding_ids().contains(&id) => {}
            Err(e) => return Err(e),
        }
        // Nothing of it is recorded or hidden any more.
        self.hide_cgroup_id(id, false)?;
        Ok(())
    }

    fn set_hide_location(&mut self, path: &Path, on: bool) -> Result<bool, DatapathError> {
        self.hide_cgroup(path, on)
    }

    fn hiding_cgroups(&self) -> Result<Vec<u64>, DatapathError> {
        Ok(self.hiding_ids())
    }

    fn set_hidden(&mut self, table: &crate::datapath::HideTable) -> Result<(), DatapathError> {
        self.write_hidden(table)
    }

    fn restart_flow(&mut self, flow: &VirtualFlow) -> Result<super::RestartOutcome, DatapathError> {
        let record = self.record(flow)?;
        if record.is_none() && self.guests.borrow().is_guest(&flow.to_key()) {
            // A container's socket is in its own namespace, out of the
            // levers' reach: its own TCP retransmits.
            return Ok(super::RestartOutcome::NotStalled);
        }
        let wire = self.wire_of_other_family(flow)?;
        restart::restart_flow(flow, record.as_ref(), wire.as_ref())
    }

    fn keep_local(&mut self, mobile: &[IpAddr], in_use: &[IpAddr]) -> Result<(), DatapathError> {
        self.keep_local_addrs(mobile, in_use)
    }

    fn set_standby(&mut self, ifindexes: &[u32]) -> Result<(), DatapathError> {
        self.standby_tc(ifindexes)
    }

    fn kick_flow(
        &mut self,
        flow: &VirtualFlow,
        peer_moved: bool,
    ) -> Result<super::Kick, DatapathError> {
        let wire = self.wire_of_other_family(flow)?;
        match self.record(flow)? {
            Some(record) => restart::kick(flow, &record, peer_moved, wire.as_ref()),
            None => Ok(super::Kick::Nothing),
        }
    }

    fn solicit_ack(&mut self, flow: &VirtualFlow) -> Result<bool, DatapathError> {
        match self.record(flow)? {
            Some(record) => restart::solicit_ack(flow, &record),
            None => Ok(false),
        }
    }

    fn hold_keepalive(&mut self, flow: &VirtualFlow, hold: bool) -> Result<bool, DatapathError> {
        match self.record(flow)? {
            Some(record) => restart::hold_keepalive(flow, &record, hold),
            None => Ok(false),
        }
    }

    fn peer_silence(
        &mut self,
        flow: &VirtualFlow,
    ) -> Result<crate::datapath::PeerSilence, DatapathError> {
        match self.record(flow)? {
            Some(record) => restart::peer_silence(flow, &record),
            None => Ok(crate::datapath::PeerSilence::Gone),
        }
    }

    fn reset_connection(&mut self, flow: &VirtualFlow) -> Result<bool, DatapathError> {
        self.reset_recorded(flow)
    }

    fn connection_socket(
        &mut self,
        flow: &VirtualFlow,
    ) -> Result<Option<std::os::fd::OwnedFd>, DatapathError> {
        match self.record(flow)? {
            Some(record) => restart::connection_socket(flow, &record),
            None => Ok(None),
        }
    }

    fn socket_holder(&mut self, flow: &VirtualFlow) -> Result<Option<u32>, DatapathError> {
        match self.record(flow)? {
            Some(record) => restart::socket_holder(flow, &record),
            None => Ok(None),
        }
    }

    fn set_user_timeout(
        &mut self,
        flow: &VirtualFlow,
        ms: u32,
    ) -> Result<Option<u32>, DatapathError> {
        match self.record(flow)? {
            Some(record) => restart::set_user_timeout(flow, &record, ms),
            None => Ok(None),
        }
    }

    fn answer_for_peer(
        &mut self,
        flow: &VirtualFlow,
        window: u32,
        unless_moved_from: Option<(u64, u64)>,
    ) -> Result<super::PeerAnswer, DatapathError> {
        match self.record(flow)? {
            Some(record) => restart::answer_for_peer(flow, &record, window, unless_moved_from),
            None => Ok(super::PeerAnswer::Gone),
        }
    }

    fn limit_until_validated(&mut self, flow: &VirtualFlow, allowed: Option<u32>) {
        let key = flow.to_key();
        match allowed {
            Some(a) => self.budget_next.insert(key, a),
            None => self.budget_next.remove(&key),
        };
    }

    fn diverted_while_unvalidated(&self, flow: &VirtualFlow) -> bool {
        self.unvalidated_diverted(flow)
            .ok()
            .flatten()
            .is_some_and(|n| n > 0)
    }

    fn credit_unvalidated(
        &mut self,
        flow: &VirtualFlow,
        allowed: u32,
    ) -> Result<bool, DatapathError> {
        self.credit_budget(flow, allowed)
    }

    fn install_translation(&mut self, t: &Translation) -> Result<(), DatapathError> {
        // Port 0: the peer moved behind a NAT whose port only its first
        // packet can tell; the tc program learns it (`rebind`).
        if t.physical_remote.port() == 0 {
            return self.rebind(t);
        }
        // Any other placement ends a rebind still waiting (a failed
        // validation reverts to the old one); only once it is in place:
        // in between, a UDP datagram from the peer's new port would match
        // neither and reach the flow's port untranslated, where a server
        // takes it for a new peer's.
        self.apply(t, true)?;
        self.drop_rebinds(&t.flow.to_key());
        Ok(())
    }

    fn prepare_translation(&mut self, t: &Translation) -> Result<(), DatapathError> {
        if t.physical_remote.port() == 0 {
            // TCP: not before the new address is validated: a rebind entry
            // makes the tc program drop that address's segments to the
            // connection's port until the peer's TCP BIND, and an
            // unvalidated address may be anyone's.
            // The mover holds its TCP flows until our SWITCHED, which
            // follows the install, so nothing is lost by waiting. A UDP
            // rebind only makes the tc program drop datagrams from that
            // address to the flow's port that no recorded flow owns (the
            // port is learnt from a BIND): at once, because the peer's
            // datagrams follow our UPD_R, which leaves before we have
            // validated it, and would reach the server's socket as a new
            // peer's.
            if t.flow.proto == crate::datapath::Proto::Udp {
                return self.rebind(t);
            }
            return Ok(());
        }
        self.apply(t, false)
    }

    fn translations(&self) -> Result<Vec<Translation>, DatapathError> {
        Ok(self
            .egress_entries()?
            .iter()
            .filter_map(|(k, v)| translation_of(k, v))
            .collect())
    }

    fn flows_with_entries(&self) -> Result<Vec<VirtualFlow>, DatapathError> {
        let mut all: std::collections::BTreeSet<VirtualFlow> = self
            .mirror
            .egress
            .keys()
            .filter_map(VirtualFlow::from_key)
            .collect();
        all.extend(self.mirror.reverse.keys().filter_map(VirtualFlow::from_key));
        Ok(all.into_iter().collect())
    }

    fn hold_send_side(&mut self, flow: &VirtualFlow, hold: bool) -> Result<(), DatapathError> {
        self.hold(flow, hold.then_some(crate::daemon::mover::HOLD_LIMIT))
    }

    fn hold_send_side_for(
        &mut self,
        flow: &VirtualFlow,
        limit: std::time::Duration,
    ) -> Result<(), DatapathError> {
        self.hold(flow, Some(limit))
    }

    fn release_held(&mut self) -> Result<usize, DatapathError> {
        self.release_all_held()
    }

    fn maintain(&mut self) -> Result<(), DatapathError> {
        self.sync_udp()?;
        self.drop_closed_adopted()?;
        self.drop_closed_guards()?;
        if self
            .last_adoption
            .is_none_or(|t| t.elapsed() >= adopt::ADOPT_EVERY)
        {
            self.adopt()?;
        }
        Ok(())
    }

    fn interface_addresses(&self) -> Result<Vec<(IpAddr, u32)>, DatapathError> {
        net::interface_addrs()
    }

    fn source_address_for(&self, dst: IpAddr) -> Result<Option<IpAddr>, DatapathError> {
        let r = match self.route(dst, None) {
            Ok(r) => r,
            Err(DatapathError::NoRoute { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let Some(src) = r.prefsrc else {
            return Ok(None);
        };
        // When the interface the route leaves by has no address of the
        // family (the old one just removed, the new one not there yet), the
        // kernel borrows one from another interface: a container bridge's,
        // a VPN's. No connection can move there.
        if net::interface_addrs()?
            .iter()
            .any(|(a, i)| *a == src && *i == r.ifindex)
        {
            return Ok(Some(src));
        }
        // A route with a source of its own (an address kept on lo) means it.
        let configured = rtnl::fib_match(dst).ok().flatten().and_then(|m| m.prefsrc);
        Ok((configured == Some(src)).then_some(src))
    }

    fn connections(&self) -> Result<Vec<ConnectionInfo>, DatapathError> {
        self.list(true)
    }

    fn connections_without_owners(&self) -> Result<Vec<ConnectionInfo>, DatapathError> {
        self.list(false)
    }

    fn settle_guests(&mut self) -> Result<(), DatapathError> {
        self.pin_guests()
    }

    fn note_interfaces(&mut self) -> Result<(), DatapathError> {
        self.sync_gone()
    }

    fn remove_translation(&mut self, flow: &VirtualFlow) -> Result<(), DatapathError> {
        self.remove(flow)
    }

    fn guard_nat(&mut self, flow: &VirtualFlow, nat: IpAddr) -> Result<(), DatapathError> {
        self.guard_flow(flow, nat)
    }

    fn nat_guard_drops(&mut self) -> Result<Vec<super::GuardDrop>, DatapathError> {
        self.guard_drops()
    }

    fn begin_batch(&mut self) {
        *self.memo.get_mut() = Some(RouteMemo::default());
        rtnl::pin_netns();
        // Rebinds the tc program completed since: take their translations
        // into this process's copy of the maps.
        if !self.rebinds.is_empty() {
            let before = self.rebinds.len();
            self.drop_stopped_rebinds();
            let pending: Vec<RebindKey> = self.rebinds.iter().copied().collect();
            for k in pending {
                if !self.rebind_pending(&k).unwrap_or(true) {
                    self.rebinds.remove(&k);
                    self.rebinds_since.remove(&k);
                }
            }
            let now = std::time::Instant::now();
            let overdue: Vec<RebindKey> = self
                .rebinds_since
                .iter()
                .filter(|(k, since)| now.duration_since(**since) >= rebind_limit(k.proto))
                .map(|(k, _)| *k)
                .collect();
            for k in overdue {
                self.rebinds_since.remove(&k);
                if self.loaded.maps.rebind.remove(&k).is_ok() || self.rebinds.contains(&k) {
                    self.rebinds.remove(&k);
                    // The key has no local port: it names no single flow,
                    // so there is no id to log.
                    if k.proto == vnat_common::PROTO_TCP {
                        tracing::warn!(
                            "a TCP connection's peer moved behind a NAT and never sent its BIND: no longer waiting for it (its packets from there now meet no translation)"
                        );
                    } else {
                        tracing::warn!(
                            "a UDP flow's peer moved behind a NAT and never sent its BIND: no longer waiting for it"
                        );
                    }
                }
            }
            if self.rebinds.len() != before {
                match self.sync_learned() {
                    Ok(n) => {
                        tracing::info!(entries = n, "learned the new NAT port of a peer that moved")
                    }
                    Err(e) => tracing::warn!(error = %e, "cannot read the learned translations"),
                }
            }
            if !self.looking_past_misses() {
                if let Err(e) = self.set_rebinding(false) {
                    tracing::debug!(error = %e, "cannot mark rebinding done");
                }
            }
        }
    }

    fn end_batch(&mut self) {
        *self.memo.get_mut() = None;
        rtnl::unpin_netns();
    }

    fn restore_sysctls(&mut self) -> Result<super::SysctlsAtStop, DatapathError> {
        self.sysctls_at_stop()
    }
}
