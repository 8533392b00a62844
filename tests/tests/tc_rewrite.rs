//! The tc translators, run by the kernel on crafted packets through
//! BPF_PROG_TEST_RUN: addresses and ports rewritten, checksums correct when
//! recomputed from scratch, non-matching packets untouched, and the verdict
//! the program returns is the one it computed.

mod support;

use support::packet::{parse_checked, Spec};
use support::{counter, run};
use vnat_daemon::datapath::{
    kernel::{pair_for, KernelDatapath, KernelOptions},
    Datapath, Proto, Translation, VirtualFlow,
};
use vnat_tests::BpffsDir;

/// The translators' verdict for a packet that goes on: TC_ACT_UNSPEC (-1,
/// "next"), so that a program after vnat's on the same hook still runs.
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

fn translation(proto: Proto, vl: &str, vr: &str, pl: &str, pr: &str) -> Translation {
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

/// The laptop's TCP connection to the server after the laptop moved from
/// 198.18.1.2 to 198.18.2.2 (the translation most tests use).
fn laptop_moved() -> Translation {
    translation(
        Proto::Tcp,
        "198.18.1.2:40000",
        "198.18.3.2:5001",
        "198.18.2.2:40000",
        "198.18.3.2:5001",
    )
}

/// Install `t`, send `spec` through egress (or ingress) and return the parsed
/// result after checking checksums and the verdict.
fn translate(
    f: &mut Fixture,
    t: &Translation,
    egress: bool,
    spec: &Spec,
    flags: u32,
) -> support::packet::Parsed {
    f.dp.insert_nat_pair(&pair_for(t, 1, flags)).unwrap();
    let out = run(&f.dp, egress, &spec.frame());
    let want = if flags & vnat_common::NAT_F_REDIRECT != 0 {
        TC_ACT_REDIRECT
    } else {
        PASS
    };
    assert_eq!(out.verdict, want, "verdict");
    let p = parse_checked(&out.packet);
    assert_eq!(p.payload, spec.payload, "payload changed");
    p
}

#[test]
fn ipv4_tcp_egress_rewrites_source_of_moved_laptop() {
    let mut f = fixture("tc-v4tcp");
    let t = laptop_moved();
    let before = counter(&f.dp, "egress_translated");
    let p = translate(
        &mut f,
        &t,
        true,
        &Spec::tcp("198.18.1.2:40000", "198.18.3.2:5001"),
        0,
    );
    assert_eq!((p.src, p.dst), (t.physical_local, t.physical_remote));
    assert_eq!(counter(&f.dp, "egress_translated"), before + 1);
}

#[test]
fn ipv4_with_options_udp_ingress_restores_virtual_endpoints() {
    let mut f = fixture("tc-v4opt");
    let t = translation(
        Proto::Udp,
        "198.18.1.2:5353",
        "198.18.3.2:53",
        "198.18.2.7:6000",
        "198.18.3.2:53",
    );
    let mut spec = Spec::udp("198.18.3.2:53", "198.18.2.7:6000");
    // IHL 8: 12 bytes of options (NOPs and an end-of-list) move the UDP header.
    spec.ip_options = vec![1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0];
    let p = translate(&mut f, &t, false, &spec, 0);
    assert_eq!((p.src, p.dst), (t.flow.remote, t.flow.local));
    assert_eq!(counter(&f.dp, "ingress_translated"), 1);
}

#[test]
fn ipv6_tcp_both_ends_moved_with_new_ports() {
    let mut f = fixture("tc-v6tcp");
    let t = translation(
        Proto::Tcp,
        "[fd00:5e:1::2]:40000",
        "[fd00:5e:3::2]:22",
        "[fd00:5e:2::2]:41000",
        "[fd00:5e:4::9]:2222",
    );
    let p = translate(
        &mut f,
        &t,
        true,
        &Spec::tcp("[fd00:5e:1::2]:40000", "[fd00:5e:3::2]:22"),
        0,
    );
    assert_eq!((p.src, p.dst), (t.physical_local, t.physical_remote));
    let back = translate(
        &mut f,
        &t,
        false,
        &Spec::tcp("[fd00:5e:4::9]:2222", "[fd00:5e:2::2]:41000"),
        0,
    );
    assert_eq!((back.src, back.dst), (t.flow.remote, t.flow.local));
}

#[test]
fn ipv6_udp_egress() {
    let mut f = fixture("tc-v6udp");
    let t = translation(
        Proto::Udp,
        "[fd00:5e:1::2]:9000",
        "[fd00:5e:3::2]:9001",
        "[fd00:5e:2::2]:9000",
        "[fd00:5e:3::2]:9001",
    );
    let p = translate(
        &mut f,
        &t,
        true,
        &Spec::udp("[fd00:5e:1::2]:9000", "[fd00:5e:3::2]:9001"),
        0,
    );
    assert_eq!((p.src, p.dst), (t.physical_local, t.physical_remote));
    assert!(!p.udp_csum_zero);
}

#[test]
fn udpv4_zero_checksum_stays_zero() {
    let mut f = fixture("tc-udp0");
    let t = translation(
        Proto::Udp,
        "198.18.1.2:9000",
        "198.18.3.2:9001",
        "198.18.2.2:9100",
        "198.18.3.2:9001",
    );
    let mut spec = Spec::udp("198.18.1.2:9000", "198.18.3.2:9001");
    spec.udp_zero_csum = true;
    let p = translate(&mut f, &t, true, &spec, 0);
    assert_eq!((p.src, p.dst), (t.physical_local, t.physical_remote));
    assert!(
        p.udp_csum_zero,
        "a UDPv4 datagram without checksum must keep checksum 0"
    );
}

#[test]
fn non_matching_packets_are_untouched_and_not_counted() {
    let mut f = fixture("tc-nomatch");
    let t = laptop_moved();
    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let others = [
        Spec::tcp("198.18.1.2:40001", "198.18.3.2:5001"), // other port
        Spec::udp("198.18.1.2:40000", "198.18.3.2:5001"), // other protocol
        Spec::tcp("198.18.3.2:5001", "198.18.1.2:40000"), // wrong direction for egress
        Spec::tcp("[fd00:5e:1::2]:40000", "[fd00:5e:3::2]:5001"),
    ];
    for spec in others {
        let frame = spec.frame();
        let out = run(&f.dp, true, &frame);
        assert_eq!(out.verdict, PASS);
        assert_eq!(
            out.packet, frame,
            "a packet of another flow was modified: {spec:?}"
        );
    }
    // An ARP frame and a truncated IPv4/TCP frame pass untouched too.
    let arp = [vec![0xff; 6], vec![2; 6], vec![0x08, 0x06], vec![0; 28]].concat();
    assert_eq!(run(&f.dp, true, &arp).packet, arp);
    let mut short = Spec::tcp("198.18.1.2:40000", "198.18.3.2:5001").frame();
    short.truncate(14 + 20 + 2);
    let out = run(&f.dp, true, &short);
    assert_eq!((out.verdict, out.packet), (PASS, short));
    assert_eq!(counter(&f.dp, "egress_translated"), 0);
}

#[test]
fn non_first_fragment_passes_and_is_counted() {
    let mut f = fixture("tc-frag");
    let t = translation(
        Proto::Udp,
        "198.18.1.2:9000",
        "198.18.3.2:9001",
        "198.18.2.2:9000",
        "198.18.3.2:9001",
    );
    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let mut spec = Spec::udp("198.18.1.2:9000", "198.18.3.2:9001");
    spec.frag_offset = 185; // 1480 bytes in
    let frame = spec.frame();
    let out = run(&f.dp, true, &frame);
    assert_eq!((out.verdict, &out.packet), (PASS, &frame));
    assert_eq!(counter(&f.dp, "pass_fragment"), 1);
}

/// The verdict computed for a redirect must reach the kernel: a program that
/// computed TC_ACT_REDIRECT and then returned OK (a stray `;`) fails here.
#[test]
fn redirect_flag_returns_redirect_verdict_and_counts_it() {
    let mut f = fixture("tc-redir");
    let t = translation(
        Proto::Tcp,
        "198.18.3.2:5001",
        "198.18.1.2:40000",
        "198.18.3.2:5001",
        "198.18.2.2:40000",
    );
    let p = translate(
        &mut f,
        &t,
        true,
        &Spec::tcp("198.18.3.2:5001", "198.18.1.2:40000"),
        vnat_common::NAT_F_REDIRECT,
    );
    assert_eq!(p.dst, t.physical_remote);
    assert_eq!(counter(&f.dp, "egress_redirected"), 1);
    assert_eq!(counter(&f.dp, "egress_translated"), 1);
}

/// While its own end moves, a TCP flow is held: its packets are dropped at
/// egress (the socket takes that as a failed transmission and keeps the
/// data), nothing else changes, and the release gives back exactly what was
/// there: the translation beneath, or for a flow that had none, packets
/// leaving untouched (and no translation left behind).
#[test]
fn held_flows_are_dropped_at_egress_until_released() {
    let mut f = fixture("tc-hold");
    let t = laptop_moved();
    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let out_frame = Spec::tcp("198.18.1.2:40000", "198.18.3.2:5001").frame();
    let in_spec = Spec::tcp("198.18.3.2:5001", "198.18.2.2:40000");

    f.dp.hold_send_side(&t.flow, true).unwrap();
    let translated = counter(&f.dp, "egress_translated");
    let held = counter(&f.dp, "drop_held");
    let out = run(&f.dp, true, &out_frame);
    assert_eq!(out.verdict, TC_ACT_SHOT, "a held flow must not leave");
    assert_eq!(counter(&f.dp, "egress_translated"), translated);
    assert_eq!(
        counter(&f.dp, "drop_held"),
        held + 1,
        "a held drop must be counted, under its own name"
    );
    // The peer's packets still come in, translated.
    let back = run(&f.dp, false, &in_spec.frame());
    assert_eq!(back.verdict, PASS);
    let p = parse_checked(&back.packet);
    assert_eq!((p.src, p.dst), (t.flow.remote, t.flow.local));
    assert_eq!(
        f.dp.translations().unwrap(),
        vec![t],
        "holding hides nothing"
    );

    f.dp.hold_send_side(&t.flow, false).unwrap();
    let out = run(&f.dp, true, &out_frame);
    assert_eq!(out.verdict, PASS, "released");
    let p = parse_checked(&out.packet);
    assert_eq!((p.src, p.dst), (t.physical_local, t.physical_remote));
    assert_eq!(counter(&f.dp, "egress_translated"), translated + 1);

    // A flow with no translation: held by an entry of its own, which is
    // no translation (not listed, not counted) and goes on release.
    let bare = VirtualFlow {
        proto: Proto::Tcp,
        local: "198.18.1.2:40001".parse().unwrap(),
        remote: "198.18.3.2:5001".parse().unwrap(),
    };
    let bare_frame = Spec::tcp("198.18.1.2:40001", "198.18.3.2:5001").frame();
    f.dp.hold_send_side(&bare, true).unwrap();
    assert_eq!(run(&f.dp, true, &bare_frame).verdict, TC_ACT_SHOT);
    assert_eq!(f.dp.translations().unwrap(), vec![t]);
    assert_eq!(f.dp.status().unwrap().translations, 1);
    // Both held; a restarted vnatd releases whatever its predecessor held.
    f.dp.hold_send_side(&t.flow, true).unwrap();
    assert_eq!(f.dp.release_held().unwrap(), 2);
    let out = run(&f.dp, true, &bare_frame);
    assert_eq!((out.verdict, &out.packet), (PASS, &bare_frame));
    assert_eq!(run(&f.dp, true, &out_frame).verdict, PASS);
    assert_eq!(f.dp.translations().unwrap(), vec![t]);
    assert_eq!(f.dp.release_held().unwrap(), 0, "nothing is held any more");
}

/// Installing a flow's translation (the switch the hold waits for) ends
/// the hold, whether or not the flow was translated before.
#[test]
fn installing_the_new_translation_releases_the_hold() {
    let mut f = fixture("tc-hold-install");
    let t = laptop_moved();
    f.dp.hold_send_side(&t.flow, true).unwrap();
    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let out = run(
        &f.dp,
        true,
        &Spec::tcp("198.18.1.2:40000", "198.18.3.2:5001").frame(),
    );
    assert_eq!(out.verdict, PASS);
    let p = parse_checked(&out.packet);
    assert_eq!((p.src, p.dst), (t.physical_local, t.physical_remote));
    assert_eq!(f.dp.release_held().unwrap(), 0);
}

#[test]
fn translations_survive_reopen_from_pins() {
    // Reopening re-attaches tc for the pinned translation (ifindex 1 = lo):
    // do it in a namespace of its own, not on the host's loopback.
    let ns = vnat_tests::Netns::new("tcreopen");
    ns.run_in(reopen_body);
}

fn reopen_body() {
    let pins = BpffsDir::new("tc-reopen");
    let opts = KernelOptions {
        bpffs: pins.path().to_path_buf(),
        cgroups: vec![],
        tc_attach: vnat_tests::harness::tc_attach(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    };
    let t = laptop_moved();
    {
        let mut dp = KernelDatapath::open(&opts).unwrap();
        dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    }
    let dp = KernelDatapath::open(&opts).unwrap();
    assert_eq!(
        dp.translations().unwrap(),
        vec![t],
        "the pinned NAT entries were not reused"
    );
    let out = run(
        &dp,
        true,
        &Spec::tcp("198.18.1.2:40000", "198.18.3.2:5001").frame(),
    );
    assert_eq!(parse_checked(&out.packet).src, t.physical_local);
}

/// While nothing is translated the translators do not even parse a packet
/// (a truncated frame is not counted); the first translation makes them
/// look again and translate, and removing the last one stops them.
#[test]
fn translators_idle_until_something_is_translated() {
    // Removing a translation touches routes and tc on its interface: do it
    // in a namespace of its own.
    let ns = vnat_tests::Netns::new("tcidle");
    ns.run_in(idle_body);
}

fn idle_body() {
    let mut f = fixture("tc-idle");
    let t = laptop_moved();
    let frame = Spec::tcp("198.18.1.2:40000", "198.18.3.2:5001").frame();
    let mut short = frame.clone();
    short.truncate(14 + 20 + 2);

    for egress in [true, false] {
        let out = run(&f.dp, egress, &short);
        assert_eq!((out.verdict, out.packet), (PASS, short.clone()));
    }
    assert_eq!(
        counter(&f.dp, "pass_truncated"),
        0,
        "with nothing translated the translators parsed a packet"
    );

    f.dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    run(&f.dp, true, &short);
    assert_eq!(
        counter(&f.dp, "pass_truncated"),
        1,
        "the first translation did not make the translators look"
    );
    let out = run(&f.dp, true, &frame);
    assert_eq!(parse_checked(&out.packet).src, t.physical_local);

    f.dp.remove_translation(&t.flow).unwrap();
    assert_eq!(f.dp.translations().unwrap(), vec![]);
    run(&f.dp, true, &short);
    assert_eq!(
        counter(&f.dp, "pass_truncated"),
        1,
        "the translators still parse packets after the last translation went"
    );
    let out = run(&f.dp, true, &frame);
    assert_eq!((out.verdict, out.packet), (PASS, frame));
}
