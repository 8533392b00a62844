//! A peer with valid keys names another host's endpoint as its new address
//! (issue 16, item 2).
//!
//! Laptop V streams UDP to the server; a rogue peer on another subnet (vnat's
//! own protocol core driven by the test, `vnat_tests::Rogue`) holds valid
//! keys for its own UDP flow to the same server port. It sends an authentic
//! update saying that its end moved to V's endpoint. Validation of that
//! address must fail (V's vnatd has no keys for the rogue's flow), but the
//! server prepares receive sides before validating: a receive side for
//! (V's endpoint -> the server's port) would hand V's datagrams to the
//! rogue's socket on the server, whose echo would go to the rogue. The
//! server's datapath refuses a translation whose physical endpoints are
//! another recorded connection's, untranslated (V before its move) or
//! translated (after it): V's stream never stalls, and the rogue's socket
//! receives nothing of V's.

use std::{net::SocketAddr, time::Duration};

use vnat_tests::{
    attach_attacker, wait_until, EchoServer, Host, LaptopRouterServer, Rogue, StreamOptions,
    TempDir, Vnatd,
};

fn counter(d: &Vnatd, group: &str, name: &str) -> u64 {
    d.ctl(&["status"]).expect("vnatd unreachable")["vcmp"][group][name]
        .as_u64()
        .unwrap_or(0)
}

/// V's physical end of its UDP flow to `port`, as the server sees it.
fn v_endpoint(srvd: &Vnatd, v_prefix: &str, port: u16) -> SocketAddr {
    let ls = srvd.ctl(&["ls", "--proto", "udp"]).expect("ls");
    let row = ls
        .as_array()
        .expect("array")
        .iter()
        .find(|r| {
            r["physical_local"]
                .as_str()
                .is_some_and(|a| a.ends_with(&format!(":{port}")))
                && r["physical_remote"]
                    .as_str()
                    .is_some_and(|a| a.starts_with(v_prefix))
        })
        .unwrap_or_else(|| panic!("no flow of V's on the server: {ls}"))
        .clone();
    row["physical_remote"]
        .as_str()
        .expect("address")
        .parse()
        .expect("socket address")
}

#[test]
fn a_keyed_peer_cannot_take_another_connection_s_endpoints() {
    let topo = LaptopRouterServer::builder().tag("col").build();
    let (r_ns, _) = attach_attacker(&topo, "colr");
    let dirs = (TempDir::new("colv"), TempDir::new("cols"));
    let v = Host::new(&topo.laptop, "colv");
    let srv = Host::new(&topo.server, "cols");
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5002);
    let _echo = EchoServer::udp_in(&srv, server);
    let vd = Vnatd::start(&v, dirs.0.path());
    let srvd = Vnatd::start(&srv, dirs.1.path());
    let mut cmd = StreamOptions::udp(server)
        .rate(100_000)
        .command(&topo.laptop);
    v.cgroup.join_on_spawn(&mut cmd);
    let v_udp = vnat_tests::StreamClient::from_command(cmd);
    v_udp.wait_verified_at_least(20_000, Duration::from_secs(10));

    let rogue = Rogue::start(&r_ns, 2031);
    let own = rogue.open_udp_flow(&r_ns, server);
    wait_until(
        Duration::from_secs(30),
        || rogue.has_keys(&own),
        || format!("the rogue's own flow was never bound: {:?}", rogue.events()),
    );
    wait_until(
        Duration::from_secs(30),
        // UDP binds in band (issue 31): on the server's BIND or on the
        // answer to V's own.
        || counter(&vd, "events", "binds_bound") >= 1,
        || "V's flow was never bound".into(),
    );
    let _ = rogue.flow_received();

    // 1. V's endpoint, untranslated.
    let target = v_endpoint(&srvd, "198.18.1.2:", 5002);
    let failed = counter(&srvd, "events", "validation_failed");
    let gap_before = v_udp.latest().expect("status").max_gap_ms;
    rogue.resume(own, target);
    let at = v_udp.latest().expect("status").verified;
    v_udp.wait_verified_at_least(at + 200_000, Duration::from_secs(20));
    wait_until(
        Duration::from_secs(30),
        || counter(&srvd, "events", "validation_failed") > failed,
        || "the server never gave up validating V's endpoint for the rogue".into(),
    );
    let got = rogue.flow_received();
    assert!(
        got.is_empty(),
        "the rogue received {} datagrams of another's flow",
        got.len()
    );
    let gap = v_udp.latest().expect("status").max_gap_ms;
    assert!(
        gap <= gap_before.max(1000),
        "V's stream stalled for {gap} ms during the attack"
    );

    // 2. V moves; then its endpoint, translated.
    topo.move_laptop_to_b();
    let at = v_udp.latest().expect("status").verified;
    v_udp.wait_verified_at_least(at + 100_000, Duration::from_secs(20));
    let target = v_endpoint(&srvd, "198.18.2.2:", 5002);
    let failed = counter(&srvd, "events", "validation_failed");
    rogue.resume(own, target);
    let at = v_udp.latest().expect("status").verified;
    v_udp.wait_verified_at_least(at + 200_000, Duration::from_secs(20));
    wait_until(
        Duration::from_secs(30),
        || counter(&srvd, "events", "validation_failed") > failed,
        || "the server never gave up validating V's new endpoint for the rogue".into(),
    );
    let got = rogue.flow_received();
    assert!(
        got.is_empty(),
        "the rogue received {} datagrams of another's flow",
        got.len()
    );
    let fin = v_udp.stop();
    assert_eq!(fin.error, None, "V's stream broke: {:?}", fin.json);
    drop((vd, rogue));
}
