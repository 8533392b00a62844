//! The driver's part in moves: it starts what the plan queued (`plan.rs`),
//! asks the mover (`super::super::mover`) what to do with the peers'
//! answers, and runs that against the datapath in one trip per turn.

use super::*;
use crate::daemon::moveops::{self, Op, Outcome};

impl Driver {
    /// Start `moves`: hold and prepare each one's receive side in one trip
    /// to the datapath thread, then tell the peers. Each move's outcome:
    /// where it goes from and to, or why it did not start.
    pub(super) async fn start_moves(
        &mut self,
        moves: Vec<Move>,
    ) -> Vec<crate::control::command::MoveOutcome> {
        let mut outcomes = Vec::new();
        let (candidates, stuck) = self.mover.starts(moves, |f| self.endpoint.connection(f));
        for m in stuck {
            if self.stuck_said.insert(m.flow) {
                tracing::warn!(id = m.flow.id(), flow = %m.flow, peer = %m.remote_phys.ip(), "connection lost its address but cannot move: the peer runs no vnatd or pairing has not completed");
            } else {
                tracing::debug!(id = m.flow.id(), flow = %m.flow, "still cannot move");
            }
            outcomes.push((m.flow, Err(MoveRefused::NotMobile)));
        }
        let preempt = self.preempting(candidates.iter().map(|st| st.mv.flow));
        let ops = candidates
            .into_iter()
            .map(|start| Op::Start {
                preempt: preempt.contains_key(&start.mv.flow),
                start,
            })
            .collect();
        let prepared = self.run_ops(ops, preempt).await;
        let mut started = Vec::new();
        let held_at = std::time::Instant::now();
        for (op, outcome) in prepared {
            let (Op::Start { start, .. }, Outcome::Started(s)) = (op, outcome) else {
                unreachable!("moveops::run answers a Start with Started");
            };
            let (m, from) = (start.mv, start.from);
            if s.held {
                self.mover.held(m.flow, held_at);
            }
            if let Err(e) = s.result {
                tracing::warn!(id = m.flow.id(), flow = %m.flow, error = %e, "cannot prepare the move");
                outcomes.push((m.flow, Err(MoveRefused::Prepare(e.to_string()))));
                continue;
            }
            // A move into the other IP family finds the peer at its end in
            // that family (`vcmp::family`).
            let across = self
                .endpoint
                .connection(&m.flow)
                .filter(|v| v.remote_phys != m.remote_phys)
                .map(|_| m.remote_phys);
            match across {
                Some(peer) => {
                    tracing::info!(id = m.flow.id(), flow = %m.flow, from = %from, to = %m.new_local, peer_in_other_family = %peer, "resuming connection at a new address")
                }
                None => {
                    tracing::info!(id = m.flow.id(), flow = %m.flow, from = %from, to = %m.new_local, "resuming connection at a new address")
                }
            }
            started.push((m.flow, from, m.new_local, across));
        }
        if started.is_empty() {
            return outcomes;
        }
        let flows: Vec<(VirtualFlow, SocketAddr, Option<SocketAddr>)> = started
            .iter()
            .map(|(f, _, to, across)| (*f, *to, *across))
            .collect();
        let started: Vec<(VirtualFlow, SocketAddr, SocketAddr)> = started
            .into_iter()
            .map(|(f, from, to, _)| (f, from, to))
            .collect();
        if let Err(e) = self.endpoint.resume_across(now(), &mut OsRng, &flows) {
            tracing::warn!(error = %e, "cannot start the migration");
            let why = MoveRefused::Start(e);
            outcomes.extend(started.into_iter().map(|(f, _, _)| (f, Err(why.clone()))));
            return outcomes;
        }
        for (f, from, to) in &started {
            self.move_started(*f, vnat_control::monitor::Side::Local, *from, *to);
        }
        outcomes.extend(started.into_iter().map(|(f, from, to)| (f, Ok((from, to)))));
        outcomes
    }

