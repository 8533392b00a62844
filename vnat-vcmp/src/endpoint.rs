//! The VCMP state machine of one vnatd: the public API the daemon drives.
//!
//! Inputs: `connection_added`, `suspend`, `resume`, `handle_datagram`,
//! `handle_timeout`, each with the current [`Timestamp`] and a
//! cryptographic random generator. Outputs: `poll_transmit` (datagrams),
//! `poll_event` (datapath actions and reports), `poll_timeout` (when to call
//! `handle_timeout` next). Receiving is in `recv.rs`, pairing in
//! `pairing/` (its state and timers in `pairing/state.rs`), the location chain and updates in `migrate.rs`.

use crate::stats::{Counter, Reject};
use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rand_core::{CryptoRng, RngCore};

use super::binding::Binding;
use super::crypto::{ConnKeys, Ephemeral, HostIdentity, PairSecret, SecretKey};
use super::location::LocationStore;
use super::migrate::Migration;
use super::replay::ReplayWindow;
use super::roles::{Role, RoleState};
use super::stats::Stats;
use super::tx::{Transmit, TxQueue};
use super::wire::{self, Ext, Family, Kind, Record, MAX_SIGNED_LEN};
use super::Timestamp;
use crate::flow::VirtualFlow;

pub use super::config::{Config, DEFAULT_PORT};
pub(crate) use super::ctx::{CryptoDyn, Ctx};
pub use super::event::{AbortReason, EndpointError, Event};

/// State of one connection.
pub(crate) struct Conn {
    pub flow: VirtualFlow,
    /// The facts that tie it to its peer host (`vcmp::binding`).
    pub binding: Binding,
    /// Our CLAIM for it while it has no peer: (claims sent, next resend).
    pub bind_retry: Option<(u32, Timestamp)>,
    /// How the peer names it, from our side (`local` is the peer's name for
    /// our end), learned from its CLAIM. Differs from `flow` when a NAT is
    /// between the ends.
    pub peer_named: Option<Box<VirtualFlow>>,
    pub local_phys: SocketAddr,
    /// Current remote physical endpoint: the last validated one.
    pub remote_phys: SocketAddr,
    /// Our end in the other IP family than `local_phys`, from before the
    /// connection was last carried across families: where it returns
    /// (`vcmp::family`).
    pub local_alt: Option<SocketAddr>,
    /// The peer's end in the other family than `remote_phys`, likewise.
    pub remote_alt: Option<SocketAddr>,
    /// Our end is in the other family than the connection's because the
    /// peer's update took it there, not because we moved: our own
    /// connection's address is still here, and the planner must not take
    /// that for a return home (`ConnectionView::follows_peer`).
    pub follows_peer: bool,
    /// The host it is bound to (by a CLAIM, or an import): the only host
    /// whose pairing its keys derive from, for life.
    pub peer_key: Option<[u8; 32]>,
    pub keys: Option<ConnKeys>,
    /// Keys before the last suspend-time DH, kept to answer a retransmitted
    /// KEYX whose answer was lost.
    pub prev_keys: Option<Box<ConnKeys>>,
    pub send_seq: u64,
    pub replay: ReplayWindow,
    /// Highest sequence number of an UPD/UPD_R that moved (or confirmed)
    /// the binding: only a higher one may move it again (issue 3, item 5).
    pub binding_seq: u64,
    /// Highest sequence number of a location record used.
    pub location_seq: u64,
    pub role: RoleState,
    /// Endpoint claimed by the peer, waiting for path validation, with the
    /// sequence number of the update that claimed it.
    pub pending_remote: Option<(SocketAddr, u64)>,
    /// While `pending_remote` waits: the address an update came from that
    /// named another (the peer's VCMP behind a NAT it just entered, or
    /// another interface of a peer that sends its VCMP elsewhere), also
    /// being validated. Taken, with the port to learn, if it answers and
    /// the named address does not within a retransmission timeout
    /// (`update::nat_fallback`).
    pub nat_candidate: Option<SocketAddr>,
    /// We send to `pending_remote` already, under the datapath's
    /// anti-amplification budget (`Event::SendUnvalidated`).
    pub sending_unvalidated: bool,
    /// Our own move changed `local_phys`, and the peer has not yet shown
    /// that it knows the new address: no UPD, UPD_R or SWITCHED of it has
    /// arrived there. Until one does, its kernel may not take our packets
    /// from there, so we send nothing to it before validation
    /// (`update::send_unvalidated`), even once our move is over: an
    /// update it sent to our old address can reach us after that.
    pub local_unproven: bool,
    pub keyx: Option<Box<KeyxState>>,
    /// Our answer to the peer's last KEYX: (peer's value, ours).
    pub keyx_answer: Option<Box<([u8; 32], [u8; 32])>>,
    /// The sequence number of the KEYX we answered last.
    pub keyx_answer_seq: u64,
    /// We answered a KEYX and ratcheted, and the peer has not been seen
    /// using the new keys: it may never have received our answer (lost,
    /// or it gave up), so we go on signing with the keys before the
    /// ratchet (`prev_keys`) until a record under the new ones arrives.
    pub send_prev: bool,
    /// Remote addresses where the peer proved it receives (bounded).
    pub validated: Vec<IpAddr>,
    /// Retransmission of our SUSP_PRIMARY claim.
    pub claim_retry: Option<(u32, Timestamp)>,
    /// A suspension under way until its claim and key agreement are over
    /// (`Event::SuspendSettled`).
    pub settling: Option<Settling>,
    pub mig: Option<Box<Migration>>,
    /// Our HELP, until the peer echoes it.
    pub help: Option<Box<super::help::HelpOut>>,
    /// The sequence number of the newest HELP taken from the peer: an
    /// older one that arrives later (reordered, or resent) is not news.
    pub help_seq: u64,
}

