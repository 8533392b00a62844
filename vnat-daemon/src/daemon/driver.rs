//! The one I/O driver of VCMP (STYLE.md): it owns the UDP socket, the
//! clock, the randomness and the timers, feeds the sans-IO protocol core
//! ([`crate::vcmp::Endpoint`]) and applies its events to the datapath.
//!
//! Connections come from the datapath's records (read every second, less
//! often when that takes long); automatic mode moves the ones whose local
//! address vanished (see [`super::mobility`]), planned on every address
//! change from the connections already known and started a share per loop
//! turn, so that the first updates leave at once at any size. A move is
//! applied in the order that never lets a kernel reset the connection:
//! receive side first
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
use tokio::{net::UdpSocket, sync::mpsc};

mod control;
mod extstore;
mod helping;
mod moves;
mod natguard;
mod outage;
mod persisted;
mod plan;
mod settling;
mod socket;
mod watch;

use socket::{
    address_owners, ask_destinations, enlarge_buffers, recv_datagram, recv_next, send_from,
    to_socket_family, unmap,
};

use super::{
    addrwatch::AddrWatch,
    conflict,
    identity::{self, PeerStore, StateError},
    mobility::{self, Move, Tracked},
    mover::{Mover, Step, Switch, HOLD_LIMIT},
};
use crate::{
    control::transfer::{self, ExportDocument, ExportedConnection, ImportOutcome, TransferError},
    datapath::{owner::DatapathHandle, Datapath, DatapathError, Translation, VirtualFlow},
    vcmp::{self, crypto::HostIdentity, Endpoint, Event, Timestamp},
};

/// How often the recorded connections are re-read even without an address
/// change (new connections to pair for): at least this often, and at most
/// [`RESYNC_SHARE`] of the time (until the wait reaches
/// [`RESYNC_MAX_WAIT`]): with 100,000 connections one resync takes a few
/// hundred milliseconds, and once a second it took a third of the daemon's
/// time, in the middle of moving them.
const RESYNC_INTERVAL: Duration = Duration::from_secs(1);
const RESYNC_SHARE: u32 = 10;
/// The longest wait between two resyncs however slow one was: a new
/// connection is paired for at most this long after it opened (a flood of
/// 65,536 spoofed UDP sources made one resync take 1.7 s on a debug build,
/// and the next waited 17 s).
const RESYNC_MAX_WAIT: Duration = Duration::from_secs(5);
/// Most VCMP datagrams handled in one loop turn before the datapath work
/// they call for (a full one carries up to 30 records).
const DATAGRAMS_PER_TURN: usize = 64;
/// Most of automatic mode's moves started (held, receive side prepared,
/// update queued) in the turn that planned them, and in each turn after.
/// The updates of a turn leave at its end: at 30,000 connections,
/// preparing all of them first (10 to 20 us each) kept the first update
/// back by 0.2 to 0.3 s, and everything else the driver does (the peer's
/// answers, its own timers) waited as long. The first share is small, so
/// that the first updates leave at once; the rest go a larger share a
/// turn, so that a mass move is not spread over many slow turns.
const FIRST_STARTS: usize = 256;
const STARTS_PER_TURN: usize = 4096;
/// How long after an address change a connection left without address or
/// route counts as cut off (`hold_stranded`). An address change comes as a
/// burst of notifications (address removed, link down, the new address,
/// its route) over a few milliseconds, and a plan made in the middle of
/// one finds connections with no address yet that the next one moves:
/// holding them then cost the move 7 to 9 ms (the hold is recorded on
/// disk first). An outage that matters lasts seconds.
const STRANDED_GRACE: Duration = Duration::from_millis(250);

