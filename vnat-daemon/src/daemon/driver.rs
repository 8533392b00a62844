//! The one I/O driver of VCMP (STYLE.md): it owns the UDP socket, the
//! clock, the randomness and the timers, feeds the sans-IO protocol core
//! ([`crate::vcmp::Endpoint`]) and applies its events to the datapath.
//!
//! Connections come from the datapath's records (every second and on every
//! address change); automatic mode moves the ones whose local address
//! vanished (see [`super::mobility`]). A move is applied in the order that
//! never lets a kernel reset the connection: receive side first
//! (`prepare_translation`), then `UPD` to the peer, which switches both
//! directions when it has validated our new address, then our send side on
//! `UPD_R`.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use rand_core::OsRng;
use tokio::{
    net::UdpSocket,
    sync::{mpsc, oneshot},
};

use super::{
    addrwatch::AddrWatch,
    identity::{self, PeerStore, StateError},
    mobility::{self, Tracked},
    mover::{Mover, Step, Switch, HOLD_LIMIT},
};
use crate::{
    control::{
        transfer::{self, ExportDocument, ExportedConnection, ImportOutcome, TransferError},
        SharedDatapath,
    },
    datapath::{Datapath, DatapathError, Translation, VirtualFlow},
    vcmp::{self, crypto::HostIdentity, Endpoint, Event, Timestamp},
};

/// How often the recorded connections are re-read even without an address
/// change (new connections to pair for): at least this often, and at most
/// [`RESYNC_SHARE`] of the time: with 100,000 connections one resync takes
/// a few hundred milliseconds, and once a second it took a third of the
/// daemon's time, in the middle of moving them.
const RESYNC_INTERVAL: Duration = Duration::from_secs(1);
const RESYNC_SHARE: u32 = 10;
/// Most VCMP datagrams handled in one loop turn before the datapath work
/// they call for (a full one carries up to 30 records).
const DATAGRAMS_PER_TURN: usize = 64;

/// Up to this many connections translated in one turn get the restart
/// levers that wait to see each socket act; more get them without waiting
/// (`Datapath::kick_flow`), or one backed-off socket after another would
/// hold up a mass move by 20 ms to 1.2 s each.
const VERIFIED_RESTARTS_MAX: usize = 16;
/// How long an imported connection may wait for its process to restore
/// the socket on this host before it is forgotten.
const IMPORT_GRACE: Duration = Duration::from_secs(60);

#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// `--listen`: the VCMP address and port.
    pub listen: SocketAddr,
    pub state_dir: PathBuf,
    pub location_servers: Vec<SocketAddr>,
    /// `standby_tc` (see the config): keep tc attached everywhere while
    /// connections are paired.
    pub standby_tc: bool,
    /// `keepalive_secs`: NAT keepalive interval (0: off).
    pub keepalive_secs: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    #[error("cannot bind the VCMP socket on {addr}: {source}; is another vnatd running in this network namespace? (choose another with --listen)")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot watch address changes: {0}")]
    Watch(std::io::Error),
    #[error(transparent)]
    State(#[from] StateError),
}

pub use crate::control::PeerInfo;

/// Requests from the control API.
pub enum Command {
    /// Planned suspend (paper 3.3.1): settle roles and keys for these flows.
    Suspend {
        flows: Vec<VirtualFlow>,
        reply: oneshot::Sender<Result<usize, String>>,
    },
    /// Re-read addresses and connections now and move what needs moving.
    Resume {
        reply: oneshot::Sender<Result<usize, String>>,
    },
    Peers {
        reply: oneshot::Sender<Vec<PeerInfo>>,
    },
    /// A reloaded configuration (SIGHUP): the settings the driver uses.
    Reconfigure {
        location_servers: Vec<SocketAddr>,
        keepalive_secs: u32,
        standby_tc: bool,
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
        reply: oneshot::Sender<HashMap<VirtualFlow, crate::control::Mobility>>,
    },
    /// The protocol core's counters (`vnatctl status`).
    Counters {
        reply: oneshot::Sender<crate::control::VcmpCounters>,
    },
    /// Hand these flows' VCMP state over (keys included) and forget them
    /// here; all of them or none.
    Export {
        flows: Vec<VirtualFlow>,
        reply: oneshot::Sender<Result<ExportDocument, TransferError>>,
    },
    /// Take over exported flows (all or none), then move those whose local
    /// end now lives at another address, as automatic mode does.
    Import {
        state: ExportDocument,
        reply: oneshot::Sender<Result<Vec<ImportOutcome>, TransferError>>,
    },
}

pub type CommandSender = mpsc::Sender<Command>;

