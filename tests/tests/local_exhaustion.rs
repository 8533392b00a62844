//! A local user cannot switch mobility off for everyone (issue 31, item 3).
//!
//! With the default cgroup (the whole host) every user's sockets are
//! recorded. An unprivileged user (uid 65534) on the laptop, in the enabled
//! cgroup, tries to fill every map the recorders fill: loopback connections
//! (recorded at both ends, they filled the connection map), TCP connections
//! to a host that runs no vnatd, UDP `sendto` to many addresses from 16
//! sockets, and, from a user and network namespace of its own, UDP to many
//! addresses and TCP between two of its own addresses (the guests' map).
//!
//! The maps are the real ones in the kernel, made smaller
//! (`VNAT_MAP_ENTRIES`) so that the flood fills them in seconds: loopback
//! is never recorded, a connection between two sockets of this host is not
//! a connection to move, and each user has a budget in every map derived
//! from its size. What another user (uid 1000) sees: its TCP connection to
//! the server is recorded, becomes mobile and moves with the laptop, bytes
//! flowing end to end; its container's first UDP flow is still recorded.
//!
//! The owners of sockets still connecting are kept for sock_ops in a map
//! of their own (`VNAT_CONNECTING`). It was an LRU map: a user holding
//! sockets that never finish connecting (SYNs to an address that drops
//! them), or starting and dropping connects, evicted other users' owners,
//! and a connection whose handshake took a while lost its owner and was
//! charged to the connections accepted from other hosts. So the attacker
//! holds 3,000 such sockets, the other user's first two SYNs are dropped (a
//! three-second handshake), and the attacker must hold no more than its
//! share of the map, the other user's connection still name uid 1000.

use std::{
    io::{BufRead, BufReader},
    net::{IpAddr, Ipv4Addr, SocketAddr},
    process::Stdio,
    time::{Duration, Instant},
};

use vnat_common::{
    Budgets, ConnRecord, FlowKey, GuestKey, Owner, CONNECTING_MAX_ENTRIES, MAP_CONNECTING,
    MAP_CONNS, MAP_GUESTS, PROTO_TCP, PROTO_UDP,
};
use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, ProcessGroup, StreamClient, StreamOptions, TempDir, Vnatd,
};

/// The laptop's maps: small enough to fill in seconds.
const CONNS: u32 = 2048;
const GUESTS: u32 = 1024;
const MAP_ENTRIES: &str = "VNAT_CONNS=2048,VNAT_GUESTS=1024";

/// The attacker: a Python program that starts as root only to raise its
/// descriptor limit, then runs as uid 65534 (or the uid given) and keeps
/// every socket it made open until killed. Prints "ready" when done.
const FLOOD: &str = r#"
import ctypes, encodings.idna, os, resource, socket, sys, time
# (Everything is imported before the uid changes: root's Python library
# may be unreadable to the user.)
uid, sink, loops, tcps, udps, guests, guest_tcps, guest_dst = sys.argv[1:9]
uid, loops, tcps, udps, guests, guest_tcps = map(int, (uid, loops, tcps, udps, guests, guest_tcps))
resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))
os.setgroups([]); os.setgid(uid); os.setuid(uid)
# Changing uid made the process undumpable, which leaves its /proc files
# root's; the user's own namespace setup below writes them.
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
keep = []

def guest_child(w):
    # Not the test's pipe: it must see EOF when the parent is done.
    os.dup2(os.open("/dev/null", os.O_WRONLY), 1)
    # A user and network namespace of the user's own (no privilege needed).
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x10000000 | 0x40000000) != 0:
        os.write(w, b"unshare failed\n"); os._exit(1)
    open("/proc/self/setgroups", "w").write("deny")
    open("/proc/self/uid_map", "w").write(f"0 {uid} 1")
    open("/proc/self/gid_map", "w").write(f"0 {uid} 1")
    os.system("ip link set lo up; ip addr add 10.9.0.1/32 dev lo; ip route add default dev lo")
    held = []
    for i in range(guests):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind(("10.9.0.1", 0))
        dst = (guest_dst, 7777) if guests == 1 else (f"10.{200 + i // 65536}.{i // 256 % 256}.{i % 256 + 1}", 9)
        try:
            s.sendto(b"x", dst)
        except OSError:
            pass
        held.append(s)
    if guest_tcps:
        l = socket.socket(); l.bind(("10.9.0.1", 0)); l.listen(4096)
        for i in range(guest_tcps):
            c = socket.socket(); c.bind(("10.9.0.1", 0)); c.connect(l.getsockname())
            a, _ = l.accept(); held += [c, a]
    os.write(w, b"ok\n")
    while True:
        time.sleep(60)

