//! Shared by the integration tests: crafted packets with checksums computed
//! from scratch (`vnat_tests::packet`, also used by the benchmarks);
//! namespace hosts with a datapath are `vnat_tests::Host`.
#![allow(unused_imports)]

pub use vnat_tests::packet;

use vnat_daemon::datapath::kernel::{testrun, KernelDatapath};

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
