//! The update (paper section 3.3.2.3, Figures 3-6 and 3-7) and the path
//! validation that must succeed before traffic moves to a new address.

use crate::stats::{Counter, Reject};
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};

use super::endpoint::{Ctx, Endpoint, Event};
use super::validation::{Group, Join, Validation, ValidationKey};
use super::wire::{Ext, Kind, Record};
use crate::flow::{Proto, VirtualFlow};

/// What may be sent to an address before it is validated, as a multiple
/// of what came from it (RFC 9000 section 8).
const AMPLIFICATION_FACTOR: usize = 3;

/// Least time a peer's named address is waited for once the address its
/// update came from answered (see `on_response`): the named one may be
/// answering on a path a few milliseconds longer.
const NAMED_GRACE_MIN: std::time::Duration = std::time::Duration::from_millis(10);

impl Endpoint {
    /// UPD (paper 3.3.2.3 (1)): the peer's end is now at `rec.sender_phys`.
    pub(crate) fn on_upd(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        flow: &VirtualFlow,
        rec: &Record,
    ) -> Result<(), Reject> {
        // A peer that moved into the other IP family (`vcmp::family`):
        // our end continues in that family too, at the address its update
        // arrived at. Taken before our UPD_R, which names our end there.
        let across = self.local_for_update(ctx, flow, rec.sender_phys)?;
        self.check_fresh(flow, rec.seq)?;
        if let Some(local) = across {
            if let Some(c) = self.conns.get_mut(flow) {
                tracing::debug!(id = flow.id(), %flow, from = %c.local_phys, to = %local, "the peer moved into the other IP family: our end follows");
                c.local_alt = Some(c.local_phys);
                c.local_phys = local;
                c.follows_peer = local.is_ipv4() != flow.local.is_ipv4();
                self.stats.count(Counter::FamilyChanged);
            }
        }
        // UPD_R leaves before the CHALLENGE of the peer's new address
        // (datagrams go out in the order they were started). When both ends
        // moved, UPD_R is how the peer learns our new address, and its
        // vnatd makes its receive side ready for it before answering
        // anything else; the peer's RESPONSE is what switches our send side
        // to it. In the other order a quick RESPONSE could let us send from
        // our new address to a peer not yet ready for it, whose kernel
        // would reset the connection.
        self.send_record(ctx, flow, Kind::UpdR, Ext::None, from);
        // A mover behind a NAT names its private address; its update comes
        // from the NAT's public one, and the port the NAT gave the
        // connection is unknown until the connection's own packets cross
        // it (port 0: the datapath learns it, see `RebindValue`). Its vnatd
        // is reached at the update's source. Taken for a NAT only when the
        // peer already was behind one (it names its end otherwise than we
        // do): a peer that merely claims another address than it sends
        // from is validated there, as before.
        let was_behind_nat = self
            .conns
            .get(flow)
            .and_then(|c| c.peer_named())
            .is_some_and(|n| n.remote != flow.remote);
        // No NAT is looked for in the other family (`vcmp::family`): a
        // connection carried over IPv6 is between the two hosts' own
        // addresses, and an update naming another address than it came
        // from there is a host with several (its kernel chose another
        // source while its addresses changed), not a NAT. (A rebind with a
        // port to learn is for the connection's own family only.)
        let other_family = rec.sender_phys.is_ipv4() != flow.local.is_ipv4();
        let was_behind_nat = was_behind_nat && !other_family;
        let (addr, vcmp) = if rec.sender_phys.ip() == from.ip() || !was_behind_nat {
            (
                rec.sender_phys,
                SocketAddr::new(rec.sender_phys.ip(), self.cfg.port),
            )
        } else {
            self.stats.count(Counter::PeerBehindNat);
            (SocketAddr::new(from.ip(), 0), from)
        };
        self.propose_binding_via(ctx, flow, addr, rec.seq, vcmp);
        if rec.sender_phys.ip() == from.ip() {
            self.send_unvalidated(ctx, flow, addr);
        }
        // A peer that was not behind a NAT names an address it does not
        // send from: it entered a NAT (a routed network left for home), or
        // it sends its VCMP from another interface than the connection's.
        // The named address is validated first; the one the update came
        // from is validated beside it, and taken only if the named one
        // stays silent (`nat_fallback`).
        if rec.sender_phys.ip() != from.ip() && !was_behind_nat && !other_family {
            self.propose_nat_candidate(ctx, flow, from);
        }
        // If we were looking for the peer, it found us (P(1)/S(1) parked).
        self.complete(ctx, flow);
        Ok(())
    }

