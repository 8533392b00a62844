//! Which planned suspensions the peers have yet to settle: filled by
//! `Command::Suspend`, drained by the core's `Event::SuspendSettled` (which
//! also comes for a connection that went). Their number is published on a
//! watch channel, for vnatd's sleep inhibitor (`daemon::sleep`), which is
//! released once it is 0.

use std::collections::HashSet;

use tokio::sync::watch;

use crate::datapath::VirtualFlow;

pub(super) struct Settling {
    pending: HashSet<VirtualFlow>,
    count: watch::Sender<usize>,
}

impl Default for Settling {
    fn default() -> Self {
        Settling {
            pending: HashSet::new(),
            count: watch::channel(0).0,
        }
    }
}

impl super::Driver {
    /// How many planned suspensions the peers have yet to settle: 0 once
    /// each was answered or given up (`daemon::sleep` waits for it).
    pub fn suspensions_settling(&self) -> watch::Receiver<usize> {
        self.settling.subscribe()
    }
}

impl Settling {
    /// How many suspensions are settling, from now on.
    pub(super) fn subscribe(&self) -> watch::Receiver<usize> {
        self.count.subscribe()
    }

    /// The core started suspending `flows`.
    pub(super) fn started(&mut self, flows: &[VirtualFlow]) {
        self.pending.extend(flows.iter().copied());
        self.publish();
    }

    /// The suspension of `flow` is over.
    pub(super) fn settled(&mut self, flow: &VirtualFlow) {
        if self.pending.remove(flow) {
            self.publish();
        }
    }

    fn publish(&self) {
        let n = self.pending.len();
        self.count
            .send_if_modified(|c| std::mem::replace(c, n) != n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::Proto;

    fn flow(port: u16) -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: format!("192.0.2.1:{port}").parse().expect("address"),
            remote: "192.0.2.2:22".parse().expect("address"),
        }
    }

    #[test]
    fn the_count_falls_to_zero_when_the_last_suspension_settles() {
        let mut s = Settling::default();
        let rx = s.subscribe();
        assert_eq!(*rx.borrow(), 0);
        s.started(&[flow(1), flow(2)]);
        // Suspended again while settling: counted once.
        s.started(&[flow(1)]);
        assert_eq!(*rx.borrow(), 2);
        s.settled(&flow(1));
        // A flow that was never suspended changes nothing.
        s.settled(&flow(9));
        assert_eq!(*rx.borrow(), 1);
        s.settled(&flow(2));
        assert_eq!(*rx.borrow(), 0);
    }

    #[test]
    fn nobody_listening_is_no_error() {
        let mut s = Settling::default();
        s.started(&[flow(1)]);
        s.settled(&flow(1));
        assert_eq!(*s.subscribe().borrow(), 0);
    }
}
