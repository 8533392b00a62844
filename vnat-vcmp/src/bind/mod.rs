//! In-band BIND: binding a UDP flow through a NAT that changes its port
//! (DESIGN.md section 4, identity).
//!
//! A TCP connection is bound by its initial sequence numbers, which a NAT
//! leaves alone. A UDP flow has nothing of the kind: both ends know it only
//! by its endpoints, and behind a NAT the two ends name it differently (the
//! client by its private address and port, the server by the NAT's public
//! address and a port the NAT chose, at random if it is "fully-random"). So
//! a CLAIM for it finds nothing on the server, and the server cannot tell
//! which of the flows from that public address it names.
//!
//! The flow's own packets can tell, because they cross the NAT with the
//! flow's mapping. So:
//!
//! 1. The server, given a CLAIM from a paired host behind NAT (its names
//!    for its end differ from the address the claim came from) with UDP
//!    entries it cannot match, while it has an unbound UDP flow from that
//!    address to the port the entry names, asks the driver to divert BINDs
//!    from that address (`Event::DivertBinds`: the tc ingress takes exactly
//!    these datagrams to the VCMP port, so no application receives one),
//!    and only then answers with a BIND_REQ naming those commitments.
//! 2. The client sends, for each of its unbound UDP flows to that address
//!    whose commitment is named, a BIND on the flow's own 5-tuple
//!    (`Event::SendInBand`): its host key, its CLAIM entry for the flow,
//!    the request's nonce, and a tag under the pairing's claim key (at most
//!    one per flow a second).
//! 3. The server's tc ingress sees it arrive at the flow's port, writes
//!    that port into the BIND and sends it to the VCMP port. vnatd checks
//!    the tag and the counter, finds the one flow with that remote endpoint
//!    (the NAT's mapping) and local port, and binds it to the sender's key
//!    with the sender's names as its binding, so that both ends compute
//!    the same commitment and keys. Its CLAIM answer binds the client's end.
//!
//! What this trusts: the BIND came from the flow's public endpoint, which
//! only the NAT's mapping of the client's socket reaches, and carries a tag
//! only the paired host can make. A host on the same LAN that can forge
//! the client's source address and knows the flow could bind it first (a
//! binding is never taken from its holder afterwards); TCP is not exposed
//! so. A BIND is taken only from an address whose BINDs are diverted (the
//! tc program there drops BINDs sent to the VCMP port itself, so the port
//! written in one is never the sender's word), and only as the answer to a
//! request still outstanding for its commitment: each nonce is used once,
//! so a replayed BIND binds nothing.
//!
//! A paired host that shares its public address with other servers (a
//! port-forwarding router, a load balancer) can ask for BINDs of our UDP
//! flows to those servers, which are flows to its address: each gets at
//! most one 134-byte BIND a second, which those servers' applications
//! receive. A server whose public port differs from its socket's is never
//! asked for one (the claim names the public port): such UDP flows stay not
//! mobile.

use crate::stats::{Counter, Reject};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use vnat_common::{BIND_HEAD, BIND_LEN, BIND_MAGIC};

use super::binding::Binding;
use super::crypto::{self, claim_commitment};
use super::endpoint::{Endpoint, Event};
use super::wire::{
    decode_claim_entry, encode_claim_entry, ClaimEntry, CLAIM_ENTRY_LEN, HEADER_LEN, MAX_CLAIMS,
    PAIR_TAG_LEN, TAG_LEN, VERSION,
};
use super::Timestamp;
use crate::flow::{Proto, VirtualFlow};

/// Kind byte of a BIND_REQ ("send me BINDs for these").
pub(crate) const KIND_BIND_REQ: u8 = 20;

/// A BIND_REQ waiting for the divert: the host key, its VCMP address, and
/// the commitments to ask for.
type WaitingRequest = ([u8; 32], SocketAddr, Vec<[u8; TAG_LEN]>);

