//! Watching moves (issue 34, item 4) with real daemons and a live TCP
//! stream: `vnatctl --json monitor` on the laptop sees the move's start and
//! its end with `outcome` and `handover_ms`; `resume --wait` while the
//! server's vnatd is stopped (SIGSTOP) exits non-zero at its timeout with a
//! reason; `resume --wait` again, with the server's vnatd running on, prints
//! the move's outcome and exits 0; monitoring clients that never read do
//! not hold the move up; the server's monitor sees its peer's end move;
//! `ls` shows the last move and `peers` when the server was last heard
//! from. About 10 seconds.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::SocketAddr,
    os::unix::net::UnixStream,
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_tests::{
    bin_path, EchoServer, Family, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir,
    Vnatd,
};

/// The laptop's `ls` row of the connection from `local`, once mobile on
/// both hosts.
fn wait_mobile(d: &Vnatd, local: &str, what: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let ls = d.ctl(&["ls"]).expect("vnatd unreachable");
        let row = ls.as_array().and_then(|rows| {
            rows.iter()
                .find(|r| {
                    (r["virtual_local"] == local || r["virtual_remote"] == local)
                        && r["mobile"] == true
                })
                .cloned()
        });
        if let Some(r) = row {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "{what} never listed the connection from {local} as mobile: {ls}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn vnatctl(d: &Vnatd, args: &[&str]) -> Command {
    let mut cmd = Command::new(bin_path("vnatctl"));
    cmd.arg("--control")
        .arg(&d.control)
        .arg("--json")
        .args(args);
    cmd
}

/// `vnatctl --json monitor`, its lines collected as they come (and the
/// text lines of a `vnatctl monitor` beside it, printed at the end: what
/// the README shows).
struct Monitor {
    child: Child,
    events: Arc<Mutex<Vec<Value>>>,
    text: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Monitor {
    fn start(d: &Vnatd) -> Monitor {
        let mut text = Command::new(bin_path("vnatctl"))
            .arg("--control")
            .arg(&d.control)
            .arg("monitor")
            .stdout(Stdio::piped())
            .spawn()
            .expect("starting vnatctl monitor");
        let out = text.stdout.take().expect("piped stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let seen = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                seen.lock().expect("lock").push(line);
            }
        });
        let mut child = vnatctl(d, &["monitor"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting vnatctl monitor");
        let out = child.stdout.take().expect("piped stdout");
        let events = Arc::new(Mutex::new(Vec::new()));
        let seen = events.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                eprintln!("vnatctl --json monitor: {line}");
                let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| {
                    panic!("monitor printed a line that is not JSON ({e}): {line}")
                });
                seen.lock().expect("lock").push(v);
            }
        });
        Monitor {
            child,
            events,
            text,
            lines,
        }
    }

    /// The first event matching `f`, waiting up to `within`.
    fn wait_for(&self, within: Duration, what: &str, f: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + within;
        loop {
            if let Some(v) = self.events.lock().expect("lock").iter().find(|v| f(v)) {
                return v.clone();
            }
            assert!(
                Instant::now() < deadline,
                "monitor never printed {what}; it printed: {:?}",
                self.events.lock().expect("lock")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        for c in [&mut self.child, &mut self.text] {
            let _ = c.kill();
            let _ = c.wait();
        }
        eprintln!("vnatctl monitor printed:");
        for l in self.lines.lock().expect("lock").iter() {
            eprintln!("{l}");
        }
    }
}

/// A monitoring client that never reads what vnatd sends it.
fn stuck_monitor(d: &Vnatd) -> UnixStream {
    let mut s = UnixStream::connect(&d.control).expect("connecting to the control socket");
    s.write_all(b"{\"version\":1,\"request\":{\"type\":\"monitor\"}}\n")
        .expect("sending the monitor request");
    s
}

/// Run vnatctl to its end: (exit status, stdout JSON, how long it took).
fn run(mut cmd: Command) -> (i32, Value, Duration) {
    let t0 = Instant::now();
    let out = cmd.output().expect("running vnatctl");
    let took = t0.elapsed();
    eprintln!(
        "vnatctl printed: {}\nand on stderr: {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "vnatctl printed invalid JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out.status.code().unwrap_or(-1), v, took)
}

#[test]
fn monitor_and_wait_see_a_tcp_move_v4() {
    let tag = "mon4";
    let family = Family::V4;
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.get(family), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());
    let mut cmd = StreamOptions::tcp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    let row = wait_mobile(&lapd, &before.local, "the laptop's vnatd");
    wait_mobile(&srvd, &before.local, "the server's vnatd");
    let id = row["id"].as_u64().expect("ls id is a number");
    let local: SocketAddr = before.local.parse().expect("client's local endpoint");
    let new_local = SocketAddr::new(topo.laptop_b_addr.get(family), local.port());

    let monitor = Monitor::start(&lapd);
    // And on the server, which sees its peer's end move.
    let srv_monitor = Monitor::start(&srvd);
    // Clients that subscribe and never read: vnatd must not wait for them.
    let _stuck: Vec<UnixStream> = (0..3).map(|_| stuck_monitor(&lapd)).collect();
    // Subscribed before anything moves (its first event is proof enough,
    // but there is none yet: give it the time to connect).
    std::thread::sleep(Duration::from_millis(300));

    // A planned move: suspend --wait returns once the server's vnatd
    // agreed roles and keys.
    let (code, v, _) = run(vnatctl(
        &lapd,
        &["suspend", "--all", "--wait", "--timeout", "5s"],
    ));
    assert_eq!(code, 0, "suspend --wait: {v}");
    let settled = v["suspensions"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["id"] == id))
        .unwrap_or_else(|| panic!("suspend --wait did not report connection {id}: {v}"));
    assert_eq!(settled["outcome"], "settled", "{v}");
    monitor.wait_for(Duration::from_secs(2), "the suspension's end", |e| {
        e["event"] == "suspend_ended" && e["id"] == id && e["outcome"] == "settled"
    });

    // The server's vnatd stopped: the laptop's move cannot complete, and a
    // wait for it ends at its timeout, non-zero, with a reason.
    srvd.freeze(true);
    topo.move_laptop_to_b();
    let (code, v, took) = run(vnatctl(
        &lapd,
        &["resume", "--all", "--wait", "--timeout", "1s"],
    ));
    assert_eq!(code, 1, "resume --wait with the peer stopped: {v}");
    let mv = v["moves"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["id"] == id))
        .unwrap_or_else(|| panic!("resume --wait did not report connection {id}: {v}"));
    assert_eq!(mv["outcome"], "still_moving", "{v}");
    assert_eq!(mv["to"], new_local.to_string(), "where it is moving: {v}");
    assert!(
        mv["reason"].as_str().is_some_and(|r| r.contains("1s")),
        "a timed-out wait says why: {v}"
    );
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "resume --wait --timeout 1s took {took:?}"
    );
    let started = monitor.wait_for(Duration::from_secs(5), "the move's start", |e| {
        e["event"] == "move_started" && e["id"] == id
    });
    assert_eq!(started["side"], "local", "{started}");
    assert_eq!(started["from"], before.local, "{started}");
    assert_eq!(started["to"], new_local.to_string(), "{started}");
    assert_eq!(
        started["peer_address"],
        server.ip().to_string(),
        "{started}"
    );
    assert!(
        started["peer"].as_str().is_some_and(|k| k.len() == 64),
        "the peer's host key: {started}"
    );
    assert!(started["time_ms"].as_u64().is_some(), "{started}");

    // Again, and the server's vnatd goes on meanwhile: the move completes,
    // resume --wait prints its outcome and exits 0.
    let waiting = vnatctl(&lapd, &["resume", "--all", "--wait"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting vnatctl resume --wait");
    std::thread::sleep(Duration::from_millis(300));
    srvd.freeze(false);
    let out = waiting.wait_with_output().expect("vnatctl resume --wait");
    eprintln!(
        "vnatctl --json resume --all --wait printed: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "resume --wait printed invalid JSON ({e}): {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert_eq!(out.status.code(), Some(0), "resume --wait: {v}");
    let mv = v["moves"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["id"] == id))
        .unwrap_or_else(|| panic!("resume --wait did not report connection {id}: {v}"));
    assert_eq!(mv["outcome"], "moved", "{v}");
    assert_eq!(mv["to"], new_local.to_string(), "{v}");
    assert_eq!(mv["physical_local"], new_local.to_string(), "{v}");
    // From its start, before the server's vnatd was stopped for 1.6 s.
    assert!(
        mv["handover_ms"].as_u64().is_some_and(|ms| ms >= 1000),
        "{v}"
    );

    let ended = monitor.wait_for(Duration::from_secs(5), "the move's end", |e| {
        e["event"] == "move_ended" && e["id"] == id && e["side"] == "local"
    });
    assert_eq!(ended["outcome"], "moved", "{ended}");
    assert_eq!(ended["handover_ms"], mv["handover_ms"], "{ended}");
    assert_eq!(ended["to"], new_local.to_string(), "{ended}");
    assert!(ended.get("reason").is_none(), "{ended}");

    // The server's vnatd saw the laptop's end move: validated, translated.
    let peer_ended = srv_monitor.wait_for(Duration::from_secs(5), "the peer's move's end", |e| {
        e["event"] == "move_ended" && e["side"] == "peer"
    });
    assert_eq!(peer_ended["outcome"], "moved", "{peer_ended}");
    assert_eq!(peer_ended["from"], before.local, "{peer_ended}");
    assert_eq!(peer_ended["to"], new_local.to_string(), "{peer_ended}");
    assert!(peer_ended["handover_ms"].as_u64().is_some(), "{peer_ended}");
    srv_monitor.wait_for(Duration::from_secs(1), "the peer's move's start", |e| {
        e["event"] == "move_started" && e["side"] == "peer" && e["id"] == peer_ended["id"]
    });

    // The same socket goes on, byte-exact.
    let at = client.latest().expect("status").verified;
    client.wait_verified_at_least(at + 100_000, Duration::from_secs(10));

    // ls: the last move and its outcome; peers: heard from just now.
    let ls = lapd.ctl(&["ls"]).expect("vnatd unreachable");
    let row = ls
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["id"] == id))
        .unwrap_or_else(|| panic!("no connection {id}: {ls}"));
    assert_eq!(row["last_move"]["outcome"], "moved", "{row}");
    assert_eq!(row["last_move"]["handover_ms"], mv["handover_ms"], "{row}");
    let peers = lapd.ctl(&["peers"]).expect("vnatd unreachable");
    let p = peers
        .as_array()
        .and_then(|p| p.iter().find(|p| p["key"] == started["peer"]))
        .unwrap_or_else(|| panic!("no peer {}: {peers}", started["peer"]));
    assert!(
        p["last_heard_secs"].as_u64().is_some_and(|s| s < 5),
        "the server was heard from just now: {peers}"
    );
    assert!(p["last_heard_ms"].as_u64().is_some(), "{peers}");
    for args in [&["ls"][..], &["peers"]] {
        let out = Command::new(bin_path("vnatctl"))
            .arg("--control")
            .arg(&lapd.control)
            .args(args)
            .output()
            .expect("vnatctl");
        eprintln!(
            "vnatctl {args:?}:\n{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
}
