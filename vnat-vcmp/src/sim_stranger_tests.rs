//! Simulator tests of pairing with a stranger (`vcmp::strangers`): a host
//! whose connection this host knows under an address it does not speak
//! VCMP from (a container whose address its host routes, no NAT).

use crate::stats::{Counter, Reject};
use std::time::Duration;

use super::endpoint::{Config, Event};
use super::sim::{reverse, sa, tcp, Link, Sim};

/// The laptop at 10.0.0.1 routes 10.9.0.0/24 to a container; the
/// container's connection to the server names 10.9.0.2, where nothing
/// answers VCMP. The server's pairing with 10.9.0.2 fails, after which it
/// lets the laptop pair from 10.0.0.1 (with a cookie), and the laptop's
/// claim binds the connection once it showed it receives at 10.9.0.2 (the
/// server's PROVE there reaches the laptop's vnatd, which routes it): both
/// ends get keys, the laptop becomes a known peer of the server's, and the
/// connection then moves.
#[test]
fn a_routed_containers_host_pairs_as_a_stranger_and_its_claim_binds() {
    let mut sim = Sim::new(41, Link::default());
    let l = sim.add_host("10.0.0.1", Config::default());
    let s = sim.add_host("10.0.0.2", Config::default());
    sim.hosts[l].routes.push(super::sim::ip("10.9.0.2"));
    sim.hosts[s].confirms_switch = true;
    let f = tcp("10.9.0.2:40000", "10.0.0.2:80");
    sim.connect(l, s, f);
    let sf = reverse(&f);
    sim.run_for(Duration::from_secs(60));

    let server = sim.hosts[s].ep.connection(&sf).expect("server side");
    let laptop = sim.hosts[l].ep.connection(&f).expect("laptop side");
    let lkey = sim.hosts[l].ep.public_key();
    assert!(
        server.has_keys && laptop.has_keys,
        "the connection has keys at both ends"
    );
    assert_eq!(server.peer_key, Some(lkey));
    let st = sim.hosts[s].ep.stats();
    assert!(
        st.rejected(Reject::PairUnknownSource) >= 1,
        "before its own pairing failed, the server refused the stranger: {st:?}"
    );
    assert_eq!(st.get(Counter::StrangerPaired), 1, "{st:?}");
    assert_eq!(st.get(Counter::StrangerPromoted), 1, "{st:?}");
    assert_eq!(st.get(Counter::StrangerDropped), 0, "{st:?}");
    assert!(
        st.get(Counter::PairCookiesSent) >= 1,
        "a stranger proves its address first"
    );
    assert_eq!(
        st.get(Counter::ProofsAccepted),
        1,
        "and the connection's address before its claim binds: {st:?}"
    );
    assert!(
        sim.events(
            s,
            |e| matches!(e, Event::Paired { key, .. } if *key == lkey)
        )
        .next()
        .is_some(),
        "the server announces the laptop once its claim bound"
    );
    assert!(!sim.hosts[s].ep.pairing.strangers.is_pending(&lkey));

    // The laptop moves: the container's connection goes on from its new
    // address, which the server switches to.
    sim.move_host(l, "10.0.1.1");
    sim.with(l, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("10.0.1.1:40000"))])
            .expect("resume")
    });
    sim.run_for(Duration::from_secs(10));
    assert!(
        sim.events(s, |e| matches!(e, Event::SetRemote { flow, remote } if *flow == sf && *remote == sa("10.0.1.1:40000")))
            .next()
            .is_some(),
        "the server must send to the laptop's new address"
    );
}

