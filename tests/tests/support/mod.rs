//! Shared by the integration tests: crafted packets with checksums computed
//! from scratch (`vnat_tests::packet`, also used by the benchmarks);
//! namespace hosts with a datapath are `vnat_tests::Host`.
#![allow(unused_imports)]

pub use vnat_tests::packet;

use vnat_daemon::datapath::kernel::{testrun, KernelDatapath, KernelOptions};
use vnat_tests::BpffsDir;

/// The datapath counter `name`, summed over CPUs.
#[allow(dead_code)]
pub fn counter(dp: &KernelDatapath, name: &str) -> u64 {
    dp.counters()
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no counter {name}"))
        .1
}

/// Run the tc egress (or ingress) translator on `frame` in the kernel
/// (BPF_PROG_TEST_RUN).
#[allow(dead_code)]
pub fn run(dp: &KernelDatapath, egress: bool, frame: &[u8]) -> testrun::TestRun {
    testrun::run(dp.tc_program_fd(egress).unwrap(), frame)
        .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN failed: {e}"))
}

/// A kernel datapath of its own (pins in a fresh directory named after
/// `tag`), for tests that run the programs on crafted packets; the pins go
/// when the directory is dropped.
#[allow(dead_code)]
pub fn open_datapath(tag: &str) -> (KernelDatapath, BpffsDir) {
    let pins = BpffsDir::new(tag);
    let dp = KernelDatapath::open(&KernelOptions {
        bpffs: pins.path().to_path_buf(),
        cgroups: vec![],
        tc_attach: vnat_tests::harness::tc_attach(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    })
    .unwrap_or_else(|e| panic!("opening the kernel datapath: {e}"));
    (dp, pins)
}
