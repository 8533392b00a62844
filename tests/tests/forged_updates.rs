//! An off-path attacker cannot move a connection. With two paired vnatd and
//! a live stream, a fourth host behind the router (subnet D, 198.18.4.2):
//!
//! (a) forges VCMP messages for the real connection's virtual endpoints
//!     (UPD, UPD_R, CHALLENGE, RESPONSE, KEYX, SUSP_*, STORE with random
//!     tags and every kind of sequence number, plus malformed datagrams, a
//!     PAIR_INIT and an unauthenticated ERROR) claiming that the laptop, or
//!     the server, moved to the attacker's address, and sends them to both
//!     daemons;
//! (b) replays genuine VCMP datagrams captured on the router during a real
//!     move, after the laptop has moved back, from its own address.
//!
//! Nothing changes: both daemons keep the connection where it really is,
//! no daemon challenges or answers the attacker's address with a record,
//! and the same socket carries on byte-exact with no reset.

use std::{
    io::{BufRead, BufReader, Read},
    net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket},
    os::unix::process::CommandExt,
    process::{Child, Stdio},
    sync::{mpsc, Arc, Mutex},
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{kill, Signal},
    unistd::Pid,
};
use serde_json::Value;
use vnat_daemon::{
    datapath::Proto,
    vcmp::wire::{ErrorCode, Ext, Family, Kind, Message, Record, TAG_LEN},
};
use vnat_tests::{
    attach_attacker, EchoServer, Host, LaptopRouterServer, Netns, StreamClient, StreamOptions,
    StreamStatus, TempDir, Vnatd, ROUTER_IF_D,
};

const VCMP_PORT: u16 = 2031;

/// The connection's row in `vnatctl --json ls` (matched by the laptop's
/// virtual endpoint, which both ends know).
fn row(d: &Vnatd, laptop_virtual: &str) -> Value {
    let ls = d.ctl(&["ls", "--proto", "tcp"]).expect("vnatd unreachable");
    ls.as_array()
        .expect("ls --json is an array")
        .iter()
        .find(|r| r["virtual_local"] == laptop_virtual || r["virtual_remote"] == laptop_virtual)
        .cloned()
        .unwrap_or_else(|| panic!("the connection of {laptop_virtual} is not listed: {ls}"))
}

/// The fields of a row that a move would change.
fn mapping(r: &Value) -> (Value, Value, Value) {
    (
        r["state"].clone(),
        r["physical_local"].clone(),
        r["physical_remote"].clone(),
    )
}

fn wait_mapping(d: &Vnatd, laptop_virtual: &str, want: (&str, &str, &str), what: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = row(d, laptop_virtual);
        if r["state"] == want.0 && r["physical_local"] == want.1 && r["physical_remote"] == want.2 {
            return r;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: expected {want:?}, vnatd shows {r}"
        );
        thread::sleep(Duration::from_millis(200));
    }
}

/// `tcpdump -w -` in a namespace; the pcap stream is collected in memory.
struct Pcap {
    child: Child,
    data: Arc<Mutex<Vec<u8>>>,
    reader: Option<JoinHandle<()>>,
}

impl Pcap {
    fn start(ns: &Netns, dev: &str, filter: &str) -> Pcap {
        let mut cmd = ns.cmd("tcpdump");
        // -U: write each packet at once; -Z root: tcpdump must not drop to
        // its own user (it writes to our pipe, nothing else).
        cmd.args(["-nn", "-U", "-Z", "root", "-s", "0", "-i", dev, "-w", "-"])
            .args(filter.split_whitespace());
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = cmd.spawn().expect("starting tcpdump");
        let mut out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        let data = Arc::new(Mutex::new(Vec::new()));
        let d = Arc::clone(&data);
        let reader = thread::spawn(move || {
            let mut buf = [0u8; 65536];
            while let Ok(n) = out.read(&mut buf) {
                if n == 0 {
                    break;
                }
                d.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut seen = Vec::new();
        loop {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(l) if l.contains("listening on") => break,
                Ok(l) => seen.push(l),
                Err(_) => {
                    let _ = child.kill();
                    panic!("tcpdump on {dev} in {} did not start: {seen:?}", ns.name());
                }
            }
        }
        Pcap {
            child,
            data,
            reader: Some(reader),
        }
    }

    /// Stop tcpdump and return every UDP datagram it saw.
    fn stop(mut self) -> Vec<Datagram> {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGINT);
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let bytes = self.data.lock().unwrap().clone();
        parse_pcap(&bytes)
    }
}

impl Drop for Pcap {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Clone, Debug)]
struct Datagram {
    src: SocketAddr,
    dst: SocketAddr,
    payload: Vec<u8>,
}

