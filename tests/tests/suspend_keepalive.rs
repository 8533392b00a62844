//! The keepalive hold (issue 18, item 3 in part): a client whose TCP
//! keepalive gives up after 5 s idle and three unanswered probes 1 s apart
//! is suspended (`vnatctl suspend --all`), the laptop is offline for 60 s,
//! wakes up on another subnet and resumes: the connection echoes again. A
//! second client, identical but in a cgroup vnat does not manage, is cut by
//! its own keepalive during the same outage, which is what the first one's
//! would have done without the hold.

mod support;

use std::{
    io::{BufRead, BufReader, Write},
    net::SocketAddr,
    process::{Child, ChildStdout, Command, Stdio},
    time::{Duration, Instant},
};

use vnat_tests::{bin_path, EchoServer, Host, LaptopRouterServer, Netns, TempDir, Vnatd};

const OUTAGE: Duration = Duration::from_secs(60);

/// An idle line client with keepalive at 5 s idle, 1 s interval, 3 probes.
struct IdleClient {
    child: Child,
    out: BufReader<ChildStdout>,
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
        let out = BufReader::new(child.stdout.take().expect("stdout"));
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
        let mut got = String::new();
        matches!(self.out.read_line(&mut got), Ok(n) if n > 0) && got.trim_end() == line
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

fn vnatctl(d: &Vnatd, args: &[&str]) {
    let out = Command::new(bin_path("vnatctl"))
        .arg("--control")
        .arg(&d.control)
        .args(args)
        .output()
        .expect("running vnatctl");
    assert!(
        out.status.success(),
        "vnatctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
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

    vnatctl(&lapd, &["suspend", "--all"]);
    let held_rows = |d: &Vnatd| {
        d.ctl(&["ls", "--proto", "tcp"])
            .unwrap_or_default()
            .as_array()
            .map_or(0, |rows| {
                rows.iter().filter(|r| r["keepalive_held"] == true).count()
            })
    };
    assert_eq!(held_rows(&lapd), 1, "ls does not show the held keepalive");
    for (a, p) in topo.laptop_a_addr.with_prefixes() {
        topo.laptop.del_addr(&topo.laptop_if_a, a, p);
    }
    topo.laptop.link_down(&topo.laptop_if_a);
    std::thread::sleep(OUTAGE);
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

    topo.plug_laptop_b();
    topo.laptop
        .default_route(topo.router_b_addr.v4.into(), &topo.laptop_if_b);
    vnatctl(&lapd, &["resume", "--all"]);
    assert!(
        held.echo("again"),
        "the suspended client's connection does not echo after resume"
    );
    assert_eq!(
        held_rows(&lapd),
        0,
        "ls still shows a held keepalive after resume"
    );
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
