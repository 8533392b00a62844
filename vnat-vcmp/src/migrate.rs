//! Resume: the location chain (paper section 3.3.2.1, Figure 3-5) and the
//! handling of location replies. Suspend is in `suspend.rs`, the update
//! and path validation in `update.rs`.
//!
//! Every connection runs its own small state machine, but connections that
//! move together share the time and the per-call request ids, so their
//! records travel in the same datagrams and their timers fire together:
//! restoring N connections to one peer costs the same round trips as one.

use crate::stats::{Counter, Reject};
use std::net::SocketAddr;

use super::crypto;
use super::endpoint::{AbortReason, Ctx, Endpoint, Event};
use super::location::{self, ChainStep, Step};
use super::roles::RoleState;
use super::wire::{Ext, Kind, Record};
use super::Timestamp;
use crate::flow::{Proto, VirtualFlow};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Querying and storing at `steps[idx]`.
    Chain,
    /// The peer was located at this VCMP address; UPD sent (P(4)/S(4)).
    Updating(SocketAddr),
    /// Our location is stored; waiting for the peer to come to us.
    Parked,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lookup {
    Pending,
    NotFound,
}

pub(crate) struct Migration {
    pub steps: Vec<ChainStep>,
    pub idx: usize,
    pub round: u32,
    pub phase: Phase,
    pub tries: u32,
    pub deadline: Timestamp,
    pub lookup: Lookup,
    pub store_ok: Option<bool>,
    /// The location servers asked at once, alongside the chain's first
    /// steps (see [`EARLY`]): what of that query is still unanswered.
    pub early: Early,
    /// Where the peer was when the move started: if it is still there when
    /// the move completes, the mover waits for its SWITCHED (see
    /// `vcmp::switched`); if it moved too, both would wait for each other.
    pub peer_at_start: SocketAddr,
    /// Our end before the move: where it stays if the move is given up
    /// (the datapath never switched its send side).
    pub local_at_start: SocketAddr,
}

/// The location servers' part of the query a move starts with. The
/// paper's chain asks the location servers (P(3)/S(3)) only after the
/// peer's old location and our own have failed, each after its retries
/// (about 15 s apiece). But when both ends moved, the location server is
/// the only place either can learn where the other went, so every round
/// of the chain also stores our new location there and looks the peer up
/// from its very first step: whichever end arrives second finds the first
/// one's record, one location-server round trip after its move. A STORE
/// leaves before its LOOKUP, so of two ends asking at the same moment at
/// least one finds the other (the server handles one host's datagrams in
/// order: both LOOKUPs cannot come before both STOREs). Answers that find
/// nothing change nothing; the chain goes on as in the paper.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Early {
    pub lookup_pending: bool,
    pub store_pending: bool,
}

/// The step index that requests of the early query are noted with (no
/// chain step has it).
pub(crate) const EARLY: usize = usize::MAX;

/// An outstanding LOOKUP or STORE: which connections' records it carried,
/// at which step, so that a reply to an older step is not taken for the
/// current one.
pub(crate) struct Request {
    pub kind: Kind,
    pub flows: Vec<(VirtualFlow, usize, u32)>,
    pub expires: Timestamp,
}

/// Most request ids remembered at once.
const MAX_REQUESTS: usize = 4096;

