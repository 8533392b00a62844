//! Containers in their own network namespaces behind their host's NAT
//! (issue 17). The container is what Docker's default bridge network makes
//! (`harness::Container`): a veth to the host, the host's nftables
//! masquerading it and publishing its ports. Nothing of vnat's runs inside
//! it; its cgroup is enabled on the host's vnatd with `vnatctl enable`.

mod support;

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use serde_json::Value;
use vnat_daemon::datapath::Proto;
use vnat_tests::{
    Container, EchoServer, Family, Host, LaptopRouterServer, Netns, ProcessGroup, StreamClient,
    StreamOptions, StreamStatus, TempDir, Vnatd,
};

/// The rows of `vnatctl ls` that are containers' connections.
fn guest_rows(d: &Vnatd) -> Vec<Value> {
    d.ctl(&["ls"])
        .expect("vnatd unreachable")
        .as_array()
        .expect("ls is an array")
        .iter()
        .filter(|r| !r["guest"].is_null())
        .cloned()
        .collect()
}

fn enable(d: &Vnatd, c: &Container) {
    let path = c.cgroup.path().display().to_string();
    let out = d
        .ctl(&["enable", "--cgroup", &path])
        .expect("vnatd unreachable");
    assert_eq!(out["enabled"], true, "{out}");
}

fn stream_from(c: &Container, server: SocketAddr, proto: Proto) -> StreamClient {
    let opts = match proto {
        Proto::Tcp => StreamOptions::tcp(server),
        Proto::Udp => StreamOptions::udp(server),
    }
    .rate(300_000);
    let mut cmd = opts.command(&c.ns);
    c.cgroup.join_on_spawn(&mut cmd);
    StreamClient::from_command(cmd)
}

/// The laptop and server hosts of `topo`, and their vnatd's directories.
struct Hosts<'t> {
    lap: Host<'t>,
    srv: Host<'t>,
    ldir: TempDir,
    sdir: TempDir,
}

