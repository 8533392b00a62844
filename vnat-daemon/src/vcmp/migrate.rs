//! Suspend (roles, key agreement) and resume (location chain, update, path
//! validation): paper sections 3.3.1 and 3.3.2.
//!
//! Every connection runs its own small state machine, but connections that
//! move together share the time and the per-call request ids, so their
//! records travel in the same datagrams and their timers fire together:
//! restoring N connections to one peer costs the same round trips as one.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use super::crypto::{self, Ephemeral};
use super::endpoint::{AbortReason, CryptoDyn, Ctx, Endpoint, Event, KeyxState};
use super::location::{self, ChainStep};
use super::roles::{ClaimOutcome, Role, RoleState};
use super::wire::{Ext, Kind, Record};
use super::Timestamp;
use crate::datapath::VirtualFlow;

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
}

/// An outstanding LOOKUP or STORE: which connections' records it carried,
/// at which step, so that a reply to an older step is not taken for the
/// current one.
pub(crate) struct Request {
    pub kind: Kind,
    pub flows: Vec<(VirtualFlow, usize, u32)>,
    pub expires: Timestamp,
}

/// Path validations are batched per (new address, peer host): one
/// CHALLENGE covers every connection of that host that claimed the address.
/// Connections whose host is unknown (imported ones) are validated alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Group {
    Host([u8; 32]),
    Conn(VirtualFlow),
}

pub(crate) type ValidationKey = (IpAddr, Group);

pub(crate) struct Validation {
    pub anchor: VirtualFlow,
    pub nonce: [u8; 16],
    pub flows: HashSet<VirtualFlow>,
    pub tries: u32,
    pub deadline: Timestamp,
}

/// Most request ids remembered at once.
const MAX_REQUESTS: usize = 4096;

impl Endpoint {
    // ---------------------------------------------------------------- suspend

    pub(crate) fn start_suspend(&mut self, ctx: &mut Ctx, flow: &VirtualFlow) {
        let port = self.cfg.port;
        let (negotiate, dh) = (self.cfg.negotiate_roles, self.cfg.suspend_dh);
        let rto = self.rto(ctx, 0);
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        let dst = c.peer_vcmp(port);
        let has_keys = c.keys.is_some();
        // A peer that already claimed primary made us secondary; we do not
        // claim in turn (paper 3.3.1.2).
        let claim = negotiate && c.role.negotiated != Some(Role::Secondary);
        if claim {
            c.role.claim();
            c.claim_retry = Some((1, ctx.now.plus(rto)));
        }
        let mut eph_pub = None;
        if dh && has_keys && c.keyx.is_none() {
            let eph = Ephemeral::generate(&mut CryptoDyn(&mut ctx.rng));
            eph_pub = Some(eph.public());
            c.keyx = Some(KeyxState {
                eph,
                tries: 1,
                deadline: ctx.now.plus(rto),
            });
        }
        if claim {
            self.send_record(ctx, flow, Kind::SuspPrimary, Ext::None, dst);
        }
        if let Some(p) = eph_pub {
            self.send_record(ctx, flow, Kind::KeyX, Ext::Key(p), dst);
        }
    }

