//! Rejection tests (issue 3, item 7): forged, replayed, reflected, spliced,
//! stale and out-of-order messages are refused with no state change and a
//! counted reason.

use crate::stats::{Counter, Reject};
use std::net::SocketAddr;
use std::time::Duration;

use proptest::prelude::*;

use super::endpoint::{Config, ConnectionView, Event};
use super::sim::{reverse, sa, tcp, Link, Sim};
use super::tx::Transmit;
use super::wire::Kind;
use crate::flow::VirtualFlow;

const A: usize = 0;
const B: usize = 1;

fn setup(n: u16) -> (Sim, Vec<VirtualFlow>) {
    let mut sim = Sim::new(11, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", Config::default());
    let flows: Vec<_> = (0..n)
        .map(|i| tcp(&format!("10.0.0.1:{}", 40000 + i), "10.0.0.2:22"))
        .collect();
    for f in &flows {
        sim.connect(A, B, *f);
    }
    sim.run_for(Duration::from_secs(10));
    (sim, flows)
}

fn of_kind(ts: &[Transmit], kind: Kind) -> Vec<u8> {
    ts.iter()
        .find(|t| t.payload[1] == kind as u8)
        .map(|t| t.payload.clone())
        .unwrap_or_else(|| panic!("no {kind:?} datagram among {} captured", ts.len()))
}

/// A's UPD claiming `phys` for `flows`.
fn upd(sim: &mut Sim, flows: &[VirtualFlow], phys: &str) -> Vec<u8> {
    let moves: Vec<_> = flows.iter().map(|f| (*f, sa(phys))).collect();
    let ts = sim.capture(A, |ep, now, rng| {
        ep.resume(now, rng, &moves).expect("resume")
    });
    of_kind(&ts, Kind::Upd)
}

struct Snapshot {
    views: Vec<Option<ConnectionView>>,
    events: usize,
    rejected: u64,
}

fn snapshot(sim: &Sim, h: usize, flows: &[VirtualFlow]) -> Snapshot {
    Snapshot {
        views: flows
            .iter()
            .map(|f| sim.hosts[h].ep.connection(f))
            .collect(),
        events: sim.hosts[h].events.len(),
        rejected: sim.hosts[h].ep.stats().rejected_total(),
    }
}

/// Deliver `bytes` to host `h` and check it was refused without a trace.
fn assert_refused(
    sim: &mut Sim,
    h: usize,
    flows: &[VirtualFlow],
    from: SocketAddr,
    bytes: &[u8],
    what: &str,
) {
    let before = snapshot(sim, h, flows);
    let replies = sim.inject(h, from, bytes);
    let after = snapshot(sim, h, flows);
    assert_eq!(
        before.views, after.views,
        "{what}: connection state changed"
    );
    assert_eq!(
        before.events,
        after.events,
        "{what}: an event was emitted: {:?}",
        sim.hosts[h].events.last()
    );
    assert!(replies.is_empty(), "{what}: the host answered");
    assert!(
        after.rejected > before.rejected,
        "{what}: no rejection was counted"
    );
}

fn b_flows(flows: &[VirtualFlow]) -> Vec<VirtualFlow> {
    flows.iter().map(reverse).collect()
}

#[test]
fn every_single_bit_flip_is_rejected() {
    // One record per datagram: records are authenticated one by one, so in
    // a batch a flip in one record leaves the others (rightly) valid.
    let (mut sim, flows) = setup(1);
    let bf = b_flows(&flows);
    let from = sa("10.0.0.1:2031");
    let susp = sim.capture(A, |ep, now, rng| {
        ep.suspend(now, rng, &flows).expect("suspend")
    });
    let mut messages = vec![
        ("SUSP_PRIMARY", of_kind(&susp, Kind::SuspPrimary)),
        ("KEYX", of_kind(&susp, Kind::KeyX)),
    ];
    messages.push(("UPD", upd(&mut sim, &flows, "10.0.0.1:50000")));
    for (name, good) in &messages {
        for bit in 0..good.len() * 8 {
            let mut bad = good.clone();
            bad[bit / 8] ^= 1 << (bit % 8);
            assert_refused(
                &mut sim,
                B,
                &bf,
                from,
                &bad,
                &format!("{name} with bit {bit} flipped"),
            );
        }
    }
    // The untouched messages are still accepted: the forgeries used nothing up.
    for (name, good) in &messages {
        let before = sim.hosts[B].ep.stats().get(Counter::RecordsAccepted);
        let replies = sim.inject(B, from, good);
        assert_eq!(
            sim.hosts[B].ep.stats().get(Counter::RecordsAccepted),
            before + 1,
            "{name} must be accepted after the forgeries"
        );
        assert!(
            !replies.is_empty() || *name == "SUSP_PRIMARY" || *name == "KEYX",
            "{name}: B must answer"
        );
    }
    assert!(sim.hosts[B].ep.stats().rejected(Reject::BadMac) > 0);
}

#[test]
fn replayed_update_is_rejected() {
    let (mut sim, flows) = setup(1);
    let bf = b_flows(&flows);
    let from = sa("10.0.0.1:2031");
    let u = upd(&mut sim, &flows, "10.0.0.1:50000");
    let replies = sim.inject(B, from, &u);
    assert!(!replies.is_empty(), "first copy must be answered");
    assert_eq!(
        sim.hosts[B].ep.connection(&bf[0]).map(|v| v.remote_phys),
        Some(sa("10.0.0.1:50000"))
    );
    assert_refused(&mut sim, B, &bf, from, &u, "replayed UPD");
    assert_eq!(sim.hosts[B].ep.stats().rejected(Reject::ReplayDuplicate), 1);
}

#[test]
fn reflected_messages_are_rejected() {
    let (mut sim, flows) = setup(1);
    let bf = b_flows(&flows);
    let u = upd(&mut sim, &flows, "10.0.0.1:50000");
    // A's own UPD sent back to A.
    assert_refused(
        &mut sim,
        A,
        &flows,
        sa("10.0.0.2:2031"),
        &u,
        "UPD reflected to its sender",
    );
    // B's UPD_R sent back to B.
    let replies = sim.inject(B, sa("10.0.0.1:2031"), &u);
    let upd_r = of_kind(&replies, Kind::UpdR);
    assert_refused(
        &mut sim,
        B,
        &bf,
        sa("10.0.0.1:2031"),
        &upd_r,
        "UPD_R reflected to its sender",
    );
    assert!(
        sim.hosts[A].ep.stats().rejected(Reject::UnknownConnection)
            + sim.hosts[B].ep.stats().rejected(Reject::UnknownConnection)
            >= 2
    );
}

#[test]
fn records_spliced_between_connections_are_rejected() {
    let (mut sim, flows) = setup(2);
    let bf = b_flows(&flows);
    let from = sa("10.0.0.1:2031");
    let u = upd(&mut sim, &flows, "10.0.0.1:50000");
    assert_eq!(u.len(), 8 + 2 * 48, "both records in one datagram");
    let (r1, r2) = (&u[8..56], &u[56..104]);
    // Record 1's body with record 2's tag, and the reverse.
    let mut swapped = u.clone();
    swapped[8 + 32..56].copy_from_slice(&r2[32..]);
    swapped[56 + 32..104].copy_from_slice(&r1[32..]);
    assert_refused(
        &mut sim,
        B,
        &bf,
        from,
        &swapped,
        "tags swapped between connections",
    );
    // Record 1 relabelled as connection 2 (its L_Vir_Port), tag kept.
    let mut relabelled = u.clone();
    relabelled[8 + 16..8 + 18].copy_from_slice(&r2[16..18]);
    relabelled[3] = 1;
    relabelled.truncate(56);
    assert_refused(
        &mut sim,
        B,
        &bf,
        from,
        &relabelled,
        "record moved to another connection",
    );
    // Record moved into a UPD_R datagram.
    let mut as_upd_r = u.clone();
    as_upd_r[1] = Kind::UpdR as u8;
    assert_refused(
        &mut sim,
        B,
        &bf,
        from,
        &as_upd_r,
        "UPD record in a UPD_R datagram",
    );
    assert!(sim.hosts[B].ep.stats().rejected(Reject::BadMac) >= 3);
    assert!(sim.hosts[B].ep.stats().rejected(Reject::CommandMismatch) >= 1);
}

#[test]
fn stale_and_out_of_window_updates_are_rejected() {
    let (mut sim, flows) = setup(1);
    let bf = b_flows(&flows);
    let from = sa("10.0.0.1:2031");
    let oldest = upd(&mut sim, &flows, "10.0.0.1:50001");
    for _ in 0..200 {
        upd(&mut sim, &flows, "10.0.0.1:50002");
    }
    let older = upd(&mut sim, &flows, "10.0.0.1:50003");
    let newer = upd(&mut sim, &flows, "10.0.0.1:50004");
    sim.inject(B, from, &newer);
    assert_eq!(
        sim.hosts[B].ep.connection(&bf[0]).map(|v| v.remote_phys),
        Some(sa("10.0.0.1:50004"))
    );
    assert_refused(
        &mut sim,
        B,
        &bf,
        from,
        &older,
        "older update after a newer one",
    );
    assert_eq!(sim.hosts[B].ep.stats().rejected(Reject::StaleUpdate), 1);
    assert_refused(
        &mut sim,
        B,
        &bf,
        from,
        &oldest,
        "update older than the replay window",
    );
    assert_eq!(sim.hosts[B].ep.stats().rejected(Reject::ReplayTooOld), 1);
}

#[test]
fn forged_lookup_answers_cannot_misdirect() {
    // A location server (or anyone) answering a lookup with a record not
    // signed by the peer: A ignores it.
    let (mut sim, flows) = setup(1);
    sim.hosts[B].alive = false;
    sim.move_host(A, "10.0.1.1");
    let moves = [(flows[0], sa("10.0.1.1:40000"))];
    let ts = sim.capture(A, |ep, now, rng| {
        ep.resume(now, rng, &moves).expect("resume")
    });
    let lookup = of_kind(&ts, Kind::Lookup);
    let req = &lookup[4..8];
    // A STORE record for B's end claiming 10.6.6.6, with a made-up tag.
    let mut fake = vec![1, Kind::LookupR as u8, 4, 1];
    fake.extend_from_slice(req);
    fake.extend_from_slice(&[
        1,
        Kind::Store as u8,
        0x9c,
        0x40,
        10,
        0,
        0,
        1,
        10,
        0,
        0,
        2,
        10,
        6,
        6,
        6,
        0,
        22,
        0,
        22,
    ]);
    fake.extend_from_slice(&[0x33; 16]); // a locator
    fake.extend_from_slice(&[6, 0, 0, 0]);
    fake.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 99]);
    fake.extend_from_slice(&[0x42; 16]);
    let before = sim.hosts[A].ep.stats().rejected(Reject::BadMac);
    let replies = sim.inject(A, sa("10.0.0.2:2031"), &fake);
    assert!(
        replies.iter().all(|t| t.dst.ip() != sa("10.6.6.6:1").ip()),
        "nothing may go to the forged location"
    );
    assert_eq!(sim.hosts[A].ep.stats().rejected(Reject::BadMac), before + 1);
    assert!(!sim.hosts[A]
        .events
        .iter()
        .any(|(_, e)| matches!(e, Event::SetRemote { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]
    /// Whatever the order (and duplicates) in which updates arrive, the
    /// binding ends at the one with the highest sequence number.
    #[test]
    fn binding_ends_at_the_highest_sequence_update(
        order in (1usize..10).prop_flat_map(|k| Just((0..k).collect::<Vec<_>>()).prop_shuffle()),
        dups in proptest::collection::vec(0usize..10, 0..4),
    ) {
        let (mut sim, flows) = setup(1);
        let bf = b_flows(&flows);
        let k = order.len();
        let ups: Vec<Vec<u8>> = (0..k).map(|i| upd(&mut sim, &flows, &format!("10.0.0.1:{}", 50000 + i))).collect();
        let from = sa("10.0.0.1:2031");
        for i in order.iter().chain(dups.iter().filter(|d| **d < k)) {
            sim.inject(B, from, &ups[*i]);
        }
        let want = sa(&format!("10.0.0.1:{}", 50000 + k - 1));
        prop_assert_eq!(sim.hosts[B].ep.connection(&bf[0]).map(|v| v.remote_phys), Some(want));
    }
}

#[test]
fn forged_stores_at_the_peer_are_refused() {
    // B is a location server for A's connection and holds its key: a
    // forged STORE for A's end is refused, A's genuine one is kept.
    let (mut sim, flows) = setup(1);
    let f = flows[0];
    let forged = super::wire::Message::Records {
        kind: Kind::Store,
        request_id: 5,
        family: super::wire::Family::V4,
        records: vec![super::wire::Record {
            command: Kind::Store,
            proto: f.proto,
            receiver_vir: f.remote,
            sender_vir: f.local,
            sender_phys: sa("10.6.6.6:40000"),
            ext: super::wire::Ext::Locator([0x77; 16]),
            seq: u64::MAX,
            tag: [0x77; 16],
        }],
    }
    .encode()
    .expect("forged STORE encodes");
    let replies = sim.inject(B, sa("10.6.6.6:2031"), &forged);
    assert_eq!(
        sim.hosts[B].ep.stored_locations(),
        0,
        "a forged STORE must not be kept"
    );
    assert_eq!(sim.hosts[B].ep.stats().rejected(Reject::BadMac), 1);
    assert!(
        replies.iter().all(|t| t.payload[3] == 0),
        "STORE_R must say nothing was stored"
    );
    let ts = sim.capture(A, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("10.0.1.1:40000"))])
            .expect("resume")
    });
    let genuine = of_kind(&ts, Kind::Store);
    sim.inject(B, sa("10.0.1.1:2031"), &genuine);
    assert_eq!(
        sim.hosts[B].ep.stored_locations(),
        1,
        "the genuine STORE must be kept"
    );
}

