//! An IPv4 connection survives its laptop's move to a network where the
//! laptop has only IPv6 (the server keeps both), carried over IPv6 between
//! the two hosts' IPv6 addresses, and the move back: the same socket, every
//! byte in order, no error, TCP (a few MB in flight, GSO-sized segments
//! through the 20-byte-larger header) and UDP. Translations are installed
//! through the datapath API as in `move_conn.rs`; the kernel does the rest
//! (the tc translators, the RFC 5549 route with its lowered MTU).

mod support;

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use vnat_daemon::datapath::{ConnState, Datapath, Proto, Translation, VirtualFlow};
use vnat_tests::{EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions};

/// Fast enough that megabytes are in flight across each move.
const RATE: u64 = 4_000_000;

fn client(host: &Host, server: SocketAddr, proto: Proto) -> StreamClient {
    let opts = match proto {
        Proto::Tcp => StreamOptions::tcp(server),
        Proto::Udp => StreamOptions::udp(server),
    }
    .rate(RATE);
    let mut cmd = opts.command(host.ns);
    host.cgroup.join_on_spawn(&mut cmd);
    StreamClient::from_command(cmd)
}

/// Both ends' translations for the laptop at `laptop_phys` and the server
/// at `server_phys` (of one family), receive sides first, as vnatd
/// installs them; then, as vnatd does, the laptop's TCP socket is made to
/// send at once rather than at its backed-off timer (`kick_flow`).
fn carry(lap: &Host, srv: &Host, flow: VirtualFlow, laptop_phys: IpAddr, server_phys: IpAddr) {
    let t = Translation {
        flow,
        physical_local: SocketAddr::new(laptop_phys, flow.local.port()),
        physical_remote: SocketAddr::new(server_phys, flow.remote.port()),
    };
    lap.datapath(move |dp| dp.prepare_translation(&t))
        .unwrap_or_else(|e| panic!("laptop, prepare: {e}"));
    let back = Translation {
        flow: reversed(flow),
        physical_local: t.physical_remote,
        physical_remote: t.physical_local,
    };
    srv.datapath(move |dp| dp.install_translation(&back))
        .unwrap_or_else(|e| panic!("server, install: {e}"));
    lap.datapath(move |dp| {
        dp.install_translation(&t)
            .unwrap_or_else(|e| panic!("laptop, install: {e}"));
        kick(dp, flow);
    });
}

fn kick(dp: &mut impl Datapath, flow: VirtualFlow) {
    if flow.proto == Proto::Tcp {
        dp.kick_flow(&flow, false)
            .unwrap_or_else(|e| panic!("laptop, kick: {e}"));
    }
}

fn reversed(flow: VirtualFlow) -> VirtualFlow {
    VirtualFlow {
        proto: flow.proto,
        local: flow.remote,
        remote: flow.local,
    }
}

/// Both ends back on the connection's own endpoints.
fn home(lap: &Host, srv: &Host, flow: VirtualFlow) {
    srv.datapath(move |dp| dp.remove_translation(&reversed(flow)))
        .unwrap_or_else(|e| panic!("server, remove: {e}"));
    lap.datapath(move |dp| {
        dp.remove_translation(&flow)
            .unwrap_or_else(|e| panic!("laptop, remove: {e}"));
        kick(dp, flow);
    });
}

/// Wait for data to flow again after a move at `moved` (64 kB more
/// verified than `from`), then for 3 MB; the verified count then. The time
/// is mostly the test's: each datapath call here loads the programs anew.
fn resumes(c: &StreamClient, from: u64, what: &str, moved: Instant) -> u64 {
    c.wait_verified_at_least(from + 65_536, Duration::from_secs(30));
    let again = moved.elapsed();
    let st = c.wait_verified_at_least(from + 3_000_000, Duration::from_secs(30));
    eprintln!(
        "{what}: data again {again:?} after the addresses changed, 3 MB in {:?}",
        moved.elapsed()
    );
    st.verified
}

