//! Outgoing datagrams: records bound for the same address, kind and request
//! are packed into as few datagrams as the path MTU allows (so restoring N
//! connections costs a few datagrams, DESIGN.md section 4), the queue is
//! bounded, and an address not yet known to run a vnatd never receives more
//! than three times the bytes that came from it (anti-amplification, as in
//! RFC 9000 section 8). Replies that answer unauthenticated requests
//! (LOOKUP_R, STORE_R, PAIR_RESP, ERROR) are held to that limit whatever
//! the address: their source may be forged, and a peer's address is the
//! one an attacker would forge.

use crate::stats::Reject;
use std::collections::{HashMap, HashSet, VecDeque};
use std::net::{IpAddr, SocketAddr};

use super::stats::Stats;
use super::wire::{self, Family, Kind, TAG_LEN};

/// A datagram to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    pub dst: SocketAddr,
    pub payload: Vec<u8>,
    /// The local address to send from, when it matters: records about a
    /// connection that moved go from its new address, so that the peer
    /// hears from the place it is to validate (its anti-amplification
    /// budget there), and leave by that address's link while the old one
    /// may still be up (a migration between links). None: the kernel's
    /// choice. A driver that cannot send from it (it went away) sends
    /// without.
    pub src: Option<IpAddr>,
}

/// Factor of the anti-amplification limit.
pub const AMPLIFICATION_FACTOR: u64 = 3;
/// Most addresses whose byte counts are tracked at once.
const MAX_TRACKED: usize = 4096;

/// Where a record goes: (destination, datagram kind, family, request id,
/// source address if it matters).
pub(crate) type OpenKey = (SocketAddr, Kind, Family, u32, Option<IpAddr>);

pub(crate) struct TxQueue {
    mtu: usize,
    max_queued: usize,
    open: HashMap<OpenKey, Vec<u8>>,
    open_order: Vec<OpenKey>,
    ready: VecDeque<Transmit>,
    /// Addresses known to run a vnatd: peers' validated locations, location
    /// servers, our own old locations. Not subject to the limit, except for
    /// unauthenticated replies.
    pub(crate) trusted: HashSet<IpAddr>,
    /// Something that earned an address its place in `trusted` went away
    /// since `trust_rebuilt` (`vcmp::trust` rebuilds it).
    pub(crate) trust_stale: bool,
    pub(crate) trust_rebuilt: crate::Timestamp,
    /// (bytes received, bytes sent) per address, at most [`MAX_TRACKED`];
    /// `tracked` has them oldest first, the first to make room.
    budget: HashMap<IpAddr, (u64, u64)>,
    tracked: VecDeque<IpAddr>,
}

impl TxQueue {
    /// Gives back room a burst left (`crate::room`).
    pub(crate) fn shrink_sparse(&mut self) {
        use crate::room::Shrink;
        self.open.shrink_sparse();
        self.open_order.shrink_sparse();
        self.ready.shrink_sparse();
    }

    pub fn new(mtu: usize, max_queued: usize) -> TxQueue {
        TxQueue {
            mtu,
            max_queued,
            open: HashMap::new(),
            open_order: Vec::new(),
            ready: VecDeque::new(),
            trusted: HashSet::new(),
            trust_stale: false,
            trust_rebuilt: crate::Timestamp(0),
            budget: HashMap::new(),
            tracked: VecDeque::new(),
        }
    }

    /// Count `n` bytes received from (or vouched for by an authenticated
    /// message naming) `ip`.
    /// A flood of forged sources makes room by pushing out the addresses
    /// seen longest ago, never by refusing new ones (a peer's new address
    /// must always be able to get its challenge).
    pub fn credit(&mut self, ip: IpAddr, n: usize) {
        if !self.budget.contains_key(&ip) {
            while self.budget.len() >= MAX_TRACKED {
                let Some(old) = self.tracked.pop_front() else {
                    break;
                };
                self.budget.remove(&old);
            }
            self.tracked.push_back(ip);
        }
        let e = self.budget.entry(ip).or_default();
        e.0 = e.0.saturating_add(n as u64);
    }

    fn push_ready(&mut self, t: Transmit, stats: &mut Stats) {
        if self.ready.len() >= self.max_queued {
            stats.reject(Reject::TxQueueFull);
            return;
        }
        self.ready.push_back(t);
    }

    /// Append one signed record to the datagram being built for
    /// (`dst`, `kind`, `family`, `request_id`).
    pub fn push_record(
        &mut self,
        key: OpenKey,
        signed: &[u8],
        tag: &[u8; TAG_LEN],
        stats: &mut Stats,
    ) {
        let (dst, kind, family, request_id, src) = key;
        let cap = wire::records_per_datagram(self.mtu, family, kind);
        let buf = self.open.entry(key).or_insert_with(|| {
            let mut b = Vec::with_capacity(wire::HEADER_LEN + cap * wire::record_len(family, kind));
            wire::begin_records(&mut b, kind, family, request_id);
            b
        });
        if buf[3] == 0 {
            self.open_order.push(key);
        }
        if wire::push_record(buf, signed, tag).is_err() {
            stats.reject(Reject::TxRecordOverflow);
            return;
        }
        if usize::from(buf[3]) >= cap {
            if let Some(full) = self.open.remove(&key) {
                self.open_order.retain(|k| *k != key);
                self.push_ready(
                    Transmit {
                        dst,
                        payload: full,
                        src,
                    },
                    stats,
                );
            }
        }
    }

