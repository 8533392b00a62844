//! An IPv4 connection carried over IPv6 (its host moved to a network where
//! it has only IPv6): the tc translators, run by the kernel on crafted
//! packets through BPF_PROG_TEST_RUN, turn the socket's IPv4 packets into
//! IPv6 ones between the hosts' IPv6 addresses and the peer's IPv6 packets
//! back into the connection's IPv4 ones, TCP and UDP, with every checksum
//! right when recomputed from scratch and the header's other fields
//! (length, hop limit or TTL, traffic class) carried over; what cannot be
//! carried (UDP over IPv4 without a checksum, IPv4 options, an ICMP error
//! about such a flow) is dropped and counted.

mod support;

use std::net::SocketAddr;

use support::packet::{icmp_error, parse_checked, Spec, ETH_HLEN};
use support::{counter, run};
use vnat_daemon::datapath::{
    kernel::{pair_for, KernelDatapath, KernelOptions},
    Proto, Translation, VirtualFlow,
};
use vnat_tests::BpffsDir;

const PASS: u32 = -1i32 as u32;
const TC_ACT_SHOT: u32 = 2;
const TC_ACT_REDIRECT: u32 = 7;

struct Fixture {
    dp: KernelDatapath,
    _pins: BpffsDir,
}

fn fixture(tag: &str) -> Fixture {
    let pins = BpffsDir::new(tag);
    let dp = KernelDatapath::open(&KernelOptions {
        bpffs: pins.path().to_path_buf(),
        cgroups: vec![],
        tc_attach: vnat_tests::harness::tc_attach(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    })
    .unwrap_or_else(|e| panic!("opening the kernel datapath: {e}"));
    Fixture { dp, _pins: pins }
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// The laptop's IPv4 connection (198.18.1.2 to the server's 198.18.3.2)
/// after the laptop moved to a network where it has only fd00:5e:2::2; the
/// server's IPv6 address is fd00:5e:3::2. `proto`'s ports; the laptop's
/// physical port `lport` (a UDP flow's may change, as behind a NAT).
fn laptop_on_v6(proto: Proto, lport: u16) -> Translation {
    Translation {
        flow: VirtualFlow {
            proto,
            local: addr("198.18.1.2:40000"),
            remote: addr("198.18.3.2:5001"),
        },
        physical_local: SocketAddr::new("fd00:5e:2::2".parse().unwrap(), lport),
        physical_remote: addr("[fd00:5e:3::2]:5001"),
    }
}

/// The header fields a translation carries over, read from a frame.
#[derive(Debug, PartialEq, Eq)]
struct Header {
    ethertype: u16,
    /// TTL or hop limit.
    ttl: u8,
    /// TOS or traffic class.
    tos: u8,
    /// The IP header's own idea of the packet's length (IPv4 total
    /// length, IPv6 payload length + 40), to hold against the frame's.
    ip_len: usize,
}

fn header(f: &[u8]) -> Header {
    let ethertype = u16::from_be_bytes([f[12], f[13]]);
    let h = &f[ETH_HLEN..];
    match ethertype {
        0x0800 => Header {
            ethertype,
            ttl: h[8],
            tos: h[1],
            ip_len: usize::from(u16::from_be_bytes([h[2], h[3]])),
        },
        0x86DD => Header {
            ethertype,
            ttl: h[7],
            tos: (h[0] << 4) | (h[1] >> 4),
            ip_len: usize::from(u16::from_be_bytes([h[4], h[5]])) + 40,
        },
        other => panic!("unexpected ethertype {other:#x}"),
    }
}

/// Set a crafted frame's TOS or traffic class (and fix the IPv4 header
/// checksum), so that carrying it over is seen.
fn set_tos(f: &mut [u8], tos: u8) {
    let h = &mut f[ETH_HLEN..];
    if h[0] >> 4 == 4 {
        h[1] = tos;
        h[10] = 0;
        h[11] = 0;
        let mut sum: u32 = h[..20]
            .chunks(2)
            .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
            .sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    } else {
        h[0] = 0x60 | (tos >> 4);
        h[1] = (h[1] & 0x0f) | (tos << 4);
    }
}

/// Run `spec` (with TOS `tos`) through egress or ingress and check the
/// verdict, the checksums, the payload and the carried-over fields.
fn translate(f: &Fixture, egress: bool, spec: &Spec, want: u32) -> support::packet::Parsed {
    let mut frame = spec.frame();
    set_tos(&mut frame, 0xb8);
    let before = header(&frame);
    let out = run(&f.dp, egress, &frame);
    assert_eq!(out.verdict, want, "verdict");
    let p = parse_checked(&out.packet);
    assert_eq!(p.payload, spec.payload, "payload changed");
    let after = header(&out.packet);
    assert_eq!(after.ip_len, out.packet.len() - ETH_HLEN, "IP length field");
    assert_eq!((after.ttl, after.tos), (before.ttl, before.tos));
    assert_ne!(after.ethertype, before.ethertype, "the IP version stayed");
    p
}

#[test]
fn ipv4_tcp_leaves_as_ipv6_and_comes_back_as_ipv4() {
    let mut f = fixture("tc-fam-tcp");
    let t = laptop_on_v6(Proto::Tcp, 40000);
    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let out = translate(
        &f,
        true,
        &Spec::tcp("198.18.1.2:40000", "198.18.3.2:5001"),
        PASS,
    );
    assert_eq!((out.src, out.dst), (t.physical_local, t.physical_remote));
    let back = translate(
        &f,
        false,
        &Spec::tcp("[fd00:5e:3::2]:5001", "[fd00:5e:2::2]:40000"),
        PASS,
    );
    assert_eq!((back.src, back.dst), (t.flow.remote, t.flow.local));
    assert_eq!(counter(&f.dp, "family_translated"), 2);
    assert_eq!(counter(&f.dp, "egress_translated"), 1);
    assert_eq!(counter(&f.dp, "ingress_translated"), 1);
}

#[test]
fn ipv4_udp_with_a_new_port_both_ways() {
    let mut f = fixture("tc-fam-udp");
    let t = laptop_on_v6(Proto::Udp, 41234);
    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let out = translate(
        &f,
        true,
        &Spec::udp("198.18.1.2:40000", "198.18.3.2:5001"),
        PASS,
    );
    assert_eq!((out.src, out.dst), (t.physical_local, t.physical_remote));
    assert!(!out.udp_csum_zero);
    let back = translate(
        &f,
        false,
        &Spec::udp("[fd00:5e:3::2]:5001", "[fd00:5e:2::2]:41234"),
        PASS,
    );
    assert_eq!((back.src, back.dst), (t.flow.remote, t.flow.local));
    assert_eq!(counter(&f.dp, "family_translated"), 2);
}

/// The server's end of the same connection: its socket's IPv4 packets to
/// the laptop's old address leave as IPv6 to the laptop's new one, sent
/// out again with the IPv6 next hop resolved (the IPv4 route's may be
/// another's).
#[test]
fn the_peer_end_redirects_after_changing_the_family() {
    let mut f = fixture("tc-fam-redir");
    let t = Translation {
        flow: VirtualFlow {
            proto: Proto::Tcp,
            local: addr("198.18.3.2:5001"),
            remote: addr("198.18.1.2:40000"),
        },
        physical_local: addr("[fd00:5e:3::2]:5001"),
        physical_remote: addr("[fd00:5e:2::2]:40000"),
    };
    f.dp.insert_nat_pair(&pair_for(&t, 1, vnat_common::NAT_F_REDIRECT))
        .unwrap();
    let out = translate(
        &f,
        true,
        &Spec::tcp("198.18.3.2:5001", "198.18.1.2:40000"),
        TC_ACT_REDIRECT,
    );
    assert_eq!((out.src, out.dst), (t.physical_local, t.physical_remote));
    assert_eq!(counter(&f.dp, "egress_redirected"), 1);
}

#[test]
fn udp_without_checksum_is_dropped_and_counted() {
    let mut f = fixture("tc-fam-udp0");
    let t = laptop_on_v6(Proto::Udp, 40000);
    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let mut spec = Spec::udp("198.18.1.2:40000", "198.18.3.2:5001");
    spec.udp_zero_csum = true;
    let out = run(&f.dp, true, &spec.frame());
    assert_eq!(out.verdict, TC_ACT_SHOT);
    assert_eq!(counter(&f.dp, "drop_udp_zero_csum"), 1);
    assert_eq!(counter(&f.dp, "family_translated"), 0);
}

#[test]
fn ipv4_options_and_fragments_are_dropped_and_counted() {
    let mut f = fixture("tc-fam-opts");
    let t = laptop_on_v6(Proto::Tcp, 40000);
    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let mut spec = Spec::tcp("198.18.1.2:40000", "198.18.3.2:5001");
    spec.ip_options = vec![1, 1, 1, 0];
    assert_eq!(run(&f.dp, true, &spec.frame()).verdict, TC_ACT_SHOT);
    let mut frag = Spec::tcp("198.18.1.2:40000", "198.18.3.2:5001");
    // A first fragment: "more fragments" set, offset 0.
    frag.frag_offset = 0x2000;
    assert_eq!(run(&f.dp, true, &frag.frame()).verdict, TC_ACT_SHOT);
    assert_eq!(counter(&f.dp, "drop_family_untranslatable"), 2);
}

/// An ICMPv6 error about the flow's IPv6 packets is not taken for one of
/// the family the flow's entry does not describe: dropped and counted,
/// never rewritten with the entry's IPv4 addresses.
#[test]
fn icmp_errors_about_such_a_flow_are_dropped_and_counted() {
    let mut f = fixture("tc-fam-icmp");
    let t = laptop_on_v6(Proto::Tcp, 40000);
    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    // A router's "packet too big" about the laptop's IPv6 packet.
    let quoted = Spec::tcp("[fd00:5e:2::2]:40000", "[fd00:5e:3::2]:5001");
    let err = icmp_error(
        "fd00:5e:2::1".parse().unwrap(),
        "fd00:5e:2::2".parse().unwrap(),
        2,
        0,
        1280,
        &quoted,
    );
    assert_eq!(run(&f.dp, false, &err).verdict, TC_ACT_SHOT);
    assert_eq!(counter(&f.dp, "drop_icmp_family"), 1);
}
