//! The move journal, without I/O: which moves are under way, when each
//! started, how each connection's last one ended, and the events
//! `vnatctl monitor` streams for them (`vnat_control::monitor`). The driver
//! tells it where moves start and end (it knows: its own move starts in
//! `start_moves`, the peer's with the core's `PrepareReceive`; both end when
//! their translation is installed, or with `MigrationAborted`, `Reverted`
//! or the connection's close) and publishes what it returns.
//!
//! Times are passed in: a monotonic one for the handover, the wall clock
//! for the events' timestamps.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Instant, SystemTime};

use vnat_control::monitor::{unix_ms, EndOutcome, EventKind, LastMove, MonitorEvent, Side};

use crate::datapath::VirtualFlow;

/// Who the peer is, for the events.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerOf {
    /// Its host key, hex (None while no paired host holds the connection).
    pub key: Option<String>,
    pub address: Option<std::net::IpAddr>,
}

struct UnderWay {
    since: Instant,
    from: SocketAddr,
    to: SocketAddr,
    started_ms: u64,
    peer: PeerOf,
}

/// Most connections whose last move is remembered for `ls` (closed ones
/// are forgotten with them; this only bounds a pathological churn).
const MAX_REMEMBERED: usize = 200_000;

#[derive(Default)]
pub struct Journal {
    under_way: HashMap<(VirtualFlow, Side), UnderWay>,
    last: HashMap<VirtualFlow, LastMove>,
}

impl Journal {
    /// Gives back the room of the moves under way once they ended, and of
    /// the last moves once their connections closed (`vnat_vcmp::room`).
    pub fn shrink_sparse(&mut self) {
        use vnat_vcmp::room::Shrink;
        self.under_way.shrink_sparse();
        self.last.shrink_sparse();
    }

    /// A move of `flow`'s `side` from `from` to `to` started. A move of the
    /// same side still under way is continued (its start is kept: the
    /// handover counts from the first start), with its new target.
    #[allow(clippy::too_many_arguments)]
    pub fn started(
        &mut self,
        flow: VirtualFlow,
        side: Side,
        from: SocketAddr,
        to: SocketAddr,
        peer: PeerOf,
        now: Instant,
        wall: SystemTime,
    ) -> MonitorEvent {
        let started_ms = unix_ms(wall);
        let u = self
            .under_way
            .entry((flow, side))
            .or_insert_with(|| UnderWay {
                since: now,
                from,
                to,
                started_ms,
                peer: peer.clone(),
            });
        u.to = to;
        u.peer = peer.clone();
        let (from, started_ms) = (u.from, u.started_ms);
        // Our own move under way stays what `ls` shows (and what `resume
        // --wait` waits for) while the peer moves too.
        let ours_under_way = self
            .last
            .get(&flow)
            .is_some_and(|l| l.side == Side::Local && l.outcome.is_none());
        let room = self.last.len() < MAX_REMEMBERED || self.last.contains_key(&flow);
        if room && !(side == Side::Peer && ours_under_way) {
            self.last.insert(
                flow,
                LastMove {
                    side,
                    from,
                    to,
                    outcome: None,
                    handover_ms: None,
                    reason: None,
                    started_ms,
                    ended_ms: None,
                },
            );
        }
        MonitorEvent {
            id: Some(flow.id()),
            proto: Some(flow.proto),
            side: Some(side),
            from: Some(from),
            to: Some(to),
            peer: peer.key,
            peer_address: peer.address,
            ..MonitorEvent::new(EventKind::MoveStarted, unix_ms(wall))
        }
    }

    /// Whether a move of `flow`'s `side` is under way.
    pub fn is_under_way(&self, flow: &VirtualFlow, side: Side) -> bool {
        self.under_way.contains_key(&(*flow, side))
    }

    /// The move of `flow`'s `side` ended (`Err`: why it failed). Nothing
    /// if none was under way.
    pub fn ended(
        &mut self,
        flow: &VirtualFlow,
        side: Side,
        result: Result<(), String>,
        now: Instant,
        wall: SystemTime,
    ) -> Option<MonitorEvent> {
        let u = self.under_way.remove(&(*flow, side))?;
        let handover_ms = result
            .is_ok()
            .then(|| now.saturating_duration_since(u.since).as_millis() as u64);
        let (outcome, reason) = match result {
            Ok(()) => (EndOutcome::Moved, None),
            Err(why) => (EndOutcome::Failed, Some(why)),
        };
        let ended_ms = unix_ms(wall);
        if let Some(l) = self.last.get_mut(flow) {
            if l.side == side {
                l.outcome = Some(outcome);
                l.handover_ms = handover_ms;
                l.reason = reason.clone();
                l.ended_ms = Some(ended_ms);
            }
        }
        Some(MonitorEvent {
            id: Some(flow.id()),
            proto: Some(flow.proto),
            side: Some(side),
            from: Some(u.from),
            to: Some(u.to),
            peer: u.peer.key,
            peer_address: u.peer.address,
            outcome: Some(outcome),
            handover_ms,
            reason,
            ..MonitorEvent::new(EventKind::MoveEnded, ended_ms)
        })
    }

