//! Crash safety (issue 16, item 8): vnatd killed with SIGKILL at any step
//! of installing or removing a translation leaves nothing behind once a new
//! vnatd has started: no address of its own on `lo`, no route of protocol
//! 157, no NAT entry, no tc attachment, on either host. And vnat never
//! replaces or removes a route or an address it did not make.
//!
//! The kill comes from vnatd's fault-injection hook
//! (`VNAT_TEST_CRASH_AT=<step>`, `vnat_daemon::datapath::kernel::fault`):
//! right after that step changed the kernel, vnatd raises SIGKILL. Both
//! daemons run with it, so each step is met on whichever host does it (the
//! laptop keeps its old address on `lo`, the server routes the laptop's old
//! address).
//!
//! What a user sees is checked too: the connection that was moving when
//! vnatd died finishes its move with the new vnatd and carries on
//! byte-exact.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use netlink_packet_route::route::RouteProtocol;
use vnat_daemon::datapath::kernel::fault;
use vnat_tests::{
    Container, EchoServer, Host, LaptopRouterServer, Route, StreamClient, StreamOptions, TempDir,
    Vnatd,
};

/// Routes of protocol 157 in the main table of `ns` (both families), as
/// `ip route show proto 157` lists them.
fn vnat_routes(host: &Host) -> Vec<Route> {
    host.ns
        .routes()
        .into_iter()
        .filter(|r| r.in_main_table() && r.protocol == RouteProtocol::from(157))
        .collect()
}

/// The addresses on `lo` in `ns`.
fn lo_addresses(host: &Host) -> Vec<IpAddr> {
    host.ns
        .addresses("lo")
        .into_iter()
        .map(|a| a.addr)
        .collect()
}

/// What vnat has set up on `host`: routes of protocol 157 (in any table),
/// rules of protocol 157, the sink of its last-resort routes, addresses on
/// `lo` other than loopback (from the kernel, over rtnetlink), entries of
/// the pinned NAT maps (from the pins alone: opening a datapath would
/// reconcile, and tidy what the check is about), and tc attachments (as
/// vnatd reports them).
fn leftovers(host: &Host, d: &Vnatd) -> String {
    let routes: Vec<Route> = host
        .ns
        .routes()
        .into_iter()
        .filter(|r| r.protocol == RouteProtocol::from(157))
        .collect();
    let rules: Vec<_> = host
        .ns
        .rules()
        .into_iter()
        .filter(|r| r.protocol == 157)
        .collect();
    let sink = host.ns.link("vnat-sink").is_some();
    let lo: Vec<IpAddr> = lo_addresses(host)
        .into_iter()
        .filter(|a| !a.is_loopback())
        .collect();
    let entries = host.pinned_nat_entries();
    let tc = d.ctl(&["status"]).expect("vnatd unreachable")["datapath"]["tc"].clone();
    let tc_empty = tc.as_array().is_none_or(|a| a.is_empty());
    if routes.is_empty() && rules.is_empty() && !sink && lo.is_empty() && entries == 0 && tc_empty {
        String::new()
    } else {
        format!(
            "routes {routes:?}, rules {rules:?}, sink {sink}, lo {lo:?}, {entries} NAT entries, tc {tc}"
        )
    }
}

fn wait_for(what: &str, secs: u64, f: impl FnMut() -> bool) {
    vnat_tests::wait_until(Duration::from_secs(secs), f, || what.to_string());
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Side {
    Laptop,
    Server,
}

/// One daemon of the pair, restarted (without the fault) when it died.
struct Daemon<'a> {
    host: &'a Host<'a>,
    dir: TempDir,
    d: Vnatd,
}

impl<'a> Daemon<'a> {
    fn start(host: &'a Host<'a>, tag: &str, crash_at: Option<&str>) -> Daemon<'a> {
        let dir = TempDir::new(tag);
        let env: Vec<(&str, &str)> = crash_at
            .map(|s| (fault::CRASH_AT_ENV, s))
            .into_iter()
            .collect();
        let d = Vnatd::start_with_env(host, dir.path(), &[], &env);
        Daemon { host, dir, d }
    }

    /// Whether it is dead (the step was reached).
    fn dead(&mut self) -> bool {
        !self.d.alive()
    }

    fn revive(&mut self) {
        assert!(!self.d.alive(), "reviving a live vnatd");
        self.d = Vnatd::start(self.host, self.dir.path());
    }
}

