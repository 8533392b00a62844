//! The move choreography without root: decisions against hand-made views,
//! the fake datapath running them, and the VCMP simulator for the ordering
//! rule (a receive side is asked for before anything the core queued in the
//! same turn leaves).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::*;
use crate::datapath::{fake::FakeDatapath, Datapath};
use crate::vcmp::AbortReason;

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn tcp(local: &str, remote: &str) -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Tcp,
        local: sa(local),
        remote: sa(remote),
    }
}

fn udp(local: &str, remote: &str) -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Udp,
        ..tcp(local, remote)
    }
}

/// A connection at its own addresses, with keys, not moving.
pub(crate) fn view(flow: VirtualFlow) -> ConnectionView {
    ConnectionView {
        flow,
        local_phys: flow.local,
        remote_phys: flow.remote,
        pending_remote: None,
        nat_candidate: None,
        peer_key: Some([7; 32]),
        seen_by_peer_as: None,
        peer_behind_nat: false,
        has_keys: true,
        role: None,
        migrating: false,
        follows_peer: false,
        binding_seq: 0,
        send_seq: 0,
    }
}

fn prepare(flow: VirtualFlow, local: SocketAddr, remote: SocketAddr) -> Event {
    Event::PrepareReceive {
        flow,
        local,
        remote,
    }
}

/// The core's view of `v` only, as the driver gives it.
fn only(v: &ConnectionView) -> impl Fn(&VirtualFlow) -> Option<ConnectionView> + '_ {
    move |f| (*f == v.flow).then(|| v.clone())
}

#[test]
fn a_peer_s_announced_address_gets_a_receive_side_once_and_again_after_our_move() {
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let peer_new = sa("10.9.0.2:443");
    let mut v = view(f);
    v.pending_remote = Some(peer_new);
    let mut m = Mover::new();
    let want = Translation {
        flow: f,
        physical_local: f.local,
        physical_remote: peer_new,
    };
    let ev = [prepare(f, f.local, peer_new)];
    assert_eq!(m.receive_sides(&ev, only(&v)), vec![want]);
    // No event: nothing to do, and no view read at all.
    assert!(m
        .receive_sides(&[], |_| -> Option<ConnectionView> { panic!("read a view") })
        .is_empty());
    assert!(!m.receive_side_done(&want, &Ok(())));
    // Asked again for the same pair (a retransmitted update): prepared.
    assert!(m.receive_sides(&ev, only(&v)).is_empty());
    // Our own end moved: the core asks for the new pair.
    v.local_phys = sa("10.0.5.1:40000");
    let again = m.receive_sides(&[prepare(f, v.local_phys, peer_new)], only(&v));
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].physical_local, sa("10.0.5.1:40000"));
}

/// A UDP flow's peer that may have entered a NAT (its update came from
/// another address than it named): the receive side at port 0 for the
/// update's source is prepared beside the named one's, while the core
/// still validates both; not once the core dropped the candidate.
#[test]
fn a_udp_flow_s_nat_candidate_gets_a_receive_side_at_port_0() {
    let f = udp("10.0.0.1:53", "10.0.1.2:5000");
    let (named, nat) = (sa("192.168.2.20:5000"), sa("10.0.3.102:40005"));
    let at_nat = sa("10.0.3.102:0");
    let mut v = view(f);
    v.pending_remote = Some(named);
    v.nat_candidate = Some(nat);
    let mut m = Mover::new();
    let ev = [prepare(f, f.local, named), prepare(f, f.local, at_nat)];
    let work = m.receive_sides(&ev, only(&v));
    let remotes: Vec<SocketAddr> = work.iter().map(|t| t.physical_remote).collect();
    assert_eq!(remotes, vec![named, at_nat]);
    // The named address answered: no candidate any more.
    v.nat_candidate = None;
    assert!(m
        .receive_sides(&[prepare(f, f.local, at_nat)], only(&v))
        .is_empty());
}

