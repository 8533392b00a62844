//! Pairing of two hosts' long-term keys (DESIGN.md section 4, beyond the
//! paper): three messages, PAIR_INIT, PAIR_RESP, PAIR_FIN, with the triple
//! Diffie-Hellman schedule of `crypto::pair_schedule`. Each side's tag can
//! only be computed with its host secret, so both hosts are authenticated
//! against the pinned (or first-seen) keys. Connection keys are then
//! derived from the pairing secret for every connection between the hosts.
//!
//! Cheap checks come first: a PAIR_INIT is only answered (the DH is only
//! computed) for an address we share a connection with or have a pin for,
//! and at most `max_pending_pairings` handshakes are held. Beyond that, a
//! responder keeps nothing and computes nothing for an initiator that has
//! not proved it receives at its address, whenever it is loaded (half its
//! handshake table in use), the source is over its DH limit (`vcmp::cookie`)
//! or the PAIR_INIT would replace a handshake under way with that address:
//! it answers with a cookie (PAIR_COOKIE), which the initiator echoes in its
//! PAIR_INIT. A spoofed PAIR_INIT flood thus costs a MAC per datagram, and
//! cannot overwrite a real handshake.
//!
//! An initiator whose pairing fails (no answer, or its own table full)
//! tries again later, with backoff, while connections with that host
//! still wait for a pairing: a connection is never left non-mobile for
//! life because a handshake was lost.
//!
//! A pairing authenticates a host, not an address: several hosts may pair
//! from one address (NAT), each with its own session, and a host with a
//! new key at a known address is a new host. Which connections a paired
//! host may move is decided by CLAIM (`vcmp::claim`), never by where it
//! paired from. Only a key pre-configured for an address (`pin_peer`)
//! refuses other keys from there.

use crate::stats::{Counter, Reject};
use std::net::{IpAddr, SocketAddr};

use super::crypto::{self, Ephemeral, PairKeys, Transcript};
use super::endpoint::{CryptoDyn, Ctx, Endpoint, Event};
use super::wire::{ErrorCode, Message, COOKIE_LEN};
use super::Timestamp;

mod state;
pub(crate) use state::{Handshake, Pairings, Side};

/// How often at most we pair again with one peer whose updates go
/// unanswered.
pub const RENEW_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

impl Endpoint {
    fn pair_addr(&self, ip: IpAddr) -> SocketAddr {
        SocketAddr::new(ip, self.cfg.port)
    }

    /// A host we share a connection with (its address is trusted) or have a
    /// pin for; or a host we are paired with that now speaks from another
    /// address: it moved while its vnatd was not
    /// running (a crash in the middle of a move, a restart on another
    /// network), and its connections still name the old one. Anyone can
    /// offer a known key, but the cookie and the per-source DH limit apply
    /// as to any PAIR_INIT, and only the key's holder completes a pairing.
    /// O(1): this check guards the DH against strangers.
    pub(crate) fn knows_initiator(&self, ip: &IpAddr, key: &[u8; 32]) -> bool {
        self.pins.contains_key(ip)
            || self.tx.trusted.contains(ip)
            // A stranger's provisional session makes it known to nobody.
            || (self.sessions.contains_key(key) && !self.pairing.strangers.is_pending(key))
            || self.pairing.known_hosts.contains(key)
    }

    /// Hosts paired with before (by a previous vnatd of this host), with
    /// the address each last paired from: they may pair again from any
    /// address (proving it with a cookie).
    pub fn know_hosts(&mut self, hosts: impl IntoIterator<Item = ([u8; 32], IpAddr)>) {
        for (key, ip) in hosts {
            self.pairing.known_hosts.insert(key);
            self.pairing.known_addrs.insert(ip);
            // It paired from there before (`vcmp::proof`).
            self.pairing.strangers.proofs.proven_at(key, ip);
        }
    }

    pub(crate) fn start_pairing(&mut self, ctx: &mut Ctx, ip: IpAddr) {
        if !self.sessions_at(ip).is_empty() {
            return;
        }
        self.initiate(ctx, ip);
    }

