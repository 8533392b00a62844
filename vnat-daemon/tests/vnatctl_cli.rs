//! The vnatctl binary against an in-process control server backed by the
//! fake datapath: what a user sees of the daemon's answers. Here rather than
//! in vnatctl, which does not depend on the daemon (it builds with stable
//! Rust alone); its tests without a daemon are in `vnatctl/tests/cli.rs`.
//!
//! Cargo builds a package's own binaries for its integration tests, not
//! another package's: `cargo test` of the workspace builds vnatctl beside
//! these tests, `cargo test -p vnat-daemon` alone needs
//! `cargo build -p vnatctl` first (see [`vnatctl_bin`]).

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use serde_json::Value;
use vnat_daemon::{
    control::{Command as DriverCommand, ControlListener, DaemonInfo, Handler},
    datapath::{fake::FakeDatapath, owner, Datapath, Proto, Translation, VirtualFlow},
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
        Daemon::start_with(false)
    }

    /// With a scripted stand-in for the VCMP driver (see [`fake_driver`]).
    fn start_with_driver() -> Daemon {
        Daemon::start_with(true)
    }

    fn start_with(driver: bool) -> Daemon {
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
        // A second link's address, for migrate.
        dp.addresses = vec![
            ("198.18.1.2".parse().expect("addr"), 2),
            ("198.18.2.2".parse().expect("addr"), 3),
        ];
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
        let mut handler = Handler::new(owner::spawn(Box::new(dp)).expect("datapath thread"), info);
        if driver {
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            runtime.spawn(fake_driver(rx));
            handler = handler.with_driver(tx);
        }
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

/// The TCP connection of [`Daemon`]: mobile (its peer runs vnatd); the UDP
/// one is not.
fn tcp_flow() -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Tcp,
        local: "198.18.1.2:40000".parse().expect("addr"),
        remote: "198.18.3.2:5001".parse().expect("addr"),
    }
}