#[test]
fn a_receive_side_no_longer_pending_in_the_core_is_not_prepared() {
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let peer_new = sa("10.9.0.2:443");
    let mut v = view(f);
    let mut m = Mover::new();
    // Validated (or replaced) before the driver got to it.
    v.pending_remote = None;
    assert!(m
        .receive_sides(&[prepare(f, f.local, peer_new)], only(&v))
        .is_empty());
    // Asked for our old end after we moved: not that pair.
    v.pending_remote = Some(peer_new);
    v.local_phys = sa("10.0.5.1:40000");
    assert!(m
        .receive_sides(&[prepare(f, f.local, peer_new)], only(&v))
        .is_empty());
    // A connection the core no longer has.
    assert!(m
        .receive_sides(&[prepare(f, f.local, peer_new)], |_| None)
        .is_empty());
}

#[test]
fn a_receive_side_that_fails_is_tried_again_and_warned_about_once() {
    let f = udp("10.0.0.1:5000", "10.0.0.2:53");
    let mut v = view(f);
    v.pending_remote = Some(sa("10.9.0.2:53"));
    let mut m = Mover::new();
    let t = m
        .receive_sides(&[prepare(f, f.local, sa("10.9.0.2:53"))], only(&v))
        .remove(0);
    let err = || {
        Err(DatapathError::NoRoute {
            addr: "10.9.0.2".parse().unwrap(),
        })
    };
    assert!(m.receive_side_done(&t, &err()), "first failure: warn");
    // Tried again on the next turn although the core asked nothing new.
    let t = m.receive_sides(&[], only(&v)).remove(0);
    assert!(!m.receive_side_done(&t, &err()), "warned once");
    let t = m.receive_sides(&[], only(&v)).remove(0);
    assert!(!m.receive_side_done(&t, &Ok(())));
    assert!(m.receive_sides(&[], only(&v)).is_empty());
    // A failed one the core gave up on (validated, reverted) is dropped.
    let t2 = Translation {
        physical_remote: sa("10.9.0.3:53"),
        ..t
    };
    m.receive_side_done(&t2, &err());
    assert!(m.receive_sides(&[], only(&v)).is_empty());
    assert!(m.receive_sides(&[], only(&v)).is_empty());
}

#[test]
fn no_receive_side_for_a_peer_back_at_its_own_address() {
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let mut v = view(f);
    v.remote_phys = sa("10.9.0.2:443");
    v.pending_remote = Some(f.remote);
    let mut m = Mover::new();
    assert!(m
        .receive_sides(&[prepare(f, f.local, f.remote)], only(&v))
        .is_empty());
}

#[test]
fn events_become_switches_only_to_validated_pairs() {
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let new_peer = sa("10.9.0.2:443");
    let mut m = Mover::new();
    // The peer moved and proved it: switch both ways, solicit an ACK.
    assert_eq!(
        m.step(
            &Event::SetRemote {
                flow: f,
                remote: new_peer
            },
            Some(&view(f))
        ),
        Step::Switch(Switch {
            flow: f,
            local: f.local,
            remote: new_peer,
            peer_moved: true,
            solicit: true,
            budget: Budget::None,
        })
    );
    // ... but not while our own move is unacknowledged.
    let mut moving = view(f);
    moving.migrating = true;
    assert!(matches!(
        m.step(
            &Event::SetRemote {
                flow: f,
                remote: new_peer
            },
            Some(&moving)
        ),
        Step::Wait(..)
    ));
    // Our move acknowledged, TCP: wait for the peer's SWITCHED.
    let mut moved = view(f);
    moved.local_phys = sa("10.0.5.1:40000");
    let resumed = |switch_now| Event::Resumed {
        flow: f,
        local: sa("10.0.5.1:40000"),
        switch_now,
    };
    assert!(matches!(
        m.step(&resumed(false), Some(&moved)),
        Step::Wait(..)
    ));
    // SWITCHED: now, from our new address, soliciting an ACK.
    assert_eq!(
        m.step(
            &Event::PeerSwitched {
                flow: f,
                confirmed: true
            },
            Some(&moved)
        ),
        Step::Switch(Switch {
            flow: f,
            local: sa("10.0.5.1:40000"),
            remote: f.remote,
            peer_moved: false,
            solicit: true,
            budget: Budget::None,
        })
    );
    // Switch-now resume (UDP, or both ends moved): no ACK solicited.
    assert!(matches!(
        m.step(&resumed(true), Some(&moved)),
        Step::Switch(Switch { solicit: false, .. })
    ));
    // The peer moved too and its address is not validated yet: wait.
    let mut both = moved.clone();
    both.pending_remote = Some(new_peer);
    assert!(matches!(
        m.step(&resumed(true), Some(&both)),
        Step::Wait(..)
    ));
    assert_eq!(
        m.step(&Event::KeysReady { flow: f }, Some(&view(f))),
        Step::NotAMove
    );
}

