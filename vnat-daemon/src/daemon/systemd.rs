//! vnatd as a systemd service: what it tells the service manager
//! (sd_notify(3): `READY=1` once the datapath is attached and the control
//! socket answers, `RELOADING=1` and `READY=1` around a SIGHUP reload,
//! `STOPPING=1`, and a one-line `STATUS=`), and whether its standard error
//! is the journal (`JOURNAL_STREAM`), in which case it logs there natively,
//! with each line's priority and fields ([`journal`]).
//!
//! Without `NOTIFY_SOCKET` (not started by systemd, or a unit that is not
//! `Type=notify`) nothing is sent and the status is never worked out.

mod journal;

use std::{io, time::Duration};

use sd_notify::NotifyState;

use crate::{
    control::{Handler, Outcome, PeerInfo, Reply, Request},
    datapath::DatapathStatus,
};

pub use journal::JournalLines;

/// How often `STATUS=` (what `systemctl status vnatd` shows under the
/// unit's name) is worked out again.
pub const STATUS_INTERVAL: Duration = Duration::from_secs(15);

/// Tells systemd how vnatd is doing. Cheap to clone.
#[derive(Clone)]
pub struct Notifier {
    /// Answers the `status` and `peers` requests the summary is made of;
    /// `None` when there is no service manager to tell.
    handler: Option<Handler>,
}

impl Notifier {
    /// A notifier that sends only if this process was given a
    /// `NOTIFY_SOCKET`.
    pub fn new(handler: Handler) -> Notifier {
        Notifier {
            handler: std::env::var_os("NOTIFY_SOCKET").map(|_| handler),
        }
    }

    /// `READY=1` with a current `STATUS=`: at start, once the datapath is
    /// attached and just before the control socket is served (connections
    /// made before that wait in its backlog, so `vnatctl status` answers),
    /// and at the end of a reload.
    pub async fn ready(&self) {
        self.send_with_status(true).await;
    }

    /// `STATUS=` every [`STATUS_INTERVAL`], until the task is aborted.
    pub async fn report_periodically(self) {
        if self.handler.is_none() {
            return;
        }
        let mut tick = tokio::time::interval(STATUS_INTERVAL);
        // The first tick is now, right after READY=1 sent the same line.
        tick.tick().await;
        loop {
            tick.tick().await;
            self.send_with_status(false).await;
        }
    }

    /// Send a fresh `STATUS=` line, after `READY=1` if `ready`. The handler
    /// blocks on the datapath's thread and the VCMP driver, so it runs on a
    /// blocking thread.
    async fn send_with_status(&self, ready: bool) {
        let Some(handler) = self.handler.clone() else {
            return;
        };
        let sent = tokio::task::spawn_blocking(move || {
            let line = current_summary(&handler);
            let status = NotifyState::Status(&line);
            if ready {
                sd_notify::notify(&[NotifyState::Ready, status])
            } else {
                sd_notify::notify(&[status])
            }
        })
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot notify systemd"),
            Err(e) => tracing::warn!(error = %e, "the systemd notification task failed"),
        }
    }
}

/// `RELOADING=1` when SIGHUP starts a reload, with the `MONOTONIC_USEC=`
/// that `Type=notify-reload` (systemd 253) requires beside it; `READY=1`
/// ([`Notifier::ready`], or [`reload_refused`]) ends it.
pub fn reloading() {
    let sent = NotifyState::monotonic_usec_now()
        .and_then(|now| sd_notify::notify(&[NotifyState::Reloading, now]));
    if let Err(e) = sent {
        tracing::warn!(error = %e, "cannot tell systemd that vnatd is reloading");
    }
}

/// `READY=1` after a reload that changed nothing (the file was refused).
pub fn reload_refused() {
    if let Err(e) = sd_notify::notify(&[NotifyState::Ready]) {
        tracing::warn!(error = %e, "cannot tell systemd that the reload is over");
    }
}

/// `STOPPING=1` at a clean stop.
pub fn stopping() {
    if let Err(e) = sd_notify::notify(&[NotifyState::Stopping]) {
        tracing::debug!(error = %e, "cannot tell systemd that vnatd is stopping");
    }
}