    /// Pair again with `ip` although we are paired with it: our updates to
    /// it go unanswered, and the likeliest reason is that its vnatd
    /// restarted (lost our session) while we moved, so that it cannot
    /// reach us at the address its connections name, and would not pair
    /// with us if it could. A new session makes both ends derive fresh
    /// keys and claim the connections again (see `paired`). At most once
    /// per [`RENEW_INTERVAL`] per address.
    pub(crate) fn pair_again(&mut self, ctx: &mut Ctx, ip: IpAddr) {
        let now = ctx.now;
        if !self.may_renew(ip, now) {
            return;
        }
        self.pairing
            .renewals
            .retain(|_, at| now.since(*at) < RENEW_INTERVAL);
        self.pairing.renewals.insert(ip, now);
        self.stats.count(Counter::PairingRenewed);
        self.initiate(ctx, ip);
    }

    /// Whether an ERROR unknown-connection from `ip` is worth looking into
    /// now: from the address of a host we share connections with, and not
    /// looked into in the last second (anyone can send ERRORs as that
    /// host, and looking walks every connection).
    pub(crate) fn check_error_from(&mut self, ip: IpAddr, now: Timestamp) -> bool {
        const EVERY: std::time::Duration = std::time::Duration::from_secs(1);
        if !self.tx.trusted.contains(&ip) || !self.may_renew(ip, now) {
            return false;
        }
        if self
            .pairing
            .error_checks
            .get(&ip)
            .is_some_and(|at| now.since(*at) < EVERY)
        {
            return false;
        }
        if self.pairing.error_checks.len() >= 1024 {
            self.pairing
                .error_checks
                .retain(|_, at| now.since(*at) < EVERY);
        }
        self.pairing.error_checks.insert(ip, now);
        true
    }

    /// Whether [`Endpoint::pair_again`] with `ip` would start a pairing
    /// now (none in the last [`RENEW_INTERVAL`]).
    pub(crate) fn may_renew(&self, ip: IpAddr, now: Timestamp) -> bool {
        self.pairing
            .renewals
            .get(&ip)
            .is_none_or(|at| now.since(*at) >= RENEW_INTERVAL)
    }

    fn initiate(&mut self, ctx: &mut Ctx, ip: IpAddr) {
        let dst = self.pair_addr(ip);
        if self.pairing.has_handshake(dst, Side::Ours) {
            return;
        }
        if self.pairing.handshake_count() >= self.cfg.max_pending_pairings {
            self.stats.reject(Reject::PairingTableFull);
            self.retry_pairing_later(ctx.now, ip);
            return;
        }
        if !self.pairing.starts.allow(ctx.now) {
            // Over the rate of new pairings: in a second, not a failure.
            let failures = self.pairing.failures(ip);
            let at = ctx.now.plus(std::time::Duration::from_secs(1));
            self.pairing.schedule_retry(ip, failures, Some(at));
            self.stats.count(Counter::PairingDeferred);
            return;
        }
        self.pairing.attempting(ip);
        let eph = Ephemeral::generate(&mut CryptoDyn(&mut ctx.rng));
        let id = ctx.rng.next_u32();
        self.send_pair_init(dst, id, eph.public(), None);
        let deadline = ctx.now.plus(self.rto(ctx, 0));
        self.pairing.insert_handshake(
            dst,
            Side::Ours,
            Handshake::Initiator {
                id,
                eph,
                cookie: None,
                tries: 1,
                deadline,
            },
        );
    }

    /// Send a PAIR_INIT with our ephemeral key's public half `eph_pub`;
    /// whether it was queued.
    fn send_pair_init(
        &mut self,
        dst: SocketAddr,
        id: u32,
        eph_pub: [u8; 32],
        cookie: Option<[u8; COOKIE_LEN]>,
    ) -> bool {
        let msg = Message::PairInit {
            request_id: id,
            static_pub: self.identity.public(),
            eph_pub,
            cookie,
        };
        let Ok(b) = msg.encode() else { return false };
        self.tx.push_datagram(dst, b, &mut self.stats);
        true
    }

