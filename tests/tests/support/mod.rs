//! Shared by the integration tests: crafted packets with checksums computed
//! from scratch (`vnat_tests::packet`, also used by the benchmarks);
//! namespace hosts with a datapath are `vnat_tests::Host`.
#![allow(unused_imports)]

pub use vnat_tests::packet;