/// Up to this many connections translated in one turn get the restart
/// levers that wait to see each socket act; more get them without waiting
/// (`Datapath::kick_flow`), or one backed-off socket after another would
/// hold up a mass move by 20 ms to 1.2 s each.
const VERIFIED_RESTARTS_MAX: usize = 16;
/// Most unverified restart levers (a mass move's) run in one loop turn,
/// after its flush; the rest wait for the next turns, which come at once,
/// with the peer's datagrams handled between them.
const RESTARTS_PER_TURN: usize = 64;
/// How often vnatd looks for NAT entries whose socket is gone and that no
/// connection of its own explains (what a vnatd killed mid-move left). An
/// entry goes when two checks in a row found it so: one listing that
/// missed a live socket removes nothing.
const ORPHAN_CHECK_INTERVAL: Duration = Duration::from_secs(10);

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
    /// `preempt_cgroups`: connections under these reset an older one in
    /// a virtual-address conflict; everyone else's move is refused.
    pub preempt_cgroups: Vec<PathBuf>,
    /// `peer_helpers`: the keep-alive helpers a peer may ask of this host.
    pub peer_helpers: Vec<String>,
    /// `helpers_dir`: where the installed ones are.
    pub helpers_dir: PathBuf,
    /// `location_store`: etcd besides the embedded store (`None`: the
    /// embedded store alone).
    pub location_store: super::config::store::StoreSetting,
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
    #[error(transparent)]
    Etcd(#[from] super::etcd::EtcdError),
}

pub use crate::control::{command::MoveRefused, Command, CommandSender, PeerInfo};

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

/// Run datapath calls on the datapath's owner thread (they may walk
/// /proc), as one batch ([`Datapath::begin_batch`]): nothing else touches
/// the datapath meanwhile, and the work of one loop turn has no reason to
/// see a route lookup change under it. The driver cannot go on without its
/// datapath: if the owner refuses (an earlier operation crashed), the
/// driver task ends here, as it did when a datapath call panicked in it.
async fn with_dp<T: Send + 'static>(
    dp: &DatapathHandle,
    f: impl FnOnce(&mut dyn Datapath) -> T + Send + 'static,
) -> T {
    match dp.run(f).await {
        Ok(v) => v,
        Err(e) => panic!("the VCMP driver stops: {e}"),
    }
}

