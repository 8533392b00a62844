//! The Rust side of `vnat-stream`: spawn it in a namespace, follow its JSON
//! status lines, wait for progress, stop it and get the final summary.
use std::{
    io::{BufRead, BufReader, Read},
    net::SocketAddr,
    process::{Child, Command, Stdio},
    sync::{Arc, Condvar, Mutex},
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{kill, Signal},
    unistd::Pid,
};
use serde_json::Value;

use super::{bin_path, Netns};

/// What `vnat-stream client` is told to do.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    pub connect: SocketAddr,
    pub udp: bool,
    /// Bytes per second to send (None: the tool's default, 100000; Some(0):
    /// as fast as the socket takes them).
    pub rate_bytes_per_sec: Option<u64>,
    /// Stop by itself after this many seconds.
    pub duration_secs: Option<u64>,
    /// Local address to bind before connecting.
    pub bind: Option<std::net::IpAddr>,
    /// With `bind`, the local port (0: the kernel's choice).
    pub bind_port: u16,
    /// UDP: bytes per datagram (vnat-stream's default otherwise).
    pub datagram_size: Option<usize>,
    /// UDP: stop at the first failed send (as many applications do).
    pub exit_on_send_error: bool,
    /// TCP: send nothing and verify what the server sends
    /// ([`super::EchoServer::tcp_source_in`]).
    pub receive_only: bool,
}

impl StreamOptions {
    pub fn tcp(connect: SocketAddr) -> Self {
        StreamOptions {
            connect,
            udp: false,
            rate_bytes_per_sec: None,
            duration_secs: None,
            bind: None,
            bind_port: 0,
            datagram_size: None,
            exit_on_send_error: false,
            receive_only: false,
        }
    }

    pub fn udp(connect: SocketAddr) -> Self {
        StreamOptions {
            udp: true,
            ..Self::tcp(connect)
        }
    }

    /// UDP: stop at the first failed send instead of going on.
    pub fn exit_on_send_error(mut self) -> Self {
        self.exit_on_send_error = true;
        self
    }

    /// TCP: a download from [`super::EchoServer::tcp_source_in`].
    pub fn receive_only(mut self) -> Self {
        self.receive_only = true;
        self
    }

    pub fn rate(mut self, bytes_per_sec: u64) -> Self {
        self.rate_bytes_per_sec = Some(bytes_per_sec);
        self
    }

    pub fn duration_secs(mut self, secs: u64) -> Self {
        self.duration_secs = Some(secs);
        self
    }

    pub fn bind(mut self, ip: std::net::IpAddr) -> Self {
        self.bind = Some(ip);
        self
    }

    /// Bind to exactly `local` (address and port) before connecting.
    pub fn bind_to(mut self, local: SocketAddr) -> Self {
        self.bind = Some(local.ip());
        self.bind_port = local.port();
        self
    }

    /// UDP datagrams of `size` bytes (the echo server must read as many).
    pub fn datagram_size(mut self, size: usize) -> Self {
        self.datagram_size = Some(size);
        self
    }

    /// The command that runs `vnat-stream client` with these options in `ns`,
    /// for callers that add more (e.g. `Cgroup::join_on_spawn`) before
    /// [`StreamClient::from_command`].
    pub fn command(&self, ns: &Netns) -> Command {
        let mut cmd = ns.cmd(bin_path("vnat-stream"));
        cmd.arg("client")
            .arg("--connect")
            .arg(self.connect.to_string());
        if self.udp {
            cmd.arg("--udp");
        }
        if let Some(r) = self.rate_bytes_per_sec {
            cmd.arg("--rate-bytes-per-sec").arg(r.to_string());
        }
        if let Some(d) = self.duration_secs {
            cmd.arg("--duration-secs").arg(d.to_string());
        }
        if let Some(b) = self.bind {
            cmd.arg("--bind").arg(b.to_string());
            if self.bind_port != 0 {
                cmd.arg("--bind-port").arg(self.bind_port.to_string());
            }
        }
        if let Some(n) = self.datagram_size {
            cmd.arg("--datagram-size").arg(n.to_string());
        }
        if self.exit_on_send_error {
            cmd.arg("--exit-on-send-error");
        }
        if self.receive_only {
            cmd.arg("--receive-only");
        }
        cmd
    }
}

