//! Containers' connections: sockets of enabled cgroups that live in other
//! network namespaces, behind this host's NAT or on addresses this host
//! routes to them (docs/containers.md).
//!
//! The sock_ops recorder keeps them apart from the host's own, by
//! namespace (`VNAT_GUESTS`). A guest's connection is this host's to
//! manage only if the host routes the socket's own address into the very
//! namespace the socket is in (`peerns`), and then either the host's
//! conntrack NATs it with an address of this host, or nothing NATs it and
//! the address is the container's own, routed by this host (a routed IPv6
//! prefix). All of that is read from the kernel, never taken from the
//! container, so a container can make vnatd claim or route nothing the
//! host did not already give it. Its name, for the peer and for vnat's
//! translations, is the public one (after the NAT; the socket's own when
//! routed), which is also what the uplink's tc sees.

use std::collections::{HashMap, HashSet};

use vnat_common::{GuestKey, MAP_GUESTS};

use super::conntrack::{self, Direction};
use super::peerns::{self, NetnsFinder};
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
    /// What the host's conntrack said of each guest, so that a listing
    /// (each resync, just before a move) asks again only where the answer
    /// can have changed.
    verdicts: HashMap<GuestKey, Verdict>,
    /// The public keys of the guests listed last: the restart levers leave
    /// them to their own TCP (their sockets are not in this namespace).
    public: HashSet<FlowKey>,
    /// The source address a guest's namespace sends from to a peer, for
    /// the UDP sockets bound to the wildcard address, by (process, peer).
    sources: HashMap<(u32, IpAddr), Option<IpAddr>>,
    /// The public keys of the routed guests listed last: their local
    /// address is the container's, never kept on this host's `lo`.
    routed: HashSet<FlowKey>,
    /// Guests' namespaces, found by cookie.
    namespaces: NetnsFinder,
    /// Where the host routes each guest's own address, once asked
    /// (`peerns::routes_into`): a veth's or bridge's other end does not
    /// change under a live socket, so it is not asked again.
    checked: HashMap<GuestKey, Option<bool>>,
    /// Outgoing NATed guests the last listing found on an interface's
    /// address and not pinned yet, with that interface (`pin_guests`).
    to_pin: HashMap<GuestKey, u32>,
}

enum Verdict {
    /// The host NATs it: its entry as read, which way, whether the entry
    /// was pinned or found unpinnable (then it is not read again), and
    /// whether its public address was on one of this host's interfaces
    /// when read (still this host's to manage after that address left:
    /// the move that follows is what vnat is for).
    Ours {
        entry: conntrack::Entry,
        dir: Direction,
        pinned: bool,
        vouched: bool,
    },
    /// Not NATed: the container's own address, which this host routes
    /// into its namespace. `anchor` is this host's address towards the
    /// peer when first seen: the network that routes the container's
    /// prefix to this host is the one that address is on, so the
    /// connection moves when it goes, as the host's own connections on it
    /// do.
    Routed { anchor: IpAddr },
    /// Not this host's (no entry, not NATed, not its address): asked again
    /// after `retry`, as a connection's entry may come after its socket.
    NotOurs { retry: std::time::Instant },
}

/// How long a guest the host does not NAT goes unasked.
const RETRY_NOT_OURS: std::time::Duration = std::time::Duration::from_secs(5);

/// How soon a young guest without a conntrack entry is asked again: the
/// recorder sees a UDP socket's first datagram before the host's NAT makes
/// its entry, and a flow that waits 5 s to be judged is not mobile by then.
const RETRY_NO_ENTRY_YET: std::time::Duration = std::time::Duration::from_millis(300);

/// How long a guest counts as young for [`RETRY_NO_ENTRY_YET`].
const YOUNG: std::time::Duration = std::time::Duration::from_secs(10);

impl GuestState {
    pub fn is_guest(&self, key: &FlowKey) -> bool {
        self.public.contains(key)
    }

    /// A routed guest's connection: its local address is a container's.
    pub fn is_routed(&self, key: &FlowKey) -> bool {
        self.routed.contains(key)
    }
}

