//! SWITCHED (beyond the paper): when the mover may restart its TCP.
//!
//! A peer takes packets from the mover's new address as soon as an
//! authenticated UPD announced it (its receive side), but it only *sends*
//! there once the address passed the reachability challenge, half a round
//! trip after the UPD_R that completes the mover's move. A retransmission
//! that the mover's restart levers trigger at its UPD_R therefore reaches a
//! peer that still answers at the old address: the ACK is lost, and if the
//! segment acknowledges some of the peer's own backed-off data, the peer's
//! TCP retransmits the rest at once, to the old address too, and then waits
//! a full (freshly computed, often seconds-long) retransmission timeout.
//! Measured: 3.5-3.7 s stalls in half the moves at 30 ms RTT after a 10 s
//! outage.
//!
//! So the order is made explicit. The peer's driver, right after its
//! datapath sends to the mover's new address, calls
//! [`Endpoint::confirm_switched`], which queues one SWITCHED record per
//! (peer host, address) group, and the mover holds each `Resumed` TCP
//! connection until a SWITCHED for its group arrives
//! ([`Event::PeerSwitched`] with `confirmed`), or, if none comes (an older
//! peer, a lost datagram), until [`SWITCH_WAIT_TRIES`] retransmission
//! timeouts have passed. UDP does not wait: it has no timer a datagram
//! could upset, and one that reaches the peer early is simply delivered.
//!
//! One record stands for the group, because the peer switches a group
//! together: the connections it validated with one CHALLENGE switch at the
//! RESPONSE, and any whose UPD comes later switch before their UPD_R leaves.
//! So every connection of the group that completed its move (saw its UPD_R)
//! before the SWITCHED arrived has switched at the peer. A SWITCHED changes
//! no binding: a forged one fails the MAC, a replayed one the replay window,
//! and an unexpected one only releases nothing.

use crate::stats::{Counter, Reject};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use rand_core::{CryptoRng, RngCore};

use super::endpoint::{Ctx, Endpoint, Event};
use super::validation::Group;
use super::wire::{Ext, Kind};
use super::Timestamp;
use crate::flow::VirtualFlow;

/// How long a moved connection waits for the peer's SWITCHED, in
/// retransmission timeouts (`rto(1)`, 400 ms by default): longer than a
/// validation takes on any path the protocol's timers are made for, short
/// enough that a lost SWITCHED costs less than TCP's own next backoff step.
pub(crate) const SWITCH_WAIT_TRIES: u32 = 1;

/// Moved connections whose restart waits for the peer's SWITCHED, by
/// (peer group, our address).
pub(crate) type Awaiting = HashMap<(Group, IpAddr), AwaitingGroup>;

pub(crate) struct AwaitingGroup {
    pub deadline: Timestamp,
    pub flows: Vec<VirtualFlow>,
}

impl Endpoint {
    fn group_of(&self, flow: &VirtualFlow) -> Option<Group> {
        let c = self.conns.get(flow)?;
        Some(c.peer_key.map_or(Group::Conn(*flow), Group::Host))
    }

    /// Our move of `flow` completed (`Resumed` was emitted): hold its
    /// restart until the peer says it switched.
    pub(crate) fn await_switch(&mut self, ctx: &Ctx, flow: &VirtualFlow) {
        let wait = self.rto(ctx, SWITCH_WAIT_TRIES);
        let (Some(group), Some(c)) = (self.group_of(flow), self.conns.get(flow)) else {
            return;
        };
        let entry = self
            .awaiting
            .entry((group, c.local_phys.ip()))
            .or_insert_with(|| AwaitingGroup {
                deadline: ctx.now.plus(wait),
                flows: Vec::new(),
            });
        if !entry.flows.contains(flow) {
            entry.flows.push(*flow);
        }
    }

    /// SWITCHED from the peer of `flow` (authenticated, fresh): release
    /// every connection of its group waiting at our address.
    pub(crate) fn on_switched(&mut self, flow: &VirtualFlow) -> Result<(), Reject> {
        let group = self.group_of(flow).ok_or(Reject::UnknownConnection)?;
        let ip = self
            .conns
            .get(flow)
            .ok_or(Reject::UnknownConnection)?
            .local_phys
            .ip();
        if let Some(g) = self.awaiting.remove(&(group, ip)) {
            self.stats.count(Counter::SwitchConfirmed);
            self.release_awaiting(g.flows, true);
        }
        Ok(())
    }

    /// Connections whose peer never confirmed: go ahead.
    pub(crate) fn switch_timeouts(&mut self, now: Timestamp) {
        let due: Vec<AwaitingGroup> = self
            .awaiting
            .extract_if(|_, g| g.deadline <= now)
            .map(|(_, g)| g)
            .collect();
        for g in due {
            self.stats.count(Counter::SwitchUnconfirmed);
            self.release_awaiting(g.flows, false);
        }
    }

    fn release_awaiting(&mut self, flows: Vec<VirtualFlow>, confirmed: bool) {
        for flow in flows {
            if self.conns.contains_key(&flow) {
                self.emit(Event::PeerSwitched { flow, confirmed });
            }
        }
    }

    /// The earliest deadline of a connection waiting for SWITCHED.
    pub(crate) fn switch_deadline(&self) -> Option<Timestamp> {
        self.awaiting.values().map(|g| g.deadline).min()
    }

    /// The driver's datapath now sends `flows` to their peers' current
    /// (new) addresses: tell each peer, one SWITCHED per (peer group,
    /// address), to that address.
    pub fn confirm_switched<R: RngCore + CryptoRng>(
        &mut self,
        now: Timestamp,
        rng: &mut R,
        flows: &[VirtualFlow],
    ) {
        let mut ctx = Ctx::new(now, rng);
        let port = self.cfg.port;
        let mut anchors: HashMap<(Group, IpAddr), VirtualFlow> = HashMap::new();
        for flow in flows {
            let (Some(group), Some(c)) = (self.group_of(flow), self.conns.get(flow)) else {
                continue;
            };
            if c.keys.is_none() {
                continue;
            }
            anchors.entry((group, c.remote_phys.ip())).or_insert(*flow);
        }
        for ((_, ip), anchor) in anchors {
            // Behind a NAT the peer's vnatd is at the NAT's mapping.
            let dst = self
                .conns
                .get(&anchor)
                .map(|c| self.vcmp_addr(c))
                .filter(|a| a.ip() == ip)
                .unwrap_or(SocketAddr::new(ip, port));
            if self.send_record(&mut ctx, &anchor, Kind::Switched, Ext::None, dst) {
                self.stats.count(Counter::SwitchedSent);
            }
        }
        self.tx.flush(&mut self.stats);
    }
}