    /// UPD_R (paper 3.3.2.3 (2)): the peer accepted our update and tells us
    /// where its end is.
    pub(crate) fn on_upd_r(
        &mut self,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
        rec: &Record,
    ) -> Result<(), Reject> {
        self.check_fresh(flow, rec.seq)?;
        // The peer names its end its own way: behind a port-forwarding NAT
        // by its private address, which we cannot reach. An end at its own
        // virtual address has not moved, and is where we know it (our name
        // for its virtual end), whatever it calls that.
        let addr = if rec.sender_phys == rec.sender_vir {
            flow.remote
        } else {
            rec.sender_phys
        };
        self.propose_binding(ctx, flow, addr, rec.seq);
        self.complete(ctx, flow);
        Ok(())
    }

    /// Only an update with a higher sequence number than the last applied
    /// one may move the binding; an older one changes nothing.
    fn check_fresh(&mut self, flow: &VirtualFlow, seq: u64) -> Result<(), Reject> {
        let c = self.conns.get_mut(flow).ok_or(Reject::UnknownConnection)?;
        if seq <= c.binding_seq {
            return Err(Reject::StaleUpdate);
        }
        c.binding_seq = seq;
        Ok(())
    }

    /// The peer claims its end is at `addr`. Switch at once if the peer
    /// already proved it receives at that address; otherwise validate it
    /// first (the data path keeps the last validated address meanwhile).
    pub(crate) fn propose_binding(
        &mut self,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
        addr: SocketAddr,
        seq: u64,
    ) {
        let vcmp = SocketAddr::new(addr.ip(), self.cfg.port);
        self.propose_binding_via(ctx, flow, addr, seq, vcmp)
    }

    /// [`Endpoint::propose_binding`], challenging the peer's vnatd at
    /// `vcmp`.
    pub(crate) fn propose_binding_via(
        &mut self,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
        addr: SocketAddr,
        seq: u64,
        vcmp: SocketAddr,
    ) {
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        // Whatever we sent to an address still being validated stops
        // here: the next placement is another (or that one validated).
        let was_unvalidated = std::mem::take(&mut c.sending_unvalidated);
        if addr == c.remote_phys {
            c.pending_remote = None;
            if was_unvalidated {
                // Back where it was validated: send there again.
                self.emit(Event::SetRemote {
                    flow: *flow,
                    remote: addr,
                });
            }
            return;
        }
        if c.validated.contains(&addr.ip()) {
            c.pending_remote = None;
            c.set_remote(addr);
            self.emit(Event::SetRemote {
                flow: *flow,
                remote: addr,
            });
            self.ask_rebind(ctx.now, flow);
            return;
        }
        c.pending_remote = Some((addr, seq));
        let local = c.local_phys;
        let group = c.peer_key.map_or(Group::Conn(*flow), Group::Host);
        let key = (addr.ip(), group);
        self.emit(Event::PrepareReceive {
            flow: *flow,
            local,
            remote: addr,
        });
        self.challenge(ctx, flow, key, vcmp);
    }

    /// The peer's update for `flow` named `addr` and came from there: send
    /// there at once, before its validation completes (RFC 9000 section
    /// 9.3), within three times what that address sent, which the
    /// datapath enforces per packet (`Event::SendUnvalidated`), starting
    /// with this record's share of the update's datagram. The mover then
    /// switches its own send side at our SWITCHED, one round trip after
    /// its update, not two. Not behind a NAT (port 0: the port is learnt
    /// first), and not to an address that already answered (switched
    /// outright).
    ///
    /// After our own end moved, only once the peer has shown it knows our
    /// new address (`Conn::local_unproven`), or for an update sent there
    /// (`Ctx::rx_to`, known when the caller gives the datagram's
    /// destination): its sender knew where we went, and its vnatd made its
    /// receive side ready for that address before the update left, so our
    /// packets from there meet a translation, not a reset. An update that
    /// reached us elsewhere (our old address, still up during a planned
    /// move or routed to us) may come from a peer that does not know our
    /// new address yet: the send side follows its validation then. That
    /// holds after our move is over too: the peer's first update, arriving
    /// at our old address, ends our move (it found us), and copies of it
    /// that it sent there before may follow in the same burst.
    fn send_unvalidated(&mut self, ctx: &Ctx, flow: &VirtualFlow, addr: SocketAddr) {
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        if c.pending_remote.map(|(a, _)| a) != Some(addr) || addr.port() == 0 {
            return;
        }
        if c.local_unproven && ctx.rx_to != Some(c.local_phys.ip()) {
            return;
        }
        // Not while the connection crosses into the other IP family
        // (`vcmp::family`): our end followed the peer's there, and the
        // last validated address is of the family we left, so nothing
        // could take over what the budget refuses. The send side waits for
        // the validation.
        if c.local_phys.is_ipv4() != c.remote_phys.is_ipv4() {
            return;
        }
        c.sending_unvalidated = true;
        let allowed = ctx.rx_share.saturating_mul(AMPLIFICATION_FACTOR);
        self.stats.count(Counter::SentUnvalidated);
        self.emit(Event::SendUnvalidated {
            flow: *flow,
            remote: addr,
            allowed: u32::try_from(allowed).unwrap_or(u32::MAX),
        });
    }

