//! Installing and removing translations: the NAT pair, the address kept on
//! `lo`, the peer's host route and the tc attachment, all or nothing.

use super::*;

impl KernelDatapath {
    /// Write a pair, ingress first (so the reply path exists before the
    /// first rewritten packet leaves). On failure the previous entries are
    /// put back.
    pub(super) fn write_pair(
        &mut self,
        p: &NatPair,
        old: Option<&NatPair>,
    ) -> Result<(), DatapathError> {
        self.nat_insert(false, p.ingress_key, p.ingress)?;
        fault::after("install:receive-side");
        if let Err(e) = self.nat_insert(true, p.egress_key, p.egress) {
            match old {
                Some(o) if o.ingress_key == p.ingress_key => {
                    let _ = self.nat_insert(false, o.ingress_key, o.ingress);
                }
                _ => {
                    let _ = self.nat_remove(false, &p.ingress_key);
                }
            }
            return Err(e);
        }
        fault::after("install:send-side");
        if let Some(o) = old {
            if o.ingress_key != p.ingress_key {
                let _ = self.nat_remove(false, &o.ingress_key);
            }
        }
        Ok(())
    }

    /// Remove what a translation needed and nothing else still needs.
    fn release(&mut self, t: &Translation, v: &NatRewrite) -> Result<(), DatapathError> {
        // What the rest of the entries still need (this translation's own
        // are gone or replaced already).
        if t.local_moved() && v.flags & NAT_F_LO_ADDR_OURS != 0 {
            let ip = t.flow.local.ip();
            let local_words =
                crate::datapath::flow_key(t.flow.proto, t.flow.local, t.flow.remote).src_addr_be;
            let prepared_use = self.mirror.prepared_lo.contains_key(&local_words);
            if !prepared_use
                && !self.mirror.local_moved.contains_key(&ip)
                && !self.kept.contains(&ip)
            {
                self.routes_changed();
                net::del_lo_addr(ip, true)?;
                self.lo_ours.remove(&ip);
                fault::after("remove:lo-address");
                self.sync_gone_or_warn();
            }
        }
        self.detach_if_unused(v.redirect_ifindex)
    }

    /// Detach tc from `ifindex` unless something still needs it there.
    pub(super) fn detach_if_unused(&mut self, ifindex: u32) -> Result<(), DatapathError> {
        if ifindex != 0
            && !self.standby.contains(&ifindex)
            && !self.bind_ifaces.contains(&ifindex)
            && !self.tc_used_by_translation(ifindex)?
        {
            attach::detach_tc(&self.bpffs, ifindex);
            self.tc_current.remove(&ifindex);
            fault::after("remove:tc");
        }
        Ok(())
    }

    /// Whether a translation's entries still send through `ifindex`.
    pub(super) fn tc_used_by_translation(&self, ifindex: u32) -> Result<bool, DatapathError> {
        Ok(self.mirror.interfaces.contains_key(&ifindex))
    }

    /// Remove the rule that routed `flow` through `ifindex`, and the route
    /// it used unless another such flow to the same address still does.
    fn drop_via_route(&mut self, flow: &VirtualFlow, ifindex: u32) -> Result<(), DatapathError> {
        let shared = self
            .egress_via
            .values()
            .any(|(f, i)| *i == ifindex && f.remote.ip() == flow.remote.ip());
        self.routes_changed();
        net::del_via_route(flow, ifindex, shared)?;
        fault::after("remove:host-route");
        Ok(())
    }

