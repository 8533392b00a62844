//! Keys and MACs: host identities (x25519), the pairing handshake,
//! per-connection keys (HKDF-SHA256) and record tags (HMAC-SHA256).
//!
//! The paper (section 3.3.1.1) establishes a per-connection key with
//! Diffie-Hellman at suspend time and checks it at resume (3.3.2.2). An
//! unannounced move (cable pulled, lid closed) gives no chance to run it, so
//! vnatd also pairs the two hosts' long-term keys when they first share a
//! connection (DESIGN.md section 4) and derives every connection's keys from
//! that pairing. The suspend-time exchange then mixes fresh DH output into
//! the connection's root key.

use std::net::{IpAddr, SocketAddr};

use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use rand_core::{CryptoRng, RngCore};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::{Zeroize, ZeroizeOnDrop};

use super::binding::Binding;
use super::wire::{PAIR_TAG_LEN, TAG_LEN};
use crate::flow::VirtualFlow;

type HmacSha256 = Hmac<Sha256>;

/// Why a cryptographic step was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CryptoError {
    #[error("peer sent a low-order x25519 point; refusing the key agreement")]
    LowOrderPoint,
    #[error("pairing confirmation tag is wrong")]
    BadConfirmation,
}

/// A 32-byte secret that is wiped when dropped and never printed.
#[derive(Clone, Zeroize, ZeroizeOnDrop, PartialEq, Eq)]
pub struct SecretKey(pub(crate) [u8; 32]);

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SecretKey(..)")
    }
}

impl SecretKey {
    pub fn from_bytes(b: [u8; 32]) -> SecretKey {
        SecretKey(b)
    }
    /// The raw bytes, for export only.
    pub fn expose(&self) -> &[u8; 32] {
        &self.0
    }
}

/// A host's long-term x25519 identity. `StaticSecret` zeroizes itself.
pub struct HostIdentity {
    secret: StaticSecret,
    public: PublicKey,
}

impl HostIdentity {
    pub fn generate<R: RngCore + CryptoRng>(rng: &mut R) -> HostIdentity {
        HostIdentity::from_secret(StaticSecret::random_from_rng(rng))
    }
    pub fn from_bytes(b: [u8; 32]) -> HostIdentity {
        HostIdentity::from_secret(StaticSecret::from(b))
    }
    fn from_secret(secret: StaticSecret) -> HostIdentity {
        let public = PublicKey::from(&secret);
        HostIdentity { secret, public }
    }
    pub fn public(&self) -> [u8; 32] {
        self.public.to_bytes()
    }
    /// x25519 with `peer`, refusing low-order points (their output is known
    /// to everyone; `was_contributory` is false exactly for them).
    pub(crate) fn dh(&self, peer: &[u8; 32]) -> Result<SecretKey, CryptoError> {
        let shared = self.secret.diffie_hellman(&PublicKey::from(*peer));
        if !shared.was_contributory() {
            return Err(CryptoError::LowOrderPoint);
        }
        Ok(SecretKey(shared.to_bytes()))
    }

    /// A 128-bit MAC of `parts` under a key derived from this host's
    /// secret, so that no other host can compute it: the tokens of
    /// `vcmp::proof`, which must come back from where they were sent.
    pub(crate) fn private_tag(&self, parts: &[&[u8]]) -> [u8; 16] {
        let key = expand(
            &SecretKey(self.secret.to_bytes()),
            &[b"vnat private tag v1"],
        );
        let full = hmac(&key, parts);
        let mut out = [0u8; 16];
        out.copy_from_slice(&full[..16]);
        out
    }
}

/// An ephemeral x25519 key pair (pairing and suspend-time DH).
pub struct Ephemeral(HostIdentity);

impl Ephemeral {
    pub fn generate<R: RngCore + CryptoRng>(rng: &mut R) -> Ephemeral {
        Ephemeral(HostIdentity::generate(rng))
    }
    pub fn public(&self) -> [u8; 32] {
        self.0.public()
    }
    pub(crate) fn dh(&self, peer: &[u8; 32]) -> Result<SecretKey, CryptoError> {
        self.0.dh(peer)
    }
}

