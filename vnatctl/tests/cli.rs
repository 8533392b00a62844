//! The vnatctl binary against an in-process control server backed by the
//! fake datapath, and against no daemon at all.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use serde_json::Value;
use vnat_daemon::{
    control::{share, ControlListener, DaemonInfo, Handler},
    datapath::{fake::FakeDatapath, Datapath, Proto, Translation, VirtualFlow},
};

/// A control server on a temp socket, stopped (and its socket removed) on drop.
struct Daemon {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    cgroup_dir: PathBuf,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Daemon {
    fn start() -> Daemon {
        let dir = tempfile::tempdir().expect("temp dir");
        let socket = dir.path().join("vnatd.sock");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let mut dp = FakeDatapath::new();
        let flow = |p, l: &str, r: &str| VirtualFlow {
            proto: p,
            local: l.parse().expect("addr"),
            remote: r.parse().expect("addr"),
        };
        dp.add_connection(
            flow(Proto::Tcp, "198.18.1.2:40000", "198.18.3.2:5001"),
            Some(42),
        );
        let moved = flow(Proto::Udp, "[fd00:1::2]:5353", "[fd00:3::2]:53");
        dp.add_connection(moved, None);
        let t = Translation {
            flow: moved,
            physical_local: "[fd00:2::2]:5353".parse().expect("addr"),
            physical_remote: moved.remote,
        };
        dp.install_translation(&t).expect("fake translation");
        let info = DaemonInfo {
            version: "0.1.0-test".into(),
            pid: std::process::id(),
            uptime_secs: 0,
            control: socket.clone(),
            state_dir: dir.path().join("state"),
            listen: "0.0.0.0:2031".parse().expect("addr"),
            configured_cgroups: Vec::new(),
        };
        let listener = {
            let _enter = runtime.enter();
            ControlListener::bind(&socket).expect("bind the control socket")
        };
        let handler = Handler::new(share(Box::new(dp)), info);
        runtime.spawn(listener.serve(handler, std::future::pending()));
        let cgroup_dir = dir.path().join("cg");
        Daemon {
            _dir: dir,
            socket,
            cgroup_dir,
            runtime: Some(runtime),
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

fn vnatctl(control: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vnatctl"))
        .arg("--control")
        .arg(control)
        .args(args)
        .env_remove("VNAT_CONTROL")
        .output()
        .expect("running vnatctl")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("UTF-8 stdout")
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).expect("UTF-8 stderr")
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", stdout(o)))
}

#[test]
fn ls_table_and_json() {
    let d = Daemon::start();
    let o = vnatctl(&d.socket, &["ls"]);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert!(lines[0].starts_with("ID  "), "{out}");
    assert_eq!(
        lines[0].split_whitespace().collect::<Vec<_>>(),
        [
            "ID",
            "PROTO",
            "VIRTUAL-LOCAL",
            "VIRTUAL-REMOTE",
            "PHYSICAL-LOCAL",
            "PHYSICAL-REMOTE",
            "STATE",
            "MOBILE",
            "PID",
            "COMMAND",
            "CGROUP"
        ]
    );
    // No VCMP driver in this server: nothing can move.
    assert!(
        lines[1..]
            .iter()
            .all(|l| l.split_whitespace().nth(7) == Some("no")),
        "{out}"
    );
    assert!(
        lines[1].contains("198.18.1.2:40000") && lines[1].contains("native"),
        "{out}"
    );
    assert!(
        lines[2].contains("[fd00:2::2]:5353") && lines[2].contains("translated"),
        "{out}"
    );

    let o = vnatctl(&d.socket, &["--json", "ls"]);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    let v = json(&o);
    let rows = v.as_array().expect("an array");
    assert_eq!(rows.len(), 2);
    for key in [
        "id",
        "proto",
        "virtual_local",
        "virtual_remote",
        "physical_local",
        "physical_remote",
        "state",
        "pid",
        "command",
        "cgroup",
        "cookie",
        "mobile",
    ] {
        assert!(
            rows.iter().all(|r| r.get(key).is_some()),
            "key {key} missing: {v}"
        );
    }
    assert_eq!(rows[1]["virtual_remote"], "[fd00:3::2]:53");
    assert_eq!(rows[0]["pid"], 42);
    assert_eq!(rows[0]["mobile"], false);

    // --json after the subcommand works too (global flag), with filters.
    let o = vnatctl(
        &d.socket,
        &["ls", "--proto", "udp", "--state", "translated", "--json"],
    );
    let v = json(&o);
    assert_eq!(v.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v[0]["proto"], "udp");
    let o = vnatctl(
        &d.socket,
        &["ls", "--proto", "tcp", "--state", "translated", "--json"],
    );
    assert_eq!(json(&o), serde_json::json!([]));
}

#[test]
fn status_enable_disable() {
    let d = Daemon::start();
    let o = vnatctl(&d.socket, &["status"]);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("vnatd 0.1.0-test") && out.contains("2 (1 translated)"),
        "{out}"
    );

    // A relative path is sent as an absolute one.
    let cg = d.cgroup_dir.display().to_string();
    let parent = d.cgroup_dir.parent().expect("parent");
    let o = Command::new(env!("CARGO_BIN_EXE_vnatctl"))
        .current_dir(parent)
        .args([
            "--control",
            &d.socket.display().to_string(),
            "--json",
            "enable",
            "--cgroup",
            "cg",
        ])
        .output()
        .expect("running vnatctl");
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    assert_eq!(
        json(&o),
        serde_json::json!({ "cgroup": cg, "enabled": true })
    );

    let o = vnatctl(&d.socket, &["--json", "status"]);
    let v = json(&o);
    assert_eq!(v["datapath"]["cgroups"][0]["path"], cg.as_str(), "{v}");
    assert_eq!(v["datapath"]["connections"], 2);

    let o = vnatctl(&d.socket, &["disable", "--cgroup", &cg]);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    assert!(stdout(&o).contains("no longer records"), "{}", stdout(&o));

    // Disabling again: a daemon-reported error, exit 1, JSON on stdout and a sentence on stderr.
    let o = vnatctl(&d.socket, &["--json", "disable", "--cgroup", &cg]);
    assert_eq!(o.status.code(), Some(1));
    let v = json(&o);
    assert_eq!(v["error"]["kind"], "datapath", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("is not enabled")),
        "{v}"
    );
    assert!(stderr(&o).starts_with("vnatctl: cgroup "), "{}", stderr(&o));
}

#[test]
fn daemon_not_running() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("absent.sock");
    let o = vnatctl(&socket, &["status"]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "exit status for an unreachable daemon"
    );
    assert!(o.stdout.is_empty(), "nothing on stdout without --json");
    assert_eq!(
        stderr(&o).trim_end(),
        format!(
            "vnatctl: cannot reach vnatd at {}: No such file or directory; is vnatd running? (start it with: systemctl start vnatd)",
            socket.display()
        )
    );
    let o = vnatctl(&socket, &["ls", "--json"]);
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(json(&o)["error"]["kind"], "unreachable");

