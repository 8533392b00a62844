//! The kernel datapath's side of a peer behind NAT: rebinding flows (the tc
//! program learns a TCP connection's new NAT port), the divert of in-band
//! BINDs, and direct map writes for the tests of the tc programs.

use std::net::IpAddr;

use vnat_common::{
    FlowKey, NatRewrite, RebindKey, RebindValue, MAP_CONNS, MAP_EGRESS_NAT, MAP_INGRESS_NAT,
    NAT_F_REDIRECT,
};

use super::{attach, is_not_found, map_err, object, KernelDatapath, NatPair};
use crate::datapath::{DatapathError, Translation};

impl KernelDatapath {
    /// Write NAT entries directly, without routes, addresses or tc
    /// attachment (for tests of the tc programs with BPF_PROG_TEST_RUN).
    pub fn insert_nat_pair(&mut self, p: &NatPair) -> Result<(), DatapathError> {
        self.write_pair(p, None)
    }

    /// Write `flow`'s allowance for an unvalidated peer address directly
    /// (for tests of the tc programs, beside [`Self::insert_nat_pair`]),
    /// with the placement what is over it goes to (`fallback`, its egress
    /// entry on interface 1, and how long from now it waits before it is
    /// used; `None`: dropped).
    pub fn insert_unvalidated_budget(
        &mut self,
        flow: &crate::datapath::VirtualFlow,
        allowed: u64,
        fallback: Option<(&Translation, std::time::Duration)>,
    ) -> Result<(), DatapathError> {
        let fallback = fallback.map_or(NatRewrite::default(), |(t, wait)| {
            let e = super::pair_for(t, 1, 0).egress;
            let ns = u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
            NatRewrite {
                flags: e.flags | vnat_common::NAT_F_FALLBACK,
                held_until: if ns == 0 {
                    0
                } else {
                    vnat_common::hold_until(super::listing::boottime_ns(), ns)
                },
                ..e
            }
        });
        let b = vnat_common::UnvalidatedBudget {
            allowed,
            fallback,
            ..Default::default()
        };
        self.loaded
            .maps
            .unvalidated
            .insert(flow.to_key(), b, 0)
            .map_err(map_err(vnat_common::MAP_UNVALIDATED))
    }

    /// `flow`'s allowance for the unvalidated peer address it sends to
    /// (`NAT_F_BUDGET`): what it may send there in all and what it sent,
    /// in bytes; `None` if it has none.
    pub fn unvalidated_budget(
        &self,
        flow: &crate::datapath::VirtualFlow,
    ) -> Result<Option<(u64, u64)>, DatapathError> {
        Ok(self.unvalidated_entry(flow)?.map(|b| (b.allowed, b.sent)))
    }

    /// How many of `flow`'s packets went to its last validated placement
    /// because they were over its allowance for the unvalidated address;
    /// `None` if it has no allowance.
    pub fn unvalidated_diverted(
        &self,
        flow: &crate::datapath::VirtualFlow,
    ) -> Result<Option<u64>, DatapathError> {
        Ok(self.unvalidated_entry(flow)?.map(|b| b.diverted))
    }

    /// [`crate::datapath::Datapath::credit_unvalidated`]: the entry
    /// rewritten with `allowed` and nothing sent yet, its fallback and its
    /// count of diverted packets kept. The tc program's plain stores to
    /// `sent` between the read and the write are lost, as an install's
    /// would be.
    pub fn credit_budget(
        &mut self,
        flow: &crate::datapath::VirtualFlow,
        allowed: u32,
    ) -> Result<bool, DatapathError> {
        let Some(b) = self.unvalidated_entry(flow)? else {
            return Ok(false);
        };
        let credited = vnat_common::UnvalidatedBudget {
            allowed: u64::from(allowed),
            sent: 0,
            ..b
        };
        // BPF_EXIST: an entry removed meanwhile stays removed.
        match self
            .loaded
            .maps
            .unvalidated
            .insert(flow.to_key(), credited, 2)
        {
            Ok(()) => Ok(true),
            Err(e) if is_not_found(&e) => Ok(false),
            Err(e) => Err(map_err(vnat_common::MAP_UNVALIDATED)(e)),
        }
    }

