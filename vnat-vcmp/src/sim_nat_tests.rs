//! Simulator tests of identity by key and NAT (issue 15): claims, names
//! through a NAT, keepalives, and moves from one NAT to another. The
//! general move tests are in `sim_tests`.

use crate::stats::{Counter, Reject};
use std::time::Duration;

use super::endpoint::{Config, Event};
use super::sim::{ip, reverse, sa, tcp, Link, Sim};
use super::sim_tests::{setup, A_IP, B_IP};
use crate::flow::VirtualFlow;
use std::net::SocketAddr;

/// Address reuse (DHCP), or a reinstalled host: another host key at an
/// address where a paired host was. It is another host: it pairs, with no
/// lock-out, and gets keys for its own connection only; the connections of
/// the host that was there stay bound to that host's key, and the newcomer
/// cannot take them, not even a UDP flow whose binding (its endpoints) it
/// can guess.
#[test]
fn a_new_key_at_a_known_address_is_another_host_with_no_power_over_the_old_ones() {
    let (mut sim, flows) = setup(8, Link::default(), Config::default(), 2);
    let (a, b) = (0, 1);
    let udp = super::sim::udp("10.0.0.1:5353", "10.0.0.2:53");
    sim.connect(a, b, udp);
    sim.run_for(Duration::from_secs(10));
    let b_key = sim.hosts[b].ep.public_key();
    assert_eq!(
        sim.hosts[a].ep.connection(&udp).expect("udp").peer_key,
        Some(b_key)
    );
    // B leaves; Y gets B's address and opens its own connection to A.
    sim.hosts[b].alive = false;
    let binds_before = sim.hosts[a].ep.stats().get(Counter::BindsSent);
    let y = sim.add_host(B_IP, Config::default());
    let y_key = sim.hosts[y].ep.public_key();
    let g = tcp("10.0.0.1:50000", "10.0.0.2:80");
    sim.connect(a, y, g);
    // Y also names B's connections: a TCP one with sequence numbers it
    // cannot know, and the UDP flow, whose endpoints it can.
    let (_, guessed) = sim.bindings(&flows[0]);
    let old = reverse(&flows[0]);
    sim.with(y, |ep, now, rng| {
        ep.connection_added(now, rng, old, old.local, old.remote, guessed)
            .expect("add");
        let u = reverse(&udp);
        ep.connection_added(
            now,
            rng,
            u,
            u.local,
            u.remote,
            super::Binding::endpoints(&u),
        )
        .expect("add")
    });
    sim.run_for(Duration::from_secs(60));

    let ga = sim.hosts[a].ep.connection(&g).expect("g on a");
    assert!(ga.has_keys, "Y's own connection must be mobile");
    assert_eq!(ga.peer_key, Some(y_key));
    assert!(
        sim.hosts[y]
            .ep
            .connection(&reverse(&g))
            .expect("g on y")
            .has_keys,
        "Y must have keys for its own connection"
    );
    assert!(
        sim.events(a, |e| matches!(e, Event::PeerKeyChanged { .. }))
            .next()
            .is_none(),
        "a new key is no lock-out"
    );
    for f in flows.iter().chain([&udp]) {
        assert_eq!(
            sim.hosts[a].ep.connection(f).expect("old flow").peer_key,
            Some(b_key),
            "{f:?} must stay bound to B"
        );
        assert!(
            sim.hosts[y]
                .ep
                .connection(&reverse(f))
                .is_none_or(|v| !v.has_keys),
            "Y must get no keys for B's {f:?}"
        );
    }
    // A UDP flow is bound only in band (issue 31): Y asks A for BINDs on
    // its flows toward Y's address, and A sends none on B's flow.
    assert!(
        sim.hosts[y].ep.stats().get(Counter::BindRequestsSent) > 0,
        "Y must have asked A for BINDs"
    );
    assert_eq!(
        sim.hosts[a].ep.stats().get(Counter::BindsSent),
        binds_before,
        "A must send no BIND on B's UDP flow at Y's request"
    );
    // Without keys, Y cannot even start moving B's connection.
    let err = sim.with(y, |ep, now, rng| {
        ep.resume(now, rng, &[(old, sa("10.0.0.2:22"))])
    });
    assert!(err.is_err(), "Y must not be able to move B's connection");
}

/// Add each of `flows` on host 0 and its reverse on host 1, in one go.
fn add_on_both(sim: &mut Sim, flows: &[VirtualFlow]) {
    let bindings: Vec<_> = flows.iter().map(|f| sim.bindings(f)).collect();
    sim.with(0, |ep, now, rng| {
        for (f, (ba, _)) in flows.iter().zip(&bindings) {
            ep.connection_added(now, rng, *f, f.local, f.remote, *ba)
                .expect("add on a");
        }
    });
    sim.with(1, |ep, now, rng| {
        for (f, (_, bb)) in flows.iter().zip(&bindings) {
            let g = reverse(f);
            ep.connection_added(now, rng, g, g.local, g.remote, *bb)
                .expect("add on b");
        }
    });
}

