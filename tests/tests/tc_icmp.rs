//! ICMP errors about translated flows (issue 31, item 8), run by the kernel
//! on crafted packets through BPF_PROG_TEST_RUN.
//!
//! Before, the tc translators passed every ICMP packet untouched. After a
//! move, a router's "fragmentation needed" or "packet too big" about a
//! flow's packet quotes the packet as it was on the wire (physical
//! endpoints), which no local socket has: the kernel dropped it, and
//! path-MTU discovery stopped working for moved flows. The other way, the
//! kernel's own errors about a translated flow's packets (port unreachable,
//! time exceeded) went out naming the virtual endpoints, the old address
//! the move was meant to leave behind. Now both are translated: the outer
//! addresses that are the flow's, and the quoted header (addresses, ports),
//! with every checksum kept right (checked here from scratch: the outer
//! header's, the ICMP message's, the quoted IP header's and, the quote
//! being whole, the quoted TCP or UDP checksum).

mod support;

use std::net::IpAddr;

use support::packet::{icmp_error, parse_icmp_checked, Spec};
use support::{counter, run};
use vnat_daemon::datapath::{kernel::pair_for, Proto, Translation, VirtualFlow};

const PASS: u32 = -1i32 as u32;

use support::open_datapath as open;

/// A flow whose both ends moved, ports too.
fn moved(proto: Proto, vl: &str, vr: &str, pl: &str, pr: &str) -> Translation {
    Translation {
        flow: VirtualFlow {
            proto,
            local: vl.parse().unwrap(),
            remote: vr.parse().unwrap(),
        },
        physical_local: pl.parse().unwrap(),
        physical_remote: pr.parse().unwrap(),
    }
}

/// A short packet of `t`'s flow from `src` to `dst`, so that an error can
/// quote it whole.
fn quoted(t: &Translation, src: std::net::SocketAddr, dst: std::net::SocketAddr) -> Spec {
    let mut s = match t.flow.proto {
        Proto::Tcp => Spec::tcp(&src.to_string(), &dst.to_string()),
        Proto::Udp => Spec::udp(&src.to_string(), &dst.to_string()),
    };
    s.payload = (0..24).collect();
    s
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn errors_are_translated_both_ways(tag: &str, t: &Translation, router: IpAddr, v6: bool) {
    let (mut dp, _pins) = open(tag);
    dp.insert_nat_pair(&pair_for(t, 1, 0)).unwrap();
    let (pl, pr, vl, vr) = (
        t.physical_local,
        t.physical_remote,
        t.flow.local,
        t.flow.remote,
    );
    // ICMPv4 3/4 "fragmentation needed", ICMPv6 2 "packet too big"; 3/3
    // and 1/4 "port unreachable"; 11/0 and 3/0 "time exceeded".
    let (too_big, unreachable, exceeded) = if v6 {
        ((2, 0), (1, 4), (3, 0))
    } else {
        ((3, 4), (3, 3), (11, 0))
    };

    // In, from a router on the new path, about a packet we sent (as it was
    // on the wire): to the socket as its own packet.
    let wire = quoted(t, pl, pr);
    let f = icmp_error(router, pl.ip(), too_big.0, too_big.1, 1280, &wire);
    let r = run(&dp, false, &f);
    assert_eq!(r.verdict, PASS);
    let p = parse_icmp_checked(&r.packet);
    assert_eq!(
        (p.src, p.dst, p.inner.src, p.inner.dst),
        (router, vl.ip(), vl, vr),
        "a 'too big' about a moved flow's packet did not reach its socket's endpoints"
    );
    assert_eq!((p.typ, p.code, p.rest), (too_big.0, too_big.1, 1280));
    assert_eq!(p.inner.payload, wire.payload);

    // In, from the peer itself: its address is the virtual one too.
    let f = icmp_error(pr.ip(), pl.ip(), exceeded.0, exceeded.1, 0, &wire);
    let p = parse_icmp_checked(&run(&dp, false, &f).packet);
    assert_eq!(
        (p.src, p.dst, p.inner.src, p.inner.dst),
        (vr.ip(), vl.ip(), vl, vr)
    );

    // Out, the kernel's error about a packet it received translated (as the
    // stack saw it): on the wire with the physical endpoints only.
    let seen = quoted(t, vr, vl);
    let f = icmp_error(vl.ip(), vr.ip(), unreachable.0, unreachable.1, 0, &seen);
    let r = run(&dp, true, &f);
    assert_eq!(r.verdict, PASS);
    let p = parse_icmp_checked(&r.packet);
    assert_eq!(
        (p.src, p.dst, p.inner.src, p.inner.dst),
        (pl.ip(), pr.ip(), pr, pl),
        "the kernel's ICMP error left naming the virtual endpoints"
    );
    assert_eq!(p.inner.payload, seen.payload);
    assert_eq!(counter(&dp, "icmp_translated"), 3);

    // Errors about other flows, and ICMP that is no error: untouched.
    let stranger = if v6 { "[fd00:99::9]:9" } else { "198.18.9.9:9" };
    let other = quoted(t, pl, stranger.parse().unwrap());
    let f = icmp_error(router, pl.ip(), too_big.0, too_big.1, 1280, &other);
    let r = run(&dp, false, &f);
    assert_eq!((r.verdict, &r.packet), (PASS, &f));
    let echo = if v6 { 128 } else { 8 };
    let f = icmp_error(router, pl.ip(), echo, 0, 0x0001_0001, &wire);
    let r = run(&dp, false, &f);
    assert_eq!(
        (r.verdict, &r.packet),
        (PASS, &f),
        "an echo request was changed"
    );
    assert_eq!(counter(&dp, "icmp_translated"), 3);
}

#[test]
fn icmpv4_errors_of_a_moved_tcp_flow_are_translated() {
    let t = moved(
        Proto::Tcp,
        "198.18.1.2:40000",
        "198.18.3.2:5001",
        "198.18.2.2:41000",
        "198.18.4.9:6001",
    );
    errors_are_translated_both_ways("tc-icmp4t", &t, ip("198.18.2.1"), false);
}

#[test]
fn icmpv4_errors_of_a_moved_udp_flow_are_translated() {
    let t = moved(
        Proto::Udp,
        "198.18.1.2:5353",
        "198.18.3.2:53",
        "198.18.2.7:6000",
        "198.18.3.2:53",
    );
    errors_are_translated_both_ways("tc-icmp4u", &t, ip("198.18.2.1"), false);
}

#[test]
fn icmpv6_errors_of_a_moved_udp_flow_are_translated() {
    let t = moved(
        Proto::Udp,
        "[fd00:5e:1::2]:40000",
        "[fd00:5e:3::2]:5001",
        "[fd00:5e:2::2]:41000",
        "[fd00:5e:4::9]:6001",
    );
    errors_are_translated_both_ways("tc-icmp6u", &t, ip("fd00:5e:2::1"), true);
}

#[test]
fn icmpv6_errors_of_a_moved_tcp_flow_are_translated() {
    let t = moved(
        Proto::Tcp,
        "[fd00:5e:1::2]:40000",
        "[fd00:5e:3::2]:22",
        "[fd00:5e:2::2]:40000",
        "[fd00:5e:3::2]:22",
    );
    errors_are_translated_both_ways("tc-icmp6t", &t, ip("fd00:5e:2::1"), true);
}
