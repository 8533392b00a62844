//! Receive path. Order of checks (STYLE.md): length and type (the decoder),
//! then the constant-time MAC with the connection's receive key, then the
//! replay window, then the state change. A record that fails any check is
//! counted under its reason and changes nothing.

use crate::stats::{Counter, Reject};
use std::net::{IpAddr, SocketAddr};

use rand_core::{CryptoRng, RngCore};

use super::crypto;
use super::endpoint::{Ctx, Endpoint, Event};
use super::replay::ReplayError;
use super::wire::{self, ErrorCode, Ext, Family, Kind, Message, Record, MAX_SIGNED_LEN};
use super::Timestamp;
use crate::flow::VirtualFlow;

impl Endpoint {
    /// Process one datagram received from `from`. Never panics and never
    /// fails: whatever is refused is counted in [`Endpoint::stats`].
    pub fn handle_datagram<R: RngCore + CryptoRng>(
        &mut self,
        now: Timestamp,
        rng: &mut R,
        from: SocketAddr,
        bytes: &[u8],
    ) {
        self.handle_datagram_at(now, rng, from, None, bytes)
    }

    /// [`Endpoint::handle_datagram`] for a datagram sent to this host's
    /// address `to` (IP_PKTINFO): a peer that sent its update to where our
    /// own move took us knows our new address, so it may be sent to before
    /// its own is validated while we move too (see `send_unvalidated`).
    pub fn handle_datagram_at<R: RngCore + CryptoRng>(
        &mut self,
        now: Timestamp,
        rng: &mut R,
        from: SocketAddr,
        to: Option<IpAddr>,
        bytes: &[u8],
    ) {
        let mut ctx = Ctx::new(now, rng);
        ctx.rx_to = to;
        self.stats.count(Counter::DatagramsReceived);
        // Every byte from an address counts towards what we may send it
        // (three times as much, `tx::AMPLIFICATION_FACTOR`): whatever it
        // is, it came from there or from someone who can forge that
        // address, who could as well have sent it to us for real.
        self.tx.credit(from.ip(), bytes.len());
        // BIND_REQ nonces start at a random point (requests go out in
        // answer to datagrams, so this is before the first).
        self.binds.seed_nonce(ctx.rng);
        self.binds.clock = now;
        if super::bind::is_bind(bytes) {
            self.on_bind_datagram(now, &mut *ctx.rng, from, bytes);
            self.tx.flush(&mut self.stats);
            return;
        }
        if super::proof::is_proof(bytes) {
            self.on_proof_datagram(from, bytes);
            return;
        }
        let msg = match Message::decode(bytes) {
            Ok(m) => m,
            Err(e) => {
                self.stats.reject(e.reason());
                return;
            }
        };
        match msg {
            Message::Records {
                kind,
                request_id,
                family,
                records,
            } => match kind {
                Kind::Lookup => self.on_lookup(&mut ctx, from, request_id, family, &records),
                Kind::Store => self.on_store(&mut ctx, from, request_id, &records),
                Kind::LookupR => self.on_lookup_r(&mut ctx, request_id, &records),
                _ => {
                    let mut unknown = false;
                    ctx.rx_share = bytes.len() / records.len().max(1);
                    for rec in &records {
                        if self.on_record(&mut ctx, from, kind, rec) == Some(false) {
                            unknown = true;
                        }
                    }
                    if unknown && matches!(kind, Kind::Upd | Kind::KeyX | Kind::SuspPrimary) {
                        self.tell_unknown(from, request_id);
                    }
                }
            },
            Message::StoreR {
                request_id,
                accepted,
            } => self.on_store_r(&mut ctx, request_id, accepted),
            Message::PairInit {
                request_id,
                static_pub,
                eph_pub,
                cookie,
            } => self.on_pair_init(&mut ctx, from, request_id, static_pub, eph_pub, cookie),
            Message::PairCookie { request_id, cookie } => {
                self.on_pair_cookie(from, request_id, cookie)
            }
            Message::PairResp {
                request_id,
                static_pub,
                eph_pub,
                tag,
            } => self.on_pair_resp(&mut ctx, from, request_id, static_pub, eph_pub, tag),
            Message::PairFin { request_id, tag } => {
                self.on_pair_fin(&mut ctx, from, request_id, tag)
            }
            Message::Claim {
                answer,
                static_pub,
                entries,
                ..
            } => self.on_claim(now, from, answer, static_pub, &entries, bytes),
            Message::Probe {
                static_pub,
                seq,
                observed,
                addrs,
                ..
            } => {
                let before = self.peer_addrs.get(&static_pub).copied();
                if self.on_probe(now, from, static_pub, seq, observed, bytes) {
                    self.peer_told_addresses(static_pub, &addrs);
                }
                self.peer_vcmp_moved(static_pub, before);
            }
            Message::Error { code, .. } => {
                // Unauthenticated: reported, and acted on only where the
                // worst a forger gets is what we would do anyway.
                self.stats.count(Counter::PeerError);
                self.emit(Event::PeerError { from, code });
                // Only while one of our moves waits for that peer's answer:
                // otherwise a forger could make us pair again (and reset
                // every connection's keys with it) at will.
                let waiting = |ep: &Self| {
                    ep.peer_addrs.iter().any(|(key, a)| {
                        *a == from
                            && ep.conns.values().any(|c| {
                                c.peer_key.as_ref() == Some(key) && ep.waits_for_peer(&c.flow)
                            })
                    })
                };
                if code == ErrorCode::UnknownConnection
                    && self.check_error_from(from.ip(), ctx.now)
                    && waiting(self)
                {
                    // A host we are paired with does not know our
                    // connection: its vnatd restarted and lost our session
                    // (while we moved, or it would have paired with us
                    // again itself). A new pairing is authenticated and
                    // rate-limited (`pair_again`).
                    self.pair_again(&mut ctx, from.ip());
                }
            }
        }
        self.tx.flush(&mut self.stats);
    }

