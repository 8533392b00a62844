//! Named counters: every datagram or record that is refused is counted under
//! a reason (`rejected`), other notable events under `events`, so that tests
//! and `vnatctl status` can tell what happened and why.

use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    pub events: BTreeMap<&'static str, u64>,
    pub rejected: BTreeMap<&'static str, u64>,
}

impl Stats {
    /// Count a notable event (sent, accepted, retransmitted...).
    pub fn count(&mut self, name: &'static str) {
        *self.events.entry(name).or_default() += 1;
    }
    /// Count `n` notable events at once.
    pub fn count_n(&mut self, name: &'static str, n: u64) {
        *self.events.entry(name).or_default() += n;
    }
    /// Count an input refused for `reason`.
    pub fn reject(&mut self, reason: &'static str) {
        *self.rejected.entry(reason).or_default() += 1;
    }
    pub fn get(&self, name: &str) -> u64 {
        self.events.get(name).copied().unwrap_or(0)
    }
    pub fn rejected(&self, reason: &str) -> u64 {
        self.rejected.get(reason).copied().unwrap_or(0)
    }
    pub fn rejected_total(&self) -> u64 {
        self.rejected.values().sum()
    }
}