/// A stranger that pairs but binds nothing (it names a waiting connection
/// without knowing its sequence numbers) is dropped after the grace, with
/// no place among the known hosts; and with no connection waiting, a
/// stranger is refused unanswered.
#[test]
fn a_stranger_that_binds_nothing_is_dropped_and_none_are_taken_when_nothing_waits() {
    let mut sim = Sim::new(42, Link::default());
    let s = sim.add_host("10.0.0.2", Config::default());
    let x = sim.add_host("10.0.0.3", Config::default());
    // The server waits for 10.9.0.2's host, which never answers.
    let sf = tcp("10.0.0.2:80", "10.9.0.2:40000");
    let (_, good) = sim.bindings(&reverse(&sf));
    sim.with(s, |ep, now, rng| {
        ep.connection_added(now, rng, sf, sf.local, sf.remote, good)
            .expect("add")
    });
    sim.run_for(Duration::from_secs(20));
    // The stranger guesses: right names, wrong sequence numbers.
    let xf = reverse(&sf);
    let (guessed, _) = sim.bindings(&xf);
    sim.with(x, |ep, now, rng| {
        ep.connection_added(now, rng, xf, xf.local, sa("10.0.0.2:80"), guessed)
            .expect("add")
    });
    sim.run_for(Duration::from_secs(10));
    let xkey = sim.hosts[x].ep.public_key();
    let st = sim.hosts[s].ep.stats();
    assert_eq!(st.get(Counter::StrangerPaired), 1, "{st:?}");
    assert!(sim.hosts[s].ep.pairing.strangers.is_pending(&xkey));
    assert_eq!(sim.hosts[s].ep.connection(&sf).expect("sf").peer_key, None);
    // Its provisional session is no introduction: pairing again, from
    // there or anywhere, is a stranger's pairing again.
    for from in ["10.0.0.3", "10.0.0.9"] {
        assert!(
            !sim.hosts[s]
                .ep
                .knows_initiator(&super::sim::ip(from), &xkey),
            "a pending stranger is known from {from}"
        );
    }
    assert_eq!(
        sim.hosts[s].ep.stats().get(Counter::Paired),
        0,
        "counted once promoted"
    );
    sim.run_for(Duration::from_secs(30));
    let st = sim.hosts[s].ep.stats();
    assert_eq!(st.get(Counter::StrangerDropped), 1, "{st:?}");
    assert_eq!(st.get(Counter::StrangerPromoted), 0, "{st:?}");
    assert!(!sim.hosts[s].ep.pairing.strangers.is_pending(&xkey));
    assert!(!sim.hosts[s].ep.pairing.known_hosts.contains(&xkey));
    assert!(
        sim.events(
            s,
            |e| matches!(e, Event::Paired { key, .. } if *key == xkey)
        )
        .next()
        .is_none(),
        "a stranger that bound nothing is never announced"
    );

    // Nothing waits any more: a stranger is refused without an answer.
    sim.with(s, |ep, _, _| ep.connection_removed(&sf));
    let before = sim.hosts[s].ep.stats().rejected(Reject::PairUnknownSource);
    let y = sim.add_host("10.0.0.4", Config::default());
    let yf = tcp("10.0.0.4:40001", "10.0.0.2:81");
    let (b, _) = sim.bindings(&yf);
    sim.with(y, |ep, now, rng| {
        ep.connection_added(now, rng, yf, yf.local, yf.remote, b)
            .expect("add")
    });
    sim.run_for(Duration::from_secs(5));
    let st = sim.hosts[s].ep.stats();
    assert!(st.rejected(Reject::PairUnknownSource) > before, "{st:?}");
    assert_eq!(st.get(Counter::StrangerPaired), 1, "{st:?}");
}

/// The server waits for the host of 10.9.0.2, which runs no vnatd. X once
/// saw the connection's handshake (public Wi-Fi), so it knows both initial
/// sequence numbers; later, from its own address, it pairs and claims the
/// connection, then "moves" it to itself. Only a host that holds the
/// connection's address may bind it: the server asks for proof at
/// 10.9.0.2, which never reaches X, so nothing is bound and the
/// connection keeps going to 10.9.0.2.
fn sniffer_claims(
    sim: &mut Sim,
    s: usize,
    x: usize,
    x_at: &str,
) -> (super::flow::VirtualFlow, [u8; 32]) {
    let sf = tcp("10.0.0.2:80", "10.9.0.2:40000");
    let xf = reverse(&sf);
    // The handshake's facts, as both ends recorded them.
    let (sniffed, good) = sim.bindings(&xf);
    sim.with(s, |ep, now, rng| {
        ep.connection_added(now, rng, sf, sf.local, sf.remote, good)
            .expect("add")
    });
    sim.run_for(Duration::from_secs(20));
    sim.with(x, |ep, now, rng| {
        ep.connection_added(now, rng, xf, xf.local, sa("10.0.0.2:80"), sniffed)
            .expect("add")
    });
    sim.run_for(Duration::from_secs(10));
    let xkey = sim.hosts[x].ep.public_key();
    // If it got keys, it redirects the connection to itself.
    if sim.hosts[x].ep.connection(&xf).is_some_and(|c| c.has_keys) {
        let to = sa(&format!("{x_at}:40000"));
        sim.with(x, |ep, now, rng| {
            ep.resume(now, rng, &[(xf, to)]).expect("resume")
        });
        sim.run_for(Duration::from_secs(10));
    }
    (sf, xkey)
}