/// Answers the VCMP driver's commands from a script: the TCP connection is
/// mobile, the peer 198.18.3.2 is paired, exports carry a fixed key, imports
/// move to 198.18.2.2.
async fn fake_driver(mut rx: tokio::sync::mpsc::Receiver<DriverCommand>) {
    use vnat_daemon::{
        control::PeerInfo,
        control::{transfer::ImportOutcome, ExportDocument, ExportedConnection},
        vcmp::{export::ConnectionExport, export::HexKey, replay::ReplayWindow, roles::RoleState},
    };
    let tcp = tcp_flow();
    while let Some(cmd) = rx.recv().await {
        match cmd {
            DriverCommand::Mobility { reply } => {
                let m = vnat_daemon::control::Mobility {
                    mobile: true,
                    role: Some("primary".into()),
                    ..Default::default()
                };
                let _ = reply.send(std::collections::HashMap::from([(tcp, m)]));
            }
            DriverCommand::Suspend { flows, help, reply } => {
                let helped = if help.is_none() { Vec::new() } else { flows };
                let _ = reply.send(Ok(helped));
            }
            DriverCommand::AskHelp { flows, reply, .. } => {
                let _ = reply.send((flows.clone(), flows));
            }
            DriverCommand::Resume { reply } => {
                let _ = reply.send(0);
            }
            DriverCommand::Migrate { moves, reply } => {
                // Started, but the fake's datapath never moves anything.
                let out = moves
                    .into_iter()
                    .map(|(f, ip)| {
                        (
                            f,
                            Ok((f.local, std::net::SocketAddr::new(ip, f.local.port()))),
                        )
                    })
                    .collect();
                let _ = reply.send(out);
            }
            DriverCommand::Counters { reply } => {
                let mut c = vnat_daemon::control::VcmpCounters::default();
                c.events.insert("datagrams_received".into(), 5);
                c.rejected.insert("bad_mac".into(), 2);
                let _ = reply.send(c);
            }
            DriverCommand::Location { reply } => {
                let _ = reply.send(vnat_daemon::control::LocationStatus {
                    store: "embedded".into(),
                    description: "embedded (records kept in the state directory, locations.json)"
                        .into(),
                    ..Default::default()
                });
            }
            DriverCommand::Peers { reply } => {
                let _ = reply.send(vec![PeerInfo {
                    address: tcp.remote.ip(),
                    key: Some("ab".repeat(32)),
                    connections: 1,
                    mobile: 1,
                    behind_nat: false,
                    reflexive: None,
                    last_heard_ms: None,
                    addresses: vec![tcp.remote.ip(), "2001:db8:3::2".parse().unwrap()],
                }]);
            }
            DriverCommand::Reconfigure { reply, .. } => {
                let _ = reply.send(());
            }
            DriverCommand::ForgetPeer { key, reply } => {
                let _ = reply.send((key == [0xab; 32]).then_some(1));
            }
            DriverCommand::Export { flows, reply, .. } => {
                let mut replay = ReplayWindow::default();
                replay.commit(3);
                let connections = flows
                    .iter()
                    .map(|f| ExportedConnection {
                        id: f.id(),
                        vcmp: ConnectionExport {
                            version: vnat_daemon::vcmp::export::EXPORT_VERSION,
                            flow: *f,
                            local_phys: f.local,
                            remote_phys: f.remote,
                            peer_key: Some("cd".repeat(32)),
                            root_key: HexKey("01".repeat(32)),
                            send_seq: 5,
                            replay,
                            binding_seq: 1,
                            location_seq: 0,
                            role: RoleState::default(),
                            tcp_isns: None,
                            udp_ends: None,
                            peer_named: None,
                            prev_root_key: None,
                            send_prev: false,
                            keyx_answer: None,
                        },
                        translation: None,
                    })
                    .collect();
                let _ = reply.send(Ok(ExportDocument {
                    vnat_export: 1,
                    connections,
                    seal: None,
                }));
            }
            DriverCommand::Import { state, reply, .. } => {
                let outcomes = state
                    .connections
                    .iter()
                    .map(|c| ImportOutcome {
                        flow: c.vcmp.flow,
                        physical_local: "198.18.2.2:40000".parse().expect("addr"),
                        physical_remote: c.vcmp.remote_phys,
                        moving: true,
                        move_pending: false,
                    })
                    .collect();
                let _ = reply.send(Ok(outcomes));
            }
        }
    }
}

/// vnatctl of this workspace, from the target directory and profile these
/// tests were built in (`VNAT_BIN_DIR` overrides the directory).
fn vnatctl_bin() -> PathBuf {
    let dir = match std::env::var_os("VNAT_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe = std::env::current_exe().expect("the path of this test executable");
            // target/<profile>/deps/vnatctl-<hash> -> target/<profile>
            let deps = exe.parent().expect("the test executable's directory");
            deps.parent().unwrap_or(deps).to_path_buf()
        }
    };
    let path = dir.join("vnatctl");
    assert!(
        path.is_file(),
        "{} does not exist: build it first (cargo build -p vnatctl, same profile), or point VNAT_BIN_DIR at the directory that holds it",
        path.display()
    );
    path
}

