//! The control protocol's wire types: one JSON object per line each way.
//!
//! A request is `{"version":1,"request":{"type":"list"}}`; the answer is
//! `{"version":1,"ok":{"type":"connections","connections":[...]}}` or
//! `{"version":1,"error":{"kind":"bad_request","message":"..."}}`. The
//! version is checked on every request so that a vnatctl and a vnatd from
//! different releases fail with a clear sentence instead of misreading each
//! other.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::datapath::{ConnectionInfo, DatapathStatus};

/// The protocol version this build speaks. Bump it on any incompatible change
/// to [`Request`] or [`Reply`].
pub const PROTOCOL_VERSION: u32 = 1;

/// Longest accepted line (request or response), newline excluded. Requests are
/// tiny; the bound only keeps a broken or hostile client from making vnatd
/// buffer without limit. Responses (a long `ls`) are allowed to be larger.
pub const MAX_REQUEST_LINE: usize = 64 * 1024;

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
    /// Start recording connections of a cgroup v2 directory (absolute path).
    EnableCgroup { path: PathBuf },
    /// Stop recording them.
    DisableCgroup { path: PathBuf },
}

impl Request {
    /// The `type` names a server accepts, for the "unknown request" error.
    pub const TYPES: &'static [&'static str] =
        &["status", "list", "enable_cgroup", "disable_cgroup"];
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
    Connections { connections: Vec<ConnectionInfo> },
    CgroupEnabled { path: PathBuf },
    CgroupDisabled { path: PathBuf },
}

/// The answer to [`Request::Status`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReply {
    pub daemon: DaemonInfo,
    pub datapath: DatapathStatus,
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
    /// The VCMP address; parsed and reported, not yet listened on.
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
            ErrorKind::Internal => "internal",
        }
    }
}

impl std::fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Paths sent to vnatd must be absolute: the daemon's working directory is not
/// the client's.
pub(crate) fn require_absolute(path: &Path) -> Result<(), String> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(format!(
            "the cgroup path {} is relative; pass an absolute path (vnatctl makes paths absolute for you)",
            path.display()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_wire_shape() {
        let req = RequestEnvelope {
            version: PROTOCOL_VERSION,
            request: Request::EnableCgroup {
                path: "/sys/fs/cgroup/unified/a".into(),
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
                _ => format!(r#"{{"type":"{t}"}}"#),
            };
            serde_json::from_str::<Request>(&line)
                .unwrap_or_else(|e| panic!("{t} does not parse: {e}"));
        }
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
            ErrorKind::Internal,
        ] {
            assert_eq!(
                serde_json::to_value(k).expect("serializable"),
                serde_json::json!(k.as_str())
            );
        }
    }
}
