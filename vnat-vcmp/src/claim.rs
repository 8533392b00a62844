//! CLAIM: binding connections to a paired host by what it knows of them
//! (see `vcmp::binding` for the facts, DESIGN.md section 4 for the rules).
//!
//! After pairing, and for every later connection with a paired host, each
//! side sends the other the commitments of its connections that have no
//! peer yet and whose binding only their two ends can know (TCP's initial
//! sequence numbers): the commitment alone, no names, since the host paired
//! from the connection's address may be another host behind the same NAT.
//! The receiver binds each of its own connections whose commitment it
//! finds, and answers (once) with its commitments for them and its names
//! for them, now that they are bound to the claimant; the claimant binds
//! on that answer and sends its own names back. A connection is bound to
//! one host key for life: a claim for a connection bound to another key
//! changes nothing and is counted (`claim_conflict`). Claims are taken only
//! from the address the claimant's session is at, within a budget per
//! host, and resent on a timer while a connection has no peer.
//!
//! A binding made of endpoints (UDP) is never claimed: its commitment
//! would let the receiver test guesses of its ports. UDP flows are bound
//! by in-band BIND (`vcmp::bind`), whose answer travels in a CLAIM answer
//! entry carrying the proof of the BIND's token.

use crate::stats::{Counter, Reject};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use super::crypto::{self, claim_commitment, SecretKey};
use super::endpoint::{Ctx, Endpoint, Event};
use super::wire::{ClaimEntry, Message, MAX_CLAIMS, PAIR_TAG_LEN, TAG_LEN};
use super::Timestamp;
use crate::flow::VirtualFlow;

/// Commitments of this host's connections under one pairing: built at the
/// first claim from that host, then kept up to date as connections come
/// and go, so that a claim costs a lookup per commitment, not an HMAC per
/// connection.
#[derive(Default)]
pub(crate) struct ClaimIndex {
    pub(crate) by_commitment: HashMap<[u8; TAG_LEN], VirtualFlow>,
}

impl Endpoint {
    /// Send `flows`' commitments to the host `peer` at `dst`, in datagrams
    /// of at most [`MAX_CLAIMS`].
    pub(crate) fn send_claims(
        &mut self,
        peer: [u8; 32],
        dst: SocketAddr,
        flows: &[VirtualFlow],
        answer: bool,
    ) {
        let Some(secret) = self.sessions.get(&peer) else {
            return;
        };
        let key = secret.claim_key();
        let me = self.identity.public();
        // Strong bindings only; names only to the host the connection is
        // bound to.
        let entries: Vec<ClaimEntry> = flows
            .iter()
            .filter_map(|f| self.conns.get(f))
            .filter(|c| c.binding.is_strong())
            .map(|c| ClaimEntry {
                commitment: claim_commitment(&key, &me, &c.binding),
                proto: c.flow.proto,
                names: (c.peer_key == Some(peer)).then_some([c.flow.local, c.flow.remote]),
            })
            .collect();
        for chunk in entries.chunks(MAX_CLAIMS) {
            let msg = Message::Claim {
                answer,
                static_pub: self.identity.public(),
                entries: chunk.to_vec(),
                tag: [0; PAIR_TAG_LEN],
            };
            let Ok(b) = msg.encode() else { continue };
            self.push_tagged(&key, b, dst);
            self.stats.count(Counter::ClaimsSent);
        }
    }

    /// Claim `flows` (connections without a peer, all with a remote end at
    /// `ip`) to every host paired from `ip`, and arm their retry timers.
    pub(crate) fn claim_at(&mut self, now: Timestamp, ip: IpAddr, flows: &[VirtualFlow]) {
        if flows.is_empty() {
            return;
        }
        for peer in self.sessions_at(ip) {
            if let Some(dst) = self.peer_addrs.get(&peer).copied() {
                self.send_claims(peer, dst, flows, false);
            }
        }
        self.request_udp_binds(ip, flows);
        let (initial, max) = (self.cfg.initial_rto, self.cfg.max_rto);
        for f in flows {
            let Some(c) = self.conns.get_mut(f).filter(|c| c.peer_key.is_none()) else {
                continue;
            };
            let tries = c.bind_retry.map_or(0, |r| r.0) + 1;
            let wait = initial.saturating_mul(1u32 << (tries - 1).min(16)).min(max);
            c.bind_retry = Some((tries, now.plus(wait)));
            self.rearm(f);
        }
    }

