//! The NAT guard (`vnat_common::natguard`, issue 32 item 2), run by the
//! kernel on crafted packets through BPF_PROG_TEST_RUN: a connection whose
//! peer sits behind a NAT that may re-map it (a reboot, a carrier-grade NAT
//! re-mapping an idle flow). After a re-map the peer's packets come from
//! the NAT's address and an unknown port; our kernel would reset such a TCP
//! segment and give such a UDP datagram to the application as a new
//! peer's. The guard drops them (counted, and reported to vnatd, which asks
//! the peer for a BIND), and nothing else: what the kernel has a socket
//! for, a SYN, a recorded flow, another port of ours, go on. A host sharing
//! the NAT that sends whatever it likes teaches nothing: only a BIND with
//! the token vnatd wrote does, and only while vnatd asked for one.
//!
//! The peer's NAT address here is 127.0.0.1, the server's port a real
//! listener's there, so that the guard's socket lookup (run in the test's
//! own namespace) finds real sockets.

mod support;

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use support::packet::{icmp_error, Spec};
use support::{counter, run};
use vnat_common::{RebindKey, RebindValue, AF_INET, PROTO_TCP, TCP_BIND_OPT};
use vnat_daemon::datapath::{
    kernel::{KernelDatapath, KernelOptions},
    Datapath, GuardDrop, Proto, Translation, VirtualFlow,
};
use vnat_tests::BpffsDir;

const PASS: u32 = -1i32 as u32;
const SHOT: u32 = 2;
const NAT: &str = "127.0.0.1";

use support::open_datapath as open;

/// A real server on 127.0.0.1 and one connection to it (the peer's, as
/// the NAT mapped it): (server, the peer's mapped endpoint, the sockets).
fn server_with_a_connection() -> (SocketAddr, SocketAddr, TcpListener, TcpStream, TcpStream) {
    let listener = TcpListener::bind((NAT, 0)).expect("listen on 127.0.0.1");
    let server = listener.local_addr().unwrap();
    let client = TcpStream::connect(server).expect("connect");
    let (accepted, _) = listener.accept().expect("accept");
    let peer = client.local_addr().unwrap();
    (server, peer, listener, client, accepted)
}

fn flow(proto: Proto, server: SocketAddr, peer: SocketAddr) -> VirtualFlow {
    VirtualFlow {
        proto,
        local: server,
        remote: peer,
    }
}

fn nat() -> IpAddr {
    NAT.parse().unwrap()
}

/// A port of 127.0.0.1 no socket uses (a client port just released).
fn free_port() -> u16 {
    let l = TcpListener::bind((NAT, 0)).unwrap();
    l.local_addr().unwrap().port()
}

fn tcp_bind(src: SocketAddr, dst: SocketAddr, token: [u8; 8]) -> Vec<u8> {
    let mut s = Spec::tcp(&src.to_string(), &dst.to_string());
    s.tcp_flags = 0x10;
    s.payload.clear();
    s.tcp_options = TCP_BIND_OPT.iter().chain(token.iter()).copied().collect();
    s.frame()
}

/// A TCP rebind waiting for `peer`'s BIND with `token` at `server` (as
/// vnatd writes it after its BIND_REQ); returns its key.
fn rebind_waiting(
    dp: &mut KernelDatapath,
    peer: SocketAddr,
    server: SocketAddr,
    token: [u8; 8],
) -> RebindKey {
    let words = |a: SocketAddr| match a {
        SocketAddr::V4(v4) => [u32::from_ne_bytes(v4.ip().octets()), 0, 0, 0],
        SocketAddr::V6(_) => unreachable!("IPv4 here"),
    };
    let key = RebindKey {
        src_addr_be: words(peer),
        dst_addr_be: words(server),
        dst_port_be: server.port().to_be(),
        family: AF_INET,
        proto: PROTO_TCP,
        slot: 0,
        _pad: [0; 3],
    };
    dp.insert_rebind(
        key,
        RebindValue {
            virt_remote_addr_be: words(peer),
            virt_local_addr_be: words(server),
            virt_remote_port_be: peer.port().to_be(),
            virt_local_port_be: server.port().to_be(),
            token: [
                u32::from_ne_bytes([token[0], token[1], token[2], token[3]]),
                u32::from_ne_bytes([token[4], token[5], token[6], token[7]]),
            ],
            token_prev: [0; 2],
            redirect_ifindex: 0,
            flags: 0,
            refusals: 0,
        },
    )
    .unwrap();
    key
}

