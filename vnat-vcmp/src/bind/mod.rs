//! In-band BIND: how every UDP flow is bound to a paired host (DESIGN.md
//! section 4, identity; issue 31).
//!
//! A TCP connection is bound by its initial sequence numbers, which only
//! its two ends (and whoever was on its path) know, and which a NAT leaves
//! alone. A UDP flow has nothing of the kind: both ends know it only by its
//! endpoints, which anyone can guess but a port, and behind a NAT the two
//! ends name it differently. So a UDP flow is never bound by a CLAIM, and
//! never by its remote address: a host that pairs from that address may be
//! another host behind the same NAT. What only the flow's two ends can do
//! is send and receive on the flow's own path:
//!
//! 1. A host with UDP flows that have no peer, toward an address where a
//!    host paired from, asks the driver to divert BINDs from that address
//!    (`Event::DivertBinds`: the tc ingress takes exactly these datagrams
//!    to the VCMP port, so no application receives one), then sends that
//!    host a BIND_REQ naming no connection, with a fresh nonce.
//! 2. The host asked sends, on each of its UDP flows toward the requester's
//!    address that has no peer or has the requester as its peer, a BIND on
//!    the flow's own 5-tuple (`Event::SendInBand`, at most one per flow a
//!    second): its host key, its names for the flow, a fresh random token,
//!    the nonce, a tag under the pairing's claim key. A BIND_REQ is taken
//!    only from the address the requester's session is at, and within a
//!    budget per host.
//! 3. The requester's tc ingress sees the BIND arrive at the flow's port,
//!    writes that port into it and sends it to the VCMP port. vnatd checks
//!    the tag, the nonce (a request of ours to that host, from that
//!    address), finds the one flow with that remote endpoint and local
//!    port, and binds it to the sender, by names both ends compute alike
//!    (`Binding::udp`). It answers over VCMP with the proof of the token
//!    (`crypto::bind_proof`), which only the receiver of the BIND can
//!    make, and its own names: the sender binds its end on that proof, so
//!    a host that shares the requester's address but is not the flow's
//!    other end, which never saw the BIND, cannot bind it.
//!
//! Both ends may ask at once; each binds on whichever comes first, the
//! other's BIND or the answer to its own, with the same binding.
//!
//! What this trusts: a BIND came from the flow's public endpoint, which
//! only the NAT's mapping of the flow's socket reaches. A host on the same
//! LAN as one end that can forge that end's source address and knows the
//! flow could bind it first (a binding is never taken from its holder
//! afterwards); so could a host on the path. TCP is not exposed so.
//!
//! A host paired from an address that others share (a NAT, a
//! port-forwarding router) can ask for BINDs on our UDP flows toward that
//! address, which belong to those others: each gets at most one 134-byte
//! BIND a second, within the asking host's budget, which their
//! applications receive (an unknown datagram), and binds nothing.
//!
//! After a bound flow's peer moved behind a new NAT, the port that NAT
//! gave the flow is learned the same way, by a BIND_REQ naming the flow's
//! commitment (`ask_rebind`).
//!
//! A TCP connection's new NAT port is learned by a BIND_REQ too, answered
//! by a TCP BIND (`vnat_common::TCP_BIND_OPT`): a pure ACK on the
//! connection's own 5-tuple carrying a token that both ends derive from
//! their pairing's claim key, the request's nonce and the connection's
//! commitment (`crypto::tcp_bind_token`).
//! The requester's datapath is given the token (`Event::ExpectTcpBind`)
//! and its tc program takes the port from the segment that carries it;
//! nothing else teaches it, so a host sharing the NAT, which may know or
//! guess the connection's sequence numbers, cannot capture the connection.
//! The mover sends its TCP BIND when the request arrives and again when
//! the requester's SWITCHED releases the connection, by which time the
//! requester's datapath holds the token.

use crate::stats::{Counter, Reject};
use std::net::{IpAddr, SocketAddr};

