//! IPv6 extension headers in the tc translators (issue 31, item 8), run by
//! the kernel on crafted packets through BPF_PROG_TEST_RUN. Before, any
//! extension header made the parser give up and pass the packet untouched:
//! a moved flow's packets with a destination-options header went out with
//! the virtual addresses, a BIND sent straight to vnatd's VCMP port escaped
//! its drop (so its sender chose the flow port vnatd reads from it), and a
//! rebinding flow's datagrams escaped theirs. Now the common headers
//! (hop-by-hop, routing, destination options, fragment, AH) are walked
//! with a bounded loop, and an incoming chain longer than the bound is
//! dropped rather than passed unseen.

mod support;

use std::net::SocketAddr;

use support::packet::{ip6_opts, parse_checked, Spec};
use support::{counter, run};
use vnat_common::{RebindKey, RebindValue, AF_INET6, BIND_HEAD, BIND_LEN, PROTO_UDP};
use vnat_daemon::datapath::{kernel::pair_for, Proto, Translation, VirtualFlow};

/// TC_ACT_UNSPEC ("next"), TC_ACT_SHOT.
const PASS: u32 = -1i32 as u32;
const TC_ACT_SHOT: u32 = 2;

const HOP_BY_HOP: u8 = 0;
const ROUTING: u8 = 43;
const FRAGMENT: u8 = 44;
const DEST_OPTS: u8 = 60;

use support::open_datapath as open;

/// The laptop's connection after it moved from fd00:5e:1::2 to fd00:5e:2::2.
fn moved(proto: Proto) -> Translation {
    Translation {
        flow: VirtualFlow {
            proto,
            local: "[fd00:5e:1::2]:40000".parse().unwrap(),
            remote: "[fd00:5e:3::2]:5001".parse().unwrap(),
        },
        physical_local: "[fd00:5e:2::2]:40000".parse().unwrap(),
        physical_remote: "[fd00:5e:3::2]:5001".parse().unwrap(),
    }
}

/// A routing header of type 0 with no segments left: walked, not acted on.
fn routing() -> Vec<u8> {
    let mut h = vec![0u8; 8];
    h[2] = 0; // routing type
    h[3] = 0; // segments left
    h
}

/// A fragment header: offset in 8-byte units, more fragments, id.
fn fragment(offset: u16, more: bool, id: u32) -> Vec<u8> {
    let mut h = vec![0u8; 8];
    h[2..4].copy_from_slice(&((offset << 3) | u16::from(more)).to_be_bytes());
    h[4..8].copy_from_slice(&id.to_be_bytes());
    h
}

#[test]
fn a_moved_flow_is_translated_behind_extension_headers() {
    let (mut dp, _pins) = open("tc-ext-tr");
    let t = moved(Proto::Tcp);
    dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();

    // Out: hop-by-hop, routing and destination options before TCP.
    let mut out = Spec::tcp("[fd00:5e:1::2]:40000", "[fd00:5e:3::2]:5001");
    out.ip6_ext = vec![
        (HOP_BY_HOP, ip6_opts(1)),
        (ROUTING, routing()),
        (DEST_OPTS, ip6_opts(2)),
    ];
    let frame = out.frame();
    let r = run(&dp, true, &frame);
    assert_eq!(r.verdict, PASS);
    let p = parse_checked(&r.packet);
    assert_eq!(
        (p.src, p.dst),
        (t.physical_local, t.physical_remote),
        "a packet with extension headers left with its virtual endpoints"
    );
    assert_eq!(p.payload, out.payload);
    // The headers themselves are untouched (same length, same bytes).
    assert_eq!(r.packet.len(), frame.len());
    assert_eq!(
        r.packet[14 + 40..14 + 40 + 32],
        frame[14 + 40..14 + 40 + 32]
    );
    assert_eq!(counter(&dp, "egress_translated"), 1);

    // In: a destination-options header, then TCP.
    let mut back = Spec::tcp("[fd00:5e:3::2]:5001", "[fd00:5e:2::2]:40000");
    back.ip6_ext = vec![(DEST_OPTS, ip6_opts(1))];
    let r = run(&dp, false, &back.frame());
    assert_eq!(r.verdict, PASS);
    let p = parse_checked(&r.packet);
    assert_eq!((p.src, p.dst), (t.flow.remote, t.flow.local));
    assert_eq!(counter(&dp, "ingress_translated"), 1);
}

#[test]
fn fragments_behind_a_destination_options_header_follow_their_flow() {
    let (mut dp, _pins) = open("tc-ext-frag");
    let t = moved(Proto::Udp);
    dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let src = "[fd00:5e:1::2]:40000";
    let dst = "[fd00:5e:3::2]:5001";

    // The first fragment: destination options, then the fragment header,
    // then the UDP header. Its checksum covers the whole datagram, so it is
    // not checked here; the addresses and ports are.
    let mut first = Spec::udp(src, dst);
    first.ip6_ext = vec![(DEST_OPTS, ip6_opts(1)), (FRAGMENT, fragment(0, true, 77))];
    let r = run(&dp, true, &first.frame());
    assert_eq!(r.verdict, PASS);
    let l4 = 14 + 40 + 8 + 8;
    let addr = |at: usize| -> std::net::Ipv6Addr {
        <[u8; 16]>::try_from(&r.packet[at..at + 16]).unwrap().into()
    };
    assert_eq!(std::net::IpAddr::V6(addr(14 + 8)), t.physical_local.ip());
    assert_eq!(
        u16::from_be_bytes([r.packet[l4], r.packet[l4 + 1]]),
        t.physical_local.port()
    );

    // A later fragment of it, behind the same header: translated by the
    // first fragment's flow.
    let mut later = Spec::udp(src, dst);
    later.ip6_ext = vec![
        (DEST_OPTS, ip6_opts(1)),
        (FRAGMENT, fragment(185, false, 77)),
    ];
    let r = run(&dp, true, &later.frame());
    assert_eq!(r.verdict, PASS);
    let addr = |at: usize| -> std::net::Ipv6Addr {
        <[u8; 16]>::try_from(&r.packet[at..at + 16]).unwrap().into()
    };
    assert_eq!(std::net::IpAddr::V6(addr(14 + 8)), t.physical_local.ip());
    assert_eq!(counter(&dp, "fragment_translated"), 1);
}