    /// Queue a complete datagram.
    pub fn push_datagram(&mut self, dst: SocketAddr, payload: Vec<u8>, stats: &mut Stats) {
        self.push_ready(
            Transmit {
                dst,
                payload,
                src: None,
            },
            stats,
        );
    }

    /// Close every datagram under construction (end of one input event).
    pub fn flush(&mut self, stats: &mut Stats) {
        for key in std::mem::take(&mut self.open_order) {
            if let Some(payload) = self.open.remove(&key) {
                self.push_ready(
                    Transmit {
                        dst: key.0,
                        payload,
                        src: key.4,
                    },
                    stats,
                );
            }
        }
    }

    /// Next datagram that the amplification limit lets through.
    pub fn pop(&mut self, stats: &mut Stats) -> Option<Transmit> {
        while let Some(t) = self.ready.pop_front() {
            let ip = t.dst.ip();
            if self.trusted.contains(&ip) && !unauthenticated_reply(&t.payload) {
                return Some(t);
            }
            let (rx, tx) = self.budget.get(&ip).copied().unwrap_or((0, 0));
            let len = t.payload.len() as u64;
            if tx.saturating_add(len) > rx.saturating_mul(AMPLIFICATION_FACTOR) {
                stats.reject(Reject::AmplificationLimit);
                continue;
            }
            self.budget.insert(ip, (rx, tx + len));
            return Some(t);
        }
        None
    }
}

/// Whether a datagram answers a request that proves nothing about its
/// source: LOOKUP_R, STORE_R, PAIR_RESP, ERROR (by its kind byte).
fn unauthenticated_reply(payload: &[u8]) -> bool {
    matches!(
        payload.get(1).copied().and_then(Kind::from_u8),
        Some(Kind::LookupR | Kind::StoreR | Kind::PairResp | Kind::Error)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn datagram(kind: Kind, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        b[0] = wire::VERSION;
        b[1] = kind as u8;
        b
    }

    /// A peer's (trusted) address gets what we send it on our own account
    /// without limit, but replies to requests anyone could forge from it
    /// no more than three times what came from it.
    #[test]
    fn unauthenticated_replies_are_limited_even_to_trusted_addresses() {
        let mut stats = Stats::default();
        let mut q = TxQueue::new(1400, 64);
        let peer: SocketAddr = "10.0.0.2:2031".parse().unwrap();
        q.trusted.insert(peer.ip());
        q.push_datagram(peer, datagram(Kind::Upd, 1200), &mut stats);
        assert!(q.pop(&mut stats).is_some(), "our own updates go out");
        q.credit(peer.ip(), 100);
        for kind in [Kind::LookupR, Kind::StoreR, Kind::PairResp, Kind::Error] {
            q.push_datagram(peer, datagram(kind, 301), &mut stats);
            assert!(q.pop(&mut stats).is_none(), "{kind:?} beyond 3x went out");
        }
        assert_eq!(stats.rejected(Reject::AmplificationLimit), 4);
        q.push_datagram(peer, datagram(Kind::PairResp, 104), &mut stats);
        assert!(q.pop(&mut stats).is_some(), "within 3x it goes out");
        // And the budget is spent: 104 of 300.
        q.push_datagram(peer, datagram(Kind::LookupR, 200), &mut stats);
        assert!(q.pop(&mut stats).is_none());
    }

    #[test]
    fn untrusted_addresses_get_at_most_three_times_what_they_sent() {
        let mut stats = Stats::default();
        let mut q = TxQueue::new(1400, 64);
        let stranger: SocketAddr = "192.0.2.9:2031".parse().unwrap();
        q.push_datagram(stranger, datagram(Kind::Challenge, 100), &mut stats);
        assert!(
            q.pop(&mut stats).is_none(),
            "nothing before it sent anything"
        );
        q.credit(stranger.ip(), 50);
        q.push_datagram(stranger, datagram(Kind::Challenge, 150), &mut stats);
        assert!(q.pop(&mut stats).is_some());
        q.push_datagram(stranger, datagram(Kind::Challenge, 2), &mut stats);
        assert!(q.pop(&mut stats).is_none());
    }

    /// 5,000 forged sources fill the table; the next address still gets
    /// its credit (the oldest make room).
    #[test]
    fn a_flood_of_sources_does_not_lock_out_a_new_address() {
        let mut stats = Stats::default();
        let mut q = TxQueue::new(1400, 64);
        for i in 0..5000u32 {
            q.credit(IpAddr::V4(std::net::Ipv4Addr::from(0x0a00_0000 + i)), 100);
        }
        let new: SocketAddr = "192.0.2.77:2031".parse().unwrap();
        q.credit(new.ip(), 100);
        q.push_datagram(new, datagram(Kind::Challenge, 300), &mut stats);
        assert!(q.pop(&mut stats).is_some());
        assert!(q.budget.len() <= MAX_TRACKED);
    }
}
