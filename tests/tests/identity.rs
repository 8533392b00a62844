//! Identity by key (issue 15, item 1), with real vnatd on namespace hosts:
//! a peer is its host key, never its address. A host that takes over
//! another's address gets nothing of the other's; a reinstalled peer (new
//! key, same address) follows the documented policy: its old connections
//! stay with the old key until `vnatctl peers forget` releases them.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use serde_json::Value;
use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, Netns, StreamClient, StreamOptions, TempDir, Vnatd,
};

/// `vnatctl peers` rows at `ip`.
fn peers_at(d: &Vnatd, ip: IpAddr) -> Vec<Value> {
    d.ctl(&["peers"])
        .expect("vnatd unreachable")
        .as_array()
        .expect("peers --json is an array")
        .iter()
        .filter(|r| r["address"].as_str() == Some(&ip.to_string()))
        .cloned()
        .collect()
}

fn rejected(d: &Vnatd, reason: &str) -> u64 {
    d.ctl(&["status"]).expect("vnatd unreachable")["vcmp"]["rejected"][reason]
        .as_u64()
        .unwrap_or(0)
}

/// Waits until `f` holds, or fails with `what` and the peers of `d`.
fn wait_for(d: &Vnatd, what: &str, secs: u64, f: impl FnMut() -> bool) {
    vnat_tests::wait_until(Duration::from_secs(secs), f, || {
        format!(
            "{what}; peers: {}; status: {}",
            d.ctl(&["peers"]).unwrap_or_default(),
            d.ctl(&["status"]).unwrap_or_default()["vcmp"]
        )
    });
}

/// The row of host key `key` (hex) at `ip` holds `n` connections, all mobile.
fn holds(d: &Vnatd, ip: IpAddr, key: &str, n: u64) -> bool {
    peers_at(d, ip).iter().any(|r| {
        r["key"].as_str() == Some(key)
            && r["connections"].as_u64() == Some(n)
            && r["mobile"].as_u64() == Some(n)
    })
}

fn stream(lap: &Host, ns: &Netns, server: SocketAddr) -> StreamClient {
    let mut cmd = StreamOptions::tcp(server).rate(300_000).command(ns);
    lap.cgroup.join_on_spawn(&mut cmd);
    StreamClient::from_command(cmd)
}

/// Laptop X leaves for subnet B; laptop Y plugs into X's place on subnet A
/// and gets X's address, and connects to the same server. Y pairs (no
/// "peer key changed" lock-out), Y's connection is mobile at both ends, and
/// X's connection stays bound to X's key: X, elsewhere, still moves it.
#[test]
fn a_host_that_gets_another_s_address_gets_nothing_of_its_connections() {
    let topo = LaptopRouterServer::builder().tag("idre").build();
    let x = Host::new(&topo.laptop, "idrex");
    let srv = Host::new(&topo.server, "idres");
    let (xdir, sdir, ydir) = (
        TempDir::new("idrex"),
        TempDir::new("idres"),
        TempDir::new("idrey"),
    );
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let xd = Vnatd::start(&x, xdir.path());
    let sd = Vnatd::start(&srv, sdir.path());
    let a_ip = IpAddr::from(topo.laptop_a_addr.v4);
    let x_client = stream(&x, &topo.laptop, server);
    x_client.wait_verified_at_least(50_000, Duration::from_secs(10));
    let x_key = xd.ctl(&["status"]).expect("x status")["vcmp"]["public_key"]
        .as_str()
        .map(str::to_string);
    wait_for(
        &sd,
        "the server never made X's connection mobile",
        15,
        || {
            peers_at(&sd, a_ip)
                .iter()
                .any(|r| r["mobile"].as_u64() == Some(1))
        },
    );
    let x_key = x_key.unwrap_or_else(|| {
        peers_at(&sd, a_ip)[0]["key"]
            .as_str()
            .expect("X's key")
            .to_string()
    });

    // X moves to B; its connection follows.
    topo.move_laptop_to_b();
    let at = x_client.latest().expect("status").verified;
    x_client.wait_verified_at_least(at + 100_000, Duration::from_secs(20));

    // Y takes X's old place on A: the same link, the same address.
    let y_ns = Netns::new("idrey");
    topo.laptop.link_set_netns(&topo.laptop_if_a, &y_ns);
    y_ns.link_up(&topo.laptop_if_a);
    y_ns.add_addr(&topo.laptop_if_a, a_ip, 24);
    y_ns.default_route(topo.router_a_addr.v4.into(), &topo.laptop_if_a);
    let y = Host::new(&y_ns, "idrey");
    let yd = Vnatd::start(&y, ydir.path());
    let y_client = stream(&y, &y_ns, server);
    y_client.wait_verified_at_least(50_000, Duration::from_secs(10));

    // Two host keys at A's address, each holding its own connection.
    wait_for(
        &sd,
        "Y's connection never became mobile beside X's",
        20,
        || {
            let rows = peers_at(&sd, a_ip);
            holds(&sd, a_ip, &x_key, 1)
                && rows.iter().any(|r| {
                    r["key"].as_str().is_some_and(|k| k != x_key)
                        && r["connections"].as_u64() == Some(1)
                        && r["mobile"].as_u64() == Some(1)
                })
        },
    );
    assert_eq!(
        rejected(&sd, "peer_key_changed"),
        0,
        "a new key at a known address must not be refused"
    );
    let y_ls = yd.ctl(&["ls"]).expect("y ls");
    assert!(
        y_ls.as_array()
            .expect("array")
            .iter()
            .any(|r| r["mobile"] == Value::Bool(true)),
        "Y's own connection is not mobile on Y: {y_ls}"
    );

    // X, elsewhere, still moves its own connection: renumbered on B.
    let b_ip = IpAddr::from(topo.laptop_b_addr.v4);
    let b2: IpAddr = "198.18.2.3".parse().expect("ip");
    // (Deleting the primary address first: it would take a secondary
    // with it.)
    topo.laptop.del_addr(&topo.laptop_if_b, b_ip, 24);
    topo.laptop.add_addr(&topo.laptop_if_b, b2, 24);
    topo.laptop
        .default_route(topo.router_b_addr.v4.into(), &topo.laptop_if_b);
    let at = x_client.latest().expect("status").verified;
    x_client.wait_verified_at_least(at + 100_000, Duration::from_secs(20));
    assert!(
        holds(&sd, a_ip, &x_key, 1),
        "X lost its connection's binding"
    );
    let ls = sd.ctl(&["ls", "--state", "translated"]).expect("server ls");
    assert!(
        ls.as_array()
            .expect("array")
            .iter()
            .any(|r| r["physical_remote"]
                .as_str()
                .is_some_and(|p| p.starts_with("198.18.2.3:"))),
        "the server does not follow X to its new address: {ls}"
    );
    let fx = x_client.stop();
    assert_eq!(fx.error, None, "X's stream broke: {:?}", fx.json);
    let fy = y_client.stop();
    assert_eq!(fy.error, None, "Y's stream broke: {:?}", fy.json);
    drop(yd);
    drop(y);
}

