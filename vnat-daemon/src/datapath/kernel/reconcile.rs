//! At open: the kernel state a previous vnatd left, brought in line with
//! the pinned translations (tc links, addresses on `lo`, host routes, the
//! per-connection rules of migrated connections).

use super::*;

impl KernelDatapath {
    /// Bring tc links and the per-translation kernel state (addresses on lo,
    /// the per-flow routes) in line with the pinned translations.
    pub(super) fn reconcile(&mut self) -> Result<(), DatapathError> {
        // A container's replies held while its NAT entry was pinned
        // (`guests.rs`) by a vnatd that died before letting them go: held
        // for good otherwise, which would stall that connection.
        let held: Vec<FlowKey> = self
            .ingress_entries()?
            .into_iter()
            .filter(|(k, v)| translate::is_hold_only(k, v))
            .map(|(k, _)| k)
            .collect();
        for k in held {
            self.nat_remove(false, &k)?;
        }
        let translations = self.egress_entries()?;
        let mut needed: std::collections::BTreeSet<u32> = translations
            .iter()
            .map(|(_, v)| v.redirect_ifindex)
            .collect();
        needed.extend(
            self.ingress_entries()?
                .iter()
                .map(|(_, v)| v.redirect_ifindex),
        );
        // The per-connection rules of migrated connections: kept for those
        // still translated, removed for the others (a vnatd that died
        // between removing a translation and its rule).
        let sent: std::collections::HashSet<FlowKey> =
            translations.iter().map(|(k, _)| *k).collect();
        let (live, stale): (Vec<_>, Vec<_>) = net::via_routes()?
            .into_iter()
            .partition(|(flow, _)| sent.contains(&flow.to_key()));
        for (flow, ifindex) in live {
            self.egress_via.insert(flow.to_key(), (flow, ifindex));
        }
        for (flow, ifindex) in stale {
            // The table's route stays if a live connection to that address
            // through that interface uses it.
            let shared = self
                .egress_via
                .values()
                .any(|(f, i)| *i == ifindex && f.remote.ip() == flow.remote.ip());
            let _ = net::del_via_route(&flow, ifindex, shared);
        }
        needed.remove(&0);
        for ifindex in attach::pinned_tc(&self.bpffs) {
            if !needed.contains(&ifindex) || net::ifname(ifindex).is_err() {
                attach::detach_tc(&self.bpffs, ifindex);
            }
        }
        for ifindex in needed {
            if net::ifname(ifindex).is_ok() {
                attach::attach_tc(&mut self.loaded.ebpf, &self.bpffs, ifindex, self.tc_mode)?;
                self.tc_current.insert(ifindex);
            }
        }
        let lo = net::lo_addrs()?;
        // vnat routes no peer's whole address any more: every host route a
        // previous vnatd made goes, before the routes of the flows that
        // still need one of their own are worked out.
        for r in net::host_routes()? {
            match net::del_host_route(r) {
                Ok(()) => {
                    tracing::info!(route = %r, "removed a host route a previous vnatd left")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot remove a host route a previous vnatd left")
                }
            }
        }
        for (k, v) in &translations {
            let Some(t) = translation_of(k, v) else {
                continue;
            };
            if t.local_moved()
                && v.flags & NAT_F_ROUTED == 0
                && !lo.iter().any(|(a, _)| *a == t.flow.local.ip())
            {
                self.add_lo_addr(t.flow.local.ip())?;
            }
            // A peer's move that a vnatd before per-flow routes installed
            // (with a host route for every application, removed above), or
            // a translation whose vnatd died before adding its rule: the
            // flow's own route, where needed.
            if (t.remote_moved() || t.local_moved()) && !self.egress_via.contains_key(k) {
                let route = if t.local_moved() {
                    self.route_from(t.physical_remote.ip(), t.physical_local.ip())
                } else {
                    self.route(t.physical_remote.ip(), Some(t.physical_local.ip()))
                };
                if let Some(r) = route.ok().and_then(|r| self.flow_route(&t, &r)) {
                    net::add_via_route(&t.flow, &r)?;
                    self.egress_via.insert(*k, (t.flow, r.ifindex));
                }
            }
        }
        // What a vnatd killed in the middle of an install or a removal left
        // behind: its own addresses on lo that no pinned entry needs. (Someone else's carry no tag of ours and stay.)
        let words = |ip: IpAddr| {
            let sa = std::net::SocketAddr::new(ip, 0);
            crate::datapath::flow_key(Proto::Tcp, sa, sa).src_addr_be
        };
        // A failure here is logged, not fatal: vnatd must start, and what is
        // left is tried again at the next start.
        // The addresses a previous vnatd kept local for mobile connections
        // stay until the driver says which still are.
        self.kept = net::fallback_rules()?.into_iter().collect();
        for (a, ours) in lo {
            if ours
                && !self.kept.contains(&a)
                && !self.mirror.local_moved.contains_key(&a)
                && !self.mirror.prepared_lo.contains_key(&words(a))
            {
                match net::del_lo_addr(a, false) {
                    Ok(_) => {
                        tracing::info!(address = %a, "removed an address a previous vnatd left on lo")
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot remove an address a previous vnatd left on lo")
                    }
                }
            }
        }
        Ok(())
    }
}
