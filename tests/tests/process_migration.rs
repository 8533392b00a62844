//! The server's process moves to another host: its TCP socket is
//! checkpointed with TCP_REPAIR on the first server (as CRIU does), the
//! connection's vnat state is exported there and imported on the second
//! server, the socket is restored there, and the client's connection
//! carries on (same socket, byte-exact, no reset) although the server side
//! now lives at another address. The first server's link goes down before
//! the checkpoint, standing in for CRIU's network lock (a socket left on the
//! network acknowledges data after its state was read).

mod support;

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    process::{Child, ChildStdout, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_tests::{
    add_location_host, bin_path, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir,
    Vnatd,
};

struct Proc {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl Proc {
    fn spawn(mut cmd: Command) -> Proc {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting vnat-repair");
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        Proc { child, out }
    }

    /// The next JSON line it prints (with a key `key`).
    fn expect(&mut self, key: &str) -> Value {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.out.read_line(&mut line).expect("reading vnat-repair");
            assert!(n > 0, "vnat-repair exited before printing {key:?}");
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                if v.get(key).is_some() {
                    return v;
                }
            }
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn vnatctl(d: &Vnatd, args: &[&str]) -> std::process::Output {
    Command::new(bin_path("vnatctl"))
        .arg("--control")
        .arg(&d.control)
        .args(args)
        .output()
        .expect("running vnatctl")
}

fn wait_mobile(d: &Vnatd, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let ls = d.ctl(&["ls"]).expect("vnatd unreachable");
        if ls
            .as_array()
            .is_some_and(|a| a.iter().any(|r| r["mobile"] == true))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the connection never became mobile: {ls}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn server_process_migrates_to_another_host_with_tcp_repair() {
    let topo = LaptopRouterServer::builder().tag("pmig").build();
    let new_host = add_location_host(&topo, "pmig");
    let lap = Host::new(&topo.laptop, "pmigl");
    let s1 = Host::new(&topo.server, "pmig1");
    let s2 = Host::new(&new_host.ns, "pmig2");
    let (dl, d1, d2) = (
        TempDir::new("pmigl"),
        TempDir::new("pmig1"),
        TempDir::new("pmig2"),
    );
    let lapd = Vnatd::start(&lap, dl.path());
    let s1d = Vnatd::start(&s1, d1.path());
    let s2d = Vnatd::start(&s2, d2.path());

    let server = SocketAddr::new(topo.server_addr.v4.into(), 7100);
    let state = d1.path().join("socket.json");
    let mut serve = s1.command(bin_path("vnat-repair").to_str().unwrap());
    serve.args([
        "serve",
        "--listen",
        &server.to_string(),
        "--state",
        state.to_str().unwrap(),
    ]);
    let mut serve = Proc::spawn(serve);
    serve.expect("ready");

    let mut cmd = StreamOptions::tcp(server)
        .rate(200_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    wait_mobile(&s1d, "first server");
    wait_mobile(&lapd, "client");

    // Checkpoint on the first server: vnat state first, then the socket.
    // The export is sealed for the second server, by its key.
    let key = |d: &Vnatd| -> String {
        d.ctl(&["status"]).expect("vnatd unreachable")["vcmp"]["host_key"]
            .as_str()
            .expect("status shows the host key")
            .to_string()
    };
    let (s1_key, s2_key) = (key(&s1d), key(&s2d));
    let export = d1.path().join("conns.json");
    let out = vnatctl(
        &s1d,
        &[
            "export",
            "--all",
            "--to",
            &s2_key,
            "--output",
            export.to_str().unwrap(),
        ],
    );
    assert!(
        out.status.success(),
        "export failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Lock the network before the socket is dumped, as CRIU does (its
    // "network lock" drops the connection's packets while it checkpoints):
    // a socket still on the network keeps receiving and acknowledging the
    // client's data after its state was read, and the restored copy would
    // then wait forever for bytes the client already saw acknowledged.
    // Here the old host leaves the network for good.
    topo.server.link_down(&topo.server_if);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(serve.child.id() as i32),
        nix::sys::signal::Signal::SIGUSR1,
    )
    .expect("signalling vnat-repair");
    serve.expect("checkpointed");
    let at_checkpoint = client.latest().expect("status").verified;
    // Then the frozen process goes (it is off the network, so no reset can
    // come from it).
    drop(serve);
    drop(s1d);

    // Restore on the second server: vnat state first (it puts the
    // connection's address in place), then the socket.
    // Refused, with nothing changed, when it does not name its sender or
    // was changed on the way; taken when it names the first server.
    let refused = |args: &[&str], why: &str| {
        let out = vnatctl(&s2d, args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            !out.status.success() && err.contains(why),
            "{args:?}: {err}"
        );
    };
    refused(&["import", export.to_str().unwrap()], "import with --from");
    let tampered = d1.path().join("tampered.json");
    let text = std::fs::read_to_string(&export).expect("reading the export");
    std::fs::write(
        &tampered,
        text.replacen("\"send_seq\": ", "\"send_seq\": 1", 1),
    )
    .expect("writing the tampered copy");
    refused(
        &["import", "--from", &s1_key, tampered.to_str().unwrap()],
        "does not match its content",
    );
    // `import --wait` returns once the connection has moved, which needs
    // the restored socket: it runs while the socket is restored, as an
    // operator's script would run it, and reports the move.
    let mut import = Command::new(bin_path("vnatctl"))
        .arg("--control")
        .arg(&s2d.control)
        .args([
            "--json",
            "import",
            "--wait",
            "--timeout",
            "30s",
            "--from",
            &s1_key,
        ])
        .arg(&export)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running vnatctl import --wait");
    // The import itself is done as soon as vnatd has the connection's state:
    // `peers` counts it (`ls` lists sockets, and its socket is not back yet).
    let deadline = Instant::now() + Duration::from_secs(10);
    let tracked = |d: &Vnatd| {
        d.ctl(&["peers"])
            .expect("vnatd unreachable")
            .as_array()
            .is_some_and(|a| a.iter().any(|p| p["connections"].as_u64() >= Some(1)))
    };
    while !tracked(&s2d) {
        if let Ok(Some(st)) = import.try_wait() {
            let out = import.wait_with_output().expect("vnatctl import --wait");
            panic!(
                "import --wait ended before the restore ({st}): {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(
            Instant::now() < deadline,
            "import took no connection within 10 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut restore = s2.command(bin_path("vnat-repair").to_str().unwrap());
    restore.args(["restore", "--state", state.to_str().unwrap()]);
    let mut restored = Proc::spawn(restore);
    restored.expect("ready");
    let out = import.wait_with_output().expect("vnatctl import --wait");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "import --wait --json printed no JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    assert!(out.status.success(), "import --wait failed: {report}");
    let imported = report["imported"].as_array().expect("imported rows");
    assert_eq!(imported.len(), 1, "{report}");
    let moves = report["moves"].as_array().expect("moves");
    assert_eq!(moves.len(), 1, "one imported connection moves: {report}");
    assert_eq!(moves[0]["outcome"], "moved", "{report}");
    assert_eq!(moves[0]["id"], imported[0]["id"], "{report}");

    let after = client.wait_verified_at_least(at_checkpoint + 100_000, Duration::from_secs(30));
    let ls = lapd
        .ctl(&["ls", "--state", "translated"])
        .expect("client vnatd unreachable");
    let new_server = SocketAddr::new(new_host.addr.v4.into(), server.port());
    assert!(
        ls.as_array()
            .unwrap()
            .iter()
            .any(|r| r["virtual_remote"] == server.to_string()
                && r["physical_remote"] == new_server.to_string()),
        "the client does not translate to the new server host: {ls}"
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= after.verified);
    drop(restored);
}