impl BindState {
    fn set_reask(&mut self, flow: VirtualFlow, tries: u32, at: Timestamp) {
        self.reasks.insert(flow, tries);
        self.reask_at.set(flow, Some(at));
    }

    fn clear_reask(&mut self, flow: &VirtualFlow) {
        self.reasks.remove(flow);
        self.reask_at.set(*flow, None);
    }
}

/// BIND state of one endpoint.
#[derive(Default)]
pub(crate) struct BindState {
    /// Addresses whose BINDs the datapath diverts.
    diverting: HashSet<IpAddr>,
    /// Requests waiting for the divert towards an address.
    waiting: HashMap<IpAddr, Vec<WaitingRequest>>,
    /// The nonce of the next BIND_REQ (seeded at random, `seed_nonce`).
    next_nonce: u64,
    /// BINDs asked for and not yet received: (host key, commitment) to the
    /// nonces of the requests still outstanding (the last few: an answer
    /// to an earlier request may still be on its way).
    asked: HashMap<([u8; 32], [u8; TAG_LEN]), Vec<u64>>,
    /// UDP flows waiting for their moved peer's BIND: requests sent, and
    /// when to ask again in a table of their own (the next deadline is not
    /// a scan of every waiting flow).
    reasks: HashMap<VirtualFlow, u32>,
    reask_at: super::timers::ConnTimers,
    /// When we last sent a BIND on each of our flows, from which local
    /// endpoint (a move allows the next one at once).
    last_sent: HashMap<VirtualFlow, (SocketAddr, Timestamp)>,
}

/// Most outstanding requests kept; beyond, new ones are not sent (the
/// peer's claims are resent, and ask again).
const MAX_ASKED: usize = 4096;
/// Most outstanding requests to one host.
const MAX_ASKED_PER_PEER: usize = 256;
/// Least time between two BINDs on one flow.
const BIND_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

impl BindState {
    /// Forget what was asked of `peer` (its pairing is gone).
    pub(crate) fn forget(&mut self, peer: &[u8; 32]) {
        self.asked.retain(|(p, _), _| p != peer);
    }

    /// Seed the request nonces from `rng` (once).
    pub(crate) fn seed_nonce(&mut self, rng: &mut dyn rand_core::RngCore) {
        if self.next_nonce == 0 {
            self.next_nonce = rng.next_u64() | 1;
        }
    }
}

/// A BIND as received.
struct Bind {
    static_pub: [u8; 32],
    entry: ClaimEntry,
    nonce: u64,
    /// The port it was sent to, written by the diverting tc program.
    port: u16,
}

fn encode_bind(static_pub: &[u8; 32], entry: &ClaimEntry, nonce: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(BIND_LEN);
    out.extend_from_slice(&[BIND_HEAD[0], BIND_HEAD[1], 0, 0]);
    out.extend_from_slice(&BIND_MAGIC);
    out.extend_from_slice(static_pub);
    encode_claim_entry(&mut out, entry);
    out.extend_from_slice(&nonce.to_be_bytes());
    out.extend_from_slice(&[0; PAIR_TAG_LEN]);
    debug_assert_eq!(out.len(), BIND_LEN);
    out
}

fn decode_bind(b: &[u8]) -> Result<Bind, Reject> {
    if b.len() != BIND_LEN || b[..2] != BIND_HEAD || b[4..8] != BIND_MAGIC {
        return Err(Reject::BindMalformed);
    }
    let mut static_pub = [0u8; 32];
    static_pub.copy_from_slice(&b[HEADER_LEN..HEADER_LEN + 32]);
    let at = HEADER_LEN + 32;
    let entry =
        decode_claim_entry(&b[at..at + CLAIM_ENTRY_LEN]).map_err(|_| Reject::BindMalformed)?;
    let mut nonce = [0u8; 8];
    nonce.copy_from_slice(&b[at + CLAIM_ENTRY_LEN..at + CLAIM_ENTRY_LEN + 8]);
    Ok(Bind {
        static_pub,
        entry,
        nonce: u64::from_be_bytes(nonce),
        port: u16::from_be_bytes([b[2], b[3]]),
    })
}

