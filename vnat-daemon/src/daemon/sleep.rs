//! Sleep through logind (issue 30): vnatd holds a "delay" inhibitor for
//! sleep (org.freedesktop.login1 on the system bus). On
//! `PrepareForSleep(true)` it does what `vnatctl suspend --all` does, while
//! the network is still up (a system-sleep hook runs after NetworkManager
//! took it down), waits until the peers have settled roles and keys, and
//! releases the inhibitor: always before logind's `InhibitDelayMaxUSec`
//! runs out ([`budget`]), whatever the peers do. On
//! `PrepareForSleep(false)` it resumes (`resume --all`) and takes a new
//! inhibitor.
//!
//! Suspend and resume go through the control handler, as vnatctl's do;
//! that the peers settled comes from the driver
//! (`Driver::suspensions_settling`).
//! Without a system bus or logind (containers, test hosts) vnatd says so
//! once and works as before.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use futures_util::StreamExt;
use tokio::sync::watch;
use zbus::{proxy::CacheProperties, zvariant::OwnedFd};

use crate::control::{Handler, Outcome, Reply, Request, Selector};

/// logind's default `InhibitDelayMaxSec`, for a logind whose delay cannot
/// be read.
const LOGIND_DEFAULT_DELAY: Duration = Duration::from_secs(5);
/// How much of logind's delay is left, at least, when the inhibitor goes.
const MARGIN: Duration = Duration::from_secs(1);
/// The longest a call to the bus may take (connecting, taking the
/// inhibitor): none of them is on the way to releasing it.
const BUS_TIMEOUT: Duration = Duration::from_secs(10);

/// The part of logind's Manager interface vnatd uses (see
/// org.freedesktop.login1(5)).
#[zbus::proxy(
    interface = "org.freedesktop.login1.Manager",
    default_service = "org.freedesktop.login1",
    default_path = "/org/freedesktop/login1",
    gen_blocking = false
)]
trait Manager {
    /// Take an inhibitor lock: it holds while the returned descriptor is
    /// open.
    fn inhibit(&self, what: &str, who: &str, why: &str, mode: &str) -> zbus::Result<OwnedFd>;

    /// The longest logind waits for delay inhibitors (microseconds).
    #[zbus(property, name = "InhibitDelayMaxUSec")]
    fn inhibit_delay_max_usec(&self) -> zbus::Result<u64>;

    /// Sent before sleep (`true`) and after wake (`false`).
    #[zbus(signal)]
    fn prepare_for_sleep(&self, start: bool) -> zbus::Result<()>;
}

/// How long the suspend before sleep may take: logind's `delay` less
/// [`MARGIN`], or half the delay when it is shorter than twice the margin,
/// so that the inhibitor is released before logind stops waiting for it.
pub fn budget(delay: Duration) -> Duration {
    if delay >= 2 * MARGIN {
        delay - MARGIN
    } else {
        delay / 2
    }
}

/// What vnatd does around sleep: the control handler's suspend and resume
/// of every connection, and the driver's count of suspensions its peers
/// have yet to settle.
pub struct Mobility {
    handler: Arc<Handler>,
    settling: watch::Receiver<usize>,
}

impl Mobility {
    pub fn new(handler: Handler, settling: watch::Receiver<usize>) -> Mobility {
        Mobility {
            handler: Arc::new(handler),
            settling,
        }
    }

    /// One request to the control handler, on a blocking thread (it waits
    /// for the driver); `None` if the handler's thread failed.
    async fn request(&self, request: Request) -> Option<Outcome> {
        let handler = self.handler.clone();
        tokio::task::spawn_blocking(move || handler.handle(&request).outcome)
            .await
            .ok()
    }

    /// `suspend --all`, then wait until the peers settled what it started.
    /// Returns how many connections were suspended.
    async fn suspend_all(&self) -> usize {
        let request = Request::Suspend {
            selector: Selector::All,
            helpers: Vec::new(),
        };
        let suspended = match self.request(request).await {
            Some(Outcome::Ok(Reply::Suspended(r))) => r.suspended.len(),
            Some(Outcome::Error(e)) => {
                tracing::info!(reason = %e.message, "about to sleep: no connection to suspend");
                0
            }
            Some(Outcome::Ok(_)) | None => {
                tracing::warn!("about to sleep: the suspend of every connection failed");
                0
            }
        };
        // The driver counted the suspensions before it answered the
        // handler, so 0 here means settled, not "not started yet". (An
        // error: the driver stopped, and nothing will settle.)
        if suspended > 0 {
            let _ = self.settling.clone().wait_for(|n| *n == 0).await;
        }
        suspended
    }

    /// `resume --all`.
    async fn resume_all(&self) {
        match self
            .request(Request::Resume {
                selector: Selector::All,
            })
            .await
        {
            Some(Outcome::Ok(Reply::Resumed(r))) => {
                tracing::info!(moves_started = r.moves_started, "woke up: resumed")
            }
            Some(Outcome::Error(e)) => {
                tracing::debug!(reason = %e.message, "woke up: nothing to resume")
            }
            Some(Outcome::Ok(_)) | None => tracing::warn!("woke up: the resume failed"),
        }
    }
}

