//! PROBE: keepalives between paired hosts, and how each sees the other
//! (DESIGN.md section 4, identity and NAT).
//!
//! A host sends its paired peer a PROBE once right after pairing, and then
//! every `keepalive_interval` while it holds mobile connections with that
//! peer and is behind a NAT (the peer sees it at another address than its
//! own). The answer carries the address and port the probe came from, as
//! STUN's reflexive address. So a host learns that it is behind a NAT and
//! where, and its NAT keeps the mapping that lets the peer reach its vnatd
//! (to validate a new address, to answer an update). Both directions are
//! tagged under the pairing's claim key; probes carry a sequence number,
//! so a replayed one changes nothing, and only a fresh authenticated probe
//! moves where this host sends to the peer. Both also tell the sender's
//! own addresses, where its peer may reach it in the other IP family
//! (`vcmp::family`).

use crate::stats::{Counter, Reject};
use std::net::SocketAddr;

use super::crypto;
use super::endpoint::Endpoint;
use super::wire::{Message, PAIR_TAG_LEN};
use super::Timestamp;

/// What the probes told about one paired host.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct ProbeState {
    /// Last sequence number sent, and whether its answer came.
    pub sent_seq: u64,
    pub answered: bool,
    /// Highest sequence number received from the peer.
    pub recv_seq: u64,
    /// Where the peer saw our last answered probe come from.
    pub reflexive: Option<SocketAddr>,
    /// When a fresh, authentic probe, probe answer or connection record
    /// of it last arrived.
    pub last_heard: Option<Timestamp>,
}

impl Endpoint {
    /// Send a probe to `peer` (a paired host's key) at its VCMP address.
    pub(crate) fn send_probe(&mut self, peer: [u8; 32]) {
        let (Some(secret), Some(dst)) = (self.sessions.get(&peer), self.peer_addrs.get(&peer))
        else {
            return;
        };
        let (key, dst) = (secret.claim_key(), *dst);
        let st = self.probes.entry(peer).or_default();
        st.sent_seq += 1;
        st.answered = false;
        let seq = st.sent_seq;
        let msg = Message::Probe {
            static_pub: self.identity.public(),
            seq,
            observed: None,
            addrs: self.host_addrs.clone(),
            tag: [0; PAIR_TAG_LEN],
        };
        if let Ok(b) = msg.encode() {
            self.push_tagged(&key, b, dst);
            self.stats.count(Counter::ProbesSent);
        }
    }

    /// Ask whether the paired host `peer` is there (issue 32: the driver
    /// watches for hosts gone silent): a PROBE now, whose answer comes as
    /// [`Event::ProbeAnswered`]. False if this host is not paired with it.
    ///
    /// [`Event::ProbeAnswered`]: crate::Event::ProbeAnswered
    pub fn probe_host(&mut self, peer: &[u8; 32]) -> bool {
        if !self.sessions.contains_key(peer) || !self.peer_addrs.contains_key(peer) {
            return false;
        }
        self.send_probe(*peer);
        true
    }

    /// Tag `b` (a PROBE or CLAIM with a zero tag) and queue it to `dst`.
    pub(crate) fn push_tagged(&mut self, key: &crypto::SecretKey, mut b: Vec<u8>, dst: SocketAddr) {
        crypto::tag_datagram(key, &mut b);
        self.tx.push_datagram(dst, b, &mut self.stats);
    }

    /// A PROBE or its answer from `from`; `bytes` is the whole datagram.
    /// True if it was authentic and fresh (what it tells may be taken).
    pub(crate) fn on_probe(
        &mut self,
        now: Timestamp,
        from: SocketAddr,
        peer: [u8; 32],
        seq: u64,
        observed: Option<SocketAddr>,
        bytes: &[u8],
    ) -> bool {
        let Some(secret) = self.sessions.get(&peer) else {
            self.stats.reject(Reject::ProbeUnpaired);
            return false;
        };
        let key = secret.claim_key();
        if !crypto::datagram_tag_valid(&key, bytes) {
            self.stats.reject(Reject::ProbeBadTag);
            return false;
        }
        let st = self.probes.entry(peer).or_default();
        match observed {
            None => {
                if seq <= st.recv_seq {
                    self.stats.reject(Reject::ProbeReplayed);
                    return false;
                }
                st.recv_seq = seq;
                st.last_heard = Some(now);
                // Fresh and authentic: the peer's VCMP is reachable there
                // now (a NAT may have given it a new mapping).
                self.peer_addrs.insert(peer, from);
                let answer = Message::Probe {
                    static_pub: self.identity.public(),
                    seq,
                    observed: Some(from),
                    addrs: self.host_addrs.clone(),
                    tag: [0; PAIR_TAG_LEN],
                };
                if let Ok(b) = answer.encode() {
                    self.push_tagged(&key, b, from);
                    self.stats.count(Counter::ProbesAnswered);
                }
            }
            Some(reflexive) => {
                if seq != st.sent_seq || st.answered {
                    self.stats.reject(Reject::ProbeUnexpectedAnswer);
                    return false;
                }
                st.answered = true;
                st.reflexive = Some(reflexive);
                st.last_heard = Some(now);
                self.stats.count(Counter::ProbeAnswers);
                self.emit(crate::Event::ProbeAnswered { key: peer });
            }
        }
        true
    }

