//! Pairing of two hosts' long-term keys (DESIGN.md section 4, beyond the
//! paper): three messages, PAIR_INIT, PAIR_RESP, PAIR_FIN, with the triple
//! Diffie-Hellman schedule of `crypto::pair_schedule`. Each side's tag can
//! only be computed with its host secret, so both hosts are authenticated
//! against the pinned (or first-seen) keys. Connection keys are then
//! derived from the pairing secret for every connection between the hosts.
//!
//! Cheap checks come first: a PAIR_INIT is only answered (the DH is only
//! computed) for an address we share a connection with or have a pin for,
//! and at most `max_pending_pairings` handshakes are held.

use std::net::{IpAddr, SocketAddr};

use super::crypto::{self, Ephemeral, PairKeys, Transcript};
use super::endpoint::{CryptoDyn, Ctx, Endpoint, Event};
use super::wire::{ErrorCode, Message};

pub(crate) enum Handshake {
    Initiator {
        id: u32,
        eph: Ephemeral,
        tries: u32,
        deadline: super::Timestamp,
    },
    Responder {
        id: u32,
        init_static: [u8; 32],
        keys: PairKeys,
        resp: Vec<u8>,
        tries: u32,
        deadline: super::Timestamp,
    },
}

impl Handshake {
    pub fn deadline(&self) -> super::Timestamp {
        match self {
            Handshake::Initiator { deadline, .. } | Handshake::Responder { deadline, .. } => {
                *deadline
            }
        }
    }
}

impl Endpoint {
    fn pair_addr(&self, ip: IpAddr) -> SocketAddr {
        SocketAddr::new(ip, self.cfg.port)
    }

    fn is_paired(&self, ip: &IpAddr) -> bool {
        self.pins
            .get(ip)
            .is_some_and(|k| self.sessions.contains_key(k))
    }

    /// A host we share a connection with (its address is trusted) or have a
    /// pin for. O(1): this check guards the DH against strangers.
    fn knows_peer(&self, ip: &IpAddr) -> bool {
        self.pins.contains_key(ip) || self.tx.trusted.contains(ip)
    }

    pub(crate) fn start_pairing(&mut self, ctx: &mut Ctx, ip: IpAddr) {
        if self.handshakes.contains_key(&ip) || self.is_paired(&ip) {
            return;
        }
        if self.handshakes.len() >= self.cfg.max_pending_pairings {
            self.stats.reject("pairing_table_full");
            return;
        }
        let eph = Ephemeral::generate(&mut CryptoDyn(&mut ctx.rng));
        let id = ctx.rng.next_u32();
        self.send_pair_init(ip, id, &eph);
        let deadline = ctx.now.plus(self.rto(ctx, 0));
        self.handshakes.insert(
            ip,
            Handshake::Initiator {
                id,
                eph,
                tries: 1,
                deadline,
            },
        );
    }

    fn send_pair_init(&mut self, ip: IpAddr, id: u32, eph: &Ephemeral) {
        let msg = Message::PairInit {
            request_id: id,
            static_pub: self.identity.public(),
            eph_pub: eph.public(),
        };
        if let Ok(b) = msg.encode() {
            let dst = self.pair_addr(ip);
            self.tx.push_datagram(dst, b, &mut self.stats);
        }
    }