#[test]
fn a_tcp_guard_drops_only_what_the_kernel_would_reset() {
    let (mut dp, _pins) = open("tc-guard-tcp");
    let (server, peer, _l, mut client, mut accepted) = server_with_a_connection();
    dp.insert_guard(&flow(Proto::Tcp, server, peer), nat())
        .unwrap();
    let remapped: SocketAddr = SocketAddr::new(nat(), free_port());

    // The connection's own segments (the kernel has its socket): on.
    let own = Spec::tcp(&peer.to_string(), &server.to_string()).frame();
    let out = run(&dp, false, &own);
    assert_eq!((out.verdict, &out.packet), (PASS, &own));
    assert_eq!(dp.nat_guard_drops().unwrap(), vec![]);

    // The same connection re-mapped by the NAT: our kernel has only the
    // listener for it and would reset it. Dropped, counted, reported once.
    let moved = Spec::tcp(&remapped.to_string(), &server.to_string()).frame();
    let out = run(&dp, false, &moved);
    assert_eq!(
        out.verdict, SHOT,
        "a segment the kernel would reset must be dropped"
    );
    assert_eq!(counter(&dp, "drop_nat_guard"), 1);
    assert_eq!(
        dp.nat_guard_drops().unwrap(),
        vec![GuardDrop {
            nat: nat(),
            local: server,
            proto: Proto::Tcp,
        }]
    );
    assert_eq!(dp.nat_guard_drops().unwrap(), vec![], "reported once");

    // A new connection from behind the NAT (a SYN), and a reset: the
    // kernel's business.
    let mut syn = Spec::tcp(&remapped.to_string(), &server.to_string());
    syn.tcp_flags = 0x02;
    syn.payload.clear();
    let f = syn.frame();
    assert_eq!(run(&dp, false, &f).verdict, PASS, "a SYN must go on");
    let mut rst = Spec::tcp(&remapped.to_string(), &server.to_string());
    rst.tcp_flags = 0x14;
    rst.payload.clear();
    assert_eq!(run(&dp, false, &rst.frame()).verdict, PASS);

    // Another connection from behind the NAT, not accepted (nor recorded)
    // yet: the kernel has its socket, so its segments go on.
    let second = TcpStream::connect(server).expect("second connect");
    let second_ep = second.local_addr().unwrap();
    let mut ack = Spec::tcp(&second_ep.to_string(), &server.to_string());
    ack.tcp_flags = 0x10;
    ack.payload.clear();
    let f = ack.frame();
    assert_eq!(
        run(&dp, false, &f).verdict,
        PASS,
        "another connection's segment must go on"
    );

    // Another port of ours: not guarded.
    let other: SocketAddr = SocketAddr::new(nat(), free_port());
    let f = Spec::tcp(&remapped.to_string(), &other.to_string()).frame();
    assert_eq!(run(&dp, false, &f).verdict, PASS);

    // A host behind the NAT sends in-window data and TCP BINDs with made-up
    // tokens from the unknown port: dropped, and nothing is learned (no
    // rebind is waiting; only vnatd starts one, and only the peer's BIND
    // with its token ends it).
    for frame in [
        Spec::tcp(&remapped.to_string(), &server.to_string()).frame(),
        tcp_bind(remapped, server, [7; 8]),
        tcp_bind(remapped, server, [0; 8]),
    ] {
        assert_eq!(run(&dp, false, &frame).verdict, SHOT);
    }
    assert_eq!(counter(&dp, "rebind_learned"), 0);
    assert_eq!(
        dp.translations().unwrap(),
        vec![],
        "a guard teaches nothing"
    );
    assert_eq!(dp.sync_learned().unwrap(), 0);

    // And the real connection still works (nothing reached its sockets).
    client.write_all(b"ping").unwrap();
    let mut buf = [0u8; 4];
    accepted
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    accepted.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"ping");
}

