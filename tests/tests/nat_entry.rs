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
    nat_router_b_only, nat_router_with, port_forward_mapped, EchoServer, Host, LaptopRouterServer,
    NatPorts, StreamClient, StreamOptions, TempDir, Vnatd, NAT_PUBLIC_B, SERVER_PUBLIC,
};

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
        || lapd.mobile_on(proto, 5001),
    );
    wait_for(
        &format!("{tag}: the {proto} connection never became mobile on the server"),
        30,
        || srvd.mobile_on(proto, 5001),
    );
    let before = client.latest().expect("status");

    // Home, behind the NAT.
    topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    // One flow at the server, sent to the NAT's address: the laptop's
    // datagrams that came from the NAT before the server took it did not
    // reach the echo server as a new peer's (which serves each on a socket
    // of its own, recorded as another flow).
    let to = server_sends_to(&srvd, proto);
    assert!(
        to.len() == 1 && to[0].starts_with(&format!("{NAT_PUBLIC_B}:")),
        "{tag}: the server's {proto} flows at port 5001 do not go to the NAT's address alone: {to:?}"
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

/// UDP through a port forward that changes the port (issue 32, item 2):
/// the server sits behind a router that forwards its public address's
/// port 8053 to the server's own port 53 (and VCMP's 2031). The laptop
/// names the flow's server end `SERVER_PUBLIC:8053`, the server names it
/// by its own address and port 53. The flow is bound (in-band BIND) and
/// moves with the laptop, same socket, every datagram verified: from its
/// routed network into a NAT and back, or (`from_a_nat`) from one NAT to
/// another and back.
fn udp_through_a_port_forward(tag: &str, from_a_nat: bool) {
    let topo = LaptopRouterServer::builder().tag(tag).build();
    if from_a_nat {
        nat_router_with(&topo, NatPorts::FullyRandom)
    } else {
        nat_router_b_only(&topo, NatPorts::FullyRandom)
    }
    .unwrap_or_else(|e| panic!("{e}"));
    port_forward_mapped(&topo, &[], &[(8053, 53), (2031, 2031)]).unwrap_or_else(|e| panic!("{e}"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let _echo = EchoServer::udp_in(&srv, SocketAddr::new(topo.server_addr.v4.into(), 53));
    let lapd = Vnatd::start_with(&lap, ldir.path(), &["--keepalive-secs", "1"]);
    let srvd = Vnatd::start(&srv, sdir.path());
    let mut cmd = StreamOptions::udp(SocketAddr::new(SERVER_PUBLIC.into(), 8053))
        .rate(100_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(20_000, Duration::from_secs(10));
    wait_for(
        &format!("{tag}: the flow to {SERVER_PUBLIC}:8053 never became mobile on the laptop"),
        30,
        || lapd.mobile_on("udp", 8053),
    );
    wait_for(
        &format!("{tag}: the flow to port 53 never became mobile on the server"),
        30,
        || srvd.mobile_on("udp", 53),
    );
    let before = client.latest().expect("status");

    topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    // The server's application still talks to the laptop on its one
    // socket for the flow (a datagram from an address it did not know
    // would have reached its listener, which serves it on a new one), and
    // the server sends the flow to the NAT.
    let rows = flows_at(&srvd, 53);
    assert!(
        rows.len() == 1 && rows[0].starts_with(&format!("{NAT_PUBLIC_B}:")),
        "{tag}: the server's flows at port 53 (physical remotes): {rows:?}"
    );

    topo.move_laptop_to_a();
    let at_back = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_back + 100_000, Duration::from_secs(20));
    let rows = flows_at(&srvd, 53);
    assert_eq!(
        rows.len(),
        1,
        "{tag}: the server's flows at port 53: {rows:?}"
    );

    let fin = client.stop();
    assert_eq!(fin.error, None, "{tag}: the stream broke: {:?}", fin.json);
    assert_eq!(
        fin.local, before.local,
        "{tag}: the client's socket changed"
    );
    drop(lapd);
}

/// The physical remotes of the server's mobile UDP flows at its `port`,
/// and of any other UDP flow there (one its application opened for a
/// datagram from an address it did not know), prefixed "not mobile ".
fn flows_at(srvd: &Vnatd, port: u16) -> Vec<String> {
    let suffix = format!(":{port}");
    srvd.ctl(&["ls", "--proto", "udp"])
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|r| {
            r["virtual_local"]
                .as_str()
                .is_some_and(|l| l.ends_with(&suffix))
        })
        .map(|r| {
            let remote = r["physical_remote"].as_str().unwrap_or("?");
            if r["mobile"] == true {
                remote.to_string()
            } else {
                format!("not mobile {remote}")
            }
        })
        .collect()
}

#[test]
fn udp_through_a_port_forward_that_changes_the_port_moves_into_a_nat_and_back() {
    udp_through_a_port_forward("nepf", false);
}

#[test]
fn udp_through_a_port_forward_that_changes_the_port_moves_between_nats() {
    udp_through_a_port_forward("nepn", true);
}
