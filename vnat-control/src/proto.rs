//! The control protocol's wire types: one JSON object per line each way.
//!
//! A request is `{"version":1,"request":{"type":"list"}}`; the answer is
//! `{"version":1,"ok":{"type":"connections","connections":[...]}}` or
//! `{"version":1,"error":{"kind":"bad_request","message":"..."}}`. The
//! version is checked on every request so that a vnatctl and a vnatd from
//! different releases fail with a clear sentence instead of misreading each
//! other.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use serde::{Deserialize, Serialize};

use crate::datapath::DatapathStatus;
use crate::monitor::MonitorEvent;
use crate::transfer::ExportDocument;

mod listed;
pub use listed::ListedConnection;
pub(crate) use listed::{AnswerHead, ConnectionsAnswer};

/// The protocol version this build speaks. Bump it on any incompatible change
/// to [`Request`] or [`Reply`].
pub const PROTOCOL_VERSION: u32 = 1;

/// Longest accepted request line, newline excluded. Most requests are tiny;
/// an `import` carries about 600 bytes per connection, so 1 MiB takes an
/// export of well over a thousand connections. The bound only keeps a broken
/// or hostile client from making vnatd buffer without limit. Responses (a
/// long `ls`) are allowed to be larger.
pub const MAX_REQUEST_LINE: usize = 1024 * 1024;

/// Longest response line a client accepts: room for about 100k connections.
pub const MAX_RESPONSE_LINE: usize = 64 * 1024 * 1024;

/// Where vnatd listens and vnatctl connects unless told otherwise.
pub const DEFAULT_CONTROL_PATH: &str = "/run/vnat/vnatd.sock";

/// One request line.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestEnvelope {
    pub version: u32,
    pub request: Request,
}

/// What a client can ask.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The daemon's settings and the datapath status.
    Status,
    /// Every recorded connection.
    List,
    /// Start recording connections of a cgroup v2 directory (absolute path);
    /// with `hide_location`, also turn hiding location on or off for it
    /// (absent: as it was).
    EnableCgroup {
        path: PathBuf,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hide_location: Option<bool>,
    },
    /// Stop recording them.
    DisableCgroup { path: PathBuf },
    /// Planned move, before it (paper section 3.3.1): settle roles and fresh
    /// keys with the peers of the selected connections.
    Suspend {
        selector: Selector,
        /// Keep-alive helpers to ask the peers for while this host is
        /// away (`vcmp::help`): "zero-window", "stop", and the name of at
        /// most one helper installed on the peer.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        helpers: Vec<String>,
    },
    /// After a planned move: re-read addresses now and move what lost its
    /// address, instead of waiting for the address watch.
    Resume { selector: Selector },
    /// Ask the peers of the selected connections for keep-alive helpers
    /// (`vcmp::help`) without suspending them (no keepalive hold, no role
    /// or key agreement); no helpers: this host is back. `vnatctl
    /// criu-hook` asks for "hold" before a checkpoint. Waits up to
    /// `wait_ms` (at most 2000) for the peers to confirm.
    AskHelp {
        selector: Selector,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        helpers: Vec<String>,
        #[serde(default)]
        wait_ms: u32,
    },
    /// Move the selected connections to another local address of this
    /// host while their current one stays up (a multihomed host: Wi-Fi to
    /// wired or cellular). Their peers validate the new address as for any
    /// move; automatic mode then leaves them there while it exists.
    Migrate {
        selector: Selector,
        to: MigrateTarget,
    },
    /// The peer hosts VCMP knows, by host key.
    Peers,
    /// Forget a peer host key (64 hex digits): its pairing, and its hold on
    /// its connections, which any host that proves them may claim again.
    ForgetPeer { key: String },
    /// Hand the selected connections' VCMP state (keys included) over, for a
    /// process that is checkpointed here and restored on another host. This
    /// vnatd forgets them. The document is sealed for the host `to` (64 hex
    /// digits; this host when absent), the only one that can import it.
    Export {
        selector: Selector,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        to: Option<String>,
    },
    /// Take over connections exported by another vnatd: the document must
    /// be sealed for this host by the host `from` (this host when absent).
    Import {
        state: ExportDocument,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        from: Option<String>,
    },
    /// Subscribe to move and pairing events: answered with
    /// [`Reply::Monitoring`], then one [`Reply::Event`] line per event until
    /// the client closes (`crate::monitor`). The connection takes no
    /// further request.
    Monitor,
}

