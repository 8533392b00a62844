//! The driver's side of the control API: commands from `vnatctl` (through
//! the control handler), exports and imports, the peers' listing.

use super::*;
use crate::daemon::restart_state;

impl Driver {
    /// Turn off the keepalive of the suspended TCP connections among
    /// `flows` until they work again: their host may be away longer than
    /// their keepalive lets an unanswered peer live.
    pub(super) async fn hold_keepalives(&mut self, flows: &[VirtualFlow]) {
        let tcp: Vec<(VirtualFlow, SocketAddr)> = flows
            .iter()
            .filter(|f| {
                f.proto == crate::datapath::Proto::Tcp
                    && !self.helpers.keepalive_held.contains_key(f)
            })
            .filter_map(|f| Some((*f, self.endpoint.connection(f)?.local_phys)))
            .collect();
        if tcp.is_empty() {
            return;
        }
        // On disk before the sockets change: a vnatd that dies while they
        // are held leaves the next one what to turn on again.
        let undo: Vec<_> = tcp
            .iter()
            .map(|(f, _)| (*f, restart_state::Undo::KeepaliveOn))
            .collect();
        if !self.record_before_change(undo) {
            return;
        }
        let held = with_dp(&self.dp, move |dp| {
            tcp.into_iter()
                .filter(|(f, _)| match dp.hold_keepalive(f, true) {
                    Ok(changed) => changed,
                    Err(e) => {
                        tracing::warn!(id = f.id(), flow = %f, error = %e, "cannot hold the connection's keepalive during its suspension");
                        false
                    }
                })
                .collect::<Vec<_>>()
        })
        .await;
        if !held.is_empty() {
            tracing::info!(
                connections = held.len(),
                "keepalives held until the connections work again"
            );
        }
        let since = std::time::Instant::now();
        for (f, local) in held {
            self.helpers.keepalive_held.insert(
                f,
                mobility::HeldKeepalive {
                    since,
                    local_at_hold: local,
                    resume_asked: false,
                },
            );
        }
    }

    /// Turn on again the held keepalives of the connections that work
    /// again (`mobility::keepalive_release_due`); all of them with `all`
    /// (vnatd stops). Looked at twice a second at most. A failed release
    /// stays held and is tried again.
    pub(super) async fn release_keepalives(&mut self, all: bool) {
        if self.helpers.keepalive_held.is_empty() && self.helpers.help_asked.is_empty() {
            return;
        }
        let now = std::time::Instant::now();
        if !all && now < self.helpers.next_keepalive_check {
            return;
        }
        self.helpers.next_keepalive_check = now + std::time::Duration::from_millis(500);
        // (flow, its hold, where VCMP has it, whether it is moving, and
        // its peer's address)
        #[allow(clippy::type_complexity)]
        let state: Vec<(
            VirtualFlow,
            mobility::HeldKeepalive,
            Option<(SocketAddr, bool, IpAddr)>,
        )> = self
            .helpers
            .keepalive_held
            .iter()
            .map(|(f, h)| {
                let c = self
                    .endpoint
                    .connection(f)
                    .map(|v| (v.local_phys, v.migrating, v.remote_phys.ip()));
                (*f, *h, c)
            })
            .collect();
        // The peers a route leads to, of the held and the helped.
        let remotes: HashSet<IpAddr> = self
            .helpers
            .keepalive_held
            .keys()
            .chain(self.helpers.help_asked.keys())
            .filter_map(|f| self.endpoint.connection(f))
            .map(|v| v.remote_phys.ip())
            .collect();
        let (released, addrs) = with_dp(&self.dp, move |dp| {
            let (addrs, routed): (HashSet<IpAddr>, HashSet<IpAddr>) = if all {
                Default::default()
            } else {
                match dp.interface_addresses() {
                    Ok(a) => (
                        a.into_iter().map(|(ip, _)| ip).collect(),
                        remotes
                            .into_iter()
                            .filter(|r| dp.source_address_for(*r).ok().flatten().is_some())
                            .collect(),
                    ),
                    Err(_) => return (Vec::new(), None),
                }
            };
            let released = state
                .into_iter()
                .filter(|(_, h, c)| {
                    all || c.is_some_and(|(local, migrating, remote)| {
                        let routed = routed.contains(&remote);
                        mobility::keepalive_release_due(h, local, migrating, &addrs, routed, now)
                    })
                })
                .filter_map(|(f, _, _)| match dp.hold_keepalive(&f, false) {
                    Ok(_) => Some(f),
                    Err(e) => {
                        tracing::warn!(id = f.id(), flow = %f, error = %e, "cannot turn the connection's keepalive on again; will retry");
                        None
                    }
                })
                .collect::<Vec<_>>();
            (released, Some((addrs, routed)))
        })
        .await;
        for f in released {
            self.helpers.keepalive_held.remove(&f);
            tracing::debug!(id = f.id(), flow = %f, "keepalive on again");
        }
        if let Some((addrs, routed)) = addrs.filter(|_| !all) {
            self.end_asked_help(&addrs, &routed).await;
        }
    }