    /// Tell `from` that we have no keys for the connection its request
    /// names, one of ours (a restarted vnatd: the sender then pairs with us
    /// again). An unauthenticated reply, held to the anti-amplification
    /// budget; a record naming no connection of ours gets none.
    fn tell_unknown(&mut self, from: SocketAddr, request_id: u32) {
        if let Ok(b) = (Message::Error {
            request_id,
            code: ErrorCode::UnknownConnection,
        })
        .encode()
        {
            self.tx.push_datagram(from, b, &mut self.stats);
        }
    }

    /// One record of a connection-bound kind. Returns whether it was
    /// authentic (MAC and replay window passed): `Some(true)` if so,
    /// `Some(false)` if it names a connection of ours that we have no keys
    /// for (yet, or since a restart), `None` if it was refused for any
    /// other reason.
    fn on_record(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        kind: Kind,
        rec: &Record,
    ) -> Option<bool> {
        // The record names the sender's end as L and ours as R, the
        // sender's way (a NAT between us makes that differ from ours).
        let named = VirtualFlow {
            proto: rec.proto,
            local: rec.receiver_vir,
            remote: rec.sender_vir,
        };
        let Some(flow) = self.resolve(&named) else {
            self.stats.reject(Reject::UnknownConnection);
            return None;
        };
        let Some(c) = self.conns.get(&flow) else {
            self.stats.reject(Reject::UnknownConnection);
            return None;
        };
        let Some(keys) = &c.keys else {
            self.stats.reject(Reject::NoKeys);
            // Worth an answer only for a connection with a host we were
            // paired with (a restart lost the keys): for any other, an
            // answer would tell a stranger which connections exist.
            let known = self.pairing.known_addrs.contains(&c.remote_phys.ip())
                || self.pairing.known_addrs.contains(&flow.remote.ip());
            return if known { Some(false) } else { None };
        };
        let mut buf = [0u8; MAX_SIGNED_LEN];
        let Ok(n) = rec.write_signed(&mut buf) else {
            self.stats.reject(Reject::MixedFamilies);
            return None;
        };
        // Records still under the keys from before the last suspend-time DH
        // are accepted until the peer is seen using the new ones (it may not
        // have received our KEYX answer yet, like a QUIC key phase).
        let mut under_prev = false;
        let current = crypto::verify_record(&keys.recv, &buf[..n], &rec.tag);
        if !current {
            let prev_ok = c
                .prev_keys
                .as_ref()
                .is_some_and(|p| crypto::verify_record(&p.recv, &buf[..n], &rec.tag));
            if !prev_ok {
                self.stats.reject(Reject::BadMac);
                return None;
            }
            under_prev = true;
        }
        // Authentic: what handling it logs carries the connection and the
        // peer host's key.
        let span = tracing::debug_span!(
            "conn",
            id = flow.id(), flow = %flow,
            peer = c.peer_key.as_ref().map(crypto::key_short).as_deref().unwrap_or("-")
        );
        let _in = span.enter();
        if let Err(e) = c.replay.check(rec.seq) {
            self.stats.reject(match e {
                ReplayError::TooOld(_) => Reject::ReplayTooOld,
                ReplayError::Duplicate(_) => Reject::ReplayDuplicate,
            });
            return None;
        }
        // Fresh and authentic: its host was heard from now (`vnatctl peers`).
        if let Some(k) = c.peer_key {
            self.probes.entry(k).or_default().last_heard = Some(ctx.now);
        }
        let res = match kind {
            Kind::SuspPrimary => self.on_susp_primary(from, ctx, &flow),
            Kind::SuspSecondary => self.on_susp_secondary(&flow),
            Kind::Upd => self.on_upd(ctx, from, &flow, rec),
            Kind::UpdR => self.on_upd_r(ctx, &flow, rec),
            Kind::KeyX => self.on_keyx(ctx, from, &flow, rec, under_prev),
            Kind::Challenge => self.on_challenge(ctx, from, &flow, rec),
            Kind::Response => self.on_response(ctx.now, &flow, rec),
            Kind::Switched => self.on_switched(&flow),
            Kind::Help => self.on_help(ctx, from, &flow, rec),
            Kind::HelpR => self.on_help_r(&flow, rec),
            _ => Err(Reject::UnexpectedKind),
        };
        self.rearm(&flow);
        match res {
            Ok(()) => {
                if let Some(c) = self.conns.get_mut(&flow) {
                    c.replay.commit(rec.seq);
                    // The peer sent this to where our move took us, and
                    // made its receive side ready for that address first
                    // (an update, its answer, or SWITCHED: not a RESPONSE,
                    // which goes wherever our CHALLENGE came from).
                    if matches!(kind, Kind::Upd | Kind::UpdR | Kind::Switched)
                        && ctx.rx_to == Some(c.local_phys.ip())
                    {
                        c.local_unproven = false;
                    }
                    // Under the keys that were current when it arrived: the
                    // peer has them (a KEYX changed them since, and says
                    // for itself where it stands).
                    if current && kind != Kind::KeyX {
                        c.send_prev = false;
                        c.prev_keys = None;
                    }
                }
                self.stats.count(Counter::RecordsAccepted);
                Some(true)
            }
            Err(reason) => {
                self.stats.reject(reason);
                None
            }
        }
    }

