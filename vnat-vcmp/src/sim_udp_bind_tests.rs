//! Simulator tests of who may bind a UDP flow (issue 31, item 1): a flow's
//! remote address is no credential, a CLAIM alone binds no UDP flow, and a
//! host that pairs from a flow's address learns nothing of that flow.

use std::time::Duration;

use super::binding::Binding;
use super::crypto::{claim_commitment, tag_datagram};
use super::endpoint::{Config, Event};
use super::sim::{reverse, sa, tcp, udp, Link, Sim};
use super::wire::{ClaimEntry, Message, PAIR_TAG_LEN};
use crate::flow::{Proto, VirtualFlow};

/// The NAT (or CGNAT) address where the victim's UDP flow comes from.
const N: &str = "203.0.113.7";

/// A (10.0.0.1) has a UDP flow A:5060 to N:40000, whose host runs no
/// vnatd; X (10.0.0.9) is paired with A through a TCP connection of its
/// own. X forges a CLAIM from N:40000 naming the flow (its endpoints are
/// all a commitment hides, so X can compute it under its own claim key),
/// then takes the flow's keys and sends an update naming its own address.
/// The flow must stay unbound and untranslated.
#[test]
fn a_claim_forged_from_a_flows_address_binds_nothing_and_the_flow_never_moves() {
    let mut sim = Sim::new(71, Link::default());
    let a = sim.add_host("10.0.0.1", Config::default());
    let x = sim.add_host("10.0.0.9", Config::default());
    sim.connect(x, a, tcp("10.0.0.9:50000", "10.0.0.1:443"));
    let victim = udp("10.0.0.1:5060", &format!("{N}:40000"));
    sim.with(a, |ep, now, rng| {
        ep.connection_added(
            now,
            rng,
            victim,
            victim.local,
            victim.remote,
            Binding::endpoints(&victim),
        )
        .expect("add the victim's flow")
    });
    sim.run_for(Duration::from_secs(30));
    let (a_key, x_key) = (sim.hosts[a].ep.public_key(), sim.hosts[x].ep.public_key());
    let key = sim.hosts[x]
        .ep
        .sessions
        .get(&a_key)
        .expect("X is paired with A")
        .claim_key();

    // The CLAIM, as X names the flow, from the flow's own address.
    let xs = reverse(&victim);
    let entry = ClaimEntry {
        commitment: claim_commitment(&key, &x_key, &Binding::endpoints(&xs)),
        proto: Proto::Udp,
        names: Some([xs.local, xs.remote]),
    };
    let mut claim = Message::Claim {
        answer: false,
        static_pub: x_key,
        entries: vec![entry],
        tag: [0; PAIR_TAG_LEN],
    }
    .encode()
    .expect("encode");
    tag_datagram(&key, &mut claim);
    sim.inject(a, sa(&format!("{N}:40000")), &claim);

    // X gives itself the flow with keys (what it would hold had the claim
    // bound) and moves it to its own address.
    sim.with(x, |ep, now, rng| {
        ep.connection_added(now, rng, xs, xs.local, xs.remote, Binding::endpoints(&xs))
            .expect("X adds the flow");
        if let Some(c) = ep.conns.get_mut(&xs) {
            c.peer_key = Some(a_key);
        }
        ep.ensure_keys(&xs);
        ep.resume(now, rng, &[(xs, sa("10.0.0.9:40000"))])
            .expect("X resumes the flow")
    });
    sim.run_for(Duration::from_secs(20));

    let v = sim.hosts[a].ep.connection(&victim).expect("victim flow");
    assert_ne!(
        v.peer_key,
        Some(x_key),
        "the victim's UDP flow was bound to X by a forged CLAIM"
    );
    assert!(!v.has_keys, "the victim's flow must have no keys");
    assert_eq!(v.remote_phys, victim.remote, "the victim's flow moved");
    assert!(
        sim.events(a, |e| matches!(e, Event::SetRemote { flow, .. } | Event::PrepareReceive { flow, .. } if *flow == victim))
            .next()
            .is_none(),
        "A must not translate the victim's flow"
    );
}

