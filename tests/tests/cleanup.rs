//! `vnatd --cleanup` after vnatd was killed in the middle of its work (a
//! migrated TCP connection, a mobile UDP flow): none of vnat's rules,
//! routes, addresses on lo, sink, tc programs or pins is left, the ARP
//! sysctls are back at the values they had before vnatd first ran, and
//! what someone else made stays. Refused while vnatd runs (on its
//! control socket, or on its pins from another control socket), as is a
//! second vnatd on the same pins; a second run finds nothing. And a clean stop puts the sysctls back once no address
//! stays kept on lo.

mod support;

use std::{
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::Output,
    time::Duration,
};

use serde_json::Value;
use vnat_tests::{
    bin_path, wait_until, EchoServer, Host, LaptopRouterServer, Netns, StreamClient, StreamOptions,
    TempDir, Vnatd,
};

/// vnat's routes, rules and `lo` addresses carry this protocol number.
const VNAT_PROTO: u8 = 157;
/// Values no host has by default and vnat never sets (it sets 1 and 2).
const ARP_IGNORE: (&str, &str) = ("net.ipv4.conf.all.arp_ignore", "2");
const ARP_ANNOUNCE: (&str, &str) = ("net.ipv4.conf.all.arp_announce", "1");
/// Metric of the laptop's second default route, via B.
const B_METRIC: u32 = 2000;