/// A 32-byte key as 64 lowercase hex digits (`vnatctl peers`, exports,
/// `peers.json`).
pub fn key_hex(k: &[u8; 32]) -> String {
    k.iter().map(|b| format!("{b:02x}")).collect()
}

/// The key's first 8 bytes as 16 hex digits: what logs name a peer host
/// by (its address may be the thing that changes).
pub fn key_short(k: &[u8; 32]) -> String {
    k[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// The key written as 64 hex digits (either case), nothing else: no sign,
/// no prefix, no spaces.
pub fn parse_key_hex(s: &str) -> Option<[u8; 32]> {
    let b = s.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16);
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (digit(b[2 * i])? * 16 + digit(b[2 * i + 1])?) as u8;
    }
    Some(out)
}

/// Tag of one record: HMAC-SHA256 truncated to 128 bits.
pub fn record_tag(key: &SecretKey, signed: &[u8]) -> [u8; TAG_LEN] {
    let mut out = [0u8; TAG_LEN];
    let full = hmac(key, &[signed]);
    out.copy_from_slice(&full[..TAG_LEN]);
    out
}

/// Constant-time check of a record tag.
pub fn verify_record(key: &SecretKey, signed: &[u8], tag: &[u8; TAG_LEN]) -> bool {
    let full = hmac(key, &[signed]);
    bool::from(full[..TAG_LEN].ct_eq(tag))
}

/// The MAC of an export document (`body`, its canonical bytes) sent from
/// the host `from` to the host `to`, keyed by the two hosts' static
/// Diffie-Hellman: only they can make or check it, and the direction is
/// part of it. `None` for a key that is not a valid point.
pub fn export_seal(
    identity: &HostIdentity,
    other: &[u8; 32],
    from: &[u8; 32],
    to: &[u8; 32],
    body: &[u8],
) -> Option<[u8; 32]> {
    let shared = identity.dh(other).ok()?;
    let key = extract(b"vnat export seal v1", &[&shared.0]);
    Some(hmac(&key, &[b"vnat export v1", from, to, body]))
}

/// Constant-time comparison of two 32-byte MACs.
pub fn macs_equal(a: &[u8; 32], b: &[u8; 32]) -> bool {
    bool::from(a.ct_eq(b))
}

fn hmac(key: &SecretKey, parts: &[&[u8]]) -> [u8; 32] {
    // HMAC accepts keys of any length, so this cannot fail; fall back to an
    // all-zero tag (which no verifier accepts as valid by chance) rather
    // than panic.
    let Ok(mut mac) = HmacSha256::new_from_slice(&key.0) else {
        return [0u8; 32];
    };
    for p in parts {
        mac.update(p);
    }
    mac.finalize().into_bytes().into()
}

/// The locator of the records signed with the direction key `key`: a
/// connection's location is stored under its sender's locator (its send
/// key's) and looked up under the asker's receive key's, the same value.
/// Nobody else can compute it, so nobody else can look the location up or
/// take its slots at a location server.
pub fn locator(key: &SecretKey) -> [u8; super::wire::LOCATOR_LEN] {
    let full = expand(key, &[b"vnat locator v1"]);
    let mut out = [0u8; super::wire::LOCATOR_LEN];
    out.copy_from_slice(&full.0[..super::wire::LOCATOR_LEN]);
    out
}

fn expand(prk: &SecretKey, info: &[&[u8]]) -> SecretKey {
    let mut out = [0u8; 32];
    // A 32-byte PRK is always long enough and 32 bytes of output is always
    // allowed, so neither call can fail.
    if let Ok(hk) = Hkdf::<Sha256>::from_prk(&prk.0) {
        let _ = hk.expand_multi_info(info, &mut out);
    }
    SecretKey(out)
}

fn extract(salt: &[u8], ikm: &[&[u8]]) -> SecretKey {
    let mut joined = zeroize::Zeroizing::new(Vec::with_capacity(96));
    for p in ikm {
        joined.extend_from_slice(p);
    }
    let (prk, _) = Hkdf::<Sha256>::extract(Some(salt), &joined);
    SecretKey(prk.into())
}