    fn unvalidated_entry(
        &self,
        flow: &crate::datapath::VirtualFlow,
    ) -> Result<Option<vnat_common::UnvalidatedBudget>, DatapathError> {
        match self.loaded.maps.unvalidated.get(&flow.to_key(), 0) {
            Ok(b) => Ok(Some(b)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(map_err(vnat_common::MAP_UNVALIDATED)(e)),
        }
    }

    /// Whether another connection than `own` (its record's key) is
    /// recorded with the physical endpoints `physical` (our end first): under
    /// that key, or, for UDP, under our wildcard address, where a socket
    /// bound to `0.0.0.0` or `::` is recorded.
    pub(super) fn recorded_elsewhere(
        &self,
        physical: &FlowKey,
        own: &FlowKey,
    ) -> Result<bool, DatapathError> {
        let wildcard = |k: &FlowKey| FlowKey {
            src_addr_be: [0; 4],
            ..*k
        };
        let mut keys = vec![*physical];
        if physical.proto == vnat_common::PROTO_UDP {
            keys.push(wildcard(physical));
        }
        for k in keys {
            if k == *own || k == wildcard(own) {
                continue;
            }
            match self.loaded.maps.conns.get(&k, 0) {
                Ok(_) => return Ok(true),
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(MAP_CONNS)(e)),
            }
        }
        Ok(false)
    }

    /// Write a connection record directly, as the recorders would (for
    /// tests of the tc programs with BPF_PROG_TEST_RUN).
    pub fn insert_conn_record(
        &mut self,
        key: FlowKey,
        rec: vnat_common::ConnRecord,
    ) -> Result<(), DatapathError> {
        self.loaded
            .maps
            .conns
            .insert(key, rec, 0)
            .map_err(map_err(MAP_CONNS))
    }

    /// Divert in-band BINDs to `vcmp_port` (0: stop), without attaching
    /// anything (see `divert_binds_toward`; tests of the tc programs call
    /// this directly).
    pub fn set_bind_divert_port(&mut self, vcmp_port: u16) -> Result<(), DatapathError> {
        if self.bind_divert_port != vcmp_port {
            object::set_config(&mut self.loaded, self.nat_empty, self.rebinding, vcmp_port)?;
            self.bind_divert_port = vcmp_port;
        }
        Ok(())
    }

    /// Make a flow rebinding: the tc ingress program installs a TCP
    /// connection's translations from the TCP BIND that matches `key` and
    /// carries one of `value`'s tokens (see `vnat_common::RebindValue`);
    /// a UDP flow's are written by vnatd on its BIND. Direct map writes for
    /// the tests of the tc programs; vnatd goes through `rebind`.
    pub fn insert_rebind(
        &mut self,
        key: RebindKey,
        value: RebindValue,
    ) -> Result<(), DatapathError> {
        // The translators parse packets only while some entry exists, and
        // look up rebinds only while some flow is rebinding.
        self.set_nat_empty(false)?;
        self.set_rebinding(true)?;
        self.loaded
            .maps
            .rebind
            .insert(key, value, 0)
            .map_err(map_err(vnat_common::MAP_REBIND))
    }

    /// tc attached to `ifindex`, if it is not already (kept as long as
    /// vnatd's bookkeeping of attached interfaces says).
    pub(super) fn tc_on(&mut self, ifindex: u32) -> Result<(), DatapathError> {
        if !self.tc_current.contains(&ifindex) {
            attach::attach_tc(&mut self.loaded.ebpf, &self.bpffs, ifindex, self.tc_mode)?;
            self.tc_current.insert(ifindex);
        }
        Ok(())
    }

