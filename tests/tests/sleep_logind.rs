//! Sleep through logind (issue 30, part 4): the laptop's vnatd holds a
//! delay inhibitor on a system bus of the test's own (a real dbus-daemon)
//! from a stand-in logind (`vnat-login1`: no logind runs on the test
//! hosts). When the stand-in sends `PrepareForSleep(true)`, vnatd settles
//! roles and keys with the peer while the network is up and releases the
//! inhibitor before logind's delay; the test takes the laptop's network
//! away as soon as it is released, as a real sleep would, wakes it on
//! another subnet, and the same TCP connection goes on byte-exact. A peer
//! that never answers must not hold the inhibitor past the delay.
//!
//! The server's vnatd gets no bus address: it says once that sleep is not
//! watched and works as before.

mod support;

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, LogindEvent, StandInLogind, StreamClient, StreamOptions,
    SystemBus, TempDir, Vnatd,
};

/// logind's default InhibitDelayMaxSec.
const DELAY: Duration = Duration::from_secs(5);

fn stream(lap: &Host, server: SocketAddr) -> StreamClient {
    let mut cmd = StreamOptions::tcp(server).rate(400_000).command(lap.ns);
    lap.cgroup.join_on_spawn(&mut cmd);
    StreamClient::from_command(cmd)
}

/// vnatd on `host` with the test's bus as its system bus.
fn vnatd_on_bus(host: &Host, dir: &TempDir, bus: &SystemBus) -> Vnatd {
    let address = bus.address();
    Vnatd::start_with_env(
        host,
        dir.path(),
        &[],
        &[("DBUS_SYSTEM_BUS_ADDRESS", address.as_str())],
    )
}

fn wait_inhibited(logind: &StandInLogind, what: &str) {
    logind.wait_for(what, Duration::from_secs(15), |e| match e {
        LogindEvent::Inhibited { who, mode } if who == "vnatd" => {
            assert_eq!(mode, "delay", "vnatd must take a delay inhibitor");
            Some(())
        }
        _ => None,
    });
}

/// How long after `PrepareForSleep(true)` vnatd released its inhibitor.
fn wait_released(logind: &StandInLogind) -> Duration {
    logind.wait_for(
        "vnatd's release of its inhibitor",
        DELAY + Duration::from_secs(5),
        |e| match e {
            LogindEvent::Released { who, after } if who == "vnatd" => {
                Some(after.expect("released before any sleep"))
            }
            _ => None,
        },
    )
}

/// The `ls` row of the TCP connection to `server`.
fn row(d: &Vnatd, server: SocketAddr, remote_is_server: bool) -> Value {
    let ls = d.ctl(&["ls", "--proto", "tcp"]).expect("vnatd answers ls");
    let key = if remote_is_server {
        "virtual_remote"
    } else {
        "virtual_local"
    };
    ls.as_array()
        .and_then(|rows| rows.iter().find(|r| r[key] == server.to_string()).cloned())
        .unwrap_or_else(|| panic!("no connection with {key} {server}: {ls}"))
}