/// CLOCK_BOOTTIME: keeps counting while a laptop sleeps (STYLE.md).
pub fn now() -> Timestamp {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given, which is
    // a live local; CLOCK_BOOTTIME exists on every Linux vnat runs on, so
    // the call cannot fail and leave `ts` at zero.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    Timestamp::from_nanos(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// Run datapath calls on a blocking thread (they may walk /proc), as one
/// batch ([`Datapath::begin_batch`]): nothing else holds the datapath
/// meanwhile, and the work of one loop turn has no reason to see a route
/// lookup change under it.
async fn with_dp<T: Send + 'static>(
    dp: &SharedDatapath,
    f: impl FnOnce(&mut dyn Datapath) -> T + Send + 'static,
) -> T {
    let dp = dp.clone();
    let r = tokio::task::spawn_blocking(move || {
        let mut guard = match dp.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        guard.begin_batch();
        let r = f(guard.as_mut());
        guard.end_batch();
        r
    })
    .await;
    match r {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Room for the VCMP bursts of a mass move: restoring 10,000 connections
/// sends over a thousand datagrams within milliseconds (UPD, LOOKUP and
/// STORE records, 30 to a datagram), far beyond the default 208 KiB, and
/// every one the kernel drops costs a retransmission timeout. 100,000
/// connections send 3,400 full datagrams (about 2.3 KiB of buffer each) at
/// once, which overflowed 8 MiB: 38,000 datagrams dropped with the
/// retransmissions, and 5% of the migrations given up. The memory is taken
/// only while datagrams wait. The FORCE
/// variants (CAP_NET_ADMIN, which vnatd has) pass net.core.rmem_max; on
/// failure the plain ones give what the sysctl allows.
fn enlarge_buffers(sock: &UdpSocket) {
    use std::os::fd::AsRawFd;
    const BYTES: libc::c_int = 32 << 20;
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        let set = |opt| {
            // SAFETY: setsockopt on our own socket with a live c_int.
            unsafe {
                libc::setsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&BYTES as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            }
        };
        if set(force) != 0 && set(plain) != 0 {
            tracing::debug!(error = %std::io::Error::last_os_error(), "cannot enlarge the VCMP socket buffers");
        }
    }
}

/// Make the datapath translate `flow` to (local, remote), or stop
/// translating it when both are its virtual endpoints again.
fn translate_one(
    dp: &mut dyn Datapath,
    flow: VirtualFlow,
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<(), DatapathError> {
    if local == flow.local && remote == flow.remote {
        match dp.remove_translation(&flow) {
            Err(DatapathError::NoSuchTranslation { .. }) => Ok(()),
            r => r,
        }
    } else {
        dp.install_translation(&Translation {
            flow,
            physical_local: local,
            physical_remote: remote,
        })?;
        prepare_old_address(dp, flow, local, remote);
        Ok(())
    }
}

/// After an outage TCP has backed off its retransmission timer; make it
/// retransmit now rather than tens of seconds later (DESIGN.md §3, "no
/// stall"); and with `solicit`, have the socket send its peer an ACK (see
/// [`Switch`]). `wait`: the verified levers, which watch the socket act (and
/// try again).
fn restart_one(dp: &mut dyn Datapath, flow: VirtualFlow, solicit: bool, wait: bool) {
    if flow.proto != crate::datapath::Proto::Tcp {
        return;
    }
    let r = if wait {
        crate::datapath::restart_verified(dp, &flow, solicit)
    } else {
        dp.kick_flow(&flow, solicit)
    };
    match r {
        Ok(sent) => tracing::debug!(?flow, %sent, "restart"),
        Err(e) => {
            tracing::debug!(?flow, error = %e, "could not restart the flow's retransmissions")
        }
    }
}

/// When both ends moved, the peer may still send to our old (virtual)
/// address, which stays local here: take those packets in as well (receive
/// side only), or the kernel would answer them with a reset that the peer's
/// translation delivers into its socket. See
/// [`mobility::old_address_receive_side`].
fn prepare_old_address(
    dp: &mut dyn Datapath,
    flow: VirtualFlow,
    local: SocketAddr,
    remote: SocketAddr,
) {
    if let Some(t) = mobility::old_address_receive_side(flow, local, remote) {
        if let Err(e) = dp.prepare_translation(&t) {
            tracing::debug!(?flow, error = %e, "cannot take in the peer's packets to our old address");
        }
    }
}

/// An IPv4 peer seen through the dual-stack socket arrives as `::ffff:a.b.c.d`.
fn unmap(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        v4 => v4,
    }
}

fn to_socket_family(a: SocketAddr, dual: bool) -> SocketAddr {
    match (a, dual) {
        (SocketAddr::V4(v4), true) => {
            SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port())
        }
        _ => a,
    }
}

pub struct Driver {
    cfg: DriverConfig,
    dp: SharedDatapath,
    endpoint: Endpoint,
    peers: PeerStore,
    sock: UdpSocket,
    dual: bool,
    /// The move choreography (`super::mover`).
    mover: Mover,
    /// Interfaces kept attached by `standby_tc`, as last set.
    standby: Vec<u32>,
    /// Imported flows not yet seen in this host's records: the migrated
    /// process restores its socket after the import (the import puts the
    /// connection's address in place first), so they are kept meanwhile.
    imported: HashMap<VirtualFlow, Timestamp>,
    /// Exported flows: their process is being checkpointed to another host,
    /// so they are not tracked again here while their socket still exists.
    exported: HashSet<VirtualFlow>,
    /// The host's addresses as last seen, for the check that a connection
    /// vnatd starts to manage uses one of them.
    host_addrs: mobility::HostAddresses,
    /// Recorded connections vnatd refuses to manage, with the reason.
    refused: HashMap<VirtualFlow, &'static str>,
}