/// One status line of `vnat-stream` (the raw JSON is in `json`; UDP lines
/// carry extra fields such as `lost` and `duplicates`).
#[derive(Clone, Debug)]
pub struct StreamStatus {
    pub t_ms: u64,
    pub sent: u64,
    pub verified: u64,
    pub max_gap_ms: u64,
    pub local: String,
    pub remote: String,
    pub error: Option<String>,
    pub is_final: bool,
    pub json: Value,
}

impl StreamStatus {
    fn parse(line: &str) -> Option<StreamStatus> {
        let json: Value = serde_json::from_str(line).ok()?;
        let u = |k: &str| json.get(k).and_then(Value::as_u64).unwrap_or(0);
        let s = |k: &str| {
            json.get(k)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        Some(StreamStatus {
            t_ms: u("t_ms"),
            sent: u("sent"),
            verified: u("verified"),
            max_gap_ms: u("max_gap_ms"),
            local: s("local"),
            remote: s("remote"),
            error: json
                .get("error")
                .and_then(Value::as_str)
                .map(str::to_string),
            is_final: json.get("final").and_then(Value::as_bool).unwrap_or(false),
            json,
        })
    }
}

#[derive(Default)]
struct Shared {
    latest: Option<StreamStatus>,
    final_status: Option<StreamStatus>,
    /// stdout closed: the process is gone (or about to be).
    closed: bool,
    stderr: String,
}

/// A running `vnat-stream client`. Dropping it kills the process.
pub struct StreamClient {
    child: Child,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    threads: Vec<JoinHandle<()>>,
    what: String,
}

impl StreamClient {
    /// Starts `vnat-stream client` with `opts` inside `ns`.
    pub fn spawn(ns: &Netns, opts: &StreamOptions) -> StreamClient {
        let what = format!(
            "vnat-stream {} to {} in netns {}",
            if opts.udp { "UDP" } else { "TCP" },
            opts.connect,
            ns.name()
        );
        let mut c = Self::from_command(opts.command(ns));
        c.what = what;
        c
    }

