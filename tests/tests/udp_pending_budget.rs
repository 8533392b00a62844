//! One local user's unbound UDP sockets cannot push other users' UDP flows
//! out of the recorders' reach (issue 31, item 3, the map left over).
//!
//! A UDP socket that calls connect() before it has a local port is kept in
//! `VNAT_UDP_PENDING` (the hook runs before the kernel picks the port) until
//! vnatd completes its record. That map was an LRU: an unprivileged user
//! holding more unbound connected sockets than the map's 16,384 entries
//! evicted everyone else's, and their flows went unrecorded until the next
//! adoption pass, a minute later (a move meanwhile lost them). Now each
//! entry is charged to its user, an eighth of the map each.
//!
//! The laptop's vnatd is frozen (SIGSTOP) while it happens, so that it
//! completes nothing and the map shows what the programs alone allowed;
//! the eBPF recorders run on without it. Another user's (uid 1000) UDP
//! stream connects first, then uid 65534 connects 17,000 sockets. What uid
//! 1000 sees: once vnatd runs again its flow is recorded in its name within
//! seconds, is mobile, and moves with the laptop, datagrams flowing end to
//! end.

use std::{
    io::{BufRead, BufReader},
    net::{IpAddr, SocketAddr},
    process::Stdio,
    time::{Duration, Instant},
};

use vnat_common::{
    Budgets, ConnRecord, FlowKey, UdpPending, MAP_CONNS, MAP_UDP_PENDING, ORIGIN_UDP_ADOPTED,
    PROTO_UDP,
};
use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, ProcessGroup, StreamClient, StreamOptions, TempDir, Vnatd,
};

/// The attacker: as uid 65534, `n` UDP sockets connected (never bound
/// first) to as many addresses, all kept open; prints "ready".
const UNBOUND: &str = r#"
import os, resource, socket, sys, time
n = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 100, n + 100))
os.setgroups([]); os.setgid(65534); os.setuid(65534)
keep = []
for i in range(n):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((f"203.0.{113 + i // 65000}.{i // 250 % 250 + 1}", 10000 + i % 50000))
    keep.append(s)
print("ready", flush=True)
while True:
    time.sleep(60)
"#;

const ATTACKER_SOCKETS: u32 = 17_000;

/// The entries of the pinned pending map, read from the pin.
fn pending(host: &Host) -> Vec<UdpPending> {
    let pin = host.pins.path().join(MAP_UDP_PENDING);
    let data = aya::maps::MapData::from_pin(&pin)
        .unwrap_or_else(|e| panic!("opening the pinned map {}: {e}", pin.display()));
    let map: aya::maps::HashMap<_, u64, UdpPending> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))
            .unwrap_or_else(|e| panic!("{MAP_UDP_PENDING}: {e}"));
    map.iter().filter_map(Result::ok).map(|(_, p)| p).collect()
}

/// The laptop's UDP records towards `server`, from the pin.
fn records_to(host: &Host, server: SocketAddr) -> Vec<ConnRecord> {
    let pin = host.pins.path().join(MAP_CONNS);
    let data = aya::maps::MapData::from_pin(&pin)
        .unwrap_or_else(|e| panic!("opening the pinned map {}: {e}", pin.display()));
    let map: aya::maps::HashMap<_, FlowKey, ConnRecord> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))
            .unwrap_or_else(|e| panic!("{MAP_CONNS}: {e}"));
    let IpAddr::V4(ip) = server.ip() else {
        unreachable!("the server is IPv4 here")
    };
    map.iter()
        .filter_map(Result::ok)
        .filter(|(k, _)| {
            k.proto == PROTO_UDP
                && k.dst_addr_be[0] == u32::from_ne_bytes(ip.octets())
                && k.dst_port_be == server.port().to_be()
        })
        .map(|(_, r)| r)
        .collect()
}

#[test]
fn one_users_unbound_udp_sockets_leave_other_users_flows_recorded() {
    let topo = LaptopRouterServer::builder().tag("upb").build();
    let (ldir, sdir) = (TempDir::new("upbl"), TempDir::new("upbs"));
    let lap = Host::new(&topo.laptop, "upbl");
    let srv = Host::new(&topo.server, "upbs");
    let lapd = Vnatd::start(&lap, ldir.path());
    let _srvd = Vnatd::start(&srv, sdir.path());
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::udp_in(&srv, server);

    lapd.freeze(true);
    // uid 1000's stream: setpriv changes the uid once the namespace and
    // cgroup are joined.
    let stream = StreamOptions::udp(server)
        .rate(300_000)
        .command(&topo.laptop);
    let mut cmd = topo.laptop.cmd("setpriv");
    cmd.args(["--reuid", "1000", "--regid", "1000", "--clear-groups"])
        .arg(stream.get_program())
        .args(stream.get_args());
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let first = client.wait_verified_at_least(20_000, Duration::from_secs(10));
    let theirs = |p: &UdpPending| p.record.owner_uid == 1000;
    assert!(
        pending(&lap).iter().any(theirs),
        "uid 1000's connect() left no pending entry"
    );

    let mut acmd = lap.command("python3");
    acmd.args(["-c", UNBOUND, &ATTACKER_SOCKETS.to_string()])
        .stdout(Stdio::piped());
    let mut attacker = ProcessGroup::spawn(acmd, "the unbound sockets");
    let mut line = String::new();
    BufReader::new(attacker.0.stdout.take().expect("their stdout"))
        .read_line(&mut line)
        .expect("their output");
    assert_eq!(line.trim(), "ready", "the unbound sockets did not start");

    let all = pending(&lap);
    let held = all.iter().filter(|p| p.record.owner_uid == 65534).count() as u32;
    eprintln!(
        "pending: {} entries, {held} the attacker's; owner_budget_full {}",
        all.len(),
        lap.counter("owner_budget_full")
    );
    assert!(
        all.iter().any(theirs),
        "{ATTACKER_SOCKETS} unbound sockets of uid 65534 evicted uid 1000's pending flow ({} entries, {held} theirs)",
        all.len()
    );
    assert!(
        held <= Budgets::DEFAULT.connecting_per_owner,
        "uid 65534 holds {held} pending entries, over its share of {}",
        Budgets::DEFAULT.connecting_per_owner
    );

    // vnatd runs again: the flow is recorded in uid 1000's name by the
    // recorders' path, within seconds (adoption would take a minute).
    lapd.freeze(false);
    let t = Instant::now();
    let rec = loop {
        if let Some(r) = records_to(&lap, server).into_iter().next() {
            break r;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "uid 1000's UDP flow was not recorded within 10 s of vnatd running again"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        rec.owner_uid, 1000,
        "uid 1000's flow is recorded in another name"
    );
    assert_ne!(
        rec.origin, ORIGIN_UDP_ADOPTED,
        "uid 1000's flow was found only by adoption"
    );
    lapd.wait_mobile_to("udp", server.ip());
    drop(attacker);

    let now = client.wait_progress(&first, 20_000, Duration::from_secs(10));
    topo.move_laptop_to_b();
    client.wait_progress(&now, 100_000, Duration::from_secs(20));
    let end = client.stop();
    assert!(
        end.error.is_none() && end.local == first.local,
        "uid 1000's stream failed or changed socket across the move: {end:?}"
    );
}