impl Driver {
    pub async fn new(cfg: DriverConfig, dp: SharedDatapath) -> Result<Driver, DriverError> {
        let key = identity::load_or_create_identity(&cfg.state_dir)?;
        let peers = PeerStore::load(&cfg.state_dir)?;
        let vcfg = vcmp::Config {
            port: cfg.listen.port(),
            location_servers: cfg.location_servers.clone(),
            keepalive_interval: std::time::Duration::from_secs(cfg.keepalive_secs.into()),
            ..vcmp::Config::default()
        };
        // Keys learned by pairing are not pins: a host is its key, and
        // another key at a known address is another host (NAT, DHCP), which
        // gets only the connections it proves it holds (vcmp::claim).
        let endpoint = Endpoint::new(vcfg, HostIdentity::from_bytes(key));
        // An unspecified listen address means both families: one dual-stack
        // socket (binding 0.0.0.0 and [::] on one port would collide).
        let (bind, dual) = if cfg.listen.ip().is_unspecified() {
            (
                SocketAddr::new(
                    IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
                    cfg.listen.port(),
                ),
                true,
            )
        } else {
            (cfg.listen, false)
        };
        let sock = match UdpSocket::bind(bind).await {
            Ok(s) => s,
            // A host with IPv6 disabled cannot bind `[::]`: IPv4 only then.
            Err(_) if dual && cfg.listen.is_ipv4() => {
                let v4 = SocketAddr::new(
                    IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
                    cfg.listen.port(),
                );
                tracing::warn!("IPv6 is not available; VCMP listens on IPv4 only");
                let s = UdpSocket::bind(v4)
                    .await
                    .map_err(|source| DriverError::Bind {
                        addr: cfg.listen,
                        source,
                    })?;
                return Ok(Driver::with_socket(cfg, dp, endpoint, peers, s, false));
            }
            Err(source) => {
                return Err(DriverError::Bind {
                    addr: cfg.listen,
                    source,
                })
            }
        };
        Ok(Driver::with_socket(cfg, dp, endpoint, peers, sock, dual))
    }

    fn with_socket(
        cfg: DriverConfig,
        dp: SharedDatapath,
        endpoint: Endpoint,
        peers: PeerStore,
        sock: UdpSocket,
        dual: bool,
    ) -> Driver {
        tracing::info!(listen = %cfg.listen, key = %identity::key_hex(&endpoint.public_key()), "VCMP listening");
        enlarge_buffers(&sock);
        Driver {
            cfg,
            dp,
            endpoint,
            peers,
            sock,
            dual,
            mover: Mover::new(),
            host_addrs: mobility::HostAddresses::default(),
            refused: HashMap::new(),
            standby: Vec::new(),
            imported: HashMap::new(),
            exported: HashSet::new(),
        }
    }

