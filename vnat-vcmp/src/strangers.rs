//! Pairing with a host we share no address with: a stranger.
//!
//! A PAIR_INIT is normally answered only from an address one of our
//! connections names (or a pinned or known host). Behind a NAT that is
//! the NAT's address, which is also where the other host's vnatd speaks
//! from. A container whose address its host routes (no NAT) breaks that:
//! our connection names the container's address, where nothing answers
//! VCMP, and the container's host pairs from its own address. Such a host
//! is a stranger here, and its connection would stay immobile.
//!
//! So while a connection of ours waits for a host that does not answer at
//! the connection's address (its pairing failed) and the connection can
//! be claimed only with what its two ends know (a strong binding, TCP's
//! sequence numbers), a stranger may pair, proving its address with a
//! cookie first. Its session is provisional: it counts for nothing (no
//! known host, no trusted address, no `Paired` event) until one of its
//! claims binds a connection, and it is dropped if none does within
//! [`STRANGER_GRACE`]. At most [`MAX_STRANGERS`] are held at once, so a
//! stranger costs a bounded table entry and one claim index, never a
//! lasting place in this host's state.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use crate::stats::{Counter, Reject};

use super::endpoint::{Endpoint, Event};
use super::pairing::{Handshake, Side};
use super::Timestamp;

/// Provisional sessions held at once.
pub const MAX_STRANGERS: usize = 64;

/// How long a stranger's session may bind nothing before it is dropped.
pub const STRANGER_GRACE: Duration = Duration::from_secs(30);

/// How long an answer to "does a connection wait for a stranger" is kept:
/// finding out walks the connections.
const WANTED_CHECK: Duration = Duration::from_secs(1);

/// The strangers' provisional sessions, owned by pairing.
#[derive(Default)]
pub(crate) struct Strangers {
    /// By host key: when its session goes unless it bound a connection.
    pending: HashMap<[u8; 32], Timestamp>,
    /// The last answer of [`Endpoint::strangers_wanted`], and when.
    wanted: Option<(Timestamp, bool)>,
}

impl Strangers {
    #[cfg(test)]
    pub fn is_pending(&self, key: &[u8; 32]) -> bool {
        self.pending.contains_key(key)
    }

    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.pending.values().min().copied()
    }
}

impl Endpoint {
    /// Whether some connection waits for a host that does not answer at
    /// its address: no peer, a binding only its two ends can make, and our
    /// pairing with its address failed or went unanswered at least once.
    fn strangers_wanted(&mut self, now: Timestamp) -> bool {
        if let Some((at, wanted)) = self.pairing.strangers.wanted {
            if now.since(at) < WANTED_CHECK {
                return wanted;
            }
        }
        let port = self.cfg.port;
        let pairing = &self.pairing;
        let unanswered = |ip: IpAddr| {
            pairing
                .retry
                .get(&ip)
                .is_some_and(|(failures, _)| *failures > 0)
                || matches!(
                    pairing.handshakes.get(&(SocketAddr::new(ip, port), Side::Ours)),
                    Some(Handshake::Initiator { tries, .. }) if *tries > 1
                )
        };
        let wanted = (!pairing.retry.is_empty() || !pairing.handshakes.is_empty())
            && self.conns.values().any(|c| {
                c.peer_key.is_none() && c.binding.is_strong() && unanswered(c.remote_phys.ip())
            });
        self.pairing.strangers.wanted = Some((now, wanted));
        wanted
    }

    /// Whether a PAIR_INIT from a stranger may go on (to the cookie, then
    /// the DH); counts the refusal if not.
    pub(crate) fn admits_stranger(&mut self, now: Timestamp) -> bool {
        if !self.strangers_wanted(now) {
            self.stats.reject(Reject::PairUnknownSource);
            return false;
        }
        if self.pairing.strangers.pending.len() >= MAX_STRANGERS {
            self.stats.reject(Reject::StrangersFull);
            return false;
        }
        true
    }

    /// A stranger completed a pairing: hold its session until it binds a
    /// connection or [`STRANGER_GRACE`] ends.
    pub(crate) fn stranger_paired(&mut self, key: [u8; 32], now: Timestamp) {
        self.pairing
            .strangers
            .pending
            .insert(key, now.plus(STRANGER_GRACE));
        self.stats.count(Counter::StrangerPaired);
    }

    /// A claim of the stranger `key`, paired from `ip`, bound a connection:
    /// from now on it is a peer like any other.
    pub(crate) fn promote_stranger(&mut self, key: [u8; 32], ip: IpAddr) {
        if self.pairing.strangers.pending.remove(&key).is_none() {
            return;
        }
        self.pairing.known_hosts.insert(key);
        self.pairing.known_addrs.insert(ip);
        self.tx.trusted.insert(ip);
        self.stats.count(Counter::StrangerPromoted);
        self.emit(Event::Paired { peer: ip, key });
    }

    /// Drop the strangers whose grace ended with nothing bound.
    pub(crate) fn stranger_timeouts(&mut self, now: Timestamp) {
        let due: Vec<[u8; 32]> = self
            .pairing
            .strangers
            .pending
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(k, _)| *k)
            .collect();
        for key in due {
            self.pairing.strangers.pending.remove(&key);
            self.sessions.remove(&key);
            self.peer_addrs.remove(&key);
            self.probes.remove(&key);
            self.claim_index.remove(&key);
            self.binds.forget(&key);
            self.stats.count(Counter::StrangerDropped);
        }
    }
}