/// SWITCHED releases a moved connection's TCP restart. A forged or
/// replayed one must release nothing (early, the restart's retransmission
/// would reach a peer still answering at the old address), and even a
/// genuine one for a connection that is not waiting changes nothing.
#[test]
fn forged_or_replayed_switched_releases_nothing() {
    let (mut sim, flows) = setup(2);
    let bf = b_flows(&flows);
    sim.move_host(A, "10.0.1.1");
    let moves: Vec<_> = flows
        .iter()
        .map(|f| (*f, sa(&format!("10.0.1.1:{}", f.local.port()))))
        .collect();
    sim.with(A, |ep, now, rng| {
        ep.resume(now, rng, &moves).expect("resume")
    });
    // Long enough for the move (B does not confirm by itself), short of
    // the 400 ms fallback.
    sim.run_for(Duration::from_millis(50));
    let released = |sim: &Sim| {
        sim.hosts[A]
            .events
            .iter()
            .filter(|(_, e)| matches!(e, Event::PeerSwitched { .. }))
            .count()
    };
    assert!(
        sim.hosts[A]
            .events
            .iter()
            .any(|(_, e)| matches!(e, Event::Resumed { .. })),
        "A's move must be complete"
    );
    assert_eq!(released(&sim), 0, "nothing released before B confirms");
    let ts = sim.capture(B, |ep, now, rng| ep.confirm_switched(now, rng, &bf));
    let good = of_kind(&ts, Kind::Switched);
    let from = sa("10.0.0.2:2031");
    for bit in 0..good.len() * 8 {
        let mut bad = good.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        assert_refused(
            &mut sim,
            A,
            &flows,
            from,
            &bad,
            &format!("SWITCHED with bit {bit} flipped"),
        );
    }
    assert_eq!(released(&sim), 0, "a forgery released a connection");
    let replies = sim.inject(A, from, &good);
    assert!(replies.is_empty(), "SWITCHED is not answered");
    let confirmed: Vec<_> = sim.hosts[A]
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::PeerSwitched { flow, confirmed } => Some((*flow, *confirmed)),
            _ => None,
        })
        .collect();
    assert_eq!(
        confirmed,
        flows.iter().map(|f| (*f, true)).collect::<Vec<_>>(),
        "one genuine SWITCHED releases the whole group"
    );
    assert_refused(&mut sim, A, &flows, from, &good, "replayed SWITCHED");
    assert!(sim.hosts[A].ep.stats().rejected(Reject::ReplayDuplicate) > 0);
    // A fresh, genuine SWITCHED when nothing waits: accepted, no effect.
    let ts = sim.capture(B, |ep, now, rng| ep.confirm_switched(now, rng, &bf));
    let again = of_kind(&ts, Kind::Switched);
    let before = snapshot(&sim, A, &flows);
    sim.inject(A, from, &again);
    let after = snapshot(&sim, A, &flows);
    assert_eq!(before.views, after.views);
    assert_eq!(before.events, after.events, "nothing was waiting");
    // And the fallback timer has nothing left to release.
    sim.run_for(Duration::from_secs(2));
    assert_eq!(released(&sim), flows.len());
    assert_eq!(sim.hosts[A].ep.stats().get(Counter::SwitchUnconfirmed), 0);
}