/// Connections added in one go to an already paired host are claimed in
/// datagrams of up to 20 entries, not one each way per connection, and
/// every one is bound on both ends.
#[test]
fn many_new_connections_are_claimed_in_batches() {
    let (mut sim, _) = setup(21, Link::default(), Config::default(), 1);
    let before = sim.hosts[0].ep.stats().get(Counter::ClaimsSent)
        + sim.hosts[1].ep.stats().get(Counter::ClaimsSent);
    let flows: Vec<VirtualFlow> = (0..500)
        .map(|i| tcp(&format!("{A_IP}:{}", 20000 + i), &format!("{B_IP}:443")))
        .collect();
    add_on_both(&mut sim, &flows);
    sim.run_for(Duration::from_secs(10));
    for f in &flows {
        assert!(sim.hosts[0].ep.connection(f).expect("a").has_keys);
        assert!(sim.hosts[1].ep.connection(&reverse(f)).expect("b").has_keys);
    }
    let sent = sim.hosts[0].ep.stats().get(Counter::ClaimsSent)
        + sim.hosts[1].ep.stats().get(Counter::ClaimsSent)
        - before;
    // 500 / 20 = 25 datagrams each way, plus the answers.
    assert!(sent <= 110, "{sent} CLAIM datagrams for 500 connections");
}

/// 30,000 connections added at once on both ends of a pair: 1,500 CLAIM
/// datagrams each way and their answers, beyond a paired host's budget of
/// repeated work (1,024 at once, 256 a second). Each binds a connection, so
/// none is refused, and all are bound within a second, none given up.
#[test]
fn thirty_thousand_connections_are_claimed_at_once_within_the_budget() {
    let (mut sim, _) = setup(23, Link::default(), Config::default(), 1);
    let flows: Vec<VirtualFlow> = (0..30_000u32)
        .map(|i| {
            tcp(
                &format!("{A_IP}:{}", 10_000 + i),
                &format!("{B_IP}:{}", 443 + (i % 3) * 1000),
            )
        })
        .collect();
    add_on_both(&mut sim, &flows);
    sim.run_for(Duration::from_secs(1));
    let unbound = flows
        .iter()
        .filter(|f| !sim.hosts[0].ep.connection(f).expect("a").has_keys)
        .count();
    assert_eq!(unbound, 0, "connections without keys on A after 1 s");
    for h in 0..2 {
        let st = sim.hosts[h].ep.stats();
        assert_eq!(st.rejected(Reject::PeerOverBudget), 0, "host {h}");
        assert_eq!(st.get(Counter::ClaimGaveUp), 0, "host {h}");
    }
}