/// Watch sleep until vnatd stops (run it as a task; dropping it releases
/// the inhibitor). Returns early, after one line at info, when there is no
/// system bus or no logind on it.
pub async fn watch(mobility: Mobility) {
    let connect = async {
        zbus::connection::Builder::system()?
            .method_timeout(BUS_TIMEOUT)
            .build()
            .await
    };
    let conn = match tokio::time::timeout(BUS_TIMEOUT, connect).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return unwatched("no system bus", &e.to_string()),
        Err(_) => return unwatched("no system bus", "connecting timed out"),
    };
    let manager = match ManagerProxy::builder(&conn)
        .cache_properties(CacheProperties::No)
        .build()
        .await
    {
        Ok(m) => m,
        Err(e) => return unwatched("no logind on the system bus", &e.to_string()),
    };
    // Subscribed before the inhibitor is taken: no sleep goes unseen.
    let mut signals = match manager.receive_prepare_for_sleep().await {
        Ok(s) => s,
        Err(e) => return unwatched("no logind on the system bus", &e.to_string()),
    };
    let Some((mut inhibitor, mut delay)) = inhibit(&manager).await else {
        return;
    };
    tracing::info!(
        delay_ms = delay.as_millis() as u64,
        "holding logind's sleep inhibitor: connections are settled with their peers before the host sleeps"
    );
    while let Some(signal) = signals.next().await {
        let start = match signal.args() {
            Ok(a) => *a.start(),
            Err(e) => {
                tracing::warn!(error = %e, "ignored a PrepareForSleep signal without its boolean");
                continue;
            }
        };
        if start {
            let budget = budget(delay);
            let started = Instant::now();
            let settled = tokio::time::timeout(budget, mobility.suspend_all()).await;
            // Closing our end is what tells logind it may go on.
            drop(inhibitor.take());
            let took_ms = started.elapsed().as_millis() as u64;
            match settled {
                Ok(connections) => tracing::info!(
                    connections,
                    took_ms,
                    "about to sleep: connections settled with their peers; sleep inhibitor released"
                ),
                Err(_) => tracing::warn!(
                    took_ms,
                    budget_ms = budget.as_millis() as u64,
                    "about to sleep: some peers did not settle in time (logind waits only so long); sleep inhibitor released"
                ),
            }
        } else {
            mobility.resume_all().await;
            if inhibitor.is_none() {
                if let Some((fd, d)) = inhibit(&manager).await {
                    (inhibitor, delay) = (fd, d);
                }
            }
        }
    }
    tracing::warn!("the system bus closed: sleep is no longer watched; use vnatctl suspend/resume");
}

/// Take a delay inhibitor for sleep and read logind's delay. `None` (said
/// once, at info) if logind refuses.
async fn inhibit(manager: &ManagerProxy<'_>) -> Option<(Option<OwnedFd>, Duration)> {
    let fd = match manager
        .inhibit(
            "sleep",
            "vnatd",
            "Settling moving connections with their peers",
            "delay",
        )
        .await
    {
        Ok(fd) => fd,
        Err(e) => {
            unwatched("logind gives no sleep inhibitor", &e.to_string());
            return None;
        }
    };
    let delay = match manager.inhibit_delay_max_usec().await {
        Ok(us) => Duration::from_micros(us),
        Err(e) => {
            tracing::debug!(error = %e, "cannot read logind's InhibitDelayMaxUSec; assuming its default, 5 s");
            LOGIND_DEFAULT_DELAY
        }
    };
    Some((Some(fd), delay))
}

fn unwatched(why: &str, detail: &str) {
    tracing::info!(
        detail,
        "{why}: sleep is not watched; use vnatctl suspend/resume"
    );
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::Parser;

    use super::*;
    use crate::daemon::config::{parse_file, Args, FileConfig, Settings};

    #[test]
    fn the_inhibitor_goes_a_second_before_logind_s_delay_and_never_after_it() {
        assert_eq!(budget(Duration::from_secs(5)), Duration::from_secs(4));
        assert_eq!(budget(Duration::from_secs(2)), Duration::from_secs(1));
        assert_eq!(
            budget(Duration::from_millis(1500)),
            Duration::from_millis(750)
        );
        assert_eq!(budget(Duration::ZERO), Duration::ZERO);
        for ms in [0, 1, 999, 1000, 1999, 2000, 5000, 30_000] {
            let d = Duration::from_millis(ms);
            assert!(budget(d) <= d, "{ms} ms");
        }
    }

    fn sleep_inhibit(flags: &[&str], file: &str) -> bool {
        let args = Args::try_parse_from(std::iter::once("vnatd").chain(flags.iter().copied()))
            .unwrap_or_else(|e| panic!("flags {flags:?} refused: {e}"));
        let file: FileConfig = parse_file(Path::new("t.toml"), file)
            .unwrap_or_else(|e| panic!("{file:?} refused: {e}"));
        Settings::resolve(args, None, file, None, || Ok("/cg2".into()))
            .unwrap_or_else(|e| panic!("settings refused: {e}"))
            .sleep_inhibit
    }

    #[test]
    fn sleep_inhibit_is_on_by_default_and_flags_override_the_file() {
        assert!(sleep_inhibit(&[], ""));
        assert!(!sleep_inhibit(&["--no-sleep-inhibit"], ""));
        assert!(!sleep_inhibit(&[], "sleep_inhibit = false"));
        assert!(sleep_inhibit(&["--sleep-inhibit"], "sleep_inhibit = false"));
        assert!(!sleep_inhibit(
            &["--no-sleep-inhibit"],
            "sleep_inhibit = true"
        ));
        assert!(Args::try_parse_from(["vnatd", "--sleep-inhibit", "--no-sleep-inhibit"]).is_err());
        assert!(parse_file(Path::new("t.toml"), "sleep_inhibit = \"no\"").is_err());
    }
}