    // A socket file nobody listens on (vnatd killed): refused, also exit 3.
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("stale socket"));
    let o = vnatctl(&socket, &["ls"]);
    assert_eq!(o.status.code(), Some(3), "stderr: {}", stderr(&o));
    assert!(
        stderr(&o).contains("Connection refused; is vnatd running?"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn usage_errors_and_version() {
    let nowhere = Path::new("/nonexistent/vnatd.sock");
    let o = vnatctl(nowhere, &["ls", "--proto", "sctp"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("sctp"), "{}", stderr(&o));
    let o = vnatctl(nowhere, &["--json", "frobnicate"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(json(&o)["error"]["kind"], "usage");
    let o = vnatctl(nowhere, &["enable"]);
    assert_eq!(o.status.code(), Some(2), "--cgroup is required");

    let o = Command::new(env!("CARGO_BIN_EXE_vnatctl"))
        .arg("--version")
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(
        stdout(&o).trim(),
        format!("vnatctl {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn changes_by_other_holders_of_the_datapath_show_in_the_next_call() {
    // The datapath trait object is shared: a change made by another holder
    // (later: the VCMP driver) is visible to the next vnatctl call.
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("vnatd.sock");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let shared = share(Box::new(FakeDatapath::new()));
    let listener = {
        let _enter = runtime.enter();
        ControlListener::bind(&socket).expect("bind")
    };
    let info = DaemonInfo {
        version: "t".into(),
        pid: 1,
        uptime_secs: 0,
        control: socket.clone(),
        state_dir: dir.path().into(),
        listen: "[::]:2031".parse().expect("addr"),
        configured_cgroups: Vec::new(),
    };
    runtime.spawn(listener.serve(Handler::new(shared.clone(), info), std::future::pending()));
    assert_eq!(
        json(&vnatctl(&socket, &["--json", "ls"])),
        serde_json::json!([])
    );
    shared
        .lock()
        .expect("lock")
        .enable_cgroup(Path::new("/sys/fs/cgroup/unified/x"))
        .expect("fake enable");
    let v = json(&vnatctl(&socket, &["--json", "status"]));
    assert_eq!(
        v["datapath"]["cgroups"][0]["path"],
        "/sys/fs/cgroup/unified/x"
    );
    runtime.shutdown_background();
}
