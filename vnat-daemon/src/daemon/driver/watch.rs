//! The driver's part in `vnatctl monitor` and `--wait`: it tells the move
//! journal (`super::super::journal`) where moves start and end, and
//! publishes the events it returns on the control API's event hub, which
//! never waits for a subscriber (`control::events`).

use std::time::{Instant, SystemTime};

use vnat_control::monitor::{unix_ms, EndOutcome, EventKind, MonitorEvent, Side};

use super::*;
use crate::daemon::journal::PeerOf;
use crate::daemon::mover::Step;

/// A move end that waits for its translation to be installed.
pub(super) type PendingEnd = (VirtualFlow, Side);

impl Driver {
    fn peer_of(&self, flow: &VirtualFlow) -> PeerOf {
        let v = self.endpoint.connection(flow);
        PeerOf {
            key: v
                .as_ref()
                .and_then(|v| v.peer_key)
                .map(|k| identity::key_hex(&k)),
            address: v.map(|v| v.remote_phys.ip()),
        }
    }

    pub(super) fn publish(&self, ev: MonitorEvent) {
        tracing::trace!(event = ev.event.as_str(), id = ?ev.id, "monitor event");
        self.events.publish(ev);
    }

    /// A move of `flow`'s `side` started from `from` to `to`.
    pub(super) fn move_started(
        &mut self,
        flow: VirtualFlow,
        side: Side,
        from: SocketAddr,
        to: SocketAddr,
    ) {
        let peer = self.peer_of(&flow);
        let ev = self.journal.started(
            flow,
            side,
            from,
            to,
            peer,
            Instant::now(),
            SystemTime::now(),
        );
        self.publish(ev);
    }

    /// A move of `flow`'s `side` ended (`Err`: why it failed).
    pub(super) fn move_ended(&mut self, flow: &VirtualFlow, side: Side, r: Result<(), String>) {
        if let Some(ev) = self
            .journal
            .ended(flow, side, r, Instant::now(), SystemTime::now())
        {
            self.publish(ev);
        }
    }

    /// These connections closed: their moves under way failed.
    pub(super) fn moves_closed(&mut self, flows: &[VirtualFlow]) {
        for f in flows {
            for ev in self.journal.closed(f, Instant::now(), SystemTime::now()) {
                self.publish(ev);
            }
        }
    }

    /// The peers' moves that `events` start: a `PrepareReceive` for an
    /// address the peer announced (again, if our own end moves meanwhile:
    /// then it is the same move).
    pub(super) fn peer_moves_started(&mut self, events: &[Event]) {
        for ev in events {
            let Event::PrepareReceive { flow, remote, .. } = ev else {
                continue;
            };
            if self.journal.is_under_way(flow, Side::Peer) {
                continue;
            }
            let from = self
                .endpoint
                .connection(flow)
                .map_or(flow.remote, |v| v.remote_phys);
            self.move_started(*flow, Side::Peer, from, *remote);
        }
    }

    /// What the mover's `step` for `ev` means for the journal: failures end
    /// their move now; successes once their translation is installed (the
    /// returned ends, for [`Driver::switches_done`]).
    pub(super) fn journal_step(
        &mut self,
        ev: &Event,
        step: &Step,
        view: Option<&vcmp::ConnectionView>,
    ) -> Vec<PendingEnd> {
        match (ev, step) {
            (
                Event::Reverted {
                    flow, attempted, ..
                },
                _,
            ) => {
                let why = format!(
                    "the peer's new address {attempted} did not answer its validation; the connection stays at its last validated address"
                );
                self.move_ended(flow, Side::Peer, Err(why));
                Vec::new()
            }
            (Event::MigrationAborted { flow, reason }, _) => {
                self.move_ended(flow, Side::Local, Err(reason.to_string()));
                Vec::new()
            }
            _ => switch_ends(ev, step, view),
        }
    }

    /// The translations installed this turn (`done`) complete the moves
    /// in `pending`; one whose translation failed failed.
    pub(super) fn switches_done(&mut self, pending: Vec<PendingEnd>, done: &[Switch]) {
        let switched: HashSet<VirtualFlow> = done.iter().map(|s| s.flow).collect();
        for (flow, side) in pending {
            let r = if switched.contains(&flow) {
                Ok(())
            } else {
                Err("vnatd could not install its new translation (see its log)".to_string())
            };
            self.move_ended(&flow, side, r);
        }
    }

    /// A planned suspension was settled with the peer, or given up.
    pub(super) fn suspend_ended(&mut self, flow: &VirtualFlow, answered: bool) {
        let peer = self.peer_of(flow);
        let mut ev = MonitorEvent {
            id: Some(flow.id()),
            proto: Some(flow.proto),
            peer: peer.key,
            peer_address: peer.address,
            ..MonitorEvent::new(EventKind::SuspendEnded, unix_ms(SystemTime::now()))
        };
        if answered {
            ev.outcome = Some(EndOutcome::Settled);
        } else {
            ev.outcome = Some(EndOutcome::Failed);
            ev.reason = Some(
                "the peer's vnatd did not answer: roles and fresh keys were not agreed (the connection can still move)"
                    .into(),
            );
        }
        self.publish(ev);
    }