    /// Install a translation; with `complete == false` only its receive side
    /// (see [`Datapath::prepare_translation`]).
    pub(super) fn apply(&mut self, t: &Translation, complete: bool) -> Result<(), DatapathError> {
        validate_translation(t)?;
        // A connection whose own end moved leaves by its new address's
        // interface; one whose peer alone moved keeps the kernel's route
        // (its address may sit on another interface than the one towards
        // the peer: a VIP, an anycast address on a dummy).
        let route = if t.local_moved() {
            self.route_from(t.physical_remote.ip(), t.physical_local.ip())?
        } else {
            self.route(t.physical_remote.ip(), Some(t.physical_local.ip()))?
        };
        let egress_key = t.flow.to_key();
        // An entry that only holds the flow is no placement to go back to
        // or release; the new pair replaces it (and so ends the hold).
        let old_val = self
            .egress_get(&egress_key)?
            .filter(|v| !is_hold_only(&egress_key, v));
        let old = old_val
            .and_then(|v| translation_of(&egress_key, &v))
            .map(|o| (pair_for(&o, v_ifindex(&old_val), v_flags(&old_val)), o));
        let probe = pair_for(t, route.ifindex, 0);
        // The physical endpoints must not be another recorded connection's
        // own (an untranslated one): its packets would match the receive
        // side and be handed to this flow's socket. A peer with valid keys
        // for its own flow could otherwise name a neighbour's endpoints as
        // its new address and capture that neighbour's traffic while the
        // address is being validated.
        let physical = crate::datapath::flow_key(t.flow.proto, t.physical_local, t.physical_remote);
        if physical != egress_key && self.recorded_elsewhere(&physical, &egress_key)? {
            return Err(DatapathError::Conflict {
                flow: t.flow,
                other: Box::new(VirtualFlow {
                    proto: t.flow.proto,
                    local: t.physical_local,
                    remote: t.physical_remote,
                }),
            });
        }
        if let Some(other) = self.ingress_get(&probe.ingress_key)? {
            // The entry restores (remote virtual -> local virtual); reversed,
            // that is the egress key of the translation that owns it.
            let owner = restored_key(&probe.ingress_key, &other).reversed();
            if owner != egress_key {
                return Err(match VirtualFlow::from_key(&owner) {
                    Some(o) => DatapathError::Conflict {
                        flow: t.flow,
                        other: Box::new(o),
                    },
                    None => DatapathError::InvalidTranslation {
                        flow: t.flow,
                        reason: "another translation already uses these physical endpoints",
                    },
                });
            }
        }

        // A routed container's address stays the container's: never on lo.
        // (Or known so from its entry, whatever the last listing said.)
        let routed = self.guests.borrow().is_routed(&egress_key)
            || old_val.is_some_and(|v| v.flags & NAT_F_ROUTED != 0);
        let mut flags = if routed { NAT_F_ROUTED } else { 0 };
        let mut added_lo: Option<IpAddr> = None;
        // Take back what this call added, on a later failure.
        let undo = |dp: &Self, added_lo: Option<IpAddr>| {
            if let Some(ip) = added_lo {
                dp.routes_changed();
                let _ = net::del_lo_addr(ip, true);
            }
        };
        if t.local_moved() && !routed {
            let ip = t.flow.local.ip();
            // Known from an earlier move of this address (the common case
            // when many connections move together), else from the maps.
            let ours_already = self.lo_ours.contains(&ip)
                || self.mirror.egress.iter().any(|(k, v)| {
                    v.flags & NAT_F_LO_ADDR_OURS != 0
                        && translation_of(k, v).is_some_and(|o| o.flow.local.ip() == ip)
                })
                || self.mirror.ingress.iter().any(|(k, v)| {
                    v.flags & NAT_F_LO_ADDR_OURS != 0
                        && restored_key(k, v).dst_addr_be
                            == crate::datapath::flow_key(t.flow.proto, t.flow.local, t.flow.remote)
                                .src_addr_be
                });
            if ours_already {
                flags |= NAT_F_LO_ADDR_OURS;
            } else {
                match net::lo_addrs()?.into_iter().find(|(a, _)| *a == ip) {
                    // Left by a vnatd that died before its entries were
                    // written: ours, in use again.
                    Some((_, true)) => flags |= NAT_F_LO_ADDR_OURS,
                    // Someone else's: used, never removed.
                    Some((_, false)) => {}
                    None => {
                        self.resolve_next_hop(t.flow.remote.ip());
                        self.routes_changed();
                        self.add_lo_addr(ip)?;
                        added_lo = Some(ip);
                        flags |= NAT_F_LO_ADDR_OURS;
                        fault::after("install:lo-address");
                        self.sync_gone_or_warn();
                    }
                }
            }
        }
        // The socket's own packets are routed by its virtual endpoints.
        // Where the main table would not take them to the new next hop (the
        // peer moved elsewhere than behind the router its old address is
        // routed by; our old address is still up: `vnatctl migrate`), a rule
        // of their own routes them by the new one's route, to be rewritten
        // by tc there (`flow_route`). Only once the new address is
        // validated (`complete`, without a budget): before, nothing may
        // steer any traffic to an address the peer merely named.
        if !self.tc_current.contains(&route.ifindex) {
            if let Err(e) = attach::attach_tc(
                &mut self.loaded.ebpf,
                &self.bpffs,
                route.ifindex,
                self.tc_mode,
            ) {
                undo(self, added_lo);
                return Err(e);
            }
            self.tc_current.insert(route.ifindex);
            fault::after("install:tc");
        }
        // Sending to a peer address not validated yet: only within what
        // came from there (`NAT_F_BUDGET`), from the first packet on.
        let budget = if complete {
            self.budget_next.remove(&egress_key)
        } else {
            None
        };
        if budget.is_some() {
            flags |= NAT_F_BUDGET;
        }
        let pair = pair_for(t, route.ifindex, flags);
        if !complete {
            // Receive side only; an earlier placement keeps working until
            // install_translation switches the send side over.
            if let Err(e) = self.nat_insert(false, pair.ingress_key, pair.ingress) {
                undo(self, added_lo);
                return Err(e);
            }
            fault::after("install:receive-side");
            if flags & NAT_F_LO_ADDR_OURS != 0 {
                self.lo_ours.insert(t.flow.local.ip());
            }
            // A peer's newly announced address replaces any other it
            // announced before that was not validated: one such address per
            // flow, however many updates name others.
            let installed = old.as_ref().map(|(_, o)| o.physical_remote);
            if t.remote_moved() && installed != Some(t.physical_remote) {
                self.drop_abandoned_receive_sides(t, installed);
            }
            return Ok(());
        }
        // The allowance before the entry that needs it: an entry with the
        // bit and no allowance sends nothing.
        if let Some(allowed) = budget {
            let b = UnvalidatedBudget {
                allowed: u64::from(allowed),
                fallback: self.fallback_for(t, &egress_key, old_val.as_ref()),
                ..UnvalidatedBudget::default()
            };
            if let Err(e) = self.loaded.maps.unvalidated.insert(egress_key, b, 0) {
                undo(self, added_lo);
                return Err(map_err(MAP_UNVALIDATED)(e));
            }
        }
        if let Err(e) = self.write_pair(&pair, old.as_ref().map(|(p, _)| p)) {
            undo(self, added_lo);
            return Err(e);
        }
        // Validated (or never limited): no allowance left behind.
        if budget.is_none() && old_val.is_some_and(|v| v.flags & NAT_F_BUDGET != 0) {
            self.drop_budget(&egress_key);
        }
        // The flow's own route, after its pair: a vnatd killed in between
        // leaves a translation whose route the next one adds (`reconcile`),
        // where one killed after the route and before the pair would leave
        // a route nothing needs and a move the peer thinks done. Without
        // its route the flow's packets follow the host's route for its old
        // peer address: rewritten if that leaves where tc is, lost at worst.
        let mut via = None;
        // Not while the address is only budgeted: it steers nothing before
        // it is validated (the install that lifts the budget adds it).
        if let Some(r) = self.flow_route(t, &route).filter(|_| budget.is_none()) {
            tracing::debug!(id = t.flow.id(), flow = %t.flow, new = ?r, "the socket's packets get a route of their own");
            match net::add_via_route(&t.flow, &r) {
                Ok(()) => {
                    self.routes_changed();
                    fault::after("install:host-route");
                    via = Some(r.ifindex);
                }
                Err(e) => {
                    tracing::warn!(id = t.flow.id(), flow = %t.flow, error = %e, "cannot route the connection's packets to its new next hop; they follow the host's route for its old peer address")
                }
            }
        }
        // Receive sides prepared for addresses the peer announced and never
        // proved go once the flow is placed.
        self.drop_abandoned_receive_sides(t, old.as_ref().map(|(_, o)| o.physical_remote));
        if flags & NAT_F_LO_ADDR_OURS != 0 {
            self.lo_ours.insert(t.flow.local.ip());
        }
        if t.local_moved() && !routed {
            self.moved_from_kept(t.flow.local.ip());
        }
        let old_via = match via {
            Some(i) => self.egress_via.insert(egress_key, (t.flow, i)),
            None => self.egress_via.remove(&egress_key),
        };
        if let Some((flow, o)) = old_via.filter(|(_, o)| Some(*o) != via) {
            self.drop_via_route(&flow, o)?;
        }
        if let Some((old_pair, old_t)) = old {
            // Moving again: release what only the previous placement needed.
            if old_pair.egress.redirect_ifindex != route.ifindex
                || old_t.remote_moved() != t.remote_moved()
            {
                let _ = self.release(
                    &old_t,
                    &NatRewrite {
                        flags: 0,
                        ..old_pair.egress
                    },
                );
            }
        }
        Ok(())
    }

