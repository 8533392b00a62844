//! IPv4 connections carried over IPv6 (issue 32, item 3): a host that has
//! lost its IPv4 address but has IPv6 continues its IPv4 connections
//! between its own and its peer's IPv6 addresses; the datapath changes
//! each packet's IP version on the way (DESIGN.md section 3, docs/laptops.md).
//!
//! What the protocol needs for it:
//! - each host tells its paired peers its addresses, in every PROBE and
//!   PROBE answer (`vcmp::probe`), so that the mover knows where its peer
//!   is reached in the other family ([`Endpoint::other_family_remote`]);
//! - a record's physical address may be IPv6 while its virtual addresses
//!   are IPv4 (`wire::Record::family`);
//! - the mover starts its move with the peer's address of the new family
//!   as the chain's first step, and validates it like the address of a
//!   peer that moved ([`Endpoint::resume_across`]);
//! - the peer, whose own end has no address in that family yet for the
//!   connection, takes the address the update arrived at
//!   ([`Endpoint::local_for_update`]), and keeps its end in the old family
//!   to return to (`Conn::local_alt`): on the way back, or when the new
//!   address fails validation.

use std::net::{IpAddr, SocketAddr};

use rand_core::{CryptoRng, RngCore};

use super::endpoint::{Conn, Ctx, Endpoint, EndpointError};
use super::wire::{Family, MAX_PROBE_ADDRS};
use crate::flow::VirtualFlow;
use crate::stats::Reject;

/// Most addresses of each family a host tells of itself: room for both
/// families in one PROBE.
const PER_FAMILY: usize = MAX_PROBE_ADDRS / 2;

/// Whether a host may tell (and its peer take) `ip` as one of its
/// addresses: one a peer elsewhere could reach, not loopback, link-local,
/// multicast, unspecified or an IPv4-mapped alias.
pub(crate) fn tellable(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            !(v4.is_loopback()
                || v4.is_link_local()
                || v4.is_multicast()
                || v4.is_unspecified()
                || v4.is_broadcast())
        }
        IpAddr::V6(v6) => {
            !(v6.is_loopback()
                || v6.is_multicast()
                || v6.is_unspecified()
                || (v6.segments()[0] & 0xffc0) == 0xfe80
                || v6.to_ipv4_mapped().is_some())
        }
    }
}

/// The addresses of `addrs` to tell: tellable ones, at most
/// [`PER_FAMILY`] of each family, in a stable order (sorted) so that an
/// unchanged set reads as unchanged.
pub(crate) fn to_tell(addrs: impl IntoIterator<Item = IpAddr>) -> Vec<IpAddr> {
    let mut all: Vec<IpAddr> = addrs.into_iter().filter(tellable).collect();
    all.sort();
    all.dedup();
    let (v4, v6): (Vec<IpAddr>, Vec<IpAddr>) = all.into_iter().partition(|a| a.is_ipv4());
    v4.into_iter()
        .take(PER_FAMILY)
        .chain(v6.into_iter().take(PER_FAMILY))
        .collect()
}

impl Conn {
    /// The peer's end is now at `addr`; one of the other family than
    /// before is a move between families, and the one before is kept to
    /// return to ([`Conn::remote_alt`]).
    pub(crate) fn set_remote(&mut self, addr: SocketAddr) {
        if addr.is_ipv4() != self.remote_phys.is_ipv4() {
            self.remote_alt = Some(self.remote_phys);
        }
        self.remote_phys = addr;
    }

    /// Our end back in the family of the peer's (validated) one, after the
    /// peer's move into the other family failed validation: the datapath
    /// cannot translate between an end of each.
    pub(crate) fn align_local(&mut self) {
        if self.local_phys.is_ipv4() == self.remote_phys.is_ipv4() {
            return;
        }
        if let Some(alt) = self
            .local_alt
            .filter(|a| a.is_ipv4() == self.remote_phys.is_ipv4())
        {
            self.local_alt = Some(self.local_phys);
            self.local_phys = alt;
            self.follows_peer = false;
        }
    }
}

/// Where a connection is carried now ([`Endpoint::placements`]): what
/// automatic mode needs of it to decide whether and where it moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    pub flow: VirtualFlow,
    pub local_phys: SocketAddr,
    pub remote_phys: SocketAddr,
    /// A move of it is under way.
    pub migrating: bool,
    /// `ConnectionView::follows_peer`.
    pub follows_peer: bool,
    /// Its peer's end in the other IP family
    /// ([`Endpoint::other_family_remote`]).
    pub across: Option<SocketAddr>,
}

impl Endpoint {
    /// This host's addresses, as the driver sees them: told to every paired
    /// host in each PROBE and PROBE answer. When they changed, every paired
    /// host is probed now, so that it knows them before it needs them (our
    /// connections' peers, when their own family's address goes).
    pub fn set_host_addresses(&mut self, addrs: impl IntoIterator<Item = IpAddr>) {
        let new = to_tell(addrs);
        if new == self.host_addrs {
            return;
        }
        self.host_addrs = new;
        let peers: Vec<[u8; 32]> = self.sessions.keys().copied().collect();
        for p in peers {
            self.send_probe(p);
        }
        self.tx.flush(&mut self.stats);
    }

