//! Keep-alive helpers (issue 18, item 3): the server's TCP gives up after
//! `net.ipv4.tcp_retries2 = 3` unanswered retransmissions (about 3 s). A
//! laptop streams to the server's echo and suspends; then what the server
//! sends stops reaching it for half a second (so that the server always has
//! unacknowledged data when the laptop leaves), the laptop is offline for
//! 20 s, comes back on subnet B and resumes.
//!
//! - With `vnatctl suspend --all --helper zero-window` the server's vnatd
//!   answers for the laptop with a zero window: the server's socket waits
//!   instead of giving up, is still there during the outage, and the stream
//!   goes on byte-exact on the same socket after the move.
//! - Without the helper (same outage, same settings, the server allowing
//!   no helper, which it would otherwise start by itself for a silent
//!   laptop) the server's socket is gone within seconds and the stream
//!   fails when the laptop is back.
//! - With `--helper stop` as well, on a server that allows it
//!   (`--peer-helper stop`), the server's echo process is stopped during the
//!   outage and runs again once the laptop is back.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

/// Longer than the server's TCP lasts without help (about 3 s).
const OUTAGE: Duration = Duration::from_secs(20);

/// The server's established sockets to the laptop's address A.
fn server_sockets(topo: &LaptopRouterServer) -> usize {
    let a = topo.laptop_a_addr.v4.to_string();
    topo.server
        .run_stdout(&["ss", "-Htn", "state", "established", "( sport = :5001 )"])
        .lines()
        .filter(|l| l.contains(&a))
        .count()
}

/// The server's process of its connection to the laptop's address A (as
/// the server's vnatd lists it), and whether it is stopped.
fn server_process(srvd: &Vnatd, lap_a: &str) -> (u32, bool) {
    let ls = srvd.ctl(&["ls", "--proto", "tcp"]).expect("ls");
    let pid = ls
        .as_array()
        .and_then(|a| {
            a.iter().find(|r| {
                r["virtual_remote"]
                    .as_str()
                    .is_some_and(|s| s.starts_with(lap_a))
            })
        })
        .and_then(|r| r["pid"].as_u64())
        .unwrap_or_else(|| panic!("the server lists no process for the connection: {ls}"))
        as u32;
    (pid, stopped(pid))
}

/// Whether process `pid` is stopped (state T in /proc/PID/stat).
fn stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the process's stat");
    // "pid (comm) S ...": the state follows the command's closing paren.
    let state = stat
        .rsplit_once(')')
        .map(|(_, r)| r.trim_start().chars().next());
    state == Some(Some('T'))
}

/// The one TCP connection `d` lists.
fn first_row(d: &Vnatd) -> serde_json::Value {
    let ls = d.ctl(&["ls", "--proto", "tcp"]).expect("ls");
    ls.as_array()
        .and_then(|a| a.first().cloned())
        .unwrap_or_else(|| panic!("no connection listed: {ls}"))
}

/// Where the laptop comes back.
#[derive(PartialEq)]
enum Back {
    /// On subnet B: the connection moves.
    Elsewhere,
    /// Where it was (woken on the same network): nothing moves, and the
    /// laptop's word ends the help.
    SamePlace,
}