#[test]
fn tcp_and_udp_are_held_during_their_move_and_flows_without_keys_stay() {
    let t = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let u = udp("10.0.0.1:5000", "10.0.0.2:53");
    let n = udp("10.0.0.1:5001", "10.0.0.2:53");
    let k = tcp("10.0.0.1:40001", "10.0.0.3:443");
    let mv = |flow: VirtualFlow| Move {
        flow,
        new_local: SocketAddr::new("10.0.5.1".parse().unwrap(), flow.local.port()),
        remote_phys: flow.remote,
    };
    let views = move |f: &VirtualFlow| {
        let mut v = view(*f);
        if *f == n {
            v.seen_by_peer_as = Some(sa("203.0.113.9:61000"));
        }
        if *f == k {
            v.has_keys = false;
        }
        Some(v)
    };
    let (go, stuck) = Mover::new().starts(vec![mv(t), mv(u), mv(n), mv(k)], views);
    let held: Vec<(VirtualFlow, bool)> = go.iter().map(|s| (s.mv.flow, s.hold)).collect();
    assert_eq!(held, vec![(t, true), (u, true), (n, true)]);
    assert_eq!(stuck, vec![mv(k)]);
}

#[test]
fn a_hold_ends_at_the_limit_once_and_not_after_a_newer_hold_or_a_switch() {
    let (a, b, c) = (
        tcp("10.0.0.1:1", "10.0.0.2:443"),
        tcp("10.0.0.1:2", "10.0.0.2:443"),
        tcp("10.0.0.1:3", "10.0.0.2:443"),
    );
    let t0 = Instant::now();
    let mut m = Mover::new();
    m.held(a, t0);
    m.held(b, t0);
    m.held(c, t0);
    assert_eq!(m.next_hold_deadline(), Some(t0 + HOLD_LIMIT));
    // b is held again later (a second move); c's move completes.
    m.held(b, t0 + Duration::from_secs(1));
    m.switched(
        &Switch {
            flow: c,
            local: c.local,
            remote: c.remote,
            peer_moved: false,
            solicit: true,
            budget: Budget::None,
        },
        true,
    );
    assert!(m.overdue_holds(t0 + Duration::from_millis(1999)).is_empty());
    assert_eq!(m.overdue_holds(t0 + HOLD_LIMIT), vec![a]);
    assert!(m.overdue_holds(t0 + HOLD_LIMIT).is_empty(), "once");
    assert_eq!(
        m.overdue_holds(t0 + Duration::from_secs(3)),
        vec![b],
        "the newer hold ends at its own limit"
    );
    assert_eq!(m.next_hold_deadline(), None);
    // An aborted move's hold is released by the abort, not again later.
    m.held(a, t0);
    assert_eq!(
        m.step(
            &Event::MigrationAborted {
                flow: a,
                reason: AbortReason::PeerNeverArrived { rounds: 3 }
            },
            None
        ),
        Step::Release(a)
    );
    assert!(m.overdue_holds(t0 + Duration::from_secs(10)).is_empty());
}

