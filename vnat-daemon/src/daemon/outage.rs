//! Unannounced outages (issue 32, item 1), decided without I/O: the help
//! `vnatctl suspend` gives also starts when nobody announced anything.
//!
//! - This host lost a connection's address (removed, link down) or its
//!   route to the peer, and no move can start: the connection is
//!   *stranded* ([`stranded`]). The driver holds its keepalive and its
//!   retransmission timeout as a suspend would, until it works again
//!   (`mobility::keepalive_release_due`).
//! - A paired host went silent: its connections' sockets here wait for an
//!   answer (keepalive or window probes out, retransmissions) while this
//!   host itself is fine. [`SilenceWatch`] then probes its vnatd (VCMP
//!   PROBE); unanswered [`PROBES`] times, the host is silent and the driver
//!   answers for it with a zero window (`daemon::helping`), as if it had
//!   asked at suspend, until it is heard from again (a probe answered, its
//!   connections move or their counters move).

use std::{
    collections::{HashMap, HashSet},
    net::IpAddr,
    time::{Duration, Instant},
};

use super::mobility::Tracked;

/// How long after a probe the next one goes (or the host is found silent).
pub const PROBE_EVERY: Duration = Duration::from_secs(1);
/// How long after this host lost a connection's address without warning
/// it first answers for the peer with a zero window. A roam brings the new
/// address within milliseconds and the move starts then; an answer given
/// before it would leave the socket waiting on a closed window that only
/// the peer, unreachable at the old address, could open (seen:
/// `hold_limit.rs`, the loss noticed 10 ms before the new address). Before
/// the socket's second unanswered probe (0.6 s): a `tcp_retries2` of 2
/// still never ends it.
pub const FIRST_ANSWER_AFTER: Duration = Duration::from_millis(300);
/// Unanswered probes after which a host is silent. With [`PROBE_EVERY`],
/// about 2 s after its sockets first waited: well within the shortest
/// keepalive an application sets (redis-cli: 15 s idle, then probes).
pub const PROBES: u32 = 2;
/// A host whose vnatd sent an authentic record of one of its connections
/// this recently is not silent, whatever became of our probes: in a move
/// of tens of thousands of connections its vnatd can be too busy to
/// answer a probe within [`PROBE_EVERY`], or the answer is lost among
/// the records, while its sockets here wait for the move to finish.
pub const HEARD_WITHIN: Duration =
    Duration::from_millis(PROBE_EVERY.as_millis() as u64 * PROBES as u64);

/// Whether a host last heard from at `last` (see [`HEARD_WITHIN`]) counts
/// as heard at `now`.
pub fn heard_lately(last: Option<crate::vcmp::Timestamp>, now: crate::vcmp::Timestamp) -> bool {
    last.is_some_and(|t| now.since(t) < HEARD_WITHIN)
}

/// How often a silent host is probed, to notice it back where it was.
pub const SILENT_PROBE_EVERY: Duration = Duration::from_secs(5);
/// The longest a silent host's connections are answered for without its
/// asking: the peer's TCP is then left to its own timeouts (a laptop gone
/// for good must not hold a server's sockets for the 24 h a suspend may).
pub const SILENT_HELP_MAX: Duration = Duration::from_secs(3600);
/// A host that answered is not probed again for this long, however its
/// sockets look (a lossy path retransmits without the host being away).
pub const ANSWERED_QUIET: Duration = Duration::from_secs(10);

/// Whether `t` is stranded by this host's own outage: no move of it is
/// under way, and its local address is gone or no route leads to its peer
/// (`routed`), so that nothing can carry it until the network is back.
pub fn stranded(t: &Tracked, addrs: &HashSet<IpAddr>, routed: bool) -> bool {
    if t.migrating {
        return false;
    }
    let here = match (t.local_phys == t.flow.local, t.anchor) {
        (true, Some(a)) => addrs.contains(&a),
        _ => addrs.contains(&t.local_phys.ip()),
    };
    !here || !routed
}

