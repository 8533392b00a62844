//! Scenario tests on the simulator: the peer sends to a moved end's new
//! address before validating it (RFC 9000 section 9.3), within the
//! datapath's budget, when one end moves and when both do.

use crate::stats::Counter;
use std::time::Duration;

use super::endpoint::{Config, Event};
use super::sim::{ip, reverse, Link, Sim};
use super::sim_tests::{
    assert_both_resumed_at, both_moved, claimed_where_nobody_answers, moved, resume, setup,
    setup_with_location_server, B_IP,
};
use super::wire::Kind;
use crate::flow::VirtualFlow;

/// Both ends move: the first update to reach its receiver at the new
/// address its own move took it to (the sender found that address through
/// the location server and made its receive side ready for it) is sent to
/// at once, within the budget, before its sender's address is validated.
/// Without it the receiver's send side waited for the validation, a round
/// trip more.
#[test]
fn when_both_ends_moved_an_update_to_our_new_address_is_sent_to_at_once() {
    let (sim, flows, b_flows) = both_moved(45);
    let mut early = 0;
    for (h, fs, peer_ip) in [(0, &flows, "10.0.2.2"), (1, &b_flows, "10.0.1.1")] {
        for f in fs.iter() {
            let at =
                |want: &dyn Fn(&Event) -> bool| sim.events(h, |e| want(e)).next().map(|(t, _)| *t);
            let Some(t_early) =
                at(&|e| matches!(e, Event::SendUnvalidated { flow, .. } if flow == f))
            else {
                continue;
            };
            early += 1;
            let peer_new = std::net::SocketAddr::new(peer_ip.parse().expect("ip"), f.remote.port());
            let t_valid = at(&|e| matches!(e, Event::SetRemote { flow, remote } if flow == f && *remote == peer_new))
                .unwrap_or_else(|| panic!("host {h}: {f:?} must validate {peer_new}"));
            let t_resumed = at(&|e| matches!(e, Event::Resumed { flow, .. } if flow == f))
                .unwrap_or_else(|| panic!("host {h}: {f:?} must resume"));
            // The update that completes our own move too: it is sent to
            // before the move's `Resumed`, at the same instant.
            assert!(
                t_early < t_valid && t_early <= t_resumed,
                "host {h}, {f:?}: sent early at {t_early:?}, validated at {t_valid:?}, own move done at {t_resumed:?}"
            );
            assert!(
                sim.events(h, |e| matches!(e, Event::SendUnvalidated { flow, remote, .. } if flow == f && *remote != peer_new))
                    .next()
                    .is_none(),
                "host {h}, {f:?}: early only to the peer's new address"
            );
        }
    }
    assert_eq!(
        early,
        flows.len(),
        "one end of each connection hears of the other's new address first, at its own new address"
    );
    assert_early_sends_meet_a_ready_peer(&sim, 0, 1, &flows, "10.0.1.1");
    assert_early_sends_meet_a_ready_peer(&sim, 1, 0, &b_flows, "10.0.2.2");
}

/// Our move is planned (the old address stays up) and the peer moves too:
/// its update reaches us at our old address, from a peer that may not know
/// our new one. Nothing is sent to the peer's new address before it is
/// validated while our move is under way: our packets would leave from
/// our new address, which the peer's kernel may not take yet.
#[test]
fn an_update_at_our_old_address_during_our_move_waits_for_validation() {
    let (mut sim, flows, _) = setup_with_location_server(46, 2);
    sim.move_host(1, "10.0.2.2");
    let b_flows: Vec<_> = flows.iter().map(reverse).collect();
    // Host 0 stays reachable at its old address: a planned move.
    resume(&mut sim, 0, &flows, "10.0.1.1");
    resume(&mut sim, 1, &b_flows, "10.0.2.2");
    sim.run_for(Duration::from_secs(120));
    for f in &flows {
        let resumed = sim
            .events(0, |e| matches!(e, Event::Resumed { flow, .. } if flow == f))
            .map(|(t, _)| *t)
            .next();
        let early: Vec<_> = sim
            .events(
                0,
                |e| matches!(e, Event::SendUnvalidated { flow, .. } if flow == f),
            )
            .map(|(t, _)| *t)
            .collect();
        assert!(
            early.iter().all(|t| resumed.is_some_and(|r| *t > r)),
            "{f:?}: sent early at {early:?} although our own move (done at {resumed:?}) was under way and the update came to our old address"
        );
    }
}