/// A small pcap reader (classic format, Ethernet link type, IPv4/UDP only:
/// all VCMP traffic in this test is IPv4).
fn parse_pcap(b: &[u8]) -> Vec<Datagram> {
    assert!(
        b.len() >= 24,
        "the capture has no pcap header ({} bytes)",
        b.len()
    );
    let magic = u32::from_le_bytes(b[0..4].try_into().unwrap());
    let le = match magic {
        0xa1b2_c3d4 | 0xa1b2_3c4d => true,
        m if m.swap_bytes() == 0xa1b2_c3d4 || m.swap_bytes() == 0xa1b2_3c4d => false,
        m => panic!("not a pcap file (magic {m:#x})"),
    };
    let u32_at = |at: usize| {
        let a: [u8; 4] = b[at..at + 4].try_into().unwrap();
        if le {
            u32::from_le_bytes(a)
        } else {
            u32::from_be_bytes(a)
        }
    };
    assert_eq!(
        u32_at(20) & 0x0fff_ffff,
        1,
        "the capture's link type is not Ethernet"
    );
    let mut out = Vec::new();
    let mut at = 24;
    while at + 16 <= b.len() {
        let incl = u32_at(at + 8) as usize;
        let start = at + 16;
        if start + incl > b.len() {
            break; // the last record may be cut off when tcpdump is stopped
        }
        let f = &b[start..start + incl];
        at = start + incl;
        if f.len() < 14 + 20 || u16::from_be_bytes([f[12], f[13]]) != 0x0800 {
            continue;
        }
        let ip = &f[14..];
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        if ip[9] != 17 || ip.len() < total || total < ihl + 8 {
            continue;
        }
        let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
        let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
        let udp = &ip[ihl..total];
        out.push(Datagram {
            src: SocketAddr::new(src.into(), u16::from_be_bytes([udp[0], udp[1]])),
            dst: SocketAddr::new(dst.into(), u16::from_be_bytes([udp[2], udp[3]])),
            payload: udp[8..].to_vec(),
        });
    }
    out
}

/// VCMP kind of a datagram (its second byte).
fn kind_of(p: &[u8]) -> Option<Kind> {
    p.get(1).copied().and_then(Kind::from_u8)
}

/// Deterministic "random" bytes: the attacker knows no key, any tag will do.
fn junk<const N: usize>(seed: u64) -> [u8; N] {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    std::array::from_fn(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x as u8
    })
}