impl Request {
    /// The `type` names a server accepts, for the "unknown request" error.
    pub const TYPES: &'static [&'static str] = &[
        "status",
        "list",
        "enable_cgroup",
        "disable_cgroup",
        "suspend",
        "resume",
        "ask_help",
        "migrate",
        "peers",
        "forget_peer",
        "export",
        "import",
        "monitor",
    ];
}

/// Where [`Request::Migrate`] moves connections. On the wire
/// `{"address":"198.18.2.2"}` or `{"device":"wlan0"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum MigrateTarget {
    /// This local address (each connection of its family).
    Address(IpAddr),
    /// The address of this interface of each connection's family.
    Device(String),
}

impl std::fmt::Display for MigrateTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MigrateTarget::Address(a) => write!(f, "{a}"),
            MigrateTarget::Device(d) => write!(f, "interface {d}"),
        }
    }
}

/// Which recorded connections a request is about. On the wire: `"all"`,
/// `{"conns":[ID,...]}`, `{"pid":PID}` or `{"cgroup":"/abs/dir"}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Selector {
    /// Every recorded connection.
    All,
    /// Connections by the `id` that `list` reports.
    Conns(Vec<u64>),
    /// Connections owned by this process.
    Pid(u32),
    /// Connections of processes in this cgroup v2 directory or below it: an
    /// absolute path under the cgroup2 mount, or the form `list` shows
    /// (relative to the mount, starting with `/`).
    Cgroup(PathBuf),
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Selector::All => f.write_str("all connections"),
            Selector::Conns(ids) => {
                let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
                write!(f, "connection id {}", ids.join(", "))
            }
            Selector::Pid(pid) => write!(f, "pid {pid}"),
            Selector::Cgroup(path) => write!(f, "cgroup {}", path.display()),
        }
    }
}

/// One response line: the version and either `ok` or `error`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResponseEnvelope {
    pub version: u32,
    #[serde(flatten)]
    pub outcome: Outcome,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Ok(Reply),
    Error(ErrorBody),
}

impl ResponseEnvelope {
    pub fn ok(reply: Reply) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            outcome: Outcome::Ok(reply),
        }
    }
    pub fn error(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            version: PROTOCOL_VERSION,
            outcome: Outcome::Error(ErrorBody {
                kind,
                message: message.into(),
            }),
        }
    }
}

/// Successful answers, one per [`Request`] variant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Reply {
    // Boxed: the status is much larger than the other replies.
    Status(Box<StatusReply>),
    Connections {
        connections: Vec<ListedConnection>,
    },
    CgroupEnabled {
        path: PathBuf,
        /// Whether its applications now see moved hosts at their virtual
        /// addresses in new connections too.
        #[serde(default)]
        hide_location: bool,
    },
    CgroupDisabled {
        path: PathBuf,
    },
    Suspended(SuspendReply),
    Resumed(ResumeReply),
    /// The answer to [`Request::AskHelp`].
    HelpAsked {
        /// Ids of the connections whose peers were asked (those with keys).
        asked: Vec<u64>,
        /// Those whose peers confirmed within the wait.
        confirmed: Vec<u64>,
    },
    Migrated(MigrateReply),
    Peers {
        peers: Vec<PeerInfo>,
    },
    PeerForgotten {
        key: String,
        /// Connections it held, now unbound.
        connections: usize,
    },
    Exported {
        state: ExportDocument,
    },
    Imported {
        connections: Vec<ImportedConnection>,
    },
    /// The answer to [`Request::Monitor`]: events follow.
    Monitoring,
    /// One event of a monitoring connection.
    Event(MonitorEvent),
}

impl Reply {
    /// The wire `type` of this reply, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Reply::Status(_) => "status",
            Reply::Connections { .. } => "connections",
            Reply::CgroupEnabled { .. } => "cgroup_enabled",
            Reply::CgroupDisabled { .. } => "cgroup_disabled",
            Reply::Suspended(_) => "suspended",
            Reply::Resumed(_) => "resumed",
            Reply::HelpAsked { .. } => "help_asked",
            Reply::Migrated(_) => "migrated",
            Reply::Peers { .. } => "peers",
            Reply::PeerForgotten { .. } => "peer_forgotten",
            Reply::Exported { .. } => "exported",
            Reply::Imported { .. } => "imported",
            Reply::Monitoring => "monitoring",
            Reply::Event(_) => "event",
        }
    }
}

