//! vnatd starts while offline (issue 16, item 8): a laptop booted with no
//! network has only `lo`, no address and no route. vnatd must start there
//! (and answer `vnatctl status`), not fail or wait for a network; once a
//! link comes up and a connection is made, it pairs with the peer's vnatd
//! and the connection is mobile, with no restart.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use vnat_tests::{veth, EchoServer, Host, Netns, StreamClient, StreamOptions, TempDir, Vnatd};

#[test]
fn vnatd_starts_with_no_network_and_manages_connections_once_online() {
    let laptop = Netns::new("offl");
    let server = Netns::new("offs");
    let (ldir, sdir) = (TempDir::new("offl"), TempDir::new("offs"));
    let lap = Host::new(&laptop, "offl");
    let srv = Host::new(&server, "offs");
    // Nothing but lo: no IPv4 route in the main table (`ip route show`).
    let routes: Vec<_> = laptop
        .routes()
        .into_iter()
        .filter(|r| r.in_main_table() && r.dst.is_ipv4())
        .collect();
    assert!(routes.is_empty(), "the laptop has routes: {routes:?}");
    let lapd = Vnatd::start(&lap, ldir.path());
    let st = lapd.ctl(&["status"]).expect("vnatd answers while offline");
    assert!(
        st["vcmp"]["host_key"]
            .as_str()
            .is_some_and(|k| k.len() == 64),
        "status while offline: {st}"
    );

    // The network comes up.
    veth(&laptop, "eth0", &server, "eth0");
    let (l_ip, s_ip): (IpAddr, IpAddr) =
        ("198.18.7.2".parse().unwrap(), "198.18.7.3".parse().unwrap());
    laptop.add_addr("eth0", l_ip, 24);
    server.add_addr("eth0", s_ip, 24);
    let srvd = Vnatd::start(&srv, sdir.path());
    let addr = SocketAddr::new(s_ip, 5001);
    let _echo = EchoServer::tcp_in(&srv, addr);
    let mut cmd = StreamOptions::tcp(addr).rate(500_000).command(&laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(50_000, Duration::from_secs(10));
    let t = Instant::now();
    while !(lapd.mobile_to("tcp", s_ip) && srvd.mobile_to("tcp", l_ip)) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the connection never became mobile on the vnatd started offline: {}",
            lapd.ctl(&["ls"]).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
}
