//! What keeps pairing cheap under attack (see `vcmp::pairing`): cookies
//! that prove an initiator receives at its address, and a per-source limit
//! on the Diffie-Hellman a responder computes for initiators that proved
//! nothing.
//!
//! A cookie is a MAC, under a secret only this host knows and replaces
//! every two minutes, of the initiator's address and port, its PAIR_INIT's
//! id and its host key. The responder keeps nothing for it: it checks the
//! echoed cookie against the current and the previous secret. Someone who
//! spoofs an address never sees the cookie sent there.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use hmac::{Hmac, Mac};
use rand_core::RngCore;
use sha2::Sha256;
use subtle::ConstantTimeEq;
use zeroize::Zeroize;

use super::wire::COOKIE_LEN;
use super::Timestamp;

/// How long a cookie secret is used before the next one (a cookie stays
/// valid for one more period).
const ROTATION: Duration = Duration::from_secs(120);

/// The responder's cookie secrets.
pub(crate) struct CookieJar {
    current: [u8; 32],
    previous: [u8; 32],
    rotates_at: Timestamp,
}

impl Drop for CookieJar {
    fn drop(&mut self) {
        self.current.zeroize();
        self.previous.zeroize();
    }
}

impl Default for CookieJar {
    /// No secret yet: the first `rotate` draws one.
    fn default() -> CookieJar {
        CookieJar {
            current: [0; 32],
            previous: [0; 32],
            rotates_at: Timestamp(0),
        }
    }
}

fn mac(secret: &[u8; 32], from: SocketAddr, id: u32, init_static: &[u8; 32]) -> [u8; COOKIE_LEN] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(b"vnat pairing cookie v1");
    match from.ip() {
        IpAddr::V4(a) => m.update(&a.octets()),
        IpAddr::V6(a) => m.update(&a.octets()),
    }
    m.update(&from.port().to_be_bytes());
    m.update(&id.to_be_bytes());
    m.update(init_static);
    let full = m.finalize().into_bytes();
    let mut out = [0u8; COOKIE_LEN];
    out.copy_from_slice(&full[..COOKIE_LEN]);
    out
}

impl CookieJar {
    /// Draw a new secret if the current one is due. The first time, and
    /// after a quiet spell of two periods or more, both are drawn: a
    /// "previous" secret must never be one anybody can know (the initial
    /// zeros) or one older than a period.
    pub fn rotate(&mut self, now: Timestamp, rng: &mut dyn RngCore) {
        if now < self.rotates_at {
            return;
        }
        let first = self.rotates_at == Timestamp(0);
        if first || now >= self.rotates_at.plus(ROTATION) {
            rng.fill_bytes(&mut self.previous);
        } else {
            self.previous = self.current;
        }
        rng.fill_bytes(&mut self.current);
        self.rotates_at = now.plus(ROTATION);
    }

    /// The cookie for a PAIR_INIT `id` from `from` with host key
    /// `init_static`.
    pub fn cookie(&self, from: SocketAddr, id: u32, init_static: &[u8; 32]) -> [u8; COOKIE_LEN] {
        mac(&self.current, from, id, init_static)
    }

    /// Whether `c` is the cookie for this PAIR_INIT under the current or
    /// the previous secret (compared in constant time).
    pub fn check(
        &self,
        from: SocketAddr,
        id: u32,
        init_static: &[u8; 32],
        c: &[u8; COOKIE_LEN],
    ) -> bool {
        let now = mac(&self.current, from, id, init_static);
        let before = mac(&self.previous, from, id, init_static);
        bool::from(now.ct_eq(c) | before.ct_eq(c))
    }
}

/// Sources of PAIR_INITs, as the limit counts them: an IPv4 address, or an
/// IPv6 /64 (one host's share of addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Source {
    V4(u32),
    V6(u64),
}

impl Source {
    pub(crate) fn of(ip: IpAddr) -> Source {
        match ip {
            IpAddr::V4(a) => Source::V4(u32::from(a)),
            IpAddr::V6(a) => Source::V6((u128::from(a) >> 64) as u64),
        }
    }
}

/// Most sources tracked at once; beyond, idle ones are forgotten, and if
/// none is idle every source counts as over its limit (cookies for all).
const MAX_SOURCES: usize = 4096;

/// A token bucket per source for the Diffie-Hellman computed for PAIR_INITs
/// without a valid cookie.
pub(crate) struct PairLimiter {
    per_sec: u32,
    burst: u32,
    /// Tokens (in thousandths) and when they were last refilled.
    buckets: HashMap<Source, (u64, Timestamp)>,
}

impl PairLimiter {
    pub fn new(per_sec: u32, burst: u32) -> PairLimiter {
        PairLimiter {
            per_sec,
            burst,
            buckets: HashMap::new(),
        }
    }

    fn refilled(&self, tokens: u64, last: Timestamp, now: Timestamp) -> u64 {
        let ms = u64::try_from(now.since(last).as_millis()).unwrap_or(u64::MAX);
        tokens
            .saturating_add(ms.saturating_mul(u64::from(self.per_sec)))
            .min(u64::from(self.burst) * 1000)
    }