/// Two laptops behind one NAT address (each with its own NAT port for
/// VCMP), each with a TCP connection to one server, which names both by
/// the NAT's address. Each pairs, each connection binds to its own laptop
/// (by its sequence numbers, not the shared address), each laptop learns
/// where the NAT put its end, and records named the laptop's way (its
/// private address) reach the server's connection: a planned suspend
/// settles roles on both.
#[test]
fn two_hosts_behind_one_nat_address_each_own_their_connection() {
    let mut sim = Sim::new(22, Link::default());
    let l1 = sim.add_host("192.168.1.10", Config::default());
    let l2 = sim.add_host("192.168.1.11", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    sim.hosts[l1].nat = Some(sa("198.51.100.7:40001"));
    sim.hosts[l2].nat = Some(sa("198.51.100.7:40002"));
    let f1 = tcp("192.168.1.10:50000", "203.0.113.5:443");
    let s1 = tcp("203.0.113.5:443", "198.51.100.7:61000");
    let f2 = tcp("192.168.1.11:50000", "203.0.113.5:443");
    let s2 = tcp("203.0.113.5:443", "198.51.100.7:61001");
    sim.connect_named(l1, s, f1, s1);
    sim.connect_named(l2, s, f2, s2);
    sim.run_for(Duration::from_secs(30));

    let (k1, k2) = (sim.hosts[l1].ep.public_key(), sim.hosts[l2].ep.public_key());
    for (h, f, sf, k, seen) in [
        (l1, f1, s1, k1, "198.51.100.7:61000"),
        (l2, f2, s2, k2, "198.51.100.7:61001"),
    ] {
        let v = sim.hosts[h].ep.connection(&f).expect("laptop side");
        assert!(v.has_keys, "{f:?} must be mobile on its laptop");
        assert_eq!(v.seen_by_peer_as, Some(sa(seen)), "where the NAT put it");
        let sv = sim.hosts[s].ep.connection(&sf).expect("server side");
        assert!(sv.has_keys, "{sf:?} must be mobile on the server");
        assert_eq!(sv.peer_key, Some(k), "{sf:?} bound to the wrong laptop");
        // The server's name for its own end is the laptop's name too.
        assert_eq!(sv.seen_by_peer_as, None);
    }
    assert_eq!(sim.hosts[s].ep.stats().rejected(Reject::PeerKeyChanged), 0);

    // Each laptop learned where the NAT put its VCMP, knows it is behind a
    // NAT, and keeps the mapping open; the server is behind none.
    let skey = sim.hosts[s].ep.public_key();
    assert_eq!(
        sim.hosts[l1].ep.reflexive_address(&skey),
        Some(sa("198.51.100.7:40001"))
    );
    assert!(sim.hosts[l1].ep.behind_nat(&skey));
    assert!(!sim.hosts[s].ep.behind_nat(&k1));
    assert_eq!(
        sim.hosts[s].ep.reflexive_address(&k1),
        Some(sa("203.0.113.5:2031"))
    );
    sim.run_for(Duration::from_secs(60));
    assert!(sim.hosts[l1].ep.stats().get(Counter::KeepalivesSent) >= 2);
    assert!(sim.hosts[l2].ep.stats().get(Counter::KeepalivesSent) >= 2);
    assert_eq!(sim.hosts[s].ep.stats().get(Counter::KeepalivesSent), 0);
    assert_eq!(sim.hosts[s].ep.stats().rejected_total(), 0);

    // Records named the laptop's way (private address) reach the server's
    // connection named by the NAT's address.
    sim.with(l1, |ep, now, rng| {
        ep.suspend(now, rng, &[f1]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(10));
    assert!(
        sim.events(
            s,
            |e| matches!(e, Event::RoleDecided { flow, .. } if *flow == s1)
        )
        .next()
        .is_some(),
        "the server never settled a role for the suspended connection"
    );
    assert_eq!(
        sim.hosts[s].ep.stats().rejected(Reject::UnknownConnection),
        0
    );
}

/// A PROBE replayed (from anywhere) or forged changes nothing: not where
/// the host sends to its peer, not what it believes of its own address.
#[test]
fn replayed_or_forged_probes_change_nothing() {
    let (mut sim, _) = setup(23, Link::default(), Config::default(), 1);
    let (a, b) = (0, 1);
    let akey = sim.hosts[a].ep.public_key();
    let bkey = sim.hosts[b].ep.public_key();
    // A's next probe, captured instead of sent.
    let probe = sim
        .capture(a, |ep, _, _| ep.send_probe(bkey))
        .into_iter()
        .next()
        .expect("a probe");
    let from = sa("10.0.0.1:2031");
    let first = sim.inject(b, from, &probe.payload);
    assert_eq!(first.len(), 1, "a fresh probe is answered");
    // Replayed from an attacker's address: refused, no answer, and B keeps
    // sending to A where it was.
    let again = sim.inject(b, sa("10.66.0.1:9999"), &probe.payload);
    assert!(again.is_empty());
    assert_eq!(sim.hosts[b].ep.stats().rejected(Reject::ProbeReplayed), 1);
    assert_eq!(sim.hosts[b].ep.peer_addrs.get(&akey), Some(&from));
    // A forged answer (one bit flipped) is refused, and so is a genuine
    // answer delivered twice.
    let mut forged = first[0].payload.clone();
    forged[HEADER_LEN_FOR_TESTS + 45] ^= 1;
    sim.inject(a, sa("10.0.0.2:2031"), &forged);
    assert_eq!(sim.hosts[a].ep.stats().rejected(Reject::ProbeBadTag), 1);
    sim.inject(a, sa("10.0.0.2:2031"), &first[0].payload);
    sim.inject(a, sa("10.0.0.2:2031"), &first[0].payload);
    assert_eq!(
        sim.hosts[a]
            .ep
            .stats()
            .rejected(Reject::ProbeUnexpectedAnswer),
        1
    );
    assert_eq!(
        sim.hosts[a].ep.reflexive_address(&bkey),
        Some(from),
        "the answer tells A where B saw its probe come from"
    );
}

const HEADER_LEN_FOR_TESTS: usize = super::wire::HEADER_LEN;

/// A laptop behind one NAT moves behind another (new public address, new
/// mapping). Its update names its new private address but comes from the
/// new NAT: the server validates the laptop's vnatd at the update's source,
/// switches the connection to the new NAT's address with the port left for
/// the datapath to learn (0), sends SWITCHED through the NAT, and reaches
/// the laptop there from then on.
#[test]
fn a_move_from_one_nat_to_another_switches_to_the_new_nat() {
    let mut sim = Sim::new(24, Link::default());
    let l = sim.add_host("192.168.1.10", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    sim.hosts[s].confirms_switch = true;
    sim.hosts[l].nat = Some(sa("198.51.100.7:40001"));
    let f = tcp("192.168.1.10:50000", "203.0.113.5:443");
    let sf = tcp("203.0.113.5:443", "198.51.100.7:61000");
    sim.connect_named(l, s, f, sf);
    sim.run_for(Duration::from_secs(10));
    assert!(
        sim.hosts[s]
            .ep
            .connection(&sf)
            .expect("server side")
            .has_keys
    );

    sim.move_host(l, "192.168.2.20");
    sim.hosts[l].nat = Some(sa("198.51.100.8:40005"));
    sim.with(l, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("192.168.2.20:50000"))])
            .expect("resume")
    });
    sim.run_for(Duration::from_secs(10));

    assert_eq!(sim.hosts[s].ep.stats().get(Counter::PeerBehindNat), 1);
    assert!(
        sim.events(s, |e| matches!(e, Event::SetRemote { flow, remote } if *flow == sf && *remote == sa("198.51.100.8:0")))
            .next()
            .is_some(),
        "the server must switch to the new NAT, port to be learned"
    );
    assert!(
        sim.events(
            l,
            |e| matches!(e, Event::PeerSwitched { flow, confirmed: true } if *flow == f)
        )
        .next()
        .is_some(),
        "the server's SWITCHED must reach the laptop through its new NAT"
    );
    let lkey = sim.hosts[l].ep.public_key();
    assert_eq!(
        sim.hosts[s].ep.peer_addrs.get(&lkey),
        Some(&sa("198.51.100.8:40005")),
        "the laptop's vnatd is now reached at the new NAT's mapping"
    );
}