impl Endpoint {
    pub(crate) fn start_migration(
        &mut self,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
        new_local: SocketAddr,
        across: Option<SocketAddr>,
    ) {
        let port = self.cfg.port;
        let servers = self.location_targets();
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        let local_at_start = c.local_phys;
        let own_old = c.local_phys.ip();
        let peer_old = c.remote_phys.ip();
        if new_local.is_ipv4() != c.local_phys.is_ipv4() {
            c.local_alt = Some(c.local_phys);
        }
        c.local_phys = new_local;
        c.local_unproven = true;
        c.follows_peer = false;
        // Into the other family (`vcmp::family`): the peer is where it
        // told us it is in that family, not at its current address.
        let across = across.filter(|p| *p != c.remote_phys);
        // A claim still unanswered is moot once we move.
        if c.claim_retry.take().is_some() {
            if let Some(s) = c.settling.as_mut() {
                s.unanswered = true;
            }
        }
        let prepared_for = c.pending_remote.map(|(p, _)| p);
        let role = c.role.effective();
        let mut steps = location::chain(role, peer_old, own_old, &servers, port);
        // The peer announced a new address (an authenticated update) that
        // is still being validated: it moved just before us, and its
        // vnatd is there, not at its old location, which may be gone with
        // ours (both ends moving, the peer's update a moment before our
        // own address changed). Ask it there first.
        if let Some(p) = prepared_for.filter(|p| p.ip() != peer_old && p.port() != 0) {
            steps.insert(0, location::ChainStep::peer_at(role, p.ip(), port));
        }
        if let Some(p) = across {
            steps.insert(0, location::ChainStep::peer_at(role, p.ip(), port));
        }
        let validate_across = across.filter(|p| !c.validated.contains(&p.ip()));
        let binding_seq = c.binding_seq;
        c.mig = Some(Box::new(Migration {
            steps,
            idx: 0,
            round: 0,
            phase: Phase::Chain,
            tries: 0,
            deadline: ctx.now,
            lookup: Lookup::Pending,
            store_ok: None,
            early: Early::default(),
            peer_at_start: c.remote_phys,
            local_at_start,
        }));
        self.tx.trusted.insert(own_old);
        // Where the peer told us (in an authenticated PROBE) it is in the
        // other family: we send there on our own account, as to the
        // connection's remote address, not in answer to what came from
        // there.
        if let Some(p) = across {
            self.tx.trusted.insert(p.ip());
        }
        self.settle_if_done(flow);
        // A receive side prepared for the peer's announced address was for
        // our old end: it is needed again for the new one.
        if let Some(remote) = prepared_for {
            self.emit(Event::PrepareReceive {
                flow: *flow,
                local: new_local,
                remote,
            });
        }
        // A validation of the peer's new address that started before this
        // move (the peer moved first and its update reached us here) gets
        // its RESPONSE at our old address, where it is lost: challenge
        // again now, from the new one, not at the retransmission timeout.
        self.validations.hurry(flow, ctx.now);
        self.run_step(ctx, flow);
        // The peer's address in the other family is validated right behind
        // our update (as one found by a LOOKUP, `found`): it was told in a
        // PROBE, which proves nothing about who receives there. An address
        // it proved before is taken at its UPD_R.
        if across.is_some() {
            self.stats.count(Counter::FamilyChanged);
        }
        if let Some(p) = validate_across {
            self.propose_binding(ctx, flow, p, binding_seq);
        }
    }

    /// Whether a move of `flow` is under way and waits for its peer: an
    /// update sent to the peer (at a step at its old address, or once it
    /// was located) and not answered yet.
    pub(crate) fn waits_for_peer(&self, flow: &VirtualFlow) -> bool {
        self.conns
            .get(flow)
            .and_then(|c| c.mig.as_ref())
            .is_some_and(|m| match m.phase {
                Phase::Updating(_) => true,
                Phase::Chain => m.steps.get(m.idx).is_some_and(|s| s.peer_old),
                Phase::Parked => true,
            })
    }

    /// Start the move of `flow`, if one is under way, from its first step
    /// again: the pairing with its peer was renewed (the peer's vnatd had
    /// lost our session), and what was sent so far went unanswered.
    pub(crate) fn restart_migration(&mut self, ctx: &mut Ctx, flow: &VirtualFlow) {
        let Some(m) = self.conns.get_mut(flow).and_then(|c| c.mig.as_mut()) else {
            return;
        };
        m.idx = 0;
        self.run_step(ctx, flow);
    }

    fn run_step(&mut self, ctx: &mut Ctx, flow: &VirtualFlow) {
        let rto = self.rto(ctx, 0);
        let Some(m) = self.conns.get_mut(flow).and_then(|c| c.mig.as_mut()) else {
            return;
        };
        m.phase = Phase::Chain;
        m.lookup = Lookup::Pending;
        m.store_ok = None;
        m.tries = 1;
        m.deadline = ctx.now.plus(rto);
        if m.idx == 0
            && self.cfg.ask_location_servers_at_once
            && (self.cfg.external_store || !self.cfg.location_servers.is_empty())
        {
            m.early = Early {
                lookup_pending: true,
                store_pending: true,
            };
        }
        self.rearm(flow);
        self.send_step(ctx, flow);
    }

