//! Virtual-address conflicts (the paper's section 3.4.3; issue 18 item
//! 4). The laptop is on links A and B at once and has two connections to
//! the server's port 5001 from the same local port P: X from A:P and Y from
//! B:P. Migrating X to B would give it Y's endpoints, which the kernels at
//! both ends could not tell apart. By default the move is refused with a
//! sentence that says why, and both connections go on untouched; with the
//! laptop's cgroup in `preempt_cgroups`, the older of the two (by the
//! connection's age, issue 32 item 4) is reset: Y, opened first, and X
//! moves to B and goes on; or X, opened first, and Y goes on untouched.
//! And the same for connections the laptop accepted (the laptop serving,
//! the other host connecting twice from one port): the policy of the
//! listener's cgroup applies to them, and `ls` shows that cgroup.

mod support;

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_tests::{
    EchoServer, Family, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

/// Metric of the second default route, via B.
const B_METRIC: u32 = 2000;

/// The laptop's row of the connection from `local`, once mobile.
fn mobile_row(d: &Vnatd, local: SocketAddr) -> Value {
    d.wait_ls_row(
        &["ls", "--proto", "tcp"],
        &format!("the connection from {local} never became mobile"),
        |r| r["virtual_local"] == local.to_string() && r["mobile"] == true,
    )
}

/// Which connection is reset, if any.
#[derive(Clone, Copy, PartialEq)]
enum Policy {
    Abort,
    /// Preempt, Y opened first (X is the newer, moving one).
    PreemptYOlder,
    /// Preempt, X opened first (the moving one is the older).
    PreemptXOlder,
}

fn conflict(tag: &str, policy: Policy) {
    let preempt = policy != Policy::Abort;
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
    let server = SocketAddr::new(topo.server_addr.get(Family::V4), 5001);
    let (a, b): (IpAddr, IpAddr) = (
        topo.laptop_a_addr.get(Family::V4),
        topo.laptop_b_addr.get(Family::V4),
    );
    let _echo = EchoServer::tcp_in(&srv, server);
    let cgroup = lap.cgroup.path().display().to_string();
    let lapd = if preempt {
        Vnatd::start_with(&lap, dl.path(), &["--preempt-cgroup", &cgroup])
    } else {
        Vnatd::start(&lap, dl.path())
    };
    let _srvd = Vnatd::start(&srv, ds.path());

    let stream = |opts: StreamOptions| {
        let mut cmd = opts.rate(200_000).command(lap.ns);
        lap.cgroup.join_on_spawn(&mut cmd);
        StreamClient::from_command(cmd)
    };
    // The older one opened first, with a port of the kernel's choice; the
    // other on the other address with the same port.
    let (x, y, x_local, y_local) = if policy == Policy::PreemptYOlder {
        let y = stream(StreamOptions::tcp(server).bind(b));
        let ys = y.wait_verified_at_least(50_000, Duration::from_secs(15));
        let y_local: SocketAddr = ys.local.parse().expect("Y's local endpoint");
        let x_local = SocketAddr::new(a, y_local.port());
        let x = stream(StreamOptions::tcp(server).bind_to(x_local));
        let xs = x.wait_verified_at_least(50_000, Duration::from_secs(15));
        assert_eq!(xs.local, x_local.to_string(), "X uses A with Y's port");
        (x, y, x_local, y_local)
    } else {
        let x = stream(StreamOptions::tcp(server).bind(a));
        let xs = x.wait_verified_at_least(50_000, Duration::from_secs(15));
        let x_local: SocketAddr = xs.local.parse().expect("X's local endpoint");
        let y_local = SocketAddr::new(b, x_local.port());
        let y = stream(StreamOptions::tcp(server).bind_to(y_local));
        let ys = y.wait_verified_at_least(50_000, Duration::from_secs(15));
        assert_eq!(ys.local, y_local.to_string(), "Y uses B with X's port");
        (x, y, x_local, y_local)
    };
    let row = mobile_row(&lapd, x_local);
    mobile_row(&lapd, y_local);
    let id = row["id"].to_string();

    let b_str = b.to_string();
    let (code, out) = lapd.ctl_status(&[
        "migrate",
        "--conn",
        &id,
        "--to",
        &b_str,
        "--wait",
        "--timeout",
        "10",
    ]);
    if !preempt {
        // Refused with the reason; nothing changed.
        assert_ne!(code, 0, "a refused migration must fail: {out}");
        let text = out.to_string();
        assert!(
            text.contains("another connection of this host") && text.contains("preempt_cgroups"),
            "the refusal does not say why or what to do: {out}"
        );
        let now = mobile_row(&lapd, x_local);
        assert_eq!(now["physical_local"], x_local.to_string(), "X moved: {now}");
        for (c, what) in [(&x, "X"), (&y, "Y")] {
            let at = c.latest().expect("status").verified;
            c.wait_verified_at_least(at + 100_000, Duration::from_secs(15));
            assert_eq!(
                c.wait_error(Duration::from_millis(10)),
                None,
                "{what} broke"
            );
        }
        let (fx, fy) = (x.stop(), y.stop());
        assert_eq!(fx.error, None, "X: {:?}", fx.json);
        assert_eq!(fy.error, None, "Y: {:?}", fy.json);
        return;
    }
    if policy == Policy::PreemptXOlder {
        // X, the older, is reset: its move ends there, and Y, the newer,
        // goes on untouched.
        assert_ne!(code, 0, "the reset X cannot have moved: {out}");
        let text = out.to_string();
        assert!(
            text.contains("older") && text.contains("reset"),
            "the outcome does not say X was reset as the older: {out}"
        );
        let err = x.wait_error(Duration::from_secs(5));
        assert!(err.is_some(), "X, the older, was not reset: {out}");
        let at = y.latest().expect("status").verified;
        y.wait_verified_at_least(at + 200_000, Duration::from_secs(20));
        let fy = y.stop();
        assert_eq!(fy.error, None, "Y, the newer, broke: {:?}", fy.json);
        assert_eq!(fy.local, y_local.to_string(), "Y's socket changed");
        return;
    }
    // Preempt: Y is reset, X moves to B and goes on there.
    assert_eq!(code, 0, "migrate failed: {out}");
    assert_eq!(out["moves"][0]["outcome"], "moved", "{out}");
    assert_eq!(out["moves"][0]["to"], y_local.to_string(), "{out}");
    // SOCK_DESTROY aborts the socket (ECONNABORTED, or whatever the
    // stream's other thread saw first) and it is gone from the laptop.
    let err = y.wait_error(Duration::from_secs(5));
    assert!(err.is_some(), "Y was not reset");
    let deadline = Instant::now() + Duration::from_secs(5);
    while lapd
        .ctl(&["ls", "--proto", "tcp"])
        .unwrap_or_default()
        .as_array()
        .is_some_and(|rows| {
            rows.iter()
                .any(|r| r["virtual_local"] == y_local.to_string())
        })
    {
        assert!(
            Instant::now() < deadline,
            "Y's socket is still there ({err:?})"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let at = x.latest().expect("status").verified;
    x.wait_verified_at_least(at + 200_000, Duration::from_secs(20));
    let now = mobile_row(&lapd, x_local);
    assert_eq!(now["physical_local"], y_local.to_string(), "{now}");
    let fx = x.stop();
    assert_eq!(fx.error, None, "X: {:?}", fx.json);
    assert_eq!(fx.local, x_local.to_string(), "X's socket changed");
}

#[test]
fn a_migration_onto_another_connections_endpoints_is_refused_by_default() {
    conflict("cfa", Policy::Abort);
}

#[test]
fn a_preempting_cgroup_resets_the_older_connection_and_moves() {
    conflict("cfp", Policy::PreemptYOlder);
}

#[test]
fn a_preempting_cgroup_resets_the_moving_connection_when_it_is_the_older() {
    conflict("cfo", Policy::PreemptXOlder);
}

/// The laptop serves on port 5001 on both links; the other host connects
/// from one port P to A:5001 (X, first) and to B:5001 (Y). Migrating Y's
/// end to A would give it X's endpoints. The laptop's cgroup, where its
/// echo server runs, preempts: the accepted connections are under it, so
/// X, the older, is reset and Y moves.
#[test]
fn accepted_connections_are_under_their_cgroups_policy() {
    let tag = "cfs";
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
    let (a, b): (IpAddr, IpAddr) = (
        topo.laptop_a_addr.get(Family::V4),
        topo.laptop_b_addr.get(Family::V4),
    );
    let client_ip = topo.server_addr.get(Family::V4);
    let _echo = EchoServer::tcp_in(&lap, SocketAddr::new("0.0.0.0".parse().unwrap(), 5001));
    let cgroup = lap.cgroup.path().display().to_string();
    let lapd = Vnatd::start_with(&lap, dl.path(), &["--preempt-cgroup", &cgroup]);
    let _srvd = Vnatd::start(&srv, ds.path());
    let from = SocketAddr::new(client_ip, 40000 + (std::process::id() % 20000) as u16);
    let stream = |to: IpAddr| {
        let opts = StreamOptions::tcp(SocketAddr::new(to, 5001)).bind_to(from);
        let mut cmd = opts.rate(200_000).command(srv.ns);
        srv.cgroup.join_on_spawn(&mut cmd);
        StreamClient::from_command(cmd)
    };
    let x = stream(a);
    x.wait_verified_at_least(50_000, Duration::from_secs(15));
    let y = stream(b);
    y.wait_verified_at_least(50_000, Duration::from_secs(15));
    let (x_here, y_here) = (SocketAddr::new(a, 5001), SocketAddr::new(b, 5001));
    let xrow = mobile_row(&lapd, x_here);
    let yrow = mobile_row(&lapd, y_here);
    let listed = lap.cgroup.path().display().to_string();
    for (row, what) in [(&xrow, "X"), (&yrow, "Y")] {
        assert_ne!(
            row["cgroup_id"], 0,
            "{what}, accepted, has no cgroup: {row}"
        );
        assert!(
            row["cgroup"]
                .as_str()
                .is_some_and(|c| listed.ends_with(c) && c.len() > 1),
            "{what}, accepted, is not listed in its listener's cgroup {listed}: {row}"
        );
    }
    let id = yrow["id"].to_string();
    let a_str = a.to_string();
    let (code, out) = lapd.ctl_status(&[
        "migrate",
        "--conn",
        &id,
        "--to",
        &a_str,
        "--wait",
        "--timeout",
        "10",
    ]);
    assert_eq!(code, 0, "the accepted connection did not preempt: {out}");
    assert_eq!(out["moves"][0]["outcome"], "moved", "{out}");
    let err = x.wait_error(Duration::from_secs(5));
    assert!(err.is_some(), "X, the older, was not reset");
    let at = y.latest().expect("status").verified;
    y.wait_verified_at_least(at + 200_000, Duration::from_secs(20));
    let fy = y.stop();
    assert_eq!(fy.error, None, "Y: {:?}", fy.json);
}
