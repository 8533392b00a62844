//! vnatd tells systemd how it is (sd_notify(3)): READY=1 once its
//! datapath is attached and `vnatctl status` answers, with a STATUS= line
//! that says what `vnatctl status` and `vnatctl peers` say; RELOADING=1
//! and READY=1 around a SIGHUP reload; STOPPING=1 at a clean stop. The
//! test plays systemd: it binds the NOTIFY_SOCKET datagram socket and
//! reads what arrives.

use std::{
    os::unix::net::UnixDatagram,
    path::{Path, PathBuf},
    process::Command,
    sync::mpsc,
    time::{Duration, Instant},
};

use nix::sys::signal::Signal;
use serde_json::Value;
use vnat_tests::{bin_path, Host, SameLink, TempDir, Vnatd};

/// One notification, and, for READY=1, what `vnatctl status` answered
/// right after it arrived.
struct Notified {
    fields: Vec<(String, String)>,
    status_then: Option<Value>,
}

impl Notified {
    fn get(&self, key: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

/// `vnatctl --json status` against `control`, None if it did not answer.
fn status(control: &Path) -> Option<Value> {
    let out = Command::new(bin_path("vnatctl"))
        .arg("--control")
        .arg(control)
        .args(["--json", "status"])
        .output()
        .expect("running vnatctl");
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

/// Read the notifications sent to `socket` until `stop` says so; on
/// READY=1, ask vnatd for its status at once.
fn listen(socket: UnixDatagram, control: PathBuf, tx: mpsc::Sender<Notified>) {
    socket
        .set_read_timeout(Some(Duration::from_millis(200)))
        .expect("a read timeout");
    let mut buf = vec![0u8; 4096];
    loop {
        let n = match socket.recv(&mut buf) {
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => panic!("reading the notify socket: {e}"),
        };
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        let fields: Vec<(String, String)> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let ready = fields.iter().any(|(k, v)| k == "READY" && v == "1");
        let status_then = ready.then(|| status(&control)).flatten();
        if tx
            .send(Notified {
                fields,
                status_then,
            })
            .is_err()
        {
            return;
        }
    }
}

/// The next notification that has `key`, within 20 s; those before it
/// are returned too, oldest first.
fn wait_for(rx: &mpsc::Receiver<Notified>, key: &str) -> (Notified, Vec<Notified>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut before = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let n = rx.recv_timeout(left).unwrap_or_else(|_| {
            panic!(
                "no {key}= within 20 s; got {:?}",
                before
                    .iter()
                    .map(|n: &Notified| &n.fields)
                    .collect::<Vec<_>>()
            )
        });
        if n.get(key).is_some() {
            return (n, before);
        }
        before.push(n);
    }
}

/// "12 connections, 3 translated, 2 peers; degraded: tcx, x" as
/// (connections, translated, peers, degraded).
fn parse_summary(line: &str) -> (u64, u64, u64, Vec<String>) {
    let (counts, degraded) = match line.split_once("; degraded: ") {
        Some((c, d)) => (c, d.split(", ").map(str::to_string).collect()),
        None => (line, Vec::new()),
    };
    let parts: Vec<&str> = counts.split(", ").collect();
    let number = |part: &str, words: &[&str]| -> u64 {
        let (n, word) = part
            .split_once(' ')
            .unwrap_or_else(|| panic!("STATUS={line:?}: {part:?} is no count"));
        assert!(words.contains(&word), "STATUS={line:?}: {part:?}");
        n.parse()
            .unwrap_or_else(|_| panic!("STATUS={line:?}: {n:?} is no number"))
    };
    assert_eq!(parts.len(), 3, "STATUS={line:?} is not the summary");
    (
        number(parts[0], &["connection", "connections"]),
        number(parts[1], &["translated"]),
        number(parts[2], &["peer", "peers"]),
        degraded,
    )
}

/// STATUS= agrees with what `vnatctl status` answered at the same time.
fn assert_summary_matches(line: &str, status: &Value) {
    let (connections, translated, peers, degraded) = parse_summary(line);
    let d = &status["datapath"];
    assert_eq!(Some(connections), d["connections"].as_u64(), "{line}");
    assert_eq!(Some(translated), d["translations"].as_u64(), "{line}");
    // Nothing has paired with a host that made no connection.
    assert_eq!(peers, 0, "{line}");
    let features: Vec<String> = d["degraded"]
        .as_array()
        .expect("status --json lists the degraded features")
        .iter()
        .map(|g| g["feature"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(degraded, features, "{line}");
}

#[test]
fn ready_once_the_control_socket_answers_and_reloading_around_a_sighup() {
    let topo = SameLink::new("sdn", false);
    let host = Host::new(&topo.laptop, "sdnl");
    let dir = TempDir::new("sdn");
    let notify_path = dir.path().join("notify");
    let socket = UnixDatagram::bind(&notify_path).expect("binding the notify socket");
    let (tx, rx) = mpsc::channel();
    let control = dir.path().join("vnatd.sock");
    std::thread::spawn(move || listen(socket, control, tx));

    let notify = notify_path.display().to_string();
    let vnatd = Vnatd::start_with_env(
        &host,
        dir.path(),
        &[],
        &[("NOTIFY_SOCKET", notify.as_str())],
    );

    let (ready, before) = wait_for(&rx, "READY");
    assert!(
        before.is_empty(),
        "notifications before READY=1: {:?}",
        before.iter().map(|n| &n.fields).collect::<Vec<_>>()
    );
    let answered = ready
        .status_then
        .as_ref()
        .expect("vnatctl status did not answer right after READY=1");
    let line = ready.get("STATUS").expect("READY=1 comes with a STATUS=");
    assert_summary_matches(line, answered);

    // systemctl reload: RELOADING=1 with the time systemd 253 requires,
    // then READY=1 once the new file is applied, with a fresh STATUS=.
    vnatd.signal(Signal::SIGHUP);
    let (reloading, _) = wait_for(&rx, "RELOADING");
    assert_eq!(reloading.get("RELOADING"), Some("1"));
    let usec: u64 = reloading
        .get("MONOTONIC_USEC")
        .expect("RELOADING=1 comes with MONOTONIC_USEC=")
        .parse()
        .expect("MONOTONIC_USEC= is a number");
    assert!(usec > 0);
    let (ready, _) = wait_for(&rx, "READY");
    let line = ready
        .get("STATUS")
        .expect("READY=1 after a reload comes with a STATUS=");
    assert_summary_matches(line, ready.status_then.as_ref().expect("status answers"));

    // A clean stop says so first.
    let stopped = vnatd.stop();
    assert!(stopped.success(), "vnatd exited with {stopped}");
    let (stopping, _) = wait_for(&rx, "STOPPING");
    assert_eq!(stopping.get("STOPPING"), Some("1"));
}