fn scenario(tag: &str, step: &str, victim: Side) {
    assert!(fault::STEPS.contains(&step), "unknown step {step}");
    let topo = LaptopRouterServer::builder().tag(tag).build();
    if step.ends_with(":host-route") {
        // The server reaches the laptop's first subnet through another
        // address of the router than its second: after the move, the
        // connection's own packets need a route of their own to the new
        // next hop (none is needed where both are behind one next hop).
        let other_hop: IpAddr = "198.18.3.254".parse().unwrap();
        topo.router.add_addr(&topo.router_if_c, other_hop, 24);
        topo.server
            .route_via("198.18.1.0/24", other_hop, &topo.server_if);
    }
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let fault_on = |side| (side == victim).then_some(step);
    let mut l = Daemon::start(&lap, &format!("{tag}l"), fault_on(Side::Laptop));
    let mut s = Daemon::start(&srv, &format!("{tag}s"), fault_on(Side::Server));

    let mut cmd = StreamOptions::tcp(server)
        .rate(200_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(30_000, Duration::from_secs(10));
    let laptop_old: IpAddr = topo.laptop_a_addr.v4.into();
    let new_local = {
        let l: SocketAddr = before.local.parse().expect("local address");
        SocketAddr::new(topo.laptop_b_addr.v4.into(), l.port())
    };
    let victim_dead = |l: &mut Daemon, s: &mut Daemon| match victim {
        Side::Laptop => l.dead(),
        Side::Server => s.dead(),
    };
    // Some steps come before the move (tc is attached at pairing).
    wait_for(
        "the connection to be mobile or the vnatd to die",
        20,
        || victim_dead(&mut l, &mut s) || l.d.try_mobile_to("tcp", server.ip()),
    );
    let moved_early = !victim_dead(&mut l, &mut s);
    if moved_early {
        topo.move_laptop_to_b();
    }
    let client = if step.starts_with("install:") {
        wait_for(
            &format!("the {victim:?}'s vnatd to die at {step}"),
            20,
            || victim_dead(&mut l, &mut s),
        );
        Some(client)
    } else {
        // The move completes; the steps of a removal come when the
        // connection closes.
        let moved = client.wait_progress(&before, 100_000, Duration::from_secs(20));
        assert!(
            !victim_dead(&mut l, &mut s),
            "vnatd died before the connection closed"
        );
        let fin = client.stop();
        assert_eq!(fin.error, None, "the stream failed: {:?}", fin.json);
        assert!(fin.verified >= moved.verified);
        wait_for(
            &format!("the {victim:?}'s vnatd to die at {step}"),
            20,
            || victim_dead(&mut l, &mut s),
        );
        None
    };
    eprintln!(
        "crash-safety {step} ({victim:?}): left: laptop routes {:?} lo {:?}; server routes {:?}",
        vnat_routes(&lap),
        lo_addresses(&lap),
        vnat_routes(&srv)
    );
    match victim {
        Side::Laptop => l.revive(),
        Side::Server => s.revive(),
    }

    if let Some(client) = client {
        // The move the dead vnatd left half done (or had not begun) is
        // made by the new one.
        if !moved_early {
            wait_for("the connection to be mobile again", 20, || {
                l.d.try_mobile_to("tcp", server.ip())
            });
            topo.move_laptop_to_b();
        }
        // The move completes: the laptop's vnatd shows the connection
        // translated to its new address. Data flowing is not proof of it:
        // past the hold limit, a move not done lets the socket's packets
        // leave with the old address, and the test's router forwards them.
        let moved = |d: &Vnatd| {
            d.ctl(&["ls", "--state", "translated"])
                .and_then(|ls| ls.as_array().cloned())
                .is_some_and(|rows| {
                    rows.iter()
                        .any(|r| r["physical_local"] == new_local.to_string())
                })
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !moved(&l.d) {
            if Instant::now() >= deadline {
                let all = |d: &Vnatd| d.ctl(&["ls"]).map(|v| v.to_string());
                panic!(
                    "{step}: 30 s after the restart, the laptop's vnatd does not show the \
                     connection translated to {new_local}; the laptop's: {:?}; the server's: {:?}",
                    all(&l.d),
                    all(&s.d)
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // And data flows over the translation.
        let at_move = client.latest().unwrap_or_else(|| before.clone());
        let after = client.wait_progress(&at_move, 200_000, Duration::from_secs(30));
        assert!(
            lo_addresses(&lap).contains(&laptop_old),
            "{step}: the moved connection's old address is not on lo"
        );
        let fin = client.stop();
        assert_eq!(fin.error, None, "{step}: the stream failed: {:?}", fin.json);
        assert_eq!(
            fin.local, before.local,
            "{step}: the client's socket changed"
        );
        assert!(fin.verified >= after.verified);
    }

    // Closed: each host is back to nothing of vnat's.
    for (host, d, who) in [(&lap, &l.d, "laptop"), (&srv, &s.d, "server")] {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = leftovers(host, d);
            if left.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{step}: the {who} still has, 30 s after the connection closed: {left}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

macro_rules! crash_at {
    ($($name:ident: $tag:literal, $step:literal, $side:ident;)*) => {$(
        #[test]
        fn $name() {
            scenario($tag, $step, Side::$side);
        }
    )*};
}

crash_at! {
    laptop_killed_after_adding_the_old_address_to_lo: "ck1", "install:lo-address", Laptop;
    server_killed_after_adding_the_host_route: "ck2", "install:host-route", Server;
    laptop_killed_after_attaching_tc: "ck3", "install:tc", Laptop;
    server_killed_after_attaching_tc: "ck4", "install:tc", Server;
    laptop_killed_after_writing_the_receive_side: "ck5", "install:receive-side", Laptop;
    server_killed_after_writing_the_receive_side: "ck6", "install:receive-side", Server;
    laptop_killed_after_writing_the_send_side: "ck7", "install:send-side", Laptop;
    server_killed_after_writing_the_send_side: "ck8", "install:send-side", Server;
    laptop_killed_after_removing_the_send_side: "cr1", "remove:send-side", Laptop;
    server_killed_after_removing_the_send_side: "cr2", "remove:send-side", Server;
    laptop_killed_after_removing_the_receive_side: "cr3", "remove:receive-side", Laptop;
    server_killed_after_removing_the_receive_side: "cr4", "remove:receive-side", Server;
    laptop_killed_after_removing_the_old_address_from_lo: "cr5", "remove:lo-address", Laptop;
    server_killed_after_removing_the_host_route: "cr6", "remove:host-route", Server;
    laptop_killed_after_detaching_tc: "cr7", "remove:tc", Laptop;
    server_killed_after_detaching_tc: "cr8", "remove:tc", Server;
}

/// A container's connection: the laptop's vnatd dies while it holds the
/// connection's replies to pin its NAT entry (`guests.rs`). The next vnatd
/// lets them go: the connection carries on byte-exact on the same socket
/// (held for good, no reply would ever reach the container again).
#[test]
fn laptop_killed_while_a_containers_replies_are_held() {
    let (tag, step) = ("ckp", "pin:replies-held");
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let ctr = Container::behind(&topo.laptop, &format!("{tag}c"), 88, "ct0");
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let mut l = Daemon::start(&lap, &format!("{tag}l"), Some(step));
    let _s = Daemon::start(&srv, &format!("{tag}s"), None);
    let cgroup = ctr.cgroup.path().display().to_string();
    l.d.ctl(&["enable", "--cgroup", &cgroup])
        .expect("laptop vnatd unreachable");
    let mut cmd = StreamOptions::tcp(server).rate(200_000).command(&ctr.ns);
    ctr.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    wait_for(&format!("the laptop's vnatd to die at {step}"), 30, || {
        l.dead()
    });
    // vnatd can die before the stream's first status line: the count at
    // the death is then the first line's.
    let at_death = client.wait_until(Duration::from_secs(10), "a first status line", |_| true);
    l.revive();
    client.wait_verified_at_least(at_death.verified + 200_000, Duration::from_secs(30));
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream failed: {:?}", fin.json);
    assert_eq!(fin.local, at_death.local, "the container's socket changed");
}

#[test]
fn every_step_has_a_test() {
    let src = include_str!("crash_safety.rs");
    for step in fault::STEPS {
        assert!(
            src.contains(&format!("\"{step}\", Laptop;"))
                || src.contains(&format!("\"{step}\", Server;"))
                || src.contains(&format!("\"{step}\");")),
            "no crash test for the step {step}"
        );
    }
}

/// A host route and an `lo` address someone else made for the very
/// addresses a move needs are used as they are, never replaced, and still
/// there after the connection closed.
#[test]
fn routes_and_addresses_vnat_did_not_make_are_left_alone() {
    let topo = LaptopRouterServer::builder().tag("ckow").build();
    let lap = Host::new(&topo.laptop, "ckowl");
    let srv = Host::new(&topo.server, "ckows");
    let (ldir, sdir) = (TempDir::new("ckowl"), TempDir::new("ckows"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let laptop_old = topo.laptop_a_addr.v4;
    let router_c = topo.router_c_addr.v4;
    // The server's administrator routes the laptop's address explicitly
    // (protocol "static"), and the laptop's keeps it on lo as well.
    topo.server.add_route(
        &laptop_old.to_string(),
        router_c.into(),
        &topo.server_if,
        RouteProtocol::Static,
    );
    topo.laptop.add_addr("lo", laptop_old.into(), 32);
    // `ip route show ADDR`: the main table's routes to exactly ADDR/32.
    let show_route = || -> Vec<Route> {
        topo.server
            .routes()
            .into_iter()
            .filter(|r| r.in_main_table() && r.dst == IpAddr::from(laptop_old) && r.prefix == 32)
            .collect()
    };
    let route_before = show_route();
    assert!(
        route_before.len() == 1 && route_before[0].protocol == RouteProtocol::Static,
        "{route_before:?}"
    );

    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());
    let mut cmd = StreamOptions::tcp(server)
        .rate(200_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(30_000, Duration::from_secs(10));
    wait_for("the connection to be mobile", 20, || {
        lapd.mobile_to("tcp", server.ip())
    });
    topo.move_laptop_to_b();
    let moved = client.wait_progress(&before, 200_000, Duration::from_secs(20));
    assert_eq!(
        show_route(),
        route_before,
        "the server's own route for the laptop's old address was replaced"
    );
    let ls = srvd
        .ctl(&["ls", "--state", "translated"])
        .expect("server vnatd");
    assert_eq!(ls.as_array().map(Vec::len), Some(1), "{ls}");
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert!(fin.verified >= moved.verified);

    wait_for("the server's translation to go", 20, || {
        srvd.ctl(&["status"]).expect("server vnatd")["datapath"]["translations"] == 0
    });
    wait_for("the laptop's translation to go", 20, || {
        lapd.ctl(&["status"]).expect("laptop vnatd")["datapath"]["translations"] == 0
    });
    assert_eq!(
        show_route(),
        route_before,
        "the server's own route was changed or removed when the connection closed"
    );
    assert!(
        lo_addresses(&lap).contains(&topo.laptop_a_addr.v4.into()),
        "vnat removed the address the laptop's administrator put on lo"
    );
    // And a restarted vnatd does not tidy them away either.
    drop((lapd, srvd));
    let (_lapd, _srvd) = (
        Vnatd::start(&lap, ldir.path()),
        Vnatd::start(&srv, sdir.path()),
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        show_route(),
        route_before,
        "a restarted vnatd removed the server's own route"
    );
    assert!(
        lo_addresses(&lap).contains(&topo.laptop_a_addr.v4.into()),
        "a restarted vnatd removed the address the laptop's administrator put on lo"
    );
}