/// Forged messages that claim `sender_vir`'s end moved to `claimed`,
/// addressed to the host whose virtual endpoint is `receiver_vir`.
fn forgeries(
    receiver_vir: SocketAddr,
    sender_vir: SocketAddr,
    claimed: SocketAddr,
) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let seqs = [1, 2, 3, 7, 1000, 1 << 32, u64::MAX - 1, u64::MAX];
    let kinds = [
        Kind::Upd,
        Kind::UpdR,
        Kind::SuspPrimary,
        Kind::SuspSecondary,
        Kind::Challenge,
        Kind::Response,
        Kind::KeyX,
        Kind::Store,
        Kind::Switched,
    ];
    for (i, kind) in kinds.into_iter().enumerate() {
        for (j, seq) in seqs.into_iter().enumerate() {
            let seed = (i * 100 + j) as u64 + 1;
            let ext = match kind {
                Kind::KeyX => Ext::Key(junk(seed)),
                Kind::Challenge | Kind::Response => Ext::Nonce(junk(seed)),
                Kind::Store => Ext::Locator(junk(seed)),
                _ => Ext::None,
            };
            let rec = Record {
                command: kind,
                proto: Proto::Tcp,
                receiver_vir,
                sender_vir,
                sender_phys: claimed,
                ext,
                seq,
                tag: if j == 0 {
                    [0; TAG_LEN]
                } else {
                    junk(seed ^ 0xabcd)
                },
            };
            let request_id = if kind.uses_request_id() {
                seed as u32
            } else {
                0
            };
            // One record, and a datagram of many copies (each must be
            // refused on its own).
            for n in [1, 5] {
                let msg = Message::Records {
                    kind,
                    request_id,
                    family: Family::V4,
                    records: vec![rec; n],
                };
                out.push(msg.encode().expect("encoding a forged message"));
            }
        }
    }
    // Malformed and unauthenticated ones.
    let upd = out[0].clone();
    out.push(upd[..upd.len() - 1].to_vec()); // cut short
    out.push([upd.as_slice(), &[0]].concat()); // one byte too many
    let mut v = upd.clone();
    v[0] = 9; // unknown version
    out.push(v);
    out.push(vec![1]);
    out.push(Vec::new());
    out.push(
        Message::PairInit {
            request_id: 7,
            static_pub: junk(77),
            eph_pub: junk(78),
            cookie: None,
        }
        .encode()
        .unwrap(),
    );
    out.push(
        Message::Error {
            request_id: 0,
            code: ErrorCode::PeerKeyMismatch,
        }
        .encode()
        .unwrap(),
    );
    out.push(
        Message::Error {
            request_id: 0,
            code: ErrorCode::UnknownConnection,
        }
        .encode()
        .unwrap(),
    );
    out
}

/// Send every datagram from the attacker's namespace to `dst`, three times.
fn send_from(attacker: &Netns, from: IpAddr, dst: SocketAddr, datagrams: &[Vec<u8>]) {
    attacker.run_in(|| {
        let sock = UdpSocket::bind(SocketAddr::new(from, 0)).expect("attacker's socket");
        for _ in 0..3 {
            for d in datagrams {
                sock.send_to(d, dst)
                    .unwrap_or_else(|e| panic!("attacker sending to {dst}: {e}"));
                thread::sleep(Duration::from_micros(200));
            }
        }
    });
}

/// What the daemons sent to the attacker's address: (sender, kind, the
/// StoreR's accepted count).
fn sent_to_attacker(
    capture: Vec<Datagram>,
    attacker: IpAddr,
) -> Vec<(SocketAddr, Option<Kind>, u8)> {
    capture
        .into_iter()
        .filter(|d| d.dst.ip() == attacker && d.src.port() == VCMP_PORT)
        .map(|d| {
            (
                d.src,
                kind_of(&d.payload),
                d.payload.get(3).copied().unwrap_or(0),
            )
        })
        .collect()
}

/// A daemon must never have challenged, updated, answered a suspend or key
/// exchange, or paired with the attacker's address. (Location-service
/// replies, STORE_R and LOOKUP_R, may go to any host: a location server
/// answers whoever asks, and the records it returns are checked by the
/// asker with the connection's key.)
fn assert_nothing_moved_towards(answered: &[(SocketAddr, Option<Kind>, u8)], what: &str) {
    let bad: Vec<_> = answered
        .iter()
        .filter(|(_, k, _)| !matches!(k, Some(Kind::StoreR | Kind::LookupR | Kind::Error)))
        .collect();
    assert!(
        bad.is_empty(),
        "{what}: a daemon sent the attacker's address {bad:?}"
    );
    let stored: u32 = answered
        .iter()
        .filter(|(_, k, _)| *k == Some(Kind::StoreR))
        .map(|(_, _, n)| u32::from(*n))
        .sum();
    let lookups = answered
        .iter()
        .filter(|(_, k, _)| *k == Some(Kind::LookupR))
        .count();
    eprintln!(
        "forged: {what}: the attacker got {} datagrams: STORE_R accepting {stored} records in all, {lookups} LOOKUP_R",
        answered.len()
    );
}

