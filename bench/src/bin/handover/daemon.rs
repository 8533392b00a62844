//! vnatd for the handover benchmark: the harness's way of starting it
//! (namespace, pins, cgroup, private state directory), but with JSON logs
//! written to a file, so that the benchmark can place vnatd's own steps (move
//! started, translation installed) on its timeline.

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use vnat_tests::{bin_path, Host};

pub struct Daemon {
    child: Child,
    pub control: PathBuf,
    pub log: PathBuf,
    state: PathBuf,
}

impl Daemon {
    pub fn start(host: &Host, dir: &Path, standby_tc: bool) -> Result<Daemon> {
        Daemon::start_with(host, dir, standby_tc, &[])
    }

    /// [`Daemon::start`] with more of vnatd's flags.
    pub fn start_with(
        host: &Host,
        dir: &Path,
        standby_tc: bool,
        extra: &[String],
    ) -> Result<Daemon> {
        let control = dir.join("vnatd.sock");
        let state = dir.join("state");
        let log = dir.join("vnatd.log");
        let err = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = host
            .ns
            .cmd(bin_path("vnatd"))
            .arg("--control")
            .arg(&control)
            .arg("--state-dir")
            .arg(&state)
            .arg("--bpffs")
            .arg(host.pins.path())
            .arg("--cgroup")
            .arg(host.cgroup.path())
            .args([
                "--config",
                "/dev/null",
                "--log-format",
                "json",
                "--log-level",
            ])
            // The figures come from info lines; debug or trace shows more
            // of a run (and slows vnatd down).
            .arg(std::env::var("VNAT_BENCH_LOG_LEVEL").unwrap_or_else(|_| "info".into()))
            .args((!standby_tc).then_some("--no-standby-tc"))
            .args(extra)
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .context("starting vnatd")?;
        let mut d = Daemon {
            child,
            control,
            log,
            state,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while d.ctl(&["status"]).is_none() {
            if let Some(status) = d.child.try_wait()? {
                bail!(
                    "vnatd in {} exited at start ({status}): {}",
                    host.ns.name(),
                    d.last_log_line()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "vnatd in {} did not answer on its control socket within 20 s",
                    host.ns.name()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(d)
    }

    /// `vnatctl --json ARGS`; `None` if vnatd cannot be reached (yet).
    pub fn ctl(&self, args: &[&str]) -> Option<Value> {
        let out = Command::new(bin_path("vnatctl"))
            .arg("--control")
            .arg(&self.control)
            .arg("--json")
            .args(args)
            .output()
            .ok()?;
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }

    /// `vnatctl [--json] ARGS`'s standard output, failing with its stderr.
    pub fn ctl_raw(&self, json: bool, args: &[&str]) -> Result<Vec<u8>> {
        let mut cmd = Command::new(bin_path("vnatctl"));
        cmd.arg("--control").arg(&self.control);
        if json {
            cmd.arg("--json");
        }
        let out = cmd.args(args).output().context("running vnatctl")?;
        ensure!(
            out.status.success(),
            "vnatctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        Ok(out.stdout)
    }

    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// True once this vnatd has pinned a peer's host key (`peers.json`).
    pub fn paired(&self) -> bool {
        std::fs::read_to_string(self.state.join("peers.json")).is_ok_and(|s| s.len() > 4)
    }

    /// vnatd's log events with `message`, as CLOCK_REALTIME nanoseconds.
    pub fn events(&self, message: &str) -> Vec<u64> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["fields"]["message"] == message)
            .filter_map(|v| v["timestamp"].as_str().and_then(parse_rfc3339_ns))
            .collect()
    }

    fn last_log_line(&self) -> String {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .last()
            .unwrap_or("(no log)")
            .to_string()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `2026-11-22T05:52:01.123456Z` (tracing-subscriber's UTC timestamps) as
/// nanoseconds since the epoch.
pub fn parse_rfc3339_ns(s: &str) -> Option<u64> {
    let s = s.strip_suffix('Z')?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, ""));
    let mut t = hms.splitn(3, ':').map(|p| p.parse::<u64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    let frac_ns = if frac.is_empty() {
        0
    } else {
        let digits: String = frac.chars().take(9).collect();
        digits.parse::<u64>().ok()? * 10u64.pow(9 - digits.len() as u32)
    };
    // Days from the civil date (proleptic Gregorian), after H. Hinnant.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = u64::try_from(days).ok()? * 86_400 + hh * 3600 + mm * 60 + ss;
    Some(secs * 1_000_000_000 + frac_ns)
}

#[cfg(test)]
mod tests {
    use super::parse_rfc3339_ns;

    #[test]
    fn parses_tracing_timestamps() {
        assert_eq!(
            parse_rfc3339_ns("1970-01-01T00:00:01.5Z"),
            Some(1_500_000_000)
        );
        // date -u -d 2026-11-22T05:52:01Z +%s = 1795326721
        assert_eq!(
            parse_rfc3339_ns("2026-11-22T05:52:01.000123Z"),
            Some(1_795_326_721_000_123_000)
        );
        assert_eq!(parse_rfc3339_ns("not a time"), None);
    }
}
