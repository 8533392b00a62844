//! The control API: vnatctl (or a script) talks to vnatd over a Unix stream
//! socket, one JSON request per line, one JSON response per line (see
//! [`proto`] for the shapes). The socket is created mode 0600, so only its
//! owner (root, for the packaged service) can use it.
//!
//! [`server::ControlListener`] creates the socket and serves it with a
//! [`handler::Handler`] that owns the shared datapath;
//! [`client::ControlClient`] is the other end.

pub mod client;
pub mod command;
pub mod handler;
mod lines;
pub mod proto;
mod select;
pub mod server;
pub mod transfer;

#[cfg(test)]
mod handler_tests;
#[cfg(test)]
mod tests;

pub use client::{ClientError, ControlClient};
pub use command::{Command, CommandSender};
pub use handler::Handler;
pub use proto::*;
pub use server::{ControlListener, ServerError};
pub use transfer::{ExportDocument, ExportedConnection, TransferError, EXPORT_FORMAT};
