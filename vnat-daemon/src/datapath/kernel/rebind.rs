//! The kernel datapath's side of a peer behind NAT: rebinding flows (the tc
//! program learns a TCP connection's new NAT port), the divert of in-band
//! BINDs, and direct map writes for the tests of the tc programs.

use std::net::IpAddr;

use vnat_common::{
    FlowKey, NatRewrite, RebindKey, RebindValue, MAP_CONNS, MAP_EGRESS_NAT, MAP_INGRESS_NAT,
    NAT_F_REDIRECT,
};

use super::{attach, is_not_found, map_err, object, restart, KernelDatapath, NatPair};
use crate::datapath::{DatapathError, Proto, Translation};

impl KernelDatapath {
    /// Write NAT entries directly, without routes, addresses or tc
    /// attachment (for tests of the tc programs with BPF_PROG_TEST_RUN).
    pub fn insert_nat_pair(&mut self, p: &NatPair) -> Result<(), DatapathError> {
        self.write_pair(p, None)
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

    /// Make a flow rebinding: the tc ingress program installs its
    /// translations from the first packet that matches `key` and falls in
    /// `value`'s window (see `vnat_common::RebindValue`). The datapath half
    /// of a peer moving behind a NAT (DESIGN.md section 3); the protocol
    /// does not drive it yet.
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

    /// Make `t.flow` rebinding towards `t.physical_remote`'s address, whose
    /// port (0 in `t`) the tc ingress program learns from the flow's first
    /// packet from there. TCP: the windows are the socket's own now (issue
    /// 31: no wider than what the peer may send or acknowledge), see
    /// [`tcp_windows`].
    pub(super) fn rebind(&mut self, t: &Translation) -> Result<(), DatapathError> {
        let route = self.route(t.physical_remote.ip(), Some(t.physical_local.ip()))?;
        if !self.tc_current.contains(&route.ifindex) {
            attach::attach_tc(
                &mut self.loaded.ebpf,
                &self.bpffs,
                route.ifindex,
                self.tc_mode,
            )?;
            self.tc_current.insert(route.ifindex);
        }
        let vkey = t.flow.to_key();
        let windows = if t.flow.proto == Proto::Tcp {
            let record = self.loaded.maps.conns.get(&vkey, 0).map_err(|_| {
                DatapathError::InvalidTranslation {
                    flow: t.flow,
                    reason: "no recorded connection to learn the peer's port for",
                }
            })?;
            let w = restart::sequence_windows(&t.flow, &record)?.ok_or(
                DatapathError::InvalidTranslation {
                    flow: t.flow,
                    reason: "the connection's socket is gone",
                },
            )?;
            tcp_windows(&w)
        } else {
            RebindWindows {
                seq_lo: 0,
                seq_span: u32::MAX,
                ack_lo: 0,
                ack_span: u32::MAX,
            }
        };
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
            seq_lo: windows.seq_lo,
            seq_span: windows.seq_span,
            ack_lo: windows.ack_lo,
            ack_span: windows.ack_span,
            redirect_ifindex: route.ifindex,
            // The new address may be reached another way than the old one:
            // resolve the next hop per packet.
            flags: NAT_F_REDIRECT,
            refusals: 0,
        };
        // The same flow's earlier entry, or a free slot.
        let mut free = None;
        for slot in 0..vnat_common::REBIND_SLOTS {
            key.slot = slot;
            match self.loaded.maps.rebind.get(&key, 0) {
                Ok(v)
                    if v.virt_remote_addr_be == value.virt_remote_addr_be
                        && v.virt_remote_port_be == value.virt_remote_port_be
                        && v.virt_local_port_be == value.virt_local_port_be =>
                {
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
        if key.proto == vnat_common::PROTO_UDP {
            self.udp_rebinds_since
                .insert(key, std::time::Instant::now());
        }
        tracing::debug!(id = t.flow.id(), flow = %t.flow, "rebinding: the tc program learns the peer's new NAT port");
        Ok(())
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
        if !self.tc_current.contains(&route.ifindex) {
            attach::attach_tc(
                &mut self.loaded.ebpf,
                &self.bpffs,
                route.ifindex,
                self.tc_mode,
            )?;
            self.tc_current.insert(route.ifindex);
        }
        self.bind_ifaces.insert(route.ifindex);
        self.set_bind_divert_port(vcmp_port)
    }

    /// TCP rebinds the tc program stopped learning (`REBIND_MAX_REFUSALS`
    /// segments from the NAT's address to the port fell outside the
    /// windows): no longer waited for, and said once.
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
            // The key has no peer port: it names no single connection.
            tracing::warn!(
                refused = vnat_common::REBIND_MAX_REFUSALS,
                "a TCP connection's peer moved behind a NAT, and segments from that NAT to the connection's port fell outside its windows: no longer learning its new port (someone may be guessing)"
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

/// The numbers a rebinding TCP flow's first segment through the peer's new
/// NAT must carry (`RebindValue`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RebindWindows {
    pub(super) seq_lo: u32,
    pub(super) seq_span: u32,
    pub(super) ack_lo: u32,
    pub(super) ack_span: u32,
}

/// The windows of a rebinding TCP flow, from its socket's state (RFC 9293
/// section 3.10.7.4, what a receiver accepts):
///
/// * sequence: what the peer may send is inside the window we offered,
///   from `rcv_nxt` on; it may also send again what we received and it has
///   not seen acknowledged (our ACKs lost on the old path), at most one
///   window back. So `[rcv_nxt - rcv_wnd, rcv_nxt + rcv_wnd)`.
/// * acknowledgment: what the peer acknowledges is what we sent, from
///   `snd_una` to `snd_nxt`, and what we may send meanwhile within its
///   window. So `[snd_una, snd_una + in_flight + snd_wnd]`.
///
/// Each span is at most 2^24 + 2^16 (what vnatd allowed before it read the
/// windows), so a guess hits both at less than 2^-16, and usually far
/// less: with 64 KiB windows both ways, 2^-31.
pub(super) fn tcp_windows(w: &restart::SequenceWindows) -> RebindWindows {
    const MOST: u32 = (1 << 24) + (1 << 16);
    let rcv = w.rcv_wnd.clamp(1 << 12, MOST / 2);
    RebindWindows {
        seq_lo: w.rcv_nxt.wrapping_sub(rcv),
        seq_span: 2 * rcv,
        ack_lo: w.snd_una,
        ack_span: w
            .in_flight
            .saturating_add(w.snd_wnd.max(1 << 12))
            .saturating_add(1)
            .min(MOST),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inside(lo: u32, span: u32, x: u32) -> bool {
        x.wrapping_sub(lo) < span
    }

    /// The peer's segments after its move are in the windows: a
    /// retransmission of what we received and it did not see acknowledged,
    /// new data up to our window, a keepalive probe (one byte before
    /// rcv_nxt); and it acknowledges from snd_una to what we may send.
    /// Numbers a window or more away, as a guesser's mostly are, are not.
    #[test]
    fn windows_hold_the_peers_segments_and_little_else() {
        let w = restart::SequenceWindows {
            snd_una: 0xffff_f000, // wraps past 2^32 within the window
            rcv_nxt: 1000,
            in_flight: 3000,
            snd_wnd: 65_535,
            rcv_wnd: 65_535,
        };
        let r = tcp_windows(&w);
        for seq in [1000u32, 999, 1000u32.wrapping_sub(60_000), 1000 + 65_000] {
            assert!(inside(r.seq_lo, r.seq_span, seq), "seq {seq}");
        }
        for seq in [1000u32.wrapping_sub(70_000), 1000 + 70_000, 1 << 31] {
            assert!(!inside(r.seq_lo, r.seq_span, seq), "seq {seq}");
        }
        for ack in [0xffff_f000u32, 0xffff_f000u32.wrapping_add(3000 + 65_535)] {
            assert!(inside(r.ack_lo, r.ack_span, ack), "ack {ack}");
        }
        for ack in [0xffff_efffu32, 0xffff_f000u32.wrapping_add(70_000), 1 << 30] {
            assert!(!inside(r.ack_lo, r.ack_span, ack), "ack {ack}");
        }
        // Both spans together: a random guess lands at about 2^-31.
        let p = f64::from(r.seq_span) * f64::from(r.ack_span) / 2f64.powi(64);
        assert!(p < 2f64.powi(-30), "{p}");
    }

    /// Huge windows (scaled, or the field's most before Linux 6.2) are cut
    /// to what vnatd allowed before it read them.
    #[test]
    fn windows_are_capped() {
        let w = restart::SequenceWindows {
            snd_una: 5,
            rcv_nxt: 5,
            in_flight: u32::MAX,
            snd_wnd: u32::MAX,
            rcv_wnd: u32::MAX,
        };
        let r = tcp_windows(&w);
        assert!(r.seq_span <= (1 << 24) + (1 << 16));
        assert!(r.ack_span <= (1 << 24) + (1 << 16));
    }
}