    /// Validate `key`'s address for `flow`: join the validation of it under
    /// way, or start one with a CHALLENGE to the peer's VCMP at `dst`.
    fn challenge(
        &mut self,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
        key: ValidationKey,
        dst: SocketAddr,
    ) {
        let rto = self.rto(ctx, 0);
        match self.validations.join(&key, *flow) {
            Join::None => {}
            Join::Added => return,
            Join::Again => {
                // The peer sent its update again: our answers to it, the
                // CHALLENGE with them, may have been lost, and the peer is
                // evidently there now. Waiting for the validation's own
                // next try (up to `max_rto` away, or never, if that try
                // was its last) would let a loss that is over fail the
                // validation, and leave the peer, which then hears our
                // UPD_R, sending from an address we reverted. At most once
                // a quarter of the initial RTO: the records of a retry for
                // every connection of a host, packed in a few datagrams,
                // bring one CHALLENGE for the host's validation.
                let gap = self.cfg.initial_rto / 4;
                if let Some((anchor, nonce, dst)) =
                    self.validations
                        .again(&key, ctx.now, gap, rto.saturating_mul(2))
                {
                    self.stats.count(Counter::Retransmit);
                    self.send_record(ctx, &anchor, Kind::Challenge, Ext::Nonce(nonce), dst);
                }
                return;
            }
        }
        let nonce = ctx.nonce::<16>();
        self.validations.start(
            key,
            Validation {
                anchor: *flow,
                dst,
                nonce,
                flows: HashSet::from([*flow]),
                tries: 1,
                deadline: ctx.now.plus(rto),
                sent: ctx.now,
            },
        );
        self.send_record(ctx, flow, Kind::Challenge, Ext::Nonce(nonce), dst);
    }

    /// See [`Endpoint::on_upd`]: validate `from`, the address an update
    /// came from, for `flow` whose named address waits for validation.
    fn propose_nat_candidate(&mut self, ctx: &mut Ctx, flow: &VirtualFlow, from: SocketAddr) {
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        // The named address was validated before (taken already), or the
        // update comes from where the connection is now: its peer stays
        // there for VCMP and names where the connection goes (`migrate`
        // over another interface), no NAT.
        if c.pending_remote.is_none() || from.ip() == c.remote_phys.ip() {
            c.nat_candidate = None;
            return;
        }
        c.nat_candidate = Some(from);
        if flow.proto == Proto::Udp {
            // The mover's UDP datagrams follow our UPD_R at once (UDP is
            // never held): through a NAT it entered they come from the
            // source's address and a port nobody knows yet, and would
            // reach our application as a new peer's (a listener that
            // serves each peer on a socket of its own opens one, and the
            // flow cannot move onto its endpoints later). Make the
            // datapath drop them until the named address answers or the
            // BIND tells the port (port 0: a UDP rebind drops, it does not
            // steer; the send side still waits for validation).
            let local = c.local_phys;
            self.emit(Event::PrepareReceive {
                flow: *flow,
                local,
                remote: SocketAddr::new(from.ip(), 0),
            });
        }
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        if c.validated.contains(&from.ip()) {
            return;
        }
        let group = c.peer_key.map_or(Group::Conn(*flow), Group::Host);
        self.challenge(ctx, flow, (from.ip(), group), from);
    }