    /// Release the holds older than [`HOLD_LIMIT`] of moves still under
    /// way. A flow whose move completed was released by its translation
    /// (the release is then a no-op).
    pub(super) async fn end_overdue_holds(&mut self) {
        let overdue = self.mover.overdue_holds(std::time::Instant::now());
        if overdue.is_empty() {
            return;
        }
        let n = overdue.len();
        let ops = overdue.into_iter().map(Op::ReleaseOverdue).collect();
        let mut failed = 0;
        for (op, outcome) in self.run_ops(ops, HashMap::new()).await {
            if let (Op::ReleaseOverdue(flow), Some(e)) = (op, outcome.error()) {
                tracing::warn!(id = flow.id(), %flow, error = %e, "cannot release the connection's held packets");
                failed += 1;
            }
        }
        tracing::info!(
            connections = n - failed,
            limit_ms = HOLD_LIMIT.as_millis() as u64,
            "moves not done within the hold limit: their packets leave untranslated until they are (into the sink while the old address is only on lo)"
        );
    }

    /// A peer announced a new address in an authenticated update that is
    /// still being validated (`Event::PrepareReceive` among `events`, or a
    /// failed attempt before): accept its packets from there already (only
    /// sending waits for validation), so that its connection never meets a
    /// kernel that resets it.
    async fn prepare_receive_sides(&mut self, events: &[Event]) {
        let endpoint = &self.endpoint;
        let work = self.mover.receive_sides(events, |f| endpoint.connection(f));
        if work.is_empty() {
            return;
        }
        // One trip to the datapath thread for all of them. A peer's move
        // never preempts (see `moveops::prepare_peer_receive_side`); a
        // conflict refuses it (and the address fails validation).
        let ops = work.into_iter().map(Op::PrepareReceive).collect();
        for (op, outcome) in self.run_ops(ops, HashMap::new()).await {
            let (Op::PrepareReceive(t), Outcome::Done(r)) = (op, outcome) else {
                unreachable!("moveops::run answers each op with its own outcome");
            };
            let new_failure = self.mover.receive_side_done(&t, &r);
            match r {
                Ok(()) => {
                    tracing::debug!(id = t.flow.id(), flow = %t.flow, remote = %t.physical_remote, "receive side ready for the peer's new address")
                }
                Err(e) if new_failure => {
                    tracing::warn!(id = t.flow.id(), flow = %t.flow, error = %e, "cannot prepare for the peer's new address yet; will retry")
                }
                Err(_) => {}
            }
        }
    }