use super::binding::Binding;
use super::crypto::{self, claim_commitment};
use super::endpoint::{Endpoint, Event};
use super::wire::{ClaimEntry, Message, MAX_CLAIMS, PAIR_TAG_LEN, TAG_LEN};
use super::Timestamp;
use crate::flow::{Proto, VirtualFlow};

mod codec;
mod state;

pub(crate) use codec::is_bind;
use codec::{decode_bind, decode_bind_req, encode_bind, encode_bind_req, KIND_BIND_REQ};
pub(crate) use state::BindState;
use state::{Asked, ASK_EVERY, ASK_LIFETIME, MAX_BINDS_PER_ASK};

/// Least time between two BINDs on one flow.
const BIND_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);
/// Least time between two TCP BINDs on one connection: one is asked for
/// only by the connection's own peer, whose retries are this far apart at
/// the least (`Config::initial_rto`).
const TCP_BIND_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

impl Endpoint {
    /// A BIND or BIND_REQ datagram from `from`.
    pub(crate) fn on_bind_datagram(
        &mut self,
        now: Timestamp,
        rng: &mut dyn rand_core::RngCore,
        from: SocketAddr,
        bytes: &[u8],
    ) {
        let r = if bytes[1] == KIND_BIND_REQ {
            self.on_bind_req(now, rng, from, bytes)
        } else {
            self.on_bind(now, from, bytes)
        };
        if let Err(reason) = r {
            self.stats.reject(reason);
        }
    }

    /// Ask every host paired from `ip` for BINDs on our UDP flows toward
    /// it that have no peer (`flows`, those among them that are UDP).
    pub(crate) fn request_udp_binds(&mut self, ip: IpAddr, flows: &[VirtualFlow]) {
        let waiting = flows.iter().any(|f| {
            f.proto == Proto::Udp
                && self
                    .conns
                    .get(f)
                    .is_some_and(|c| c.peer_key.is_none() && c.remote_phys.ip() == ip)
        });
        if !waiting {
            return;
        }
        let now = self.binds.clock;
        for peer in self.sessions_at(ip) {
            let recent = self
                .binds
                .last_all
                .get(&peer)
                .is_some_and(|t| now.since(*t) < ASK_EVERY);
            let Some(to) = self.peer_addrs.get(&peer).copied() else {
                continue;
            };
            if recent {
                continue;
            }
            if self.binds.last_all.len() >= 4096 {
                self.binds.last_all.retain(|_, t| now.since(*t) < ASK_EVERY);
            }
            self.binds.last_all.insert(peer, now);
            self.queue_bind_req(peer, to, ip, None);
        }
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
        self.binds.remapped.remove(flow);
        self.binds.untrack_udp(flow);
        self.binds.tcp_tokens.remove(flow);
    }

    /// The next time `bind_timeouts` has work.
    pub(crate) fn next_bind_timeout(&self) -> Option<Timestamp> {
        self.binds.reask_at.next()
    }

    /// Ask for the BIND of the rebinding flow `flow` again now, outside
    /// its timer (its peer's VCMP has a new mapping: `vcmp::remap`).
    pub(crate) fn resend_rebind_request(&mut self, flow: &VirtualFlow) {
        if self.request_rebind(flow) {
            self.stats.count(Counter::BindRequestsResent);
        }
    }