/// A BIND-shaped datagram (see `vnat_common::BIND_LEN`) from `src` to `dst`.
fn bind(src: &str, dst: &str, flow_port: u16) -> Spec {
    let mut b = Spec::udp(src, dst);
    b.payload = vec![0x5a; BIND_LEN];
    let fp = flow_port.to_be_bytes();
    b.payload[..8].copy_from_slice(&[
        BIND_HEAD[0],
        BIND_HEAD[1],
        fp[0],
        fp[1],
        b'v',
        b'n',
        b'a',
        b't',
    ]);
    b
}

#[test]
fn extension_headers_do_not_let_a_bind_or_a_rebinding_datagram_through() {
    let (mut dp, _pins) = open("tc-ext-bind");
    dp.set_bind_divert_port(2031).unwrap();
    let server: SocketAddr = "[fd00:5e:3::2]:5001".parse().unwrap();
    let words = |a: SocketAddr| match a.ip() {
        std::net::IpAddr::V6(v6) => {
            let o = v6.octets();
            core::array::from_fn(|i| u32::from_ne_bytes(o[i * 4..i * 4 + 4].try_into().unwrap()))
        }
        _ => unreachable!(),
    };
    let nat: SocketAddr = "[fd00:5e:4::66]:0".parse().unwrap();
    let old: SocketAddr = "[fd00:5e:4::65]:40000".parse().unwrap();
    let key = RebindKey {
        src_addr_be: words(nat),
        dst_addr_be: words(server),
        dst_port_be: server.port().to_be(),
        family: AF_INET6,
        proto: PROTO_UDP,
        slot: 0,
        _pad: [0; 3],
    };
    dp.insert_rebind(
        key,
        RebindValue {
            virt_remote_addr_be: words(old),
            virt_local_addr_be: words(server),
            virt_remote_port_be: old.port().to_be(),
            virt_local_port_be: server.port().to_be(),
            token: [0; 2],
            token_prev: [0; 2],
            ..Default::default()
        },
    )
    .unwrap();

    // A BIND straight to the VCMP port, its flow port chosen by its
    // sender, behind a hop-by-hop header: dropped like one without.
    let mut direct = bind("[fd00:5e:4::66]:61000", "[fd00:5e:3::2]:2031", 5001);
    direct.ip6_ext = vec![(HOP_BY_HOP, ip6_opts(1))];
    let r = run(&dp, false, &direct.frame());
    assert_eq!(
        r.verdict, TC_ACT_SHOT,
        "a BIND sent to the VCMP port behind a hop-by-hop header reached vnatd"
    );
    assert_eq!(counter(&dp, "drop_bind_direct"), 1);

    // A datagram from the rebinding flow's new NAT address to its port,
    // behind a destination-options header: dropped like one without.
    let mut dgram = Spec::udp("[fd00:5e:4::66]:61000", "[fd00:5e:3::2]:5001");
    dgram.ip6_ext = vec![(DEST_OPTS, ip6_opts(1))];
    let r = run(&dp, false, &dgram.frame());
    assert_eq!(r.verdict, TC_ACT_SHOT);
    assert_eq!(counter(&dp, "drop_rebinding"), 1);

    // A BIND on the flow's port behind an extension header: diverted to
    // the VCMP port with the flow's port written in, checksum right.
    let mut onflow = bind("[fd00:5e:4::66]:61000", "[fd00:5e:3::2]:5001", 0);
    onflow.ip6_ext = vec![(DEST_OPTS, ip6_opts(1))];
    let r = run(&dp, false, &onflow.frame());
    assert_eq!(r.verdict, PASS);
    let p = parse_checked(&r.packet);
    assert_eq!(p.dst, "[fd00:5e:3::2]:2031".parse().unwrap());
    assert_eq!(&p.payload[2..4], &5001u16.to_be_bytes());
    assert_eq!(counter(&dp, "bind_diverted"), 1);

    // A chain longer than the parser walks: what it hides cannot be told,
    // so it is dropped on the way in (counted), and passed on the way out.
    let mut long = Spec::udp("[fd00:5e:4::66]:61000", "[fd00:5e:3::2]:2031");
    long.ip6_ext = (0..9).map(|_| (DEST_OPTS, ip6_opts(1))).collect();
    let r = run(&dp, false, &long.frame());
    assert_eq!(
        r.verdict, TC_ACT_SHOT,
        "an over-long chain was passed unseen"
    );
    assert_eq!(counter(&dp, "drop_ipv6_exthdr"), 1);
    let mut long_out = Spec::udp("[fd00:5e:3::2]:5001", "[fd00:5e:4::66]:61000");
    long_out.ip6_ext = (0..9).map(|_| (DEST_OPTS, ip6_opts(1))).collect();
    let frame = long_out.frame();
    let r = run(&dp, true, &frame);
    assert_eq!((r.verdict, &r.packet), (PASS, &frame));
}