/// A laptop with valid keys behind the same NAT names its own connection
/// after its neighbour's (the neighbour's private address and port): the
/// server keeps the names with the connection that had them first, counts
/// the attempt, and the neighbour's records still reach its connection.
#[test]
fn a_neighbour_behind_the_nat_cannot_take_another_s_names() {
    let mut sim = Sim::new(25, Link::default());
    let a = sim.add_host("192.168.1.10", Config::default());
    let b = sim.add_host("192.168.1.11", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    sim.hosts[a].nat = Some(sa("198.51.100.7:40001"));
    sim.hosts[b].nat = Some(sa("198.51.100.7:40002"));
    let fa = tcp("192.168.1.10:50000", "203.0.113.5:443");
    let sa_ = tcp("203.0.113.5:443", "198.51.100.7:61000");
    sim.connect_named(a, s, fa, sa_);
    sim.run_for(Duration::from_secs(10));
    // B's real connection, which B names exactly as A names A's.
    let sb = tcp("203.0.113.5:443", "198.51.100.7:61001");
    sim.connect_named(b, s, fa, sb);
    sim.run_for(Duration::from_secs(30));
    assert!(
        sim.hosts[s].ep.stats().rejected(Reject::ClaimNamesTaken) >= 1,
        "B's borrowed names must be refused"
    );
    let ka = sim.hosts[a].ep.public_key();
    assert_eq!(
        sim.hosts[s].ep.connection(&sa_).expect("a").peer_key,
        Some(ka)
    );
    // A's records, named A's way, still reach A's connection.
    sim.with(a, |ep, now, rng| {
        ep.suspend(now, rng, &[fa]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(10));
    assert!(
        sim.events(
            s,
            |e| matches!(e, Event::RoleDecided { flow, .. } if *flow == sa_)
        )
        .next()
        .is_some(),
        "A's suspend must still reach A's connection"
    );
}

/// A laptop (192.168.1.10) behind a NAT (public 198.51.100.7) that gives
/// its UDP flow to the server's port 53 the public port 61234, and the
/// server (203.0.113.5, confirming switches if `confirms`). Returns the sim,
/// the laptop, the server and the flow as each names it, not yet bound.
fn udp_behind_nat(seed: u64, confirms: bool) -> (Sim, usize, usize, VirtualFlow, VirtualFlow) {
    let mut sim = Sim::new(seed, Link::default());
    let l = sim.add_host("192.168.1.10", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    sim.hosts[s].confirms_switch = confirms;
    sim.hosts[l].nat = Some(sa("198.51.100.7:40001"));
    sim.hosts[l]
        .flow_nat
        .insert(sa("192.168.1.10:5000"), sa("198.51.100.7:61234"));
    let f = super::sim::udp("192.168.1.10:5000", "203.0.113.5:53");
    let sf = super::sim::udp("203.0.113.5:53", "198.51.100.7:61234");
    (sim, l, s, f, sf)
}

/// The laptop of [`udp_behind_nat`] moves to 192.168.2.20 behind another
/// NAT (198.51.100.8), which gives its flow the port 7777.
fn move_behind_nat_b(sim: &mut Sim, l: usize) {
    sim.move_host(l, "192.168.2.20");
    sim.hosts[l].nat = Some(sa("198.51.100.8:40005"));
    sim.hosts[l]
        .flow_nat
        .insert(sa("192.168.2.20:5000"), sa("198.51.100.8:7777"));
}

/// A UDP flow through a NAT that picks a random port: the two ends name it
/// differently, so claims cannot match it. The server asks the laptop for
/// a BIND only after its datapath diverts them; the laptop sends it on the
/// flow's own path, where it picks up the NAT's mapping; the server binds
/// the flow with that mapping to the laptop's key, and both ends get the
/// same keys. No BIND reaches an application. Then the laptop moves behind
/// another NAT and the flow follows, its port left for the datapath to
/// learn.
#[test]
fn a_udp_flow_through_a_port_changing_nat_is_bound_in_band_and_moves() {
    let (mut sim, l, s, f, sf) = udp_behind_nat(26, true);
    // Another host's flow from the same public address to the same port.
    let other = super::sim::udp("203.0.113.5:53", "198.51.100.7:61235");
    sim.connect_named(l, s, f, sf);
    sim.with(s, |ep, now, rng| {
        ep.connection_added(
            now,
            rng,
            other,
            other.local,
            other.remote,
            super::Binding::endpoints(&other),
        )
        .expect("add")
    });
    sim.run_for(Duration::from_secs(10));

    let (lkey, skey) = (sim.hosts[l].ep.public_key(), sim.hosts[s].ep.public_key());
    let sv = sim.hosts[s].ep.connection(&sf).expect("server side");
    assert!(sv.has_keys, "the server's end must be bound");
    assert_eq!(sv.peer_key, Some(lkey));
    let lv = sim.hosts[l].ep.connection(&f).expect("laptop side");
    assert!(lv.has_keys, "the laptop's end must be bound");
    assert_eq!(lv.peer_key, Some(skey));
    assert_eq!(
        sim.hosts[s].ep.connection(&other).expect("other").peer_key,
        None,
        "the other flow from the NAT must stay unbound"
    );
    assert_eq!(
        sim.hosts[s].binds_to_app, 0,
        "a BIND reached an application"
    );
    assert_eq!(sim.hosts[s].ep.stats().get(Counter::BindsBound), 1);
    assert!(sim.hosts[s]
        .diverting
        .contains(&"198.51.100.7".parse().unwrap()));
    // Same keys at both ends: a suspend from the laptop authenticates.
    sim.with(l, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(5));
    assert!(
        sim.events(
            s,
            |e| matches!(e, Event::RoleDecided { flow, .. } if *flow == sf)
        )
        .next()
        .is_some(),
        "the laptop's records must authenticate at the server"
    );

    move_behind_nat_b(&mut sim, l);
    sim.with(l, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("192.168.2.20:5000"))])
            .expect("resume")
    });
    sim.run_for(Duration::from_secs(10));
    assert!(
        sim.events(s, |e| matches!(e, Event::SetRemote { flow, remote } if *flow == sf && *remote == sa("198.51.100.8:0")))
            .next()
            .is_some(),
        "the server must switch the UDP flow to the new NAT, port to be learned"
    );
    // The port comes from the laptop's BIND on the new path, not from a
    // datagram anyone behind that NAT could send.
    assert!(
        sim.events(s, |e| matches!(e, Event::SetRemote { flow, remote } if *flow == sf && *remote == sa("198.51.100.8:7777")))
            .next()
            .is_some(),
        "the server must learn the new NAT's port from the laptop's BIND"
    );
    assert_eq!(sim.hosts[s].ep.stats().get(Counter::BindsRebound), 1);
    assert_eq!(
        sim.hosts[s].binds_to_app, 0,
        "a BIND reached an application"
    );
}