pub struct Driver {
    cfg: DriverConfig,
    dp: DatapathHandle,
    endpoint: Endpoint,
    peers: PeerStore,
    sock: UdpSocket,
    dual: bool,
    /// The move choreography (`super::mover`).
    mover: Mover,
    /// Interfaces kept attached by `standby_tc`, as last set.
    standby: Vec<u32>,
    /// Whether the standby set may have changed: after a resync (addresses,
    /// interfaces, connections) or an event of the core (pairing, keys).
    /// Checked only then, not on every loop turn: a flood of junk at the
    /// VCMP port makes thousands of turns a second, and each check walks
    /// every connection and dumps the interfaces.
    standby_due: bool,
    /// Addresses kept local for mobile connections, as last set
    /// (`Datapath::keep_local`); recomputed when `standby_due` is. None
    /// until the first call, which also releases what a previous vnatd
    /// kept for connections that closed meanwhile.
    kept: Option<(Vec<IpAddr>, Vec<IpAddr>)>,
    /// What the last failed `keep_local` said: the same failure again (a
    /// foreign `vnat-sink`, at every route change) is not warned again.
    kept_error: Option<String>,
    /// The address watch fired since `update_kept` last ran (see
    /// `Datapath::keep_local` on renewing).
    kept_renew_due: bool,
    /// When the NAT guards' drops are read next (`driver/natguard.rs`);
    /// None while none was set.
    next_guard_poll: Option<std::time::Instant>,
    /// The host's addresses as last seen, for the check that a connection
    /// vnatd starts to manage uses one of them.
    host_addrs: super::hostaddrs::HostAddresses,
    /// Which recorded connections the core tracks, and what moves need to
    /// know of them (exported, imported, placed, anchors, cgroups).
    tracking: super::tracking::Tracking,
    /// What must outlast this vnatd: placements, changes to sockets
    /// (`driver/persisted.rs`).
    restart_state: super::restart_state::RestartState,
    /// When `resync` next looks for orphaned NAT entries (at once after a
    /// start, then every [`ORPHAN_CHECK_INTERVAL`]), and what the last
    /// look found.
    next_orphan_check: std::time::Instant,
    orphans: HashSet<VirtualFlow>,
    /// Keepalives held at suspend, helpers asked of the peers and given
    /// to them, installed helpers' runs (`driver/helping.rs`).
    helpers: helping::Helpers,
    /// Planned suspensions the peers have yet to settle (`settling.rs`).
    settling: settling::Settling,
    /// Unannounced outages: this host's own held timeouts, the paired
    /// hosts watched for silence (`driver/outage.rs`).
    outages: outage::Outages,
    /// The embedded location store's saved records, and etcd
    /// (`driver/extstore.rs`).
    stores: extstore::Stores,
    /// Hide location: whether some cgroup hides (as last read), the
    /// shown addresses kept from one table to the next, whether
    /// connections changed since the table was last computed, and the
    /// table last written (none before the first write).
    hiding: bool,
    hider: super::hide::Hider,
    hide_due: bool,
    last_hidden: Option<crate::datapath::HideTable>,
    /// Connections that lost their address and cannot move, said once
    /// each (automatic mode looks every second) until they can again.
    stuck_said: HashSet<VirtualFlow>,
    /// Automatic mode's planned moves not started yet: a plan starts
    /// [`FIRST_STARTS`], sends their updates, starts the rest of
    /// [`STARTS_PER_TURN`] and leaves what remains to the next turns, so
    /// that the first updates leave while the others are prepared. Each
    /// plan replaces what the last one left (it plans them again).
    queued_starts: Vec<Move>,
    /// When automatic mode looks again, after an address change, for the
    /// connections it left without address or route ([`STRANDED_GRACE`]).
    stranded_check: Option<std::time::Instant>,
    /// Moves under way and each connection's last one (`vnatctl ls`),
    /// published as they start and end (`vnatctl monitor`,
    /// `driver/watch.rs`).
    journal: super::journal::Journal,
    events: crate::control::events::EventHub,
}

