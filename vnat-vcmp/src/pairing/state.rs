//! Pairing's state and its API: the handshakes under way, the retries,
//! the cookie secrets and limits, the known hosts, and the timer table of
//! the handshakes' retransmissions and the retries. Its maps are private
//! to this module, so the protocol (`pairing/mod.rs`) changes them only
//! through methods that keep the timer table in step.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use crate::config::Config;
use crate::cookie::{CookieJar, PairLimiter, StartLimit};
use crate::crypto::{Ephemeral, PairKeys};
use crate::timers::TimerTable;
use crate::wire::COOKIE_LEN;
use crate::Timestamp;

/// Pairing's own state, owned by the endpoint: the handshakes under way
/// (per address and side), the last PAIR_FIN per address, the cookie
/// secrets, the DH and start limits, and the failed pairings to retry.
pub(crate) struct Pairings {
    /// Reached through [`Pairings::insert_handshake`] and its siblings,
    /// which keep `timers` in step.
    handshakes: HashMap<(SocketAddr, Side), Handshake>,
    pub fins: HashMap<SocketAddr, (u32, Vec<u8>)>,
    pub cookies: CookieJar,
    pub limit: PairLimiter,
    pub starts: StartLimit,
    /// By address: (failures so far, when to try next, `None` while an
    /// attempt is under way). Changed through [`Pairings::schedule_retry`]
    /// and its siblings.
    retry: HashMap<IpAddr, (u32, Option<Timestamp>)>,
    /// The handshakes' retransmissions and the retries, in deadline order.
    timers: TimerTable<PairTimer>,
    /// Host keys this host has paired with, now or before a restart (the
    /// daemon's `peers.json`): a PAIR_INIT with one is welcome from any
    /// address (see [`crate::Endpoint::knows_initiator`]).
    pub known_hosts: std::collections::HashSet<[u8; 32]>,
    /// The addresses those hosts last paired from: a record for a
    /// connection with one of them that we have no keys for is answered
    /// with ERROR unknown-connection (see `recv.rs`), nobody else's.
    pub known_addrs: std::collections::HashSet<IpAddr>,
    /// When we last paired again with an address we were paired with,
    /// because an update went unanswered (see [`crate::Endpoint::pair_again`]).
    pub renewals: HashMap<IpAddr, Timestamp>,
    /// When an ERROR unknown-connection from each address was last looked
    /// into (at most once a second: looking walks the connections).
    pub error_checks: HashMap<IpAddr, Timestamp>,
    /// Hosts paired from an address we share nothing with, on probation
    /// (`vcmp::strangers`).
    pub strangers: crate::strangers::Strangers,
}

impl Pairings {
    pub fn new(cfg: &Config) -> Pairings {
        Pairings {
            handshakes: HashMap::new(),
            fins: HashMap::new(),
            cookies: CookieJar::default(),
            limit: PairLimiter::new(cfg.pair_dh_per_sec, cfg.pair_dh_burst),
            starts: StartLimit::new(cfg.pair_starts_per_sec, cfg.pair_starts_burst),
            retry: HashMap::new(),
            timers: TimerTable::default(),
            known_hosts: std::collections::HashSet::new(),
            known_addrs: std::collections::HashSet::new(),
            renewals: HashMap::new(),
            error_checks: HashMap::new(),
            strangers: Default::default(),
        }
    }