impl Conn {
    /// How the peer names the connection, if it told us (see `peer_named`).
    pub(crate) fn peer_named(&self) -> Option<VirtualFlow> {
        self.peer_named.as_deref().copied()
    }

    /// Our answer to the peer's last KEYX, if any (see `keyx_answer`).
    pub(crate) fn keyx_answer(&self) -> Option<([u8; 32], [u8; 32])> {
        self.keyx_answer.as_deref().copied()
    }

    /// The first of its deadlines: migration, key agreement, role claim
    /// resend, CLAIM resend.
    pub(crate) fn deadline(&self) -> Option<Timestamp> {
        [
            self.mig.as_ref().map(|m| m.deadline),
            self.keyx.as_ref().map(|k| k.deadline),
            self.claim_retry.map(|(_, d)| d),
            self.bind_retry.map(|(_, d)| d),
            self.help.as_ref().map(|h| h.deadline),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The key our records are signed with now: the current send key, or
    /// the one before the last ratchet while the peer may not have it yet
    /// ([`Conn::send_prev`]).
    pub(crate) fn send_key(&self) -> Option<&super::crypto::SecretKey> {
        match (&self.keys, &self.prev_keys) {
            (Some(_), Some(prev)) if self.send_prev => Some(&prev.send),
            (Some(k), _) => Some(&k.send),
            (None, _) => None,
        }
    }
}

/// What a suspension under way has met so far.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Settling {
    /// Its claim or key agreement was given up unanswered.
    pub unanswered: bool,
}

pub(crate) struct KeyxState {
    pub eph: Ephemeral,
    pub tries: u32,
    pub deadline: Timestamp,
}

/// The protocol core of one vnatd.
pub struct Endpoint {
    pub(crate) cfg: Config,
    pub(crate) identity: HostIdentity,
    pub(crate) conns: HashMap<VirtualFlow, Box<Conn>>,
    pub(crate) per_peer: HashMap<IpAddr, usize>,
    /// Host keys pre-configured for an address (`pin_peer`): pairing from
    /// there with any other key is refused. Keys learned by pairing are no
    /// pins: a host is its key, and another key at the same address is
    /// another host (NAT, DHCP), which gets only what it proves it holds.
    pub(crate) pins: HashMap<IpAddr, [u8; 32]>,
    pub(crate) sessions: HashMap<[u8; 32], PairSecret>,
    /// The VCMP address each paired host paired from (where its claims go).
    pub(crate) peer_addrs: HashMap<[u8; 32], SocketAddr>,
    /// This host's addresses, told in every PROBE (`vcmp::family`).
    pub(crate) host_addrs: Vec<IpAddr>,
    /// The addresses each paired host told us it has.
    pub(crate) peer_host_addrs: HashMap<[u8; 32], Vec<IpAddr>>,
    /// Pairing's own state: handshakes, cookies, limits, retries
    /// (`vcmp::pairing`).
    pub(crate) pairing: super::pairing::Pairings,
    /// Commitments of our connections per paired host (`vcmp::claim`).
    pub(crate) claim_index: HashMap<[u8; 32], super::claim::ClaimIndex>,
    /// UDP flows bound through NAT (`vcmp::bind`).
    pub(crate) binds: super::bind::BindState,
    /// Connections added since the last `poll_transmit`, by remote address,
    /// whose claims go out then, batched.
    pub(crate) claims_due: HashMap<IpAddr, Vec<VirtualFlow>>,
    /// Connections by the names their peers give them, where those differ
    /// from ours (a NAT between the ends; see `vcmp::claim`).
    pub(crate) aliases: HashMap<VirtualFlow, VirtualFlow>,
    /// Keepalive state per paired host (`vcmp::probe`).
    pub(crate) probes: HashMap<[u8; 32], super::probe::ProbeState>,
    pub(crate) next_keepalive: Timestamp,
    /// Path validations under way (`vcmp::validation`).
    pub(crate) validations: super::validation::Validations,
    /// Moved connections waiting for the peer's SWITCHED.
    pub(crate) awaiting: super::switched::Awaiting,
    pub(crate) requests: HashMap<u32, super::migrate::Request>,
    pub(crate) store: LocationStore,
    pub(crate) next_store_expiry: Timestamp,
    /// Each connection's next deadline, in order (`timers.rs`).
    pub(crate) conn_timers: super::timers::ConnTimers,
    pub(crate) tx: TxQueue,
    /// What goes to the external store instead of a datagram
    /// (`vcmp::extstore`).
    pub(crate) ext: super::extstore::ExtQueue,
    pub(crate) events: VecDeque<Event>,
    pub(crate) stats: Stats,
}

/// Read-only view of a connection, for the control API and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectionView {
    pub flow: VirtualFlow,
    pub local_phys: SocketAddr,
    pub remote_phys: SocketAddr,
    pub pending_remote: Option<SocketAddr>,
    /// While `pending_remote` waits: the address the peer's update came
    /// from, validated beside it (the peer may have entered a NAT there,
    /// `update::nat_fallback`). A UDP flow's receive side is prepared for
    /// it too, at port 0 ([`Event::PrepareReceive`]).
    pub nat_candidate: Option<SocketAddr>,
    /// The host it is bound to.
    pub peer_key: Option<[u8; 32]>,
    /// How that host names our end of it, when it differs from our name (a
    /// NAT between us: the address and port the peer sees).
    pub seen_by_peer_as: Option<SocketAddr>,
    /// The peer names its own end otherwise than we do: a NAT was between
    /// us when the connection was opened, so the peer's virtual address
    /// here is that NAT's (which other hosts may share).
    pub peer_behind_nat: bool,
    pub has_keys: bool,
    pub role: Option<Role>,
    pub migrating: bool,
    /// Our end is carried in the other IP family because the peer moved
    /// there (`vcmp::family`), not because our own address went: no move
    /// of ours takes it back; the peer's next update does.
    pub follows_peer: bool,
    pub binding_seq: u64,
    pub send_seq: u64,
}

