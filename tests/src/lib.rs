//! vnat-tests: privileged integration tests and the demo, on hosts built from
//! network namespaces.
//!
//! The library is the harness shared by `tests/*.rs` and the `vnat-demo`
//! binary: namespaces, veths, addresses and routes, cgroups, bpffs
//! directories, the two standard topologies, a socat echo server and a reader
//! for the `vnat-stream` traffic checker, and crafted packets with their
//! checksums checked from scratch (`packet`). Everything it creates is uniquely
//! named per process and counter and removed in `Drop`, also when a test
//! panics, so tests run in parallel and leave nothing behind.
//!
//! Everything here needs root.
pub mod harness;
pub mod packet;

pub use harness::*;