    /// When pairing needs `handle_timeout` next: a handshake's
    /// retransmission, a retry or a stranger's probation.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        #[cfg(debug_assertions)]
        self.check_timers();
        [self.timers.next(), self.strangers.next_deadline()]
            .into_iter()
            .flatten()
            .min()
    }

    /// Every handshake's and retry's deadline is in the timer table, and
    /// nothing else is: a deadline changed behind the table's back panics
    /// here in tests instead of firing late.
    #[cfg(debug_assertions)]
    fn check_timers(&self) {
        for (&(addr, side), h) in &self.handshakes {
            let key = PairTimer::Handshake(addr, side);
            assert_eq!(self.timers.get(&key), Some(h.deadline()), "{key:?}");
        }
        let mut armed = self.handshakes.len();
        for (&ip, &(_, at)) in &self.retry {
            let key = PairTimer::Retry(ip);
            assert_eq!(self.timers.get(&key), at, "{key:?}");
            armed += usize::from(at.is_some());
        }
        assert_eq!(self.timers.len(), armed, "stale pairing timers");
    }

    /// Whether a handshake with the VCMP address `addr` is under way.
    pub fn with(&self, addr: SocketAddr) -> bool {
        self.has_handshake(addr, Side::Ours) || self.has_handshake(addr, Side::Theirs)
    }

    pub fn handshake(&self, addr: SocketAddr, side: Side) -> Option<&Handshake> {
        self.handshakes.get(&(addr, side))
    }

    /// Our handshake with `addr` whose PAIR_INIT had the id `id` echoes
    /// the responder's `cookie` from now on; its ephemeral key's public
    /// half, for the PAIR_INIT to send again at once. `None`: no such
    /// handshake of ours (the cookie was not asked for).
    pub fn set_cookie(
        &mut self,
        addr: SocketAddr,
        id: u32,
        cookie: [u8; COOKIE_LEN],
    ) -> Option<[u8; 32]> {
        match self.handshakes.get_mut(&(addr, Side::Ours)) {
            Some(Handshake::Initiator {
                id: iid,
                eph,
                cookie: c,
                ..
            }) if *iid == id => {
                *c = Some(cookie);
                Some(eph.public())
            }
            _ => None,
        }
    }

    pub fn has_handshake(&self, addr: SocketAddr, side: Side) -> bool {
        self.handshakes.contains_key(&(addr, side))
    }

    /// Handshakes under way, both sides (against `max_pending_pairings`).
    pub fn handshake_count(&self) -> usize {
        self.handshakes.len()
    }

    /// Hold `h` (replacing any with that address and side), due at its
    /// deadline.
    pub fn insert_handshake(&mut self, addr: SocketAddr, side: Side, h: Handshake) {
        self.timers
            .set(PairTimer::Handshake(addr, side), Some(h.deadline()));
        self.handshakes.insert((addr, side), h);
    }

    pub fn remove_handshake(&mut self, addr: SocketAddr, side: Side) -> Option<Handshake> {
        self.timers.set(PairTimer::Handshake(addr, side), None);
        self.handshakes.remove(&(addr, side))
    }

    /// Forget every handshake (for tests that start from a clean table).
    #[cfg(test)]
    pub fn clear_handshakes(&mut self) {
        let all: Vec<(SocketAddr, Side)> = self.handshakes.keys().copied().collect();
        for (addr, side) in all {
            self.remove_handshake(addr, side);
        }
    }

    /// The handshakes whose retransmission is due at `now`, earliest first.
    pub fn due_handshakes(&self, now: Timestamp) -> Vec<(SocketAddr, Side)> {
        let due = self.timers.due(now).into_iter();
        due.filter_map(|t| match t {
            PairTimer::Handshake(addr, side) => Some((addr, side)),
            PairTimer::Retry(_) => None,
        })
        .collect()
    }

    /// The pairings with `ip` that failed in a row so far.
    pub fn failures(&self, ip: IpAddr) -> u32 {
        self.retry.get(&ip).map_or(0, |r| r.0)
    }

    /// The retry kept for `ip`: failures so far, and when it is due
    /// (`None`: an attempt is under way).
    pub fn retry_of(&self, ip: IpAddr) -> Option<(u32, Option<Timestamp>)> {
        self.retry.get(&ip).copied()
    }

    pub fn has_retries(&self) -> bool {
        !self.retry.is_empty()
    }

    /// Pair with `ip` again at `at` (`None`: an attempt is under way),
    /// after `failures` failed pairings.
    pub fn schedule_retry(&mut self, ip: IpAddr, failures: u32, at: Option<Timestamp>) {
        self.timers.set(PairTimer::Retry(ip), at);
        self.retry.insert(ip, (failures, at));
    }

    /// An attempt with `ip` is under way: its retry, if one is kept, is
    /// not due until the attempt fails.
    pub fn attempting(&mut self, ip: IpAddr) {
        if let Some(failures) = self.retry.get(&ip).map(|r| r.0) {
            self.schedule_retry(ip, failures, None);
        }
    }

    /// Paired, or nothing waits for it any more: no retry with `ip`.
    pub fn forget_retry(&mut self, ip: IpAddr) {
        self.timers.set(PairTimer::Retry(ip), None);
        self.retry.remove(&ip);
    }

    /// The addresses whose retry is due at `now`.
    pub fn due_retries(&self, now: Timestamp) -> Vec<IpAddr> {
        let due = self.timers.due(now).into_iter();
        due.filter_map(|t| match t {
            PairTimer::Retry(ip) => Some(ip),
            PairTimer::Handshake(..) => None,
        })
        .collect()
    }

    /// Handshakes we answer (what "loaded" counts).
    pub fn answering(&self) -> usize {
        self.handshakes
            .keys()
            .filter(|(_, side)| *side == Side::Theirs)
            .count()
    }
}

/// Whose handshake with an address: the one we started, or theirs that we
/// answer. Both may be under way at once (crossing initiations), and
/// answering theirs never touches ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Side {
    Ours,
    Theirs,
}

/// What pairing's timer table holds (see [`Pairings::next_deadline`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum PairTimer {
    /// A handshake's next retransmission, or its end.
    Handshake(SocketAddr, Side),
    /// A failed pairing's next attempt.
    Retry(IpAddr),
}

pub(crate) enum Handshake {
    Initiator {
        id: u32,
        eph: Ephemeral,
        /// The responder's cookie, once it asked for one.
        cookie: Option<[u8; COOKIE_LEN]>,
        tries: u32,
        deadline: Timestamp,
    },
    Responder {
        id: u32,
        init_static: [u8; 32],
        keys: PairKeys,
        resp: Vec<u8>,
        tries: u32,
        deadline: Timestamp,
    },
}

impl Handshake {
    pub fn deadline(&self) -> Timestamp {
        match self {
            Handshake::Initiator { deadline, .. } | Handshake::Responder { deadline, .. } => {
                *deadline
            }
        }
    }
}