/// BINDs that did not come through the divert, or that replay an earlier
/// one, or that name a flow the sender does not have, bind nothing.
#[test]
fn forged_and_replayed_binds_bind_nothing() {
    let (mut sim, l, s, f, sf) = udp_behind_nat(27, false);
    sim.connect_named(l, s, f, sf);
    // Capture the laptop's BIND instead of delivering it.
    sim.run_for(Duration::from_secs(10));
    let bind = sim.hosts[l]
        .events
        .iter()
        .find_map(|(_, e)| match e {
            Event::SendInBand { payload, .. } => Some(payload.clone()),
            _ => None,
        })
        .expect("the laptop sent a BIND");
    assert_eq!(sim.hosts[s].ep.stats().get(Counter::BindsBound), 1);
    // A second flow, unbound, from another public port.
    let sg = super::sim::udp("203.0.113.5:53", "198.51.100.7:61300");
    sim.with(s, |ep, now, rng| {
        ep.connection_added(
            now,
            rng,
            sg,
            sg.local,
            sg.remote,
            super::Binding::endpoints(&sg),
        )
        .expect("add")
    });
    // Straight to the VCMP port (not diverted), and a replay through the
    // divert from the second flow's endpoint.
    sim.inject(s, sa("198.51.100.7:61300"), &bind);
    let mut diverted = bind.clone();
    diverted[2..4].copy_from_slice(&53u16.to_be_bytes());
    sim.inject(s, sa("198.51.100.7:61300"), &diverted);
    // A flipped bit in the tag.
    let mut bad = diverted.clone();
    let n = bad.len();
    bad[n - 1] ^= 1;
    sim.inject(s, sa("198.51.100.7:61300"), &bad);
    let st = sim.hosts[s].ep.stats();
    assert_eq!(st.rejected(Reject::BindNotDiverted), 1);
    assert_eq!(st.rejected(Reject::BindReplayed), 1);
    assert_eq!(st.rejected(Reject::BindBadTag), 1);
    assert_eq!(
        sim.hosts[s].ep.connection(&sg).expect("sg").peer_key,
        None,
        "the second flow must stay unbound"
    );
    // The binding made of the laptop's names travels with an export, so
    // the keys stay the same where it is imported.
    let ex = sim
        .with(s, |ep, _, _| ep.export_connection(&sf))
        .expect("export");
    assert_eq!(
        ex.udp_ends,
        Some([sa("203.0.113.5:53"), sa("192.168.1.10:5000")])
    );
    let json = serde_json::to_string(&ex).expect("json");
    let back: super::export::ConnectionExport = serde_json::from_str(&json).expect("parse");
    sim.with(s, |ep, _, _| ep.import_connection(&back))
        .expect("import");
    sim.with(l, |ep, now, rng| {
        ep.suspend(now, rng, &[f]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(5));
    assert!(
        sim.events(
            s,
            |e| matches!(e, Event::RoleDecided { flow, .. } if *flow == sf)
        )
        .next()
        .is_some(),
        "after export and import the laptop's records must still authenticate"
    );
}

/// A NAT that gives an unmoved laptop's VCMP a new mapping (its idle UDP
/// entry expired, or the NAT restarted): the laptop's next keepalive comes
/// from the new port and the server reaches the laptop there from then on.
/// Nothing moves: the connection keeps its keys and its placement, and a
/// suspend the server starts gets through.
#[test]
fn a_nat_that_remaps_an_unmoved_laptop_breaks_nothing() {
    let mut sim = Sim::new(28, Link::default());
    let l = sim.add_host("192.168.1.10", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    sim.hosts[l].nat = Some(sa("198.51.100.7:40001"));
    let f = tcp("192.168.1.10:50000", "203.0.113.5:443");
    let sf = tcp("203.0.113.5:443", "198.51.100.7:61000");
    sim.connect_named(l, s, f, sf);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[s].ep.connection(&sf).expect("sf").has_keys);
    let lkey = sim.hosts[l].ep.public_key();
    assert_eq!(
        sim.hosts[s].ep.peer_addrs.get(&lkey),
        Some(&sa("198.51.100.7:40001"))
    );

    sim.hosts[l].nat = Some(sa("198.51.100.7:40077"));
    sim.run_for(Duration::from_secs(60));
    assert_eq!(
        sim.hosts[s].ep.peer_addrs.get(&lkey),
        Some(&sa("198.51.100.7:40077")),
        "the keepalive from the new mapping must be where the server reaches the laptop"
    );
    let v = sim.hosts[s].ep.connection(&sf).expect("sf");
    assert!(v.has_keys, "the connection must stay mobile");
    assert_eq!(v.remote_phys, sa("198.51.100.7:61000"), "nothing moved");
    assert!(
        sim.events(s, |e| matches!(
            e,
            Event::SetRemote { .. } | Event::Reverted { .. }
        ))
        .next()
        .is_none(),
        "a remapped VCMP is no move"
    );
    sim.with(s, |ep, now, rng| {
        ep.suspend(now, rng, &[sf]).expect("suspend")
    });
    sim.run_for(Duration::from_secs(5));
    assert!(
        sim.events(
            l,
            |e| matches!(e, Event::RoleDecided { flow, .. } if *flow == f)
        )
        .next()
        .is_some(),
        "the server's suspend must reach the laptop through the new mapping"
    );
}

/// The laptop's BIND after its move is lost: the server asks again, and
/// the flow learns its new NAT port from the next one.
#[test]
fn a_lost_bind_after_a_move_is_asked_for_again() {
    let (mut sim, l, s, f, sf) = udp_behind_nat(29, true);
    sim.connect_named(l, s, f, sf);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[s].ep.connection(&sf).expect("sf").has_keys);

    move_behind_nat_b(&mut sim, l);
    sim.hosts[l].lose_in_band = 1;
    sim.with(l, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("192.168.2.20:5000"))])
            .expect("resume")
    });
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[s].ep.stats().get(Counter::BindRequestsResent) >= 1);
    assert!(
        sim.events(s, |e| matches!(e, Event::SetRemote { flow, remote } if *flow == sf && *remote == sa("198.51.100.8:7777")))
            .next()
            .is_some(),
        "the server must learn the new NAT's port from the second BIND"
    );
}