/// Canonical bytes of an endpoint: family tag, address, port.
pub(crate) fn endpoint_bytes(a: &SocketAddr) -> Vec<u8> {
    let mut v = Vec::with_capacity(19);
    match a.ip() {
        IpAddr::V4(ip) => {
            v.push(4);
            v.extend_from_slice(&ip.octets());
        }
        IpAddr::V6(ip) => {
            v.push(6);
            v.extend_from_slice(&ip.octets());
        }
    }
    v.extend_from_slice(&a.port().to_be_bytes());
    v
}

/// The secret two paired hosts share.
#[derive(Clone, Debug)]
pub struct PairSecret(pub(crate) SecretKey);

impl PairSecret {
    /// The key of this pairing's CLAIM messages (see `vcmp::binding`).
    pub(crate) fn claim_key(&self) -> SecretKey {
        expand(&self.0, &[b"vnat claim v1"])
    }
}

/// The commitment to a connection's binding that a CLAIM from `sender`
/// carries: only a host that knows the binding's facts can make it, and it
/// reveals nothing of them. It names its sender, so that the two ends'
/// commitments differ: a host that sends back the commitment it was sent
/// (a host behind the same NAT as the connection's peer, which is sent
/// the claims of every connection at that address) proves nothing.
pub(crate) fn claim_commitment(
    claim_key: &SecretKey,
    sender: &[u8; 32],
    binding: &Binding,
) -> [u8; TAG_LEN] {
    let mut out = [0u8; TAG_LEN];
    let full = hmac(
        claim_key,
        &[b"vnat commitment v2", sender, binding.digest()],
    );
    out.copy_from_slice(&full[..TAG_LEN]);
    out
}

/// What the answer to an in-band BIND carries (`vcmp::bind`): proof that
/// its receiver saw the BIND's random token, which travelled only on the
/// flow's own path.
pub(crate) fn bind_proof(claim_key: &SecretKey, token: &[u8; TAG_LEN]) -> [u8; TAG_LEN] {
    let mut out = [0u8; TAG_LEN];
    let full = hmac(claim_key, &[b"vnat bind proof v1", token]);
    out.copy_from_slice(&full[..TAG_LEN]);
    out
}

/// The token of a TCP BIND (`vnat_common::TCP_BIND_OPT`) answering the
/// BIND request with `nonce` for the connection with `commitment`, under
/// the claim key of the two hosts' pairing: both compute it, no one else
/// can (a neighbour behind the same NAT has a pairing of its own), each
/// request has its own, and it does not change when a suspend ratchets the
/// connection's keys (which the two ends may do a moment apart).
pub fn tcp_bind_token(claim_key: &SecretKey, nonce: u64, commitment: &[u8; TAG_LEN]) -> [u8; 8] {
    let full = hmac(
        claim_key,
        &[b"vnat tcp bind v1", &nonce.to_be_bytes(), commitment],
    );
    let mut out = [0u8; 8];
    out.copy_from_slice(&full[..8]);
    // All zero is what an entry without a token holds: never a token.
    if out == [0; 8] {
        out[7] = 1;
    }
    out
}

/// The tag of a CLAIM or PROBE datagram: HMAC over all of it before the
/// tag, which is its last [`PAIR_TAG_LEN`] bytes.
fn claim_tag(claim_key: &SecretKey, signed: &[u8]) -> [u8; 32] {
    hmac(claim_key, &[b"vnat claim tag v1", signed])
}

/// Fill in the tag of an encoded CLAIM or PROBE (its last bytes).
pub(crate) fn tag_datagram(claim_key: &SecretKey, datagram: &mut [u8]) {
    let n = datagram.len();
    let at = n.saturating_sub(PAIR_TAG_LEN);
    let tag = claim_tag(claim_key, &datagram[..at]);
    datagram[at..].copy_from_slice(&tag[..n - at]);
}