fn encode_bind_req(static_pub: &[u8; 32], nonce: u64, commitments: &[[u8; TAG_LEN]]) -> Vec<u8> {
    let mut out = vec![
        VERSION,
        KIND_BIND_REQ,
        0,
        commitments.len() as u8,
        0,
        0,
        0,
        0,
    ];
    out.extend_from_slice(static_pub);
    out.extend_from_slice(&nonce.to_be_bytes());
    for c in commitments {
        out.extend_from_slice(c);
    }
    out.extend_from_slice(&[0; PAIR_TAG_LEN]);
    out
}

/// A BIND_REQ: the requester's host key, its nonce, the commitments.
type BindReq = ([u8; 32], u64, Vec<[u8; TAG_LEN]>);

fn decode_bind_req(b: &[u8]) -> Result<BindReq, Reject> {
    if b.len() < HEADER_LEN + 32 + 8 + PAIR_TAG_LEN || b[0] != VERSION || b[1] != KIND_BIND_REQ {
        return Err(Reject::BindReqMalformed);
    }
    let count = usize::from(b[3]);
    if count == 0
        || count > MAX_CLAIMS
        || b[2] != 0
        || b[4..8] != [0; 4]
        || b.len() != HEADER_LEN + 32 + 8 + count * TAG_LEN + PAIR_TAG_LEN
    {
        return Err(Reject::BindReqMalformed);
    }
    let mut static_pub = [0u8; 32];
    static_pub.copy_from_slice(&b[HEADER_LEN..HEADER_LEN + 32]);
    let mut nonce = [0u8; 8];
    nonce.copy_from_slice(&b[HEADER_LEN + 32..HEADER_LEN + 40]);
    let at = HEADER_LEN + 40;
    let commitments = b[at..at + count * TAG_LEN]
        .chunks_exact(TAG_LEN)
        .map(|c| {
            let mut x = [0u8; TAG_LEN];
            x.copy_from_slice(c);
            x
        })
        .collect();
    Ok((static_pub, u64::from_be_bytes(nonce), commitments))
}

/// Whether `bytes` is a BIND or a BIND_REQ (which `Message::decode` does
/// not parse).
pub(crate) fn is_bind(bytes: &[u8]) -> bool {
    bytes.len() >= 2
        && bytes[0] == VERSION
        && (bytes[1] == BIND_HEAD[1] || bytes[1] == KIND_BIND_REQ)
}

impl Endpoint {
    /// A BIND or BIND_REQ datagram from `from`.
    pub(crate) fn on_bind_datagram(&mut self, now: Timestamp, from: SocketAddr, bytes: &[u8]) {
        let r = if bytes[1] == KIND_BIND_REQ {
            self.on_bind_req(now, from, bytes)
        } else {
            self.on_bind(from, bytes)
        };
        if let Err(reason) = r {
            self.stats.reject(reason);
        }
    }

    /// After a CLAIM from the paired host `peer` at `from`: ask it for
    /// BINDs of the UDP entries that named nothing here, if it is behind
    /// NAT and we have an unbound UDP flow from its address to the port
    /// the entry names.
    pub(crate) fn request_binds(
        &mut self,
        peer: [u8; 32],
        from: SocketAddr,
        unmatched: &[ClaimEntry],
    ) {
        let wanted: Vec<[u8; TAG_LEN]> = unmatched
            .iter()
            .filter(|e| e.proto == Proto::Udp && e.sender_local.ip() != from.ip())
            .filter(|e| self.unbound_udp(from.ip(), e.sender_remote.port()))
            .map(|e| e.commitment)
            .collect();
        self.queue_bind_req(peer, from, from.ip(), wanted);
    }