    pub(super) async fn release_due_keepalives(&mut self) {
        self.release_keepalives(false).await;
    }

    /// One control request, in a span naming it: what the driver logs
    /// while it starts the moves, exports and imports carries the command
    /// (the datapath thread's own lines do not).
    pub(super) async fn command(&mut self, cmd: Command) {
        use tracing::Instrument;
        let span = tracing::info_span!("control", command = cmd.name());
        self.run_command(cmd).instrument(span).await;
    }

    async fn run_command(&mut self, cmd: Command) {
        match cmd {
            Command::Suspend { flows, help, reply } => {
                let r = self.endpoint.suspend(now(), &mut OsRng, &flows);
                let r = match r {
                    Ok(()) => {
                        self.settling.started(&flows);
                        self.hold_keepalives(&flows).await;
                        self.hold_own_timeouts(&flows, false).await;
                        Ok(if help.is_none() {
                            Vec::new()
                        } else {
                            self.ask_help(&flows, &help)
                        })
                    }
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
            Command::AskHelp {
                flows,
                help,
                wait,
                reply,
            } => self.ask_help_now(&flows, &help, wait, reply),
            Command::Resume { reply } => {
                // Held keepalives go back on once each connection works
                // again, not now: at wake the network may not be back.
                for h in self.helpers.keepalive_held.values_mut() {
                    h.resume_asked = true;
                }
                // The same for the helpers asked of the peers: a host that
                // wakes at the same address says it is back as soon as the
                // connection works.
                for (h, _) in self.helpers.help_asked.values_mut() {
                    h.resume_asked = true;
                }
                self.resume_own_timeouts();
                let n = self.resync().await;
                let _ = reply.send(n);
            }
            Command::Migrate { moves, reply } => {
                let r = self.migrate(moves).await;
                let _ = reply.send(r);
            }
            Command::Counters { reply } => {
                let st = self.endpoint.stats();
                let _ = reply.send(crate::control::VcmpCounters {
                    host_key: identity::key_hex(&self.endpoint.public_key()),
                    events: st.events().map(|(c, n)| (c.name().into(), n)).collect(),
                    rejected: st.rejects().map(|(r, n)| (r.name().into(), n)).collect(),
                });
            }
            Command::Peers { reply } => {
                let _ = reply.send(self.peer_infos());
            }
            Command::Location { reply } => {
                let _ = reply.send(self.stores.status(&self.cfg));
            }
            Command::Reconfigure {
                location_servers,
                keepalive_secs,
                standby_tc,
                preempt_cgroups,
                reply,
            } => {
                self.cfg.preempt_cgroups = preempt_cgroups;
                self.endpoint.reconfigure(
                    location_servers.clone(),
                    std::time::Duration::from_secs(keepalive_secs.into()),
                );
                self.cfg.location_servers = location_servers;
                self.cfg.keepalive_secs = keepalive_secs;
                self.cfg.standby_tc = standby_tc;
                self.standby_due = true;
                let _ = reply.send(());
            }
            Command::ForgetPeer { key, reply } => {
                let held = self.endpoint.forget_peer(now(), &key);
                self.standby_due = true;
                self.hide_due = true;
                let stored = match self.peers.forget(&key) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot remove the key from peers.json");
                        false
                    }
                };
                let out = match (held, stored) {
                    (None, false) => None,
                    (h, _) => Some(h.unwrap_or(0)),
                };
                if let Some(n) = out {
                    tracing::info!(key = %identity::key_hex(&key), connections = n,
                        "forgot peer host; its connections are claimed anew");
                }
                let _ = reply.send(out);
            }
            Command::Mobility { reply } => {
                let started = std::time::Instant::now();
                let m: HashMap<_, _> = self
                    .endpoint
                    .connections()
                    .filter_map(|f| {
                        let v = self.endpoint.connection(f)?;
                        Some((
                            *f,
                            crate::control::Mobility {
                                mobile: v.has_keys,
                                seen_by_peer_as: v.seen_by_peer_as,
                                why_not: self.endpoint.why_not_mobile(f).map(str::to_string),
                                role: v.role.map(|r| match r {
                                    vcmp::roles::Role::Primary => "primary".into(),
                                    vcmp::roles::Role::Secondary => "secondary".into(),
                                }),
                                moving: v.migrating,
                                local_phys: Some(v.local_phys),
                                keepalive_held: self.helpers.keepalive_held.contains_key(f),
                                placed: self.tracking.placed_at(f),
                                helpers_asked: self
                                    .helpers
                                    .help_asked
                                    .get(f)
                                    .map(|(_, h)| h.names())
                                    .unwrap_or_default(),
                                helping: self
                                    .helpers
                                    .helping
                                    .get(f)
                                    .map(|h| h.help.names())
                                    .unwrap_or_default(),
                                last_move: self.journal.last_move(f).cloned(),
                            },
                        ))
                    })
                    .chain(self.tracking.refused().map(|(f, why)| {
                        (
                            *f,
                            crate::control::Mobility {
                                mobile: false,
                                why_not: Some(why.to_string()),
                                ..Default::default()
                            },
                        )
                    }))
                    .collect();
                tracing::debug!(
                    flows = m.len(),
                    took_ms = started.elapsed().as_millis() as u64,
                    "mobility of every connection, for a listing"
                );
                let _ = reply.send(m);
            }
            Command::Export { flows, to, reply } => {
                let r = self.export(&flows, to).await;
                let _ = reply.send(r);
            }
            Command::Import { state, from, reply } => {
                let r = match transfer::check_seal(&state, &self.endpoint, from) {
                    Ok(()) => self.import(&state).await,
                    Err(e) => Err(e),
                };
                let _ = reply.send(r);
            }
        }
    }

