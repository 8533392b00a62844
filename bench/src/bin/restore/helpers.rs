//! The restoration benchmark's helper processes (`restore echo`, `restore
//! client`) in the hosts' namespaces and cgroups, driven through stdin and
//! read through their JSON lines on stdout.

use std::{
    io::Write,
    net::SocketAddr,
    process::{Child, ChildStdin, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use vnat_bench::lines::read_json_lines;
use vnat_tests::Host;

/// Helper processes of one kind that share the connections between them.
pub struct Helpers(pub Vec<Helper>);

impl Helpers {
    pub fn sum(&self, f: impl Fn(&HelperLog) -> usize) -> usize {
        self.0.iter().map(|h| f(&h.log())).sum()
    }

    pub fn all(&self, f: impl Fn(&HelperLog) -> bool) -> bool {
        self.0.iter().all(|h| f(&h.log()))
    }

    pub fn error(&self) -> Option<String> {
        self.0.iter().find_map(|h| h.log().error.clone())
    }

    pub fn send(&mut self, line: &str) -> Result<()> {
        self.0.iter_mut().try_for_each(|h| h.send(line))
    }

    pub fn wait_for(
        &self,
        what: &str,
        limit: Duration,
        done: impl Fn(&Helpers) -> bool,
    ) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            if done(self) {
                return Ok(());
            }
            if let Some(e) = self.error() {
                bail!("waiting for {what}: {e}");
            }
            ensure!(
                Instant::now() < deadline,
                "waiting for {what}: nothing within {limit:?}"
            );
            ensure!(!vnat_bench::interrupted(), "interrupted");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops every helper and returns what they reported together.
    pub fn stop(self) -> HelperLog {
        let mut all = HelperLog::default();
        for h in self.0 {
            let l = h.stop();
            all.restored.extend(l.restored);
            all.conn_errors.extend(l.conn_errors);
            all.error = all.error.or(l.error);
        }
        all
    }
}

/// A connection's restoration as the client reported it.
#[derive(Clone, Debug)]
pub struct Restored {
    pub local: Option<SocketAddr>,
    /// CLOCK_MONOTONIC ns: the message's write, its echo's arrival.
    pub sent: u64,
    pub recv: u64,
}

#[derive(Default)]
pub struct HelperLog {
    pub listening: bool,
    pub connected: Option<usize>,
    pub echoing: bool,
    pub restored: Vec<Restored>,
    pub conn_errors: Vec<String>,
    pub stats: Vec<Value>,
    pub verified: Option<(usize, usize)>,
    pub error: Option<String>,
}

/// A helper process (`restore echo` or `restore client`) in a host's
/// namespace and cgroup, and what it has printed so far.
pub struct Helper {
    child: Child,
    stdin: Option<ChildStdin>,
    log: Arc<Mutex<HelperLog>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Helper {
    pub fn spawn(host: &Host, args: &[&str], stdin: bool) -> Result<Helper> {
        let exe = std::env::current_exe().context("finding the benchmark's own executable")?;
        let mut cmd = host.ns.cmd(exe);
        host.cgroup.join_on_spawn(&mut cmd);
        cmd.args(args)
            .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped());
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting `restore {}`", args[0]))?;
        let stdout = child.stdout.take().expect("piped");
        let stdin = child.stdin.take();
        let log = Arc::new(Mutex::new(HelperLog::default()));
        let what = args[0].to_string();
        let reader = read_json_lines(
            stdout,
            log.clone(),
            |log: &mut HelperLog, v| {
                if v.get("conn").is_some() {
                    if let Some(e) = v["error"].as_str() {
                        log.conn_errors
                            .push(format!("{}: {e}", v["local"].as_str().unwrap_or("?")));
                    } else if let (Some(sent), Some(recv)) =
                        (v["sent_ns"].as_u64(), v["recv_ns"].as_u64())
                    {
                        let local = v["local"].as_str().and_then(|s| s.parse().ok());
                        log.restored.push(Restored { local, sent, recv });
                    }
                } else if v.get("stats").is_some() {
                    log.stats.push(v["stats"].clone());
                } else if v.get("listening").is_some() {
                    log.listening = true;
                } else if let Some(n) = v["connected"].as_u64() {
                    log.connected = Some(n as usize);
                } else if v.get("echoing").is_some() {
                    log.echoing = true;
                } else if let (Some(k), Some(of)) = (v["verified"].as_u64(), v["of"].as_u64()) {
                    log.verified = Some((k as usize, of as usize));
                } else if let Some(e) = v["error"].as_str() {
                    log.error = Some(e.to_string());
                }
            },
            move |log| {
                if log.error.is_none() {
                    log.error = Some(format!("`restore {what}` exited"));
                }
            },
        );
        Ok(Helper {
            child,
            stdin,
            log,
            reader: Some(reader),
        })
    }

    pub fn log(&self) -> std::sync::MutexGuard<'_, HelperLog> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn send(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("the helper has no stdin")?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .context("writing to the client")?;
        stdin.flush().context("writing to the client")
    }

    /// Stops the helper and returns everything it reported.
    pub fn stop(mut self) -> HelperLog {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        std::mem::take(&mut *self.log())
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