    /// After `flow` was switched to a peer behind a new NAT, with the port
    /// left to learn (`SetRemote` to port 0): a UDP flow learns it from
    /// its BIND on the new path (the datapath drops its datagrams until
    /// then), so ask the peer for one, and again on a timer until it comes
    /// (`bind_timeouts`).
    pub(crate) fn ask_rebind(&mut self, now: Timestamp, flow: &VirtualFlow) {
        if self.request_rebind(flow) {
            let wait = self.cfg.initial_rto;
            self.binds.set_reask(*flow, 1, now.plus(wait));
        }
    }

    /// Ask again for the BINDs still missing; give up after `max_tries`
    /// (the datapath gives up its wait too).
    pub(crate) fn bind_timeouts(&mut self, now: Timestamp) {
        let due: Vec<(VirtualFlow, u32)> = self
            .binds
            .reask_at
            .due(now)
            .into_iter()
            .map(|f| (f, self.binds.reasks.get(&f).copied().unwrap_or(0)))
            .collect();
        for (flow, tries) in due {
            let waiting = self
                .conns
                .get(&flow)
                .is_some_and(|c| c.remote_phys.port() == 0);
            if !waiting || tries >= self.cfg.max_tries || !self.request_rebind(&flow) {
                self.binds.clear_reask(&flow);
                continue;
            }
            self.stats.count(Counter::BindRequestsResent);
            let wait = self
                .cfg
                .initial_rto
                .saturating_mul(1u32 << tries.min(16))
                .min(self.cfg.max_rto);
            self.binds.set_reask(flow, tries + 1, now.plus(wait));
        }
    }

    /// A connection that goes: no BIND is asked for it any more.
    pub(crate) fn forget_rebind(&mut self, flow: &VirtualFlow) {
        self.binds.clear_reask(flow);
    }

    /// The next time `bind_timeouts` has work.
    pub(crate) fn next_bind_timeout(&self) -> Option<Timestamp> {
        self.binds.reask_at.next()
    }

    /// Send (or queue) a BIND_REQ for a rebinding UDP flow; false if it is
    /// not one, or its peer is gone.
    fn request_rebind(&mut self, flow: &VirtualFlow) -> bool {
        let Some(c) = self.conns.get(flow) else {
            return false;
        };
        if flow.proto != Proto::Udp || c.remote_phys.port() != 0 {
            return false;
        }
        let (Some(peer), toward) = (c.peer_key, c.remote_phys.ip()) else {
            return false;
        };
        let (Some(to), Some(key)) = (
            self.peer_addrs.get(&peer).copied(),
            self.sessions.get(&peer).map(|s| s.claim_key()),
        ) else {
            return false;
        };
        let commitment = claim_commitment(&key, &c.binding);
        self.queue_bind_req(peer, to, toward, vec![commitment]);
        true
    }

    /// Send a BIND_REQ for `wanted` to `peer` at `to`, once BINDs from
    /// `toward` are diverted.
    fn queue_bind_req(
        &mut self,
        peer: [u8; 32],
        to: SocketAddr,
        toward: IpAddr,
        wanted: Vec<[u8; TAG_LEN]>,
    ) {
        if wanted.is_empty() {
            return;
        }
        if self.binds.diverting.contains(&toward) {
            self.send_bind_req(peer, to, &wanted);
            return;
        }
        let waiting = self.binds.waiting.entry(toward).or_default();
        if waiting.is_empty() {
            self.events.push_back(Event::DivertBinds { toward });
        }
        if waiting.len() < 16 {
            waiting.push((peer, to, wanted));
        }
    }

    /// The datapath now diverts BINDs from `toward` (`ok`), or cannot: send
    /// the BIND_REQs that waited for it, or drop them (the peer's claims
    /// are resent, and ask again).
    pub fn binds_diverted(&mut self, toward: IpAddr, ok: bool) {
        let waiting = self.binds.waiting.remove(&toward).unwrap_or_default();
        if !ok {
            self.stats.count(Counter::BindDivertFailed);
            return;
        }
        self.binds.diverting.insert(toward);
        for (peer, from, wanted) in waiting {
            self.send_bind_req(peer, from, &wanted);
        }
        self.tx.flush(&mut self.stats);
    }