    /// Send whatever the current step still waits for: the query, the
    /// store, and at the peer's old location an update as well (if the
    /// peer did not move, that is all it takes: paper 3.3.2.1, first
    /// paragraph).
    fn send_step(&mut self, ctx: &mut Ctx, flow: &VirtualFlow) {
        let Some(m) = self.conns.get(flow).and_then(|c| c.mig.as_ref()) else {
            return;
        };
        let Some(step) = m.steps.get(m.idx).copied() else {
            return;
        };
        let (idx, round, lookup, store_ok) = (m.idx, m.round, m.lookup, m.store_ok);
        // The early query rides on the chain's steps before its own
        // location-server steps, which then ask again in the paper's way.
        let early = if matches!(step.step, Step::P3 | Step::S3) {
            Early::default()
        } else {
            m.early
        };
        // STORE before LOOKUP, here as at the early query (see [`Early`]).
        if store_ok.is_none() && self.send_record(ctx, flow, Kind::Store, Ext::None, step.target) {
            self.note_request(ctx, Kind::Store, (*flow, idx, round));
        }
        if lookup == Lookup::Pending
            && self.send_record(ctx, flow, Kind::Lookup, Ext::None, step.target)
        {
            self.note_request(ctx, Kind::Lookup, (*flow, idx, round));
        }
        if step.peer_old {
            self.send_record(ctx, flow, Kind::Upd, Ext::None, step.target);
        }
        if early.store_pending || early.lookup_pending {
            self.send_early_query(ctx, flow, early, round);
        }
    }

    /// The early query at every location server (see [`Early`]).
    fn send_early_query(&mut self, ctx: &mut Ctx, flow: &VirtualFlow, early: Early, round: u32) {
        for server in self.location_targets() {
            for (pending, kind) in [
                (early.store_pending, Kind::Store),
                (early.lookup_pending, Kind::Lookup),
            ] {
                if pending && self.send_record(ctx, flow, kind, Ext::None, server) {
                    self.note_request(ctx, kind, (*flow, EARLY, round));
                }
            }
        }
    }

    fn note_request(&mut self, ctx: &mut Ctx, kind: Kind, entry: (VirtualFlow, usize, u32)) {
        let id = ctx.last_req;
        if !self.requests.contains_key(&id) && self.requests.len() >= MAX_REQUESTS {
            self.stats.reject(Reject::RequestTableFull);
            return;
        }
        let expires = ctx.now.plus(self.cfg.max_rto * 4);
        let r = self.requests.entry(id).or_insert_with(|| Request {
            kind,
            flows: Vec::new(),
            expires,
        });
        r.flows.push(entry);
    }

    fn advance(&mut self, ctx: &mut Ctx, flow: &VirtualFlow) {
        let Some(m) = self.conns.get_mut(flow).and_then(|c| c.mig.as_mut()) else {
            return;
        };
        m.idx += 1;
        if m.idx >= m.steps.len() {
            let tried = m.steps.iter().map(|s| s.target).collect();
            self.abort(flow, AbortReason::LocationUnknown { tried });
        } else {
            self.run_step(ctx, flow);
        }
    }

    fn park(&mut self, ctx: &mut Ctx, flow: &VirtualFlow) {
        let wait = self.cfg.park_timeout;
        let Some(m) = self.conns.get_mut(flow).and_then(|c| c.mig.as_mut()) else {
            return;
        };
        m.phase = Phase::Parked;
        m.deadline = ctx.now.plus(wait);
        let step = m.steps.get(m.idx).map(|s| s.step);
        self.rearm(flow);
        if let Some(step) = step {
            self.emit(Event::Parked { flow: *flow, step });
        }
    }

    fn abort(&mut self, flow: &VirtualFlow, reason: AbortReason) {
        if let Some(c) = self.conns.get_mut(flow) {
            // Where the datapath still sends from: a move given up while
            // the old address is there (a migration between links) is not
            // taken for done, and one whose address is gone is tried
            // again by the next plan.
            if let Some(m) = c.mig.take() {
                c.local_phys = m.local_at_start;
            }
            c.role = RoleState::default();
        }
        self.rearm(flow);
        self.stats.count(Counter::MigrationAborted);
        tracing::warn!(id = flow.id(), %flow, %reason, "VCMP migration aborted");
        self.emit(Event::MigrationAborted {
            flow: *flow,
            reason,
        });
    }