    /// Remove the flow's receive sides for peer addresses other than `t`'s
    /// own, the flow's virtual remote and `installed` (the placement `t`
    /// replaces, whose entries the caller handles): those prepared for an
    /// address the peer announced and then replaced or never proved.
    fn drop_abandoned_receive_sides(&mut self, t: &Translation, installed: Option<SocketAddr>) {
        let keep = [Some(t.physical_remote), Some(t.flow.remote), installed];
        let stale: Vec<FlowKey> = self
            .mirror
            .reverse
            .get(&t.flow.to_key())
            .into_iter()
            .flatten()
            .filter(|k| key_endpoints(k).is_some_and(|(remote, _)| !keep.contains(&Some(remote))))
            .copied()
            .collect();
        for k in stale {
            tracing::debug!(id = t.flow.id(), flow = %t.flow, remote = ?key_endpoints(&k).map(|e| e.0), "receive side for an address the peer did not prove removed");
            let _ = self.nat_remove(false, &k);
        }
    }

    pub(super) fn remove(&mut self, flow: &VirtualFlow) -> Result<(), DatapathError> {
        let key = flow.to_key();
        // A rebind that never saw its first packet goes with the flow.
        let had_rebind = self.drop_rebinds(&key);
        // Every reverse entry of the flow: during a move there may be two
        // (old and new placement), and a prepared-only move has no egress.
        let reverse: Vec<(FlowKey, NatRewrite)> = self
            .mirror
            .reverse
            .get(&key)
            .into_iter()
            .flatten()
            .filter_map(|k| Some((*k, *self.mirror.ingress.get(k)?)))
            .collect();
        let egress = self.egress_get(&key)?;
        let (t, v) = match (egress, reverse.first()) {
            (Some(v), _) => (translation_of(&key, &v), v),
            (None, Some((k, v))) => {
                // Rebuild the translation from the reverse entry: the packet
                // it matches is (physical remote -> physical local).
                let t = key_endpoints(k).map(|(pr, pl)| Translation {
                    flow: *flow,
                    physical_local: pl,
                    physical_remote: pr,
                });
                (t, *v)
            }
            (None, None) if had_rebind => return Ok(()),
            (None, None) => return Err(DatapathError::NoSuchTranslation { flow: *flow }),
        };
        let t = t.ok_or(DatapathError::NoSuchTranslation { flow: *flow })?;
        if egress.is_some() {
            self.nat_remove(true, &key)?;
            fault::after("remove:send-side");
        }
        self.budget_next.remove(&key);
        if v.flags & NAT_F_BUDGET != 0 {
            self.drop_budget(&key);
        }
        for (k, _) in &reverse {
            let _ = self.nat_remove(false, k);
        }
        if !reverse.is_empty() {
            fault::after("remove:receive-side");
        }
        if let Some((f, i)) = self.egress_via.remove(&key) {
            self.drop_via_route(&f, i)?;
        }
        if t.local_moved() {
            // Home again (or closed): its socket must not keep a route to
            // the sink it may have cached on the way.
            self.moved_from_kept(t.flow.local.ip());
        }
        self.release(&t, &v)
    }
}

