//! BIND's state (`vcmp::bind`): the divert, the requests outstanding, the
//! tokens of the BINDs sent, the UDP flows by address, and the budgets of
//! what a paired host may ask. Every table is bounded.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::super::budget::PeerBudget;
use super::super::timers::ConnTimers;
use super::super::wire::TAG_LEN;
use super::super::Timestamp;
use crate::flow::VirtualFlow;

/// Most outstanding requests kept; beyond, new ones are not sent (the
/// retry timers ask again).
pub(super) const MAX_ASKED: usize = 4096;
/// Most outstanding requests to one host.
pub(super) const MAX_ASKED_PER_PEER: usize = 256;
/// Least time between two requests to one host for every flow.
pub(super) const ASK_EVERY: Duration = Duration::from_millis(100);
/// How long a request's nonce is good for.
pub(super) const ASK_LIFETIME: Duration = Duration::from_secs(30);
/// Most tokens of BINDs sent and not yet answered.
const MAX_TOKENS: usize = 4096;
/// How long a BIND's token waits for its answer.
const TOKEN_LIFETIME: Duration = Duration::from_secs(30);

/// What a request asked for: BINDs on every UDP flow toward us (`None`),
/// or on the flows with these commitments (a moved peer's new NAT port).
#[derive(Clone)]
pub(super) struct Asked {
    /// The address the BINDs must come from (whose BINDs are diverted).
    pub toward: IpAddr,
    pub wanted: Option<Vec<[u8; TAG_LEN]>>,
    pub at: Timestamp,
    /// The tokens of the BINDs taken under it: each BIND once (a replay
    /// from another port would otherwise bind another flow).
    pub used: Vec<[u8; TAG_LEN]>,
}

/// Most BINDs taken under one request for every flow.
pub(super) const MAX_BINDS_PER_ASK: usize = 256;

/// A BIND we sent: to whom, on which flow, when. Kept by the proof its
/// answer must carry (`crypto::bind_proof` of its token).
struct Token {
    peer: [u8; 32],
    flow: VirtualFlow,
    at: Timestamp,
}

/// A BIND_REQ waiting for the divert: the host key, its VCMP address, and
/// the commitments to ask for (`None`: every flow).
pub(super) type WaitingRequest = ([u8; 32], SocketAddr, Option<Vec<[u8; TAG_LEN]>>);

/// BIND state of one endpoint.
pub(crate) struct BindState {
    /// Addresses whose BINDs the datapath diverts.
    pub(super) diverting: HashSet<IpAddr>,
    /// Requests waiting for the divert towards an address.
    pub(super) waiting: HashMap<IpAddr, Vec<WaitingRequest>>,
    /// The nonce of the next BIND_REQ (seeded at random, `seed_nonce`).
    pub(super) next_nonce: u64,
    /// Requests outstanding, by (host key, nonce).
    pub(super) asked: HashMap<([u8; 32], u64), Asked>,
    /// UDP flows waiting for their moved peer's BIND: requests sent, and
    /// when to ask again in a table of their own (the next deadline is not
    /// a scan of every waiting flow).
    pub(super) reasks: HashMap<VirtualFlow, u32>,
    pub(super) reask_at: ConnTimers,
    /// When we last sent a BIND on each of our flows, from which local
    /// endpoint (a move allows the next one at once).
    pub(super) last_sent: HashMap<VirtualFlow, (SocketAddr, Timestamp)>,
    tokens: HashMap<[u8; TAG_LEN], Token>,
    /// The token of the last TCP BIND sent on each of our TCP connections,
    /// and when: sent again when the peer's SWITCHED releases the
    /// connection (the peer's datapath has the token by then), within
    /// [`ASK_LIFETIME`]. One entry per connection at most.
    pub(super) tcp_tokens: HashMap<VirtualFlow, ([u8; 8], Timestamp)>,
    /// UDP flows by the remote address they were added (or unbound) at:
    /// what a request for every flow toward an address walks, instead of
    /// every connection. Entries may be stale (a flow bound since); the
    /// lookup checks.
    udp_at: HashMap<IpAddr, HashSet<VirtualFlow>>,
    udp_ip: HashMap<VirtualFlow, IpAddr>,
    /// CLAIM datagrams one paired host may send (`vcmp::claim`).
    pub(crate) claims: PeerBudget,
    /// BIND_REQs one paired host may send.
    pub(super) requests: PeerBudget,
    /// When we last asked each host for BINDs on every flow: at most one
    /// such request per [`ASK_EVERY`] (flows added meanwhile are asked for
    /// by their retry timer), so a burst of new flows costs the host one
    /// request, not one each.
    pub(super) last_all: HashMap<[u8; 32], Timestamp>,
    /// The time of the input being handled (for what the public
    /// `binds_diverted`, which is not given one, sends).
    pub(crate) clock: Timestamp,
    /// When a re-map of each connection by its peer's NAT was last
    /// suspected (`vcmp::remap`); one entry per connection at most.
    pub(crate) remapped: HashMap<VirtualFlow, Timestamp>,
}