    /// Our move of `flow` is acknowledged: `Resumed`, and a TCP flow (or a
    /// UDP flow through a NAT) whose peer stayed put waits for the peer's
    /// SWITCHED (see `vcmp::switched`).
    pub(crate) fn complete(&mut self, ctx: &Ctx, flow: &VirtualFlow) {
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        let Some(m) = c.mig.take() else {
            return;
        };
        c.role = RoleState::default();
        let local = c.local_phys;
        let peer_stayed = c.remote_phys == m.peer_at_start && c.pending_remote.is_none();
        // UDP through a NAT waits too: the peer cannot know our new NAT's
        // port before our BIND, and a datagram that reached it before its
        // datapath holds them would reach its application as a stranger's.
        let through_nat = c.peer_named().is_some_and(|n| n.local != flow.local);
        let wait = peer_stayed && (flow.proto == Proto::Tcp || through_nat);
        self.rearm(flow);
        self.stats.count(Counter::MigrationCompleted);
        self.emit(Event::Resumed {
            flow: *flow,
            local,
            switch_now: !wait,
        });
        if wait {
            self.await_switch(ctx, flow);
        }
    }

    /// The peer's location was learnt (P(4)/S(4)) from its record `seq`:
    /// send it the update, and if it is a new address for the peer, the
    /// CHALLENGE that validates it right behind (not after the peer's
    /// UPD_R: that would cost a round trip more). The peer handles the UPD
    /// first, so it is ready for our new address before its RESPONSE lets
    /// us send from there.
    fn found(&mut self, ctx: &mut Ctx, flow: &VirtualFlow, at: SocketAddr, seq: u64) {
        let port = self.cfg.port;
        let rto = self.rto(ctx, 0);
        let Some(m) = self.conns.get_mut(flow).and_then(|c| c.mig.as_mut()) else {
            return;
        };
        if !matches!(m.phase, Phase::Chain | Phase::Parked) {
            return;
        }
        let target = SocketAddr::new(at.ip(), port);
        let already_sent = m.phase == Phase::Chain
            && m.steps
                .get(m.idx)
                .is_some_and(|s| s.peer_old && s.target == target);
        m.phase = Phase::Updating(target);
        m.tries = 1;
        m.deadline = ctx.now.plus(rto);
        self.rearm(flow);
        if !already_sent {
            self.send_record(ctx, flow, Kind::Upd, Ext::None, target);
        }
        self.propose_binding(ctx, flow, at, seq);
    }

    pub(crate) fn migration_timeouts(&mut self, ctx: &mut Ctx) {
        let now = ctx.now;
        for f in self.conn_timers.due(now) {
            let Some(m) = self.conns.get(&f).and_then(|c| c.mig.as_ref()) else {
                continue;
            };
            if m.deadline > now {
                continue;
            }
            let (phase, tries, round, store_ok) = (m.phase, m.tries, m.round, m.store_ok);
            match phase {
                Phase::Parked => {
                    if round + 1 >= self.cfg.max_rounds {
                        self.abort(&f, AbortReason::PeerNeverArrived { rounds: round + 1 });
                    } else if let Some(m) = self.conns.get_mut(&f).and_then(|c| c.mig.as_mut()) {
                        m.round += 1;
                        m.idx = 0;
                        self.run_step(ctx, &f);
                    }
                }
                _ if tries >= self.cfg.max_tries => {
                    // Updates the peer we are paired with never answered:
                    // it may have lost our session (see `pair_again`).
                    let updated = match phase {
                        Phase::Updating(target) => Some(target),
                        _ => m.steps.get(m.idx).filter(|s| s.peer_old).map(|s| s.target),
                    };
                    let paired = self
                        .conns
                        .get(&f)
                        .and_then(|c| c.peer_key)
                        .is_some_and(|k| self.sessions.contains_key(&k));
                    if let Some(target) = updated.filter(|_| paired) {
                        self.pair_again(ctx, target.ip());
                    }
                    if phase == Phase::Chain && store_ok == Some(true) {
                        self.park(ctx, &f);
                    } else {
                        self.advance(ctx, &f);
                    }
                }
                _ => {
                    let d = now.plus(self.rto(ctx, tries));
                    if let Some(m) = self.conns.get_mut(&f).and_then(|c| c.mig.as_mut()) {
                        m.tries += 1;
                        m.deadline = d;
                    }
                    self.rearm(&f);
                    self.stats.count(Counter::Retransmit);
                    match phase {
                        Phase::Updating(target) => {
                            self.send_record(ctx, &f, Kind::Upd, Ext::None, target);
                        }
                        _ => self.send_step(ctx, &f),
                    }
                }
            }
        }
    }