/// Constant-time check of a decoded CLAIM's or PROBE's tag.
pub(crate) fn datagram_tag_valid(claim_key: &SecretKey, datagram: &[u8]) -> bool {
    let Some(at) = datagram.len().checked_sub(PAIR_TAG_LEN) else {
        return false;
    };
    let mut tag = [0u8; PAIR_TAG_LEN];
    tag.copy_from_slice(&datagram[at..]);
    tags_equal(&claim_tag(claim_key, &datagram[..at]), &tag)
}

/// Keys of one connection: a root bound to both host identities and to the
/// connection's binding facts (never to addresses, which a NAT changes and
/// DHCP hands to another host), and one key per direction derived from it.
#[derive(Clone, Debug)]
pub struct ConnKeys {
    pub(crate) root: SecretKey,
    pub(crate) send: SecretKey,
    pub(crate) recv: SecretKey,
}

impl ConnKeys {
    /// Keys for `flow` (local view) between the host `my_pub` and `peer_pub`.
    /// Both hosts compute the same root because its inputs are ordered
    /// canonically; the direction keys name sender and receiver.
    pub fn derive(
        pair: &PairSecret,
        my_pub: &[u8; 32],
        peer_pub: &[u8; 32],
        flow: &VirtualFlow,
        binding: &Binding,
    ) -> ConnKeys {
        let (k1, k2) = if my_pub <= peer_pub {
            (my_pub, peer_pub)
        } else {
            (peer_pub, my_pub)
        };
        let root = expand(
            &pair.0,
            &[
                b"vnat conn root v2",
                &[flow.proto.number()],
                k1,
                k2,
                binding.digest(),
            ],
        );
        ConnKeys::from_root(root, flow, binding)
    }

    /// Rebuild the direction keys from a root (import, ratchet).
    pub fn from_root(root: SecretKey, flow: &VirtualFlow, binding: &Binding) -> ConnKeys {
        let (l, r) = binding.directions(flow);
        let send = expand(&root, &[b"vnat conn dir v2", &l, &r]);
        let recv = expand(&root, &[b"vnat conn dir v2", &r, &l]);
        ConnKeys { root, send, recv }
    }

    /// Mix a suspend-time DH result into the root (paper section 3.3.1.1).
    /// The two public values are ordered so both sides agree.
    pub fn ratchet(
        &self,
        dh: &SecretKey,
        eph_a: &[u8; 32],
        eph_b: &[u8; 32],
        flow: &VirtualFlow,
        binding: &Binding,
    ) -> ConnKeys {
        let (x, y) = if eph_a <= eph_b {
            (eph_a, eph_b)
        } else {
            (eph_b, eph_a)
        };
        let root = extract(&self.root.0, &[b"vnat suspend dh v1", &dh.0, x, y]);
        ConnKeys::from_root(root, flow, binding)
    }
}

/// Transcript of one pairing: request id and the four public values.
pub struct Transcript(pub(crate) [u8; 4 + 128]);

impl Transcript {
    pub fn new(
        id: u32,
        init_static: &[u8; 32],
        init_eph: &[u8; 32],
        resp_static: &[u8; 32],
        resp_eph: &[u8; 32],
    ) -> Transcript {
        let mut t = [0u8; 132];
        t[..4].copy_from_slice(&id.to_be_bytes());
        for (i, k) in [init_static, init_eph, resp_static, resp_eph]
            .iter()
            .enumerate()
        {
            t[4 + 32 * i..36 + 32 * i].copy_from_slice(*k);
        }
        Transcript(t)
    }
}

/// Output of the pairing key schedule.
pub struct PairKeys {
    pub secret: PairSecret,
    pub resp_tag: [u8; PAIR_TAG_LEN],
    pub init_tag: [u8; PAIR_TAG_LEN],
}

