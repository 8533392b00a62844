//! The datapath's work on one recorded connection's socket: the restart
//! levers' record lookups, resets for conflicts, and the standby tc
//! attachments (kept here to keep `mod.rs`, the trait's implementation,
//! short).

use super::*;

impl KernelDatapath {
    /// The record of `flow` on this host, if any (not a container's).
    pub(super) fn record(&self, flow: &VirtualFlow) -> Result<Option<ConnRecord>, DatapathError> {
        match self.loaded.maps.conns.get(&flow.to_key(), 0) {
            Ok(r) => Ok(Some(r)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(map_err(MAP_CONNS)(e)),
        }
    }

    /// `Datapath::set_standby`.
    pub(super) fn standby_tc(&mut self, ifindexes: &[u32]) -> Result<(), DatapathError> {
        let wanted: std::collections::BTreeSet<u32> = ifindexes.iter().copied().collect();
        for &ifindex in wanted.difference(&self.standby.clone()) {
            // An interface vnat cannot translate on (CAN, InfiniBand, ...)
            // is no place a connection moves to: skipped, not an error
            // that would leave the interfaces after it unattached.
            if let Err(e) = net::link_layer(ifindex) {
                tracing::debug!(error = %e, "no standby tc here");
                continue;
            }
            if !self.tc_current.contains(&ifindex) {
                // One interface that cannot take tc (it vanished meanwhile)
                // leaves the others attached.
                if let Err(e) =
                    attach::attach_tc(&mut self.loaded.ebpf, &self.bpffs, ifindex, self.tc_mode)
                {
                    tracing::warn!(error = %e, "no standby tc on this interface");
                    continue;
                }
                self.tc_current.insert(ifindex);
                fault::after("install:tc");
            }
            self.standby.insert(ifindex);
        }
        let leaving: Vec<u32> = self.standby.difference(&wanted).copied().collect();
        for ifindex in leaving {
            self.standby.remove(&ifindex);
            if !self.bind_ifaces.contains(&ifindex) && !self.tc_used_by_translation(ifindex)? {
                attach::detach_tc(&self.bpffs, ifindex);
                self.tc_current.remove(&ifindex);
                fault::after("remove:tc");
            }
        }
        Ok(())
    }

    /// `Datapath::reset_connection`.
    pub(super) fn reset_recorded(&mut self, flow: &VirtualFlow) -> Result<bool, DatapathError> {
        let key = flow.to_key();
        // Only a socket recorded here, by its cookie: never one found by its
        // tuple alone (a later socket that reused it), nor a container's
        // (its socket is in another namespace, its record in the guest map).
        let cookie = match self.loaded.maps.conns.get(&key, 0) {
            Ok(r) if r.cookie != 0 => r.cookie,
            Ok(_) => return Ok(false),
            Err(e) if is_not_found(&e) => return Ok(false),
            Err(e) => return Err(map_err(MAP_CONNS)(e)),
        };
        if !restart::reset(flow, cookie)? {
            return Ok(false);
        }
        // Gone now: a move that preempted it must not find its record (or
        // its translation) in its way.
        let _ = self.loaded.maps.conns.remove(&key);
        match self.remove(flow) {
            Ok(()) | Err(DatapathError::NoSuchTranslation { .. }) => {}
            Err(e) => {
                tracing::warn!(id = flow.id(), %flow, error = %e, "cannot remove the translation of a connection reset for a conflict")
            }
        }
        Ok(true)
    }
}