/// What the driver does for a peer host (by its key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send the host a VCMP probe.
    Probe([u8; 32]),
    /// The host is silent: answer for its connections.
    Silent([u8; 32]),
    /// The host that was silent answered: its help ends.
    Back([u8; 32]),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Watch {
    /// Probed `sent` times; the next step at `next`.
    Probing { sent: u32, next: Instant },
    /// Found silent; probed again at `next`.
    Silent { next: Instant },
    /// Answered; not probed again before `until`.
    Answered { until: Instant },
}

/// Which paired hosts are being checked for silence, and which are silent.
#[derive(Debug, Default)]
pub struct SilenceWatch {
    hosts: HashMap<[u8; 32], Watch>,
}

impl SilenceWatch {
    /// `waiting`: the hosts some of whose connections' sockets wait for an
    /// answer at `now` (this host being fine). What to do now; the steps
    /// of every host watched are taken here, so call it at least every
    /// [`PROBE_EVERY`] while [`SilenceWatch::busy`].
    pub fn tick(&mut self, now: Instant, waiting: &HashSet<[u8; 32]>) -> Vec<Action> {
        let mut out = Vec::new();
        for k in waiting {
            if !self.hosts.contains_key(k) {
                self.hosts.insert(
                    *k,
                    Watch::Probing {
                        sent: 1,
                        next: now + PROBE_EVERY,
                    },
                );
                out.push(Action::Probe(*k));
            }
        }
        let mut forget = Vec::new();
        for (k, w) in self.hosts.iter_mut() {
            match *w {
                Watch::Probing { sent, next } if now >= next => {
                    if sent >= PROBES {
                        *w = Watch::Silent {
                            next: now + SILENT_PROBE_EVERY,
                        };
                        out.push(Action::Silent(*k));
                    } else {
                        *w = Watch::Probing {
                            sent: sent + 1,
                            next: now + PROBE_EVERY,
                        };
                        out.push(Action::Probe(*k));
                    }
                }
                Watch::Silent { next } if now >= next => {
                    *w = Watch::Silent {
                        next: now + SILENT_PROBE_EVERY,
                    };
                    out.push(Action::Probe(*k));
                }
                Watch::Answered { until } if now >= until => forget.push(*k),
                _ => {}
            }
        }
        for k in forget {
            self.hosts.remove(&k);
        }
        out
    }

    /// `host` answered a probe (or was otherwise heard from) at `now`.
    pub fn answered(&mut self, host: &[u8; 32], now: Instant) -> Option<Action> {
        let was = self.hosts.insert(
            *host,
            Watch::Answered {
                until: now + ANSWERED_QUIET,
            },
        );
        match was {
            Some(Watch::Silent { .. }) => Some(Action::Back(*host)),
            Some(_) => None,
            None => {
                // Not watched: nothing to remember.
                self.hosts.remove(host);
                None
            }
        }
    }

    /// `host` is silent now.
    pub fn is_silent(&self, host: &[u8; 32]) -> bool {
        matches!(self.hosts.get(host), Some(Watch::Silent { .. }))
    }

    /// `host`'s connections are gone or it moved: stop watching it.
    pub fn forget(&mut self, host: &[u8; 32]) {
        self.hosts.remove(host);
    }

    /// When [`SilenceWatch::tick`] must run next, if some host is watched.
    pub fn next_step(&self) -> Option<Instant> {
        self.hosts
            .values()
            .map(|w| match *w {
                Watch::Probing { next, .. } | Watch::Silent { next } => next,
                Watch::Answered { until } => until,
            })
            .min()
    }

