//! The routes a translation needs: the kernel's lookups, remembered per
//! batch, the route out of the interface that holds a new source address,
//! and the route of a moved flow's own packets where the kernel's would
//! not take them to their new next hop.

use std::net::IpAddr;

use super::{net, KernelDatapath};
use crate::datapath::{DatapathError, Translation};

/// How long a move waits for its new next hop to be resolved
/// ([`KernelDatapath::resolve_next_hop`]) before it goes on without: an
/// ARP or neighbour-discovery round trip on the local link, a few
/// milliseconds on Wi-Fi. The wait costs the move little: its first message
/// to the peer leaves by the same next hop and would wait for the same
/// answer.
const NEXT_HOP_WAIT: std::time::Duration = std::time::Duration::from_millis(20);
const NEXT_HOP_POLL: std::time::Duration = std::time::Duration::from_micros(200);

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

    /// Resolve the next hop towards `dst` before a moved connection's old
    /// address goes on `lo`, from which moment its socket can send again,
    /// by the new network's route (see [`NEXT_HOP_WAIT`]).
    ///
    /// tc egress runs after the neighbour layer. A segment the socket sends
    /// while that next hop is still being resolved waits in the neighbour
    /// entry, and TCP counts it as sent; when the answer comes, the move's
    /// hold drops it in tc, and TCP sends it again only when the peer's
    /// SACK shows the hole, a round trip after the move (the one segment
    /// every run of `bench handover` without an outage sent again). With the
    /// next hop resolved, a held send fails at once instead, the data stays
    /// in the socket, and the move's restart sends it. Best effort: a next
    /// hop that does not answer in time leaves things as they were.
    pub(super) fn resolve_next_hop(&self, dst: IpAddr) {
        let Ok(route) = self.route(dst, None) else {
            return;
        };
        let hop = route.gateway.unwrap_or(dst);
        let started = std::time::Instant::now();
        let resolved = || net::neighbour_resolved(hop, route.ifindex);
        match resolved() {
            Ok(true) => return,
            Ok(false) => {}
            Err(e) => {
                tracing::debug!(next_hop = %hop, dev = %route.dev, error = %e, "cannot read the next hop's neighbour entry");
                return;
            }
        }
        if let Err(e) = net::resolve_neighbour(hop, route.ifindex) {
            tracing::debug!(next_hop = %hop, dev = %route.dev, error = %e, "cannot have the next hop resolved");
            return;
        }
        loop {
            std::thread::sleep(NEXT_HOP_POLL);
            let done = matches!(resolved(), Ok(true));
            if done || started.elapsed() >= NEXT_HOP_WAIT {
                tracing::debug!(next_hop = %hop, dev = %route.dev, resolved = done, waited_ms = started.elapsed().as_secs_f64() * 1e3, "waited for the next hop before the old address goes on lo");
                return;
            }
        }
    }

    /// The route a translated flow's own packets need where the kernel's
    /// route for them would not take them to their new next hop, to be
    /// installed for that flow alone (`net::add_via_route`); None where it
    /// does. `route` is the route to the new physical remote (from the new
    /// local address).
    ///
    /// The socket sends to the peer's virtual address V, and tc egress runs
    /// after the neighbour lookup for V's next hop: when the peer moved, V's
    /// route must lead where its new address P's does, or the packets die
    /// in an unresolved neighbour entry (V on the link, its host gone) or
    /// leave by the wrong link. Usually both leave by the same router, and
    /// nothing is needed. Never a route for V itself: V may be the address
    /// of other hosts too (a NAT's, a CGNAT's, a proxy's), whose traffic
    /// from every application of this host would follow it.
    ///
    /// A connection whose own end alone moved (`vnatctl migrate` while the
    /// old address stays up) needs one where V's route leaves by another
    /// interface than the new address's.
    pub(super) fn flow_route(
        &self,
        t: &Translation,
        route: &net::RouteInfo,
    ) -> Option<net::RouteInfo> {
        let v = t.flow.remote.ip();
        let natural = self.route(v, Some(t.flow.local.ip()));
        if t.remote_moved() && t.physical_remote.ip() != v {
            let hop = route.gateway.unwrap_or(t.physical_remote.ip());
            return match natural {
                Ok(n) if n.ifindex == route.ifindex && n.gateway.unwrap_or(v) == hop => None,
                _ => Some(net::RouteInfo {
                    gateway: Some(hop),
                    ..route.clone()
                }),
            };
        }
        match natural {
            Ok(n) if t.local_moved() && n.ifindex != route.ifindex => Some(route.clone()),
            _ => None,
        }
    }
}
