//! Hide location (paper section 3.4.1): which address the applications of
//! a hiding cgroup are shown for each moved host, and where their new
//! connections to it go. Sans-IO: connections in, a [`HideTable`] out, for
//! `Datapath::set_hidden`.
//!
//! A host that moved keeps one address for the applications: the virtual
//! address of its connections opened before the move (its "shown"
//! address). Every other address its connections use now, where it is and
//! the virtual addresses of connections opened since, is shown as that
//! one; a new connection or datagram to the shown address goes to where
//! the host is now. The same holds for this host's own moves (getsockname
//! and bind) and for each peer host (getpeername, accept, recvmsg, connect
//! and sendmsg), told apart by its key.
//!
//! The shown address stays the same while connections use it, so that a
//! host that moves twice, or moves back, keeps being shown where its
//! applications first saw it. An address that would be shown as two
//! different ones (two moved peers behind one NAT address) is shown as it
//! is: nothing can tell which host a new connection from it belongs to.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::{IpAddr, SocketAddr},
};

use crate::datapath::{HideTable, Proto, VirtualFlow};

/// One connection as VCMP has it.
#[derive(Clone, Copy, Debug)]
pub struct Seen {
    pub flow: VirtualFlow,
    pub local_phys: SocketAddr,
    pub remote_phys: SocketAddr,
    /// The peer host's key (none before pairing: its peer side is skipped).
    pub peer: Option<[u8; 32]>,
}

/// Whose addresses: this host's, or a peer host's; one family each.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Group {
    Local { v6: bool },
    Peer { key: [u8; 32], v6: bool },
}

/// Computes the table, keeping each group's shown address from one call
/// to the next.
#[derive(Debug, Default)]
pub struct Hider {
    shown: HashMap<Group, IpAddr>,
}

/// A group's connections: (virtual address, physical address, the flow).
type Members = Vec<(IpAddr, IpAddr, VirtualFlow)>;

impl Hider {
    /// The table for these connections.
    pub fn table(&mut self, conns: impl IntoIterator<Item = Seen>) -> HideTable {
        let mut groups: BTreeMap<Group, Members> = BTreeMap::new();
        for c in conns {
            let v6 = c.flow.local.is_ipv6();
            groups.entry(Group::Local { v6 }).or_default().push((
                c.flow.local.ip(),
                c.local_phys.ip(),
                c.flow,
            ));
            if let Some(key) = c.peer {
                let v6 = c.flow.remote.is_ipv6();
                groups.entry(Group::Peer { key, v6 }).or_default().push((
                    c.flow.remote.ip(),
                    c.remote_phys.ip(),
                    c.flow,
                ));
            }
        }
        // A group without connections has nothing to keep.
        self.shown.retain(|g, _| groups.contains_key(g));
        // Candidates per side: address -> the shown ones it would map to.
        let mut show: [BTreeMap<IpAddr, BTreeSet<IpAddr>>; 2] = Default::default();
        let mut reach: [BTreeMap<IpAddr, BTreeSet<IpAddr>>; 2] = Default::default();
        // Translated flows to a remote address that may get a reach entry.
        let mut moved_flows: Vec<VirtualFlow> = Vec::new();
        for (group, members) in &groups {
            let side = usize::from(matches!(group, Group::Peer { .. }));
            let Some(shown) = self.shown_for(*group, members) else {
                continue;
            };
            for (virt, phys, flow) in members {
                if virt == phys {
                    continue;
                }
                for a in [virt, phys] {
                    if *a != shown {
                        show[side].entry(*a).or_default().insert(shown);
                    }
                }
                if side == 1 {
                    moved_flows.push(*flow);
                }
            }
            if let Some(now) = where_now(members, shown) {
                reach[side].entry(shown).or_default().insert(now);
            }
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
        let [local_reach, remote_reach] = reach;
        let remote_reach = single(remote_reach);
        let translated = moved_flows
            .into_iter()
            .filter(|f| remote_reach.contains_key(&f.remote.ip()))
            .map(|f| (f.proto, f.local.port(), f.remote))
            .collect::<BTreeSet<(Proto, u16, SocketAddr)>>();
        HideTable {
            remote_show: single(remote_show),
            remote_reach,
            local_show: single(local_show),
            local_reach: single(local_reach),
            translated,
        }
    }

    /// The group's shown address: the one it had, while some connection
    /// still has it as virtual address; else the lowest virtual address of
    /// its moved connections. None while none of them moved.
    fn shown_for(&mut self, group: Group, members: &Members) -> Option<IpAddr> {
        let kept = self
            .shown
            .get(&group)
            .copied()
            .filter(|s| members.iter().any(|(v, _, _)| v == s));
        let moved = members.iter().filter(|(v, p, _)| v != p);
        let shown = match kept {
            Some(s) => s,
            None => {
                let first = moved.clone().map(|(v, _, _)| *v).min()?;
                self.shown.insert(group, first);
                first
            }
        };
        moved.clone().next().map(|_| shown)
    }
}

/// Where the connections with virtual address `shown` are now: the
/// physical address most of them use (the lowest on a tie), if that is not
/// `shown` itself.
fn where_now(members: &Members, shown: IpAddr) -> Option<IpAddr> {
    let mut count: BTreeMap<IpAddr, usize> = BTreeMap::new();
    for (v, p, _) in members {
        if *v == shown {
            *count.entry(*p).or_default() += 1;
        }
    }
    let best = count.values().copied().max()?;
    let now = count.into_iter().find(|(_, n)| *n == best)?.0;
    (now != shown).then_some(now)
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
        assert_eq!(
            t.remote_reach,
            BTreeMap::from([(ip("10.0.1.5"), ip("10.0.2.5"))])
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
        h.table([at_laptop("10.0.2.5:40000", "10.0.3.5:40000", "10.0.9.1:21")]);
        // Before that, from the first one's point of view: it was opened at
        // 10.0.2.5, moved; now a connection from 10.0.1.5 (lower) appears
        // moved too: the shown address stays the one already shown.
        let t = h.table([
            at_laptop("10.0.2.5:40000", "10.0.3.5:40000", "10.0.9.1:21"),
            at_laptop("10.0.1.5:40001", "10.0.3.5:40001", "10.0.9.1:21"),
        ]);
        assert_eq!(
            t.local_show,
            BTreeMap::from([
                (ip("10.0.1.5"), ip("10.0.2.5")),
                (ip("10.0.3.5"), ip("10.0.2.5"))
            ])
        );
        assert_eq!(
            t.local_reach,
            BTreeMap::from([(ip("10.0.2.5"), ip("10.0.3.5"))])
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
}
