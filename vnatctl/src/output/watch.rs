//! What `vnatctl monitor` prints for each event, and what `--wait` prints
//! for each connection: with `--json`, the event objects as vnatd sends
//! them (docs/monitor.md) and one row per connection.

use std::fmt::Write as _;

use serde::Serialize;
use vnat_control::{EndOutcome, EventKind, MonitorEvent, Side};

use crate::wait::{physical_local, Awaited, Ended, Waited};

/// `2026-11-28T21:40:01.123Z` for milliseconds since the Unix epoch.
pub fn utc(ms: u64) -> String {
    let (days, rem) = ((ms / 86_400_000) as i64, ms % 86_400_000);
    // Days to a civil date (the proleptic Gregorian calendar).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3_600_000,
        rem / 60_000 % 60,
        rem / 1000 % 60,
        rem % 1000
    )
}

/// A host key as people read it: its first 16 hex digits.
fn short(key: &str) -> &str {
    key.get(..16).unwrap_or(key)
}

fn peer(ev: &MonitorEvent) -> String {
    match (&ev.peer_address, &ev.peer) {
        (Some(a), Some(k)) => format!(" peer {a} (key {}…)", short(k)),
        (Some(a), None) => format!(" peer {a}"),
        (None, Some(k)) => format!(" peer key {}…", short(k)),
        (None, None) => String::new(),
    }
}

fn addr(a: Option<std::net::SocketAddr>) -> String {
    a.map_or_else(|| "?".into(), |a| a.to_string())
}

/// One line of `vnatctl monitor`.
pub fn event_line(ev: &MonitorEvent) -> String {
    let conn = ev.id.map_or_else(String::new, |id| {
        let proto = ev.proto.map_or_else(String::new, |p| format!(" {p}"));
        format!("connection {id}{proto}")
    });
    let whose = match ev.side {
        Some(Side::Peer) => "the peer's end",
        _ => "this host's end",
    };
    let what = match ev.event {
        EventKind::MoveStarted => format!(
            "{conn}: {whose} moves from {} to {}{}",
            addr(ev.from),
            addr(ev.to),
            peer(ev)
        ),
        EventKind::MoveEnded => match (ev.outcome, ev.handover_ms) {
            (Some(EndOutcome::Moved), Some(ms)) => format!(
                "{conn}: {whose} moved from {} to {} in {ms} ms{}",
                addr(ev.from),
                addr(ev.to),
                peer(ev)
            ),
            _ => format!(
                "{conn}: {whose} did not move to {}: {}",
                addr(ev.to),
                ev.reason.as_deref().unwrap_or("no reason given")
            ),
        },
        EventKind::SuspendEnded => match ev.outcome {
            Some(EndOutcome::Settled) => {
                format!("{conn}: suspended, roles and fresh keys agreed{}", peer(ev))
            }
            _ => format!(
                "{conn}: suspension not settled: {}",
                ev.reason.as_deref().unwrap_or("no reason given")
            ),
        },
        EventKind::Paired => format!("paired with{}", peer(ev)),
        EventKind::Lost => format!(
            "{} event(s) lost: this monitor read too slowly",
            ev.count.unwrap_or(0)
        ),
    };
    format!("{} {:<13} {what}\n", utc(ev.time_ms), ev.event.as_str())
}

/// One connection of a `--wait` report (`--json`).
#[derive(Debug, Serialize)]
pub struct WaitedJson {
    pub id: u64,
    /// Moves: "moved", "not_moved" (given up: it stays where it was; see
    /// `reason`), "still_moving" (the wait timed out) or "closed".
    /// Suspensions: "settled", "not_settled", "still_settling", "closed".
    pub outcome: &'static str,
    /// Where the moving end was and goes ("ip:port"); null if unknown.
    pub from: Option<String>,
    pub to: Option<String>,
    /// Its local physical endpoint now; null once closed.
    pub physical_local: Option<String>,
    /// For "moved": from the move's start until both ends translated.
    pub handover_ms: Option<u64>,
    /// Why it did not end well, in one sentence; null when it did.
    pub reason: Option<String>,
}