/// Key schedule of the pairing handshake, a triple Diffie-Hellman: the
/// ephemeral-ephemeral term gives forward secrecy, and each static-ephemeral
/// term can only be computed by the holder of one host's long-term key, so
/// a correct confirmation tag authenticates that host.
/// `ee`, `se` (initiator static, responder eph), `es` (initiator eph,
/// responder static) are computed by the caller from its own secrets.
pub fn pair_schedule(t: &Transcript, ee: &SecretKey, se: &SecretKey, es: &SecretKey) -> PairKeys {
    let salt: [u8; 32] = Sha256::new()
        .chain_update(b"vnat pair v1")
        .chain_update(t.0)
        .finalize()
        .into();
    let prk = extract(&salt, &[&ee.0, &se.0, &es.0]);
    let resp_key = expand(&prk, &[b"vnat pair responder confirm"]);
    let init_key = expand(&prk, &[b"vnat pair initiator confirm"]);
    let secret = PairSecret(expand(&prk, &[b"vnat pair secret"]));
    PairKeys {
        secret,
        resp_tag: hmac(&resp_key, &[&t.0]),
        init_tag: hmac(&init_key, &[&t.0]),
    }
}

/// Constant-time comparison of two pairing tags.
pub fn tags_equal(a: &[u8; PAIR_TAG_LEN], b: &[u8; PAIR_TAG_LEN]) -> bool {
    bool::from(a.ct_eq(b))
}

/// Constant-time comparison of two challenge nonces.
pub fn tags_equal16(a: &[u8; 16], b: &[u8; 16]) -> bool {
    bool::from(a.ct_eq(b))
}

/// A deterministic random generator built from HMAC-SHA256 in counter mode
/// (the construction of HMAC-DRBG without reseeding). It is as unpredictable
/// as its seed: the simulator, the benchmark and the fuzz targets seed it
/// with constants, a daemon must use `rand_core::OsRng` instead.
pub struct DrbgRng {
    key: SecretKey,
    counter: u64,
    buf: [u8; 32],
    used: usize,
}

impl DrbgRng {
    pub fn from_seed(seed: u64) -> DrbgRng {
        let key = extract(b"vnat drbg v1", &[&seed.to_be_bytes()]);
        DrbgRng {
            key,
            counter: 0,
            buf: [0; 32],
            used: 32,
        }
    }
}

impl Drop for DrbgRng {
    fn drop(&mut self) {
        self.buf.zeroize();
    }
}

impl RngCore for DrbgRng {
    fn next_u32(&mut self) -> u32 {
        let mut b = [0u8; 4];
        self.fill_bytes(&mut b);
        u32::from_le_bytes(b)
    }
    fn next_u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        self.fill_bytes(&mut b);
        u64::from_le_bytes(b)
    }
    fn fill_bytes(&mut self, dest: &mut [u8]) {
        for d in dest.iter_mut() {
            if self.used == 32 {
                self.counter += 1;
                self.buf = hmac(&self.key, &[&self.counter.to_be_bytes()]);
                self.used = 0;
            }
            *d = self.buf[self.used];
            self.used += 1;
        }
    }
    fn try_fill_bytes(&mut self, dest: &mut [u8]) -> Result<(), rand_core::Error> {
        self.fill_bytes(dest);
        Ok(())
    }
}

impl CryptoRng for DrbgRng {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::Proto;