fn vnatctl(control: &Path, args: &[&str]) -> Output {
    Command::new(vnatctl_bin())
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
            "ROLE",
            "PID",
            "COMMAND",
            "CGROUP",
            "LAST-MOVE",
            "NOTE"
        ]
    );
    // No VCMP driver in this server: nothing can move, and NOTE says why.
    assert!(
        lines[1..]
            .iter()
            .all(|l| l.split_whitespace().nth(7) == Some("no")
                && l.ends_with("vnatd runs without VCMP")),
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
    assert_eq!(rows[0]["why_not_mobile"], "vnatd runs without VCMP");
    assert_eq!(rows[0]["behind_nat"], false);

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
    // No VCMP driver here: no location section.
    assert!(!out.contains("locations"), "{out}");

    // A relative path is sent as an absolute one.
    let cg = d.cgroup_dir.display().to_string();
    let parent = d.cgroup_dir.parent().expect("parent");
    let o = Command::new(vnatctl_bin())
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
        serde_json::json!({ "cgroup": cg, "enabled": true, "hide_location": false })
    );

    // Hide location on, shown by status, left on by a plain enable, off
    // with --no-hide-location; both flags at once are a usage error.
    let o = vnatctl(&d.socket, &["enable", "--cgroup", &cg, "--hide-location"]);
    assert_eq!(o.status.code(), Some(0), "stderr: {}", stderr(&o));
    assert!(stdout(&o).contains("(hide location)"), "{}", stdout(&o));
    let v = json(&vnatctl(&d.socket, &["--json", "status"]));
    assert_eq!(v["datapath"]["cgroups"][0]["hide_location"], true, "{v}");
    let o = vnatctl(&d.socket, &["--json", "enable", "--cgroup", &cg]);
    assert_eq!(json(&o)["hide_location"], true);
    let o = vnatctl(
        &d.socket,
        &["--json", "enable", "--cgroup", &cg, "--no-hide-location"],
    );
    assert_eq!(json(&o)["hide_location"], false);
    let o = vnatctl(
        &d.socket,
        &[
            "enable",
            "--cgroup",
            &cg,
            "--hide-location",
            "--no-hide-location",
        ],
    );
    assert_eq!(o.status.code(), Some(2), "stderr: {}", stderr(&o));

    let o = vnatctl(&d.socket, &["--json", "status"]);
    let v = json(&o);
    assert_eq!(v["datapath"]["cgroups"][0]["path"], cg.as_str(), "{v}");
    assert_eq!(v["datapath"]["cgroups"][0]["hide_location"], false, "{v}");
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
fn changes_by_other_holders_of_the_datapath_show_in_the_next_call() {
    // The datapath has one owner that runs everybody's commands: a change
    // made through another handle (the VCMP driver's) is visible to the
    // next vnatctl call.
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("vnatd.sock");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let shared = owner::spawn(Box::new(FakeDatapath::new())).expect("datapath thread");
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
        .run_blocking(|dp| dp.enable_cgroup(Path::new("/sys/fs/cgroup/unified/x")))
        .expect("datapath owner")
        .expect("fake enable");
    let v = json(&vnatctl(&socket, &["--json", "status"]));
    assert_eq!(
        v["datapath"]["cgroups"][0]["path"],
        "/sys/fs/cgroup/unified/x"
    );
    runtime.shutdown_background();
}