impl KernelDatapath {
    /// The guests' connections this host NATs with one of its addresses,
    /// under their public names (`with_owners`: with their namespaces'
    /// names). Pins each outgoing one's NAT entry while its address is
    /// still on an interface (see `conntrack`).
    pub(super) fn guests(&self, with_owners: bool) -> Result<Vec<Guest>, DatapathError> {
        let all: Vec<(GuestKey, ConnRecord)> = self
            .loaded
            .maps
            .guests
            .iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(MAP_GUESTS))?;
        let mut state = self.guests.borrow_mut();
        let live: HashSet<GuestKey> = all.iter().map(|(k, _)| *k).collect();
        state.verdicts.retain(|k, _| live.contains(k));
        state.checked.retain(|k, _| live.contains(k));
        let pids: HashSet<u32> = all.iter().map(|(_, r)| r.pid).collect();
        state.sources.retain(|(pid, _), _| pids.contains(pid));
        if all.is_empty() {
            state.public.clear();
            state.routed.clear();
            return Ok(Vec::new());
        }
        let on_links = net::interface_addrs()?;
        let on_lo = net::lo_addrs()?;
        let now = std::time::Instant::now();
        // The sources of wildcard-bound UDP sockets not known yet: one
        // thread per namespace asks them all, and at most
        // [`SOURCES_PER_PASS`] are asked per listing (the others at the
        // next); never a thread per (process, peer).
        let mut wanted: HashMap<u32, Vec<IpAddr>> = HashMap::new();
        let mut n = 0;
        for (gkey, rec) in &all {
            if n >= SOURCES_PER_PASS {
                break;
            }
            let Some(private) = VirtualFlow::from_key(&gkey.flow) else {
                continue;
            };
            if private.local.ip().is_unspecified()
                && !state.sources.contains_key(&(rec.pid, private.remote.ip()))
            {
                let dsts = wanted.entry(rec.pid).or_default();
                if !dsts.contains(&private.remote.ip()) {
                    dsts.push(private.remote.ip());
                    n += 1;
                }
            }
        }
        for (pid, dsts) in wanted {
            for (dst, src) in dsts.iter().zip(sources_in(pid, &dsts)) {
                state.sources.insert((pid, *dst), src);
            }
        }
        let mut candidates = Vec::new();
        let mut out = Vec::new();
        let mut judged = 0;
        for (gkey, rec) in all {
            let Some(mut private) = VirtualFlow::from_key(&gkey.flow) else {
                continue;
            };
            if private.local.ip().is_unspecified() {
                // A UDP socket bound to the wildcard address: its datagrams
                // leave from the address its namespace routes from.
                // Not asked yet (beyond this pass's share): listed later.
                match state.sources.get(&(rec.pid, private.remote.ip())) {
                    Some(Some(ip)) => private.local = SocketAddr::new(*ip, private.local.port()),
                    _ => continue,
                }
            }
            let stale = match state.verdicts.get(&gkey) {
                None => true,
                Some(Verdict::NotOurs { retry }) => now >= *retry,
                // An entry not pinned may be replaced (masquerade again,
                // after a failed pin): read it each time.
                Some(Verdict::Ours { pinned, dir, .. }) => !pinned && *dir == Direction::Out,
                Some(Verdict::Routed { .. }) => false,
            };
            // Bounded work per listing: the others are judged at the next.
            let stale = stale && judged < JUDGED_PER_PASS;
            judged += usize::from(stale);
            if stale {
                let was_vouched = matches!(
                    state.verdicts.get(&gkey),
                    Some(Verdict::Ours { vouched: true, .. })
                );
                let mut checked = state.checked.get(&gkey).copied();
                let finder = &mut state.namespaces;
                let young = listing::boottime_ns().saturating_sub(rec.first_seen_ns)
                    < YOUNG.as_nanos() as u64;
                let judged = judge(
                    &private,
                    &on_links,
                    was_vouched,
                    young,
                    &mut checked,
                    now,
                    || finder.find(gkey.netns_cookie, rec.pid),
                );
                if let Some(c) = checked {
                    state.checked.insert(gkey, c);
                }
                match judged {
                    Some(verdict) => {
                        state.verdicts.insert(gkey, verdict);
                    }
                    // Could not tell (a netlink error): as it was, or
                    // asked again later.
                    None => {
                        state.verdicts.entry(gkey).or_insert(Verdict::NotOurs {
                            retry: now + RETRY_NOT_OURS,
                        });
                    }
                }
            }
            match state.verdicts.get_mut(&gkey) {
                Some(Verdict::Ours {
                    entry,
                    dir,
                    vouched,
                    ..
                }) => {
                    let (local, remote) = entry.public(*dir);
                    let on_link = on_links
                        .iter()
                        .find(|(a, _)| *a == local.ip())
                        .map(|(_, ifindex)| *ifindex);
                    *vouched |= on_link.is_some();
                    // A vnatd started after a move: the old address is kept
                    // on lo, tagged as vnat's.
                    let public = VirtualFlow {
                        proto: private.proto,
                        local,
                        remote,
                    };
                    if !*vouched && !on_lo.iter().any(|(a, ours)| *ours && *a == local.ip()) {
                        tracing::debug!(id = public.id(), flow = %public, %private, "a guest's connection NATed to an address this host does not have: not listed");
                        continue;
                    }
                    candidates.push((gkey, rec, private, public, on_link, None));
                }
                Some(Verdict::Routed { anchor }) => {
                    candidates.push((gkey, rec, private, private, None, Some(*anchor)));
                }
                _ => {}
            }
        }
        // Two namespaces' sockets that map to one entry of the host's: one
        // of them made up the other's tuple. Neither is taken (nor pinned).
        let mut seen: HashMap<FlowKey, usize> = HashMap::new();
        // Built whole, then swapped in: an error above leaves the last
        // listing's sets (a routed guest taken for the host's own would get
        // its address put on lo).
        let mut public_keys = HashSet::new();
        let mut routed_keys = HashSet::new();
        for (_, _, _, public, _, _) in &candidates {
            *seen.entry(public.to_key()).or_default() += 1;
        }
        let mut to_pin = HashMap::new();
        for (gkey, rec, private, public, on_link, routed_via) in candidates {
            let key = public.to_key();
            if seen.get(&key) != Some(&1) {
                tracing::warn!(id = public.id(), flow = %public, "two network namespaces have a socket for the same NATed flow: managing neither");
                continue;
            }
            if let (
                Some(Verdict::Ours {
                    dir: Direction::Out,
                    pinned: false,
                    ..
                }),
                Some(ifindex),
            ) = (state.verdicts.get(&gkey), on_link)
            {
                to_pin.insert(gkey, ifindex);
            }
            public_keys.insert(key);
            if routed_via.is_some() {
                routed_keys.insert(key);
            }
            out.push(Guest {
                key,
                rec,
                info: GuestInfo {
                    netns_cookie: gkey.netns_cookie,
                    netns: (with_owners && rec.pid != 0)
                        .then(|| std::fs::read_link(format!("/proc/{}/ns/net", rec.pid)).ok())
                        .flatten()
                        .map(|p| p.to_string_lossy().into_owned()),
                    private_local: private.local,
                    private_remote: private.remote,
                    routed_via,
                },
            });
        }
        state.public = public_keys;
        state.routed = routed_keys;
        state.to_pin = to_pin;
        Ok(out)
    }

    /// Pin the NAT entries of the guests' connections the last listing
    /// found unpinned (see `conntrack::pin_snat`), each while the replies
    /// of its flow are held in tc ingress: between the entry's removal and
    /// its copy a reply would find no entry, be taken for this host's own
    /// and answered with a reset that ends the connection on both ends (a
    /// gap of microseconds that a slow machine or a busy flow hits). The
    /// held replies are dropped and the peer's TCP sends them again.
    pub(super) fn pin_guests(&mut self) -> Result<(), DatapathError> {
        let pending: Vec<(GuestKey, u32)> = self.guests.borrow_mut().to_pin.drain().collect();
        let mut by_link: HashMap<u32, Vec<GuestKey>> = HashMap::new();
        for (gkey, ifindex) in pending {
            by_link.entry(ifindex).or_default().push(gkey);
        }
        let mut failed = None;
        for (ifindex, gkeys) in by_link {
            // tc on the interface the replies come in by: the standby's,
            // or attached for these pins only.
            let borrowed = !self.tc_current.contains(&ifindex);
            if borrowed {
                if let Err(e) =
                    attach::attach_tc(&mut self.loaded.ebpf, &self.bpffs, ifindex, self.tc_mode)
                {
                    tracing::warn!(error = %e, "cannot hold replies while pinning containers' NAT entries: not pinned now");
                    continue;
                }
                self.tc_current.insert(ifindex);
            }
            // Each pin on its own: one that fails leaves the others to
            // be done, and the borrowed tc to be given back.
            for gkey in gkeys {
                if let Err(e) = self.pin_guest(&gkey) {
                    failed.get_or_insert(e);
                }
            }
            if borrowed
                && !self.standby.contains(&ifindex)
                && !self.bind_ifaces.contains(&ifindex)
                && !self.tc_used_by_translation(ifindex)?
            {
                attach::detach_tc(&self.bpffs, ifindex);
                self.tc_current.remove(&ifindex);
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Pin one guest's entry, its replies held meanwhile (`pin_guests`).
    fn pin_guest(&mut self, gkey: &GuestKey) -> Result<(), DatapathError> {
        let entry = match self.guests.borrow_mut().verdicts.get_mut(gkey) {
            Some(Verdict::Ours {
                entry,
                dir: Direction::Out,
                pinned: pinned @ false,
                ..
            }) => {
                // Tried once: an entry that cannot be pinned (a copy
                // would change it) is not asked about again.
                *pinned = true;
                entry.clone()
            }
            _ => return Ok(()),
        };
        // Read again: the copy takes the entry's state as it is now, and
        // an entry that changed (replaced meanwhile) is left as it is.
        let entry = match conntrack::find(entry.proto, entry.orig.0, entry.orig.1) {
            Ok(Some((now, Direction::Out))) if now.reply == entry.reply && now.snat => now,
            _ => return Ok(()),
        };
        let (local, remote) = entry.public(Direction::Out);
        let public = VirtualFlow {
            proto: entry.proto,
            local,
            remote,
        };
        // The replies as they arrive: from the peer to the public name.
        let reply = public.to_key().reversed();
        let hold = self.ingress_get(&reply)?.is_none();
        if hold {
            self.nat_insert(false, reply, translate::hold_only(&reply))?;
            // A vnatd that dies here leaves the replies held: the next
            // one lets them go at open (`reconcile`).
            fault::after("pin:replies-held");
        }
        let pinned = conntrack::pin_snat(&entry);
        if hold {
            self.nat_remove(false, &reply)?;
        }
        if let Err(e) = pinned {
            tracing::warn!(id = public.id(), flow = %public, error = %e, "cannot pin the NAT entry of a container's connection: a move of this host would reset it");
        }
        Ok(())
    }

    /// Drop the guests' UDP records whose socket is gone: the recorder
    /// cannot see a container's UDP socket close. A record is alive while
    /// its process's namespace (`/proc/PID/net`) has a UDP socket on its
    /// local end (connected to its peer, or not connected). TCP records go
    /// when their socket closes (sock_ops).
    pub(super) fn drop_closed_udp_guests(&mut self) {
        let udp: Vec<(GuestKey, ConnRecord)> = self
            .loaded
            .maps
            .guests
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, _)| k.flow.proto == PROTO_UDP)
            .collect();
        // Each process's namespace read once, its sockets by port.
        let mut sockets: HashMap<u32, listing::UdpSockets> = HashMap::new();
        for (k, rec) in udp {
            let Some((local, remote)) = key_endpoints(&k.flow) else {
                continue;
            };
            let theirs = sockets.entry(rec.pid).or_insert_with(|| {
                listing::udp_sockets_by_port(
                    procfs::udp_socket_inodes_in(&format!("/proc/{}/net", rec.pid)).into_keys(),
                )
            });
            let (alive, _) = listing::udp_socket_of(theirs, local, remote);
            if !alive {
                let _ = self.loaded.maps.guests.remove(&k);
            }
        }
    }
}