    /// Send the claims of the connections added since the last call, to
    /// each address in datagrams of up to [`MAX_CLAIMS`] (a resync that
    /// adds thousands of connections sends a few datagrams, not one each).
    pub(crate) fn flush_due_claims(&mut self, now: Timestamp) {
        for (ip, flows) in std::mem::take(&mut self.claims_due) {
            self.claim_at(now, ip, &flows);
        }
    }

    /// Keep every built index in step with a connection added (`true`) or
    /// removed.
    pub(crate) fn index_connection(&mut self, flow: &VirtualFlow, added: bool) {
        let Some(binding) = self.conns.get(flow).map(|c| c.binding) else {
            return;
        };
        for (peer, index) in self.claim_index.iter_mut() {
            let Some(secret) = self.sessions.get(peer) else {
                continue;
            };
            // What that host's claims carry (their sender is it).
            let commitment = claim_commitment(&secret.claim_key(), peer, &binding);
            if added {
                index.by_commitment.insert(commitment, *flow);
            } else {
                index.by_commitment.remove(&commitment);
            }
        }
    }

    /// Connections without a peer whose remote end is at `ip`.
    pub(crate) fn unbound_at(&self, ip: IpAddr) -> Vec<VirtualFlow> {
        self.conns
            .values()
            .filter(|c| c.peer_key.is_none() && c.remote_phys.ip() == ip)
            .map(|c| c.flow)
            .collect()
    }

    /// Host keys with a session whose host paired from `ip`.
    pub(crate) fn sessions_at(&self, ip: IpAddr) -> Vec<[u8; 32]> {
        self.peer_addrs
            .iter()
            .filter(|(k, a)| a.ip() == ip && self.sessions.contains_key(*k))
            .map(|(k, _)| *k)
            .collect()
    }

    /// One CLAIM datagram from `from`. `bytes` is the whole datagram.
    pub(crate) fn on_claim(
        &mut self,
        now: Timestamp,
        from: SocketAddr,
        answer: bool,
        peer: [u8; 32],
        entries: &[ClaimEntry],
        bytes: &[u8],
    ) {
        let Some(secret) = self.sessions.get(&peer) else {
            self.stats.reject(Reject::ClaimUnpaired);
            return;
        };
        let key = secret.claim_key();
        if !crypto::datagram_tag_valid(&key, bytes) {
            self.stats.reject(Reject::ClaimBadTag);
            return;
        }
        // From where its session is: a claim from anywhere else is a
        // replay, or forged by someone who can send from there.
        if self.peer_addrs.get(&peer) != Some(&from) {
            self.stats.reject(Reject::ClaimWrongAddress);
            return;
        }
        self.refresh_claim_index(&peer, &key);
        // The budget bounds what a paired host can make us do again and
        // again; a claim that binds one of our connections to it, or tells
        // us its names for one for the first time, is work each connection
        // asks once, which a peer with 100,000 connections to us asks in
        // thousands of datagrams at once (charged, but never refused).
        if !self.binds.claims.allow(&peer, now, 1) && !self.claim_is_news(&peer, entries) {
            self.stats.reject(Reject::PeerOverBudget);
            return;
        }
        let mut matched: Vec<(VirtualFlow, ClaimEntry)> = Vec::new();
        let mut unmatched = 0u64;
        for e in entries {
            if answer && self.on_bind_answer(now, peer, e) {
                continue;
            }
            let index = self.claim_index.get(&peer);
            match index.and_then(|i| i.by_commitment.get(&e.commitment)) {
                Some(f) => matched.push((*f, *e)),
                None => unmatched += 1,
            }
        }
        let mut mine = Vec::with_capacity(matched.len());
        let mut newly = Vec::new();
        let mut conflict: Option<([u8; 32], usize)> = None;
        for (flow, entry) in matched {
            // Bound only by a host that receives at its address
            // (`vcmp::proof`): knowing its facts is not enough.
            if entry.proto == flow.proto && !self.claimant_holds_address(peer, &flow) {
                continue;
            }
            let Some(c) = self.conns.get_mut(&flow) else {
                continue;
            };
            // A claim must name the same protocol; the names may differ
            // (a NAT between the ends), the protocol may not.
            if entry.proto != flow.proto {
                self.stats.reject(Reject::ClaimWrongProtocol);
                continue;
            }
            match c.peer_key {
                Some(k) if k == peer => {
                    if let Some(names) = entry.names {
                        self.learn_peer_view(&flow, names);
                    }
                    mine.push(flow);
                }
                Some(holder) => {
                    // Held by another host: never taken away.
                    self.stats.reject(Reject::ClaimConflict);
                    let n = conflict.map_or(0, |c| c.1);
                    conflict = Some((holder, n + 1));
                }
                // A binding made of endpoints can be guessed: never bound
                // by a claim (UDP binds in band, `vcmp::bind`).
                None if !c.binding.is_strong() => {
                    self.stats.reject(Reject::ClaimWeakBinding);
                }
                None => {
                    c.peer_key = Some(peer);
                    c.bind_retry = None;
                    self.stats.count(Counter::ClaimsBound);
                    if let Some(names) = entry.names {
                        self.learn_peer_view(&flow, names);
                    }
                    self.ensure_keys(&flow);
                    self.rearm(&flow);
                    mine.push(flow);
                    newly.push(flow);
                    // A stranger's first bound connection makes it a peer.
                    self.promote_stranger(peer);
                }
            }
        }
        if let Some((holder, connections)) = conflict {
            self.emit(Event::ClaimConflict {
                peer: from.ip(),
                claimant: peer,
                holder,
                connections,
            });
        }
        if !answer && !mine.is_empty() {
            // Answered with our commitments and, now that they are bound
            // to the claimant, our names.
            self.send_claims(peer, from, &mine, true);
        } else if answer && !newly.is_empty() {
            // Bound on its answer: our names for them, which it has not
            // had (our claim carried none).
            self.send_claims(peer, from, &newly, true);
        }
        if unmatched > 0 {
            // Connections we do not have (closed, or guessed).
            self.stats.count_n(Counter::ClaimUnmatched, unmatched);
        }
    }

