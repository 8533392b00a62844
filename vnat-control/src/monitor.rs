//! The events `vnatctl monitor` streams, and `--wait` waits for: one JSON
//! object per event, with stable field names (docs/monitor.md).
//!
//! A client asks `{"version":1,"request":{"type":"monitor"}}`; vnatd
//! answers `{"version":1,"ok":{"type":"monitoring"}}` and from then on
//! writes one line per event, `{"version":1,"ok":{"type":"event",...}}`,
//! with the fields of [`MonitorEvent`] beside `type`. The connection takes
//! no further request; closing it ends the subscription.

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use crate::datapath::Proto;

/// What happened. On the wire, the `event` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A move of a connection started: this host's end (`side` "local")
    /// or the peer's (`side` "peer").
    MoveStarted,
    /// A move ended: `outcome` "moved" with `handover_ms`, or "failed"
    /// with `reason`.
    MoveEnded,
    /// A planned suspension (`vnatctl suspend`) was settled with the peer
    /// (`outcome` "settled") or given up (`outcome` "failed", `reason`).
    SuspendEnded,
    /// Pairing with a peer host completed (`peer` is its key,
    /// `peer_address` where it paired from).
    Paired,
    /// This subscriber read too slowly: `count` events before this one
    /// were dropped for it (vnatd never waits for a subscriber).
    Lost,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::MoveStarted => "move_started",
            EventKind::MoveEnded => "move_ended",
            EventKind::SuspendEnded => "suspend_ended",
            EventKind::Paired => "paired",
            EventKind::Lost => "lost",
        }
    }
}

/// Whose end of the connection moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// This host's end (automatic mode, resume, migrate, import).
    Local,
    /// The peer's end: it announced a new address, which this host
    /// validates.
    Peer,
}

/// How a move (or a suspension) ended. On the wire, the `outcome` field.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EndOutcome {
    /// Both ends translate to the new address: the move is complete.
    Moved,
    /// The suspension's roles and keys were agreed with the peer.
    Settled,
    /// The move or suspension was given up (`reason` says why); the
    /// connection stays where it was.
    Failed,
}

impl EndOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            EndOutcome::Moved => "moved",
            EndOutcome::Settled => "settled",
            EndOutcome::Failed => "failed",
        }
    }
}

/// One event. Fields that do not apply to an event are absent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MonitorEvent {
    pub event: EventKind,
    /// When it happened: milliseconds since the Unix epoch (UTC).
    pub time_ms: u64,
    /// The connection's id, as `vnatctl ls` shows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proto: Option<Proto>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side: Option<Side>,
    /// The moving end's physical endpoint before the move.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<SocketAddr>,
    /// Where it moves to (a port 0: the peer's new port behind a NAT is
    /// learned later).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<SocketAddr>,
    /// The peer host's key (64 hex digits, as `vnatctl peers` shows it);
    /// absent while no paired host holds the connection.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    /// The peer's address (where its end is, or where it paired from).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_address: Option<IpAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<EndOutcome>,
    /// For a move that ended "moved": from its start to both ends
    /// translating, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_ms: Option<u64>,
    /// For one that "failed": why, in one sentence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// For `lost`: how many events were dropped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u64>,
}

impl MonitorEvent {
    /// An event of `kind` at `time_ms` with no other field.
    pub fn new(event: EventKind, time_ms: u64) -> MonitorEvent {
        MonitorEvent {
            event,
            time_ms,
            id: None,
            proto: None,
            side: None,
            from: None,
            to: None,
            peer: None,
            peer_address: None,
            outcome: None,
            handover_ms: None,
            reason: None,
            count: None,
        }
    }

    /// `count` events were dropped for a slow subscriber.
    pub fn lost(count: u64, time_ms: u64) -> MonitorEvent {
        MonitorEvent {
            count: Some(count),
            ..MonitorEvent::new(EventKind::Lost, time_ms)
        }
    }

    /// Whether this event ends something a `--wait` waits for.
    pub fn is_end(&self) -> bool {
        matches!(self.event, EventKind::MoveEnded | EventKind::SuspendEnded)
    }
}

/// The last move of a connection, as `vnatctl ls` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastMove {
    pub side: Side,
    pub from: SocketAddr,
    pub to: SocketAddr,
    /// None while it is under way.
    #[serde(default)]
    pub outcome: Option<EndOutcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handover_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// When it started (ms since the Unix epoch).
    pub started_ms: u64,
    /// When it ended, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_ms: Option<u64>,
}

/// Milliseconds since the Unix epoch of `t` (0 before it).
pub fn unix_ms(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_move_end_has_the_stable_field_names() {
        let ev = MonitorEvent {
            id: Some(7),
            proto: Some(Proto::Tcp),
            side: Some(Side::Local),
            from: Some("198.18.1.2:40000".parse().expect("addr")),
            to: Some("198.18.2.2:40000".parse().expect("addr")),
            peer: Some("ab".repeat(32)),
            peer_address: Some("198.18.3.2".parse().expect("addr")),
            outcome: Some(EndOutcome::Moved),
            handover_ms: Some(12),
            ..MonitorEvent::new(EventKind::MoveEnded, 1_700_000_000_000)
        };
        let line = serde_json::to_string(&ev).expect("serializable");
        assert_eq!(
            line,
            format!(
                r#"{{"event":"move_ended","time_ms":1700000000000,"id":7,"proto":"tcp","side":"local","from":"198.18.1.2:40000","to":"198.18.2.2:40000","peer":"{}","peer_address":"198.18.3.2","outcome":"moved","handover_ms":12}}"#,
                "ab".repeat(32)
            )
        );
        assert_eq!(
            serde_json::from_str::<MonitorEvent>(&line).expect("parses back"),
            ev
        );
        assert!(ev.is_end());
    }

    #[test]
    fn a_failed_end_carries_its_reason_and_no_handover() {
        let ev = MonitorEvent {
            id: Some(3),
            outcome: Some(EndOutcome::Failed),
            reason: Some("the connection closed".into()),
            ..MonitorEvent::new(EventKind::MoveEnded, 5)
        };
        let v = serde_json::to_value(&ev).expect("serializable");
        assert_eq!(v["outcome"], "failed");
        assert_eq!(v["reason"], "the connection closed");
        assert!(v.get("handover_ms").is_none(), "{v}");
        let lost = serde_json::to_value(MonitorEvent::lost(42, 9)).expect("serializable");
        assert_eq!(
            lost,
            serde_json::json!({"event":"lost","time_ms":9,"count":42})
        );
    }

    #[test]
    fn kind_and_outcome_names_match_serde() {
        for k in [
            EventKind::MoveStarted,
            EventKind::MoveEnded,
            EventKind::SuspendEnded,
            EventKind::Paired,
            EventKind::Lost,
        ] {
            assert_eq!(
                serde_json::json!(k.as_str()),
                serde_json::to_value(k).expect("ok")
            );
        }
        for o in [EndOutcome::Moved, EndOutcome::Settled, EndOutcome::Failed] {
            assert_eq!(
                serde_json::json!(o.as_str()),
                serde_json::to_value(o).expect("ok")
            );
        }
    }
}
