//! The UDP recorders under a spoofed flood (issue 16, item 4), with real
//! vnatd on the server: an off-path host sends 300,000 UDP datagrams, each
//! from a different spoofed source, to a server that receives on 20
//! sockets with recvfrom and never answers (a log or metrics collector),
//! half of them to one socket.
//!
//! Before, every source became a record in the one connection map shared
//! with TCP, for as long as the server's sockets lived, and a candidate
//! for pairing: the flood filled the map and new TCP connections went
//! unrecorded, never mobile. Now UDP records have a budget of their own
//! (65,536 of the map's 262,144), each socket at most 4,096 of them, a
//! source only received from is no pairing target, and idle ones expire.
//! What a user sees: the server's next TCP connection is recorded and
//! mobile, and moves.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4},
    process::Stdio,
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_common::{UDP_MAX_RECORDS, UDP_PER_SOCKET_MAX};
use vnat_daemon::datapath::{Datapath, Proto};
use vnat_tests::{
    attach_attacker, EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir,
    Vnatd, ROUTER_IF_D,
};

const SOCKETS: u16 = 20;
const FIRST_PORT: u16 = 6000;
const DATAGRAMS: u32 = 300_000;

/// A receiver on `SOCKETS` UDP ports that reads with recvfrom and never
/// answers, started in `host`'s cgroup (so vnatd records its flows).
fn collector(host: &Host, ip: Ipv4Addr) -> std::process::Child {
    let script = format!(
        r#"
import select, socket
socks = []
for port in range({first}, {end}):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind(("{ip}", port))
    s.setblocking(False)
    socks.append(s)
print("ready", flush=True)
while True:
    for s in select.select(socks, [], [])[0]:
        try:
            while True:
                s.recvfrom(2048)
        except BlockingIOError:
            pass
"#,
        first = FIRST_PORT,
        end = FIRST_PORT + SOCKETS,
    );
    let mut cmd = host.ns.cmd("python3");
    cmd.args(["-c", &script]).stdout(Stdio::piped());
    host.cgroup.join_on_spawn(&mut cmd);
    let mut child = cmd.spawn().expect("python3 collector");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().expect("stdout")),
        &mut line,
    )
    .expect("collector output");
    assert_eq!(line.trim(), "ready", "the collector did not start");
    child
}

/// IPv4 + UDP, checksum left to the kernel (IP) and off (UDP, allowed in
/// IPv4): what a raw IP_HDRINCL socket sends as is.
fn datagram(src: SocketAddrV4, dst: SocketAddrV4) -> [u8; 36] {
    let mut p = [0u8; 36];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&36u16.to_be_bytes());
    p[8] = 64;
    p[9] = 17;
    p[12..16].copy_from_slice(&src.ip().octets());
    p[16..20].copy_from_slice(&dst.ip().octets());
    p[20..22].copy_from_slice(&src.port().to_be_bytes());
    p[22..24].copy_from_slice(&dst.port().to_be_bytes());
    p[24..26].copy_from_slice(&16u16.to_be_bytes());
    p[28..36].copy_from_slice(b"spoofed!");
    p
}