#[test]
fn mass_switches_queue_their_levers_and_solicit_only_where_the_peer_moved() {
    let a = tcp("10.0.0.1:1", "10.0.0.2:443");
    let b = tcp("10.0.0.1:2", "10.0.0.2:443");
    let mut m = Mover::new();
    let s = |flow, peer_moved| Switch {
        flow,
        local: sa("10.0.5.1:1"),
        remote: sa("10.0.0.2:443"),
        peer_moved,
        solicit: true,
        budget: Budget::None,
    };
    m.switched(&s(a, true), true);
    assert!(
        m.take_restarts(usize::MAX).is_empty(),
        "verified: levers ran already"
    );
    m.switched(&s(a, true), false);
    m.switched(&s(b, false), false);
    assert_eq!(m.take_restarts(usize::MAX), vec![(a, true), (b, false)]);
    assert!(m.take_restarts(usize::MAX).is_empty());
}

#[test]
fn queued_levers_are_taken_a_bounded_share_at_a_time_oldest_first() {
    let flows: Vec<VirtualFlow> = (1..=5)
        .map(|p| tcp(&format!("10.0.0.1:{p}"), "10.0.0.2:443"))
        .collect();
    let mut m = Mover::new();
    for &f in &flows {
        m.switched(
            &Switch {
                flow: f,
                local: sa("10.0.5.1:1"),
                remote: sa("10.0.0.2:443"),
                peer_moved: true,
                solicit: true,
                budget: Budget::None,
            },
            false,
        );
    }
    let first: Vec<VirtualFlow> = m.take_restarts(2).into_iter().map(|(f, _)| f).collect();
    assert_eq!(first, flows[..2]);
    assert!(m.restarts_queued(), "three are left for the next turn");
    let rest: Vec<VirtualFlow> = m.take_restarts(8).into_iter().map(|(f, _)| f).collect();
    assert_eq!(rest, flows[2..]);
    assert!(!m.restarts_queued());
    assert!(m.take_restarts(8).is_empty());
}

#[test]
fn the_peer_is_told_of_a_switch_unless_a_udp_flow_still_waits_for_its_bind() {
    let t = tcp("10.0.0.2:443", "203.0.113.7:40000");
    let u = udp("10.0.0.2:53", "203.0.113.7:40001");
    let to = |flow: VirtualFlow, remote: &str, peer_moved| Switch {
        flow,
        local: flow.local,
        remote: sa(remote),
        peer_moved,
        solicit: true,
        budget: Budget::None,
    };
    // TCP to a NAT whose port the tc program learns: told at once (the
    // mover's first packet is what teaches the port).
    assert!(to(t, "198.51.100.8:0", true).confirms());
    // UDP: only once the BIND gave the port.
    assert!(!to(u, "198.51.100.8:0", true).confirms());
    assert!(to(u, "198.51.100.8:7777", true).confirms());
    // Back at its own addresses after our move: nothing to tell.
    assert!(!to(t, "203.0.113.7:40000", false).confirms());
}

/// What the mover asks, run on the fake datapath: the receive side for the
/// peer's announced address is in place (prepared) before the switch, and
/// the switch installs the translation that the receive side began.
#[test]
fn on_the_fake_datapath_the_receive_side_comes_before_the_switch() {
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let new_peer = sa("10.9.0.2:443");
    let mut dp = FakeDatapath::new();
    dp.add_connection(f, None);
    let mut m = Mover::new();
    let mut v = view(f);
    v.pending_remote = Some(new_peer);
    for t in m.receive_sides(&[prepare(f, f.local, new_peer)], only(&v)) {
        let r = dp.prepare_translation(&t);
        m.receive_side_done(&t, &r);
    }
    assert!(dp.prepared.contains_key(&f), "receive side first");
    assert!(dp.translations().unwrap().is_empty(), "send side not yet");
    let Step::Switch(s) = m.step(
        &Event::SetRemote {
            flow: f,
            remote: new_peer,
        },
        Some(&view(f)),
    ) else {
        panic!("no switch");
    };
    dp.install_translation(&Translation {
        flow: s.flow,
        physical_local: s.local,
        physical_remote: s.remote,
    })
    .unwrap();
    assert_eq!(dp.translations().unwrap()[0].physical_remote, new_peer);
}