/// Issue 31, item 5: a TCP connection whose laptop moved behind a new NAT
/// learns that NAT's port from the laptop's TCP BIND, whose token both
/// ends derive from the connection's keys and the server's request: the
/// server's datapath is given the token, the laptop sends it on the
/// connection's new path (when asked, and again at the SWITCHED), and the
/// two are the same. Before, the server's tc program took the port from
/// the first segment with the connection's numbers, which a neighbour
/// behind the NAT may know.
#[test]
fn a_tcp_connection_behind_a_new_nat_learns_its_port_from_its_tcp_bind() {
    let mut sim = Sim::new(31, Link::default());
    let l = sim.add_host("192.168.1.10", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    sim.hosts[s].confirms_switch = true;
    sim.hosts[l].nat = Some(sa("198.51.100.7:40001"));
    let f = tcp("192.168.1.10:50000", "203.0.113.5:443");
    let sf = tcp("203.0.113.5:443", "198.51.100.7:61000");
    sim.connect_named(l, s, f, sf);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[s].ep.connection(&sf).expect("sf").has_keys);

    sim.move_host(l, "192.168.2.20");
    sim.hosts[l].nat = Some(sa("198.51.100.8:40005"));
    sim.with(l, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("192.168.2.20:50000"))])
            .expect("resume")
    });
    sim.run_for(Duration::from_secs(3));

    let expected: Vec<[u8; 8]> = sim
        .events(
            s,
            |e| matches!(e, Event::ExpectTcpBind { flow, .. } if *flow == sf),
        )
        .map(|(_, e)| match e {
            Event::ExpectTcpBind { token, .. } => *token,
            _ => unreachable!(),
        })
        .collect();
    assert!(!expected.is_empty(), "the server must ask for a TCP BIND");
    let sent: Vec<(SocketAddr, SocketAddr, [u8; 8])> = sim
        .events(
            l,
            |e| matches!(e, Event::SendTcpBind { flow, .. } if *flow == f),
        )
        .map(|(_, e)| match e {
            Event::SendTcpBind {
                local,
                remote,
                token,
                ..
            } => (*local, *remote, *token),
            _ => unreachable!(),
        })
        .collect();
    assert!(
        sent.len() >= 2,
        "the laptop sends its TCP BIND when asked and again at the SWITCHED: {sent:?}"
    );
    for (local, remote, token) in &sent {
        assert_eq!(
            (*local, *remote),
            (sa("192.168.2.20:50000"), sa("203.0.113.5:443")),
            "on the connection's new path"
        );
        assert!(
            expected.contains(token),
            "a token the server's datapath was not given"
        );
    }
    // The SWITCHED's resend comes before the release of the connection.
    let order: Vec<bool> = sim
        .events(l, |e| {
            matches!(e, Event::SendTcpBind { flow, .. } | Event::PeerSwitched { flow, .. } if *flow == f)
        })
        .map(|(_, e)| matches!(e, Event::SendTcpBind { .. }))
        .collect();
    let released = order.iter().position(|b| !b).expect("released");
    assert!(
        released > 0 && order[released - 1],
        "a TCP BIND must leave right before the release: {order:?}"
    );
}

