//! An in-memory [`Datapath`] for unit tests of the logic above the kernel.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use super::{
    validate_translation, CgroupAttachment, ConnState, ConnectionInfo, Datapath, DatapathError,
    DatapathStatus, Kick, RestartOutcome, Translation, VirtualFlow,
};

/// Holds connections and translations in memory; tests add connections with
/// [`FakeDatapath::add_connection`] as if the kernel had recorded them.
#[derive(Debug, Default)]
pub struct FakeDatapath {
    conns: BTreeMap<u64, ConnectionInfo>,
    translations: BTreeMap<VirtualFlow, Translation>,
    /// Translations in phase one (receive side only).
    pub prepared: BTreeMap<VirtualFlow, Translation>,
    /// Flows whose send side is held ([`Datapath::hold_send_side`]).
    pub held: BTreeSet<VirtualFlow>,
    /// Flows whose next install is limited ([`Datapath::limit_until_validated`]).
    budget_next: BTreeMap<VirtualFlow, u32>,
    /// Installed translations that send to an unvalidated address, with
    /// the allowance they were installed with.
    pub limited: BTreeMap<VirtualFlow, u32>,
    /// Flows that sent packets over their allowance to their last
    /// validated placement ([`Datapath::diverted_while_unvalidated`]).
    pub diverted: BTreeSet<VirtualFlow>,
    cgroups: Vec<PathBuf>,
    /// Cgroups that hide location ([`Datapath::set_hide_location`]).
    pub hiding: BTreeSet<PathBuf>,
    /// The last [`Datapath::set_hidden`] table, and how many were written.
    pub hidden: crate::datapath::HideTable,
    pub hidden_writes: usize,
    /// What [`Datapath::interface_addresses`] returns (tests change it to
    /// simulate a move).
    pub addresses: Vec<(std::net::IpAddr, u32)>,
    /// Source address per destination for [`Datapath::source_address_for`];
    /// destinations not listed take the first address of their family.
    pub sources: BTreeMap<std::net::IpAddr, std::net::IpAddr>,
    /// When set, the next mutating call fails with this (consumed) error,
    /// so tests can check that failures change nothing above.
    pub fail_next: Option<DatapathError>,
    /// Addresses BINDs are diverted from ([`Datapath::divert_binds`]).
    pub diverting: BTreeSet<std::net::IpAddr>,
    /// Datagrams sent with [`Datapath::send_in_band`]: (from, to, payload).
    pub sent_in_band: Vec<(std::net::SocketAddr, std::net::SocketAddr, Vec<u8>)>,
    /// TCP BIND tokens expected, by connection (`expect_tcp_bind`).
    pub tcp_bind_tokens: BTreeMap<VirtualFlow, [u8; 8]>,
    /// TCP BINDs sent: (connection, local, remote, token).
    pub sent_tcp_binds: Vec<(
        VirtualFlow,
        std::net::SocketAddr,
        std::net::SocketAddr,
        [u8; 8],
    )>,
    /// Guest addresses whose VCMP datagrams vnatd receives (`receive_vcmp_at`).
    pub receiving_vcmp_at: BTreeSet<std::net::IpAddr>,
    /// Flows asked to restart ([`Datapath::restart_flow`],
    /// [`Datapath::kick_flow`]) and to solicit an ACK, in order.
    pub restarted: Vec<VirtualFlow>,
    pub solicited: Vec<VirtualFlow>,
    /// Connections reset ([`Datapath::reset_connection`]), in order.
    pub reset: Vec<VirtualFlow>,
    /// Keepalive holds (true) and releases ([`Datapath::hold_keepalive`]).
    pub keepalive_held: Vec<(VirtualFlow, bool)>,
    /// `set_user_timeout` values per flow.
    pub user_timeouts: BTreeMap<VirtualFlow, u32>,
    /// Flows whose socket waits for its peer ([`Datapath::peer_silence`]).
    pub silent: BTreeSet<VirtualFlow>,
    /// `answer_for_peer` deliveries: (flow, window).
    pub answered: Vec<(VirtualFlow, u32)>,
    /// The byte counters `answer_for_peer` reports per flow (default 0, 0):
    /// a test changes them to play a peer that is back.
    pub peer_counters: BTreeMap<VirtualFlow, (u64, u64)>,
    /// Interfaces kept attached ([`Datapath::set_standby`]).
    pub standby: Vec<u32>,
    /// Addresses kept local ([`Datapath::keep_local`]).
    pub kept: Vec<std::net::IpAddr>,
    /// Calls of [`Datapath::maintain`].
    pub maintained: usize,
    /// Whether a batch is open ([`Datapath::begin_batch`]); batches do not
    /// nest.
    pub in_batch: bool,
    /// Guarded connections and their peer's NAT ([`Datapath::guard_nat`]).
    pub guarded: BTreeMap<VirtualFlow, std::net::IpAddr>,
    /// What the next [`Datapath::nat_guard_drops`] returns (a test plays
    /// the tc program's drops).
    pub guard_drops: Vec<crate::datapath::GuardDrop>,
}

