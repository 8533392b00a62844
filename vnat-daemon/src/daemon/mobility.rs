//! Automatic mode's decisions (DESIGN.md §5): which connections lost their
//! local address and where each can continue. Pure functions over the
//! datapath's and the protocol core's views, so they are unit-tested without
//! a kernel.

use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
};

use crate::datapath::{Proto, Translation, VirtualFlow};

/// One connection as the driver tracks it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tracked {
    pub flow: VirtualFlow,
    pub local_phys: SocketAddr,
    pub remote_phys: SocketAddr,
    /// A migration of this connection is under way.
    pub migrating: bool,
    /// An operator placed it at `local_phys` (`vnatctl migrate`): it stays
    /// there while that address exists, even where its virtual address is
    /// still up (the old link of a multihomed host).
    pub placed: bool,
    /// A routed container's connection (its virtual address is the
    /// container's, never one of this host's): the host address whose
    /// presence stands for the virtual address's. The network that routes
    /// the container's prefix to this host is the one that address is on.
    pub anchor: Option<IpAddr>,
    /// Where its peer is reached in the other IP family than now (an IPv4
    /// connection only: the peer's IPv6 address it told us, or, while the
    /// connection is carried over IPv6, its IPv4 end;
    /// `Endpoint::other_family_remote`).
    pub across: Option<SocketAddr>,
    /// Its end is in the other family because the peer moved there
    /// (`ConnectionView::follows_peer`): its virtual address being here is
    /// no return home, and it stays in that family while it can.
    pub follows_peer: bool,
}

/// A decided move: continue `flow` from `new_local`, with its peer at
/// `remote_phys` (its current end, or its end in the other family when
/// the move crosses between IPv4 and IPv6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub flow: VirtualFlow,
    pub new_local: SocketAddr,
    pub remote_phys: SocketAddr,
}

/// Whether vnat should manage a recorded flow at all: never loopback or
/// link-local traffic (it cannot move), never VCMP itself.
pub fn is_mobile_candidate(flow: &VirtualFlow, vcmp_port: u16) -> bool {
    let local_only = |ip: IpAddr| match ip {
        IpAddr::V4(v4) => v4.is_loopback() || v4.is_link_local() || v4.is_unspecified(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.is_unspecified() || (v6.segments()[0] & 0xffc0) == 0xfe80
        }
    };
    let vcmp = flow.proto == Proto::Udp
        && (flow.local.port() == vcmp_port || flow.remote.port() == vcmp_port);
    !vcmp && !local_only(flow.local.ip()) && !local_only(flow.remote.ip())
}

/// Why a UDP flow is not managed yet: this host has only received from
/// the peer, and a source address proves nothing.
pub const INBOUND_ONLY: &str =
    "a UDP source this host has only received from: it becomes mobile once this host answers it";

/// Why a newly seen connection is not managed although it is a candidate:
/// its local address is not one of this host's.
pub const NOT_OUR_ADDRESS: &str =
    "its local address is not one of this host's (an IP_FREEBIND or IP_TRANSPARENT socket)";

/// Connections whose local physical address is no longer on any interface,
/// moved to the address the kernel now uses towards their peer.
///
/// A connection whose virtual address came back (the laptop returned home)
/// moves back to it: continuing from the virtual address ends translation;
/// except one an operator placed elsewhere, while that place exists.
pub fn plan_moves(
    tracked: &[Tracked],
    addrs: &HashSet<IpAddr>,
    source_for: impl Fn(IpAddr) -> Option<IpAddr>,
) -> Vec<Move> {
    let mut out = Vec::new();
    for t in tracked.iter().filter(|t| !t.migrating) {
        // Where the virtual address is reachable: on this host, or, for a
        // routed container's, while the network that routes it is here.
        let virtual_here = match t.anchor {
            None => addrs.contains(&t.flow.local.ip()),
            Some(a) => addrs.contains(&a),
        };
        let here = if t.local_phys == t.flow.local {
            virtual_here
        } else {
            addrs.contains(&t.local_phys.ip())
        };
        // A routed container's connection never goes back untranslated:
        // its address is where nothing speaks VCMP, so the peer could not
        // validate it; it stays on this host's addresses.
        let home = t.anchor.is_none()
            && !t.follows_peer
            && !(t.placed && here)
            && t.local_phys != t.flow.local
            && virtual_here;
        // The peer's end in each family: where it is now, and where it is
        // reached in the other one (an IPv4 connection carried over IPv6
        // and back, `vcmp::family`).
        let same = |ip: &IpAddr| ip.is_ipv4() == t.remote_phys.is_ipv4();
        let target = if home {
            let remote = if same(&t.flow.local.ip()) {
                Some(t.remote_phys)
            } else {
                t.across
            };
            remote.map(|r| (t.flow.local.ip(), r))
        } else if !here {
            // Where the kernel would send to the peer from: in the
            // connection's own family first (no translation between
            // families), then in the other.
            let via = |r: SocketAddr| {
                source_for(r.ip())
                    .filter(|ip| addrs.contains(ip) && ip.is_ipv4() == r.is_ipv4())
                    .map(|ip| (ip, r))
            };
            let own_first = if t.follows_peer || t.remote_phys.is_ipv4() == t.flow.local.is_ipv4() {
                [Some(t.remote_phys), t.across]
            } else {
                [t.across, Some(t.remote_phys)]
            };
            own_first.into_iter().flatten().find_map(via)
        } else {
            None
        };
        if let Some((ip, remote)) = target {
            if ip != t.local_phys.ip() {
                out.push(Move {
                    flow: t.flow,
                    new_local: SocketAddr::new(ip, t.flow.local.port()),
                    remote_phys: remote,
                });
            }
        }
    }
    out
}