    /// LOOKUP, in the location-server role (every vnatd has it). For a
    /// connection that is our own, we answer with a fresh record of where
    /// our end is; otherwise with what was stored for it.
    fn on_lookup(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        req: u32,
        family: Family,
        records: &[Record],
    ) {
        let mut answered = false;
        for rec in records {
            let named = VirtualFlow {
                proto: rec.proto,
                local: rec.receiver_vir,
                remote: rec.sender_vir,
            };
            let flow = self.resolve(&named).unwrap_or(named);
            if self.own_lookup(from, req, &flow, rec) {
                answered = true;
                continue;
            }
            // Every record stored under its locator (at most
            // MAX_RECORDS_PER_KEY, which fits the anti-amplification budget):
            // the store cannot tell the genuine one, so it must not pick,
            // least of all by sequence number, which a forger chooses. The
            // asker checks each tag. Only the connection's two ends know the
            // locator: whoever merely knows its addresses finds nothing.
            let super::wire::Ext::Locator(locator) = rec.ext else {
                continue;
            };
            let mut found = self.store.lookup(ctx.now, &locator);
            found.sort_by_key(|r| std::cmp::Reverse(r.seq));
            for s in &found {
                let mut buf = [0u8; MAX_SIGNED_LEN];
                let Ok(n) = s.write_signed(&mut buf) else {
                    continue;
                };
                self.tx.push_record(
                    (from, Kind::LookupR, family, req, None),
                    &buf[..n],
                    &s.tag,
                    &mut self.stats,
                );
                answered = true;
            }
        }
        if !answered {
            let mut b = Vec::with_capacity(wire::HEADER_LEN);
            wire::begin_records(&mut b, Kind::LookupR, family, req);
            self.tx.push_datagram(from, b, &mut self.stats);
        }
        self.stats.count(Counter::LookupsServed);
    }

