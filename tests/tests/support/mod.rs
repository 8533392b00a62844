//! Shared by the integration tests: crafted packets with checksums computed
//! from scratch, and namespace hosts with their own datapath.
#![allow(dead_code)]

pub mod host;
pub mod packet;
