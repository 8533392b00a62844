//! What must last across a restart of vnatd (issue 32, item 4):
//!
//! - a connection an operator placed with `vnatctl migrate` stays where it
//!   was put when vnatd restarts, and `vnatctl ls` says it was placed;
//! - what vnatd changed on applications' sockets to carry them across an
//!   outage (the suspend's keepalive hold on the laptop, the zero-window
//!   helper's TCP_USER_TIMEOUT on the server) is given back by the next
//!   vnatd when the one that made the change was killed (SIGKILL): the
//!   applications themselves report their sockets' settings.

mod support;

use std::{
    io::{BufRead, BufReader},
    net::{IpAddr, SocketAddr},
    process::{Child, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

/// Metric of the laptop's second default route, via B (A's is preferred).
const B_METRIC: u32 = 2000;

/// How long the restarted vnatd is watched for a move back to A: automatic
/// mode looks at the connections as soon as it starts, and again at every
/// address change; a few of its turns.
const WATCH: Duration = Duration::from_secs(5);

fn stream(lap: &Host, to: SocketAddr) -> StreamClient {
    let mut cmd = StreamOptions::tcp(to).rate(200_000).command(lap.ns);
    lap.cgroup.join_on_spawn(&mut cmd);
    StreamClient::from_command(cmd)
}

/// The `ls` row of the connection to `server`, once vnatd lists it as
/// mobile.
fn mobile_row(d: &Vnatd, server: SocketAddr) -> Value {
    d.wait_ls_row(
        &["ls", "--proto", "tcp"],
        &format!("the connection to {server} never became mobile"),
        |r| r["virtual_remote"] == server.to_string() && r["mobile"] == true,
    )
}

fn local_ip(row: &Value) -> Option<IpAddr> {
    row["physical_local"]
        .as_str()
        .and_then(|s| s.parse::<SocketAddr>().ok())
        .map(|a| a.ip())
}

#[test]
fn a_migrated_connection_stays_where_it_was_put_across_a_restart_of_vnatd() {
    let tag = "rsp";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    topo.plug_laptop_b();
    topo.laptop
        .add_default_route_metric(topo.router_b_addr.v4.into(), &topo.laptop_if_b, B_METRIC);
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let (a, b): (IpAddr, IpAddr) = (topo.laptop_a_addr.v4.into(), topo.laptop_b_addr.v4.into());
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, dl.path());
    let srvd = Vnatd::start(&srv, ds.path());
    let client = stream(&lap, server);
    client.wait_verified_at_least(50_000, Duration::from_secs(15));
    let row = mobile_row(&lapd, server);
    assert_eq!(local_ip(&row), Some(a), "{row}");
    let id = row["id"].to_string();

    let out = lapd
        .ctl(&["migrate", "--conn", &id, "--to", &b.to_string(), "--wait"])
        .expect("vnatd answers");
    assert_eq!(out["moves"][0]["outcome"], "moved", "migrate --wait: {out}");
    let row = mobile_row(&lapd, server);
    assert_eq!(local_ip(&row), Some(b), "{row}");
    assert_eq!(
        row["placed"],
        b.to_string(),
        "ls does not say the connection was placed at {b}: {row}"
    );

    // A planned restart (an upgrade): A is still up and preferred, which
    // is where automatic mode would take an unplaced connection.
    lapd.stop();
    let lapd = Vnatd::start(&lap, dl.path());
    let deadline = Instant::now() + WATCH;
    while Instant::now() < deadline {
        let row = mobile_row(&lapd, server);
        assert_eq!(
            local_ip(&row),
            Some(b),
            "the restarted vnatd moved the placed connection away from {b}: {row}"
        );
        assert_eq!(
            row["placed"],
            b.to_string(),
            "the restarted vnatd forgot the placement: {row}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let (to_b, ls) = srvd.sending_to(b);
    assert_eq!(to_b, 1, "the server no longer sends to {b}: {ls}");
    let text = lap
        .ns
        .cmd(vnat_tests::bin_path("vnatctl"))
        .arg("--control")
        .arg(&lapd.control)
        .arg("ls")
        .output()
        .expect("vnatctl ls");
    let text = String::from_utf8_lossy(&text.stdout).to_string();
    assert!(
        text.contains(&format!("placed at {b} by migrate")),
        "the ls table does not say the connection is placed: {text}"
    );

    let at = client.latest().expect("status").verified;
    client.wait_verified_at_least(at + 100_000, Duration::from_secs(15));
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
}

/// A TCP end that sets its own socket options and prints them every 200 ms
/// ("ka=0|1 uto=MS"), idle otherwise: the server sets TCP_USER_TIMEOUT to
/// [`APP_USER_TIMEOUT_MS`] on the connection it accepts; both ends turn
/// keepalive on.
const SOCKOPTS_PY: &str = r#"
import socket, sys, time
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
fam = socket.AF_INET6 if ":" in host else socket.AF_INET
if mode == "server":
    l = socket.socket(fam, socket.SOCK_STREAM)
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind((host, port))
    l.listen(1)
    print("listening", flush=True)
    s, _ = l.accept()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(sys.argv[4]))
else:
    s = socket.create_connection((host, port))
s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 60)
while True:
    ka = s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    uto = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
    print(f"ka={ka} uto={uto}", flush=True)
    time.sleep(0.2)
"#;

/// The TCP_USER_TIMEOUT the server application sets on its connection.
const APP_USER_TIMEOUT_MS: u32 = 7000;

/// One end running [`SOCKOPTS_PY`], and the last line it printed.
struct SockOpts {
    child: Child,
    last: Arc<Mutex<String>>,
}

impl SockOpts {
    fn start(host: &Host, script: &std::path::Path, args: &[String]) -> SockOpts {
        let mut cmd = host.ns.cmd("/usr/bin/python3");
        cmd.arg(script)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        host.cgroup.join_on_spawn(&mut cmd);
        let mut child = cmd.spawn().expect("starting python3");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        let last = Arc::new(Mutex::new(String::new()));
        let l = last.clone();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                *l.lock().unwrap() = line;
            }
        });
        SockOpts { child, last }
    }

    fn last(&self) -> String {
        self.last.lock().unwrap().clone()
    }

    /// Wait (at most `within`) until the last line is `want`.
    fn wait_for(&self, want: &str, within: Duration, what: &str) {
        let deadline = Instant::now() + within;
        while self.last() != want {
            assert!(
                Instant::now() < deadline,
                "{what}: the application reports {:?}, not {want:?}",
                self.last()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for SockOpts {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn what_a_killed_vnatd_changed_on_sockets_the_next_one_gives_back() {
    let tag = "rsh";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let script = dl.path().join("sockopts.py");
    std::fs::write(&script, SOCKOPTS_PY).expect("writing the script");
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let (ip, port) = (server.ip().to_string(), server.port().to_string());
    let app = |mode: &str| vec![mode.to_string(), ip.clone(), port.clone()];
    let mut srv_args = app("server");
    srv_args.push(APP_USER_TIMEOUT_MS.to_string());
    let lapd = Vnatd::start(&lap, dl.path());
    let srvd = Vnatd::start(&srv, ds.path());
    let server_app = SockOpts::start(&srv, &script, &srv_args);
    server_app.wait_for("listening", Duration::from_secs(10), "server");
    let client_app = SockOpts::start(&lap, &script, &app("client"));
    let own = format!("ka=1 uto={APP_USER_TIMEOUT_MS}");
    server_app.wait_for(&own, Duration::from_secs(10), "server");
    client_app.wait_for("ka=1 uto=0", Duration::from_secs(10), "client");
    lapd.wait_mobile_to("tcp", server.ip());
    srvd.wait_mobile_to("tcp", topo.laptop_a_addr.v4.into());

    // Suspended with the zero-window helper: the laptop's vnatd turns the
    // client's keepalive off and holds its timeout (its own data may wait
    // through the outage), the server's holds the server's timeout.
    lapd.ctl(&["suspend", "--all", "--helper", "zero-window"])
        .expect("suspend answers");
    let hold_ms = 24 * 3600 * 1000;
    let client_held = format!("ka=0 uto={hold_ms}");
    client_app.wait_for(&client_held, Duration::from_secs(5), "client, held");
    let held = format!("ka=1 uto={hold_ms}");
    server_app.wait_for(&held, Duration::from_secs(5), "server, helped");

    // Both vnatds die without undoing anything; new ones start.
    lapd.kill9();
    srvd.kill9();
    assert_eq!(
        client_app.last(),
        client_held,
        "nothing else undoes the hold"
    );
    let _lapd = Vnatd::start(&lap, dl.path());
    client_app.wait_for(
        "ka=1 uto=0",
        Duration::from_secs(5),
        "the client's keepalive and timeout after vnatd restarted",
    );
    let _srvd = Vnatd::start(&srv, ds.path());
    server_app.wait_for(
        &own,
        Duration::from_secs(5),
        "the server's user timeout after vnatd restarted",
    );
}

/// Whether process `pid` is stopped (state T in /proc/PID/stat).
fn stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // "pid (comm) S ...": the state follows the command's closing paren.
    let state = stat
        .rsplit_once(')')
        .map(|(_, r)| r.trim_start().chars().next());
    state == Some(Some('T'))
}

/// The stop helper: the server's vnatd stops the server application while
/// the laptop is away; killed, it cannot let it go on. The next one does.
#[test]
fn a_process_a_killed_vnatd_stopped_for_a_peer_runs_again_with_the_next() {
    let tag = "rsc";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let script = dl.path().join("sockopts.py");
    std::fs::write(&script, SOCKOPTS_PY).expect("writing the script");
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let (ip, port) = (server.ip().to_string(), server.port().to_string());
    let srv_args = vec![
        "server".to_string(),
        ip.clone(),
        port.clone(),
        APP_USER_TIMEOUT_MS.to_string(),
    ];
    let helpers = ["--peer-helper", "zero-window", "--peer-helper", "stop"];
    let lapd = Vnatd::start(&lap, dl.path());
    let srvd = Vnatd::start_with(&srv, ds.path(), &helpers);
    let server_app = SockOpts::start(&srv, &script, &srv_args);
    server_app.wait_for("listening", Duration::from_secs(10), "server");
    let _client_app = SockOpts::start(&lap, &script, &["client".into(), ip, port]);
    let own = format!("ka=1 uto={APP_USER_TIMEOUT_MS}");
    server_app.wait_for(&own, Duration::from_secs(10), "server");
    lapd.wait_mobile_to("tcp", server.ip());
    srvd.wait_mobile_to("tcp", topo.laptop_a_addr.v4.into());
    let pid = server_app.child.id();

    lapd.ctl(&["suspend", "--all", "--helper", "stop"])
        .expect("suspend answers");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !stopped(pid) {
        assert!(
            Instant::now() < deadline,
            "the server's vnatd did not stop the server application"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    srvd.kill9();
    std::thread::sleep(Duration::from_millis(500));
    assert!(stopped(pid), "nothing but vnatd lets the application go on");
    let _srvd = Vnatd::start_with(&srv, ds.path(), &helpers);
    let deadline = Instant::now() + Duration::from_secs(5);
    while stopped(pid) {
        assert!(
            Instant::now() < deadline,
            "the server application is still stopped after vnatd restarted"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // It runs: it reports its socket again.
    *server_app.last.lock().unwrap() = String::new();
    server_app.wait_for(&own, Duration::from_secs(5), "the server after it went on");
}

/// No vnatd started again, but `vnatd --cleanup` (what the package's purge
/// runs): it gives back what the killed vnatd changed on sockets too.
#[test]
fn vnatd_cleanup_after_a_crash_gives_the_sockets_back() {
    let tag = "rsx";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let script = dl.path().join("sockopts.py");
    std::fs::write(&script, SOCKOPTS_PY).expect("writing the script");
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let (ip, port) = (server.ip().to_string(), server.port().to_string());
    let srv_args = vec![
        "server".to_string(),
        ip.clone(),
        port.clone(),
        APP_USER_TIMEOUT_MS.to_string(),
    ];
    let lapd = Vnatd::start(&lap, dl.path());
    let _srvd = Vnatd::start(&srv, ds.path());
    let server_app = SockOpts::start(&srv, &script, &srv_args);
    server_app.wait_for("listening", Duration::from_secs(10), "server");
    let client_app = SockOpts::start(&lap, &script, &["client".into(), ip, port]);
    client_app.wait_for("ka=1 uto=0", Duration::from_secs(10), "client");
    lapd.wait_mobile_to("tcp", server.ip());

    lapd.ctl(&["suspend", "--all"]).expect("suspend answers");
    let held = format!("ka=0 uto={}", 24 * 3600 * 1000);
    client_app.wait_for(&held, Duration::from_secs(5), "client, held");
    lapd.kill9();
    let out = lap
        .ns
        .cmd(vnat_tests::bin_path("vnatd"))
        .args(["--config", "/dev/null", "--cleanup", "--control"])
        .arg(dl.path().join("vnatd.sock"))
        .arg("--state-dir")
        .arg(dl.path().join("state"))
        .arg("--bpffs")
        .arg(lap.pins.path())
        .output()
        .expect("running vnatd --cleanup");
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "vnatd --cleanup failed: {said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    client_app.wait_for(
        "ka=1 uto=0",
        Duration::from_secs(5),
        &format!("the client after vnatd --cleanup, which said: {said}"),
    );
    assert!(
        said.contains("keepalive"),
        "vnatd --cleanup does not say what it gave back: {said}"
    );
}
