//! Scenario tests on the simulator: an IPv4 connection is carried over
//! IPv6 when its host lands on a network with only IPv6 (the peer has
//! both), and comes back (issue 32, item 3; `vcmp::family`).

use std::net::SocketAddr;
use std::time::Duration;

use super::endpoint::{Config, Event};
use super::sim::{ip, reverse, Link, Sim};
use super::sim_tests::{setup, A_IP, B_IP};
use crate::flow::VirtualFlow;
use crate::stats::{Counter, Reject};

const A6: &str = "2001:db8:a::1";
const B6: &str = "2001:db8:b::2";

/// Three TCP connections from A to B over IPv4; B is reached over IPv6
/// too, and both hosts told each other their addresses (after pairing:
/// the change itself sends the PROBE that tells them).
fn dual_stack(seed: u64) -> (Sim, Vec<VirtualFlow>) {
    let (mut sim, flows) = setup(seed, Link::default(), Config::default(), 3);
    sim.hosts[1].also.push(ip(B6));
    // What is never told: loopback, link-local.
    sim.with(0, |ep, _, _| {
        ep.set_host_addresses([ip(A_IP), ip(A6), ip("127.0.0.1"), ip("fe80::1")])
    });
    sim.with(1, |ep, _, _| {
        ep.set_host_addresses([ip(B6), ip(B_IP), ip("::1")])
    });
    sim.run_for(Duration::from_secs(1));
    (sim, flows)
}

/// Host 0 lost its IPv4 address and has `to` only: each connection goes
/// on from `to` to where its peer told us it is over IPv6.
fn move_across(sim: &mut Sim, flows: &[VirtualFlow], to: &str) {
    move_across_naming(sim, flows, to, to);
}

/// [`move_across`], host 0 reached at `at` while its updates name `named`.
fn move_across_naming(sim: &mut Sim, flows: &[VirtualFlow], at: &str, named: &str) {
    sim.move_host(0, at);
    let to = named;
    let moves: Vec<_> = flows
        .iter()
        .map(|f| {
            let peer = sim.hosts[0]
                .ep
                .other_family_remote(f)
                .expect("the peer's address in the other family");
            (*f, SocketAddr::new(ip(to), f.local.port()), Some(peer))
        })
        .collect();
    sim.with(0, |ep, now, rng| {
        ep.resume_across(now, rng, &moves)
            .expect("resume across families")
    });
}

fn at(sim: &Sim, h: usize, want: impl Fn(&Event) -> bool) -> Option<crate::Timestamp> {
    sim.events(h, want).next().map(|(t, _)| *t)
}

#[test]
fn paired_hosts_learn_each_others_addresses_from_their_probes() {
    let (sim, flows) = dual_stack(31);
    let b_key = sim.hosts[1].ep.public_key();
    let a_key = sim.hosts[0].ep.public_key();
    assert_eq!(sim.hosts[0].ep.peer_addresses(&b_key), &[ip(B_IP), ip(B6)]);
    assert_eq!(sim.hosts[1].ep.peer_addresses(&a_key), &[ip(A_IP), ip(A6)]);
    assert_eq!(
        sim.hosts[0].ep.other_family_remote(&flows[0]),
        Some(SocketAddr::new(ip(B6), 22))
    );
    // An IPv6 connection is never carried over IPv4.
    let v6 = super::sim::tcp("[2001:db8:a::1]:40000", "[2001:db8:b::2]:22");
    assert_eq!(sim.hosts[0].ep.other_family_remote(&v6), None);
}

