//! Hide location (paper section 3.4.1): which address the applications of
//! a hiding cgroup are shown for each moved host, and where their new
//! connections to it go. Sans-IO: connections in, a [`HideTable`] out, for
//! `Datapath::set_hidden`.
//!
//! A host that moved keeps, for the applications, the addresses its
//! connections had before the move (its "original" addresses): a new
//! connection or datagram to one of them goes to where the host is now.
//! Where it is now, and the addresses of connections it opened while away,
//! are shown as one of them: the address of its oldest moved connection
//! (the "shown" address). The same holds for this host's own moves
//! (getsockname and bind) and for each peer host (getpeername, accept,
//! recvmsg, connect and sendmsg), told apart by its key. An original
//! address is never shown as another one: an existing connection's
//! getpeername stays what it was.
//!
//! What an address stands for must be certain, or a hiding application
//! would be sent to, or shown, the wrong host. So an address that another
//! host's connection also uses (a recorded flow of another peer, or of no
//! peer vnatd knows) is shown as it is and never redirected, nor is an
//! original address where the peer was behind a NAT (other hosts may
//! share it), nor an address that two moved hosts would each claim.
//!
//! And what is redirected is never a whole address: only the endpoints
//! (address and port) where this host saw the peer's connections, each to
//! where that connection is now. Whether the peer was behind a NAT is the
//! peer's own word (how it names its end in its CLAIM), and no
//! observation here can prove that it was not: a peer behind a NAT, or
//! one whose old address passed to another host, may name that address
//! as its own. With endpoints, such a peer reaches only what it held,
//! never another host's port at the same address.
//!
//! The shown address stays the same while connections use it, so that a
//! host that moves twice, or moves back, keeps being shown where its
//! applications first saw it. vnatd forgets it when it restarts, and then
//! chooses among the original addresses again.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
};

use crate::datapath::{HideTable, Proto, VirtualFlow};

/// One connection as VCMP has it.
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    pub flow: VirtualFlow,
    pub local_phys: SocketAddr,
    pub remote_phys: SocketAddr,
    /// The peer host the connection is bound to, by key (none before its
    /// claim: its peer side is skipped, and its addresses count as an
    /// unknown host's).
    pub peer: Option<[u8; 32]>,
    /// A NAT was between the hosts when it was opened (the peer names its
    /// end otherwise): its remote virtual address is that NAT's.
    pub peer_behind_nat: bool,
}

/// Whose addresses: this host's, or a peer host's; one family each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Group {
    Local { v6: bool },
    Peer { key: [u8; 32], v6: bool },
}

/// Computes the table, keeping from one call to the next each group's
/// shown address, the addresses where each was while moved, and the order
/// in which connections were first seen.
#[derive(Debug, Default)]
pub struct Hider {
    shown: HashMap<Group, IpAddr>,
    away: HashMap<Group, BTreeSet<IpAddr>>,
    first_seen: HashMap<VirtualFlow, u64>,
    seen_count: u64,
}

/// One connection of a group: its virtual and physical address on the
/// group's side, when it was first seen, and whether that side's virtual
/// address was a NAT's.
#[derive(Clone, Copy, Debug)]
struct Member {
    virt: IpAddr,
    phys: IpAddr,
    age: u64,
    natted: bool,
    flow: VirtualFlow,
    /// The remote physical endpoint (where a peer's end of it is now).
    remote_phys: SocketAddr,
}