/// A host that is not the connection's peer (a neighbour paired with the
/// laptop) asks for a TCP BIND naming the connection's commitment: the
/// laptop sends none, since only the connection's own peer can name it,
/// and a token only its two ends can compute would be of no use to it
/// anyway.
#[test]
fn only_the_connections_peer_gets_a_tcp_bind() {
    let mut sim = Sim::new(32, Link::default());
    let l = sim.add_host("192.168.1.10", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    let x = sim.add_host("203.0.113.9", Config::default());
    let f = tcp("192.168.1.10:50000", "203.0.113.5:443");
    sim.connect(l, s, f);
    // The neighbour has a connection with the laptop too, so they pair.
    let fx = tcp("192.168.1.10:50001", "203.0.113.9:443");
    sim.connect(l, x, fx);
    sim.run_for(Duration::from_secs(10));
    let before = sim
        .events(l, |e| matches!(e, Event::SendTcpBind { .. }))
        .count();
    // The neighbour's vnatd re-sends the server's request for the
    // laptop's connection with the server: a BIND_REQ under its own key.
    let lkey = sim.hosts[l].ep.public_key();
    let binding = sim.hosts[l].ep.conns.get(&f).expect("f").binding;
    let forged = sim.hosts[x]
        .ep
        .bind_req_naming_for_test(&lkey, &binding)
        .expect("x is paired with the laptop");
    let from = sim.hosts[l]
        .ep
        .peer_addrs
        .get(&sim.hosts[x].ep.public_key())
        .copied()
        .expect("x's session");
    sim.inject(l, from, &forged);
    sim.run_for(Duration::from_secs(2));
    assert_eq!(
        sim.hosts[l].ep.stats().rejected(Reject::BindReqUnknown),
        1,
        "the request must reach the laptop and be refused"
    );
    let after = sim
        .events(l, |e| matches!(e, Event::SendTcpBind { .. }))
        .count();
    assert_eq!(
        after, before,
        "a TCP BIND was sent for another host's request"
    );
}

/// A laptop with a routed public address (no NAT) and a UDP flow to the
/// server moves behind a NAT (issue 32, item 2). Its update names its
/// private address and comes from the NAT's: the server validates the
/// named address and the NAT's beside it, and until one of them wins, its
/// datapath must drop the laptop's datagrams from the NAT's address
/// (which follow the UPD_R at once) rather than hand them to the
/// application as a new peer's: a receive side at port 0 for the NAT's
/// address, asked for before the flow is switched there.
#[test]
fn a_udp_flow_that_enters_a_nat_is_dropped_not_delivered_until_its_port_is_known() {
    let mut sim = Sim::new(29, Link::default());
    let l = sim.add_host("198.51.100.20", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    let f = super::sim::udp("198.51.100.20:5000", "203.0.113.5:53");
    let sf = reverse(&f);
    sim.connect_named(l, s, f, sf);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[s].ep.connection(&sf).expect("sf").has_keys);

    sim.move_host(l, "192.168.2.20");
    sim.hosts[l].nat = Some(sa("198.51.100.8:40005"));
    sim.hosts[l]
        .flow_nat
        .insert(sa("192.168.2.20:5000"), sa("198.51.100.8:7777"));
    sim.with(l, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("192.168.2.20:5000"))])
            .expect("resume")
    });
    sim.run_for(Duration::from_secs(10));
    let at = |pred: &dyn Fn(&Event) -> bool| sim.hosts[s].events.iter().position(|(_, e)| pred(e));
    let guard = at(&|e| {
        matches!(e, Event::PrepareReceive { flow, remote, .. }
            if *flow == sf && *remote == sa("198.51.100.8:0"))
    });
    let switched = at(&|e| {
        matches!(e, Event::SetRemote { flow, remote }
            if *flow == sf && *remote == sa("198.51.100.8:0"))
    });
    assert!(
        guard.is_some(),
        "the server must drop the laptop's datagrams from the NAT until it knows the port"
    );
    assert!(switched.is_some(), "the server must take the NAT");
    assert!(guard < switched, "the drop must come before the switch");
    assert!(
        sim.events(s, |e| matches!(e, Event::SetRemote { flow, remote }
            if *flow == sf && *remote == sa("198.51.100.8:7777")))
            .next()
            .is_some(),
        "the server must learn the NAT's port from the laptop's BIND"
    );
}

