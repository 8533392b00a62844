//! Moves into and out of a NAT (issue 32, item 2): a laptop with a live
//! connection on a network with routed public addresses (a campus, an
//! office: subnet A here) goes home behind a NAT (subnet B, nftables source
//! NAT on the router, port-preserving or `fully-random`), and back.
//!
//! Behind the NAT the laptop's update names its private address, which the
//! server cannot reach, and comes from the NAT's public one. The laptop was
//! not behind a NAT before, so the server cannot tell from the names alone
//! a NAT from a host that sends its VCMP from another interface than the
//! connection's (`vnatctl migrate`): it challenges both, and takes the NAT's
//! address (its port learned from the laptop's BIND) only when the named
//! one does not answer. The application's socket stays the same and every
//! byte arrives, TCP and UDP.

use std::{net::SocketAddr, time::Duration};

use vnat_tests::{
    nat_router_b_only, EchoServer, Host, LaptopRouterServer, NatPorts, StreamClient,
    StreamOptions, TempDir, Vnatd, NAT_PUBLIC_B,
};

/// Whether `d` lists a mobile `proto` connection with an end at `port`.
fn mobile_on(d: &Vnatd, proto: &str, port: u16) -> bool {
    let suffix = format!(":{port}");
    d.ctl(&["ls", "--proto", proto])
        .and_then(|v| v.as_array().cloned())
        .is_some_and(|rows| {
            rows.iter().any(|r| {
                r["mobile"] == true
                    && [&r["virtual_local"], &r["virtual_remote"]]
                        .iter()
                        .any(|a| a.as_str().is_some_and(|a| a.ends_with(&suffix)))
            })
        })
}

fn wait_for(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Where the server sends its connections at port 5001 now (their
/// physical remotes; a UDP socket may have records of old peers too).
fn server_sends_to(srvd: &Vnatd, proto: &str) -> Vec<String> {
    srvd.ctl(&["ls", "--proto", proto])
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|r| {
            r["virtual_local"]
                .as_str()
                .is_some_and(|l| l.ends_with(":5001"))
        })
        .filter_map(|r| r["physical_remote"].as_str().map(String::from))
        .collect()
}

fn into_a_nat_and_back(tag: &str, ports: NatPorts, proto: &str) {
    let topo = LaptopRouterServer::builder().tag(tag).build();
    nat_router_b_only(&topo, ports).unwrap_or_else(|e| panic!("{e}"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = if proto == "tcp" {
        EchoServer::tcp_in(&srv, server)
    } else {
        EchoServer::udp_in(&srv, server)
    };
    let lapd = Vnatd::start_with(&lap, ldir.path(), &["--keepalive-secs", "1"]);
    let srvd = Vnatd::start(&srv, sdir.path());
    let opts = if proto == "tcp" {
        StreamOptions::tcp(server)
    } else {
        StreamOptions::udp(server)
    };
    let mut cmd = opts.rate(100_000).command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(20_000, Duration::from_secs(10));
    wait_for(
        &format!("{tag}: the {proto} connection never became mobile on the laptop"),
        30,
        || mobile_on(&lapd, proto, 5001),
    );
    wait_for(
        &format!("{tag}: the {proto} connection never became mobile on the server"),
        30,
        || mobile_on(&srvd, proto, 5001),
    );
    let before = client.latest().expect("status");

    // Home, behind the NAT.
    topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    let to = server_sends_to(&srvd, proto);
    assert!(
        to.iter()
            .any(|a| a.starts_with(&format!("{NAT_PUBLIC_B}:"))),
        "{tag}: the server does not send to the NAT's address: {to:?}"
    );

    // Back to the routed network.
    topo.move_laptop_to_a();
    let at_back = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_back + 100_000, Duration::from_secs(20));

    let fin = client.stop();
    assert_eq!(fin.error, None, "{tag}: the stream broke: {:?}", fin.json);
    assert_eq!(
        fin.local, before.local,
        "{tag}: the client's socket changed"
    );
    drop(lapd);
}

#[test]
fn tcp_moves_from_a_routed_address_into_a_port_preserving_nat_and_back() {
    into_a_nat_and_back("nein", NatPorts::Preserving, "tcp");
}

#[test]
fn tcp_moves_from_a_routed_address_into_a_fully_random_nat_and_back() {
    into_a_nat_and_back("neir", NatPorts::FullyRandom, "tcp");
}

#[test]
fn udp_moves_from_a_routed_address_into_a_fully_random_nat_and_back() {
    into_a_nat_and_back("neur", NatPorts::FullyRandom, "udp");
}
