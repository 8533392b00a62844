//! A NAT that re-maps a connection that did not move (issue 32, item 2): a
//! home router that reboots, a carrier-grade NAT that gives an idle flow a
//! new port. The peer behind it sends from the same address as before but
//! another port, which nobody announces.
//!
//! What makes us suspect it teaches nothing: the datapath's guard
//! (`Event::GuardNat`, `vnat_common::natguard`) dropped packets from that
//! NAT's address to the connection's port that no flow owns
//! (`nat_guard_dropped`): some host behind the NAT sends there from a port
//! we do not know. The connection then starts the rebind a move behind a
//! new NAT starts (`update`, `bind`): its remote port is set unknown (`SetRemote`
//! to port 0: the datapath keeps the kernel from resetting, or the
//! application from taking as a new peer's, what comes from the NAT to the
//! port meanwhile) and the peer is asked for the connection's BIND. Only
//! that BIND, authenticated and sent on the connection's own path, tells
//! the new port (or that the port did not change); so a host that shares
//! the NAT and makes the guard drop, which anyone behind it can, costs the
//! peer one BIND per connection a second at most and moves nothing.
//!
//! A NAT that forgot the connection's mapping (a reboot) forgot the one of
//! the peer's vnatd too, so our requests go nowhere until the peer's next
//! keepalive reaches us from its new mapping (`keepalive_secs`, 25 s by
//! default): then the requests still waiting are sent again at once
//! (`peer_vcmp_moved`). A new VCMP mapping alone moves nothing.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::endpoint::{Endpoint, Event};
use super::Timestamp;
use crate::flow::{Proto, VirtualFlow};
use crate::stats::Counter;

/// Least time between two suspected re-maps of one connection.
const REMAP_EVERY: Duration = Duration::from_secs(1);

impl Endpoint {
    /// The datapath's guard dropped packets from `nat` to our endpoint
    /// `local` (`proto`): every connection there whose peer is behind
    /// `nat` may have been re-mapped by it; ask those peers for BINDs.
    pub fn nat_guard_dropped(
        &mut self,
        now: Timestamp,
        nat: IpAddr,
        local: SocketAddr,
        proto: Proto,
    ) {
        self.binds.clock = now;
        let flows: Vec<VirtualFlow> = self
            .conns
            .values()
            .filter(|c| c.flow.proto == proto && c.flow.local == local && c.remote_phys.ip() == nat)
            .map(|c| c.flow)
            .collect();
        for flow in flows {
            self.suspect_remap(now, &flow);
        }
        self.tx.flush(&mut self.stats);
    }

    /// A fresh, authenticated keepalive of `peer` was just taken, from
    /// where `peer_addrs` now says; `before` is where it was reached until
    /// then. Another port of the same address: the NAT in front of it gave
    /// it a new mapping, and the BIND requests still waiting for an answer
    /// (sent to the mapping that is gone) are sent there again at once.
    pub(crate) fn peer_vcmp_moved(&mut self, peer: [u8; 32], before: Option<SocketAddr>) {
        let (Some(before), Some(now_at)) = (before, self.peer_addrs.get(&peer).copied()) else {
            return;
        };
        if before == now_at || before.ip() != now_at.ip() {
            return;
        }
        let flows: Vec<VirtualFlow> = self
            .conns
            .values()
            .filter(|c| c.peer_key == Some(peer) && c.remote_phys.ip() == now_at.ip())
            .map(|c| c.flow)
            .collect();
        for flow in flows {
            if self.binds.asking(&flow) {
                self.resend_rebind_request(&flow);
            }
        }
        self.tx.flush(&mut self.stats);
    }

    /// Start `flow`'s rebind if its peer is behind a NAT (it names its end
    /// otherwise than we do), nothing else is under way for it, and none
    /// was started within [`REMAP_EVERY`]. True if started.
    fn suspect_remap(&mut self, now: Timestamp, flow: &VirtualFlow) -> bool {
        let Some(c) = self.conns.get(flow) else {
            return false;
        };
        // (Not while the connection is carried in the other IP family: it
        // is between the two hosts' own addresses there, and a rebind is
        // for its own family only, as in `on_upd`.)
        let behind_nat = c.peer_named().is_some_and(|n| n.remote != c.flow.remote)
            && c.remote_phys.is_ipv4() == c.flow.remote.is_ipv4();
        let busy = c.pending_remote.is_some() || c.mig.is_some();
        if c.peer_key.is_none() || c.keys.is_none() || !behind_nat || busy {
            return false;
        }
        if self.binds.asking(flow)
            || self
                .binds
                .remapped
                .get(flow)
                .is_some_and(|t| now.since(*t) < REMAP_EVERY)
        {
            return false;
        }
        let remote = SocketAddr::new(c.remote_phys.ip(), 0);
        self.binds.remapped.insert(*flow, now);
        if let Some(c) = self.conns.get_mut(flow) {
            c.set_remote(remote);
        }
        self.stats.count(Counter::NatRemapSuspected);
        self.emit(Event::SetRemote {
            flow: *flow,
            remote,
        });
        self.ask_rebind(now, flow);
        true
    }
}