    pub(crate) fn role_and_key_timeouts(&mut self, ctx: &mut Ctx) {
        let now = ctx.now;
        let port = self.cfg.port;
        let max = self.cfg.max_tries;
        let due: Vec<VirtualFlow> = self
            .conns
            .values()
            .filter(|c| {
                c.claim_retry.is_some_and(|(_, d)| d <= now)
                    || c.keyx.as_ref().is_some_and(|k| k.deadline <= now)
            })
            .map(|c| c.flow)
            .collect();
        for f in due {
            let Some(c) = self.conns.get_mut(&f) else {
                continue;
            };
            let dst = c.peer_vcmp(port);
            let mut resend_claim = false;
            if let Some((tries, d)) = c.claim_retry {
                if d <= now {
                    if tries >= max {
                        // Unanswered: we keep the primary role we claimed.
                        c.claim_retry = None;
                        c.role.claim_pending = false;
                        self.stats.count("claim_unanswered");
                    } else {
                        resend_claim = true;
                    }
                }
            }
            let mut resend_key = None;
            if let Some(k) = &c.keyx {
                if k.deadline <= now {
                    if k.tries >= max {
                        c.keyx = None;
                        self.stats.count("keyx_unanswered");
                    } else {
                        resend_key = Some((k.tries, k.eph.public()));
                    }
                }
            }
            if resend_claim {
                let tries = c.claim_retry.map_or(1, |t| t.0);
                let d = now.plus(self.rto(ctx, tries));
                if let Some(c) = self.conns.get_mut(&f) {
                    c.claim_retry = Some((tries + 1, d));
                }
                self.send_record(ctx, &f, Kind::SuspPrimary, Ext::None, dst);
                self.stats.count("retransmit");
            }
            if let Some((tries, p)) = resend_key {
                let d = now.plus(self.rto(ctx, tries));
                if let Some(k) = self.conns.get_mut(&f).and_then(|c| c.keyx.as_mut()) {
                    k.tries += 1;
                    k.deadline = d;
                }
                self.send_record(ctx, &f, Kind::KeyX, Ext::Key(p), dst);
                self.stats.count("retransmit");
            }
        }
    }