    /// Whether some entry of a CLAIM from `peer` would bind one of our
    /// connections or name it for the first time (the index is built).
    fn claim_is_news(&self, peer: &[u8; 32], entries: &[ClaimEntry]) -> bool {
        let Some(index) = self.claim_index.get(peer) else {
            return false;
        };
        entries.iter().any(|e| {
            index
                .by_commitment
                .get(&e.commitment)
                .and_then(|f| self.conns.get(f))
                .is_some_and(|c| match (c.peer_key, e.names) {
                    // One it would bind (the claimant's proof of its
                    // address aside: asking for it is bounded on its own).
                    (None, _) => c.binding.is_strong() && e.proto == c.flow.proto,
                    // Names it has not given us yet, which we would take:
                    // names refused (`learn_peer_view`) stay refused, and a
                    // replay of them is no news.
                    (Some(k), Some(names)) if k == *peer && c.peer_named.is_none() => {
                        let named = VirtualFlow {
                            proto: c.flow.proto,
                            local: names[1],
                            remote: names[0],
                        };
                        self.aliases.get(&named).is_none_or(|other| {
                            *other == c.flow
                                || self.conns.get(other).and_then(|o| o.peer_key) == Some(*peer)
                        })
                    }
                    _ => false,
                })
        })
    }

    /// Remember how the peer names `flow` (from its claim): records named
    /// its way find the connection, and its name for our end is where a
    /// NAT put us.
    pub(crate) fn learn_peer_view(&mut self, flow: &VirtualFlow, names: [SocketAddr; 2]) {
        let named = VirtualFlow {
            proto: flow.proto,
            local: names[1],
            remote: names[0],
        };
        // The names must not shadow a connection of ours that has those
        // names itself, nor take over names another host's connection
        // already has (a paired host naming its connection after someone
        // else's would otherwise divert that host's records).
        let peer = self.conns.get(flow).and_then(|c| c.peer_key);
        if let Some(other) = self.aliases.get(&named).copied() {
            if other != *flow && self.conns.get(&other).and_then(|c| c.peer_key) != peer {
                self.stats.reject(Reject::ClaimNamesTaken);
                return;
            }
        }
        let Some(c) = self.conns.get_mut(flow) else {
            return;
        };
        let before = c.peer_named.replace(Box::new(named)).map(|b| *b);
        let nat = c.remote_phys.ip();
        if let Some(old) = before {
            if old != named {
                self.aliases.remove(&old);
            }
        }
        if named != *flow && !self.conns.contains_key(&named) {
            self.aliases.insert(named, *flow);
        }
        // The peer names its end otherwise than we do: a NAT is in front
        // of it, which may re-map the connection some day (`vcmp::remap`).
        if before != Some(named) && named.remote != flow.remote {
            self.emit(Event::GuardNat { flow: *flow, nat });
        }
    }

