//! The local user (issue 16, item 1): an unprivileged user (uid 65534)
//! binds a UDP socket with IP_FREEBIND to an address the host does not have
//! and sends one datagram to a peer vnatd is paired with. vnatd runs as
//! root; if it took that flow for a connection whose address vanished, it
//! would put the address on `lo` and route it, and the user's freebind
//! listener would receive other users' connections to it. The flow is
//! recorded but never managed: `ls` says why, `lo` gets nothing.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    process::Stdio,
    time::{Duration, Instant},
};

use netlink_packet_route::route::RouteProtocol;
use vnat_tests::{
    bin_path, EchoServer, Family, Host, LaptopRouterServer, ProcessGroup, StreamClient,
    StreamOptions, TempDir, Vnatd,
};

fn freebind_sender_cannot_make_vnatd_claim_an_address(family: Family, tag: &str) {
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
    let server_ip = topo.server_addr.get(family);
    let tcp = SocketAddr::new(server_ip, 5001);
    let udp = SocketAddr::new(server_ip, 5002);
    let _echo = EchoServer::tcp_in(&srv, tcp);
    let _uecho = EchoServer::udp_in(&srv, udp);
    let lapd = Vnatd::start(&lap, ldir.path());
    let _srvd = Vnatd::start(&srv, sdir.path());
    // A real connection, so that the server is a paired peer.
    let mut cmd = StreamOptions::tcp(tcp).rate(100_000).command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(20_000, Duration::from_secs(10));
    lapd.wait_paired("the laptop's vnatd");

    // An address on the laptop's own subnet that no interface has.
    let fake: IpAddr = match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::new(198, 18, 1, 77)),
        Family::V6 => {
            let mut s = topo.laptop_a_addr.v6().segments();
            s[7] = 0x77;
            IpAddr::V6(Ipv6Addr::from(s))
        }
    };
    let mut cmd = topo.laptop.cmd(bin_path("vnat-freebind"));
    cmd.args([
        "--bind",
        &SocketAddr::new(fake, 40077).to_string(),
        "--to",
        &udp.to_string(),
        "--uid",
        "65534",
        "--hold-secs",
        "30",
    ])
    .stdout(Stdio::null());
    lap.cgroup.join_on_spawn(&mut cmd);
    let _sender = ProcessGroup::spawn(cmd, "vnat-freebind");

    // The kernel records the flow; vnatd lists it as not mobile, and why.
    let deadline = Instant::now() + Duration::from_secs(10);
    let row = loop {
        let ls = lapd.ctl(&["ls", "--proto", "udp"]).expect("laptop ls");
        let found = ls.as_array().expect("array").iter().find(|r| {
            r["virtual_local"]
                .as_str()
                .and_then(|a| a.parse::<SocketAddr>().ok())
                .is_some_and(|a| a.ip() == fake)
        });
        // (Before vnatd's first look at it, it is "not managed" in general.)
        if let Some(r) = found.filter(|r| {
            r["why_not_mobile"]
                .as_str()
                .is_some_and(|w| w.contains("not one of this host's"))
        }) {
            break r.clone();
        }
        assert!(
            Instant::now() < deadline,
            "the freebind flow was not listed as refused: {ls}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(row["mobile"], false, "{row}");
    // Give automatic mode several turns: nothing is claimed or routed.
    std::thread::sleep(Duration::from_secs(3));
    let lo = topo.laptop.addresses("lo");
    assert!(
        !lo.iter().any(|a| a.addr == fake),
        "vnatd put the user's freebind address on lo: {lo:?}"
    );
    // Protocol 157 (vnat's), in any table, of either family, but for the
    // last-resort routes of the real connection's address (kept local
    // while it is mobile): none; and no rule names the user's address.
    let routes: Vec<_> = topo
        .laptop
        .routes()
        .into_iter()
        .filter(|r| r.protocol == RouteProtocol::from(157) && r.table != 0x766e_ffff)
        .collect();
    assert!(routes.is_empty(), "vnatd added routes: {routes:?}");
    let rules = topo.laptop.rules();
    assert!(
        !rules.iter().any(|r| r.src == Some(fake)),
        "vnatd routes the user's address: {rules:?}"
    );
    let status = lapd.ctl(&["status"]).expect("status");
    assert_eq!(
        status["datapath"]["translations"].as_u64(),
        Some(0),
        "vnatd translated something: {status}"
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "the real connection broke: {:?}", fin.json);
}

#[test]
fn freebind_v4() {
    freebind_sender_cannot_make_vnatd_claim_an_address(Family::V4, "fbv4");
}

#[test]
fn freebind_v6() {
    freebind_sender_cannot_make_vnatd_claim_an_address(Family::V6, "fbv6");
}
