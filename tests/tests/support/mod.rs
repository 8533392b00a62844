//! Shared by the integration tests: crafted packets with checksums computed
//! from scratch, (namespace hosts with a datapath are `vnat_tests::Host`).
#![allow(dead_code)]

pub mod packet;