/// A peer host as `vnatctl peers` shows it: one per host key, plus one per
/// address for connections no paired host has claimed yet (`key: None`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// Where the host last paired from.
    pub address: IpAddr,
    /// Its x25519 host key, hex.
    pub key: Option<String>,
    /// Connections bound to it that VCMP tracks.
    pub connections: usize,
    /// Connections that have keys, i.e. can move.
    pub mobile: usize,
    /// This host is behind a NAT as that peer sees it.
    #[serde(default)]
    pub behind_nat: bool,
    /// Where the peer last saw this host's VCMP come from (the reflexive
    /// address of its last answered keepalive).
    #[serde(default)]
    pub reflexive: Option<SocketAddr>,
    /// When an authenticated datagram of it last arrived (ms since the
    /// Unix epoch); absent if none did since vnatd started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_heard_ms: Option<u64>,
    /// The addresses it told us it has (in its keepalives): where its
    /// connections continue in the other IP family when theirs is gone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<IpAddr>,
}

/// The answer to [`Request::Suspend`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SuspendReply {
    /// Ids of the connections whose peers were asked to prepare.
    pub suspended: Vec<u64>,
    /// Ids of those whose peers were also asked for the helpers (the ones
    /// with keys: paired).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub helped: Vec<u64>,
    /// Selected connections that cannot move, with the reason.
    pub skipped: Vec<Skipped>,
}

/// A selected connection that was left alone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Skipped {
    pub id: u64,
    pub reason: String,
}

/// The answer to [`Request::Resume`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeReply {
    /// Ids of the connections the selector matched.
    pub selected: Vec<u64>,
    /// Moves started by this resume (any connection that lost its address,
    /// as automatic mode would); 0 when everything already is where it
    /// should be, for example because automatic mode moved it first.
    pub moves_started: usize,
    /// Ids of the selected connections with a move under way when the
    /// resume was done (started by it or before it): what `--wait`
    /// waits for.
    #[serde(default)]
    pub moving: Vec<u64>,
}

/// The answer to [`Request::Migrate`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateReply {
    /// Moves started: the peers are validating the new addresses. `list`
    /// shows each as `moving` until it completes or is given up.
    pub started: Vec<MigrateStarted>,
    /// Selected connections that were left where they are, with the reason.
    pub skipped: Vec<Skipped>,
}

/// One move [`Request::Migrate`] started.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrateStarted {
    pub id: u64,
    /// The local physical endpoint it leaves.
    pub from: SocketAddr,
    /// The one it moves to.
    pub to: SocketAddr,
}

/// One connection taken over by [`Request::Import`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportedConnection {
    pub id: u64,
    pub proto: crate::datapath::Proto,
    pub virtual_local: SocketAddr,
    pub virtual_remote: SocketAddr,
    /// Where the local end continues on this host.
    pub physical_local: SocketAddr,
    pub physical_remote: SocketAddr,
    /// A move to `physical_local` was started (the peer is being updated).
    pub moving: bool,
    /// A move starts once the restored socket appears here (its address
    /// is not one of this host's).
    #[serde(default)]
    pub move_pending: bool,
}

/// The answer to [`Request::Status`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReply {
    pub daemon: DaemonInfo,
    pub datapath: DatapathStatus,
    /// VCMP's counters: what happened and every rejected datagram or record
    /// by reason (bad MAC, replay, stale update, ...). Absent when the
    /// driver is not running.
    #[serde(default)]
    pub vcmp: Option<VcmpCounters>,
    /// Where this host keeps and looks up its connections' locations, and
    /// whether that works. Absent when the driver is not running (or vnatd
    /// is older).
    #[serde(default)]
    pub location: Option<LocationStatus>,
}

/// The location store and servers vnatd uses (`vnatctl status`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LocationStatus {
    /// "embedded" (records kept by this vnatd, for its peers to look up)
    /// or "etcd" (besides the embedded one).
    pub store: String,
    /// The store in one sentence, as `vnatd --check` says it.
    pub description: String,
    /// `location_servers`: the vnatd location servers moves also use.
    #[serde(default)]
    pub servers: Vec<SocketAddr>,
    /// etcd only: how its calls went. None for the embedded store.
    #[serde(default)]
    pub etcd: Option<EtcdHealth>,
}

/// How vnatd's calls to etcd went since it started.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EtcdHealth {
    /// "untried" (no call finished yet), "answering" (the last call
    /// worked) or "failing" (it did not: moves go on without etcd).
    pub state: String,
    /// Calls that worked, and calls that failed or timed out.
    pub answered: u64,
    pub failed: u64,
    /// Seconds since the last call that worked, if one did.
    #[serde(default)]
    pub last_answer_secs_ago: Option<u64>,
    /// The last failure, in one sentence, and how long ago it was.
    #[serde(default)]
    pub last_error: Option<String>,
    #[serde(default)]
    pub last_error_secs_ago: Option<u64>,
}

