//! The suspend-time key update when its answer never arrives (issue 16,
//! item 6): both ends must still authenticate each other afterwards, and a
//! later key update must work.

use crate::stats::{Counter, Reject};
use std::time::Duration;

use super::endpoint::{Config, Event};
use super::sim::{reverse, sa, Link, Sim};
use super::sim_tests::setup;
use crate::flow::VirtualFlow;

/// The laptop `a` moves to 10.0.5.1 and resumes `f` there: its move must
/// complete (both ends authenticate each other's records).
fn assert_the_laptop_s_move_completes(sim: &mut Sim, a: usize, f: VirtualFlow) {
    sim.move_host(a, "10.0.5.1");
    sim.with(a, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("10.0.5.1:40000"))])
            .expect("resume")
    });
    sim.run_for(Duration::from_secs(10));
    assert!(
        sim.events(
            a,
            |e| matches!(e, Event::Resumed { flow, .. } if *flow == f)
        )
        .next()
        .is_some(),
        "the laptop's move must complete"
    );
}

/// The laptop (a) suspends: its KEYX reaches the server (b), whose answers
/// (the first and every one to a retransmission) are all lost, as in a
/// suspend hook with no network for 20 s; the laptop gives up. The server
/// ratcheted; the laptop did not. Then: a suspend the server starts must
/// reach the laptop (records signed under keys the laptop has), the
/// laptop's move must complete, and a second key update must agree.
#[test]
fn a_lost_keyx_answer_leaves_both_ends_able_to_authenticate_each_other() {
    let (mut sim, flows) = setup(61, Link::default(), Config::default(), 1);
    let (a, b) = (0, 1);
    let f = flows[0];
    let g = reverse(&f);

    sim.hosts[b].mute = true;
    sim.with(a, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(60));
    assert_eq!(
        sim.hosts[a].ep.stats().get(Counter::KeyxUnanswered),
        1,
        "the laptop must give up on its KEYX"
    );
    assert!(
        sim.hosts[b].ep.stats().get(Counter::Rekeyed) >= 1,
        "the server ratcheted"
    );
    assert_eq!(sim.hosts[a].ep.stats().get(Counter::Rekeyed), 0);
    sim.hosts[b].mute = false;

    // The server reaches the laptop: its records authenticate there.
    let bad_before = sim.hosts[a].ep.stats().rejected(Reject::BadMac);
    sim.with(b, |ep, now, rng| {
        ep.suspend(now, rng, &[g]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(10));
    assert_eq!(
        sim.hosts[a].ep.stats().rejected(Reject::BadMac),
        bad_before,
        "the server's records must authenticate at the laptop"
    );
    // The server's suspend-time key update (it does not claim a role: the
    // laptop already made it secondary) agrees with the laptop, from the
    // keys they share.
    assert!(
        sim.hosts[a].ep.stats().get(Counter::Rekeyed) >= 1,
        "the laptop must take the server's KEYX"
    );
    assert_eq!(sim.hosts[b].ep.stats().get(Counter::KeyxRolledBack), 1);

    // And the laptop's move completes.
    assert_the_laptop_s_move_completes(&mut sim, a, f);
}

/// The same loss, then the laptop starts the next key update itself: its
/// new KEYX (under the keys before the server's unconfirmed ratchet) makes
/// the server undo that ratchet, and both agree on the new keys.
#[test]
fn after_a_lost_keyx_answer_the_next_keyx_from_the_same_side_agrees() {
    let (mut sim, flows) = setup(62, Link::default(), Config::default(), 1);
    let (a, b) = (0, 1);
    let f = flows[0];
    sim.hosts[b].mute = true;
    sim.with(a, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(60));
    assert_eq!(sim.hosts[a].ep.stats().get(Counter::KeyxUnanswered), 1);
    sim.hosts[b].mute = false;

    sim.with(a, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(10));
    assert_eq!(sim.hosts[b].ep.stats().get(Counter::KeyxRolledBack), 1);
    assert_eq!(sim.hosts[a].ep.stats().get(Counter::Rekeyed), 1);
    // Both on the same keys: the laptop's move completes.
    assert_the_laptop_s_move_completes(&mut sim, a, f);
    // Nothing the server sent was under keys the laptop lacked (the
    // server may drop a late retransmission under the old keys once both
    // use the new ones).
    assert_eq!(sim.hosts[a].ep.stats().rejected(Reject::BadMac), 0);
}

/// A copy of the laptop's first KEYX, held back by someone on the path and
/// delivered after the server rolled back to the laptop's second one, is
/// older than the KEYX the server answered last: it changes nothing, and
/// both ends stay on the keys they agreed.
#[test]
fn a_late_copy_of_an_older_keyx_does_not_roll_back_again() {
    let (mut sim, flows) = setup(63, Link::default(), Config::default(), 1);
    let (a, b) = (0, 1);
    let f = flows[0];
    // The laptop's first KEYX, taken off the wire and kept.
    let first = sim.capture(a, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    assert!(!first.is_empty());
    let from = sa("10.0.0.1:2031");
    // Its retransmissions reach the server, whose answers are all lost.
    sim.hosts[b].mute = true;
    sim.run_for(Duration::from_secs(60));
    assert_eq!(sim.hosts[a].ep.stats().get(Counter::KeyxUnanswered), 1);
    sim.hosts[b].mute = false;
    // The second exchange: the server rolls back and both agree.
    sim.with(a, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(10));
    assert_eq!(sim.hosts[b].ep.stats().get(Counter::KeyxRolledBack), 1);
    let rekeyed = sim.hosts[b].ep.stats().get(Counter::Rekeyed);
    // The held copy arrives now.
    for t in &first {
        sim.inject(b, from, &t.payload);
    }
    assert_eq!(
        sim.hosts[b].ep.stats().get(Counter::KeyxRolledBack),
        1,
        "rolled back again"
    );
    assert_eq!(sim.hosts[b].ep.stats().get(Counter::Rekeyed), rekeyed);
    assert_the_laptop_s_move_completes(&mut sim, a, f);
}

/// The locators of the STORE and LOOKUP records among `ts`.
fn locators(ts: &[super::tx::Transmit], kind: super::wire::Kind) -> Vec<[u8; 16]> {
    use super::wire::{Ext, Message};
    ts.iter()
        .filter_map(|t| Message::decode(&t.payload).ok())
        .flat_map(|m| match m {
            Message::Records {
                kind: k, records, ..
            } if k == kind => records,
            _ => Vec::new(),
        })
        .filter_map(|r| match r.ext {
            Ext::Locator(l) => Some(l),
            _ => None,
        })
        .collect()
}

/// After a suspend-time key update, the end that answered it signs with
/// its previous keys until it sees the other use the new ones, and so
/// stores its location under its previous locator; the other end, on the
/// new keys already, must still find it: it looks up under both.
#[test]
fn after_a_key_update_each_end_still_finds_where_the_other_stored() {
    use super::wire::Kind;
    let (mut sim, flows) = setup(67, Link::default(), Config::default(), 1);
    let (a, b) = (0, 1);
    let f = flows[0];
    let g = reverse(&f);
    sim.with(a, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(5));
    assert!(sim.hosts[a].ep.stats().get(Counter::Rekeyed) >= 1);
    assert!(sim.hosts[b].ep.stats().get(Counter::Rekeyed) >= 1);
    // Both move at once: what each stores and asks at its first step.
    sim.move_host(a, "10.0.5.1");
    sim.move_host(b, "10.0.6.1");
    let from_a = sim.capture(a, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("10.0.5.1:40000"))])
            .expect("resume")
    });
    let from_b = sim.capture(b, |ep, now, rng| {
        ep.resume(now, rng, &[(g, sa("10.0.6.1:22"))])
            .expect("resume")
    });
    for (stores, asks, who) in [
        (&from_b, &from_a, "the laptop finds the server"),
        (&from_a, &from_b, "the server finds the laptop"),
    ] {
        let stored = locators(stores, Kind::Store);
        let asked = locators(asks, Kind::Lookup);
        assert!(
            !stored.is_empty() && stored.iter().all(|l| asked.contains(l)),
            "{who}: stored under {stored:?}, asked under {asked:?}"
        );
    }
}