/// `vnatd --cleanup ARGS` in `ns`, for the vnatd whose files are in `dir`
/// and whose pins are `host`'s.
fn cleanup(host: &Host, dir: &Path, extra: &[&str]) -> Output {
    host.ns
        .cmd(bin_path("vnatd"))
        .args(["--config", "/dev/null", "--cleanup"])
        .arg("--control")
        .arg(dir.join("vnatd.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--bpffs")
        .arg(host.pins.path())
        .args(extra)
        .output()
        .expect("running vnatd --cleanup")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn set_unusual_arp(ns: &Netns) {
    for (key, value) in [ARP_IGNORE, ARP_ANNOUNCE] {
        ns.set_sysctl(key, value);
    }
}

fn arp(ns: &Netns) -> (String, String) {
    (ns.sysctl(ARP_IGNORE.0), ns.sysctl(ARP_ANNOUNCE.0))
}

fn unusual() -> (String, String) {
    (ARP_IGNORE.1.to_string(), ARP_ANNOUNCE.1.to_string())
}

fn vnats() -> (String, String) {
    ("1".to_string(), "2".to_string())
}

/// What of vnat's a user sees in `ns`: rules and routes (any table) with
/// its protocol number, its addresses on lo, the sink, and the tc programs
/// (TCX or clsact, with a clsact qdisc) on `interfaces`. Empty when there
/// is none.
fn vnat_footprint(ns: &Netns, interfaces: &[&str]) -> Vec<String> {
    let mut out: Vec<String> = ns
        .rules()
        .into_iter()
        .filter(|r| r.protocol == VNAT_PROTO)
        .map(|r| format!("rule {r:?}"))
        .collect();
    out.extend(
        ns.routes()
            .into_iter()
            .filter(|r| u8::from(r.protocol) == VNAT_PROTO)
            .map(|r| format!("route {r:?}")),
    );
    out.extend(
        ns.addresses("lo")
            .into_iter()
            .filter(|a| a.protocol.map(u8::from) == Some(VNAT_PROTO))
            .map(|a| format!("address on lo {a:?}")),
    );
    if ns.link("vnat-sink").is_some() {
        out.push("link vnat-sink".into());
    }
    for dev in interfaces {
        for hook in ["ingress", "egress"] {
            let filters = ns.run_stdout(&["tc", "filter", "show", "dev", dev, hook]);
            if filters.contains("vnat_") {
                out.push(format!("clsact filter on {dev} {hook}: {filters}"));
            }
        }
        // A clsact qdisc vnat added goes with its filters (the test's
        // namespaces have no other).
        if ns
            .run_stdout(&["tc", "qdisc", "show", "dev", dev])
            .contains("clsact")
        {
            out.push(format!("clsact qdisc on {dev}"));
        }
        for program in tcx_programs(ns, dev) {
            out.push(format!("TCX program {program} on {dev}"));
        }
    }
    out
}

/// The names of vnat's programs attached to `dev` by TCX, both hooks.
fn tcx_programs(ns: &Netns, dev: &str) -> Vec<String> {
    use aya::programs::{tc::TcAttachType, SchedClassifier};
    let dev = dev.to_string();
    ns.run_in(move || {
        [TcAttachType::Ingress, TcAttachType::Egress]
            .into_iter()
            // A kernel without TCX has none.
            .filter_map(|hook| SchedClassifier::query_tcx(&dev, hook).ok())
            .flat_map(|(_, programs)| programs)
            .filter_map(|p| p.name_as_str().map(str::to_string))
            .filter(|name| name.starts_with("vnat_"))
            .collect()
    })
}

/// Wait (at most 20 s) for the laptop's `ls` row of a mobile connection
/// of `proto` to `server`, and return it.
fn mobile_row(d: &Vnatd, proto: &str, server: SocketAddr) -> Value {
    let mut row = Value::Null;
    wait_until(
        Duration::from_secs(20),
        || {
            let ls = d.ctl(&["ls", "--proto", proto]).unwrap_or_default();
            row = ls
                .as_array()
                .and_then(|rows| {
                    rows.iter()
                        .find(|r| r["virtual_remote"] == server.to_string() && r["mobile"] == true)
                        .cloned()
                })
                .unwrap_or(Value::Null);
            !row.is_null()
        },
        || format!("the {proto} connection to {server} never became mobile"),
    );
    row
}

fn stream(host: &Host, opts: StreamOptions) -> StreamClient {
    let mut cmd = opts.rate(200_000).command(host.ns);
    host.cgroup.join_on_spawn(&mut cmd);
    StreamClient::from_command(cmd)
}

#[test]
fn cleanup_after_a_crash_removes_all_of_vnats_and_nothing_else() {
    let topo = LaptopRouterServer::builder().tag("clnk").build();
    // Multihomed, A preferred: `vnatctl migrate` then gives the moved
    // connection a rule and a table of its own.
    topo.plug_laptop_b();
    topo.laptop
        .add_default_route_metric(topo.router_b_addr.v4.into(), &topo.laptop_if_b, B_METRIC);
    let lap = Host::new(&topo.laptop, "clnkl");
    let srv = Host::new(&topo.server, "clnks");
    let (dl, ds) = (TempDir::new("clnkl"), TempDir::new("clnks"));
    for ns in [&topo.laptop, &topo.server] {
        set_unusual_arp(ns);
    }
    // Someone else's: a rule at vnat's priority with another protocol
    // number, and an address on lo.
    topo.laptop.run(&[
        "ip",
        "rule",
        "add",
        "from",
        "198.18.9.9",
        "lookup",
        "100",
        "priority",
        "1000",
        "protocol",
        "42",
    ]);
    let foreign_lo: IpAddr = "198.18.9.8".parse().unwrap();
    topo.laptop.add_addr("lo", foreign_lo, 32);

    let server_ip: IpAddr = topo.server_addr.v4.into();
    let (tcp_to, udp_to) = (
        SocketAddr::new(server_ip, 5001),
        SocketAddr::new(server_ip, 5002),
    );
    let _tcp_echo = EchoServer::tcp_in(&srv, tcp_to);
    let _udp_echo = EchoServer::udp_in(&srv, udp_to);
    let lapd = Vnatd::start(&lap, dl.path());
    let srvd = Vnatd::start(&srv, ds.path());
    let tcp = stream(&lap, StreamOptions::tcp(tcp_to));
    let udp = stream(&lap, StreamOptions::udp(udp_to));
    tcp.wait_verified_at_least(50_000, Duration::from_secs(15));
    udp.wait_verified_at_least(50_000, Duration::from_secs(15));
    // The UDP flow's address is kept on lo, with the sink and a
    // last-resort rule for it.
    mobile_row(&lapd, "udp", udp_to);
    let id = mobile_row(&lapd, "tcp", tcp_to)["id"].to_string();
    let b = topo.laptop_b_addr.v4.to_string();
    let out = lapd
        .ctl(&["migrate", "--conn", &id, "--wait", "--to", &b])
        .expect("vnatd answers");
    assert_eq!(out["moves"][0]["outcome"], "moved", "migrate: {out}");
    let at = tcp.latest().expect("status").verified;
    tcp.wait_verified_at_least(at + 50_000, Duration::from_secs(20));

    let lap_ifs = ["lo", "wa", "wb"];
    let srv_ifs = ["lo", "eth0"];
    let lap_before = vnat_footprint(&topo.laptop, &lap_ifs);
    let has = |what: &str| lap_before.iter().any(|l| l.starts_with(what));
    assert!(
        has("rule") && has("route") && has("address on lo") && has("link vnat-sink"),
        "the laptop lacks some of what the test removes: {lap_before:#?}"
    );
    assert!(
        lap_before.iter().any(|l| l.contains(" on wb")),
        "no tc on the laptop's B: {lap_before:#?}"
    );
    // The server reaches the laptop's old and new addresses through the
    // same router: it translates the moved connection in tc and routes
    // nothing for it.
    assert!(
        vnat_footprint(&topo.server, &srv_ifs)
            .iter()
            .any(|l| l.contains(" on eth0")),
        "the server does not translate the moved laptop's connection"
    );
    assert_eq!(
        arp(&topo.laptop),
        vnats(),
        "vnatd did not set the ARP sysctls"
    );
    assert!(lap.pins.path().exists());

    // Refused while vnatd runs, changing nothing.
    let refused = cleanup(&lap, dl.path(), &[]);
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(
        text(&refused.stderr).contains("a vnatd is running"),
        "{}",
        text(&refused.stderr)
    );
    assert_eq!(text(&refused.stdout), "");
    assert_eq!(vnat_footprint(&topo.laptop, &lap_ifs), lap_before);
    assert_eq!(arp(&topo.laptop), vnats());
    assert!(lap.pins.path().exists());

    // The same pins from another control socket and state directory: the
    // cleanup, and a second vnatd, are refused by the pins' lock, and the
    // running vnatd's connection goes on as it was.
    let other = TempDir::new("clnko");
    let refused = cleanup(&lap, other.path(), &[]);
    assert_eq!(refused.status.code(), Some(1), "{refused:?}");
    assert!(
        text(&refused.stderr).contains("holds the pins"),
        "{}",
        text(&refused.stderr)
    );
    assert_eq!(vnat_footprint(&topo.laptop, &lap_ifs), lap_before);
    // (Under `timeout`: one that started would run until killed.)
    let second = lap
        .ns
        .cmd("timeout")
        .arg("20")
        .arg(bin_path("vnatd"))
        .args(["--config", "/dev/null", "--control"])
        .arg(other.path().join("vnatd.sock"))
        .arg("--state-dir")
        .arg(other.path().join("state"))
        .arg("--bpffs")
        .arg(lap.pins.path())
        .arg("--cgroup")
        .arg(lap.cgroup.path())
        .args(["--listen", "0.0.0.0:2041"])
        .output()
        .expect("running a second vnatd");
    assert_eq!(
        second.status.code(),
        Some(1),
        "a second vnatd on the same pins: {}",
        text(&second.stderr)
    );
    assert!(
        text(&second.stderr).contains("has the datapath pinned in"),
        "{}",
        text(&second.stderr)
    );
    assert_eq!(vnat_footprint(&topo.laptop, &lap_ifs), lap_before);
    let at = tcp.latest().expect("status").verified;
    tcp.wait_verified_at_least(at + 50_000, Duration::from_secs(10));

    lapd.kill9();
    srvd.kill9();
    for (host, dir, ifs) in [
        (&lap, dl.path(), &lap_ifs[..]),
        (&srv, ds.path(), &srv_ifs[..]),
    ] {
        let name = host.ns.name().to_string();
        let out = cleanup(host, dir, &[]);
        let said = text(&out.stdout);
        assert!(
            out.status.success(),
            "vnatd --cleanup in {name} failed: {}{said}",
            text(&out.stderr)
        );
        assert!(
            said.contains("removed the stale control socket"),
            "{name}: {said}"
        );
        if host.ns.name() == topo.laptop.name() {
            for line in [
                "removed rule",
                "removed address",
                "restored sysctl",
                "detached tc",
            ] {
                assert!(said.contains(line), "{name}: no {line:?} in:\n{said}");
            }
        }
        // A TCX link whose pin is gone is released when its last reference
        // goes, which the kernel may finish in a workqueue a moment later
        // (seen under load): what is left must go within 2 s.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        let left = loop {
            let left = vnat_footprint(host.ns, ifs);
            if left.is_empty() || std::time::Instant::now() >= deadline {
                break left;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        assert!(
            left.is_empty(),
            "{name}: vnat's are left: {left:#?}\nit said:\n{said}"
        );
        assert_eq!(arp(host.ns), unusual(), "{name}: the ARP sysctls");
        assert!(!host.pins.path().exists(), "{name}: the pins stayed");
        assert!(!dir.join("vnatd.sock").exists(), "{name}: the stale socket");
        // The state directory is this host's identity, not host settings.
        assert!(dir.join("state/identity.key").exists(), "{name}: the key");
        assert!(!dir.join("state/sysctl-saved.json").exists(), "{name}");

        // A second run finds nothing.
        let again = cleanup(host, dir, &["--json"]);
        assert!(again.status.success(), "{name}: {again:?}");
        let v: Value = serde_json::from_slice(&again.stdout).expect("--json");
        assert_eq!(v["done"], Value::Array(vec![]), "{name}: {v}");
        assert_eq!(v["failed"], Value::Array(vec![]), "{name}: {v}");
        let plain = cleanup(host, dir, &[]);
        assert_eq!(
            (plain.status.code(), text(&plain.stdout)),
            (
                Some(0),
                "nothing of vnat's is left on this host\n".to_string()
            )
        );
    }
    // Someone else's stayed.
    assert!(
        topo.laptop
            .rules()
            .iter()
            .any(|r| r.protocol == 42 && r.priority == 1000 && r.table == 100),
        "someone else's rule went: {:?}",
        topo.laptop.rules()
    );
    assert!(
        topo.laptop
            .addresses("lo")
            .iter()
            .any(|a| a.addr == foreign_lo),
        "someone else's address on lo went"
    );
}

#[test]
fn a_clean_stop_puts_the_sysctls_back_once_no_address_stays_on_lo() {
    let topo = LaptopRouterServer::builder().tag("clst").build();
    let lap = Host::new(&topo.laptop, "clstl");
    let srv = Host::new(&topo.server, "clsts");
    let (dl, ds) = (TempDir::new("clstl"), TempDir::new("clsts"));
    set_unusual_arp(&topo.laptop);
    let record: PathBuf = dl.path().join("state/sysctl-saved.json");
    let to = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::udp_in(&srv, to);
    let lapd = Vnatd::start(&lap, dl.path());
    let _srvd = Vnatd::start(&srv, ds.path());
    let udp = stream(&lap, StreamOptions::udp(to));
    udp.wait_verified_at_least(50_000, Duration::from_secs(15));
    mobile_row(&lapd, "udp", to);
    assert_eq!(
        arp(&topo.laptop),
        vnats(),
        "the mobile flow's address is kept"
    );
    assert!(record.exists(), "no record of the values from before");

    // Stopped while the flow's address is kept on lo: the sysctls stay,
    // or the host would answer ARP for that address on its other links.
    assert!(lapd.stop().success());
    assert_eq!(arp(&topo.laptop), vnats(), "put back under a kept address");
    assert!(record.exists(), "the record went while still needed");

    // The flow ends; the next vnatd lets its address go, then stops.
    let lapd = Vnatd::start(&lap, dl.path());
    let fin = udp.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    wait_until(
        Duration::from_secs(15),
        || {
            !topo
                .laptop
                .addresses("lo")
                .iter()
                .any(|a| a.protocol.map(u8::from) == Some(VNAT_PROTO))
        },
        || "vnatd kept the closed flow's address on lo".into(),
    );
    assert!(lapd.stop().success());
    assert_eq!(arp(&topo.laptop), unusual(), "not put back at a clean stop");
    assert!(!record.exists(), "the record stayed after it was used");
}