/// Wildcard sources asked per listing at most (`KernelDatapath::guests`).
const SOURCES_PER_PASS: usize = 256;

/// Guests' connections judged (conntrack, routes, namespaces) per listing
/// at most (`KernelDatapath::guests`).
const JUDGED_PER_PASS: usize = 512;

/// The source addresses the network namespace of process `pid` sends
/// from to each of `dsts` (its routes' preferred source), asked from one
/// thread that enters that namespace; `None` where the process is gone or
/// has no route.
fn sources_in(pid: u32, dsts: &[IpAddr]) -> Vec<Option<IpAddr>> {
    let none = || vec![None; dsts.len()];
    if pid == 0 {
        return none();
    }
    let Ok(ns) = std::fs::File::open(format!("/proc/{pid}/ns/net")) else {
        return none();
    };
    std::thread::scope(|s| {
        s.spawn(|| {
            if nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).is_err() {
                return none();
            }
            dsts.iter()
                .map(|d| net::route_get(*d, None).ok().and_then(|r| r.prefsrc))
                .collect()
        })
        .join()
        .unwrap_or_else(|_| none())
    })
}

/// What this host says of a guest's connection `private`: whether it
/// routes the socket's address into the socket's namespace (`namespace`
/// finds it; `checked` keeps the answer), and then whether its conntrack
/// NATs the connection with an address of this host, or tracks it without
/// NAT (a routed container). `None`: it could not tell (an error), so the
/// last verdict stands.
fn judge(
    private: &VirtualFlow,
    on_links: &[(IpAddr, u32)],
    was_vouched: bool,
    young: bool,
    checked: &mut Option<Option<bool>>,
    now: std::time::Instant,
    namespace: impl FnOnce() -> Option<std::fs::File>,
) -> Option<Verdict> {
    let not_ours = Verdict::NotOurs {
        retry: now + RETRY_NOT_OURS,
    };
    let (entry, dir) = match conntrack::find(private.proto, private.local, private.remote) {
        Ok(Some(found)) => found,
        // No entry (yet): a masqueraded flow's may come after its socket,
        // and without one nothing says the host routes it unNATed.
        // Without the host's entry the public flow, and so the id `vnatctl
        // ls` would list it under, is not known: the private flow names it.
        Ok(None) => {
            tracing::debug!(%private, young, "no conntrack entry for a guest's connection (yet)");
            return Some(Verdict::NotOurs {
                retry: now
                    + if young {
                        RETRY_NO_ENTRY_YET
                    } else {
                        RETRY_NOT_OURS
                    },
            });
        }
        Err(e) => {
            tracing::debug!(%private, error = %e, "cannot read the conntrack entry of a guest's connection");
            return None;
        }
    };
    let nated = match dir {
        Direction::Out => entry.snat,
        Direction::In => entry.dnat,
    };
    // The connection as `vnatctl ls` would list it (the same as `private`
    // when the host does not NAT it), for what is logged.
    let public = {
        let (local, remote) = entry.public(dir);
        VirtualFlow {
            proto: private.proto,
            local,
            remote,
        }
    };
    let into = match *checked {
        Some(c) => c,
        None => {
            let Some(ns) = namespace() else {
                tracing::debug!(id = public.id(), flow = %public, %private, "the network namespace of a guest's socket is gone");
                return Some(not_ours);
            };
            match peerns::routes_into(private.local.ip(), &ns) {
                Ok(c) => {
                    *checked = Some(c);
                    c
                }
                Err(e) => {
                    tracing::debug!(id = public.id(), flow = %public, %private, error = %e, "cannot tell where this host routes a guest's address");
                    return None;
                }
            }
        }
    };
    if into == Some(false) {
        tracing::debug!(id = public.id(), flow = %public, %private, "this host does not route the guest's address into the guest's namespace: not its connection");
        return Some(not_ours);
    }
    if nated {
        // Into the namespace, or by a link that cannot be followed (Open
        // vSwitch, ipvlan): the host's NAT entry vouches for the rest.
        let vouched = was_vouched || on_links.iter().any(|(a, _)| *a == entry.public(dir).0.ip());
        return Some(Verdict::Ours {
            entry,
            dir,
            pinned: false,
            vouched,
        });
    }
    // Tracked, not NATed: the container's own address, routed to it by
    // this host (only where the route is seen to lead into its namespace),
    // to a peer beyond this host (not this host itself, nor a neighbour on
    // the container's own bridge). It moves with this host's address
    // towards that peer.
    if into != Some(true) {
        return Some(not_ours);
    }
    match peerns::stays_on_host(private.local.ip(), private.remote.ip()) {
        Ok(false) => {}
        Ok(true) => return Some(not_ours),
        Err(_) => return None,
    }
    match net::route_get(private.remote.ip(), None)
        .ok()
        .and_then(|r| r.prefsrc)
        .filter(|a| on_links.iter().any(|(o, _)| o == a))
    {
        Some(anchor) => Some(Verdict::Routed { anchor }),
        None => Some(not_ours),
    }
}
