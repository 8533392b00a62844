//! Pairing under attack (issue 16, item 3), with real vnatd on both hosts
//! over IPv6: an off-path host floods the server's VCMP port with PAIR_INITs
//! from 300 spoofed IPv6 sources, one of them the laptop's own VCMP address,
//! each datagram with a fresh host key, while the laptop opens a connection
//! and its vnatd pairs with the server's.
//!
//! What a user sees: the connection becomes mobile on both ends during the
//! flood, and moves afterwards without a break. What the server's counters
//! show: the flood cost it no Diffie-Hellman (only the laptop's, and at most
//! the per-source burst), the spoofed copies of the laptop's address got
//! cookies instead of handshakes, and strangers were turned away unanswered.

use std::{
    net::{Ipv6Addr, SocketAddr, SocketAddrV6, UdpSocket},
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_daemon::vcmp::{crypto::HostIdentity, wire::Message};
use vnat_tests::{
    attach_attacker, EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir,
    Vnatd, ROUTER_IF_D,
};

const ATTACKER_V6: &str = "fd00:5e:4::2";
const ROUTER_D_V6: &str = "fd00:5e:4::1";
const SOURCES: u16 = 300;

/// One UDP socket per spoofed source, bound (IPV6_FREEBIND) to an address
/// the attacker does not have, port 2031. Source 0 is the laptop's address.
fn spoofed_sockets(laptop: Ipv6Addr) -> Vec<UdpSocket> {
    (0..SOURCES)
        .map(|i| {
            let ip = if i == 0 {
                laptop
            } else {
                let mut s = laptop.segments();
                s[7] = 0x1000 + i;
                Ipv6Addr::from(s)
            };
            free_bind(SocketAddrV6::new(ip, 2031, 0, 0))
        })
        .collect()
}

fn free_bind(addr: SocketAddrV6) -> UdpSocket {
    // SAFETY: plain socket syscalls on a descriptor this function owns; the
    // option value is a live local of the size passed.
    unsafe {
        let fd = libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let one: libc::c_int = 1;
        let r = libc::setsockopt(
            fd,
            libc::IPPROTO_IPV6,
            libc::IPV6_FREEBIND,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(r, 0, "IPV6_FREEBIND: {}", std::io::Error::last_os_error());
        let sock = <UdpSocket as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let sa = socket_addr_v6(addr);
        let r = libc::bind(
            sock.as_raw_fd(),
            (&sa as *const libc::sockaddr_in6).cast(),
            std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
        );
        assert_eq!(r, 0, "bind {addr}: {}", std::io::Error::last_os_error());
        sock
    }
}

fn socket_addr_v6(a: SocketAddrV6) -> libc::sockaddr_in6 {
    libc::sockaddr_in6 {
        sin6_family: libc::AF_INET6 as libc::sa_family_t,
        sin6_port: a.port().to_be(),
        sin6_flowinfo: 0,
        sin6_addr: libc::in6_addr {
            s6_addr: a.ip().octets(),
        },
        sin6_scope_id: 0,
    }
}

/// A PAIR_INIT with a fresh host key, ephemeral value and id.
fn init(n: u64) -> Vec<u8> {
    let mut k = [0u8; 32];
    k[..8].copy_from_slice(&n.to_le_bytes());
    k[8] = 1;
    let static_pub = HostIdentity::from_bytes(k).public();
    k[9] = 2;
    let eph_pub = HostIdentity::from_bytes(k).public();
    Message::PairInit {
        request_id: n as u32,
        static_pub,
        eph_pub,
        cookie: None,
    }
    .encode()
    .expect("encode")
}

fn counter(status: &Value, group: &str, name: &str) -> u64 {
    status["vcmp"][group][name].as_u64().unwrap_or(0)
}

#[test]
fn a_pair_init_flood_from_300_spoofed_ipv6_sources_does_not_stop_a_real_pairing() {
    let topo = LaptopRouterServer::builder().tag("pfl").ipv6(true).build();
    let (attacker, _) = attach_attacker(&topo, "pfa");
    attacker.add_addr("eth0", ATTACKER_V6.parse().unwrap(), 64);
    topo.router
        .add_addr(ROUTER_IF_D, ROUTER_D_V6.parse().unwrap(), 64);
    attacker.default_route(ROUTER_D_V6.parse().unwrap(), "eth0");
    let (lap_dir, srv_dir) = (TempDir::new("pfll"), TempDir::new("pfls"));
    let lap = Host::new(&topo.laptop, "pfll");
    let srv = Host::new(&topo.server, "pfls");
    let laptop_v6 = topo.laptop_a_addr.v6();
    let server_v6 = topo.server_addr.v6();
    let server = SocketAddr::new(server_v6.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, lap_dir.path());
    let srvd = Vnatd::start(&srv, srv_dir.path());

    // The flood, paced to about 4,000 datagrams a second, until the
    // pairing is done and a little after.
    let socks = attacker.run_in(|| spoofed_sockets(laptop_v6));
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let flood_started = Instant::now();
    let flood = {
        let (stop, sent) = (stop.clone(), sent.clone());
        let dst = SocketAddr::new(server_v6.into(), 2031);
        std::thread::spawn(move || {
            let mut n = 0u64;
            let t0 = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                // Every other datagram from the laptop's address (which
                // the server knows once the connection is up), the rest
                // from the 299 strangers in turn.
                let i = if n.is_multiple_of(2) {
                    0
                } else {
                    1 + (n / 2) % u64::from(SOURCES - 1)
                };
                let s = &socks[i as usize];
                if s.send_to(&init(n), dst).is_ok() {
                    sent.fetch_add(1, Ordering::Relaxed);
                }
                n += 1;
                let due = t0 + Duration::from_micros(n * 250);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    std::thread::sleep(wait);
                }
            }
        })
    };
    std::thread::sleep(Duration::from_secs(1));

    // The laptop opens a connection while the flood runs.
    let mut cmd = StreamOptions::tcp(server)
        .rate(2_000_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(100_000, Duration::from_secs(10));
    let t0 = Instant::now();
    while !(lapd.mobile_to("tcp", server_v6.into()) && srvd.mobile_to("tcp", laptop_v6.into())) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the connection never became mobile during the flood: server {}",
            srvd.ctl(&["status"]).unwrap_or_default()["vcmp"]
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let paired_after = t0.elapsed();
    std::thread::sleep(Duration::from_secs(2));
    // On a loaded machine the paced sender falls behind: keep it going
    // until the flood is big enough to mean something (the check below),
    // for at most 10 s more.
    let more = Instant::now();
    while sent.load(Ordering::Relaxed) < 10_000 && more.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    flood.join().expect("flood thread");
    let sent = sent.load(Ordering::Relaxed);

    let st = srvd.ctl(&["status"]).expect("server status");
    let dh = counter(&st, "events", "pair_dh_computed");
    let cookies = counter(&st, "events", "pair_cookies_sent");
    let strangers = counter(&st, "rejected", "pair_unknown_source");
    eprintln!(
        "flood: {sent} PAIR_INITs from {SOURCES} sources; paired {paired_after:?} after the \
         connection; server: {dh} DH, {cookies} cookies, {strangers} strangers refused"
    );
    assert!(
        sent >= 10_000,
        "the flood was too small to mean anything: {sent}"
    );
    // Half the flood claimed the laptop's address. Without a cookie, the
    // server computes at most the laptop's own DH, the per-source burst (5)
    // and 2 a second for that source, whatever the flood's rate.
    let flood_secs = flood_started.elapsed().as_secs() + 1;
    let bound = 1 + 5 + 2 * flood_secs;
    assert!(
        dh <= bound,
        "the flood cost the server {dh} DH (at most {bound}): {}",
        st["vcmp"]
    );
    assert!(
        cookies >= sent / 6,
        "the spoofed laptop address got few cookies: {}",
        st["vcmp"]
    );
    assert!(
        strangers >= sent / 3,
        "the strangers' PAIR_INITs were not refused unanswered: {}",
        st["vcmp"]
    );

    // And the pairing is real: the laptop moves and the stream goes on.
    let at_move = client.latest().expect("status").verified;
    topo.move_laptop_to_b();
    client.wait_verified_at_least(at_move + 1_000_000, Duration::from_secs(20));
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
}
