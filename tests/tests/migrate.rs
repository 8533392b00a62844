//! `vnatctl migrate`: a multihomed laptop (links A and B both up, a default
//! route on each, A's preferred, as a network manager sets them) moves one
//! live TCP connection to B while A stays up; another connection stays on
//! A. Then the router's side of A goes dark, and the migrated connection
//! goes on through B: same socket, content verified. IPv4 by address
//! (`--to`), IPv6 by interface (`--dev`). And what migrate refuses, each
//! with a sentence that says why, changing nothing.

mod support;

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_tests::{
    EchoServer, Family, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

/// Metric of the second default route, via B (A's has the kernel's
/// default: 0 for IPv4, 1024 for IPv6).
const B_METRIC: u32 = 2000;

fn multihomed(tag: &str, ipv6: bool, route_via_b: bool) -> LaptopRouterServer {
    let topo = LaptopRouterServer::builder().tag(tag).ipv6(ipv6).build();
    topo.plug_laptop_b();
    if route_via_b {
        let l = &topo.laptop;
        l.add_default_route_metric(topo.router_b_addr.v4.into(), &topo.laptop_if_b, B_METRIC);
        if ipv6 {
            l.add_default_route_metric(topo.router_b_addr.v6().into(), &topo.laptop_if_b, B_METRIC);
        }
    }
    topo
}

fn stream(lap: &Host, to: SocketAddr) -> StreamClient {
    let mut cmd = StreamOptions::tcp(to).rate(200_000).command(lap.ns);
    lap.cgroup.join_on_spawn(&mut cmd);
    StreamClient::from_command(cmd)
}

/// The laptop's `ls` row of the connection to `server`, once mobile.
fn mobile_row(d: &Vnatd, server: SocketAddr) -> Value {
    d.wait_ls_row(
        &["ls", "--proto", "tcp"],
        &format!("the connection to {server} never became mobile"),
        |r| r["virtual_remote"] == server.to_string() && r["mobile"] == true,
    )
}

fn row_by_id(d: &Vnatd, id: &str) -> Value {
    let ls = d.ctl(&["ls"]).unwrap_or_default();
    ls.as_array()
        .and_then(|rows| {
            rows.iter()
                .find(|r| r["id"] == id.parse::<u64>().unwrap_or(0))
                .cloned()
        })
        .unwrap_or_else(|| panic!("no connection {id} in {ls}"))
}

/// `vnatctl --json ARGS` that must fail: its exit status and error object.
fn ctl_refused(d: &Vnatd, args: &[&str]) -> (i32, Value) {
    let (code, v) = d.ctl_status(args);
    assert_ne!(code, 0, "vnatctl {args:?} should have failed, printed {v}");
    (code, v)
}

fn migrate_then_the_old_link_goes_dark(tag: &str, family: Family) {
    let ipv6 = family == Family::V6;
    let topo = multihomed(tag, ipv6, true);
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server_ip = topo.server_addr.get(family);
    let (a, b) = (
        topo.laptop_a_addr.get(family),
        topo.laptop_b_addr.get(family),
    );
    let moving_to = SocketAddr::new(server_ip, 5001);
    let staying_to = SocketAddr::new(server_ip, 5002);
    let _e1 = EchoServer::tcp_in(&srv, moving_to);
    let _e2 = EchoServer::tcp_in(&srv, staying_to);
    let lapd = Vnatd::start(&lap, dl.path());
    let srvd = Vnatd::start(&srv, ds.path());
    let moving = stream(&lap, moving_to);
    let staying = stream(&lap, staying_to);
    moving.wait_verified_at_least(50_000, Duration::from_secs(15));
    staying.wait_verified_at_least(50_000, Duration::from_secs(15));
    let row = mobile_row(&lapd, moving_to);
    mobile_row(&lapd, staying_to);
    assert_eq!(
        row["physical_local"]
            .as_str()
            .map(|s| s.parse::<SocketAddr>().unwrap().ip()),
        Some(a)
    );
    let id = row["id"].to_string();

    let target: Vec<String> = if ipv6 {
        vec!["--dev".into(), topo.laptop_if_b.clone()]
    } else {
        vec!["--to".into(), b.to_string()]
    };
    let mut args = vec!["migrate", "--conn", &id, "--wait"];
    args.extend(target.iter().map(String::as_str));
    let out = lapd.ctl(&args).expect("vnatd answers");
    let moved = &out["moves"][0];
    assert_eq!(moved["outcome"], "moved", "migrate --wait: {out}");
    let port = moving
        .latest()
        .expect("status")
        .local
        .parse::<SocketAddr>()
        .unwrap()
        .port();
    let new_local = SocketAddr::new(b, port).to_string();
    assert_eq!(moved["to"], new_local, "{out}");

    // The laptop shows the new physical endpoint; the other connection
    // stayed where it was.
    let now = row_by_id(&lapd, &id);
    assert_eq!(now["physical_local"], new_local, "{now}");
    assert_eq!(now["state"], "translated", "{now}");
    let other = mobile_row(&lapd, staying_to);
    assert_eq!(
        other["physical_local"]
            .as_str()
            .map(|s| s.parse::<SocketAddr>().unwrap().ip()),
        Some(a),
        "the connection not selected moved too: {other}"
    );
    assert_eq!(other["state"], "native", "{other}");
    // The server sends the migrated one to B.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (to_b, ls) = srvd.sending_to(b);
        if to_b == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the server does not send to {b}: {ls}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let fin = staying.stop();
    assert_eq!(
        fin.error, None,
        "the connection left on A broke: {:?}",
        fin.json
    );

    // Its packets are routed by B's route, by a rule of its own.
    let rules = topo.laptop.rules();
    assert_eq!(
        rules.iter().filter(|r| per_connection(r)).count(),
        1,
        "one rule for the migrated connection: {rules:?}"
    );

    // A goes dark at the router: only B carries anything now.
    topo.router.link_down(&topo.router_if_a);
    let at = moving.latest().expect("status").verified;
    moving.wait_verified_at_least(at + 200_000, Duration::from_secs(20));
    // Nothing made automatic mode take it back to A while A was up.
    assert_eq!(row_by_id(&lapd, &id)["physical_local"], new_local);
    let before = row["virtual_local"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let fin = moving.stop();
    assert_eq!(
        fin.error, None,
        "the migrated connection broke: {:?}",
        fin.json
    );
    assert_eq!(fin.local, before, "the socket changed");

    // Closed: the rule and route that sent it by B go with it.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rules: Vec<_> = topo
            .laptop
            .rules()
            .into_iter()
            .filter(per_connection)
            .collect();
        let routes: Vec<_> = topo
            .laptop
            .routes()
            .into_iter()
            .filter(|r| {
                r.table >= VIA_TABLE_BASE
                    && r.table != FALLBACK_TABLE
                    && u8::from(r.protocol) == VNAT_PROTO
            })
            .collect();
        if rules.is_empty() && routes.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "vnat's rules {rules:?} and routes {routes:?} stayed after the connection closed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// vnat's routes, rules and `lo` addresses carry this protocol number.
const VNAT_PROTO: u8 = 157;
/// vnat's per-interface tables for migrated connections start here.
const VIA_TABLE_BASE: u32 = 0x766e_0000;
/// vnat's table of last-resort routes (for the addresses it keeps local).
const FALLBACK_TABLE: u32 = 0x766e_ffff;

/// One of vnat's per-connection rules (not a last-resort one).
fn per_connection(r: &vnat_tests::Rule) -> bool {
    r.protocol == VNAT_PROTO && r.table >= VIA_TABLE_BASE && r.table != FALLBACK_TABLE
}

#[test]
fn ipv4_connection_migrated_by_address_survives_its_old_link_going_dark() {
    migrate_then_the_old_link_goes_dark("mig4", Family::V4);
}

#[test]
fn ipv6_connection_migrated_by_interface_survives_its_old_link_going_dark() {
    migrate_then_the_old_link_goes_dark("mig6", Family::V6);
}

#[test]
fn what_migrate_refuses_it_says_and_changes_nothing() {
    let tag = "migx";
    // No route through B: a move there could only be lost.
    let topo = multihomed(tag, false, false);
    let lap = Host::new(&topo.laptop, "migxl");
    let srv = Host::new(&topo.server, "migxs");
    let (dl, ds) = (TempDir::new("migxl"), TempDir::new("migxs"));
    let to = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, to);
    let lapd = Vnatd::start(&lap, dl.path());
    let _srvd = Vnatd::start(&srv, ds.path());
    let client = stream(&lap, to);
    client.wait_verified_at_least(20_000, Duration::from_secs(15));
    let row = mobile_row(&lapd, to);
    let id = row["id"].to_string();
    let a = IpAddr::from(topo.laptop_a_addr.v4).to_string();
    let b = IpAddr::from(topo.laptop_b_addr.v4).to_string();

    let cases: [(&[&str], &str); 5] = [
        (&["--to", "203.0.113.9"], "not a global address"),
        (&["--to", "127.0.0.1"], "not a global address"),
        (&["--dev", "nosuch0"], "no interface"),
        (&["--to", &a], "already"),
        (&["--to", &b], "leaves through"),
    ];
    for (target, says) in cases {
        let mut args = vec!["migrate", "--conn", &id];
        args.extend_from_slice(target);
        let (code, err) = ctl_refused(&lapd, &args);
        assert_eq!(code, 1, "{args:?}: {err}");
        let msg = err["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(says), "{args:?}: expected {says:?} in {err}");
        let now = row_by_id(&lapd, &id);
        assert_eq!(
            now["physical_local"], row["physical_local"],
            "{args:?} changed it: {now}"
        );
        assert_eq!(
            now["moving"], false,
            "{args:?} left a move under way: {now}"
        );
    }
    // A connection id that does not exist, and no place at all.
    let (code, err) = ctl_refused(&lapd, &["migrate", "--conn", "424242", "--dev", "wb"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("no connection has id"),
        "{err}"
    );
    let (code, _) = ctl_refused(&lapd, &["migrate", "--all"]);
    assert_eq!(code, 2, "a missing --to/--dev is a usage error");

    let at = client.latest().expect("status").verified;
    client.wait_verified_at_least(at + 50_000, Duration::from_secs(10));
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
}