    /// Starts a prepared `vnat-stream client` command (see
    /// [`StreamOptions::command`]); stdout and stderr are taken over.
    pub fn from_command(mut cmd: Command) -> StreamClient {
        let what = format!("{:?}", cmd.get_program());
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let shared = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let sh = Arc::clone(&shared);
        let out_thread = thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let Some(status) = StreamStatus::parse(&line) else {
                    continue;
                };
                let (lock, cv) = &*sh;
                let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
                if status.is_final {
                    s.final_status = Some(status.clone());
                }
                s.latest = Some(status);
                cv.notify_all();
            }
            let (lock, cv) = &*sh;
            lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            cv.notify_all();
        });
        let sh = Arc::clone(&shared);
        let err_thread = thread::spawn(move || {
            let mut text = String::new();
            let _ = BufReader::new(stderr).read_to_string(&mut text);
            sh.0.lock().unwrap_or_else(|e| e.into_inner()).stderr = text;
        });
        StreamClient {
            child,
            shared,
            threads: vec![out_thread, err_thread],
            what,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The most recent status line, if any arrived yet.
    pub fn latest(&self) -> Option<StreamStatus> {
        self.shared
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .latest
            .clone()
    }

    /// Waits until at least `n` bytes were echoed back and verified; panics if
    /// the stream reports an error, exits, or `timeout` passes first.
    pub fn wait_verified_at_least(&self, n: u64, timeout: Duration) -> StreamStatus {
        self.wait_until(timeout, &format!("{n} verified bytes"), |s| s.verified >= n)
    }

    /// Waits until `more` bytes beyond both the latest status and `since`
    /// are verified: proof that data is flowing now.
    pub fn wait_progress(
        &self,
        since: &StreamStatus,
        more: u64,
        timeout: Duration,
    ) -> StreamStatus {
        let now = self.latest().map_or(0, |s| s.verified).max(since.verified);
        self.wait_verified_at_least(now + more, timeout)
    }

    /// Waits up to `timeout` for the stream to fail (a reset, a mismatch,
    /// an exit) and returns what it reported; `None` if it is still fine.
    pub fn wait_error(&self, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(err) = s.latest.as_ref().and_then(|l| l.error.clone()) {
                return Some(err);
            }
            if s.closed || s.final_status.is_some() {
                return Some(format!("the stream ended: {}", s.stderr.trim()));
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s = cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Waits until a status line satisfies `done`; panics (with the latest
    /// status) if the stream reports an error, exits, or `timeout` passes.
    pub fn wait_until(
        &self,
        timeout: Duration,
        what: &str,
        done: impl Fn(&StreamStatus) -> bool,
    ) -> StreamStatus {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(latest) = &s.latest {
                if let Some(err) = &latest.error {
                    panic!(
                        "{} failed while waiting for {what}: {err}; latest status: {}",
                        self.what, latest.json
                    );
                }
                if done(latest) {
                    return latest.clone();
                }
            }
            if s.closed || s.final_status.is_some() {
                panic!(
                    "{} ended while waiting for {what}; latest status: {}; stderr: {}",
                    self.what,
                    show(&s.latest),
                    s.stderr.trim()
                );
            }
            let now = Instant::now();
            if now >= deadline {
                panic!(
                    "{} did not reach {what} within {timeout:?}; latest status: {}; its socket: {}",
                    self.what,
                    show(&s.latest),
                    self.socket_state_at(&s.latest)
                );
            }
            s = cv
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Sends SIGTERM and returns the final summary line (with `is_final`);
    /// the caller asserts on it (`error`, `verified == sent`...). Panics if
    /// no summary arrives within 30 s.
    pub fn stop(mut self) -> StreamStatus {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        self.wait_final(Duration::from_secs(30))
    }

    /// As [`StreamClient::stop`], for a client that is a field of a
    /// larger struct (the CRIU scene).
    pub fn stop_in_place(&mut self) -> StreamStatus {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        self.wait_final(Duration::from_secs(30))
    }

    /// Waits for the process to finish by itself (after `--duration-secs`)
    /// and returns its final summary.
    pub fn wait(mut self, timeout: Duration) -> StreamStatus {
        self.wait_final(timeout)
    }

    fn wait_final(&mut self, timeout: Duration) -> StreamStatus {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.shared;
        let mut s = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !s.closed && Instant::now() < deadline {
            s = cv
                .wait_timeout(s, deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let final_status = s.final_status.clone();
        let latest = show(&s.latest);
        drop(s);
        let _ = self.child.kill();
        let _ = self.child.wait();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let stderr = self
            .shared
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stderr
            .clone();
        final_status.unwrap_or_else(|| {
            panic!("{} printed no final summary within {timeout:?}; latest status: {latest}; stderr: {}", self.what, stderr.trim())
        })
    }
}

impl StreamClient {
    /// What the kernel says of the stream's socket (`ss` in the stream's
    /// namespace: TCP's timers, backoff, retransmissions, window): a
    /// stall's cause is in there, and a CI log is all there is of a run in
    /// a VM.
    pub fn socket_state(&self) -> String {
        self.socket_state_at(&self.latest())
    }

    fn socket_state_at(&self, latest: &Option<StreamStatus>) -> String {
        let Some(port) = latest
            .as_ref()
            .and_then(|s| s.local.parse::<SocketAddr>().ok())
            .map(|a| a.port())
        else {
            return "unknown (no local address reported)".to_string();
        };
        let udp = latest
            .as_ref()
            .is_some_and(|s| s.json.get("proto").and_then(Value::as_str) == Some("udp"));
        let out = Command::new("nsenter")
            .arg(format!("--net=/proc/{}/ns/net", self.child.id()))
            .args(["ss", if udp { "-Huinoem" } else { "-Htinoem" }])
            .arg(format!("sport = :{port}"))
            .output();
        match out {
            Ok(o) if o.status.success() => {
                let text = String::from_utf8_lossy(&o.stdout);
                let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
                if text.is_empty() {
                    "ss lists none".to_string()
                } else {
                    text
                }
            }
            Ok(o) => format!("ss failed: {}", String::from_utf8_lossy(&o.stderr).trim()),
            Err(e) => format!("cannot run ss: {e}"),
        }
    }
}

fn show(s: &Option<StreamStatus>) -> String {
    s.as_ref()
        .map_or_else(|| "none".to_string(), |s| s.json.to_string())
}

impl Drop for StreamClient {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
