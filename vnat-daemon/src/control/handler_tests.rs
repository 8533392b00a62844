//! The mobility requests (suspend, resume, peers, export, import) and the
//! `mobile` flag of `list`, against the fake datapath and a scripted driver
//! thread that stands in for the VCMP driver.

use std::{
    collections::HashMap,
    net::SocketAddr,
    path::Path,
    sync::{Arc, Mutex},
    thread::JoinHandle,
};

use serde_json::json;
use tokio::sync::mpsc;

use super::{
    handler::{parse_request, resolve},
    *,
};
use crate::{
    control::PeerInfo,
    datapath::{fake::FakeDatapath, owner::spawn, ConnState, ConnectionInfo, Proto, VirtualFlow},
    vcmp::{export::ConnectionExport, export::HexKey, replay::ReplayWindow, roles::RoleState},
};

fn addr(s: &str) -> SocketAddr {
    s.parse()
        .unwrap_or_else(|e| panic!("test address {s}: {e}"))
}

fn flow(local: &str, remote: &str) -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Tcp,
        local: addr(local),
        remote: addr(remote),
    }
}

fn record(f: VirtualFlow, pid: Option<u32>, cgroup: Option<&str>) -> ConnectionInfo {
    ConnectionInfo {
        id: f.id(),
        proto: f.proto,
        virtual_local: f.local,
        virtual_remote: f.remote,
        physical_local: f.local,
        physical_remote: f.remote,
        state: ConnState::Native,
        cookie: 1,
        cgroup_id: 9,
        cgroup: cgroup.map(str::to_string),
        pid,
        command: None,
        age_secs: 0,
        recorded_ns: 0,
        tcp_isns: None,
        adopted: false,
        hide_location: false,
        udp_inbound_only: false,
        guest: None,
    }
}

/// A mobile connection (pid 42), one whose peer runs no vnatd (pid 42) and
/// one VCMP does not track (pid 7).
fn flows() -> [VirtualFlow; 3] {
    [
        flow("198.18.1.2:40000", "198.18.3.2:5001"),
        flow("198.18.1.2:40001", "198.18.9.9:80"),
        flow("198.18.1.2:40002", "198.18.3.2:22"),
    ]
}

fn datapath() -> FakeDatapath {
    let mut dp = FakeDatapath::new();
    let [a, b, c] = flows();
    dp.add_connection(a, Some(42));
    dp.add_connection(b, Some(42));
    dp.add_connection(c, Some(7));
    dp
}

fn info() -> DaemonInfo {
    DaemonInfo {
        version: "test".into(),
        pid: 1,
        uptime_secs: 0,
        control: "/run/vnat/vnatd.sock".into(),
        state_dir: "/var/lib/vnat".into(),
        listen: addr("0.0.0.0:2031"),
        configured_cgroups: Vec::new(),
    }
}

/// A stand-in for the VCMP driver on its own thread: answers every command
/// from a script and records what it was asked, so tests can check that a
/// refused request never reached it.
struct FakeDriver {
    log: Arc<Mutex<Vec<String>>>,
    thread: Option<JoinHandle<()>>,
}