fn outage(tag: &str, helpers: &[&str], server_flags: &[&str], back: Back) {
    let helper = helpers.contains(&"zero-window");
    let stop = helpers.contains(&"stop");
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    topo.server.set_sysctl("net/ipv4/tcp_retries2", "3");
    let lapd = Vnatd::start(&lap, dl.path());
    let srvd = Vnatd::start_with(&srv, ds.path(), server_flags);

    let mut cmd = StreamOptions::tcp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(50_000, Duration::from_secs(10));
    lapd.wait_mobile_to("tcp", server.ip());

    let mut args = vec!["suspend", "--all"];
    for h in helpers {
        args.extend(["--helper", h]);
    }
    let reply = lapd.ctl(&args).expect("suspend answers");
    let helped = reply["helped"].as_array().map_or(0, Vec::len);
    assert_eq!(helped, usize::from(helper), "suspend's answer: {reply}");
    if helper {
        // The server's vnatd has the request before the laptop leaves.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let st = srvd.ctl(&["status"]).expect("status");
            if st["vcmp"]["events"]["help_answered"].as_u64() >= Some(1) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the server's vnatd never got the request for help: {st}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    // What the server sends stops reaching the laptop, which still sends:
    // the server has unacknowledged data from now on.
    let server_ip = topo.server_addr.v4.to_string();
    topo.laptop
        .run(&["nft", "add", "table", "ip", "vnatoutage"]);
    topo.laptop.run(&[
        "nft",
        "add chain ip vnatoutage in { type filter hook input priority 0 ; }",
    ]);
    topo.laptop.run(&[
        "nft",
        "add",
        "rule",
        "ip",
        "vnatoutage",
        "in",
        "ip",
        "saddr",
        &server_ip,
        "tcp",
        "sport",
        "5001",
        "drop",
    ]);
    std::thread::sleep(Duration::from_millis(500));
    if helper {
        // Both ends say so in `ls`.
        let row = first_row;
        let want: Vec<&str> = helpers.to_vec();
        let l = row(&lapd);
        assert_eq!(l["helpers_asked"], serde_json::json!(want), "laptop: {l}");
        let s = row(&srvd);
        assert_eq!(s["helping"], serde_json::json!(want), "server: {s}");
    }
    let before = client.latest().expect("a status line");
    match back {
        Back::Elsewhere => {
            for (a, p) in topo.laptop_a_addr.with_prefixes() {
                topo.laptop.del_addr(&topo.laptop_if_a, a, p);
            }
            topo.laptop.link_down(&topo.laptop_if_a);
        }
        // Asleep: nothing of the server's reaches it, nothing leaves it.
        Back::SamePlace => {
            topo.laptop.run(&[
                "nft",
                "add chain ip vnatoutage out { type filter hook output priority 0 ; }",
            ]);
            for (chain, dir) in [("in", "saddr"), ("out", "daddr")] {
                topo.laptop.run(&[
                    "nft",
                    "add",
                    "rule",
                    "ip",
                    "vnatoutage",
                    chain,
                    "ip",
                    dir,
                    &server_ip,
                    "drop",
                ]);
            }
        }
    }
    std::thread::sleep(OUTAGE);
    let alive = server_sockets(&topo);
    let lap_a = topo.laptop_a_addr.v4.to_string();
    let stopped = stop.then(|| server_process(&srvd, &lap_a));
    if let Some((pid, stopped)) = stopped {
        assert!(
            stopped,
            "the server's process {pid} was not stopped while the laptop was away"
        );
    }

    if back == Back::Elsewhere {
        topo.plug_laptop_b();
        topo.laptop
            .default_route(topo.router_b_addr.v4.into(), &topo.laptop_if_b);
    }
    topo.laptop
        .run(&["nft", "delete", "table", "ip", "vnatoutage"]);
    lapd.ctl(&["resume", "--all"]).expect("resume answers");

    if helper {
        assert_eq!(
            alive, 1,
            "the server's socket did not last the outage although its vnatd answered for the laptop"
        );
        let after = client.wait_progress(&before, 200_000, Duration::from_secs(30));
        assert_eq!(after.local, before.local, "not the same socket");
        if let Some((pid, _)) = stopped {
            assert!(
                !self::stopped(pid),
                "the server's process {pid} is still stopped after the laptop came back"
            );
        }
        // The laptop tells the server it is back once the connection works
        // again, and neither end shows the helpers any more.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let l = first_row(&lapd);
            let s = first_row(&srvd);
            let none = serde_json::json!([]);
            let asked = l.get("helpers_asked").unwrap_or(&none);
            let helping = s.get("helping").unwrap_or(&none);
            if asked == &none && helping == &none {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the help did not end once the laptop was back: laptop {l}, server {s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let ev = srvd.ctl(&["status"]).expect("status")["vcmp"]["events"].clone();
        assert!(
            ev["help_answered"].as_u64() >= Some(2),
            "the laptop never said it is back: {ev}"
        );
        let end = client.stop();
        assert!(end.error.is_none(), "the stream failed: {end:?}");
    } else {
        assert_eq!(
            alive, 0,
            "without help the server's socket outlived the outage: the test shows nothing"
        );
        // The laptop's end is alive, the server's is gone: nothing more
        // arrives (the laptop retransmits into a socket that no longer
        // exists, whose resets cannot reach it).
        let at_resume = client.latest().map_or(0, |s| s.verified);
        std::thread::sleep(Duration::from_secs(15));
        let now = client.latest().map_or(0, |s| s.verified);
        assert!(
            now < at_resume + 100_000,
            "the stream went on ({at_resume} -> {now} bytes) although its server's TCP gave up: the test shows nothing"
        );
    }
}

#[test]
fn a_zero_window_helper_keeps_the_peers_tcp_waiting_through_an_outage() {
    outage("hzw", &["zero-window"], &[], Back::Elsewhere);
}

#[test]
fn the_stop_helper_stops_the_peers_process_until_the_end_is_back() {
    outage(
        "hzs",
        &["zero-window", "stop"],
        &["--peer-helper", "zero-window", "--peer-helper", "stop"],
        Back::Elsewhere,
    );
}

#[test]
fn without_a_helper_the_peers_tcp_gives_up_during_the_outage() {
    // No helper at all on the server: it would otherwise start the
    // zero-window help on its own once the laptop is silent (issue 32).
    outage("hzn", &[], &["--peer-helper", "none"], Back::Elsewhere);
}

/// Woken where it slept: nothing moves, so the help ends by the laptop's
/// word (an empty HELP once the connection works again after `resume`),
/// and the server reopens the window and restarts its socket at once.
#[test]
fn back_at_the_same_place_the_laptops_word_ends_the_help() {
    outage("hzp", &["zero-window"], &[], Back::SamePlace);
}

/// An installed helper (`--peer-helper note` on the server, an executable
/// `note` in its `--helpers-dir`): the laptop suspends with `--helper
/// zero-window --helper note`; the server runs `note` as user nobody with
/// the connection's socket as descriptor 3 and the event on its standard
/// input, "away" at the suspension and "back" once the laptop is back.
#[test]
fn an_installed_helper_runs_unprivileged_with_its_connection() {
    use std::os::unix::fs::PermissionsExt;
    let tag = "hzu";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let helpers = TempDir::new(&format!("{tag}h"));
    let out = TempDir::new(&format!("{tag}o"));
    let mode = |p: &std::path::Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).expect("chmod")
    };
    mode(helpers.path(), 0o755);
    mode(out.path(), 0o1777);
    let script = helpers.path().join("note");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n{{ id -u; readlink /proc/self/fd/3; cat; }} > {}/run.$$\n",
            out.path().display()
        ),
    )
    .expect("writing the helper");
    mode(&script, 0o755);
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, dl.path());
    let hd = helpers.path().display().to_string();
    let _srvd = Vnatd::start_with(
        &srv,
        ds.path(),
        &[
            "--helpers-dir",
            &hd,
            "--peer-helper",
            "zero-window",
            "--peer-helper",
            "note",
        ],
    );
    let mut cmd = StreamOptions::tcp(server)
        .rate(100_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let first = client.wait_verified_at_least(20_000, Duration::from_secs(10));
    lapd.wait_mobile_to("tcp", server.ip());
    lapd.ctl(&[
        "suspend",
        "--all",
        "--helper",
        "zero-window",
        "--helper",
        "note",
    ])
    .expect("suspend answers");
    // The runs so far, as (uid, fd 3's target, the event's JSON).
    let runs = || -> Vec<(String, String, serde_json::Value)> {
        let mut v = Vec::new();
        for e in std::fs::read_dir(out.path())
            .expect("the output directory")
            .flatten()
        {
            let text = std::fs::read_to_string(e.path()).unwrap_or_default();
            let mut lines = text.lines();
            let (Some(uid), Some(fd3), Some(json)) = (lines.next(), lines.next(), lines.next())
            else {
                continue;
            };
            if let Ok(j) = serde_json::from_str(json) {
                v.push((uid.to_string(), fd3.to_string(), j));
            }
        }
        v
    };
    let wait_event = |event: &str| {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(r) = runs().into_iter().find(|r| r.2["event"] == event) {
                return r;
            }
            assert!(
                Instant::now() < deadline,
                "the helper never ran for {event:?}: {:?}",
                runs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let (uid, fd3, json) = wait_event("away");
    assert_eq!(uid, "65534", "the helper does not run as nobody");
    // Descriptor 3 is the connection's own socket (the server's end, by
    // its inode as ss shows it).
    let ss = topo
        .server
        .run_stdout(&["ss", "-Htne", "state", "established", "( sport = :5001 )"]);
    let inode = ss
        .split_whitespace()
        .find_map(|w| w.strip_prefix("ino:"))
        .unwrap_or_else(|| panic!("no inode in ss: {ss}"));
    assert_eq!(
        fd3,
        format!("socket:[{inode}]"),
        "descriptor 3 is not the connection's socket"
    );
    assert_eq!(json["proto"], "tcp");
    assert_eq!(json["local"], server.to_string(), "{json}");
    assert_eq!(json["remote"], first.local, "{json}");
    // Back at the same place: the laptop's word ends the help.
    lapd.ctl(&["resume", "--all"]).expect("resume answers");
    let (_, _, json) = wait_event("back");
    assert_eq!(json["remote"], first.local, "{json}");
    std::thread::sleep(Duration::from_secs(1));
    let events: Vec<String> = runs()
        .iter()
        .map(|r| r.2["event"].as_str().unwrap_or("?").to_string())
        .collect();
    let count = |e: &str| events.iter().filter(|x| *x == e).count();
    assert_eq!(
        (count("away"), count("back")),
        (1, 1),
        "one run each: {events:?}"
    );
    let end = client.stop();
    assert!(end.error.is_none(), "the stream failed: {end:?}");
}

/// `--helper hold` (what `vnatctl criu-hook` asks for before a
/// checkpoint): the server's vnatd keeps the server's packets of the
/// connection in its socket, so the laptop's stream stops; the laptop's
/// word that it is back (after `resume` at the same place) lets them go,
/// and a hold nobody ends lets them go by itself after its limit (3.75 s
/// with the default `tcp_retries2`), before the server's TCP gives up.
#[test]
fn the_hold_helper_keeps_the_peers_packets_until_the_end_is_back_or_the_limit() {
    let tag = "hzh";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    // The server allows hold by default.
    let lapd = Vnatd::start(&lap, dl.path());
    let srvd = Vnatd::start(&srv, ds.path());
    let mut cmd = StreamOptions::tcp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(50_000, Duration::from_secs(10));
    lapd.wait_mobile_to("tcp", server.ip());
    let verified = || client.latest().map_or(0, |s| s.verified);

    // Held until the laptop says it is back.
    let reply = lapd
        .ctl(&["suspend", "--all", "--helper", "hold"])
        .expect("suspend answers");
    assert_eq!(reply["helped"].as_array().map(Vec::len), Some(1), "{reply}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while first_row(&srvd)["helping"] != serde_json::json!(["hold"]) {
        assert!(
            Instant::now() < deadline,
            "the server never held: {}",
            first_row(&srvd)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let held_since = Instant::now();
    // What was in flight drains; then nothing comes back.
    std::thread::sleep(Duration::from_millis(500));
    let held_at = verified();
    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        verified() < held_at + 20_000,
        "the server's packets were not held: {} bytes came back in 1 s",
        verified() - held_at
    );
    lapd.ctl(&["resume", "--all"]).expect("resume answers");
    let after = client.wait_verified_at_least(held_at + 100_000, Duration::from_secs(8));
    // Before the hold's own limit (3.75 s): the laptop's word ended it.
    assert!(
        held_since.elapsed() < Duration::from_millis(3500),
        "the hold did not end with the laptop's word (the stream went on {:?} after the hold)",
        held_since.elapsed()
    );
    assert!(after.error.is_none());

    // Held again, and nobody ends it: the limit does.
    let reply = lapd
        .ctl(&["suspend", "--all", "--helper", "hold"])
        .expect("suspend answers");
    assert_eq!(reply["helped"].as_array().map(Vec::len), Some(1), "{reply}");
    let asked = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    let held_at = verified();
    let back = client.wait_verified_at_least(held_at + 100_000, Duration::from_secs(20));
    let waited = asked.elapsed();
    // The limit: half of what the server's TCP would take to give up
    // (tcp_retries2 probes, 500 ms apart when sends fail locally).
    assert!(
        waited >= Duration::from_millis(3500),
        "the stream went on after {waited:?}, before the hold's limit (3.75 s)"
    );
    let end = client.stop();
    assert!(
        end.error.is_none() && end.verified >= back.verified,
        "the stream failed: {end:?}"
    );
}