    /// Refuse loudly a key that differs from one pre-configured for the
    /// address.
    fn check_pin(&mut self, from: SocketAddr, offered: &[u8; 32], id: u32) -> bool {
        match self.pins.get(&from.ip()).copied() {
            Some(pinned) if pinned != *offered => {
                self.stats.reject(Reject::PeerKeyChanged);
                tracing::error!(peer = %from.ip(), "peer presented a host key other than the pinned one; refusing to pair");
                self.emit(Event::PeerKeyChanged {
                    peer: from.ip(),
                    pinned,
                    offered: *offered,
                });
                if let Ok(b) = (Message::Error {
                    request_id: id,
                    code: ErrorCode::PeerKeyMismatch,
                })
                .encode()
                {
                    self.tx.push_datagram(from, b, &mut self.stats);
                }
                false
            }
            _ => true,
        }
    }

    pub(crate) fn on_pair_init(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        id: u32,
        init_static: [u8; 32],
        init_eph: [u8; 32],
        cookie: Option<[u8; COOKIE_LEN]>,
    ) {
        let ip = from.ip();
        // A stranger only while a connection of ours waits for a host that
        // does not answer at its address (`vcmp::strangers`), and always
        // with a cookie (below: it is neither pinned nor trusted).
        if !self.knows_initiator(&ip, &init_static) && !self.admits_stranger(ip, ctx.now) {
            return;
        }
        if let Some(Handshake::Responder { id: rid, resp, .. }) =
            self.pairing.handshake(from, Side::Theirs)
        {
            if *rid == id {
                let again = resp.clone();
                self.tx.push_datagram(from, again, &mut self.stats);
                self.stats.count(Counter::PairRespResent);
                return;
            }
        }
        if init_static == self.identity.public() {
            self.stats.reject(Reject::PairReflected);
            return;
        }
        if self.pairing.has_handshake(from, Side::Ours) {
            // Crossing initiations: the host with the lower key answers (its
            // own handshake stays until the pairing completes) and the
            // other one waits for that answer.
            if self.identity.public() > init_static {
                self.stats.count(Counter::PairCrossingIgnored);
                return;
            }
        }
        // Admitted by its key alone (a known host at an address we share
        // nothing with): keys travel in clear, so anyone can quote one;
        // such an initiator proves its address with a cookie first.
        let by_key_only = !self.pins.contains_key(&ip) && !self.tx.trusted.contains(&ip);
        if !self.proved_or_cheap(ctx, from, id, &init_static, cookie, by_key_only) {
            return;
        }
        if !self.check_pin(from, &init_static, id) {
            return;
        }
        if !self.pairing.has_handshake(from, Side::Theirs)
            && self.pairing.handshake_count() >= self.cfg.max_pending_pairings
        {
            self.stats.reject(Reject::PairingTableFull);
            return;
        }
        let eph = Ephemeral::generate(&mut CryptoDyn(&mut ctx.rng));
        self.stats.count(Counter::PairDhComputed);
        let (Ok(ee), Ok(se), Ok(es)) = (
            eph.dh(&init_eph),
            eph.dh(&init_static),
            self.identity.dh(&init_eph),
        ) else {
            self.stats.reject(Reject::LowOrderPoint);
            return;
        };
        let my_pub = self.identity.public();
        let t = Transcript::new(id, &init_static, &init_eph, &my_pub, &eph.public());
        let keys = crypto::pair_schedule(&t, &ee, &se, &es);
        let msg = Message::PairResp {
            request_id: id,
            static_pub: my_pub,
            eph_pub: eph.public(),
            tag: keys.resp_tag,
        };
        let Ok(resp) = msg.encode() else { return };
        self.tx.push_datagram(from, resp.clone(), &mut self.stats);
        let deadline = ctx.now.plus(self.rto(ctx, 0));
        self.pairing.insert_handshake(
            from,
            Side::Theirs,
            Handshake::Responder {
                id,
                init_static,
                keys,
                resp,
                tries: 1,
                deadline,
            },
        );
    }