    /// Make `t.flow` rebinding towards `t.physical_remote`'s address, whose
    /// port (0 in `t`) the flow learns from its peer's BIND: a UDP flow's
    /// through vnatd, a TCP flow's in the tc ingress program, once
    /// [`KernelDatapath::expect_tcp_bind`] gave it the token (issue 31).
    pub(super) fn rebind(&mut self, t: &Translation) -> Result<(), DatapathError> {
        let route = self.route(t.physical_remote.ip(), Some(t.physical_local.ip()))?;
        self.tc_on(route.ifindex)?;
        let vkey = t.flow.to_key();
        let phys = crate::datapath::flow_key(t.flow.proto, t.physical_local, t.physical_remote);
        let mut key = RebindKey {
            src_addr_be: phys.dst_addr_be,
            dst_addr_be: phys.src_addr_be,
            dst_port_be: phys.src_port_be,
            family: phys.family,
            proto: phys.proto,
            slot: 0,
            _pad: [0; 3],
        };
        let value = RebindValue {
            virt_remote_addr_be: vkey.dst_addr_be,
            virt_local_addr_be: vkey.src_addr_be,
            virt_remote_port_be: vkey.dst_port_be,
            virt_local_port_be: vkey.src_port_be,
            token: [0; 2],
            token_prev: [0; 2],
            redirect_ifindex: route.ifindex,
            // The new address may be reached another way than the old one:
            // resolve the next hop per packet.
            flags: NAT_F_REDIRECT,
            refusals: 0,
        };
        // The same flow's earlier entry, or a free slot.
        let mut free = None;
        let mut value = value;
        for slot in 0..vnat_common::REBIND_SLOTS {
            key.slot = slot;
            match self.loaded.maps.rebind.get(&key, 0) {
                Ok(v)
                    if v.virt_remote_addr_be == value.virt_remote_addr_be
                        && v.virt_remote_port_be == value.virt_remote_port_be
                        && v.virt_local_port_be == value.virt_local_port_be =>
                {
                    // Its tokens stay: a BIND request may be on its way.
                    value.token = v.token;
                    value.token_prev = v.token_prev;
                    free = Some(slot);
                    break;
                }
                Ok(_) => {}
                Err(_) => {
                    free.get_or_insert(slot);
                }
            }
        }
        key.slot = free.ok_or(DatapathError::InvalidTranslation {
            flow: t.flow,
            reason: "too many connections from that address are rebinding at once",
        })?;
        self.insert_rebind(key, value)?;
        self.rebinds.insert(key);
        self.rebinds_since
            .entry(key)
            .or_insert_with(std::time::Instant::now);
        tracing::debug!(id = t.flow.id(), flow = %t.flow, "rebinding: the tc program learns the peer's new NAT port");
        Ok(())
    }

    /// The token of the BIND request just sent for the rebinding TCP flow
    /// `flow` (our virtual view): its peer's TCP BIND must carry it, or the
    /// one before. `Ok(false)`: the flow is not rebinding (any more).
    pub(super) fn set_rebind_token(
        &mut self,
        flow: &crate::datapath::VirtualFlow,
        token: [u8; vnat_common::TCP_BIND_TOKEN_LEN],
    ) -> Result<bool, DatapathError> {
        let vkey = flow.to_key();
        let words = [
            u32::from_ne_bytes([token[0], token[1], token[2], token[3]]),
            u32::from_ne_bytes([token[4], token[5], token[6], token[7]]),
        ];
        let keys: Vec<RebindKey> = self
            .rebinds
            .iter()
            .filter(|k| k.proto == vnat_common::PROTO_TCP)
            .copied()
            .collect();
        for k in keys {
            let Ok(mut v) = self.loaded.maps.rebind.get(&k, 0) else {
                continue;
            };
            if v.virt_remote_addr_be != vkey.dst_addr_be
                || v.virt_remote_port_be != vkey.dst_port_be
                || v.virt_local_addr_be != vkey.src_addr_be
                || v.virt_local_port_be != vkey.src_port_be
            {
                continue;
            }
            if v.token != words {
                v.token_prev = v.token;
                v.token = words;
            }
            // BPF_EXIST: if the tc program took the flow's BIND meanwhile,
            // the entry is gone and stays gone.
            return match self.loaded.maps.rebind.insert(k, v, 2) {
                Ok(()) => Ok(true),
                Err(e) if is_not_found(&e) => Ok(false),
                Err(e) => Err(map_err(vnat_common::MAP_REBIND)(e)),
            };
        }
        Ok(false)
    }