impl FakeDriver {
    fn start() -> (FakeDriver, mpsc::Sender<Command>) {
        let (tx, mut rx) = mpsc::channel::<Command>(4);
        let log = Arc::new(Mutex::new(Vec::new()));
        let seen = log.clone();
        let thread = std::thread::spawn(move || {
            let [a, b, _] = flows();
            while let Some(cmd) = rx.blocking_recv() {
                let mut seen = seen.lock().expect("log lock");
                match cmd {
                    Command::Mobility { reply } => {
                        seen.push("mobility".into());
                        let m = |mobile: bool| crate::control::Mobility {
                            mobile,
                            seen_by_peer_as: None,
                            why_not: (!mobile).then(|| "pairing with the peer's vnatd".into()),
                            ..Default::default()
                        };
                        // `a` is moving (this host's end), for resume's
                        // `moving`.
                        let moving = crate::control::Mobility {
                            last_move: Some(vnat_control::LastMove {
                                side: vnat_control::Side::Local,
                                from: a.local,
                                to: addr("198.18.2.2:40000"),
                                outcome: None,
                                handover_ms: None,
                                reason: None,
                                started_ms: 1,
                                ended_ms: None,
                            }),
                            ..m(true)
                        };
                        let _ = reply.send(HashMap::from([(a, moving), (b, m(false))]));
                    }
                    Command::Suspend { flows, help, reply } => {
                        seen.push(format!("suspend {} {:?}", flows.len(), help.names()));
                        let helped = if help.is_none() { Vec::new() } else { flows };
                        let _ = reply.send(Ok(helped));
                    }
                    Command::AskHelp {
                        flows,
                        help,
                        wait,
                        reply,
                    } => {
                        seen.push(format!(
                            "ask_help {} {:?} {}ms",
                            flows.len(),
                            help.names(),
                            wait.as_millis()
                        ));
                        // The first peer confirms, the others do not.
                        let confirmed = flows.iter().take(1).copied().collect();
                        let _ = reply.send((flows, confirmed));
                    }
                    Command::Resume { reply } => {
                        seen.push("resume".into());
                        let _ = reply.send(1);
                    }
                    Command::Migrate { moves, reply } => {
                        seen.push(format!("migrate {}", moves.len()));
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
                    Command::Counters { reply } => {
                        seen.push("counters".into());
                        let mut c = crate::control::VcmpCounters::default();
                        c.rejected.insert("bad_mac".into(), 3);
                        let _ = reply.send(c);
                    }
                    Command::Location { reply } => {
                        seen.push("location".into());
                        let _ = reply.send(crate::control::LocationStatus {
                            store: "embedded".into(),
                            ..Default::default()
                        });
                    }
                    Command::Peers { reply } => {
                        seen.push("peers".into());
                        let _ = reply.send(vec![PeerInfo {
                            address: a.remote.ip(),
                            key: Some("ab".repeat(32)),
                            connections: 2,
                            mobile: 1,
                            behind_nat: false,
                            reflexive: None,
                            last_heard_ms: None,
                            addresses: Vec::new(),
                        }]);
                    }
                    Command::Reconfigure { reply, .. } => {
                        seen.push("reconfigure".into());
                        let _ = reply.send(());
                    }
                    Command::ForgetPeer { key, reply } => {
                        seen.push("forget".into());
                        // The fake knows one host, key ab..ab, holding 2.
                        let _ = reply.send((key == [0xab; 32]).then_some(2));
                    }
                    Command::Export { flows, reply, .. } => {
                        seen.push(format!("export {}", flows.len()));
                        let _ = reply.send(Ok(document(&flows)));
                    }
                    Command::Import { state, reply, .. } => {
                        seen.push(format!("import {}", state.connections.len()));
                        let outcomes = state
                            .connections
                            .iter()
                            .map(|c| transfer::ImportOutcome {
                                flow: c.vcmp.flow,
                                physical_local: addr("198.18.2.2:40000"),
                                physical_remote: c.vcmp.remote_phys,
                                moving: true,
                                move_pending: false,
                            })
                            .collect();
                        let _ = reply.send(Ok(outcomes));
                    }
                }
            }
        });
        (
            FakeDriver {
                log,
                thread: Some(thread),
            },
            tx,
        )
    }

    fn log(&self) -> Vec<String> {
        self.log.lock().expect("log lock").clone()
    }
}

impl Drop for FakeDriver {
    fn drop(&mut self) {
        // The thread ends when every sender (the handler's) is gone.
        if let Some(t) = self.thread.take() {
            if !std::thread::panicking() {
                t.join().expect("fake driver thread panicked");
            }
        }
    }
}

/// A connection's export as the driver would make it (keys made up).
pub(super) fn export_of(f: &VirtualFlow) -> ConnectionExport {
    ConnectionExport {
        version: crate::vcmp::export::EXPORT_VERSION,
        flow: *f,
        local_phys: f.local,
        remote_phys: f.remote,
        peer_key: Some("cd".repeat(32)),
        root_key: HexKey("01".repeat(32)),
        send_seq: 5,
        replay: ReplayWindow::default(),
        binding_seq: 1,
        location_seq: 0,
        role: RoleState::default(),
        tcp_isns: None,
        udp_ends: None,
        peer_named: None,
        prev_root_key: None,
        send_prev: false,
        keyx_answer: None,
    }
}

fn document(flows: &[VirtualFlow]) -> ExportDocument {
    ExportDocument {
        vnat_export: EXPORT_FORMAT,
        connections: flows
            .iter()
            .map(|f| ExportedConnection {
                id: f.id(),
                vcmp: export_of(f),
                translation: None,
            })
            .collect(),
        seal: None,
    }
}

fn ok(response: ResponseEnvelope) -> Reply {
    match response.outcome {
        Outcome::Ok(reply) => reply,
        Outcome::Error(e) => panic!("expected success, got {e:?}"),
    }
}

fn err(response: ResponseEnvelope) -> ErrorBody {
    match response.outcome {
        Outcome::Error(e) => e,
        Outcome::Ok(reply) => panic!("expected an error, got {reply:?}"),
    }
}

// ---------------------------------------------------------------- selectors

#[test]
fn selectors_resolve_against_the_records() {
    let [a, b, c] = flows();
    let conns = vec![
        record(a, Some(42), Some("/system.slice/app.service")),
        record(b, Some(42), Some("/system.slice/app.service/worker")),
        record(c, Some(7), Some("/system.slice/application.service")),
    ];
    let ids = |sel: Selector, mount: Option<&Path>| -> Vec<u64> {
        resolve(&sel, &conns, mount)
            .unwrap_or_else(|e| panic!("{sel}: {e}"))
            .iter()
            .map(|c| c.id)
            .collect()
    };
    assert_eq!(ids(Selector::All, None), vec![a.id(), b.id(), c.id()]);
    assert_eq!(
        ids(Selector::Conns(vec![c.id(), a.id()]), None),
        vec![a.id(), c.id()]
    );
    assert_eq!(ids(Selector::Pid(42), None), vec![a.id(), b.id()]);
    // A cgroup selects its own connections and its descendants', by whole
    // path components (app.service does not contain application.service).
    let mount = Path::new("/sys/fs/cgroup");
    assert_eq!(
        ids(
            Selector::Cgroup("/sys/fs/cgroup/system.slice/app.service".into()),
            Some(mount)
        ),
        vec![a.id(), b.id()]
    );
    // The form `vnatctl ls` prints works too.
    assert_eq!(
        ids(
            Selector::Cgroup("/system.slice/app.service/worker".into()),
            Some(mount)
        ),
        vec![b.id()]
    );
    assert_eq!(
        ids(Selector::Cgroup("/sys/fs/cgroup".into()), Some(mount)).len(),
        3,
        "the root cgroup holds everything"
    );
}

#[test]
fn selectors_that_match_nothing_are_errors_naming_the_selector() {
    let [a, _, _] = flows();
    let conns = vec![record(a, Some(42), Some("/app"))];
    let message = |sel: Selector, conns: &[ConnectionInfo]| match resolve(&sel, conns, None) {
        Err(e) => e.to_string(),
        Ok(m) => panic!("{sel} matched {m:?}"),
    };
    assert_eq!(
        message(Selector::Pid(1), &conns),
        "no connection matches pid 1; list the connections with: vnatctl ls"
    );
    assert_eq!(
        message(Selector::Conns(vec![a.id(), 5, 6]), &conns),
        "no connection has id 5, 6; list the connections with: vnatctl ls"
    );
    assert!(message(Selector::Conns(vec![]), &conns).contains("at least one"));
    assert!(message(Selector::Cgroup("/other".into()), &conns).contains("cgroup /other"));
    assert!(message(Selector::Cgroup("rel/dir".into()), &conns).contains("relative"));
    assert!(message(Selector::All, &[]).contains("all connections"));
    // A record without a known cgroup never matches a cgroup selector.
    let unknown = vec![record(a, None, None)];
    assert!(resolve(&Selector::Cgroup("/".into()), &unknown, None).is_err());
}

// ---------------------------------------------------------- with a driver

#[test]
fn list_marks_the_connections_vcmp_can_move() {
    let (driver, tx) = FakeDriver::start();
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info()).with_driver(tx);
    let Reply::Connections { connections } = ok(h.handle(&Request::List)) else {
        panic!("list answered something else")
    };
    let [a, b, c] = flows();
    let mobile: HashMap<u64, bool> = connections.iter().map(|c| (c.info.id, c.mobile)).collect();
    assert_eq!(
        mobile,
        HashMap::from([(a.id(), true), (b.id(), false), (c.id(), false)])
    );
    drop(h);
    assert_eq!(driver.log(), ["mobility"]);
}

