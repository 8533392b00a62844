//! Simulator tests of a NAT that re-maps a connection that did not move
//! (issue 32, item 2; `vcmp::remap`): the server guards connections whose
//! peer is behind a NAT, and what its guard drops makes it ask the peer for
//! the connection's BIND, which alone teaches the new port. The datapath's
//! side (what the guard drops, how a TCP BIND is taken) is tested on the
//! kernel in `tests/tests/tc_nat_guard.rs`.

use crate::stats::{Counter, Reject};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::endpoint::{Config, Event};
use super::sim::{sa, tcp, Link, Sim};
use crate::flow::{Proto, VirtualFlow};

const NAT: &str = "198.51.100.7";

fn nat() -> IpAddr {
    NAT.parse().unwrap()
}

/// A laptop behind a NAT with a TCP connection to a server, paired and
/// mobile: (sim, laptop, server, the laptop's flow, the server's).
fn tcp_behind_nat(seed: u64) -> (Sim, usize, usize, VirtualFlow, VirtualFlow) {
    let mut sim = Sim::new(seed, Link::default());
    let l = sim.add_host("192.168.1.10", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    sim.hosts[s].confirms_switch = true;
    sim.hosts[l].nat = Some(sa("198.51.100.7:40001"));
    let f = tcp("192.168.1.10:50000", "203.0.113.5:443");
    let sf = tcp("203.0.113.5:443", "198.51.100.7:61000");
    sim.connect_named(l, s, f, sf);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[s].ep.connection(&sf).expect("sf").has_keys);
    (sim, l, s, f, sf)
}

fn set_remotes(sim: &Sim, h: usize, flow: VirtualFlow) -> Vec<SocketAddr> {
    sim.events(
        h,
        |e| matches!(e, Event::SetRemote { flow: f, .. } if *f == flow),
    )
    .map(|(_, e)| match e {
        Event::SetRemote { remote, .. } => *remote,
        _ => unreachable!(),
    })
    .collect()
}

/// The server names the connection's peer by the NAT's mapping and the
/// laptop names its end by its private address: the server guards it, and
/// the laptop (whose peer is where it says) guards nothing.
#[test]
fn a_connection_whose_peer_is_behind_a_nat_is_guarded_at_the_server_only() {
    let (sim, l, s, f, sf) = tcp_behind_nat(61);
    assert!(
        sim.events(
            s,
            |e| matches!(e, Event::GuardNat { flow, nat: n } if *flow == sf && *n == nat())
        )
        .next()
        .is_some(),
        "the server must guard the connection against the laptop's NAT"
    );
    assert!(sim
        .events(
            l,
            |e| matches!(e, Event::GuardNat { flow, .. } if *flow == f)
        )
        .next()
        .is_none());
}

/// The guard dropped segments from the NAT to the connection's port (the
/// NAT re-mapped it, or a host behind it sends junk): the server asks the
/// laptop for the connection's TCP BIND, with the port left to learn, and
/// the laptop sends it on the connection's path with a token the server's
/// datapath holds. The drops themselves teach nothing, and however many a
/// stranger causes, the laptop is asked once while the answer is awaited
/// and at most once a second after.
#[test]
fn guard_drops_ask_the_unmoved_laptop_for_its_tcp_bind_and_teach_nothing() {
    let (mut sim, l, s, f, sf) = tcp_behind_nat(62);
    for _ in 0..20 {
        sim.with(s, |ep, now, _| {
            ep.nat_guard_dropped(now, nat(), sf.local, Proto::Tcp)
        });
    }
    sim.run_for(Duration::from_secs(2));
    assert_eq!(
        set_remotes(&sim, s, sf),
        vec![sa("198.51.100.7:0")],
        "one rebind, the port left to the datapath"
    );
    assert_eq!(sim.hosts[s].ep.stats().get(Counter::NatRemapSuspected), 1);
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
    assert!(!sent.is_empty(), "the laptop must send its TCP BIND");
    for (local, remote, token) in &sent {
        assert_eq!(
            (*local, *remote),
            (f.local, f.remote),
            "on the connection's own path"
        );
        assert!(
            expected.contains(token),
            "a token the server's datapath lacks"
        );
    }
    // Nothing moved at the laptop, whose address did not change.
    assert!(set_remotes(&sim, l, f).is_empty());

    // Drops long after (the datapath took the BIND: settled): asked again,
    // once.
    sim.with(s, |ep, _, _| ep.tcp_bind_settled(&sf));
    sim.run_for(Duration::from_secs(5));
    for _ in 0..10 {
        sim.with(s, |ep, now, _| {
            ep.nat_guard_dropped(now, nat(), sf.local, Proto::Tcp)
        });
    }
    sim.run_for(Duration::from_millis(500));
    assert_eq!(sim.hosts[s].ep.stats().get(Counter::NatRemapSuspected), 2);

    // Drops at another port of the server, or from another address, are
    // no connection's here.
    let before = sim.hosts[s].ep.stats().get(Counter::NatRemapSuspected);
    sim.run_for(Duration::from_secs(5));
    sim.with(s, |ep, now, _| {
        ep.nat_guard_dropped(now, nat(), sa("203.0.113.5:444"), Proto::Tcp);
        ep.nat_guard_dropped(now, "198.51.100.9".parse().unwrap(), sf.local, Proto::Tcp);
        ep.nat_guard_dropped(now, nat(), sf.local, Proto::Udp);
    });
    assert_eq!(
        sim.hosts[s].ep.stats().get(Counter::NatRemapSuspected),
        before
    );
}