/// The remote addresses whose routes a plan over `tracked` needs (see
/// [`plan_moves`]'s `source_for`).
pub fn plan_remotes(tracked: &[Tracked]) -> HashSet<IpAddr> {
    tracked
        .iter()
        .flat_map(|t| [Some(t.remote_phys), t.across])
        .flatten()
        .map(|r| r.ip())
        .collect()
}

/// A suspended connection whose keepalive vnatd holds (turned off) until
/// it works again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldKeepalive {
    pub since: std::time::Instant,
    /// Where our end was when the hold began.
    pub local_at_hold: SocketAddr,
    /// `vnatctl resume` was asked since.
    pub resume_asked: bool,
}

/// How long a keepalive is held at most, whatever happens.
pub const MAX_KEEPALIVE_HOLD: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// Whether a held keepalive goes back on now: once its connection works
/// again, i.e. no move of it is under way, its local address is one of this
/// host's, a route leads to its peer (`routed`), and either `resume` was
/// asked (or nobody suspended it: an unannounced outage's hold) or it
/// moved since the hold began (automatic mode). Not at the `resume` command itself: a laptop resumes
/// at wake, before its network is back, and a keepalive turned on then
/// probes a peer it cannot reach yet. At the latest after
/// [`MAX_KEEPALIVE_HOLD`].
pub fn keepalive_release_due(
    held: &HeldKeepalive,
    local_phys: SocketAddr,
    migrating: bool,
    addrs: &HashSet<IpAddr>,
    routed: bool,
    now: std::time::Instant,
) -> bool {
    if now.duration_since(held.since) >= MAX_KEEPALIVE_HOLD {
        return true;
    }
    !migrating
        && routed
        && addrs.contains(&local_phys.ip())
        && (held.resume_asked || local_phys != held.local_at_hold)
}

/// Where our send side goes when our own move completes (`Resumed`): to
/// (`local`, the peer's last validated endpoint), unless the peer moved too
/// and its new endpoint is still being validated. Then its validated endpoint
/// is its *old* location, where the peer has no receive side for our new
/// address, and sending there can only be lost or, if that address still
/// reaches the peer's host, answered with a reset. So wait: `SetRemote` (or
/// `Reverted`) follows and switches the send side to the right pair. Until
/// then the socket's packets leave untranslated, i.e. addressed to the
/// peer's virtual endpoint, which a host keeps local after it moves.
pub fn send_side_after_resume(
    local: SocketAddr,
    remote_phys: SocketAddr,
    pending_remote: Option<SocketAddr>,
) -> Option<(SocketAddr, SocketAddr)> {
    match pending_remote {
        Some(p) if p != remote_phys => None,
        _ => Some((local, remote_phys)),
    }
}