#[test]
fn suspend_moves_only_mobile_connections_and_says_why_not_the_others() {
    let (driver, tx) = FakeDriver::start();
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info()).with_driver(tx);
    let [a, b, c] = flows();
    let reply = ok(h.handle(&Request::Suspend {
        selector: Selector::All,
        helpers: Vec::new(),
    }));
    let Reply::Suspended(r) = reply.clone() else {
        panic!("suspend answered {reply:?}")
    };
    assert_eq!(r.suspended, vec![a.id()]);
    let skipped: Vec<u64> = r.skipped.iter().map(|s| s.id).collect();
    assert_eq!(skipped.len(), 2);
    assert!(skipped.contains(&b.id()) && skipped.contains(&c.id()));
    assert!(r.skipped.iter().any(|s| s.reason.contains("no keys")));
    assert!(r.skipped.iter().any(|s| s.reason.contains("not managed")));
    let v = serde_json::to_value(ResponseEnvelope::ok(reply)).expect("serializable");
    assert_eq!(v["ok"]["type"], "suspended");
    assert_eq!(v["ok"]["suspended"], json!([a.id()]));

    // Only non-mobile connections selected: an error, and the driver is
    // not asked to suspend anything.
    let e = err(h.handle(&Request::Suspend {
        selector: Selector::Pid(7),
        helpers: Vec::new(),
    }));
    assert_eq!(e.kind, ErrorKind::Mobility);
    assert!(e.message.contains("can move yet"), "{}", e.message);
    drop(h);
    assert_eq!(driver.log(), ["mobility", "suspend 1 []", "mobility"]);
}

