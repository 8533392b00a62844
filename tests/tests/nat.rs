//! A laptop behind a real NAT (nftables on the router: source NAT with
//! `fully-random` ports unless a test asks otherwise, and no connection may be opened from outside), a
//! public server, real vnatd on both (issue 15, items 1, 3, 4 and 7):
//! - the laptop's TCP connection is mobile at both ends although they name
//!   it differently (bound by its sequence numbers, not its addresses);
//! - the laptop knows it is behind a NAT and where the NAT put it (`ls`
//!   and `peers`), the server knows it is not;
//! - the laptop's keepalives keep the NAT's mapping open, so the server's
//!   vnatd still reaches it after the NAT would have forgotten an idle
//!   mapping; without keepalives it does not;
//! - TCP connections and UDP flows move from one NAT to another, with
//!   port-preserving and with `fully-random` NATs (UDP bound by an in-band
//!   BIND, `vcmp::bind`).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, NatPorts, StreamClient, StreamOptions, TempDir, Vnatd,
    NAT_PUBLIC_A, NAT_PUBLIC_B, SERVER_PUBLIC,
};

const PUBLIC: Ipv4Addr = NAT_PUBLIC_A;
const PUBLIC_B: Ipv4Addr = NAT_PUBLIC_B;
/// How long the NAT keeps an idle UDP mapping.
const UDP_TIMEOUT_SECS: u32 = 3;

/// The NATs of `vnat_tests::nat_router`, forgetting idle UDP mappings
/// after [`UDP_TIMEOUT_SECS`].
fn nat_router(topo: &LaptopRouterServer, ports: NatPorts) {
    vnat_tests::nat_router_with(topo, ports).unwrap_or_else(|e| panic!("{e}"));
    for key in [
        "net/netfilter/nf_conntrack_udp_timeout",
        "net/netfilter/nf_conntrack_udp_timeout_stream",
    ] {
        topo.router.set_sysctl(key, &UDP_TIMEOUT_SECS.to_string());
    }
}

/// Streams from `lap` with `opts` (at 100 kB/s), each flowing.
fn streams<const N: usize>(lap: &Host, opts: [StreamOptions; N]) -> Vec<StreamClient> {
    opts.into_iter()
        .map(|o| {
            let mut cmd = o.rate(100_000).command(lap.ns);
            lap.cgroup.join_on_spawn(&mut cmd);
            let c = StreamClient::from_command(cmd);
            c.wait_verified_at_least(20_000, Duration::from_secs(10));
            c
        })
        .collect()
}

fn counter(d: &Vnatd, group: &str, name: &str) -> u64 {
    d.ctl(&["status"]).expect("vnatd unreachable")["vcmp"][group][name]
        .as_u64()
        .unwrap_or(0)
}

fn wait_for(what: &str, secs: u64, f: impl FnMut() -> bool) {
    vnat_tests::wait_until(Duration::from_secs(secs), f, || what.to_string());
}

/// The laptop's only row of `peers` (the server), as JSON.
fn the_peer(d: &Vnatd) -> Value {
    let v = d.ctl(&["peers"]).expect("vnatd unreachable");
    let rows: Vec<Value> = v
        .as_array()
        .expect("array")
        .iter()
        .filter(|r| r["key"].is_string())
        .cloned()
        .collect();
    assert_eq!(rows.len(), 1, "one paired host expected: {v}");
    rows[0].clone()
}

struct Bed {
    topo: LaptopRouterServer,
    dirs: (TempDir, TempDir),
    tag: String,
}

impl Bed {
    fn new(tag: &str) -> Bed {
        Bed::with(tag, NatPorts::FullyRandom)
    }

    fn with(tag: &str, ports: NatPorts) -> Bed {
        let topo = LaptopRouterServer::builder().tag(tag).build();
        nat_router(&topo, ports);
        Bed {
            topo,
            dirs: (
                TempDir::new(&format!("{tag}l")),
                TempDir::new(&format!("{tag}s")),
            ),
            tag: tag.into(),
        }
    }
}

