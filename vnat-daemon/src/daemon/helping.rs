//! Keep-alive helpers (issue 18, item 3; paper 3.3.1.3, VTL's zero-window
//! persist), what the driver decides on each side, without I/O:
//! - the host about to be away (`vnatctl suspend --helper NAME`) asks its
//!   peers through VCMP (`vcmp::help`) and tells them it is back once each
//!   connection works again (the keepalive hold's rule,
//!   `mobility::keepalive_release_due`);
//! - the peer runs what it allows (`peer_helpers`): "zero-window" answers
//!   for the absent end every [`ANSWER_EVERY`] with a zero window, so that
//!   its TCP waits in persist mode instead of retransmitting to death, and
//!   reopens the window (the one the absent end last advertised) when the
//!   end is back; "stop" stops the connection's local process until then;
//!   "hold" keeps the connection's packets in its socket (held at the tc
//!   egress: the socket sees a local send failure and keeps its data) for
//!   at most [`hold_limit`], for an end about to freeze, whose host would
//!   drop them.
//!   Help ends when the end says it is back, when the connection moves,
//!   when the end is heard from (the socket's byte counters move), when the
//!   connection closes, and after [`MAX_HELP`].

use std::time::{Duration, Instant};

use crate::datapath::PeerAnswer;
use crate::vcmp::help::{Help, HOLD, STOP, ZERO_WINDOW};

/// How often a zero-window answer is repeated: each one clears the count of
/// the socket's unanswered window probes, which backs off from 200 ms, so
/// that even a `tcp_retries2` of 2 is never reached between two.
pub const ANSWER_EVERY: Duration = Duration::from_millis(500);
/// How long a peer is helped at most.
pub const MAX_HELP: Duration = Duration::from_secs(24 * 3600);
/// How long a connection's packets are held for a peer at most, for a
/// host whose `net.ipv4.tcp_retries2` is `retries2`. A socket whose sends
/// fail locally tries again every 500 ms, and one waiting on a closed
/// window counts each try as an unanswered window probe: after
/// `tcp_retries2` of them (7.5 s by default) it gives up and the
/// connection is lost (seen in the hold test). So half that, at most 5 s:
/// a checkpoint and restore takes a few hundred ms. After it, the packets
/// leave again, to wherever the peer was.
pub fn hold_limit(retries2: u32) -> Duration {
    (Duration::from_millis(250) * retries2.max(1)).min(Duration::from_secs(5))
}
/// Counters no socket has: an answer "delivered only at these" is a
/// reading.
pub const READ_ONLY: (u64, u64) = (u64::MAX, u64::MAX);
/// The window reopened when the absent end's last one is unknown.
const DEFAULT_REOPEN: u32 = 65_535;

/// The part of `asked` this host runs (`allowed`: the `peer_helpers`
/// setting, which names the installed helpers peers may ask for too).
pub fn allowed(asked: &Help, allowed: &[String]) -> Help {
    let has = |n: &str| allowed.iter().any(|a| a == n);
    Help {
        zero_window: asked.zero_window && has(ZERO_WINDOW),
        stop: asked.stop && has(STOP),
        hold: asked.hold && has(HOLD),
        // Never a built-in's name taken for an installed helper's.
        user: asked
            .user
            .clone()
            .filter(|u| has(u) && u != ZERO_WINDOW && u != STOP && u != HOLD),
    }
}

/// A process stopped for an absent peer, held by a pidfd so that the
/// SIGCONT reaches that process and no other that took its pid.
#[derive(Debug)]
pub struct Stopped {
    pub pid: u32,
    pub pidfd: std::os::fd::OwnedFd,
    /// Its start time (/proc/PID/stat, clock ticks since boot), which
    /// tells it from a later process with its pid after a restart of
    /// vnatd (`restart_state`).
    pub start_time: u64,
}

/// Help this host gives a peer that is away, for one connection.
#[derive(Debug)]
pub struct Helping {
    pub help: Help,
    pub since: Instant,
    /// The socket's byte counters at the last look.
    pub counters: Option<(u64, u64)>,
    /// The peer has gone quiet (its counters held still for a look) and
    /// is being answered for: from now on, counters that move mean it is
    /// back. Before, the peer may still be talking (a suspend comes before
    /// the host leaves), and nothing is answered for it.
    pub quiet: bool,
    /// The window the absent end advertised last, before the first answer.
    pub peer_window: Option<u32>,
    /// The process stopped for it.
    pub stopped: Option<Stopped>,
    /// The socket's TCP_USER_TIMEOUT before the help held it (see
    /// [`USER_TIMEOUT_HOLD`]).
    pub user_timeout: Option<u32>,
    /// Until when the connection's packets are held ("hold", see
    /// [`hold_limit`]).
    pub held_until: Option<Instant>,
}

/// TCP_USER_TIMEOUT while a peer is helped (ms): the absence must not count
/// against `tcp_retries2` when the window opens again (a socket that
/// retransmitted before its window closed measures its timeout from its
/// first retransmission). Given back once the peer has acknowledged data
/// again, or after [`USER_TIMEOUT_GIVE_BACK`].
pub const USER_TIMEOUT_HOLD: u32 = 24 * 3600 * 1000;
pub const USER_TIMEOUT_GIVE_BACK: Duration = Duration::from_secs(600);

/// What an answer means for the help.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterAnswer {
    Keep,
    /// The end is back (its socket's counters moved, or the window it
    /// advertises is open again): end the help, leave the window as the
    /// end set it, and restart the socket's timers (backed off meanwhile).
    PeerBack,
    /// Our zero-window ACK did not take (the socket still saw an open
    /// window at the next look while nothing moved): answering for the
    /// peer does not work on this connection; end the help.
    NotTaken,
    /// The connection is gone.
    Gone,
}