#[test]
fn a_udp_guard_holds_an_unknown_port_for_a_few_seconds_then_lets_it_through() {
    let (mut dp, _pins) = open("tc-guard-udp");
    let server: SocketAddr = SocketAddr::new(nat(), 5353);
    let peer: SocketAddr = SocketAddr::new(nat(), 40000);
    dp.insert_guard(&flow(Proto::Udp, server, peer), nat())
        .unwrap();
    // The flow as the server's recorders know it: its datagrams go on.
    dp.insert_conn_record(
        vnat_daemon::datapath::flow_key(Proto::Udp, server, peer),
        Default::default(),
    )
    .unwrap();
    let own = Spec::udp(&peer.to_string(), &server.to_string()).frame();
    assert_eq!(run(&dp, false, &own).verdict, PASS);

    // The flow re-mapped (or a stranger's new flow: the same datagram):
    // held, and reported.
    let a = Spec::udp("127.0.0.1:41000", &server.to_string()).frame();
    let b = Spec::udp("127.0.0.1:41001", &server.to_string()).frame();
    let held_at = std::time::Instant::now();
    assert_eq!(run(&dp, false, &a).verdict, SHOT);
    assert_eq!(run(&dp, false, &a).verdict, SHOT);
    // Another unknown port just after: held too. A NAT that forgot its
    // mappings re-maps every flow at once, and two datagrams of one flow
    // racing through its conntrack can each get a mapping; the flow may
    // go on from the second (`nat_remap`'s UDP flow reached the server's
    // application as a new peer's so, about one loaded run in thirty).
    assert_eq!(
        run(&dp, false, &b).verdict,
        SHOT,
        "a second re-mapped port right after the first must be held too"
    );
    assert_eq!(counter(&dp, "drop_nat_guard"), 3);
    assert_eq!(dp.nat_guard_drops().unwrap().len(), 1);

    // Later in the hold, another port goes on: one hold at a time, so
    // that a spoofer cannot keep other hosts' new flows out (review).
    let all = Duration::from_nanos(vnat_common::GUARD_UDP_ALL_NS);
    std::thread::sleep(all + Duration::from_millis(100));
    assert_eq!(
        run(&dp, false, &b).verdict,
        PASS,
        "another port must not wait behind the held one for its whole hold"
    );
    assert_eq!(
        run(&dp, false, &a).verdict,
        SHOT,
        "the held port is still held"
    );
    assert!(
        held_at.elapsed() < Duration::from_nanos(vnat_common::GUARD_UDP_HOLD_NS),
        "the machine was too slow for this check"
    );

    // Nobody claimed it with a BIND within the hold: another host's flow,
    // let through for good, with nothing learned.
    std::thread::sleep(
        Duration::from_nanos(vnat_common::GUARD_UDP_HOLD_NS).saturating_sub(held_at.elapsed())
            + Duration::from_millis(200),
    );
    assert_eq!(run(&dp, false, &a).verdict, PASS, "held without end");
    assert_eq!(run(&dp, false, &a).verdict, PASS);
    assert_eq!(counter(&dp, "nat_guard_released"), 1);
    assert_eq!(dp.translations().unwrap(), vec![]);
}

