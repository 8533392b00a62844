//! The client side of the control socket, used by vnatctl and tests.

use std::{
    io,
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::{
    io::{AsyncWriteExt, BufReader},
    net::{
        unix::{OwnedReadHalf, OwnedWriteHalf},
        UnixStream,
    },
};

use crate::{
    lines::{read_line_bounded_into, Line},
    monitor::MonitorEvent,
    proto::{
        AnswerHead, ConnectionsAnswer, ErrorBody, ErrorKind, ImportedConnection, ListedConnection,
        MigrateReply, MigrateTarget, Outcome, PeerInfo, Reply, Request, RequestEnvelope,
        ResponseEnvelope, ResumeReply, Selector, StatusReply, SuspendReply, MAX_RESPONSE_LINE,
        PROTOCOL_VERSION,
    },
    transfer::ExportDocument,
};

/// Default bound on connecting and on each request's round trip.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// What went wrong talking to vnatd.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot reach vnatd at {}: {}; {}", path.display(), os_reason(source), unreachable_hint(source))]
    Unreachable {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("vnatd at {} did not answer within {} s; check its log (journalctl -u vnatd)", path.display(), timeout.as_secs())]
    Timeout { path: PathBuf, timeout: Duration },
    #[error("lost the connection to vnatd at {}: {}; check its log (journalctl -u vnatd)", path.display(), os_reason(source))]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("vnatd at {} sent an answer this vnatctl cannot read ({violation}); use a vnatctl from the same release as vnatd", path.display())]
    Protocol {
        path: PathBuf,
        violation: ProtocolViolation,
    },
    /// vnatd understood the request and refused it.
    #[error("{message}")]
    Daemon { kind: ErrorKind, message: String },
}

/// How an answer from vnatd broke the protocol.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolViolation {
    #[error("it closed the connection without answering")]
    Closed,
    #[error("the answer is longer than {MAX_RESPONSE_LINE} bytes")]
    TooLong,
    #[error("the answer is not a valid response: {0}")]
    Malformed(#[source] serde_json::Error),
    #[error("it speaks control protocol version {found}, this client {PROTOCOL_VERSION}")]
    Version { found: u32 },
    #[error("a {got} answer to a {asked} request")]
    UnexpectedReply {
        asked: &'static str,
        got: &'static str,
    },
}

impl ClientError {
    /// Whether the daemon could not be talked to at all (vnatctl exit code 3),
    /// as opposed to a daemon that answered with an error.
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            ClientError::Unreachable { .. } | ClientError::Timeout { .. }
        )
    }
}

/// A connection to vnatd's control socket. Requests are answered in order.
pub struct ControlClient {
    path: PathBuf,
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    timeout: Duration,
    /// What was read of a response line not yet complete: a read dropped
    /// at a caller's timeout ([`Subscription::next`] under
    /// `tokio::time::timeout`) resumes there.
    partial: Vec<u8>,
}

impl ControlClient {
    /// Connect with [`DEFAULT_TIMEOUT`].
    pub async fn connect(path: &Path) -> Result<Self, ClientError> {
        Self::connect_with_timeout(path, DEFAULT_TIMEOUT).await
    }

    /// Connect; `timeout` bounds the connect and each later request.
    pub async fn connect_with_timeout(path: &Path, timeout: Duration) -> Result<Self, ClientError> {
        let stream = tokio::time::timeout(timeout, UnixStream::connect(path))
            .await
            .map_err(|_| ClientError::Timeout {
                path: path.to_path_buf(),
                timeout,
            })?
            .map_err(|source| ClientError::Unreachable {
                path: path.to_path_buf(),
                source,
            })?;
        let (read, writer) = stream.into_split();
        Ok(Self {
            path: path.to_path_buf(),
            reader: BufReader::new(read),
            writer,
            timeout,
            partial: Vec::new(),
        })
    }

    /// Send one request and wait for its answer. A daemon-side error comes
    /// back as [`ClientError::Daemon`].
    pub async fn request(&mut self, request: Request) -> Result<Reply, ClientError> {
        let timeout = self.timeout;
        tokio::time::timeout(timeout, self.round_trip(request))
            .await
            .map_err(|_| ClientError::Timeout {
                path: self.path.clone(),
                timeout,
            })?
    }

    pub async fn status(&mut self) -> Result<StatusReply, ClientError> {
        match self.request(Request::Status).await? {
            Reply::Status(status) => Ok(*status),
            other => Err(self.unexpected("status", &other)),
        }
    }