impl Hider {
    /// The table for these connections.
    pub fn table(&mut self, conns: impl IntoIterator<Item = Seen>) -> HideTable {
        let mut conns: Vec<Seen> = conns.into_iter().collect();
        conns.sort_by_key(|c| c.flow);
        let live: HashSet<VirtualFlow> = conns.iter().map(|c| c.flow).collect();
        self.first_seen.retain(|f, _| live.contains(f));
        let mut groups: BTreeMap<Group, Vec<Member>> = BTreeMap::new();
        // Which hosts use each remote address (None: one vnatd knows no key of).
        let mut users: HashMap<IpAddr, HashSet<Option<[u8; 32]>>> = HashMap::new();
        for c in &conns {
            let age = *self.first_seen.entry(c.flow).or_insert_with(|| {
                self.seen_count += 1;
                self.seen_count
            });
            for a in [c.flow.remote.ip(), c.remote_phys.ip()] {
                users.entry(a).or_default().insert(c.peer);
            }
            groups
                .entry(Group::Local {
                    v6: c.flow.local.is_ipv6(),
                })
                .or_default()
                .push(Member {
                    virt: c.flow.local.ip(),
                    phys: c.local_phys.ip(),
                    age,
                    natted: false,
                    flow: c.flow,
                    remote_phys: c.remote_phys,
                });
            if let Some(key) = c.peer {
                groups
                    .entry(Group::Peer {
                        key,
                        v6: c.flow.remote.is_ipv6(),
                    })
                    .or_default()
                    .push(Member {
                        virt: c.flow.remote.ip(),
                        phys: c.remote_phys.ip(),
                        age,
                        natted: c.peer_behind_nat,
                        flow: c.flow,
                        remote_phys: c.remote_phys,
                    });
            }
        }
        // A group without connections has nothing to keep.
        self.shown.retain(|g, _| groups.contains_key(g));
        self.away.retain(|g, _| groups.contains_key(g));
        // Candidates per side: address -> the addresses it would map to.
        let mut show: [BTreeMap<IpAddr, BTreeSet<IpAddr>>; 2] = Default::default();
        let mut reach: [BTreeMap<IpAddr, BTreeSet<IpAddr>>; 2] = Default::default();
        // A peer's held endpoints -> where each is now (several: ambiguous).
        let mut held: BTreeMap<(Proto, SocketAddr), BTreeSet<SocketAddr>> = BTreeMap::new();
        for (group, members) in &groups {
            let peer = match group {
                Group::Peer { key, .. } => Some(*key),
                Group::Local { .. } => None,
            };
            // Only this host uses its own addresses. A peer's address is
            // redirected only if no other host uses it, not even one vnatd
            // has no key of; it is shown as another only if no other
            // known host uses it (the moved peer's own new connections
            // are of no known host until they are claimed).
            let used_only_by_it = |a: &IpAddr, unknown_ok: bool| {
                peer.is_none()
                    || users
                        .get(a)
                        .is_none_or(|u| u.iter().all(|o| *o == peer || (unknown_ok && o.is_none())))
            };
            let Some(plan) = self.plan(*group, members) else {
                continue;
            };
            let side = usize::from(peer.is_some());
            for a in &plan.shown_as {
                if used_only_by_it(a, true) {
                    show[side].entry(*a).or_default().insert(plan.shown);
                }
            }
            for (original, now) in &plan.reach {
                if !used_only_by_it(original, false) {
                    continue;
                }
                if peer.is_none() {
                    reach[side].entry(*original).or_default().insert(*now);
                    continue;
                }
                // The peer's: only the endpoints its moved connections held
                // at the original address, each to where it is now.
                for m in members
                    .iter()
                    .filter(|m| m.virt == *original && m.flow.remote != m.remote_phys)
                {
                    held.entry((m.flow.proto, m.flow.remote))
                        .or_default()
                        .insert(m.remote_phys);
                }
            }
            self.away.entry(*group).or_default().extend(plan.shown_as);
        }
        let single = |m: BTreeMap<IpAddr, BTreeSet<IpAddr>>| -> BTreeMap<IpAddr, IpAddr> {
            m.into_iter()
                .filter_map(|(a, to)| {
                    if to.len() > 1 {
                        tracing::debug!(address = %a, candidates = ?to, "hide location: the address stands for several moved hosts; shown as it is");
                        return None;
                    }
                    to.into_iter().next().map(|t| (a, t))
                })
                .collect()
        };
        let [local_show, remote_show] = show;
        let [local_reach, _] = reach;
        let remote_reach: BTreeMap<(Proto, SocketAddr), SocketAddr> = held
            .into_iter()
            .filter_map(|(held, to)| {
                if to.len() > 1 {
                    tracing::debug!(endpoint = %held.1, candidates = ?to, "hide location: the endpoint is now at several places; not redirected");
                    return None;
                }
                to.into_iter().next().map(|t| (held, t))
            })
            .collect();
        // The connections to those endpoints are left to tc, from their
        // own sockets.
        let translated = conns
            .iter()
            .filter(|c| c.peer.is_some() && c.flow.remote != c.remote_phys)
            .filter(|c| remote_reach.contains_key(&(c.flow.proto, c.flow.remote)))
            .map(|c| (c.flow.proto, c.flow.local.port(), c.flow.remote))
            .collect::<BTreeSet<(Proto, u16, SocketAddr)>>();
        HideTable {
            remote_show: single(remote_show),
            remote_reach,
            local_show: single(local_show),
            local_reach: single(local_reach),
            translated,
        }
    }

