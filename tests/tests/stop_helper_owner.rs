//! The stop helper (issue 31, item 8): vnatd stops the process that holds
//! the connection's socket now, never one that merely made the connect()
//! vnatd recorded. A process that connected, handed the socket to a child
//! and closed its own copy no longer holds it; nor does whatever process
//! later takes the recorded pid. Stopping either would freeze a process
//! that has nothing to do with the connection (any local process, after
//! pid reuse).
//!
//! The server connects to an echo on the laptop, forks a child that keeps
//! the connection streaming, and closes its own copy; the laptop then
//! suspends with `--helper stop`, which the server allows.

use std::{
    net::SocketAddr,
    process::Stdio,
    time::{Duration, Instant},
};

use vnat_tests::{EchoServer, LaptopAndServer, LaptopRouterServer, ProcessGroup, Vnatd};

/// Connect to argv[1]:argv[2], fork a child that streams on the
/// connection, close the parent's copy, write "PARENT CHILD" to argv[3].
const HAND_OFF: &str = r#"
import os, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
child = os.fork()
if child == 0:
    s.settimeout(0.2)
    while True:
        try:
            s.sendall(b"x" * 100)
            s.recv(65536)
        except OSError:
            pass
        time.sleep(0.1)
s.close()
with open(sys.argv[3], "w") as f:
    f.write("%d %d\n" % (os.getpid(), child))
while True:
    time.sleep(1)
"#;

/// Whether process `pid` is stopped (state T in /proc/PID/stat).
fn stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process's stat");
    let state = stat
        .rsplit_once(')')
        .map(|(_, r)| r.trim_start().chars().next());
    state == Some(Some('T'))
}

/// The server's row for its connection to the laptop.
fn server_row(d: &Vnatd, laptop: SocketAddr) -> serde_json::Value {
    let ls = d.ctl(&["ls", "--proto", "tcp"]).expect("ls");
    ls.as_array()
        .and_then(|a| {
            a.iter()
                .find(|r| r["virtual_remote"].as_str() == Some(laptop.to_string().as_str()))
                .cloned()
        })
        .unwrap_or_else(|| panic!("the server lists no connection to {laptop}: {ls}"))
}

#[test]
fn the_stop_helper_stops_the_sockets_holder_not_the_process_that_connected() {
    let tag = "hso";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let h = LaptopAndServer::new(&topo, tag);
    let laptop = SocketAddr::new(topo.laptop_a_addr.v4.into(), 5002);
    let _echo = EchoServer::tcp_in(&h.lap, laptop);
    let lapd = Vnatd::start(&h.lap, h.lap_dir.path());
    let srvd = Vnatd::start_with(&h.srv, h.srv_dir.path(), &["--peer-helper", "stop"]);

    let pids = h.work.path().join("pids");
    let mut cmd = h.srv.command("python3");
    cmd.args([
        "-c",
        HAND_OFF,
        &laptop.ip().to_string(),
        &laptop.port().to_string(),
    ])
    .arg(&pids)
    .stdin(Stdio::null())
    .stdout(Stdio::null());
    let _app = ProcessGroup::spawn(cmd, "the connecting process");
    let deadline = Instant::now() + Duration::from_secs(10);
    let (parent, child) = loop {
        let text = std::fs::read_to_string(&pids).unwrap_or_default();
        if let [p, c] = text.split_whitespace().collect::<Vec<_>>()[..] {
            break (
                p.parse::<u32>().expect("parent pid"),
                c.parse::<u32>().expect("child pid"),
            );
        }
        assert!(Instant::now() < deadline, "the application never connected");
        std::thread::sleep(Duration::from_millis(50));
    };
    lapd.wait_mobile_to("tcp", topo.server_addr.v4.into());
    srvd.wait_mobile_to("tcp", laptop.ip());
    // vnatd recorded the process that connected.
    assert_eq!(
        server_row(&srvd, laptop)["pid"].as_u64(),
        Some(u64::from(parent)),
        "the premise: the connection is recorded with the pid that connected"
    );

    let reply = lapd
        .ctl(&["suspend", "--all", "--helper", "stop"])
        .expect("suspend answers");
    assert_eq!(reply["helped"].as_array().map(Vec::len), Some(1), "{reply}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while server_row(&srvd, laptop)["helping"] != serde_json::json!(["stop"]) {
        assert!(
            Instant::now() < deadline,
            "the server never helped: {}",
            server_row(&srvd, laptop)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !stopped(parent),
        "vnatd stopped process {parent}, which made the connect() but no longer holds the socket"
    );
    assert!(
        stopped(child),
        "vnatd did not stop process {child}, which holds the connection's socket"
    );

    lapd.ctl(&["resume", "--all"]).expect("resume answers");
    let deadline = Instant::now() + Duration::from_secs(10);
    while stopped(child) {
        assert!(
            Instant::now() < deadline,
            "process {child} is still stopped after the laptop came back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
