//! Containers' connections: sockets of enabled cgroups that live in other
//! network namespaces, behind this host's NAT (README, "Containers").
//!
//! The sock_ops recorder keeps them apart from the host's own, by
//! namespace (`VNAT_GUESTS`). A guest's connection is this host's to
//! manage only if the host's conntrack NATs it with an address of this
//! host: that is read from the kernel, never taken from the container, so
//! a container can make vnatd claim or route nothing the host's NAT did
//! not already give it. Its name, for the peer and for vnat's
//! translations, is the public one (after the NAT), which is also what the
//! uplink's tc sees.

use std::collections::HashSet;

use vnat_common::{GuestKey, MAP_GUESTS};

use super::conntrack::{self, Direction};
use super::listing::boottime_ns;
use super::*;
use crate::datapath::GuestInfo;

/// A guest's connection under its public name.
pub(super) struct Guest {
    /// The public flow's key (local = this host's address and NAT port).
    pub key: FlowKey,
    pub rec: ConnRecord,
    pub info: GuestInfo,
}

/// What the listing learned about guests, kept between listings.
#[derive(Default)]
pub(super) struct GuestState {
    /// Guests whose masquerade entry was swapped for an explicit one
    /// ([`conntrack::pin_snat`]).
    pinned: HashSet<GuestKey>,
    /// Guests whose public address was on one of this host's interfaces
    /// when listed: still this host's to manage after that address left
    /// (the move that follows is what vnat is for).
    vouched: HashSet<GuestKey>,
    /// The public keys of the guests listed last: the restart levers leave
    /// them to their own TCP (their sockets are not in this namespace).
    public: HashSet<FlowKey>,
}

impl GuestState {
    pub fn is_guest(&self, key: &FlowKey) -> bool {
        self.public.contains(key)
    }
}

impl KernelDatapath {
    /// The guests' connections this host NATs with one of its addresses,
    /// under their public names. Pins each outgoing one's NAT entry while
    /// its address is still on an interface (see `conntrack`).
    pub(super) fn guests(&self) -> Result<Vec<Guest>, DatapathError> {
        let all: Vec<(GuestKey, ConnRecord)> = self
            .loaded
            .maps
            .guests
            .iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(MAP_GUESTS))?;
        let mut state = self.guests.borrow_mut();
        state.pinned.retain(|k| all.iter().any(|(g, _)| g == k));
        state.vouched.retain(|k| all.iter().any(|(g, _)| g == k));
        state.public.clear();
        if all.is_empty() {
            return Ok(Vec::new());
        }
        let on_links = net::interface_addrs()?;
        let on_lo = net::lo_addrs()?;
        let mut out = Vec::new();
        for (gkey, rec) in all {
            let Some(private) = VirtualFlow::from_key(&gkey.flow) else {
                continue;
            };
            let (entry, dir) = match conntrack::find(private.proto, private.local, private.remote) {
                Ok(Some(found)) => found,
                Ok(None) => continue,
                Err(e) => {
                    tracing::debug!(flow = %private, error = %e, "no conntrack entry for a guest's connection");
                    continue;
                }
            };
            let nated = match dir {
                Direction::Out => entry.snat,
                Direction::In => entry.dnat,
            };
            if !nated {
                continue;
            }
            let (local, remote) = entry.public(dir);
            let on_link = on_links.iter().any(|(a, _)| *a == local.ip());
            if on_link {
                state.vouched.insert(gkey);
            } else if !state.vouched.contains(&gkey)
                // A vnatd started after a move: the old address is kept on
                // lo, tagged as vnat's.
                && !on_lo.iter().any(|(a, ours)| *ours && *a == local.ip())
            {
                continue;
            }
            if dir == Direction::Out && on_link && !state.pinned.contains(&gkey) {
                match conntrack::pin_snat(&entry) {
                    Ok(()) => {
                        state.pinned.insert(gkey);
                    }
                    Err(e) => {
                        tracing::warn!(flow = %private, error = %e, "cannot pin the NAT entry of a container's connection: a move of this host would reset it");
                    }
                }
            }
            let public = VirtualFlow {
                proto: private.proto,
                local,
                remote,
            };
            let key = public.to_key();
            state.public.insert(key);
            out.push(Guest {
                key,
                rec,
                info: GuestInfo {
                    netns_cookie: gkey.netns_cookie,
                    netns: (rec.pid != 0)
                        .then(|| std::fs::read_link(format!("/proc/{}/ns/net", rec.pid)).ok())
                        .flatten()
                        .map(|p| p.to_string_lossy().into_owned()),
                    private_local: private.local,
                    private_remote: private.remote,
                },
            });
        }
        Ok(out)
    }
}

/// How long a guest's UDP record outlives the host's NAT entry for it: the
/// recorder runs before the datagram that makes the entry leaves.
const UDP_GUEST_GRACE_NS: u64 = 5_000_000_000;

impl KernelDatapath {
    /// Drop the guests' UDP records whose flow the host's NAT has
    /// forgotten (its conntrack entry timed out): nothing of vnat's can
    /// keep such a flow, and the recorder cannot see a container's socket
    /// close. TCP records go when their socket closes (sock_ops).
    pub(super) fn drop_forgotten_udp_guests(&mut self) {
        let now = boottime_ns();
        let forgotten: Vec<GuestKey> = self
            .loaded
            .maps
            .guests
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, r)| {
                k.flow.proto == PROTO_UDP && now.saturating_sub(r.last_seen_ns) > UDP_GUEST_GRACE_NS
            })
            .filter(|(k, _)| {
                VirtualFlow::from_key(&k.flow).is_some_and(|f| {
                    matches!(conntrack::find(f.proto, f.local, f.remote), Ok(None))
                })
            })
            .map(|(k, _)| k)
            .collect();
        for k in forgotten {
            let _ = self.loaded.maps.guests.remove(&k);
        }
    }
}
