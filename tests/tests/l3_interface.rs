//! Interfaces without a link-layer header (issue 16, item 9): a laptop whose
//! new path is a tunnel (a tun device, as wireguard and most VPN clients
//! make, here carried by socat over UDP to the router) moves its live
//! connection onto it. vnatd attaches the L3 translators there (packets
//! start with their IP header) and the stream goes on byte-exact; with the
//! Ethernet translators the rewrite never happens and the connection is
//! lost.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    process::Stdio,
    time::Duration,
};

use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, ProcessGroup, StreamClient, StreamOptions, TempDir, Vnatd,
};

const TUN_ROUTER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
const TUN_LAPTOP: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 2);
const TUN_PORT: u16 = 7000;

/// A point-to-point tun link `vt0` between the laptop and the router,
/// carried over subnet B in UDP.
fn tunnel(topo: &LaptopRouterServer) -> (ProcessGroup, ProcessGroup) {
    topo.plug_laptop_b();
    let end = |ns: &vnat_tests::Netns, udp: String, addr: Ipv4Addr| {
        let mut cmd = ns.cmd("socat");
        cmd.arg(udp)
            .arg(format!("TUN:{addr}/24,tun-name=vt0,tun-type=tun,iff-up"))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        ProcessGroup::spawn(cmd, "socat (tun)")
    };
    // Unconnected UDP at both ends: each opens its tun device at once, and
    // an ICMP error for a datagram that arrived before the other end was
    // bound does not end it (a connected socket reports ECONNREFUSED, and
    // socat exits).
    let (router_b, laptop_b) = (topo.router_b_addr.v4, topo.laptop_b_addr.v4);
    let r = end(
        &topo.router,
        format!("UDP4-DATAGRAM:{laptop_b}:{TUN_PORT},bind={router_b}:{TUN_PORT}"),
        TUN_ROUTER,
    );
    let l = end(
        &topo.laptop,
        format!("UDP4-DATAGRAM:{router_b}:{TUN_PORT},bind={laptop_b}:{TUN_PORT}"),
        TUN_LAPTOP,
    );
    vnat_tests::wait_until(
        Duration::from_secs(10),
        || {
            [&topo.laptop, &topo.router]
                .iter()
                .all(|ns| ns.link("vt0").is_some())
        },
        || "the tun devices did not appear".into(),
    );
    // Send into the tunnel until the router's tun device has received
    // something: both ends are up and the path between them works.
    let received = || -> u64 {
        topo.router
            .link("vt0")
            .and_then(|l| l.rx_packets)
            .unwrap_or(0)
    };
    vnat_tests::wait_until(
        Duration::from_secs(10),
        || {
            let mut probe = topo
                .laptop
                .cmd("socat")
                .args(["-u", "-", &format!("UDP4-SENDTO:{TUN_ROUTER}:9")])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("socat");
            if let Some(mut stdin) = probe.stdin.take() {
                let _ = std::io::Write::write_all(&mut stdin, b"probe");
            }
            let _ = probe.wait();
            std::thread::sleep(Duration::from_millis(100));
            received() > 0
        },
        || "nothing crosses the tunnel".into(),
    );
    (r, l)
}

