//! Where `vnatctl monitor` gets its events: the driver publishes each move
//! and pairing event here, and every monitoring control connection has a
//! receiver.
//!
//! A subscriber never slows vnatd: publishing is a non-blocking write into
//! a ring of [`CAPACITY`] events shared by all subscribers (a tokio
//! broadcast channel). A subscriber that falls more than that behind (it
//! stopped reading, its socket buffer is full) loses the oldest events and
//! is told how many, with one `lost` event, when it reads again; it is not
//! disconnected. Memory stays bounded whatever the subscribers do.

use tokio::sync::broadcast;
use vnat_control::monitor::MonitorEvent;

/// Events kept for the slowest subscriber. A mass move of 10,000
/// connections publishes 20,000 events within a second; a subscriber that
/// reads (vnatctl) keeps up with that, and one that does not loses the
/// oldest, which `--wait` then looks up in `ls` (each connection's last
/// move).
pub const CAPACITY: usize = 8192;

/// The publishing side, cheap to clone.
#[derive(Clone)]
pub struct EventHub {
    tx: broadcast::Sender<MonitorEvent>,
}

impl Default for EventHub {
    fn default() -> Self {
        EventHub::new()
    }
}

impl EventHub {
    pub fn new() -> EventHub {
        let (tx, _) = broadcast::channel(CAPACITY);
        EventHub { tx }
    }

    /// Hand `ev` to every subscriber; never waits. Nobody subscribed: it
    /// goes nowhere.
    pub fn publish(&self, ev: MonitorEvent) {
        let _ = self.tx.send(ev);
    }

    pub fn subscribe(&self) -> Subscriber {
        Subscriber {
            rx: self.tx.subscribe(),
        }
    }

    /// Monitoring connections open now.
    pub fn subscribers(&self) -> usize {
        self.tx.receiver_count()
    }
}

/// One monitoring connection's receiver.
pub struct Subscriber {
    rx: broadcast::Receiver<MonitorEvent>,
}

impl Subscriber {
    /// The next event, or a `lost` event if this subscriber fell behind;
    /// `None` once the hub is gone (vnatd stops).
    pub async fn next(&mut self) -> Option<MonitorEvent> {
        match self.rx.recv().await {
            Ok(ev) => Some(ev),
            Err(broadcast::error::RecvError::Lagged(n)) => Some(MonitorEvent::lost(
                n,
                vnat_control::monitor::unix_ms(std::time::SystemTime::now()),
            )),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vnat_control::monitor::EventKind;

    fn ev(id: u64) -> MonitorEvent {
        MonitorEvent {
            id: Some(id),
            ..MonitorEvent::new(EventKind::MoveStarted, 1)
        }
    }

    #[tokio::test]
    async fn a_subscriber_that_never_reads_costs_the_publisher_nothing_and_learns_what_it_lost() {
        let hub = EventHub::new();
        let mut stuck = hub.subscribe();
        let mut reader = hub.subscribe();
        let n = (CAPACITY * 3) as u64;
        for id in 0..n {
            hub.publish(ev(id));
            // The reading subscriber keeps up and misses nothing.
            assert_eq!(reader.next().await.and_then(|e| e.id), Some(id));
        }
        let first = stuck.next().await.expect("an event");
        assert_eq!(first.event, EventKind::Lost, "{first:?}");
        assert_eq!(first.count, Some(n - CAPACITY as u64));
        // Then the newest CAPACITY events, in order.
        let next = stuck.next().await.expect("an event");
        assert_eq!(next.id, Some(n - CAPACITY as u64));
    }

    #[test]
    fn publishing_with_no_subscriber_is_harmless() {
        let hub = EventHub::new();
        hub.publish(ev(1));
        assert_eq!(hub.subscribers(), 0);
    }
}