    pub(super) async fn export(
        &mut self,
        flows: &[VirtualFlow],
        to: Option<[u8; 32]>,
    ) -> Result<ExportDocument, TransferError> {
        let me = self.endpoint.public_key();
        let to = to.unwrap_or(me);
        if self.endpoint.seal_export(&to, b"").is_none() {
            return Err(TransferError::BadKey { what: "--to" });
        }
        // Check every flow before forgetting any: all or nothing.
        for f in flows {
            let (id, flow) = (f.id(), transfer::describe(f));
            match self.endpoint.connection(f) {
                None => return Err(TransferError::NotTracked { id, flow }),
                Some(v) if !v.has_keys => return Err(TransferError::NoKeys { id, flow }),
                Some(_) => {}
            }
        }
        let translations = with_dp(&self.dp, |dp| dp.translations())
            .await
            .map_err(TransferError::Datapath)?;
        let translations: HashMap<VirtualFlow, Translation> =
            translations.into_iter().map(|t| (t.flow, t)).collect();
        let mut connections = Vec::with_capacity(flows.len());
        for f in flows {
            let vcmp = self
                .endpoint
                .export_connection(f)
                .map_err(|source| TransferError::Export { id: f.id(), source })?;
            let translation = translations.get(f).copied();
            tracing::info!(id = f.id(), flow = %f, "connection exported; VCMP forgets it here");
            self.tracking.exported(*f);
            connections.push(ExportedConnection {
                id: f.id(),
                vcmp,
                translation,
            });
        }
        let mut doc = ExportDocument {
            vnat_export: transfer::EXPORT_FORMAT,
            connections,
            seal: None,
        };
        if !transfer::seal(&mut doc, &self.endpoint, &to) {
            // Checked above, so not expected; the connections are already
            // forgotten here, so hand the document over unsealed rather than
            // lose their keys (import will refuse it until re-sealed).
            tracing::error!("cannot seal the export; it is written unsealed");
        }
        Ok(doc)
    }

