//! Which addresses are trusted (`TxQueue::trusted`): sent to without the
//! anti-amplification limit, and welcome to pair without proving their
//! address first. Addresses are added as they earn it (a connection's
//! remote end, a paired host, a validated path, a location server, our own
//! old address), and the set is rebuilt from what is live at most once a
//! second after something went (a connection closed, a host forgotten), so
//! it stays bounded by the live connections, sessions and servers, and an
//! address whose last connection closed earns nothing any more (issue 31).

use std::collections::HashSet;
use std::net::IpAddr;
use std::time::Duration;

use super::endpoint::Endpoint;
use super::Timestamp;

/// Least time between two rebuilds.
const REBUILD_EVERY: Duration = Duration::from_secs(1);

impl Endpoint {
    /// Something that earned an address its trust went away: rebuild soon.
    pub(crate) fn trust_lost(&mut self) {
        self.tx.trust_stale = true;
    }

    /// When [`Endpoint::rebuild_trust`] is due, if it is.
    pub(crate) fn next_trust_rebuild(&self) -> Option<Timestamp> {
        self.tx
            .trust_stale
            .then(|| self.tx.trust_rebuilt.plus(REBUILD_EVERY))
    }

    /// Rebuild the trusted set from what is live, if due at `now`.
    pub(crate) fn trust_timeouts(&mut self, now: Timestamp) {
        if self.next_trust_rebuild().is_none_or(|t| t > now) {
            return;
        }
        let mut t: HashSet<IpAddr> = self.cfg.location_servers.iter().map(|s| s.ip()).collect();
        for (key, a) in &self.peer_addrs {
            if self.sessions.contains_key(key) && !self.pairing.strangers.is_pending(key) {
                t.insert(a.ip());
            }
        }
        for c in self.conns.values() {
            t.insert(c.remote_phys.ip());
            t.extend(c.validated.iter().copied());
            if let Some(m) = &c.mig {
                t.insert(m.local_at_start.ip());
            }
        }
        self.tx.trusted = t;
        self.tx.trust_stale = false;
        self.tx.trust_rebuilt = now;
    }
}