    /// The addresses the paired host `peer` told us it has (its last
    /// authentic PROBE or answer), for `vnatctl peers` and the planner.
    pub fn peer_addresses(&self, peer: &[u8; 32]) -> &[IpAddr] {
        self.peer_host_addrs.get(peer).map_or(&[], |v| v.as_slice())
    }

    /// What the paired host `peer` told of its addresses, taken from an
    /// authentic, fresh PROBE or answer.
    pub(crate) fn peer_told_addresses(&mut self, peer: [u8; 32], addrs: &[IpAddr]) {
        self.peer_host_addrs
            .insert(peer, to_tell(addrs.iter().copied()));
    }

    /// Where `flow`'s peer is reached in the other IP family than where
    /// the connection is now carried: for an IPv4 connection carried over
    /// IPv4, the first IPv6 address its host told us of (same port); over
    /// IPv6, its IPv4 end from before it was carried over IPv6 (or its
    /// virtual one). None for an IPv6 connection (not carried over IPv4),
    /// or a peer that told no address of that family.
    pub fn other_family_remote(&self, flow: &VirtualFlow) -> Option<SocketAddr> {
        self.across_of(self.conns.get(flow)?)
    }

    /// [`Endpoint::other_family_remote`] of a connection at hand.
    fn across_of(&self, c: &Conn) -> Option<SocketAddr> {
        if !c.flow.local.is_ipv4() {
            return None;
        }
        if c.remote_phys.is_ipv6() {
            return Some(
                c.remote_alt
                    .filter(SocketAddr::is_ipv4)
                    .unwrap_or(c.flow.remote),
            );
        }
        let told = self.peer_addresses(c.peer_key.as_ref()?);
        told.iter()
            .find(|a| a.is_ipv6())
            .map(|ip| SocketAddr::new(*ip, c.remote_phys.port()))
    }

    /// Every connection's placement, as automatic mode plans from it, in
    /// one pass over the table: at 100,000 connections, looking each one
    /// up again for its view ([`Endpoint::connection`]) and its
    /// [`Endpoint::other_family_remote`] was most of the time between an
    /// address change and the first move.
    pub fn placements(&self) -> impl Iterator<Item = Placement> + '_ {
        self.conns.values().map(|c| Placement {
            flow: c.flow,
            local_phys: c.local_phys,
            remote_phys: c.remote_phys,
            migrating: c.mig.is_some(),
            follows_peer: c.follows_peer,
            across: self.across_of(c),
        })
    }

    /// Whether a move of `flow` is under way; None for a connection not
    /// tracked.
    pub fn is_migrating(&self, flow: &VirtualFlow) -> Option<bool> {
        self.conns.get(flow).map(|c| c.mig.is_some())
    }

    /// Start the moves of `moves`: `flow` continues from `new_local`, and
    /// where `peer` is given (an address of the other family than the
    /// peer's current one, from [`Endpoint::other_family_remote`]), its
    /// peer is asked there first and that address is validated at once, as
    /// a peer's that moved. A move into the other family needs one: the
    /// peer's current address is not reachable from `new_local`.
    pub fn resume_across<R: RngCore + CryptoRng>(
        &mut self,
        now: super::Timestamp,
        rng: &mut R,
        moves: &[(VirtualFlow, SocketAddr, Option<SocketAddr>)],
    ) -> Result<(), EndpointError> {
        for (f, new_local, peer) in moves {
            let c = self
                .conns
                .get(f)
                .ok_or(EndpointError::UnknownConnection(*f))?;
            if c.keys.is_none() {
                return Err(EndpointError::NoKeys(*f));
            }
            let remote = peer.unwrap_or(c.remote_phys);
            let carried = f.local.is_ipv4() && new_local.is_ipv6();
            if (Family::of(new_local) != Family::of(&f.local) && !carried)
                || new_local.is_ipv4() != remote.is_ipv4()
            {
                return Err(EndpointError::MixedFamilies(*f));
            }
        }
        let mut ctx = Ctx::new(now, rng);
        for (f, new_local, peer) in moves {
            self.start_migration(&mut ctx, f, *new_local, *peer);
        }
        self.tx.flush(&mut self.stats);
        Ok(())
    }

    /// An authentic update of `flow` names the peer's end at `named`: our
    /// end for it, which is our current one unless `named` is of the other
    /// family. Then it is the address the update arrived at (`ctx.rx_to`),
    /// or our end from before in that family, with our port. Some(new end)
    /// when it changes; refused when we have no address of that family.
    pub(crate) fn local_for_update(
        &self,
        ctx: &Ctx,
        flow: &VirtualFlow,
        named: SocketAddr,
    ) -> Result<Option<SocketAddr>, Reject> {
        let c = self.conns.get(flow).ok_or(Reject::UnknownConnection)?;
        if named.is_ipv4() == c.local_phys.is_ipv4() {
            return Ok(None);
        }
        let port = c.local_phys.port();
        let arrived = ctx
            .rx_to
            .filter(|ip| ip.is_ipv4() == named.is_ipv4() && tellable(ip))
            .map(|ip| SocketAddr::new(ip, port));
        let before = c.local_alt.filter(|a| a.is_ipv4() == named.is_ipv4());
        match arrived.or(before) {
            // Back to the connection's own family: its own address if the
            // update came there (no translation left on our side).
            Some(a) if a.ip() == flow.local.ip() => Ok(Some(flow.local)),
            Some(a) => Ok(Some(a)),
            None => Err(Reject::NoLocalInFamily),
        }
    }
}
