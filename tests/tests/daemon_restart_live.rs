//! vnatd restarts around a live, moving connection, with real daemons on
//! both ends: the laptop's vnatd is restarted (SIGTERM, then started again
//! with the same state directory, pins and cgroup) while the connection
//! runs, the laptop then moves (automatic mode), and both daemons are
//! restarted after the move. Nothing is lost: the same socket carries on
//! byte-exact with no reset, the moved connection stays translated after
//! each restart, each daemon keeps its identity and its pinned peers, and
//! the restarted pair can still move the connection (back to subnet A).

use std::{
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, StreamStatus, TempDir, Vnatd,
};

/// The state files that make up a vnatd's identity and its pairings.
#[derive(Clone, Debug, PartialEq, Eq)]
struct State {
    identity: Vec<u8>,
    peers: serde_json::Value,
}

fn state(dir: &TempDir) -> State {
    let s = dir.path().join("state");
    let identity = std::fs::read(s.join("identity.key")).expect("reading identity.key");
    assert_eq!(identity.len(), 32, "identity.key is not a 32-byte key");
    let peers = std::fs::read_to_string(s.join("peers.json")).expect("reading peers.json");
    let peers = serde_json::from_str(&peers)
        .unwrap_or_else(|e| panic!("peers.json is not JSON ({e}): {peers}"));
    State { identity, peers }
}

