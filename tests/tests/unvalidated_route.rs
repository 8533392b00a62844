//! An authenticated update never steers traffic that is not the moved
//! flow's, and nothing at all before the new address is validated (issue
//! 31, item 2).
//!
//! The server has a second link, a LAN (subnet 198.18.77.0/24) where
//! nobody answers. A rogue peer behind the router (vnat's own protocol
//! core driven by the test, with valid keys for its own UDP flow to the
//! server, so its updates authenticate) first makes a genuine move of its
//! flow to a second address of its own, which the server validates; then
//! it announces that its end moved to P1 = 198.18.77.9:9 on the server's
//! LAN. Until a RESPONSE comes from there (never), the server must not
//! route anything by it: `ip route get` for the rogue's virtual address V
//! still leaves by the router, and another application of the server (not
//! in vnat's cgroup) still reaches V. Then the rogue alternates updates
//! naming P1 and P2 = 198.18.77.10:9, one a second, for longer than two
//! validations take to fail, so that validations fail while the other
//! address is pending: all along, nothing leads to the LAN; once it stops
//! and the last validation fails, no route, rule or NAT entry for either
//! address is left, and the flow is translated to its validated address
//! again.
//!
//! (Before the fix, the server added `V/32 via P` to its main table as
//! soon as the update authenticated, for every application, and left the
//! receive sides of abandoned addresses in its NAT map.)

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    thread,
    time::{Duration, Instant},
};

use vnat_common::{FlowKey, NatRewrite, MAP_EGRESS_NAT, MAP_INGRESS_NAT};
use vnat_daemon::datapath::key_endpoints;
use vnat_tests::{
    attach_attacker, veth, wait_until, EchoServer, Host, LaptopRouterServer, Netns, Rogue, TempDir,
    Vnatd,
};

const LAN_IF: &str = "lan0";
const SERVER_LAN: Ipv4Addr = Ipv4Addr::new(198, 18, 77, 1);
const P1: Ipv4Addr = Ipv4Addr::new(198, 18, 77, 9);
const P2: Ipv4Addr = Ipv4Addr::new(198, 18, 77, 10);
/// The rogue's second address, on its own subnet (a genuine move).
const ROGUE_B: Ipv4Addr = Ipv4Addr::new(198, 18, 4, 3);

/// `ip route get DST` in `ns`, as one line.
fn route_get(ns: &Netns, dst: IpAddr) -> String {
    ns.run_stdout(&["ip", "route", "get", &dst.to_string()])
        .trim()
        .replace('\n', " ")
}

/// Every (map, source, destination) of the server's pinned NAT entries,
/// keys and rewritten endpoints both, that involves `ip`.
fn nat_entries_with(host: &Host, ip: IpAddr) -> Vec<String> {
    let mut found = Vec::new();
    for name in [MAP_EGRESS_NAT, MAP_INGRESS_NAT] {
        let pin = host.pins.path().join(name);
        let data = aya::maps::MapData::from_pin(&pin)
            .unwrap_or_else(|e| panic!("opening the pinned map {}: {e}", pin.display()));
        let map: aya::maps::HashMap<_, FlowKey, NatRewrite> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))
                .unwrap_or_else(|e| panic!("{name} is not a hash map: {e}"));
        for entry in map.iter() {
            let (k, v) = entry.unwrap_or_else(|e| panic!("reading {name}: {e}"));
            let rewritten = FlowKey {
                src_addr_be: v.src_addr_be,
                dst_addr_be: v.dst_addr_be,
                src_port_be: v.src_port_be,
                dst_port_be: v.dst_port_be,
                ..k
            };
            for key in [k, rewritten] {
                if let Some((s, d)) = key_endpoints(&key) {
                    if s.ip() == ip || d.ip() == ip {
                        found.push(format!("{name}: {s} -> {d}"));
                    }
                }
            }
        }
    }
    found
}

/// In `ns`: routes to or through `p`, vnat's routes (protocol 157) for
/// `v`, and vnat's per-flow rules.
fn routing_with(ns: &Netns, v: IpAddr, p: IpAddr) -> Vec<String> {
    let mut found: Vec<String> = ns
        .routes()
        .into_iter()
        .filter(|r| {
            r.gateway == Some(p) || r.dst == p || (u8::from(r.protocol) == 157 && r.dst == v)
        })
        .map(|r| format!("route {r:?}"))
        .collect();
    found.extend(
        ns.rules()
            .into_iter()
            // Not the last-resort rules of addresses kept for mobile flows
            // (vnat's table 0x766effff): no route of theirs leads anywhere.
            .filter(|r| r.protocol == 157 && r.table != 0x766e_ffff)
            .map(|r| format!("rule {r:?}")),
    );
    found
}

use vnat_tests::rogue_row as row;

/// Nothing of vnat's leads to the LAN: the route to V does not, another
/// application still reaches V.
fn assert_v_untouched(ns: &Netns, v: IpAddr, what: &str) {
    let r = route_get(ns, v);
    assert!(
        !r.contains(LAN_IF),
        "{what}: `ip route get {v}` leads to the LAN, where the unvalidated address is: {r}"
    );
    assert!(
        ns.reachable(v, Duration::from_secs(2)),
        "{what}: another application of the server no longer reaches {v} (route: {r})"
    );
}

