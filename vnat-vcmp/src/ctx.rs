//! The per-call context of the endpoint's handlers ([`Ctx`]) and the
//! adapter that lets them hand its generator to APIs that want a
//! `CryptoRng` ([`CryptoDyn`]).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use rand_core::{CryptoRng, RngCore};

use super::wire::Kind;
use super::Timestamp;

/// Per-call context: the time, and values shared by every record produced
/// while handling one input, so that their datagrams coalesce (one request
/// id per destination and kind) and their timers fire together (one jitter).
pub(crate) struct Ctx<'r> {
    pub now: Timestamp,
    pub rng: &'r mut dyn RngCore,
    pub jitter_permille: u64,
    pub req_ids: HashMap<(SocketAddr, Kind), (u32, usize)>,
    /// The id given out last by `request_id`.
    pub last_req: u32,
    /// Bytes of the datagram being handled per record it carries: what
    /// each record's sender spent on it (0 outside a record datagram).
    pub rx_share: usize,
    /// This host's address the datagram being handled was sent to, when
    /// the caller knows it (`Endpoint::handle_datagram_at`).
    pub rx_to: Option<IpAddr>,
}

impl<'r> Ctx<'r> {
    pub fn new(now: Timestamp, rng: &'r mut dyn RngCore) -> Ctx<'r> {
        // Jitter of +-25% (RFC 8961 section 4 asks for randomised timers so
        // that hosts do not synchronise).
        let jitter_permille = 750 + u64::from(rng.next_u32() % 500);
        Ctx {
            now,
            rng,
            jitter_permille,
            req_ids: HashMap::new(),
            last_req: 0,
            rx_share: 0,
            rx_to: None,
        }
    }

    /// Request id for the next `kind` record to `dst`: records of one call
    /// share an id until a datagram's worth (`cap`) has been given out, so
    /// each LOOKUP or STORE datagram has its own id and its reply concerns
    /// at most `cap` connections.
    pub fn request_id(&mut self, dst: SocketAddr, kind: Kind, cap: usize) -> u32 {
        let rng = &mut self.rng;
        let e = self
            .req_ids
            .entry((dst, kind))
            .or_insert_with(|| (rng.next_u32(), 0));
        if e.1 >= cap {
            *e = (rng.next_u32(), 0);
        }
        e.1 += 1;
        self.last_req = e.0;
        e.0
    }

    pub fn nonce<const N: usize>(&mut self) -> [u8; N] {
        let mut n = [0u8; N];
        self.rng.fill_bytes(&mut n);
        n
    }
}

/// Adapter: the public API only accepts `CryptoRng` generators, so the
/// internal `dyn RngCore` is one.
pub(crate) struct CryptoDyn<'a, 'r>(pub &'a mut &'r mut dyn RngCore);

impl RngCore for CryptoDyn<'_, '_> {
    fn next_u32(&mut self) -> u32 {
        self.0.next_u32()
    }
    fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    fn fill_bytes(&mut self, d: &mut [u8]) {
        self.0.fill_bytes(d)
    }
    fn try_fill_bytes(&mut self, d: &mut [u8]) -> Result<(), rand_core::Error> {
        self.0.try_fill_bytes(d)
    }
}
impl CryptoRng for CryptoDyn<'_, '_> {}
