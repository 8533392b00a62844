//! The tc translators' memory of fragmented datagrams (VNAT_FRAGS) against
//! spoofed first fragments (issue 31, item 8), run by the kernel on crafted
//! packets through BPF_PROG_TEST_RUN.
//!
//! A datagram's later fragments carry no ports: they follow the flow its
//! first fragment was translated by, remembered under the datagram's
//! addresses and identification. Before, that memory was one LRU map for
//! every flow: anyone able to send first fragments of one translated flow
//! (its peer, or a spoofer who knows its ports) could evict every other
//! flow's entries by sending many identifications, or overwrite another
//! flow's entry between the same addresses by sending its identification,
//! and the victims' later fragments then passed untranslated or were
//! translated by the wrong flow. Now a flow's first fragment never takes a
//! live entry of another flow, and one address pair holds a few entries at
//! most, so one pair's fragments cannot push out another's.

mod support;

use support::packet::Spec;
use support::{counter, run};
use vnat_daemon::datapath::{
    kernel::{pair_for, KernelDatapath, KernelOptions},
    Proto, Translation, VirtualFlow,
};
use vnat_tests::BpffsDir;

const PASS: u32 = -1i32 as u32;
const MORE_FRAGMENTS: u16 = 0x2000;

fn udp(vl: &str, vr: &str, pl: &str, pr: &str) -> Translation {
    Translation {
        flow: VirtualFlow {
            proto: Proto::Udp,
            local: vl.parse().unwrap(),
            remote: vr.parse().unwrap(),
        },
        physical_local: pl.parse().unwrap(),
        physical_remote: pr.parse().unwrap(),
    }
}

/// An IPv4 fragment from `src` to `dst` (the UDP header is there only in a
/// first fragment; the bytes are the same either way) with identification
/// `id` and the fragment field `frag` (offset, MF).
fn fragment(src: &str, dst: &str, id: u16, frag: u16) -> Vec<u8> {
    let mut s = Spec::udp(src, dst);
    s.frag_offset = frag;
    let mut f = s.frame();
    f[14 + 4..14 + 6].copy_from_slice(&id.to_be_bytes());
    set_ip_checksum(&mut f);
    f
}

fn set_ip_checksum(f: &mut [u8]) {
    f[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let mut acc: u32 = f[14..14 + 20]
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    f[14 + 10..14 + 12].copy_from_slice(&(!(acc as u16)).to_be_bytes());
}

/// The destination address of an IPv4 frame, after checking its header
/// checksum from scratch.
fn dst_of(f: &[u8]) -> std::net::Ipv4Addr {
    let mut acc: u32 = f[14..14 + 20]
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    assert_eq!(acc, 0xffff, "IPv4 header checksum is wrong");
    <[u8; 4]>::try_from(&f[14 + 16..14 + 20]).unwrap().into()
}

#[test]
fn spoofed_first_fragments_neither_overwrite_nor_evict_a_flows_entry() {
    let pins = BpffsDir::new("tc-frag-spoof");
    let mut dp = KernelDatapath::open(&KernelOptions {
        bpffs: pins.path().to_path_buf(),
        cgroups: vec![],
        tc_attach: vnat_tests::harness::tc_attach(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    })
    .unwrap_or_else(|e| panic!("opening the kernel datapath: {e}"));
    // The victim's flow A and flow B between the same physical addresses
    // (both moved to 198.18.2.2, from different virtual addresses), and a
    // flow C between other addresses.
    let a = udp(
        "198.18.1.2:5000",
        "198.18.3.2:53",
        "198.18.2.2:5000",
        "198.18.3.2:53",
    );
    let b = udp(
        "198.18.1.7:5001",
        "198.18.3.2:53",
        "198.18.2.2:5001",
        "198.18.3.2:53",
    );
    let c = udp(
        "198.18.1.9:5002",
        "198.18.3.9:53",
        "198.18.2.2:5002",
        "198.18.3.9:53",
    );
    for t in [&a, &b, &c] {
        dp.insert_nat_pair(&pair_for(t, 1, 0)).unwrap();
    }
    let a_virtual: std::net::Ipv4Addr = "198.18.1.2".parse().unwrap();

    // A's datagram 0x1111 arrives: its first fragment is translated.
    let first = fragment("198.18.3.2:53", "198.18.2.2:5000", 0x1111, MORE_FRAGMENTS);
    let r = run(&dp, false, &first);
    assert_eq!(r.verdict, PASS);
    assert_eq!(dst_of(&r.packet), a_virtual);

    // A spoofed first fragment of B with the same identification.
    let spoof = fragment("198.18.3.2:53", "198.18.2.2:5001", 0x1111, MORE_FRAGMENTS);
    run(&dp, false, &spoof);

    // A flood of C's first fragments, every identification a new one.
    for id in 0..9000u16 {
        let f = fragment("198.18.3.9:53", "198.18.2.2:5002", id, MORE_FRAGMENTS);
        run(&dp, false, &f);
    }

    // A's last fragment still follows A's flow.
    let last = fragment("198.18.3.2:53", "198.18.2.2:5000", 0x1111, 185);
    let r = run(&dp, false, &last);
    assert_eq!(r.verdict, PASS);
    assert_eq!(
        dst_of(&r.packet),
        a_virtual,
        "A's later fragment was not translated by A's flow (entry overwritten or evicted)"
    );
    assert!(counter(&dp, "fragment_collision") >= 1);

    // A's own next datagrams still find their place, also where an entry
    // of A's was left incomplete (its last fragment lost).
    for id in [0x2222u16, 0x2222 + 16, 0x2222 + 32] {
        let first = fragment("198.18.3.2:53", "198.18.2.2:5000", id, MORE_FRAGMENTS);
        run(&dp, false, &first);
    }
    let last = fragment("198.18.3.2:53", "198.18.2.2:5000", 0x2222 + 32, 185);
    let r = run(&dp, false, &last);
    assert_eq!(dst_of(&r.packet), a_virtual);
}