/// Sends the flood from a raw socket (created in the attacker's namespace)
/// and returns how many datagrams left.
fn flood(fd: i32, server: Ipv4Addr) -> u32 {
    let mut sent = 0;
    let t0 = Instant::now();
    for i in 0..DATAGRAMS {
        // 100.64.0.0/10: 300,000 sources, each its own address.
        let src = Ipv4Addr::from(u32::from(Ipv4Addr::new(100, 64, 0, 0)) + i);
        // Half of it to the first socket (which reaches its own cap),
        // the rest spread over the others (which reach UDP's budget).
        let port = if i % 2 == 0 {
            FIRST_PORT
        } else {
            FIRST_PORT + 1 + ((i / 2) % u32::from(SOCKETS - 1)) as u16
        };
        let dst = SocketAddrV4::new(server, port);
        let p = datagram(SocketAddrV4::new(src, 1024 + (i % 50_000) as u16), dst);
        let to = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(server.octets()),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: `fd` is the raw socket this test opened; the buffer and
        // the address are live locals of the lengths passed.
        let r = unsafe {
            libc::sendto(
                fd,
                p.as_ptr().cast(),
                p.len(),
                0,
                (&to as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if r == p.len() as isize {
            sent += 1;
        }
        // About 100,000 a second: what the collector can read.
        let due = t0 + Duration::from_micros(u64::from(i) * 10);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    sent
}

/// A datapath counter of `vnatctl status`.
fn stat(status: &Value, name: &str) -> u64 {
    status["datapath"]["counters"][name].as_u64().unwrap_or(0)
}

#[test]
fn a_spoofed_udp_flood_leaves_room_for_tcp_and_makes_no_pairing_targets() {
    let topo = LaptopRouterServer::builder().tag("ufl").build();
    let (attacker, _) = attach_attacker(&topo, "ufa");
    // The router forwards the spoofed sources (no reverse-path filter).
    for k in ["all", "default", ROUTER_IF_D] {
        topo.router
            .set_sysctl(&format!("net/ipv4/conf/{k}/rp_filter"), "0");
    }
    let (lap_dir, srv_dir) = (TempDir::new("ufll"), TempDir::new("ufls"));
    let lap = Host::new(&topo.laptop, "ufll");
    let srv = Host::new(&topo.server, "ufls");
    let server_ip = topo.server_addr.v4;
    let laptop_ip = IpAddr::from(topo.laptop_a_addr.v4);
    let lapd = Vnatd::start(&lap, lap_dir.path());
    let srvd = Vnatd::start(&srv, srv_dir.path());
    let mut collector = collector(&srv, server_ip);

    // SAFETY: a plain socket call; the descriptor is closed below.
    let fd = attacker
        .run_in(|| unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) });
    assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    let t0 = Instant::now();
    let sent = flood(fd, server_ip);
    // SAFETY: closing the descriptor opened above, once.
    unsafe { libc::close(fd) };
    eprintln!("flood: {sent} spoofed datagrams in {:?}", t0.elapsed());
    assert!(
        sent >= DATAGRAMS * 9 / 10,
        "the flood did not leave: {sent}"
    );
    std::thread::sleep(Duration::from_secs(2));

    // The recorders kept within their budgets.
    let (udp, inbound_only) = srv.datapath(|dp| {
        let udp: Vec<_> = dp
            .connections()
            .expect("listing")
            .into_iter()
            .filter(|c| c.proto == Proto::Udp)
            .collect();
        let inbound = udp.iter().filter(|c| c.udp_inbound_only).count();
        (udp.len(), inbound)
    });
    let st = srvd.ctl(&["status"]).expect("server status");
    eprintln!(
        "server: {udp} UDP records; udp_socket_full {}, udp_budget_full {}, conns_map_full {}",
        stat(&st, "udp_socket_full"),
        stat(&st, "udp_budget_full"),
        stat(&st, "conns_map_full")
    );
    assert!(
        udp as u64 <= UDP_MAX_RECORDS + 1_000,
        "{udp} UDP records, beyond the budget of {UDP_MAX_RECORDS}"
    );
    assert!(
        stat(&st, "udp_socket_full") > 0,
        "no socket reached its cap of {UDP_PER_SOCKET_MAX}: {}",
        st["datapath"]["counters"]
    );
    assert!(
        stat(&st, "udp_budget_full") > 0,
        "the UDP budget was never reached: {}",
        st["datapath"]["counters"]
    );
    assert_eq!(stat(&st, "conns_map_full"), 0);
    // No spoofed source became a peer to pair with: the flows are marked
    // as only received from, and vnatd started no pairing at all.
    assert_eq!(inbound_only, udp, "UDP records not marked inbound-only");
    let vcmp = &st["vcmp"];
    for (group, name) in [
        ("events", "pairing_deferred"),
        ("rejected", "pairing_table_full"),
        ("events", "pairing_timed_out"),
    ] {
        assert_eq!(
            vcmp[group][name].as_u64().unwrap_or(0),
            0,
            "vnatd tried to pair with spoofed sources: {vcmp}"
        );
    }

    // A new TCP connection is recorded and mobile on both ends, and moves.
    let server = SocketAddr::new(server_ip.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let mut cmd = StreamOptions::tcp(server)
        .rate(2_000_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(100_000, Duration::from_secs(10));
    srv.wait_connection("the server's new TCP connection", |c| {
        c.proto == Proto::Tcp && c.virtual_remote.ip() == laptop_ip
    });
    let t = Instant::now();
    while !(srvd.mobile_to("tcp", laptop_ip) && lapd.mobile_to("tcp", server_ip.into())) {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the TCP connection never became mobile after the flood: {}",
            srvd.ctl(&["status"]).unwrap_or_default()["vcmp"]
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let at_move = client.latest().expect("status").verified;
    topo.move_laptop_to_b();
    client.wait_verified_at_least(at_move + 1_000_000, Duration::from_secs(20));
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
    let _ = collector.kill();
    let _ = collector.wait();
}