    /// Why `flow` cannot move (has no keys), in a few words for `vnatctl
    /// ls`; `None` if it can, or is unknown.
    pub fn why_not_mobile(&self, flow: &VirtualFlow) -> Option<&'static str> {
        let c = self.conns.get(flow)?;
        if c.keys.is_some() {
            return None;
        }
        let ip = c.remote_phys.ip();
        if c.peer_key.is_some() {
            return Some("its peer host's pairing was forgotten");
        }
        if !self.sessions_at(ip).is_empty() {
            return Some(if c.bind_retry.is_some() {
                "waiting for the peer host to claim it"
            } else {
                "the host paired at its address does not claim it"
            });
        }
        if self.pairing.with(SocketAddr::new(ip, self.cfg.port)) {
            return Some("pairing with the peer's vnatd");
        }
        Some("no vnatd answered at the peer's address")
    }

    /// Our connection named `named`, directly or as its peer names it.
    pub(crate) fn resolve(&self, named: &VirtualFlow) -> Option<VirtualFlow> {
        if self.conns.contains_key(named) {
            return Some(*named);
        }
        self.aliases.get(named).copied()
    }

    /// Forget the peer's names of `flow` (it is going away).
    pub(crate) fn drop_alias(&mut self, flow: &VirtualFlow) {
        if let Some(named) = self.conns.get(flow).and_then(|c| c.peer_named()) {
            if self.aliases.get(&named) == Some(flow) {
                self.aliases.remove(&named);
            }
        }
    }

    pub(crate) fn refresh_claim_index(&mut self, peer: &[u8; 32], key: &SecretKey) {
        if self.claim_index.contains_key(peer) {
            return;
        }
        let by_commitment = self
            .conns
            .values()
            .map(|c| (claim_commitment(key, peer, &c.binding), c.flow))
            .collect();
        self.claim_index.insert(*peer, ClaimIndex { by_commitment });
    }

    /// Resend the claims of connections still without a peer; after
    /// `max_tries`, give up (the connection is not mobile, as with a peer
    /// without vnatd). A host that is at the connection's address now and
    /// was never paired pairs by itself: it has a connection with us and
    /// no session.
    pub(crate) fn claim_timeouts(&mut self, ctx: &mut Ctx) {
        let mut due: HashMap<IpAddr, Vec<VirtualFlow>> = HashMap::new();
        for f in self.conn_timers.due(ctx.now) {
            let Some(c) = self.conns.get_mut(&f) else {
                continue;
            };
            let Some((tries, deadline)) = c.bind_retry else {
                continue;
            };
            if deadline > ctx.now || c.peer_key.is_some() {
                continue;
            }
            if tries >= self.cfg.max_tries {
                c.bind_retry = None;
                self.stats.count(Counter::ClaimGaveUp);
                self.rearm(&f);
                continue;
            }
            due.entry(c.remote_phys.ip()).or_default().push(c.flow);
        }
        for (ip, flows) in due {
            self.claim_at(ctx.now, ip, &flows);
        }
    }

    /// Forget the host `peer`: its session, and the binding and keys of
    /// its connections, which are then claimed to whoever is paired at
    /// their address now (a reinstalled peer's new key). Returns how many
    /// connections it held, or `None` if the key is unknown here.
    pub fn forget_peer(&mut self, now: Timestamp, peer: &[u8; 32]) -> Option<usize> {
        let known = self.sessions.remove(peer).is_some();
        self.pairing.strangers.forget(peer);
        // Forgotten entirely: no more pairing from anywhere by key alone.
        self.pairing.known_hosts.remove(peer);
        if let Some(a) = self.peer_addrs.get(peer) {
            self.pairing.known_addrs.remove(&a.ip());
            self.pairing.renewals.remove(&a.ip());
        }
        self.peer_addrs.remove(peer);
        self.probes.remove(peer);
        self.claim_index.remove(peer);
        self.binds.forget(peer);
        self.pins.retain(|_, k| k != peer);
        let mut freed: HashMap<IpAddr, Vec<VirtualFlow>> = HashMap::new();
        for c in self.conns.values_mut() {
            if c.peer_key.as_ref() == Some(peer) {
                if let Some(named) = c.peer_named.take() {
                    self.aliases.remove(&named);
                }
                c.peer_key = None;
                c.keys = None;
                c.prev_keys = None;
                c.mig = None;
                c.bind_retry = None;
                if c.flow.proto == crate::flow::Proto::Udp {
                    self.binds.track_udp(c.flow, c.remote_phys.ip());
                }
                freed.entry(c.remote_phys.ip()).or_default().push(c.flow);
            }
        }
        if !known && freed.is_empty() {
            return None;
        }
        self.stats.count(Counter::PeersForgotten);
        self.trust_lost();
        let n = freed.values().map(Vec::len).sum();
        for f in freed.values().flatten() {
            self.rearm(f);
        }
        for (ip, flows) in freed {
            self.claim_at(now, ip, &flows);
        }
        self.tx.flush(&mut self.stats);
        Some(n)
    }
}