/// A laptop moves from a routed address into a NAT (a campus network left
/// for home): its update names its private address, which nobody reaches,
/// and comes from the NAT's. The server validates both; once the NAT's
/// answered, it waits for the named one only a little longer than that
/// round trip, then takes the NAT's. It used to wait the whole
/// retransmission timeout (200 ms at the least) of the named address's
/// CHALLENGE: most of the 426 ms handover of `bench handover --into-nat`.
#[test]
fn a_laptop_entering_a_nat_is_taken_at_the_nats_address_within_a_few_round_trips() {
    let mut sim = Sim::new(35, Link::default());
    let l = sim.add_host("198.51.100.20", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    let f = tcp("198.51.100.20:50000", "203.0.113.5:443");
    let sf = reverse(&f);
    sim.connect(l, s, f);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[s].ep.connection(&sf).expect("sf").has_keys);

    sim.move_host(l, "192.168.2.20");
    sim.hosts[l].nat = Some(sa("198.51.100.8:40005"));
    let moved = sim.now;
    sim.with(l, |ep, now, rng| {
        ep.resume(now, rng, &[(f, sa("192.168.2.20:50000"))])
            .expect("resume")
    });
    sim.run_for(Duration::from_secs(3));
    let (taken, _) = sim
        .events(s, |e| {
            matches!(e, Event::SetRemote { flow, remote }
                if *flow == sf && remote.ip() == ip("198.51.100.8"))
        })
        .next()
        .expect("the server takes the NAT's address");
    // The link's round trip is 3 ms: the update, the two CHALLENGEs, the
    // NAT's RESPONSE, then at most 10 ms for the named address.
    let after = taken.since(moved);
    assert!(
        after <= Duration::from_millis(20),
        "the NAT's address taken {after:?} after the move"
    );
    assert!(sim.hosts[s].ep.stats().get(Counter::PeerBehindNat) > 0);
}
