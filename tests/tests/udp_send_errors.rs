//! A UDP application that gives up at its first failed send (many do)
//! survives unannounced moves. Without vnat's help its connected socket
//! fails in the window between the old address vanishing and vnatd moving
//! the flow: first "Network is unreachable" (no route at all while the
//! laptop is between networks), then "Invalid argument" (its source
//! address is no longer local). From the moment its flow is mobile, vnatd
//! keeps that address local and gives packets from it a last-resort route,
//! so no send fails. IPv4 and IPv6, there and back.

mod support;

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use vnat_tests::{
    EchoServer, Family, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

fn udp_sender_that_stops_at_its_first_send_error_survives(tag: &str, family: Family) {
    let ipv6 = family == Family::V6;
    let topo = LaptopRouterServer::builder().tag(tag).ipv6(ipv6).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.get(family), 5001);
    let _echo = EchoServer::udp_in(&srv, server);
    let lapd = Vnatd::start(&lap, dl.path());
    let _srvd = Vnatd::start(&srv, ds.path());
    // About 2,000 datagrams a second: a send every half millisecond, so
    // any window in which sends fail is hit.
    let mut cmd = StreamOptions::udp(server)
        .rate(1_000_000)
        .exit_on_send_error()
        .command(lap.ns);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let first = client.wait_verified_at_least(100_000, Duration::from_secs(15));
    let first_local: SocketAddr = first.local.parse().expect("local address");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !lapd.mobile_to("udp", server.ip()) {
        assert!(Instant::now() < deadline, "the flow never became mobile");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Kept local from now on: a last-resort rule for its address.
    assert!(
        topo.laptop.link("vnat-sink").is_some(),
        "no sink for the mobile flow's packets"
    );
    // The sink is up but has no IPv6 address of its own: a link-local
    // address would send router solicitations and MLD reports into it,
    // and wake vnatd's address watch.
    for dev in ["vnat-sink", "vnat-sinkp"] {
        let out = topo
            .laptop
            .run_stdout(&["ip", "-6", "-o", "addr", "show", "dev", dev]);
        assert_eq!(out.trim(), "", "{dev} has IPv6 addresses");
    }
    assert_eq!(
        topo.laptop
            .rules()
            .iter()
            .filter(|r| r.table == FALLBACK_TABLE
                && r.protocol == VNAT_PROTO
                && r.src == Some(first_local.ip()))
            .count(),
        1,
        "one last-resort rule, for the flow's address: {:?}",
        topo.laptop.rules()
    );
    for (i, there) in [true, false, true].into_iter().enumerate() {
        if there {
            topo.move_laptop_to_b();
        } else {
            topo.move_laptop_to_a();
        }
        let at = client.latest().expect("status").verified;
        let st = client.wait_verified_at_least(at + 200_000, Duration::from_secs(20));
        assert_eq!(
            st.error, None,
            "move {i}: the sender met a failed send: {:?}",
            st.json
        );
    }
    // vnatd killed while it keeps the address: what it set up is found
    // by the next one, kept while the flow lives, and released after.
    lapd.kill9();
    let lapd = Vnatd::start(&lap, dl.path());
    let st = client.wait_verified_at_least(
        client.latest().expect("status").verified + 100_000,
        Duration::from_secs(20),
    );
    assert_eq!(st.error, None, "after vnatd's restart: {:?}", st.json);
    let fin = client.stop();
    assert_eq!(fin.error, None, "the sender stopped: {:?}", fin.json);
    assert_eq!(fin.local, first.local, "the socket changed");
    let _ = &lapd;

    // The flow is gone (vnatd notices within its resync): so are the rule
    // and the sink.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rules = topo.laptop.rules();
        let ours = rules.iter().filter(|r| r.protocol == VNAT_PROTO).count();
        let lo: Vec<_> = topo
            .laptop
            .addresses("lo")
            .into_iter()
            .filter(|a| a.protocol.map(u8::from) == Some(VNAT_PROTO))
            .collect();
        if ours == 0 && lo.is_empty() && topo.laptop.link("vnat-sink").is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "vnat's rules {rules:?}, addresses on lo {lo:?} or its sink stayed after the flow closed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// vnat's routes, rules and `lo` addresses carry this protocol number.
const VNAT_PROTO: u8 = 157;
/// vnat's table of last-resort routes.
const FALLBACK_TABLE: u32 = 0x766e_ffff;

#[test]
fn ipv4_udp_sender_never_sees_a_failed_send_across_moves() {
    udp_sender_that_stops_at_its_first_send_error_survives("use4", Family::V4);
}

#[test]
fn ipv6_udp_sender_never_sees_a_failed_send_across_moves() {
    udp_sender_that_stops_at_its_first_send_error_survives("use6", Family::V6);
}

/// An interface named `vnat-sink` that vnat did not make (here a veth
/// whose peer has another name) is not vnat's sink: vnatd neither routes
/// into it nor removes it when the mobile UDP flow that wanted the sink
/// ends, and says why in its log.
#[test]
fn an_interface_named_like_the_sink_that_vnat_did_not_make_is_left_alone() {
    let tag = "usef";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds, work) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
        TempDir::new(&format!("{tag}w")),
    );
    topo.laptop.run_stdout(&[
        "ip",
        "link",
        "add",
        "vnat-sink",
        "type",
        "veth",
        "peer",
        "name",
        "theirs",
    ]);
    let foreign = topo
        .laptop
        .link("vnat-sink")
        .expect("the foreign vnat-sink");
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::udp_in(&srv, server);
    let log = work.path().join("vnatd.log");
    let lapd = Vnatd::start_logging(&lap, dl.path(), &[], &log);
    let _srvd = Vnatd::start(&srv, ds.path());
    let mut cmd = StreamOptions::udp(server).rate(200_000).command(lap.ns);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(20_000, Duration::from_secs(15));
    lapd.wait_mobile_to("udp", server.ip());
    // No last-resort route into someone else's interface.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("that vnat did not make")
    {
        assert!(
            Instant::now() < deadline,
            "vnatd never said why it does not use the foreign vnat-sink"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Each route change makes vnatd try again; the same failure is not
    // warned again (it was at every route change).
    for _ in 0..3 {
        for verb in ["add", "del"] {
            topo.laptop
                .run_stdout(&["ip", "route", verb, "198.51.100.0/24", "dev", "lo"]);
            std::thread::sleep(Duration::from_millis(700));
        }
    }
    lapd.wait_mobile_to("udp", server.ip());
    let warned = std::fs::read_to_string(&log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("that vnat did not make"))
        .count();
    assert_eq!(
        warned, 1,
        "the foreign vnat-sink was warned about {warned} times, not once"
    );
    let routes = topo
        .laptop
        .run_stdout(&["ip", "route", "show", "table", "all"]);
    assert!(
        !routes.contains("dev vnat-sink"),
        "vnatd routed into an interface it did not make: {routes}"
    );
    // The flow ends: what vnat would remove of its own sink stays.
    client.stop();
    std::thread::sleep(Duration::from_secs(8));
    lapd.stop();
    let after = topo
        .laptop
        .link("vnat-sink")
        .expect("vnatd removed an interface it did not make");
    assert_eq!(
        (after.index, after.up),
        (foreign.index, foreign.up),
        "the foreign vnat-sink was replaced or brought up"
    );
    assert!(topo.laptop.link("theirs").is_some(), "its peer was removed");
}
