//! Turns one request line into one response, against the datapath and (for
//! mobility requests) the VCMP driver's command channel. No sockets here, so
//! the whole request logic is tested with the fake datapath and a scripted
//! driver.
//!
//! Selectors (`all`, connection ids, pid, cgroup) are resolved against the
//! datapath's records (`super::select`); an empty match is an error that
//! reaches neither the datapath nor the driver.

use std::{
    collections::HashMap,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};

use serde_json::Value;
use tokio::sync::oneshot;

pub use super::select::{resolve, SelectError};
use super::{
    command::{Command, CommandSender, Mobility},
    proto::{
        DaemonInfo, ErrorBody, ErrorKind, ImportedConnection, ListedConnection, MigrateReply,
        MigrateStarted, MigrateTarget, Outcome, Reply, Request, RequestEnvelope, ResponseEnvelope,
        ResumeReply, Selector, Skipped, StatusReply, SuspendReply, PROTOCOL_VERSION,
    },
    transfer::{self, ExportDocument, TransferError},
};
use crate::datapath::{
    owner::{DatapathGone, DatapathHandle},
    ConnectionInfo, Datapath, DatapathError, DatapathStatus, VirtualFlow,
};

/// Paths sent to vnatd must be absolute: the daemon's working directory is not
/// the client's.
fn require_absolute(path: &Path) -> Result<(), String> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(format!(
            "the cgroup path {} is relative; pass an absolute path (vnatctl makes paths absolute for you)",
            path.display()
        ))
    }
}

/// An optional host key given as 64 hex digits (`--to`, `--from`).
fn host_key(key: Option<&str>, what: &str) -> Result<Option<[u8; 32]>, RequestError> {
    key.map(|k| {
        crate::vcmp::crypto::parse_key_hex(k.trim()).ok_or_else(|| {
            RequestError::InvalidArgument(format!(
                "{what} {k:?} is not a host key: give the 64 hex digits `vnatctl status` shows on that host"
            ))
        })
    })
    .transpose()
}

/// What a datapath request did, before it becomes a [`Reply`].
enum Done {
    Status(DatapathStatus),
    Connections(Vec<ConnectionInfo>),
    Enabled(PathBuf, bool),
    Disabled(PathBuf),
    Misrouted,
}

/// Answers requests. Cheap to clone: one per connection.
#[derive(Clone)]
pub struct Handler {
    /// The datapath's owner, which runs what the requests ask of it.
    datapath: DatapathHandle,
    /// `uptime_secs` is filled in at each status request.
    info: Arc<std::sync::RwLock<DaemonInfo>>,
    started: Instant,
    /// The VCMP driver, for requests about mobility (absent in tests of the
    /// datapath-only requests).
    driver: Option<CommandSender>,
    /// Where the driver publishes move and pairing events (`monitor`).
    events: Option<super::events::EventHub>,
}

impl Handler {
    pub fn new(datapath: DatapathHandle, info: DaemonInfo) -> Self {
        Self {
            datapath,
            info: Arc::new(std::sync::RwLock::new(info)),
            started: Instant::now(),
            driver: None,
            events: None,
        }
    }

    /// Serve `monitor` from the events the driver publishes on `hub`.
    pub fn with_events(mut self, hub: super::events::EventHub) -> Self {
        self.events = Some(hub);
        self
    }

    /// A new monitoring subscription (None without an event hub).
    pub fn subscribe(&self) -> Option<super::events::Subscriber> {
        self.events.as_ref().map(|h| h.subscribe())
    }

    /// What `status` says of the daemon, shared with whoever changes it (a
    /// reload changes the configured cgroups).
    pub fn daemon_info(&self) -> Arc<std::sync::RwLock<DaemonInfo>> {
        self.info.clone()
    }