/// VCMP reject counters, if `vnatctl status` shows them.
fn vcmp_rejects(d: &Vnatd) -> Option<Value> {
    let st = d.ctl(&["status"]).expect("vnatd unreachable");
    [
        "/vcmp/rejected",
        "/vcmp/stats/rejected",
        "/daemon/vcmp/rejected",
    ]
    .iter()
    .find_map(|p| st.pointer(p).cloned())
}

/// Rejects counted by the replay window (`replay_duplicate`, `replay_too_old`).
fn replays(v: &Option<Value>) -> u64 {
    v.as_ref().and_then(Value::as_object).map_or(0, |o| {
        o.iter()
            .filter(|(k, _)| k.starts_with("replay"))
            .filter_map(|(_, n)| n.as_u64())
            .sum()
    })
}

fn total(v: &Option<Value>) -> u64 {
    v.as_ref()
        .and_then(Value::as_object)
        .map_or(0, |o| o.values().filter_map(Value::as_u64).sum())
}

/// 100 kB more verified than now (and than `since`), within 20 s.
fn flows(client: &StreamClient, since: &StreamStatus, what: &str) -> StreamStatus {
    eprintln!("forged: {what}");
    client.wait_progress(since, 100_000, Duration::from_secs(20))
}

#[test]
fn forged_and_replayed_vcmp_messages_change_nothing() {
    let tag = "forg";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let (attacker, attacker_ip) = attach_attacker(&topo, &format!("{tag}-a"));
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let server_vcmp = SocketAddr::new(topo.server_addr.v4.into(), VCMP_PORT);
    let laptop_vcmp = SocketAddr::new(topo.laptop_a_addr.v4.into(), VCMP_PORT);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());
    attacker.wait_reachable(topo.server_addr.v4.into(), Duration::from_secs(5));

    let mut cmd = StreamOptions::tcp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");
    let laptop_virtual: SocketAddr = before.local.parse().unwrap();
    let lv = before.local.as_str();
    let native_srv = wait_mapping(
        &srvd,
        lv,
        ("native", &server.to_string(), lv),
        "server, before the attack",
    );
    let native_lap = wait_mapping(
        &lapd,
        lv,
        ("native", lv, &server.to_string()),
        "laptop, before the attack",
    );
    // Let both daemons derive the connection's keys, so that the forgeries
    // meet a connection that could really move.
    thread::sleep(Duration::from_secs(2));
    let rejects_before = (vcmp_rejects(&srvd), vcmp_rejects(&lapd));

    // (a) Forgeries, to both daemons, watched on the router's link to the
    // attacker.
    let watch = Pcap::start(&topo.router, ROUTER_IF_D, "udp");
    let claimed = SocketAddr::new(attacker_ip, laptop_virtual.port());
    let to_server = forgeries(server, laptop_virtual, claimed);
    send_from(&attacker, attacker_ip, server_vcmp, &to_server);
    let to_laptop = forgeries(
        laptop_virtual,
        server,
        SocketAddr::new(attacker_ip, server.port()),
    );
    send_from(&attacker, attacker_ip, laptop_vcmp, &to_laptop);
    eprintln!(
        "forged: sent {} forged datagrams to each daemon, three times",
        to_server.len()
    );
    let s = flows(&client, &before, "after the forgeries, data still flowing");
    thread::sleep(Duration::from_secs(2));
    assert_eq!(
        mapping(&row(&srvd, lv)),
        mapping(&native_srv),
        "a forged message changed the server's mapping"
    );
    assert_eq!(
        mapping(&row(&lapd, lv)),
        mapping(&native_lap),
        "a forged message changed the laptop's mapping"
    );
    assert_nothing_moved_towards(&sent_to_attacker(watch.stop(), attacker_ip), "forgeries");
    let rejects_after = (vcmp_rejects(&srvd), vcmp_rejects(&lapd));
    match &rejects_after {
        (Some(_), Some(_)) => {
            let n = to_server.len() as u64 * 3;
            assert!(total(&rejects_after.0) >= total(&rejects_before.0) + n, "server rejects: {rejects_before:?} -> {rejects_after:?}");
            assert!(total(&rejects_after.1) >= total(&rejects_before.1) + n, "laptop rejects: {rejects_before:?} -> {rejects_after:?}");
        }
        _ => eprintln!(
            "forged: NOTE: `vnatctl status` shows no VCMP reject counters; only the unchanged mappings and the stream are checked"
        ),
    }

    // (b) A real move, captured on the router's link to the server.
    let capture = Pcap::start(
        &topo.router,
        &topo.router_if_c,
        &format!("udp port {VCMP_PORT}"),
    );
    topo.move_laptop_to_b();
    let new_local =
        SocketAddr::new(topo.laptop_b_addr.v4.into(), laptop_virtual.port()).to_string();
    let s = flows(&client, &s, "moved to B");
    wait_mapping(
        &srvd,
        lv,
        ("translated", &server.to_string(), &new_local),
        "server after the move to B",
    );
    wait_mapping(
        &lapd,
        lv,
        ("translated", &new_local, &server.to_string()),
        "laptop after the move to B",
    );
    thread::sleep(Duration::from_secs(1));
    let genuine = capture.stop();
    let kinds: Vec<_> = genuine
        .iter()
        .map(|d| {
            (
                d.src,
                d.dst,
                kind_of(&d.payload),
                if kind_of(&d.payload) == Some(Kind::StoreR) {
                    d.payload[3]
                } else {
                    0
                },
            )
        })
        .collect();
    eprintln!("forged: captured VCMP during the move (src, dst, kind, STORE_R's accepted count): {kinds:?}");
    let from_laptop: Vec<Vec<u8>> = genuine
        .iter()
        .filter(|d| d.dst == server_vcmp && d.src.port() == VCMP_PORT)
        .map(|d| d.payload.clone())
        .collect();
    let from_server: Vec<Vec<u8>> = genuine
        .iter()
        .filter(|d| d.src == server_vcmp && d.dst.port() == VCMP_PORT)
        .map(|d| d.payload.clone())
        .collect();
    assert!(
        from_laptop.iter().any(|p| kind_of(p) == Some(Kind::Upd)),
        "no UPD from the laptop was captured during the move: {kinds:?}"
    );
    assert!(
        !from_server.is_empty(),
        "nothing from the server was captured during the move: {kinds:?}"
    );

    // Back to A, where the connection is native again; then replay the
    // move to B from the attacker: if accepted, the server would send to B,
    // where the laptop no longer is.
    thread::sleep(Duration::from_secs(2));
    topo.move_laptop_to_a();
    let s = flows(&client, &s, "moved back to A");
    let back_srv = wait_mapping(
        &srvd,
        lv,
        ("native", &server.to_string(), lv),
        "server after moving back to A",
    );
    let back_lap = wait_mapping(
        &lapd,
        lv,
        ("native", lv, &server.to_string()),
        "laptop after moving back to A",
    );
    let rejects_before = (vcmp_rejects(&srvd), vcmp_rejects(&lapd));
    let watch = Pcap::start(&topo.router, ROUTER_IF_D, "udp");
    send_from(&attacker, attacker_ip, server_vcmp, &from_laptop);
    send_from(&attacker, attacker_ip, laptop_vcmp, &from_server);
    eprintln!(
        "forged: replayed {} genuine datagrams to the server and {} to the laptop, three times",
        from_laptop.len(),
        from_server.len()
    );
    let s = flows(&client, &s, "after the replays, data still flowing");
    thread::sleep(Duration::from_secs(2));
    assert_eq!(
        mapping(&row(&srvd, lv)),
        mapping(&back_srv),
        "a replayed message changed the server's mapping"
    );
    assert_eq!(
        mapping(&row(&lapd, lv)),
        mapping(&back_lap),
        "a replayed message changed the laptop's mapping"
    );
    assert_nothing_moved_towards(&sent_to_attacker(watch.stop(), attacker_ip), "replays");
    let rejects_after = (vcmp_rejects(&srvd), vcmp_rejects(&lapd));
    // At least the replayed UPD (sent three times) must be refused by the
    // replay window. Not every replayed datagram is a reject: a replayed
    // STORE is kept under the attacker's own source slot, which moves
    // nothing.
    assert!(
        rejects_after.0.is_some(),
        "vnatctl status shows no VCMP reject counters"
    );
    assert!(
        replays(&rejects_after.0) >= replays(&rejects_before.0) + 3,
        "the server did not count the replayed update as a replay: {rejects_before:?} -> {rejects_after:?}"
    );
    assert!(total(&rejects_after.0) > total(&rejects_before.0));
    let s = flows(&client, &s, "after the checks, data still flowing");

    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= s.verified, "{:?}", fin.json);
}

