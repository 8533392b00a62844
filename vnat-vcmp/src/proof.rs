//! Proof that a claimant receives at a connection's address (return
//! routability, as RFC 9000 section 8.2 does for paths).
//!
//! A strong binding (TCP's initial sequence numbers) is known to the two
//! ends, and to anyone who once saw the handshake go by (public Wi-Fi, a
//! tap on one link for one moment). Such a host pairs from an address of
//! its own, as a stranger or as a peer with a connection of its own, and
//! claims the connection; once bound, it could move it to itself from
//! anywhere. So a claim binds a connection only for a host that holds the
//! connection's address now:
//!
//! - the address it paired from, which its handshake proved (our PAIR_RESP
//!   went there and its PAIR_FIN answered it, or its PAIR_RESP answered
//!   our PAIR_INIT sent there), or
//!   (or, for a host known from an earlier run, the address it paired
//!   from then), or
//! - an address where it received a PROVE: a token, under a key only this
//!   host has, sent to the connection's remote address, which the claimant
//!   echoes in a PROVE_R under its pairing and then claims again.
//!
//! The PROVE goes to the connection's address at the port its session is
//! reached at if it is at that address (a NAT's mapping of the claimant's
//! VCMP socket), else at our VCMP port (a routed container's host takes
//! those for its guests' addresses). Both messages are authenticated under
//! the pairing's claim key, like CLAIM. Asking is bounded: a PROVE answers
//! a claim that named a connection of ours by its commitment (so the
//! claimant knew its facts), to that connection's own remote address, at
//! most [`ASKS_PER_ADDRESS`] times per claimant and address, and for at
//! most [`ADDRESSES_PER_HOST`] addresses per claimant at once.
//!
//! What this does not tell apart: hosts behind one NAT address receive at
//! it alike, so one of them that once saw another's handshake can still
//! claim that host's connection (the binding is never taken from a holder
//! afterwards, so only while it is still unbound).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use crate::stats::{Counter, Reject};

use super::crypto;
use super::endpoint::Endpoint;
use super::wire::{HEADER_LEN, PAIR_TAG_LEN, VERSION};
use crate::flow::VirtualFlow;

/// Kind byte of a PROVE ("echo this token, which went to that address").
pub(crate) const KIND_PROVE: u8 = 24;
/// Kind byte of a PROVE_R (the echo).
pub(crate) const KIND_PROVE_R: u8 = 25;
const TOKEN_LEN: usize = 16;
/// Header, sender's host key, the address, the token, the tag.
pub(crate) const PROVE_LEN: usize = HEADER_LEN + 32 + 16 + TOKEN_LEN + PAIR_TAG_LEN;

/// Most PROVEs sent to one address for one claimant (lost ones are asked
/// again when its claim is resent).
pub const ASKS_PER_ADDRESS: u8 = 4;
/// Most addresses asked of one claimant and not yet proven.
pub const ADDRESSES_PER_HOST: usize = 8;
/// Most addresses kept as proven for one host (the oldest goes).
const PROVEN_PER_HOST: usize = 16;
/// Most outstanding asks in all.
const MAX_ASKED: usize = 4096;

/// A token asked for and how often it was sent.
struct Ask {
    token: [u8; TOKEN_LEN],
    sent: u8,
}

/// What claimants proved and what was asked of them, by host key.
#[derive(Default)]
pub(crate) struct Proofs {
    proven: HashMap<[u8; 32], Vec<IpAddr>>,
    asked: HashMap<([u8; 32], IpAddr), Ask>,
    /// Numbers the tokens, so that each ask is fresh.
    next: u64,
}

impl Proofs {
    /// `key` receives at `ip` (its handshake or a PROVE_R showed it).
    pub fn proven_at(&mut self, key: [u8; 32], ip: IpAddr) {
        self.asked.remove(&(key, ip));
        let list = self.proven.entry(key).or_default();
        if list.contains(&ip) {
            return;
        }
        if list.len() >= PROVEN_PER_HOST {
            list.remove(0);
        }
        list.push(ip);
    }

    /// How many addresses `key` was asked to prove and has not (for the
    /// simulator's tests).
    #[cfg(test)]
    pub fn asked_of(&self, key: &[u8; 32]) -> usize {
        self.asked.keys().filter(|(k, _)| k == key).count()
    }

