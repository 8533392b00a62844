//! The connections' timer table: each connection's next deadline (its
//! migration's, key agreement's, claim resend's or role claim's, whichever
//! is first), ordered, so that the next deadline is the table's first entry
//! and the connections due are a prefix of it, not a scan of them all.
//!
//! The rule that keeps it right: whatever changes one of a connection's
//! deadlines calls `Endpoint::rearm` for it afterwards. Debug builds check
//! the table against the connections on every `poll_timeout`.

use std::collections::{BTreeSet, HashMap};

use crate::flow::VirtualFlow;
use crate::Timestamp;

#[derive(Default)]
pub(crate) struct ConnTimers {
    order: BTreeSet<(Timestamp, VirtualFlow)>,
    at: HashMap<VirtualFlow, Timestamp>,
}

impl ConnTimers {
    /// `flow`'s next deadline is now `deadline` (`None`: it has none).
    pub fn set(&mut self, flow: VirtualFlow, deadline: Option<Timestamp>) {
        let old = self.at.get(&flow).copied();
        if old == deadline {
            return;
        }
        if let Some(old) = old {
            self.order.remove(&(old, flow));
            self.at.remove(&flow);
        }
        if let Some(d) = deadline {
            self.order.insert((d, flow));
            self.at.insert(flow, d);
        }
    }

    /// The earliest deadline of any connection.
    pub fn next(&self) -> Option<Timestamp> {
        self.order.first().map(|(t, _)| *t)
    }

    /// The connections whose deadline is at or before `now`, earliest first.
    pub fn due(&self, now: Timestamp) -> Vec<VirtualFlow> {
        self.order
            .iter()
            .take_while(|(t, _)| *t <= now)
            .map(|(_, f)| *f)
            .collect()
    }

    /// The deadline the table holds for `flow`.
    #[cfg(debug_assertions)]
    pub fn get(&self, flow: &VirtualFlow) -> Option<Timestamp> {
        self.at.get(flow).copied()
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