#[test]
fn an_ipv4_connection_goes_on_over_ipv6_and_comes_back() {
    let (mut sim, flows) = dual_stack(32);
    move_across(&mut sim, &flows, A6);
    sim.run_for(Duration::from_secs(10));
    for f in &flows {
        let a = sim.hosts[0].ep.connection(f).expect("flow on A");
        let b = sim.hosts[1].ep.connection(&reverse(f)).expect("flow on B");
        let a_end = SocketAddr::new(ip(A6), f.local.port());
        let b_end = SocketAddr::new(ip(B6), 22);
        assert!(!a.migrating && a.pending_remote.is_none() && b.pending_remote.is_none());
        assert_eq!((a.local_phys, a.remote_phys), (a_end, b_end), "A: {f:?}");
        // B's end followed into IPv6, at the address the update came to:
        // the two datapaths translate mirror images of one pair.
        assert_eq!((b.local_phys, b.remote_phys), (b_end, a_end), "B: {f:?}");
        // B is there because A moved, A because it moved itself.
        assert!(b.follows_peer && !a.follows_peer, "{f:?}");
        // Each end sends from its new pair only once the other end's
        // receive side is ready for it.
        let b_ready = at(&sim, 1, |e| {
            matches!(e, Event::PrepareReceive { flow, local, remote }
                if *flow == reverse(f) && *local == b_end && *remote == a_end)
        })
        .expect("B prepares its receive side for A's IPv6 end");
        let a_ready = at(&sim, 0, |e| {
            matches!(e, Event::PrepareReceive { flow, local, remote }
                if flow == f && *local == a_end && *remote == b_end)
        })
        .expect("A prepares its receive side for B's IPv6 end");
        let a_sends = at(
            &sim,
            0,
            |e| matches!(e, Event::SetRemote { flow, remote } if flow == f && *remote == b_end),
        )
        .expect("A validates B's IPv6 address");
        let b_sends = at(&sim, 1, |e| {
            matches!(e, Event::SetRemote { flow, remote } if *flow == reverse(f) && *remote == a_end)
        })
        .expect("B validates A's IPv6 address");
        assert!(b_ready <= a_sends && a_ready <= b_sends);
        // Nothing was sent before validation across families.
        assert!(at(&sim, 1, |e| matches!(e, Event::SendUnvalidated { .. })).is_none());
    }
    assert!(sim.hosts[1].ep.stats().get(Counter::FamilyChanged) >= 3);

    // A's IPv4 address is back: the connections return to their own
    // addresses, untranslated on both ends.
    move_across(&mut sim, &flows, A_IP);
    sim.run_for(Duration::from_secs(10));
    for f in &flows {
        let a = sim.hosts[0].ep.connection(f).expect("flow on A");
        let b = sim.hosts[1].ep.connection(&reverse(f)).expect("flow on B");
        assert!(!a.migrating && a.pending_remote.is_none() && b.pending_remote.is_none());
        assert_eq!(
            (a.local_phys, a.remote_phys),
            (f.local, f.remote),
            "A: {f:?}"
        );
        assert_eq!(
            (b.local_phys, b.remote_phys),
            (f.remote, f.local),
            "B: {f:?}"
        );
        assert!(!b.follows_peer, "{f:?}");
    }
    assert_eq!(sim.hosts[1].ep.stats().rejected(Reject::NoLocalInFamily), 0);
}

/// A's update reaches B over IPv6, but A is not heard again there: B's
/// validation of A's IPv6 address fails, and B's end goes back to IPv4
/// with the last validated address (the datapath cannot translate
/// between an end of each family).
#[test]
fn a_failed_validation_takes_the_peers_end_back_to_its_family() {
    let (mut sim, flows) = dual_stack(33);
    move_across(&mut sim, &flows, A6);
    // The update is on the wire; from now on A's datagrams are lost.
    sim.hosts[0].mute = true;
    sim.run_for(Duration::from_secs(120));
    // B had followed A into IPv6 before it gave up.
    assert!(sim.hosts[1].ep.stats().get(Counter::FamilyChanged) >= 3);
    for f in &flows {
        let b = sim.hosts[1].ep.connection(&reverse(f)).expect("flow on B");
        assert!(
            at(
                &sim,
                1,
                |e| matches!(e, Event::Reverted { flow, .. } if *flow == reverse(f))
            )
            .is_some(),
            "B gives A's IPv6 address up: {f:?}"
        );
        assert_eq!(
            (b.local_phys, b.remote_phys),
            (f.remote, f.local),
            "B: {f:?}"
        );
        assert!(b.pending_remote.is_none() && !b.follows_peer);
    }
}

/// A vnatd that restarts finds such a connection translated in the
/// datapath and takes it up again as it is; an end in each family is no
/// connection.
#[test]
fn a_connection_carried_over_ipv6_can_be_taken_up_again() {
    let mut sim = Sim::new(34, Link::default());
    let a = sim.add_host(A_IP, Config::default());
    let f = super::sim::tcp("10.0.0.1:40000", "10.0.0.2:22");
    let binding = super::binding::Binding::endpoints(&f);
    let (l6, r6) = (SocketAddr::new(ip(A6), 40000), SocketAddr::new(ip(B6), 22));
    sim.with(a, |ep, now, rng| {
        ep.connection_added(now, rng, f, l6, r6, binding)
            .expect("an IPv4 connection carried over IPv6")
    });
    let g = super::sim::tcp("10.0.0.1:40001", "10.0.0.2:22");
    let err = sim.with(a, |ep, now, rng| {
        ep.connection_added(now, rng, g, l6, g.remote, binding)
    });
    assert!(err.is_err(), "one end in each family: {err:?}");
    let v6 = super::sim::tcp("[2001:db8:a::1]:40000", "[2001:db8:b::2]:22");
    let err = sim.with(a, |ep, now, rng| {
        ep.connection_added(now, rng, v6, f.local, f.remote, binding)
    });
    assert!(err.is_err(), "an IPv6 connection over IPv4: {err:?}");
}