impl KernelDatapath {
    /// Translations a previous vnatd left sending to an address under a
    /// budget (`NAT_F_BUDGET`): the validation it had under way went with
    /// it, and nothing would ever lift the limit, which throttles the
    /// connection for life. Its peer's update came from that address and
    /// authenticated, and the new vnatd takes a restored placement for
    /// validated (as it takes any other): so the limit goes here.
    pub(super) fn lift_left_budgets(&mut self) {
        let left: Vec<(FlowKey, NatRewrite)> = self
            .mirror
            .egress
            .iter()
            .filter(|(_, v)| v.flags & NAT_F_BUDGET != 0)
            .map(|(k, v)| (*k, *v))
            .collect();
        for (k, v) in &left {
            let unlimited = |v: &NatRewrite| NatRewrite {
                flags: v.flags & !NAT_F_BUDGET,
                ..*v
            };
            let ingress_key = FlowKey {
                src_addr_be: v.dst_addr_be,
                dst_addr_be: v.src_addr_be,
                src_port_be: v.dst_port_be,
                dst_port_be: v.src_port_be,
                family: super::nat::value_family(k, v),
                proto: k.proto,
                _pad: [0; 2],
            };
            if let Some(iv) = self.mirror.ingress.get(&ingress_key).copied() {
                let _ = self.nat_insert(false, ingress_key, unlimited(&iv));
            }
            if let Err(e) = self.nat_insert(true, *k, unlimited(v)) {
                tracing::warn!(error = %e, "cannot lift the budget a previous vnatd left on a translation");
                continue;
            }
            self.drop_budget(k);
        }
        if !left.is_empty() {
            tracing::info!(
                connections = left.len(),
                "validations of peers' new addresses were under way when the last vnatd stopped: those addresses are taken as validated"
            );
        }
    }

