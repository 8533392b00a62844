//! The process that owns the datapath can die: after a move, vnatd is
//! killed with SIGKILL, translation goes on with no owner, and a new vnatd
//! reconciles with the pins (same translations, tc still attached) and shows
//! the moved connection through `vnatctl`.

mod support;

use vnat_tests::{move_flow, Host};

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use vnat_daemon::datapath::{Proto, VirtualFlow};
use vnat_tests::{EchoServer, LaptopRouterServer, StreamClient, StreamOptions, Vnatd};

#[test]
fn translation_survives_vnatd_sigkill_and_a_new_vnatd_reconciles() {
    let topo = LaptopRouterServer::builder().tag("drst").build();
    let lap = Host::new(&topo.laptop, "drstl");
    let srv = Host::new(&topo.server, "drsts");
    let tmp = vnat_tests::TempDir::new("drst");
    let tmp = tmp.path();
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp(&topo.server, server);

    let vnatd = Vnatd::start(&lap, tmp);
    let mut cmd = StreamOptions::tcp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));

    // vnatctl ls --json shows the connection with the contract's keys.
    let deadline = Instant::now() + Duration::from_secs(10);
    let row = loop {
        let ls = vnatd.ctl(&["ls"]).expect("vnatd unreachable");
        let rows = ls.as_array().expect("ls --json is an array").clone();
        if let Some(r) = rows
            .into_iter()
            .find(|r| r["virtual_remote"] == server.to_string())
        {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "vnatctl ls never showed the connection"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(row["proto"], "tcp");
    assert_eq!(row["state"], "native");
    assert_eq!(row["virtual_local"], before.local);
    assert_eq!(row["physical_local"], before.local);

    topo.move_laptop_to_b();
    let local: SocketAddr = before.local.parse().unwrap();
    let new_local = SocketAddr::new(topo.laptop_b_addr.v4.into(), local.port());
    let flow = VirtualFlow {
        proto: Proto::Tcp,
        local,
        remote: server,
    };
    move_flow(&lap, &srv, flow, new_local);
    let moved = client.wait_verified_at_least(before.verified + 100_000, Duration::from_secs(30));

    // Kill the owner: nothing but the pins is left, and data keeps flowing.
    vnatd.kill9();
    let orphan = client.wait_verified_at_least(moved.verified + 200_000, Duration::from_secs(30));

    // A new vnatd adopts the pins.
    let vnatd = Vnatd::start(&lap, tmp);
    let status = vnatd.ctl(&["status"]).unwrap();
    let dp = &status["datapath"];
    assert_eq!(dp["translations"], 1, "status after restart: {status}");
    let tc = dp["tc"].as_array().expect("tc list");
    assert!(
        tc.iter()
            .any(|a| a["ifname"] == topo.laptop_if_b && a["users"] == 1),
        "tc is not attached to the laptop's new interface: {tc:?}"
    );
    let ls = vnatd.ctl(&["ls", "--state", "translated"]).unwrap();
    let rows = ls.as_array().unwrap();
    assert_eq!(rows.len(), 1, "{ls}");
    assert_eq!(rows[0]["physical_local"], new_local.to_string());
    assert_eq!(rows[0]["virtual_local"], before.local);
    client.wait_verified_at_least(orphan.verified + 100_000, Duration::from_secs(30));

    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
}