impl Endpoint {
    /// Gives back the room of tables a mass move filled and emptied (the
    /// moves' requests, validations, SWITCHED waits and timers, the queued
    /// events and datagrams), and of the connection table after many
    /// closed. The driver calls it from time to time; it changes nothing
    /// the endpoint does (`crate::room`).
    pub fn shrink_sparse(&mut self) {
        use crate::room::Shrink;
        self.conns.shrink_sparse();
        self.per_peer.shrink_sparse();
        self.claims_due.shrink_sparse();
        self.aliases.shrink_sparse();
        self.requests.shrink_sparse();
        self.events.shrink_sparse();
        self.validations.shrink_sparse();
        self.awaiting.shrink_sparse();
        self.conn_timers.shrink_sparse();
        self.tx.shrink_sparse();
    }

    pub fn new(cfg: Config, identity: HostIdentity) -> Endpoint {
        let mut tx = TxQueue::new(cfg.mtu, cfg.max_queued_datagrams);
        let pairing = super::pairing::Pairings::new(&cfg);
        for s in &cfg.location_servers {
            tx.trusted.insert(s.ip());
        }
        Endpoint {
            store: LocationStore::new(cfg.store),
            tx,
            ext: Default::default(),
            cfg,
            identity,
            conns: HashMap::new(),
            per_peer: HashMap::new(),
            pins: HashMap::new(),
            sessions: HashMap::new(),
            peer_addrs: HashMap::new(),
            host_addrs: Vec::new(),
            peer_host_addrs: HashMap::new(),
            pairing,
            claim_index: HashMap::new(),
            binds: Default::default(),
            claims_due: HashMap::new(),
            aliases: HashMap::new(),
            probes: HashMap::new(),
            next_keepalive: Timestamp(0),
            validations: Default::default(),
            awaiting: Default::default(),
            requests: HashMap::new(),
            next_store_expiry: Timestamp(0),
            conn_timers: Default::default(),
            events: VecDeque::new(),
            stats: Stats::default(),
        }
    }

