//! `vnatctl monitor`, and `--wait`: wait for the outcome of each connection
//! a command affected, from vnatd's event stream (`monitor`'s), and
//! `--timeout`'s durations.
//!
//! Nothing is missed between the command and the wait: the subscription is
//! made first, on its own connection, so every end that follows the
//! command reaches it (queued in its socket while the command's answer is
//! read). If vnatd dropped events for this subscriber (a `lost` event), or
//! cannot stream events at all (a vnatd without them), each connection's
//! last move is looked up in `ls` instead.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{IsTerminal as _, Write as _},
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use vnat_control::{
    client::Subscription, ClientError, ControlClient, EndOutcome, EventKind, ListedConnection,
    MonitorEvent, Side,
};

/// A duration as `--timeout` takes it: `500ms`, `10s`, `2m`, `1h`, or a
/// plain number of seconds (`15`). At least a millisecond, at most a day.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || {
        format!("{s:?} is not a duration: give a number with a unit, such as 500ms, 10s, 2m or 1h")
    };
    let n: u64 = num.parse().map_err(|_| bad())?;
    let ms = match unit.trim() {
        "ms" => Some(n),
        "" | "s" => n.checked_mul(1000),
        "m" | "min" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => return Err(bad()),
    };
    match ms {
        Some(0) => Err(format!("{s:?} is no time at all; give at least 1ms")),
        Some(ms) if ms <= 86_400_000 => Ok(Duration::from_millis(ms)),
        _ => Err(format!("{s:?} is longer than a day; give at most 24h")),
    }
}

/// "2s", "500ms", "1m30s": a duration for people.
pub fn show(d: Duration) -> String {
    let ms = d.as_millis() as u64;
    if ms < 1000 {
        format!("{ms}ms")
    } else if ms.is_multiple_of(1000) && ms < 60_000 {
        format!("{}s", ms / 1000)
    } else if ms < 60_000 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else {
        crate::output::duration(ms / 1000)
    }
}

/// What the wait waits for: moves of this host's end, or suspensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Awaited {
    Moves,
    Suspensions,
}

impl Awaited {
    fn ends(self, ev: &MonitorEvent) -> bool {
        match self {
            Awaited::Moves => ev.event == EventKind::MoveEnded && ev.side == Some(Side::Local),
            Awaited::Suspensions => ev.event == EventKind::SuspendEnded,
        }
    }
}

/// How one connection's wait ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// Its end event (or, after lost events, its last move in `ls`).
    Event(MonitorEvent),
    /// It is gone from `ls`.
    Closed,
    /// No outcome within the timeout.
    TimedOut,
}

/// One connection's outcome.
#[derive(Clone, Debug)]
pub struct Waited {
    pub id: u64,
    pub ended: Ended,
    /// Its `ls` row at the end (for where it is now), if it was read.
    pub now: Option<ListedConnection>,
}

