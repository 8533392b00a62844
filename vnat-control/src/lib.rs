//! What vnatd and vnatctl share: the control protocol's wire types
//! ([`proto`], one JSON object per line each way), its framing ([`lines`]),
//! its client ([`client::ControlClient`]), the export document that carries
//! connections to another host ([`transfer`]), the datapath's state as the
//! protocol reports it ([`datapath`]), and the socket tables of `/proc` that
//! both read ([`procfs`]).
//!
//! This crate builds with stable Rust alone: it depends on the VCMP core
//! (re-exported as [`vcmp`]) for the flows and exports the wire carries, and
//! never on vnat-daemon, whose build script builds the eBPF programs. vnatd
//! serves the protocol (`vnat_daemon::control`) and re-exports these items
//! where they used to live.

pub mod client;
pub mod datapath;
pub mod lines;
pub mod monitor;
pub mod procfs;
pub mod proto;
pub mod transfer;

pub use vnat_vcmp as vcmp;

pub use client::{ClientError, ControlClient, ProtocolViolation};
pub use monitor::{EndOutcome, EventKind, LastMove, MonitorEvent, Side};
pub use proto::*;
pub use transfer::{ExportDocument, ExportedConnection, Seal, EXPORT_FORMAT};