/// The peer sends to the mover's new address as soon as the update that
/// came from there authenticates (RFC 9000 section 9.3), within three
/// times that update's bytes until more come (the datapath's budget),
/// and lifts the limit when the address answers its challenge.
#[test]
fn the_peer_sends_to_an_announced_address_before_it_is_validated() {
    let (mut sim, flows) = setup(41, Link::default(), Config::default(), 3);
    sim.move_host(0, "10.0.1.1");
    resume(&mut sim, 0, &flows, "10.0.1.1");
    sim.run_for(Duration::from_secs(2));
    for f in &flows {
        let b = reverse(f);
        let new = moved(f, "10.0.1.1");
        let early: Vec<_> = sim
            .events(
                1,
                |e| matches!(e, Event::SendUnvalidated { flow, .. } if *flow == b),
            )
            .map(|(t, e)| (*t, e.clone()))
            .collect();
        assert_eq!(early.len(), 1, "{f:?}: one early switch, got {early:?}");
        let (
            t_early,
            Event::SendUnvalidated {
                remote, allowed, ..
            },
        ) = early[0].clone()
        else {
            unreachable!("filtered to SendUnvalidated")
        };
        assert_eq!(remote, new);
        // The three records shared one UPD datagram: each flow may send
        // three times its share of it.
        let upd = sim.hosts[1]
            .inbox
            .iter()
            .find(|(from, bytes)| from.ip() == new.ip() && bytes.get(1) == Some(&(Kind::Upd as u8)))
            .map(|(_, b)| b.len())
            .expect("B received the update from the new address");
        assert_eq!(allowed as usize, 3 * (upd / flows.len()), "{f:?}");
        let (t_valid, _) = *sim
            .events(
                1,
                |e| matches!(e, Event::SetRemote { flow, remote } if *flow == b && *remote == new),
            )
            .next()
            .unwrap_or_else(|| panic!("B must validate {f:?}'s new address"));
        assert!(
            t_valid.since(t_early) >= Duration::from_millis(3),
            "{f:?}: sent early at {t_early:?}, validated at {t_valid:?}: the validation takes a round trip"
        );
        assert_eq!(
            sim.hosts[1].ep.connection(&b).expect("flow").remote_phys,
            new
        );
    }
    assert_eq!(sim.hosts[1].ep.stats().get(Counter::SentUnvalidated), 3);
}

/// An update naming an address it did not come from (a peer with valid
/// keys naming a victim's) moves no traffic before validation: nothing
/// came from there to send three times of.
#[test]
fn an_update_from_elsewhere_sends_nothing_before_validation() {
    let (sim, _) = claimed_where_nobody_answers(42);
    assert!(
        sim.events(1, |e| matches!(e, Event::SendUnvalidated { .. }))
            .next()
            .is_none(),
        "B must not send to an address the update did not come from"
    );
    assert_eq!(sim.hosts[1].ep.stats().get(Counter::SentUnvalidated), 0);
}

/// The mover's update came from its new address, which then stops
/// answering (the mover left again, or its update was spoofed): the peer,
/// which sent there under the budget, goes back to the last validated
/// address when the validation fails.
#[test]
fn an_early_switch_whose_address_never_answers_is_reverted() {
    let (mut sim, flows) = setup(43, Link::default(), Config::default(), 1);
    let f = flows[0];
    let b = reverse(&f);
    sim.move_host(0, "10.0.1.1");
    resume(&mut sim, 0, &flows, "10.0.1.1");
    // The update is on its way; A is gone before B's challenge arrives.
    sim.run_for(Duration::from_micros(1600));
    sim.hosts[0].alive = false;
    sim.run_for(Duration::from_secs(120));
    let new = moved(&f, "10.0.1.1");
    let told: Vec<Event> = sim
        .events(1, |e| {
            matches!(e, Event::SendUnvalidated { flow, .. } | Event::SetRemote { flow, .. } | Event::Reverted { flow, .. } if *flow == b)
        })
        .map(|(_, e)| e.clone())
        .collect();
    assert!(
        matches!(
            told.as_slice(),
            [Event::SendUnvalidated { remote, .. }, Event::Reverted { remote: back, attempted, .. }]
                if *remote == new && *back == f.local && *attempted == new
        ),
        "B must send early, then revert to {}: {told:?}",
        f.local
    );
    let v = sim.hosts[1].ep.connection(&b).expect("flow");
    assert_eq!((v.remote_phys, v.pending_remote), (f.local, None));
}