/// The summary from what `vnatctl status` and `vnatctl peers` answer now.
fn current_summary(handler: &Handler) -> String {
    let datapath = match handler.handle(&Request::Status).outcome {
        Outcome::Ok(Reply::Status(st)) => Some(st.datapath),
        _ => None,
    };
    let peers = match handler.handle(&Request::Peers).outcome {
        Outcome::Ok(Reply::Peers { peers }) => Some(peers),
        _ => None,
    };
    summary(datapath.as_ref(), peers.as_deref())
}

/// `STATUS=`'s line: "12 connections, 3 translated, 2 peers; degraded:
/// tcx, tcp-info-windows". Connections and translated as `vnatctl status`
/// counts them, peers as many as `vnatctl peers` lists (left out when the
/// VCMP driver does not answer), and the kernel features whose absence
/// weakens vnat, by the names `vnatd --check` uses.
pub fn summary(datapath: Option<&DatapathStatus>, peers: Option<&[PeerInfo]>) -> String {
    let Some(d) = datapath else {
        return "the datapath does not answer".to_string();
    };
    let plural = |n: u64, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    let mut line = format!(
        "{}, {} translated",
        plural(d.connections, "connection"),
        d.translations
    );
    if let Some(p) = peers {
        line.push_str(", ");
        line.push_str(&plural(p.len() as u64, "peer"));
    }
    if !d.degraded.is_empty() {
        let names: Vec<&str> = d.degraded.iter().map(|g| g.feature.as_str()).collect();
        line.push_str("; degraded: ");
        line.push_str(&names.join(", "));
    }
    line
}

/// Whether standard error is a stream to the journal: systemd then sets
/// `JOURNAL_STREAM` to its device and inode ("DEV:INODE", decimal;
/// systemd.exec(5), "Environment variables in spawned processes"). Checked
/// against fd 2 itself, because the variable is inherited by whatever a
/// service starts, with its own standard error (a terminal, a file).
pub fn stderr_is_journal() -> bool {
    let Some(value) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Ok(st) = nix::sys::stat::fstat(libc::STDERR_FILENO) else {
        return false;
    };
    value
        .to_str()
        .is_some_and(|v| names_stream(v, st.st_dev, st.st_ino))
}

/// What starts a line written straight to stderr that says why vnatd
/// stops: the journal reads a `<3>` prefix as priority err (sd-daemon(3)),
/// so `journalctl -p err` shows it; nothing elsewhere.
pub fn error_prefix() -> &'static str {
    if stderr_is_journal() {
        "<3>"
    } else {
        ""
    }
}

/// Whether a `JOURNAL_STREAM` value names the file with `dev` and `ino`.
fn names_stream(value: &str, dev: u64, ino: u64) -> bool {
    value.split_once(':').is_some_and(|(d, i)| {
        d.parse::<u64>().is_ok_and(|d| d == dev) && i.parse::<u64>().is_ok_and(|i| i == ino)
    })
}

/// The journal layer: each event to journald with its priority (error 3,
/// warn 4, info 6, debug and trace 7), its fields as `VNAT_<NAME>` fields
/// (`journalctl VNAT_ID=<id>` follows one connection) and a `MESSAGE=`
/// that reads like the text log's line, fields included.
pub fn journal_layer() -> io::Result<JournalLines<tracing_journald::Layer>> {
    use tracing_journald::{Priority, PriorityMappings};
    let layer = tracing_journald::layer()?
        .with_field_prefix(Some("VNAT".to_string()))
        .with_syslog_identifier("vnatd".to_string())
        // The crate's default puts info at notice (5) and debug at info:
        // `journalctl -p info` would then show the debug lines.
        .with_priority_mappings(PriorityMappings {
            info: Priority::Informational,
            debug: Priority::Debug,
            trace: Priority::Debug,
            ..PriorityMappings::new()
        });
    Ok(JournalLines::new(layer))
}

#[cfg(test)]
mod tests;