/// A (10.0.0.1) with a UDP flow and a TCP connection with hosts behind
/// the NAT address N that run no vnatd, and X behind the same NAT (its
/// VCMP at N:30000), paired with A for a TCP connection of its own.
/// Returns the sim, A, X, N's two flows and X's connection as A names it.
fn neighbours_behind_one_nat(seed: u64) -> (Sim, usize, usize, [VirtualFlow; 2], VirtualFlow) {
    let mut sim = Sim::new(seed, Link::default());
    let a = sim.add_host("10.0.0.1", Config::default());
    let x = sim.add_host("192.168.0.9", Config::default());
    sim.hosts[x].nat = Some(sa(&format!("{N}:30000")));
    let theirs = [
        udp("10.0.0.1:5060", &format!("{N}:40000")),
        tcp("10.0.0.1:443", &format!("{N}:40001")),
    ];
    sim.with(a, |ep, now, rng| {
        for f in theirs {
            let b = Binding::of(&f, (f.proto == Proto::Tcp).then_some([7, 9]));
            ep.connection_added(now, rng, f, f.local, f.remote, b)
                .expect("add");
        }
    });
    sim.run_for(Duration::from_secs(5));
    // X's own connection, named through the NAT at A.
    let xf = tcp("192.168.0.9:50000", "10.0.0.1:22");
    let af = tcp("10.0.0.1:22", &format!("{N}:50000"));
    sim.connect_named(x, a, xf, af);
    sim.run_for(Duration::from_secs(30));
    (sim, a, x, theirs, af)
}

/// [`neighbours_behind_one_nat`]: nothing A sends X names N's flows: no
/// endpoints, and no commitment X could test guesses of their ports
/// against.
#[test]
fn a_host_pairing_from_a_shared_nat_address_learns_nothing_of_its_neighbours_flows() {
    let (sim, a, x, theirs, af) = neighbours_behind_one_nat(72);
    let a_key = sim.hosts[a].ep.public_key();
    assert!(
        sim.hosts[a].ep.connection(&af).is_some_and(|c| c.has_keys),
        "X's own connection must bind"
    );
    let key = sim.hosts[x]
        .ep
        .sessions
        .get(&a_key)
        .expect("X is paired with A")
        .claim_key();
    // What A would send for the UDP flow, and what X would send for it.
    let b = Binding::endpoints(&reverse(&theirs[0]));
    let guessable = [
        claim_commitment(&key, &a_key, &b),
        claim_commitment(&key, &sim.hosts[x].ep.public_key(), &b),
    ];
    let hidden = [sa(&format!("{N}:40000")), sa(&format!("{N}:40001"))];
    let mut claims = 0;
    for (_, bytes) in &sim.hosts[x].inbox {
        let Ok(Message::Claim { entries, .. }) = Message::decode(bytes) else {
            continue;
        };
        claims += 1;
        for e in entries {
            assert!(
                !e.names
                    .is_some_and(|n| n.iter().any(|a| hidden.contains(a))),
                "A told X the endpoints of a neighbour's flow: {e:?}"
            );
            assert!(
                !guessable.contains(&e.commitment),
                "A sent X a commitment of a neighbour's UDP flow, which X can test port guesses against"
            );
        }
    }
    assert!(claims > 0, "A claimed X's own connection to X");
}

/// [`neighbours_behind_one_nat`]: X sends back, as its own claims, every
/// CLAIM A sent it (re-signed under its own key, from its own session
/// address). A binds none of its neighbours' connections to X: a host that
/// only repeats what it was told proves nothing.
#[test]
fn a_host_echoing_the_claims_it_was_sent_binds_nothing_of_its_neighbours() {
    let (mut sim, a, x, theirs, _) = neighbours_behind_one_nat(73);
    let (a_key, x_key) = (sim.hosts[a].ep.public_key(), sim.hosts[x].ep.public_key());
    let key = sim.hosts[x]
        .ep
        .sessions
        .get(&a_key)
        .expect("X is paired with A")
        .claim_key();
    let received: Vec<Vec<u8>> = sim.hosts[x]
        .inbox
        .iter()
        .filter(|(_, b)| b.len() > 40 && b[1] == 17)
        .map(|(_, b)| b.clone())
        .collect();
    assert!(!received.is_empty(), "A sent X claims");
    for mut b in received {
        b[2] = 0;
        b[8..40].copy_from_slice(&x_key);
        tag_datagram(&key, &mut b);
        sim.inject(a, sa(&format!("{N}:30000")), &b);
    }
    sim.run_for(Duration::from_secs(10));
    for f in &theirs {
        let v = sim.hosts[a].ep.connection(f).expect("flow");
        assert_ne!(
            v.peer_key,
            Some(x_key),
            "A bound its neighbour's {f:?} to X on X's echo of A's own claim"
        );
    }
}
