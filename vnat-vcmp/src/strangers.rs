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
//! cookie first. Its claim binds the connection only once it also showed
//! it receives at the connection's address (`vcmp::proof`: whoever once
//! saw the handshake knows the sequence numbers). Its session is provisional: it counts for nothing (no
//! known host, no trusted address, no `Paired` event) until one of its
//! claims binds a connection, and it is dropped if none does within
//! [`STRANGER_GRACE`]. At most [`MAX_STRANGERS`] are held at once, so a
//! stranger costs a bounded table entry and one claim index, never a
//! lasting place in this host's state.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use crate::stats::{Counter, Reject};

use super::cookie::Source;
use super::endpoint::{Endpoint, Event};
use super::pairing::{Handshake, Side};
use super::Timestamp;

/// Provisional sessions held at once.
pub const MAX_STRANGERS: usize = 64;

/// Provisional sessions held at once from one source (an IPv4 address, an
/// IPv6 /64), so that one host cannot take every place.
pub const MAX_STRANGERS_PER_SOURCE: usize = 4;

/// How long a stranger's session may bind nothing before it is dropped.
pub const STRANGER_GRACE: Duration = Duration::from_secs(30);

/// How long an answer to "does a connection wait for a stranger" is kept:
/// finding out walks the connections.
const WANTED_CHECK: Duration = Duration::from_secs(1);

/// One provisional session: when it goes unless it bound a connection, and
/// the address it proved with its cookie.
struct Pending {
    deadline: Timestamp,
    ip: IpAddr,
}

/// The strangers' provisional sessions, owned by pairing.
#[derive(Default)]
pub(crate) struct Strangers {
    /// By host key.
    pending: HashMap<[u8; 32], Pending>,
    /// The last answer of [`Endpoint::strangers_wanted`], and when.
    wanted: Option<(Timestamp, bool)>,
    /// The addresses each host proved it receives at (`vcmp::proof`): a
    /// stranger's claim binds only a connection at one of them.
    pub proofs: crate::proof::Proofs,
}

impl Strangers {
    pub fn is_pending(&self, key: &[u8; 32]) -> bool {
        self.pending.contains_key(key)
    }

    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.pending.values().map(|p| p.deadline).min()
    }

    /// Whether one more stranger from `ip` fits under both caps.
    fn fits(&self, ip: IpAddr) -> bool {
        let source = Source::of(ip);
        self.pending.len() < MAX_STRANGERS
            && self
                .pending
                .values()
                .filter(|p| Source::of(p.ip) == source)
                .count()
                < MAX_STRANGERS_PER_SOURCE
    }

    /// The host `key` is forgotten (`forget_peer`).
    pub fn forget(&mut self, key: &[u8; 32]) {
        self.pending.remove(key);
        self.proofs.forget(key);
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
            pairing.failures(ip) > 0
                || matches!(
                    pairing.handshake(SocketAddr::new(ip, port), Side::Ours),
                    Some(Handshake::Initiator { tries, .. }) if *tries > 1
                )
        };
        let wanted = (pairing.has_retries() || pairing.handshake_count() > 0)
            && self.conns.values().any(|c| {
                c.peer_key.is_none() && c.binding.is_strong() && unanswered(c.remote_phys.ip())
            });
        self.pairing.strangers.wanted = Some((now, wanted));
        wanted
    }

    /// Whether a PAIR_INIT from a stranger at `ip` may go on (to the
    /// cookie, then the DH); counts the refusal if not.
    pub(crate) fn admits_stranger(&mut self, ip: IpAddr, now: Timestamp) -> bool {
        if !self.strangers_wanted(now) {
            self.stats.reject(Reject::PairUnknownSource);
            return false;
        }
        self.stranger_fits(ip)
    }

    /// Whether one more stranger from `ip` fits (checked again when its
    /// pairing completes: several may have been under way at once).
    pub(crate) fn stranger_fits(&mut self, ip: IpAddr) -> bool {
        if self.pairing.strangers.fits(ip) {
            return true;
        }
        self.stats.reject(Reject::StrangersFull);
        false
    }

    /// A stranger completed a pairing from `ip`: hold its session until it
    /// binds a connection or [`STRANGER_GRACE`] ends (a pairing again does
    /// not extend it).
    pub(crate) fn stranger_paired(&mut self, key: [u8; 32], ip: IpAddr, now: Timestamp) {
        self.pairing
            .strangers
            .pending
            .entry(key)
            .or_insert(Pending {
                deadline: now.plus(STRANGER_GRACE),
                ip,
            });
        self.stats.count(Counter::StrangerPaired);
    }

    /// A claim or BIND of `key` bound a connection: if it is a stranger, it
    /// is a peer like any other from now on, at the address it proved.
    pub(crate) fn promote_stranger(&mut self, key: [u8; 32]) {
        let Some(p) = self.pairing.strangers.pending.remove(&key) else {
            return;
        };
        self.pairing.known_hosts.insert(key);
        self.pairing.known_addrs.insert(p.ip);
        self.tx.trusted.insert(p.ip);
        self.stats.count(Counter::StrangerPromoted);
        self.stats.count(Counter::Paired);
        self.emit(Event::Paired { peer: p.ip, key });
    }

    /// Drop the strangers whose grace ended with nothing bound.
    pub(crate) fn stranger_timeouts(&mut self, now: Timestamp) {
        let due: Vec<[u8; 32]> = self
            .pairing
            .strangers
            .pending
            .iter()
            .filter(|(_, p)| p.deadline <= now)
            .map(|(k, _)| *k)
            .collect();
        for key in due {
            self.pairing.strangers.pending.remove(&key);
            // What it was asked to prove goes too: strangers come and go,
            // and their asks must not fill the table for the next ones.
            self.pairing.strangers.proofs.forget(&key);
            self.sessions.remove(&key);
            self.peer_addrs.remove(&key);
            self.probes.remove(&key);
            self.claim_index.remove(&key);
            self.binds.forget(&key);
            // Nothing should be bound to it (binding promotes); should
            // anything be, it waits for a peer again rather than keep keys
            // of a session that is gone.
            for c in self.conns.values_mut() {
                if c.peer_key == Some(key) {
                    c.peer_key = None;
                    c.keys = None;
                    c.prev_keys = None;
                }
            }
            self.stats.count(Counter::StrangerDropped);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_source_takes_at_most_its_share_and_all_together_at_most_the_cap() {
        let mut s = Strangers::default();
        let add = |s: &mut Strangers, n: u8, ip: &str| {
            s.pending.insert(
                [n; 32],
                Pending {
                    deadline: Timestamp(0),
                    ip: ip.parse().unwrap(),
                },
            );
        };
        for n in 0..MAX_STRANGERS_PER_SOURCE as u8 {
            assert!(s.fits("2001:db8:1:1::7".parse().unwrap()));
            add(&mut s, n, &format!("2001:db8:1:1::{}", n + 1));
        }
        // The same /64 under another address is the same source.
        assert!(!s.fits("2001:db8:1:1::ffff".parse().unwrap()));
        assert!(s.fits("2001:db8:1:2::1".parse().unwrap()));
        for n in 0..(MAX_STRANGERS - MAX_STRANGERS_PER_SOURCE) as u8 {
            add(&mut s, 100 + n, &format!("10.0.{n}.1"));
        }
        assert!(!s.fits("192.0.2.1".parse().unwrap()), "the table is full");
        s.forget(&[100; 32]);
        assert!(s.fits("192.0.2.1".parse().unwrap()));
    }
}