    /// A LOOKUP by our peer for our own end of a connection: authenticate it
    /// like any record, then answer with our current location.
    fn own_lookup(&mut self, from: SocketAddr, req: u32, flow: &VirtualFlow, rec: &Record) -> bool {
        let Some(c) = self.conns.get_mut(flow) else {
            return false;
        };
        let Some(keys) = &c.keys else { return false };
        let mut buf = [0u8; MAX_SIGNED_LEN];
        let Ok(n) = rec.write_signed(&mut buf) else {
            return false;
        };
        if !crypto::verify_record(&keys.recv, &buf[..n], &rec.tag)
            || c.replay.check(rec.seq).is_err()
        {
            return false;
        }
        c.replay.commit(rec.seq);
        let Some(key) = c.send_key().cloned() else {
            return false;
        };
        c.send_seq += 1;
        let mine = Record {
            command: Kind::Store,
            proto: flow.proto,
            receiver_vir: flow.remote,
            sender_vir: flow.local,
            sender_phys: c.local_phys,
            ext: Ext::Locator(crypto::locator(&key)),
            seq: c.send_seq,
            tag: [0; wire::TAG_LEN],
        };
        let mut out = [0u8; MAX_SIGNED_LEN];
        let Ok(m) = mine.write_signed(&mut out) else {
            return false;
        };
        let tag = crypto::record_tag(&key, &out[..m]);
        self.tx.push_record(
            (from, Kind::LookupR, mine.family(), req, None),
            &out[..m],
            &tag,
            &mut self.stats,
        );
        self.stats.count(Counter::RecordsSent);
        true
    }

    /// Whether `rec` is a location record this host signed for its own end
    /// of one of its connections (checked with our send key, so nobody else
    /// can make a record look like ours).
    fn signed_by_us(&self, rec: &Record) -> bool {
        let own = VirtualFlow {
            proto: rec.proto,
            local: rec.sender_vir,
            remote: rec.receiver_vir,
        };
        let Some(c) = self.conns.get(&own) else {
            return false;
        };
        let mut buf = [0u8; MAX_SIGNED_LEN];
        let Ok(n) = rec.write_signed(&mut buf) else {
            return false;
        };
        [c.keys.as_ref(), c.prev_keys.as_deref()]
            .into_iter()
            .flatten()
            .any(|k| crypto::verify_record(&k.send, &buf[..n], &rec.tag))
    }

    /// STORE, in the location-server role: keep the records as signed.
    fn on_store(&mut self, ctx: &mut Ctx, from: SocketAddr, req: u32, records: &[Record]) {
        let mut accepted: u8 = 0;
        for rec in records {
            if self.signed_by_us(rec) {
                // Our own STORE came back to us: the chain's "own old
                // location" step (P(2)/S(1), paper 3.3.2.1) reached this
                // host because a host that moved keeps its old, virtual
                // address local (on lo, DESIGN.md section 3). Whoever asks
                // here for us gets our live answer (own_lookup) anyway, and
                // a host that moved whole cannot be reached at its old
                // address by the peer: accepting would park us at a place
                // nobody else can get to, never reaching the location
                // servers of step P(3)/S(3). Refused, the step fails at
                // once, as the paper's chain expects of an old location
                // that is gone.
                self.stats.reject(Reject::OwnLocation);
                continue;
            }
            if !self.store_is_genuine(rec) {
                self.stats.reject(Reject::BadMac);
                continue;
            }
            if self.store.store(ctx.now, from.ip(), *rec) {
                accepted = accepted.saturating_add(1);
            } else {
                self.stats.reject(Reject::StoreFull);
            }
        }
        if let Ok(b) = (Message::StoreR {
            request_id: req,
            accepted,
        })
        .encode()
        {
            self.tx.push_datagram(from, b, &mut self.stats);
        }
        self.stats.count(Counter::StoresServed);
    }

    /// A STORE for a connection we are the far end of (our peer keeps its
    /// location with us, step P(1)) can be checked with the connection key,
    /// and a forged one is refused; one for a connection we do not know
    /// cannot be checked here, and is kept as signed for the asker to check.
    fn store_is_genuine(&self, rec: &Record) -> bool {
        let named = VirtualFlow {
            proto: rec.proto,
            local: rec.receiver_vir,
            remote: rec.sender_vir,
        };
        let Some(c) = self.resolve(&named).and_then(|f| self.conns.get(&f)) else {
            return true;
        };
        let Some(keys) = c.keys.as_ref() else {
            return true;
        };
        let mut buf = [0u8; MAX_SIGNED_LEN];
        let Ok(n) = rec.write_signed(&mut buf) else {
            return false;
        };
        let signed = &buf[..n];
        crypto::verify_record(&keys.recv, signed, &rec.tag)
            || c.prev_keys
                .as_ref()
                .is_some_and(|p| crypto::verify_record(&p.recv, signed, &rec.tag))
    }
}