if guests:
    r, w = os.pipe()
    if os.fork() == 0:
        try:
            guest_child(w)
        finally:
            os._exit(1)
    os.close(w)
    line = os.read(r, 100)
    assert line == b"ok\n", line

# Loopback: both ends of each connection are this host's.
if loops:
    l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(4096)
    for i in range(loops):
        c = socket.create_connection(l.getsockname()); a, _ = l.accept(); keep += [c, a]
    try:
        l6 = socket.socket(socket.AF_INET6); l6.bind(("::1", 0)); l6.listen(4096)
        for i in range(loops // 4):
            c = socket.create_connection(l6.getsockname()[:2]); a, _ = l6.accept(); keep += [c, a]
    except OSError:
        pass
# TCP to a host without vnatd.
host, port = sink.rsplit(":", 1)
for i in range(tcps):
    keep.append(socket.create_connection((host, int(port))))
# UDP sendto to many addresses, from 16 sockets.
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(16)]
keep += socks
for i in range(udps):
    try:
        socks[i % 16].sendto(b"x", (f"203.0.113.{i % 250 + 1}", 10000 + i))
    except OSError:
        pass
print("ready", flush=True)
while True:
    time.sleep(60)
"#;

/// The attacker's sockets that never finish connecting: as uid 65534,
/// 3,000 non-blocking connects to a port whose SYNs the router drops, all
/// kept open; prints "ready" when they are out.
const CONNECTING: &str = r#"
import os, resource, socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
resource.setrlimit(resource.RLIMIT_NOFILE, (20000, 20000))
os.setgroups([]); os.setgid(65534); os.setuid(65534)
keep = []
for i in range(3000):
    s = socket.socket(); s.setblocking(False)
    try:
        s.connect((host, int(port)))
    except OSError:
        pass
    keep.append(s)
print("ready", flush=True)
while True:
    time.sleep(60)
"#;

/// Runs [`FLOOD`] in the laptop's namespace and cgroup and waits for it.
#[allow(clippy::too_many_arguments)]
fn flood(
    host: &Host,
    uid: u32,
    sink: SocketAddr,
    loops: u32,
    tcps: u32,
    udps: u32,
    guests: u32,
    guest_tcps: u32,
    guest_dst: Ipv4Addr,
) -> ProcessGroup {
    let mut cmd = host.command("python3");
    cmd.args(["-c", FLOOD])
        .args(
            [
                uid.to_string(),
                sink.to_string(),
                loops.to_string(),
                tcps.to_string(),
                udps.to_string(),
                guests.to_string(),
                guest_tcps.to_string(),
                guest_dst.to_string(),
            ]
            .iter(),
        )
        .stdout(Stdio::piped());
    let mut pg = ProcessGroup::spawn(cmd, "the flood");
    let out = pg.0.stdout.take().expect("the flood's stdout");
    let mut line = String::new();
    BufReader::new(out)
        .read_line(&mut line)
        .expect("the flood's output");
    assert_eq!(line.trim(), "ready", "the flood did not finish");
    pg
}

/// Every record of a pinned map, read from the pin (no datapath opened).
fn pinned<K: aya::Pod>(host: &Host, name: &str) -> Vec<(K, ConnRecord)> {
    let pin = host.pins.path().join(name);
    let data = aya::maps::MapData::from_pin(&pin)
        .unwrap_or_else(|e| panic!("opening the pinned map {}: {e}", pin.display()));
    let map: aya::maps::HashMap<_, K, ConnRecord> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))
            .unwrap_or_else(|e| panic!("{name} is not a hash map: {e}"));
    map.iter()
        .map(|r| r.unwrap_or_else(|e| panic!("reading {name}: {e}")))
        .collect()
}

/// The owners of sockets still connecting, from the pin.
fn pinned_owners(host: &Host) -> Vec<Owner> {
    let pin = host.pins.path().join(MAP_CONNECTING);
    let data = aya::maps::MapData::from_pin(&pin)
        .unwrap_or_else(|e| panic!("opening the pinned map {}: {e}", pin.display()));
    let map: aya::maps::HashMap<_, u64, Owner> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))
            .unwrap_or_else(|e| panic!("{MAP_CONNECTING} is not a hash map: {e}"));
    map.iter().filter_map(Result::ok).map(|(_, o)| o).collect()
}