/// The ordering rule against the real protocol core (the simulator's
/// endpoints): in the turn in which the server's core takes the laptop's
/// UPD, the mover already asks for the receive side of the laptop's new
/// address, before the UPD_R that the core queued in that turn leaves (the
/// driver runs the mover's work before it flushes).
#[test]
fn the_core_s_pending_address_reaches_the_mover_in_the_turn_of_the_update() {
    use crate::vcmp::sim::{reverse, sa as ssa, Link, Sim};
    let mut sim = Sim::new(41, Link::default());
    let l = sim.add_host("10.0.0.1", crate::vcmp::Config::default());
    let s = sim.add_host("10.0.0.2", crate::vcmp::Config::default());
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    sim.connect(l, s, f);
    sim.run_for(Duration::from_secs(10));
    let sf = reverse(&f);
    assert!(sim.hosts[s].ep.connection(&sf).unwrap().has_keys);
    sim.move_host(l, "10.0.5.1");
    // The laptop's UPD, taken off the wire by hand.
    let upd = sim.capture(l, |ep, now, rng| {
        ep.resume(now, rng, &[(f, ssa("10.0.5.1:40000"))]).unwrap()
    });
    assert!(!upd.is_empty());
    let mut m = Mover::new();
    // One driver turn on the server: the datagrams in (what the core
    // queues is kept off the wire here)...
    let from = ssa("10.0.5.1:2031");
    let out = sim.capture(s, |ep, now, rng| {
        for t in &upd {
            ep.handle_datagram(now, rng, from, &t.payload);
        }
    });
    // ... the core's events (which `capture` kept) and the mover's work ...
    let events: Vec<Event> = std::mem::take(&mut sim.hosts[s].events)
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    let ep = &sim.hosts[s].ep;
    let work = m.receive_sides(&events, |f| ep.connection(f));
    assert_eq!(
        work,
        vec![Translation {
            flow: sf,
            physical_local: sf.local,
            physical_remote: ssa("10.0.5.1:40000"),
        }],
        "the receive side for the laptop's new address must be asked for in this turn"
    );
    // ... and only then the flush, whose UPD_R lets the laptop send there.
    assert!(
        out.iter()
            .any(|t| t.payload.get(1) == Some(&(crate::vcmp::wire::Kind::UpdR as u8))),
        "the UPD_R leaves after the work"
    );
    m.receive_side_done(&work[0], &Ok(()));
    // The server moves while the laptop's address is still pending: the
    // core asks for the receive side again, for the server's new end.
    sim.move_host(s, "10.0.6.2");
    let new_local = ssa("10.0.6.2:443");
    sim.capture(s, |ep, now, rng| {
        ep.resume(now, rng, &[(sf, new_local)]).unwrap()
    });
    let events: Vec<Event> = std::mem::take(&mut sim.hosts[s].events)
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    let ep = &sim.hosts[s].ep;
    assert_eq!(
        m.receive_sides(&events, |f| ep.connection(f)),
        vec![Translation {
            flow: sf,
            physical_local: new_local,
            physical_remote: ssa("10.0.5.1:40000"),
        }],
        "our own move must ask for the receive side again: {events:?}"
    );
}

