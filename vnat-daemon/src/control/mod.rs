//! The control API: vnatctl (or a script) talks to vnatd over a Unix stream
//! socket, one JSON request per line, one JSON response per line. The wire
//! types, the framing and the client are in `vnat-control`, which vnatctl
//! shares; they are re-exported here ([`proto`], [`client`]). The socket is
//! created mode 0600, so only its owner (root, for the packaged service) can
//! use it.
//!
//! [`server::ControlListener`] creates the socket and serves it with a
//! [`handler::Handler`] that owns the shared datapath;
//! [`client::ControlClient`] is the other end.

pub mod command;
pub mod events;
pub mod handler;
mod select;
pub mod server;
pub mod transfer;

#[cfg(test)]
mod handler_tests;
#[cfg(test)]
mod monitor_tests;
#[cfg(test)]
mod tests;

use vnat_control::lines;
pub use vnat_control::{client, proto};

pub use client::{ClientError, ControlClient};
pub use command::{Command, CommandSender, Mobility};
pub use handler::Handler;
pub use proto::*;
pub use server::{ControlListener, ServerError};
pub use transfer::{ExportDocument, ExportedConnection, TransferError, EXPORT_FORMAT};