    /// Route mobility requests (suspend, resume, peers, export, import) and
    /// the `mobile` column of `list` to the VCMP driver.
    pub fn with_driver(mut self, driver: CommandSender) -> Self {
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

    /// Answer one parsed request. Mobility requests block until the driver
    /// answers, so call this from a blocking thread (the server runs it under
    /// `spawn_blocking`), never from an async task.
    pub fn handle(&self, request: &Request) -> ResponseEnvelope {
        let result = match request {
            Request::Status
            | Request::List
            | Request::EnableCgroup { .. }
            | Request::DisableCgroup { .. } => self.datapath_request(request),
            Request::Suspend { selector, .. }
            | Request::Resume { selector }
            | Request::Migrate { selector, .. }
            | Request::Export { selector, .. }
            | Request::AskHelp { selector, .. } => self.mobility_request(request, selector),
            Request::Peers => self
                .ask(|reply| Command::Peers { reply })
                .map(|peers| Reply::Peers { peers }),
            Request::ForgetPeer { key } => self.forget_peer(key),
            Request::Import { state, from } => self.import(state, from.as_deref()),
            // The server subscribes the connection once it sees this
            // answer (`server::serve_client`).
            Request::Monitor => match self.events {
                Some(_) => Ok(Reply::Monitoring),
                None => Err(RequestError::NoDriver),
            },
        };
        // The VCMP counters come from the driver.
        let result = match result {
            Ok(Reply::Status(mut st)) => {
                st.vcmp = self.ask(|reply| Command::Counters { reply }).ok();
                st.location = self.ask(|reply| Command::Location { reply }).ok();
                Ok(Reply::Status(st))
            }
            other => other,
        };
        match result {
            Ok(reply) => ResponseEnvelope::ok(reply),
            Err(e) => ResponseEnvelope::error(e.kind(), e.to_string()),
        }
    }

    fn datapath_request(&self, request: &Request) -> Result<Reply, RequestError> {
        if let Request::EnableCgroup { path, .. } | Request::DisableCgroup { path } = request {
            // Checked before the datapath sees it: bad input never reaches it.
            require_absolute(path).map_err(RequestError::InvalidArgument)?;
        }
        let req = request.clone();
        let asked = std::time::Instant::now();
        let (result, waited) = self
            .datapath
            .run_blocking(move |dp| {
                // How long the datapath thread's other work kept us.
                let waited = asked.elapsed();
                let r = match req {
                    Request::Status => dp.status().map(Done::Status),
                    Request::List => dp.connections().map(Done::Connections),
                    Request::EnableCgroup {
                        path,
                        hide_location,
                    } => enable(dp, path, hide_location),
                    Request::DisableCgroup { path } => {
                        dp.disable_cgroup(&path).map(|()| Done::Disabled(path))
                    }
                    _ => Ok(Done::Misrouted),
                };
                (r, waited)
            })
            .map_err(|DatapathGone| RequestError::DatapathGone)?;
        if let Ok(Done::Connections(c)) = &result {
            tracing::debug!(
                connections = c.len(),
                waited_ms = waited.as_millis() as u64,
                listed_ms = (asked.elapsed() - waited).as_millis() as u64,
                "control: list read from the datapath"
            );
        }
        log_change(request, result.as_ref().err());
        let mut reply = match result.map_err(RequestError::Datapath)? {
            Done::Status(datapath) => {
                let mut daemon = match self.info.read() {
                    Ok(i) => i.clone(),
                    Err(poisoned) => poisoned.into_inner().clone(),
                };
                daemon.uptime_secs = self.started.elapsed().as_secs();
                Reply::Status(Box::new(StatusReply {
                    daemon,
                    datapath,
                    vcmp: None,
                    location: None,
                }))
            }
            Done::Connections(connections) => Reply::Connections {
                connections: connections
                    .into_iter()
                    .map(|info| ListedConnection {
                        info,
                        mobile: false,
                        seen_by_peer_as: None,
                        why_not_mobile: None,
                        role: None,
                        moving: false,
                        keepalive_held: false,
                        placed: None,
                        helpers_asked: Vec::new(),
                        helping: Vec::new(),
                        last_move: None,
                    })
                    .collect(),
            },
            Done::Enabled(path, hide_location) => Reply::CgroupEnabled {
                path,
                hide_location,
            },
            Done::Disabled(path) => Reply::CgroupDisabled { path },
            Done::Misrouted => return Err(RequestError::Misrouted),
        };
        if let Reply::Connections { connections } = &mut reply {
            self.mark_mobile(connections);
        }
        Ok(reply)
    }

    /// The datapath's connection records.
    fn connections(&self) -> Result<Vec<ConnectionInfo>, RequestError> {
        self.datapath
            .run_blocking(|dp| dp.connections())
            .map_err(|DatapathGone| RequestError::DatapathGone)?
            .map_err(RequestError::Datapath)
    }

    /// Fill in `mobile` from VCMP. `list` must work without VCMP too (the
    /// datapath alone, or a stopped driver): then nothing is mobile.
    fn mark_mobile(&self, connections: &mut [ListedConnection]) {
        if self.driver.is_none() {
            for c in connections {
                c.why_not_mobile = Some("vnatd runs without VCMP".into());
            }
            return;
        }
        let asked = std::time::Instant::now();
        match self.ask(|reply| Command::Mobility { reply }) {
            Ok(mobility) => {
                tracing::debug!(
                    flows = mobility.len(),
                    took_ms = asked.elapsed().as_millis() as u64,
                    "control: list's mobility from the driver"
                );
                for c in connections {
                    let m = mobility.get(&flow_of(&c.info));
                    c.mobile = m.is_some_and(|m| m.mobile);
                    c.seen_by_peer_as = m.and_then(|m| m.seen_by_peer_as);
                    c.role = m.and_then(|m| m.role.clone());
                    c.keepalive_held = m.is_some_and(|m| m.keepalive_held);
                    c.placed = m.and_then(|m| m.placed);
                    c.helpers_asked = m.map(|m| m.helpers_asked.clone()).unwrap_or_default();
                    c.helping = m.map(|m| m.helping.clone()).unwrap_or_default();
                    c.last_move = m.and_then(|m| m.last_move.clone());
                    // Under way until the datapath sends from where VCMP
                    // has our end (after the peer's SWITCHED).
                    c.moving = m.is_some_and(|m| {
                        m.moving || m.local_phys.is_some_and(|l| l != c.info.physical_local)
                    });
                    c.why_not_mobile = match m {
                        Some(m) => m.why_not.clone(),
                        None => Some(NOT_MANAGED.into()),
                    };
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "control: cannot tell which connections are mobile")
            }
        }
    }

    /// Suspend, resume and export: resolve the selector against the
    /// datapath's records, then hand the flows to the driver.
    fn mobility_request(
        &self,
        request: &Request,
        selector: &Selector,
    ) -> Result<Reply, RequestError> {
        // Without a driver nothing below can work: say so before anything
        // else, whatever the selector.
        if self.driver.is_none() {
            return Err(RequestError::NoDriver);
        }
        let selected = {
            let connections = self.connections()?;
            let mount = if matches!(selector, Selector::Cgroup(_)) {
                crate::mounts::cgroup2_mount()
            } else {
                None
            };
            resolve(selector, &connections, mount.as_deref()).map_err(RequestError::Select)?
        };
        let ids: Vec<u64> = selected.iter().map(|c| c.id).collect();
        match request {
            Request::Suspend { helpers, .. } => {
                let help = crate::vcmp::help::Help::from_names(helpers)
                    .map_err(RequestError::InvalidArgument)?;
                let mobility = self.ask(|reply| Command::Mobility { reply })?;
                let (mobile, skipped) = split_mobile(&selected, &mobility);
                if mobile.is_empty() {
                    return Err(RequestError::NothingMobile {
                        selector: selector.to_string(),
                        count: selected.len(),
                    });
                }
                let suspended: Vec<u64> = mobile.iter().map(VirtualFlow::id).collect();
                let helped: Vec<u64> = self
                    .ask(|reply| Command::Suspend {
                        flows: mobile,
                        help: help.clone(),
                        reply,
                    })?
                    .map_err(|e| RequestError::Refused(e.to_string()))?
                    .iter()
                    .map(VirtualFlow::id)
                    .collect();
                tracing::info!(connections = ?suspended, helpers = ?help.names(), "control: suspend (planned move)");
                Ok(Reply::Suspended(SuspendReply {
                    suspended,
                    helped,
                    skipped,
                }))
            }
            Request::Resume { .. } => {
                let moves_started = self.ask(|reply| Command::Resume { reply })?;
                // What `--wait` waits for: the selected connections with a
                // move under way now, started by this resume or before it
                // (automatic mode is often first). One that ended since is
                // in the waiting client's subscription.
                let mobility = self.ask(|reply| Command::Mobility { reply })?;
                let moving: Vec<u64> = selected
                    .iter()
                    .filter(|c| {
                        mobility.get(&flow_of(c)).is_some_and(|m| {
                            m.last_move.as_ref().is_some_and(|l| {
                                l.side == vnat_control::Side::Local && l.outcome.is_none()
                            })
                        })
                    })
                    .map(|c| c.id)
                    .collect();
                tracing::info!(selected = ?ids, moves_started, ?moving, "control: resume");
                Ok(Reply::Resumed(ResumeReply {
                    selected: ids,
                    moves_started,
                    moving,
                }))
            }
            Request::Migrate { to, .. } => self.migrate(&selected, to),
            Request::AskHelp {
                helpers, wait_ms, ..
            } => {
                let help = crate::vcmp::help::Help::from_names(helpers)
                    .map_err(RequestError::InvalidArgument)?;
                let flows: Vec<VirtualFlow> = selected.iter().map(flow_of).collect();
                let wait = std::time::Duration::from_millis(u64::from((*wait_ms).min(2000)));
                let (asked, confirmed) = self.ask(|reply| Command::AskHelp {
                    flows,
                    help: help.clone(),
                    wait,
                    reply,
                })?;
                let ids = |v: Vec<VirtualFlow>| v.iter().map(VirtualFlow::id).collect::<Vec<_>>();
                let (asked, confirmed) = (ids(asked), ids(confirmed));
                tracing::info!(connections = ?asked, confirmed = ?confirmed, helpers = ?help.names(), "control: asked the peers for helpers");
                Ok(Reply::HelpAsked { asked, confirmed })
            }
            Request::Export { to, .. } => {
                let to = host_key(to.as_deref(), "--to")?;
                let flows: Vec<VirtualFlow> = selected.iter().map(flow_of).collect();
                let state = self
                    .ask(|reply| Command::Export { flows, to, reply })?
                    .map_err(RequestError::Transfer)?;
                tracing::info!(connections = ?ids, "control: exported connections (VCMP forgets them here)");
                Ok(Reply::Exported { state })
            }
            _ => Err(RequestError::Misrouted),
        }
    }

    /// `migrate`: each selected connection that can move goes to the
    /// target's address of its family, or, for an IPv4 connection and a
    /// target with only IPv6, to that (carried over IPv6 if its peer told
    /// an IPv6 address; the driver says so if not).
    fn migrate(
        &self,
        selected: &[ConnectionInfo],
        to: &MigrateTarget,
    ) -> Result<Reply, RequestError> {
        let addrs = self
            .datapath
            .run_blocking(|dp| dp.interface_addresses())
            .map_err(|DatapathGone| RequestError::DatapathGone)?
            .map_err(RequestError::Datapath)?;
        let ifindex = |name: &str| nix::net::if_::if_nametoindex(name).ok();
        let targets =
            migrate_targets(to, &addrs, ifindex).map_err(RequestError::InvalidArgument)?;
        let mobility = self.ask(|reply| Command::Mobility { reply })?;
        let (mobile, mut skipped) = split_mobile(selected, &mobility);
        let mut moves = Vec::new();
        for flow in mobile {
            let own = targets.iter().find(|a| a.is_ipv4() == flow.local.is_ipv4());
            let carried = targets.iter().find(|a| flow.local.is_ipv4() && a.is_ipv6());
            match own.or(carried) {
                Some(a) => moves.push((flow, *a)),
                None => skipped.push(Skipped {
                    id: flow.id(),
                    reason: format!(
                        "{to} has no IPv{} address",
                        if flow.local.is_ipv4() { 4 } else { 6 }
                    ),
                }),
            }
        }
        let outcomes = if moves.is_empty() {
            Vec::new()
        } else {
            self.ask(|reply| Command::Migrate { moves, reply })?
        };
        let mut started = Vec::new();
        for (flow, r) in outcomes {
            match r {
                Ok((from, to)) => started.push(MigrateStarted {
                    id: flow.id(),
                    from,
                    to,
                }),
                Err(why) => skipped.push(Skipped {
                    id: flow.id(),
                    reason: why.to_string(),
                }),
            }
        }
        if started.is_empty() {
            let why: Vec<String> = skipped
                .iter()
                .map(|s| format!("{}: {}", s.id, s.reason))
                .collect();
            return Err(RequestError::Refused(format!(
                "no connection moved to {to}: {}",
                why.join("; ")
            )));
        }
        let ids: Vec<u64> = started.iter().map(|s| s.id).collect();
        tracing::info!(connections = ?ids, %to, "control: migrate");
        Ok(Reply::Migrated(MigrateReply { started, skipped }))
    }

    fn forget_peer(&self, key: &str) -> Result<Reply, RequestError> {
        // Checked before the driver is involved: bad input changes nothing.
        let bytes = crate::vcmp::crypto::parse_key_hex(key.trim()).ok_or_else(|| {
            RequestError::InvalidArgument(format!(
                "{key:?} is not a host key: give the 64 hex digits `vnatctl peers` shows"
            ))
        })?;
        match self.ask(|reply| Command::ForgetPeer { key: bytes, reply })? {
            Some(connections) => Ok(Reply::PeerForgotten {
                key: crate::vcmp::crypto::key_hex(&bytes),
                connections,
            }),
            None => Err(RequestError::UnknownPeer(key.trim().to_string())),
        }
    }

    fn import(&self, state: &ExportDocument, from: Option<&str>) -> Result<Reply, RequestError> {
        // Refuse a bad document or key before the driver is involved.
        let from = host_key(from, "--from")?;
        transfer::validate(state).map_err(RequestError::Transfer)?;
        let state = state.clone();
        let outcomes = self
            .ask(|reply| Command::Import { state, from, reply })?
            .map_err(RequestError::Transfer)?;
        let connections = outcomes
            .into_iter()
            .map(|o| ImportedConnection {
                id: o.flow.id(),
                proto: o.flow.proto,
                virtual_local: o.flow.local,
                virtual_remote: o.flow.remote,
                physical_local: o.physical_local,
                physical_remote: o.physical_remote,
                moving: o.moving,
                move_pending: o.move_pending,
            })
            .collect();
        Ok(Reply::Imported { connections })
    }

    /// Send one command to the driver and wait for its answer. Runs on the
    /// blocking thread the server gives each request, so blocking here is
    /// what the channels' blocking calls are for.
    fn ask<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, RequestError> {
        let driver = self.driver.as_ref().ok_or(RequestError::NoDriver)?;
        let (reply, answer) = oneshot::channel();
        driver
            .blocking_send(command(reply))
            .map_err(|_| RequestError::DriverStopped)?;
        answer
            .blocking_recv()
            .map_err(|_| RequestError::DriverStopped)
    }
}

/// The virtual flow of a recorded connection.
fn flow_of(c: &ConnectionInfo) -> VirtualFlow {
    VirtualFlow {
        proto: c.proto,
        local: c.virtual_local,
        remote: c.virtual_remote,
    }
}

/// Split selected connections into the flows VCMP can move and the rest,
/// with a reason for each of the rest.
/// Why a recorded connection VCMP does not track cannot move.
const NOT_MANAGED: &str = "not managed by VCMP (local traffic, or recorded less than a second ago)";

fn split_mobile(
    selected: &[ConnectionInfo],
    mobility: &HashMap<VirtualFlow, Mobility>,
) -> (Vec<VirtualFlow>, Vec<Skipped>) {
    let mut mobile = Vec::new();
    let mut skipped = Vec::new();
    for c in selected {
        let flow = flow_of(c);
        match mobility.get(&flow) {
            Some(m) if m.mobile => mobile.push(flow),
            Some(m) => skipped.push(Skipped {
                id: c.id,
                reason: format!(
                    "no keys: {}",
                    m.why_not
                        .as_deref()
                        .unwrap_or("the peer runs no vnatd, or pairing has not completed")
                ),
            }),
            None => skipped.push(Skipped {
                id: c.id,
                reason: NOT_MANAGED.into(),
            }),
        }
    }
    (mobile, skipped)
}

/// The addresses `migrate` may move connections to: `to` itself, which
/// must be a global address of one of this host's interfaces (`addrs`,
/// with their interface index), or the global addresses of the interface
/// `to` names, in the kernel's order. An error sentence for anything else.
fn migrate_targets(
    to: &MigrateTarget,
    addrs: &[(IpAddr, u32)],
    ifindex: impl Fn(&str) -> Option<u32>,
) -> Result<Vec<IpAddr>, String> {
    match to {
        MigrateTarget::Address(a) => {
            if addrs.iter().any(|(x, _)| x == a) {
                Ok(vec![*a])
            } else {
                Err(format!(
                    "{a} is not a global address of any of this host's interfaces (loopback and link-local addresses cannot be moved to); `ip address` lists them"
                ))
            }
        }
        MigrateTarget::Device(name) => {
            let Some(i) = ifindex(name) else {
                return Err(format!(
                    "there is no interface {name:?} on this host; `ip link` lists them"
                ));
            };
            let here: Vec<IpAddr> = addrs
                .iter()
                .filter(|(_, x)| *x == i)
                .map(|(a, _)| *a)
                .collect();
            if here.is_empty() {
                return Err(format!(
                    "interface {name} has no global address to move to (is it up and configured?)"
                ));
            }
            Ok(here)
        }
    }
}

/// Why a request failed, and the error kind scripts see.
#[derive(Debug, thiserror::Error)]
enum RequestError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error(transparent)]
    Datapath(DatapathError),
    #[error(transparent)]
    Select(SelectError),
    #[error("none of the {count} connection(s) matching {selector} can move yet: their peers run no vnatd or pairing has not completed (vnatctl ls shows which are mobile)")]
    NothingMobile { selector: String, count: usize },
    #[error("VCMP refused: {0}")]
    Refused(String),
    #[error("no peer host has the key {0}; `vnatctl peers` lists the known ones")]
    UnknownPeer(String),
    #[error(transparent)]
    Transfer(TransferError),
    #[error("this vnatd runs without its VCMP driver, so it cannot suspend, resume, export or import connections, list peers or stream move events; run vnatd as a service (not only its control API)")]
    NoDriver,
    #[error("vnatd's VCMP driver has stopped; see vnatd's log (journalctl -u vnatd) and restart vnatd (translation continues meanwhile)")]
    DriverStopped,
    #[error("{}", DatapathGone)]
    DatapathGone,
    #[error("vnatd routed a request to the wrong handler; this is a bug, please report it")]
    Misrouted,
}