#[test]
fn mobility_commands_without_vcmp_fail_with_one_sentence() {
    // This in-process server has the datapath only, no VCMP driver.
    let d = Daemon::start();
    let export = d.cgroup_dir.with_file_name("export.json");
    std::fs::write(&export, br#"{"vnat_export":1,"connections":[]}"#).expect("write export");
    let export = export.display().to_string();
    for args in [
        vec!["suspend", "--all"],
        vec!["resume", "--conn", "1", "2"],
        vec!["peers"],
        vec!["export", "--pid", "42"],
    ] {
        let o = vnatctl(&d.socket, &args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.starts_with("vnatctl: this vnatd runs without its VCMP driver")
                && err.trim_end().lines().count() == 1,
            "{args:?}: {err}"
        );
        assert!(
            o.stdout.is_empty(),
            "{args:?}: nothing on stdout without --json"
        );
        let mut json_args = vec!["--json"];
        json_args.extend(&args);
        let o = vnatctl(&d.socket, &json_args);
        assert_eq!(o.status.code(), Some(1));
        assert_eq!(json(&o)["error"]["kind"], "unavailable", "{args:?}");
    }
    // An empty export is refused by vnatd before VCMP is involved.
    let o = vnatctl(&d.socket, &["--json", "import", &export]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(json(&o)["error"]["kind"], "invalid_argument");
    // ls still works, and shows nothing as mobile.
    let o = vnatctl(&d.socket, &["--json", "ls"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(json(&o)
        .as_array()
        .is_some_and(|rows| rows.iter().all(|r| r["mobile"] == false)));
}

#[test]
fn planned_mode_commands_with_vcmp() {
    let d = Daemon::start_with_driver();
    let id = tcp_flow().id().to_string();

    // status: where locations are kept, from the driver.
    let o = vnatctl(&d.socket, &["status"]);
    assert!(
        stdout(&o).contains("locations    embedded (records kept in the state directory"),
        "{}",
        stdout(&o)
    );
    let v = json(&vnatctl(&d.socket, &["--json", "status"]));
    assert_eq!(v["location"]["store"], "embedded", "{v}");

    // ls: the TCP connection is mobile, the UDP one is not.
    let o = vnatctl(&d.socket, &["ls"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    let mobile: Vec<&str> = out
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().nth(7))
        .collect();
    assert_eq!(mobile, ["yes", "no"], "{out}");

    // suspend: the UDP connection is skipped with its reason.
    let o = vnatctl(&d.socket, &["--json", "suspend", "--all"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["suspended"], serde_json::json!([tcp_flow().id()]), "{v}");
    assert_eq!(v["skipped"].as_array().map(Vec::len), Some(1), "{v}");
    let o = vnatctl(&d.socket, &["suspend", "--pid", "42"]);
    assert!(
        stdout(&o).starts_with("suspended 1 connection(s)"),
        "{}",
        stdout(&o)
    );
    // Only the non-mobile connection: refused with the reason.
    let udp_id = json(&vnatctl(&d.socket, &["--json", "ls", "--proto", "udp"]))[0]["id"]
        .as_u64()
        .expect("udp id")
        .to_string();
    let o = vnatctl(&d.socket, &["--json", "suspend", "--conn", &udp_id]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert_eq!(json(&o)["error"]["kind"], "mobility");
    // A selector that matches nothing.
    let o = vnatctl(&d.socket, &["--json", "resume", "--conn", "12345"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(json(&o)["error"]["kind"], "no_match");
    assert_eq!(
        stderr(&o).trim_end(),
        "vnatctl: no connection has id 12345; list the connections with: vnatctl ls"
    );

    // resume after automatic mode already moved everything: harmless.
    let o = vnatctl(&d.socket, &["resume", "--all"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("nothing to move"), "{}", stdout(&o));
    let v = json(&vnatctl(&d.socket, &["--json", "resume", "--conn", &id]));
    assert_eq!(
        v,
        serde_json::json!({ "selected": [tcp_flow().id()], "moves_started": 0 })
    );

    // ls shows the role the suspension settled.
    let v = json(&vnatctl(&d.socket, &["--json", "ls", "--proto", "tcp"]));
    assert_eq!(v[0]["role"], "primary", "{v}");
    assert_eq!(v[0]["moving"], false, "{v}");

    // migrate: started; with --wait, a move that did not happen is
    // reported as such, with exit status 1 (this fake never moves).
    let o = vnatctl(&d.socket, &["migrate", "--conn", &id, "--to", "198.18.2.2"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with(&format!(
            "connection {id}: moving from 198.18.1.2:40000 to 198.18.2.2:40000"
        )),
        "{}",
        stdout(&o)
    );
    let o = vnatctl(
        &d.socket,
        &[
            "--json",
            "migrate",
            "--all",
            "--to",
            "198.18.2.2",
            "--wait",
            "--timeout",
            "2",
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v["moves"][0]["outcome"], "not_moved", "{v}");
    assert_eq!(v["moves"][0]["physical_local"], "198.18.1.2:40000", "{v}");
    assert_eq!(
        v["skipped"].as_array().map(Vec::len),
        Some(1),
        "the UDP one: {v}"
    );
    assert!(stderr(&o).contains("did not move"), "{}", stderr(&o));
    // Not an address of this host; no such interface; neither given.
    let o = vnatctl(
        &d.socket,
        &["--json", "migrate", "--all", "--to", "192.0.2.1"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        json(&o)["error"]["kind"],
        "invalid_argument",
        "{}",
        stdout(&o)
    );
    let o = vnatctl(&d.socket, &["migrate", "--all", "--dev", "nosuch0"]);
    assert!(
        stderr(&o).contains("no interface \"nosuch0\""),
        "{}",
        stderr(&o)
    );
    let o = vnatctl(&d.socket, &["migrate", "--all"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));

    // peers: table and JSON.
    let o = vnatctl(&d.socket, &["peers"]);
    let out = stdout(&o);
    let lines: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        lines[0],
        ["ADDRESS", "KEY", "CONNECTIONS", "MOBILE", "NAT", "HEARD"],
        "{out}"
    );
    assert_eq!(
        lines[1],
        ["198.18.3.2", "ab".repeat(32).as_str(), "1", "1", "no", "-"],
        "{out}"
    );
    let v = json(&vnatctl(&d.socket, &["--json", "peers"]));
    assert_eq!(
        v,
        serde_json::json!([{ "address": "198.18.3.2", "key": "ab".repeat(32), "connections": 1, "mobile": 1, "behind_nat": false, "reflexive": null, "last_heard_ms": null, "last_heard_secs": null, "addresses": ["198.18.3.2", "2001:db8:3::2"] }])
    );

    // peers forget: the key goes; an unknown or malformed key is an error.
    let v = json(&vnatctl(
        &d.socket,
        &["--json", "peers", "forget", &"ab".repeat(32)],
    ));
    assert_eq!(
        v,
        serde_json::json!({ "forgotten": "ab".repeat(32), "connections": 1 })
    );
    let o = vnatctl(&d.socket, &["peers", "forget", &"cd".repeat(32)]);
    assert_ne!(o.status.code(), Some(0));
    assert!(
        stderr(&o).contains("no peer host has the key"),
        "{}",
        stderr(&o)
    );
    let o = vnatctl(&d.socket, &["peers", "forget", "abc"]);
    assert_ne!(o.status.code(), Some(0));
    assert!(stderr(&o).contains("64 hex digits"), "{}", stderr(&o));

    // export to a new 0600 file, then import it.
    let file = d.cgroup_dir.with_file_name("conns.json");
    let path = file.display().to_string();
    let o = vnatctl(
        &d.socket,
        &["--json", "export", "--conn", &id, "--output", &path],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        json(&o),
        serde_json::json!({ "output": path, "exported": [tcp_flow().id()] })
    );
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&file)
        .expect("export written")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the export holds keys");
    let doc: Value = serde_json::from_slice(&std::fs::read(&file).expect("read")).expect("JSON");
    assert_eq!(doc["vnat_export"], 1);
    assert_eq!(doc["connections"][0]["id"], tcp_flow().id());
    assert_eq!(doc["connections"][0]["vcmp"]["root_key"], "01".repeat(32));
    // Without --output the document goes to stdout, --json or not.
    let o = vnatctl(&d.socket, &["export", "--pid", "42"]);
    assert_eq!(json(&o)["vnat_export"], 1);

    let o = vnatctl(&d.socket, &["import", &path]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.starts_with("imported 1 connection(s)")
            && out.contains("moving to 198.18.2.2:40000, the peer is being updated"),
        "{out}"
    );
    // From stdin, as JSON.
    let mut child = Command::new(vnatctl_bin())
        .args([
            "--control",
            &d.socket.display().to_string(),
            "--json",
            "import",
            "-",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(&std::fs::read(&file).expect("read"))
            .expect("write stdin");
    }
    let o = child.wait_with_output().expect("wait");
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v = json(&o);
    assert_eq!(v[0]["id"], tcp_flow().id(), "{v}");
    assert_eq!(v[0]["physical_local"], "198.18.2.2:40000");
    assert_eq!(v[0]["moving"], true);
}