    fn unbound_udp(&self, remote: IpAddr, local_port: u16) -> bool {
        self.conns.values().any(|c| {
            c.flow.proto == Proto::Udp
                && c.peer_key.is_none()
                && c.remote_phys.ip() == remote
                && c.local_phys.port() == local_port
        })
    }

    fn send_bind_req(&mut self, peer: [u8; 32], to: SocketAddr, wanted: &[[u8; TAG_LEN]]) {
        let Some(key) = self.sessions.get(&peer).map(|s| s.claim_key()) else {
            return;
        };
        for chunk in wanted.chunks(MAX_CLAIMS) {
            // One host that never answers may not use up the room of all:
            // past its share, its unanswered requests are dropped (a
            // genuine one whose answer is lost is asked for again).
            let its_own = self.binds.asked.keys().filter(|(p, _)| *p == peer).count();
            if its_own + chunk.len() > MAX_ASKED_PER_PEER {
                self.binds.asked.retain(|(p, _), _| *p != peer);
                self.stats.count(Counter::BindRequestsDropped);
            }
            if self.binds.asked.len() + chunk.len() > MAX_ASKED {
                self.stats.reject(Reject::BindRequestsFull);
                return;
            }
            let nonce = self.binds.next_nonce;
            self.binds.next_nonce = nonce.wrapping_add(1).max(1);
            for c in chunk {
                let nonces = self.binds.asked.entry((peer, *c)).or_default();
                if nonces.len() >= 4 {
                    nonces.remove(0);
                }
                nonces.push(nonce);
            }
            let b = encode_bind_req(&self.identity.public(), nonce, chunk);
            self.push_tagged(&key, b, to);
            self.stats.count(Counter::BindRequestsSent);
        }
    }

    /// A BIND_REQ from the paired host at `from`: send a BIND on each named
    /// flow of ours that is UDP, unbound or bound to that host (after our
    /// move, to teach it our new NAT's port), and has its remote end at
    /// `from`'s address (never into anyone else's flow).
    fn on_bind_req(
        &mut self,
        now: Timestamp,
        from: SocketAddr,
        bytes: &[u8],
    ) -> Result<(), Reject> {
        let (peer, nonce, commitments) = decode_bind_req(bytes)?;
        let key = self
            .sessions
            .get(&peer)
            .ok_or(Reject::BindReqUnpaired)?
            .claim_key();
        if !crypto::datagram_tag_valid(&key, bytes) {
            return Err(Reject::BindReqBadTag);
        }
        for commitment in commitments {
            let flow = self
                .conns
                .values()
                .find(|c| {
                    c.flow.proto == Proto::Udp
                        && c.peer_key.is_none_or(|k| k == peer)
                        && c.remote_phys.ip() == from.ip()
                        && claim_commitment(&key, &c.binding) == commitment
                })
                .map(|c| (c.flow, c.local_phys, c.remote_phys));
            let Some((flow, local, remote)) = flow else {
                self.stats.reject(Reject::BindReqUnknown);
                continue;
            };
            if self
                .binds
                .last_sent
                .get(&flow)
                .is_some_and(|(at, t)| *at == local && now.since(*t) < BIND_INTERVAL)
            {
                self.stats.reject(Reject::BindReqTooSoon);
                continue;
            }
            if self.binds.last_sent.len() >= MAX_ASKED {
                let conns = &self.conns;
                self.binds.last_sent.retain(|f, _| conns.contains_key(f));
            }
            self.binds.last_sent.insert(flow, (local, now));
            let entry = ClaimEntry {
                commitment,
                proto: flow.proto,
                sender_local: flow.local,
                sender_remote: flow.remote,
            };
            let mut payload = encode_bind(&self.identity.public(), &entry, nonce);
            crypto::tag_datagram(&key, &mut payload);
            self.stats.count(Counter::BindsSent);
            self.events.push_back(Event::SendInBand {
                local,
                remote,
                payload,
            });
        }
        Ok(())
    }

