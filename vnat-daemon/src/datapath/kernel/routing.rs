//! The routes a translation needs: the kernel's lookups, remembered per
//! batch, the route out of the interface that holds a new source address,
//! and the host route that sends a moved peer's old address where its new
//! one goes.

use std::net::IpAddr;

use super::{fault, net, KernelDatapath};
use crate::datapath::DatapathError;

impl KernelDatapath {
    /// `net::route_get`, answered from the batch's memory when it can be.
    pub(super) fn route(
        &self,
        dst: IpAddr,
        from: Option<IpAddr>,
    ) -> Result<net::RouteInfo, DatapathError> {
        if let Some(r) = self
            .memo
            .borrow()
            .as_ref()
            .and_then(|m| m.routes.get(&(dst, from)))
        {
            return Ok(r.clone());
        }
        let r = net::route_get(dst, from)?;
        if let Some(m) = self.memo.borrow_mut().as_mut() {
            m.routes.insert((dst, from), r.clone());
        }
        Ok(r)
    }

    /// This datapath changed a route or an address: lookups remembered in
    /// the batch may no longer hold.
    pub(super) fn routes_changed(&self) {
        if let Some(m) = self.memo.borrow_mut().as_mut() {
            m.routes.clear();
            m.host_routes.clear();
            m.addrs = None;
        }
    }

    /// `net::interface_addrs`, listed once per batch.
    pub(super) fn interface_addrs_memo(&self) -> Result<Vec<(IpAddr, u32)>, DatapathError> {
        if let Some(a) = self.memo.borrow().as_ref().and_then(|m| m.addrs.clone()) {
            return Ok(a);
        }
        let a = net::interface_addrs()?;
        if let Some(m) = self.memo.borrow_mut().as_mut() {
            m.addrs = Some(a.clone());
        }
        Ok(a)
    }

    /// The route for packets from `src` to `dst`: the kernel's own choice
    /// when it leaves through an interface that holds `src` (or `src` is on
    /// no interface, as an address kept on `lo`), else the best route
    /// through the interface that does. A connection moved to a second
    /// interface's address while the first stays up (`vnatctl migrate`)
    /// must leave by its new link, not by the old one's default route,
    /// where its packets would go on with the new source address, and be
    /// lost when that link goes dark.
    pub(super) fn route_from(
        &self,
        dst: IpAddr,
        src: IpAddr,
    ) -> Result<net::RouteInfo, DatapathError> {
        let r = self.route(dst, Some(src))?;
        let owners: Vec<u32> = self
            .interface_addrs_memo()?
            .into_iter()
            .filter(|(a, _)| *a == src)
            .map(|(_, i)| i)
            .collect();
        if owners.is_empty() || owners.contains(&r.ifindex) {
            return Ok(r);
        }
        let via = owners[0];
        net::route_get_via(dst, src, via)?.ok_or_else(|| DatapathError::NoRouteVia {
            addr: dst,
            from: src,
            dev: net::ifname(via).unwrap_or_else(|_| via.to_string()),
        })
    }

    /// Route the peer's virtual address `virt` like its physical one
    /// (`net::add_host_route`) unless this batch already did exactly that.
    /// Returns whether a route for `virt` existed before (vnat's, or
    /// someone else's that is left alone): then a failure later in the
    /// install has no route to take back.
    pub(super) fn ensure_host_route(
        &self,
        virt: IpAddr,
        phys: IpAddr,
        via: &net::RouteInfo,
    ) -> Result<bool, DatapathError> {
        let target = (via.gateway.unwrap_or(phys), via.ifindex);
        if let Some(m) = self.memo.borrow().as_ref() {
            if m.host_routes.get(&virt) == Some(&target) {
                return Ok(true);
            }
        }
        let r = net::add_host_route(virt, phys, via);
        self.routes_changed();
        match r? {
            net::HostRoute::Foreign(protocol) => {
                // Not ours to change: tc redirects the flow's packets to the
                // right next hop instead (the caller checks the route).
                tracing::warn!(address = %virt, protocol, "a host route vnat did not make is in place for a moved peer's address; leaving it and redirecting in tc");
                Ok(true)
            }
            done => {
                fault::after("install:host-route");
                if let Some(m) = self.memo.borrow_mut().as_mut() {
                    m.host_routes.insert(virt, target);
                }
                Ok(done == net::HostRoute::Replaced)
            }
        }
    }
}