/// A's addresses change twice in a row (its IPv4 address goes first, then
/// the IPv6 address of the same network, then B's IPv6 address comes): its
/// first update names the address it is losing and leaves, by the kernel's
/// choice, from the new one. That is no NAT: B validates what each update
/// names, never takes the address it came from with a port to learn (the
/// rebind of a NAT is for the connection's own family), and ends at A's
/// second IPv6 address.
#[test]
fn an_update_across_families_from_another_address_is_no_nat() {
    let (mut sim, flows) = dual_stack(37);
    let first = "2001:db8:a::1";
    let second = "2001:db8:a::2";
    // The update names `first` but A is already reached only at `second`.
    move_across_naming(&mut sim, &flows, second, first);
    sim.run_for(Duration::from_millis(50));
    // Then A moves on to `second` itself.
    let moves: Vec<_> = flows
        .iter()
        .map(|f| (*f, SocketAddr::new(ip(second), f.local.port()), None))
        .collect();
    sim.with(0, |ep, now, rng| {
        ep.resume_across(now, rng, &moves).expect("resume")
    });
    sim.run_for(Duration::from_secs(30));
    for f in &flows {
        assert!(
            sim.events(1, |e| matches!(e, Event::SetRemote { flow, remote }
                if *flow == reverse(f) && remote.port() == 0))
                .next()
                .is_none(),
            "B took A for a NAT: {f:?}"
        );
        let b = sim.hosts[1].ep.connection(&reverse(f)).expect("flow on B");
        assert_eq!(
            b.remote_phys,
            SocketAddr::new(ip(second), f.local.port()),
            "B: {f:?}"
        );
    }
    assert_eq!(sim.hosts[1].ep.stats().get(Counter::PeerBehindNat), 0);
}

/// What `Endpoint::placements` (the planner's single pass over the table)
/// says of each connection on host `h` is what its view and
/// `other_family_remote` say. Returns how many it listed.
fn placements_agree(sim: &Sim, h: usize) -> usize {
    let ep = &sim.hosts[h].ep;
    let mut n = 0;
    for p in ep.placements() {
        let v = ep.connection(&p.flow).expect("a tracked connection");
        assert_eq!(
            (p.local_phys, p.remote_phys, p.migrating, p.follows_peer),
            (v.local_phys, v.remote_phys, v.migrating, v.follows_peer),
            "{:?}",
            p.flow
        );
        assert_eq!(p.across, ep.other_family_remote(&p.flow), "{:?}", p.flow);
        assert_eq!(ep.is_migrating(&p.flow), Some(p.migrating));
        assert!(ep.has_connection(&p.flow));
        n += 1;
    }
    assert_eq!(n, ep.connection_count());
    n
}

#[test]
fn placements_agree_with_each_connections_view_through_a_move_across_families() {
    let (mut sim, flows) = dual_stack(33);
    assert_eq!(placements_agree(&sim, 0), flows.len());
    assert_eq!(placements_agree(&sim, 1), flows.len());
    assert!(sim.hosts[0].ep.placements().all(|p| p.across.is_some()));
    move_across(&mut sim, &flows, A6);
    assert!(sim.hosts[0].ep.placements().all(|p| p.migrating));
    placements_agree(&sim, 0);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[0].ep.placements().all(|p| !p.migrating));
    assert!(sim.hosts[1].ep.placements().all(|p| p.follows_peer));
    assert_eq!(placements_agree(&sim, 0), flows.len());
    assert_eq!(placements_agree(&sim, 1), flows.len());
    let gone = super::sim::tcp("198.51.100.9:1", "198.51.100.10:2");
    assert!(!sim.hosts[0].ep.has_connection(&gone));
    assert_eq!(sim.hosts[0].ep.is_migrating(&gone), None);
}