impl FakeDatapath {
    pub fn new() -> Self {
        Self::default()
    }

    /// Record a connection as the kernel would on establishment.
    pub fn add_connection(&mut self, flow: VirtualFlow, pid: Option<u32>) -> u64 {
        let id = flow.id();
        // In the order of the calls, as the kernel's clock would.
        let recorded_ns = self
            .conns
            .values()
            .map(|c| c.recorded_ns)
            .max()
            .unwrap_or(0)
            + 1;
        self.conns.insert(
            id,
            ConnectionInfo {
                id,
                proto: flow.proto,
                virtual_local: flow.local,
                virtual_remote: flow.remote,
                physical_local: flow.local,
                physical_remote: flow.remote,
                state: ConnState::Native,
                cookie: id,
                cgroup_id: 1,
                cgroup: Some("/".into()),
                pid,
                command: pid.map(|_| "fake".into()),
                age_secs: 0,
                recorded_ns,
                tcp_isns: None,
                adopted: false,
                hide_location: false,
                udp_inbound_only: false,
                guest: None,
            },
        );
        id
    }

    /// Forget a connection as the kernel would on close.
    pub fn close_connection(&mut self, id: u64) {
        self.conns.remove(&id);
    }

    fn take_failure(&mut self) -> Result<(), DatapathError> {
        match self.fail_next.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Datapath for FakeDatapath {
    fn connections_without_owners(&self) -> Result<Vec<ConnectionInfo>, DatapathError> {
        Ok(self
            .connections()?
            .into_iter()
            .map(|c| ConnectionInfo {
                pid: None,
                command: None,
                cgroup: None,
                ..c
            })
            .collect())
    }

    fn maintain(&mut self) -> Result<(), DatapathError> {
        self.take_failure()?;
        self.maintained += 1;
        Ok(())
    }

    /// The fake has no sockets to restart, and says so.
    fn restart_flow(&mut self, flow: &VirtualFlow) -> Result<RestartOutcome, DatapathError> {
        self.take_failure()?;
        self.restarted.push(*flow);
        Ok(RestartOutcome::Unsupported)
    }

    fn solicit_ack(&mut self, flow: &VirtualFlow) -> Result<bool, DatapathError> {
        self.take_failure()?;
        self.solicited.push(*flow);
        Ok(false)
    }

    fn hold_keepalive(&mut self, flow: &VirtualFlow, hold: bool) -> Result<bool, DatapathError> {
        self.take_failure()?;
        self.keepalive_held.push((*flow, hold));
        Ok(flow.proto == crate::datapath::Proto::Tcp)
    }

    /// What the test set in `silent` (the fake has no sockets).
    fn peer_silence(
        &mut self,
        flow: &VirtualFlow,
    ) -> Result<crate::datapath::PeerSilence, DatapathError> {
        self.take_failure()?;
        Ok(if self.silent.contains(flow) {
            crate::datapath::PeerSilence::Unanswered
        } else {
            crate::datapath::PeerSilence::Answering
        })
    }

    fn connection_socket(
        &mut self,
        _flow: &VirtualFlow,
    ) -> Result<Option<std::os::fd::OwnedFd>, DatapathError> {
        self.take_failure()?;
        Ok(None)
    }

    /// The pid listed for the connection (the fake has no sockets).
    fn socket_holder(&mut self, flow: &VirtualFlow) -> Result<Option<u32>, DatapathError> {
        self.take_failure()?;
        Ok(self
            .connections()?
            .into_iter()
            .find(|c| {
                c.proto == flow.proto
                    && c.virtual_local == flow.local
                    && c.virtual_remote == flow.remote
            })
            .and_then(|c| c.pid))
    }

    fn set_user_timeout(
        &mut self,
        flow: &VirtualFlow,
        ms: u32,
    ) -> Result<Option<u32>, DatapathError> {
        self.take_failure()?;
        Ok(self.user_timeouts.insert(*flow, ms).or(Some(0)))
    }

    fn answer_for_peer(
        &mut self,
        flow: &VirtualFlow,
        window: u32,
        unless_moved_from: Option<(u64, u64)>,
    ) -> Result<super::PeerAnswer, DatapathError> {
        self.take_failure()?;
        let known = flow.proto == crate::datapath::Proto::Tcp
            && self.conns.values().any(|c| {
                c.proto == flow.proto
                    && c.virtual_local == flow.local
                    && c.virtual_remote == flow.remote
            });
        if !known {
            return Ok(super::PeerAnswer::Gone);
        }
        let counters = self.peer_counters.get(flow).copied().unwrap_or((0, 0));
        if unless_moved_from.is_some_and(|c| c != counters) {
            return Ok(super::PeerAnswer::PeerActive { counters });
        }
        self.answered.push((*flow, window));
        Ok(super::PeerAnswer::Answered {
            counters,
            peer_window: Some(65_535),
        })
    }

    fn reset_connection(&mut self, flow: &VirtualFlow) -> Result<bool, DatapathError> {
        self.take_failure()?;
        let before = self.conns.len();
        self.conns.retain(|_, c| {
            !(c.proto == flow.proto
                && c.virtual_local == flow.local
                && c.virtual_remote == flow.remote)
        });
        self.reset.push(*flow);
        Ok(self.conns.len() < before)
    }

    fn kick_flow(&mut self, flow: &VirtualFlow, peer_moved: bool) -> Result<Kick, DatapathError> {
        self.take_failure()?;
        self.restarted.push(*flow);
        if peer_moved {
            self.solicited.push(*flow);
        }
        Ok(Kick::Nothing)
    }

    /// The fake changes no sysctl.
    fn restore_sysctls(&mut self) -> Result<crate::datapath::SysctlsAtStop, DatapathError> {
        self.take_failure()?;
        Ok(crate::datapath::SysctlsAtStop::Unchanged)
    }

    fn keep_local(
        &mut self,
        mobile: &[std::net::IpAddr],
        in_use: &[std::net::IpAddr],
    ) -> Result<(), DatapathError> {
        self.take_failure()?;
        let mut kept: Vec<std::net::IpAddr> = mobile.to_vec();
        kept.extend(self.kept.iter().filter(|a| in_use.contains(a)));
        kept.sort_unstable();
        kept.dedup();
        self.kept = kept;
        Ok(())
    }

    fn set_standby(&mut self, ifindexes: &[u32]) -> Result<(), DatapathError> {
        self.take_failure()?;
        self.standby = ifindexes.to_vec();
        Ok(())
    }

    fn begin_batch(&mut self) {
        assert!(!self.in_batch, "datapath batches do not nest");
        self.in_batch = true;
    }

    fn end_batch(&mut self) {
        assert!(self.in_batch, "end_batch without begin_batch");
        self.in_batch = false;
    }

    fn divert_binds(
        &mut self,
        toward: std::net::IpAddr,
        _vcmp_port: u16,
    ) -> Result<(), DatapathError> {
        if let Some(e) = self.fail_next.take() {
            return Err(e);
        }
        self.diverting.insert(toward);
        Ok(())
    }

    fn send_in_band(
        &mut self,
        local: std::net::SocketAddr,
        remote: std::net::SocketAddr,
        payload: &[u8],
    ) -> Result<(), DatapathError> {
        if let Some(e) = self.fail_next.take() {
            return Err(e);
        }
        self.sent_in_band.push((local, remote, payload.to_vec()));
        Ok(())
    }

    fn expect_tcp_bind(
        &mut self,
        flow: &VirtualFlow,
        token: [u8; 8],
    ) -> Result<bool, DatapathError> {
        if let Some(e) = self.fail_next.take() {
            return Err(e);
        }
        let rebinding = self
            .translations
            .get(flow)
            .is_some_and(|t| t.physical_remote.port() == 0);
        if rebinding {
            self.tcp_bind_tokens.insert(*flow, token);
        }
        Ok(rebinding)
    }

    fn send_tcp_bind(
        &mut self,
        flow: &VirtualFlow,
        local: std::net::SocketAddr,
        remote: std::net::SocketAddr,
        token: [u8; 8],
    ) -> Result<(), DatapathError> {
        if let Some(e) = self.fail_next.take() {
            return Err(e);
        }
        self.sent_tcp_binds.push((*flow, local, remote, token));
        Ok(())
    }

    fn receive_vcmp_at(
        &mut self,
        addrs: &BTreeSet<std::net::IpAddr>,
        _vcmp_port: u16,
    ) -> Result<(), DatapathError> {
        if let Some(e) = self.fail_next.take() {
            return Err(e);
        }
        self.receiving_vcmp_at = addrs.clone();
        Ok(())
    }

    fn status(&self) -> Result<DatapathStatus, DatapathError> {
        Ok(DatapathStatus {
            kernel: "fake".into(),
            tc_mode: crate::datapath::TcMode::Tcx,
            degraded: Vec::new(),
            bpffs: PathBuf::from("/fake"),
            netns_cookie: 1,
            programs_loaded: vec!["fake".into()],
            // As the kernel's: the enabled ones, then hiding ones that an
            // enabled one above covers.
            cgroups: self
                .cgroups
                .iter()
                .chain(self.hiding.iter().filter(|h| !self.cgroups.contains(h)))
                .enumerate()
                .map(|(i, p)| CgroupAttachment {
                    path: p.clone(),
                    id: i as u64 + 1,
                    hide_location: self.hiding.contains(p),
                })
                .collect(),
            tc: Vec::new(),
            connections: self.conns.len() as u64,
            translations: self.translations.len() as u64,
            counters: Vec::new(),
        })
    }

    fn connections(&self) -> Result<Vec<ConnectionInfo>, DatapathError> {
        Ok(self
            .conns
            .values()
            .map(|c| {
                let mut c = c.clone();
                let flow = VirtualFlow {
                    proto: c.proto,
                    local: c.virtual_local,
                    remote: c.virtual_remote,
                };
                if let Some(t) = self.translations.get(&flow) {
                    c.physical_local = t.physical_local;
                    c.physical_remote = t.physical_remote;
                    c.state = ConnState::Translated;
                }
                c
            })
            .collect())
    }

    fn enable_cgroup(&mut self, path: &Path) -> Result<(), DatapathError> {
        self.take_failure()?;
        if !self.cgroups.iter().any(|p| p == path) {
            self.cgroups.push(path.to_path_buf());
        }
        Ok(())
    }

    fn disable_cgroup(&mut self, path: &Path) -> Result<(), DatapathError> {
        self.take_failure()?;
        let before = self.cgroups.len();
        self.cgroups.retain(|p| p != path);
        if self.cgroups.len() == before && !self.hiding.contains(path) {
            return Err(DatapathError::CgroupNotEnabled {
                path: path.to_path_buf(),
            });
        }
        self.hiding.remove(path);
        Ok(())
    }

    fn set_hide_location(&mut self, path: &Path, on: bool) -> Result<bool, DatapathError> {
        self.take_failure()?;
        Ok(if on {
            self.hiding.insert(path.to_path_buf())
        } else {
            self.hiding.remove(path)
        })
    }

    fn hiding_cgroups(&self) -> Result<Vec<u64>, DatapathError> {
        Ok(self
            .cgroups
            .iter()
            .enumerate()
            .filter(|(_, p)| self.hiding.contains(*p))
            .map(|(i, _)| i as u64 + 1)
            .collect())
    }

    fn set_hidden(&mut self, table: &crate::datapath::HideTable) -> Result<(), DatapathError> {
        self.take_failure()?;
        self.hidden = table.clone();
        self.hidden_writes += 1;
        Ok(())
    }

    fn install_translation(&mut self, t: &Translation) -> Result<(), DatapathError> {
        validate_translation(t)?;
        self.take_failure()?;
        self.prepared.remove(&t.flow);
        self.held.remove(&t.flow);
        self.translations.insert(t.flow, *t);
        match self.budget_next.remove(&t.flow) {
            Some(a) => self.limited.insert(t.flow, a),
            None => self.limited.remove(&t.flow),
        };
        Ok(())
    }

    fn diverted_while_unvalidated(&self, flow: &VirtualFlow) -> bool {
        self.limited.contains_key(flow) && self.diverted.contains(flow)
    }

    fn credit_unvalidated(
        &mut self,
        flow: &VirtualFlow,
        allowed: u32,
    ) -> Result<bool, DatapathError> {
        self.take_failure()?;
        Ok(match self.limited.get_mut(flow) {
            Some(a) => {
                *a = allowed;
                true
            }
            None => false,
        })
    }

    fn limit_until_validated(&mut self, flow: &VirtualFlow, allowed: Option<u32>) {
        match allowed {
            Some(a) => self.budget_next.insert(*flow, a),
            None => self.budget_next.remove(flow),
        };
    }

    fn prepare_translation(&mut self, t: &Translation) -> Result<(), DatapathError> {
        validate_translation(t)?;
        self.take_failure()?;
        // As the kernel datapath: not onto another connection's endpoints.
        if let Some(c) = self.conns.values().find(|c| {
            c.proto == t.flow.proto
                && c.virtual_local == t.physical_local
                && c.virtual_remote == t.physical_remote
                && (c.virtual_local, c.virtual_remote) != (t.flow.local, t.flow.remote)
        }) {
            return Err(DatapathError::Conflict {
                flow: t.flow,
                other: Box::new(VirtualFlow {
                    proto: c.proto,
                    local: c.virtual_local,
                    remote: c.virtual_remote,
                }),
            });
        }
        self.prepared.insert(t.flow, *t);
        Ok(())
    }

    fn guard_nat(
        &mut self,
        flow: &VirtualFlow,
        nat: std::net::IpAddr,
    ) -> Result<(), DatapathError> {
        self.take_failure()?;
        self.guarded.insert(*flow, nat);
        Ok(())
    }

    fn nat_guard_drops(&mut self) -> Result<Vec<crate::datapath::GuardDrop>, DatapathError> {
        self.take_failure()?;
        Ok(std::mem::take(&mut self.guard_drops))
    }

    fn remove_translation(&mut self, flow: &VirtualFlow) -> Result<(), DatapathError> {
        self.take_failure()?;
        self.prepared.remove(flow);
        self.limited.remove(flow);
        // As in the kernel, a held flow has an entry (that only holds).
        let held = self.held.remove(flow);
        if self.translations.remove(flow).is_some() || held {
            Ok(())
        } else {
            Err(DatapathError::NoSuchTranslation { flow: *flow })
        }
    }

    fn hold_send_side(&mut self, flow: &VirtualFlow, hold: bool) -> Result<(), DatapathError> {
        self.take_failure()?;
        if hold {
            self.held.insert(*flow);
        } else {
            self.held.remove(flow);
        }
        Ok(())
    }

    fn release_held(&mut self) -> Result<usize, DatapathError> {
        self.take_failure()?;
        let n = self.held.len();
        self.held.clear();
        Ok(n)
    }

    fn translations(&self) -> Result<Vec<Translation>, DatapathError> {
        Ok(self.translations.values().copied().collect())
    }

    fn flows_with_entries(&self) -> Result<Vec<VirtualFlow>, DatapathError> {
        let mut all: BTreeSet<VirtualFlow> = self.translations.keys().copied().collect();
        all.extend(self.prepared.keys());
        all.extend(&self.held);
        Ok(all.into_iter().collect())
    }

    fn interface_addresses(&self) -> Result<Vec<(std::net::IpAddr, u32)>, DatapathError> {
        Ok(self.addresses.clone())
    }

    fn source_address_for(
        &self,
        dst: std::net::IpAddr,
    ) -> Result<Option<std::net::IpAddr>, DatapathError> {
        if let Some(s) = self.sources.get(&dst) {
            return Ok(Some(*s));
        }
        Ok(self
            .addresses
            .iter()
            .map(|(a, _)| *a)
            .find(|a| a.is_ipv4() == dst.is_ipv4()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::Proto;

    fn flow() -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: "198.18.1.2:4000".parse().unwrap(),
            remote: "198.18.3.2:80".parse().unwrap(),
        }
    }

    #[test]
    fn translation_shows_in_ls_and_failure_changes_nothing() {
        let mut dp = FakeDatapath::new();
        let id = dp.add_connection(flow(), Some(7));
        let t = Translation {
            flow: flow(),
            physical_local: "198.18.2.2:4000".parse().unwrap(),
            physical_remote: flow().remote,
        };
        dp.fail_next = Some(DatapathError::NoRoute {
            addr: t.physical_local.ip(),
        });
        assert!(dp.install_translation(&t).is_err());
        assert_eq!(dp.connections().unwrap()[0].state, ConnState::Native);
        dp.install_translation(&t).unwrap();
        let c = &dp.connections().unwrap()[0];
        assert_eq!(
            (c.id, c.state, c.physical_local),
            (id, ConnState::Translated, t.physical_local)
        );
    }

    #[test]
    fn restart_levers_are_typed_and_recorded() {
        let mut dp = FakeDatapath::new();
        let f = flow();
        let r = crate::datapath::restart_verified(&mut dp, &f, true).unwrap();
        assert_eq!(
            r,
            crate::datapath::Restarted {
                outcome: RestartOutcome::Unsupported,
                ack_solicited: Some(false),
            }
        );
        assert_eq!(dp.kick_flow(&f, false).unwrap(), Kick::Nothing);
        assert_eq!((dp.restarted.len(), dp.solicited.len()), (2, 1));
        dp.fail_next = Some(DatapathError::NoRoute {
            addr: f.remote.ip(),
        });
        assert!(dp.kick_flow(&f, true).is_err());
        assert_eq!(dp.restarted.len(), 2, "a failed call records nothing");
    }

    #[test]
    fn unmoved_or_mixed_family_translation_is_refused() {
        let mut dp = FakeDatapath::new();
        let same = Translation {
            flow: flow(),
            physical_local: flow().local,
            physical_remote: flow().remote,
        };
        assert!(matches!(
            dp.install_translation(&same),
            Err(DatapathError::InvalidTranslation { .. })
        ));
        let mixed = Translation {
            physical_local: "[fd00::1]:4000".parse().unwrap(),
            ..same
        };
        assert!(matches!(
            dp.install_translation(&mixed),
            Err(DatapathError::InvalidTranslation { .. })
        ));
        assert!(dp.translations().unwrap().is_empty());
    }
}
