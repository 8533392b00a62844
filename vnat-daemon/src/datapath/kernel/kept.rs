//! The addresses of mobile connections, kept local from the moment a
//! connection becomes mobile (`Datapath::keep_local`). When such an
//! address vanishes from its interface (an unannounced move), the
//! connection's socket still sends from it until vnatd has moved it: with
//! the address gone its sends would fail ("Invalid argument", and while the
//! host has no route at all, "Network is unreachable"), and many UDP
//! applications stop at their first failed send. Kept on `lo` (with the ARP
//! settings of every address vnat keeps there) and given a last-resort
//! route to a sink, the sends succeed; what leaves before the move is lost,
//! as on any link that went dark.

use std::{collections::BTreeSet, net::IpAddr};

use super::{fault, net, KernelDatapath};
use crate::datapath::{DatapathError, Proto};

impl KernelDatapath {
    /// See [`crate::datapath::Datapath::keep_local`].
    pub(super) fn keep_local_addrs(
        &mut self,
        mobile: &[IpAddr],
        in_use: &[IpAddr],
    ) -> Result<(), DatapathError> {
        let mut wanted: BTreeSet<IpAddr> = mobile.iter().copied().collect();
        // Kept before and still used (its connections not mobile again
        // yet, as after a restart): kept.
        wanted.extend(self.kept.iter().filter(|a| in_use.contains(a)));
        if wanted == self.kept && !wanted.is_empty() {
            // Asked again after a route change.
            if wanted.iter().any(IpAddr::is_ipv6) {
                if let Err(e) = net::refresh_sink_v6() {
                    tracing::debug!(error = %e, "cannot renew the IPv6 last-resort route");
                }
            }
            return Ok(());
        }
        let adding: Vec<IpAddr> = wanted.difference(&self.kept).copied().collect();
        if !adding.is_empty() {
            net::ensure_sink()?;
            let lo = net::lo_addrs()?;
            for ip in adding {
                if !lo.iter().any(|(a, _)| *a == ip) {
                    self.routes_changed();
                    self.add_lo_addr(ip)?;
                    fault::after("install:lo-address");
                }
                net::add_fallback_rule(ip)?;
                self.kept.insert(ip);
            }
        }
        let dropping: Vec<IpAddr> = self.kept.difference(&wanted).copied().collect();
        for ip in dropping {
            net::del_fallback_rule(ip)?;
            self.kept.remove(&ip);
            if !self.lo_needed_by_translation(ip) {
                self.routes_changed();
                // Only if it carries vnat's tag: never someone else's.
                if net::del_lo_addr(ip, false)? {
                    fault::after("remove:lo-address");
                }
                self.lo_ours.remove(&ip);
            }
        }
        if self.kept.is_empty() && net::remove_sink()? == net::SinkRemoval::Foreign {
            // Warned by the driver when a kept address needs the sink.
            tracing::debug!("{}", net::foreign_sink_warning());
        }
        self.sync_gone_or_warn();
        Ok(())
    }

    /// A connection from the kept address `ip` was moved: make the IPv6
    /// sockets that cached the route to the sink while the host had no
    /// route look again (`net::refresh_sink_v6`), once per batch.
    pub(super) fn moved_from_kept(&self, ip: IpAddr) {
        if !ip.is_ipv6() || !self.kept.contains(&ip) {
            return;
        }
        if let Some(m) = self.memo.borrow_mut().as_mut() {
            if std::mem::replace(&mut m.sink_renewed, true) {
                return;
            }
        }
        if let Err(e) = net::refresh_sink_v6() {
            tracing::debug!(error = %e, "cannot renew the IPv6 last-resort route");
        }
    }

    /// Whether a translation (installed or prepared) keeps `ip` on `lo`.
    pub(super) fn lo_needed_by_translation(&self, ip: IpAddr) -> bool {
        let sa = std::net::SocketAddr::new(ip, 0);
        let words = crate::datapath::flow_key(Proto::Tcp, sa, sa).src_addr_be;
        self.mirror.local_moved.contains_key(&ip) || self.mirror.prepared_lo.contains_key(&words)
    }
}