    /// Whether a PAIR_INIT from `from` may have state and a DH: always
    /// with a valid cookie; without one only if it replaces no handshake
    /// under way with `from`, we are not loaded, and the source is within
    /// its DH limit. Otherwise the initiator gets a cookie to echo.
    fn proved_or_cheap(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        id: u32,
        init_static: &[u8; 32],
        cookie: Option<[u8; COOKIE_LEN]>,
        always_cookie: bool,
    ) -> bool {
        self.pairing.cookies.rotate(ctx.now, &mut *ctx.rng);
        if let Some(c) = cookie {
            if self.pairing.cookies.check(from, id, init_static, &c) {
                return true;
            }
            // Stale (the secret moved on twice) or forged: ask again.
            self.stats.reject(Reject::PairBadCookie);
        } else {
            // Only a handshake we answer for that address would be
            // replaced (ours stays), and only those count as load.
            let replaces = self.pairing.has_handshake(from, Side::Theirs);
            let loaded = self.pairing.answering() >= self.cfg.max_pending_pairings / 2;
            if !always_cookie
                && !replaces
                && !loaded
                && self.pairing.limit.allow(from.ip(), ctx.now)
            {
                return true;
            }
        }
        let cookie = self.pairing.cookies.cookie(from, id, init_static);
        if let Ok(b) = (Message::PairCookie {
            request_id: id,
            cookie,
        })
        .encode()
        {
            self.tx.push_datagram(from, b, &mut self.stats);
            self.stats.count(Counter::PairCookiesSent);
        }
        false
    }

    /// A responder asks us to prove our address: PAIR_INIT again, at once,
    /// with its cookie (and with it on every retransmission).
    pub(crate) fn on_pair_cookie(&mut self, from: SocketAddr, id: u32, c: [u8; COOKIE_LEN]) {
        let Some(eph_pub) = self.pairing.set_cookie(from, id, c) else {
            self.stats.reject(Reject::PairCookieUnsolicited);
            return;
        };
        if self.send_pair_init(from, id, eph_pub, Some(c)) {
            self.stats.count(Counter::PairCookieEchoed);
        }
    }

    pub(crate) fn on_pair_resp(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        id: u32,
        resp_static: [u8; 32],
        resp_eph: [u8; 32],
        tag: [u8; 32],
    ) {
        let Some(Handshake::Initiator { id: iid, eph, .. }) =
            self.pairing.handshake(from, Side::Ours)
        else {
            // A duplicate RESP after we finished: our FIN was lost, send
            // it again (no new state, no DH).
            match self.pairing.fins.get(&from) {
                Some((fid, fin))
                    if *fid == id && self.peer_addrs.get(&resp_static) == Some(&from) =>
                {
                    let fin = fin.clone();
                    self.tx.push_datagram(from, fin, &mut self.stats);
                    self.stats.count(Counter::PairFinResent);
                }
                _ => self.stats.reject(Reject::PairRespUnsolicited),
            }
            return;
        };
        if *iid != id {
            self.stats.reject(Reject::PairWrongId);
            return;
        }
        let my_pub = self.identity.public();
        let (Ok(ee), Ok(se), Ok(es)) = (
            eph.dh(&resp_eph),
            self.identity.dh(&resp_eph),
            eph.dh(&resp_static),
        ) else {
            self.stats.reject(Reject::LowOrderPoint);
            return;
        };
        let t = Transcript::new(id, &my_pub, &eph.public(), &resp_static, &resp_eph);
        let keys = crypto::pair_schedule(&t, &ee, &se, &es);
        if !crypto::tags_equal(&keys.resp_tag, &tag) {
            self.stats.reject(Reject::PairBadTag);
            return;
        }
        if !self.check_pin(from, &resp_static, id) {
            self.pairing.remove_handshake(from, Side::Ours);
            self.retry_pairing_later(ctx.now, from.ip());
            return;
        }
        if let Ok(b) = (Message::PairFin {
            request_id: id,
            tag: keys.init_tag,
        })
        .encode()
        {
            if self.pairing.fins.len() >= self.cfg.max_pending_pairings {
                self.pairing.fins.clear();
            }
            self.pairing.fins.insert(from, (id, b.clone()));
            self.tx.push_datagram(from, b, &mut self.stats);
        }
        self.paired(ctx, from, resp_static, keys);
    }

