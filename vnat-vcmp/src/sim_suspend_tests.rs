//! When a suspension is over (`Event::SuspendSettled`): vnatd releases
//! logind's sleep inhibitor on it, so it must come once per suspension,
//! after the peer's answers when there are some, and also when there are
//! none.

use std::time::Duration;

use super::endpoint::{Config, Event};
use super::sim::{Link, Sim};
use super::sim_tests::setup;
use crate::flow::VirtualFlow;

/// Host `h`'s events of `f`'s suspension, in order: "role", "rekeyed",
/// "settled" or "unanswered".
fn suspend_events(sim: &Sim, h: usize, f: VirtualFlow) -> Vec<&'static str> {
    sim.events(h, |_| true)
        .filter_map(|(_, e)| match e {
            Event::RoleDecided { flow, .. } if *flow == f => Some("role"),
            Event::Rekeyed { flow } if *flow == f => Some("rekeyed"),
            Event::SuspendSettled { flow, answered } if *flow == f => {
                Some(if *answered { "settled" } else { "unanswered" })
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_suspension_the_peer_answers_settles_once_after_the_role_and_the_keys() {
    let (mut sim, flows) = setup(71, Link::default(), Config::default(), 1);
    let f = flows[0];
    sim.with(0, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    // Asked again while the first is under way: still one settlement.
    sim.with(0, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(20));
    let seen = suspend_events(&sim, 0, f);
    assert_eq!(
        seen.iter().filter(|e| e.starts_with("settled")).count(),
        1,
        "{seen:?}"
    );
    assert_eq!(seen.last(), Some(&"settled"), "{seen:?}");
    assert!(
        seen.contains(&"role") && seen.contains(&"rekeyed"),
        "{seen:?}"
    );
}

#[test]
fn a_suspension_nobody_answers_settles_unanswered_after_the_last_resend() {
    let (mut sim, flows) = setup(72, Link::default(), Config::default(), 1);
    let f = flows[0];
    sim.hosts[1].mute = true;
    sim.with(0, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(2));
    assert!(
        suspend_events(&sim, 0, f).is_empty(),
        "not over while the claim is resent"
    );
    sim.run_for(Duration::from_secs(60));
    assert_eq!(suspend_events(&sim, 0, f), vec!["unanswered"]);
}

#[test]
fn a_suspension_ends_when_its_connection_goes() {
    let (mut sim, flows) = setup(73, Link::default(), Config::default(), 1);
    let f = flows[0];
    sim.hosts[1].mute = true;
    sim.with(0, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend");
        assert!(ep.connection_removed(&f));
    });
    assert_eq!(suspend_events(&sim, 0, f), vec!["unanswered"]);
}

#[test]
fn with_nothing_to_settle_a_suspension_is_over_at_once() {
    let cfg = Config {
        negotiate_roles: false,
        suspend_dh: false,
        ..Config::default()
    };
    let (mut sim, flows) = setup(74, Link::default(), cfg, 1);
    let f = flows[0];
    sim.with(0, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    assert_eq!(suspend_events(&sim, 0, f), vec!["settled"]);
}