impl Default for BindState {
    fn default() -> BindState {
        BindState {
            diverting: HashSet::new(),
            waiting: HashMap::new(),
            next_nonce: 0,
            asked: HashMap::new(),
            reasks: HashMap::new(),
            reask_at: ConnTimers::default(),
            last_sent: HashMap::new(),
            tokens: HashMap::new(),
            tcp_tokens: HashMap::new(),
            udp_at: HashMap::new(),
            udp_ip: HashMap::new(),
            // A resync of thousands of connections is a few hundred
            // datagrams; a host that sends more is held to 256 a second.
            claims: PeerBudget::new(256, 1024),
            // A request asks for every flow at once: a few suffice.
            requests: PeerBudget::new(8, 32),
            last_all: HashMap::new(),
            clock: Timestamp(0),
            remapped: HashMap::new(),
        }
    }
}

impl BindState {
    pub(super) fn set_reask(&mut self, flow: VirtualFlow, tries: u32, at: Timestamp) {
        self.reasks.insert(flow, tries);
        self.reask_at.set(flow, Some(at));
    }

    /// Whether a BIND is still asked for `flow` (its rebind waits).
    pub(crate) fn asking(&self, flow: &VirtualFlow) -> bool {
        self.reask_at.get(flow).is_some()
    }

    pub(super) fn clear_reask(&mut self, flow: &VirtualFlow) {
        self.reasks.remove(flow);
        self.reask_at.set(*flow, None);
    }

    /// Forget what was asked of `peer` and sent to it (its pairing is gone).
    pub(crate) fn forget(&mut self, peer: &[u8; 32]) {
        self.asked.retain(|(p, _), _| p != peer);
        self.tokens.retain(|_, t| t.peer != *peer);
        self.claims.forget(peer);
        self.requests.forget(peer);
        self.last_all.remove(peer);
    }

    /// Seed the request nonces from `rng` (once).
    pub(crate) fn seed_nonce(&mut self, rng: &mut dyn rand_core::RngCore) {
        if self.next_nonce == 0 {
            self.next_nonce = rng.next_u64() | 1;
        }
    }

    /// Room for one more request to `peer`: expired ones go first; a host
    /// past its share loses its oldest. False if the table is full.
    pub(super) fn room_for(&mut self, peer: &[u8; 32], now: Timestamp) -> bool {
        let mine = self.asked.keys().filter(|(p, _)| p == peer).count();
        if mine >= MAX_ASKED_PER_PEER || self.asked.len() >= MAX_ASKED {
            self.asked.retain(|_, a| now.since(a.at) < ASK_LIFETIME);
        }
        if self.asked.keys().filter(|(p, _)| p == peer).count() >= MAX_ASKED_PER_PEER {
            let oldest = self
                .asked
                .iter()
                .filter(|((p, _), _)| p == peer)
                .min_by_key(|(_, a)| a.at)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                self.asked.remove(&k);
            }
        }
        self.asked.len() < MAX_ASKED
    }

    /// Keep the token of a BIND sent to `peer` on `flow`, by its proof.
    pub(super) fn keep_token(
        &mut self,
        proof: [u8; TAG_LEN],
        peer: [u8; 32],
        flow: VirtualFlow,
        now: Timestamp,
    ) {
        if self.tokens.len() >= MAX_TOKENS {
            self.tokens.retain(|_, t| now.since(t.at) < TOKEN_LIFETIME);
            if self.tokens.len() >= MAX_TOKENS {
                return;
            }
        }
        self.tokens.insert(
            proof,
            Token {
                peer,
                flow,
                at: now,
            },
        );
    }

    /// The flow whose BIND to `peer` the proof `proof` answers (each token
    /// once, while fresh).
    pub(crate) fn take_token(
        &mut self,
        peer: &[u8; 32],
        proof: &[u8; TAG_LEN],
        now: Timestamp,
    ) -> Option<VirtualFlow> {
        match self.tokens.get(proof) {
            Some(t) if t.peer == *peer && now.since(t.at) < TOKEN_LIFETIME => {
                self.tokens.remove(proof).map(|t| t.flow)
            }
            _ => None,
        }
    }

    /// `flow` is a UDP flow with its remote end at `ip` now.
    pub(crate) fn track_udp(&mut self, flow: VirtualFlow, ip: IpAddr) {
        if let Some(old) = self.udp_ip.insert(flow, ip) {
            if let Some(set) = self.udp_at.get_mut(&old) {
                set.remove(&flow);
                if set.is_empty() {
                    self.udp_at.remove(&old);
                }
            }
        }
        self.udp_at.entry(ip).or_default().insert(flow);
    }

    /// `flow` is gone.
    pub(crate) fn untrack_udp(&mut self, flow: &VirtualFlow) {
        self.last_sent.remove(flow);
        let Some(ip) = self.udp_ip.remove(flow) else {
            return;
        };
        if let Some(set) = self.udp_at.get_mut(&ip) {
            set.remove(flow);
            if set.is_empty() {
                self.udp_at.remove(&ip);
            }
        }
    }

    /// The UDP flows last known at `ip` (check each: some may be bound or
    /// have moved since).
    pub(super) fn udp_at(&self, ip: IpAddr) -> Vec<VirtualFlow> {
        self.udp_at
            .get(&ip)
            .map(|s| s.iter().copied().collect())
            .unwrap_or_default()
    }
}
