//! NAT guards (`vnat_common::natguard`, `vcmp::remap`): the core names the
//! connections whose peer is behind a NAT (`Event::GuardNat`), the
//! datapath guards them, and what the guards drop goes back to the core,
//! which asks those peers for BINDs.

use std::net::IpAddr;
use std::time::Duration;

use super::{now, with_dp, Driver};
use crate::datapath::VirtualFlow;

/// How often the guards' drop counts are read while some exist: the UDP
/// guard holds an unknown port for `vnat_common::GUARD_UDP_HOLD_NS` (3 s),
/// which must cover this and the peer's rebind request.
pub(super) const GUARD_POLL: Duration = Duration::from_millis(250);

impl Driver {
    /// `Event::GuardNat`.
    pub(super) async fn guard_nat(&mut self, flow: VirtualFlow, nat: IpAddr) {
        match with_dp(&self.dp, move |dp| dp.guard_nat(&flow, nat)).await {
            Ok(()) => {
                if self.next_guard_poll.is_none() {
                    self.next_guard_poll = Some(std::time::Instant::now() + GUARD_POLL);
                }
            }
            Err(e) => {
                tracing::warn!(id = flow.id(), %flow, %nat, error = %e, "cannot guard the connection against its peer's NAT re-mapping it: if that NAT forgets the mapping, the connection breaks")
            }
        }
    }

    /// Read the guards' drops, and tell the core where they were.
    pub(super) async fn poll_nat_guards(&mut self) {
        self.next_guard_poll = Some(std::time::Instant::now() + GUARD_POLL);
        let drops = match with_dp(&self.dp, |dp| dp.nat_guard_drops()).await {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the NAT guards");
                return;
            }
        };
        for d in drops {
            tracing::debug!(nat = %d.nat, local = %d.local, proto = ?d.proto, "a NAT guard dropped packets: asking the peers behind that NAT for their BINDs");
            self.endpoint
                .nat_guard_dropped(now(), d.nat, d.local, d.proto);
        }
    }
}