#[test]
fn a_connection_moves_onto_a_tun_interface() {
    let topo = LaptopRouterServer::builder().tag("l3if").build();
    let lap = Host::new(&topo.laptop, "l3ifl");
    let srv = Host::new(&topo.server, "l3ifs");
    let (ldir, sdir) = (TempDir::new("l3ifl"), TempDir::new("l3ifs"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, ldir.path());
    let _srvd = Vnatd::start(&srv, sdir.path());

    let mut cmd = StreamOptions::tcp(server)
        .rate(200_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(30_000, Duration::from_secs(10));
    vnat_tests::wait_until(
        Duration::from_secs(20),
        || lapd.mobile_to("tcp", server.ip()),
        || "the connection never became mobile".into(),
    );

    // No interface of the laptop lacks a link-layer header yet: vnatd has
    // not paid for verifying the translators of such interfaces.
    assert_eq!(
        l3_programs(&lapd),
        Vec::<String>::new(),
        "the L3 translators were loaded with no interface to use them"
    );

    // The tunnel comes up over B; then A goes away and the default route
    // points into the tunnel: the laptop's address toward the server is now
    // the tun device's.
    let _tunnel = tunnel(&topo);
    let l = &topo.laptop;
    for (a, p) in topo.laptop_a_addr.with_prefixes() {
        l.del_addr(&topo.laptop_if_a, a, p);
    }
    l.link_down(&topo.laptop_if_a);
    l.default_route(IpAddr::V4(TUN_ROUTER), "vt0");

    let moved = client.wait_progress(&before, 200_000, Duration::from_secs(30));
    let ls = lapd.ctl(&["ls", "--state", "translated"]).expect("vnatd");
    let new_local = SocketAddr::new(TUN_LAPTOP.into(), {
        let l: SocketAddr = before.local.parse().expect("local address");
        l.port()
    });
    assert!(
        ls.as_array().is_some_and(|rows| rows
            .iter()
            .any(|r| r["physical_local"] == new_local.to_string())),
        "the connection is not translated to the tun address: {ls}"
    );
    let status = lapd.ctl(&["status"]).expect("vnatd");
    let tc = status["datapath"]["tc"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        tc.iter().any(|a| a["ifname"] == "vt0"),
        "tc is not attached to the tun device: {tc:?}"
    );
    // Loaded when the tun device was first attached.
    assert_eq!(
        l3_programs(&lapd),
        vec![
            "vnat_tc_egress_l3".to_string(),
            "vnat_tc_ingress_l3".to_string()
        ],
        "{status}"
    );
    let counters = &status["datapath"]["counters"];
    assert!(
        counters["egress_translated"].as_u64().unwrap_or(0) > 0
            && counters["ingress_translated"].as_u64().unwrap_or(0) > 0,
        "nothing was translated: {counters}"
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= moved.verified);
}

/// The L3 translators `vnatctl status` lists as loaded, sorted.
fn l3_programs(d: &Vnatd) -> Vec<String> {
    let status = d.ctl(&["status"]).expect("vnatd");
    let mut l3: Vec<String> = status["datapath"]["programs_loaded"]
        .as_array()
        .expect("programs_loaded")
        .iter()
        .filter_map(|p| p.as_str())
        .filter(|p| p.ends_with("_l3"))
        .map(str::to_string)
        .collect();
    l3.sort();
    l3
}

/// A vnatd that starts where an interface without a link-layer header
/// already exists loads the L3 translators at once: a move onto that
/// interface must not wait for the verifier.
#[test]
fn the_l3_translators_load_at_start_where_such_an_interface_exists() {
    let topo = LaptopRouterServer::builder().tag("l3st").build();
    let lap = Host::new(&topo.laptop, "l3stl");
    let dir = TempDir::new("l3stl");
    let out = topo
        .laptop
        .cmd("ip")
        .args(["tuntap", "add", "dev", "vt1", "mode", "tun"])
        .output()
        .expect("running ip tuntap");
    assert!(
        out.status.success(),
        "ip tuntap add: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A persistent tun device is not removed with its namespace.
    struct DelOnDrop<'a>(&'a vnat_tests::Netns);
    impl Drop for DelOnDrop<'_> {
        fn drop(&mut self) {
            let _ = self.0.cmd("ip").args(["link", "del", "vt1"]).status();
        }
    }
    let _vt1 = DelOnDrop(&topo.laptop);
    let lapd = Vnatd::start(&lap, dir.path());
    assert_eq!(
        l3_programs(&lapd),
        vec![
            "vnat_tc_egress_l3".to_string(),
            "vnat_tc_ingress_l3".to_string()
        ]
    );
}