/// Issue 16, item 5 (found by the `vcmp_location` fuzz target): a location
/// server cannot verify a STORE, so forged records for a connection, from
/// other sources and with higher sequence numbers, must not push the
/// genuine one out of the answer to a LOOKUP. They used to: four were kept
/// and the three highest sequence numbers answered.
#[test]
fn forged_stores_with_higher_sequence_numbers_cannot_hide_the_genuine_record() {
    use super::crypto::{DrbgRng, HostIdentity};
    use super::endpoint::Endpoint;
    use super::wire::{Ext, Family, Message, Record};
    use super::Timestamp;
    use crate::flow::Proto;

    let (owner, other) = (sa("10.0.0.1:40000"), sa("10.0.0.2:443"));
    // Forgers that know even the locator (they saw the STORE go by).
    let locator = Ext::Locator([0x5a; 16]);
    let rec = |seq: u64, tag: u8, phys: &str| Record {
        command: Kind::Store,
        proto: Proto::Tcp,
        receiver_vir: other,
        sender_vir: owner,
        sender_phys: sa(phys),
        ext: locator,
        seq,
        tag: [tag; 16],
    };
    let records = |kind: Kind, r: Record| {
        Message::Records {
            kind,
            request_id: 9,
            family: Family::V4,
            records: vec![r],
        }
        .encode()
        .unwrap()
    };
    let mut rng = DrbgRng::from_seed(4);
    let now = Timestamp(1_000_000_000);
    let mut server = Endpoint::new(Config::default(), HostIdentity::from_bytes([9; 32]));
    let genuine = rec(10, 0x11, "10.0.5.1:2031");
    server.handle_datagram(
        now,
        &mut rng,
        sa("10.0.5.1:2031"),
        &records(Kind::Store, genuine),
    );
    for (i, src) in ["10.6.6.1:2031", "10.6.6.2:2031", "10.6.6.3:2031"]
        .iter()
        .enumerate()
    {
        let forged = rec(u64::MAX - i as u64, 0x66, "10.6.6.6:2031");
        server.handle_datagram(now, &mut rng, sa(src), &records(Kind::Store, forged));
    }
    while server.poll_transmit(now).is_some() {}
    let asker = sa("10.0.0.2:2031");
    let lookup = Record {
        command: Kind::Lookup,
        receiver_vir: owner,
        sender_vir: other,
        sender_phys: other,
        seq: 0,
        tag: [0; 16],
        ..genuine
    };
    server.handle_datagram(now, &mut rng, asker, &records(Kind::Lookup, lookup));
    let mut answered = Vec::new();
    while let Some(t) = server.poll_transmit(now) {
        if let Ok(Message::Records {
            kind: Kind::LookupR,
            records,
            ..
        }) = Message::decode(&t.payload)
        {
            answered.extend(records.iter().map(|r| (r.seq, r.tag[0])));
        }
    }
    assert!(
        answered.contains(&(10, 0x11)),
        "the genuine record is missing from the answer: {answered:?}"
    );
}

