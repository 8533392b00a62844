//! Locating a moved peer (paper section 3.3.2.1, Figure 3-5): the order of
//! places each role asks, and the location-server store every vnatd runs.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::roles::Role;
use super::wire::{Ext, Record, LOCATOR_LEN};
use super::Timestamp;

/// A step of the chain, named as in the paper.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Step {
    P1,
    P2,
    P3,
    S1,
    S2,
    S3,
}

/// One place to query and store at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChainStep {
    pub step: Step,
    pub target: SocketAddr,
    /// The target is the peer itself: its old location (if the peer did
    /// not move it is still there) or an address it announced since, so
    /// an update is sent along with the query.
    pub peer_old: bool,
}

/// The chain for `role`: the primary asks the secondary's old location (P1),
/// then its own (P2), then each location server (P3); the secondary asks its
/// own old location first (S1), then the primary's (S2), then the servers
/// (S3). P(4)/S(4), the update, follows whichever step finds the peer.
impl ChainStep {
    /// The step that asks the peer itself at `ip` (its old location in
    /// the paper's chain, or an address it announced since).
    pub(crate) fn peer_at(role: Role, ip: IpAddr, port: u16) -> ChainStep {
        ChainStep {
            step: match role {
                Role::Primary => Step::P1,
                Role::Secondary => Step::S2,
            },
            target: SocketAddr::new(ip, port),
            peer_old: true,
        }
    }
}

pub fn chain(
    role: Role,
    peer_old: IpAddr,
    own_old: IpAddr,
    servers: &[SocketAddr],
    port: u16,
) -> Vec<ChainStep> {
    let peer = ChainStep::peer_at(role, peer_old, port);
    let own = ChainStep {
        step: Step::P2,
        target: SocketAddr::new(own_old, port),
        peer_old: false,
    };
    let mut steps = match role {
        Role::Primary => vec![peer, own],
        Role::Secondary => vec![
            ChainStep {
                step: Step::S1,
                ..own
            },
            peer,
        ],
    };
    let server_step = if role == Role::Primary {
        Step::P3
    } else {
        Step::S3
    };
    for s in servers {
        steps.push(ChainStep {
            step: server_step,
            target: *s,
            peer_old: false,
        });
    }
    steps
}

/// The most records stored per connection: all of them fit the answer to
/// a LOOKUP of one connection within 3x its size.
pub const MAX_RECORDS_PER_KEY: usize = 3;

/// Under what a stored record is kept and found: its locator
/// (`crypto::locator`), which only the connection's two ends can compute.
/// Keyed by the connection's addresses instead, anyone who knows them could
/// look its location up, or take its slots before its owner stores.
pub type LocKey = [u8; LOCATOR_LEN];

/// Limits of the location store (bounded memory).
#[derive(Clone, Copy, Debug)]
pub struct StoreLimits {
    pub max_entries: usize,
    /// Records kept per connection (one per source address). A LOOKUP is
    /// answered with all of them, since the store cannot tell the genuine
    /// one from forgeries (the asker checks each tag): above 3, the answer
    /// to a one-record LOOKUP no longer fits the anti-amplification budget
    /// and is cut, so it is capped at [`MAX_RECORDS_PER_KEY`].
    pub max_per_key: usize,
    pub max_per_source: usize,
    pub ttl: Duration,
}

impl Default for StoreLimits {
    fn default() -> Self {
        StoreLimits {
            max_entries: 65_536,
            max_per_key: MAX_RECORDS_PER_KEY,
            max_per_source: 4_096,
            ttl: Duration::from_secs(600),
        }
    }
}

/// A record of the store as saved across a restart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedRecord {
    pub source: IpAddr,
    /// Its lifetime left.
    pub left: Duration,
    pub value: Vec<u8>,
}

struct Stored {
    record: Record,
    source: IpAddr,
    expires: Timestamp,
}

/// The location-server role. The server holds no connection keys: it keeps
/// the STORE records exactly as signed by their owner, and the peer that
/// looks them up checks the owner's tag with the connection key. So a forged
/// record can take space but never misdirect anyone; to keep a forger from
/// pushing out the real record, each key holds one record per source address
/// (a source can only replace its own), full keys refuse newcomers until
/// their records expire, and each source address has a global quota. When
/// the location server is the peer itself, it holds the key and checks the
/// tag before storing (see `recv.rs`).
pub struct LocationStore {
    limits: StoreLimits,
    entries: HashMap<LocKey, Vec<Stored>>,
    per_source: HashMap<IpAddr, usize>,
    total: usize,
}

