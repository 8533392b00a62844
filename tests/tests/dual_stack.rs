//! Dual-stack sockets (issue 15, item 6): an AF_INET6 socket that carries
//! IPv4 (a `[::]` listener with IPV6_V6ONLY off, the default of Go's,
//! Node.js's, Java's and iperf3's listeners, or a client socket connected to
//! `::ffff:a.b.c.d`) sees its IPv4 peer as a v4-mapped address. Such a
//! connection is IPv4 on the wire, and both ends must name it as the IPv4
//! flow it is: recorded, paired (MOBILE yes on both ends), translated and
//! moved like any IPv4 connection, at full speed, byte-exact, on the same
//! socket.
//!
//! Real vnatd on both hosts, automatic mode: the laptop changes subnet and
//! nobody gives a command.

use std::{
    net::{IpAddr, SocketAddr},
    process::Stdio,
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_tests::{
    EchoServer, Host, Iperf3Server, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

/// Rows of `vnatctl ls` for `proto` whose remote end is `remote_ip`.
fn rows(d: &Vnatd, proto: &str, remote_ip: IpAddr) -> Vec<Value> {
    let ls = d.ctl(&["ls"]).expect("vnatd unreachable");
    ls.as_array()
        .expect("ls --json is an array")
        .iter()
        .filter(|r| {
            r["proto"].as_str() == Some(proto)
                && r["virtual_remote"]
                    .as_str()
                    .and_then(|s| s.parse::<SocketAddr>().ok())
                    .is_some_and(|a| a.ip() == remote_ip)
        })
        .cloned()
        .collect()
}

/// Waits until `want` connections of `proto` to `remote_ip` are listed, every
/// one IPv4 on both ends (no v4-mapped address) and mobile. Before the fix
/// they were listed as IPv6 on the dual-stack side and never became mobile.
fn wait_mobile_v4(d: &Vnatd, what: &str, proto: &str, remote_ip: IpAddr, want: usize) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = rows(d, proto, remote_ip);
        let ok = r.len() >= want
            && r.iter().all(|row| {
                row["mobile"] == Value::Bool(true)
                    && ["virtual_local", "virtual_remote"].iter().all(|k| {
                        row[*k]
                            .as_str()
                            .and_then(|s| s.parse::<SocketAddr>().ok())
                            .is_some_and(|a| a.is_ipv4())
                    })
            });
        if ok {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: expected {want} mobile IPv4 {proto} connection(s) to {remote_ip}, \
             `vnatctl ls` shows (all rows): {}",
            d.ctl(&["ls"]).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The server's vnatd sends to the laptop's new address for every connection
/// of `proto` from the laptop, within 10 s of the move. (Data verified by
/// the client just after the move may have been sent before it: the
/// stream's status lines come every so often, and a full-speed stream has
/// megabytes in flight.)
fn assert_server_follows(srvd: &Vnatd, topo: &LaptopRouterServer, proto: &str) {
    let old = IpAddr::from(topo.laptop_a_addr.v4);
    let new = IpAddr::from(topo.laptop_b_addr.v4);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = rows(srvd, proto, old);
        assert!(!r.is_empty(), "the server lists no {proto} connection");
        let behind = r.iter().find(|row| {
            let phys: SocketAddr = row["physical_remote"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("no physical_remote in {row}"));
            phys.ip() != new
        });
        match behind {
            None => return,
            Some(row) => assert!(
                Instant::now() < deadline,
                "the server does not send to the laptop's new address: {row}"
            ),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

struct Bed {
    topo: LaptopRouterServer,
    lap_dir: TempDir,
    srv_dir: TempDir,
    tag: String,
}

impl Bed {
    fn new(tag: &str) -> Bed {
        Bed {
            topo: LaptopRouterServer::builder().tag(tag).build(),
            lap_dir: TempDir::new(&format!("{tag}l")),
            srv_dir: TempDir::new(&format!("{tag}s")),
            tag: tag.to_string(),
        }
    }

    fn hosts(&self) -> (Host<'_>, Host<'_>) {
        (
            Host::new(&self.topo.laptop, &format!("{}l", self.tag)),
            Host::new(&self.topo.server, &format!("{}s", self.tag)),
        )
    }

    fn server_v4(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.topo.server_addr.v4.into(), port)
    }
}

/// A numbered byte stream, sent as fast as the socket takes it, through an
/// echo server; the laptop moves while it runs. Same socket, byte-exact, no
/// reset; both vnatds list the connection as mobile IPv4 before the move and
/// translate it after.
fn stream_across_move(bed: &Bed, lap: &Host, srv: &Host, connect: SocketAddr, udp: bool) {
    let lapd = Vnatd::start(lap, bed.lap_dir.path());
    let srvd = Vnatd::start(srv, bed.srv_dir.path());
    let proto = if udp { "udp" } else { "tcp" };
    let opts = if udp {
        // UDP may lose datagrams at full speed: a paced stream, so that
        // what it verifies is the move and not the queue.
        StreamOptions::udp(connect).rate(300_000)
    } else {
        StreamOptions::tcp(connect).rate(0)
    };
    let mut cmd = opts.command(&bed.topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(200_000, Duration::from_secs(10));
    let server_ip = IpAddr::from(bed.topo.server_addr.v4);
    let laptop_ip = IpAddr::from(bed.topo.laptop_a_addr.v4);
    wait_mobile_v4(&lapd, "laptop", proto, server_ip, 1);
    wait_mobile_v4(&srvd, "server", proto, laptop_ip, 1);

    let t0 = Instant::now();
    bed.topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    let after = client.wait_verified_at_least(at_move + 2_000_000, Duration::from_secs(20));
    eprintln!(
        "{}: {} bytes verified {:?} after the move",
        bed.tag,
        after.verified - at_move,
        t0.elapsed()
    );
    assert_server_follows(&srvd, &bed.topo, proto);
    // And data flows with the server sending to the new address.
    let after = client.wait_verified_at_least(after.verified + 200_000, Duration::from_secs(20));
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= after.verified);
}

/// The server listens on `[::]` (dual-stack): its accepted socket is
/// AF_INET6 with a v4-mapped peer, the laptop's is AF_INET.
#[test]
fn tcp_dual_stack_listener_survives_the_move() {
    let bed = Bed::new("dsls");
    let (lap, srv) = bed.hosts();
    let _echo = EchoServer::tcp_dual_stack_in(&srv, 5001);
    stream_across_move(&bed, &lap, &srv, bed.server_v4(5001), false);
}

/// The laptop's client socket is AF_INET6 connected to `::ffff:SERVER`; the
/// server listens on IPv4 only.
#[test]
fn tcp_dual_stack_client_survives_the_move() {
    let bed = Bed::new("dscl");
    let (lap, srv) = bed.hosts();
    let server = bed.server_v4(5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let mapped = SocketAddr::new(
        IpAddr::V6(bed.topo.server_addr.v4.to_ipv6_mapped()),
        server.port(),
    );
    stream_across_move(&bed, &lap, &srv, mapped, false);
}

/// UDP on dual-stack sockets at both ends: the laptop's socket is AF_INET6
/// connected to `::ffff:SERVER`, the server's echo listens on `[::]`.
#[test]
fn udp_dual_stack_both_ends_survive_the_move() {
    let bed = Bed::new("dsud");
    let (lap, srv) = bed.hosts();
    let _echo = EchoServer::udp_dual_stack_in(&srv, 5001);
    let mapped = SocketAddr::new(IpAddr::V6(bed.topo.server_addr.v4.to_ipv6_mapped()), 5001);
    stream_across_move(&bed, &lap, &srv, mapped, true);
}

/// What a user tried: a full-speed download (`iperf3 -R`) from iperf3 as it
/// runs by default (dual-stack `[::]` listener) while the laptop moves. The
/// download finishes without error and data keeps arriving after the move.
#[test]
fn iperf3_download_from_a_dual_stack_server_survives_the_move() {
    let bed = Bed::new("dsip");
    let (lap, srv) = bed.hosts();
    let iperf = Iperf3Server::start_dual_stack(&bed.topo.server, &srv.cgroup, bed.server_v4(5201));
    let lapd = Vnatd::start(&lap, bed.lap_dir.path());
    let srvd = Vnatd::start(&srv, bed.srv_dir.path());

    let seconds = 8.0;
    let mut cmd = iperf.client_cmd(&bed.topo.laptop, &["-R", "-t", "8", "-i", "0.5"]);
    lap.cgroup.join_on_spawn(&mut cmd);
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().expect("starting iperf3 -c");
    let started = Instant::now();

    // iperf3's control and data connections.
    let server_ip = IpAddr::from(bed.topo.server_addr.v4);
    let laptop_ip = IpAddr::from(bed.topo.laptop_a_addr.v4);
    wait_mobile_v4(&lapd, "laptop", "tcp", server_ip, 2);
    wait_mobile_v4(&srvd, "server", "tcp", laptop_ip, 2);
    std::thread::sleep(Duration::from_millis(2500).saturating_sub(started.elapsed()));
    let moved_at = started.elapsed().as_secs_f64();
    bed.topo.move_laptop_to_b();
    // Mid-download (iperf3 closes its connections when it ends).
    std::thread::sleep(Duration::from_secs(3));
    assert_server_follows(&srvd, &bed.topo, "tcp");

    let out = child.wait_with_output().expect("waiting for iperf3");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "iperf3 -J printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(
        out.status.success() && report.get("error").is_none(),
        "the download failed across the move: {}",
        report.get("error").unwrap_or(&report)
    );
    // Bytes arrived in the last seconds, well after the move (not only a
    // tail that was in flight).
    let late: u64 = report["intervals"]
        .as_array()
        .expect("iperf3 report has intervals")
        .iter()
        .filter(|i| i["sum"]["start"].as_f64().unwrap_or(0.0) >= moved_at + 2.0)
        .map(|i| i["sum"]["bytes"].as_u64().unwrap_or(0))
        .sum();
    let total = report["end"]["sum_received"]["bytes"].as_u64().unwrap_or(0);
    eprintln!("dsip: {total} bytes in {seconds} s, {late} of them from 2 s after the move");
    assert!(
        late > 10_000_000,
        "the download did not carry on after the move ({late} bytes in the intervals \
         2 s after it): {}",
        report["intervals"]
    );
}