    pub(super) async fn apply_events(&mut self) {
        let mut events = Vec::new();
        while let Some(ev) = self.endpoint.poll_event() {
            events.push(ev);
        }
        if !events.is_empty() {
            self.standby_due = true;
            self.hide_due = true;
        }
        self.peer_moves_started(&events);
        // Receive sides first, as the core asks: what it queued with the
        // events may let a peer send to them.
        self.prepare_receive_sides(&events).await;
        // Datapath work of all other events in one batch, in event order.
        let mut batch = Vec::new();
        let mut aborted = Vec::new();
        let mut help_requests = Vec::new();
        let mut probes_answered = Vec::new();
        let mut tcp_bind_tokens = Vec::new();
        // Moves that end once their translation is installed.
        let mut ends = Vec::new();
        for ev in events {
            let flow = match &ev {
                Event::SetRemote { flow, .. }
                | Event::SendUnvalidated { flow, .. }
                | Event::Reverted { flow, .. }
                | Event::Resumed { flow, .. }
                | Event::PeerSwitched { flow, .. }
                | Event::MigrationAborted { flow, .. } => Some(*flow),
                _ => None,
            };
            let view = flow.and_then(|f| self.endpoint.connection(&f));
            // What is logged about the event carries its connection and
            // the peer host's key (its address may be the one changing).
            // (The fields are only worked out when the span is enabled.)
            let span = flow.map(|f| {
                tracing::debug_span!(
                    "conn",
                    id = f.id(), flow = %f,
                    peer = view
                        .as_ref()
                        .and_then(|v| v.peer_key)
                        .map(|k| vcmp::crypto::key_short(&k))
                        .as_deref()
                        .unwrap_or("-")
                )
            });
            let in_span = span.as_ref().map(|s| s.enter());
            let step = self.mover.step(&ev, view.as_ref());
            ends.extend(self.journal_step(&ev, &step, view.as_ref()));
            match step {
                Step::Switch(s) => {
                    if let Event::PeerSwitched { confirmed, .. } = ev {
                        tracing::debug!(id = s.flow.id(), flow = %s.flow, confirmed, "the peer sends to our new address");
                    }
                    batch.push(s);
                    continue;
                }
                Step::Release(flow) => {
                    if let Event::MigrationAborted { reason, .. } = &ev {
                        tracing::warn!(id = flow.id(), %flow, %reason, "migration aborted");
                    }
                    aborted.push(flow);
                    continue;
                }
                Step::Wait(flow, why) => {
                    tracing::debug!(id = flow.id(), %flow, ?view, "{why}");
                    continue;
                }
                Step::NotAMove => {}
            }
            // Not entered across the awaits below.
            drop(in_span);
            match ev {
                Event::Paired { peer, key } => {
                    tracing::info!(%peer, key = %identity::key_hex(&key), "paired with peer host");
                    self.paired(peer, &key);
                    if let Err(e) = self.peers.remember(peer, key) {
                        tracing::error!(error = %e, "cannot save the peer's key");
                    }
                }
                Event::ClaimConflict {
                    peer,
                    claimant,
                    holder,
                    connections,
                } => {
                    tracing::warn!(%peer, claimant = %identity::key_hex(&claimant), holder = %identity::key_hex(&holder), connections,
                        "a host claims connections that belong to another host key; they stay with it (if that host was reinstalled, run `vnatctl peers forget <holder key>`)");
                }
                Event::PeerKeyChanged {
                    peer,
                    pinned,
                    offered,
                } => {
                    tracing::error!(%peer, pinned = %identity::key_hex(&pinned), offered = %identity::key_hex(&offered),
                        "peer presented a different host key than the pinned one: refused (if the peer was reinstalled, remove it from peers.json in the state directory)");
                }
                Event::DivertBinds { toward } => {
                    // Before the BIND_REQ that this makes the core send
                    // (flushed after the events): no BIND may reach an
                    // application.
                    let port = self.sock.local_addr().map(|a| a.port()).unwrap_or(0);
                    let r = with_dp(&self.dp, move |dp| dp.divert_binds(toward, port)).await;
                    if let Err(e) = &r {
                        tracing::warn!(%toward, error = %e, "cannot divert in-band BINDs: UDP flows from there stay unbound");
                    }
                    self.endpoint.binds_diverted(toward, r.is_ok());
                }
                Event::GuardNat { flow, nat } => self.guard_nat(flow, nat).await,
                Event::SendInBand {
                    local,
                    remote,
                    payload,
                } => {
                    let r =
                        with_dp(&self.dp, move |dp| dp.send_in_band(local, remote, &payload)).await;
                    if let Err(e) = r {
                        // The event names the path (physical endpoints), not
                        // the flow, so there is no id to log.
                        tracing::warn!(%local, %remote, error = %e, "cannot send a BIND on the flow's path");
                    }
                }
                // After the batch below, which installs the connection's
                // rebind.
                Event::ExpectTcpBind { flow, token } => tcp_bind_tokens.push((flow, token)),
                Event::SendTcpBind {
                    flow,
                    local,
                    remote,
                    token,
                } => {
                    let r = with_dp(&self.dp, move |dp| {
                        dp.send_tcp_bind(&flow, local, remote, token)
                    })
                    .await;
                    if let Err(e) = r {
                        tracing::warn!(id = flow.id(), %flow, %local, %remote, error = %e, "cannot send a TCP BIND on the connection's path");
                    }
                }
                Event::HelpRequested { flow, help } => help_requests.push((flow, help)),
                Event::ProbeAnswered { key } => probes_answered.push(key),
                Event::SuspendSettled { flow, answered } => {
                    tracing::debug!(id = flow.id(), %flow, answered, "suspension settled");
                    self.settling.settled(&flow);
                    self.suspend_ended(&flow, answered);
                }
                // Prepared above, before the rest.
                Event::PrepareReceive { .. } => {}
                other => tracing::debug!(event = ?other, "VCMP event"),
            }
        }
        let done = self.translate_all(batch).await;
        self.switches_done(ends, &done);
        // The tokens of TCP BIND requests the core queued: in place before
        // those requests leave (they are flushed after the events).
        for (flow, token) in tcp_bind_tokens {
            match with_dp(&self.dp, move |dp| dp.expect_tcp_bind(&flow, token)).await {
                Ok(true) => {
                    tracing::debug!(id = flow.id(), %flow, "waiting for the peer's TCP BIND")
                }
                Ok(false) => self.endpoint.tcp_bind_settled(&flow),
                Err(e) => {
                    tracing::warn!(id = flow.id(), %flow, error = %e, "cannot give the datapath a TCP BIND's token: the connection's new NAT port is not learned")
                }
            }
        }
        // A helped peer that moved is back: reopen its window now that the
        // socket's packets reach it.
        let back: Vec<VirtualFlow> = done
            .iter()
            .filter(|s| s.peer_moved && self.helpers.helping.contains_key(&s.flow))
            .map(|s| s.flow)
            .collect();
        for f in back {
            self.end_helping(f, helping::End::Reopen).await;
        }
        // A peer that moved was heard from: not silent, whatever its
        // sockets showed while it moved.
        let moved: Vec<VirtualFlow> = done
            .iter()
            .filter(|s| s.peer_moved)
            .map(|s| s.flow)
            .collect();
        for f in moved {
            self.peer_heard(f).await;
        }
        for (flow, help) in help_requests {
            self.help_requested(flow, help).await;
        }
        for key in probes_answered {
            self.probe_answered(key).await;
        }
        // Tell each peer whose new address we now send to (SWITCHED).
        let confirm: Vec<VirtualFlow> = done
            .iter()
            .filter(|s| s.confirms())
            .map(|s| s.flow)
            .collect();
        if !confirm.is_empty() {
            self.endpoint.confirm_switched(now(), &mut OsRng, &confirm);
        }
        let ops = aborted.into_iter().map(Op::ReleaseAborted).collect();
        for (op, outcome) in self.run_ops(ops, HashMap::new()).await {
            if let (Op::ReleaseAborted(flow), Some(e)) = (op, outcome.error()) {
                tracing::warn!(id = flow.id(), %flow, error = %e, "cannot release the connection's held packets");
            }
        }
    }

