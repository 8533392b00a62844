//! NAT guards (`vnat_common::natguard`): one entry per NAT address and port
//! of ours where a peer behind that NAT has a connection, kept while one of
//! those connections lives; and the drops they count, which tell vnatd that
//! the NAT may have re-mapped one of them.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, SocketAddr};

use vnat_common::{GuardValue, RebindKey, MAP_GUARD};

use super::{is_not_found, map_err, KernelDatapath};
use crate::datapath::{DatapathError, GuardDrop, Proto, VirtualFlow};

/// Which guards this process wrote, for which connections.
#[derive(Default)]
pub(super) struct Guards {
    by_key: HashMap<RebindKey, (IpAddr, BTreeSet<VirtualFlow>)>,
    of_flow: HashMap<VirtualFlow, RebindKey>,
    /// Each guard's drop count when last looked at.
    seen: HashMap<RebindKey, u32>,
}

impl Guards {
    pub(super) fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
}

/// The guard's key for `flow` (our end as the connection names it) and a
/// peer behind `nat`.
fn key_of(flow: &VirtualFlow, nat: IpAddr) -> RebindKey {
    let k = crate::datapath::flow_key(flow.proto, flow.local, SocketAddr::new(nat, 0));
    RebindKey {
        src_addr_be: k.dst_addr_be,
        dst_addr_be: k.src_addr_be,
        dst_port_be: k.src_port_be,
        family: k.family,
        proto: k.proto,
        slot: 0,
        _pad: [0; 3],
    }
}

impl KernelDatapath {
    /// `Datapath::guard_nat`.
    pub(super) fn guard_flow(
        &mut self,
        flow: &VirtualFlow,
        nat: IpAddr,
    ) -> Result<(), DatapathError> {
        if nat.is_ipv4() != flow.local.is_ipv4() {
            return Err(DatapathError::InvalidTranslation {
                flow: *flow,
                reason: "the peer's NAT address is of another family than the connection",
            });
        }
        let key = key_of(flow, nat);
        if self.guards.of_flow.get(flow) == Some(&key) {
            return Ok(());
        }
        self.unguard_flow(flow)?;
        if !self.peer_opened(flow)? {
            // We opened it, to the peer's service port: a NAT in front of
            // the peer forwards that port (a static mapping), it does not
            // re-map it; datagrams from other ports of that address are
            // no business of this connection.
            tracing::debug!(id = flow.id(), %flow, "not guarded: this host opened the connection");
            return Ok(());
        }
        let route = self.route(nat, None)?;
        self.tc_on(route.ifindex)?;
        // Kept attached for the process's life, like a BIND divert: the
        // next connection from behind that NAT needs it again.
        self.bind_ifaces.insert(route.ifindex);
        self.insert_guard(flow, nat)
    }

    /// Whether the peer opened `flow` (an accepted TCP connection, a UDP
    /// flow first seen by receiving): then its end is a NAT's dynamic
    /// mapping, which the NAT may change. Adopted and unrecorded ones are
    /// not known to be.
    fn peer_opened(&self, flow: &VirtualFlow) -> Result<bool, DatapathError> {
        let mut keys = vec![flow.to_key()];
        if flow.proto == Proto::Udp {
            keys.push(vnat_common::FlowKey {
                src_addr_be: [0; 4],
                ..flow.to_key()
            });
        }
        for k in keys {
            match self.loaded.maps.conns.get(&k, 0) {
                Ok(r) => {
                    return Ok(matches!(
                        r.origin,
                        vnat_common::ORIGIN_TCP_PASSIVE | vnat_common::ORIGIN_UDP_RECVMSG
                    ))
                }
                Err(e) if is_not_found(&e) => {}
                Err(e) => return Err(map_err(vnat_common::MAP_CONNS)(e)),
            }
        }
        Ok(false)
    }

