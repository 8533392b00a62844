//! vnatd's library: the datapath manager (the only code that touches the
//! kernel), the VCMP protocol core (no I/O), and the control API.

pub mod control;
pub mod daemon;
pub mod datapath;
pub mod mounts;
pub mod vcmp;
