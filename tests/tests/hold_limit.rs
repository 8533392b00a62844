//! A moving TCP connection is held (its packets dropped) only for a while.
//!
//! vnatd holds a moving connection's send side until the peer says it sends
//! to the new address (SWITCHED), so that nothing reaches a peer still
//! answering at the old one. But a socket whose sends keep failing locally
//! is given up by the kernel after some seconds (tcp_retries2 probes, 500
//! ms apart): a move that takes long (a silent peer, a move of 100,000
//! connections) must not hold its sockets to death. After a limit (2 s)
//! the hold ends; the packets then go into vnat's sink (the laptop has its
//! old address only on `lo`, `vnat_common::MAP_GONE`), where the socket
//! sees them sent and lost, as over a link that went dark, and backs off
//! instead of giving up, until the move completes.
//!
//! The server's vnatd is frozen (SIGSTOP) before the laptop moves, so the
//! laptop's update is never answered (its move would be abandoned only
//! after about 15 s of retries); the server's kernel keeps the connection.

use std::{
    net::SocketAddr,
    thread,
    time::{Duration, Instant},
};

use vnat_tests::{
    tcp_segs_received, EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir,
    Vnatd,
};

#[test]
fn a_move_the_peer_never_answers_stops_holding_after_the_limit() {
    let topo = LaptopRouterServer::builder().tag("hlim").build();
    let lap = Host::new(&topo.laptop, "hliml");
    let srv = Host::new(&topo.server, "hlims");
    let (ldir, sdir) = (TempDir::new("hliml"), TempDir::new("hlims"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5014);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());
    let opts = StreamOptions::tcp(server).rate(100_000);
    let mut cmd = opts.command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(20_000, Duration::from_secs(10));
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");
    let local: SocketAddr = before.local.parse().expect("the client's local address");
    // Both ends know the connection with its keys: it can move.
    let deadline = Instant::now() + Duration::from_secs(15);
    while !lapd.ctl(&["ls", "--proto", "tcp"]).is_some_and(|v| {
        v.as_array().is_some_and(|a| {
            a.iter()
                .any(|c| c["virtual_local"] == before.local && c["mobile"] == true)
        })
    }) {
        assert!(
            Instant::now() < deadline,
            "the connection never became mobile"
        );
        thread::sleep(Duration::from_millis(100));
    }

    srvd.freeze(true);
    // Segments, not bytes: after the limit the laptop may only resend its
    // oldest unacknowledged segment, which can be one the server already
    // has (its ACK went to the old address). Bytes would not grow then,
    // though the laptop's packets do arrive.
    let received = || tcp_segs_received(&topo.server, server, local);
    topo.move_laptop_to_b();
    let moved = Instant::now();
    // Let what was in flight land, then nothing more arrives while held.
    thread::sleep(Duration::from_millis(300));
    let held = received();
    thread::sleep(Duration::from_millis(1200));
    assert_eq!(
        received(),
        held,
        "the laptop's packets reached the server while its move was held"
    );
    // Past the point where a socket whose sends kept failing locally would
    // have been given up, the connection is still there and has not
    // failed: the hold ended and its packets went into the sink.
    while moved.elapsed() < Duration::from_secs(10) {
        thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        client.wait_error(Duration::ZERO),
        None,
        "the laptop's connection failed while its move went unanswered"
    );
    let counters =
        lapd.ctl(&["status"]).expect("vnatd unreachable")["datapath"]["counters"].clone();
    assert!(
        counters["gone_discarded"].as_u64() > Some(0),
        "after the hold nothing went into the sink: {counters}"
    );
    assert_eq!(
        received(),
        held,
        "the laptop's packets reached the server with its old address after the hold ended"
    );
    // The server's vnatd answers again: the move completes and the stream
    // goes on.
    srvd.freeze(false);
    let now = client.latest().expect("a status of the client");
    client.wait_progress(&now, 20_000, Duration::from_secs(30));
    drop(client);
}