    /// Take new location servers and a new keepalive interval (a reloaded
    /// configuration); migrations under way keep the chain they planned.
    pub fn reconfigure(&mut self, location_servers: Vec<SocketAddr>, keepalive: Duration) {
        for s in &location_servers {
            self.tx.trusted.insert(s.ip());
        }
        self.cfg.location_servers = location_servers;
        self.cfg.keepalive_interval = keepalive;
    }

    /// This host's public identity key.
    pub fn public_key(&self) -> [u8; 32] {
        self.identity.public()
    }

    /// Pre-configure the key of the host at `ip`; pairing with any other
    /// key from there is refused.
    pub fn pin_peer(&mut self, ip: IpAddr, key: [u8; 32]) {
        self.pins.insert(ip, key);
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    pub fn connection(&self, flow: &VirtualFlow) -> Option<ConnectionView> {
        self.conns.get(flow).map(|c| ConnectionView {
            flow: c.flow,
            local_phys: c.local_phys,
            remote_phys: c.remote_phys,
            pending_remote: c.pending_remote.map(|p| p.0),
            nat_candidate: c.nat_candidate,
            peer_key: c.peer_key,
            seen_by_peer_as: c
                .peer_named()
                .map(|n| n.local)
                .filter(|a| *a != c.flow.local),
            peer_behind_nat: c.peer_named().is_some_and(|n| n.remote != c.flow.remote),
            has_keys: c.keys.is_some(),
            role: c.role.negotiated,
            migrating: c.mig.is_some(),
            follows_peer: c.follows_peer,
            binding_seq: c.binding_seq,
            send_seq: c.send_seq,
        })
    }

    pub fn connections(&self) -> impl Iterator<Item = &VirtualFlow> {
        self.conns.keys()
    }

    /// Whether `flow` is tracked (without building its view).
    pub fn has_connection(&self, flow: &VirtualFlow) -> bool {
        self.conns.contains_key(flow)
    }

    /// How many connections are tracked.
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Number of records stored in the location-server role.
    pub fn stored_locations(&self) -> usize {
        self.store.len()
    }

    pub(crate) fn emit(&mut self, e: Event) {
        // A receive side that is never prepared costs a connection; these
        // come only from authenticated updates, at most one per record.
        // A lost end of help would leave the peer helping. A lost revert
        // would leave the receive side prepared for an address the peer
        // never proved (at most one per validation and connection).
        let needed = matches!(
            e,
            Event::PrepareReceive { .. } | Event::HelpRequested { .. } | Event::Reverted { .. }
        );
        if self.events.len() >= self.cfg.max_events && !needed {
            self.stats.reject(Reject::EventQueueFull);
            return;
        }
        self.events.push_back(e);
    }

    /// A new connection to track: `flow` is named by its virtual endpoints,
    /// which are its initial physical ones (paper section 3.1), so at first
    /// `local_phys == flow.local` and `remote_phys == flow.remote` unless the
    /// connection was adopted after a move. `binding` holds the facts that
    /// tie it to its peer host (`Binding::of` with the TCP sequence numbers
    /// the datapath recorded). Claims it to the hosts paired from the
    /// peer's address, or starts pairing with that address.
    pub fn connection_added<R: RngCore + CryptoRng>(
        &mut self,
        now: Timestamp,
        rng: &mut R,
        flow: VirtualFlow,
        local_phys: SocketAddr,
        remote_phys: SocketAddr,
        binding: Binding,
    ) -> Result<(), EndpointError> {
        // Its physical ends are of its own family, or, for an IPv4
        // connection carried over IPv6 (taken up again after a restart,
        // `vcmp::family`), both IPv6.
        let fam = Family::of(&flow.local);
        let phys = Family::of(&local_phys);
        let carried = fam == Family::V4 && phys == Family::V6;
        if Family::of(&flow.remote) != fam
            || Family::of(&remote_phys) != phys
            || (phys != fam && !carried)
        {
            return Err(EndpointError::MixedFamilies(flow));
        }
        if self.conns.contains_key(&flow) {
            return Err(EndpointError::DuplicateConnection(flow));
        }
        self.admit(&flow)?;
        self.conns.insert(
            flow,
            Box::new(Conn::new(flow, local_phys, remote_phys, binding)),
        );
        self.index_connection(&flow, true);
        if flow.proto == crate::flow::Proto::Udp {
            self.binds.track_udp(flow, remote_phys.ip());
        }
        self.tx.trusted.insert(remote_phys.ip());
        self.binds.clock = now;
        let mut ctx = Ctx::new(now, rng);
        let ip = remote_phys.ip();
        if self.sessions_at(ip).is_empty() {
            self.start_pairing(&mut ctx, ip);
        } else {
            self.claims_due.entry(ip).or_default().push(flow);
        }
        self.tx.flush(&mut self.stats);
        Ok(())
    }

    /// Check the global and per-peer caps for one more connection.
    pub(crate) fn admit(&mut self, flow: &VirtualFlow) -> Result<(), EndpointError> {
        // Peers are counted by their virtual address, which never changes.
        let peer = flow.remote.ip();
        if self.conns.len() >= self.cfg.max_connections {
            return Err(EndpointError::TooManyConnections {
                limit: self.cfg.max_connections,
            });
        }
        let n = self.per_peer.get(&peer).copied().unwrap_or(0);
        if n >= self.cfg.max_connections_per_peer {
            return Err(EndpointError::TooManyForPeer {
                peer,
                limit: self.cfg.max_connections_per_peer,
            });
        }
        *self.per_peer.entry(peer).or_default() += 1;
        Ok(())
    }

    /// Forget a closed connection (its keys are wiped on drop).
    pub fn connection_removed(&mut self, flow: &VirtualFlow) -> bool {
        self.index_connection(flow, false);
        self.drop_alias(flow);
        match self.conns.remove(flow) {
            Some(c) => {
                self.release(&c);
                true
            }
            None => false,
        }
    }

    pub(crate) fn release(&mut self, c: &Conn) {
        if c.settling.is_some() {
            self.emit(Event::SuspendSettled {
                flow: c.flow,
                answered: false,
            });
        }
        self.conn_timers.set(c.flow, None);
        self.forget_rebind(&c.flow);
        self.trust_lost();
        let peer = c.flow.remote.ip();
        if let Some(n) = self.per_peer.get_mut(&peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.per_peer.remove(&peer);
            }
        }
    }