/// Counters of the VCMP protocol core.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VcmpCounters {
    /// This host's key (64 hex digits): what its peers pair with, and what
    /// `vnatctl export --to` names to seal an export for it.
    #[serde(default)]
    pub host_key: String,
    pub events: std::collections::BTreeMap<String, u64>,
    pub rejected: std::collections::BTreeMap<String, u64>,
}

/// What vnatd itself was started with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DaemonInfo {
    /// vnatd's release (crate version).
    pub version: String,
    pub pid: u32,
    pub uptime_secs: u64,
    pub control: PathBuf,
    pub state_dir: PathBuf,
    /// The VCMP address and port (`--listen`).
    pub listen: SocketAddr,
    /// The cgroups vnatd was configured to enable at start.
    pub configured_cgroups: Vec<PathBuf>,
}

/// A failed request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub kind: ErrorKind,
    /// One sentence saying what was wrong and what to do.
    pub message: String,
}

/// Machine-readable class of a failed request; scripts match on these names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// Not JSON, not an object, or fields of the wrong shape.
    BadRequest,
    /// A `type` the daemon does not know.
    UnknownRequest,
    /// The client speaks another protocol version.
    UnsupportedVersion,
    /// The request line exceeded [`MAX_REQUEST_LINE`]; the connection is closed.
    RequestTooLarge,
    /// Well-formed but unacceptable arguments (for example a relative path).
    InvalidArgument,
    /// The datapath refused or failed; nothing was changed.
    Datapath,
    /// The selector matched no recorded connection; nothing was changed.
    NoMatch,
    /// This vnatd has no VCMP driver (or it stopped), so it cannot do
    /// mobility requests.
    Unavailable,
    /// VCMP refused: the connection cannot move (no keys, not tracked) or
    /// the imported state is unusable; nothing was changed.
    Mobility,
    /// A bug or a poisoned lock inside vnatd.
    Internal,
}