    pub(super) async fn import(
        &mut self,
        state: &ExportDocument,
    ) -> Result<Vec<ImportOutcome>, TransferError> {
        let mut done: Vec<VirtualFlow> = Vec::new();
        for c in &state.connections {
            if let Err(source) = self.endpoint.import_connection(&c.vcmp) {
                // All or nothing: a half-imported set would leave the peer
                // talking to two hosts about one process.
                for f in &done {
                    self.endpoint.connection_removed(f);
                }
                return Err(TransferError::Import { id: c.id, source });
            }
            done.push(c.vcmp.flow);
            self.tracking.imported(c.vcmp.flow, now());
        }
        // Do not move yet: the process restores its socket after the import,
        // and until that socket exists here a packet the peer sends to this
        // host would be answered with a reset. Prepare only the receive side
        // (which also makes the connection's address local, so the restored
        // socket can bind to it); the move starts when the restored socket
        // appears in this host's records (see `resync`).
        let here: HashSet<IpAddr> = with_dp(&self.dp, |dp| dp.interface_addresses())
            .await
            .map(|a| a.into_iter().map(|(ip, _)| ip).collect())
            .unwrap_or_default();
        for flow in &done {
            let Some(v) = self.endpoint.connection(flow) else {
                continue;
            };
            if here.contains(&v.local_phys.ip()) {
                continue;
            }
            let (flow, remote) = (*flow, v.remote_phys);
            let preempt = self.preempting(std::iter::once(flow));
            let prepared = with_dp(&self.dp, move |dp| {
                let src = dp
                    .source_address_for(remote.ip())?
                    .ok_or(DatapathError::NoRoute { addr: remote.ip() })?;
                let t = Translation {
                    flow,
                    physical_local: SocketAddr::new(src, flow.local.port()),
                    physical_remote: remote,
                };
                conflict::prepare_resolving(dp, &t, preempt.contains_key(&flow), |o| {
                    preempt.get(o).copied()
                })
            })
            .await;
            if let Err(e) = prepared {
                tracing::warn!(id = flow.id(), %flow, error = %e, "cannot prepare the imported connection's address");
            }
        }
        let mut out = Vec::with_capacity(done.len());
        for flow in done {
            let Some(v) = self.endpoint.connection(&flow) else {
                continue;
            };
            let moved = v.local_phys != flow.local || v.remote_phys != flow.remote;
            if !v.migrating && moved && here.contains(&v.local_phys.ip()) {
                // Staying at the exported physical endpoints (this host has
                // that address too): translate as the exporting host did.
                self.translate(flow, v.local_phys, v.remote_phys, false)
                    .await;
            }
            tracing::info!(id = flow.id(), %flow, local = %v.local_phys, moving = v.migrating, "connection imported");
            out.push(ImportOutcome {
                flow,
                physical_local: v.local_phys,
                physical_remote: v.remote_phys,
                moving: v.migrating,
                move_pending: !v.migrating && !here.contains(&v.local_phys.ip()),
            });
        }
        Ok(out)
    }