    /// Take one token for `ip`; false if it has none left.
    pub fn allow(&mut self, ip: IpAddr, now: Timestamp) -> bool {
        let src = Source::of(ip);
        if !self.buckets.contains_key(&src) && self.buckets.len() >= MAX_SOURCES {
            let full = u64::from(self.burst) * 1000;
            let keep: Vec<(Source, (u64, Timestamp))> = self
                .buckets
                .iter()
                .filter(|(_, (t, last))| self.refilled(*t, *last, now) < full)
                .map(|(s, v)| (*s, *v))
                .collect();
            self.buckets = keep.into_iter().collect();
            if self.buckets.len() >= MAX_SOURCES {
                return false;
            }
        }
        let full = u64::from(self.burst) * 1000;
        let (tokens, last) = self.buckets.get(&src).copied().unwrap_or((full, now));
        let tokens = self.refilled(tokens, last, now);
        if tokens < 1000 {
            self.buckets.insert(src, (tokens, now));
            return false;
        }
        self.buckets.insert(src, (tokens - 1000, now));
        true
    }
}

/// One token bucket: how many pairings this host starts, whoever asks
/// (new connections to new addresses, a flood of UDP sources that a server
/// answered among them), so that it is never a reflector of PAIR_INITs.
pub(crate) struct StartLimit {
    per_sec: u32,
    burst: u32,
    tokens: u64,
    last: Timestamp,
}

impl StartLimit {
    pub fn new(per_sec: u32, burst: u32) -> StartLimit {
        StartLimit {
            per_sec,
            burst,
            tokens: u64::from(burst) * 1000,
            last: Timestamp(0),
        }
    }

    /// Take a token; false if none is left now.
    pub fn allow(&mut self, now: Timestamp) -> bool {
        let ms = u64::try_from(now.since(self.last).as_millis()).unwrap_or(u64::MAX);
        self.tokens = self
            .tokens
            .saturating_add(ms.saturating_mul(u64::from(self.per_sec)))
            .min(u64::from(self.burst) * 1000);
        self.last = now;
        if self.tokens < 1000 {
            return false;
        }
        self.tokens -= 1000;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crypto::DrbgRng;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_cookie_is_bound_to_address_port_id_and_key_and_outlives_one_rotation() {
        let mut rng = DrbgRng::from_seed(1);
        let mut jar = CookieJar::default();
        jar.rotate(Timestamp(1), &mut rng);
        let from = sa("[2001:db8::1]:2031");
        let c = jar.cookie(from, 7, &[1; 32]);
        assert!(jar.check(from, 7, &[1; 32], &c));
        assert!(!jar.check(sa("[2001:db8::2]:2031"), 7, &[1; 32], &c));
        assert!(!jar.check(sa("[2001:db8::1]:2032"), 7, &[1; 32], &c));
        assert!(!jar.check(from, 8, &[1; 32], &c));
        assert!(!jar.check(from, 7, &[2; 32], &c));
        let later = Timestamp(1).plus(ROTATION);
        jar.rotate(later, &mut rng);
        assert!(jar.check(from, 7, &[1; 32], &c), "valid one period more");
        jar.rotate(later.plus(ROTATION), &mut rng);
        assert!(!jar.check(from, 7, &[1; 32], &c), "then gone");
    }

    #[test]
    fn no_cookie_under_a_secret_anybody_knows_or_an_old_one_is_valid() {
        let mut rng = DrbgRng::from_seed(2);
        let from = sa("10.0.0.1:2031");
        let zero = mac(&[0; 32], from, 7, &[1; 32]);
        let mut jar = CookieJar::default();
        jar.rotate(Timestamp(5), &mut rng);
        assert!(!jar.check(from, 7, &[1; 32], &zero), "the initial zeros");
        let c = jar.cookie(from, 7, &[1; 32]);
        // Quiet for three periods: the next PAIR_INIT rotates once, and
        // the cookie from before is not valid any more.
        let later = Timestamp(5).plus(ROTATION * 3);
        jar.rotate(later, &mut rng);
        assert!(!jar.check(from, 7, &[1; 32], &c));
    }

    #[test]
    fn the_limit_is_per_source_with_ipv6_counted_by_slash_64() {
        let mut l = PairLimiter::new(2, 3);
        let t = Timestamp(1_000_000_000);
        let a: IpAddr = "2001:db8::1".parse().unwrap();
        let same_64: IpAddr = "2001:db8::ffff:1".parse().unwrap();
        let other: IpAddr = "2001:db8:0:1::1".parse().unwrap();
        assert!(l.allow(a, t) && l.allow(same_64, t) && l.allow(a, t));
        assert!(!l.allow(same_64, t), "burst of 3 for the whole /64");
        assert!(l.allow(other, t), "another /64 has its own");
        assert!(
            l.allow(a, t.plus(Duration::from_millis(500))),
            "2 per second"
        );
        assert!(!l.allow(a, t.plus(Duration::from_millis(500))));
    }

    #[test]
    fn a_full_table_forgets_idle_sources_and_refuses_if_none_is() {
        let mut l = PairLimiter::new(1, 1);
        let t = Timestamp(1_000_000_000);
        for i in 0..MAX_SOURCES as u32 {
            assert!(l.allow(IpAddr::V4(i.into()), t));
        }
        assert!(!l.allow("10.255.0.1".parse().unwrap(), t), "all busy");
        let later = t.plus(Duration::from_secs(2));
        assert!(l.allow("10.255.0.1".parse().unwrap(), later));
        assert_eq!(l.buckets.len(), 1);
    }
}