    /// Derive the connection's keys if it is bound to a paired host.
    /// Returns whether it has keys.
    pub(crate) fn ensure_keys(&mut self, flow: &VirtualFlow) -> bool {
        let my_pub = self.identity.public();
        let Some(c) = self.conns.get_mut(flow) else {
            return false;
        };
        if c.keys.is_some() {
            return true;
        }
        let Some(peer) = c.peer_key else {
            return false;
        };
        let Some(secret) = self.sessions.get(&peer) else {
            return false;
        };
        c.keys = Some(ConnKeys::derive(secret, &my_pub, &peer, flow, &c.binding));
        self.emit(Event::KeysReady { flow: *flow });
        true
    }

    /// Where the vnatd of `c`'s peer is reached: where the host bound to it
    /// last paired or probed from, while that is at the address the
    /// connection uses (behind a NAT that is the NAT's mapping, not the
    /// VCMP port); otherwise the connection's remote address and the VCMP
    /// port.
    pub(crate) fn vcmp_addr(&self, c: &Conn) -> SocketAddr {
        match c.peer_key.and_then(|k| self.peer_addrs.get(&k)) {
            Some(a) if a.ip() == c.remote_phys.ip() => *a,
            _ => SocketAddr::new(c.remote_phys.ip(), self.cfg.port),
        }
    }