impl RequestError {
    fn kind(&self) -> ErrorKind {
        match self {
            RequestError::InvalidArgument(_) | RequestError::Select(SelectError::NoIds) => {
                ErrorKind::InvalidArgument
            }
            RequestError::Select(SelectError::RelativeCgroup { .. }) => ErrorKind::InvalidArgument,
            RequestError::Select(_) | RequestError::UnknownPeer(_) => ErrorKind::NoMatch,
            RequestError::Datapath(_) => ErrorKind::Datapath,
            RequestError::Transfer(TransferError::Datapath(_)) => ErrorKind::Datapath,
            RequestError::Transfer(
                TransferError::Format { .. }
                | TransferError::Empty
                | TransferError::IdMismatch { .. },
            ) => ErrorKind::InvalidArgument,
            RequestError::NothingMobile { .. }
            | RequestError::Refused(_)
            | RequestError::Transfer(_) => ErrorKind::Mobility,
            RequestError::NoDriver | RequestError::DriverStopped => ErrorKind::Unavailable,
            RequestError::DatapathGone | RequestError::Misrouted => ErrorKind::Internal,
        }
    }
}

/// Enable a cgroup and, if asked, turn hiding location on or off for it,
/// all or nothing: hiding is set first (a map entry, undone if enabling
/// fails), so that no moment exists where the cgroup is recorded but not
/// yet hidden as asked. A cgroup that an enabled one above already covers
/// (its connections are managed already) only has its hiding set:
/// attaching the programs there too would run them twice on its sockets.
fn enable(
    dp: &mut dyn Datapath,
    path: PathBuf,
    hide_location: Option<bool>,
) -> Result<Done, DatapathError> {
    let before = dp.status()?.cgroups;
    let was_hiding = before.iter().any(|c| c.path == path && c.hide_location);
    // A listed cgroup above it has programs, or is listed for hiding
    // under one that has.
    let covered = before
        .iter()
        .any(|c| c.path != path && path.starts_with(&c.path));
    let changed = match hide_location {
        Some(on) => dp.set_hide_location(&path, on)?,
        None => false,
    };
    if !covered {
        if let Err(e) = dp.enable_cgroup(&path) {
            if let (true, Some(on)) = (changed, hide_location) {
                let _ = dp.set_hide_location(&path, !on);
            }
            return Err(e);
        }
    }
    Ok(Done::Enabled(path, hide_location.unwrap_or(was_hiding)))
}

fn log_change(request: &Request, error: Option<&DatapathError>) {
    let (action, path): (&str, &Path) = match request {
        Request::EnableCgroup {
            path,
            hide_location: Some(true),
        } => ("enable (hide location) of", path),
        Request::EnableCgroup {
            path,
            hide_location: Some(false),
        } => ("enable (location shown) of", path),
        Request::EnableCgroup { path, .. } => ("enable", path),
        Request::DisableCgroup { path } => ("disable", path),
        _ => return,
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
    // Typed parse from the bytes again, not from `value`: serde_json's
    // `Value` cannot hold a u128, which the import document has (the replay
    // window's bitmap).
    serde_json::from_slice::<RequestEnvelope>(line)
        .map(|envelope| envelope.request)
        .map_err(|e| {
            bad(
                ErrorKind::BadRequest,
                format!("malformed {} request: {e}", kind.unwrap_or("?")),
            )
        })
}
