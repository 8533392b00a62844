//! Giving back a table's room once it is mostly empty.
//!
//! A mass move fills some tables for its duration only (the holds, the
//! moves under way, the validations, the events of one turn): at 100,000
//! connections each is megabytes, and a hash table or a queue keeps its
//! largest size after it empties. The owners call [`Shrink::shrink_sparse`]
//! from time to time (vnatd after each resync): a table holding less than a
//! quarter of its room is cut to twice what it holds, so a table that
//! shrinks and grows again does not churn (issue 33, item 1).

use std::collections::{HashMap, HashSet, VecDeque};
use std::hash::{BuildHasher, Hash};

/// Below this room a table is left as it is.
const KEEP: usize = 64;

pub trait Shrink {
    fn shrink_sparse(&mut self);
}

fn sparse(len: usize, capacity: usize) -> bool {
    capacity > KEEP && len.saturating_mul(4) < capacity
}

impl<K: Eq + Hash, V, S: BuildHasher> Shrink for HashMap<K, V, S> {
    fn shrink_sparse(&mut self) {
        if sparse(self.len(), self.capacity()) {
            self.shrink_to((self.len() * 2).max(KEEP));
        }
    }
}

impl<K: Eq + Hash, S: BuildHasher> Shrink for HashSet<K, S> {
    fn shrink_sparse(&mut self) {
        if sparse(self.len(), self.capacity()) {
            self.shrink_to((self.len() * 2).max(KEEP));
        }
    }
}

impl<T> Shrink for VecDeque<T> {
    fn shrink_sparse(&mut self) {
        if sparse(self.len(), self.capacity()) {
            self.shrink_to((self.len() * 2).max(KEEP));
        }
    }
}

impl<T> Shrink for Vec<T> {
    fn shrink_sparse(&mut self) {
        if sparse(self.len(), self.capacity()) {
            self.shrink_to((self.len() * 2).max(KEEP));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_emptied_table_gives_back_its_room_and_a_full_one_keeps_it() {
        let mut m: HashMap<u32, [u8; 64]> = (0..100_000).map(|i| (i, [0; 64])).collect();
        let full = m.capacity();
        m.shrink_sparse();
        assert_eq!(m.capacity(), full, "a full table keeps its room");
        m.retain(|k, _| *k < 10);
        m.shrink_sparse();
        assert!(m.capacity() < 200, "room {} for 10 entries", m.capacity());
        assert_eq!(m.len(), 10);

        let mut q: VecDeque<u64> = (0..10_000).collect();
        q.drain(..9_990);
        q.shrink_sparse();
        assert!(q.capacity() <= 2 * KEEP, "room {}", q.capacity());
        assert_eq!(
            q.iter().copied().collect::<Vec<_>>(),
            (9_990..10_000).collect::<Vec<_>>()
        );

        // A quarter full or more: left alone (no churn as it refills).
        let mut v: Vec<u8> = Vec::with_capacity(1000);
        v.resize(300, 0);
        v.shrink_sparse();
        assert_eq!(v.capacity(), 1000);
        // Small tables are never touched.
        let mut s: HashSet<u8> = HashSet::with_capacity(KEEP);
        let before = s.capacity();
        s.shrink_sparse();
        assert_eq!(s.capacity(), before);
    }
}