    /// Retransmission timeout for the `tries`-th transmission.
    pub(crate) fn rto(&self, ctx: &Ctx, tries: u32) -> Duration {
        let base = self.cfg.initial_rto.saturating_mul(1u32 << tries.min(16));
        let capped = base.min(self.cfg.max_rto);
        // Checked: a huge configured timeout must not overflow (and panic).
        capped
            .checked_mul(ctx.jitter_permille as u32)
            .map_or(capped, |d| d / 1000)
    }

    /// Sign a record of `kind` for `flow` with a fresh sequence number and
    /// queue it to `dst`. Returns false (and counts why) if it could not.
    pub(crate) fn send_record(
        &mut self,
        ctx: &mut Ctx,
        flow: &VirtualFlow,
        kind: Kind,
        ext: Ext,
        dst: SocketAddr,
    ) -> bool {
        let Some(c) = self.conns.get_mut(flow) else {
            return false;
        };
        let Some(key) = c.send_key().cloned() else {
            self.stats.reject(Reject::SendWithoutKeys);
            return false;
        };
        // Locations are stored under our locator (our send key's) and
        // looked up under the peer's (our receive key's).
        let ext = match (kind, &c.keys) {
            (Kind::Store, _) => Ext::Locator(super::crypto::locator(&key)),
            (Kind::Lookup, Some(k)) => Ext::Locator(super::crypto::locator(&k.recv)),
            _ => ext,
        };
        // After a suspend-time rekey the peer may still store under its
        // previous keys (it signs with them until it sees us use the new
        // ones): ask under that locator too.
        let prev_lookup = match (kind, &c.prev_keys) {
            (Kind::Lookup, Some(p)) => Some(Ext::Locator(super::crypto::locator(&p.recv))),
            _ => None,
        };
        let req = match kind {
            Kind::Lookup | Kind::Store => {
                let family = if c.local_phys.is_ipv6() {
                    Family::V6
                } else {
                    Family::of(&flow.local)
                };
                let cap = wire::records_per_datagram(self.cfg.mtu, family, kind);
                // One request id per datagram: this call may put two records
                // in it.
                let per_call = 1 + usize::from(prev_lookup.is_some());
                ctx.request_id(dst, kind, (cap / per_call).max(1))
            }
            _ => 0,
        };
        let mut rec = Record {
            command: kind,
            proto: flow.proto,
            receiver_vir: flow.remote,
            sender_vir: flow.local,
            sender_phys: c.local_phys,
            ext,
            seq: 0,
            tag: [0; wire::TAG_LEN],
        };
        // From where the connection is now, once it moved (see
        // `Transmit::src`).
        // (Not to an address of the other family: a LOOKUP to an IPv4
        // location server while the connection is carried over IPv6.)
        let src = (c.local_phys.ip() != flow.local.ip() && c.local_phys.is_ipv4() == dst.is_ipv4())
            .then_some(c.local_phys.ip());
        let mut sent = true;
        for ext in std::iter::once(ext).chain(prev_lookup) {
            let Some(c) = self.conns.get_mut(flow) else {
                return false;
            };
            c.send_seq += 1;
            rec.seq = c.send_seq;
            rec.ext = ext;
            sent &= self.push_signed(&rec, &key, kind, req, dst, src);
        }
        sent
    }