    pub(crate) fn on_pair_fin(&mut self, ctx: &mut Ctx, from: SocketAddr, id: u32, tag: [u8; 32]) {
        let Some(Handshake::Responder {
            id: rid,
            keys,
            init_static,
            ..
        }) = self.pairing.handshake(from, Side::Theirs)
        else {
            self.stats.reject(Reject::PairFinUnsolicited);
            return;
        };
        if *rid != id || !crypto::tags_equal(&keys.init_tag, &tag) {
            self.stats.reject(Reject::PairBadTag);
            return;
        }
        let peer = *init_static;
        if let Some(Handshake::Responder { keys, .. }) =
            self.pairing.remove_handshake(from, Side::Theirs)
        {
            self.paired(ctx, from, peer, keys);
        }
    }

    fn paired(&mut self, ctx: &mut Ctx, from: SocketAddr, peer: [u8; 32], keys: PairKeys) {
        let ip = from.ip();
        // Decided before the session exists: a stranger's is provisional.
        let stranger = !self.knows_initiator(&ip, &peer);
        if stranger && !self.stranger_fits(ip) {
            // Over the caps since its PAIR_INIT was let through (several
            // handshakes were in flight): no session.
            self.pairing.remove_handshake(from, Side::Ours);
            self.pairing.remove_handshake(from, Side::Theirs);
            return;
        }
        // A new session with a host we were already paired with means the
        // peer lost its state (its vnatd restarted): it derives every
        // connection's keys from the new session and numbers its records
        // from the start, so ours must follow or every update it sends is
        // refused (bad MAC, then "replay" on the sequence numbers). It also
        // lost its bindings, so those connections are claimed to it again.
        // Paired: neither side's handshake with that address is needed.
        self.pairing.remove_handshake(from, Side::Ours);
        self.pairing.remove_handshake(from, Side::Theirs);
        let renewed = self.sessions.insert(peer, keys.secret).is_some();
        self.peer_addrs.insert(peer, from);
        // Its handshake proved it receives there (`vcmp::proof`).
        self.pairing.strangers.proofs.proven_at(peer, ip);
        self.claim_index.remove(&peer);
        // A new session numbers its probes from the start.
        self.probes.remove(&peer);
        if stranger {
            // Known, trusted, counted and announced only once a claim of
            // its binds a connection (`promote_stranger`).
            self.stranger_paired(peer, ip, ctx.now);
        } else {
            self.stats.count(Counter::Paired);
            self.pairing.known_hosts.insert(peer);
            self.pairing.known_addrs.insert(ip);
            self.tx.trusted.insert(ip);
            self.pairing.forget_retry(ip);
            self.emit(Event::Paired {
                peer: ip,
                key: peer,
            });
        }
        let mut held = Vec::new();
        for c in self.conns.values_mut() {
            if c.peer_key != Some(peer) {
                continue;
            }
            if renewed {
                // The old keys are gone on the other side: keeping them
                // (as `prev_keys`) would only let old records be replayed
                // against the fresh window.
                c.keys = None;
                c.prev_keys = None;
                c.replay = Default::default();
                c.send_seq = 0;
                // Its updates and location records are numbered from the
                // start too.
                c.binding_seq = 0;
                c.location_seq = 0;
                c.help_seq = 0;
            }
            held.push(c.flow);
        }
        for f in &held {
            self.ensure_keys(f);
        }
        if renewed && !held.is_empty() {
            self.send_claims(peer, from, &held, false);
            // Every move under way starts over under the new session (after
            // the claims, which the peer needs first): what it sent is
            // signed with keys nobody holds any more, and what it stored
            // sits under a locator nobody will ask for.
            for f in &held {
                self.restart_migration(ctx, f);
            }
        }
        let unbound = self.unbound_at(ip);
        self.claim_at(ctx.now, ip, &unbound);
        // Learn at once how the peer sees us (behind a NAT or not).
        self.send_probe(peer);
    }