    /// Send (or queue) a BIND_REQ for a rebinding flow; false if it is not
    /// one, or its peer is gone.
    fn request_rebind(&mut self, flow: &VirtualFlow) -> bool {
        let Some(c) = self.conns.get(flow) else {
            return false;
        };
        if c.remote_phys.port() != 0 {
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
        let commitment = claim_commitment(&key, &self.identity.public(), &c.binding);
        if flow.proto == Proto::Tcp {
            return self.send_tcp_bind_req(to, &key, flow, commitment);
        }
        self.queue_bind_req(peer, to, toward, Some(vec![commitment]));
        true
    }

    /// A BIND_REQ for the rebinding TCP connection `flow`, straight away
    /// (no divert: its TCP BIND is taken by our tc program), and the token
    /// its answer carries to the datapath.
    fn send_tcp_bind_req(
        &mut self,
        to: SocketAddr,
        key: &crypto::SecretKey,
        flow: &VirtualFlow,
        commitment: [u8; TAG_LEN],
    ) -> bool {
        let nonce = self.binds.next_nonce;
        self.binds.next_nonce = nonce.wrapping_add(1).max(1);
        let b = encode_bind_req(&self.identity.public(), nonce, &[commitment]);
        // The token goes to the datapath with the events, which the driver
        // takes after this datagram may have left: a BIND that arrives
        // before the token is dropped and counts as no refusal, and the
        // mover sends it again when our SWITCHED (sent after the token is
        // in place) releases the connection.
        self.events.push_back(Event::ExpectTcpBind {
            flow: *flow,
            token: crypto::tcp_bind_token(key, nonce, &commitment),
        });
        self.push_tagged(key, b, to);
        self.stats.count(Counter::BindRequestsSent);
        true
    }

    /// The datapath says the rebinding TCP connection `flow` is rebinding
    /// no more (its TCP BIND taught the port, or the wait was given up):
    /// no more requests for it.
    pub fn tcp_bind_settled(&mut self, flow: &VirtualFlow) {
        self.binds.clear_reask(flow);
    }

    /// Send a BIND_REQ for `wanted` (`None`: every flow) to `peer` at
    /// `to`, once BINDs from `toward` are diverted.
    fn queue_bind_req(
        &mut self,
        peer: [u8; 32],
        to: SocketAddr,
        toward: IpAddr,
        wanted: Option<Vec<[u8; TAG_LEN]>>,
    ) {
        if wanted.as_ref().is_some_and(|w| w.is_empty()) {
            return;
        }
        if self.binds.diverting.contains(&toward) {
            self.send_bind_req(peer, to, toward, wanted);
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
    /// the BIND_REQs that waited for it, or drop them (the retry timers
    /// ask again).
    pub fn binds_diverted(&mut self, toward: IpAddr, ok: bool) {
        let waiting = self.binds.waiting.remove(&toward).unwrap_or_default();
        if !ok {
            self.stats.count(Counter::BindDivertFailed);
            return;
        }
        self.binds.diverting.insert(toward);
        for (peer, to, wanted) in waiting {
            self.send_bind_req(peer, to, toward, wanted);
        }
        self.tx.flush(&mut self.stats);
    }

    fn send_bind_req(
        &mut self,
        peer: [u8; 32],
        to: SocketAddr,
        toward: IpAddr,
        wanted: Option<Vec<[u8; TAG_LEN]>>,
    ) {
        let Some(key) = self.sessions.get(&peer).map(|s| s.claim_key()) else {
            return;
        };
        let now = self.binds.clock;
        let chunks: Vec<Option<Vec<[u8; TAG_LEN]>>> = match wanted {
            None => vec![None],
            Some(w) => w.chunks(MAX_CLAIMS).map(|c| Some(c.to_vec())).collect(),
        };
        for chunk in chunks {
            if !self.binds.room_for(&peer, now) {
                self.stats.reject(Reject::BindRequestsFull);
                return;
            }
            let nonce = self.binds.next_nonce;
            self.binds.next_nonce = nonce.wrapping_add(1).max(1);
            let b = encode_bind_req(
                &self.identity.public(),
                nonce,
                chunk.as_deref().unwrap_or(&[]),
            );
            self.binds.asked.insert(
                (peer, nonce),
                Asked {
                    toward,
                    wanted: chunk,
                    at: now,
                    used: Vec::new(),
                },
            );
            self.push_tagged(&key, b, to);
            self.stats.count(Counter::BindRequestsSent);
        }
    }

    /// A BIND_REQ from the paired host at `from`: send a BIND on each flow
    /// of ours it asks for that is UDP, unbound or bound to that host, and
    /// has its remote end at `from`'s address (never into anyone else's
    /// flow).
    fn on_bind_req(
        &mut self,
        now: Timestamp,
        rng: &mut dyn rand_core::RngCore,
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
        // From where its session is (a replayed request from elsewhere
        // would make us send BINDs toward that address).
        if self.peer_addrs.get(&peer) != Some(&from) {
            return Err(Reject::ClaimWrongAddress);
        }
        if !self.binds.requests.allow(&peer, now, 1) {
            return Err(Reject::PeerOverBudget);
        }
        let candidates: Vec<VirtualFlow> = if commitments.is_empty() {
            self.binds.udp_at(from.ip())
        } else {
            self.refresh_claim_index(&peer, &key);
            let index = self.claim_index.get(&peer);
            commitments
                .iter()
                .filter_map(|c| index.and_then(|i| i.by_commitment.get(c)).copied())
                .collect()
        };
        let mut sent = 0;
        for flow in candidates {
            let Some(c) = self.conns.get(&flow) else {
                continue;
            };
            if c.flow.proto == Proto::Tcp {
                // Only a connection of that host's, named by commitment.
                if c.peer_key == Some(peer)
                    && !commitments.is_empty()
                    && c.remote_phys.ip() == from.ip()
                    && self.send_tcp_bind(now, &flow, nonce, &key, &peer)
                {
                    sent += 1;
                }
                continue;
            }
            let ours = c.flow.proto == Proto::Udp
                && c.remote_phys.ip() == from.ip()
                && (c.peer_key == Some(peer) || (commitments.is_empty() && c.peer_key.is_none()));
            if !ours {
                continue;
            }
            let (local, remote) = (c.local_phys, c.remote_phys);
            if self
                .binds
                .last_sent
                .get(&flow)
                .is_some_and(|(at, t)| *at == local && now.since(*t) < BIND_INTERVAL)
            {
                self.stats.reject(Reject::BindReqTooSoon);
                continue;
            }
            self.binds.last_sent.insert(flow, (local, now));
            let mut token = [0u8; TAG_LEN];
            rng.fill_bytes(&mut token);
            self.binds
                .keep_token(crypto::bind_proof(&key, &token), peer, flow, now);
            let entry = ClaimEntry {
                commitment: token,
                proto: flow.proto,
                names: Some([flow.local, flow.remote]),
            };
            let mut payload = encode_bind(&self.identity.public(), &entry, nonce);
            crypto::tag_datagram(&key, &mut payload);
            self.stats.count(Counter::BindsSent);
            sent += 1;
            self.events.push_back(Event::SendInBand {
                local,
                remote,
                payload,
            });
        }
        if sent == 0 && !commitments.is_empty() {
            self.stats.reject(Reject::BindReqUnknown);
        }
        Ok(())
    }

    /// Send a TCP BIND on our TCP connection `flow`, answering the request
    /// with `nonce` of its peer `peer` (pairing claim key `key`); false if
    /// one just left.
    fn send_tcp_bind(
        &mut self,
        now: Timestamp,
        flow: &VirtualFlow,
        nonce: u64,
        key: &crypto::SecretKey,
        peer: &[u8; 32],
    ) -> bool {
        let Some(c) = self.conns.get(flow) else {
            return false;
        };
        let (local, remote) = (c.local_phys, c.remote_phys);
        // The commitment the request named (as the claim index has it).
        let commitment = claim_commitment(key, peer, &c.binding);
        if self
            .binds
            .last_sent
            .get(flow)
            .is_some_and(|(at, t)| *at == local && now.since(*t) < TCP_BIND_INTERVAL)
        {
            self.stats.reject(Reject::BindReqTooSoon);
            return false;
        }
        self.binds.last_sent.insert(*flow, (local, now));
        let token = crypto::tcp_bind_token(key, nonce, &commitment);
        self.binds.tcp_tokens.insert(*flow, (token, now));
        self.stats.count(Counter::BindsSent);
        self.events.push_back(Event::SendTcpBind {
            flow: *flow,
            local,
            remote,
            token,
        });
        true
    }

    /// The peer's SWITCHED released our moved TCP connection `flow`: if it
    /// asked for a TCP BIND lately, send it again (the first may have
    /// arrived before the peer's datapath held the token).
    pub(crate) fn resend_tcp_bind(&mut self, now: Timestamp, flow: &VirtualFlow) {
        let Some((token, at)) = self.binds.tcp_tokens.remove(flow) else {
            return;
        };
        let Some(c) = self.conns.get(flow) else {
            return;
        };
        if now.since(at) >= ASK_LIFETIME {
            return;
        }
        self.stats.count(Counter::BindsSent);
        self.events.push_back(Event::SendTcpBind {
            flow: *flow,
            local: c.local_phys,
            remote: c.remote_phys,
            token,
        });
    }

    /// A BIND that the tc program diverted from one of our UDP flows: the
    /// answer to a request of ours. Bind the flow with that remote
    /// endpoint and port to its sender (or learn a moved peer's new NAT
    /// port), and answer with the proof of its token.
    fn on_bind(&mut self, now: Timestamp, from: SocketAddr, bytes: &[u8]) -> Result<(), Reject> {
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
        if e.proto != Proto::Udp {
            return Err(Reject::BindBadCommitment);
        }
        // The answer to a request of ours to that host, fresh, with BINDs
        // from where we asked them.
        let asked = match self.binds.asked.get_mut(&(b.static_pub, b.nonce)) {
            Some(a)
                if a.toward == from.ip()
                    && now.since(a.at) < ASK_LIFETIME
                    && !a.used.contains(&e.commitment)
                    && a.used.len() < MAX_BINDS_PER_ASK =>
            {
                a.used.push(e.commitment);
                a.clone()
            }
            _ => return Err(Reject::BindReplayed),
        };
        // The flow as the sender names it, turned to our side.
        let named = VirtualFlow {
            proto: e.proto,
            local: b.names[1],
            remote: b.names[0],
        };
        if let Some(wanted) = asked.wanted {
            // A moved peer's new NAT port: each request once.
            self.binds.asked.remove(&(b.static_pub, b.nonce));
            return self.rebound(from, b.port, b.static_pub, &key, &wanted, &named);
        }
        let flow = self
            .binds
            .udp_at(from.ip())
            .into_iter()
            .find(|f| {
                self.conns.get(f).is_some_and(|c| {
                    c.remote_phys == from
                        && c.local_phys.port() == b.port
                        && c.flow.proto == e.proto
                })
            })
            .ok_or(Reject::BindNoFlow)?;
        let Some(c) = self.conns.get(&flow) else {
            return Err(Reject::BindNoFlow);
        };
        let binding = Binding::udp(&c.flow, &named);
        match c.peer_key {
            Some(k) if k == b.static_pub => {
                // Bound already (its earlier BIND, or our answer reached
                // it): the same names, or nothing.
                if c.binding != binding {
                    return Err(Reject::BindMismatch);
                }
                self.stats.count(Counter::BindAgain);
            }
            Some(_) => return Err(Reject::ClaimConflict),
            None => {
                self.bind_udp(&flow, b.static_pub, binding, b.names);
                self.stats.count(Counter::BindsBound);
            }
        }
        // Its end binds on the proof that we received its BIND.
        self.answer_bind(b.static_pub, &key, &flow, &e.commitment);
        self.tx.flush(&mut self.stats);
        Ok(())
    }

    /// A BIND from `peer` through its new NAT, answering a request for
    /// `wanted`: the port that NAT gave the flow.
    fn rebound(
        &mut self,
        from: SocketAddr,
        port: u16,
        peer: [u8; 32],
        key: &crypto::SecretKey,
        wanted: &[[u8; TAG_LEN]],
        named: &VirtualFlow,
    ) -> Result<(), Reject> {
        let me = self.identity.public();
        let flow = self
            .conns
            .values()
            .find(|c| {
                c.flow.proto == Proto::Udp
                    && c.peer_key == Some(peer)
                    && c.remote_phys == SocketAddr::new(from.ip(), 0)
                    && c.local_phys.port() == port
                    && Binding::udp(&c.flow, named) == c.binding
                    && wanted.contains(&claim_commitment(key, &me, &c.binding))
            })
            .map(|c| c.flow)
            .ok_or(Reject::BindNoFlow)?;
        // Its peer moved behind a new NAT (validated there): this is the
        // port that NAT gave the flow.
        if let Some(c) = self.conns.get_mut(&flow) {
            c.remote_phys = from;
        }
        self.stats.count(Counter::BindsRebound);
        self.binds.clear_reask(&flow);
        self.emit(Event::SetRemote { flow, remote: from });
        Ok(())
    }

    /// Bind the unbound UDP flow `flow` to `peer` with `binding`; `names`
    /// are the peer's for it (its end first).
    pub(crate) fn bind_udp(
        &mut self,
        flow: &VirtualFlow,
        peer: [u8; 32],
        binding: Binding,
        names: [SocketAddr; 2],
    ) {
        self.index_connection(flow, false);
        if let Some(c) = self.conns.get_mut(flow) {
            c.binding = binding;
            c.peer_key = Some(peer);
            c.bind_retry = None;
        }
        self.rearm(flow);
        self.index_connection(flow, true);
        self.promote_stranger(peer);
        self.learn_peer_view(flow, names);
        self.ensure_keys(flow);
    }

    /// Tell `peer` that its BIND with `token` on `flow` arrived: a CLAIM
    /// answer whose entry carries the token's proof and our names.
    fn answer_bind(
        &mut self,
        peer: [u8; 32],
        key: &crypto::SecretKey,
        flow: &VirtualFlow,
        token: &[u8; TAG_LEN],
    ) {
        let Some(dst) = self.peer_addrs.get(&peer).copied() else {
            return;
        };
        let msg = Message::Claim {
            answer: true,
            static_pub: self.identity.public(),
            entries: vec![ClaimEntry {
                commitment: crypto::bind_proof(key, token),
                proto: flow.proto,
                names: Some([flow.local, flow.remote]),
            }],
            tag: [0; PAIR_TAG_LEN],
        };
        if let Ok(b) = msg.encode() {
            self.push_tagged(key, b, dst);
            self.stats.count(Counter::ClaimsSent);
        }
    }

    /// A CLAIM answer entry from `peer` carrying the proof of one of our
    /// BINDs' tokens: the peer received it on the flow's path, so the flow
    /// is its. Returns false if the entry answers no BIND of ours.
    pub(crate) fn on_bind_answer(
        &mut self,
        now: Timestamp,
        peer: [u8; 32],
        entry: &ClaimEntry,
    ) -> bool {
        let Some(flow) = self.binds.take_token(&peer, &entry.commitment, now) else {
            return false;
        };
        let (Some(names), Some(c)) = (entry.names, self.conns.get(&flow)) else {
            self.stats.reject(Reject::BindMalformed);
            return true;
        };
        let named = VirtualFlow {
            proto: c.flow.proto,
            local: names[1],
            remote: names[0],
        };
        let binding = Binding::udp(&c.flow, &named);
        match c.peer_key {
            None => {
                self.bind_udp(&flow, peer, binding, names);
                self.stats.count(Counter::BindsBound);
            }
            Some(k) if k == peer && c.binding == binding => {
                self.learn_peer_view(&flow, names);
            }
            Some(k) if k == peer => self.stats.reject(Reject::BindMismatch),
            Some(_) => self.stats.reject(Reject::ClaimConflict),
        }
        true
    }
}

#[cfg(test)]
impl Endpoint {
    /// A BIND_REQ from us to the paired host `peer`, tagged under our
    /// session, naming the connection with `binding` at that host (a test
    /// playing a host that asks for another host's connection).
    pub(crate) fn bind_req_naming_for_test(
        &self,
        peer: &[u8; 32],
        binding: &Binding,
    ) -> Option<Vec<u8>> {
        let key = self.sessions.get(peer)?.claim_key();
        let me = self.identity.public();
        let commitment = claim_commitment(&key, &me, binding);
        let mut b = encode_bind_req(&me, 77, &[commitment]);
        crypto::tag_datagram(&key, &mut b);
        Some(b)
    }
}
