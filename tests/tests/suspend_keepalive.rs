//! The keepalive hold (issue 18, item 3 in part): a client whose TCP
//! keepalive gives up after 5 s idle and three unanswered probes 1 s apart
//! is suspended (`vnatctl suspend --all`) and the laptop is offline for
//! 60 s. As vnatd does at logind's wake signal, `vnatctl resume --all` comes
//! at wake, 15 s before the network is back (on another subnet): the
//! keepalive stays held until the connection works again, and then it
//! echoes. A second client, identical but in a cgroup vnat does not manage,
//! is cut by its own keepalive during the same outage, which is what the
//! first one's would have done without the hold.

mod support;

use std::{
    io::{BufRead, BufReader, Write},
    net::SocketAddr,
    process::{Child, ChildStdout, Stdio},
    time::{Duration, Instant},
};

use vnat_tests::{EchoServer, Host, LaptopRouterServer, Netns, TempDir, Vnatd};

/// Offline before `resume`, and after it until the network is back.
const BEFORE_RESUME: Duration = Duration::from_secs(45);
const AFTER_RESUME: Duration = Duration::from_secs(15);

/// An idle line client with keepalive at 5 s idle, 1 s interval, 3 probes.
struct IdleClient {
    child: Child,
    out: Option<BufReader<ChildStdout>>,
}

impl IdleClient {
    fn start(ns: &Netns, server: SocketAddr, cgroup: Option<&vnat_tests::Cgroup>) -> IdleClient {
        let mut cmd = ns.cmd("socat");
        cmd.args([
            "-".to_string(),
            format!("TCP:{server},keepalive,keepidle=5,keepintvl=1,keepcnt=3"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
        if let Some(c) = cgroup {
            c.join_on_spawn(&mut cmd);
        }
        let mut child = cmd.spawn().expect("starting socat");
        let out = Some(BufReader::new(child.stdout.take().expect("stdout")));
        IdleClient { child, out }
    }

    /// Send `line` and read its echo; false if the connection is gone.
    fn echo(&mut self, line: &str) -> bool {
        let Some(stdin) = self.child.stdin.as_mut() else {
            return false;
        };
        if stdin
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|()| stdin.flush())
            .is_err()
        {
            return false;
        }
        // Read in a thread, so that a connection that never answers fails
        // the test instead of hanging it.
        let Some(mut out) = self.out.take() else {
            return false;
        };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut got = String::new();
            let n = out.read_line(&mut got);
            let _ = tx.send((out, n.map(|n| (n, got))));
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok((out, Ok((n, got)))) => {
                self.out = Some(out);
                n > 0 && got.trim_end() == line
            }
            _ => false,
        }
    }

    fn exited(&mut self) -> bool {
        self.child.try_wait().ok().flatten().is_some()
    }
}

impl Drop for IdleClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_suspended_clients_keepalive_does_not_kill_it_during_a_minute_offline() {
    let topo = LaptopRouterServer::builder().tag("kah").build();
    let lap = Host::new(&topo.laptop, "kahl");
    let srv = Host::new(&topo.server, "kahs");
    let (dl, ds) = (TempDir::new("kahl"), TempDir::new("kahs"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, dl.path());
    let _srvd = Vnatd::start(&srv, ds.path());

    let mut held = IdleClient::start(&topo.laptop, server, Some(&lap.cgroup));
    let mut control = IdleClient::start(&topo.laptop, server, None);
    assert!(held.echo("hello"), "the managed client does not echo");
    assert!(control.echo("hello"), "the control client does not echo");
    let deadline = Instant::now() + Duration::from_secs(15);
    while !lapd.mobile_to("tcp", server.ip()) {
        assert!(
            Instant::now() < deadline,
            "the connection never became mobile"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    lapd.ctl(&["suspend", "--all"]).expect("suspend answers");
    // (held, listed) among the laptop's connections to the server.
    let held_rows = |d: &Vnatd| {
        let ls = d
            .ctl(&["ls", "--proto", "tcp"])
            .expect("ls lists the connection");
        let rows: Vec<&serde_json::Value> = ls
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|r| r["virtual_remote"] == server.to_string())
                    .collect()
            })
            .unwrap_or_default();
        (
            rows.iter().filter(|r| r["keepalive_held"] == true).count(),
            rows.len(),
        )
    };
    assert_eq!(
        held_rows(&lapd),
        (1, 1),
        "ls does not show the held keepalive"
    );
    for (a, p) in topo.laptop_a_addr.with_prefixes() {
        topo.laptop.del_addr(&topo.laptop_if_a, a, p);
    }
    topo.laptop.link_down(&topo.laptop_if_a);
    std::thread::sleep(BEFORE_RESUME);
    // The unmanaged one's keepalive gave up (about 8 s in): the outage was
    // long enough to kill a connection with these settings.
    assert!(
        control.exited(),
        "the control client survived the outage: the test shows nothing"
    );
    assert!(
        !held.exited(),
        "the suspended client died during the outage"
    );

    // Resumed at wake (as vnatd does for logind), the network not back yet:
    // still held, and alive after longer than its keepalive allows.
    lapd.ctl(&["resume", "--all"]).expect("resume answers");
    std::thread::sleep(AFTER_RESUME);
    assert!(
        !held.exited(),
        "the client died between resume and the network's return"
    );
    assert_eq!(
        held_rows(&lapd),
        (1, 1),
        "the hold ended before the connection worked again"
    );
    topo.plug_laptop_b();
    topo.laptop
        .default_route(topo.router_b_addr.v4.into(), &topo.laptop_if_b);
    assert!(
        held.echo("again"),
        "the suspended client's connection does not echo after the move"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while held_rows(&lapd) != (0, 1) {
        assert!(
            Instant::now() < deadline,
            "ls still shows a held keepalive once the connection works: {:?}",
            held_rows(&lapd)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // Its keepalive is on again: the hold ends with the suspension (the
    // timer shows once the connection is idle).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let ss = topo
            .laptop
            .run_stdout(&["ss", "-tno", "state", "established"]);
        if ss
            .lines()
            .any(|l| l.contains(&server.to_string()) && l.contains("keepalive"))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no keepalive timer on the resumed connection: {ss}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