/// Wait until `d` shows a translated connection matching `pred`.
fn wait_translated(
    d: &Vnatd,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ls = d
            .ctl(&["ls", "--state", "translated"])
            .unwrap_or_else(|| panic!("{what}: vnatd unreachable"));
        if let Some(r) = ls
            .as_array()
            .expect("ls --json is an array")
            .iter()
            .find(|r| pred(r))
        {
            return r.clone();
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the moved connection is not shown as translated: {ls}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The connection as `ls` shows it, in any state.
fn row(d: &Vnatd, virtual_local: &str) -> serde_json::Value {
    let ls = d.ctl(&["ls"]).expect("vnatd unreachable");
    ls.as_array()
        .expect("array")
        .iter()
        .find(|r| r["virtual_local"] == virtual_local || r["virtual_remote"] == virtual_local)
        .cloned()
        .unwrap_or_else(|| panic!("the connection of {virtual_local} is not listed: {ls}"))
}

fn restart(d: Vnatd, host: &Host, dir: &Path, what: &str) -> Vnatd {
    let status = d.stop();
    assert!(
        status.success(),
        "{what}: vnatd exited with {status} on SIGTERM"
    );
    Vnatd::start(host, dir)
}

/// 100 kB more verified than now (and than `since`), within 20 s.
fn flows(client: &StreamClient, since: &StreamStatus, what: &str) -> StreamStatus {
    eprintln!("restart-live: {what}");
    client.wait_progress(since, 100_000, Duration::from_secs(20))
}

/// The brief's sequence: the laptop's vnatd alone is restarted before the
/// move.
#[test]
fn live_connection_survives_vnatd_restarts_before_and_after_a_move() {
    scenario("rstl", Before::LaptopOnly);
}

/// The same with both daemons restarted together before the move (both then
/// hold keys of the same new pairing): everything else as above.
#[test]
fn live_connection_survives_restarts_of_both_vnatd_before_and_after_a_move() {
    scenario("rstb", Before::Both);
}

#[derive(PartialEq)]
enum Before {
    LaptopOnly,
    Both,
}

fn scenario(tag: &str, before_move: Before) {
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let mut lapd = Vnatd::start(&lap, ldir.path());
    let mut srvd = Vnatd::start(&srv, sdir.path());

    let mut cmd = StreamOptions::tcp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");
    let (lap_state, srv_state) = (state(&ldir), state(&sdir));
    let local: SocketAddr = before.local.parse().expect("vnat-stream's local address");
    assert_eq!(row(&lapd, &before.local)["state"], "native");

    // 1. Restart the laptop's vnatd (or both) while the connection runs (not
    //    moved yet).
    if before_move == Before::Both {
        let (ls, ss) = (lapd.stop(), srvd.stop());
        assert!(
            ls.success() && ss.success(),
            "vnatd exit statuses on SIGTERM: laptop {ls}, server {ss}"
        );
        lapd = Vnatd::start(&lap, ldir.path());
        srvd = Vnatd::start(&srv, sdir.path());
    } else {
        lapd = restart(lapd, &lap, ldir.path(), "laptop, before the move");
    }
    let s = flows(
        &client,
        &before,
        "vnatd restarted before the move; data still flowing",
    );
    assert_eq!(
        state(&ldir),
        lap_state,
        "the laptop's identity or pinned peers changed across a restart"
    );
    assert_eq!(
        state(&sdir),
        srv_state,
        "the server's identity or pinned peers changed across a restart"
    );
    for (d, who) in [(&lapd, "laptop"), (&srvd, "server")] {
        let r = row(d, &before.local);
        assert_eq!(
            r["state"], "native",
            "{who}: the restarted vnatd changed an unmoved connection: {r}"
        );
    }
    // Let the restarted daemon adopt the connection and pair again (its
    // session keys are per process; the host keys are the pinned ones).
    std::thread::sleep(Duration::from_secs(3));

    // 2. Move the laptop: the restarted daemon must move the connection.
    let t0 = Instant::now();
    topo.move_laptop_to_b();
    let new_local = SocketAddr::new(topo.laptop_b_addr.v4.into(), local.port());
    let s = flows(&client, &s, "moved to B");
    eprintln!(
        "restart-live: data flowing again {:?} after the move",
        t0.elapsed()
    );
    let is_lap = |r: &serde_json::Value| {
        r["virtual_local"] == before.local && r["physical_local"] == new_local.to_string()
    };
    let is_srv = |r: &serde_json::Value| {
        r["virtual_remote"] == before.local && r["physical_remote"] == new_local.to_string()
    };
    wait_translated(&lapd, "laptop after the move", is_lap);
    wait_translated(&srvd, "server after the move", is_srv);

    // 3. Restart both daemons after the move, one after the other, then both
    //    at once; the translation is in the pins and must stay.
    srvd = restart(srvd, &srv, sdir.path(), "server, after the move");
    wait_translated(&srvd, "server restarted after the move", is_srv);
    let s = flows(
        &client,
        &s,
        "server vnatd restarted after the move; data still flowing",
    );
    lapd = restart(lapd, &lap, ldir.path(), "laptop, after the move");
    wait_translated(&lapd, "laptop restarted after the move", is_lap);
    let s = flows(
        &client,
        &s,
        "laptop vnatd restarted after the move; data still flowing",
    );
    let (ls, ss) = (lapd.stop(), srvd.stop());
    assert!(
        ls.success() && ss.success(),
        "vnatd exit statuses on SIGTERM: laptop {ls}, server {ss}"
    );
    let s = flows(
        &client,
        &s,
        "both vnatd stopped; the pins carry the translation",
    );
    lapd = Vnatd::start(&lap, ldir.path());
    srvd = Vnatd::start(&srv, sdir.path());
    wait_translated(&lapd, "laptop, both restarted", is_lap);
    wait_translated(&srvd, "server, both restarted", is_srv);
    let s = flows(&client, &s, "both vnatd restarted; data still flowing");
    assert_eq!(
        state(&ldir).identity,
        lap_state.identity,
        "the laptop's identity key changed"
    );
    assert_eq!(
        state(&sdir).identity,
        srv_state.identity,
        "the server's identity key changed"
    );
    // Pinned host keys are never dropped or replaced. Each is kept with the
    // address its host last paired from: the server's stays, the laptop's
    // may follow it to subnet B (where a restarted daemon pairs with it).
    let laptop_addrs = [
        topo.laptop_a_addr.v4.to_string(),
        topo.laptop_b_addr.v4.to_string(),
    ];
    for (before, now, who) in [
        (&lap_state, state(&ldir), "laptop"),
        (&srv_state, state(&sdir), "server"),
    ] {
        let (b, n) = (before.peers.as_object(), now.peers.as_object());
        match (b, n) {
            (Some(b), Some(n)) => {
                for (k, v) in b {
                    let ok = match n.get(k).and_then(|a| a.as_str()) {
                        Some(a) if who == "server" => laptop_addrs.iter().any(|l| l == a),
                        Some(a) => Some(a) == v.as_str(),
                        None => false,
                    };
                    assert!(
                        ok,
                        "{who}: pinned peer {k} changed or vanished: before {b:?}, now {n:?}"
                    );
                }
            }
            _ => assert_eq!(now.peers, before.peers, "{who}: peers.json changed"),
        }
        eprintln!("restart-live: {who} peers.json now: {}", now.peers);
    }

    // 4. The restarted pair can still move it: back to subnet A, where the
    //    connection is native again.
    std::thread::sleep(Duration::from_secs(3));
    topo.move_laptop_to_a();
    let s = flows(&client, &s, "moved back to A after the restarts");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (l, r) = (row(&lapd, &before.local), row(&srvd, &before.local));
        if l["physical_local"] == before.local && r["physical_remote"] == before.local {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after moving back to A: laptop {l}, server {r}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    client.wait_verified_at_least(s.verified + 100_000, Duration::from_secs(20));

    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= s.verified, "{:?}", fin.json);
}