/// `suspend --helper`: the names reach the driver as one request, the
/// reply says whose peers were asked, and a bad name is refused before
/// anything is suspended.
#[test]
fn suspend_with_helpers_asks_the_driver_and_refuses_bad_names() {
    let (driver, tx) = FakeDriver::start();
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info()).with_driver(tx);
    let [a, _, _] = flows();
    let reply = ok(h.handle(&Request::Suspend {
        selector: Selector::All,
        helpers: vec!["zero-window".into(), "stop".into()],
    }));
    let Reply::Suspended(r) = reply else {
        panic!("suspend answered {reply:?}")
    };
    assert_eq!(r.helped, vec![a.id()]);
    for bad in [vec!["../etc/x".to_string()], vec!["a".into(), "b".into()]] {
        let e = err(h.handle(&Request::Suspend {
            selector: Selector::All,
            helpers: bad,
        }));
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{}", e.message);
    }
    drop(h);
    assert_eq!(
        driver.log(),
        ["mobility", "suspend 1 [\"zero-window\", \"stop\"]"]
    );
}

#[test]
fn ask_help_passes_the_helpers_and_the_bounded_wait_and_refuses_bad_names() {
    let (driver, tx) = FakeDriver::start();
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info()).with_driver(tx);
    let reply = ok(h.handle(&Request::AskHelp {
        selector: Selector::Pid(42),
        helpers: vec!["hold".into()],
        wait_ms: 60_000,
    }));
    let Reply::HelpAsked { asked, confirmed } = reply.clone() else {
        panic!("ask_help answered {reply:?}")
    };
    assert_eq!(asked.len(), 2);
    assert_eq!(confirmed, asked[..1]);
    let v = serde_json::to_value(ResponseEnvelope::ok(reply)).expect("serializable");
    assert_eq!(v["ok"]["type"], "help_asked");
    let e = err(h.handle(&Request::AskHelp {
        selector: Selector::All,
        helpers: vec!["Hold".into()],
        wait_ms: 0,
    }));
    assert_eq!(e.kind, ErrorKind::InvalidArgument, "{}", e.message);
    let parsed = parse_request(
        br#"{"version":1,"request":{"type":"ask_help","selector":"all","helpers":["hold"],"wait_ms":500}}"#,
    )
    .expect("parses");
    assert!(matches!(parsed, Request::AskHelp { wait_ms: 500, .. }));
    drop(h);
    // The wait is capped at 2 s whatever the client asks.
    assert_eq!(driver.log(), ["ask_help 2 [\"hold\"] 2000ms"]);
}