/// A NAT that forgot a UDP flow's mapping answers what our socket sends to
/// the old one itself, with "port unreachable" (a Linux router does), and
/// a connected UDP socket ends on that (ECONNREFUSED) before the peer's
/// next datagram, from the new mapping, lets vnatd rebind the flow
/// (`nat_remap`'s UDP tests lost their server's socket so under load).
/// Where a guard stands the error is dropped and reported like a held
/// datagram; an error from a router on the path, of another kind, about
/// TCP or about a port without a guard goes on.
fn the_nats_port_unreachable_is_dropped(tag: &str, nat: IpAddr, router: IpAddr, v6: bool) {
    let (mut dp, _pins) = open(tag);
    let server = SocketAddr::new(nat, 5353);
    let peer = SocketAddr::new(nat, 40000);
    dp.insert_guard(&flow(Proto::Udp, server, peer), nat)
        .unwrap();
    // (type, code): port unreachable, and "fragmentation needed" / "packet
    // too big" (a path MTU's).
    let (unreachable, too_big) = if v6 {
        ((1, 4), (2, 0))
    } else {
        ((3, 3), (3, 4))
    };
    let ours = Spec::udp(&server.to_string(), &peer.to_string());

    let f = icmp_error(nat, server.ip(), unreachable.0, unreachable.1, 0, &ours);
    assert_eq!(
        run(&dp, false, &f).verdict,
        SHOT,
        "the NAT's port unreachable would end the flow's socket"
    );
    assert_eq!(counter(&dp, "drop_nat_guard"), 1);
    assert_eq!(
        dp.nat_guard_drops().unwrap(),
        vec![GuardDrop {
            nat,
            local: server,
            proto: Proto::Udp
        }],
        "vnatd is not told to ask the peer for its BIND"
    );

    let passes = |f: &[u8], why: &str| {
        let out = run(&dp, false, f);
        assert_eq!((out.verdict, &out.packet[..]), (PASS, f), "{why}");
    };
    passes(
        &icmp_error(router, server.ip(), unreachable.0, unreachable.1, 0, &ours),
        "a router's error is about the path, not a forgotten mapping",
    );
    passes(
        &icmp_error(nat, server.ip(), too_big.0, too_big.1, 1280, &ours),
        "a path MTU's error must reach the socket",
    );
    let tcp = Spec::tcp(&server.to_string(), &peer.to_string());
    passes(
        &icmp_error(nat, server.ip(), unreachable.0, unreachable.1, 0, &tcp),
        "a TCP guard's business is the NAT's reset",
    );
    let other_port = Spec::udp(&SocketAddr::new(nat, 5354).to_string(), &peer.to_string());
    passes(
        &icmp_error(
            nat,
            server.ip(),
            unreachable.0,
            unreachable.1,
            0,
            &other_port,
        ),
        "a port without a guard",
    );
    assert_eq!(counter(&dp, "drop_nat_guard"), 1);
}

#[test]
fn a_udp_guard_drops_the_nats_own_port_unreachable() {
    the_nats_port_unreachable_is_dropped(
        "tc-guard-icmp",
        nat(),
        "198.18.9.9".parse().unwrap(),
        false,
    );
}

#[test]
fn a_udp_guard_drops_the_nats_own_icmpv6_port_unreachable() {
    the_nats_port_unreachable_is_dropped(
        "tc-guard-icmp6",
        "fd00:99::1".parse().unwrap(),
        "fd00:99::9".parse().unwrap(),
        true,
    );
}

/// After a suspected re-map vnatd asks the peer for its TCP BIND; a NAT
/// that kept the mapping brings it on the recorded 4-tuple: the rebind
/// ends with nothing to learn (`rebind_unchanged`), and the BIND, a pure
/// ACK for the socket's past, is dropped. A BIND with another token on
/// that tuple is the recorded connection's segment, as before.
#[test]
fn a_tcp_bind_on_the_recorded_tuple_says_the_port_is_unchanged() {
    let (mut dp, _pins) = open("tc-guard-same");
    let server: SocketAddr = "198.18.3.2:5001".parse().unwrap();
    let peer: SocketAddr = "198.18.3.101:40000".parse().unwrap();
    let token = [0x5a, 1, 2, 3, 4, 5, 6, 0xa5];
    let key = rebind_waiting(&mut dp, peer, server, token);
    dp.insert_conn_record(
        vnat_daemon::datapath::flow_key(Proto::Tcp, server, peer),
        Default::default(),
    )
    .unwrap();
    let wrong = tcp_bind(peer, server, [9; 8]);
    let out = run(&dp, false, &wrong);
    assert_eq!((out.verdict, &out.packet), (PASS, &wrong));
    assert!(dp.rebind_pending(&key).unwrap());
    assert_eq!(
        run(&dp, false, &tcp_bind(peer, server, token)).verdict,
        SHOT
    );
    assert_eq!(counter(&dp, "rebind_unchanged"), 1);
    assert!(!dp.rebind_pending(&key).unwrap(), "the rebind must end");
    assert_eq!(counter(&dp, "rebind_learned"), 0);
    assert_eq!(dp.translations().unwrap(), vec![]);
}

