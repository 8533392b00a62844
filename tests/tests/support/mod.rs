//! Shared by the integration tests: crafted packets with checksums computed
//! from scratch, and their verification.
#![allow(dead_code)]

pub mod packet;