    pub(crate) fn on_susp_primary(
        &mut self,
        from: SocketAddr,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
    ) -> Result<(), &'static str> {
        let c = self.conns.get_mut(flow).ok_or("unknown_connection")?;
        match c.role.on_claim(&flow.local, &flow.remote) {
            ClaimOutcome::AnswerSecondary => {
                self.send_record(ctx, flow, Kind::SuspSecondary, Ext::None, from);
                self.emit(Event::RoleDecided {
                    flow: *flow,
                    role: Role::Secondary,
                });
            }
            ClaimOutcome::Arbitrated(role) => {
                c.claim_retry = None;
                self.emit(Event::RoleDecided { flow: *flow, role });
            }
        }
        Ok(())
    }

    pub(crate) fn on_susp_secondary(&mut self, flow: &VirtualFlow) -> Result<(), &'static str> {
        let c = self.conns.get_mut(flow).ok_or("unknown_connection")?;
        if !c.role.claimed {
            return Err("unsolicited_susp_secondary");
        }
        let first = c.role.claim_pending;
        c.role.on_accept();
        c.claim_retry = None;
        if first {
            self.emit(Event::RoleDecided {
                flow: *flow,
                role: Role::Primary,
            });
        }
        Ok(())
    }

    /// Suspend-time Diffie-Hellman (paper 3.3.1.1), authenticated by the
    /// current connection key and mixed into it. `under_prev`: the record
    /// verified only under the keys before our last ratchet, i.e. it is a
    /// retransmission whose answer was lost; answer it again under those.
    pub(crate) fn on_keyx(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        flow: &VirtualFlow,
        rec: &Record,
        under_prev: bool,
    ) -> Result<(), &'static str> {
        let Ext::Key(peer_eph) = rec.ext else {
            return Err("bad_extension");
        };
        let c = self.conns.get_mut(flow).ok_or("unknown_connection")?;
        if under_prev {
            let (Some((seen, mine)), Some(prev)) = (c.keyx_answer, &c.prev_keys) else {
                return Err("bad_mac");
            };
            if seen != peer_eph {
                return Err("bad_mac");
            }
            let key = prev.send.clone();
            c.send_seq += 1;
            let answer = Record {
                command: Kind::KeyX,
                proto: flow.proto,
                receiver_vir: flow.remote,
                sender_vir: flow.local,
                sender_phys: c.local_phys,
                ext: Ext::Key(mine),
                seq: c.send_seq,
                tag: [0; 16],
            };
            self.push_signed(&answer, &key, Kind::KeyX, 0, from);
            return Ok(());
        }
        let keys = c.keys.as_ref().ok_or("no_keys")?;
        if let Some(mine) = c.keyx.take() {
            // We started (or both started): finish with our value, no reply.
            let Ok(dh) = mine.eph.dh(&peer_eph) else {
                c.keyx = Some(mine);
                return Err("low_order_point");
            };
            let new = keys.ratchet(&dh, &mine.eph.public(), &peer_eph, flow);
            c.prev_keys = c.keys.replace(new);
            c.keyx_answer = None;
        } else {
            let eph = Ephemeral::generate(&mut CryptoDyn(&mut ctx.rng));
            let dh = eph.dh(&peer_eph).map_err(|_| "low_order_point")?;
            let new = keys.ratchet(&dh, &eph.public(), &peer_eph, flow);
            let mine = eph.public();
            // Answer under the old keys: the peer has not ratcheted yet.
            self.send_record(ctx, flow, Kind::KeyX, Ext::Key(mine), from);
            let c = self.conns.get_mut(flow).ok_or("unknown_connection")?;
            c.prev_keys = c.keys.replace(new);
            c.keyx_answer = Some((peer_eph, mine));
        }
        self.stats.count("rekeyed");
        self.emit(Event::Rekeyed { flow: *flow });
        Ok(())
    }

    // ----------------------------------------------------------------- resume

    pub(crate) fn start_migration(
        &mut self,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
        new_local: SocketAddr,
    ) {
        let port = self.cfg.port;
        let servers = self.cfg.location_servers.clone();
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        let own_old = c.local_phys.ip();
        let peer_old = c.remote_phys.ip();
        c.local_phys = new_local;
        c.claim_retry = None;
        let steps = location::chain(c.role.effective(), peer_old, own_old, &servers, port);
        c.mig = Some(Migration {
            steps,
            idx: 0,
            round: 0,
            phase: Phase::Chain,
            tries: 0,
            deadline: ctx.now,
            lookup: Lookup::Pending,
            store_ok: None,
        });
        self.tx.trusted.insert(own_old);
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
        if lookup == Lookup::Pending
            && self.send_record(ctx, flow, Kind::Lookup, Ext::None, step.target)
        {
            self.note_request(ctx, step.target, Kind::Lookup, (*flow, idx, round));
        }
        if store_ok.is_none() && self.send_record(ctx, flow, Kind::Store, Ext::None, step.target) {
            self.note_request(ctx, step.target, Kind::Store, (*flow, idx, round));
        }
        if step.peer_old {
            self.send_record(ctx, flow, Kind::Upd, Ext::None, step.target);
        }
    }

    fn note_request(
        &mut self,
        ctx: &mut Ctx,
        dst: SocketAddr,
        kind: Kind,
        entry: (VirtualFlow, usize, u32),
    ) {
        let _ = dst;
        let id = ctx.last_req;
        if !self.requests.contains_key(&id) && self.requests.len() >= MAX_REQUESTS {
            self.stats.reject("request_table_full");
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
        if let Some(step) = step {
            self.emit(Event::Parked { flow: *flow, step });
        }
    }

    fn abort(&mut self, flow: &VirtualFlow, reason: AbortReason) {
        if let Some(c) = self.conns.get_mut(flow) {
            c.mig = None;
            c.role = RoleState::default();
        }
        self.stats.count("migration_aborted");
        tracing::warn!(?flow, %reason, "VCMP migration aborted");
        self.emit(Event::MigrationAborted {
            flow: *flow,
            reason,
        });
    }

    fn complete(&mut self, flow: &VirtualFlow) {
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        if c.mig.take().is_none() {
            return;
        }
        c.role = RoleState::default();
        let local = c.local_phys;
        self.stats.count("migration_completed");
        self.emit(Event::Resumed { flow: *flow, local });
    }

    /// The peer's location was learnt (P(4)/S(4)): send it the update.
    fn found(&mut self, ctx: &mut Ctx, flow: &VirtualFlow, at: SocketAddr) {
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
        if !already_sent {
            self.send_record(ctx, flow, Kind::Upd, Ext::None, target);
        }
    }

    pub(crate) fn migration_timeouts(&mut self, ctx: &mut Ctx) {
        let now = ctx.now;
        let due: Vec<VirtualFlow> = self
            .conns
            .values()
            .filter(|c| c.mig.as_ref().is_some_and(|m| m.deadline <= now))
            .map(|c| c.flow)
            .collect();
        for f in due {
            let Some(m) = self.conns.get(&f).and_then(|c| c.mig.as_ref()) else {
                continue;
            };
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
                    self.stats.count("retransmit");
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

    // ------------------------------------------------------------ receive side

    /// UPD (paper 3.3.2.3 (1)): the peer's end is now at `rec.sender_phys`.
    pub(crate) fn on_upd(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        flow: &VirtualFlow,
        rec: &Record,
    ) -> Result<(), &'static str> {
        self.check_fresh(flow, rec.seq)?;
        self.propose_binding(ctx, flow, rec.sender_phys, rec.seq);
        self.send_record(ctx, flow, Kind::UpdR, Ext::None, from);
        // If we were looking for the peer, it found us (P(1)/S(1) parked).
        self.complete(flow);
        Ok(())
    }

    /// UPD_R (paper 3.3.2.3 (2)): the peer accepted our update and tells us
    /// where its end is.
    pub(crate) fn on_upd_r(
        &mut self,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
        rec: &Record,
    ) -> Result<(), &'static str> {
        self.check_fresh(flow, rec.seq)?;
        self.propose_binding(ctx, flow, rec.sender_phys, rec.seq);
        self.complete(flow);
        Ok(())
    }

    /// Only an update with a higher sequence number than the last applied
    /// one may move the binding; an older one changes nothing.
    fn check_fresh(&mut self, flow: &VirtualFlow, seq: u64) -> Result<(), &'static str> {
        let c = self.conns.get_mut(flow).ok_or("unknown_connection")?;
        if seq <= c.binding_seq {
            return Err("stale_update");
        }
        c.binding_seq = seq;
        Ok(())
    }

    /// The peer claims its end is at `addr`. Switch at once if the peer
    /// already proved it receives at that address; otherwise validate it
    /// first (the data path keeps the last validated address meanwhile).
    fn propose_binding(&mut self, ctx: &mut Ctx, flow: &VirtualFlow, addr: SocketAddr, seq: u64) {
        let port = self.cfg.port;
        let rto = self.rto(ctx, 0);
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        if addr == c.remote_phys {
            c.pending_remote = None;
            return;
        }
        if c.validated.contains(&addr.ip()) {
            c.pending_remote = None;
            c.remote_phys = addr;
            self.emit(Event::SetRemote {
                flow: *flow,
                remote: addr,
            });
            return;
        }
        c.pending_remote = Some((addr, seq));
        let group = c.peer_key.map_or(Group::Conn(*flow), Group::Host);
        let key = (addr.ip(), group);
        if let Some(v) = self.validations.get_mut(&key) {
            v.flows.insert(*flow);
            return;
        }
        let nonce = ctx.nonce::<16>();
        self.validations.insert(
            key,
            Validation {
                anchor: *flow,
                nonce,
                flows: HashSet::from([*flow]),
                tries: 1,
                deadline: ctx.now.plus(rto),
            },
        );
        self.send_record(
            ctx,
            flow,
            Kind::Challenge,
            Ext::Nonce(nonce),
            SocketAddr::new(addr.ip(), port),
        );
    }

    pub(crate) fn on_challenge(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        flow: &VirtualFlow,
        rec: &Record,
    ) -> Result<(), &'static str> {
        let Ext::Nonce(n) = rec.ext else {
            return Err("bad_extension");
        };
        self.send_record(ctx, flow, Kind::Response, Ext::Nonce(n), from);
        Ok(())
    }

    pub(crate) fn on_response(
        &mut self,
        flow: &VirtualFlow,
        rec: &Record,
    ) -> Result<(), &'static str> {
        let Ext::Nonce(n) = rec.ext else {
            return Err("bad_extension");
        };
        let key = self
            .validations
            .iter()
            .find(|(_, v)| v.anchor == *flow && crypto::tags_equal16(&v.nonce, &n))
            .map(|(k, _)| *k)
            .ok_or("unexpected_response")?;
        let Some(v) = self.validations.remove(&key) else {
            return Err("unexpected_response");
        };
        let ip = key.0;
        self.tx.trusted.insert(ip);
        self.stats.count("path_validated");
        for f in v.flows {
            let Some(c) = self.conns.get_mut(&f) else {
                continue;
            };
            if !c.validated.contains(&ip) {
                if c.validated.len() >= 4 {
                    c.validated.remove(0);
                }
                c.validated.push(ip);
            }
            if let Some((addr, _)) = c.pending_remote {
                if addr.ip() == ip {
                    c.pending_remote = None;
                    c.remote_phys = addr;
                    self.emit(Event::SetRemote {
                        flow: f,
                        remote: addr,
                    });
                }
            }
        }
        Ok(())
    }

    pub(crate) fn validation_timeouts(&mut self, ctx: &mut Ctx) {
        let now = ctx.now;
        let port = self.cfg.port;
        let due: Vec<ValidationKey> = self
            .validations
            .iter()
            .filter(|(_, v)| v.deadline <= now)
            .map(|(k, _)| *k)
            .collect();
        for key in due {
            let Some(mut v) = self.validations.remove(&key) else {
                continue;
            };
            v.flows.retain(|f| self.conns.contains_key(f));
            if v.flows.is_empty() {
                continue;
            }
            if v.tries >= self.cfg.max_tries {
                self.stats.count("validation_failed");
                for f in v.flows {
                    let Some(c) = self.conns.get_mut(&f) else {
                        continue;
                    };
                    if let Some((addr, _)) = c.pending_remote {
                        if addr.ip() == key.0 {
                            c.pending_remote = None;
                            let remote = c.remote_phys;
                            self.emit(Event::Reverted {
                                flow: f,
                                remote,
                                attempted: addr,
                            });
                        }
                    }
                }
                continue;
            }
            if !v.flows.contains(&v.anchor) {
                if let Some(f) = v.flows.iter().next() {
                    v.anchor = *f;
                }
            }
            v.deadline = now.plus(self.rto(ctx, v.tries));
            v.tries += 1;
            let (anchor, nonce) = (v.anchor, v.nonce);
            self.validations.insert(key, v);
            self.stats.count("retransmit");
            self.send_record(
                ctx,
                &anchor,
                Kind::Challenge,
                Ext::Nonce(nonce),
                SocketAddr::new(key.0, port),
            );
        }
    }

    // ------------------------------------------------------- location replies

    /// Records found by a LOOKUP: each is checked with the connection key
    /// of the peer that stored it, so a location server cannot lie.
    pub(crate) fn on_lookup_r(&mut self, ctx: &mut Ctx, req: u32, records: &[Record]) {
        let Some(r) = self.requests.get(&req) else {
            self.stats.reject("unsolicited_lookup_r");
            return;
        };
        if r.kind != Kind::Lookup {
            self.stats.reject("unsolicited_lookup_r");
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
                self.stats.reject("unrequested_location");
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
            if !crypto::verify_record(&keys.recv, &buf[..n], &rec.tag) {
                self.stats.reject("bad_mac");
                continue;
            }
            if rec.seq <= c.location_seq {
                self.stats.reject("stale_location");
                continue;
            }
            c.location_seq = rec.seq;
            self.stats.count("location_found");
            // The address comes from an authenticated record: it may be
            // sent as much as three times this record (see tx.rs).
            self.tx.credit(
                rec.sender_phys.ip(),
                super::wire::record_len(rec.family(), Kind::Store),
            );
            self.found(ctx, &flow, rec.sender_phys);
        }
        for (f, idx, round) in asked {
            let Some(m) = self.conns.get_mut(&f).and_then(|c| c.mig.as_mut()) else {
                continue;
            };
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
            self.stats.reject("unsolicited_store_r");
            return;
        };
        if r.kind != Kind::Store {
            self.stats.reject("unsolicited_store_r");
            return;
        }
        let asked = r.flows.clone();
        for (f, idx, round) in asked {
            let Some(m) = self.conns.get_mut(&f).and_then(|c| c.mig.as_mut()) else {
                continue;
            };
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
