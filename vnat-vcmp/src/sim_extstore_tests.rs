//! Scenario tests on the simulator: both ends moving with only an external
//! store (etcd in vnatd; `vcmp::extstore`) knowing where each went, and a
//! store that lies, replays or is down.

use std::collections::HashMap;
use std::time::Duration;

use crate::stats::{Counter, Reject};

use super::endpoint::{AbortReason, Config, Event};
use super::extstore::{StoreAnswer, StoreRequest};
use super::location::LocKey;
use super::sim::{reverse, sa, Link, Sim};
use super::sim_tests::{assert_both_resumed_at, resume, setup};
use super::wire::{self, Ext, Kind, Record, LOCATOR_LEN, MAX_SIGNED_LEN, TAG_LEN};

/// The store the test plays: values by writer and locator, and what it
/// does to them.
#[derive(Default)]
struct Store {
    values: HashMap<([u8; 32], LocKey), Vec<u8>>,
    /// Every value ever put, oldest first.
    history: Vec<([u8; 32], LocKey, Vec<u8>)>,
    down: bool,
    /// Answers every lookup with this instead of what is stored.
    lie: Option<Vec<u8>>,
}

impl Store {
    /// Answer every request of every host.
    fn serve(&mut self, sim: &mut Sim) {
        for h in 0..sim.hosts.len() {
            while let Some(r) = sim.hosts[h].ep.poll_store_request() {
                let id = r.id();
                let answer = match r {
                    _ if self.down => StoreAnswer::Unavailable,
                    StoreRequest::Put { items, .. } => {
                        for i in items {
                            self.history.push((i.host, i.locator, i.value.clone()));
                            self.values.insert((i.host, i.locator), i.value);
                        }
                        StoreAnswer::Stored
                    }
                    StoreRequest::Get { wanted, .. } => StoreAnswer::Found(
                        wanted
                            .iter()
                            .filter_map(|w| match &self.lie {
                                Some(v) => Some(v.clone()),
                                None => self.values.get(&(w.host, w.locator)).cloned(),
                            })
                            .collect(),
                    ),
                };
                sim.with(h, |ep, now, rng| {
                    ep.handle_store_answer(now, rng, id, answer)
                });
            }
        }
    }

    /// Run the simulation for `d`, answering the store's requests every
    /// millisecond or so (the store's round trip).
    fn run(&mut self, sim: &mut Sim, d: Duration) {
        let step = Duration::from_millis(2);
        let mut t = Duration::ZERO;
        while t < d {
            self.serve(sim);
            sim.run_for(step);
            t += step;
        }
    }
}

fn external() -> Config {
    Config {
        external_store: true,
        ..Config::default()
    }
}

fn both_move(
    sim: &mut Sim,
    flows: &[super::flow::VirtualFlow],
    a: &str,
    b: &str,
    store: &mut Store,
) {
    sim.move_host(0, a);
    sim.move_host(1, b);
    let b_flows: Vec<_> = flows.iter().map(reverse).collect();
    resume(sim, 0, flows, a);
    store.run(sim, Duration::from_millis(300));
    resume(sim, 1, &b_flows, b);
}

#[test]
fn both_move_and_only_the_external_store_can_tell() {
    let (mut sim, flows) = setup(11, Link::default(), external(), 3);
    let mut store = Store::default();
    both_move(&mut sim, &flows, "10.0.1.1", "10.0.2.2", &mut store);
    store.run(&mut sim, Duration::from_secs(20));
    assert_both_resumed_at(&sim, &flows, "10.0.1.1", "10.0.2.2");
    // One record per connection and end, under its writer's key.
    let a_key = sim.hosts[0].ep.public_key();
    let b_key = sim.hosts[1].ep.public_key();
    let per = |k: [u8; 32]| store.values.keys().filter(|(h, _)| *h == k).count();
    assert_eq!((per(a_key), per(b_key)), (flows.len(), flows.len()));
}

