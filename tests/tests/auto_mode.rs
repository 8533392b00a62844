//! Automatic mode with real daemons: vnatd on the laptop and on the server
//! pair when they share a connection; when the laptop changes subnet, the
//! laptop's vnatd notices (rtnetlink), and the two daemons move the
//! connection over VCMP with no command. The same socket carries on,
//! byte-exact, with no reset.

mod support;

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use vnat_daemon::datapath::Proto;
use vnat_tests::{
    EchoServer, Family, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

fn roam_automatically(family: Family, proto: Proto, tag: &str) {
    let topo = LaptopRouterServer::builder()
        .tag(tag)
        .ipv6(family == Family::V6)
        .build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.get(family), 5001);
    // Inside the server host's cgroup, so its vnatd records the accepted side.
    let _echo = match proto {
        Proto::Tcp => EchoServer::tcp_in(&srv, server),
        Proto::Udp => EchoServer::udp_in(&srv, server),
    };
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());

    let opts = match proto {
        Proto::Tcp => StreamOptions::tcp(server),
        Proto::Udp => StreamOptions::udp(server),
    }
    .rate(300_000);
    let mut cmd = opts.command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");

    let t0 = Instant::now();
    topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    let after = client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    eprintln!(
        "{tag}: data flowing again {:?} after the move",
        t0.elapsed()
    );

    let new_local = SocketAddr::new(
        topo.laptop_b_addr.get(family),
        before.local.parse::<SocketAddr>().unwrap().port(),
    );
    let ls = lapd
        .ctl(&["ls", "--state", "translated"])
        .expect("laptop vnatd unreachable");
    let rows = ls.as_array().expect("array");
    assert!(
        rows.iter()
            .any(|r| r["virtual_local"] == before.local
                && r["physical_local"] == new_local.to_string()),
        "the laptop's vnatd does not show the moved connection: {ls}"
    );
    let ls = srvd
        .ctl(&["ls", "--state", "translated"])
        .expect("server vnatd unreachable");
    assert!(
        ls.as_array()
            .unwrap()
            .iter()
            .any(|r| r["physical_remote"] == new_local.to_string()),
        "the server's vnatd does not translate to the laptop's new address: {ls}"
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= after.verified);

    // Once the connection is closed its translations go, with the laptop's
    // old address on lo. (A UDP echo keeps its socket open after the client
    // leaves: socat's per-peer child lives 600 s, so the server's side of a
    // UDP flow rightly stays translated.)
    let old_ip = topo.laptop_a_addr.get(family).to_string();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let left = |d: &Vnatd| {
            d.ctl(&["status"]).map_or(u64::MAX, |s| {
                s["datapath"]["translations"].as_u64().unwrap_or(u64::MAX)
            })
        };
        let on_lo = topo
            .laptop
            .run_stdout(&["ip", "addr", "show", "dev", "lo"])
            .contains(&format!("{old_ip}/"));
        let server_done = proto == Proto::Udp || left(&srvd) == 0;
        if left(&lapd) == 0 && server_done && !on_lo {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "translations left after the connection closed: laptop {}, server {}, old address on lo: {on_lo}",
            left(&lapd),
            left(&srvd)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn tcp_v4_automatic() {
    roam_automatically(Family::V4, Proto::Tcp, "autot4");
}

#[test]
fn tcp_v6_automatic() {
    roam_automatically(Family::V6, Proto::Tcp, "autot6");
}

#[test]
fn udp_v4_automatic() {
    roam_automatically(Family::V4, Proto::Udp, "autou4");
}
