//! Adoption (issue 18, item 6): a connection that no vnatd recorded when it
//! was opened still moves. Three ways a connection escapes the recorders,
//! each on real namespace hosts with a live TCP stream, followed by the
//! laptop's move to another subnet; the same socket must go on byte-exact:
//!
//! - opened before vnatd started, on both hosts (both ends adopt it, and
//!   each works out the connection's first sequence numbers on its own);
//! - opened before the server's cgroup was enabled (`vnatctl enable`), to a
//!   server whose listener closed after accepting it: the server adopts the
//!   accepted end, the laptop recorded it as usual;
//! - held by a laptop whose vnatd lost its pins (killed, pins removed,
//!   started again): the laptop adopts the connecting end, the server
//!   recorded it as usual.
//!
//! The last two check each end's adoption against what sock_ops recorded
//! at the other: the two ends pair the connection only if they name it by
//! the same sequence numbers.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, StreamStatus, TempDir, Vnatd,
};

/// The row of `d`'s listing for the stream whose laptop end is `lap_end`
/// (the laptop's local or the server's remote end), waiting for it up to
/// 45 s (adoption is periodic, and in a VM without KVM, as `cargo xtask
/// test --kernel` runs, its probes take seconds).
fn listed(d: &Vnatd, lap_end: &str, what: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        let ls = d.ctl(&["ls"]);
        if let Some(r) = ls.as_ref().and_then(|v| v.as_array()).and_then(|a| {
            a.iter()
                .find(|r| r["virtual_local"] == lap_end || r["virtual_remote"] == lap_end)
        }) {
            return r.clone();
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the adopted connection is not listed: {ls:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The laptop moves to subnet B; the stream must go on on the same socket,
/// and both vnatds must show it translated to the laptop's new address.
fn move_and_check(
    topo: &LaptopRouterServer,
    client: StreamClient,
    since: &StreamStatus,
    lapd: &Vnatd,
    srvd: &Vnatd,
) {
    let local: SocketAddr = since.local.parse().expect("vnat-stream's local address");
    topo.move_laptop_to_b();
    let new_local = SocketAddr::new(topo.laptop_b_addr.v4.into(), local.port());
    let after = client.wait_progress(since, 100_000, Duration::from_secs(20));
    assert_eq!(
        after.local, since.local,
        "the stream is not on the same socket after the move"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (l, s) = (
            listed(lapd, &since.local, "laptop"),
            listed(srvd, &since.local, "server"),
        );
        if l["physical_local"] == new_local.to_string()
            && s["physical_remote"] == new_local.to_string()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the adopted connection is not shown moved to {new_local}:\nlaptop {l}\nserver {s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    client.wait_progress(&after, 100_000, Duration::from_secs(20));
    let end = client.stop();
    assert!(
        end.error.is_none() && end.verified >= after.verified,
        "the stream failed after the move: {end:?}"
    );
}

struct Setup<'a> {
    topo: &'a LaptopRouterServer,
    lap: Host<'a>,
    srv: Host<'a>,
    ldir: TempDir,
    sdir: TempDir,
    _echo: EchoServer,
    server: SocketAddr,
}

/// The server's echo: a listener that stays, or one that closes once it
/// has accepted the connection (the accepted end must then be told from
/// its ports).
#[derive(PartialEq)]
enum Listener {
    Stays,
    ClosesAfterAccept,
}

fn setup<'a>(topo: &'a LaptopRouterServer, tag: &str, listener: Listener) -> Setup<'a> {
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let echo = match listener {
        Listener::Stays => EchoServer::tcp_in(&srv, server),
        Listener::ClosesAfterAccept => EchoServer::tcp_once_in(&srv, server),
    };
    Setup {
        ldir: TempDir::new(&format!("{tag}l")),
        sdir: TempDir::new(&format!("{tag}s")),
        topo,
        lap,
        srv,
        _echo: echo,
        server,
    }
}

/// A TCP stream from the laptop's cgroup to the server's echo, once 50 kB
/// went there and back.
fn stream(s: &Setup) -> (StreamClient, StreamStatus) {
    let mut cmd = StreamOptions::tcp(s.server)
        .rate(300_000)
        .command(&s.topo.laptop);
    s.lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let first = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    (client, first)
}

#[test]
fn a_connection_opened_before_vnatd_started_on_both_hosts_moves() {
    let topo = LaptopRouterServer::builder().tag("adb").build();
    let s = setup(&topo, "adb", Listener::Stays);
    unpin_all(&s.lap);
    unpin_all(&s.srv);
    let (client, first) = stream(&s);
    let lapd = Vnatd::start(&s.lap, s.ldir.path());
    let srvd = Vnatd::start(&s.srv, s.sdir.path());
    let l = listed(&lapd, &first.local, "laptop");
    assert_eq!(
        l["command"], "vnat-stream",
        "the laptop's adopted connection names the wrong owner: {l}"
    );
    assert_eq!(l["adopted"], true, "{l}");
    let r = listed(&srvd, &first.local, "server");
    assert_eq!(r["adopted"], true, "{r}");
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");
    lapd.wait_mobile_to("tcp", s.server.ip());
    let now = client.wait_progress(&first, 50_000, Duration::from_secs(10));
    move_and_check(s.topo, client, &now, &lapd, &srvd);
}

#[test]
fn a_connection_opened_before_its_cgroup_was_enabled_moves() {
    let topo = LaptopRouterServer::builder().tag("ade").build();
    // The echo's listener closes once it has accepted: the server tells
    // the accepted end by its ports.
    let s = setup(&topo, "ade", Listener::ClosesAfterAccept);
    let lapd = Vnatd::start(&s.lap, s.ldir.path());
    // The server's vnatd runs, but does not record the echo's cgroup.
    let srvd = Vnatd::start(&s.srv, s.sdir.path());
    let cg = s.srv.cgroup.path().display().to_string();
    srvd.ctl(&["disable", "--cgroup", &cg])
        .expect("vnatctl disable failed");
    let (client, first) = stream(&s);
    std::thread::sleep(Duration::from_secs(1));
    let ls = srvd
        .ctl(&["ls", "--proto", "tcp"])
        .expect("the server's vnatd is unreachable");
    assert_eq!(
        ls.as_array().map(Vec::len),
        Some(0),
        "the server's vnatd lists a connection of a cgroup it was not told about: {ls}"
    );
    srvd.ctl(&["enable", "--cgroup", &cg])
        .expect("vnatctl enable failed");
    let r = listed(&srvd, &first.local, "server");
    assert_eq!(r["virtual_remote"], first.local, "{r}");
    assert_eq!(r["adopted"], true, "{r}");
    let l = listed(&lapd, &first.local, "laptop");
    assert_eq!(l["adopted"], false, "recorded as usual, not adopted: {l}");
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");
    lapd.wait_mobile_to("tcp", s.server.ip());
    let now = client.wait_progress(&first, 50_000, Duration::from_secs(10));
    move_and_check(s.topo, client, &now, &lapd, &srvd);
}

#[test]
fn a_vnatd_that_lost_its_pins_adopts_its_connections_again() {
    let topo = LaptopRouterServer::builder().tag("adp").build();
    let s = setup(&topo, "adp", Listener::Stays);
    let lapd = Vnatd::start(&s.lap, s.ldir.path());
    let srvd = Vnatd::start(&s.srv, s.sdir.path());
    let (client, first) = stream(&s);
    lapd.wait_paired("the laptop's vnatd");
    lapd.wait_mobile_to("tcp", s.server.ip());
    // Killed (no clean stop), and everything it pinned is gone: the new
    // vnatd starts with empty maps.
    drop(lapd);
    unpin_all(&s.lap);
    let lapd = Vnatd::start(&s.lap, s.ldir.path());
    let l = listed(&lapd, &first.local, "laptop");
    assert_eq!(l["adopted"], true, "{l}");
    lapd.wait_mobile_to("tcp", s.server.ip());
    let now = client.wait_progress(&first, 50_000, Duration::from_secs(10));
    move_and_check(s.topo, client, &now, &lapd, &srvd);
}

/// Remove everything `host`'s datapath pinned (the harness opened it once
/// when it made the host): its recorders are then attached nowhere, as on
/// a host where vnatd never ran, and its maps are gone.
fn unpin_all(host: &Host) {
    for e in std::fs::read_dir(host.pins.path()).expect("reading the pin directory") {
        let p = e.expect("a pin").path();
        let r = if p.is_dir() {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        };
        r.unwrap_or_else(|e| panic!("removing {}: {e}", p.display()));
    }
}

/// A connected UDP socket opened before vnatd started: the recorders see
/// only later connects and sends to an address, so only adoption records
/// it; the laptop's move must carry its datagrams on.
#[test]
fn a_connected_udp_socket_opened_before_vnatd_started_moves() {
    let topo = LaptopRouterServer::builder().tag("adu").build();
    let lap = Host::new(&topo.laptop, "adul");
    let srv = Host::new(&topo.server, "adus");
    let (ldir, sdir) = (TempDir::new("adul"), TempDir::new("adus"));
    unpin_all(&lap);
    unpin_all(&srv);
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::udp_in(&srv, server);
    let mut cmd = StreamOptions::udp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let first = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());
    let l = listed(&lapd, &first.local, "laptop");
    assert_eq!(l["adopted"], true, "{l}");
    lapd.wait_mobile_to("udp", server.ip());
    let now = client.wait_progress(&first, 50_000, Duration::from_secs(10));
    move_and_check(&topo, client, &now, &lapd, &srvd);
}