    /// Make the datapath translate `flow` to (local, remote), or stop
    /// translating it when both are its virtual endpoints again.
    /// `peer_moved`: the peer's address changed (see [`Switch`]).
    pub(super) async fn translate(
        &mut self,
        flow: VirtualFlow,
        local: SocketAddr,
        remote: SocketAddr,
        peer_moved: bool,
    ) {
        self.translate_all(vec![Switch {
            flow,
            local,
            remote,
            peer_moved,
            solicit: peer_moved,
            budget: crate::daemon::mover::Budget::None,
        }])
        .await;
    }

    /// [`Driver::translate`] for many connections in one trip to the
    /// datapath thread: when thousands move together, one hand-off each
    /// (and a wait for a CPU on a busy host) would cost more than the work.
    /// Returns the switches that took effect.
    ///
    /// The TCP restart levers (and the solicited ACKs of [`Switch`]): for a
    /// few connections, the verified ones, at once after each install,
    /// before anything VCMP queued is sent. For a mass move they are queued
    /// for [`Driver::restart_translated`], which the loop runs after the
    /// flush: they cost tens of microseconds per connection, and the peer's
    /// RESPONSE, UPD_R or SWITCHED must not wait behind thousands of them.
    pub(super) async fn translate_all(&mut self, items: Vec<Switch>) -> Vec<Switch> {
        if items.is_empty() {
            return Vec::new();
        }
        let verified = items.len() <= VERIFIED_RESTARTS_MAX;
        let started = std::time::Instant::now();
        let ops = items
            .into_iter()
            .map(|switch| Op::Switch { switch, verified })
            .collect();
        let done = self.run_ops(ops, HashMap::new()).await;
        let mut ok = Vec::with_capacity(done.len());
        for (op, outcome) in done {
            let (Op::Switch { switch: s, .. }, Outcome::Done(r)) = (op, outcome) else {
                unreachable!("moveops::run answers each op with its own outcome");
            };
            match r {
                Ok(()) => {
                    // The peer's solicited ACKs leave after its SWITCHED and
                    // make our held sockets send what they queued, with
                    // their ACK; one with nothing to send keeps its ACK
                    // until it next sends or receives.
                    self.mover.switched(&s, verified);
                    if s.budget == crate::daemon::mover::Budget::Lift {
                        // Not "translation updated": it was, at the
                        // update (the benchmarks read that line).
                        tracing::debug!(id = s.flow.id(), flow = %s.flow, remote = %s.remote, "the peer's new address is validated: its budget is lifted");
                    } else if matches!(s.budget, crate::daemon::mover::Budget::Again(_)) {
                        tracing::debug!(id = s.flow.id(), flow = %s.flow, remote = %s.remote, "the peer sent its update again: its budget starts again, SWITCHED goes again");
                    } else {
                        tracing::info!(id = s.flow.id(), flow = %s.flow, local = %s.local, remote = %s.remote, "translation updated");
                    }
                    ok.push(s);
                }
                Err(e) => {
                    tracing::error!(id = s.flow.id(), flow = %s.flow, error = %e, "cannot update the translation")
                }
            }
        }
        if verified && !ok.is_empty() {
            tracing::info!(
                connections = ok.len(),
                verified,
                elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
                "restart levers sent"
            );
        }
        ok
    }