/// Every early send of host `h` to its peer (host `peer`) of `flows` went
/// to a peer whose receive side was ready for it: the peer had prepared
/// for (the address sent to, `h`'s address at `h_ip`) before. Otherwise
/// the peer's kernel meets a packet of a connection it does not have and
/// resets it.
fn assert_early_sends_meet_a_ready_peer(
    sim: &Sim,
    h: usize,
    peer: usize,
    flows: &[VirtualFlow],
    h_ip: &str,
) {
    let h_ip: std::net::IpAddr = h_ip.parse().expect("ip");
    for f in flows {
        let theirs = reverse(f);
        for (t, e) in sim.events(
            h,
            |e| matches!(e, Event::SendUnvalidated { flow, .. } if flow == f),
        ) {
            let Event::SendUnvalidated { remote, .. } = e else {
                unreachable!("filtered to SendUnvalidated")
            };
            let ready = sim
                .events(peer, |e| {
                    matches!(e, Event::PrepareReceive { flow, local, remote: r }
                        if *flow == theirs && local == remote && r.ip() == h_ip)
                })
                .any(|(tp, _)| tp <= t);
            assert!(
                ready,
                "host {h} sent {f:?} to {remote} from {h_ip} at {t:?}, before its peer was ready for that address"
            );
        }
    }
}

/// Both ends move; the server's old address is routed to its new link, so
/// the laptop's updates, sent to the server's old address before it knows
/// the new one, arrive there, several in one burst (they waited in a
/// router). The first ends the server's own move (the peer found it);
/// the copies behind it must not make the server send from its new
/// address, which the laptop does not know yet: its kernel would reset
/// the connection (seen in `both_move_old_server_location_answers_v6`).
#[test]
fn updates_at_our_old_address_after_our_move_ended_wait_for_validation() {
    let (mut sim, flows) = setup(47, Link::default(), Config::default(), 1);
    let f = flows[0];
    let b = reverse(&f);
    let (laptop_new, server_old, server_new) = ("10.0.1.1", ip(B_IP), "10.0.2.2");
    sim.move_host(0, laptop_new);
    sim.move_host(1, server_new);
    sim.hosts[1].routes.push(server_old);
    // The server's update goes to the laptop's old address: lost.
    resume(&mut sim, 1, &[b], server_new);
    // The laptop's first update and its retransmission, held back.
    let mut held = sim.capture(0, |ep, now, rng| {
        ep.resume(now, rng, &[(f, moved(&f, laptop_new))])
            .expect("resume")
    });
    sim.now = sim.hosts[0]
        .ep
        .poll_timeout()
        .expect("a retransmission timer");
    held.extend(sim.capture(0, |ep, now, rng| ep.handle_timeout(now, rng)));
    let updates: Vec<_> = held
        .iter()
        .filter(|t| t.dst.ip() == server_old && t.payload.get(1) == Some(&(Kind::Upd as u8)))
        .collect();
    assert!(
        updates.len() >= 2,
        "the laptop must have sent its update twice to the server's old address"
    );
    let from = std::net::SocketAddr::new(ip(laptop_new), sim.hosts[0].ep.cfg.port);
    sim.with(1, |ep, now, rng| {
        for t in &updates {
            ep.handle_datagram_at(now, rng, from, Some(server_old), &t.payload);
        }
    });
    sim.run_for(Duration::from_secs(60));
    assert_early_sends_meet_a_ready_peer(&sim, 1, 0, &[b], server_new);
    assert_both_resumed_at(&sim, &flows, laptop_new, server_new);
}