    /// Records found by a LOOKUP: each is checked with the connection key
    /// of the peer that stored it, so a location server cannot lie.
    pub(crate) fn on_lookup_r(&mut self, ctx: &mut Ctx, req: u32, records: &[Record]) {
        let Some(r) = self.requests.get(&req) else {
            self.stats.reject(Reject::UnsolicitedLookupR);
            return;
        };
        if r.kind != Kind::Lookup {
            self.stats.reject(Reject::UnsolicitedLookupR);
            return;
        }
        let asked = r.flows.clone();
        for rec in records {
            let flow = VirtualFlow {
                proto: rec.proto,
                local: rec.receiver_vir,
                remote: rec.sender_vir,
            };
            if !asked.iter().any(|(f, _, _)| *f == flow) {
                self.stats.reject(Reject::UnrequestedLocation);
                continue;
            }
            let Some(c) = self.conns.get_mut(&flow) else {
                continue;
            };
            let Some(keys) = &c.keys else { continue };
            let mut buf = [0u8; super::wire::MAX_SIGNED_LEN];
            let Ok(n) = rec.write_signed(&mut buf) else {
                continue;
            };
            // Under the current keys, or those before the last ratchet,
            // which the peer signs with until it sees us use the new ones.
            let genuine = [Some(keys), c.prev_keys.as_deref()]
                .into_iter()
                .flatten()
                .any(|k| crypto::verify_record(&k.recv, &buf[..n], &rec.tag));
            if !genuine {
                self.stats.reject(Reject::BadMac);
                continue;
            }
            // Older than a location already followed, or than a record
            // the peer sent us itself: a replay (from a store, which
            // keeps whatever it is given), never news.
            if rec.seq <= c.location_seq.max(c.replay.highest()) {
                self.stats.reject(Reject::StaleLocation);
                continue;
            }
            c.location_seq = rec.seq;
            self.stats.count(Counter::LocationFound);
            // The address comes from an authenticated record: it may be
            // sent as much as three times this record (see tx.rs).
            self.tx.credit(
                rec.sender_phys.ip(),
                super::wire::record_len(rec.family(), Kind::Store),
            );
            self.found(ctx, &flow, rec.sender_phys, rec.seq);
        }
        for (f, idx, round) in asked {
            let Some(m) = self.conns.get_mut(&f).and_then(|c| c.mig.as_mut()) else {
                continue;
            };
            if idx == EARLY {
                // Found or not, this server answered: no more asking it
                // early (a found record has already moved the migration
                // on to the update).
                if m.round == round {
                    m.early.lookup_pending = false;
                }
                continue;
            }
            if m.phase == Phase::Chain
                && m.idx == idx
                && m.round == round
                && m.lookup == Lookup::Pending
            {
                m.lookup = Lookup::NotFound;
                match m.store_ok {
                    Some(true) => self.park(ctx, &f),
                    // Both query and store failed: on to the next step
                    // (paper 3.3.2.1, P(2)/P(3)), not after the retries.
                    Some(false) => self.advance(ctx, &f),
                    None => {}
                }
            }
        }
    }

    pub(crate) fn on_store_r(&mut self, ctx: &mut Ctx, req: u32, accepted: u8) {
        let Some(r) = self.requests.get(&req) else {
            self.stats.reject(Reject::UnsolicitedStoreR);
            return;
        };
        if r.kind != Kind::Store {
            self.stats.reject(Reject::UnsolicitedStoreR);
            return;
        }
        let asked = r.flows.clone();
        for (f, idx, round) in asked {
            let Some(m) = self.conns.get_mut(&f).and_then(|c| c.mig.as_mut()) else {
                continue;
            };
            if idx == EARLY {
                // Kept or refused, it was answered: a refusal (a full
                // store) is not retried early; the chain's own
                // location-server step tries again.
                if m.round == round {
                    m.early.store_pending = false;
                }
                continue;
            }
            if m.phase == Phase::Chain && m.idx == idx && m.round == round && m.store_ok.is_none() {
                m.store_ok = Some(accepted > 0);
                if m.lookup == Lookup::NotFound {
                    if accepted > 0 {
                        self.park(ctx, &f);
                    } else {
                        // Both failed: next step at once (paper 3.3.2.1).
                        self.advance(ctx, &f);
                    }
                }
            }
        }
    }
}