    /// A BIND that the tc program diverted from one of our UDP flows: bind
    /// the flow with that remote endpoint and port to its sender.
    fn on_bind(&mut self, from: SocketAddr, bytes: &[u8]) -> Result<(), Reject> {
        let b = decode_bind(bytes)?;
        if b.port == 0 || !self.binds.diverting.contains(&from.ip()) {
            // Not through our divert: its port is the sender's word.
            return Err(Reject::BindNotDiverted);
        }
        let key = self
            .sessions
            .get(&b.static_pub)
            .ok_or(Reject::BindUnpaired)?
            .claim_key();
        let mut signed = bytes.to_vec();
        signed[2] = 0;
        signed[3] = 0;
        if !crypto::datagram_tag_valid(&key, &signed) {
            return Err(Reject::BindBadTag);
        }
        let e = b.entry;
        // The answer to a request still outstanding, each nonce once.
        match self.binds.asked.get(&(b.static_pub, e.commitment)) {
            Some(nonces) if nonces.contains(&b.nonce) => {
                self.binds.asked.remove(&(b.static_pub, e.commitment));
            }
            Some(_) | None => return Err(Reject::BindReplayed),
        }
        // The flow as the sender names it, turned to our side.
        let named = VirtualFlow {
            proto: e.proto,
            local: e.sender_remote,
            remote: e.sender_local,
        };
        let binding = Binding::endpoints(&named);
        if e.proto != Proto::Udp || claim_commitment(&key, &binding) != e.commitment {
            return Err(Reject::BindBadCommitment);
        }
        let rebinding = self
            .conns
            .values()
            .find(|c| {
                c.flow.proto == Proto::Udp
                    && c.peer_key == Some(b.static_pub)
                    && c.remote_phys == SocketAddr::new(from.ip(), 0)
                    && c.local_phys.port() == b.port
                    && c.binding == binding
            })
            .map(|c| c.flow);
        if let Some(flow) = rebinding {
            // Its peer moved behind a new NAT (validated there): this is the
            // port that NAT gave the flow.
            if let Some(c) = self.conns.get_mut(&flow) {
                c.remote_phys = from;
            }
            self.stats.count(Counter::BindsRebound);
            self.binds.clear_reask(&flow);
            self.emit(Event::SetRemote { flow, remote: from });
            return Ok(());
        }
        let flow = self
            .conns
            .values()
            .find(|c| {
                c.flow.proto == Proto::Udp && c.remote_phys == from && c.local_phys.port() == b.port
            })
            .map(|c| (c.flow, c.peer_key))
            .ok_or(Reject::BindNoFlow)?;
        match flow.1 {
            Some(k) if k == b.static_pub => {
                // Its own flow, named as some other flow: changes nothing.
                if self.conns.get(&flow.0).map(|c| c.binding) != Some(binding) {
                    return Err(Reject::BindMismatch);
                }
                self.stats.count(Counter::BindAgain);
            }
            Some(_) => return Err(Reject::ClaimConflict),
            None => {
                let flow = flow.0;
                self.index_connection(&flow, false);
                if let Some(c) = self.conns.get_mut(&flow) {
                    c.binding = binding;
                    c.peer_key = Some(b.static_pub);
                    c.bind_retry = None;
                }
                self.rearm(&flow);
                self.index_connection(&flow, true);
                self.stats.count(Counter::BindsBound);
                self.promote_stranger(b.static_pub);
                self.learn_peer_view(&flow, &e);
                self.ensure_keys(&flow);
                // Our claim of it, now with the sender's commitment, binds
                // its end: to where its pairing lives, not to the flow.
                if let Some(dst) = self.peer_addrs.get(&b.static_pub).copied() {
                    self.send_claims(b.static_pub, dst, &[flow], true);
                }
            }
        }
        self.tx.flush(&mut self.stats);
        Ok(())
    }
}
