//! Suspend (paper section 3.3.1): the primary/secondary claim of Figure 3-4
//! and the suspend-time Diffie-Hellman of 3.3.1.1.

use crate::stats::{Counter, Reject};
use std::net::SocketAddr;

use super::crypto::Ephemeral;
use super::endpoint::{CryptoDyn, Ctx, Endpoint, Event, KeyxState, Settling};
use super::roles::{ClaimOutcome, Role};
use super::wire::{Ext, Kind, Record};
use crate::flow::VirtualFlow;

impl Endpoint {
    pub(crate) fn start_suspend(&mut self, ctx: &mut Ctx, flow: &VirtualFlow) {
        let (negotiate, dh) = (self.cfg.negotiate_roles, self.cfg.suspend_dh);
        let rto = self.rto(ctx, 0);
        let Some(dst) = self.conns.get(flow).map(|c| self.vcmp_addr(c)) else {
            return;
        };
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
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
            c.keyx = Some(Box::new(KeyxState {
                eph,
                tries: 1,
                deadline: ctx.now.plus(rto),
            }));
        }
        // A suspension already under way goes on (one SuspendSettled).
        c.settling.get_or_insert_with(Settling::default);
        if claim {
            self.send_record(ctx, flow, Kind::SuspPrimary, Ext::None, dst);
        }
        if let Some(p) = eph_pub {
            self.send_record(ctx, flow, Kind::KeyX, Ext::Key(p), dst);
        }
        self.rearm(flow);
        // Nothing to wait for (no keys, roles not negotiated): over now.
        self.settle_if_done(flow);
    }

    /// End `flow`'s suspension (`Event::SuspendSettled`) once neither its
    /// claim nor its key agreement waits for the peer.
    pub(crate) fn settle_if_done(&mut self, flow: &VirtualFlow) {
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        if c.claim_retry.is_some() || c.keyx.is_some() {
            return;
        }
        if let Some(s) = c.settling.take() {
            self.emit(Event::SuspendSettled {
                flow: *flow,
                answered: !s.unanswered,
            });
        }
    }

    pub(crate) fn role_and_key_timeouts(&mut self, ctx: &mut Ctx) {
        let now = ctx.now;
        let max = self.cfg.max_tries;
        let due: Vec<VirtualFlow> = self
            .conn_timers
            .due(now)
            .into_iter()
            .filter(|f| {
                self.conns.get(f).is_some_and(|c| {
                    c.claim_retry.is_some_and(|(_, d)| d <= now)
                        || c.keyx.as_ref().is_some_and(|k| k.deadline <= now)
                })
            })
            .collect();
        for f in due {
            let Some(dst) = self.conns.get(&f).map(|c| self.vcmp_addr(c)) else {
                continue;
            };
            let Some(c) = self.conns.get_mut(&f) else {
                continue;
            };
            let mut resend_claim = false;
            if let Some((tries, d)) = c.claim_retry {
                if d <= now {
                    if tries >= max {
                        // Unanswered: we keep the primary role we claimed.
                        c.claim_retry = None;
                        c.role.claim_pending = false;
                        if let Some(s) = c.settling.as_mut() {
                            s.unanswered = true;
                        }
                        self.stats.count(Counter::ClaimUnanswered);
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
                        if let Some(s) = c.settling.as_mut() {
                            s.unanswered = true;
                        }
                        self.stats.count(Counter::KeyxUnanswered);
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
                self.stats.count(Counter::Retransmit);
            }
            if let Some((tries, p)) = resend_key {
                let d = now.plus(self.rto(ctx, tries));
                if let Some(k) = self.conns.get_mut(&f).and_then(|c| c.keyx.as_mut()) {
                    k.tries += 1;
                    k.deadline = d;
                }
                self.send_record(ctx, &f, Kind::KeyX, Ext::Key(p), dst);
                self.stats.count(Counter::Retransmit);
            }
            self.rearm(&f);
            self.settle_if_done(&f);
        }
    }

    pub(crate) fn on_susp_primary(
        &mut self,
        from: SocketAddr,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
    ) -> Result<(), Reject> {
        let c = self.conns.get_mut(flow).ok_or(Reject::UnknownConnection)?;
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
                self.settle_if_done(flow);
            }
        }
        Ok(())
    }

    pub(crate) fn on_susp_secondary(&mut self, flow: &VirtualFlow) -> Result<(), Reject> {
        let c = self.conns.get_mut(flow).ok_or(Reject::UnknownConnection)?;
        if !c.role.claimed {
            return Err(Reject::UnsolicitedSuspSecondary);
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
        self.settle_if_done(flow);
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
    ) -> Result<(), Reject> {
        let Ext::Key(peer_eph) = rec.ext else {
            return Err(Reject::BadExtension);
        };
        let c = self.conns.get_mut(flow).ok_or(Reject::UnknownConnection)?;
        if under_prev
            && c.send_prev
            && rec.seq > c.keyx_answer_seq
            && c.keyx_answer().is_some_and(|(seen, _)| seen != peer_eph)
        {
            // A KEYX sent after the one we answered (not a late copy of an
            // older one), under the keys before our unconfirmed ratchet:
            // the peer never got our answer (it gave up), so that ratchet
            // never happened for it. Undo it and take this one as the
            // first.
            c.keys = c.prev_keys.take().map(|b| *b);
            c.send_prev = false;
            c.keyx_answer = None;
            self.stats.count(Counter::KeyxRolledBack);
            return self.on_keyx(ctx, from, flow, rec, false);
        }
        if under_prev && c.keyx_answer.is_none() {
            // We started the last exchange and ratcheted on the answer; the
            // peer started this one before it saw us use the new keys, so
            // it signed with the old ones, and ratchets from the new ones
            // (its current) when our answer comes: so do we.
            return self.on_keyx(ctx, from, flow, rec, false);
        }
        if under_prev {
            let (Some((seen, mine)), Some(prev)) = (c.keyx_answer(), &c.prev_keys) else {
                return Err(Reject::BadMac);
            };
            if seen != peer_eph {
                return Err(Reject::BadMac);
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
            self.push_signed(&answer, &key, Kind::KeyX, 0, from, None);
            return Ok(());
        }
        let keys = c.keys.as_ref().ok_or(Reject::NoKeys)?;
        let binding = c.binding;
        if let Some(mine) = c.keyx.take() {
            // We started (or both started): finish with our value, no reply.
            let Ok(dh) = mine.eph.dh(&peer_eph) else {
                c.keyx = Some(mine);
                return Err(Reject::LowOrderPoint);
            };
            let new = keys.ratchet(&dh, &mine.eph.public(), &peer_eph, flow, &binding);
            c.prev_keys = c.keys.replace(new).map(Box::new);
            c.keyx_answer = None;
            // The peer answered, so it has the new keys.
            c.send_prev = false;
        } else {
            let eph = Ephemeral::generate(&mut CryptoDyn(&mut ctx.rng));
            let dh = eph.dh(&peer_eph).map_err(|_| Reject::LowOrderPoint)?;
            let new = keys.ratchet(&dh, &eph.public(), &peer_eph, flow, &binding);
            let mine = eph.public();
            // Answer under the old keys: the peer has not ratcheted yet.
            self.send_record(ctx, flow, Kind::KeyX, Ext::Key(mine), from);
            let c = self.conns.get_mut(flow).ok_or(Reject::UnknownConnection)?;
            c.prev_keys = c.keys.replace(new).map(Box::new);
            c.keyx_answer = Some(Box::new((peer_eph, mine)));
            c.keyx_answer_seq = rec.seq;
            c.send_prev = true;
        }
        self.stats.count(Counter::Rekeyed);
        self.emit(Event::Rekeyed { flow: *flow });
        self.settle_if_done(flow);
        Ok(())
    }
}
