//! The vnatd process: settings, logging, state directory, and the run loop
//! that ties the control socket to the datapath. The binary
//! (`src/bin/vnatd.rs`) only parses flags, opens the kernel datapath and
//! waits for signals.

mod addrwatch;
pub mod cgroup;
pub mod config;
pub mod conflict;
pub mod driver;
pub mod etcd;
pub mod helping;
pub mod hide;
pub mod hostaddrs;
pub mod identity;
pub mod journal;
pub mod locations;
pub mod mobility;
pub mod moveops;
pub mod mover;
pub mod outage;
pub mod restart_state;
pub mod sleep;
pub mod systemd;
pub mod tracking;
pub mod userhelper;

#[cfg(test)]
mod tests;

use std::{
    future::Future,
    io,
    os::unix::fs::{DirBuilderExt, PermissionsExt},
    path::{Path, PathBuf},
};

use crate::{
    control::{ControlListener, DaemonInfo, Handler, ServerError},
    datapath::{owner::DatapathHandle, Datapath, DatapathError, SysctlRestore, SysctlsAtStop},
};
use config::{ConfigError, LogFormat, Settings};

/// Why vnatd could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot create the state directory {}: {source}; create it or pass --state-dir", path.display())]
    StateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the state directory {} exists and is not a directory; remove it or pass --state-dir", path.display())]
    StateDirNotADirectory { path: PathBuf },
    #[error("the state directory {} is {why} (mode {mode:o}); it holds this host's key and its peers' keys: chown root and chmod 700 it", path.display())]
    StateDirUnsafe {
        path: PathBuf,
        mode: u32,
        why: &'static str,
    },
    #[error(transparent)]
    Control(#[from] ServerError),
    #[error("cannot start the datapath: {0}")]
    Datapath(#[from] DatapathError),
    #[error("cannot start the datapath's thread: {0}")]
    DatapathThread(io::Error),
    #[error(transparent)]
    Driver(#[from] driver::DriverError),
    #[error("cannot {what}: {source}")]
    Runtime {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("cannot set up logging: {source}")]
    Logging {
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl DaemonError {
    /// vnatd's exit status: 2 for a usage or config error, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            DaemonError::Config(e) if e.is_usage() => 2,
            _ => 1,
        }
    }
}

/// Install the tracing subscriber: text (or JSON) on stderr, or, when
/// stderr is the journal and the format is text, the journal itself, with
/// each line's priority and fields (`systemd::journal_layer`).
pub fn init_logging(settings: &Settings) -> Result<LogReload, DaemonError> {
    use tracing_subscriber::{layer::SubscriberExt, util::SubscriberInitExt};
    let filter = log_filter(&settings.log_level)?;
    let (filter, handle) = tracing_subscriber::reload::Layer::new(filter);
    // Colour only on a terminal: the journal and log files want plain text.
    let ansi = std::io::IsTerminal::is_terminal(&io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(io::stderr);
    let journal = (settings.log_format == LogFormat::Text && systemd::stderr_is_journal())
        .then(systemd::journal_layer);
    let registry = tracing_subscriber::registry().with(filter);
    let (result, journal_error) = match (settings.log_format, journal) {
        (_, Some(Ok(journal))) => (registry.with(journal).try_init(), None),
        (LogFormat::Text, other) => (registry.with(fmt).try_init(), other.and_then(Result::err)),
        (LogFormat::Json, _) => (registry.with(fmt.json()).try_init(), None),
    };
    result.map_err(|source| DaemonError::Logging {
        source: Box::new(source),
    })?;
    if let Some(e) = journal_error {
        tracing::warn!(error = %e, "cannot write to the journal's socket; logging to stderr instead");
    }
    Ok(LogReload(handle))
}

fn log_filter(level: &str) -> Result<tracing_subscriber::EnvFilter, ConfigError> {
    tracing_subscriber::EnvFilter::builder()
        .parse(level)
        .map_err(|source| ConfigError::LogLevel {
            value: level.to_string(),
            source,
        })
}

/// Changes the log level of the running vnatd (on SIGHUP).
pub struct LogReload(
    tracing_subscriber::reload::Handle<tracing_subscriber::EnvFilter, tracing_subscriber::Registry>,
);

impl LogReload {
    /// Log at `level` (a level or a filter) from now on.
    pub fn set_level(&self, level: &str) -> Result<(), DaemonError> {
        let filter = log_filter(level)?;
        self.0
            .reload(filter)
            .map_err(|source| DaemonError::Logging {
                source: Box::new(source),
            })
    }
}

/// Create the state directory 0700 if missing. An existing one that
/// another user owns or may write is refused: whoever can write there can
/// plant a key or a link where vnatd, which runs as root, writes. One that
/// others may only read is warned about.
pub fn prepare_state_dir(path: &Path) -> Result<(), DaemonError> {
    use std::os::unix::fs::MetadataExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if !meta.is_dir() => Err(DaemonError::StateDirNotADirectory {
            path: path.to_path_buf(),
        }),
        Ok(meta) => {
            let mode = meta.permissions().mode() & 0o7777;
            let unsafe_because = if meta.uid() != nix::unistd::geteuid().as_raw() {
                Some("owned by another user")
            } else if mode & 0o022 != 0 {
                Some("writable by other users")
            } else {
                None
            };
            if let Some(why) = unsafe_because {
                return Err(DaemonError::StateDirUnsafe {
                    path: path.to_path_buf(),
                    mode,
                    why,
                });
            }
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(
                    state_dir = %path.display(),
                    mode = format!("{:o}", meta.permissions().mode() & 0o777),
                    "the state directory is accessible to other users; chmod 700 it"
                );
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|source| DaemonError::StateDir {
                path: path.to_path_buf(),
                source,
            }),
        Err(source) => Err(DaemonError::StateDir {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// What `vnatctl status` reports about the daemon itself.
pub fn daemon_info(settings: &Settings) -> DaemonInfo {
    DaemonInfo {
        version: env!("CARGO_PKG_VERSION").to_string(),
        pid: std::process::id(),
        uptime_secs: 0,
        control: settings.control.clone(),
        state_dir: settings.state_dir.clone(),
        listen: settings.listen,
        configured_cgroups: settings.cgroups.clone(),
    }
}

/// How often the datapath's housekeeping runs (UDP record completion and
/// garbage collection).
const MAINTENANCE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

async fn maintain_periodically(datapath: DatapathHandle) {
    let mut tick = tokio::time::interval(MAINTENANCE_INTERVAL);
    loop {
        tick.tick().await;
        match datapath.run(|dp| dp.maintain()).await {
            Ok(Err(e)) => tracing::warn!(error = %e, "datapath housekeeping failed; retrying"),
            Err(e) => {
                tracing::error!(error = %e, "datapath housekeeping stopped");
                return;
            }
            Ok(Ok(())) => {}
        }
    }
}

/// Apply each reloaded configuration (SIGHUP, `systemctl reload`) without
/// losing any state: cgroups are enabled and disabled to match, the location
/// servers, keepalive interval and standby_tc go to the driver; settings
/// only a restart can change are named in the log. (The log level was set
/// by whoever read the new file.)
async fn apply_reloads(
    mut reloads: tokio::sync::mpsc::Receiver<Settings>,
    mut running: Settings,
    dp: DatapathHandle,
    driver: driver::CommandSender,
    info: std::sync::Arc<std::sync::RwLock<DaemonInfo>>,
    notifier: systemd::Notifier,
) {
    while let Some(new) = reloads.recv().await {
        let plan = config::ReloadPlan::between(&running, &new);
        for key in &plan.restart_only {
            tracing::warn!(
                key,
                "the new configuration changes {key}, which takes effect only when vnatd restarts"
            );
        }
        let (enable, disable) = (plan.enable.clone(), plan.disable.clone());
        let (hide, unhide) = (plan.hide.clone(), plan.unhide.clone());
        let outcome = dp
            .run(move |dp| {
                let mut out = Vec::new();
                for p in &enable {
                    out.push((
                        format!("enable {}", p.display()),
                        dp.enable_cgroup(p).map_err(|e| e.to_string()),
                    ));
                }
                for p in &disable {
                    out.push((
                        format!("disable {}", p.display()),
                        dp.disable_cgroup(p).map_err(|e| e.to_string()),
                    ));
                }
                // After the disables, which stop hiding too; only changes
                // are logged (the file's list is asserted each time).
                for (list, on, what) in [
                    (&hide, true, "hide location for"),
                    (&unhide, false, "stop hiding location for"),
                ] {
                    for p in list {
                        match dp.set_hide_location(p, on) {
                            Ok(false) => {}
                            Ok(true) => out.push((format!("{what} {}", p.display()), Ok(()))),
                            Err(e) => {
                                out.push((format!("{what} {}", p.display()), Err(e.to_string())))
                            }
                        }
                    }
                }
                out
            })
            .await
            .unwrap_or_else(|e| vec![("apply the cgroups".to_string(), Err(e.to_string()))]);
        let mut cgroups_applied = true;
        for (what, r) in outcome {
            match r {
                Ok(()) => tracing::info!("reload: {what}"),
                Err(e) => {
                    cgroups_applied = false;
                    tracing::error!(error = %e, "reload: cannot {what}")
                }
            }
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let sent = driver
            .send(driver::Command::Reconfigure {
                location_servers: new.location_servers.clone(),
                keepalive_secs: new.keepalive_secs,
                standby_tc: new.standby_tc,
                preempt_cgroups: new.preempt_cgroups.clone(),
                reply: tx,
            })
            .await;
        if sent.is_err() || rx.await.is_err() {
            tracing::error!(
                "reload: the VCMP driver has stopped; location servers and keepalives unchanged"
            );
        }
        if cgroups_applied {
            running.cgroups = new.cgroups;
            running.hide_location_cgroups = new.hide_location_cgroups;
            match info.write() {
                Ok(mut i) => i.configured_cgroups = running.cgroups.clone(),
                Err(poisoned) => poisoned.into_inner().configured_cgroups = running.cgroups.clone(),
            }
        }
        running.location_servers = new.location_servers;
        running.keepalive_secs = new.keepalive_secs;
        running.standby_tc = new.standby_tc;
        running.preempt_cgroups = new.preempt_cgroups;
        running.log_level = new.log_level;
        tracing::info!(
            cgroups = ?running.cgroups,
            hide_location_cgroups = ?running.hide_location_cgroups,
            preempt_cgroups = ?running.preempt_cgroups,
            location_servers = ?running.location_servers,
            keepalive_secs = running.keepalive_secs,
            standby_tc = running.standby_tc,
            log_level = %running.log_level,
            "configuration reloaded"
        );
        // Ends the RELOADING=1 that the SIGHUP sent.
        notifier.ready().await;
    }
}

/// Say what a clean stop did with the sysctls vnat changed.
fn log_sysctls(
    outcome: Result<Result<SysctlsAtStop, DatapathError>, crate::datapath::owner::DatapathGone>,
) {
    match outcome {
        Ok(Ok(SysctlsAtStop::Unchanged)) => {}
        Ok(Ok(SysctlsAtStop::Restored(all))) => {
            for r in all {
                match r {
                    SysctlRestore::PutBack { key, value } => {
                        tracing::info!(sysctl = %key, %value, "put back the value from before vnat changed it")
                    }
                    SysctlRestore::LeftChanged { key, value } => tracing::info!(
                        sysctl = %key,
                        %value,
                        "left as it is: it changed since vnat set it"
                    ),
                }
            }
        }
        Ok(Ok(SysctlsAtStop::Kept { lo_addresses })) => tracing::info!(
            lo_addresses,
            "keeping net.ipv4.conf.all.arp_ignore and arp_announce as vnat set them: addresses stay on lo for connections translated while vnatd is down, and without these the host would answer ARP for them on its other links; a clean stop without such addresses, or vnatd --cleanup, puts them back"
        ),
        Ok(Err(e)) => tracing::warn!(error = %e, "cannot put back the sysctls vnat changed"),
        Err(e) => tracing::warn!(error = %e, "cannot put back the sysctls vnat changed"),
    }
}

/// Run vnatd until `shutdown` completes.
///
/// The control socket is bound *before* the datapath is opened: binding is
/// what detects another live vnatd on the same socket, and that one must not
/// have its pins reconciled or its cgroups re-attached under it. On a clean
/// stop the socket is removed and the datapath is left pinned.
pub async fn run<F, S>(
    settings: &Settings,
    open_datapath: F,
    shutdown: S,
    reloads: tokio::sync::mpsc::Receiver<Settings>,
) -> Result<(), DaemonError>
where
    F: FnOnce(&Settings) -> Result<Box<dyn Datapath + Send>, DaemonError>,
    S: Future<Output = ()>,
{
    prepare_state_dir(&settings.state_dir)?;
    let listener = ControlListener::bind(&settings.control)?;
    // On error the listener is dropped here, which removes the socket file.
    let datapath = open_datapath(settings)?;
    let shared = crate::datapath::owner::spawn(datapath).map_err(DaemonError::DatapathThread)?;
    let at_stop = shared.clone();
    let housekeeping = tokio::spawn(maintain_periodically(shared.clone()));
    let driver_cfg = driver::DriverConfig {
        listen: settings.listen,
        state_dir: settings.state_dir.clone(),
        location_servers: settings.location_servers.clone(),
        standby_tc: settings.standby_tc,
        keepalive_secs: settings.keepalive_secs,
        preempt_cgroups: settings.preempt_cgroups.clone(),
        peer_helpers: settings.peer_helpers.clone(),
        helpers_dir: settings.helpers_dir.clone(),
        location_store: settings.location_store.clone(),
    };
    // Move and pairing events, from the driver to `vnatctl monitor`.
    let events = crate::control::events::EventHub::new();
    let driver = driver::Driver::new(driver_cfg, shared.clone())
        .await?
        .with_events(events.clone());
    let settling = driver.suspensions_settling();
    let (commands_tx, commands_rx) = tokio::sync::mpsc::channel(64);
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    let driver_task = tokio::spawn(driver.run(commands_rx, async move {
        let _ = stop_rx.changed().await;
    }));
    let handler = Handler::new(shared.clone(), daemon_info(settings))
        .with_driver(commands_tx.clone())
        .with_events(events);
    // Suspend before sleep and resume after, through logind (`sleep`).
    let sleeping = settings.sleep_inhibit.then(|| {
        let sleep_handler =
            Handler::new(shared.clone(), daemon_info(settings)).with_driver(commands_tx.clone());
        tokio::spawn(sleep::watch(sleep::Mobility::new(sleep_handler, settling)))
    });
    let notifier = systemd::Notifier::new(handler.clone());
    let reloading = tokio::spawn(apply_reloads(
        reloads,
        settings.clone(),
        shared,
        commands_tx,
        handler.daemon_info(),
        notifier.clone(),
    ));
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        control = %settings.control.display(),
        state_dir = %settings.state_dir.display(),
        bpffs = %settings.bpffs.display(),
        listen = %settings.listen,
        cgroups = ?settings.cgroups,
        location_servers = ?settings.location_servers,
        location_store = %config::store::describe(&settings.location_store),
        config = %settings
            .config_file
            .as_deref()
            .map_or_else(|| "none, defaults".to_string(), |p| p.display().to_string()),
        "vnatd started"
    );
    notifier.ready().await;
    let reporting = tokio::spawn(notifier.report_periodically());
    listener.serve(handler, shutdown).await;
    systemd::stopping();
    reporting.abort();
    housekeeping.abort();
    reloading.abort();
    if let Some(s) = sleeping {
        s.abort();
    }
    let _ = stop_tx.send(true);
    match driver_task.await {
        Ok(Err(e)) => tracing::warn!(error = %e, "the VCMP driver stopped with an error"),
        Err(e) => tracing::warn!(error = %e, "the VCMP driver task failed"),
        Ok(Ok(())) => {}
    }
    log_sysctls(at_stop.run(|dp| dp.restore_sysctls()).await);
    // Nobody answers a PROVE at a routed container's address any more: its
    // VCMP datagrams go to the container again.
    if let Ok(Err(e)) = at_stop
        .run(|dp| dp.receive_vcmp_at(&Default::default(), 0))
        .await
    {
        tracing::warn!(error = %e, "cannot remove the rules that took VCMP datagrams to routed containers' addresses; `vnatd --cleanup` removes them");
    }
    tracing::info!(
        bpffs = %settings.bpffs.display(),
        "vnatd stopped; the eBPF programs and maps stay pinned, so translated connections keep working until vnatd starts again"
    );
    Ok(())
}
