//! Packet captures with tcpdump, for assertions on what is seen on the wire
//! (which addresses a moved connection's packets carry on each link).
use std::{
    io::{BufRead, BufReader},
    process::{Child, Stdio},
    sync::{Arc, Condvar, Mutex},
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{kill, Signal},
    unistd::Pid,
};

use super::Netns;

#[derive(Default)]
struct Lines {
    stdout: Vec<String>,
    stderr: Vec<String>,
    listening: bool,
    closed: bool,
}

/// `tcpdump -n -l -i DEV FILTER` running in a namespace; its one-line packet
/// summaries are collected as they arrive.
pub struct Capture {
    child: Child,
    shared: Arc<(Mutex<Lines>, Condvar)>,
    threads: Vec<JoinHandle<()>>,
    what: String,
}

impl Capture {
    /// Starts capturing on `dev` (or `any`) with a pcap `filter` (may be
    /// empty), and returns once tcpdump reports that it is listening, so no
    /// packet sent after this call is missed.
    pub fn start(ns: &Netns, dev: &str, filter: &str) -> Capture {
        let what = format!("tcpdump on {dev} in netns {} ({filter})", ns.name());
        let mut cmd = ns.cmd("tcpdump");
        // -nn: numeric addresses and ports (what tests compare); -l and
        // --immediate-mode: each packet as soon as it is seen.
        cmd.args(["-nn", "-l", "--immediate-mode", "-i", dev]);
        if !filter.is_empty() {
            cmd.args(filter.split_whitespace());
        }
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        let shared = Arc::new((Mutex::new(Lines::default()), Condvar::new()));
        let out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        let sh = Arc::clone(&shared);
        let t_out = thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                // tcpdump ends with an empty line when interrupted.
                if line.trim().is_empty() {
                    continue;
                }
                let (lock, cv) = &*sh;
                lock.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .stdout
                    .push(line);
                cv.notify_all();
            }
            let (lock, cv) = &*sh;
            lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            cv.notify_all();
        });
        let sh = Arc::clone(&shared);
        let t_err = thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let (lock, cv) = &*sh;
                let mut l = lock.lock().unwrap_or_else(|e| e.into_inner());
                // "listening on eth0, link-type EN10MB ..." once the socket
                // is bound.
                l.listening |= line.starts_with("listening on");
                l.stderr.push(line);
                cv.notify_all();
            }
            let (lock, cv) = &*sh;
            lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            cv.notify_all();
        });
        let capture = Capture {
            child,
            shared,
            threads: vec![t_out, t_err],
            what,
        };
        capture.wait_listening();
        capture
    }

    fn wait_listening(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let (lock, cv) = &*self.shared;
        let mut l = lock.lock().unwrap_or_else(|e| e.into_inner());
        while !l.listening {
            assert!(
                !l.closed,
                "{} exited at once: {}",
                self.what,
                l.stderr.join("; ")
            );
            let now = Instant::now();
            assert!(
                now < deadline,
                "{} did not start within 10 s: {}",
                self.what,
                l.stderr.join("; ")
            );
            l = cv
                .wait_timeout(l, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The packet lines captured so far.
    pub fn lines(&self) -> Vec<String> {
        self.shared
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stdout
            .clone()
    }

    /// Waits for a captured line containing `needle` and returns it; panics
    /// after `timeout` with what was captured.
    pub fn wait_for(&self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.shared;
        let mut l = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(line) = l.stdout.iter().find(|line| line.contains(needle)) {
                return line.clone();
            }
            let now = Instant::now();
            if now >= deadline || l.closed {
                let tail = &l.stdout[l.stdout.len().saturating_sub(20)..];
                panic!(
                    "{}: no packet matching `{needle}` within {timeout:?}; last lines:\n{}",
                    self.what,
                    tail.join("\n")
                );
            }
            l = cv
                .wait_timeout(l, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Stops tcpdump (it flushes what it has) and returns every packet line.
    pub fn stop(mut self) -> Vec<String> {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGINT);
        let _ = self.child.wait();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.lines()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