    /// Refuse loudly a key that differs from the pinned one.
    fn check_pin(&mut self, from: SocketAddr, offered: &[u8; 32], id: u32) -> bool {
        match self.pins.get(&from.ip()).copied() {
            Some(pinned) if pinned != *offered => {
                self.stats.reject("peer_key_changed");
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
    ) {
        let ip = from.ip();
        if !self.knows_peer(&ip) {
            self.stats.reject("pair_unknown_source");
            return;
        }
        if let Some(Handshake::Responder { id: rid, resp, .. }) = self.handshakes.get(&ip) {
            if *rid == id {
                let again = resp.clone();
                self.tx.push_datagram(from, again, &mut self.stats);
                self.stats.count("pair_resp_resent");
                return;
            }
        }
        if init_static == self.identity.public() {
            self.stats.reject("pair_reflected");
            return;
        }
        if !self.check_pin(from, &init_static, id) {
            return;
        }
        if let Some(Handshake::Initiator { .. }) = self.handshakes.get(&ip) {
            // Crossing initiations: the host with the lower key answers and
            // the other one waits for that answer.
            if self.identity.public() > init_static {
                self.stats.count("pair_crossing_ignored");
                return;
            }
        }
        if !self.handshakes.contains_key(&ip)
            && self.handshakes.len() >= self.cfg.max_pending_pairings
        {
            self.stats.reject("pairing_table_full");
            return;
        }
        let eph = Ephemeral::generate(&mut CryptoDyn(&mut ctx.rng));
        let (Ok(ee), Ok(se), Ok(es)) = (
            eph.dh(&init_eph),
            eph.dh(&init_static),
            self.identity.dh(&init_eph),
        ) else {
            self.stats.reject("low_order_point");
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
        self.handshakes.insert(
            ip,
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

    pub(crate) fn on_pair_resp(
        &mut self,
        from: SocketAddr,
        id: u32,
        resp_static: [u8; 32],
        resp_eph: [u8; 32],
        tag: [u8; 32],
    ) {
        let ip = from.ip();
        let Some(Handshake::Initiator { id: iid, eph, .. }) = self.handshakes.get(&ip) else {
            // A duplicate RESP after we finished: our FIN was lost, send
            // it again (no new state, no DH).
            match self.fins.get(&ip) {
                Some((fid, fin)) if *fid == id && self.pins.get(&ip) == Some(&resp_static) => {
                    let fin = fin.clone();
                    self.tx.push_datagram(from, fin, &mut self.stats);
                    self.stats.count("pair_fin_resent");
                }
                _ => self.stats.reject("pair_resp_unsolicited"),
            }
            return;
        };
        if *iid != id {
            self.stats.reject("pair_wrong_id");
            return;
        }
        let my_pub = self.identity.public();
        let (Ok(ee), Ok(se), Ok(es)) = (
            eph.dh(&resp_eph),
            self.identity.dh(&resp_eph),
            eph.dh(&resp_static),
        ) else {
            self.stats.reject("low_order_point");
            return;
        };
        let t = Transcript::new(id, &my_pub, &eph.public(), &resp_static, &resp_eph);
        let keys = crypto::pair_schedule(&t, &ee, &se, &es);
        if !crypto::tags_equal(&keys.resp_tag, &tag) {
            self.stats.reject("pair_bad_tag");
            return;
        }
        if !self.check_pin(from, &resp_static, id) {
            self.handshakes.remove(&ip);
            return;
        }
        if let Ok(b) = (Message::PairFin {
            request_id: id,
            tag: keys.init_tag,
        })
        .encode()
        {
            if self.fins.len() >= self.cfg.max_pending_pairings {
                self.fins.clear();
            }
            self.fins.insert(ip, (id, b.clone()));
            self.tx.push_datagram(from, b, &mut self.stats);
        }
        self.handshakes.remove(&ip);
        self.paired(ip, resp_static, keys);
    }

    pub(crate) fn on_pair_fin(&mut self, from: SocketAddr, id: u32, tag: [u8; 32]) {
        let ip = from.ip();
        let Some(Handshake::Responder {
            id: rid,
            keys,
            init_static,
            ..
        }) = self.handshakes.get(&ip)
        else {
            self.stats.reject("pair_fin_unsolicited");
            return;
        };
        if *rid != id || !crypto::tags_equal(&keys.init_tag, &tag) {
            self.stats.reject("pair_bad_tag");
            return;
        }
        let peer = *init_static;
        if let Some(Handshake::Responder { keys, .. }) = self.handshakes.remove(&ip) {
            self.paired(ip, peer, keys);
        }
    }

    fn paired(&mut self, ip: IpAddr, peer: [u8; 32], keys: PairKeys) {
        self.pins.insert(ip, peer);
        // A new session with a host we were already paired with means the
        // peer lost its state (its vnatd restarted): it derives every
        // connection's keys from the new session and numbers its records
        // from the start, so ours must follow or every update it sends is
        // refused (bad MAC, then "replay" on the sequence numbers).
        let renewed = self.sessions.insert(peer, keys.secret).is_some();
        self.tx.trusted.insert(ip);
        self.stats.count("paired");
        self.emit(Event::Paired {
            peer: ip,
            key: peer,
        });
        let flows: Vec<_> = self
            .conns
            .values()
            .filter(|c| (renewed || c.keys.is_none()) && c.remote_phys.ip() == ip)
            .map(|c| c.flow)
            .collect();
        for f in flows {
            if renewed {
                if let Some(c) = self.conns.get_mut(&f) {
                    // The old keys are gone on the other side: keeping them
                    // (as `prev_keys`) would only let old records be replayed
                    // against the fresh window.
                    c.keys = None;
                    c.prev_keys = None;
                    c.replay = Default::default();
                    c.send_seq = 0;
                }
            }
            self.ensure_keys(&f);
        }
    }

    pub(crate) fn pairing_timeouts(&mut self, ctx: &mut Ctx) {
        let due: Vec<IpAddr> = self
            .handshakes
            .iter()
            .filter(|(_, h)| h.deadline() <= ctx.now)
            .map(|(ip, _)| *ip)
            .collect();
        for ip in due {
            let Some(mut h) = self.handshakes.remove(&ip) else {
                continue;
            };
            let tries = match &mut h {
                Handshake::Initiator { tries, .. } | Handshake::Responder { tries, .. } => {
                    *tries += 1;
                    *tries
                }
            };
            if tries > self.cfg.max_tries {
                self.stats.count("pairing_timed_out");
                continue;
            }
            let deadline = ctx.now.plus(self.rto(ctx, tries - 1));
            match &mut h {
                Handshake::Initiator {
                    id,
                    eph,
                    deadline: d,
                    ..
                } => {
                    *d = deadline;
                    let (id, eph) = (*id, &*eph);
                    self.send_pair_init(ip, id, eph);
                }
                Handshake::Responder {
                    resp, deadline: d, ..
                } => {
                    *d = deadline;
                    let dst = self.pair_addr(ip);
                    self.tx.push_datagram(dst, resp.clone(), &mut self.stats);
                }
            }
            self.stats.count("pair_retransmit");
            self.handshakes.insert(ip, h);
        }
    }
}