impl ErrorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::UnknownRequest => "unknown_request",
            ErrorKind::UnsupportedVersion => "unsupported_version",
            ErrorKind::RequestTooLarge => "request_too_large",
            ErrorKind::InvalidArgument => "invalid_argument",
            ErrorKind::Datapath => "datapath",
            ErrorKind::NoMatch => "no_match",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::Mobility => "mobility",
            ErrorKind::Internal => "internal",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::ConnectionInfo;

    #[test]
    fn request_wire_shape() {
        let req = RequestEnvelope {
            version: PROTOCOL_VERSION,
            request: Request::EnableCgroup {
                path: "/sys/fs/cgroup/unified/a".into(),
                hide_location: None,
            },
        };
        let line = serde_json::to_string(&req).expect("serializable");
        assert_eq!(
            line,
            r#"{"version":1,"request":{"type":"enable_cgroup","path":"/sys/fs/cgroup/unified/a"}}"#
        );
        let back: RequestEnvelope = serde_json::from_str(&line).expect("parses back");
        assert_eq!(back, req);
        let list: RequestEnvelope =
            serde_json::from_str(r#"{"version":1,"request":{"type":"list"}}"#).expect("list");
        assert_eq!(list.request, Request::List);
    }

    #[test]
    fn response_wire_shape() {
        let ok = ResponseEnvelope::ok(Reply::CgroupDisabled { path: "/x".into() });
        let line = serde_json::to_string(&ok).expect("serializable");
        assert_eq!(
            line,
            r#"{"version":1,"ok":{"type":"cgroup_disabled","path":"/x"}}"#
        );
        assert_eq!(
            serde_json::from_str::<ResponseEnvelope>(&line).expect("parses back"),
            ok
        );

        let err = ResponseEnvelope::error(ErrorKind::UnknownRequest, "no");
        let line = serde_json::to_string(&err).expect("serializable");
        assert_eq!(
            line,
            r#"{"version":1,"error":{"kind":"unknown_request","message":"no"}}"#
        );
        assert_eq!(
            serde_json::from_str::<ResponseEnvelope>(&line).expect("parses back"),
            err
        );
    }

    #[test]
    fn every_type_name_parses() {
        for t in Request::TYPES {
            let line = match *t {
                "enable_cgroup" | "disable_cgroup" => format!(r#"{{"type":"{t}","path":"/p"}}"#),
                "suspend" | "resume" | "export" | "ask_help" => {
                    format!(r#"{{"type":"{t}","selector":"all"}}"#)
                }
                "migrate" => {
                    format!(r#"{{"type":"{t}","selector":"all","to":{{"device":"wlan0"}}}}"#)
                }
                "import" => {
                    format!(r#"{{"type":"{t}","state":{{"vnat_export":1,"connections":[]}}}}"#)
                }
                "forget_peer" => format!(r#"{{"type":"{t}","key":"ab"}}"#),
                _ => format!(r#"{{"type":"{t}"}}"#),
            };
            serde_json::from_str::<Request>(&line)
                .unwrap_or_else(|e| panic!("{t} does not parse: {e}"));
        }
    }

    #[test]
    fn selector_wire_shapes() {
        let cases = [
            (Selector::All, r#""all""#),
            (Selector::Conns(vec![7, 9]), r#"{"conns":[7,9]}"#),
            (Selector::Pid(42), r#"{"pid":42}"#),
            (
                Selector::Cgroup("/sys/fs/cgroup/app".into()),
                r#"{"cgroup":"/sys/fs/cgroup/app"}"#,
            ),
        ];
        for (selector, wire) in cases {
            let req = Request::Suspend {
                selector: selector.clone(),
                helpers: Vec::new(),
            };
            let line = serde_json::to_string(&req).expect("serializable");
            assert_eq!(line, format!(r#"{{"type":"suspend","selector":{wire}}}"#));
            assert_eq!(
                serde_json::from_str::<Request>(&line).expect("parses back"),
                req
            );
        }
        for bad in [
            r#"{"type":"resume","selector":"some"}"#,
            r#"{"type":"resume","selector":{"pid":-1}}"#,
            r#"{"type":"resume","selector":{"pid":1,"all":null}}"#,
            r#"{"type":"resume"}"#,
        ] {
            assert!(
                serde_json::from_str::<Request>(bad).is_err(),
                "{bad} must not parse"
            );
        }
    }

    #[test]
    fn list_reply_keeps_the_record_keys_and_adds_mobile() {
        use crate::datapath::{ConnState, Proto};
        let addr = |s: &str| s.parse().expect("test address");
        let listed = ListedConnection {
            info: ConnectionInfo {
                id: 7,
                proto: Proto::Tcp,
                virtual_local: addr("198.18.1.2:40000"),
                virtual_remote: addr("198.18.3.2:5001"),
                physical_local: addr("198.18.1.2:40000"),
                physical_remote: addr("198.18.3.2:5001"),
                state: ConnState::Native,
                cookie: 1,
                cgroup_id: 2,
                cgroup: None,
                pid: None,
                command: None,
                age_secs: 3,
                recorded_ns: 0,
                tcp_isns: None,
                adopted: false,
                hide_location: false,
                udp_inbound_only: false,
                guest: None,
            },
            mobile: true,
            seen_by_peer_as: None,
            why_not_mobile: None,
            role: None,
            moving: false,
            keepalive_held: false,
            placed: None,
            helpers_asked: Vec::new(),
            helping: Vec::new(),
            last_move: None,
        };
        let v = serde_json::to_value(&listed).expect("serializable");
        let mut plain = serde_json::to_value(&listed.info).expect("serializable");
        plain["mobile"] = serde_json::json!(true);
        plain["role"] = serde_json::Value::Null;
        plain["moving"] = serde_json::json!(false);
        plain["keepalive_held"] = serde_json::json!(false);
        assert_eq!(
            v, plain,
            "mobile, role and moving are keys beside the record's"
        );
        let back: ListedConnection = serde_json::from_value(v).expect("parses back");
        assert_eq!(back, listed);
        // A vnatd from before `mobile` still speaks version 1: its records
        // read as not mobile (it could not move them either).
        let old: ListedConnection =
            serde_json::from_value(serde_json::to_value(&listed.info).expect("serializable"))
                .expect("a record without mobile parses");
        assert!(!old.mobile);
    }

    #[test]
    fn error_kind_names_match_serde() {
        for k in [
            ErrorKind::BadRequest,
            ErrorKind::UnknownRequest,
            ErrorKind::UnsupportedVersion,
            ErrorKind::RequestTooLarge,
            ErrorKind::InvalidArgument,
            ErrorKind::Datapath,
            ErrorKind::NoMatch,
            ErrorKind::Unavailable,
            ErrorKind::Mobility,
            ErrorKind::Internal,
        ] {
            assert_eq!(
                serde_json::to_value(k).expect("serializable"),
                serde_json::json!(k.as_str())
            );
        }
    }
}