/// Ask `server_vcmp` (as a location server) from the attacker where the
/// owner of `owner_vir` (in its connection with `other_vir`) is, under
/// `locator`: the records of its LOOKUP_R, if any came back.
fn lookup_from(
    attacker: &Netns,
    from: IpAddr,
    server_vcmp: SocketAddr,
    (owner_vir, other_vir): (SocketAddr, SocketAddr),
    locator: [u8; 16],
) -> Vec<Record> {
    let rec = Record {
        command: Kind::Lookup,
        proto: Proto::Tcp,
        receiver_vir: owner_vir,
        sender_vir: other_vir,
        sender_phys: SocketAddr::new(from, other_vir.port()),
        ext: Ext::Locator(locator),
        seq: 1,
        tag: junk(4242),
    };
    let id = 0x5eed_0001;
    let q = Message::Records {
        kind: Kind::Lookup,
        request_id: id,
        family: Family::V4,
        records: vec![rec],
    }
    .encode()
    .unwrap();
    attacker.run_in(|| {
        let sock = UdpSocket::bind(SocketAddr::new(from, 0)).expect("attacker's socket");
        sock.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        sock.send_to(&q, server_vcmp).expect("sending LOOKUP");
        let mut buf = [0u8; 2048];
        match sock.recv_from(&mut buf) {
            Ok((n, _)) => match Message::decode(&buf[..n]) {
                Ok(Message::Records {
                    kind: Kind::LookupR,
                    request_id,
                    records,
                    ..
                }) if request_id == id => records,
                other => panic!("unexpected answer to LOOKUP: {other:?}"),
            },
            Err(e) => panic!("no answer to the LOOKUP from {server_vcmp}: {e}"),
        }
    })
}