    /// Pairing with the host `key` at `peer` completed.
    pub(super) fn paired(&mut self, peer: IpAddr, key: &[u8; 32]) {
        self.publish(MonitorEvent {
            peer: Some(identity::key_hex(key)),
            peer_address: Some(peer),
            ..MonitorEvent::new(EventKind::Paired, unix_ms(SystemTime::now()))
        });
    }
}

/// The moves a switch completes once its translation is installed: the
/// side whose event it answers, and the other side too when the switch
/// carries it. Both ends moved and our own move was acknowledged first
/// (`Resumed`, which waits for the peer's address): the switch that
/// follows the peer's validation (`SetRemote`) or its unvalidated sending
/// (`SendUnvalidated`) installs our new address as well, and no other
/// event will end our move (`migrate --wait` would wait in vain).
fn switch_ends(ev: &Event, step: &Step, view: Option<&vcmp::ConnectionView>) -> Vec<PendingEnd> {
    let Step::Switch(s) = step else {
        return Vec::new();
    };
    let ours_done = |v: &vcmp::ConnectionView| !v.migrating && s.local == v.local_phys;
    match ev {
        Event::SetRemote { flow, .. } => {
            let mut ends = vec![(*flow, Side::Peer)];
            if view.is_some_and(ours_done) {
                ends.push((*flow, Side::Local));
            }
            ends
        }
        Event::SendUnvalidated { flow, .. } if view.is_some_and(ours_done) => {
            vec![(*flow, Side::Local)]
        }
        Event::Resumed { flow, .. } | Event::PeerSwitched { flow, .. } => {
            let mut ends = vec![(*flow, Side::Local)];
            // Both ends moved: the peer's validated address goes in
            // with ours.
            if view.is_some_and(|v| v.pending_remote.is_none()) {
                ends.push((*flow, Side::Peer));
            }
            ends
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::mover::{Budget, Switch};
    use crate::vcmp::flow::Proto;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// Our move to `new` acknowledged (`migrating` false) or not.
    fn view(flow: VirtualFlow, new: SocketAddr, migrating: bool) -> vcmp::ConnectionView {
        vcmp::ConnectionView {
            local_phys: new,
            migrating,
            ..crate::daemon::mover::tests::view(flow)
        }
    }

    fn switch(flow: VirtualFlow, local: SocketAddr, remote: SocketAddr) -> Step {
        Step::Switch(Switch {
            flow,
            local,
            remote,
            peer_moved: true,
            solicit: true,
            budget: Budget::None,
        })
    }

    /// Seen in `family_auto` (1 run in 3): our move onto IPv6 acknowledged
    /// while the peer's IPv6 address was still being validated; the switch
    /// that followed the validation installed both, and our move stayed
    /// "moving" for ever.
    #[test]
    fn the_switch_after_the_peers_validation_ends_our_acknowledged_move_too() {
        let flow = VirtualFlow {
            proto: Proto::Tcp,
            local: sa("198.18.1.2:33054"),
            remote: sa("198.18.3.2:5001"),
        };
        let (ours, theirs) = (sa("[fd00:5e:1::2]:33054"), sa("[fd00:5e:3::2]:5001"));
        let step = switch(flow, ours, theirs);
        let validated = Event::SetRemote {
            flow,
            remote: theirs,
        };
        let acknowledged = view(flow, ours, false);
        assert_eq!(
            switch_ends(&validated, &step, Some(&acknowledged)),
            vec![(flow, Side::Peer), (flow, Side::Local)]
        );
        let unvalidated = Event::SendUnvalidated {
            flow,
            remote: theirs,
            allowed: 0,
        };
        assert_eq!(
            switch_ends(&unvalidated, &step, Some(&acknowledged)),
            vec![(flow, Side::Local)]
        );
        // Our move not acknowledged yet: only the peer's ends here; ours
        // ends with its own `Resumed`.
        let under_way = view(flow, ours, true);
        assert_eq!(
            switch_ends(&validated, &step, Some(&under_way)),
            vec![(flow, Side::Peer)]
        );
        assert!(switch_ends(&unvalidated, &step, Some(&under_way)).is_empty());
        // A switch that does not carry our placement: the peer's only.
        assert_eq!(
            switch_ends(
                &validated,
                &switch(flow, flow.local, theirs),
                Some(&acknowledged)
            ),
            vec![(flow, Side::Peer)]
        );
        // No switch, no end.
        assert!(switch_ends(&validated, &Step::NotAMove, Some(&acknowledged)).is_empty());
    }
}
