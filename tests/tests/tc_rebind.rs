//! The datapath half of a peer moving behind a NAT (DESIGN.md section 3,
//! "learning a NAT's new mapping"), run by the kernel on crafted packets
//! through BPF_PROG_TEST_RUN. The server's vnatd cannot know the port the
//! laptop's new NAT chose. A TCP connection learns it in the ingress
//! translator from the laptop's TCP BIND: a pure ACK from the NAT's public
//! address (named by the laptop's authenticated update) to the
//! connection's port, carrying an option with a token that vnatd gave the
//! tc program (`vnat_common::TCP_BIND_OPT`). The translator then installs
//! both translations itself and drops the BIND. Nothing else teaches the
//! port (issue 31, item 5): a segment with the connection's very sequence
//! numbers, which a host sharing the NAT may know or guess, does not.
//!
//! A UDP flow learns nothing in tc: see the UDP test below.

mod support;

use std::net::SocketAddr;

use support::packet::{parse_checked, Spec};
use support::{counter, run};
use vnat_common::{
    RebindKey, RebindValue, AF_INET, BIND_HEAD, BIND_LEN, PROTO_TCP, PROTO_UDP, TCP_BIND_OPT,
};
use vnat_daemon::datapath::{
    kernel::{KernelDatapath, KernelOptions},
    Datapath, Proto, Translation, VirtualFlow,
};
use vnat_tests::BpffsDir;

/// The translators' verdict for a packet that goes on: TC_ACT_UNSPEC (-1,
/// "next"), so that a program after vnat's on the same hook still runs.
const PASS: u32 = -1i32 as u32;

/// The server's end, the laptop's old NAT endpoint (what the server's
/// socket names the peer), and the new NAT's public address.
const SERVER: &str = "198.18.3.2:5001";
const OLD_NAT: &str = "198.18.3.101:40000";
const NEW_NAT_IP: [u8; 4] = [198, 18, 3, 102];

/// The token vnatd gave the tc program for the rebinding connection.
const TOKEN: [u8; 8] = [0x5a, 1, 2, 3, 4, 5, 6, 0xa5];

fn words(a: SocketAddr) -> [u32; 4] {
    match a {
        SocketAddr::V4(v4) => [u32::from_ne_bytes(v4.ip().octets()), 0, 0, 0],
        SocketAddr::V6(_) => panic!("IPv4 only here"),
    }
}

fn key() -> RebindKey {
    let server: SocketAddr = SERVER.parse().unwrap();
    RebindKey {
        src_addr_be: [u32::from_ne_bytes(NEW_NAT_IP), 0, 0, 0],
        dst_addr_be: words(server),
        dst_port_be: server.port().to_be(),
        family: AF_INET,
        proto: PROTO_TCP,
        slot: 0,
        _pad: [0; 3],
    }
}

/// The connection's entry, with [`TOKEN`] expected.
fn value() -> RebindValue {
    let (server, old): (SocketAddr, SocketAddr) =
        (SERVER.parse().unwrap(), OLD_NAT.parse().unwrap());
    RebindValue {
        virt_remote_addr_be: words(old),
        virt_local_addr_be: words(server),
        virt_remote_port_be: old.port().to_be(),
        virt_local_port_be: server.port().to_be(),
        token: words8(TOKEN),
        token_prev: [0; 2],
        redirect_ifindex: 0,
        flags: 0,
        refusals: 0,
    }
}

/// A token as the entry holds it: two words in memory order.
fn words8(t: [u8; 8]) -> [u32; 2] {
    [
        u32::from_ne_bytes([t[0], t[1], t[2], t[3]]),
        u32::from_ne_bytes([t[4], t[5], t[6], t[7]]),
    ]
}

/// A TCP BIND with `token` from `src` to the server, as the laptop's vnatd
/// sends it: a pure ACK whose only option is the BIND's.
fn tcp_bind(src: &str, token: [u8; 8]) -> Vec<u8> {
    let mut s = Spec::tcp(src, SERVER);
    s.tcp_flags = 0x10;
    s.payload.clear();
    s.tcp_options = TCP_BIND_OPT.iter().chain(token.iter()).copied().collect();
    s.frame()
}