/// Sets up the stream and both vnatd; returns them once the connection is
/// mobile at both ends.
fn mobile_through_nat<'a>(
    bed: &'a Bed,
    lap: &Host<'a>,
    srv: &Host<'a>,
    keepalive_secs: &str,
) -> (Vnatd, Vnatd, StreamClient) {
    let server = SocketAddr::new(bed.topo.server_addr.v4.into(), 5001);
    let lapd = Vnatd::start_with(
        lap,
        bed.dirs.0.path(),
        &["--keepalive-secs", keepalive_secs],
    );
    let srvd = Vnatd::start(srv, bed.dirs.1.path());
    let mut cmd = StreamOptions::tcp(server)
        .rate(100_000)
        .command(&bed.topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(20_000, Duration::from_secs(10));
    let mobile_at = |d: &Vnatd| {
        d.ctl(&["ls", "--proto", "tcp"])
            .and_then(|v| v.as_array().cloned())
            .is_some_and(|rows| {
                rows.iter().any(|r| {
                    r["virtual_local"]
                        .as_str()
                        .is_some_and(|l| !l.ends_with(":2031"))
                        && r["mobile"] == true
                })
            })
    };
    wait_for(
        &format!(
            "{}: the connection never became mobile on the laptop",
            bed.tag
        ),
        20,
        || mobile_at(&lapd),
    );
    wait_for(
        &format!(
            "{}: the connection never became mobile on the server",
            bed.tag
        ),
        20,
        || mobile_at(&srvd),
    );
    (lapd, srvd, client)
}

#[test]
fn a_laptop_behind_nat_is_mobile_knows_it_and_keeps_its_mapping() {
    let bed = Bed::new("natk");
    let lap = Host::new(&bed.topo.laptop, "natkl");
    let srv = Host::new(&bed.topo.server, "natks");
    let server = SocketAddr::new(bed.topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let (lapd, srvd, client) = mobile_through_nat(&bed, &lap, &srv, "1");

    // The server sees the connection from the NAT's address; the laptop
    // knows it is behind a NAT and where the NAT put its end.
    let srv_ls = srvd.ctl(&["ls", "--proto", "tcp"]).expect("server ls");
    assert!(
        srv_ls
            .as_array()
            .expect("array")
            .iter()
            .any(|r| r["virtual_remote"]
                .as_str()
                .is_some_and(|a| a.starts_with(&format!("{PUBLIC}:")))),
        "the server does not see the laptop behind the NAT's address: {srv_ls}"
    );
    let lap_ls = lapd.ctl(&["ls", "--proto", "tcp"]).expect("laptop ls");
    let row = lap_ls
        .as_array()
        .expect("array")
        .iter()
        .find(|r| r["virtual_remote"] == server.to_string())
        .cloned()
        .unwrap_or_else(|| panic!("no row for the stream: {lap_ls}"));
    assert_eq!(row["behind_nat"], true, "{row}");
    assert!(
        row["seen_by_peer_as"]
            .as_str()
            .is_some_and(|a| a.starts_with(&format!("{PUBLIC}:"))),
        "{row}"
    );
    wait_for("the laptop never learned its reflexive address", 10, || {
        the_peer(&lapd)["reflexive"].is_string()
    });
    let peer = the_peer(&lapd);
    assert_eq!(peer["behind_nat"], true, "{peer}");
    let reflexive = peer["reflexive"].as_str().expect("reflexive").to_string();
    assert!(
        reflexive
            .parse::<SocketAddr>()
            .is_ok_and(|a| a.ip() == IpAddr::from(PUBLIC)),
        "{peer}"
    );
    assert_eq!(
        the_peer(&srvd)["behind_nat"],
        false,
        "the server is behind no NAT"
    );

    // Idle for well over the NAT's UDP timeout: keepalives hold the
    // mapping, so the server's vnatd still reaches the laptop's (a planned
    // suspend run on the server agrees fresh keys with it), at the same
    // NAT port.
    std::thread::sleep(Duration::from_secs(3 * u64::from(UDP_TIMEOUT_SECS)));
    srvd.ctl(&["suspend", "--all"]).expect("server suspend");
    wait_for(
        "the server's vnatd could not reach the laptop's behind the NAT",
        10,
        || counter(&lapd, "events", "rekeyed") >= 1,
    );
    assert!(counter(&lapd, "events", "keepalives_sent") >= 3);
    assert_eq!(counter(&srvd, "events", "keepalives_sent"), 0);
    assert_eq!(
        the_peer(&lapd)["reflexive"].as_str(),
        Some(reflexive.as_str()),
        "the NAT mapping changed although keepalives ran"
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
}

/// The same without keepalives: once the NAT forgot the idle mapping, the
/// server's vnatd cannot reach the laptop's (what keepalives are for).
#[test]
fn without_keepalives_the_nat_forgets_the_laptop() {
    let bed = Bed::new("natn");
    let lap = Host::new(&bed.topo.laptop, "natnl");
    let srv = Host::new(&bed.topo.server, "natns");
    let server = SocketAddr::new(bed.topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let (lapd, srvd, client) = mobile_through_nat(&bed, &lap, &srv, "0");
    std::thread::sleep(Duration::from_secs(3 * u64::from(UDP_TIMEOUT_SECS)));
    srvd.ctl(&["suspend", "--all"]).expect("server suspend");
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        counter(&lapd, "events", "rekeyed"),
        0,
        "the laptop was reached through a mapping the NAT should have dropped"
    );
    assert_eq!(counter(&lapd, "events", "keepalives_sent"), 0);
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
}

/// The move itself (issue 15, item 2): the laptop leaves the home NAT for
/// the café's (another public address, random ports) while a byte stream
/// runs. The server's vnatd takes the update from the new NAT's address,
/// validates the laptop's vnatd through it, and lets its datapath learn the
/// port the new NAT gave the connection from the connection's first packet
/// (in its TCP window); the stream goes on, same socket, byte-exact.
#[test]
fn tcp_moves_from_one_nat_to_another() {
    tcp_moves("natm", NatPorts::FullyRandom);
}

#[test]
fn tcp_moves_through_port_preserving_nats() {
    tcp_moves("natp", NatPorts::Preserving);
}

fn tcp_moves(tag: &str, ports: NatPorts) {
    let bed = Bed::with(tag, ports);
    let lap = Host::new(&bed.topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&bed.topo.server, &format!("{tag}s"));
    let server = SocketAddr::new(bed.topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let (lapd, srvd, client) = mobile_through_nat(&bed, &lap, &srv, "25");
    let before = client.latest().expect("status");
    let t0 = Instant::now();
    bed.topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    let after = client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    eprintln!(
        "{tag}: data flowing again {:?} after the move",
        t0.elapsed()
    );
    assert!(
        counter(&srvd, "events", "peer_behind_nat") >= 1,
        "the server did not take the update for a move behind a NAT"
    );
    let st = srvd.ctl(&["status"]).expect("status");
    let learned = st["datapath"]["counters"]["rebind_learned"]
        .as_u64()
        .unwrap_or(0);
    assert!(learned >= 1, "the datapath learned no NAT port: {st}");
    // Learned from the laptop's TCP BIND (issue 31), which no socket saw.
    let binds = st["datapath"]["counters"]["tcp_bind_consumed"]
        .as_u64()
        .unwrap_or(0);
    assert!(binds >= 1, "no TCP BIND reached the server: {st}");
    let ls = srvd
        .ctl(&["ls", "--proto", "tcp", "--state", "translated"])
        .expect("ls");
    assert!(
        ls.as_array()
            .expect("array")
            .iter()
            .any(|r| r["physical_remote"]
                .as_str()
                .is_some_and(|a| a.starts_with(&format!("{PUBLIC_B}:")))),
        "the server does not send to the new NAT: {ls}"
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= after.verified);
    drop(lapd);
}

/// A UDP flow through the NAT, which names it by a port of its own (at
/// random, or the laptop's if free): the server cannot match the laptop's
/// claim, so it diverts in-band BINDs and asks for one; the laptop sends it
/// on the flow's own path, the server's datapath takes it off the flow's
/// port (the echo server never sees it), and both ends bind the flow. The
/// laptop then moves behind the other NAT and the stream goes on, same
/// socket, every datagram's content verified.
fn udp_through_nat(tag: &str, ports: NatPorts) {
    let bed = Bed::with(tag, ports);
    let lap = Host::new(&bed.topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&bed.topo.server, &format!("{tag}s"));
    let server = SocketAddr::new(bed.topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::udp_in(&srv, server);
    let lapd = Vnatd::start_with(&lap, bed.dirs.0.path(), &["--keepalive-secs", "1"]);
    let srvd = Vnatd::start(&srv, bed.dirs.1.path());
    let mut cmd = StreamOptions::udp(server)
        .rate(100_000)
        .command(&bed.topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(20_000, Duration::from_secs(10));
    wait_for(
        &format!("{tag}: the UDP flow never became mobile on the laptop"),
        30,
        || lapd.mobile_on("udp", 5001),
    );
    wait_for(
        &format!("{tag}: the UDP flow never became mobile on the server"),
        30,
        || srvd.mobile_on("udp", 5001),
    );
    assert!(
        counter(&srvd, "events", "binds_bound") >= 1,
        "{tag}: the server did not bind the flow by a BIND"
    );
    let st = srvd.ctl(&["status"]).expect("status");
    assert!(
        st["datapath"]["counters"]["bind_diverted"]
            .as_u64()
            .unwrap_or(0)
            >= 1,
        "{tag}: the server's datapath diverted no BIND: {st}"
    );
    let before = client.latest().expect("status");
    bed.topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    let ls = srvd.ctl(&["ls", "--proto", "udp"]).expect("ls");
    assert!(
        ls.as_array()
            .expect("array")
            .iter()
            .any(|r| r["physical_remote"]
                .as_str()
                .is_some_and(|a| a.starts_with(&format!("{PUBLIC_B}:")))),
        "{tag}: the server does not send to the new NAT: {ls}"
    );
    assert!(
        counter(&srvd, "events", "binds_rebound") >= 1,
        "{tag}: the server did not learn the new NAT's port from the laptop's BIND: server {:?}, laptop {:?}",
        srvd.ctl(&["status"]).map(|s| s["vcmp"].clone()),
        lapd.ctl(&["status"]).map(|s| s["vcmp"].clone())
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "{tag}: the stream broke: {:?}", fin.json);
    assert_eq!(
        fin.local, before.local,
        "{tag}: the client's socket changed"
    );
    drop(lapd);
}

#[test]
fn udp_moves_through_a_port_preserving_nat() {
    udp_through_nat("natup", NatPorts::Preserving);
}

#[test]
fn udp_moves_through_a_fully_random_nat() {
    udp_through_nat("natur", NatPorts::FullyRandom);
}

/// The server behind a port-forwarding router (destination NAT: the laptop
/// knows it by the router's public address, its sockets see their private
/// one; VCMP's port is forwarded too), while the laptop moves from one NAT
/// to another: a TCP stream and a UDP flow, each mobile at both ends and
/// going on after the move, same socket, content verified.
#[test]
fn the_server_behind_port_forwarding_while_the_laptop_moves_between_nats() {
    let tag = "natd";
    let bed = Bed::new(tag);
    vnat_tests::port_forward(&bed.topo, &[5001], &[5002, 2031]).unwrap_or_else(|e| panic!("{e}"));
    let lap = Host::new(&bed.topo.laptop, "natdl");
    let srv = Host::new(&bed.topo.server, "natds");
    let own = |port| SocketAddr::new(bed.topo.server_addr.v4.into(), port);
    let public = |port| SocketAddr::new(SERVER_PUBLIC.into(), port);
    let _tcp_echo = EchoServer::tcp_in(&srv, own(5001));
    let _udp_echo = EchoServer::udp_in(&srv, own(5002));
    let lapd = Vnatd::start_with(&lap, bed.dirs.0.path(), &["--keepalive-secs", "1"]);
    let srvd = Vnatd::start(&srv, bed.dirs.1.path());
    let clients = streams(
        &lap,
        [
            StreamOptions::tcp(public(5001)),
            StreamOptions::udp(public(5002)),
        ],
    );
    // Mobile at both ends: the laptop names the server's end by the public
    // address, the server by its own.
    both_flows_follow_the_laptop(tag, &lapd, &srvd, clients, || bed.topo.move_laptop_to_b());
    drop(lapd);
}

/// Planned mode through NATs: the laptop suspends its TCP stream and UDP
/// flow (`vnatctl suspend --all`), moves from one NAT to another, and
/// resumes (`vnatctl resume --all`); both go on, same sockets, content
/// verified, the server sending both to the new NAT.
#[test]
fn suspend_and_resume_across_nats() {
    let tag = "nats";
    let bed = Bed::new(tag);
    let lap = Host::new(&bed.topo.laptop, "natsl");
    let srv = Host::new(&bed.topo.server, "natss");
    let at = |port| SocketAddr::new(bed.topo.server_addr.v4.into(), port);
    let _tcp_echo = EchoServer::tcp_in(&srv, at(5001));
    let _udp_echo = EchoServer::udp_in(&srv, at(5002));
    let lapd = Vnatd::start_with(&lap, bed.dirs.0.path(), &["--keepalive-secs", "1"]);
    let srvd = Vnatd::start(&srv, bed.dirs.1.path());
    let clients = streams(
        &lap,
        [StreamOptions::tcp(at(5001)), StreamOptions::udp(at(5002))],
    );
    both_flows_follow_the_laptop(tag, &lapd, &srvd, clients, || {
        lapd.ctl(&["suspend", "--all"]).expect("suspend");
        bed.topo.move_laptop_to_b();
        lapd.ctl(&["resume", "--all"]).expect("resume");
    });
    drop(lapd);
}

/// The TCP stream (server port 5001) and UDP flow (5002) of `clients`,
/// once mobile at both ends, go on after `move_laptop` takes the laptop
/// behind NAT B: same sockets, content verified, and the server sends
/// exactly those two to NAT B.
fn both_flows_follow_the_laptop(
    tag: &str,
    lapd: &Vnatd,
    srvd: &Vnatd,
    clients: Vec<StreamClient>,
    move_laptop: impl FnOnce(),
) {
    for (proto, port) in [("tcp", 5001), ("udp", 5002)] {
        wait_for(
            &format!("{tag}: {proto} never mobile on the laptop"),
            30,
            || lapd.mobile_on(proto, port),
        );
        wait_for(
            &format!("{tag}: {proto} never mobile on the server"),
            30,
            || srvd.mobile_on(proto, port),
        );
    }
    let before: Vec<_> = clients
        .iter()
        .map(|c| c.latest().expect("status"))
        .collect();
    move_laptop();
    for c in &clients {
        let at_move = c.latest().expect("status").verified;
        c.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    }
    let (to_b, ls) = srvd.sending_to(PUBLIC_B.into());
    assert_eq!(
        to_b, 2,
        "{tag}: the server must send both flows to the new NAT: {ls}"
    );
    for (c, b) in clients.into_iter().zip(before) {
        let fin = c.stop();
        assert_eq!(fin.error, None, "{tag}: a stream broke: {:?}", fin.json);
        assert_eq!(fin.local, b.local, "{tag}: a client's socket changed");
    }
}