    fn flow(l: &str, r: &str) -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: l.parse().expect("addr"),
            remote: r.parse().expect("addr"),
        }
    }

    #[test]
    fn connection_keys_agree_and_differ_by_direction() {
        let mut rng = DrbgRng::from_seed(1);
        let (a, b) = (
            HostIdentity::generate(&mut rng),
            HostIdentity::generate(&mut rng),
        );
        let pair = PairSecret(a.dh(&b.public()).expect("dh"));
        let fa = flow("10.0.0.1:1000", "10.0.0.2:22");
        let fb = flow("10.0.0.2:22", "10.0.0.1:1000");
        let ep = |f: &VirtualFlow| Binding::endpoints(f);
        let ka = ConnKeys::derive(&pair, &a.public(), &b.public(), &fa, &ep(&fa));
        let kb = ConnKeys::derive(&pair, &b.public(), &a.public(), &fb, &ep(&fb));
        assert_eq!(ka.root, kb.root, "both ends must derive one root");
        assert_eq!(ka.send, kb.recv, "a's send key is b's receive key");
        assert_eq!(ka.recv, kb.send, "b's send key is a's receive key");
        assert_ne!(ka.send, ka.recv, "directions must differ (no reflection)");
        let f2 = flow("10.0.0.1:1001", "10.0.0.2:22");
        let other = ConnKeys::derive(&pair, &a.public(), &b.public(), &f2, &ep(&f2));
        assert_ne!(ka.send, other.send, "keys must be bound to the binding");
        let mut udp = fa;
        udp.proto = Proto::Udp;
        assert_ne!(
            ka.send,
            ConnKeys::derive(&pair, &a.public(), &b.public(), &udp, &ep(&udp)).send
        );
    }

    /// Through a NAT the two ends name a TCP connection by different
    /// addresses; bound by its sequence numbers, they still derive one set
    /// of keys, and another connection with the same addresses does not.
    #[test]
    fn tcp_keys_agree_through_a_nat_and_ignore_addresses() {
        let mut rng = DrbgRng::from_seed(4);
        let (a, b) = (
            HostIdentity::generate(&mut rng),
            HostIdentity::generate(&mut rng),
        );
        let pair = PairSecret(a.dh(&b.public()).expect("dh"));
        let client = flow("192.168.1.10:40000", "203.0.113.5:443");
        let server = flow("203.0.113.5:443", "198.51.100.7:61234");
        let (bc, bs) = (Binding::tcp(111, 999), Binding::tcp(999, 111));
        let kc = ConnKeys::derive(&pair, &a.public(), &b.public(), &client, &bc);
        let ks = ConnKeys::derive(&pair, &b.public(), &a.public(), &server, &bs);
        assert_eq!(kc.send, ks.recv);
        assert_eq!(kc.recv, ks.send);
        assert_ne!(kc.send, kc.recv);
        let later = Binding::tcp(112, 999);
        let k2 = ConnKeys::derive(&pair, &a.public(), &b.public(), &client, &later);
        assert_ne!(kc.send, k2.send, "same addresses, other connection");
    }

    #[test]
    fn low_order_points_are_refused() {
        let mut rng = DrbgRng::from_seed(2);
        let id = HostIdentity::generate(&mut rng);
        // The all-zero point and the point of order 8 encoded as 1.
        let mut one = [0u8; 32];
        one[0] = 1;
        for p in [[0u8; 32], one] {
            assert_eq!(id.dh(&p).err(), Some(CryptoError::LowOrderPoint));
        }
    }

    #[test]
    fn record_tags_verify_and_truncate() {
        let k = SecretKey([7; 32]);
        let t = record_tag(&k, b"hello");
        assert!(verify_record(&k, b"hello", &t));
        assert!(!verify_record(&k, b"hellp", &t));
        assert!(!verify_record(&SecretKey([8; 32]), b"hello", &t));
    }

    #[test]
    fn ratchet_is_symmetric() {
        let mut rng = DrbgRng::from_seed(3);
        let fa = flow("10.0.0.1:1000", "10.0.0.2:22");
        let fb = flow("10.0.0.2:22", "10.0.0.1:1000");
        let (ba, bb) = (Binding::endpoints(&fa), Binding::endpoints(&fb));
        let ka = ConnKeys::from_root(SecretKey([1; 32]), &fa, &ba);
        let kb = ConnKeys::from_root(SecretKey([1; 32]), &fb, &bb);
        let (ea, eb) = (Ephemeral::generate(&mut rng), Ephemeral::generate(&mut rng));
        let na = ka.ratchet(
            &ea.dh(&eb.public()).expect("dh"),
            &ea.public(),
            &eb.public(),
            &fa,
            &ba,
        );
        let nb = kb.ratchet(
            &eb.dh(&ea.public()).expect("dh"),
            &eb.public(),
            &ea.public(),
            &fb,
            &bb,
        );
        assert_eq!(na.send, nb.recv);
        assert_ne!(na.root, ka.root);
    }
}