impl WaitedJson {
    pub fn of(w: &Waited, awaited: Awaited, timeout: std::time::Duration) -> WaitedJson {
        let moves = awaited == Awaited::Moves;
        let (outcome, ev) = match &w.ended {
            Ended::Event(ev) => (
                match (ev.outcome, moves) {
                    (Some(EndOutcome::Moved), _) => "moved",
                    (Some(EndOutcome::Settled), _) => "settled",
                    (_, true) => "not_moved",
                    (_, false) => "not_settled",
                },
                Some(ev),
            ),
            Ended::Closed => ("closed", None),
            Ended::TimedOut => (
                if moves {
                    "still_moving"
                } else {
                    "still_settling"
                },
                None,
            ),
        };
        let reason = match &w.ended {
            Ended::Event(ev) => ev.reason.clone(),
            Ended::Closed => Some("the connection closed".into()),
            Ended::TimedOut if moves => Some(format!(
                "no outcome within {}: the peer's vnatd has not confirmed the new address (is it running and reachable?)",
                crate::wait::show(timeout)
            )),
            Ended::TimedOut => Some(format!(
                "no answer within {} from the peer's vnatd (is it running and reachable?)",
                crate::wait::show(timeout)
            )),
        };
        // Without an end event: the move under way, as `ls` has it.
        let under_way = w.now.as_ref().and_then(|c| c.last_move.as_ref());
        WaitedJson {
            id: w.id,
            outcome,
            from: ev
                .and_then(|e| e.from)
                .or(under_way.map(|m| m.from))
                .map(|a| a.to_string()),
            to: ev
                .and_then(|e| e.to)
                .or(under_way.map(|m| m.to))
                .map(|a| a.to_string()),
            physical_local: physical_local(w).map(|a| a.to_string()),
            handover_ms: ev.and_then(|e| e.handover_ms),
            reason,
        }
    }

    pub fn ok(&self) -> bool {
        matches!(self.outcome, "moved" | "settled")
    }
}

/// The text report of `--wait`: one line per connection.
pub fn waited_text(rows: &[WaitedJson]) -> String {
    let mut out = String::new();
    for r in rows {
        let to = r.to.as_deref().unwrap_or("its new address");
        let what = match r.outcome {
            "moved" => format!(
                "moved from {} to {to}{}",
                r.from.as_deref().unwrap_or("?"),
                r.handover_ms
                    .map_or_else(String::new, |ms| format!(" (handover {ms} ms)"))
            ),
            "settled" => "suspended: roles and fresh keys agreed with its peer".into(),
            "closed" => "closed before it finished".into(),
            "still_moving" => format!("still moving to {to}"),
            "still_settling" => "suspension not settled yet".into(),
            "not_settled" => "suspension not settled".into(),
            _ => format!(
                "did not move to {to}: it stays at {}",
                r.physical_local.as_deref().unwrap_or("-")
            ),
        };
        let why = match (&r.reason, r.ok()) {
            (Some(why), false) => format!(" ({why})"),
            _ => String::new(),
        };
        let _ = writeln!(out, "connection {}: {what}{why}", r.id);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_reports_read_as_sentences() {
        let row = |outcome, handover_ms, reason: Option<&str>| WaitedJson {
            id: 7,
            outcome,
            from: Some("198.18.1.2:40000".into()),
            to: Some("198.18.2.2:40000".into()),
            physical_local: Some("198.18.1.2:40000".into()),
            handover_ms,
            reason: reason.map(Into::into),
        };
        assert_eq!(
            waited_text(&[
                row("moved", Some(12), None),
                row("still_moving", None, Some("no outcome within 1s")),
                row("not_moved", None, Some("the connection closed")),
            ]),
            "connection 7: moved from 198.18.1.2:40000 to 198.18.2.2:40000 (handover 12 ms)\n\
             connection 7: still moving to 198.18.2.2:40000 (no outcome within 1s)\n\
             connection 7: did not move to 198.18.2.2:40000: it stays at 198.18.1.2:40000 (the connection closed)\n"
        );
    }

    #[test]
    fn utc_timestamps() {
        assert_eq!(utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(utc(1_795_901_201_005), "2026-11-28T21:26:41.005Z");
    }

    #[test]
    fn a_moved_event_reads_as_a_sentence() {
        let ev = MonitorEvent {
            id: Some(7),
            proto: Some(vnat_control::datapath::Proto::Tcp),
            side: Some(Side::Local),
            from: Some("198.18.1.2:40000".parse().expect("addr")),
            to: Some("198.18.2.2:40000".parse().expect("addr")),
            peer: Some("3f1c".repeat(16)),
            peer_address: Some("198.18.3.2".parse().expect("addr")),
            outcome: Some(EndOutcome::Moved),
            handover_ms: Some(12),
            ..MonitorEvent::new(EventKind::MoveEnded, 0)
        };
        assert_eq!(
            event_line(&ev),
            "1970-01-01T00:00:00.000Z move_ended    connection 7 tcp: this host's end moved from 198.18.1.2:40000 to 198.18.2.2:40000 in 12 ms peer 198.18.3.2 (key 3f1c3f1c3f1c3f1c…)\n"
        );
    }
}