    /// Sign `rec` with `key` and queue it in a `kind` datagram.
    pub(crate) fn push_signed(
        &mut self,
        rec: &Record,
        key: &SecretKey,
        kind: Kind,
        req: u32,
        dst: SocketAddr,
        src: Option<IpAddr>,
    ) -> bool {
        let mut buf = [0u8; MAX_SIGNED_LEN];
        let Ok(n) = rec.write_signed(&mut buf) else {
            self.stats.reject(Reject::UnencodableRecord);
            return false;
        };
        let tag = super::crypto::record_tag(key, &buf[..n]);
        if super::extstore::is_external(&dst) {
            self.push_external(rec, &buf[..n], &tag, req);
            self.stats.count(Counter::RecordsSent);
            return true;
        }
        self.tx.push_record(
            (dst, kind, rec.family(), req, src),
            &buf[..n],
            &tag,
            &mut self.stats,
        );
        self.stats.count(Counter::RecordsSent);
        true
    }

    /// The next datagram to send, if any.
    pub fn poll_transmit(&mut self, now: Timestamp) -> Option<Transmit> {
        self.binds.clock = now;
        if !self.claims_due.is_empty() {
            self.flush_due_claims(now);
        }
        self.tx.flush(&mut self.stats);
        self.tx.pop(&mut self.stats)
    }