    /// The restart levers, without waits, for the connections of a mass
    /// move translated (see [`Driver::translate_all`]): at most
    /// [`RESTARTS_PER_TURN`] a turn, oldest first, the rest in the turns
    /// after. Each lever costs tens to hundreds of microseconds (the
    /// injected packet's whole trip runs in the syscall), and thousands at
    /// once kept the loop from the peer's next datagrams for 50-240 ms a
    /// share: at 10,000 connections the exchange went one share per round
    /// of levers, and moves overran the hold limit.
    pub(super) async fn restart_translated(&mut self) {
        let items = self.mover.take_restarts(RESTARTS_PER_TURN);
        if items.is_empty() {
            return;
        }
        let (n, started) = (items.len(), std::time::Instant::now());
        let ops = items
            .into_iter()
            .map(|(flow, solicit)| Op::Restart { flow, solicit })
            .collect();
        self.run_ops(ops, HashMap::new()).await;
        tracing::info!(
            connections = n,
            verified = false,
            elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
            "restart levers sent"
        );
    }

    /// Run `ops` on the datapath thread, in one trip and in order
    /// ([`moveops::run`]); `preempting`: the connections a preempting move
    /// may reset. Nothing to run costs no trip.
    async fn run_ops(
        &mut self,
        ops: Vec<Op>,
        preempting: HashMap<VirtualFlow, u64>,
    ) -> Vec<(Op, Outcome)> {
        if ops.is_empty() {
            return Vec::new();
        }
        with_dp(&self.dp, move |dp| moveops::run(dp, ops, &preempting)).await
    }
}