    pub async fn list(&mut self) -> Result<Vec<ListedConnection>, ClientError> {
        match self.request(Request::List).await? {
            Reply::Connections { connections } => Ok(connections),
            other => Err(self.unexpected("list", &other)),
        }
    }

    pub async fn enable_cgroup(&mut self, path: &Path) -> Result<PathBuf, ClientError> {
        self.enable_cgroup_hiding(path, None)
            .await
            .map(|(path, _)| path)
    }

    /// Enable a cgroup and turn hiding location on or off for it (`None`:
    /// leave it): the cgroup and whether it now hides.
    pub async fn enable_cgroup_hiding(
        &mut self,
        path: &Path,
        hide_location: Option<bool>,
    ) -> Result<(PathBuf, bool), ClientError> {
        match self
            .request(Request::EnableCgroup {
                path: path.to_path_buf(),
                hide_location,
            })
            .await?
        {
            Reply::CgroupEnabled {
                path,
                hide_location,
            } => Ok((path, hide_location)),
            other => Err(self.unexpected("enable_cgroup", &other)),
        }
    }

    pub async fn disable_cgroup(&mut self, path: &Path) -> Result<PathBuf, ClientError> {
        match self
            .request(Request::DisableCgroup {
                path: path.to_path_buf(),
            })
            .await?
        {
            Reply::CgroupDisabled { path } => Ok(path),
            other => Err(self.unexpected("disable_cgroup", &other)),
        }
    }

    pub async fn suspend(
        &mut self,
        selector: Selector,
        helpers: Vec<String>,
    ) -> Result<SuspendReply, ClientError> {
        match self.request(Request::Suspend { selector, helpers }).await? {
            Reply::Suspended(r) => Ok(r),
            other => Err(self.unexpected("suspend", &other)),
        }
    }

    /// Ask the selected connections' peers for `helpers` without
    /// suspending (none: this host is back), waiting up to `wait_ms` for
    /// their confirmations: (ids asked, ids confirmed).
    pub async fn ask_help(
        &mut self,
        selector: Selector,
        helpers: Vec<String>,
        wait_ms: u32,
    ) -> Result<(Vec<u64>, Vec<u64>), ClientError> {
        match self
            .request(Request::AskHelp {
                selector,
                helpers,
                wait_ms,
            })
            .await?
        {
            Reply::HelpAsked { asked, confirmed } => Ok((asked, confirmed)),
            other => Err(self.unexpected("ask_help", &other)),
        }
    }

    pub async fn resume(&mut self, selector: Selector) -> Result<ResumeReply, ClientError> {
        match self.request(Request::Resume { selector }).await? {
            Reply::Resumed(r) => Ok(r),
            other => Err(self.unexpected("resume", &other)),
        }
    }

    pub async fn migrate(
        &mut self,
        selector: Selector,
        to: MigrateTarget,
    ) -> Result<MigrateReply, ClientError> {
        match self.request(Request::Migrate { selector, to }).await? {
            Reply::Migrated(r) => Ok(r),
            other => Err(self.unexpected("migrate", &other)),
        }
    }

    pub async fn peers(&mut self) -> Result<Vec<PeerInfo>, ClientError> {
        match self.request(Request::Peers).await? {
            Reply::Peers { peers } => Ok(peers),
            other => Err(self.unexpected("peers", &other)),
        }
    }

    /// Forget a peer host key; how many connections it held.
    pub async fn forget_peer(&mut self, key: &str) -> Result<usize, ClientError> {
        match self
            .request(Request::ForgetPeer {
                key: key.to_string(),
            })
            .await?
        {
            Reply::PeerForgotten { connections, .. } => Ok(connections),
            other => Err(self.unexpected("peer_forgotten", &other)),
        }
    }

    /// The selected connections' state, keys included: a secret, sealed
    /// for the host whose key is `to` (this one when `None`).
    pub async fn export(
        &mut self,
        selector: Selector,
        to: Option<String>,
    ) -> Result<ExportDocument, ClientError> {
        match self.request(Request::Export { selector, to }).await? {
            Reply::Exported { state } => Ok(state),
            other => Err(self.unexpected("export", &other)),
        }
    }

