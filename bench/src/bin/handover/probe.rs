//! `handover probe --connect ADDR`: the measuring client, run by the
//! benchmark inside the laptop's namespace and cgroup (so that the laptop's
//! vnatd records and moves its connection).
//!
//! It opens one TCP connection to an echo server and every `--interval-us`
//! writes a 16-byte probe: sequence number and CLOCK_MONOTONIC send time,
//! both little-endian u64. The echoed probes come back in order; for each
//! one it prints a JSON line `{"seq":N,"sent_ns":T,"recv_ns":R}` where R is
//! when the read that returned it completed. CLOCK_MONOTONIC is one clock
//! for all namespaces and processes, so the benchmark compares these times
//! with its own.
//!
//! Writes never block: when the socket's send buffer is full (during an
//! outage), the probe of that tick is skipped and counted, so every printed
//! send time is the time its bytes entered the socket (a probe cut by a
//! partial write is finished before any new one is made). Once a second it
//! prints `{"sent":N,"skipped":N,"echoed":N}`. It stops at the first
//! error (`{"error":"..."}`, exit 1) or when killed.
//!
//! [`Probe`] is the benchmark's side: it starts the probe and collects
//! what it prints.

use std::{
    io::{self, Read, Write},
    net::{SocketAddr, TcpStream},
    os::fd::AsRawFd,
    process::{Child, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use nix::libc;
use vnat_bench::delayline::{monotonic_ns, precise_thread};
use vnat_bench::lines::read_json_lines;
use vnat_tests::Host;

/// Bytes per probe: sequence number, send time.
pub const PROBE_LEN: usize = 16;

/// The probe process's main.
pub fn run(connect: SocketAddr, interval: Duration) -> i32 {
    match probe(connect, interval) {
        Ok(()) => 0,
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            1
        }
    }
}

fn probe(connect: SocketAddr, interval: Duration) -> io::Result<()> {
    // The probe is the instrument: its own wake-ups should not be what the
    // benchmark measures on a busy machine.
    let realtime = precise_thread();
    let mut sock = TcpStream::connect_timeout(&connect, Duration::from_secs(5))?;
    // Every probe goes out when written, not coalesced behind unacknowledged
    // ones (Nagle would hold it for up to a round trip).
    sock.set_nodelay(true)?;
    sock.set_nonblocking(true)?;
    let mut out = io::stdout().lock();
    writeln!(
        out,
        "{}",
        serde_json::json!({
            "connected": true,
            "local": sock.local_addr()?.to_string(),
            "remote": connect.to_string(),
            "realtime": realtime,
        })
    )?;
    out.flush()?;

    let step = interval.as_nanos() as u64;
    let mut next_send = monotonic_ns();
    let mut next_summary = next_send + 1_000_000_000;
    let (mut seq, mut skipped, mut echoed) = (0u64, 0u64, 0u64);
    // Bytes of a probe that a partial write left unsent.
    let mut pending: Vec<u8> = Vec::new();
    let mut inbuf: Vec<u8> = Vec::with_capacity(1 << 16);
    let mut chunk = vec![0u8; 1 << 16];
    loop {
        let now = monotonic_ns();
        if now >= next_send {
            if pending.is_empty() {
                let mut p = [0u8; PROBE_LEN];
                p[..8].copy_from_slice(&seq.to_le_bytes());
                p[8..].copy_from_slice(&monotonic_ns().to_le_bytes());
                pending.extend_from_slice(&p);
                match write_some(&mut sock, &mut pending)? {
                    0 => {
                        // Not a byte accepted: this tick's probe was never sent.
                        pending.clear();
                        skipped += 1;
                    }
                    _ => seq += 1,
                }
            } else {
                write_some(&mut sock, &mut pending)?;
                skipped += 1;
            }
            // A fixed schedule; ticks missed while descheduled are skipped,
            // not sent in a burst.
            next_send += step;
            if next_send <= now {
                next_send = now + step;
            }
        }
        if now >= next_summary {
            writeln!(
                out,
                "{}",
                serde_json::json!({ "sent": seq, "skipped": skipped, "echoed": echoed })
            )?;
            out.flush()?;
            next_summary += 1_000_000_000;
        }
        let wait = next_send.saturating_sub(monotonic_ns());
        if !wait_readable(&sock, Duration::from_nanos(wait))? {
            continue;
        }
        let n = match sock.read(&mut chunk) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the echo server closed the connection",
                ))
            }
            Ok(n) => n,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                continue
            }
            Err(e) => return Err(e),
        };
        let recv_ns = monotonic_ns();
        inbuf.extend_from_slice(&chunk[..n]);
        let whole = inbuf.len() / PROBE_LEN * PROBE_LEN;
        for p in inbuf[..whole].chunks_exact(PROBE_LEN) {
            let s = u64::from_le_bytes(p[..8].try_into().expect("8 bytes"));
            let sent = u64::from_le_bytes(p[8..].try_into().expect("8 bytes"));
            if s != echoed {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("echo out of order: probe {s} came back where {echoed} was due"),
                ));
            }
            echoed += 1;
            writeln!(
                out,
                "{{\"seq\":{s},\"sent_ns\":{sent},\"recv_ns\":{recv_ns}}}"
            )?;
        }
        inbuf.drain(..whole);
        out.flush()?;
    }
}