fn is_loopback(k: &FlowKey) -> bool {
    let v4 = |w: u32| w.to_ne_bytes()[0] == 127;
    let v6 = |a: &[u32; 4]| *a == [0, 0, 0, 1u32.to_be()];
    match k.family {
        vnat_common::AF_INET => v4(k.src_addr_be[0]) || v4(k.dst_addr_be[0]),
        _ => v6(&k.src_addr_be) || v6(&k.dst_addr_be),
    }
}

#[test]
fn a_local_user_filling_the_maps_leaves_other_users_mobile() {
    // The harness opens the datapath too (and may make the pins first):
    // both must make the maps small. Set before this test (the only one in
    // this binary) starts a thread or a process.
    std::env::set_var("VNAT_MAP_ENTRIES", MAP_ENTRIES);
    let topo = LaptopRouterServer::builder().tag("lex").build();
    let (ldir, sdir) = (TempDir::new("lexl"), TempDir::new("lexs"));
    let lap = Host::new(&topo.laptop, "lexl");
    let srv = Host::new(&topo.server, "lexs");
    let server_ip = IpAddr::from(topo.server_addr.v4);
    let lapd = Vnatd::start_with_env(&lap, ldir.path(), &[], &[("VNAT_MAP_ENTRIES", MAP_ENTRIES)]);
    let _srvd = Vnatd::start(&srv, sdir.path());
    let echo_at = SocketAddr::new(server_ip, 5001);
    let _echo = EchoServer::tcp_in(&srv, echo_at);
    // A host without vnatd: the router, with a listener that holds every
    // connection it accepts.
    let sink = SocketAddr::new(topo.router_a_addr.v4.into(), 5100);
    let mut scmd = topo.router.cmd("python3");
    scmd.args([
        "-c",
        "import socket,resource,time\n\
         resource.setrlimit(resource.RLIMIT_NOFILE,(20000,20000))\n\
         l=socket.socket();l.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n\
         l.bind(('0.0.0.0',5100));l.listen(4096);k=[]\n\
         while True: k.append(l.accept()[0])",
    ]);
    let _sink = ProcessGroup::spawn(scmd, "the TCP sink");
    topo.router.wait_tcp_listening(5100);

    let t0 = Instant::now();
    let _flood = flood(
        &lap,
        65534,
        sink,
        700,
        400,
        800,
        1100,
        200,
        Ipv4Addr::UNSPECIFIED,
    );
    eprintln!("the flood took {:?}", t0.elapsed());
    std::thread::sleep(Duration::from_secs(1));

    // Nothing of loopback is recorded, and the user stayed within budgets.
    let conns: Vec<(FlowKey, ConnRecord)> = pinned(&lap, MAP_CONNS);
    let guests: Vec<(GuestKey, ConnRecord)> = pinned(&lap, MAP_GUESTS);
    let lo: Vec<_> = conns.iter().filter(|(k, _)| is_loopback(k)).collect();
    let tcp = conns.iter().filter(|(k, _)| k.proto == PROTO_TCP).count();
    let udp = conns.iter().filter(|(k, _)| k.proto == PROTO_UDP).count();
    let guest_tcp = guests
        .iter()
        .filter(|(k, _)| k.flow.proto == PROTO_TCP)
        .count();
    eprintln!(
        "laptop: {} records ({tcp} TCP, {udp} UDP, {} loopback), {} guests ({guest_tcp} TCP); conns_map_full {}, guests_map_full {}",
        conns.len(),
        lo.len(),
        guests.len(),
        lap.counter("conns_map_full"),
        lap.counter("guests_map_full"),
    );
    assert!(
        lo.is_empty(),
        "loopback connections were recorded: {}",
        lo.len()
    );
    assert!(
        (conns.len() as u32) < CONNS * 3 / 4,
        "one user filled the connection map: {} of {CONNS}",
        conns.len()
    );
    assert!(
        (guests.len() as u32) < GUESTS / 2,
        "one user filled the guests' map: {} of {GUESTS}",
        guests.len()
    );
    assert_eq!(
        guest_tcp, 0,
        "TCP between two sockets of one namespace was recorded"
    );

    // Another user's container: its first UDP flow is recorded.
    let victim_dst = Ipv4Addr::new(10, 77, 0, 1);
    let _victim_guest = flood(&lap, 1000, sink, 0, 0, 0, 1, 0, victim_dst);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found = pinned::<GuestKey>(&lap, MAP_GUESTS).iter().any(|(k, _)| {
            k.flow.dst_addr_be[0] == u32::from_ne_bytes(victim_dst.octets())
                && k.flow.dst_port_be == 7777u16.to_be()
        });
        if found {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "another user's container flow was not recorded (guests_map_full {})",
            lap.counter("guests_map_full")
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    // The router drops the SYNs of the attacker's connecting sockets, and
    // the other user's first two SYNs to the server (about 60 bytes each):
    // its handshake takes three seconds.
    let nft = |rules: &str| {
        let out = topo.router.run(&["nft", rules]);
        assert!(
            out.status.success(),
            "nft {rules}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    nft("add table ip lexsyn");
    nft("add chain ip lexsyn f { type filter hook input priority -10; }");
    nft("add rule ip lexsyn f tcp dport 5199 drop");
    nft("add chain ip lexsyn fw { type filter hook forward priority -10; }");
    nft(&format!(
        "add rule ip lexsyn fw ip daddr {} tcp dport 5001 tcp flags & (syn | ack) == syn quota until 121 bytes drop",
        topo.server_addr.v4
    ));
    let mut ccmd = lap.command("python3");
    ccmd.args(["-c", CONNECTING, &format!("{}:5199", topo.router_a_addr.v4)])
        .stdout(Stdio::piped());
    let connecting_flood = ProcessGroup::spawn(ccmd, "the connecting sockets");
    let mut connecting_flood = connecting_flood;
    let mut line = String::new();
    BufReader::new(connecting_flood.0.stdout.take().expect("their stdout"))
        .read_line(&mut line)
        .expect("their output");
    assert_eq!(line.trim(), "ready", "the connecting sockets did not start");

    // Another user's TCP connection is recorded, mobile, and moves.
    // As uid 1000: setpriv changes it once the namespace and cgroup are
    // joined (Command::uid would change it before, and then fail them).
    let stream = StreamOptions::tcp(echo_at)
        .rate(500_000)
        .command(&topo.laptop);
    let mut cmd = topo.laptop.cmd("setpriv");
    cmd.args(["--reuid", "1000", "--regid", "1000", "--clear-groups"])
        .arg(stream.get_program())
        .args(stream.get_args());
    lap.cgroup.join_on_spawn(&mut cmd);
    let started = Instant::now();
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(50_000, Duration::from_secs(15));
    // Its record names its owner, and the churning attacker never held
    // more than its share of the owners' map.
    let theirs: Vec<(FlowKey, ConnRecord)> = pinned::<FlowKey>(&lap, MAP_CONNS)
        .into_iter()
        .filter(|(k, _)| {
            k.proto == PROTO_TCP
                && k.dst_addr_be[0] == u32::from_ne_bytes(topo.server_addr.v4.octets())
                && k.dst_port_be == 5001u16.to_be()
        })
        .collect();
    assert_eq!(theirs.len(), 1, "the other user's connection: {theirs:?}");
    assert_eq!(
        theirs[0].1.owner_uid, 1000,
        "the other user's connection lost its owner to the churn"
    );
    let connecting = pinned_owners(&lap);
    let held = connecting.iter().filter(|o| o.uid == 65534).count() as u32;
    eprintln!(
        "connecting: {} entries, {held} the attacker's; owner_budget_full {}",
        connecting.len(),
        lap.counter("owner_budget_full")
    );
    assert!(
        held <= Budgets::DEFAULT.connecting_per_owner,
        "the attacker holds {held} of {CONNECTING_MAX_ENTRIES} connecting entries"
    );
    drop(connecting_flood);
    eprintln!(
        "the other user's connection was established {:?} after it started",
        started.elapsed()
    );
    let t = Instant::now();
    while !lapd.mobile_to("tcp", server_ip) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "another user's connection never became mobile (conns_map_full {}): {}",
            lap.counter("conns_map_full"),
            lapd.ctl(&["ls", "--proto", "tcp"]).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let at_move = client.latest().expect("status").verified;
    let moved = Instant::now();
    topo.move_laptop_to_b();
    client.wait_verified_at_least(at_move + 500_000, Duration::from_secs(20));
    eprintln!("bytes flowed again {:?} after the move", moved.elapsed());
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
}