    /// Where a flow about to send to an unvalidated peer address sends what
    /// is over its allowance (`UnvalidatedBudget::fallback`): the placement
    /// it has now, `old` (its egress entry; `None`: untranslated), when that
    /// one was validated and sends from where `t` will; else the fallback
    /// that placement had itself (the peer named another address before
    /// the last was validated, with the wait that began then). None
    /// (zeroed: the packet is dropped) when our own end moves: its old
    /// placement sends from an address we left. A TCP flow's new fallback
    /// is used [`FALLBACK_WAIT`] from now (`held_until`), a UDP flow's at
    /// once.
    fn fallback_for(
        &self,
        t: &Translation,
        egress_key: &FlowKey,
        old: Option<&NatRewrite>,
    ) -> NatRewrite {
        let none = NatRewrite::default();
        let placement = match old {
            None if t.local_moved() => return none,
            // Untranslated: the flow's own endpoints.
            None => NatRewrite {
                src_addr_be: egress_key.src_addr_be,
                dst_addr_be: egress_key.dst_addr_be,
                src_port_be: egress_key.src_port_be,
                dst_port_be: egress_key.dst_port_be,
                ..none
            },
            Some(v) if v.flags & NAT_F_BUDGET != 0 => {
                return self
                    .loaded
                    .maps
                    .unvalidated
                    .get(egress_key, 0)
                    .map_or(none, |b| b.fallback);
            }
            Some(v) => {
                let sends_from_here = translation_of(egress_key, v)
                    .is_some_and(|o| o.physical_local == t.physical_local);
                if !sends_from_here || v.flags & (NAT_F_HOLD | NAT_F_FAMILY) != 0 {
                    return none;
                }
                *v
            }
        };
        let held_until = match t.flow.proto {
            Proto::Tcp => {
                let ns = u64::try_from(FALLBACK_WAIT.as_nanos()).unwrap_or(u64::MAX);
                vnat_common::hold_until(super::listing::boottime_ns(), ns)
            }
            Proto::Udp => 0,
        };
        NatRewrite {
            flags: placement.flags | NAT_F_FALLBACK,
            held_until,
            ..placement
        }
    }

    /// Remove the flow's allowance for an unvalidated address (its entries
    /// no longer carry `NAT_F_BUDGET`). A failure leaves an entry nothing
    /// reads, which the next install of the flow replaces.
    pub(super) fn drop_budget(&mut self, key: &FlowKey) {
        match self.loaded.maps.unvalidated.remove(key) {
            Ok(()) => {}
            Err(e) if is_not_found(&e) => {}
            Err(e) => {
                tracing::debug!(error = %e, "cannot remove a flow's allowance for an unvalidated address")
            }
        }
    }

    /// Remove the rebind entries of the flow `key` (virtual, our side)
    /// that are still waiting for their first packet; whether there were.
    pub(super) fn drop_rebinds(&mut self, key: &FlowKey) -> bool {
        let stale: Vec<RebindKey> = self
            .rebinds
            .iter()
            .filter(|k| {
                self.loaded.maps.rebind.get(k, 0).is_ok_and(|v| {
                    v.virt_local_addr_be == key.src_addr_be
                        && v.virt_remote_addr_be == key.dst_addr_be
                        && v.virt_local_port_be == key.src_port_be
                        && v.virt_remote_port_be == key.dst_port_be
                })
            })
            .copied()
            .collect();
        let any = !stale.is_empty();
        for k in stale {
            let _ = self.loaded.maps.rebind.remove(&k);
            self.rebinds.remove(&k);
            self.rebinds_since.remove(&k);
        }
        if any && !self.looking_past_misses() {
            let _ = self.set_rebinding(false);
        }
        any
    }