/// While a TCP connection waits for its peer's BIND (a move behind a new
/// NAT, or a re-map the guard suspected, which any host behind the NAT can
/// provoke), other hosts behind the same NAT still connect to the port:
/// the last ACK of their handshake, which our kernel has a socket for but
/// sock_ops has not recorded yet, goes on. The moved peer's own segments
/// from its unknown port (the kernel has only the listener) still wait.
#[test]
fn a_rebind_lets_other_hosts_behind_the_nat_connect() {
    let (mut dp, _pins) = open("tc-guard-rebind-others");
    let (server, peer, _l, _client, _accepted) = server_with_a_connection();
    let key = rebind_waiting(
        &mut dp,
        peer,
        server,
        [0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0],
    );
    // Another host's connection, established in our kernel, not accepted
    // nor recorded: its ACK goes on.
    let second = TcpStream::connect(server).expect("second connect");
    let mut ack = Spec::tcp(
        &second.local_addr().unwrap().to_string(),
        &server.to_string(),
    );
    ack.tcp_flags = 0x10;
    ack.payload.clear();
    assert_eq!(
        run(&dp, false, &ack.frame()).verdict,
        PASS,
        "another host's connection behind the NAT must complete while a rebind waits"
    );
    // The moved peer's data from a port our kernel has no socket for:
    // dropped until its BIND (the kernel would reset it).
    let unknown = SocketAddr::new(nat(), free_port());
    let f = Spec::tcp(&unknown.to_string(), &server.to_string()).frame();
    assert_eq!(run(&dp, false, &f).verdict, SHOT);
    assert!(dp.rebind_pending(&key).unwrap(), "nothing was learned");
}

/// A rebind that ends (its flow placed or gone) while a guard stands
/// leaves the guard working: the translators look past a miss only while
/// the config says something is rebinding or guarded, and the end of the
/// last rebind cleared that, leaving every guard inert. Rebinding routes
/// to the NAT and attaches tc there: in a namespace of its own, the NAT
/// beyond a veth.
#[test]
fn a_guard_keeps_working_after_the_last_rebind_ends() {
    beyond_a_veth("tcguardrb", guard_after_rebind_body);
}

/// Run `body` in a namespace of its own where 10.99.0.1 is ours and the
/// NAT, 10.99.0.2, lies beyond a veth: a rebind and an install route
/// there and attach tc to that interface, not to the host's.
fn beyond_a_veth(tag: &str, body: fn()) {
    let ns = vnat_tests::Netns::new(tag);
    for cmd in [
        "ip link add g0 type veth peer name g1",
        "ip addr add 10.99.0.1/24 dev g0",
        "ip link set g0 up",
        "ip link set g1 up",
    ] {
        ns.run(&cmd.split(' ').collect::<Vec<_>>());
    }
    ns.run_in(body);
}

/// The same for a rebind: the last translation removed while a UDP flow
/// waits for its BIND (its peer moved behind a NAT) used to mark the NAT
/// maps empty, and the translators then passed everything unparsed: the
/// peer's datagrams from its new port reached the application as a new
/// peer's instead of waiting for the BIND.
#[test]
fn a_rebind_keeps_working_after_the_last_translation_goes() {
    beyond_a_veth("tcrbempty", rebind_after_removal_body);
}