    pub fn is_proven(&self, key: &[u8; 32], ip: IpAddr) -> bool {
        self.proven.get(key).is_some_and(|l| l.contains(&ip))
    }

    /// The host `key` is gone: nothing it proved or was asked counts.
    pub fn forget(&mut self, key: &[u8; 32]) {
        self.proven.remove(key);
        self.asked.retain(|(k, _), _| k != key);
    }
}

/// Whether `b` is a PROVE or a PROVE_R (by its first two bytes).
pub(crate) fn is_proof(b: &[u8]) -> bool {
    b.len() >= 2 && b[0] == VERSION && (b[1] == KIND_PROVE || b[1] == KIND_PROVE_R)
}

fn v6_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// A PROVE or PROVE_R, its tag still to be filled in.
fn encode(kind: u8, sender: &[u8; 32], ip: IpAddr, token: &[u8; TOKEN_LEN]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PROVE_LEN);
    out.extend_from_slice(&[VERSION, kind, 0, 0, 0, 0, 0, 0]);
    out.extend_from_slice(sender);
    out.extend_from_slice(&v6_bytes(ip));
    out.extend_from_slice(token);
    out.extend_from_slice(&[0; PAIR_TAG_LEN]);
    out
}

/// A PROVE or PROVE_R as received.
struct Proof {
    kind: u8,
    sender: [u8; 32],
    ip: IpAddr,
    token: [u8; TOKEN_LEN],
}

fn decode(b: &[u8]) -> Result<Proof, Reject> {
    if b.len() != PROVE_LEN || !is_proof(b) || b[2..HEADER_LEN].iter().any(|x| *x != 0) {
        return Err(Reject::ProofMalformed);
    }
    let mut sender = [0u8; 32];
    sender.copy_from_slice(&b[HEADER_LEN..HEADER_LEN + 32]);
    let at = HEADER_LEN + 32;
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[at..at + 16]);
    let mut token = [0u8; TOKEN_LEN];
    token.copy_from_slice(&b[at + 16..at + 16 + TOKEN_LEN]);
    Ok(Proof {
        kind: b[1],
        sender,
        ip: IpAddr::V6(Ipv6Addr::from(a)).to_canonical(),
        token,
    })
}

impl Endpoint {
    /// Whether a claim of `peer` may bind `flow`: anything but an unbound,
    /// strongly bound connection is left to the claim's own checks; one of
    /// those binds only for a host that receives at its remote address,
    /// else that is asked (a PROVE) and the claim binds nothing now.
    pub(crate) fn claimant_holds_address(&mut self, peer: [u8; 32], flow: &VirtualFlow) -> bool {
        let Some(c) = self.conns.get(flow) else {
            return true;
        };
        if c.peer_key.is_some() || !c.binding.is_strong() {
            return true;
        }
        let ip = c.remote_phys.ip();
        if self.pairing.strangers.proofs.is_proven(&peer, ip) {
            return true;
        }
        // Found translated (it moved before this vnatd started, which
        // needed an authenticated update): a host we paired with before
        // may claim it again; it holds the address its move went to, not
        // this one, which the restart left behind.
        if c.remote_phys != c.flow.remote && self.pairing.known_hosts.contains(&peer) {
            return true;
        }
        self.stats.reject(Reject::ClaimUnproven);
        self.ask_proof(peer, ip);
        false
    }

    /// Send `peer` a PROVE at `ip`, within the bounds.
    fn ask_proof(&mut self, peer: [u8; 32], ip: IpAddr) {
        let Some(key) = self.sessions.get(&peer).map(|s| s.claim_key()) else {
            return;
        };
        let proofs = &mut self.pairing.strangers.proofs;
        let token = match proofs.asked.get_mut(&(peer, ip)) {
            Some(a) if a.sent >= ASKS_PER_ADDRESS => {
                self.stats.reject(Reject::ProofsCapped);
                return;
            }
            Some(a) => {
                a.sent += 1;
                a.token
            }
            None => {
                let open = proofs.asked.keys().filter(|(k, _)| *k == peer).count();
                if open >= ADDRESSES_PER_HOST || proofs.asked.len() >= MAX_ASKED {
                    self.stats.reject(Reject::ProofsCapped);
                    return;
                }
                proofs.next = proofs.next.wrapping_add(1);
                let token = self.identity.private_tag(&[
                    b"vnat address proof v1",
                    &peer,
                    &v6_bytes(ip),
                    &proofs.next.to_be_bytes(),
                ]);
                proofs.asked.insert((peer, ip), Ask { token, sent: 1 });
                token
            }
        };
        // Where its VCMP is reached if that is at this address (a NAT's
        // mapping), else our port there.
        let dst = match self.peer_addrs.get(&peer) {
            Some(a) if a.ip() == ip => *a,
            _ => SocketAddr::new(ip, self.cfg.port),
        };
        let b = encode(KIND_PROVE, &self.identity.public(), ip, &token);
        self.push_tagged(&key, b, dst);
        self.stats.count(Counter::ProofsAsked);
    }