#[test]
fn a_bad_selector_changes_nothing_and_never_reaches_the_driver() {
    let (driver, tx) = FakeDriver::start();
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info()).with_driver(tx);
    for request in [
        Request::Suspend {
            selector: Selector::Pid(999),
            helpers: Vec::new(),
        },
        Request::Resume {
            selector: Selector::Conns(vec![1, 2]),
        },
        Request::Export {
            selector: Selector::Cgroup("/nowhere".into()),
            to: None,
        },
    ] {
        let e = err(h.handle(&request));
        assert_eq!(e.kind, ErrorKind::NoMatch, "{request:?}: {}", e.message);
    }
    let e = err(h.handle(&Request::Export {
        selector: Selector::Cgroup("relative".into()),
        to: None,
    }));
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    drop(h);
    assert!(driver.log().is_empty(), "{:?}", driver.log());
}

#[test]
fn resume_peers_export_and_import_go_to_the_driver() {
    let (driver, tx) = FakeDriver::start();
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info()).with_driver(tx);
    let [a, b, _] = flows();

    let reply = ok(h.handle(&Request::Resume {
        selector: Selector::Pid(42),
    }));
    let Reply::Resumed(mut r) = reply else {
        panic!("resume answered {reply:?}")
    };
    r.selected.sort_unstable();
    let mut expected = vec![a.id(), b.id()];
    expected.sort_unstable();
    assert_eq!((r.selected, r.moves_started), (expected, 1));
    // What `--wait` waits for: the selected connection with our move
    // under way.
    assert_eq!(r.moving, vec![a.id()]);

    let v = serde_json::to_value(h.handle(&Request::Peers)).expect("serializable");
    assert_eq!(
        v["ok"],
        json!({ "type": "peers", "peers": [{ "address": "198.18.3.2", "key": "ab".repeat(32), "connections": 2, "mobile": 1, "behind_nat": false, "reflexive": null }] })
    );

    let reply = ok(h.handle(&Request::Export {
        selector: Selector::Conns(vec![a.id()]),
        to: None,
    }));
    let Reply::Exported { state } = reply.clone() else {
        panic!("export answered {reply:?}")
    };
    let v = serde_json::to_value(&state).expect("serializable");
    assert_eq!(v["vnat_export"], 1);
    assert_eq!(v["connections"][0]["id"], a.id());
    assert_eq!(v["connections"][0]["vcmp"]["root_key"], "01".repeat(32));
    assert_eq!(v["connections"][0]["translation"], json!(null));

    // The document goes back in as it came out.
    let reply = ok(h.handle(&Request::Import { state, from: None }));
    let Reply::Imported { connections } = reply else {
        panic!("import answered {reply:?}")
    };
    assert_eq!(connections.len(), 1);
    assert_eq!(connections[0].id, a.id());
    assert!(connections[0].moving);
    assert_eq!(connections[0].physical_local, addr("198.18.2.2:40000"));
    drop(h);
    assert_eq!(
        driver.log(),
        ["resume", "mobility", "peers", "export 1", "import 1"]
    );
}

#[test]
fn a_bad_import_is_refused_before_the_driver() {
    let (driver, tx) = FakeDriver::start();
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info()).with_driver(tx);
    let [a, _, _] = flows();
    let mut wrong_version = document(&[a]);
    wrong_version.vnat_export = 2;
    let mut wrong_id = document(&[a]);
    wrong_id.connections[0].id += 1;
    for (state, needle) in [
        (wrong_version, "format version is 2"),
        (document(&[]), "no connection"),
        (wrong_id, "damaged"),
    ] {
        let e = err(h.handle(&Request::Import { state, from: None }));
        assert_eq!(e.kind, ErrorKind::InvalidArgument);
        assert!(e.message.contains(needle), "{}", e.message);
    }
    drop(h);
    assert!(driver.log().is_empty(), "{:?}", driver.log());
}