impl Driver {
    pub async fn new(cfg: DriverConfig, dp: DatapathHandle) -> Result<Driver, DriverError> {
        let key = identity::load_or_create_identity(&cfg.state_dir)?;
        let peers = PeerStore::load(&cfg.state_dir)?;
        let vcfg = vcmp::Config {
            port: cfg.listen.port(),
            location_servers: cfg.location_servers.clone(),
            keepalive_interval: std::time::Duration::from_secs(cfg.keepalive_secs.into()),
            external_store: cfg.location_store.is_some(),
            ..vcmp::Config::default()
        };
        // Keys learned by pairing are not pins: a host is its key, and
        // another key at a known address is another host (NAT, DHCP), which
        // gets only the connections it proves it holds (vcmp::claim).
        let mut endpoint = Endpoint::new(vcfg, HostIdentity::from_bytes(key));
        // Hosts paired with before may pair again from a new address (one
        // that moved while this vnatd was not running).
        endpoint.know_hosts(peers.peers.iter().map(|(k, ip)| (*k, *ip)));
        let stores = extstore::Stores::open(&cfg, &mut endpoint)?;
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
                return Ok(Driver::with_socket(
                    cfg, dp, endpoint, peers, s, false, stores,
                ));
            }
            Err(source) => {
                return Err(DriverError::Bind {
                    addr: cfg.listen,
                    source,
                })
            }
        };
        Ok(Driver::with_socket(
            cfg, dp, endpoint, peers, sock, dual, stores,
        ))
    }

    fn with_socket(
        cfg: DriverConfig,
        dp: DatapathHandle,
        endpoint: Endpoint,
        peers: PeerStore,
        sock: UdpSocket,
        dual: bool,
        stores: extstore::Stores,
    ) -> Driver {
        let host_addrs = super::hostaddrs::HostAddresses::load(&cfg.state_dir).in_background();
        tracing::info!(listen = %cfg.listen, key = %identity::key_hex(&endpoint.public_key()), "VCMP listening");
        enlarge_buffers(&sock);
        ask_destinations(&sock, dual);
        let mut tracking = super::tracking::Tracking::default();
        let restart_state = persisted::load(&cfg.state_dir, &mut tracking);
        Driver {
            cfg,
            dp,
            endpoint,
            peers,
            sock,
            dual,
            mover: Mover::new(),
            host_addrs,
            tracking,
            restart_state,
            standby: Vec::new(),
            standby_due: true,
            kept: None,
            kept_error: None,
            kept_renew_due: false,
            next_guard_poll: None,
            next_orphan_check: std::time::Instant::now(),
            orphans: HashSet::new(),
            helpers: helping::Helpers::new(),
            settling: Default::default(),
            outages: Default::default(),
            stores,
            hiding: false,
            hider: Default::default(),
            hide_due: true,
            last_hidden: None,
            stuck_said: HashSet::new(),
            queued_starts: Vec::new(),
            stranded_check: None,
            journal: Default::default(),
            events: Default::default(),
        }
    }

    /// Publish move and pairing events on `hub` (the control API's, for
    /// `vnatctl monitor`).
    pub fn with_events(mut self, hub: crate::control::events::EventHub) -> Driver {
        self.events = hub;
        self
    }

    /// Gives back the room of tables a mass move or many closed
    /// connections left (`vnat_vcmp::room`): at 100,000 connections they
    /// hold tens of megabytes after a move (issue 33, item 1). Each table
    /// is shrunk only when it is under a quarter full.
    fn shrink_sparse(&mut self) {
        self.endpoint.shrink_sparse();
        self.mover.shrink_sparse();
        self.journal.shrink_sparse();
        self.tracking.shrink_sparse();
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
        // Know this host's connections before the first datagram: a peer
        // that moves while this vnatd was not running pairs again as soon
        // as it hears from us, and its claims must find them.
        self.resync().await;
        self.undo_left_changes().await;
        self.apply_and_send().await;
        self.host_addrs.save_if_changed();
        let mut next_resync = tokio::time::Instant::now() + RESYNC_INTERVAL;
        let mut buf = vec![0u8; 65536];
        let mut store_answers = self.stores.take_answers();
        tokio::pin!(shutdown);
        loop {
            let far = std::time::Instant::now() + Duration::from_secs(3600);
            let timeout = self.endpoint.poll_timeout().map(|t| t.since(now()));
            let sleep = tokio::time::sleep(timeout.unwrap_or(Duration::from_secs(3600)));
            tokio::select! {
                _ = &mut shutdown => break,
                r = recv_next(&self.sock, &mut buf) => match r {
                    Ok((n, from, to)) => {
                        self.datagram(unmap(from), to, n, &buf);
                        // And whatever else is queued, up to a bound: the
                        // datapath work below then runs once for a whole
                        // burst (a mass move's UPDs) instead of once per
                        // datagram, with everything behind it waiting.
                        for _ in 1..DATAGRAMS_PER_TURN {
                            match self
                                .sock
                                .try_io(tokio::io::Interest::READABLE, || {
                                    recv_datagram(&self.sock, &mut buf)
                                }) {
                                Ok((n, from, to)) => self.datagram(unmap(from), to, n, &buf),
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
                _ = sleep, if timeout.is_some() => {
                    // What the core's timers log (retransmissions, give-ups)
                    // carries where it came from.
                    let _timers = tracing::debug_span!("vcmp_timers").entered();
                    self.endpoint.handle_timeout(now(), &mut OsRng);
                }
                r = watch.changed() => {
                    if let Err(e) = r {
                        tracing::warn!(error = %e, "address watch failed; relying on the periodic resync");
                    }
                    self.stores.addresses_changed();
                    // At once: a move is only as quick as its start. The
                    // moves are planned from the connections already
                    // known, not after listing them again (at 100,000 a
                    // listing takes seconds); the listing follows at the
                    // next periodic resync, within RESYNC_INTERVAL.
                    // Address changes come in bursts (address removed,
                    // link down, routes), and a plan that sees half of one
                    // starts no move; the next notification brings the
                    // rest.
                    self.plan_and_move(false).await;
                    let check = std::time::Instant::now() + STRANDED_GRACE;
                    self.stranded_check = Some(self.stranded_check.map_or(check, |c| c.min(check)));
                    next_resync = next_resync.min(tokio::time::Instant::now() + RESYNC_INTERVAL);
                    self.standby_due = true;
                    self.hide_due = true;
                    self.kept_renew_due = true;
                }
                // Moves planned but not started yet: a turn now, which
                // starts the next share below.
                _ = std::future::ready(()), if !self.queued_starts.is_empty() => {}
                // Restart levers still queued: a turn now, which runs the
                // next share of them below.
                _ = std::future::ready(()), if self.mover.restarts_queued() => {}
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(
                        self.stranded_check.unwrap_or(far))),
                    if self.stranded_check.is_some() => {
                    self.stranded_check = None;
                    self.plan_and_move(true).await;
                }
                _ = tokio::time::sleep_until(self.mover.next_hold_deadline().map_or(next_resync, tokio::time::Instant::from_std)),
                    if self.mover.next_hold_deadline().is_some() => {}
                _ = tokio::time::sleep_until(next_resync) => {
                    let started = tokio::time::Instant::now();
                    self.resync().await;
                    self.shrink_sparse();
                    let took = started.elapsed();
                    if took * RESYNC_SHARE > RESYNC_INTERVAL {
                        tracing::debug!(took_ms = took.as_millis() as u64, "slow resync: the next one waits longer");
                    }
                    let wait = (took * RESYNC_SHARE).clamp(RESYNC_INTERVAL, RESYNC_MAX_WAIT);
                    next_resync = tokio::time::Instant::now() + wait;
                }
                Some(cmd) = commands.recv() => self.command(cmd).await,
                Some(a) = extstore::next_answer(&mut store_answers) => self.store_answer(a),
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(
                        self.next_guard_poll.unwrap_or(far))),
                    if self.next_guard_poll.is_some() => self.poll_nat_guards().await,
                _ = tokio::time::sleep_until(tokio::time::Instant::from_std(
                        self.next_helper_wake().unwrap_or(far))),
                    if self.next_helper_wake().is_some() => {}
            }
            // Planned moves not started yet (`queued_starts`): the next
            // share, whatever woke this turn, with its updates sent below.
            if !self.queued_starts.is_empty() {
                self.start_queued(STARTS_PER_TURN).await;
            }
            self.apply_and_send().await;
            // After the flush: an address change starts moves, whose first
            // datagrams must not wait for this write's fsyncs.
            self.host_addrs.save_if_changed();
            // The restart levers after the flush: for the socket they only
            // matter once both ends translate, which what we just sent is
            // what lets the peer do.
            self.restart_translated().await;
            // After the flush: attaching takes the kernel tens of ms, which
            // must not delay what a move just queued.
            self.update_kept().await;
            self.update_standby().await;
            self.end_overdue_holds().await;
            self.release_due_keepalives().await;
            self.release_own_timeouts(false).await;
            self.watch_silence().await;
            self.answer_for_absent_peers().await;
            self.answer_help_waits();
            self.undo_left_changes().await;
            self.save_restart_state();
            self.save_locations(false);
        }
        self.save_locations(true);
        // A socket must not stay without the keepalive its application set,
        // nor a process stopped for a peer.
        self.release_keepalives(true).await;
        self.release_own_timeouts(true).await;
        for f in self.helpers.helping.keys().copied().collect::<Vec<_>>() {
            self.end_helping(f, helping::End::Reopen).await;
        }
        // Nor with a retransmission timeout held for a peer.
        let held: Vec<(VirtualFlow, u32)> = self
            .helpers
            .timeout_restore
            .drain()
            .map(|(f, (prev, _, _))| (f, prev))
            .collect();
        with_dp(&self.dp, move |dp| {
            for (f, prev) in held {
                let _ = dp.set_user_timeout(&f, prev);
            }
        })
        .await;
        self.save_restart_state();
        Ok(())
    }

    /// Keep the local addresses of the mobile UDP connections local
    /// (`Datapath::keep_local`), so that their sends never fail between
    /// an address vanishing and their move. Checked when `standby_due`
    /// says connections or keys changed, before `update_standby` takes
    /// that flag.
    async fn update_kept(&mut self) {
        let routes_changed = std::mem::take(&mut self.kept_renew_due);
        if !self.standby_due && !routes_changed {
            return;
        }
        let mut wanted: Vec<IpAddr> = Vec::new();
        let mut in_use: Vec<IpAddr> = Vec::new();
        // UDP only: a TCP socket never shows a failed send to its
        // application (it retries by itself), and segments sent into the
        // sink are lost where a failed send would have been retried as soon
        // as the route is back (measured: a mass move of TCP connections
        // drained 50 ms slower).
        for v in self
            .endpoint
            .connections()
            .filter(|f| f.proto == crate::datapath::Proto::Udp)
            // A routed container's address is the container's, not ours.
            .filter(|f| self.tracking.anchor(f).is_none())
            .filter_map(|f| self.endpoint.connection(f))
        {
            in_use.push(v.flow.local.ip());
            if v.has_keys {
                wanted.push(v.flow.local.ip());
            }
        }
        // And TCP while this host is cut off from it (its timeout held,
        // `driver/outage.rs`): a send that fails locally counts as a window
        // probe, and `tcp_retries2` of them end the connection whatever its
        // TCP_USER_TIMEOUT (seen: 4 s with tcp_retries2 = 3). Sent into the
        // sink, the data is in flight and retransmitted under the held
        // timeout instead, at once after the move (the restart levers).
        for v in self
            .outages
            .own_timeouts
            .keys()
            .filter(|f| self.tracking.anchor(f).is_none())
            .filter_map(|f| self.endpoint.connection(f))
        {
            in_use.push(v.flow.local.ip());
            wanted.push(v.flow.local.ip());
        }
        for l in [&mut wanted, &mut in_use] {
            l.sort_unstable();
            l.dedup();
        }
        let renew = routes_changed && !wanted.is_empty();
        let args = (wanted, in_use);
        if self.kept.as_ref() == Some(&args) && !renew {
            return;
        }
        let (list, used) = args.clone();
        let wanted = list.clone();
        match with_dp(&self.dp, move |dp| dp.keep_local(&list, &used)).await {
            Ok(()) => {
                self.kept_error = None;
                tracing::debug!(addresses = ?wanted, "addresses kept local for mobile connections")
            }
            Err(e) => {
                let e = e.to_string();
                if self.kept_error.as_ref() == Some(&e) {
                    tracing::debug!(error = %e, "still cannot keep the addresses of mobile connections local");
                } else {
                    tracing::warn!(error = %e, "cannot keep the addresses of mobile connections local: their sends may fail while the host moves");
                    self.kept_error = Some(e);
                }
            }
        }
        // Not again on every turn after a failure: the next change does.
        self.kept = Some(args);
    }

    /// Hide location: compute what the hiding cgroups' applications see
    /// from VCMP's connections (`super::hide`) and write it when it
    /// changed. Nothing to do while no cgroup hides, once the table
    /// written is empty.
    async fn update_hidden(&mut self) {
        if !std::mem::take(&mut self.hide_due) {
            return;
        }
        if !self.hiding && self.last_hidden.as_ref().is_some_and(|t| t.is_empty()) {
            return;
        }
        let table = if self.hiding {
            let seen = self
                .endpoint
                .connections()
                .filter_map(|f| self.endpoint.connection(f))
                .map(|v| super::hide::Seen {
                    flow: v.flow,
                    local_phys: v.local_phys,
                    remote_phys: v.remote_phys,
                    peer: v.peer_key,
                    peer_behind_nat: v.peer_behind_nat,
                })
                .collect::<Vec<_>>();
            self.hider.table(seen)
        } else {
            crate::datapath::HideTable::default()
        };
        if self.last_hidden.as_ref() == Some(&table) {
            return;
        }
        let written = table.clone();
        match with_dp(&self.dp, move |dp| dp.set_hidden(&written)).await {
            Ok(()) => {
                tracing::debug!(
                    peers_shown = table.remote_show.len(),
                    peers_reached = table.remote_reach.len(),
                    local_shown = table.local_show.len(),
                    "hide location updated"
                );
                self.last_hidden = Some(table);
            }
            Err(e) => {
                // Tried again at the next change (not on every turn).
                tracing::warn!(error = %e, "cannot update what hiding applications see of moves");
            }
        }
    }

    /// With `standby_tc`, keep the translators attached to every interface
    /// but `lo` while some connection is paired (it could move onto any of
    /// them), and to none otherwise.
    async fn update_standby(&mut self) {
        if !self.cfg.standby_tc || !std::mem::take(&mut self.standby_due) {
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
                    // The sink of kept addresses' last-resort route.
                    .filter(|i| !i.name().to_bytes().starts_with(b"vnat-sink"))
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

    /// One VCMP datagram into the core, in a span naming the peer it came
    /// from (what the core logs about it carries the address).
    fn datagram(&mut self, from: SocketAddr, to: Option<IpAddr>, n: usize, buf: &[u8]) {
        let span = tracing::debug_span!("vcmp", peer = %from);
        let _in = span.enter();
        self.endpoint
            .handle_datagram_at(now(), &mut OsRng, from, to, &buf[..n]);
    }

    /// The core's events applied, then what it queued sent. Order
    /// matters: become receive-ready for a peer's announced new address
    /// and apply events *before* sending (an UPD_R lets the peer start
    /// sending from its new address); and, before the peer hears of it,
    /// what a hiding application opens once a move works must find its
    /// addresses already hidden.
    pub(super) async fn apply_and_send(&mut self) {
        self.apply_events().await;
        self.update_hidden().await;
        self.flush().await;
    }

    async fn flush(&mut self) {
        // Which interface holds each source address, listed at most once
        // per flush and only when some datagram names its source.
        let mut owners: Option<HashMap<IpAddr, u32>> = None;
        self.send_store_requests();
        while let Some(t) = self.endpoint.poll_transmit(now()) {
            let dst = to_socket_family(t.dst, self.dual);
            if let Some(src) = t.src {
                // Out of that address's own interface, not by the main
                // table's default route (the old link's, after a
                // migration between links).
                let oif = owners
                    .get_or_insert_with(address_owners)
                    .get(&src)
                    .copied()
                    .unwrap_or(0);
                let src = match (src, self.dual) {
                    (IpAddr::V4(v4), true) => IpAddr::V6(v4.to_ipv6_mapped()),
                    _ => src,
                };
                let sent = self
                    .sock
                    .async_io(tokio::io::Interest::WRITABLE, || {
                        send_from(&self.sock, &t.payload, dst, src, oif)
                    })
                    .await;
                match sent {
                    Ok(_) => continue,
                    // The address went away (or is of the other family):
                    // the kernel's choice, as for any other datagram.
                    Err(e) => {
                        tracing::debug!(dst = %t.dst, %src, error = %e, "VCMP send from the connection's address failed; sending without")
                    }
                }
            }
            if let Err(e) = self.sock.send_to(&t.payload, dst).await {
                tracing::debug!(dst = %t.dst, error = %e, "VCMP send failed");
            }
        }
    }
}