    pub fn busy(&self) -> bool {
        !self.hosts.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::{Proto, VirtualFlow};

    #[test]
    fn a_host_heard_from_within_the_probes_time_is_not_silent() {
        use crate::vcmp::Timestamp;
        let now = Timestamp(100_000_000_000);
        let ago = |d: Duration| Timestamp(now.0 - d.as_nanos() as u64);
        assert!(heard_lately(Some(now), now));
        assert!(heard_lately(Some(ago(Duration::from_millis(1_900))), now));
        assert!(!heard_lately(Some(ago(HEARD_WITHIN)), now));
        assert!(!heard_lately(Some(ago(Duration::from_secs(60))), now));
        assert!(!heard_lately(None, now), "never heard from");
    }

    fn sa(s: &str) -> std::net::SocketAddr {
        s.parse().expect("address")
    }

    fn tracked(local_phys: &str, migrating: bool) -> Tracked {
        Tracked {
            flow: VirtualFlow {
                proto: Proto::Tcp,
                local: sa("198.18.1.2:4000"),
                remote: sa("198.18.3.2:22"),
            },
            local_phys: sa(local_phys),
            remote_phys: sa("198.18.3.2:22"),
            migrating,
            placed: false,
            anchor: None,
            across: None,
            follows_peer: false,
        }
    }

    #[test]
    fn a_connection_is_stranded_while_its_address_or_route_is_gone_and_no_move_runs() {
        let a: HashSet<IpAddr> = ["198.18.1.2".parse().expect("ip")].into();
        let none = HashSet::new();
        let home = tracked("198.18.1.2:4000", false);
        assert!(!stranded(&home, &a, true), "working");
        assert!(stranded(&home, &none, true), "address removed");
        assert!(stranded(&home, &a, false), "no route to the peer");
        assert!(
            !stranded(&tracked("198.18.1.2:4000", true), &none, false),
            "a move is under way: the move's own hold covers it"
        );
        let moved = tracked("198.18.2.2:4000", false);
        assert!(stranded(&moved, &a, true), "the moved-to address is gone");
    }

    #[test]
    fn a_host_is_silent_after_unanswered_probes_and_back_when_it_answers() {
        let t = Instant::now();
        let k = [7u8; 32];
        let mut w = SilenceWatch::default();
        let waiting: HashSet<[u8; 32]> = [k].into();
        assert_eq!(w.tick(t, &waiting), vec![Action::Probe(k)]);
        // Not again before its time, however often asked.
        assert_eq!(w.tick(t + Duration::from_millis(500), &waiting), vec![]);
        assert_eq!(w.tick(t + PROBE_EVERY, &waiting), vec![Action::Probe(k)]);
        assert!(!w.is_silent(&k));
        assert_eq!(
            w.tick(t + 2 * PROBE_EVERY, &HashSet::new()),
            vec![Action::Silent(k)],
            "silent once the last probe went unanswered, waiting or not"
        );
        assert!(w.is_silent(&k));
        let later = t + 2 * PROBE_EVERY + SILENT_PROBE_EVERY;
        assert_eq!(w.tick(later, &HashSet::new()), vec![Action::Probe(k)]);
        assert_eq!(w.answered(&k, later), Some(Action::Back(k)));
        assert!(!w.is_silent(&k));
        // Answered: left alone for a while even if its sockets still wait.
        assert_eq!(w.tick(later + Duration::from_secs(1), &waiting), vec![]);
        assert_eq!(w.tick(later + ANSWERED_QUIET, &HashSet::new()), vec![]);
        assert!(!w.busy());
    }

    #[test]
    fn a_host_that_answers_in_time_is_never_silent() {
        let t = Instant::now();
        let k = [1u8; 32];
        let mut w = SilenceWatch::default();
        let waiting: HashSet<[u8; 32]> = [k].into();
        assert_eq!(w.tick(t, &waiting), vec![Action::Probe(k)]);
        assert_eq!(w.answered(&k, t + Duration::from_millis(3)), None);
        for s in 1..30 {
            assert_eq!(w.tick(t + Duration::from_secs(s), &HashSet::new()), vec![]);
        }
        // An answer from a host never watched leaves nothing behind.
        assert_eq!(w.answered(&[2u8; 32], t), None);
        assert!(!w.busy());
    }
}
