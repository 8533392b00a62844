//! A moving TCP connection is held (its packets dropped) only for a while.
//!
//! vnatd holds a moving connection's send side until the peer says it sends
//! to the new address (SWITCHED), so that nothing reaches a peer still
//! answering at the old one. But a socket whose sends keep failing locally
//! is given up by the kernel after some seconds: a move that takes long (a
//! silent peer, a move of 100,000 connections) must not hold its sockets to
//! death. After a limit (2 s) the packets leave with the old address, as
//! before there was a hold, until the move completes.
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
    // After the limit the socket's packets leave (with the old address,
    // which the router still forwards to the server).
    loop {
        let now = received();
        if now > held {
            eprintln!("the held packets left {:?} after the move", moved.elapsed());
            break;
        }
        assert!(
            moved.elapsed() < Duration::from_secs(6),
            "the laptop's connection was still held {:?} after its move",
            moved.elapsed()
        );
        thread::sleep(Duration::from_millis(50));
    }
    srvd.freeze(false);
    drop(client);
}
