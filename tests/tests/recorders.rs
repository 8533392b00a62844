//! The recorders: sock_ops records TCP connections of processes in an
//! enabled cgroup (and only those) with their socket cookie, cgroup and
//! owner, and forgets them on close; the sock_addr hooks record UDP flows of
//! connected and unconnected sockets, IPv4 and IPv6.

mod support;

use vnat_tests::Host;

use std::{
    net::SocketAddr,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use vnat_daemon::datapath::{Datapath, Proto};
use vnat_tests::{EchoServer, SameLink, StreamClient, StreamOptions};

fn wait_gone(
    host: &Host,
    what: &str,
    pred: impl Fn(&vnat_daemon::datapath::ConnectionInfo) -> bool + Send + Sync + Copy,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while host.datapath(move |dp| dp.connections().unwrap().iter().any(pred)) {
        assert!(Instant::now() < deadline, "{what} was never removed");
        std::thread::sleep(Duration::from_millis(100));
    }
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn tcp_recorded_only_in_enabled_cgroup_and_removed_on_close() {
    let topo = SameLink::new("rectcp", false);
    let lap = Host::new(&topo.laptop, "rectcp");
    let server = SocketAddr::new(topo.server_addr.v4.into(), 7001);
    let _echo = EchoServer::tcp(&topo.server, server);

    let inside = {
        let mut cmd = StreamOptions::tcp(server)
            .rate(50_000)
            .command(&topo.laptop);
        lap.cgroup.join_on_spawn(&mut cmd);
        StreamClient::from_command(cmd)
    };
    let outside = StreamClient::spawn(&topo.laptop, &StreamOptions::tcp(server).rate(50_000));
    let in_local = inside
        .wait_verified_at_least(1_000, Duration::from_secs(10))
        .local;
    let out_local = outside
        .wait_verified_at_least(1_000, Duration::from_secs(10))
        .local;

    let c = lap.wait_connection("the client in the enabled cgroup", |c| {
        c.virtual_remote == server
    });
    assert_eq!(c.virtual_local.to_string(), in_local);
    assert_eq!(c.proto, Proto::Tcp);
    assert_eq!(c.cgroup_id, lap.cgroup.id(), "recorded cgroup id");
    assert_eq!(c.pid, Some(inside.pid()), "recorded owner");
    assert_eq!(c.command.as_deref(), Some("vnat-stream"));
    assert_ne!(c.cookie, 0);
    let all = lap.connections(Proto::Tcp);
    assert!(
        all.iter().all(|c| c.virtual_local.to_string() != out_local),
        "a connection of a process outside the enabled cgroup was recorded: {all:?}"
    );
    assert_eq!(
        all.len(),
        1,
        "exactly the one connection is recorded: {all:?}"
    );

    let recorded_before = lap.counter("sockops_recorded");
    inside.stop();
    wait_gone(&lap, "the closed connection", move |c| {
        c.virtual_remote == server
    });
    assert!(lap.counter("sockops_removed") >= 1);
    assert_eq!(lap.counter("sockops_recorded"), recorded_before);
    outside.stop();
}

/// The server side: an accepted (passive) connection is recorded too, with
/// its owner found through /proc.
#[test]
fn tcp_passive_connections_are_recorded() {
    let topo = SameLink::new("recpas", true);
    let srv = Host::new(&topo.server, "recpas");
    let server = SocketAddr::new(topo.server_addr.v6().into(), 7002);
    let mut cmd = srv.command("socat");
    cmd.args([
        format!("TCP6-LISTEN:{},reuseaddr,fork", server.port()),
        "EXEC:cat".into(),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    let socat = Kill(cmd.spawn().expect("starting socat"));
    // Until socat listens (a fixed wait was too short in a slow VM).
    topo.server.wait_tcp_listening(server.port());
    let client = StreamClient::spawn(&topo.laptop, &StreamOptions::tcp(server).rate(50_000));
    let local = client
        .wait_verified_at_least(1_000, Duration::from_secs(10))
        .local;
    let c = srv.wait_connection("the accepted connection", |c| c.virtual_local == server);
    assert_eq!(c.virtual_remote.to_string(), local);
    assert!(
        c.pid.is_some(),
        "the owner of an accepted socket is found: {c:?}"
    );
    assert_eq!(c.command.as_deref(), Some("socat"));
    client.stop();
    drop(socat);
}

fn udp_flow_recorded(ipv6: bool, connected: bool, tag: &str) {
    let topo = SameLink::new(tag, ipv6);
    let lap = Host::new(&topo.laptop, tag);
    let ip = if ipv6 {
        topo.server_addr.v6().into()
    } else {
        topo.server_addr.v4.into()
    };
    let server = SocketAddr::new(ip, 7003);
    let _echo = EchoServer::udp(&topo.server, server);
    let fam = if ipv6 { "UDP6" } else { "UDP4" };
    // socat's UDP-SENDTO sends with sendto() on an unconnected socket;
    // UDP-CONNECT calls connect() first (before the kernel picks a port).
    let target = if connected {
        format!("{fam}-CONNECT:{server}")
    } else {
        format!("{fam}-SENDTO:{server}")
    };
    let mut cmd = lap.command("socat");
    cmd.args(["-u", "EXEC:yes", &target])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let _sender = Kill(cmd.spawn().expect("starting socat"));
    let c = lap.wait_connection("the UDP flow", |c| {
        c.proto == Proto::Udp && c.virtual_remote == server
    });
    assert_ne!(c.virtual_local.port(), 0);
    assert_eq!(c.cgroup_id, lap.cgroup.id());
    if connected {
        // connect() ran before the kernel picked a local port: the flow went
        // through the pending map and was completed by userspace.
        assert_eq!(
            lap.counter("udp_recorded"),
            0,
            "a connect() on an unbound socket is recorded as pending first"
        );
    } else {
        assert!(
            lap.counter("udp_recorded") >= 1,
            "sendmsg() recorded no UDP flow in the kernel"
        );
    }
}

#[test]
fn udp_v4_unconnected_sender_is_recorded() {
    udp_flow_recorded(false, false, "recu4");
}

#[test]
fn udp_v6_unconnected_sender_is_recorded() {
    udp_flow_recorded(true, false, "recu6");
}

#[test]
fn udp_v4_connected_sender_is_recorded() {
    udp_flow_recorded(false, true, "recc4");
}

#[test]
fn udp_v6_connected_sender_is_recorded() {
    udp_flow_recorded(true, true, "recc6");
}

/// A program attached to a cgroup sees that cgroup's sockets in every
/// network namespace. Two datapaths (two vnatd) in two namespaces enabled on
/// the same cgroup must each list only their own namespace's connections
/// (and containers' they NAT, `containers.rs`).
#[test]
fn each_namespace_records_only_its_own_sockets() {
    let topo = SameLink::new("recns", false);
    let lap = Host::new(&topo.laptop, "recnsl");
    let srv = Host::new(&topo.server, "recnss");
    // The server's datapath is enabled on the laptop's cgroup too.
    let shared = lap.cgroup.path().to_path_buf();
    let opts = vnat_daemon::datapath::kernel::KernelOptions {
        bpffs: srv.pins.path().to_path_buf(),
        cgroups: vec![shared],
        tc_attach: vnat_tests::harness::tc_attach(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    };
    topo.server
        .run_in(move || vnat_daemon::datapath::kernel::KernelDatapath::open(&opts).map(|_| ()))
        .unwrap_or_else(|e| panic!("enabling the shared cgroup on the server: {e}"));

    let server = SocketAddr::new(topo.server_addr.v4.into(), 7004);
    let _echo = EchoServer::tcp(&topo.server, server);
    let mut cmd = StreamOptions::tcp(server)
        .rate(50_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(1_000, Duration::from_secs(10));
    lap.wait_connection("the laptop's connection", |c| c.virtual_remote == server);
    let on_server = srv.connections(Proto::Tcp);
    assert!(
        on_server.is_empty(),
        "the server's datapath claimed a laptop socket: {on_server:?}"
    );
    // It is kept apart, as a guest of another namespace, which a datapath
    // lists only if its own host NATs the flow (a container behind it):
    // this host does not.
    assert!(
        srv.counter("guest_recorded") >= 1,
        "the foreign socket was not kept apart as another namespace's"
    );
    assert_eq!(
        srv.counter("sockops_recorded"),
        0,
        "recorded as the server's own"
    );
    client.stop();
}

/// Who is still connecting, from the pinned map: the owners' uids.
fn connecting_owners(host: &Host) -> Vec<u32> {
    let pin = host.pins.path().join(vnat_common::MAP_CONNECTING);
    let data = aya::maps::MapData::from_pin(&pin)
        .unwrap_or_else(|e| panic!("opening the pinned map {}: {e}", pin.display()));
    let map: aya::maps::HashMap<_, u64, vnat_common::Owner> =
        aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))
            .expect("the connecting map is a hash map");
    map.iter()
        .filter_map(Result::ok)
        .map(|(_, o)| o.uid)
        .collect()
}

/// A TCP socket's owner is kept from connect() until the connection is
/// established, and the entry goes however the socket ends: closed while
/// its SYN is out, closed after a refused connect, or established. (The
/// release hook looks only at sockets that never reached ESTABLISHED.)
#[test]
fn a_tcp_socket_closed_before_it_connects_leaves_no_owner_behind() {
    use std::io::{BufRead, BufReader, Write};

    let topo = SameLink::new("recsyn", false);
    let lap = Host::new(&topo.laptop, "recsyn");
    let server = topo.server_addr.v4;
    let echo = SocketAddr::new(server.into(), 7003);
    let _echo = EchoServer::tcp(&topo.server, echo);
    // On the link but nobody's: no ARP answer, so the SYN never leaves and
    // the socket stays in SYN_SENT.
    let nobody = {
        let mut o = server.octets();
        o[3] = 250;
        std::net::Ipv4Addr::from(o)
    };
    let script = r#"
import errno, socket, sys
server, nobody = sys.argv[1], sys.argv[2]
s = socket.socket()
try:
    s.connect((server, 7004))
    sys.exit("a closed port accepted the connection")
except ConnectionRefusedError:
    pass
s.close()
s = socket.socket()
s.setblocking(False)
err = s.connect_ex((nobody, 9))
if err != errno.EINPROGRESS:
    sys.exit("connecting to nobody: %s" % errno.errorcode.get(err, err))
print("syn-sent", flush=True)
sys.stdin.readline()
s.close()
socket.create_connection((server, 7003)).close()
print("done", flush=True)
"#;
    let mut cmd = lap.command("/usr/bin/python3");
    cmd.args(["-c", script, &server.to_string(), &nobody.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    let mut child = Kill(cmd.spawn().expect("starting python3"));
    let mut out = BufReader::new(child.0.stdout.take().expect("its stdout"));
    let mut line = String::new();
    out.read_line(&mut line).expect("reading python3");
    assert_eq!(line.trim(), "syn-sent", "the script stopped early");
    assert_eq!(
        connecting_owners(&lap).len(),
        1,
        "the socket in SYN_SENT has its owner recorded (and the refused one none left)"
    );
    writeln!(child.0.stdin.as_mut().expect("its stdin")).expect("telling python3 to go on");
    line.clear();
    out.read_line(&mut line).expect("reading python3");
    assert_eq!(line.trim(), "done", "the script failed");
    assert!(child.0.wait().expect("python3's status").success());
    assert_eq!(
        connecting_owners(&lap),
        Vec::<u32>::new(),
        "an owner entry outlived its socket"
    );
}

/// A simultaneous open (both ends connect() to each other, as TCP hole
/// punching does): the end whose SYN_SENT socket meets its peer's SYN is
/// established through SYN_RECV, by sock_ops' passive callback. Its
/// connect() owner must still be taken out of the map and put on its
/// record.
#[test]
fn a_simultaneous_open_keeps_its_owner_and_leaves_no_entry() {
    use std::io::{BufRead, BufReader, Write};

    let topo = SameLink::new("recsim", false);
    let lap = Host::new(&topo.laptop, "recsim");
    let (lap_ip, srv_ip) = (topo.laptop_addr.v4, topo.server_addr.v4);
    let (lap_port, srv_port) = (7100u16, 7101u16);
    let script = r#"
import errno, select, socket, sys
lip, lport, rip, rport = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((lip, lport))
s.setblocking(False)
err = s.connect_ex((rip, rport))
if err != errno.EINPROGRESS:
    sys.exit("connect: %s" % errno.errorcode.get(err, err))
print("sent", flush=True)
_, w, _ = select.select([], [s], [], 20)
if not w:
    sys.exit("never connected")
err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
if err:
    sys.exit("connect failed: %s" % errno.errorcode.get(err, err))
print("connected", flush=True)
sys.stdin.readline()
s.close()
"#;
    // Each end drops the other's bare SYNs until the test lets them in.
    let drop_syns = |ns: &vnat_tests::Netns, port: u16| {
        ns.run(&["nft", "add table inet simopen"]);
        ns.run(&[
            "nft",
            "add chain inet simopen in { type filter hook input priority 0 ; }",
        ]);
        ns.run(&[
            "nft",
            &format!(
                "add rule inet simopen in tcp dport {port} tcp flags & (syn | ack) == syn drop"
            ),
        ]);
    };
    drop_syns(&topo.laptop, lap_port);
    drop_syns(&topo.server, srv_port);
    let spawn = |mut cmd: std::process::Command, args: [String; 4]| {
        cmd.arg("-c")
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        let mut child = Kill(cmd.spawn().expect("starting python3"));
        let out = BufReader::new(child.0.stdout.take().expect("its stdout"));
        (child, out)
    };
    let line = |out: &mut BufReader<std::process::ChildStdout>| {
        let mut l = String::new();
        out.read_line(&mut l).expect("reading python3");
        l.trim().to_string()
    };
    let (mut lap_py, mut lap_out) = spawn(
        lap.command("/usr/bin/python3"),
        [
            lap_ip.to_string(),
            lap_port.to_string(),
            srv_ip.to_string(),
            srv_port.to_string(),
        ],
    );
    let (mut srv_py, mut srv_out) = spawn(
        topo.server.cmd("/usr/bin/python3"),
        [
            srv_ip.to_string(),
            srv_port.to_string(),
            lap_ip.to_string(),
            lap_port.to_string(),
        ],
    );
    assert_eq!(line(&mut lap_out), "sent");
    assert_eq!(line(&mut srv_out), "sent");
    assert_eq!(
        connecting_owners(&lap).len(),
        1,
        "the laptop's connecting socket has its owner recorded"
    );
    // The server's next SYN reaches the laptop's socket in SYN_SENT: the
    // laptop's end goes through SYN_RECV (the server's own SYN stays
    // dropped, so the server's end completes as an ordinary connect).
    topo.laptop.run(&["nft", "delete table inet simopen"]);
    assert_eq!(
        line(&mut lap_out),
        "connected",
        "the simultaneous open failed"
    );
    assert_eq!(line(&mut srv_out), "connected", "the server's end failed");
    topo.server.run(&["nft", "delete table inet simopen"]);
    assert_eq!(
        connecting_owners(&lap),
        Vec::<u32>::new(),
        "the established socket's owner entry stayed behind"
    );
    let local = SocketAddr::new(lap_ip.into(), lap_port);
    let c = lap.wait_connection("the simultaneous open", |c| c.virtual_local == local);
    assert_eq!(
        c.pid,
        Some(lap_py.0.id()),
        "the connection carries the process that called connect(): {c:?}"
    );
    for (py, who) in [(&mut lap_py, "laptop"), (&mut srv_py, "server")] {
        writeln!(py.0.stdin.as_mut().expect("its stdin")).expect("telling python3 to end");
        assert!(
            py.0.wait().expect("python3's status").success(),
            "the {who}'s python3 failed"
        );
    }
}

/// A live UDP flow keeps its record while the host's other UDP sockets
/// come and go by the thousand (a resolver, a game, a busy daemon). The
/// record's socket is looked for at every pass; a reading of the sockets
/// that skipped it dropped the record, and with it, after a move, the
/// connection's translation. (/proc/net/udp, read a page at a time, skips
/// a line whenever a socket ahead of the reader's place closes between two
/// pages.)
#[test]
fn a_udp_record_outlives_other_sockets_opening_and_closing() {
    let topo = SameLink::new("recchurn", false);
    let lap = Host::new(&topo.laptop, "recchurn");
    let server = SocketAddr::new(topo.server_addr.v4.into(), 7004);
    let _echo = EchoServer::udp(&topo.server, server);
    let target = format!("UDP4-CONNECT:{server}");
    let _sender = lap.socat(
        &["-u", "SYSTEM:while sleep 0.2; do echo x; done", &target],
        Stdio::null(),
    );
    let flow = lap.wait_connection("the UDP flow", |c| {
        c.proto == Proto::Udp && c.virtual_remote == server
    });
    // 3,000 unconnected UDP sockets, outside vnat's cgroup (none of them is
    // recorded), one closed and another opened in its place without pause.
    let churn = "import socket, random\n\
        s = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(3000)]\n\
        [x.bind(('0.0.0.0', 0)) for x in s]\n\
        print('ready', flush=True)\n\
        while True:\n\
        \x20   i = random.randrange(len(s)); s[i].close()\n\
        \x20   s[i] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s[i].bind(('0.0.0.0', 0))\n";
    let mut cmd = topo.laptop.cmd("python3");
    cmd.args(["-c", churn])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut churner = Kill(cmd.spawn().expect("starting python3"));
    let mut ready = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(churner.0.stdout.take().expect("stdout"))
        .read_line(&mut ready)
        .expect("reading the churner");
    assert_eq!(ready.trim(), "ready", "the churner did not start");
    for pass in 0..200 {
        // Each listing first runs the pass that drops records whose socket
        // is gone (sync_udp).
        let found = lap
            .connections(Proto::Udp)
            .iter()
            .any(|c| c.cookie == flow.cookie && c.virtual_remote == server);
        assert!(
            found,
            "pass {pass}: the live UDP flow lost its record while other sockets churned"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(
        churner.0.try_wait().expect("churner").is_none(),
        "the churner ended early: the test churned nothing"
    );
}
