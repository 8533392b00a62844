//! A planned move with a long outage, as when a laptop is suspended, carried
//! elsewhere and woken up: `vnatctl suspend --all`, the network is gone for
//! two minutes (TCP backs its retransmission timer off to tens of seconds
//! meanwhile), the laptop wakes up on another subnet, `vnatctl resume --all`:
//! data flows again within 2 seconds, on the same connection, byte-exact.

mod support;

use std::{
    net::SocketAddr,
    process::Command,
    time::{Duration, Instant},
};

use vnat_tests::{
    bin_path, EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

const OUTAGE: Duration = Duration::from_secs(120);

fn vnatctl(d: &Vnatd, args: &[&str]) {
    let out = Command::new(bin_path("vnatctl"))
        .arg("--control")
        .arg(&d.control)
        .args(args)
        .output()
        .expect("running vnatctl");
    assert!(
        out.status.success(),
        "vnatctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn wait_mobile(d: &Vnatd) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !d.ctl(&["ls"]).is_some_and(|ls| {
        ls.as_array()
            .is_some_and(|a| a.iter().any(|r| r["mobile"] == true))
    }) {
        assert!(
            Instant::now() < deadline,
            "the connection never became mobile"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn suspend_two_minutes_without_network_then_resume_elsewhere() {
    let topo = LaptopRouterServer::builder().tag("pout").build();
    let lap = Host::new(&topo.laptop, "poutl");
    let srv = Host::new(&topo.server, "pouts");
    let (dl, ds) = (TempDir::new("poutl"), TempDir::new("pouts"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, dl.path());
    let _srvd = Vnatd::start(&srv, ds.path());
    let mut cmd = StreamOptions::tcp(server)
        .rate(100_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(20_000, Duration::from_secs(10));
    wait_mobile(&lapd);

    vnatctl(&lapd, &["suspend", "--all"]);
    // The network goes: subnet A's address and link.
    for (a, p) in topo.laptop_a_addr.with_prefixes() {
        topo.laptop.del_addr(&topo.laptop_if_a, a, p);
    }
    topo.laptop.link_down(&topo.laptop_if_a);
    std::thread::sleep(OUTAGE);
    let at_wake = client.latest().expect("status").verified;

    // The laptop wakes up on subnet B and resumes.
    topo.plug_laptop_b();
    topo.laptop
        .default_route(topo.router_b_addr.v4.into(), &topo.laptop_if_b);
    let usable = Instant::now();
    vnatctl(&lapd, &["resume", "--all"]);
    let resumed = client.wait_verified_at_least(at_wake + 1, Duration::from_secs(30));
    let took = usable.elapsed();
    eprintln!(
        "data flowing again {took:?} after the new address became usable (outage {OUTAGE:?})"
    );
    assert!(
        took <= Duration::from_secs(2),
        "data took {took:?} (> 2 s) to flow again after a {OUTAGE:?} outage"
    );
    let after = client.wait_verified_at_least(resumed.verified + 50_000, Duration::from_secs(10));
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= after.verified);
}