fn rebind_after_removal_body() {
    let (mut dp, _pins) = open("tc-rebind-empty");
    let nat: IpAddr = "10.99.0.2".parse().unwrap();
    let server: SocketAddr = "10.99.0.1:5353".parse().unwrap();
    let waiting = flow(Proto::Udp, server, SocketAddr::new(nat, 40000));
    dp.install_translation(&Translation {
        flow: waiting,
        physical_local: server,
        physical_remote: SocketAddr::new(nat, 0),
    })
    .expect("rebinding the flow");
    // Another connection's peer moved, then it closed.
    let other = Translation {
        flow: flow(
            Proto::Udp,
            "10.99.0.1:5354".parse().unwrap(),
            SocketAddr::new(nat, 40001),
        ),
        physical_local: "10.99.0.1:5354".parse().unwrap(),
        physical_remote: SocketAddr::new(nat, 40002),
    };
    dp.install_translation(&other)
        .expect("the other translation");
    dp.remove_translation(&other.flow)
        .expect("removing the other translation");

    let stranger = Spec::udp("10.99.0.2:41000", &server.to_string()).frame();
    assert_eq!(
        run(&dp, false, &stranger).verdict,
        SHOT,
        "a datagram for the rebinding flow's port passed before its BIND"
    );
    assert_eq!(counter(&dp, "drop_rebinding"), 1);
}

fn guard_after_rebind_body() {
    let (mut dp, _pins) = open("tc-guard-rebind-end");
    let nat: IpAddr = "10.99.0.2".parse().unwrap();
    let server: SocketAddr = "10.99.0.1:5353".parse().unwrap();
    dp.insert_guard(&flow(Proto::Udp, server, SocketAddr::new(nat, 40000)), nat)
        .unwrap();
    // Another flow from behind that NAT rebinds (its peer moved behind it),
    // then goes: the last rebind ends.
    let other = flow(
        Proto::Udp,
        "10.99.0.1:5354".parse().unwrap(),
        SocketAddr::new(nat, 40001),
    );
    dp.install_translation(&Translation {
        flow: other,
        physical_local: other.local,
        physical_remote: SocketAddr::new(nat, 0),
    })
    .expect("rebinding the other flow");
    let _ = dp.remove_translation(&other);

    let remapped = Spec::udp("10.99.0.2:41000", &server.to_string()).frame();
    assert_eq!(
        run(&dp, false, &remapped).verdict,
        SHOT,
        "the guard no longer holds a re-mapped datagram once the last rebind ended"
    );
    assert_eq!(counter(&dp, "drop_nat_guard"), 1);
}

/// A vnatd that stops leaves its guards pinned; the next one removes them
/// at open and guards again the connections its core names, so a guard of
/// a connection that closed meanwhile holds no stranger's flow for good.
#[test]
fn guards_left_by_a_previous_vnatd_are_removed_at_open() {
    let pins = BpffsDir::new("tc-guard-left");
    let opts = KernelOptions {
        bpffs: pins.path().to_path_buf(),
        cgroups: vec![],
        tc_attach: vnat_tests::harness::tc_attach(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    };
    let server: SocketAddr = SocketAddr::new(nat(), 5353);
    let stranger = Spec::udp("127.0.0.1:41000", &server.to_string()).frame();
    {
        let mut dp = KernelDatapath::open(&opts).unwrap();
        dp.insert_guard(
            &flow(Proto::Udp, server, SocketAddr::new(nat(), 40000)),
            nat(),
        )
        .unwrap();
        assert_eq!(run(&dp, false, &stranger).verdict, SHOT);
    }
    let mut dp = KernelDatapath::open(&opts).unwrap();
    // Something else keeps the translators looking (a rebind elsewhere).
    dp.insert_guard(
        &flow(
            Proto::Udp,
            SocketAddr::new(nat(), 5354),
            SocketAddr::new(nat(), 40000),
        ),
        nat(),
    )
    .unwrap();
    assert_eq!(
        run(&dp, false, &stranger).verdict,
        PASS,
        "a guard the previous vnatd left still holds datagrams"
    );
}