    /// When `peer` (a paired host's key) was last heard from: a fresh,
    /// authentic probe, probe answer (keepalives are probes) or connection
    /// record of it; None if never since this endpoint started.
    pub fn last_heard(&self, peer: &[u8; 32]) -> Option<Timestamp> {
        self.probes.get(peer).and_then(|p| p.last_heard)
    }

    /// Where `peer` last saw this host's VCMP come from, if a probe told.
    pub fn reflexive_address(&self, peer: &[u8; 32]) -> Option<SocketAddr> {
        self.probes.get(peer).and_then(|p| p.reflexive)
    }

    /// Whether this host is behind a NAT as `peer` sees it: the peer names
    /// one of our connections by another address than ours, or saw our
    /// VCMP come from an address that none of our connections with it use.
    pub fn behind_nat(&self, peer: &[u8; 32]) -> bool {
        let mut ours = self
            .conns
            .values()
            .filter(|c| c.peer_key.as_ref() == Some(peer));
        let named_otherwise = ours.clone().any(|c| {
            c.peer_named()
                .is_some_and(|n| n.local.ip() != c.local_phys.ip())
        });
        let reflexive_foreign = self
            .reflexive_address(peer)
            .is_some_and(|r| !ours.any(|c| c.local_phys.ip() == r.ip()));
        named_otherwise || reflexive_foreign
    }

    /// Keepalives due at `now`: a probe to each paired host we are behind a
    /// NAT from and hold mobile connections with.
    pub(crate) fn keepalive_timeouts(&mut self, now: Timestamp) {
        let interval = self.cfg.keepalive_interval;
        if interval.is_zero() || now < self.next_keepalive {
            return;
        }
        self.next_keepalive = now.plus(interval);
        let due: Vec<[u8; 32]> = self
            .sessions
            .keys()
            .filter(|k| {
                self.conns
                    .values()
                    .any(|c| c.peer_key.as_ref() == Some(*k) && c.keys.is_some())
            })
            .filter(|k| self.behind_nat(k))
            .copied()
            .collect();
        for peer in due {
            self.send_probe(peer);
            self.stats.count(Counter::KeepalivesSent);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::endpoint::{Config, Event};
    use super::super::sim::Link;
    use super::super::sim_tests::setup;

    #[test]
    fn a_probed_host_is_reported_when_it_answers_and_not_when_it_is_gone() {
        let (mut sim, _) = setup(41, Link::default(), Config::default(), 1);
        let (a, b) = (0, 1);
        let bkey = sim.hosts[b].ep.public_key();
        let answered = |sim: &super::super::sim::Sim| {
            sim.events(
                a,
                |e| matches!(e, Event::ProbeAnswered { key } if *key == bkey),
            )
            .count()
        };
        let before = answered(&sim);
        assert!(sim.with(a, |ep, _, _| ep.probe_host(&bkey)));
        sim.run_for(Duration::from_secs(1));
        assert_eq!(answered(&sim), before + 1, "B answers A's probe");
        // B is gone: the probe goes, nothing comes back.
        sim.hosts[b].alive = false;
        assert!(sim.with(a, |ep, _, _| ep.probe_host(&bkey)));
        sim.run_for(Duration::from_secs(5));
        assert_eq!(
            answered(&sim),
            before + 1,
            "no answer from a host that is gone"
        );
        // A host never paired with is not probed.
        assert!(!sim.with(a, |ep, _, _| ep.probe_host(&[9u8; 32])));
    }
}