/// The extra receive-side entry a both-ends move needs: packets from the
/// peer's `remote` to our *virtual* address (our old location, kept on `lo`).
///
/// The peer sends there while it has not yet learnt (or validated) our new
/// address, e.g. when our old address is still routed to us (the paper's
/// section 4.2, step 2: the old location still answers). Without an entry
/// such a packet matches no socket and the kernel resets it, and the reset
/// reaches the peer's socket through the peer's translation. Nothing is
/// needed when our end did not move (the packet is already addressed to the
/// socket) or the peer's did not (the packet is the socket's own 4-tuple).
pub fn old_address_receive_side(
    flow: VirtualFlow,
    local: SocketAddr,
    remote: SocketAddr,
) -> Option<Translation> {
    // (Not for a connection carried in the other family: its virtual
    // address cannot receive from there.)
    (local != flow.local && remote != flow.remote && remote.is_ipv4() == flow.local.is_ipv4())
        .then_some(Translation {
            flow,
            physical_local: flow.local,
            physical_remote: remote,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn tracked(local: &str, phys: &str, remote: &str) -> Tracked {
        let flow = VirtualFlow {
            proto: Proto::Tcp,
            local: sa(local),
            remote: sa(remote),
        };
        Tracked {
            flow,
            local_phys: sa(phys),
            remote_phys: sa(remote),
            migrating: false,
            placed: false,
            anchor: None,
            across: None,
            follows_peer: false,
        }
    }

    fn addrs(list: &[&str]) -> HashSet<IpAddr> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn a_connection_whose_address_vanished_moves_to_the_routed_source() {
        let t = [tracked(
            "198.18.1.2:4000",
            "198.18.1.2:4000",
            "198.18.3.2:22",
        )];
        let moves = plan_moves(&t, &addrs(&["198.18.2.2"]), |_| {
            Some("198.18.2.2".parse().unwrap())
        });
        assert_eq!(
            moves,
            vec![Move {
                flow: t[0].flow,
                new_local: sa("198.18.2.2:4000"),
                remote_phys: sa("198.18.3.2:22")
            }]
        );
    }

    /// The kernel's source towards each destination, by family: IPv4
    /// `v4` (None: no IPv4 route), IPv6 `v6`.
    fn routes(v4: Option<&'static str>, v6: &'static str) -> impl Fn(IpAddr) -> Option<IpAddr> {
        move |dst| match dst {
            IpAddr::V4(_) => v4.map(|a| a.parse().unwrap()),
            IpAddr::V6(_) => Some(v6.parse().unwrap()),
        }
    }

    #[test]
    fn an_ipv4_connection_with_no_ipv4_left_moves_to_the_peers_ipv6_address() {
        let mut t = tracked("198.18.1.2:4000", "198.18.1.2:4000", "198.18.3.2:22");
        t.across = Some(sa("[2001:db8:3::2]:22"));
        // Only IPv6 here (a network without IPv4): across families.
        let moves = plan_moves(
            &[t],
            &addrs(&["2001:db8:2::2"]),
            routes(None, "2001:db8:2::2"),
        );
        assert_eq!(
            moves,
            vec![Move {
                flow: t.flow,
                new_local: sa("[2001:db8:2::2]:4000"),
                remote_phys: sa("[2001:db8:3::2]:22")
            }]
        );
        // IPv4 on the new network too: the connection's own family first.
        let moves = plan_moves(
            &[t],
            &addrs(&["198.18.2.2", "2001:db8:2::2"]),
            routes(Some("198.18.2.2"), "2001:db8:2::2"),
        );
        assert_eq!(moves[0].new_local, sa("198.18.2.2:4000"));
        assert_eq!(moves[0].remote_phys, t.remote_phys);
        // A peer that told no IPv6 address: no move, as before.
        t.across = None;
        assert!(plan_moves(
            &[t],
            &addrs(&["2001:db8:2::2"]),
            routes(None, "2001:db8:2::2")
        )
        .is_empty());
    }

    #[test]
    fn a_connection_carried_over_ipv6_returns_to_ipv4_when_it_can() {
        // Carried over IPv6; its IPv4 end is the peer's virtual one.
        let mut t = tracked("198.18.1.2:4000", "[2001:db8:2::2]:4000", "198.18.3.2:22");
        t.remote_phys = sa("[2001:db8:3::2]:22");
        t.across = Some(sa("198.18.3.2:22"));
        // Home again: its own address is back.
        let moves = plan_moves(
            &[t],
            &addrs(&["198.18.1.2", "2001:db8:2::2"]),
            routes(Some("198.18.1.2"), "2001:db8:2::2"),
        );
        assert_eq!(
            moves,
            vec![Move {
                flow: t.flow,
                new_local: t.flow.local,
                remote_phys: t.flow.remote
            }]
        );
        // Its IPv6 address gone, IPv4 elsewhere: back to IPv4 from there.
        let moves = plan_moves(
            &[t],
            &addrs(&["198.18.4.2"]),
            routes(Some("198.18.4.2"), "2001:db8:9::9"),
        );
        assert_eq!(moves[0].new_local, sa("198.18.4.2:4000"));
        assert_eq!(moves[0].remote_phys, sa("198.18.3.2:22"));
        // Still on its IPv6 address, no IPv4: it stays.
        assert!(plan_moves(
            &[t],
            &addrs(&["2001:db8:2::2"]),
            routes(None, "2001:db8:2::2")
        )
        .is_empty());
        // The peer's end of the same connection, carried over IPv6 because
        // the peer moved there: its own IPv4 address never went, and
        // nothing of ours takes it back.
        let mut peer = t;
        peer.follows_peer = true;
        assert!(plan_moves(
            &[peer],
            &addrs(&["198.18.1.2", "2001:db8:2::2"]),
            routes(Some("198.18.1.2"), "2001:db8:2::2"),
        )
        .is_empty());
        assert_eq!(
            plan_remotes(&[t]),
            HashSet::from([ip("2001:db8:3::2"), ip("198.18.3.2")])
        );
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn nothing_moves_while_the_address_is_there_or_no_route_exists() {
        let t = [tracked(
            "198.18.1.2:4000",
            "198.18.1.2:4000",
            "198.18.3.2:22",
        )];
        assert!(
            plan_moves(&t, &addrs(&["198.18.1.2", "198.18.2.2"]), |_| Some(
                "198.18.2.2".parse().unwrap()
            ))
            .is_empty()
        );
        // Address gone, no new one yet (cable pulled): wait.
        assert!(plan_moves(&t, &addrs(&[]), |_| None).is_empty());
        // A route whose source is not one of ours (stale) is not used.
        assert!(plan_moves(&t, &addrs(&["198.18.2.2"]), |_| Some(
            "198.18.9.9".parse().unwrap()
        ))
        .is_empty());
        // An IPv6 source for an IPv4 connection is not used.
        assert!(plan_moves(&t, &addrs(&["fd00::1"]), |_| Some(
            "fd00::1".parse().unwrap()
        ))
        .is_empty());
    }

    #[test]
    fn coming_home_moves_back_to_the_virtual_address_and_migrating_ones_wait() {
        let mut t = [tracked(
            "198.18.1.2:4000",
            "198.18.2.2:4000",
            "198.18.3.2:22",
        )];
        let moves = plan_moves(&t, &addrs(&["198.18.1.2", "198.18.2.2"]), |_| None);
        assert_eq!(moves[0].new_local, sa("198.18.1.2:4000"));
        t[0].migrating = true;
        assert!(plan_moves(&t, &addrs(&["198.18.1.2"]), |_| None).is_empty());
    }

    #[test]
    fn a_placed_connection_stays_while_its_place_exists_then_moves_as_any() {
        // Migrated from the first link's address to the second's, with
        // the first still up: no "coming home".
        let mut t = [tracked(
            "198.18.1.2:4000",
            "198.18.2.2:4000",
            "198.18.3.2:22",
        )];
        t[0].placed = true;
        let both = addrs(&["198.18.1.2", "198.18.2.2"]);
        assert!(plan_moves(&t, &both, |_| Some("198.18.1.2".parse().unwrap())).is_empty());
        // The second link goes: it moves where the route says, home here.
        let moves = plan_moves(&t, &addrs(&["198.18.1.2"]), |_| {
            Some("198.18.1.2".parse().unwrap())
        });
        assert_eq!(moves[0].new_local, sa("198.18.1.2:4000"));
        // Not placed: the same connection goes home while both are up.
        t[0].placed = false;
        assert_eq!(
            plan_moves(&t, &both, |_| None)[0].new_local,
            sa("198.18.1.2:4000")
        );
    }

    #[test]
    fn a_routed_containers_connection_moves_with_its_anchor() {
        // The container's own address (never one of the host's), reached
        // through the network the host's 198.18.1.2 is on.
        let mut t = [tracked(
            "[2001:db8:88::2]:4000",
            "[2001:db8:88::2]:4000",
            "[fd00:5e:3::2]:22",
        )];
        t[0].anchor = Some("fd00:5e:1::2".parse().unwrap());
        let new = |_| Some("fd00:5e:2::2".parse().unwrap());
        // The anchor is here: nothing moves, although the container's
        // address is no address of this host's.
        assert!(plan_moves(&t, &addrs(&["fd00:5e:1::2", "fd00:5e:2::2"]), new).is_empty());
        // The anchor went: the connection moves to the new source.
        let moves = plan_moves(&t, &addrs(&["fd00:5e:2::2"]), new);
        assert_eq!(moves[0].new_local, sa("[fd00:5e:2::2]:4000"));
        // Moved; the anchor's network is back: it stays translated (the
        // peer could not validate the container's address).
        t[0].local_phys = sa("[fd00:5e:2::2]:4000");
        assert!(plan_moves(&t, &addrs(&["fd00:5e:1::2", "fd00:5e:2::2"]), new).is_empty());
        // Its new address goes too: on to where the route says, the
        // anchor's network included, translated.
        let back = |_| Some("fd00:5e:1::2".parse().unwrap());
        let moves = plan_moves(&t, &addrs(&["fd00:5e:1::2"]), back);
        assert_eq!(moves[0].new_local, sa("[fd00:5e:1::2]:4000"));
    }

    #[test]
    fn a_held_keepalive_goes_back_on_when_the_connection_works_again() {
        let t0 = std::time::Instant::now();
        let here = sa("198.18.1.2:4000");
        let held = HeldKeepalive {
            since: t0,
            local_at_hold: here,
            resume_asked: false,
        };
        let none = addrs(&[]);
        let a = addrs(&["198.18.1.2"]);
        let b = addrs(&["198.18.2.2"]);
        // Suspended, nothing asked yet: held, even with the address here.
        assert!(!keepalive_release_due(&held, here, false, &a, true, t0));
        // Resumed at wake, the network not back: still held.
        let resumed = HeldKeepalive {
            resume_asked: true,
            ..held
        };
        assert!(!keepalive_release_due(
            &resumed, here, false, &none, true, t0
        ));
        // Its move under way: held.
        let there = sa("198.18.2.2:4000");
        assert!(!keepalive_release_due(&resumed, there, true, &b, true, t0));
        // Moved, or back where it was after resume: released.
        assert!(keepalive_release_due(&resumed, there, false, &b, true, t0));
        assert!(keepalive_release_due(&resumed, here, false, &a, true, t0));
        // Moved by automatic mode without resume: released too.
        assert!(keepalive_release_due(&held, there, false, &b, true, t0));
        // At the latest after the limit.
        assert!(keepalive_release_due(
            &held,
            here,
            false,
            &none,
            false,
            t0 + MAX_KEEPALIVE_HOLD
        ));
        // The address back but no route to the peer yet: held.
        assert!(!keepalive_release_due(&resumed, here, false, &a, false, t0));
    }

    #[test]
    fn our_send_side_waits_for_a_peer_that_moved_too() {
        let (local, old, new) = (
            sa("198.18.2.2:4000"),
            sa("198.18.3.2:22"),
            sa("198.18.5.2:22"),
        );
        assert_eq!(
            send_side_after_resume(local, old, None),
            Some((local, old)),
            "the peer stayed"
        );
        assert_eq!(
            send_side_after_resume(local, new, Some(new)),
            Some((local, new)),
            "nothing new pending"
        );
        assert_eq!(
            send_side_after_resume(local, old, Some(new)),
            None,
            "the peer's new address is not validated yet"
        );
    }

    #[test]
    fn the_old_address_takes_packets_only_when_both_ends_moved() {
        let flow = VirtualFlow {
            proto: Proto::Tcp,
            local: sa("198.18.3.2:22"),
            remote: sa("198.18.1.2:4000"),
        };
        let (us_new, peer_new) = (sa("198.18.5.2:22"), sa("198.18.2.2:4000"));
        assert_eq!(
            old_address_receive_side(flow, us_new, peer_new),
            Some(Translation {
                flow,
                physical_local: flow.local,
                physical_remote: peer_new
            })
        );
        assert_eq!(
            old_address_receive_side(flow, flow.local, peer_new),
            None,
            "we did not move"
        );
        assert_eq!(
            old_address_receive_side(flow, us_new, flow.remote),
            None,
            "the peer did not move"
        );
    }

    #[test]
    fn loopback_link_local_and_vcmp_flows_are_not_managed() {
        let f = |l: &str, r: &str, p| VirtualFlow {
            proto: p,
            local: sa(l),
            remote: sa(r),
        };
        assert!(is_mobile_candidate(
            &f("198.18.1.2:4000", "198.18.3.2:22", Proto::Tcp),
            2031
        ));
        assert!(!is_mobile_candidate(
            &f("127.0.0.1:4000", "127.0.0.1:22", Proto::Tcp),
            2031
        ));
        assert!(!is_mobile_candidate(
            &f("[fe80::1]:4000", "[fe80::2]:22", Proto::Tcp),
            2031
        ));
        assert!(!is_mobile_candidate(
            &f("198.18.1.2:2031", "198.18.3.2:2031", Proto::Udp),
            2031
        ));
        assert!(is_mobile_candidate(
            &f("198.18.1.2:2031", "198.18.3.2:80", Proto::Tcp),
            2031
        ));
    }
}
