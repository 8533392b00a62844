//! Timer tables: each key's next deadline, ordered, so that the next
//! deadline is the table's first entry and the keys due are a prefix of it,
//! not a scan of them all. The connections' table ([`ConnTimers`]) holds
//! each connection's earliest deadline (its migration's, key agreement's,
//! claim resend's or role claim's); pairing has its own for handshakes and
//! retries (`pairing::PairTimer`).
//!
//! The rule that keeps a table right: whatever changes a key's deadline
//! sets it in the table afterwards (for connections, `Endpoint::rearm`).
//! Debug builds check the tables against their state on every
//! `poll_timeout`.

use std::collections::{BTreeSet, HashMap};
use std::hash::Hash;

use crate::flow::VirtualFlow;
use crate::Timestamp;

pub(crate) struct TimerTable<K> {
    order: BTreeSet<(Timestamp, K)>,
    at: HashMap<K, Timestamp>,
}

/// The connections' timer table.
pub(crate) type ConnTimers = TimerTable<VirtualFlow>;

impl<K> Default for TimerTable<K> {
    fn default() -> Self {
        TimerTable {
            order: BTreeSet::new(),
            at: HashMap::new(),
        }
    }
}

impl<K: Copy + Ord + Hash> TimerTable<K> {
    /// Gives back room a burst left (`crate::room`).
    pub fn shrink_sparse(&mut self) {
        use crate::room::Shrink;
        self.at.shrink_sparse();
    }

    /// `key`'s next deadline is now `deadline` (`None`: it has none).
    pub fn set(&mut self, key: K, deadline: Option<Timestamp>) {
        let old = self.at.get(&key).copied();
        if old == deadline {
            return;
        }
        if let Some(old) = old {
            self.order.remove(&(old, key));
            self.at.remove(&key);
        }
        if let Some(d) = deadline {
            self.order.insert((d, key));
            self.at.insert(key, d);
        }
    }

    /// The earliest deadline of any key.
    pub fn next(&self) -> Option<Timestamp> {
        self.order.first().map(|(t, _)| *t)
    }

    /// The keys whose deadline is at or before `now`, earliest first.
    pub fn due(&self, now: Timestamp) -> Vec<K> {
        self.order
            .iter()
            .take_while(|(t, _)| *t <= now)
            .map(|(_, k)| *k)
            .collect()
    }

    /// The deadline the table holds for `key`.
    pub fn get(&self, key: &K) -> Option<Timestamp> {
        self.at.get(key).copied()
    }

    #[cfg(debug_assertions)]
    pub fn len(&self) -> usize {
        self.at.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::Proto;

    fn flow(port: u16) -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: format!("10.0.0.1:{port}").parse().unwrap(),
            remote: "10.0.0.2:22".parse().unwrap(),
        }
    }

    #[test]
    fn rearming_moves_an_entry_and_none_removes_it() {
        let mut t = ConnTimers::default();
        t.set(flow(1), Some(Timestamp(30)));
        t.set(flow(2), Some(Timestamp(10)));
        t.set(flow(3), Some(Timestamp(20)));
        assert_eq!(t.next(), Some(Timestamp(10)));
        assert_eq!(t.due(Timestamp(20)), vec![flow(2), flow(3)]);
        t.set(flow(2), Some(Timestamp(40)));
        assert_eq!(t.next(), Some(Timestamp(20)));
        assert_eq!(t.due(Timestamp(35)), vec![flow(3), flow(1)]);
        t.set(flow(3), None);
        t.set(flow(1), None);
        assert_eq!(t.due(Timestamp(100)), vec![flow(2)]);
        t.set(flow(2), None);
        assert_eq!(t.next(), None);
        assert_eq!(t.len(), 0);
    }
}
