//! Simulator tests of what an address or a paired host can make us do
//! (issue 31, item 8): trust that outlives its reason, and work a paired
//! host can ask for without limit.

use std::time::Duration;

use super::crypto::{claim_commitment, tag_datagram, HostIdentity};
use super::endpoint::{Config, Event};
use super::sim::{reverse, sa, tcp, udp, Link, Sim};
use super::wire::{Kind, Message, PAIR_TAG_LEN};
use crate::stats::{Counter, Reject};

/// A had connections with 200 hosts that run no vnatd, and they closed. A
/// host at one of those addresses is a stranger again: its PAIR_INIT gets
/// no Diffie-Hellman and no state, and A's trusted set shrinks back.
#[test]
fn an_address_whose_connections_closed_is_trusted_no_more() {
    let mut sim = Sim::new(81, Link::default());
    let a = sim.add_host("10.0.0.1", Config::default());
    let baseline = sim.hosts[a].ep.tx.trusted.len();
    let flows: Vec<_> = (0..200u16)
        .map(|i| {
            udp(
                &format!("10.0.0.1:{}", 20000 + i),
                &format!("192.0.{}.{}:53", 2 + i / 200, 1 + i % 200),
            )
        })
        .collect();
    sim.with(a, |ep, now, rng| {
        for f in &flows {
            ep.connection_added(
                now,
                rng,
                *f,
                f.local,
                f.remote,
                super::Binding::endpoints(f),
            )
            .expect("add");
        }
    });
    sim.run_for(Duration::from_secs(5));
    sim.with(a, |ep, _, _| {
        for f in &flows {
            assert!(ep.connection_removed(f));
        }
    });
    // Until A's own pairing attempts with those addresses are over.
    sim.run_for(Duration::from_secs(60));
    assert!(
        sim.hosts[a].ep.tx.trusted.len() <= baseline,
        "{} addresses still trusted after every connection closed",
        sim.hosts[a].ep.tx.trusted.len()
    );

    let stranger = HostIdentity::from_bytes([0x42; 32]);
    let eph = HostIdentity::from_bytes([0x43; 32]);
    let init = Message::PairInit {
        request_id: 7,
        static_pub: stranger.public(),
        eph_pub: eph.public(),
        cookie: None,
    }
    .encode()
    .expect("encode");
    let dh = sim.hosts[a].ep.stats().get(Counter::PairDhComputed);
    let out = sim.inject(a, sa("192.0.2.7:2031"), &init);
    assert_eq!(
        sim.hosts[a].ep.stats().get(Counter::PairDhComputed),
        dh,
        "A computed a DH for an address whose connections closed"
    );
    assert!(
        out.iter().all(|t| t.payload[1] != Kind::PairResp as u8),
        "A answered a PAIR_INIT from an address it shares nothing with any more"
    );
}

/// X, paired with A over a UDP flow, sends A a thousand valid BIND_REQs
/// for that flow at once, from its own address: A looks at a handful, not
/// at every one (each cost a walk of A's connections with an HMAC each).
#[test]
fn a_paired_host_flooding_bind_requests_is_held_to_its_budget() {
    let mut sim = Sim::new(82, Link::default());
    let a = sim.add_host("10.0.0.1", Config::default());
    let x = sim.add_host("10.0.0.9", Config::default());
    let xf = udp("10.0.0.9:5000", "10.0.0.1:53");
    let af = reverse(&xf);
    sim.connect(x, a, xf);
    sim.run_for(Duration::from_secs(30));
    assert!(
        sim.hosts[a].ep.connection(&af).is_some_and(|c| c.has_keys),
        "the flow must bind"
    );
    let (a_key, x_key) = (sim.hosts[a].ep.public_key(), sim.hosts[x].ep.public_key());
    let key = sim.hosts[x]
        .ep
        .sessions
        .get(&a_key)
        .expect("paired")
        .claim_key();
    let binding = sim.hosts[a].ep.conns.get(&af).expect("flow").binding;
    let commitment = claim_commitment(&key, &x_key, &binding);
    let sent_before = sim.hosts[a].ep.stats().get(Counter::BindsSent);
    let soon_before = sim.hosts[a].ep.stats().rejected(Reject::BindReqTooSoon);
    for nonce in 1..=1000u64 {
        let mut b = vec![1, 20, 0, 1, 0, 0, 0, 0];
        b.extend_from_slice(&x_key);
        b.extend_from_slice(&nonce.to_be_bytes());
        b.extend_from_slice(&commitment);
        b.extend_from_slice(&[0; PAIR_TAG_LEN]);
        tag_datagram(&key, &mut b);
        sim.inject(a, sa("10.0.0.9:2031"), &b);
    }
    let st = sim.hosts[a].ep.stats();
    let looked_at = st.get(Counter::BindsSent) - sent_before + st.rejected(Reject::BindReqTooSoon)
        - soon_before;
    assert!(
        looked_at <= 40,
        "A handled {looked_at} of 1000 BIND_REQs sent at once by one host"
    );
    // X's flow is unharmed.
    assert!(sim.hosts[a].ep.connection(&af).is_some_and(|c| c.has_keys));
    assert!(sim
        .events(a, |e| matches!(e, Event::SetRemote { .. }))
        .next()
        .is_none());
}

/// X replays its own CLAIM to A a few thousand times at once from its
/// session address: A answers a bounded number, not one each.
#[test]
fn a_paired_host_flooding_claims_is_held_to_its_budget() {
    let mut sim = Sim::new(83, Link::default());
    let a = sim.add_host("10.0.0.1", Config::default());
    let x = sim.add_host("10.0.0.9", Config::default());
    let xf = tcp("10.0.0.9:5000", "10.0.0.1:22");
    sim.connect(x, a, xf);
    sim.run_for(Duration::from_secs(30));
    let a_key = sim.hosts[a].ep.public_key();
    let claim = sim.capture(x, |ep, _, _| {
        ep.send_claims(a_key, sa("10.0.0.1:2031"), &[xf], false)
    });
    assert_eq!(claim.len(), 1, "one CLAIM datagram");
    let answers_before = sim.hosts[a].ep.stats().get(Counter::ClaimsSent);
    for _ in 0..3000 {
        sim.inject(a, sa("10.0.0.9:2031"), &claim[0].payload);
    }
    let answers = sim.hosts[a].ep.stats().get(Counter::ClaimsSent) - answers_before;
    assert!(
        answers <= 1100,
        "A answered {answers} of 3000 CLAIMs sent at once by one host"
    );
}