    /// The next event for the datapath or the control API.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When `handle_timeout` must be called next.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        #[cfg(debug_assertions)]
        self.check_timers();
        let mut t: Option<Timestamp> = None;
        let mut take = |d: Timestamp| t = Some(t.map_or(d, |x| x.min(d)));
        if let Some(d) = self.conn_timers.next() {
            take(d);
        }
        if let Some(d) = self.pairing.next_deadline() {
            take(d);
        }
        if let Some(d) = self.validations.next_deadline() {
            take(d);
        }
        if let Some(d) = self.switch_deadline() {
            take(d);
        }
        if let Some(d) = self.next_bind_timeout() {
            take(d);
        }
        if let Some(d) = self.next_trust_rebuild() {
            take(d);
        }
        if !self.store.is_empty() {
            take(self.next_store_expiry);
        }
        if !self.cfg.keepalive_interval.is_zero() && !self.sessions.is_empty() {
            take(self.next_keepalive);
        }
        t
    }

    /// Every connection's entry in the timer table is its deadline, and
    /// there is no other entry: a deadline changed without `rearm` panics
    /// here in tests instead of firing late.
    #[cfg(debug_assertions)]
    fn check_timers(&self) {
        for c in self.conns.values() {
            assert_eq!(
                self.conn_timers.get(&c.flow),
                c.deadline(),
                "timer table out of date for {}",
                c.flow
            );
        }
        let armed = self.conns.values().filter(|c| c.deadline().is_some());
        assert_eq!(self.conn_timers.len(), armed.count(), "stale timer entries");
    }

    /// `flow`'s deadlines may have changed: put it where it now belongs in
    /// the timer table.
    pub(crate) fn rearm(&mut self, flow: &VirtualFlow) {
        let d = self.conns.get(flow).and_then(|c| c.deadline());
        self.conn_timers.set(*flow, d);
    }

    /// Retransmit, give up or expire whatever is due at `now`.
    pub fn handle_timeout<R: RngCore + CryptoRng>(&mut self, now: Timestamp, rng: &mut R) {
        let mut ctx = Ctx::new(now, rng);
        self.binds.clock = now;
        self.pairing_timeouts(&mut ctx);
        self.pair_retry_timeouts(&mut ctx);
        self.claim_timeouts(&mut ctx);
        self.keepalive_timeouts(now);
        self.role_and_key_timeouts(&mut ctx);
        self.help_timeouts(&mut ctx);
        self.migration_timeouts(&mut ctx);
        self.validation_timeouts(&mut ctx);
        self.switch_timeouts(now);
        self.bind_timeouts(now);
        self.trust_timeouts(now);
        if now >= self.next_store_expiry {
            self.store.expire(now);
            self.next_store_expiry = now.plus(Duration::from_secs(10));
        }
        self.requests.retain(|_, r| r.expires > now);
        self.tx.flush(&mut self.stats);
    }

    /// Prepare `flows` for a planned move (paper section 3.3.1): claim the
    /// primary role and run the suspend-time key agreement. Optional: a move
    /// without it still works.
    pub fn suspend<R: RngCore + CryptoRng>(
        &mut self,
        now: Timestamp,
        rng: &mut R,
        flows: &[VirtualFlow],
    ) -> Result<(), EndpointError> {
        for f in flows {
            if !self.conns.contains_key(f) {
                return Err(EndpointError::UnknownConnection(*f));
            }
        }
        let mut ctx = Ctx::new(now, rng);
        for f in flows {
            self.start_suspend(&mut ctx, f);
        }
        self.tx.flush(&mut self.stats);
        Ok(())
    }

    /// Ask the peers of `flows` for `help` while this host is away (see
    /// `vcmp::help`); an empty `help` ends it. Connections without keys
    /// (not paired) are skipped: nothing could authenticate the request.
    /// Returns how many were asked.
    pub fn request_help<R: RngCore + CryptoRng>(
        &mut self,
        now: Timestamp,
        rng: &mut R,
        flows: &[VirtualFlow],
        help: &super::help::Help,
    ) -> Result<usize, EndpointError> {
        for f in flows {
            if !self.conns.contains_key(f) {
                return Err(EndpointError::UnknownConnection(*f));
            }
        }
        let mut ctx = Ctx::new(now, rng);
        let mut asked = 0;
        for f in flows {
            if self.conns.get(f).is_some_and(|c| c.keys.is_some()) {
                self.start_help(&mut ctx, f, help);
                asked += 1;
            }
        }
        self.tx.flush(&mut self.stats);
        Ok(asked)
    }

    /// Whether the peer of `flow` has confirmed (HELP_R) the last help
    /// asked of it with [`Endpoint::request_help`]: false while it is
    /// being resent, and for a connection VCMP does not have.
    pub fn help_confirmed(&self, flow: &VirtualFlow) -> bool {
        self.conns.get(flow).is_some_and(|c| c.help.is_none())
    }

    /// `flows` now live at new local physical endpoints (the host woke up
    /// elsewhere, or the connections were imported on a new host): locate
    /// the peers and update them (paper section 3.3.2).
    pub fn resume<R: RngCore + CryptoRng>(
        &mut self,
        now: Timestamp,
        rng: &mut R,
        moves: &[(VirtualFlow, SocketAddr)],
    ) -> Result<(), EndpointError> {
        let moves: Vec<_> = moves.iter().map(|(f, to)| (*f, *to, None)).collect();
        self.resume_across(now, rng, &moves)
    }
}

impl Conn {
    pub fn new(
        flow: VirtualFlow,
        local_phys: SocketAddr,
        remote_phys: SocketAddr,
        binding: Binding,
    ) -> Conn {
        Conn {
            flow,
            binding,
            bind_retry: None,
            peer_named: None,
            local_phys,
            remote_phys,
            local_alt: None,
            remote_alt: None,
            follows_peer: false,
            peer_key: None,
            keys: None,
            prev_keys: None,
            send_seq: 0,
            replay: ReplayWindow::default(),
            binding_seq: 0,
            location_seq: 0,
            role: RoleState::default(),
            pending_remote: None,
            nat_candidate: None,
            sending_unvalidated: false,
            local_unproven: false,
            keyx: None,
            keyx_answer: None,
            keyx_answer_seq: 0,
            send_prev: false,
            validated: vec![remote_phys.ip()],
            claim_retry: None,
            settling: None,
            mig: None,
            help: None,
            help_seq: 0,
        }
    }
}
