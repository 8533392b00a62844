//! Automatic mode's plan in the driver: the periodic resync that reads
//! this host's connections and addresses, and the plan that decides from
//! them which connections move where (`super::super::mobility`) and queues
//! their starts; `moves.rs` starts them and carries them through.

use super::*;

impl Driver {
    /// Track new connections, forget closed ones, and move the ones whose
    /// address vanished. Returns the number of moves started.
    pub(super) async fn resync(&mut self) -> usize {
        tracing::trace!("resync");
        self.standby_due = true;
        self.hide_due = true;
        let port = self.cfg.listen.port();
        let listed = with_dp(&self.dp, |dp| {
            let listed = (
                dp.connections_without_owners(),
                dp.interface_addresses(),
                dp.hiding_cgroups(),
            );
            if let Err(e) = dp.settle_guests() {
                tracing::warn!(error = %e, "cannot make containers' connections ready to move");
            }
            if let Err(e) = dp.note_interfaces() {
                tracing::warn!(error = %e, "cannot update which addresses this host has only on lo: packets from them may leave untranslated until the next resync");
            }
            listed
        })
        .await;
        match listed.2 {
            Ok(ids) => self.hiding = !ids.is_empty(),
            Err(e) => tracing::warn!(error = %e, "cannot read which cgroups hide location"),
        }
        let conns = match listed.0 {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list connections");
                return 0;
            }
        };
        let seen_at = std::time::Instant::now();
        let boot_secs = now().as_nanos() / 1_000_000_000;
        match listed.1 {
            Ok(a) => {
                // Told to paired hosts (a PROBE to each when they change):
                // where they reach us in the other IP family.
                self.endpoint
                    .set_host_addresses(a.iter().map(|(ip, _)| *ip));
                self.host_addrs
                    .update(boot_secs, a.into_iter().map(|(ip, _)| ip).collect())
            }
            Err(e) => tracing::warn!(error = %e, "cannot list this host's addresses"),
        }
        let endpoint = &self.endpoint;
        let host_addrs = &self.host_addrs;
        let synced = self.tracking.sync(
            conns,
            port,
            |f| endpoint.has_connection(f),
            |ip, at| host_addrs.may_manage(ip, at),
            boot_secs,
            now(),
        );
        for (flow, pid) in &synced.not_ours {
            tracing::warn!(id = flow.id(), %flow, ?pid, "not managing a connection whose local address is not one of this host's (IP_FREEBIND or IP_TRANSPARENT socket)");
        }
        for n in synced.new {
            let r = self.endpoint.connection_added(
                now(),
                &mut OsRng,
                n.flow,
                n.local_phys,
                n.remote_phys,
                n.binding,
            );
            match r {
                Ok(()) => tracing::debug!(id = n.flow.id(), flow = %n.flow, "tracking connection"),
                Err(e) => {
                    tracing::debug!(id = n.flow.id(), flow = %n.flow, error = %e, "not tracking connection")
                }
            }
        }
        let live = synced.live;
        let gone = self.tracking.gone(self.endpoint.connections(), &live);
        for f in &gone {
            self.endpoint.connection_removed(f);
            self.mover.forget(f);
        }
        self.moves_closed(&gone);
        self.helpers.keepalive_held.retain(|f, _| live.contains(f));
        self.helpers.help_asked.retain(|f, _| live.contains(f));
        self.helpers.helper_runs.retain(|f, _| live.contains(f));
        // A closed connection's help ends (its stopped process goes on).
        let helped_gone: Vec<VirtualFlow> = self
            .helpers
            .helping
            .keys()
            .filter(|f| !live.contains(f))
            .copied()
            .collect();
        for f in helped_gone {
            self.end_helping(f, helping::End::Quiet).await;
        }
        if !gone.is_empty() {
            // The connections closed: undo what their translations set up
            // (NAT entries, the address kept on lo, the peer's host route,
            // the tc attachment) unless another connection still needs it.
            with_dp(&self.dp, move |dp| {
                for f in gone {
                    match dp.remove_translation(&f) {
                        Ok(()) => tracing::info!(id = f.id(), flow = %f, "connection closed; translation removed"),
                        Err(DatapathError::NoSuchTranslation { .. }) => {}
                        Err(e) => tracing::warn!(id = f.id(), flow = %f, error = %e, "cannot remove a closed connection's translation"),
                    }
                }
            })
            .await;
        }
        self.receive_proofs_for_guests(port).await;
        if seen_at >= self.next_orphan_check {
            self.next_orphan_check = seen_at + ORPHAN_CHECK_INTERVAL;
            self.remove_orphans(&live).await;
        }
        self.plan_and_move(true).await
    }

    /// While a routed container's connection waits to be bound, its peer
    /// asks for proof that this host receives at the container's address
    /// (a PROVE sent there, `vnat_vcmp` `proof`): have the datapath deliver
    /// VCMP datagrams to exactly those addresses here.
    async fn receive_proofs_for_guests(&mut self, port: u16) {
        let want: std::collections::BTreeSet<IpAddr> = self
            .tracking
            .routed()
            .filter(|f| {
                self.endpoint
                    .connection(f)
                    .is_some_and(|c| c.peer_key.is_none())
            })
            .map(|f| f.local.ip())
            .collect();
        if self.tracking.receiving_vcmp_at.as_ref() == Some(&want) {
            return;
        }
        let asked = want.clone();
        match with_dp(&self.dp, move |dp| dp.receive_vcmp_at(&asked, port)).await {
            Ok(()) => self.tracking.receiving_vcmp_at = Some(want),
            Err(e) => {
                tracing::warn!(error = %e, "cannot receive VCMP at routed containers' addresses: their connections may stay not mobile")
            }
        }
    }

    /// The connections under `preempt_cgroups` (`daemon::conflict`) when
    /// some of `flows` are about to move, with when each was recorded (its
    /// age: the older of two is reset): those of them may preempt, and
    /// only those can be preempted. Empty when nothing moves or no cgroup
    /// is listed (no walk of the cgroup tree then).
    pub(super) fn preempting(
        &self,
        flows: impl Iterator<Item = VirtualFlow>,
    ) -> HashMap<VirtualFlow, u64> {
        let mut flows = flows.peekable();
        if self.cfg.preempt_cgroups.is_empty() || flows.peek().is_none() {
            return HashMap::new();
        }
        let ids = conflict::cgroup_ids_under(&self.cfg.preempt_cgroups);
        self.tracking
            .cgroups()
            .filter(|(_, id)| *id != 0 && ids.contains(id))
            .filter_map(|(f, _)| Some((*f, self.tracking.recorded_ns(f)?)))
            .collect()
    }

    /// Remove the NAT entries (and what they set up: addresses on lo, host
    /// routes, tc) of flows whose socket is gone and that this vnatd is not
    /// waiting for (an import), found so by this check and the one before:
    /// what a vnatd killed in the middle of a move or a removal left
    /// behind, or a removal that failed.
    async fn remove_orphans(&mut self, live: &HashSet<VirtualFlow>) {
        let mut keep = live.clone();
        keep.extend(self.tracking.imports());
        let before = std::mem::take(&mut self.orphans);
        let (found, removed) = with_dp(&self.dp, move |dp| {
            let flows = match dp.flows_with_entries() {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list the NAT entries");
                    return (HashSet::new(), 0);
                }
            };
            let found: HashSet<VirtualFlow> =
                flows.into_iter().filter(|f| !keep.contains(f)).collect();
            let mut n = 0;
            for f in found.iter().filter(|f| before.contains(f)) {
                match dp.remove_translation(f) {
                    Ok(()) => n += 1,
                    Err(DatapathError::NoSuchTranslation { .. }) => {}
                    Err(e) => tracing::warn!(id = f.id(), flow = %f, error = %e, "cannot remove the entries of a connection that is gone"),
                }
            }
            (found, n)
        })
        .await;
        self.orphans = found;
        if removed > 0 {
            tracing::info!(
                connections = removed,
                "removed the translations of connections that closed while no vnatd managed them"
            );
        }
    }

    /// Automatic mode: plan the moves of the connections whose address
    /// went from the connections known now, start the first of them and
    /// queue the rest (`queued_starts`). `hold_stranded`: also hold those
    /// that no move can carry now (an outage); not for the plan made at
    /// an address change, which may see half of it ([`STRANDED_GRACE`]).
    /// Returns how many moves started or wait to.
    pub(super) async fn plan_and_move(&mut self, hold_stranded: bool) -> usize {
        let began = std::time::Instant::now();
        let cpu = thread_cpu();
        // One pass over the core's table (`Endpoint::placements`); at
        // 100,000 connections this is what a mass move waits for first.
        let mut tracked: Vec<Tracked> = Vec::with_capacity(self.endpoint.connection_count());
        tracked.extend(
            self.endpoint
                .placements()
                .filter(|p| !self.tracking.is_imported(&p.flow))
                .map(|p| Tracked {
                    flow: p.flow,
                    local_phys: p.local_phys,
                    remote_phys: p.remote_phys,
                    migrating: p.migrating,
                    placed: self.tracking.is_placed(&p.flow),
                    anchor: self.tracking.anchor(&p.flow),
                    across: p.across,
                    follows_peer: p.follows_peer,
                }),
        );
        if tracked.is_empty() {
            return 0;
        }
        // (No await above: this thread did all of it.)
        let pass_cpu = thread_cpu().saturating_sub(cpu);
        let remotes = mobility::plan_remotes(&tracked);
        let (addrs, sources) = with_dp(&self.dp, move |dp| {
            let addrs: HashSet<IpAddr> = match dp.interface_addresses() {
                Ok(a) => a.into_iter().map(|(a, _)| a).collect(),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list this host's addresses");
                    HashSet::new()
                }
            };
            let sources: HashMap<IpAddr, Option<IpAddr>> = remotes
                .into_iter()
                .map(|r| {
                    // A lookup that fails plans no move for this peer's
                    // connections: say so, or a mass move stops silently.
                    let src = dp.source_address_for(r).unwrap_or_else(|e| {
                        tracing::warn!(peer = %r, error = %e, "cannot look up the route to a peer: its connections wait for the next plan to move");
                        None
                    });
                    (r, src)
                })
                .collect();
            (addrs, sources)
        })
        .await;
        let moves =
            mobility::plan_moves(&tracked, &addrs, |ip| sources.get(&ip).copied().flatten());
        tracing::trace!(?tracked, ?addrs, ?sources, ?moves, "automatic mode");
        if hold_stranded {
            self.hold_stranded(&tracked, &addrs, &sources, &moves).await;
        }
        // A connection that cannot move is said once, until it is no move
        // to make any more (it moved, closed, or its address came back).
        // (A set: at 100,000 connections a search of the moves per flow
        // was 10^10 comparisons.)
        if !self.stuck_said.is_empty() {
            let moving: HashSet<VirtualFlow> = moves.iter().map(|m| m.flow).collect();
            self.stuck_said.retain(|f| moving.contains(f));
        }
        // A connection placed by `vnatctl migrate` that lost its address
        // is automatic mode's again.
        if self.tracking.any_placed() {
            for m in &moves {
                self.tracking.place(m.flow, None);
            }
        }
        if !moves.is_empty() {
            tracing::debug!(
                connections = tracked.len(),
                moves = moves.len(),
                planned_ms = began.elapsed().as_secs_f64() * 1e3,
                pass_cpu_ms = pass_cpu.as_secs_f64() * 1e3,
                "moves planned"
            );
        }
        // What the last plan left unstarted is in this one again (or no
        // longer a move to make).
        self.queued_starts = moves;
        let mut started = self.start_queued(FIRST_STARTS).await;
        if !self.queued_starts.is_empty() {
            // The first share's updates leave now, then the rest of this
            // turn's share starts.
            self.apply_and_send().await;
            started += self
                .start_queued(STARTS_PER_TURN.saturating_sub(FIRST_STARTS))
                .await;
        }
        started + self.queued_starts.len()
    }

    /// Start the next `most` of the planned moves (see `queued_starts`).
    /// Returns how many started.
    pub(super) async fn start_queued(&mut self, most: usize) -> usize {
        let rest = self
            .queued_starts
            .split_off(most.min(self.queued_starts.len()));
        let now: Vec<Move> = std::mem::replace(&mut self.queued_starts, rest)
            .into_iter()
            // Whatever began since the plan (a `migrate`, a move the
            // core started) is no longer the plan's to start.
            .filter(|m| {
                !self.tracking.is_placed(&m.flow)
                    && self.endpoint.is_migrating(&m.flow) == Some(false)
            })
            .collect();
        if now.is_empty() {
            return 0;
        }
        let outcomes = self.start_moves(now).await;
        outcomes.iter().filter(|(_, r)| r.is_ok()).count()
    }
}

/// The CPU time this thread has used (the planner's own cost, whatever
/// else the machine runs).
fn thread_cpu() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .map(Duration::from)
        .unwrap_or_default()
}
