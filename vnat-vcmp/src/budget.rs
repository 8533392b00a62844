//! Per-peer budgets of the work a paired host can ask of us (issue 31):
//! its CLAIMs and BIND_REQs are authenticated, but a paired host is not
//! trusted, and each such datagram costs a MAC, table lookups and, for a
//! BIND_REQ, datagrams sent on our flows. A token bucket per host key.

use std::collections::HashMap;

use super::Timestamp;

/// Most hosts whose buckets are kept; beyond, full buckets are forgotten
/// (a forgotten bucket is a full one).
const MAX_PEERS: usize = 4096;

/// One token bucket per host key: `burst` tokens at most, `per_sec` more
/// each second.
pub(crate) struct PeerBudget {
    per_sec: u64,
    burst: u64,
    /// (tokens in thousandths, when last refilled).
    buckets: HashMap<[u8; 32], (u64, Timestamp)>,
}

impl PeerBudget {
    pub fn new(per_sec: u64, burst: u64) -> PeerBudget {
        PeerBudget {
            per_sec,
            burst,
            buckets: HashMap::new(),
        }
    }

    fn refilled(&self, at: (u64, Timestamp), now: Timestamp) -> u64 {
        let ms = u64::try_from(now.since(at.1).as_millis()).unwrap_or(u64::MAX);
        at.0.saturating_add(ms.saturating_mul(self.per_sec))
            .min(self.burst * 1000)
    }

    /// Take `cost` tokens of `peer`'s bucket; false (nothing taken) if it
    /// has fewer.
    pub fn allow(&mut self, peer: &[u8; 32], now: Timestamp, cost: u64) -> bool {
        if !self.buckets.contains_key(peer) && self.buckets.len() >= MAX_PEERS {
            let full = self.burst * 1000;
            let mut keep = std::mem::take(&mut self.buckets);
            keep.retain(|_, b| self.refilled(*b, now) < full);
            self.buckets = keep;
            if self.buckets.len() >= MAX_PEERS {
                return false;
            }
        }
        let at = self
            .buckets
            .get(peer)
            .copied()
            .unwrap_or((self.burst * 1000, now));
        let have = self.refilled(at, now);
        let need = cost.saturating_mul(1000);
        if have < need {
            self.buckets.insert(*peer, (have, now));
            return false;
        }
        self.buckets.insert(*peer, (have - need, now));
        true
    }

    /// The host is gone.
    pub fn forget(&mut self, peer: &[u8; 32]) {
        self.buckets.remove(peer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_host_gets_its_burst_then_its_rate_and_others_are_not_charged() {
        let mut b = PeerBudget::new(2, 4);
        let t0 = Timestamp(1_000_000_000);
        for _ in 0..4 {
            assert!(b.allow(&[1; 32], t0, 1));
        }
        assert!(!b.allow(&[1; 32], t0, 1), "past its burst");
        assert!(b.allow(&[2; 32], t0, 1), "another host has its own");
        let t1 = t0.plus(Duration::from_millis(500));
        assert!(b.allow(&[1; 32], t1, 1), "two a second");
        assert!(!b.allow(&[1; 32], t1, 1));
        b.forget(&[1; 32]);
        assert!(b.allow(&[1; 32], t1, 4));
    }
}
