//! Planned mode with real daemons (DESIGN.md §5): before the move the user
//! runs `vnatctl suspend --all` on the laptop, which settles roles and fresh
//! keys with the server's vnatd; `vnatctl peers` on both hosts shows the
//! other host's pinned key and a mobile connection; after the move
//! `vnatctl resume --all` returns and the same socket carries on, byte-exact.
//! Automatic mode may move the connection before the resume: the resume must
//! then be harmless. At the end the connection is exported (keys and
//! translation in a new 0600 file) and keeps flowing.

use std::{
    net::SocketAddr,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_daemon::{
    daemon::identity::{key_hex, load_or_create_identity},
    vcmp::crypto::HostIdentity,
};
use vnat_tests::{
    bin_path, EchoServer, Family, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir,
    Vnatd,
};

/// The host key a vnatd uses, as `vnatctl peers` prints it on the other host.
fn host_key(dir: &TempDir) -> String {
    let secret = load_or_create_identity(&dir.path().join("state"))
        .unwrap_or_else(|e| panic!("reading the identity in {}: {e}", dir.path().display()));
    key_hex(&HostIdentity::from_bytes(secret).public())
}

/// `vnatctl --json ARGS` whatever its exit status: (status, stdout JSON).
fn ctl_status(control: &Path, args: &[&str]) -> (Option<i32>, Value) {
    let out = Command::new(bin_path("vnatctl"))
        .arg("--control")
        .arg(control)
        .arg("--json")
        .args(args)
        .output()
        .expect("running vnatctl");
    let json = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "vnatctl {args:?} printed invalid JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    (out.status.code(), json)
}

/// Poll `vnatctl ls` until the connection from `local` is listed as mobile
/// (the daemons paired and derived its keys).
fn wait_mobile(d: &Vnatd, local: &str, what: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let ls = d.ctl(&["ls"]).expect("vnatd unreachable");
        let row = ls
            .as_array()
            .expect("ls --json prints an array")
            .iter()
            .find(|r| r["virtual_local"] == local || r["virtual_remote"] == local)
            .cloned();
        if let Some(row) = row.filter(|r| r["mobile"] == true) {
            return row;
        }
        assert!(
            Instant::now() < deadline,
            "{what} never listed the connection from {local} as mobile: {ls}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The peers row for `address` must carry `key` and at least one mobile
/// connection.
fn assert_peer(d: &Vnatd, address: std::net::IpAddr, key: &str, what: &str) {
    let peers = d.ctl(&["peers"]).expect("vnatd unreachable");
    let rows = peers.as_array().expect("peers --json prints an array");
    let row = rows
        .iter()
        .find(|p| p["address"] == address.to_string())
        .unwrap_or_else(|| panic!("{what}: no peer {address} in {peers}"));
    assert_eq!(row["key"], key, "{what}: wrong pinned key in {peers}");
    assert!(
        row["mobile"].as_u64().is_some_and(|m| m >= 1),
        "{what}: no mobile connection with {address}: {peers}"
    );
    assert!(
        row["connections"].as_u64() >= row["mobile"].as_u64(),
        "{what}: more mobile than tracked connections: {peers}"
    );
}

#[test]
fn suspend_move_resume_tcp_v4() {
    let tag = "plan4";
    let family = Family::V4;
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.get(family), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());

    let mut cmd = StreamOptions::tcp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    let row = wait_mobile(&lapd, &before.local, "the laptop's vnatd");
    wait_mobile(&srvd, &before.local, "the server's vnatd");
    let id = row["id"].as_u64().expect("ls id is a number");

    // A selector that matches nothing is an error and changes nothing.
    let (code, err) = ctl_status(&lapd.control, &["suspend", "--pid", "999999"]);
    assert_eq!(code, Some(1), "suspend of an unknown pid: {err}");
    assert_eq!(err["error"]["kind"], "no_match", "{err}");

    let suspended = lapd
        .ctl(&["suspend", "--all"])
        .expect("laptop vnatd unreachable");
    assert!(
        suspended["suspended"]
            .as_array()
            .is_some_and(|ids| ids.contains(&Value::from(id))),
        "suspend --all did not suspend connection {id}: {suspended}"
    );
    let (lkey, skey) = (host_key(&ldir), host_key(&sdir));
    assert_peer(&lapd, server.ip(), &skey, "the laptop's vnatd");
    let laptop_a = topo.laptop_a_addr.get(family);
    assert_peer(&srvd, laptop_a, &lkey, "the server's vnatd");
    // Data still flows between suspend and the move.
    let mid = client.latest().expect("status").verified;
    client.wait_verified_at_least(mid + 30_000, Duration::from_secs(10));

    let t0 = Instant::now();
    topo.move_laptop_to_b();
    let resumed = lapd
        .ctl(&["resume", "--all"])
        .expect("laptop vnatd unreachable");
    assert!(
        resumed["moves_started"].as_u64().is_some(),
        "resume reply lacks moves_started: {resumed}"
    );
    let at_move = client.latest().expect("status").verified;
    let after = client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    eprintln!(
        "{tag}: data flowing again {:?} after the move ({resumed})",
        t0.elapsed()
    );
    // A second resume once everything moved: harmless, nothing to do.
    let again = lapd
        .ctl(&["resume", "--all"])
        .expect("laptop vnatd unreachable");
    assert_eq!(again["moves_started"], 0, "{again}");

    let local: SocketAddr = before.local.parse().expect("client's local endpoint");
    let new_local = SocketAddr::new(topo.laptop_b_addr.get(family), local.port());
    let ls = lapd
        .ctl(&["ls", "--state", "translated"])
        .expect("laptop vnatd unreachable");
    assert!(
        ls.as_array()
            .expect("array")
            .iter()
            .any(|r| r["virtual_local"] == before.local
                && r["physical_local"] == new_local.to_string()
                && r["mobile"] == true),
        "the laptop's vnatd does not show the moved, mobile connection: {ls}"
    );

    // Export (the real driver's state over the control socket): a new 0600
    // file with the keys and the translation to the new address. The
    // translation stays installed, so the stream carries on.
    let file = ldir.path().join("export.json");
    let path = file.display().to_string();
    let exported = lapd
        .ctl(&["export", "--conn", &id.to_string(), "--output", &path])
        .expect("laptop vnatd unreachable");
    assert_eq!(exported["exported"], serde_json::json!([id]), "{exported}");
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&file)
        .expect("export file written")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the export holds keys");
    let doc: Value = serde_json::from_slice(&std::fs::read(&file).expect("reading the export"))
        .expect("the export is JSON");
    assert_eq!(doc["vnat_export"], 1, "{doc}");
    let conn = &doc["connections"][0];
    assert_eq!(conn["id"], id, "{doc}");
    assert!(
        conn["vcmp"]["root_key"]
            .as_str()
            .is_some_and(|k| k.len() == 64 && k.bytes().all(|b| b.is_ascii_hexdigit())),
        "{doc}"
    );
    assert_eq!(
        conn["translation"]["physical_local"],
        new_local.to_string(),
        "{doc}"
    );
    let mid = client.latest().expect("status").verified;
    client.wait_verified_at_least(mid + 30_000, Duration::from_secs(10));

    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= after.verified);
}