/// A location server keeps locations under a locator only the
/// connection's two ends can compute, and must not let forged records push
/// out the genuine one. Here the server's vnatd, a location server for the
/// laptop's connection, does not tell an attacker who asks by the
/// connection's addresses where the laptop is; the attacker then learns
/// the locator as an on-path host would (from the laptop's STORE, captured
/// at the router), which answers the genuine location (control); it STOREs
/// forged records with high sequence numbers under that locator, and
/// after the next move the genuine location must still be among the
/// answers. (Before 859b0d1 the store kept the highest sequence numbers of
/// unauthenticated records: the forgeries evicted the genuine location and
/// the laptop's next STORE was refused.)
#[test]
fn forged_stores_do_not_crowd_out_the_genuine_location() {
    let tag = "fsto";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let (attacker, attacker_ip) = attach_attacker(&topo, &format!("{tag}-a"));
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let server_vcmp = SocketAddr::new(topo.server_addr.v4.into(), VCMP_PORT);
    let _echo = EchoServer::tcp_in(&srv, server);
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());
    attacker.wait_reachable(topo.server_addr.v4.into(), Duration::from_secs(5));
    let mut cmd = StreamOptions::tcp(server)
        .rate(300_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");
    let laptop_virtual: SocketAddr = before.local.parse().unwrap();
    let lv = before.local.as_str();
    let at_b = SocketAddr::new(topo.laptop_b_addr.v4.into(), laptop_virtual.port());
    thread::sleep(Duration::from_secs(2));

    // Control: a genuine move stores the laptop's location at the server.
    let sniff = Pcap::start(
        &topo.router,
        &topo.router_if_c,
        &format!("udp port {VCMP_PORT}"),
    );
    topo.move_laptop_to_b();
    let s = flows(&client, &before, "moved to B");
    wait_mapping(
        &srvd,
        lv,
        ("translated", &server.to_string(), &at_b.to_string()),
        "server after the move to B",
    );
    let conn = (laptop_virtual, server);
    let guessed = lookup_from(&attacker, attacker_ip, server_vcmp, conn, junk(31));
    assert!(
        !guessed.iter().any(|r| r.sender_phys == at_b),
        "an attacker who knows only the connection's addresses found the laptop: {guessed:?}"
    );
    thread::sleep(Duration::from_secs(1));
    let sniffed = sniff.stop();
    eprintln!(
        "forged: VCMP at the router during the first move: {:?}",
        sniffed
            .iter()
            .map(|d| (d.src, d.dst, kind_of(&d.payload)))
            .collect::<Vec<_>>()
    );
    let locator = sniffed
        .iter()
        .filter(|d| d.dst == server_vcmp && kind_of(&d.payload) == Some(Kind::Store))
        .filter_map(|d| match Message::decode(&d.payload) {
            Ok(Message::Records { records, .. }) => records.first().map(|r| r.ext),
            _ => None,
        })
        .find_map(|e| match e {
            Ext::Locator(l) => Some(l),
            _ => None,
        })
        .expect("the laptop's STORE at the server was captured");
    let found = lookup_from(&attacker, attacker_ip, server_vcmp, conn, locator);
    eprintln!("forged: LOOKUP after the first move: {found:?}");
    assert!(
        found.iter().any(|r| r.sender_phys == at_b),
        "the server's location store does not return the laptop's genuine location even without forgeries: {found:?}"
    );
    thread::sleep(Duration::from_secs(2));
    topo.move_laptop_to_a();
    let s = flows(&client, &s, "moved back to A");
    wait_mapping(
        &srvd,
        lv,
        ("native", &server.to_string(), lv),
        "server after moving back to A",
    );

    // Forged STOREs for the laptop's end of the connection.
    let forged: Vec<Vec<u8>> = [
        u64::MAX,
        u64::MAX - 1,
        u64::MAX - 2,
        u64::MAX - 3,
        1 << 40,
        1 << 41,
    ]
    .into_iter()
    .enumerate()
    .map(|(i, seq)| {
        let rec = Record {
            command: Kind::Store,
            proto: Proto::Tcp,
            receiver_vir: server,
            sender_vir: laptop_virtual,
            sender_phys: SocketAddr::new(attacker_ip, laptop_virtual.port()),
            ext: Ext::Locator(locator),
            seq,
            tag: junk(900 + i as u64),
        };
        Message::Records {
            kind: Kind::Store,
            request_id: 77 + i as u32,
            family: Family::V4,
            records: vec![rec],
        }
        .encode()
        .unwrap()
    })
    .collect();
    send_from(&attacker, attacker_ip, server_vcmp, &forged);
    thread::sleep(Duration::from_secs(2));

    let capture = Pcap::start(
        &topo.router,
        &topo.router_if_c,
        &format!("udp port {VCMP_PORT}"),
    );
    topo.move_laptop_to_b();
    let s = flows(&client, &s, "moved to B again");
    wait_mapping(
        &srvd,
        lv,
        ("translated", &server.to_string(), &at_b.to_string()),
        "server after the second move",
    );
    thread::sleep(Duration::from_secs(1));
    let store_r: Vec<u8> = capture
        .stop()
        .iter()
        .filter(|d| d.src == server_vcmp && kind_of(&d.payload) == Some(Kind::StoreR))
        .map(|d| d.payload[3])
        .collect();
    let found = lookup_from(&attacker, attacker_ip, server_vcmp, conn, locator);
    eprintln!("forged: STORE_R accepted counts during the second move: {store_r:?}; LOOKUP now: {found:?}");
    assert!(
        found.iter().any(|r| r.sender_phys == at_b),
        "forged STOREs pushed the laptop's genuine location out of the server's location store \
         (STORE_R accepted counts to the laptop during the move: {store_r:?}); a LOOKUP returns only {found:?}"
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= s.verified, "{:?}", fin.json);
}