/// Subscribe before the command: `Ok(None)` if this vnatd cannot stream
/// events (then [`wait`] polls `ls`).
pub async fn subscribe(control: &Path) -> Result<Option<Subscription>, ClientError> {
    let client = ControlClient::connect(control).await?;
    match client.subscribe().await {
        Ok(s) => Ok(Some(s)),
        Err(ClientError::Daemon { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// How long [`wait`] reads the subscription for the ends of connections
/// in `also` once nothing else is pending.
const ALSO_GRACE: Duration = Duration::from_millis(300);

/// Wait until each of `ids` has an outcome, or `timeout`. Ends seen for
/// other connections in `also` (selected, but not known to be moving when
/// the command answered: their move ended in between) are reported too.
/// `targets`: where moves go, if the command said (for a vnatd without
/// events). `unlisted`: connections not in `ls` until their socket appears
/// (imported ones): until they have been listed, their absence is not an
/// end. On a terminal, waits over a second show progress on stderr.
#[allow(clippy::too_many_arguments)]
pub async fn wait(
    control: &Path,
    sub: Option<Subscription>,
    awaited: Awaited,
    ids: &[u64],
    also: &[u64],
    targets: &BTreeMap<u64, SocketAddr>,
    unlisted: &[u64],
    timeout: Duration,
) -> Result<Vec<Waited>, ClientError> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut pending: BTreeSet<u64> = ids.iter().copied().collect();
    // Imported connections whose restored socket has not appeared are not
    // in `ls` yet: their absence is not their end until they were seen.
    let mut unlisted: BTreeSet<u64> = unlisted.iter().copied().collect();
    let mut done: BTreeMap<u64, Ended> = BTreeMap::new();
    let mut progress = Progress::new(ids.len());
    let mut sub = sub;
    // Without events (or after losing some): what `ls` says. Looked at
    // once at first and after each loss; without events, every 100 ms.
    let mut look = true;
    while !pending.is_empty() {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        if look || sub.is_none() {
            look = false;
            let mut client = ControlClient::connect(control).await?;
            let list = client.list().await?;
            let polling = sub.is_none();
            from_list(
                awaited,
                &list,
                started,
                &mut pending,
                &mut done,
                polling,
                targets,
                &mut unlisted,
            );
            if pending.is_empty() {
                break;
            }
        }
        progress.show(ids.len() - pending.len(), started);
        let tick = Duration::from_millis(100).min(deadline - now);
        let Some(s) = sub.as_mut() else {
            tokio::time::sleep(tick).await;
            continue;
        };
        let ev = match tokio::time::timeout(tick, s.next()).await {
            Err(_) => continue,
            Ok(Ok(Some(ev))) => ev,
            // vnatd went away: what is pending stays so.
            Ok(Ok(None)) => {
                sub = None;
                continue;
            }
            Ok(Err(e)) => return Err(e),
        };
        if ev.event == EventKind::Lost {
            look = true;
            continue;
        }
        if !awaited.ends(&ev) {
            continue;
        }
        let Some(id) = ev.id else { continue };
        if pending.remove(&id) || (also.contains(&id) && !done.contains_key(&id)) {
            done.insert(id, Ended::Event(ev));
        }
    }
    // Connections whose move ended before the command answered: their
    // ends were published before the answer, so they are in the
    // subscription already, or arrive within moments (the hub writes to
    // each subscriber on its own task). Read them, briefly, even when
    // nothing else was awaited: a failure among them must not exit 0.
    if let Some(s) = sub.as_mut() {
        let grace = Instant::now() + ALSO_GRACE.min(deadline.saturating_duration_since(started));
        while also.iter().any(|id| !done.contains_key(id)) {
            let left = grace.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let Ok(Ok(Some(ev))) = tokio::time::timeout(left, s.next()).await else {
                break;
            };
            if !awaited.ends(&ev) {
                continue;
            }
            let Some(id) = ev.id else { continue };
            if also.contains(&id) && !done.contains_key(&id) {
                done.insert(id, Ended::Event(ev));
            }
        }
    }
    progress.clear();
    for id in pending {
        done.insert(id, Ended::TimedOut);
    }
    // Where each connection is now.
    let list = match ControlClient::connect(control).await {
        Ok(mut c) => c.list().await.unwrap_or_default(),
        Err(_) => Vec::new(),
    };
    let mut out: Vec<Waited> = done
        .into_iter()
        .map(|(id, ended)| Waited {
            id,
            now: list.iter().find(|c| c.info.id == id).cloned(),
            ended,
        })
        .collect();
    // The order the command named them in, then the others.
    out.sort_by_key(|w| {
        (
            ids.iter().position(|i| *i == w.id).unwrap_or(usize::MAX),
            w.id,
        )
    });
    Ok(out)
}

/// `--wait`: each affected connection's outcome ([`wait`]), as the
/// report's rows.
#[allow(clippy::too_many_arguments)]
pub async fn report(
    control: &Path,
    sub: Option<vnat_control::client::Subscription>,
    awaited: Awaited,
    ids: &[u64],
    also: &[u64],
    targets: &std::collections::BTreeMap<u64, std::net::SocketAddr>,
    unlisted: &[u64],
    timeout: std::time::Duration,
) -> Result<Vec<crate::output::WaitedJson>, crate::Failure> {
    let outcomes = wait(control, sub, awaited, ids, also, targets, unlisted, timeout).await?;
    Ok(outcomes
        .iter()
        .map(|w| crate::output::WaitedJson::of(w, awaited, timeout))
        .collect())
}

/// `vnatctl monitor`: print each event until vnatd closes the stream (or
/// the user interrupts).
pub async fn monitor(control: &Path, json: bool) -> Result<String, crate::Failure> {
    let mut sub = ControlClient::connect(control).await?.subscribe().await?;
    let mut out = std::io::stdout();
    while let Some(ev) = sub.next().await? {
        let line = if json {
            serde_json::to_string(&ev).unwrap_or_default() + "\n"
        } else {
            crate::output::event_line(&ev)
        };
        // A closed pipe (`| head`) ends the monitor quietly.
        if out
            .write_all(line.as_bytes())
            .and_then(|()| out.flush())
            .is_err()
        {
            return Ok(String::new());
        }
    }
    Err(crate::Failure::MonitorEnded)
}

/// Resolve what `ls` shows as ended (a last move that ended after the wait
/// started) or gone. `polling`: no events, so a connection still listed as
/// under way only shows in a later look.
#[allow(clippy::too_many_arguments)]
fn from_list(
    awaited: Awaited,
    list: &[ListedConnection],
    started: Instant,
    pending: &mut BTreeSet<u64>,
    done: &mut BTreeMap<u64, Ended>,
    polling: bool,
    targets: &BTreeMap<u64, SocketAddr>,
    unlisted: &mut BTreeSet<u64>,
) {
    let since_ms = vnat_control::monitor::unix_ms(std::time::SystemTime::now())
        .saturating_sub(started.elapsed().as_millis() as u64 + 1000);
    for id in pending.clone() {
        let Some(c) = list.iter().find(|c| c.info.id == id) else {
            if !unlisted.contains(&id) {
                pending.remove(&id);
                done.insert(id, Ended::Closed);
            }
            continue;
        };
        unlisted.remove(&id);
        if awaited != Awaited::Moves {
            continue;
        }
        let ended = c.last_move.as_ref().filter(|l| {
            l.side == Side::Local && l.outcome.is_some() && l.ended_ms.unwrap_or(0) >= since_ms
        });
        if let Some(l) = ended {
            pending.remove(&id);
            done.insert(
                id,
                Ended::Event(MonitorEvent {
                    id: Some(id),
                    side: Some(l.side),
                    from: Some(l.from),
                    to: Some(l.to),
                    outcome: l.outcome,
                    handover_ms: l.handover_ms,
                    reason: l.reason.clone(),
                    ..MonitorEvent::new(EventKind::MoveEnded, l.ended_ms.unwrap_or(0))
                }),
            );
        } else if polling && c.last_move.is_none() && !c.moving {
            // A vnatd without a journal: not moving any more is the end.
            pending.remove(&id);
            done.insert(id, polled_end(c, targets.get(&id)));
        }
    }
}

/// The end of a move, as a vnatd without events shows it: where the
/// connection is, against where it was to go (if known).
fn polled_end(c: &ListedConnection, target: Option<&SocketAddr>) -> Ended {
    let moved = target.is_none_or(|t| *t == c.info.physical_local);
    Ended::Event(MonitorEvent {
        id: Some(c.info.id),
        side: Some(Side::Local),
        to: target.copied(),
        outcome: Some(if moved {
            EndOutcome::Moved
        } else {
            EndOutcome::Failed
        }),
        reason: (!moved).then(|| "its peer could not validate the new address".into()),
        ..MonitorEvent::new(EventKind::MoveEnded, 0)
    })
}

/// Where a connection is now (for the report).
pub fn physical_local(w: &Waited) -> Option<SocketAddr> {
    w.now.as_ref().map(|c| c.info.physical_local)
}

/// "3 of 5 connections done (1.2s)" on stderr, rewritten in place, once the
/// wait has lasted a second, and only if stderr is a terminal.
struct Progress {
    tty: bool,
    total: usize,
    shown: bool,
}

impl Progress {
    fn new(total: usize) -> Progress {
        Progress {
            tty: std::io::stderr().is_terminal(),
            total,
            shown: false,
        }
    }

    fn show(&mut self, done: usize, started: Instant) {
        let waited = started.elapsed();
        if !self.tty || waited < Duration::from_secs(1) {
            return;
        }
        self.shown = true;
        let _ = write!(
            std::io::stderr(),
            "\r\x1b[Kwaiting: {done} of {} connection(s) done ({:.1}s)",
            self.total,
            waited.as_secs_f64()
        );
    }

    fn clear(&mut self) {
        if self.shown {
            let _ = write!(std::io::stderr(), "\r\x1b[K");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_with_and_without_units() {
        let ms = |n| Ok(Duration::from_millis(n));
        assert_eq!(parse_duration("500ms"), ms(500));
        assert_eq!(parse_duration("10s"), ms(10_000));
        assert_eq!(parse_duration("2m"), ms(120_000));
        assert_eq!(parse_duration("1h"), ms(3_600_000));
        // A plain number is seconds (what `migrate --timeout` took before).
        assert_eq!(parse_duration("15"), ms(15_000));
        assert_eq!(parse_duration(" 3s "), ms(3000));
    }

    #[test]
    fn bad_durations_say_what_to_give() {
        for bad in [
            "",
            "s",
            "ten",
            "10x",
            "-1s",
            "1.5s",
            "99999999999999999999s",
        ] {
            let e = parse_duration(bad).expect_err(bad);
            assert!(e.contains("duration") || e.contains("day"), "{bad}: {e}");
        }
        assert!(parse_duration("0s")
            .expect_err("zero")
            .contains("at least 1ms"));
        assert!(parse_duration("25h")
            .expect_err("long")
            .contains("at most 24h"));
    }

    fn listed(id: u64, last: Option<vnat_control::LastMove>) -> ListedConnection {
        let a: SocketAddr = "198.18.1.2:40000".parse().expect("addr");
        ListedConnection {
            info: vnat_control::datapath::ConnectionInfo {
                id,
                proto: vnat_control::datapath::Proto::Tcp,
                virtual_local: a,
                virtual_remote: a,
                physical_local: a,
                physical_remote: a,
                state: vnat_control::datapath::ConnState::Native,
                cookie: 0,
                cgroup_id: 0,
                cgroup: None,
                pid: None,
                command: None,
                age_secs: 0,
                recorded_ns: 0,
                tcp_isns: None,
                adopted: false,
                hide_location: false,
                udp_inbound_only: false,
                guest: None,
            },
            mobile: true,
            seen_by_peer_as: None,
            why_not_mobile: None,
            role: None,
            moving: last.as_ref().is_some_and(|l| l.outcome.is_none()),
            keepalive_held: false,
            placed: None,
            helpers_asked: Vec::new(),
            helping: Vec::new(),
            last_move: last,
        }
    }

    /// After lost events, `ls` settles what it can: a move that ended
    /// during the wait, a connection that is gone; one still under way, or
    /// whose last move ended before the wait, stays pending.
    #[test]
    fn after_lost_events_ls_tells_what_ended() {
        let now = vnat_control::monitor::unix_ms(std::time::SystemTime::now());
        let a: SocketAddr = "198.18.1.2:40000".parse().expect("addr");
        let b: SocketAddr = "198.18.2.2:40000".parse().expect("addr");
        let last = |outcome, ended_ms| vnat_control::LastMove {
            side: Side::Local,
            from: a,
            to: b,
            outcome,
            handover_ms: outcome.map(|_| 12),
            reason: None,
            started_ms: now - 60_000,
            ended_ms,
        };
        let list = vec![
            listed(1, Some(last(Some(EndOutcome::Moved), Some(now)))),
            listed(2, Some(last(None, None))),
            listed(3, Some(last(Some(EndOutcome::Moved), Some(now - 50_000)))),
        ];
        let mut pending: BTreeSet<u64> = [1, 2, 3, 4].into();
        let mut done = BTreeMap::new();
        from_list(
            Awaited::Moves,
            &list,
            Instant::now(),
            &mut pending,
            &mut done,
            false,
            &BTreeMap::new(),
            &mut BTreeSet::new(),
        );
        assert_eq!(pending, [2, 3].into());
        assert!(matches!(&done[&1], Ended::Event(e)
            if e.outcome == Some(EndOutcome::Moved) && e.handover_ms == Some(12)));
        assert_eq!(done[&4], Ended::Closed);

        // An imported connection waiting for its socket (5) is not in the
        // list: still pending, until it has been listed once; gone after
        // that, it closed.
        let mut pending: BTreeSet<u64> = [5].into();
        let mut unlisted: BTreeSet<u64> = [5].into();
        let mut done = BTreeMap::new();
        let look = |list: &[ListedConnection],
                    p: &mut BTreeSet<u64>,
                    d: &mut BTreeMap<u64, Ended>,
                    u: &mut BTreeSet<u64>| {
            from_list(
                Awaited::Moves,
                list,
                Instant::now(),
                p,
                d,
                false,
                &BTreeMap::new(),
                u,
            )
        };
        look(&[], &mut pending, &mut done, &mut unlisted);
        assert_eq!(pending, [5].into(), "{done:?}");
        look(&[listed(5, None)], &mut pending, &mut done, &mut unlisted);
        assert_eq!(pending, [5].into(), "listed, not moved yet: {done:?}");
        look(&[], &mut pending, &mut done, &mut unlisted);
        assert_eq!(done[&5], Ended::Closed);
    }

    #[test]
    fn durations_read_well() {
        assert_eq!(show(Duration::from_millis(500)), "500ms");
        assert_eq!(show(Duration::from_secs(2)), "2s");
        assert_eq!(show(Duration::from_millis(1500)), "1.5s");
        assert_eq!(show(Duration::from_secs(90)), "1m30s");
    }
}