    /// Write `flow`'s guard against `nat` into the map, without routes or
    /// tc attachment (`guard_flow` adds those; the tests of the tc
    /// programs call this directly).
    pub fn insert_guard(&mut self, flow: &VirtualFlow, nat: IpAddr) -> Result<(), DatapathError> {
        let key = key_of(flow, nat);
        // The translators parse packets only while the NAT maps are not
        // empty, and look further on a miss only while this flag is set.
        self.set_nat_empty(false)?;
        self.set_rebinding(true)?;
        if !self.guards.by_key.contains_key(&key) {
            // A guard a vnatd before this one left (pinned) keeps its
            // counts.
            let drops = match self.loaded.maps.guard.get(&key, 0) {
                Ok(v) => v.drops,
                Err(e) if is_not_found(&e) => {
                    self.loaded
                        .maps
                        .guard
                        .insert(key, GuardValue::default(), 0)
                        .map_err(map_err(MAP_GUARD))?;
                    0
                }
                Err(e) => return Err(map_err(MAP_GUARD)(e)),
            };
            self.guards.seen.insert(key, drops);
        }
        self.guards
            .by_key
            .entry(key)
            .or_insert_with(|| (nat, BTreeSet::new()))
            .1
            .insert(*flow);
        self.guards.of_flow.insert(*flow, key);
        tracing::debug!(id = flow.id(), %flow, %nat, "guarding the connection against its peer's NAT re-mapping it");
        Ok(())
    }

    /// The connection `flow` needs its guard no more (it closed); the entry
    /// goes with its last connection.
    pub(super) fn unguard_flow(&mut self, flow: &VirtualFlow) -> Result<(), DatapathError> {
        let Some(key) = self.guards.of_flow.remove(flow) else {
            return Ok(());
        };
        let Some((_, flows)) = self.guards.by_key.get_mut(&key) else {
            return Ok(());
        };
        flows.remove(flow);
        if !flows.is_empty() {
            return Ok(());
        }
        self.guards.by_key.remove(&key);
        self.guards.seen.remove(&key);
        match self.loaded.maps.guard.remove(&key) {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(map_err(MAP_GUARD)(e)),
        }
    }

    /// `Datapath::nat_guard_drops`.
    pub(super) fn guard_drops(&mut self) -> Result<Vec<GuardDrop>, DatapathError> {
        let mut out = Vec::new();
        let keys: Vec<RebindKey> = self.guards.by_key.keys().copied().collect();
        for key in keys {
            let drops = match self.loaded.maps.guard.get(&key, 0) {
                Ok(v) => v.drops,
                Err(e) if is_not_found(&e) => continue,
                Err(e) => return Err(map_err(MAP_GUARD)(e)),
            };
            if self.guards.seen.insert(key, drops) == Some(drops) {
                continue;
            }
            let Some((nat, Some(flow))) = self
                .guards
                .by_key
                .get(&key)
                .map(|(nat, f)| (*nat, f.iter().next()))
            else {
                continue;
            };
            out.push(GuardDrop {
                nat,
                local: flow.local,
                proto: flow.proto,
            });
        }
        Ok(out)
    }

    /// Guards a previous vnatd left (pinned): removed at open. This one
    /// guards again each connection the core names (`Event::GuardNat`, once
    /// the peer has paired and claimed it again); a guard of a connection
    /// that closed meanwhile would otherwise hold a stranger's new UDP flow
    /// from that NAT to that port for nothing, for good.
    pub(super) fn forget_left_guards(&mut self) {
        let left: Vec<RebindKey> = self
            .loaded
            .maps
            .guard
            .keys()
            .filter_map(Result::ok)
            .collect();
        for k in left {
            let _ = self.loaded.maps.guard.remove(&k);
        }
    }

    /// Guards of connections whose record went (closed; an idle UDP flow
    /// expired): given up. At each housekeeping pass.
    pub(super) fn drop_closed_guards(&mut self) -> Result<(), DatapathError> {
        let flows: Vec<VirtualFlow> = self.guards.of_flow.keys().copied().collect();
        for flow in flows {
            let mut keys = vec![flow.to_key()];
            if flow.proto == Proto::Udp {
                keys.push(vnat_common::FlowKey {
                    src_addr_be: [0; 4],
                    ..flow.to_key()
                });
            }
            let mut alive = false;
            for k in keys {
                match self.loaded.maps.conns.get(&k, 0) {
                    Ok(_) => alive = true,
                    Err(e) if is_not_found(&e) => {}
                    Err(e) => return Err(map_err(vnat_common::MAP_CONNS)(e)),
                }
            }
            if !alive {
                self.unguard_flow(&flow)?;
            }
        }
        Ok(())
    }
}