/// The server's vnatd is reinstalled (new state directory, so a new host
/// key) while its connection to the laptop lives on. The new key pairs,
/// but the connection stays bound to the old key (a claim conflict, counted
/// and logged) until the laptop's operator runs `vnatctl peers forget
/// OLDKEY`; then the new key claims it and the laptop's move works.
#[test]
fn a_reinstalled_peer_gets_its_connections_after_peers_forget() {
    let topo = LaptopRouterServer::builder().tag("idri").build();
    let lap = Host::new(&topo.laptop, "idril");
    let srv = Host::new(&topo.server, "idris");
    let (ldir, sdir, sdir2) = (
        TempDir::new("idril"),
        TempDir::new("idris"),
        TempDir::new("idrin"),
    );
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());
    let client = stream(&lap, &topo.laptop, server);
    client.wait_verified_at_least(50_000, Duration::from_secs(10));
    let s_ip = IpAddr::from(topo.server_addr.v4);
    wait_for(
        &lapd,
        "the laptop's connection never became mobile",
        15,
        || {
            peers_at(&lapd, s_ip)
                .iter()
                .any(|r| r["mobile"].as_u64() == Some(1))
        },
    );
    let old_key = peers_at(&lapd, s_ip)[0]["key"]
        .as_str()
        .expect("the server's key")
        .to_string();

    // Reinstall: same kernel, same pins and sockets, a new identity.
    srvd.stop();
    let srvd2 = Vnatd::start(&srv, sdir2.path());
    wait_for(
        &lapd,
        "the reinstalled server's claim was not refused",
        30,
        || rejected(&lapd, "claim_conflict") > 0,
    );
    assert!(
        holds(&lapd, s_ip, &old_key, 1),
        "the connection must stay with the old key until forgotten"
    );
    assert!(
        peers_at(&lapd, s_ip)
            .iter()
            .any(|r| r["key"].as_str().is_some_and(|k| k != old_key)),
        "the new key must have paired (no lock-out)"
    );

    // The documented step: forget the old key.
    let out = lapd
        .ctl(&["peers", "forget", &old_key])
        .expect("vnatctl peers forget");
    assert_eq!(out["connections"], 1, "{out}");
    wait_for(
        &lapd,
        "the new key never claimed the connection",
        20,
        || {
            peers_at(&lapd, s_ip).iter().any(|r| {
                r["key"].as_str().is_some_and(|k| k != old_key) && r["mobile"].as_u64() == Some(1)
            })
        },
    );
    assert!(
        peers_at(&lapd, s_ip)
            .iter()
            .all(|r| r["key"].as_str() != Some(&old_key)),
        "the old key is still listed after forget"
    );
    // A typo or an unknown key changes nothing and says why.
    let bad = std::process::Command::new(vnat_tests::bin_path("vnatctl"))
        .arg("--control")
        .arg(&lapd.control)
        .args(["peers", "forget", "not-a-key"])
        .output()
        .expect("vnatctl");
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("64 hex digits"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );

    // The laptop's move now works with the new key.
    topo.move_laptop_to_b();
    let at = client.latest().expect("status").verified;
    client.wait_verified_at_least(at + 100_000, Duration::from_secs(20));
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
    drop(srvd2);
}