    /// Divert in-band BINDs arriving from `toward` (through the interface
    /// that reaches it) to `vcmp_port` (`CFG_F_BIND_DIVERT`). Stays on for
    /// the process's life once needed: a BIND is recognised by its exact
    /// length, head and magic, so leaving it on costs a compare of a few
    /// bytes per incoming UDP datagram and takes no application's data.
    pub(super) fn divert_binds_toward(
        &mut self,
        toward: IpAddr,
        vcmp_port: u16,
    ) -> Result<(), DatapathError> {
        let route = self.route(toward, None)?;
        self.tc_on(route.ifindex)?;
        self.bind_ifaces.insert(route.ifindex);
        self.set_bind_divert_port(vcmp_port)
    }

    /// TCP rebinds the tc program stopped learning (`REBIND_MAX_REFUSALS`
    /// TCP BINDs from the NAT's address to the port carried a wrong
    /// token): no longer waited for, and said once.
    pub(super) fn drop_stopped_rebinds(&mut self) {
        let stopped: Vec<RebindKey> = self
            .rebinds
            .iter()
            .filter(|k| k.proto == vnat_common::PROTO_TCP)
            .filter(|k| {
                self.loaded
                    .maps
                    .rebind
                    .get(k, 0)
                    .is_ok_and(|v| v.refusals >= vnat_common::REBIND_MAX_REFUSALS)
            })
            .copied()
            .collect();
        for k in stopped {
            let _ = self.loaded.maps.rebind.remove(&k);
            self.rebinds.remove(&k);
            self.rebinds_since.remove(&k);
            // The key has no peer port: it names no single connection.
            tracing::warn!(
                refused = vnat_common::REBIND_MAX_REFUSALS,
                "a TCP connection's peer moved behind a NAT, and BINDs from that NAT to the connection's port carried wrong tokens: no longer learning its new port (someone may be guessing)"
            );
        }
    }

    /// Whether a rebinding entry is still waiting for its first packet.
    pub fn rebind_pending(&self, key: &RebindKey) -> Result<bool, DatapathError> {
        match self.loaded.maps.rebind.get(key, 0) {
            Ok(_) => Ok(true),
            Err(e) if is_not_found(&e) => Ok(false),
            Err(e) => Err(map_err(vnat_common::MAP_REBIND)(e)),
        }
    }

    /// Take into this process's copy of the NAT maps the entries the tc
    /// program wrote itself (learned rebinds). Returns how many were new.
    pub fn sync_learned(&mut self) -> Result<usize, DatapathError> {
        let mut new = 0;
        for egress in [true, false] {
            let entries: Vec<(FlowKey, NatRewrite)> = if egress {
                self.loaded.maps.egress.iter().collect::<Result<_, _>>()
            } else {
                self.loaded.maps.ingress.iter().collect::<Result<_, _>>()
            }
            .map_err(map_err(if egress {
                MAP_EGRESS_NAT
            } else {
                MAP_INGRESS_NAT
            }))?;
            for (k, v) in entries {
                let known = if egress {
                    self.mirror.egress.get(&k)
                } else {
                    self.mirror.ingress.get(&k)
                };
                if known != Some(&v) {
                    self.mirror.insert(egress, k, v);
                    new += 1;
                }
            }
        }
        Ok(new)
    }
}