impl Helping {
    pub fn new(help: Help, now: Instant) -> Helping {
        Helping {
            help,
            since: now,
            counters: None,
            quiet: false,
            peer_window: None,
            stopped: None,
            user_timeout: None,
            held_until: None,
        }
    }

    /// The hold has reached its limit at `now`.
    pub fn hold_overdue(&self, now: Instant) -> bool {
        self.held_until.is_some_and(|t| now >= t)
    }

    /// The counters a zero-window answer is delivered at: the last ones
    /// seen, so that it goes only to a socket whose peer stayed quiet
    /// since; at the first look none ([`READ_ONLY`]).
    pub fn deliver_if_still_at(&self) -> (u64, u64) {
        self.counters.unwrap_or(READ_ONLY)
    }

    /// Take in what a zero-window answer found.
    pub fn answered(&mut self, a: PeerAnswer) -> AfterAnswer {
        match a {
            PeerAnswer::Gone => AfterAnswer::Gone,
            // Only for an open window, which the periodic answer is not.
            PeerAnswer::Retransmitting => AfterAnswer::Keep,
            PeerAnswer::PeerActive { .. } if self.quiet => AfterAnswer::PeerBack,
            PeerAnswer::PeerActive { counters } => {
                // Still talking (not gone yet): look again.
                self.counters = Some(counters);
                AfterAnswer::Keep
            }
            PeerAnswer::Answered {
                counters,
                peer_window,
            } => {
                if !self.quiet {
                    // Before our first answer: the end's own window.
                    self.peer_window = peer_window;
                    self.quiet = true;
                    self.counters = Some(counters);
                    return AfterAnswer::Keep;
                }
                self.counters = Some(counters);
                // After one of our zero windows the socket should see 0.
                match peer_window {
                    Some(w) if w > 0 => AfterAnswer::NotTaken,
                    _ => AfterAnswer::Keep,
                }
            }
        }
    }

    /// The window to reopen with when the end is back by its word or by a
    /// move (it may not have sent anything yet): none if no zero window
    /// was ever delivered (the socket's view is the end's own).
    pub fn reopen_window(&self) -> Option<u32> {
        self.quiet.then(|| {
            self.peer_window
                .filter(|w| *w > 0)
                .unwrap_or(DEFAULT_REOPEN)
        })
    }

    pub fn expired(&self, now: Instant) -> bool {
        now.duration_since(self.since) >= MAX_HELP
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_allowed_helpers_run() {
        let asked = Help {
            zero_window: true,
            stop: true,
            hold: true,
            user: Some("notify".into()),
        };
        let z = allowed(&asked, &["zero-window".to_string()]);
        assert!(z.zero_window && !z.stop && z.user.is_none());
        let n = allowed(&asked, &["notify".to_string()]);
        assert!(!n.zero_window && n.user.as_deref() == Some("notify"));
        assert!(allowed(&asked, &[]).is_none());
        let both = allowed(&asked, &["zero-window".into(), "stop".into()]);
        assert!(both.zero_window && both.stop && !both.hold);
        assert_eq!(hold_limit(15), Duration::from_millis(3750));
        assert_eq!(hold_limit(3), Duration::from_millis(750));
        assert_eq!(hold_limit(0), Duration::from_millis(250));
        assert_eq!(hold_limit(100), Duration::from_secs(5));
        let hold = allowed(&asked, &["hold".into()]);
        assert!(hold.hold && !hold.zero_window && hold.user.is_none());
        // An installed helper cannot take a built-in's name.
        let named = Help {
            user: Some("hold".into()),
            ..Help::default()
        };
        assert!(allowed(&named, &["hold".into()]).is_none());
    }

    #[test]
    fn the_first_answer_keeps_the_ends_window_and_moved_counters_end_the_help() {
        let t = Instant::now();
        let mut h = Helping::new(
            Help {
                zero_window: true,
                ..Help::default()
            },
            t,
        );
        assert_eq!(
            h.reopen_window(),
            None,
            "nothing to reopen before a zero window"
        );
        assert_eq!(h.deliver_if_still_at(), READ_ONLY, "the first look reads");
        let a = |c, w| PeerAnswer::Answered {
            counters: c,
            peer_window: w,
        };
        // Still talking after the suspend: not back, not answered for.
        let moved = |c| PeerAnswer::PeerActive { counters: c };
        assert_eq!(h.answered(moved((1, 2))), AfterAnswer::Keep);
        assert_eq!(h.answered(moved((3, 4))), AfterAnswer::Keep);
        assert!(!h.quiet);
        assert_eq!(h.deliver_if_still_at(), (3, 4));
        assert_eq!(h.answered(a((5, 6), Some(4096))), AfterAnswer::Keep);
        assert!(h.quiet);
        // Our own zero window, seen by the next answer, is not the end's.
        assert_eq!(h.answered(a((5, 6), Some(0))), AfterAnswer::Keep);
        assert_eq!(h.reopen_window(), Some(4096));
        assert_eq!(h.counters, Some((5, 6)));
        // An open window at the next look: our ACK did not take.
        assert_eq!(h.answered(a((5, 6), Some(100))), AfterAnswer::NotTaken);
        assert_eq!(h.answered(moved((7, 8))), AfterAnswer::PeerBack);
        assert_eq!(h.answered(PeerAnswer::Gone), AfterAnswer::Gone);
        assert!(!h.expired(t));
        assert!(h.expired(t + MAX_HELP));
    }
}
