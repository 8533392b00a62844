//! Self-test of the harness, without vnat: the topologies route, socat
//! echoes, vnat-stream verifies bytes, and drop leaves nothing behind.
//! Needs root (run through `cargo xtask test`).
use std::{
    fs, io,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    process::Command,
    time::Duration,
};

use vnat_tests::{
    BpffsDir, Cgroup, EchoServer, Family, LaptopRouterServer, SameLink, StreamClient, StreamOptions,
};

/// The namespaces `ip netns list` would show: the files in /run/netns.
fn netns_list() -> Vec<String> {
    match fs::read_dir("/run/netns") {
        Ok(dir) => dir
            .map(|e| {
                e.expect("reading /run/netns")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect(),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("reading /run/netns: {e}"),
    }
}

fn assert_netns_gone(names: &[String]) {
    let list = netns_list();
    for name in names {
        assert!(
            !list.contains(name),
            "netns {name} still exists after drop: {list:?}"
        );
    }
}

/// Streams `bytes` through an echo server at `server`:`port` from `client`
/// and checks that every byte came back verified.
fn stream_through(
    client: &vnat_tests::Netns,
    server_ns: &vnat_tests::Netns,
    server: IpAddr,
    port: u16,
    udp: bool,
) {
    let addr = SocketAddr::new(server, port);
    let _echo = if udp {
        EchoServer::udp(server_ns, addr)
    } else {
        EchoServer::tcp(server_ns, addr)
    };
    let opts = if udp {
        StreamOptions::udp(addr)
    } else {
        StreamOptions::tcp(addr)
    }
    .rate(200_000);
    let stream = StreamClient::spawn(client, &opts);
    let status = stream.wait_verified_at_least(100_000, Duration::from_secs(10));
    assert_eq!(status.error, None);
    assert_eq!(
        status.remote,
        addr.to_string(),
        "the stream is connected to the wrong address"
    );
    let last = stream.stop();
    assert!(last.is_final);
    assert_eq!(last.error, None, "stream failed: {}", last.json);
    assert!(
        last.verified >= 100_000,
        "too little verified: {}",
        last.json
    );
    if udp {
        // A quiet veth loses nothing; losses here mean a harness bug.
        assert_eq!(
            last.json["lost"], 0,
            "UDP datagrams lost on an idle topology: {}",
            last.json
        );
    } else {
        assert_eq!(
            last.verified, last.sent,
            "TCP echo incomplete after stop: {}",
            last.json
        );
    }
}

#[test]
fn laptop_router_server_routes_and_echoes_dual_stack() {
    let names;
    {
        let t = LaptopRouterServer::builder()
            .tag("hself")
            .ipv6(true)
            .build();
        names = vec![
            t.laptop.name().to_string(),
            t.router.name().to_string(),
            t.server.name().to_string(),
        ];
        assert!(
            netns_list().contains(&names[0]),
            "netns {} not listed after creation",
            names[0]
        );
        assert_eq!(t.router.sysctl("net.ipv4.ip_forward"), "1");
        assert_eq!(
            t.laptop.sysctl("net.ipv4.ip_forward"),
            "0",
            "sysctl leaked across namespaces"
        );

        for family in [Family::V4, Family::V6] {
            let server = t.server_addr.get(family);
            t.laptop.wait_reachable(server, Duration::from_secs(5));
            t.server
                .wait_reachable(t.laptop_a_addr.get(family), Duration::from_secs(5));
            stream_through(&t.laptop, &t.server, server, 7000, false);
            stream_through(&t.laptop, &t.server, server, 7001, true);
        }

        // The roam: A goes away, B comes up; the laptop reaches the server
        // from its new address and the old one is gone.
        t.move_laptop_to_b();
        for family in [Family::V4, Family::V6] {
            t.laptop
                .wait_reachable(t.server_addr.get(family), Duration::from_secs(5));
            assert!(
                !t.server
                    .reachable(t.laptop_a_addr.get(family), Duration::from_millis(500)),
                "the laptop's old {family:?} address still answers after the move"
            );
            t.server
                .wait_reachable(t.laptop_b_addr.get(family), Duration::from_secs(5));
        }
        let addrs: Vec<(IpAddr, u8)> = t
            .laptop
            .addresses("wb")
            .iter()
            .map(|a| (a.addr, a.prefix))
            .collect();
        assert!(
            addrs.contains(&("198.18.2.2".parse().unwrap(), 24))
                && addrs.contains(&("fd00:5e:2::2".parse().unwrap(), 64)),
            "wb: {addrs:?}"
        );
        t.move_laptop_to_a();
        t.laptop
            .wait_reachable(t.server_addr.v4.into(), Duration::from_secs(5));
    }
    assert_netns_gone(&names);
}

#[test]
fn same_link_routes_echoes_and_renumbers() {
    let names;
    {
        let t = SameLink::new("hsame", true);
        names = vec![t.laptop.name().to_string(), t.server.name().to_string()];
        for family in [Family::V4, Family::V6] {
            let server = t.server_addr.get(family);
            t.laptop.wait_reachable(server, Duration::from_secs(5));
            stream_through(&t.laptop, &t.server, server, 7100, false);
        }
        stream_through(&t.laptop, &t.server, t.server_addr.v4.into(), 7101, true);
        t.move_laptop();
        for family in [Family::V4, Family::V6] {
            t.server
                .wait_reachable(t.laptop_new_addr.get(family), Duration::from_secs(5));
            assert!(!t
                .server
                .reachable(t.laptop_addr.get(family), Duration::from_millis(500)));
        }
    }
    assert_netns_gone(&names);
}

/// Without vnat a TCP connection does not survive the laptop's move: the
/// checker must report it rather than hang or call it a success. (This is
/// the failure vnat exists to prevent; here it proves the checker notices.)
#[test]
fn stream_reports_a_connection_that_breaks() {
    let t = SameLink::new("hbrk", false);
    let addr = SocketAddr::new(t.server_addr.v4.into(), 7200);
    let echo = EchoServer::tcp(&t.server, addr);
    let stream = StreamClient::spawn(&t.laptop, &StreamOptions::tcp(addr).rate(50_000));
    stream.wait_verified_at_least(20_000, Duration::from_secs(10));
    // Killing the server resets the connection (socat's children are killed).
    // Which error the checker sees depends on where the reset catches it:
    // a read or write gets ECONNRESET (or EOF), and a write after the
    // reader already took the reset gets EPIPE. Each names a closed
    // connection; anything else (a mismatch, a timeout) does not.
    drop(echo);
    let status = stream.wait(Duration::from_secs(20));
    let err = status
        .error
        .expect("vnat-stream did not report the broken connection");
    assert!(
        err.contains("reset") || err.contains("EOF") || err.contains("EPIPE"),
        "unexpected error: {err}"
    );
}

#[test]
fn cgroup_and_bpffs_dirs_are_created_and_removed() {
    let (cg_path, bpf_path): (PathBuf, PathBuf);
    {
        let cg = Cgroup::new("hself");
        let bpf = BpffsDir::new("hself");
        cg_path = cg.path().to_path_buf();
        bpf_path = bpf.path().to_path_buf();
        assert!(cg.id() > 1, "cgroup id of {}", cg_path.display());
        assert!(bpf_path.is_dir());

        // A child that joins on spawn is in the cgroup from the start and is
        // killed by the drop.
        let mut cmd = Command::new("sleep");
        cmd.arg("600");
        cg.join_on_spawn(&mut cmd);
        let child = cmd.spawn().expect("spawning sleep");
        assert_eq!(cg.procs(), vec![child.id()]);
        std::mem::forget(child);
    }
    assert!(
        !cg_path.exists(),
        "cgroup {} still exists after drop",
        cg_path.display()
    );
    assert!(
        !bpf_path.exists(),
        "bpffs dir {} still exists after drop",
        bpf_path.display()
    );
}

/// The other real peers: sshd runs a remote command, iperf3 moves data, and
/// tcpdump sees the laptop's address on the server's link.
#[test]
fn sshd_iperf3_and_capture_work_across_the_router() {
    use vnat_tests::{Capture, Iperf3Server, SshServer};
    let t = LaptopRouterServer::builder().tag("hsrv").build();
    let server = IpAddr::from(t.server_addr.v4);
    t.laptop.wait_reachable(server, Duration::from_secs(5));

    let capture = Capture::start(&t.server, &t.server_if, "tcp port 2222");
    let ssh = SshServer::start(&t.server, SocketAddr::new(server, 2222));
    let out = ssh
        .client_cmd(&t.laptop, "echo vnat-$((40+2))")
        .output()
        .expect("running ssh");
    assert!(
        out.status.success(),
        "ssh failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "vnat-42");
    // The server's link carries the laptop's real address (no vnat here).
    capture.wait_for(&format!("{}.", t.laptop_a_addr.v4), Duration::from_secs(5));
    let lines = capture.stop();
    assert!(
        lines
            .iter()
            .all(|l| l.contains("198.18.1.2") && l.contains("198.18.3.2.2222")),
        "{lines:?}"
    );

    let iperf = Iperf3Server::start(&t.server, SocketAddr::new(server, 5201));
    let out = iperf
        .client_cmd(&t.laptop, &["-t", "1"])
        .output()
        .expect("running iperf3");
    assert!(
        out.status.success(),
        "iperf3 failed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("iperf3 -J output is JSON");
    let bytes = report["end"]["sum_received"]["bytes"]
        .as_u64()
        .expect("iperf3 report has end.sum_received.bytes");
    assert!(bytes > 0, "iperf3 moved no data: {report}");
}

/// A test that panics half-way (with servers and a stream running) still
/// leaves no namespace, cgroup or bpffs directory behind.
#[test]
fn a_panicking_test_leaves_nothing_behind() {
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let t = LaptopRouterServer::builder()
            .tag("hpanic")
            .ipv6(true)
            .build();
        let cg = Cgroup::new("hpanic");
        let bpf = BpffsDir::new("hpanic");
        let addr = SocketAddr::new(t.server_addr.v4.into(), 7300);
        let _echo = EchoServer::tcp(&t.server, addr);
        let stream = StreamClient::spawn(&t.laptop, &StreamOptions::tcp(addr));
        stream.wait_verified_at_least(1_000, Duration::from_secs(10));
        let names = vec![
            t.laptop.name().to_string(),
            t.router.name().to_string(),
            t.server.name().to_string(),
        ];
        tx.send((names, cg.path().to_path_buf(), bpf.path().to_path_buf()))
            .expect("sending names");
        panic!("deliberate panic to check cleanup on unwind");
    })
    .join();
    assert!(result.is_err(), "the test thread was meant to panic");
    let (names, cg_path, bpf_path) = rx.recv().expect("names from the test thread");
    assert_netns_gone(&names);
    assert!(
        !cg_path.exists(),
        "cgroup {} left behind",
        cg_path.display()
    );
    assert!(
        !bpf_path.exists(),
        "bpffs dir {} left behind",
        bpf_path.display()
    );
}