fn v4_connection_moves_to_v6_only_and_back(proto: Proto, tag: &str) {
    let topo = LaptopRouterServer::builder().tag(tag).ipv6(true).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = match proto {
        Proto::Tcp => EchoServer::tcp(srv.ns, server),
        Proto::Udp => EchoServer::udp(srv.ns, server),
    };
    let c = client(&lap, server, proto);
    let before = c.wait_verified_at_least(1_000_000, Duration::from_secs(15));
    let conn = lap.wait_connection("the client's flow", |c| {
        c.proto == proto && c.virtual_remote == server
    });
    assert_eq!(conn.virtual_local.to_string(), before.local);
    let flow = VirtualFlow {
        proto,
        local: conn.virtual_local,
        remote: conn.virtual_remote,
    };

    // To the IPv6-only network: carried over IPv6.
    topo.move_laptop_to_b_v6_only();
    let moved = Instant::now();
    let laptop_v6: IpAddr = topo.laptop_b_addr.v6().into();
    let at = c.latest().expect("no status from the stream").verified;
    carry(&lap, &srv, flow, laptop_v6, topo.server_addr.v6().into());
    let after = resumes(&c, at, &format!("{proto} v4 over v6"), moved);
    // The laptop's socket is routed through the IPv6 next hop (RFC 5549),
    // with room for the 20 bytes the header grows by; the server's too.
    for (ns, hop) in [
        (&topo.laptop, topo.router_b_addr.v6()),
        (&topo.server, topo.router_c_addr.v6()),
    ] {
        let routes = ns.run_stdout(&["ip", "-4", "route", "show", "table", "all", "proto", "157"]);
        assert!(
            routes.contains(&format!("via inet6 {hop}")) && routes.contains("mtu 1480"),
            "no route via {hop} with MTU 1480 in {}: {routes}",
            ns.name()
        );
    }
    let now = lap
        .connections(proto)
        .into_iter()
        .find(|c| c.virtual_remote == server)
        .expect("the flow vanished from the connection map");
    assert_eq!(
        (now.state, now.physical_local.ip()),
        (ConnState::Translated, laptop_v6)
    );
    for (host, name) in [(&lap, "laptop"), (&srv, "server")] {
        assert!(
            host.counter("family_translated") > 0,
            "the {name} translated nothing between the families"
        );
        // No ICMPv6 "packet too big" either: the route's MTU made room
        // for the larger header.
        for drop in [
            "drop_family_untranslatable",
            "drop_family_failed",
            "drop_udp_zero_csum",
            "drop_icmp_family",
        ] {
            assert_eq!(host.counter(drop), 0, "the {name} counted {drop}");
        }
    }

    // Back to A, where the laptop has its IPv4 address again: no
    // translation at either end.
    topo.move_laptop_to_a();
    let back = Instant::now();
    let at = c
        .latest()
        .expect("no status from the stream")
        .verified
        .max(after);
    home(&lap, &srv, flow);
    resumes(&c, at, &format!("{proto} back on v4"), back);
    let now = lap
        .connections(proto)
        .into_iter()
        .find(|c| c.virtual_remote == server)
        .expect("the flow vanished from the connection map");
    assert_eq!(
        (now.state, now.physical_local),
        (ConnState::Native, flow.local)
    );

    let fin = c.stop();
    assert_eq!(
        fin.error, None,
        "the stream reported an error: {:?}",
        fin.json
    );
    assert_eq!(fin.local, before.local, "the client's socket changed");
}

#[test]
fn tcp_v4_connection_moves_to_v6_only_network_and_back() {
    v4_connection_moves_to_v6_only_and_back(Proto::Tcp, "fmt");
}

#[test]
fn udp_v4_flow_moves_to_v6_only_network_and_back() {
    v4_connection_moves_to_v6_only_and_back(Proto::Udp, "fmu");
}