impl LocationStore {
    pub fn new(limits: StoreLimits) -> LocationStore {
        LocationStore {
            limits,
            entries: HashMap::new(),
            per_source: HashMap::new(),
            total: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    fn forget(per_source: &mut HashMap<IpAddr, usize>, total: &mut usize, s: &Stored) {
        *total -= 1;
        if let Some(n) = per_source.get_mut(&s.source) {
            *n -= 1;
            if *n == 0 {
                per_source.remove(&s.source);
            }
        }
    }

    /// Drop expired records.
    pub fn expire(&mut self, now: Timestamp) {
        let (ps, total) = (&mut self.per_source, &mut self.total);
        self.entries.retain(|_, v| {
            v.retain(|s| {
                let keep = s.expires > now;
                if !keep {
                    Self::forget(ps, total, s);
                }
                keep
            });
            !v.is_empty()
        });
    }

    /// Keep `rec` (a STORE record) sent from `source`. Returns whether it
    /// was kept.
    pub fn store(&mut self, now: Timestamp, source: IpAddr, rec: Record) -> bool {
        self.store_for(now, source, rec, self.limits.ttl)
    }

    /// [`LocationStore::store`] for `ttl` (at most the store's).
    fn store_for(&mut self, now: Timestamp, source: IpAddr, rec: Record, ttl: Duration) -> bool {
        let Ext::Locator(key) = rec.ext else {
            return false;
        };
        let expires = now.plus(ttl.min(self.limits.ttl));
        // One slot per source address and key: a source only ever replaces
        // its own record (with a higher sequence number), never another
        // source's, so forged records from elsewhere cannot push out the
        // genuine one whatever sequence numbers they carry.
        if let Some(v) = self.entries.get_mut(&key) {
            if let Some(mine) = v.iter_mut().find(|s| s.source == source) {
                if mine.record == rec {
                    mine.expires = expires;
                    return true;
                }
                if rec.seq <= mine.record.seq {
                    return false;
                }
                mine.record = rec;
                mine.expires = expires;
                return true;
            }
        }
        if self.total >= self.limits.max_entries {
            self.expire(now);
        }
        let from_source = self.per_source.get(&source).copied().unwrap_or(0);
        if self.total >= self.limits.max_entries || from_source >= self.limits.max_per_source {
            return false;
        }
        let v = self.entries.entry(key).or_default();
        if v.len() >= self.limits.max_per_key.min(MAX_RECORDS_PER_KEY) {
            // Full: the slots are kept by whoever came first, until they
            // expire (evicting by sequence number would let a forger win).
            return false;
        }
        v.push(Stored {
            record: rec,
            source,
            expires,
        });
        self.total += 1;
        *self.per_source.entry(source).or_default() += 1;
        true
    }

    /// Every live record, to be saved across a restart of vnatd: its
    /// source, how long it has left, and its bytes (a one-record STORE
    /// datagram, as `extstore` keeps records).
    pub fn saved(&self, now: Timestamp) -> Vec<SavedRecord> {
        let mut out = Vec::with_capacity(self.total);
        for s in self.entries.values().flatten() {
            if s.expires <= now {
                continue;
            }
            if let Some(value) = super::extstore::encode_value(&s.record) {
                out.push(SavedRecord {
                    source: s.source,
                    left: s.expires.since(now),
                    value,
                });
            }
        }
        out
    }

    /// Take back records saved by [`LocationStore::saved`], within the
    /// store's limits; what does not decode is left out. Returns how many
    /// were kept.
    pub fn restore(&mut self, now: Timestamp, saved: &[SavedRecord]) -> usize {
        let mut kept = 0;
        for s in saved {
            if s.left.is_zero() {
                continue;
            }
            let Ok(rec) = super::extstore::decode_value(&s.value) else {
                continue;
            };
            if self.store_for(now, s.source, rec, s.left) {
                kept += 1;
            }
        }
        kept
    }

    /// Records stored under `locator`.
    pub fn lookup(&self, now: Timestamp, locator: &LocKey) -> Vec<Record> {
        self.entries
            .get(locator)
            .map(|v| {
                v.iter()
                    .filter(|s| s.expires > now)
                    .map(|s| s.record)
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::Proto;
    use crate::wire::Kind;

    /// The locator of the connection the tests store for.
    const LOC: LocKey = [7; LOCATOR_LEN];

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    fn rec(seq: u64) -> Record {
        Record {
            command: Kind::Store,
            proto: Proto::Tcp,
            receiver_vir: sa("10.0.0.2:22"),
            sender_vir: sa("10.0.0.1:1000"),
            sender_phys: sa("10.9.0.1:1000"),
            ext: Ext::Locator(LOC),
            seq,
            tag: [seq as u8; 16],
        }
    }

    #[test]
    fn chain_orders_follow_figure_3_5() {
        let (peer, own) = (
            "10.0.0.2".parse().expect("ip"),
            "10.0.0.1".parse().expect("ip"),
        );
        let servers = [sa("10.5.5.5:2031")];
        let p = chain(Role::Primary, peer, own, &servers, 2031);
        let s = chain(Role::Secondary, peer, own, &servers, 2031);
        let view = |c: &[ChainStep]| {
            c.iter()
                .map(|s| (s.step, s.target, s.peer_old))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            view(&p),
            vec![
                (Step::P1, sa("10.0.0.2:2031"), true),
                (Step::P2, sa("10.0.0.1:2031"), false),
                (Step::P3, servers[0], false)
            ]
        );
        assert_eq!(
            view(&s),
            vec![
                (Step::S1, sa("10.0.0.1:2031"), false),
                (Step::S2, sa("10.0.0.2:2031"), true),
                (Step::S3, servers[0], false)
            ]
        );
    }

    #[test]
    fn store_is_bounded_and_expires() {
        let limits = StoreLimits {
            max_entries: 3,
            max_per_key: 2,
            max_per_source: 10,
            ttl: Duration::from_secs(1),
        };
        let mut s = LocationStore::new(limits);
        let ip = |x: &str| -> IpAddr { x.parse().expect("ip") };
        let (src, forger, other) = (ip("10.0.0.1"), ip("10.6.6.6"), ip("10.7.7.7"));
        let t0 = Timestamp(0);
        assert!(s.store(t0, src, rec(1)));
        assert!(s.store(t0, src, rec(2)), "a source replaces its own record");
        assert!(!s.store(t0, src, rec(1)), "but not with an older one");
        assert!(
            s.store(t0, forger, rec(u64::MAX)),
            "another source gets its own slot"
        );
        assert!(
            !s.store(t0, other, rec(u64::MAX - 1)),
            "a full key refuses newcomers"
        );
        assert!(s.store(t0, src, rec(3)), "the first source keeps its slot");
        assert_eq!(s.len(), 2);
        let mut seqs: Vec<u64> = s.lookup(t0, &LOC).iter().map(|r| r.seq).collect();
        seqs.sort();
        assert_eq!(seqs, vec![3, u64::MAX]);
        let mut other_key = rec(9);
        other_key.ext = Ext::Locator([8; LOCATOR_LEN]);
        assert!(s.store(t0, src, other_key));
        let mut third = rec(9);
        third.ext = Ext::Locator([9; LOCATOR_LEN]);
        assert!(!s.store(t0, src, third), "global cap");
        let later = Timestamp(2_000_000_000);
        assert!(s.lookup(later, &LOC).is_empty());
        assert!(s.store(later, src, third), "expired records make room");
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn saved_records_come_back_with_their_time_left() {
        let mut s = LocationStore::new(StoreLimits::default());
        let src: IpAddr = "10.0.0.1".parse().expect("ip");
        let t0 = Timestamp(0);
        assert!(s.store(t0, src, rec(5)));
        let mut other = rec(6);
        other.ext = Ext::Locator([8; LOCATOR_LEN]);
        assert!(s.store(t0, "10.0.0.3".parse().expect("ip"), other));
        let later = t0.plus(Duration::from_secs(100));
        let saved = s.saved(later);
        assert_eq!(saved.len(), 2);
        assert!(saved.iter().all(|r| r.left == Duration::from_secs(500)));
        let mut back = LocationStore::new(StoreLimits::default());
        let t1 = Timestamp(7_000_000_000);
        let mut with_garbage = saved.clone();
        with_garbage.push(SavedRecord {
            source: src,
            left: Duration::from_secs(10),
            value: vec![1, 2, 3],
        });
        assert_eq!(back.restore(t1, &with_garbage), 2, "garbage is left out");
        assert_eq!(back.lookup(t1, &LOC), vec![rec(5)]);
        assert!(back
            .lookup(t1.plus(Duration::from_secs(501)), &LOC)
            .is_empty());
        assert!(
            back.store(t1, src, rec(6)),
            "the source's slot is its own again"
        );
        assert!(
            !back.store(t1, src, rec(4)),
            "and older records stay refused"
        );
    }

    #[test]
    fn per_source_quota() {
        let limits = StoreLimits {
            max_per_source: 1,
            ..StoreLimits::default()
        };
        let mut s = LocationStore::new(limits);
        let (a, b): (IpAddr, IpAddr) = (
            "10.0.0.1".parse().expect("ip"),
            "10.0.0.3".parse().expect("ip"),
        );
        let mut elsewhere = rec(2);
        elsewhere.ext = Ext::Locator([8; LOCATOR_LEN]);
        assert!(s.store(Timestamp(0), a, rec(1)));
        assert!(!s.store(Timestamp(0), a, elsewhere), "quota of a reached");
        assert!(s.store(Timestamp(0), b, elsewhere));
    }
}