    /// One group's entries, or None while none of its connections moved.
    fn plan(&mut self, group: Group, members: &[Member]) -> Option<Plan> {
        let moved: Vec<&Member> = members.iter().filter(|m| m.virt != m.phys).collect();
        let away = self.away.get(&group).cloned().unwrap_or_default();
        // The addresses the applications knew the host at before it moved.
        let originals: BTreeSet<IpAddr> = moved
            .iter()
            .map(|m| m.virt)
            .filter(|v| !away.contains(v))
            .collect();
        let kept = self
            .shown
            .get(&group)
            .copied()
            .filter(|s| members.iter().any(|m| m.virt == *s));
        let shown = match kept {
            Some(s) => s,
            None => {
                let oldest = moved
                    .iter()
                    .filter(|m| originals.contains(&m.virt))
                    .min_by_key(|m| m.age)?
                    .virt;
                self.shown.insert(group, oldest);
                oldest
            }
        };
        if moved.is_empty() {
            return None;
        }
        let shown_as: BTreeSet<IpAddr> = moved
            .iter()
            .map(|m| m.phys)
            .chain(members.iter().map(|m| m.virt).filter(|v| away.contains(v)))
            .filter(|a| *a != shown && !originals.contains(a))
            .collect();
        let mut reach = Vec::new();
        for original in originals.iter().chain(std::iter::once(&shown)) {
            if reach.iter().any(|(o, _)| o == original) {
                continue;
            }
            let natted = members.iter().any(|m| m.virt == *original && m.natted);
            if let Some(now) = where_now(members, *original).filter(|_| !natted) {
                reach.push((*original, now));
            }
        }
        Some(Plan {
            shown,
            shown_as,
            reach,
        })
    }
}

/// What one group's applications see: `shown_as` are shown as `shown`;
/// each (original, now) is reached at now.
struct Plan {
    shown: IpAddr,
    shown_as: BTreeSet<IpAddr>,
    reach: Vec<(IpAddr, IpAddr)>,
}

