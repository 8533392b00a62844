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
    // Paired is not yet mobile: a UDP flow binds in band, a round trip
    // after pairing, and one not bound when its address goes cannot be.
    let name = match proto {
        Proto::Tcp => "tcp",
        Proto::Udp => "udp",
    };
    lapd.wait_mobile_to(name, server.ip());

    let t0 = Instant::now();
    topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    let after = client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    eprintln!(
        "{tag}: data flowing again {:?} after the move",
        t0.elapsed()
    );

    // The protocol's order held: the laptop's TCP waited for the server's
    // SWITCHED, which came (not the 400 ms fallback); UDP waited for nothing.
    let event = |d: &Vnatd, name: &str| {
        d.ctl(&["status"]).expect("vnatd unreachable")["vcmp"]["events"][name]
            .as_u64()
            .unwrap_or(0)
    };
    assert_eq!(
        event(&lapd, "switch_unconfirmed"),
        0,
        "the laptop gave up waiting for the server's SWITCHED"
    );
    match proto {
        Proto::Tcp => {
            assert!(
                event(&srvd, "switched_sent") >= 1,
                "the server sent no SWITCHED"
            );
            assert!(
                event(&lapd, "switch_confirmed") >= 1,
                "the laptop's connection was not released by the server's SWITCHED"
            );
        }
        Proto::Udp => assert_eq!(
            event(&lapd, "switch_confirmed"),
            0,
            "a UDP flow waited for SWITCHED"
        ),
    }

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
    let old_ip = topo.laptop_a_addr.get(family);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let left = |d: &Vnatd| {
            d.ctl(&["status"]).map_or(u64::MAX, |s| {
                s["datapath"]["translations"].as_u64().unwrap_or(u64::MAX)
            })
        };
        let on_lo = topo.laptop.addresses("lo").iter().any(|a| a.addr == old_ip);
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

/// The interfaces vnatd reports tc attached to.
fn tc_ifnames(d: &Vnatd) -> Vec<String> {
    let s = d.ctl(&["status"]).expect("vnatd unreachable");
    let mut names: Vec<String> = s["datapath"]["tc"]
        .as_array()
        .unwrap_or_else(|| panic!("status has no datapath.tc: {s}"))
        .iter()
        .map(|t| t["ifname"].as_str().expect("ifname").to_string())
        .collect();
    names.sort();
    names
}

/// By default (`standby_tc`): once a connection is paired, tc is attached
/// to every interface of both hosts before anything moves (the laptop's
/// unused subnet-B link too), the move works as without it, and when the
/// last paired connection closes the attachments go.
#[test]
fn tc_attaches_ahead_by_default_and_lets_go() {
    tc_attachments("autosb", &[], true);
}

/// `--no-standby-tc`: nothing is attached while nothing moved; the move
/// attaches tc only to the interfaces the moved connection uses.
#[test]
fn no_standby_tc_attaches_only_where_moved() {
    tc_attachments("autons", &["--no-standby-tc"], false);
}

fn tc_attachments(tag: &str, flags: &[&str], ahead: bool) {
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.get(Family::V4), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start_with(&lap, ldir.path(), flags);
    let srvd = Vnatd::start_with(&srv, sdir.path(), flags);
    assert!(
        tc_ifnames(&lapd).is_empty(),
        "tc attached before any connection was paired: {:?}",
        tc_ifnames(&lapd)
    );

    let mut cmd = StreamOptions::tcp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(50_000, Duration::from_secs(10));
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");
    if ahead {
        let mut want_lap = vec![topo.laptop_if_a.clone(), topo.laptop_if_b.clone()];
        want_lap.sort();
        let deadline = Instant::now() + Duration::from_secs(10);
        while tc_ifnames(&lapd) != want_lap || tc_ifnames(&srvd).is_empty() {
            assert!(
                Instant::now() < deadline,
                "standby tc not attached: laptop {:?} (want {want_lap:?}), server {:?}",
                tc_ifnames(&lapd),
                tc_ifnames(&srvd)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    } else {
        // Give a wrongly eager vnatd the time it would take to attach.
        std::thread::sleep(Duration::from_secs(1));
        assert!(
            tc_ifnames(&lapd).is_empty() && tc_ifnames(&srvd).is_empty(),
            "tc attached with --no-standby-tc before anything moved: laptop {:?}, server {:?}",
            tc_ifnames(&lapd),
            tc_ifnames(&srvd)
        );
    }
    assert_eq!(
        lapd.ctl(&["status"]).expect("status")["datapath"]["translations"],
        0,
        "nothing may be translated before the move"
    );

    topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    if !ahead {
        assert_eq!(
            tc_ifnames(&lapd),
            vec![topo.laptop_if_b.clone()],
            "with --no-standby-tc the laptop must attach tc to the link it moved to, and only there"
        );
        assert_eq!(
            tc_ifnames(&srvd).len(),
            1,
            "with --no-standby-tc the server must attach tc to its one link the moved connection uses"
        );
    }
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);

    let deadline = Instant::now() + Duration::from_secs(15);
    while !tc_ifnames(&lapd).is_empty() || !tc_ifnames(&srvd).is_empty() {
        assert!(
            Instant::now() < deadline,
            "tc still attached after the last connection closed: laptop {:?}, server {:?}",
            tc_ifnames(&lapd),
            tc_ifnames(&srvd)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