    /// One row per known host key (with the address it last paired from)
    /// and one per address whose connections no host has claimed yet.
    pub(super) fn peer_infos(&self) -> Vec<PeerInfo> {
        let mut by_key: BTreeMap<[u8; 32], (IpAddr, usize, usize)> = BTreeMap::new();
        let mut unclaimed: BTreeMap<IpAddr, usize> = BTreeMap::new();
        for (key, ip) in &self.peers.peers {
            by_key.insert(*key, (*ip, 0, 0));
        }
        for f in self.endpoint.connections() {
            let Some(v) = self.endpoint.connection(f) else {
                continue;
            };
            match v.peer_key {
                Some(k) => {
                    let e = by_key.entry(k).or_insert((v.remote_phys.ip(), 0, 0));
                    e.1 += 1;
                    e.2 += usize::from(v.has_keys);
                }
                None => *unclaimed.entry(v.remote_phys.ip()).or_default() += 1,
            }
        }
        let mut out: Vec<PeerInfo> = by_key
            .into_iter()
            .map(|(key, (address, connections, mobile))| PeerInfo {
                address,
                key: Some(identity::key_hex(&key)),
                connections,
                mobile,
                behind_nat: self.endpoint.behind_nat(&key),
                reflexive: self.endpoint.reflexive_address(&key),
                // Boot time to wall clock: how long ago, from now.
                last_heard_ms: self.endpoint.last_heard(&key).map(|t| {
                    vnat_control::monitor::unix_ms(std::time::SystemTime::now() - now().since(t))
                }),
                addresses: self.endpoint.peer_addresses(&key).to_vec(),
            })
            .collect();
        out.extend(
            unclaimed
                .into_iter()
                .map(|(address, connections)| PeerInfo {
                    address,
                    key: None,
                    connections,
                    mobile: 0,
                    behind_nat: false,
                    reflexive: None,
                    last_heard_ms: None,
                    addresses: Vec::new(),
                }),
        );
        out.sort_by(|a, b| (a.address, &a.key).cmp(&(b.address, &b.key)));
        out
    }
}

impl Driver {
    /// `vnatctl migrate`: move each flow to the address given with it,
    /// while its current one stays up. Started as automatic mode starts a
    /// move (hold, receive side, UPD to the peer); the flow is then placed
    /// there, so automatic mode does not take it back home.
    pub(super) async fn migrate(
        &mut self,
        wanted: Vec<(VirtualFlow, IpAddr)>,
    ) -> Vec<crate::control::command::MoveOutcome> {
        let mut outcomes = Vec::new();
        let mut moves = Vec::new();
        for (flow, ip) in wanted {
            let Some(v) = self.endpoint.connection(&flow) else {
                outcomes.push((flow, Err(MoveRefused::NotManaged)));
                continue;
            };
            if v.migrating {
                outcomes.push((flow, Err(MoveRefused::AlreadyMoving)));
                continue;
            }
            if v.local_phys.ip() == ip {
                outcomes.push((flow, Err(MoveRefused::AlreadyThere(ip))));
                continue;
            }
            // To an address of the other family than the peer's end (an
            // IPv4 connection onto an IPv6-only link, or back): its peer's
            // end in that family (`vcmp::family`).
            let remote_phys = if ip.is_ipv4() == v.remote_phys.is_ipv4() {
                v.remote_phys
            } else {
                match self
                    .endpoint
                    .other_family_remote(&flow)
                    .filter(|r| r.is_ipv4() == ip.is_ipv4())
                {
                    Some(r) => r,
                    None => {
                        outcomes.push((flow, Err(MoveRefused::NoPeerAddressInFamily(ip))));
                        continue;
                    }
                }
            };
            moves.push(Move {
                flow,
                new_local: SocketAddr::new(ip, flow.local.port()),
                remote_phys,
            });
        }
        for (flow, r) in self.start_moves(moves).await {
            if let Ok((_, to)) = &r {
                // Back to its own address: nothing left to keep.
                let back = to.ip() == flow.local.ip();
                self.tracking.place(flow, (!back).then_some(to.ip()));
            }
            outcomes.push((flow, r));
        }
        outcomes
    }
}