fn rekeyed(d: &Vnatd) -> u64 {
    d.ctl(&["status"]).expect("vnatd answers status")["vcmp"]["events"]["rekeyed"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn roles_and_keys_are_settled_before_the_inhibitor_goes_and_the_connection_wakes_elsewhere() {
    let topo = LaptopRouterServer::builder().tag("slp").build();
    let lap = Host::new(&topo.laptop, "slpl");
    let srv = Host::new(&topo.server, "slps");
    let (dl, ds) = (TempDir::new("slpl"), TempDir::new("slps"));
    let bus = SystemBus::start("slp");
    let mut logind = StandInLogind::start(&bus, DELAY);
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = vnatd_on_bus(&lap, &dl, &bus);
    let srvd = Vnatd::start(&srv, ds.path());
    wait_inhibited(&logind, "vnatd's inhibitor at start");

    let c = stream(&lap, server);
    let before = c.wait_verified_at_least(100_000, Duration::from_secs(15));
    lapd.wait_mobile_to("tcp", server.ip());
    let (lap_keys, srv_keys) = (rekeyed(&lapd), rekeyed(&srvd));

    logind.sleep();
    let after = wait_released(&logind);
    // As a real sleep does once the inhibitor is gone: no network.
    topo.laptop.link_down(&topo.laptop_if_a);
    let released_at = Instant::now();
    assert!(
        after < DELAY,
        "the inhibitor was held {after:?}, past logind's delay of {DELAY:?}"
    );
    // Settled with the peer before the release: both ends agree on the
    // roles, and both took the suspend-time key agreement.
    let lap_row = row(&lapd, server, true);
    let srv_row = row(&srvd, server, false);
    assert_eq!(lap_row["role"], "primary", "laptop: {lap_row}");
    assert_eq!(
        srv_row["role"], "secondary",
        "the server never answered the laptop's claim: {srv_row}"
    );
    assert!(
        rekeyed(&lapd) > lap_keys && rekeyed(&srvd) > srv_keys,
        "the suspend-time key agreement did not complete before the release"
    );
    eprintln!(
        "inhibitor released {after:?} after PrepareForSleep(true); checked in {:?}",
        released_at.elapsed()
    );

    // Asleep a while, then awake on the other subnet (A's addresses go).
    std::thread::sleep(Duration::from_secs(2));
    topo.move_laptop_to_b();
    let at_wake = c.latest().expect("no status from the stream").verified;
    logind.wake();
    wait_inhibited(&logind, "a new inhibitor after the wake");
    let resumed = c.wait_verified_at_least(at_wake + 200_000, Duration::from_secs(30));
    eprintln!(
        "{} bytes verified after the wake",
        resumed.verified - at_wake
    );
    let moved = row(&lapd, server, true);
    assert_eq!(
        moved["physical_local"]
            .as_str()
            .map(|a| a.starts_with(&topo.laptop_b_addr.v4.to_string())),
        Some(true),
        "the connection does not use the new network: {moved}"
    );
    let fin = c.stop();
    assert_eq!(fin.error, None, "the stream failed: {:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
}

#[test]
fn a_peer_that_never_answers_does_not_hold_the_inhibitor_past_the_delay() {
    const SHORT_DELAY: Duration = Duration::from_secs(3);
    let topo = LaptopRouterServer::builder().tag("slq").build();
    let lap = Host::new(&topo.laptop, "slql");
    let srv = Host::new(&topo.server, "slqs");
    let (dl, ds) = (TempDir::new("slql"), TempDir::new("slqs"));
    let bus = SystemBus::start("slq");
    let mut logind = StandInLogind::start(&bus, SHORT_DELAY);
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = vnatd_on_bus(&lap, &dl, &bus);
    let srvd = Vnatd::start(&srv, ds.path());
    wait_inhibited(&logind, "vnatd's inhibitor at start");
    let c = stream(&lap, server);
    c.wait_verified_at_least(50_000, Duration::from_secs(15));
    lapd.wait_mobile_to("tcp", server.ip());

    // The server's vnatd hears nothing more: the laptop's claim and key
    // agreement would be resent for about 15 s.
    srvd.freeze(true);
    logind.sleep();
    let after = wait_released(&logind);
    assert!(
        after < SHORT_DELAY,
        "an unanswering peer held the inhibitor {after:?}, past logind's delay of {SHORT_DELAY:?}"
    );
    // It waited for the peer (up to the delay less a second) rather than
    // letting go at once.
    assert!(
        after >= SHORT_DELAY - Duration::from_millis(1500),
        "the inhibitor went after {after:?}, before the peer could have answered"
    );
    let lap_row = row(&lapd, server, true);
    assert_ne!(
        lap_row["role"], "secondary",
        "nobody answered, so the laptop keeps its claim: {lap_row}"
    );
    srvd.freeze(false);
    logind.wake();
    wait_inhibited(&logind, "a new inhibitor after the wake");
    let fin = c.stop();
    assert_eq!(fin.error, None, "the stream failed: {:?}", fin.json);
}
