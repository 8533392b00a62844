//! The commands the control handler sends the VCMP driver (a channel: the
//! handler never touches the driver's state), with the types of their
//! replies. Defined here, below the driver, so that the control API does
//! not import the driver.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use tokio::sync::{mpsc, oneshot};

use super::proto::{LocationStatus, PeerInfo, VcmpCounters};
use super::transfer::{ExportDocument, ImportOutcome, TransferError};
use crate::datapath::VirtualFlow;
use crate::vcmp::EndpointError;

/// What the control API asks of the VCMP driver, which owns the protocol
/// core: the control handler sends these, the driver answers on `reply`.
pub enum Command {
    /// Planned suspend (paper 3.3.1): settle roles and keys for these flows.
    /// With `help` (not empty), the peers are also asked for keep-alive
    /// helpers (`vcmp::help`); the answer is the flows whose peers were.
    Suspend {
        flows: Vec<VirtualFlow>,
        help: crate::vcmp::help::Help,
        reply: oneshot::Sender<Result<Vec<VirtualFlow>, EndpointError>>,
    },
    /// Ask the peers of `flows` for `help` (empty: this host is back)
    /// without suspending; the answer, once every peer confirmed or `wait`
    /// passed: the flows whose peers were asked, and those that confirmed.
    AskHelp {
        flows: Vec<VirtualFlow>,
        help: crate::vcmp::help::Help,
        wait: std::time::Duration,
        reply: oneshot::Sender<(Vec<VirtualFlow>, Vec<VirtualFlow>)>,
    },
    /// Re-read addresses and connections now and move what needs moving.
    Resume { reply: oneshot::Sender<usize> },
    /// Move each flow to the address given with it (`vnatctl migrate`):
    /// each one's outcome, where it goes from and to or why it does not.
    Migrate {
        moves: Vec<(VirtualFlow, IpAddr)>,
        reply: oneshot::Sender<Vec<MoveOutcome>>,
    },
    Peers {
        reply: oneshot::Sender<Vec<PeerInfo>>,
    },
    /// A reloaded configuration (SIGHUP): the settings the driver uses.
    Reconfigure {
        location_servers: Vec<SocketAddr>,
        keepalive_secs: u32,
        standby_tc: bool,
        preempt_cgroups: Vec<std::path::PathBuf>,
        reply: oneshot::Sender<()>,
    },
    /// Forget a host key: its session, the stored key, and the binding of
    /// its connections (`vnatctl peers forget`). Replies with how many
    /// connections it held, `None` if the key is unknown.
    ForgetPeer {
        key: [u8; 32],
        reply: oneshot::Sender<Option<usize>>,
    },
    /// Which tracked flows can move (have keys).
    Mobility {
        reply: oneshot::Sender<HashMap<VirtualFlow, Mobility>>,
    },
    /// The protocol core's counters (`vnatctl status`).
    Counters {
        reply: oneshot::Sender<VcmpCounters>,
    },
    /// The location store and servers, and how etcd's calls went
    /// (`vnatctl status`).
    Location {
        reply: oneshot::Sender<LocationStatus>,
    },
    /// Hand these flows' VCMP state over (keys included) and forget them
    /// here; all of them or none.
    Export {
        flows: Vec<VirtualFlow>,
        /// The host the document is sealed for (`None`: this one).
        to: Option<[u8; 32]>,
        reply: oneshot::Sender<Result<ExportDocument, TransferError>>,
    },
    /// Take over exported flows (all or none), then move those whose local
    /// end now lives at another address, as automatic mode does.
    Import {
        state: ExportDocument,
        /// The host the document must be sealed by (`None`: this one).
        from: Option<[u8; 32]>,
        reply: oneshot::Sender<Result<Vec<ImportOutcome>, TransferError>>,
    },
}

impl Command {
    /// The command's name, for the span its work is logged in.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Suspend { .. } => "suspend",
            Command::AskHelp { .. } => "ask-help",
            Command::Resume { .. } => "resume",
            Command::Migrate { .. } => "migrate",
            Command::Peers { .. } => "peers",
            Command::Reconfigure { .. } => "reconfigure",
            Command::ForgetPeer { .. } => "forget-peer",
            Command::Mobility { .. } => "mobility",
            Command::Counters { .. } => "counters",
            Command::Location { .. } => "location",
            Command::Export { .. } => "export",
            Command::Import { .. } => "import",
        }
    }
}

pub type CommandSender = mpsc::Sender<Command>;

/// How one move the driver was asked for went: where it goes from and to,
/// or why it did not start.
pub type MoveOutcome = (VirtualFlow, Result<(SocketAddr, SocketAddr), MoveRefused>);

/// Why a move the driver was asked for did not start (the `skipped`
/// reasons of `migrate`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MoveRefused {
    #[error("vnatd does not manage it")]
    NotManaged,
    #[error("a move of it is already under way")]
    AlreadyMoving,
    #[error("it is at {0} already")]
    AlreadyThere(IpAddr),
    #[error("it cannot move: the peer runs no vnatd or pairing has not completed")]
    NotMobile,
    /// The datapath could not make the receive side ready (its error, in
    /// words: a datapath error is not `Clone`).
    #[error("cannot prepare the move: {0}")]
    Prepare(String),
    #[error("cannot start the migration: {0}")]
    Start(EndpointError),
    /// An IPv4 connection to an IPv6 address, whose peer told no IPv6
    /// address of its own (`vnatctl peers`).
    #[error("it is IPv4 and {0} is IPv6, but its peer has told no IPv6 address to carry it over")]
    NoPeerAddressInFamily(IpAddr),
}

/// What VCMP says of one connection's mobility, for `list` and the
/// selectors of mobility requests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Mobility {
    /// VCMP holds keys for it, so it can move.
    pub mobile: bool,
    /// The address and port the peer sees for our end, when it differs
    /// from ours (a NAT between the ends).
    pub seen_by_peer_as: Option<SocketAddr>,
    /// Why it cannot move, when it cannot.
    pub why_not: Option<String>,
    /// The role its suspension settled ("primary" moves, "secondary"
    /// waits for it), if one did.
    pub role: Option<String>,
    /// A move of it is under way.
    pub moving: bool,
    /// Where VCMP has our end (the datapath may not send from there yet:
    /// the send side switches once the peer sends to it).
    pub local_phys: Option<SocketAddr>,
    /// Its keepalive is held (off) until resume (`vnatctl suspend`).
    pub keepalive_held: bool,
    /// Where an operator placed it (`vnatctl migrate`).
    pub placed: Option<std::net::IpAddr>,
    /// Keep-alive helpers this host asked the peer for, until the
    /// connection works again (`suspend --helper`).
    pub helpers_asked: Vec<String>,
    /// Keep-alive helpers this host runs for the absent peer.
    pub helping: Vec<String>,
    /// Its last move since vnatd started (`daemon::journal`).
    pub last_move: Option<vnat_control::monitor::LastMove>,
}