#[test]
fn import_request_wire_shape_round_trips() {
    let [a, _, _] = flows();
    let mut state = document(&[a]);
    // A replay window whose bitmap needs all 128 bits: it must survive the
    // trip through a request line.
    for seq in 1..=200 {
        state.connections[0].vcmp.replay.commit(seq);
    }
    let line = serde_json::to_string(&RequestEnvelope {
        version: PROTOCOL_VERSION,
        request: Request::Import {
            state: state.clone(),
            from: None,
        },
    })
    .expect("serializable");
    assert!(
        line.contains(r#""replay":{"bitmap":"ffffffffffffffffffffffffffffffff","highest":200}"#),
        "{line}"
    );
    assert_eq!(
        parse_request(line.as_bytes()).expect("the line parses"),
        Request::Import {
            state: state.clone(),
            from: None,
        }
    );
    // And as an answer, through the client's parser.
    let answer = serde_json::to_string(&ResponseEnvelope::ok(Reply::Exported {
        state: state.clone(),
    }))
    .expect("serializable");
    let back: ResponseEnvelope = serde_json::from_str(&answer).expect("the answer parses");
    assert_eq!(back, ResponseEnvelope::ok(Reply::Exported { state }));
    assert!(
        line.starts_with(r#"{"version":1,"request":{"type":"import","state":{"vnat_export":1,"connections":[{"id":"#),
        "{line}"
    );
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info());
    // Parsed fully (without a driver it then stops at "unavailable").
    let e = err(h.handle_line(line.as_bytes()));
    assert_eq!(e.kind, ErrorKind::Unavailable, "{}", e.message);
    // Unknown keys in the document are refused.
    let tampered = line.replacen(r#""vnat_export":1"#, r#""vnat_export":1,"extra":true"#, 1);
    assert_eq!(
        err(h.handle_line(tampered.as_bytes())).kind,
        ErrorKind::BadRequest
    );
}

// ------------------------------------------------------- without a driver

#[test]
fn without_a_driver_mobility_requests_fail_with_one_sentence_and_list_works() {
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info());
    let [a, _, _] = flows();
    for request in [
        Request::Suspend {
            selector: Selector::All,
            helpers: Vec::new(),
        },
        Request::Resume {
            selector: Selector::Pid(12345),
        },
        Request::Peers,
        Request::Export {
            selector: Selector::All,
            to: None,
        },
        Request::Import {
            state: document(&[a]),
            from: None,
        },
    ] {
        let e = err(h.handle(&request));
        assert_eq!(e.kind, ErrorKind::Unavailable, "{request:?}");
        assert!(
            e.message
                .starts_with("this vnatd runs without its VCMP driver"),
            "{}",
            e.message
        );
    }
    let Reply::Connections { connections } = ok(h.handle(&Request::List)) else {
        panic!("list answered something else")
    };
    assert!(connections.iter().all(|c| !c.mobile));
}

#[test]
fn a_stopped_driver_is_reported_and_list_still_works() {
    let (tx, rx) = mpsc::channel::<Command>(1);
    drop(rx);
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info()).with_driver(tx);
    let e = err(h.handle(&Request::Peers));
    assert_eq!(e.kind, ErrorKind::Unavailable);
    assert!(e.message.contains("has stopped"), "{}", e.message);
    let Reply::Connections { connections } = ok(h.handle(&Request::List)) else {
        panic!("list answered something else")
    };
    assert_eq!(connections.len(), 3);
}

#[test]
fn forget_peer_checks_the_key_before_the_driver_and_reports_what_it_freed() {
    let (driver, tx) = FakeDriver::start();
    let h = Handler::new(spawn(Box::new(datapath())).unwrap(), info()).with_driver(tx);
    let v = serde_json::to_value(h.handle(&Request::ForgetPeer {
        key: "ab".repeat(32),
    }))
    .expect("serializable");
    assert_eq!(v["ok"]["connections"], 2, "{v}");
    let e = err(h.handle(&Request::ForgetPeer {
        key: "cd".repeat(32),
    }));
    assert_eq!(e.kind, ErrorKind::NoMatch);
    assert!(
        e.message.contains("no peer host has the key"),
        "{}",
        e.message
    );
    let e = err(h.handle(&Request::ForgetPeer { key: "ab".into() }));
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert!(e.message.contains("64 hex digits"), "{}", e.message);
    drop(h);
    // The malformed key never reached the driver.
    assert_eq!(driver.log(), vec!["forget", "forget"]);
}