/// Writes what the socket accepts of `pending` without blocking, removes it
/// from `pending` and returns how much that was.
fn write_some(sock: &mut TcpStream, pending: &mut Vec<u8>) -> io::Result<usize> {
    match sock.write(pending) {
        Ok(n) => {
            pending.drain(..n);
            Ok(n)
        }
        Err(e)
            if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted =>
        {
            Ok(0)
        }
        Err(e) => Err(e),
    }
}

fn wait_readable(sock: &TcpStream, wait: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: wait.as_secs() as libc::time_t,
        tv_nsec: wait.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `pfd` is one live pollfd (count 1) for the socket `sock`
    // keeps open, `ts` a live timespec, and a null signal mask means "leave
    // the mask alone".
    let rc = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::Interrupted {
            Ok(false)
        } else {
            Err(e)
        };
    }
    Ok(rc > 0 && pfd.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0)
}

/// One echoed probe: when it was written and when its echo was read
/// (CLOCK_MONOTONIC ns).
#[derive(Clone, Copy, Debug)]
pub struct Echo {
    pub sent: u64,
    pub recv: u64,
}

#[derive(Default)]
pub struct ProbeLog {
    pub local: Option<SocketAddr>,
    pub echoes: Vec<Echo>,
    pub skipped: u64,
    pub error: Option<String>,
}

/// The probe process and what it has reported so far.
pub struct Probe {
    child: Child,
    log: Arc<Mutex<ProbeLog>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Probe {
    pub fn spawn(host: &Host, server: SocketAddr) -> Result<Probe> {
        let exe = std::env::current_exe().context("finding the benchmark's own executable")?;
        let mut cmd = host.ns.cmd(exe);
        host.cgroup.join_on_spawn(&mut cmd);
        cmd.args([
            "probe",
            "--connect",
            &server.to_string(),
            "--interval-us",
            "1000",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
        let mut child = cmd.spawn().context("starting the probe client")?;
        let stdout = child.stdout.take().expect("piped");
        let log = Arc::new(Mutex::new(ProbeLog::default()));
        let reader = read_json_lines(
            stdout,
            log.clone(),
            |log: &mut ProbeLog, v| {
                if let (Some(sent), Some(recv)) = (v["sent_ns"].as_u64(), v["recv_ns"].as_u64()) {
                    log.echoes.push(Echo { sent, recv });
                } else if let Some(s) = v["skipped"].as_u64() {
                    log.skipped = s;
                } else if let Some(l) = v["local"].as_str() {
                    log.local = l.parse().ok();
                } else if let Some(e) = v["error"].as_str() {
                    log.error = Some(e.to_string());
                }
            },
            |log| {
                if log.error.is_none() {
                    log.error = Some("the probe client exited".into());
                }
            },
        );
        Ok(Probe {
            child,
            log,
            reader: Some(reader),
        })
    }

    pub fn log(&self) -> std::sync::MutexGuard<'_, ProbeLog> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for the connection and a first echo; returns the local address.
    pub fn wait_connected(&self, limit: Duration) -> Result<SocketAddr> {
        let deadline = Instant::now() + limit;
        loop {
            {
                let log = self.log();
                if let (Some(local), false) = (log.local, log.echoes.is_empty()) {
                    return Ok(local);
                }
                if let Some(e) = &log.error {
                    bail!("the probe client could not reach the echo server: {e}");
                }
            }
            ensure!(
                Instant::now() < deadline,
                "the probe client got no echo within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Stops the probe and returns everything it reported (an error is only
    /// what it reported before being stopped).
    pub fn stop(mut self) -> ProbeLog {
        let early = self.log().error.clone();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let mut log = std::mem::take(&mut *self.log());
        log.error = early;
        log
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