    /// A validation of the named address of `flow` is due (unanswered for
    /// a retransmission timeout): if the address its update came from
    /// answered meanwhile, the peer is behind a NAT there. Take it, with
    /// the port the connection's BIND will tell (port 0, `ask_rebind`), and
    /// reach the peer's vnatd where it answered. True if taken.
    fn nat_fallback(&mut self, now: super::Timestamp, flow: &VirtualFlow, named: IpAddr) -> bool {
        let Some(c) = self.conns.get_mut(flow) else {
            return false;
        };
        let (Some((addr, _)), Some(nat)) = (c.pending_remote, c.nat_candidate) else {
            return false;
        };
        if addr.ip() != named || !c.validated.contains(&nat.ip()) {
            return false;
        }
        let remote = SocketAddr::new(nat.ip(), 0);
        c.pending_remote = None;
        c.nat_candidate = None;
        c.sending_unvalidated = false;
        c.set_remote(remote);
        if let Some(k) = c.peer_key {
            if self.sessions.contains_key(&k) {
                self.peer_addrs.insert(k, nat);
            }
        }
        self.stats.count(Counter::PeerBehindNat);
        self.emit(Event::SetRemote {
            flow: *flow,
            remote,
        });
        self.ask_rebind(now, flow);
        true
    }

    pub(crate) fn on_challenge(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        flow: &VirtualFlow,
        rec: &Record,
    ) -> Result<(), Reject> {
        let Ext::Nonce(n) = rec.ext else {
            return Err(Reject::BadExtension);
        };
        self.send_record(ctx, flow, Kind::Response, Ext::Nonce(n), from);
        Ok(())
    }

    pub(crate) fn on_response(
        &mut self,
        now: super::Timestamp,
        flow: &VirtualFlow,
        rec: &Record,
    ) -> Result<(), Reject> {
        let Ext::Nonce(n) = rec.ext else {
            return Err(Reject::BadExtension);
        };
        let (key, v) = self
            .validations
            .answered(flow, &n)
            .ok_or(Reject::UnexpectedResponse)?;
        let ip = key.0;
        // The round trip of this validation's last CHALLENGE.
        let rtt = now.since(v.sent);
        self.tx.trusted.insert(ip);
        self.stats.count(Counter::PathValidated);
        // The peer's vnatd answered there: that is where it is reached now
        // (behind a NAT, the NAT's mapping).
        if let Group::Host(k) = key.1 {
            if self.sessions.contains_key(&k) {
                self.peer_addrs.insert(k, v.dst);
            }
        }
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
                    c.nat_candidate = None;
                    c.sending_unvalidated = false;
                    c.set_remote(addr);
                    self.emit(Event::SetRemote {
                        flow: f,
                        remote: addr,
                    });
                    self.ask_rebind(now, &f);
                } else if c.nat_candidate.is_some_and(|n| n.ip() == ip) {
                    // The address the update came from answered; the one
                    // it named has not yet. A peer reachable there would
                    // have answered about as fast (the two CHALLENGEs left
                    // together): give it a little more than this round
                    // trip, not the whole retransmission timeout, then
                    // take the NAT's (`nat_fallback`).
                    let grace = rtt.saturating_mul(2).max(NAMED_GRACE_MIN);
                    self.validations
                        .due_by(&(addr.ip(), key.1), now.plus(grace));
                }
            }
        }
        Ok(())
    }

    pub(crate) fn validation_timeouts(&mut self, ctx: &mut Ctx) {
        let now = ctx.now;
        for (key, mut v) in self.validations.take_due(now) {
            v.flows.retain(|f| self.conns.contains_key(f));
            let fell_back: Vec<VirtualFlow> = v
                .flows
                .iter()
                .copied()
                .filter(|f| self.nat_fallback(now, f, key.0))
                .collect();
            for f in &fell_back {
                v.flows.remove(f);
            }
            if v.flows.is_empty() {
                continue;
            }
            if v.tries >= self.cfg.max_tries {
                self.stats.count(Counter::ValidationFailed);
                for f in v.flows {
                    let Some(c) = self.conns.get_mut(&f) else {
                        continue;
                    };
                    if let Some((addr, _)) = c.pending_remote {
                        if addr.ip() == key.0 {
                            c.pending_remote = None;
                            c.nat_candidate = None;
                            c.sending_unvalidated = false;
                            // Our end had followed the peer into the other
                            // family: back with it.
                            c.align_local();
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
            v.sent = now;
            v.tries += 1;
            let (anchor, nonce, dst) = (v.anchor, v.nonce, v.dst);
            self.validations.start(key, v);
            self.stats.count(Counter::Retransmit);
            self.send_record(ctx, &anchor, Kind::Challenge, Ext::Nonce(nonce), dst);
        }
    }
}
