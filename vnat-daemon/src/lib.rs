//! vnatd's library: the datapath manager (the only code that touches the
//! kernel), the daemon that drives the VCMP protocol core (the `vnat-vcmp`
//! crate, re-exported as [`vcmp`]), and the control API.

pub mod control;
pub mod daemon;
pub mod datapath;
pub mod mounts;
pub use vnat_vcmp as vcmp;
