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
use std::collections::{BTreeSet, HashMap, HashSet};
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
/// (peer group, our address), with the groups' deadlines in order.
#[derive(Default)]
pub(crate) struct Awaiting {
    groups: HashMap<AwaitKey, AwaitingGroup>,
    order: BTreeSet<(Timestamp, AwaitKey)>,
}

type AwaitKey = (Group, IpAddr);

struct AwaitingGroup {
    deadline: Timestamp,
    /// In the order they joined; `members` tells at once whether one did
    /// (a search of the list for each of 100,000 connections moving
    /// together was half of the protocol core's time).
    flows: Vec<VirtualFlow>,
    members: HashSet<VirtualFlow>,
}

impl Awaiting {
    /// Gives back room a burst left (`crate::room`).
    pub fn shrink_sparse(&mut self) {
        use crate::room::Shrink;
        self.groups.shrink_sparse();
    }

    /// `flow` waits with its group, which waits until `deadline` if it is
    /// new.
    fn add(&mut self, key: AwaitKey, flow: VirtualFlow, deadline: Timestamp) {
        let g = self.groups.entry(key).or_insert_with(|| {
            self.order.insert((deadline, key));
            AwaitingGroup {
                deadline,
                flows: Vec::new(),
                members: HashSet::new(),
            }
        });
        if g.members.insert(flow) {
            g.flows.push(flow);
        }
    }

    /// The connections of group `key`, which waits no more.
    fn take(&mut self, key: &AwaitKey) -> Option<Vec<VirtualFlow>> {
        let g = self.groups.remove(key)?;
        self.order.remove(&(g.deadline, *key));
        Some(g.flows)
    }

    /// The connections of every group whose deadline is at or before
    /// `now`, a list per group.
    fn take_due(&mut self, now: Timestamp) -> Vec<Vec<VirtualFlow>> {
        let due: Vec<AwaitKey> = self
            .order
            .iter()
            .take_while(|(t, _)| *t <= now)
            .map(|(_, k)| *k)
            .collect();
        due.iter().filter_map(|k| self.take(k)).collect()
    }

    fn next_deadline(&self) -> Option<Timestamp> {
        self.order.first().map(|(t, _)| *t)
    }
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
        self.awaiting
            .add((group, c.local_phys.ip()), *flow, ctx.now.plus(wait));
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
        if let Some(flows) = self.awaiting.take(&(group, ip)) {
            self.stats.count(Counter::SwitchConfirmed);
            self.release_awaiting(flows, true);
        }
        Ok(())
    }

    /// Connections whose peer never confirmed: go ahead.
    pub(crate) fn switch_timeouts(&mut self, now: Timestamp) {
        for flows in self.awaiting.take_due(now) {
            self.stats.count(Counter::SwitchUnconfirmed);
            self.release_awaiting(flows, false);
        }
    }

    fn release_awaiting(&mut self, flows: Vec<VirtualFlow>, confirmed: bool) {
        let now = self.binds.clock;
        for flow in flows {
            if self.conns.contains_key(&flow) {
                // Before the release: a peer that moved us behind a NAT
                // takes the connection's segments only after its BIND.
                self.resend_tcp_bind(now, &flow);
                self.emit(Event::PeerSwitched { flow, confirmed });
            }
        }
    }

    /// The earliest deadline of a connection waiting for SWITCHED.
    pub(crate) fn switch_deadline(&self) -> Option<Timestamp> {
        self.awaiting.next_deadline()
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
            anchors.entry((group, sending_to(c).ip())).or_insert(*flow);
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

/// Where our datapath sends `c` now: the address still being validated
/// while it sends there under the budget, else the last validated one.
fn sending_to(c: &super::endpoint::Conn) -> SocketAddr {
    match c.pending_remote {
        Some((a, _)) if c.sending_unvalidated => a,
        _ => c.remote_phys,
    }
}