    /// Run until `shutdown` completes.
    pub async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), DriverError> {
        let watch = AddrWatch::new().map_err(DriverError::Watch)?;
        // Held send sides are a move in progress of a vnatd that is gone;
        // whatever move is still needed starts (and holds) again.
        match with_dp(&self.dp, |dp| dp.release_held()).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                connections = n,
                "released the connections held by an unfinished move"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot release connections held by an unfinished move")
            }
        }
        let mut next_resync = tokio::time::Instant::now() + RESYNC_INTERVAL;
        let mut buf = vec![0u8; 65536];
        tokio::pin!(shutdown);
        loop {
            let timeout = self.endpoint.poll_timeout().map(|t| t.since(now()));
            let sleep = tokio::time::sleep(timeout.unwrap_or(Duration::from_secs(3600)));
            tokio::select! {
                _ = &mut shutdown => break,
                r = self.sock.recv_from(&mut buf) => match r {
                    Ok((n, from)) => {
                        self.endpoint.handle_datagram(now(), &mut OsRng, unmap(from), &buf[..n]);
                        // And whatever else is queued, up to a bound: the
                        // datapath work below then runs once for a whole
                        // burst (a mass move's UPDs) instead of once per
                        // datagram, with everything behind it waiting.
                        for _ in 1..DATAGRAMS_PER_TURN {
                            match self.sock.try_recv_from(&mut buf) {
                                Ok((n, from)) => self.endpoint.handle_datagram(now(), &mut OsRng, unmap(from), &buf[..n]),
                                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                                Err(e) => {
                                    tracing::warn!(error = %e, "VCMP receive failed");
                                    break;
                                }
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "VCMP receive failed"),
                },
                _ = sleep, if timeout.is_some() => self.endpoint.handle_timeout(now(), &mut OsRng),
                r = watch.changed() => {
                    if let Err(e) = r {
                        tracing::warn!(error = %e, "address watch failed; relying on the periodic resync");
                    }
                    // At once: a move is only as quick as its start. Address
                    // changes come in bursts (address removed, link down,
                    // routes), and a resync that sees half of one starts no
                    // move; the next notification brings the rest.
                    self.resync().await;
                }
                _ = tokio::time::sleep_until(self.mover.next_hold_deadline().map_or(next_resync, tokio::time::Instant::from_std)),
                    if self.mover.next_hold_deadline().is_some() => {}
                _ = tokio::time::sleep_until(next_resync) => {
                    let started = tokio::time::Instant::now();
                    self.resync().await;
                    next_resync = tokio::time::Instant::now()
                        + RESYNC_INTERVAL.max(started.elapsed() * RESYNC_SHARE);
                }
                Some(cmd) = commands.recv() => self.command(cmd).await,
            }
            // Order matters: become receive-ready for a peer's announced new
            // address and apply events *before* sending what the core queued
            // (an UPD_R lets the peer start sending from its new address).
            self.prepare_pending().await;
            self.apply_events().await;
            self.flush().await;
            // The restart levers after the flush: for the socket they only
            // matter once both ends translate, which what we just sent is
            // what lets the peer do.
            self.restart_translated().await;
            // After the flush: attaching takes the kernel tens of ms, which
            // must not delay what a move just queued.
            self.update_standby().await;
            self.end_overdue_holds().await;
        }
        Ok(())
    }

    /// With `standby_tc`, keep the translators attached to every interface
    /// but `lo` while some connection is paired (it could move onto any of
    /// them), and to none otherwise.
    async fn update_standby(&mut self) {
        if !self.cfg.standby_tc {
            return;
        }
        let paired = self
            .endpoint
            .connections()
            .filter_map(|f| self.endpoint.connection(f))
            .any(|v| v.has_keys);
        let wanted: Vec<u32> = if paired {
            match nix::net::if_::if_nameindex() {
                Ok(list) => list
                    .iter()
                    .filter(|i| i.name().to_bytes() != b"lo")
                    .map(|i| i.index())
                    .collect(),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list interfaces for standby_tc");
                    return;
                }
            }
        } else {
            Vec::new()
        };
        if wanted == self.standby {
            return;
        }
        let list = wanted.clone();
        match with_dp(&self.dp, move |dp| dp.set_standby(&list)).await {
            Ok(()) => {
                tracing::debug!(interfaces = ?wanted, "tc standby updated");
                self.standby = wanted;
            }
            Err(e) => {
                // Not again on every turn: the next change of the
                // interfaces or of pairing tries again.
                tracing::warn!(error = %e, "cannot keep tc attached in standby to every interface");
                self.standby = wanted;
            }
        }
    }

    async fn flush(&mut self) {
        while let Some(t) = self.endpoint.poll_transmit(now()) {
            let dst = to_socket_family(t.dst, self.dual);
            if let Err(e) = self.sock.send_to(&t.payload, dst).await {
                tracing::debug!(dst = %t.dst, error = %e, "VCMP send failed");
            }
        }
    }

    async fn command(&mut self, cmd: Command) {
        // Suspend, resume and import may change our end of connections.
        self.mover.rescan();
        match cmd {
            Command::Suspend { flows, reply } => {
                let r = self
                    .endpoint
                    .suspend(now(), &mut OsRng, &flows)
                    .map(|()| flows.len())
                    .map_err(|e| e.to_string());
                let _ = reply.send(r);
            }
            Command::Resume { reply } => {
                let n = self.resync().await;
                let _ = reply.send(Ok(n));
            }
            Command::Counters { reply } => {
                let st = self.endpoint.stats();
                let map = |m: &BTreeMap<&'static str, u64>| {
                    m.iter().map(|(k, v)| (k.to_string(), *v)).collect()
                };
                let _ = reply.send(crate::control::VcmpCounters {
                    events: map(&st.events),
                    rejected: map(&st.rejected),
                });
            }
            Command::Peers { reply } => {
                let _ = reply.send(self.peer_infos());
            }
            Command::Reconfigure {
                location_servers,
                keepalive_secs,
                standby_tc,
                reply,
            } => {
                self.endpoint.reconfigure(
                    location_servers.clone(),
                    std::time::Duration::from_secs(keepalive_secs.into()),
                );
                self.cfg.location_servers = location_servers;
                self.cfg.keepalive_secs = keepalive_secs;
                self.cfg.standby_tc = standby_tc;
                let _ = reply.send(());
            }
            Command::ForgetPeer { key, reply } => {
                let held = self.endpoint.forget_peer(now(), &key);
                let stored = match self.peers.forget(&key) {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot remove the key from peers.json");
                        false
                    }
                };
                let out = match (held, stored) {
                    (None, false) => None,
                    (h, _) => Some(h.unwrap_or(0)),
                };
                if let Some(n) = out {
                    tracing::info!(key = %identity::key_hex(&key), connections = n,
                        "forgot peer host; its connections are claimed anew");
                }
                let _ = reply.send(out);
            }
            Command::Mobility { reply } => {
                let m = self
                    .endpoint
                    .connections()
                    .filter_map(|f| {
                        let v = self.endpoint.connection(f)?;
                        Some((
                            *f,
                            crate::control::Mobility {
                                mobile: v.has_keys,
                                seen_by_peer_as: v.seen_by_peer_as,
                                why_not: self.endpoint.why_not_mobile(f).map(str::to_string),
                            },
                        ))
                    })
                    .chain(self.refused.iter().map(|(f, why)| {
                        (
                            *f,
                            crate::control::Mobility {
                                mobile: false,
                                seen_by_peer_as: None,
                                why_not: Some((*why).to_string()),
                            },
                        )
                    }))
                    .collect();
                let _ = reply.send(m);
            }
            Command::Export { flows, reply } => {
                let r = self.export(&flows).await;
                let _ = reply.send(r);
            }
            Command::Import { state, reply } => {
                let r = self.import(&state).await;
                let _ = reply.send(r);
            }
        }
    }

    async fn export(&mut self, flows: &[VirtualFlow]) -> Result<ExportDocument, TransferError> {
        // Check every flow before forgetting any: all or nothing.
        for f in flows {
            let (id, flow) = (f.id(), transfer::describe(f));
            match self.endpoint.connection(f) {
                None => return Err(TransferError::NotTracked { id, flow }),
                Some(v) if !v.has_keys => return Err(TransferError::NoKeys { id, flow }),
                Some(_) => {}
            }
        }
        let translations = with_dp(&self.dp, |dp| dp.translations())
            .await
            .map_err(TransferError::Datapath)?;
        let mut connections = Vec::with_capacity(flows.len());
        for f in flows {
            let vcmp = self
                .endpoint
                .export_connection(f)
                .map_err(|source| TransferError::Export { id: f.id(), source })?;
            let translation = translations.iter().find(|t| t.flow == *f).copied();
            tracing::info!(flow = ?f, "connection exported; VCMP forgets it here");
            self.exported.insert(*f);
            connections.push(ExportedConnection {
                id: f.id(),
                vcmp,
                translation,
            });
        }
        Ok(ExportDocument {
            vnat_export: transfer::EXPORT_FORMAT,
            connections,
        })
    }

    async fn import(
        &mut self,
        state: &ExportDocument,
    ) -> Result<Vec<ImportOutcome>, TransferError> {
        let mut done: Vec<VirtualFlow> = Vec::new();
        for c in &state.connections {
            if let Err(source) = self.endpoint.import_connection(&c.vcmp) {
                // All or nothing: a half-imported set would leave the peer
                // talking to two hosts about one process.
                for f in &done {
                    self.endpoint.connection_removed(f);
                }
                return Err(TransferError::Import { id: c.id, source });
            }
            done.push(c.vcmp.flow);
            self.imported.insert(c.vcmp.flow, now());
        }
        // Do not move yet: the process restores its socket after the import,
        // and until that socket exists here a packet the peer sends to this
        // host would be answered with a reset. Prepare only the receive side
        // (which also makes the connection's address local, so the restored
        // socket can bind to it); the move starts when the restored socket
        // appears in this host's records (see `resync`).
        let here: HashSet<IpAddr> = with_dp(&self.dp, |dp| dp.interface_addresses())
            .await
            .map(|a| a.into_iter().map(|(ip, _)| ip).collect())
            .unwrap_or_default();
        for flow in &done {
            let Some(v) = self.endpoint.connection(flow) else {
                continue;
            };
            if here.contains(&v.local_phys.ip()) {
                continue;
            }
            let (flow, remote) = (*flow, v.remote_phys);
            let prepared = with_dp(&self.dp, move |dp| {
                let src = dp
                    .source_address_for(remote.ip())?
                    .ok_or(DatapathError::NoRoute { addr: remote.ip() })?;
                let t = Translation {
                    flow,
                    physical_local: SocketAddr::new(src, flow.local.port()),
                    physical_remote: remote,
                };
                dp.prepare_translation(&t)
            })
            .await;
            if let Err(e) = prepared {
                tracing::warn!(?flow, error = %e, "cannot prepare the imported connection's address");
            }
        }
        let mut out = Vec::with_capacity(done.len());
        for flow in done {
            let Some(v) = self.endpoint.connection(&flow) else {
                continue;
            };
            let moved = v.local_phys != flow.local || v.remote_phys != flow.remote;
            if !v.migrating && moved && here.contains(&v.local_phys.ip()) {
                // Staying at the exported physical endpoints (this host has
                // that address too): translate as the exporting host did.
                self.translate(flow, v.local_phys, v.remote_phys, false)
                    .await;
            }
            tracing::info!(?flow, local = %v.local_phys, moving = v.migrating, "connection imported");
            out.push(ImportOutcome {
                flow,
                physical_local: v.local_phys,
                physical_remote: v.remote_phys,
                moving: v.migrating,
            });
        }
        Ok(out)
    }

    /// One row per known host key (with the address it last paired from)
    /// and one per address whose connections no host has claimed yet.
    fn peer_infos(&self) -> Vec<PeerInfo> {
        let mut by_key: BTreeMap<[u8; 32], (IpAddr, usize, usize)> = BTreeMap::new();
        let mut unclaimed: BTreeMap<IpAddr, usize> = BTreeMap::new();
        for (key, ip) in &self.peers.peers {
            by_key.insert(*key, (*ip, 0, 0));
        }
        for f in self.endpoint.connections() {
            let Some(v) = self.endpoint.connection(f) else {
                continue;
            };
            match v.peer_key {
                Some(k) => {
                    let e = by_key.entry(k).or_insert((v.remote_phys.ip(), 0, 0));
                    e.1 += 1;
                    e.2 += usize::from(v.has_keys);
                }
                None => *unclaimed.entry(v.remote_phys.ip()).or_default() += 1,
            }
        }
        let mut out: Vec<PeerInfo> = by_key
            .into_iter()
            .map(|(key, (address, connections, mobile))| PeerInfo {
                address,
                key: Some(identity::key_hex(&key)),
                connections,
                mobile,
                behind_nat: self.endpoint.behind_nat(&key),
                reflexive: self.endpoint.reflexive_address(&key),
            })
            .collect();
        out.extend(
            unclaimed
                .into_iter()
                .map(|(address, connections)| PeerInfo {
                    address,
                    key: None,
                    connections,
                    mobile: 0,
                    behind_nat: false,
                    reflexive: None,
                }),
        );
        out.sort_by(|a, b| (a.address, &a.key).cmp(&(b.address, &b.key)));
        out
    }

    /// Track new connections, forget closed ones, and move the ones whose
    /// address vanished. Returns the number of moves started.
    async fn resync(&mut self) -> usize {
        tracing::trace!("resync");
        let port = self.cfg.listen.port();
        let listed = with_dp(&self.dp, |dp| {
            (dp.connections_without_owners(), dp.interface_addresses())
        })
        .await;
        let conns = match listed.0 {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list connections");
                return 0;
            }
        };
        let seen_at = std::time::Instant::now();
        match listed.1 {
            Ok(a) => self
                .host_addrs
                .update(seen_at, a.into_iter().map(|(ip, _)| ip).collect()),
            Err(e) => tracing::warn!(error = %e, "cannot list this host's addresses"),
        }
        let mut live = HashSet::new();
        for c in conns {
            let flow = VirtualFlow {
                proto: c.proto,
                local: c.virtual_local,
                remote: c.virtual_remote,
            };
            if !mobility::is_mobile_candidate(&flow, port) {
                continue;
            }
            live.insert(flow);
            if self.endpoint.connection(&flow).is_none()
                && !self.exported.contains(&flow)
                && !self.imported.contains_key(&flow)
                // Physical: a connection that moved before a restart of
                // vnatd uses its new address; its virtual one is on `lo`.
                && !self.host_addrs.may_manage(c.physical_local.ip(), seen_at)
            {
                if self
                    .refused
                    .insert(flow, mobility::NOT_OUR_ADDRESS)
                    .is_none()
                {
                    tracing::warn!(?flow, pid = ?c.pid, "not managing a connection whose local address is not one of this host's (IP_FREEBIND or IP_TRANSPARENT socket)");
                }
                continue;
            }
            if self.endpoint.connection(&flow).is_none() && !self.exported.contains(&flow) {
                let r = self.endpoint.connection_added(
                    now(),
                    &mut OsRng,
                    flow,
                    c.physical_local,
                    c.physical_remote,
                    vcmp::Binding::of(&flow, c.tcp_isns),
                );
                match r {
                    Ok(()) => tracing::debug!(?flow, "tracking connection"),
                    Err(e) => tracing::debug!(?flow, error = %e, "not tracking connection"),
                }
            }
        }
        self.exported.retain(|f| live.contains(f));
        self.refused.retain(|f, _| live.contains(f));
        let t = now();
        self.imported
            .retain(|f, since| !live.contains(f) && t.since(*since) < IMPORT_GRACE);
        let gone: Vec<VirtualFlow> = self
            .endpoint
            .connections()
            .filter(|f| !live.contains(f) && !self.imported.contains_key(f))
            .copied()
            .collect();
        for f in &gone {
            self.endpoint.connection_removed(f);
            self.mover.forget(f);
        }
        if !gone.is_empty() {
            // The connections closed: undo what their translations set up
            // (NAT entries, the address kept on lo, the peer's host route,
            // the tc attachment) unless another connection still needs it.
            with_dp(&self.dp, move |dp| {
                for f in gone {
                    match dp.remove_translation(&f) {
                        Ok(()) => tracing::info!(flow = ?f, "connection closed; translation removed"),
                        Err(DatapathError::NoSuchTranslation { .. }) => {}
                        Err(e) => tracing::warn!(flow = ?f, error = %e, "cannot remove a closed connection's translation"),
                    }
                }
            })
            .await;
        }
        self.plan_and_move().await
    }

    async fn plan_and_move(&mut self) -> usize {
        let tracked: Vec<Tracked> = self
            .endpoint
            .connections()
            .filter(|f| !self.imported.contains_key(f))
            .filter_map(|f| self.endpoint.connection(f))
            .map(|v| Tracked {
                flow: v.flow,
                local_phys: v.local_phys,
                remote_phys: v.remote_phys,
                migrating: v.migrating,
            })
            .collect();
        if tracked.is_empty() {
            return 0;
        }
        let remotes: HashSet<IpAddr> = tracked.iter().map(|t| t.remote_phys.ip()).collect();
        let (addrs, sources) = with_dp(&self.dp, move |dp| {
            let addrs: HashSet<IpAddr> = match dp.interface_addresses() {
                Ok(a) => a.into_iter().map(|(a, _)| a).collect(),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list this host's addresses");
                    HashSet::new()
                }
            };
            let sources: HashMap<IpAddr, Option<IpAddr>> = remotes
                .into_iter()
                .map(|r| (r, dp.source_address_for(r).ok().flatten()))
                .collect();
            (addrs, sources)
        })
        .await;
        let moves =
            mobility::plan_moves(&tracked, &addrs, |ip| sources.get(&ip).copied().flatten());
        tracing::trace!(?tracked, ?addrs, ?sources, ?moves, "automatic mode");
        // Which moves can go, then all their receive sides in one trip to
        // the datapath thread.
        let (candidates, stuck) = self.mover.starts(moves, |f| self.endpoint.connection(f));
        for m in stuck {
            tracing::warn!(flow = ?m.flow, peer = %m.remote_phys.ip(), "connection lost its address but cannot move: the peer runs no vnatd or pairing has not completed");
        }
        let prepared = with_dp(&self.dp, move |dp| {
            candidates
                .into_iter()
                .map(|st| {
                    let m = st.mv;
                    let r = if m.new_local != m.flow.local {
                        dp.prepare_translation(&Translation {
                            flow: m.flow,
                            physical_local: m.new_local,
                            physical_remote: m.remote_phys,
                        })
                    } else {
                        Ok(())
                    };
                    let mut held = false;
                    if r.is_ok() && st.hold {
                        match dp.hold_send_side(&m.flow, true) {
                            Ok(()) => held = true,
                            Err(e) => tracing::warn!(flow = ?m.flow, error = %e, "cannot hold the connection's packets during its move"),
                        }
                    }
                    (m, st.from, r, held)
                })
                .collect::<Vec<_>>()
        })
        .await;
        let mut started = Vec::new();
        let held_at = std::time::Instant::now();
        for (m, from, r, held) in prepared {
            if held {
                self.mover.held(m.flow, held_at);
            }
            if let Err(e) = r {
                tracing::warn!(flow = ?m.flow, error = %e, "cannot prepare the move");
                continue;
            }
            tracing::info!(flow = ?m.flow, from = %from, to = %m.new_local, "resuming connection at a new address");
            started.push((m.flow, m.new_local));
        }
        if started.is_empty() {
            return 0;
        }
        if let Err(e) = self.endpoint.resume(now(), &mut OsRng, &started) {
            tracing::warn!(error = %e, "cannot start the migration");
            return 0;
        }
        // Our end moved: receive sides prepared for a peer's pending address
        // must be prepared again for our new one.
        self.mover.rescan();
        started.len()
    }

    /// Release the holds older than [`HOLD_LIMIT`] of moves still under
    /// way. A flow whose move completed was released by its translation
    /// (the release is then a no-op).
    async fn end_overdue_holds(&mut self) {
        let overdue = self.mover.overdue_holds(std::time::Instant::now());
        if overdue.is_empty() {
            return;
        }
        let n = overdue.len();
        let failed = with_dp(&self.dp, move |dp| {
            let mut failed = Vec::new();
            for f in overdue {
                match dp.hold_send_side(&f, false) {
                    // The socket's sends failed while held, so it waits on
                    // a backed-off probe timer: push what it queued now,
                    // not seconds later.
                    Ok(()) => restart_one(dp, f, false, false),
                    Err(e) => failed.push((f, e)),
                }
            }
            failed
        })
        .await;
        for (flow, e) in &failed {
            tracing::warn!(?flow, error = %e, "cannot release the connection's held packets");
        }
        tracing::info!(
            connections = n - failed.len(),
            limit_ms = HOLD_LIMIT.as_millis() as u64,
            "moves not done within the hold limit: their packets leave with the old address until they are"
        );
    }

    /// A peer announced a new address in an authenticated update that is
    /// still being validated: accept its packets from there already (only
    /// sending waits for validation), so that its connection never meets a
    /// kernel that resets it.
    async fn prepare_pending(&mut self) {
        let endpoint = &self.endpoint;
        let work = self.mover.receive_sides(endpoint.pending_epoch(), || {
            endpoint
                .connections()
                .filter_map(|f| endpoint.connection(f))
                .collect::<Vec<_>>()
        });
        if work.is_empty() {
            return;
        }
        // One trip to the datapath thread for all of them.
        let done = with_dp(&self.dp, move |dp| {
            work.into_iter()
                .map(|t| {
                    let r = dp.prepare_translation(&t).map(|()| {
                        prepare_old_address(dp, t.flow, t.physical_local, t.physical_remote);
                    });
                    (t, r)
                })
                .collect::<Vec<_>>()
        })
        .await;
        for (t, r) in done {
            let new_failure = self.mover.receive_side_done(&t, &r);
            match r {
                Ok(()) => {
                    tracing::debug!(flow = ?t.flow, remote = %t.physical_remote, "receive side ready for the peer's new address")
                }
                Err(e) if new_failure => {
                    tracing::warn!(flow = ?t.flow, error = %e, "cannot prepare for the peer's new address yet; will retry")
                }
                Err(_) => {}
            }
        }
    }

    async fn apply_events(&mut self) {
        // Datapath work of all events in one batch, in event order.
        let mut batch = Vec::new();
        let mut aborted = Vec::new();
        while let Some(ev) = self.endpoint.poll_event() {
            let flow = match &ev {
                Event::SetRemote { flow, .. }
                | Event::Reverted { flow, .. }
                | Event::Resumed { flow, .. }
                | Event::PeerSwitched { flow, .. }
                | Event::MigrationAborted { flow, .. } => Some(*flow),
                _ => None,
            };
            let view = flow.and_then(|f| self.endpoint.connection(&f));
            match self.mover.step(&ev, view.as_ref()) {
                Step::Switch(s) => {
                    if let Event::PeerSwitched { confirmed, .. } = ev {
                        tracing::debug!(flow = ?s.flow, confirmed, "the peer sends to our new address");
                    }
                    batch.push(s);
                    continue;
                }
                Step::Release(flow) => {
                    if let Event::MigrationAborted { reason, .. } = &ev {
                        tracing::warn!(?flow, %reason, "migration aborted");
                    }
                    aborted.push(flow);
                    continue;
                }
                Step::Wait(flow, why) => {
                    tracing::debug!(?flow, ?view, "{why}");
                    continue;
                }
                Step::NotAMove => {}
            }
            match ev {
                Event::Paired { peer, key } => {
                    tracing::info!(%peer, key = %identity::key_hex(&key), "paired with peer host");
                    if let Err(e) = self.peers.remember(peer, key) {
                        tracing::error!(error = %e, "cannot save the peer's key");
                    }
                }
                Event::ClaimConflict {
                    peer,
                    claimant,
                    holder,
                    connections,
                } => {
                    tracing::warn!(%peer, claimant = %identity::key_hex(&claimant), holder = %identity::key_hex(&holder), connections,
                        "a host claims connections that belong to another host key; they stay with it (if that host was reinstalled, run `vnatctl peers forget <holder key>`)");
                }
                Event::PeerKeyChanged {
                    peer,
                    pinned,
                    offered,
                } => {
                    tracing::error!(%peer, pinned = %identity::key_hex(&pinned), offered = %identity::key_hex(&offered),
                        "peer presented a different host key than the pinned one: refused (if the peer was reinstalled, remove it from peers.json in the state directory)");
                }
                Event::DivertBinds { toward } => {
                    // Before the BIND_REQ that this makes the core send
                    // (flushed after the events): no BIND may reach an
                    // application.
                    let port = self.sock.local_addr().map(|a| a.port()).unwrap_or(0);
                    let r = with_dp(&self.dp, move |dp| dp.divert_binds(toward, port)).await;
                    if let Err(e) = &r {
                        tracing::warn!(%toward, error = %e, "cannot divert in-band BINDs: UDP flows from there stay unbound");
                    }
                    self.endpoint.binds_diverted(toward, r.is_ok());
                }
                Event::SendInBand {
                    local,
                    remote,
                    payload,
                } => {
                    let r =
                        with_dp(&self.dp, move |dp| dp.send_in_band(local, remote, &payload)).await;
                    if let Err(e) = r {
                        tracing::warn!(%local, %remote, error = %e, "cannot send a BIND on the flow's path");
                    }
                }
                other => tracing::debug!(event = ?other, "VCMP event"),
            }
        }
        let done = self.translate_all(batch).await;
        // Tell each peer whose new address we now send to (SWITCHED): its
        // moved connections wait for that before restarting their TCP.
        let confirm: Vec<VirtualFlow> = done
            .iter()
            .filter(|s| s.peer_moved || s.remote != s.flow.remote)
            .map(|s| s.flow)
            .collect();
        if !confirm.is_empty() {
            self.endpoint.confirm_switched(now(), &mut OsRng, &confirm);
        }
        if !aborted.is_empty() {
            // Back to what it did before the move (the connection is most
            // likely lost, but that is for TCP to decide).
            with_dp(&self.dp, move |dp| {
                for flow in aborted {
                    if let Err(e) = dp.hold_send_side(&flow, false) {
                        tracing::warn!(?flow, error = %e, "cannot release the connection's held packets");
                    }
                }
            })
            .await;
        }
    }

    /// Make the datapath translate `flow` to (local, remote), or stop
    /// translating it when both are its virtual endpoints again.
    /// `peer_moved`: the peer's address changed (see [`Switch`]).
    async fn translate(
        &mut self,
        flow: VirtualFlow,
        local: SocketAddr,
        remote: SocketAddr,
        peer_moved: bool,
    ) {
        self.translate_all(vec![Switch {
            flow,
            local,
            remote,
            peer_moved,
            solicit: peer_moved,
        }])
        .await;
    }

    /// [`Driver::translate`] for many connections in one trip to the
    /// datapath thread: when thousands move together, one hand-off each
    /// (and a wait for a CPU on a busy host) would cost more than the work.
    /// Returns the switches that took effect.
    ///
    /// The TCP restart levers (and the solicited ACKs of [`Switch`]): for a
    /// few connections, the verified ones, at once after each install,
    /// before anything VCMP queued is sent. For a mass move they are queued
    /// for [`Driver::restart_translated`], which the loop runs after the
    /// flush: they cost tens of microseconds per connection, and the peer's
    /// RESPONSE, UPD_R or SWITCHED must not wait behind thousands of them.
    async fn translate_all(&mut self, items: Vec<Switch>) -> Vec<Switch> {
        if items.is_empty() {
            return Vec::new();
        }
        let verified = items.len() <= VERIFIED_RESTARTS_MAX;
        let started = std::time::Instant::now();
        let done = with_dp(&self.dp, move |dp| {
            items
                .into_iter()
                .map(|s| {
                    let r = translate_one(dp, s.flow, s.local, s.remote);
                    if verified && r.is_ok() {
                        restart_one(dp, s.flow, s.solicit, true);
                    }
                    (s, r)
                })
                .collect::<Vec<_>>()
        })
        .await;
        let mut ok = Vec::with_capacity(done.len());
        for (s, r) in done {
            match r {
                Ok(()) => {
                    // The peer's solicited ACKs leave after its SWITCHED and
                    // make our held sockets send what they queued, with
                    // their ACK; one with nothing to send keeps its ACK
                    // until it next sends or receives.
                    self.mover.switched(&s, verified);
                    tracing::info!(flow = ?s.flow, local = %s.local, remote = %s.remote, "translation updated");
                    ok.push(s);
                }
                Err(e) => {
                    tracing::error!(flow = ?s.flow, error = %e, "cannot update the translation")
                }
            }
        }
        if verified && !ok.is_empty() {
            tracing::info!(
                connections = ok.len(),
                verified,
                elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
                "restart levers sent"
            );
        }
        ok
    }

    /// The restart levers, without waits, for the connections of a mass
    /// move translated this turn (see [`Driver::translate_all`]).
    async fn restart_translated(&mut self) {
        let items = self.mover.take_restarts();
        if items.is_empty() {
            return;
        }
        let (n, started) = (items.len(), std::time::Instant::now());
        with_dp(&self.dp, move |dp| {
            for (flow, solicit) in items {
                restart_one(dp, flow, solicit, false);
            }
        })
        .await;
        tracing::info!(
            connections = n,
            verified = false,
            elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
            "restart levers sent"
        );
    }
}