#[test]
fn an_unvalidated_address_steers_nothing_and_leaves_nothing() {
    let tag = "uvr";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let (attacker, attacker_ip) = attach_attacker(&topo, &format!("{tag}-a"));
    attacker.add_addr("eth0", ROGUE_B.into(), 24);
    // The server's LAN: a link to a namespace with no address at all.
    let lan = Netns::new(&format!("{tag}-n"));
    veth(&topo.server, LAN_IF, &lan, "eth0");
    topo.server.add_addr(LAN_IF, SERVER_LAN.into(), 24);

    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let sdir = TempDir::new(&format!("{tag}s"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5002);
    let _echo = EchoServer::udp_in(&srv, server);
    let srvd = Vnatd::start(&srv, sdir.path());
    attacker.wait_reachable(topo.server_addr.v4.into(), Duration::from_secs(5));
    assert_v_untouched(&topo.server, attacker_ip, "before anything");

    // The rogue listens on the VCMP port, so that it can answer the
    // server's challenge of its genuine second address.
    let rogue = Rogue::start(&attacker, 2031);
    let own = rogue.open_bound_udp_flow(&attacker, server, &srvd);

    // 1. A genuine move, validated: the flow is translated to B. The
    //    rogue's VCMP now leaves from B (its flow's socket stays bound to
    //    its first address), so that the server may challenge B: it sends
    //    nothing to an address that sent it nothing.
    attacker.run(&[
        "ip",
        "route",
        "replace",
        "default",
        "via",
        "198.18.4.1",
        "dev",
        "eth0",
        "src",
        &ROGUE_B.to_string(),
    ]);
    let at_b = SocketAddr::new(ROGUE_B.into(), own.local.port());
    rogue.resume(own, at_b);
    wait_until(
        Duration::from_secs(20),
        || row(&srvd, &own).is_some_and(|r| r["physical_remote"] == at_b.to_string()),
        || {
            format!(
                "the server never sent the rogue's flow to {at_b}: {:?}",
                row(&srvd, &own)
            )
        },
    );
    assert_v_untouched(&topo.server, attacker_ip, "after a validated move");

    // 2. An authenticated update naming P1 on the server's LAN; nothing
    //    answers there. The receive side is prepared (the ingress entry
    //    from P1 appears), but nothing may steer V's traffic.
    let (p1, p2) = (IpAddr::V4(P1), IpAddr::V4(P2));
    rogue.resume(own, SocketAddr::new(p1, 9));
    wait_until(
        Duration::from_secs(10),
        || !nat_entries_with(&srv, p1).is_empty(),
        || "the server never prepared a receive side for P1".to_string(),
    );
    assert_v_untouched(&topo.server, attacker_ip, "P1 announced, not validated");
    let routing = routing_with(&topo.server, attacker_ip, p1);
    assert!(
        routing.is_empty(),
        "before P1 is validated, the server routes by it: {routing:?}"
    );

    // 3. P1 and P2 alternately for 60 s (issue 31's figure), four times
    //    as long as a validation takes to fail (8 tries, about 15 s): some
    //    fail while the other one is pending.
    let started = Instant::now();
    let mut n = 0u32;
    while started.elapsed() < Duration::from_secs(60) {
        let p = if n.is_multiple_of(2) { p2 } else { p1 };
        rogue.resume(own, SocketAddr::new(p, 9));
        n += 1;
        thread::sleep(Duration::from_millis(500));
        assert_v_untouched(
            &topo.server,
            attacker_ip,
            &format!("update {n}, naming {p}, not validated"),
        );
        let routing = [
            routing_with(&topo.server, attacker_ip, p1),
            routing_with(&topo.server, attacker_ip, p2),
        ]
        .concat();
        assert!(
            routing.is_empty(),
            "update {n}: the server routes by an unvalidated address: {routing:?}"
        );
    }
    eprintln!(
        "unvalidated_route: {n} updates alternating P1 and P2 in {:?}",
        started.elapsed()
    );

    // 4. Once the rogue stops, the last validation fails (at most about
    //    15 s later): nothing for P1 or P2 is left, and the flow goes to
    //    its validated address.
    wait_until(
        Duration::from_secs(40),
        || {
            nat_entries_with(&srv, p1).is_empty()
                && nat_entries_with(&srv, p2).is_empty()
                && routing_with(&topo.server, attacker_ip, p1).is_empty()
                && routing_with(&topo.server, attacker_ip, p2).is_empty()
        },
        || {
            format!(
                "after the last validation failed, the server still holds: {:?} {:?} {:?} {:?}",
                nat_entries_with(&srv, p1),
                nat_entries_with(&srv, p2),
                routing_with(&topo.server, attacker_ip, p1),
                routing_with(&topo.server, attacker_ip, p2)
            )
        },
    );
    let r = row(&srvd, &own).expect("the rogue's flow is still listed");
    assert_eq!(
        r["physical_remote"],
        at_b.to_string(),
        "the flow is not back at its validated address: {r}"
    );
    assert_v_untouched(
        &topo.server,
        attacker_ip,
        "after the last validation failed",
    );
    drop((srvd, rogue));
}