/// Where the connections with virtual address `original` are now: the
/// physical address most of them use (the lowest on a tie), if that is not
/// `original` itself.
fn where_now(members: &[Member], original: IpAddr) -> Option<IpAddr> {
    let mut count: BTreeMap<IpAddr, usize> = BTreeMap::new();
    for m in members {
        if m.virt == original {
            *count.entry(m.phys).or_default() += 1;
        }
    }
    let best = count.values().copied().max()?;
    let now = count.into_iter().find(|(_, n)| *n == best)?.0;
    (now != original).then_some(now)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }
    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }
    const LAPTOP: [u8; 32] = [1; 32];
    const OTHER: [u8; 32] = [2; 32];

    /// A connection from the server's side: local `srv`, remote virtual
    /// `rv`, remote physical `rp`.
    fn at_server(proto: Proto, srv: &str, rv: &str, rp: &str, peer: [u8; 32]) -> Seen {
        Seen {
            flow: VirtualFlow {
                proto,
                local: sa(srv),
                remote: sa(rv),
            },
            local_phys: sa(srv),
            remote_phys: sa(rp),
            peer: Some(peer),
            peer_behind_nat: false,
        }
    }

    /// From the moving host's side: local virtual `lv`, physical `lp`.
    fn at_laptop(lv: &str, lp: &str, srv: &str) -> Seen {
        Seen {
            flow: VirtualFlow {
                proto: Proto::Tcp,
                local: sa(lv),
                remote: sa(srv),
            },
            local_phys: sa(lp),
            remote_phys: sa(srv),
            peer: Some([9; 32]),
            peer_behind_nat: false,
        }
    }

    #[test]
    fn nothing_moved_nothing_hidden() {
        let mut h = Hider::default();
        let t = h.table([at_server(
            Proto::Tcp,
            "10.0.9.1:21",
            "10.0.1.5:40000",
            "10.0.1.5:40000",
            LAPTOP,
        )]);
        assert!(t.is_empty(), "{t:?}");
    }

    #[test]
    fn a_moved_peer_is_shown_where_it_was_and_reached_where_it_is() {
        let mut h = Hider::default();
        // The FTP control connection, opened at A, now from B; a data
        // connection opened from B since.
        let t = h.table([
            at_server(
                Proto::Tcp,
                "10.0.9.1:21",
                "10.0.1.5:40000",
                "10.0.2.5:40000",
                LAPTOP,
            ),
            at_server(
                Proto::Tcp,
                "10.0.9.1:20",
                "10.0.2.5:40100",
                "10.0.2.5:40100",
                LAPTOP,
            ),
        ]);
        assert_eq!(
            t.remote_show,
            BTreeMap::from([(ip("10.0.2.5"), ip("10.0.1.5"))])
        );
        // Only the endpoint it held is reached where it is now.
        assert_eq!(
            t.remote_reach,
            BTreeMap::from([((Proto::Tcp, sa("10.0.1.5:40000")), sa("10.0.2.5:40000"))])
        );
        assert_eq!(
            t.translated,
            BTreeSet::from([(Proto::Tcp, 21, sa("10.0.1.5:40000"))])
        );
        assert!(t.local_show.is_empty() && t.local_reach.is_empty());
    }

    #[test]
    fn the_moving_host_shows_and_binds_its_old_address() {
        let mut h = Hider::default();
        let t = h.table([at_laptop("10.0.1.5:40000", "10.0.2.5:40000", "10.0.9.1:21")]);
        assert_eq!(
            t.local_show,
            BTreeMap::from([(ip("10.0.2.5"), ip("10.0.1.5"))])
        );
        assert_eq!(
            t.local_reach,
            BTreeMap::from([(ip("10.0.1.5"), ip("10.0.2.5"))])
        );
        assert!(t.remote_show.is_empty() && t.remote_reach.is_empty());
    }

    #[test]
    fn a_second_move_keeps_the_first_address_shown() {
        let mut h = Hider::default();
        // Opened at A, moved to B; one opened at B since.
        let t = h.table([
            at_laptop("10.0.1.5:40000", "10.0.2.5:40000", "10.0.9.1:21"),
            at_laptop("10.0.2.5:40100", "10.0.2.5:40100", "10.0.9.1:21"),
        ]);
        assert_eq!(
            t.local_show,
            BTreeMap::from([(ip("10.0.2.5"), ip("10.0.1.5"))])
        );
        // Both move on to C: B was where the host was away, so it is shown
        // as A too, and only A (the original) is reached at C.
        let t = h.table([
            at_laptop("10.0.1.5:40000", "10.0.3.5:40000", "10.0.9.1:21"),
            at_laptop("10.0.2.5:40100", "10.0.3.5:40100", "10.0.9.1:21"),
        ]);
        assert_eq!(
            t.local_show,
            BTreeMap::from([
                (ip("10.0.2.5"), ip("10.0.1.5")),
                (ip("10.0.3.5"), ip("10.0.1.5"))
            ])
        );
        assert_eq!(
            t.local_reach,
            BTreeMap::from([(ip("10.0.1.5"), ip("10.0.3.5"))])
        );
    }

    #[test]
    fn several_original_addresses_are_each_reached_and_none_is_shown_as_another() {
        let mut h = Hider::default();
        // Two connections opened from two addresses (IPv6 privacy
        // addresses, say), the second one first; both moved to P.
        h.table([at_server(
            Proto::Tcp,
            "[fd00:9::1]:21",
            "[fd00:1::20]:40000",
            "[fd00:1::20]:40000",
            LAPTOP,
        )]);
        let t = h.table([
            at_server(
                Proto::Tcp,
                "[fd00:9::1]:21",
                "[fd00:1::20]:40000",
                "[fd00:2::5]:40000",
                LAPTOP,
            ),
            at_server(
                Proto::Tcp,
                "[fd00:9::1]:22",
                "[fd00:1::10]:40001",
                "[fd00:2::5]:40001",
                LAPTOP,
            ),
        ]);
        // The oldest connection's address is shown for P; the other
        // original address stays itself (an existing connection's
        // getpeername never changes); both are reached at P.
        assert_eq!(
            t.remote_show,
            BTreeMap::from([(ip("fd00:2::5"), ip("fd00:1::20"))])
        );
        assert_eq!(
            t.remote_reach,
            BTreeMap::from([
                (
                    (Proto::Tcp, sa("[fd00:1::10]:40001")),
                    sa("[fd00:2::5]:40001")
                ),
                (
                    (Proto::Tcp, sa("[fd00:1::20]:40000")),
                    sa("[fd00:2::5]:40000")
                )
            ])
        );
    }

    #[test]
    fn an_address_another_host_uses_is_neither_shown_nor_redirected() {
        let mut h = Hider::default();
        // A peer that left the NAT address N, where a host vnatd has no
        // key of still talks to us from, for P.
        let moved = at_server(
            Proto::Tcp,
            "10.0.9.1:21",
            "192.0.2.1:50000",
            "10.0.2.5:50000",
            LAPTOP,
        );
        let mut other = at_server(
            Proto::Tcp,
            "10.0.9.1:21",
            "192.0.2.1:50001",
            "192.0.2.1:50001",
            OTHER,
        );
        other.peer = None;
        let t = h.table([moved, other]);
        assert!(t.remote_reach.is_empty(), "N is not only the peer's: {t:?}");
        assert!(t.translated.is_empty());
        assert_eq!(
            t.remote_show,
            BTreeMap::from([(ip("10.0.2.5"), ip("192.0.2.1"))])
        );
        // A known host that never moved, at P: P is not the moved peer's
        // alone, so it is shown as it is. (An unknown one's connection
        // at P may be the moved peer's own, not claimed yet.)
        let at_p = at_server(
            Proto::Tcp,
            "10.0.9.1:21",
            "10.0.2.5:50002",
            "10.0.2.5:50002",
            OTHER,
        );
        let t = h.table([moved, at_p]);
        assert!(t.remote_show.is_empty(), "{t:?}");
        assert_eq!(t.remote_reach.len(), 1);
    }

    #[test]
    fn a_peer_that_was_behind_a_nat_is_not_reached_through_the_nat_address() {
        let mut h = Hider::default();
        let mut c = at_server(
            Proto::Tcp,
            "10.0.9.1:21",
            "192.0.2.1:50000",
            "10.0.2.5:50000",
            LAPTOP,
        );
        c.peer_behind_nat = true;
        let t = h.table([c]);
        assert!(t.remote_reach.is_empty(), "others may be behind it: {t:?}");
        assert_eq!(
            t.remote_show,
            BTreeMap::from([(ip("10.0.2.5"), ip("192.0.2.1"))])
        );
    }

    #[test]
    fn moving_back_keeps_the_shown_address_and_shows_the_other_as_it() {
        let mut h = Hider::default();
        h.table([at_laptop("10.0.1.5:40000", "10.0.2.5:40000", "10.0.9.1:21")]);
        // Back at A: the first connection is native again; one opened at B
        // is translated to A now.
        let t = h.table([
            at_laptop("10.0.1.5:40000", "10.0.1.5:40000", "10.0.9.1:21"),
            at_laptop("10.0.2.5:40100", "10.0.1.5:40100", "10.0.9.1:21"),
        ]);
        assert_eq!(
            t.local_show,
            BTreeMap::from([(ip("10.0.2.5"), ip("10.0.1.5"))])
        );
        assert!(t.local_reach.is_empty(), "A is where it is: {t:?}");
    }

    #[test]
    fn two_moved_peers_behind_one_address_are_not_told_apart() {
        let mut h = Hider::default();
        let t = h.table([
            at_server(
                Proto::Tcp,
                "10.0.9.1:21",
                "10.0.1.5:40000",
                "192.0.2.1:50000",
                LAPTOP,
            ),
            at_server(
                Proto::Tcp,
                "10.0.9.1:21",
                "10.0.1.6:40000",
                "192.0.2.1:50001",
                OTHER,
            ),
        ]);
        assert!(
            !t.remote_show.contains_key(&ip("192.0.2.1")),
            "ambiguous: {t:?}"
        );
        // Each is still reached at the NAT's address.
        assert_eq!(t.remote_reach.len(), 2);
    }

    #[test]
    fn two_peers_that_left_one_address_are_not_reached_through_it() {
        let mut h = Hider::default();
        let t = h.table([
            at_server(
                Proto::Udp,
                "10.0.9.1:5000",
                "192.0.2.1:50000",
                "10.0.2.5:50000",
                LAPTOP,
            ),
            at_server(
                Proto::Udp,
                "10.0.9.1:5000",
                "192.0.2.1:50001",
                "10.0.3.6:50001",
                OTHER,
            ),
        ]);
        assert!(t.remote_reach.is_empty(), "{t:?}");
        assert!(t.translated.is_empty(), "{t:?}");
        assert_eq!(t.remote_show.len(), 2);
    }

    #[test]
    fn unpaired_connections_name_no_peer_and_families_stay_apart() {
        let mut h = Hider::default();
        let mut c = at_server(
            Proto::Tcp,
            "10.0.9.1:21",
            "10.0.1.5:40000",
            "10.0.2.5:40000",
            LAPTOP,
        );
        c.peer = None;
        let v6 = at_server(
            Proto::Tcp,
            "[fd00:9::1]:21",
            "[fd00:1::5]:40000",
            "[fd00:2::5]:40000",
            LAPTOP,
        );
        let t = h.table([c, v6]);
        assert_eq!(
            t.remote_show,
            BTreeMap::from([(ip("fd00:2::5"), ip("fd00:1::5"))])
        );
    }

    #[test]
    fn the_shown_address_is_forgotten_with_the_last_connection() {
        let mut h = Hider::default();
        h.table([at_laptop("10.0.2.5:40000", "10.0.3.5:40000", "10.0.9.1:21")]);
        assert!(h.table([]).is_empty());
        let t = h.table([at_laptop("10.0.1.5:40000", "10.0.3.5:40000", "10.0.9.1:21")]);
        assert_eq!(
            t.local_show,
            BTreeMap::from([(ip("10.0.3.5"), ip("10.0.1.5"))])
        );
    }

    /// Issue 31, item 4: a peer behind a NAT names its end by the NAT's
    /// address (as if it had none) and moves. It is reached, where it is
    /// now, at the one endpoint of that address it held, never at another
    /// port of it (another host's behind the same NAT).
    #[test]
    fn a_peer_naming_its_nat_address_as_its_own_is_reached_only_where_it_held_it() {
        let mut h = Hider::default();
        let lying = at_server(
            Proto::Udp,
            "10.0.9.1:5060",
            "192.0.2.1:40000",
            "203.0.113.7:40000",
            LAPTOP,
        );
        assert!(!lying.peer_behind_nat, "it says it has no NAT");
        let t = h.table([lying]);
        assert_eq!(
            t.remote_reach,
            BTreeMap::from([((Proto::Udp, sa("192.0.2.1:40000")), sa("203.0.113.7:40000"))]),
            "only the endpoint it held"
        );
        assert!(
            !t.remote_reach
                .keys()
                .any(|(_, e)| e.ip() == ip("192.0.2.1") && e.port() != 40000),
            "{t:?}"
        );
    }
}