/// The server's tc ingress verdict for a packet it drops.
const SHOT: u32 = 2;

#[test]
fn the_laptops_tcp_bind_teaches_its_port() {
    let pins = BpffsDir::new("tc-rebind");
    let mut dp = KernelDatapath::open(&KernelOptions {
        bpffs: pins.path().to_path_buf(),
        cgroups: vec![],
        tc_attach: vnat_tests::harness::tc_attach(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    })
    .unwrap_or_else(|e| panic!("opening the kernel datapath: {e}"));
    dp.insert_rebind(key(), value()).unwrap();
    let new_nat = |port: u16| format!("198.18.3.102:{port}");

    // From another address: not the flow's, untouched, nothing learned.
    let other = Spec::tcp("198.18.3.103:61000", SERVER).frame();
    let out = run(&dp, false, &other);
    assert_eq!((out.verdict, &out.packet), (PASS, &other));
    assert!(dp.rebind_pending(&key()).unwrap());

    // The laptop's data before its BIND: dropped (the server's kernel
    // would answer it with a reset), nothing learned; its TCP sends again.
    let early = Spec::tcp(&new_nat(61000), SERVER).frame();
    let out = run(&dp, false, &early);
    assert_eq!(out.verdict, SHOT, "a segment before the BIND must wait");
    assert_eq!(counter(&dp, "drop_rebinding"), 1);
    assert!(dp.rebind_pending(&key()).unwrap());

    // A BIND with another token (a guess): dropped, refused, not learned.
    let out = run(&dp, false, &tcp_bind(&new_nat(61000), [9; 8]));
    assert_eq!(out.verdict, SHOT);
    assert_eq!(counter(&dp, "rebind_refused"), 1);
    assert_eq!(counter(&dp, "rebind_learned"), 0);
    assert!(dp.rebind_pending(&key()).unwrap());

    // The laptop's BIND through its new NAT: learned, and dropped (it
    // carries nothing for the socket).
    let out = run(&dp, false, &tcp_bind(&new_nat(61000), TOKEN));
    assert_eq!(out.verdict, SHOT);
    assert_eq!(counter(&dp, "rebind_learned"), 1);
    assert!(
        !dp.rebind_pending(&key()).unwrap(),
        "learned once, then gone"
    );

    // The laptop's segments now reach the socket as its old peer's.
    let first = Spec::tcp(&new_nat(61000), SERVER);
    let out = run(&dp, false, &first.frame());
    assert_eq!(out.verdict, PASS);
    let p = parse_checked(&out.packet);
    assert_eq!(
        (p.src, p.dst),
        (OLD_NAT.parse().unwrap(), SERVER.parse().unwrap()),
        "the laptop's segment must reach the socket as its old peer's"
    );
    assert_eq!(p.payload, first.payload);

    // The server's replies now go to the new NAT port.
    let reply = Spec::tcp(SERVER, OLD_NAT);
    let out = run(&dp, true, &reply.frame());
    assert_eq!(out.verdict, PASS);
    let p = parse_checked(&out.packet);
    assert_eq!(
        (p.src, p.dst),
        (SERVER.parse().unwrap(), new_nat(61000).parse().unwrap())
    );

    // Nothing more is learned: a BIND from another port of the NAT (even
    // with the token, seen on the wire) finds no rebinding flow.
    let late = tcp_bind(&new_nat(62000), TOKEN);
    let out = run(&dp, false, &late);
    assert_eq!((out.verdict, &out.packet), (PASS, &late));
    assert_eq!(counter(&dp, "rebind_learned"), 1);

    // vnatd's view takes the learned translation in.
    assert_eq!(dp.sync_learned().unwrap(), 2);
    assert_eq!(
        dp.translations().unwrap(),
        vec![Translation {
            flow: VirtualFlow {
                proto: Proto::Tcp,
                local: SERVER.parse().unwrap(),
                remote: OLD_NAT.parse().unwrap(),
            },
            physical_local: SERVER.parse().unwrap(),
            physical_remote: new_nat(61000).parse().unwrap(),
        }]
    );
}

/// Issue 31, item 5: a host behind the same NAT that knows the moved
/// connection's sequence numbers (or guessed them) sends segments that
/// carry them exactly, as the laptop's own would: before TCP BINDs,
/// the first such acknowledging segment taught the connection its port and
/// the neighbour captured the connection. Now none teaches anything.
#[test]
fn a_segment_with_the_connections_own_numbers_teaches_nothing() {
    let (dp, _pins) = rebinding("tc-rebind-nums");
    // `Spec`'s segments carry the numbers an earlier entry's windows were
    // built around (what `the_first_in_window_packet_from_the_nat_teaches_
    // its_port` asserted was learned): PSH|ACK with data, a pure ACK, and
    // the same with the token's option but another token.
    let mut pure = Spec::tcp("198.18.3.102:61000", SERVER);
    pure.tcp_flags = 0x10;
    pure.payload.clear();
    for (frame, what) in [
        (
            Spec::tcp("198.18.3.102:61000", SERVER).frame(),
            "a data segment",
        ),
        (pure.frame(), "a pure ACK"),
        (
            tcp_bind("198.18.3.102:61000", [0; 8]),
            "a BIND with a zero token",
        ),
    ] {
        let out = run(&dp, false, &frame);
        assert_eq!(
            out.verdict, SHOT,
            "{what} from the NAT must be dropped while the connection waits for its BIND"
        );
        assert_eq!(
            counter(&dp, "rebind_learned"),
            0,
            "{what} taught the connection its port"
        );
    }
    assert!(dp.rebind_pending(&key()).unwrap());
}

/// A UDP flow whose peer moved behind a new NAT: a datagram proves nothing
/// (anyone behind that NAT can send one), so the flow learns its port only
/// from the peer's authenticated BIND, which vnatd checks. Until then a
/// datagram from the NAT's address to the flow's port is dropped (counted),
/// unless a recorded flow owns it (another host behind the same NAT), and
/// a BIND is diverted to vnatd's VCMP port with the flow's port written in
/// it, only while vnatd asks for that.
#[test]
fn udp_waits_for_the_bind_and_binds_are_diverted_to_vnatd() {
    let pins = BpffsDir::new("tc-rebind-udp");
    let mut dp = KernelDatapath::open(&KernelOptions {
        bpffs: pins.path().to_path_buf(),
        cgroups: vec![],
        tc_attach: vnat_tests::harness::tc_attach(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    })
    .unwrap_or_else(|e| panic!("opening the kernel datapath: {e}"));
    let udp_key = RebindKey {
        proto: PROTO_UDP,
        ..key()
    };
    dp.insert_rebind(
        udp_key,
        RebindValue {
            token: [0; 2],
            token_prev: [0; 2],
            ..value()
        },
    )
    .unwrap();
    const TC_ACT_SHOT: u32 = 2;

    // The peer's datagram on the new path: dropped, nothing learned.
    let first = Spec::udp("198.18.3.102:61000", SERVER).frame();
    let out = run(&dp, false, &first);
    assert_eq!(out.verdict, TC_ACT_SHOT);
    assert_eq!(counter(&dp, "drop_rebinding"), 1);
    assert_eq!(counter(&dp, "rebind_learned"), 0);
    assert!(dp.rebind_pending(&udp_key).unwrap());

    // Another host's recorded flow from the same NAT address: passed.
    let neighbour: SocketAddr = "198.18.3.102:61001".parse().unwrap();
    let server: SocketAddr = SERVER.parse().unwrap();
    dp.insert_conn_record(
        vnat_daemon::datapath::flow_key(Proto::Udp, server, neighbour),
        Default::default(),
    )
    .unwrap();
    let theirs = Spec::udp("198.18.3.102:61001", SERVER).frame();
    let out = run(&dp, false, &theirs);
    assert_eq!((out.verdict, &out.packet), (PASS, &theirs));

    // A BIND, before vnatd asks for BINDs: no different from a datagram.
    let mut bind = Spec::udp("198.18.3.102:61000", SERVER);
    bind.payload = vec![0x5a; BIND_LEN];
    bind.payload[..8].copy_from_slice(&[BIND_HEAD[0], BIND_HEAD[1], 0, 0, b'v', b'n', b'a', b't']);
    let out = run(&dp, false, &bind.frame());
    assert_eq!(out.verdict, TC_ACT_SHOT);
    assert_eq!(counter(&dp, "drop_rebinding"), 2);

    // Once asked: diverted to the VCMP port, the flow's port written into
    // bytes 2..4, the checksum still right (parse_checked), nothing else
    // changed.
    dp.set_bind_divert_port(2031).unwrap();
    let out = run(&dp, false, &bind.frame());
    assert_eq!(out.verdict, PASS);
    let p = parse_checked(&out.packet);
    assert_eq!(p.dst, "198.18.3.2:2031".parse().unwrap());
    assert_eq!(p.src, "198.18.3.102:61000".parse().unwrap());
    let mut expected = bind.payload.clone();
    expected[2..4].copy_from_slice(&5001u16.to_be_bytes());
    assert_eq!(p.payload, expected);
    assert_eq!(counter(&dp, "bind_diverted"), 1);

    // A BIND sent to the VCMP port itself: dropped, so the flow port in a
    // BIND that reaches vnatd is always the divert's, never the sender's.
    let mut direct = Spec::udp("198.18.3.102:61000", "198.18.3.2:2031");
    direct.payload = bind.payload.clone();
    direct.payload[2..4].copy_from_slice(&5001u16.to_be_bytes());
    let out = run(&dp, false, &direct.frame());
    assert_eq!(out.verdict, TC_ACT_SHOT);
    assert_eq!(counter(&dp, "drop_bind_direct"), 1);

    // A neighbour's flow to a wildcard-bound socket (recorded under
    // 0.0.0.0): passed too.
    let wild: SocketAddr = "0.0.0.0:5001".parse().unwrap();
    dp.insert_conn_record(
        vnat_daemon::datapath::flow_key(Proto::Udp, wild, "198.18.3.102:61002".parse().unwrap()),
        Default::default(),
    )
    .unwrap();
    let theirs = Spec::udp("198.18.3.102:61002", SERVER).frame();
    let out = run(&dp, false, &theirs);
    assert_eq!((out.verdict, &out.packet), (PASS, &theirs));

    // Application datagrams of that length that are not BINDs stay
    // application datagrams (here: dropped as the rebinding flow's).
    let mut lookalike = bind.clone();
    lookalike.payload[4] = b'V';
    let out = run(&dp, false, &lookalike.frame());
    assert_eq!(out.verdict, TC_ACT_SHOT);
    assert_eq!(counter(&dp, "bind_diverted"), 1);
    assert!(
        dp.rebind_pending(&udp_key).unwrap(),
        "nothing learned in tc"
    );
}

/// A datapath with the TCP rebind of `key()` / `value()` waiting.
fn rebinding(tag: &str) -> (KernelDatapath, BpffsDir) {
    let pins = BpffsDir::new(tag);
    let mut dp = KernelDatapath::open(&KernelOptions {
        bpffs: pins.path().to_path_buf(),
        cgroups: vec![],
        tc_attach: vnat_tests::harness::tc_attach(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    })
    .unwrap_or_else(|e| panic!("opening the kernel datapath: {e}"));
    dp.insert_rebind(key(), value()).unwrap();
    (dp, pins)
}

/// Another host behind the same NAT with its own recorded connection to the
/// same server port (issue 31, item 5): its segments, in the moved flow's
/// window or not, are its own connection's, and never teach the moved flow
/// its port.
#[test]
fn a_recorded_connections_segments_are_never_learned() {
    let (mut dp, _pins) = rebinding("tc-rebind-rec");
    let neighbour: SocketAddr = "198.18.3.102:61001".parse().unwrap();
    let server: SocketAddr = SERVER.parse().unwrap();
    dp.insert_conn_record(
        vnat_daemon::datapath::flow_key(Proto::Tcp, server, neighbour),
        Default::default(),
    )
    .unwrap();
    let theirs = Spec::tcp("198.18.3.102:61001", SERVER).frame();
    let out = run(&dp, false, &theirs);
    assert_eq!(
        (out.verdict, &out.packet),
        (PASS, &theirs),
        "a recorded connection's segment was taken for the rebinding flow's"
    );
    assert_eq!(counter(&dp, "rebind_learned"), 0);
    assert_eq!(counter(&dp, "rebind_refused"), 0, "not a refusal either");
    assert!(dp.rebind_pending(&key()).unwrap());
}

/// While the connection waits for its BIND, a SYN from behind the NAT is a
/// new connection's (another host's, or the laptop's own) and goes on;
/// any other segment from there that no recorded connection owns is
/// dropped, and none teaches the port.
#[test]
fn a_syn_from_behind_the_nat_goes_on_and_other_segments_wait() {
    let (dp, _pins) = rebinding("tc-rebind-ack");
    const FLAGS_AT: usize = 14 + 20 + 13;
    let mut syn = Spec::tcp("198.18.3.102:61000", SERVER);
    syn.tcp_flags = 0x02;
    syn.payload.clear();
    let f = syn.frame();
    let out = run(&dp, false, &f);
    assert_eq!((out.verdict, &out.packet), (PASS, &f), "a SYN must go on");
    for (flags, what) in [
        (0x14u8, "a RST"),
        (0x12, "a SYN-ACK"),
        (0x08, "a PSH without ACK"),
    ] {
        let mut s = Spec::tcp("198.18.3.102:61000", SERVER);
        s.tcp_flags = flags;
        let f = s.frame();
        assert_eq!(f[FLAGS_AT], flags);
        let out = run(&dp, false, &f);
        assert_eq!(out.verdict, SHOT, "{what} must wait for the BIND");
    }
    assert_eq!(counter(&dp, "rebind_learned"), 0);
    assert!(dp.rebind_pending(&key()).unwrap());
}

/// A guesser gets a few tries per rebinding flow, not one per packet: after
/// `vnat_common::REBIND_MAX_REFUSALS` BINDs with wrong tokens the flow
/// stops learning, and even the right token teaches nothing.
#[test]
fn learning_stops_after_a_few_refusals() {
    let (dp, _pins) = rebinding("tc-rebind-stop");
    for i in 0..32u8 {
        let out = run(
            &dp,
            false,
            &tcp_bind("198.18.3.102:61000", [i, 0x77, 0, 0, 0, 0, 0, 1]),
        );
        assert_eq!(out.verdict, SHOT);
    }
    assert!(counter(&dp, "rebind_refused") >= 8);
    let out = run(&dp, false, &tcp_bind("198.18.3.102:61000", TOKEN));
    assert_eq!(out.verdict, SHOT);
    assert_eq!(
        counter(&dp, "rebind_learned"),
        0,
        "the token was taken after 32 refused guesses"
    );
    assert!(counter(&dp, "rebind_stopped") >= 1);
}

/// An entry whose token is not set yet takes no BIND (the laptop's may come
/// before vnatd wrote it: the laptop sends it again at the SWITCHED), and
/// the token of the request before the newest is taken too (its BIND may
/// still be on its way when vnatd asks again).
#[test]
fn an_unset_token_takes_nothing_and_the_previous_one_is_taken() {
    let (mut dp, _pins) = rebinding("tc-rebind-prev");
    let mut v = value();
    v.token = [0; 2];
    dp.insert_rebind(key(), v).unwrap();
    let out = run(&dp, false, &tcp_bind("198.18.3.102:61000", TOKEN));
    assert_eq!(out.verdict, SHOT);
    assert_eq!(counter(&dp, "rebind_learned"), 0);
    let mut v = value();
    v.token_prev = v.token;
    v.token = words8([7; 8]);
    dp.insert_rebind(key(), v).unwrap();
    let out = run(&dp, false, &tcp_bind("198.18.3.102:61000", TOKEN));
    assert_eq!(out.verdict, SHOT);
    assert_eq!(counter(&dp, "rebind_learned"), 1);
    assert!(!dp.rebind_pending(&key()).unwrap());
}