fn assert_untouched(sim: &Sim, s: usize, sf: &super::flow::VirtualFlow, xkey: &[u8; 32]) {
    let c = sim.hosts[s].ep.connection(sf).expect("server side");
    let st = sim.hosts[s].ep.stats();
    let redirected: Vec<_> = sim
        .events(
            s,
            |e| matches!(e, Event::SetRemote { flow, .. } if flow == sf),
        )
        .collect();
    assert!(
        redirected.is_empty(),
        "the server redirected the connection: {redirected:?}"
    );
    assert_eq!(c.peer_key, None, "bound to the sniffer: {st:?}");
    assert!(!c.has_keys, "{st:?}");
    assert_eq!(c.remote_phys, sa("10.9.0.2:40000"));
    assert!(!sim.hosts[s].ep.pairing.known_hosts.contains(xkey));
    assert!(
        st.rejected(Reject::ClaimUnproven) >= 1,
        "the claim waited for a proof: {st:?}"
    );
    assert!(
        sim.wire_log.iter().any(
            |(_, from, to, kind)| from.ip() == super::sim::ip("10.0.0.2")
                && *to == sa("10.9.0.2:2031")
                && *kind == crate::proof::KIND_PROVE
        ),
        "the proof was asked of the connection's address"
    );
}

#[test]
fn a_stranger_that_sniffed_the_handshake_cannot_claim_the_connection() {
    let mut sim = Sim::new(43, Link::default());
    let s = sim.add_host("10.0.0.2", Config::default());
    let x = sim.add_host("10.0.0.66", Config::default());
    let (sf, xkey) = sniffer_claims(&mut sim, s, x, "10.0.0.66");
    assert_untouched(&sim, s, &sf, &xkey);
    let st = sim.hosts[s].ep.stats();
    assert_eq!(st.get(Counter::StrangerPromoted), 0, "{st:?}");
    assert_eq!(sim.hosts[s].ep.pairing.strangers.proofs.asked_of(&xkey), 1);
    // Its grace ends: nothing of it stays, what it was asked included (or
    // strangers coming and going would fill the table of asks).
    sim.run_for(Duration::from_secs(40));
    let st = sim.hosts[s].ep.stats();
    assert_eq!(st.get(Counter::StrangerDropped), 1, "{st:?}");
    assert_eq!(
        sim.hosts[s].ep.pairing.strangers.proofs.asked_of(&xkey),
        0,
        "a dropped stranger's asks stayed"
    );
}

/// The same from a host the server knows (paired because of a connection
/// of its own): being a peer is no right to someone else's connection.
#[test]
fn a_paired_peer_that_sniffed_the_handshake_cannot_claim_the_connection() {
    let mut sim = Sim::new(44, Link::default());
    let s = sim.add_host("10.0.0.2", Config::default());
    let x = sim.add_host("10.0.0.66", Config::default());
    sim.connect(x, s, tcp("10.0.0.66:5000", "10.0.0.2:81"));
    sim.run_for(Duration::from_secs(5));
    let xkey = sim.hosts[x].ep.public_key();
    assert!(sim.hosts[s].ep.pairing.known_hosts.contains(&xkey));
    let (sf, _) = sniffer_claims(&mut sim, s, x, "10.0.0.66");
    let c = sim.hosts[s].ep.connection(&sf).expect("server side");
    let st = sim.hosts[s].ep.stats();
    let redirected: Vec<_> = sim
        .events(
            s,
            |e| matches!(e, Event::SetRemote { flow, .. } if *flow == sf),
        )
        .collect();
    assert!(
        redirected.is_empty(),
        "the server redirected the connection: {redirected:?}"
    );
    assert_eq!(c.peer_key, None, "bound to the sniffer: {st:?}");
    assert!(st.rejected(Reject::ClaimUnproven) >= 1, "{st:?}");
}