/// The peer's announced address, before its validation: a budgeted switch
/// (which SWITCHED confirms), then the validation only lifts the budget
/// (no levers, no second SWITCHED); a failed one switches back unlimited.
#[test]
fn an_unvalidated_address_is_sent_to_under_a_budget_until_validated() {
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let new_peer = sa("10.9.0.2:443");
    let mut m = Mover::new();
    let early = Event::SendUnvalidated {
        flow: f,
        remote: new_peer,
        allowed: 450,
    };
    let s = match m.step(&early, Some(&view(f))) {
        Step::Switch(s) => s,
        other => panic!("expected a switch, got {other:?}"),
    };
    assert_eq!(
        s,
        Switch {
            flow: f,
            local: f.local,
            remote: new_peer,
            peer_moved: true,
            solicit: true,
            budget: Budget::Unvalidated(450),
        }
    );
    assert!(s.confirms(), "the peer learns at once that we send there");
    // The peer sends its update again (our answer was late or lost): the
    // same address, so only the allowance starts again, and SWITCHED goes
    // again; no install, no levers.
    let again = match m.step(&early, Some(&view(f))) {
        Step::Switch(s) => s,
        other => panic!("expected a switch, got {other:?}"),
    };
    assert_eq!(again.budget, Budget::Again(450));
    assert!(
        again.confirms(),
        "SWITCHED again: the first may be what was lost"
    );
    m.switched(&again, false);
    assert!(
        m.take_restarts(usize::MAX).is_empty(),
        "a repeat restarts nothing"
    );
    let validated = Event::SetRemote {
        flow: f,
        remote: new_peer,
    };
    let lift = match m.step(&validated, Some(&view(f))) {
        Step::Switch(s) => s,
        other => panic!("expected a switch, got {other:?}"),
    };
    assert_eq!(lift.budget, Budget::Lift);
    assert!(!lift.confirms() && !lift.peer_moved && !lift.solicit);
    m.switched(&lift, false);
    assert!(
        m.take_restarts(usize::MAX).is_empty(),
        "a lift restarts nothing"
    );

    // Sent early, then not validated: back to the old address, unlimited.
    m.step(&early, Some(&view(f)));
    let back = Event::Reverted {
        flow: f,
        remote: f.remote,
        attempted: new_peer,
    };
    assert!(matches!(
        m.step(&back, Some(&view(f))),
        Step::Switch(Switch { remote, budget: Budget::None, .. }) if remote == f.remote
    ));
    // While our own move is under way the core asks for a budgeted send
    // only when the peer's update came to our new address (the peer knows
    // it): the send side switches there from our new address, and our
    // move's completion, with the peer's address still pending, leaves it.
    let mut moving = view(f);
    moving.migrating = true;
    moving.local_phys = sa("10.0.5.1:40000");
    moving.pending_remote = Some(new_peer);
    assert!(matches!(
        m.step(&early, Some(&moving)),
        Step::Switch(Switch { local, remote, budget: Budget::Unvalidated(450), .. })
            if local == moving.local_phys && remote == new_peer
    ));
    moving.migrating = false;
    let done = Event::Resumed {
        flow: f,
        local: moving.local_phys,
        switch_now: true,
    };
    assert!(matches!(m.step(&done, Some(&moving)), Step::Wait(..)));
}

/// A peer's update that comes again while its address is sent to under a
/// budget (our answer was late) prepares no receive side: that would
/// replace the budgeted translation's receive side with one that no longer
/// adds to the allowance (issue 32, item 5's candidate for the UDP
/// blackhole). After our own move the pair differs and is prepared.
#[test]
fn a_repeated_update_does_not_prepare_again_the_receive_side_of_a_budgeted_switch() {
    let f = udp("10.0.0.1:40000", "10.0.0.2:53");
    let new_peer = sa("10.9.0.2:53");
    let mut m = Mover::new();
    let mut v = view(f);
    v.pending_remote = Some(new_peer);
    let ev = [prepare(f, v.local_phys, new_peer)];
    assert_eq!(m.receive_sides(&ev, only(&v)).len(), 1);
    assert!(m.receive_sides(&[], only(&v)).is_empty(), "prepared twice");
    let want = Translation {
        flow: f,
        physical_local: v.local_phys,
        physical_remote: new_peer,
    };
    m.receive_side_done(&want, &Ok(()));
    let early = Event::SendUnvalidated {
        flow: f,
        remote: new_peer,
        allowed: 450,
    };
    assert!(matches!(m.step(&early, Some(&v)), Step::Switch(..)));
    assert!(
        m.receive_sides(&ev, only(&v)).is_empty(),
        "the repeated update prepared the budgeted pair's receive side again"
    );
    // Our own move: the pair is new and gets its receive side.
    let mut moved = v;
    moved.local_phys = sa("10.0.5.1:40000");
    let after = [prepare(f, moved.local_phys, new_peer)];
    assert_eq!(
        m.receive_sides(&after, only(&moved)),
        vec![Translation {
            flow: f,
            physical_local: moved.local_phys,
            physical_remote: new_peer,
        }]
    );
}