/// Issue 16, item 5: locations are kept and found under a locator that only
/// the connection's two ends can compute (from its keys). A host that knows
/// the connection's addresses, and even both host keys, can neither look
/// its location up nor take its slots before the owner stores.
#[test]
fn only_the_two_ends_can_look_a_location_up_or_take_its_slots() {
    let cfg = Config {
        location_servers: vec![sa("10.9.9.9:2031")],
        ..Config::default()
    };
    let (mut sim, flows) = super::sim_tests::setup(5, super::sim::Link::default(), cfg, 1);
    let server = sim.add_host("10.9.9.9", Config::default());
    let f = flows[0];
    // The stranger fills the slots of every locator it can think of for
    // this connection's addresses, before the owner stores.
    let forged = |loc: [u8; 16], phys: &str| {
        super::wire::Message::Records {
            kind: Kind::Store,
            request_id: 1,
            family: super::wire::Family::V4,
            records: vec![super::wire::Record {
                command: Kind::Store,
                proto: f.proto,
                receiver_vir: f.remote,
                sender_vir: f.local,
                sender_phys: sa(phys),
                ext: super::wire::Ext::Locator(loc),
                seq: u64::MAX,
                tag: [0x66; 16],
            }],
        }
        .encode()
        .expect("encodes")
    };
    for (i, src) in ["10.6.6.1:2031", "10.6.6.2:2031", "10.6.6.3:2031"]
        .iter()
        .enumerate()
    {
        for loc in [[0u8; 16], [0xff; 16], [i as u8; 16]] {
            sim.inject(server, sa(src), &forged(loc, "10.6.6.6:40000"));
        }
    }
    // A moves; its STORE at the location server is kept beside them.
    sim.move_host(A, "10.0.1.1");
    let ts = sim.capture(A, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("10.0.1.1:40000"))])
            .expect("resume")
    });
    let store: Vec<_> = ts
        .iter()
        .filter(|t| t.dst == sa("10.9.9.9:2031") && t.payload[1] == Kind::Store as u8)
        .collect();
    assert!(!store.is_empty(), "A stores at the location server");
    let replies = sim.inject(server, sa("10.0.1.1:2031"), &store[0].payload);
    assert!(
        replies
            .iter()
            .any(|t| t.payload[1] == Kind::StoreR as u8 && t.payload[3] == 1),
        "the genuine STORE must be kept"
    );
    // The stranger asks by the connection's addresses with any locator:
    // nothing. B asks with its own: A's genuine record.
    let lookup = |loc: [u8; 16]| {
        super::wire::Message::Records {
            kind: Kind::Lookup,
            request_id: 2,
            family: super::wire::Family::V4,
            records: vec![super::wire::Record {
                command: Kind::Lookup,
                proto: f.proto,
                receiver_vir: f.local,
                sender_vir: f.remote,
                sender_phys: f.remote,
                ext: super::wire::Ext::Locator(loc),
                seq: 1,
                tag: [0; 16],
            }],
        }
        .encode()
        .expect("encodes")
    };
    let found = |replies: Vec<super::tx::Transmit>| -> Vec<std::net::SocketAddr> {
        replies
            .iter()
            .filter_map(|t| super::wire::Message::decode(&t.payload).ok())
            .flat_map(|m| match m {
                super::wire::Message::Records {
                    kind: Kind::LookupR,
                    records,
                    ..
                } => records.iter().map(|r| r.sender_phys).collect(),
                _ => Vec::new(),
            })
            .collect()
    };
    let guessed = found(sim.inject(server, sa("10.7.7.7:2031"), &lookup([0x42; 16])));
    assert!(!guessed.contains(&sa("10.0.1.1:40000")), "{guessed:?}");
    // B's locator for A's records: from its receive key (what its LOOKUP
    // carries; the tag of a LOOKUP is not checked by a third party).
    let b_conn = &sim.hosts[B].ep.conns[&reverse(&f)];
    let b_loc = super::crypto::locator(&b_conn.keys.as_ref().expect("B has keys").recv);
    let answer = found(sim.inject(server, sa("10.0.0.2:2031"), &lookup(b_loc)));
    assert_eq!(
        answer,
        vec![sa("10.0.1.1:40000")],
        "B finds exactly A's record"
    );
}