    /// `flow` closed: the moves under way of it failed, and its last move
    /// is forgotten.
    pub fn closed(
        &mut self,
        flow: &VirtualFlow,
        now: Instant,
        wall: SystemTime,
    ) -> Vec<MonitorEvent> {
        let out = [Side::Local, Side::Peer]
            .into_iter()
            .filter_map(|side| {
                self.ended(
                    flow,
                    side,
                    Err("the connection closed before its move finished".into()),
                    now,
                    wall,
                )
            })
            .collect();
        self.last.remove(flow);
        out
    }

    /// `flow`'s last move, for `ls`.
    pub fn last_move(&self, flow: &VirtualFlow) -> Option<&LastMove> {
        self.last.get(flow)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::Proto;
    use std::time::Duration;

    fn flow() -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: "198.18.1.2:40000".parse().expect("addr"),
            remote: "198.18.3.2:5001".parse().expect("addr"),
        }
    }

    fn peer() -> PeerOf {
        PeerOf {
            key: Some("ab".repeat(32)),
            address: Some("198.18.3.2".parse().expect("addr")),
        }
    }

    #[test]
    fn a_completed_move_reports_its_handover_and_stays_in_ls() {
        let mut j = Journal::default();
        let (t0, w0) = (
            Instant::now(),
            SystemTime::UNIX_EPOCH + Duration::from_secs(100),
        );
        let to: SocketAddr = "198.18.2.2:40000".parse().expect("addr");
        let started = j.started(flow(), Side::Local, flow().local, to, peer(), t0, w0);
        assert_eq!(started.event, EventKind::MoveStarted);
        assert_eq!(started.time_ms, 100_000);
        assert_eq!(started.peer, peer().key);
        assert!(j.is_under_way(&flow(), Side::Local));
        assert_eq!(j.last_move(&flow()).and_then(|l| l.outcome), None);
        let ended = j
            .ended(
                &flow(),
                Side::Local,
                Ok(()),
                t0 + Duration::from_millis(37),
                w0 + Duration::from_millis(37),
            )
            .expect("a move was under way");
        assert_eq!(ended.outcome, Some(EndOutcome::Moved));
        assert_eq!(ended.handover_ms, Some(37));
        assert_eq!((ended.from, ended.to), (Some(flow().local), Some(to)));
        let last = j.last_move(&flow()).expect("remembered");
        assert_eq!(last.outcome, Some(EndOutcome::Moved));
        assert_eq!(last.ended_ms, Some(100_037));
        // Ended once: a second end is no event.
        assert!(j.ended(&flow(), Side::Local, Ok(()), t0, w0).is_none());
    }

    #[test]
    fn a_restarted_move_keeps_its_first_start_and_a_close_fails_it() {
        let mut j = Journal::default();
        let t0 = Instant::now();
        let w = SystemTime::UNIX_EPOCH;
        let a: SocketAddr = "198.18.2.2:40000".parse().expect("addr");
        let b: SocketAddr = "198.18.4.2:40000".parse().expect("addr");
        j.started(flow(), Side::Local, flow().local, a, peer(), t0, w);
        let again = j.started(
            flow(),
            Side::Local,
            a,
            b,
            peer(),
            t0 + Duration::from_secs(1),
            w,
        );
        assert_eq!((again.from, again.to), (Some(flow().local), Some(b)));
        let ends = j.closed(&flow(), t0 + Duration::from_secs(2), w);
        assert_eq!(ends.len(), 1);
        assert_eq!(ends[0].outcome, Some(EndOutcome::Failed));
        assert_eq!(ends[0].handover_ms, None);
        assert!(ends[0]
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("closed")));
        assert!(j.last_move(&flow()).is_none());
    }

    #[test]
    fn the_peer_moving_too_does_not_hide_our_move_under_way() {
        let mut j = Journal::default();
        let (t, w) = (Instant::now(), SystemTime::UNIX_EPOCH);
        let ours: SocketAddr = "198.18.2.2:40000".parse().expect("addr");
        let theirs: SocketAddr = "198.18.9.9:5001".parse().expect("addr");
        j.started(flow(), Side::Local, flow().local, ours, peer(), t, w);
        j.started(flow(), Side::Peer, flow().remote, theirs, peer(), t, w);
        let l = j.last_move(&flow()).expect("remembered");
        assert_eq!((l.side, l.outcome), (Side::Local, None));
        j.ended(&flow(), Side::Peer, Ok(()), t, w);
        assert_eq!(j.last_move(&flow()).and_then(|l| l.outcome), None);
        j.ended(&flow(), Side::Local, Ok(()), t, w);
        assert_eq!(
            j.last_move(&flow()).and_then(|l| l.outcome),
            Some(EndOutcome::Moved)
        );
    }

    #[test]
    fn both_sides_are_tracked_apart() {
        let mut j = Journal::default();
        let (t, w) = (Instant::now(), SystemTime::UNIX_EPOCH);
        let to: SocketAddr = "198.18.9.9:5001".parse().expect("addr");
        j.started(flow(), Side::Peer, flow().remote, to, peer(), t, w);
        assert!(j.ended(&flow(), Side::Local, Ok(()), t, w).is_none());
        let e = j
            .ended(
                &flow(),
                Side::Peer,
                Err("the peer's new address did not answer".into()),
                t,
                w,
            )
            .expect("under way");
        assert_eq!(e.side, Some(Side::Peer));
        assert_eq!(e.outcome, Some(EndOutcome::Failed));
    }
}