    /// A PROVE or PROVE_R from `from`; `bytes` is the whole datagram.
    pub(crate) fn on_proof_datagram(&mut self, from: SocketAddr, bytes: &[u8]) {
        let p = match decode(bytes) {
            Ok(p) => p,
            Err(r) => {
                self.stats.reject(r);
                return;
            }
        };
        let Some(key) = self.sessions.get(&p.sender).map(|s| s.claim_key()) else {
            self.stats.reject(Reject::ProofRefused);
            return;
        };
        if !crypto::datagram_tag_valid(&key, bytes) {
            self.stats.reject(Reject::ProofRefused);
            return;
        }
        if p.kind == KIND_PROVE {
            self.answer_proof(p, from, &key);
            return;
        }
        let proofs = &mut self.pairing.strangers.proofs;
        let asked = proofs.asked.get(&(p.sender, p.ip));
        if !asked.is_some_and(|a| crypto::tags_equal16(&a.token, &p.token)) {
            self.stats.reject(Reject::ProofRefused);
            return;
        }
        proofs.proven_at(p.sender, p.ip);
        self.stats.count(Counter::ProofsAccepted);
    }

    /// Our peer asks us to show we receive at `p.ip`: echo its token, then
    /// claim again what waits for it (those claims now bind).
    fn answer_proof(&mut self, p: Proof, from: SocketAddr, key: &crypto::SecretKey) {
        let dst = self.peer_addrs.get(&p.sender).copied().unwrap_or(from);
        let b = encode(KIND_PROVE_R, &self.identity.public(), p.ip, &p.token);
        self.push_tagged(key, b, dst);
        self.stats.count(Counter::ProofsAnswered);
        let waiting = self.unbound_at(dst.ip());
        if !waiting.is_empty() {
            self.send_claims(p.sender, dst, &waiting, false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prove_round_trips_and_odd_lengths_or_bits_are_refused() {
        let ip: IpAddr = "192.0.2.7".parse().unwrap();
        let b = encode(KIND_PROVE, &[7; 32], ip, &[9; TOKEN_LEN]);
        assert_eq!(b.len(), PROVE_LEN);
        assert!(is_proof(&b));
        let p = decode(&b).expect("decodes");
        assert_eq!(
            (p.kind, p.sender, p.ip, p.token),
            (KIND_PROVE, [7; 32], ip, [9; TOKEN_LEN])
        );
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        let p = decode(&encode(KIND_PROVE_R, &[1; 32], v6, &[2; 16])).expect("decodes");
        assert_eq!((p.kind, p.ip), (KIND_PROVE_R, v6));
        assert_eq!(
            decode(&b[..b.len() - 1]).err(),
            Some(Reject::ProofMalformed)
        );
        let mut odd = b.clone();
        odd[5] = 1;
        assert_eq!(decode(&odd).err(), Some(Reject::ProofMalformed));
        assert!(!is_proof(&[VERSION]));
    }

    #[test]
    fn proven_addresses_are_bounded_and_forgotten_with_the_host() {
        let mut p = Proofs::default();
        for n in 0..=PROVEN_PER_HOST as u8 {
            p.proven_at([1; 32], IpAddr::from([10, 0, 0, n]));
        }
        assert!(
            !p.is_proven(&[1; 32], IpAddr::from([10, 0, 0, 0])),
            "the oldest went"
        );
        assert!(p.is_proven(&[1; 32], IpAddr::from([10, 0, 0, 1])));
        assert!(!p.is_proven(&[2; 32], IpAddr::from([10, 0, 0, 1])));
        p.forget(&[1; 32]);
        assert!(!p.is_proven(&[1; 32], IpAddr::from([10, 0, 0, 1])));
    }
}