impl<'t> Hosts<'t> {
    fn new(topo: &'t LaptopRouterServer, tag: &str) -> Hosts<'t> {
        Hosts {
            lap: Host::new(&topo.laptop, &format!("{tag}l")),
            srv: Host::new(&topo.server, &format!("{tag}s")),
            ldir: TempDir::new(&format!("{tag}l")),
            sdir: TempDir::new(&format!("{tag}s")),
        }
    }

    /// The laptop's and the server's vnatd. The laptop's logs how it
    /// judges each container's connection (debug), so that a connection
    /// that is never listed says why in the test's output.
    fn start(&self) -> (Vnatd, Vnatd) {
        let judging = [(
            "RUST_LOG",
            "info,vnat_daemon::datapath::kernel::guests=debug,vnat_daemon::datapath::kernel::peerns=debug",
        )];
        (
            Vnatd::start_with_env(&self.lap, self.ldir.path(), &[], &judging),
            Vnatd::start(&self.srv, self.sdir.path()),
        )
    }
}

/// The laptop moves to subnet B; the stream carries on (100 kB more
/// verified, byte-exact) and ends with no error, on the same socket.
fn moves_and_carries_on(topo: &LaptopRouterServer, client: StreamClient, before: &StreamStatus) {
    topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the socket changed");
}

/// After the laptop's move: its vnatd lists the container's connection
/// (`public`, the name the server knows) translated to `moved`, and the
/// server's vnatd sends to `moved`.
fn both_show_the_move(lapd: &Vnatd, srvd: &Vnatd, public: SocketAddr, moved: SocketAddr) {
    let rows = guest_rows(lapd);
    assert!(
        rows.iter().any(|r| r["virtual_local"] == public.to_string()
            && r["physical_local"] == moved.to_string()
            && r["state"] == "translated"),
        "the laptop's vnatd does not show the container's connection moved: {rows:?}"
    );
    let ls = srvd.ctl(&["ls"]).expect("server vnatd unreachable");
    assert!(
        ls.as_array()
            .expect("array")
            .iter()
            .any(|r| r["virtual_remote"] == public.to_string()
                && r["physical_remote"] == moved.to_string()),
        "the server does not send to the laptop's new address: {ls}"
    );
}

/// A container behind the laptop, its cgroup enabled on the laptop's
/// vnatd, streaming to an echo on the server in `family` and `proto`; both
/// vnatd paired.
struct Streaming {
    ctr: Container,
    _echo: EchoServer,
    lapd: Vnatd,
    srvd: Vnatd,
    server: SocketAddr,
    client: StreamClient,
    before: StreamStatus,
}

impl Streaming {
    fn start(
        topo: &LaptopRouterServer,
        hosts: &Hosts,
        tag: &str,
        family: Family,
        proto: Proto,
    ) -> Streaming {
        let ctr = Container::behind(&topo.laptop, &format!("{tag}c"), 88, "ct0");
        let server = SocketAddr::new(topo.server_addr.get(family), 5001);
        let _echo = match proto {
            Proto::Tcp => EchoServer::tcp_in(&hosts.srv, server),
            Proto::Udp => EchoServer::udp_in(&hosts.srv, server),
        };
        let (lapd, srvd) = hosts.start();
        enable(&lapd, &ctr);
        let client = stream_from(&ctr, server, proto);
        let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
        lapd.wait_paired("the laptop's vnatd");
        srvd.wait_paired("the server's vnatd");
        // vnatd finds a container's connection at its next resync: wait for
        // it to be listed (a slow VM takes seconds; 20 s is the limit).
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while !guest_rows(&lapd)
            .iter()
            .any(|r| r["guest"]["private_local"] == before.local)
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the laptop's vnatd never listed the container's connection {}: {:?}",
                before.local,
                guest_rows(&lapd)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        // Listed is not yet mobile: a UDP flow binds in band, a round trip
        // after pairing, and one not bound when its address goes cannot be.
        while !guest_rows(&lapd)
            .iter()
            .any(|r| r["guest"]["private_local"] == before.local && r["mobile"] == true)
        {
            assert!(
                std::time::Instant::now() < deadline,
                "the container's connection {} never became mobile: {:?}",
                before.local,
                guest_rows(&lapd)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Streaming {
            ctr,
            _echo,
            lapd,
            srvd,
            server,
            client,
            before,
        }
    }
}

/// A container on the laptop talks to the server; the laptop moves from
/// subnet A to B. The container's connection carries on, byte-exact on the
/// same socket, under the public name the server knows.
fn container_moves_with_its_host(family: Family, proto: Proto, tag: &str) {
    let topo = LaptopRouterServer::builder()
        .tag(tag)
        .ipv6(family == Family::V6)
        .build();
    let hosts = Hosts::new(&topo, tag);
    let Streaming {
        ctr,
        _echo,
        lapd,
        srvd,
        server,
        client,
        before,
    } = Streaming::start(&topo, &hosts, tag, family, proto);
    let private: SocketAddr = before.local.parse().expect("local endpoint");
    let mine = match family {
        Family::V4 => IpAddr::V4(ctr.addr),
        Family::V6 => IpAddr::V6(ctr.addr6),
    };
    assert_eq!(private.ip(), mine, "the stream runs in the container");

    // The laptop's vnatd shows the container's connection under its public
    // name: the laptop's address and the NAT's port.
    let rows = guest_rows(&lapd);
    let row = rows
        .iter()
        .find(|r| r["guest"]["private_local"] == private.to_string())
        .unwrap_or_else(|| panic!("the container's connection is not listed: {rows:?}"));
    let public: SocketAddr = row["virtual_local"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("virtual_local");
    assert_eq!(public.ip(), topo.laptop_a_addr.get(family));
    assert_eq!(row["virtual_remote"], server.to_string());
    assert_eq!(row["guest"]["private_remote"], server.to_string());
    assert!(
        row["guest"]["netns"]
            .as_str()
            .is_some_and(|n| n.starts_with("net:[")),
        "no namespace shown: {row}"
    );
    // A UDP flow is mobile once its claim is bound, a moment after pairing.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !lapd.mobile_to(&proto.to_string(), server.ip()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the container's connection never became mobile: {rows:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    let after = client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));

    let moved = SocketAddr::new(topo.laptop_b_addr.get(family), public.port());
    both_show_the_move(&lapd, &srvd, public, moved);
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the container's socket changed");
    assert!(fin.verified >= after.verified);
}

#[test]
fn tcp_of_a_container_behind_the_laptops_nat_survives_the_move() {
    container_moves_with_its_host(Family::V4, Proto::Tcp, "ctt");
}

#[test]
fn udp_of_a_container_behind_the_laptops_nat_survives_the_move() {
    container_moves_with_its_host(Family::V4, Proto::Udp, "ctu");
}

/// The same over IPv6, the host masquerading the container's ULA (NAT66).
#[test]
fn tcp_v6_of_a_container_behind_the_laptops_nat66_survives_the_move() {
    container_moves_with_its_host(Family::V6, Proto::Tcp, "ct6");
}

/// A container whose IPv6 prefix the laptop routes (no NAT): the network
/// on A routes it to the laptop. Its connection is listed under its own
/// address, routed via the laptop's address on A, and when the laptop moves
/// to B (whose network does not route the prefix) it carries on byte-exact
/// on the same socket, translated to the laptop's new address; the
/// container's address is never put on the laptop's lo (that would take
/// the container's traffic for the laptop).
#[test]
fn tcp_v6_of_a_routed_container_survives_the_move() {
    let tag = "ctr";
    let topo = LaptopRouterServer::builder().tag(tag).ipv6(true).build();
    let hosts = Hosts::new(&topo, tag);
    let ctr = Container::routed(&topo.laptop, &format!("{tag}c"), 0x88, "ct0");
    let via_a = topo.laptop_a_addr.get(Family::V6);
    ctr.route_prefix(&topo.router, via_a, &topo.router_if_a);
    let server = SocketAddr::new(topo.server_addr.get(Family::V6), 5001);
    let _echo = EchoServer::tcp_in(&hosts.srv, server);
    let (lapd, srvd) = hosts.start();
    enable(&lapd, &ctr);
    let client = stream_from(&ctr, server, Proto::Tcp);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    let own: SocketAddr = before.local.parse().expect("local endpoint");
    assert_eq!(
        own.ip(),
        IpAddr::V6(ctr.addr6),
        "the stream runs in the container"
    );
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");

    let rows = guest_rows(&lapd);
    let row = rows
        .iter()
        .find(|r| r["virtual_local"] == own.to_string())
        .unwrap_or_else(|| {
            panic!(
                "the routed container's connection is not listed under its own address: {rows:?}"
            )
        });
    assert_eq!(row["guest"]["private_local"], own.to_string());
    assert_eq!(row["guest"]["routed_via"], via_a.to_string(), "{row}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !lapd.mobile_to("tcp", server.ip()) {
        assert!(
            std::time::Instant::now() < deadline,
            "the routed container's connection never became mobile: {:?}",
            guest_rows(&lapd)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The server bound it only once the laptop showed it receives at the
    // container's address (the PROVE sent there reached the laptop's vnatd).
    let st = srvd.ctl(&["status"]).expect("server status");
    assert!(
        st["vcmp"]["events"]["proofs_accepted"]
            .as_u64()
            .unwrap_or(0)
            >= 1,
        "the server took the laptop's claim without a proof: {}",
        st["vcmp"]
    );
    // Nothing of the container's traffic is taken once it is bound.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let out = topo.laptop.run(&["ip", "-6", "rule", "show"]);
        let rules = String::from_utf8_lossy(&out.stdout).to_string();
        if !rules.contains(&ctr.addr6.to_string()) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the rule taking VCMP to the container's address stayed after it was bound: {rules}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    topo.move_laptop_to_b();
    let at_move = client.latest().expect("status").verified;
    let after = client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));

    let moved = SocketAddr::new(topo.laptop_b_addr.get(Family::V6), own.port());
    both_show_the_move(&lapd, &srvd, own, moved);
    assert!(
        !topo
            .laptop
            .addresses("lo")
            .iter()
            .any(|a| a.addr == IpAddr::V6(ctr.addr6)),
        "the container's address was put on the laptop's lo"
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the container's socket changed");
    assert!(fin.verified >= after.verified);
}

/// A container whose cgroup is not enabled is not vnat's: not listed, and
/// its connection is left to the host's NAT, which loses it when the
/// laptop moves, as it would without vnat.
#[test]
fn a_container_not_enabled_is_never_touched() {
    let tag = "ctn";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let hosts = Hosts::new(&topo, tag);
    let srv = &hosts.srv;
    let ctr = Container::behind(&topo.laptop, &format!("{tag}c"), 88, "ct0");
    let server = SocketAddr::new(topo.server_addr.get(Family::V4), 5001);
    let _echo = EchoServer::tcp_in(srv, server);
    let (lapd, _srvd) = hosts.start();

    let client = stream_from(&ctr, server, Proto::Tcp);
    client.wait_verified_at_least(50_000, Duration::from_secs(10));
    assert!(
        guest_rows(&lapd).is_empty(),
        "a container not enabled is listed"
    );

    topo.move_laptop_to_b();
    assert!(
        client.wait_error(Duration::from_secs(20)).is_some(),
        "the connection of a container vnat must not touch survived the host's move"
    );
    assert!(
        guest_rows(&lapd).is_empty(),
        "a container not enabled is listed"
    );
}

/// `docker run -p 8080:80` (or `-p 5353:53/udp`, the container's UDP
/// server bound to the wildcard address, as UDP servers are) on the
/// server: a laptop's connection to the published port survives the
/// laptop's move, and the server's vnatd knows the container's connection
/// by the name the laptop uses, with the container's real private end (for
/// the UDP server, found from the container's own routes).
fn published_port_keeps_a_moving_laptops_connection(proto: Proto, tag: &str) {
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let hosts = Hosts::new(&topo, tag);
    let ctr = Container::behind(&topo.server, &format!("{tag}c"), 89, "ct0");
    let (host_port, port, opts) = match proto {
        Proto::Tcp => (
            8080,
            80,
            StreamOptions::tcp as fn(SocketAddr) -> StreamOptions,
        ),
        Proto::Udp => (
            5353,
            53,
            StreamOptions::udp as fn(SocketAddr) -> StreamOptions,
        ),
    };
    let _echo = match proto {
        Proto::Tcp => {
            ctr.publish(&topo.server, host_port, port);
            EchoServer::tcp_in_container(&ctr, ctr.endpoint(port))
        }
        Proto::Udp => {
            ctr.publish_udp(&topo.server, host_port, port);
            EchoServer::udp_in_container(&ctr, port)
        }
    };
    let (lapd, srvd) = hosts.start();
    enable(&srvd, &ctr);

    let published = SocketAddr::new(topo.server_addr.get(Family::V4), host_port);
    let mut cmd = opts(published).rate(300_000).command(&topo.laptop);
    hosts.lap.cgroup.join_on_spawn(&mut cmd);
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
    lapd.wait_mobile_to(name, published.ip());
    let rows = guest_rows(&srvd);
    assert!(
        rows.iter()
            .any(|r| r["virtual_local"] == published.to_string()
                && r["virtual_remote"] == before.local
                && r["guest"]["private_local"] == ctr.endpoint(port).to_string()),
        "the server's vnatd does not show the container's connection by its public name: {rows:?}"
    );
    moves_and_carries_on(&topo, client, &before);
}

#[test]
fn a_containers_published_port_keeps_a_moving_laptops_connection() {
    published_port_keeps_a_moving_laptops_connection(Proto::Tcp, "ctp");
}

#[test]
fn a_containers_published_udp_port_keeps_a_moving_laptops_flow() {
    published_port_keeps_a_moving_laptops_connection(Proto::Udp, "ctq");
}

/// Two containers with the same private address, 10.88.0.2, one behind the
/// laptop and one behind the server (published on 8080), both enabled on
/// both hosts' vnatd: the first talks to the second. Each vnatd records
/// both sockets but lists only its own host's container's end, by that
/// container's namespace, and the connection survives the laptop's move
/// through both NATs.
#[test]
fn two_containers_with_the_same_private_address_are_kept_apart() {
    let tag = "ct2";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let hosts = Hosts::new(&topo, tag);
    let mine = Container::behind(&topo.laptop, &format!("{tag}a"), 88, "ct0");
    let theirs = Container::behind(&topo.server, &format!("{tag}b"), 88, "ct0");
    assert_eq!(mine.addr, theirs.addr);
    theirs.publish(&topo.server, 8080, 80);
    let _echo = EchoServer::tcp_in_container(&theirs, theirs.endpoint(80));
    let (lapd, srvd) = hosts.start();
    // Both containers' cgroups on both hosts' vnatd: each records both
    // sockets, and must list only the one its own host NATs.
    for d in [&lapd, &srvd] {
        enable(d, &mine);
        enable(d, &theirs);
    }

    let published = SocketAddr::new(topo.server_addr.get(Family::V4), 8080);
    let client = stream_from(&mine, published, Proto::Tcp);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");

    for d in [&lapd, &srvd] {
        let st = d.ctl(&["status"]).expect("vnatd unreachable");
        assert!(
            st["datapath"]["counters"]["guest_recorded"].as_u64() >= Some(2),
            "a vnatd did not record both containers' sockets: {st}"
        );
    }
    let (lrows, srows) = (guest_rows(&lapd), guest_rows(&srvd));
    assert_eq!(
        lrows.len(),
        1,
        "the laptop lists one container's end: {lrows:?}"
    );
    assert_eq!(
        srows.len(),
        1,
        "the server lists one container's end: {srows:?}"
    );
    let (l, s) = (&lrows[0], &srows[0]);
    assert_eq!(l["guest"]["private_local"], before.local);
    assert_eq!(s["guest"]["private_local"], theirs.endpoint(80).to_string());
    assert_ne!(
        l["guest"]["netns_cookie"], s["guest"]["netns_cookie"],
        "two namespaces"
    );
    // Each end's public name is the other's remote.
    assert_eq!(l["virtual_remote"], published.to_string());
    assert_eq!(s["virtual_local"], published.to_string());
    assert_eq!(s["virtual_remote"], l["virtual_local"]);

    moves_and_carries_on(&topo, client, &before);
}

/// Planned mode: `vnatctl suspend --pid` names the container's process
/// (its pid as the host sees it), the laptop moves, `vnatctl resume --all`,
/// and the container's connection carries on.
#[test]
fn a_containers_connection_moves_in_planned_mode() {
    let tag = "ctm";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let hosts = Hosts::new(&topo, tag);
    // Every field bound: one left out would be dropped here, and with it
    // the container's namespace or the server's vnatd.
    let Streaming {
        ctr: _ctr,
        _echo,
        lapd,
        srvd: _srvd,
        server: _server,
        client,
        before,
    } = Streaming::start(&topo, &hosts, tag, Family::V4, Proto::Tcp);
    let rows = guest_rows(&lapd);
    let row = rows
        .iter()
        .find(|r| r["guest"]["private_local"] == before.local)
        .unwrap_or_else(|| panic!("the container's connection is not listed: {rows:?}"));
    let pid = client.pid().to_string();
    let suspended = lapd
        .ctl(&["suspend", "--pid", &pid])
        .expect("laptop vnatd unreachable");
    assert!(
        suspended["suspended"]
            .as_array()
            .is_some_and(|ids| ids.contains(&row["id"])),
        "suspend --pid of the container's process did not take its connection: {suspended}"
    );

    topo.move_laptop_to_b();
    lapd.ctl(&["resume", "--all"])
        .expect("laptop vnatd unreachable");
    let at_move = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_move + 100_000, Duration::from_secs(20));
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the container's socket changed");
}

/// A process in an enabled cgroup that makes a namespace of its own and a
/// loopback connection with the same tuple as a container's real one
/// cannot have vnatd take the real flow for its socket: the host routes the
/// container's address into the container's namespace, not the copy's, so
/// the copy is never listed, the real one stays listed under its own
/// namespace, and it still moves with the laptop.
#[test]
fn a_namespace_that_copies_a_containers_tuple_takes_nothing() {
    let tag = "ctf";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let hosts = Hosts::new(&topo, tag);
    let Streaming {
        ctr,
        _echo,
        lapd,
        srvd: _srvd,
        server,
        client,
        before,
    } = Streaming::start(&topo, &hosts, tag, Family::V4, Proto::Tcp);
    let rows = guest_rows(&lapd);
    let real = rows
        .iter()
        .find(|r| r["guest"]["private_local"] == before.local)
        .unwrap_or_else(|| panic!("the real connection is not listed to begin with: {rows:?}"));
    let real_ns = real["guest"]["netns_cookie"].clone();

    // The copy: both ends on the rogue namespace's lo, in the container's
    // (enabled) cgroup, the client bound to the real one's address and port.
    let rogue = Netns::new(&format!("{tag}r"));
    rogue.add_addr("lo", ctr.addr.into(), 32);
    rogue.add_addr("lo", server.ip(), 32);
    let mut listen = rogue.cmd("socat");
    listen.args([
        &format!(
            "TCP-LISTEN:{},bind={},reuseaddr,fork",
            server.port(),
            server.ip()
        ),
        "EXEC:cat",
    ]);
    ctr.cgroup.join_on_spawn(&mut listen);
    let _listener = ProcessGroup::spawn(listen, "the rogue listener");
    rogue.wait_tcp_listening(server.port());
    let mut copy = rogue.cmd("socat");
    copy.args([
        "-u".to_string(),
        "OPEN:/dev/zero".to_string(),
        format!("TCP:{server},bind={}", before.local),
    ])
    .stdout(std::process::Stdio::null());
    ctr.cgroup.join_on_spawn(&mut copy);
    let _copy = ProcessGroup::spawn(copy, "the rogue client");

    let recorded = || {
        lapd.ctl(&["status"]).expect("vnatd unreachable")["datapath"]["counters"]["guest_recorded"]
            .as_u64()
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while recorded() < 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "the copy was never recorded, so this test would show nothing"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Several listings after the copy was recorded: only the real one.
    for _ in 0..10 {
        let rows = guest_rows(&lapd);
        assert!(
            rows.len() == 1
                && rows[0]["guest"]["private_local"] == before.local
                && rows[0]["guest"]["netns_cookie"] == real_ns,
            "the copy's socket was taken for the flow, or the real one dropped: {rows:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    moves_and_carries_on(&topo, client, &before);
}