/// The datapath installs a budgeted switch limited, and the next install
/// (the validation's lift, or any other) unlimited.
#[test]
fn the_datapath_gets_the_budget_with_the_switch_and_loses_it_at_the_lift() {
    use crate::daemon::moveops::{run, Op};
    let mut dp = FakeDatapath::new();
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    dp.add_connection(f, None);
    let new_peer = sa("10.9.0.2:443");
    let switch = |budget| Switch {
        flow: f,
        local: f.local,
        remote: new_peer,
        peer_moved: budget != Budget::Lift,
        solicit: budget != Budget::Lift,
        budget,
    };
    let ops = vec![Op::Switch {
        switch: switch(Budget::Unvalidated(300)),
        verified: true,
    }];
    run(&mut dp, ops, &std::collections::HashMap::new());
    assert_eq!(dp.limited.get(&f), Some(&300));
    assert_eq!(dp.restarted, vec![f]);
    let ops = vec![Op::Switch {
        switch: switch(Budget::Lift),
        verified: true,
    }];
    run(&mut dp, ops, &std::collections::HashMap::new());
    assert!(dp.limited.is_empty());
    assert_eq!(dp.restarted, vec![f], "a lift runs no lever");
    assert_eq!(dp.translations().unwrap().len(), 1);
}

/// The peer's update sent again for the address already budgeted: the
/// allowance starts again, nothing is installed and no lever is pulled;
/// with no allowance left to credit it is installed as the first was.
#[test]
fn a_repeated_update_credits_the_budget_and_installs_nothing() {
    use crate::daemon::moveops::{run, Op};
    let mut dp = FakeDatapath::new();
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    dp.add_connection(f, None);
    let new_peer = sa("10.9.0.2:443");
    let switch = |budget| Op::Switch {
        switch: Switch {
            flow: f,
            local: f.local,
            remote: new_peer,
            peer_moved: true,
            solicit: true,
            budget,
        },
        verified: true,
    };
    run(
        &mut dp,
        vec![switch(Budget::Unvalidated(300))],
        &Default::default(),
    );
    assert_eq!(dp.restarted, vec![f]);
    // An install releases a hold: one still here afterwards shows that
    // nothing was installed.
    dp.held.insert(f);
    let done = run(
        &mut dp,
        vec![switch(Budget::Again(500))],
        &Default::default(),
    );
    assert!(done[0].1.error().is_none());
    assert_eq!(dp.limited.get(&f), Some(&500), "the allowance starts again");
    assert!(dp.held.contains(&f), "nothing installed");
    assert_eq!(dp.restarted, vec![f], "no lever for a repeat");
    // The allowance is gone (validated and lifted meanwhile, say): the
    // repeat is a full budgeted switch.
    dp.limited.clear();
    run(
        &mut dp,
        vec![switch(Budget::Again(700))],
        &Default::default(),
    );
    assert_eq!(dp.limited.get(&f), Some(&700));
    assert!(!dp.held.contains(&f), "installed");
}

/// Our own end moved while the peer's address was budgeted: its
/// validation then switches our new placement in full.
#[test]
fn a_validation_after_our_own_move_is_a_full_switch() {
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let new_peer = sa("10.9.0.2:443");
    let mut m = Mover::new();
    let early = Event::SendUnvalidated {
        flow: f,
        remote: new_peer,
        allowed: 450,
    };
    assert!(matches!(m.step(&early, Some(&view(f))), Step::Switch(_)));
    m.held(f, Instant::now());
    let mut moved = view(f);
    moved.local_phys = sa("10.0.5.1:40000");
    let validated = Event::SetRemote {
        flow: f,
        remote: new_peer,
    };
    assert!(matches!(
        m.step(&validated, Some(&moved)),
        Step::Switch(Switch { budget: Budget::None, peer_moved: true, local, .. }) if local == moved.local_phys
    ));
}