    /// See [`Datapath::hold_send_side`]: set [`NAT_F_HOLD`] on the flow's
    /// egress entry for `hold`'s time (the datapath ends it then by itself),
    /// adding one that only holds (rewrites the flow to itself) if it has
    /// none; or, with `None`, clear it, removing that one. A flow already
    /// held keeps the later of the two ends.
    pub(super) fn hold(
        &mut self,
        flow: &VirtualFlow,
        hold: Option<std::time::Duration>,
    ) -> Result<(), DatapathError> {
        let key = flow.to_key();
        let until = |limit: std::time::Duration| {
            let ns = u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX);
            vnat_common::hold_until(super::listing::boottime_ns(), ns)
        };
        match (self.egress_get(&key)?, hold) {
            (Some(v), Some(limit)) => {
                let until = until(limit);
                let later = v.flags & NAT_F_HOLD == 0
                    || (v.held_until != 0 && until.wrapping_sub(v.held_until) as i32 > 0);
                if !later {
                    return Ok(());
                }
                self.nat_insert(
                    true,
                    key,
                    NatRewrite {
                        flags: v.flags | NAT_F_HOLD,
                        held_until: until,
                        ..v
                    },
                )
            }
            (None, Some(limit)) => self.nat_insert(
                true,
                key,
                NatRewrite {
                    held_until: until(limit),
                    ..hold_only(&key)
                },
            ),
            (Some(v), None) if v.flags & NAT_F_HOLD != 0 => {
                if is_hold_only(&key, &v) {
                    self.nat_remove(true, &key)
                } else {
                    self.nat_insert(
                        true,
                        key,
                        NatRewrite {
                            flags: v.flags & !NAT_F_HOLD,
                            held_until: 0,
                            ..v
                        },
                    )
                }
            }
            _ => Ok(()),
        }
    }

    /// See [`Datapath::release_held`].
    pub(super) fn release_all_held(&mut self) -> Result<usize, DatapathError> {
        let held: Vec<FlowKey> = self
            .mirror
            .egress
            .iter()
            .filter(|(_, v)| v.flags & NAT_F_HOLD != 0)
            .map(|(k, _)| *k)
            .collect();
        let mut n = 0;
        for k in held {
            if let Some(flow) = VirtualFlow::from_key(&k) {
                self.hold(&flow, None)?;
                n += 1;
            }
        }
        Ok(n)
    }
}

/// The entry that only holds a flow: it rewrites the flow to itself (on
/// egress for a moving connection's send side, on ingress for the replies
/// of a container's connection while its NAT entry is pinned).
pub(super) fn hold_only(key: &FlowKey) -> NatRewrite {
    NatRewrite {
        src_addr_be: key.src_addr_be,
        dst_addr_be: key.dst_addr_be,
        src_port_be: key.src_port_be,
        dst_port_be: key.dst_port_be,
        redirect_ifindex: 0,
        flags: NAT_F_HOLD,
        held_until: 0,
    }
}

/// Whether an egress entry only holds its flow (no translation beneath).
pub(super) fn is_hold_only(key: &FlowKey, v: &NatRewrite) -> bool {
    NatRewrite {
        flags: v.flags & NAT_F_HOLD,
        held_until: 0,
        ..*v
    } == hold_only(key)
}

pub(super) fn v_ifindex(v: &Option<NatRewrite>) -> u32 {
    v.map_or(0, |v| v.redirect_ifindex)
}
pub(super) fn v_flags(v: &Option<NatRewrite>) -> u32 {
    v.map_or(0, |v| v.flags)
}

/// The packet an ingress entry produces: (remote virtual -> local virtual).
pub(super) fn restored_key(key: &FlowKey, v: &NatRewrite) -> FlowKey {
    FlowKey {
        src_addr_be: v.src_addr_be,
        dst_addr_be: v.dst_addr_be,
        src_port_be: v.src_port_be,
        dst_port_be: v.dst_port_be,
        // A flow carried in the other family restores the other one.
        family: super::nat::value_family(key, v),
        ..*key
    }
}
