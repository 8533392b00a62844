//! What the datapath manager sets up for a translation (address on lo, the
//! moved flow's own route, tc attachment, NAT pair) and takes down again when the last
//! translation needing it goes; a failed install changes nothing.

mod support;

use std::net::{IpAddr, SocketAddr};

use netlink_packet_route::route::RouteProtocol;
use vnat_daemon::datapath::{Datapath, DatapathError, Proto, Translation, VirtualFlow};
use vnat_tests::{Host, Route, SameLink};

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn lo_has(h: &Host, addr: &str) -> bool {
    h.ns.addresses("lo")
        .iter()
        .any(|a| a.addr == ip(addr) && a.prefix == 32)
}

/// The routes of protocol 157 (vnat's), both families, every table.
fn vnat_routes(h: &Host) -> Vec<Route> {
    h.ns.routes()
        .into_iter()
        .filter(|r| r.protocol == RouteProtocol::from(157))
        .collect()
}

/// How many rules of protocol 157 (vnat's) there are.
fn vnat_rules(h: &Host) -> usize {
    h.ns.rules().iter().filter(|r| r.protocol == 157).count()
}

fn tc_users(h: &Host) -> Vec<(String, u32)> {
    h.datapath(|dp| {
        dp.status()
            .unwrap()
            .tc
            .into_iter()
            .map(|t| (t.ifname, t.users))
            .collect()
    })
}

#[test]
fn install_and_remove_set_up_and_take_down_everything() {
    let topo = SameLink::new("life", false);
    let lap = Host::new(&topo.laptop, "lifel");
    let srv = Host::new(&topo.server, "lifes");
    topo.move_laptop();
    let flow = VirtualFlow {
        proto: Proto::Tcp,
        local: sa("198.18.1.2:40000"),
        remote: sa("198.18.1.3:5001"),
    };
    let t = Translation {
        flow,
        physical_local: sa("198.18.1.9:40000"),
        physical_remote: flow.remote,
    };
    let back_flow = VirtualFlow {
        proto: Proto::Tcp,
        local: flow.remote,
        remote: flow.local,
    };
    let back = Translation {
        flow: back_flow,
        physical_local: flow.remote,
        physical_remote: t.physical_local,
    };

    assert!(
        tc_users(&lap).is_empty(),
        "tc must not be attached before any translation"
    );
    lap.datapath(move |dp| dp.install_translation(&t)).unwrap();
    srv.datapath(move |dp| dp.install_translation(&back))
        .unwrap();
    assert!(
        lo_has(&lap, "198.18.1.2"),
        "the moved-away address is not kept on lo"
    );
    assert_eq!(topo.laptop.sysctl("net.ipv4.conf.all.arp_ignore"), "1");
    let eth0 = srv.ns.link("eth0").expect("the server's eth0").index;
    // The flow's own packets, and only they, are routed to the laptop's
    // new address: a rule for the flow, a route in vnat's table.
    assert!(
        vnat_routes(&srv)
            .iter()
            .any(|r| (r.dst, r.prefix, r.gateway, r.oif)
                == (ip("198.18.1.2"), 32, Some(ip("198.18.1.9")), Some(eth0))
                && !r.in_main_table()),
        "no route 198.18.1.2 via 198.18.1.9 dev eth0 in a table of vnat's: {:?}",
        vnat_routes(&srv)
    );
    assert_eq!(vnat_rules(&srv), 1, "{:?}", srv.ns.rules());
    assert_eq!(tc_users(&lap), vec![("eth0".to_string(), 1)]);
    assert_eq!(tc_users(&srv), vec![("eth0".to_string(), 1)]);

    // A failed install (no route to the new physical address) changes nothing.
    let bad = Translation {
        physical_remote: sa("198.18.77.7:5001"),
        ..back
    };
    let err = srv
        .datapath(move |dp| dp.install_translation(&bad))
        .unwrap_err();
    assert!(matches!(err, DatapathError::NoRoute { .. }), "{err}");
    assert_eq!(srv.datapath(|dp| dp.translations().unwrap()), vec![back]);
    // Another flow claiming the same physical endpoints is refused: a
    // conflict that names the translation holding them.
    let other = Translation {
        flow: VirtualFlow {
            local: sa("198.18.1.3:5002"),
            ..back_flow
        },
        physical_local: back.physical_local,
        physical_remote: back.physical_remote,
    };
    let err = srv
        .datapath(move |dp| dp.install_translation(&other))
        .unwrap_err();
    assert!(
        matches!(&err, DatapathError::Conflict { other, .. } if **other == back.flow),
        "{err}"
    );
    assert_eq!(srv.datapath(|dp| dp.translations().unwrap()), vec![back]);

    lap.datapath(move |dp| dp.remove_translation(&flow))
        .unwrap();
    srv.datapath(move |dp| dp.remove_translation(&back_flow))
        .unwrap();
    assert!(
        !lo_has(&lap, "198.18.1.2"),
        "the lo address outlived its last translation"
    );
    assert_eq!(
        vnat_routes(&srv),
        vec![],
        "the flow's route outlived its translation"
    );
    assert_eq!(
        vnat_rules(&srv),
        0,
        "the flow's rule outlived its translation"
    );
    assert!(
        tc_users(&lap).is_empty() && tc_users(&srv).is_empty(),
        "tc stayed attached with no translation"
    );
    let err = lap
        .datapath(move |dp| dp.remove_translation(&flow))
        .unwrap_err();
    assert!(matches!(err, DatapathError::NoSuchTranslation { .. }));
}

#[test]
fn an_address_that_was_on_lo_before_is_left_alone() {
    let topo = SameLink::new("lifelo", false);
    let lap = Host::new(&topo.laptop, "lifelo");
    topo.move_laptop();
    topo.laptop.add_addr("lo", ip("198.18.1.2"), 32);
    let flow = VirtualFlow {
        proto: Proto::Udp,
        local: sa("198.18.1.2:9000"),
        remote: sa("198.18.1.3:9001"),
    };
    let t = Translation {
        flow,
        physical_local: sa("198.18.1.9:9000"),
        physical_remote: flow.remote,
    };
    lap.datapath(move |dp| dp.install_translation(&t)).unwrap();
    lap.datapath(move |dp| dp.remove_translation(&flow))
        .unwrap();
    assert!(
        lo_has(&lap, "198.18.1.2"),
        "vnat removed an address it had not added"
    );
}

#[test]
fn a_prepared_move_only_accepts_and_can_be_abandoned() {
    let topo = SameLink::new("lifeprep", false);
    let lap = Host::new(&topo.laptop, "lifep");
    topo.move_laptop();
    let flow = VirtualFlow {
        proto: Proto::Tcp,
        local: sa("198.18.1.2:40000"),
        remote: sa("198.18.1.3:5001"),
    };
    let t = Translation {
        flow,
        physical_local: sa("198.18.1.9:40000"),
        physical_remote: flow.remote,
    };
    lap.datapath(move |dp| dp.prepare_translation(&t)).unwrap();
    // Receive side ready (tc attached, address kept), send side untouched.
    assert_eq!(tc_users(&lap), vec![("eth0".to_string(), 0)]);
    assert!(lo_has(&lap, "198.18.1.2"));
    assert!(lap.datapath(|dp| dp.translations().unwrap()).is_empty());
    // The migration is abandoned: everything goes.
    lap.datapath(move |dp| dp.remove_translation(&flow))
        .unwrap();
    assert!(tc_users(&lap).is_empty());
    assert!(!lo_has(&lap, "198.18.1.2"));
}