    pub(crate) fn pairing_timeouts(&mut self, ctx: &mut Ctx) {
        self.stranger_timeouts(ctx.now);
        for (dst, side) in self.pairing.due_handshakes(ctx.now) {
            let Some(mut h) = self.pairing.remove_handshake(dst, side) else {
                continue;
            };
            let tries = match &mut h {
                Handshake::Initiator { tries, .. } | Handshake::Responder { tries, .. } => {
                    *tries += 1;
                    *tries
                }
            };
            if tries > self.cfg.max_tries {
                self.stats.count(Counter::PairingTimedOut);
                // Ours or theirs (a crossing one that replaced nothing of
                // ours but never finished): the connections still wait.
                self.retry_pairing_later(ctx.now, dst.ip());
                continue;
            }
            let deadline = ctx.now.plus(self.rto(ctx, tries - 1));
            match &mut h {
                Handshake::Initiator {
                    id,
                    eph,
                    cookie,
                    deadline: d,
                    ..
                } => {
                    *d = deadline;
                    let (id, eph, cookie) = (*id, &*eph, *cookie);
                    self.send_pair_init(dst, id, eph.public(), cookie);
                }
                Handshake::Responder {
                    resp, deadline: d, ..
                } => {
                    *d = deadline;
                    self.tx.push_datagram(dst, resp.clone(), &mut self.stats);
                }
            }
            self.stats.count(Counter::PairRetransmit);
            self.pairing.insert_handshake(dst, side, h);
        }
    }

    /// A pairing with `ip` failed (or could not start): try again after a
    /// backoff, doubled per failure. Whether any connection still waits for
    /// it is decided when the retry is due, for all retries due then at
    /// once (the deadlines fall on whole seconds), so that many peers
    /// without vnatd cost one scan of the connections a second, not one
    /// each. Retries go on at most every `pair_retry_max` (one PAIR_INIT
    /// per five minutes to a host that never answers).
    pub(crate) fn retry_pairing_later(&mut self, now: Timestamp, ip: IpAddr) {
        let failures = self.pairing.failures(ip) + 1;
        let wait = self
            .cfg
            .pair_retry_initial
            .saturating_mul(1u32 << (failures - 1).min(16))
            .min(self.cfg.pair_retry_max);
        let at = now.plus(wait);
        let at = Timestamp(at.0.div_ceil(1_000_000_000).saturating_mul(1_000_000_000));
        self.pairing.schedule_retry(ip, failures, Some(at));
        self.stats.count(Counter::PairingRetryScheduled);
        tracing::debug!(peer = %ip, failures, retry_in_s = wait.as_secs(), "pairing failed; trying again later");
    }

    /// Start again the failed pairings that are due, for the addresses
    /// that still have connections waiting and no session.
    pub(crate) fn pair_retry_timeouts(&mut self, ctx: &mut Ctx) {
        let due: std::collections::HashSet<IpAddr> =
            self.pairing.due_retries(ctx.now).into_iter().collect();
        if due.is_empty() {
            return;
        }
        let waiting: std::collections::HashSet<IpAddr> = self
            .conns
            .values()
            .filter(|c| c.peer_key.is_none() && due.contains(&c.remote_phys.ip()))
            .map(|c| c.remote_phys.ip())
            .collect();
        for ip in due {
            if !waiting.contains(&ip) || !self.sessions_at(ip).is_empty() {
                self.pairing.forget_retry(ip);
                continue;
            }
            self.stats.count(Counter::PairingRetried);
            self.start_pairing(ctx, ip);
            let ours = self.pairing.has_handshake(self.pair_addr(ip), Side::Ours);
            match self.pairing.retry_of(ip) {
                // An attempt of ours is under way (just started, or it was
                // already: then the due retry must not stay due, or every
                // loop turn would come back here).
                Some(_) if ours => self.pairing.attempting(ip),
                // Deferred by the start rate: due again in a second.
                Some((_, Some(t))) if t > ctx.now => {}
                // Could not start (its table full): not forgotten.
                _ => self.retry_pairing_later(ctx.now, ip),
            }
        }
    }
}