/// A CGNAT gives the laptop's idle UDP flow a new port (its VCMP mapping,
/// kept by keepalives, stays): the guard's drops make the server ask for
/// the flow's BIND, which comes through the new mapping and teaches the
/// port; the flow stays the one the application knows. A copy of that BIND
/// sent from another port of the NAT (a host behind it that saw it) teaches
/// nothing more.
#[test]
fn a_udp_flow_remapped_by_its_nat_learns_the_new_port_from_its_bind() {
    let mut sim = Sim::new(63, Link::default());
    let l = sim.add_host("192.168.1.10", Config::default());
    let s = sim.add_host("203.0.113.5", Config::default());
    sim.hosts[l].nat = Some(sa("198.51.100.7:40001"));
    sim.hosts[l]
        .flow_nat
        .insert(sa("192.168.1.10:5000"), sa("198.51.100.7:61234"));
    let f = super::sim::udp("192.168.1.10:5000", "203.0.113.5:53");
    let sf = super::sim::udp("203.0.113.5:53", "198.51.100.7:61234");
    sim.connect_named(l, s, f, sf);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[s].ep.connection(&sf).expect("sf").has_keys);
    assert!(sim
        .events(
            s,
            |e| matches!(e, Event::GuardNat { flow, .. } if *flow == sf)
        )
        .next()
        .is_some());

    sim.hosts[l]
        .flow_nat
        .insert(sa("192.168.1.10:5000"), sa("198.51.100.7:62000"));
    sim.with(s, |ep, now, _| {
        ep.nat_guard_dropped(now, nat(), sf.local, Proto::Udp)
    });
    sim.run_for(Duration::from_secs(3));
    assert_eq!(
        set_remotes(&sim, s, sf),
        vec![sa("198.51.100.7:0"), sa("198.51.100.7:62000")],
        "the datagrams wait, then the BIND tells the new port"
    );
    let v = sim.hosts[s].ep.connection(&sf).expect("sf");
    assert_eq!(v.remote_phys, sa("198.51.100.7:62000"));
    assert_eq!(
        sim.hosts[s].binds_to_app, 0,
        "no BIND reaches the application"
    );

    // The BIND again, from another port of the NAT: refused.
    let bind = sim.hosts[s]
        .inbox
        .iter()
        .rev()
        .find(|(from, b)| *from == sa("198.51.100.7:62000") && crate::bind::is_bind(b))
        .map(|(_, b)| b.clone())
        .expect("the BIND as vnatd received it");
    let rejected = sim.hosts[s].ep.stats().rejected_total();
    sim.with(s, |ep, now, rng| {
        ep.handle_datagram(now, rng, sa("198.51.100.7:63000"), &bind)
    });
    assert!(sim.hosts[s].ep.stats().rejected_total() > rejected);
    assert!(sim.hosts[s].ep.stats().rejected(Reject::BindReplayed) >= 1);
    let v = sim.hosts[s].ep.connection(&sf).expect("sf");
    assert_eq!(
        v.remote_phys,
        sa("198.51.100.7:62000"),
        "a replay moved the flow"
    );
}

/// A NAT reboot forgets the VCMP mapping too: the server's requests go to
/// the mapping that is gone, and are sent again as soon as the laptop's
/// keepalive comes from its new one, not at the end of their backoff.
#[test]
fn waiting_requests_follow_the_laptops_new_vcmp_mapping_at_once() {
    let mut sim = Sim::new(64, Link::default());
    let cfg = Config {
        keepalive_interval: Duration::from_secs(1),
        ..Config::default()
    };
    let l = sim.add_host("192.168.1.10", cfg.clone());
    let s = sim.add_host("203.0.113.5", Config::default());
    sim.hosts[s].confirms_switch = true;
    sim.hosts[l].nat = Some(sa("198.51.100.7:40001"));
    let f = tcp("192.168.1.10:50000", "203.0.113.5:443");
    let sf = tcp("203.0.113.5:443", "198.51.100.7:61000");
    sim.connect_named(l, s, f, sf);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[s].ep.connection(&sf).expect("sf").has_keys);

    // The NAT reboots: new mappings for everything.
    sim.hosts[l].nat = Some(sa("198.51.100.7:40077"));
    sim.with(s, |ep, now, _| {
        ep.nat_guard_dropped(now, nat(), sf.local, Proto::Tcp)
    });
    sim.run_for(Duration::from_millis(1500));
    let sent = sim
        .events(
            l,
            |e| matches!(e, Event::SendTcpBind { flow, .. } if *flow == f),
        )
        .count();
    assert!(
        sent >= 1,
        "the request must reach the laptop within a keepalive of the reboot"
    );
    // A new VCMP mapping alone starts no rebind.
    assert_eq!(set_remotes(&sim, s, sf), vec![sa("198.51.100.7:0")]);
}