#[test]
fn a_forged_record_in_the_store_is_refused() {
    let (mut sim, flows) = setup(12, Link::default(), external(), 1);
    let f = flows[0];
    // What a forger with write access to the store can make: a record
    // naming A's connection and a new address for B, with a tag it had to
    // guess, put where A looks.
    let rec = Record {
        command: Kind::Store,
        proto: f.proto,
        receiver_vir: f.local,
        sender_vir: f.remote,
        sender_phys: sa("10.6.6.6:22"),
        ext: Ext::Locator([0; LOCATOR_LEN]),
        seq: u64::MAX / 2,
        tag: [0x42; TAG_LEN],
    };
    let mut signed = [0u8; MAX_SIGNED_LEN];
    let n = rec.write_signed(&mut signed).expect("encodes");
    let mut forged = Vec::new();
    wire::begin_records(&mut forged, Kind::Store, rec.family(), 0);
    wire::push_record(&mut forged, &signed[..n], &rec.tag).expect("fits");
    let mut store = Store {
        lie: Some(forged),
        ..Store::default()
    };
    both_move(&mut sim, &flows, "10.0.1.1", "10.0.2.2", &mut store);
    store.run(&mut sim, Duration::from_secs(5));
    assert!(
        sim.hosts[0].ep.stats().rejected(Reject::BadMac) > 0,
        "the forged record must be refused as unauthentic"
    );
    let forged_at = sa("10.6.6.6:22");
    assert!(
        sim.events(
            0,
            |e| matches!(e, Event::SetRemote { remote, .. } if *remote == forged_at)
        )
        .next()
        .is_none(),
        "A must not follow a forged record"
    );
    assert!(
        !sim.wire_log
            .iter()
            .any(|(_, _, to, _)| to.ip() == forged_at.ip()),
        "nothing may be sent where the forged record points"
    );
}

#[test]
fn a_replayed_older_record_is_refused() {
    let (mut sim, flows) = setup(13, Link::default(), external(), 1);
    let mut store = Store::default();
    both_move(&mut sim, &flows, "10.0.1.1", "10.0.2.2", &mut store);
    store.run(&mut sim, Duration::from_secs(20));
    assert_both_resumed_at(&sim, &flows, "10.0.1.1", "10.0.2.2");
    let b_key = sim.hosts[1].ep.public_key();
    let old = store
        .history
        .iter()
        .find(|(h, _, _)| *h == b_key)
        .map(|(_, _, v)| v.clone())
        .expect("B stored its location");
    // Both move again; the store answers A with B's first record, genuine
    // but older than the one A already followed.
    store.lie = Some(old);
    let stale_before = sim.hosts[0].ep.stats().rejected(Reject::StaleLocation);
    both_move(&mut sim, &flows, "10.0.3.3", "10.0.4.4", &mut store);
    store.run(&mut sim, Duration::from_secs(5));
    assert!(
        sim.hosts[0].ep.stats().rejected(Reject::StaleLocation) > stale_before,
        "a replayed record older than the one followed must be refused"
    );
    let f = flows[0];
    let back_at = sa(&format!("10.0.2.2:{}", f.remote.port()));
    assert_eq!(
        sim.events(
            0,
            |e| matches!(e, Event::SetRemote { flow, remote } if *flow == f && *remote == back_at)
        )
        .count(),
        1,
        "A must not go back to B's old address"
    );
}

#[test]
fn a_store_that_is_down_fails_its_steps_and_the_move_ends() {
    let cfg = Config {
        max_rounds: 1,
        ..external()
    };
    let (mut sim, flows) = setup(14, Link::default(), cfg, 1);
    let mut store = Store {
        down: true,
        ..Store::default()
    };
    both_move(&mut sim, &flows, "10.0.1.1", "10.0.2.2", &mut store);
    store.run(&mut sim, Duration::from_secs(120));
    let f = flows[0];
    assert!(
        sim.events(0, |e| matches!(
            e,
            Event::MigrationAborted { flow, reason: AbortReason::LocationUnknown { .. } } if *flow == f
        ))
        .next()
        .is_some(),
        "with the store down and both ends moved, the move must end as without a location server"
    );
    assert!(sim.hosts[0].ep.stats().get(Counter::MigrationAborted) > 0);
}