    /// Import a document sealed by the host whose key is `from` (this one
    /// when `None`).
    pub async fn import(
        &mut self,
        state: ExportDocument,
        from: Option<String>,
    ) -> Result<Vec<ImportedConnection>, ClientError> {
        match self.request(Request::Import { state, from }).await? {
            Reply::Imported { connections } => Ok(connections),
            other => Err(self.unexpected("import", &other)),
        }
    }

    /// Subscribe to vnatd's events (`vnatctl monitor`): once this returns,
    /// every later event reaches the subscription, so a command sent
    /// afterwards (on another connection) cannot end unseen.
    pub async fn subscribe(mut self) -> Result<Subscription, ClientError> {
        match self.request(Request::Monitor).await? {
            Reply::Monitoring => Ok(Subscription { client: self }),
            other => Err(self.unexpected("monitor", &other)),
        }
    }

    async fn round_trip(&mut self, request: Request) -> Result<Reply, ClientError> {
        let io_err = |source| ClientError::Io {
            path: self.path.clone(),
            source,
        };
        let mut line = serde_json::to_vec(&RequestEnvelope {
            version: PROTOCOL_VERSION,
            request,
        })
        .map_err(|e| io_err(io::Error::other(e)))?;
        line.push(b'\n');
        self.writer.write_all(&line).await.map_err(io_err)?;
        self.read_reply().await
    }

    /// Read one response line.
    async fn read_reply(&mut self) -> Result<Reply, ClientError> {
        let io_err = |source| ClientError::Io {
            path: self.path.clone(),
            source,
        };
        let protocol = |violation| ClientError::Protocol {
            path: self.path.clone(),
            violation,
        };
        let answer =
            match read_line_bounded_into(&mut self.reader, MAX_RESPONSE_LINE, &mut self.partial)
                .await
                .map_err(io_err)?
            {
                Line::Data(answer) => answer,
                Line::Eof => return Err(protocol(ProtocolViolation::Closed)),
                Line::TooLong => return Err(protocol(ProtocolViolation::TooLong)),
            };
        match decode_reply(&answer) {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(body)) => Err(ClientError::Daemon {
                kind: body.kind,
                message: body.message,
            }),
            Err(violation) => Err(protocol(violation)),
        }
    }

    fn unexpected(&self, asked: &'static str, got: &Reply) -> ClientError {
        let got = got.type_name();
        ClientError::Protocol {
            path: self.path.clone(),
            violation: ProtocolViolation::UnexpectedReply { asked, got },
        }
    }
}

/// A monitoring connection ([`ControlClient::subscribe`]).
pub struct Subscription {
    client: ControlClient,
}

