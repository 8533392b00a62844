//! Turns one request line into one response, against the datapath. No I/O
//! here besides the datapath calls, so the whole request logic is tested
//! without sockets.

use std::{
    path::Path,
    sync::{Arc, Mutex},
    time::Instant,
};

use serde_json::Value;

use super::proto::{
    require_absolute, DaemonInfo, ErrorBody, ErrorKind, Outcome, Reply, Request, RequestEnvelope,
    ResponseEnvelope, StatusReply, PROTOCOL_VERSION,
};
use crate::datapath::Datapath;

/// The datapath as the daemon shares it between the control API and (later)
/// the VCMP driver. A std mutex is enough: every datapath call is short and
/// synchronous, and the server makes them from blocking threads.
pub type SharedDatapath = Arc<Mutex<Box<dyn Datapath + Send>>>;

/// Wrap a datapath for sharing.
pub fn share(datapath: Box<dyn Datapath + Send>) -> SharedDatapath {
    Arc::new(Mutex::new(datapath))
}

/// Answers requests. Cheap to clone: one per connection.
#[derive(Clone)]
pub struct Handler {
    datapath: SharedDatapath,
    /// `uptime_secs` is filled in at each status request.
    info: Arc<DaemonInfo>,
    started: Instant,
    /// The VCMP driver, for requests about mobility (absent in tests of the
    /// datapath-only requests).
    driver: Option<crate::daemon::driver::CommandSender>,
}

impl Handler {
    pub fn new(datapath: SharedDatapath, info: DaemonInfo) -> Self {
        Self {
            datapath,
            info: Arc::new(info),
            started: Instant::now(),
            driver: None,
        }
    }

    /// Route mobility requests (suspend, resume, peers) to the VCMP driver.
    pub fn with_driver(mut self, driver: crate::daemon::driver::CommandSender) -> Self {
        self.driver = Some(driver);
        self
    }

    /// Parse and answer one line (without its newline).
    pub fn handle_line(&self, line: &[u8]) -> ResponseEnvelope {
        match parse_request(line) {
            Ok(request) => self.handle(&request),
            Err(body) => ResponseEnvelope {
                version: PROTOCOL_VERSION,
                outcome: Outcome::Error(body),
            },
        }
    }

    /// Answer one parsed request.
    pub fn handle(&self, request: &Request) -> ResponseEnvelope {
        if let Request::EnableCgroup { path } | Request::DisableCgroup { path } = request {
            // Checked before taking the lock: bad input never reaches the datapath.
            if let Err(message) = require_absolute(path) {
                return ResponseEnvelope::error(ErrorKind::InvalidArgument, message);
            }
        }
        let mut datapath = match self.datapath.lock() {
            Ok(guard) => guard,
            Err(_) => {
                // A datapath call panicked while holding the lock; its state is
                // unknown, so refuse rather than act on it.
                return ResponseEnvelope::error(
                    ErrorKind::Internal,
                    "an earlier datapath operation crashed inside vnatd; restart vnatd (translation continues meanwhile)",
                );
            }
        };
        let result = match request {
            Request::Status => datapath.status().map(|datapath| {
                let mut daemon = (*self.info).clone();
                daemon.uptime_secs = self.started.elapsed().as_secs();
                Reply::Status(Box::new(StatusReply { daemon, datapath }))
            }),
            Request::List => datapath
                .connections()
                .map(|connections| Reply::Connections { connections }),
            Request::EnableCgroup { path } => datapath
                .enable_cgroup(path)
                .map(|()| Reply::CgroupEnabled { path: path.clone() }),
            Request::DisableCgroup { path } => datapath
                .disable_cgroup(path)
                .map(|()| Reply::CgroupDisabled { path: path.clone() }),
        };
        match result {
            Ok(reply) => {
                log_change(request, None);
                ResponseEnvelope::ok(reply)
            }
            Err(e) => {
                log_change(request, Some(&e));
                ResponseEnvelope::error(ErrorKind::Datapath, e.to_string())
            }
        }
    }
}

fn log_change(request: &Request, error: Option<&crate::datapath::DatapathError>) {
    let (action, path): (&str, &Path) = match request {
        Request::EnableCgroup { path } => ("enable", path),
        Request::DisableCgroup { path } => ("disable", path),
        Request::Status | Request::List => return,
    };
    match error {
        None => tracing::info!(cgroup = %path.display(), "control: {action} cgroup"),
        Some(e) => {
            tracing::warn!(cgroup = %path.display(), error = %e, "control: {action} cgroup failed")
        }
    }
}

/// Parse a request line in steps, so that each way of being wrong gets its
/// own sentence (serde's message alone would not list the valid types).
pub fn parse_request(line: &[u8]) -> Result<Request, ErrorBody> {
    let bad = |kind, message: String| ErrorBody { kind, message };
    const EXAMPLE: &str = r#"{"version":1,"request":{"type":"status"}}"#;
    let value: Value = serde_json::from_slice(line).map_err(|e| {
        bad(ErrorKind::BadRequest, format!("the request is not valid JSON ({e}); send one JSON object per line, such as {EXAMPLE}"))
    })?;
    let Some(object) = value.as_object() else {
        return Err(bad(
            ErrorKind::BadRequest,
            format!("the request must be a JSON object, such as {EXAMPLE}"),
        ));
    };
    match object.get("version").and_then(Value::as_u64) {
        Some(v) if v == u64::from(PROTOCOL_VERSION) => {}
        Some(v) => {
            return Err(bad(
                ErrorKind::UnsupportedVersion,
                format!(
                    "this vnatd speaks control protocol version {PROTOCOL_VERSION} but the client sent version {v}; use a vnatctl from the same release as vnatd"
                ),
            ))
        }
        None => {
            return Err(bad(
                ErrorKind::BadRequest,
                format!("the request has no numeric \"version\" field; send {{\"version\":{PROTOCOL_VERSION},\"request\":{{...}}}}"),
            ))
        }
    }
    let kind = object
        .get("request")
        .and_then(|r| r.get("type"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let kind = kind.as_deref();
    let valid = Request::TYPES.join(", ");
    match kind {
        Some(t) if Request::TYPES.contains(&t) => {}
        Some(t) => {
            return Err(bad(
                ErrorKind::UnknownRequest,
                format!("unknown request type \"{t}\"; valid types are: {valid}"),
            ))
        }
        None => {
            return Err(bad(
                ErrorKind::BadRequest,
                format!(
                "the request has no \"request\":{{\"type\":...}} field; valid types are: {valid}"
            ),
            ))
        }
    }
    serde_json::from_value::<RequestEnvelope>(value)
        .map(|envelope| envelope.request)
        .map_err(|e| {
            bad(
                ErrorKind::BadRequest,
                format!("malformed {} request: {e}", kind.unwrap_or("?")),
            )
        })
}