impl Subscription {
    /// The next event, waiting as long as it takes; `None` once vnatd
    /// closed the connection (it stopped).
    pub async fn next(&mut self) -> Result<Option<MonitorEvent>, ClientError> {
        match self.client.read_reply().await {
            Ok(Reply::Event(ev)) => Ok(Some(ev)),
            Ok(other) => Err(self.client.unexpected("monitor", &other)),
            Err(ClientError::Protocol {
                violation: ProtocolViolation::Closed,
                ..
            }) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[derive(serde::Deserialize)]
struct VersionOnly {
    version: u32,
}

/// `Reply::Connections`'s tag on the wire.
const CONNECTIONS_TYPE: &str = "connections";

/// One response line: the daemon's reply or its error, or what is wrong
/// with the line.
fn decode_reply(answer: &[u8]) -> Result<Result<Reply, ErrorBody>, ProtocolViolation> {
    // Check the version before the shape, so a newer daemon's unknown
    // reply types are reported as a version mismatch, not as garbage.
    // The version and the reply's type in one pass; if what follows the
    // version has a shape the head does not expect, the version alone.
    let head = match serde_json::from_slice::<AnswerHead>(answer) {
        Ok(h) => Some((h.version, h.ok.and_then(|t| t.kind))),
        Err(_) => serde_json::from_slice::<VersionOnly>(answer)
            .ok()
            .map(|v| (v.version, None)),
    };
    if let Some((version, _)) = &head {
        if *version != PROTOCOL_VERSION {
            return Err(ProtocolViolation::Version { found: *version });
        }
    }
    // A list, which may hold 100,000 connections, is read straight into
    // its type (`ConnectionsAnswer`); everything else through the
    // envelope, whose internally tagged reply is read into a buffer first.
    let kind = head.and_then(|(_, kind)| kind);
    if kind.as_deref() == Some(CONNECTIONS_TYPE) {
        let list: ConnectionsAnswer =
            serde_json::from_slice(answer).map_err(ProtocolViolation::Malformed)?;
        return Ok(Ok(Reply::Connections {
            connections: list.ok.connections,
        }));
    }
    let response: ResponseEnvelope =
        serde_json::from_slice(answer).map_err(ProtocolViolation::Malformed)?;
    Ok(match response.outcome {
        Outcome::Ok(reply) => Ok(reply),
        Outcome::Error(body) => Err(body),
    })
}

/// "No such file or directory" rather than "No such file or directory (os
/// error 2)": the sentence is for people.
fn os_reason(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(code) => nix::errno::Errno::from_raw(code).desc().to_string(),
        None => e.to_string(),
    }
}

fn unreachable_hint(e: &io::Error) -> &'static str {
    match e.kind() {
        io::ErrorKind::PermissionDenied => {
            "the control socket is only open to its owner; run vnatctl as root (or with sudo)"
        }
        _ => "is vnatd running? (start it with: systemctl start vnatd)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_answer_reads_as_the_envelope_does() {
        let listed: ListedConnection = serde_json::from_str(
            r#"{"id":1,"proto":"tcp","virtual_local":"10.0.0.1:1","virtual_remote":"10.0.0.2:2",
            "physical_local":"10.0.0.1:1","physical_remote":"10.0.0.2:2","state":"native",
            "cookie":3,"cgroup_id":0,"cgroup":null,"pid":null,"command":null,"age_secs":0,
            "mobile":true}"#,
        )
        .expect("a listing");
        let reply = Reply::Connections {
            connections: vec![listed.clone(), listed],
        };
        let line = serde_json::to_vec(&ResponseEnvelope::ok(reply.clone())).expect("JSON");
        assert_eq!(decode_reply(&line).expect("decodes"), Ok(reply));
        // An empty list, and other replies and errors, as before.
        let empty = Reply::Connections {
            connections: vec![],
        };
        let line = serde_json::to_vec(&ResponseEnvelope::ok(empty.clone())).expect("JSON");
        assert_eq!(decode_reply(&line).expect("decodes"), Ok(empty));
        let other = Reply::CgroupDisabled { path: "/x".into() };
        let line = serde_json::to_vec(&ResponseEnvelope::ok(other.clone())).expect("JSON");
        assert_eq!(decode_reply(&line).expect("decodes"), Ok(other));
        let line =
            serde_json::to_vec(&ResponseEnvelope::error(ErrorKind::Datapath, "no")).expect("JSON");
        let body = decode_reply(&line).expect("decodes").expect_err("an error");
        assert_eq!(
            (body.kind, body.message.as_str()),
            (ErrorKind::Datapath, "no")
        );
    }

    #[test]
    fn a_bad_list_answer_is_a_protocol_violation() {
        // Another version, whatever follows.
        let v = decode_reply(br#"{"version":99,"ok":{"type":"connections","connections":7}}"#);
        assert!(matches!(v, Err(ProtocolViolation::Version { found: 99 })));
        let v = decode_reply(br#"{"version":2,"ok":["a","reply","of","another","shape"]}"#);
        assert!(
            matches!(v, Err(ProtocolViolation::Version { found: 2 })),
            "{v:?}"
        );
        let v = decode_reply(br#"{"version":2,"ok":{"type":7}}"#);
        assert!(
            matches!(v, Err(ProtocolViolation::Version { found: 2 })),
            "{v:?}"
        );
        // A list whose element is not a connection.
        let v =
            decode_reply(br#"{"version":1,"ok":{"type":"connections","connections":[{"id":1}]}}"#);
        assert!(matches!(v, Err(ProtocolViolation::Malformed(_))), "{v:?}");
        // Not JSON at all.
        let v = decode_reply(b"connections");
        assert!(matches!(v, Err(ProtocolViolation::Malformed(_))), "{v:?}");
    }

    #[tokio::test]
    async fn unreachable_daemon_error_is_one_clear_sentence() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("vnatd.sock");
        let e = match ControlClient::connect(&path).await {
            Err(e) => e,
            Ok(_) => panic!("connected to nothing"),
        };
        assert!(e.is_unreachable());
        assert_eq!(
            e.to_string(),
            format!(
                "cannot reach vnatd at {}: No such file or directory; is vnatd running? (start it with: systemctl start vnatd)",
                path.display()
            )
        );
    }
}
