//! `restore client --connect ADDR --conns N`: the measuring client of the
//! restoration benchmark, run in the laptop host's namespace and cgroup (so
//! that the laptop's vnatd records and moves every connection).
//!
//! It opens N TCP connections to the echo server (at most [`CONNECTING`] at
//! a time), then every `--interval-ms` writes a 16-byte message on each:
//! sequence number and CLOCK_MONOTONIC write time, little-endian u64s. The
//! echoes come back in order on each connection and are checked. One thread
//! and one epoll set serve every connection and stdin.
//!
//! The benchmark drives it through stdin, one command a line:
//! - `arm`: from now on remember every echo (its write and arrival time);
//!   sent just before the move;
//! - `mark T`: T (CLOCK_MONOTONIC ns, one clock in every namespace) is when
//!   the new address became usable. For every connection the client reports
//!   the first echo of a message *written* at or after T, and stops writing
//!   on a connection once it is reported (its measurement is done, and the
//!   connections still waiting should not compete with finished ones);
//! - `verify`: write one more message on every connection and report how
//!   many came back (the connections carry on, same sockets, bytes intact);
//! - `pause` / `go`: stop writing at the ticks, and start again (the scale
//!   benchmark times `vnatctl ls` with the harness quiet too);
//! - `reset`: forget `arm` and `mark` and which connections were reported,
//!   and write on every connection at the ticks again (after the harness's
//!   own round, a `mark` with no move, the real one can follow);
//! - `quit` or end of input: exit.
//!
//! On stdout, JSON lines:
//! - `{"connected":N,"local":...}` once all N are established (one address);
//! - `{"echoing":N}` once every connection has echoed a message;
//! - `{"conn":I,"local":"A:P","sent_ns":S,"recv_ns":R}` per connection after
//!   `mark` (R: when the read that returned the echo completed);
//! - `{"conn":I,"error":"..."}` when a connection fails (the others go on);
//! - `{"verified":K,"of":N}` after `verify`;
//! - once a second `{"stats":{...}}`: messages written, writes skipped (send
//!   buffer full), echoes, their median round trip in that second, and how
//!   late the write ticks ran;
//! - `{"error":"..."}` and exit 1 when the client as a whole fails.

use std::{
    io::{self, BufRead, Read, Write},
    net::{SocketAddr, TcpStream},
    os::fd::AsRawFd,
    time::Duration,
};

use serde_json::json;
use vnat_bench::delayline::monotonic_ns;

use super::sys::{connect_nonblocking, raise_nofile_limit, Epoll, IN, OUT};

/// Bytes per message: sequence number, write time.
const MSG_LEN: usize = 16;
/// Connects in flight at once: a burst of thousands of SYNs would overflow
/// the listener's queue and cost a SYN retransmission (1 s) each.
const CONNECTING: usize = 64;
/// The stdin token; connections use their index.
const STDIN: u64 = u64::MAX;

#[derive(Default)]
struct Conn {
    stream: Option<TcpStream>,
    local: Option<SocketAddr>,
    connected: bool,
    failed: bool,
    /// Bytes of a message that a partial write left unsent.
    pending: Vec<u8>,
    /// Bytes of an echo not yet complete.
    inbuf: Vec<u8>,
    seq: u64,
    echoed: u64,
    /// (write, arrival) of echoes since `arm`, until the mark is known.
    armed: Vec<(u64, u64)>,
    measured: bool,
    /// Waiting for the echo of the `verify` message with this sequence.
    verify_seq: Option<u64>,
}

#[derive(Default)]
struct Stats {
    written: u64,
    skipped: u64,
    echoes: u64,
    rtt_ns: Vec<u64>,
    tick_late_max_ns: u64,
}

pub fn run(connect: &[SocketAddr], conns: usize, interval: Duration) -> i32 {
    match client(connect, conns, interval) {
        Ok(()) => 0,
        Err(e) => {
            println!("{}", json!({ "error": e.to_string() }));
            1
        }
    }
}

/// Connection `i` goes to `to[i % to.len()]` (several server ports: one
/// client address has only ~64k ports towards one server port).
fn client(to: &[SocketAddr], n: usize, interval: Duration) -> io::Result<()> {
    raise_nofile_limit()?;
    let epoll = Epoll::new()?;
    // SAFETY: fcntl with F_GETFL and F_SETFL takes no pointers; on a closed
    // fd 0 both calls just fail. Nothing in std assumes that stdin blocks:
    // a read that would block returns WouldBlock, and a line cut by one
    // stays in `line` until its end arrives (see the loop below).
    unsafe {
        let fl = nix::libc::fcntl(0, nix::libc::F_GETFL);
        nix::libc::fcntl(0, nix::libc::F_SETFL, fl | nix::libc::O_NONBLOCK);
    }
    epoll.add(0, IN, STDIN)?;
    let mut stdin = io::BufReader::new(io::stdin());
    let mut line = String::new();
    let mut out = io::stdout().lock();

    let mut conns: Vec<Conn> = (0..n).map(|_| Conn::default()).collect();
    let (mut started, mut connected, mut echoing, mut measured, mut failed) =
        (0usize, 0usize, 0usize, 0usize, 0usize);
    let mut armed = false;
    let mut paused = false;
    let mut mark: Option<u64> = None;
    // `verify`: (connections asked, echoes still due, echoes back).
    let mut verifying: Option<(usize, usize, usize)> = None;
    let mut stats = Stats::default();
    let step = interval.as_nanos() as u64;
    let mut next_tick = monotonic_ns() + step;
    let mut next_stats = monotonic_ns() + 1_000_000_000;
    let mut events = Epoll::buffer(4096);
    let mut chunk = vec![0u8; 1 << 16];

    loop {
        // Keep CONNECTING connects in flight until all are started.
        while started < n && started - connected < CONNECTING {
            let s = connect_nonblocking(to[started % to.len()])?;
            epoll.add(s.as_raw_fd(), OUT, started as u64)?;
            conns[started].stream = Some(s);
            started += 1;
        }

        let now = monotonic_ns();
        if now >= next_tick {
            stats.tick_late_max_ns = stats.tick_late_max_ns.max(now - next_tick);
            for (i, c) in conns
                .iter_mut()
                .enumerate()
                .filter(|(_, c)| !paused && c.connected && !c.failed && !c.measured)
            {
                if let Err(e) = write_message(c, &mut stats) {
                    fail(i, c, &epoll, &mut out, &mut failed, &mut verifying, &e)?;
                }
            }
            next_tick += step;
            if next_tick <= monotonic_ns() {
                next_tick = monotonic_ns() + step;
            }
        }
        if now >= next_stats {
            let mut r = std::mem::take(&mut stats.rtt_ns);
            r.sort_unstable();
            let median_ms = r.get(r.len() / 2).map(|v| *v as f64 / 1e6);
            writeln!(
                out,
                "{}",
                json!({ "stats": {
                    "written": stats.written, "skipped": stats.skipped, "echoes": stats.echoes,
                    "echo_rtt_median_ms": median_ms, "tick_late_max_ms": stats.tick_late_max_ns as f64 / 1e6,
                    "connected": connected, "echoing": echoing, "measured": measured, "failed": failed,
                }})
            )?;
            out.flush()?;
            stats.tick_late_max_ns = 0;
            next_stats += 1_000_000_000;
        }

        let wait_ns = next_tick.min(next_stats).saturating_sub(monotonic_ns());
        let ready = epoll.wait(&mut events, wait_ns.div_ceil(1_000_000) as i32)?;
        for (token, _) in ready {
            if token == STDIN {
                loop {
                    // A line cut by a would-block stays in `line` until its end arrives.
                    match stdin.read_line(&mut line) {
                        Ok(0) => return Ok(()),
                        Ok(_) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                        Err(e) => return Err(e),
                    }
                    let cmd = std::mem::take(&mut line);
                    let mut words = cmd.split_whitespace();
                    match (words.next(), words.next()) {
                        (Some("arm"), _) => armed = true,
                        (Some("pause"), _) => paused = true,
                        (Some("go"), _) => paused = false,
                        (Some("reset"), _) => {
                            armed = false;
                            mark = None;
                            measured = 0;
                            for c in &mut conns {
                                c.measured = false;
                                c.armed = Vec::new();
                            }
                        }
                        (Some("mark"), Some(t)) => {
                            let t: u64 = t
                                .parse()
                                .map_err(|_| io::Error::other(format!("bad mark {t:?}")))?;
                            mark = Some(t);
                            for (i, c) in conns.iter_mut().enumerate().filter(|(_, c)| !c.failed) {
                                if let Some(&(sent, recv)) = c.armed.iter().find(|(s, _)| *s >= t) {
                                    report(&mut out, i, c, sent, recv, &mut measured)?;
                                }
                                c.armed = Vec::new();
                            }
                            // Write on every connection now rather than at
                            // the next tick: with a long interval (many
                            // connections) the wait for the tick would be
                            // counted as restoration time.
                            next_tick = monotonic_ns();
                        }
                        (Some("verify"), _) => {
                            let mut asked = 0;
                            for (i, c) in conns
                                .iter_mut()
                                .enumerate()
                                .filter(|(_, c)| c.connected && !c.failed)
                            {
                                c.verify_seq = Some(c.seq);
                                if let Err(e) = write_message(c, &mut stats) {
                                    fail(i, c, &epoll, &mut out, &mut failed, &mut verifying, &e)?;
                                } else {
                                    asked += 1;
                                }
                            }
                            if asked == 0 {
                                writeln!(out, "{}", json!({ "verified": 0, "of": 0 }))?;
                            } else {
                                verifying = Some((asked, asked, 0));
                            }
                        }
                        (Some("quit"), _) => return Ok(()),
                        _ => {
                            return Err(io::Error::other(format!(
                                "unknown command {:?}",
                                cmd.trim()
                            )))
                        }
                    }
                }
                out.flush()?;
                continue;
            }
            let i = token as usize;
            let c = &mut conns[i];
            if c.failed {
                continue;
            }
            if !c.connected {
                // The connect finished, one way or the other.
                let s = c.stream.as_ref().expect("started");
                if let Some(e) = s.take_error()? {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("connection {i} to {}: {e}", to[i % to.len()]),
                    ));
                }
                s.set_nodelay(true)?;
                c.local = Some(s.local_addr()?);
                c.connected = true;
                epoll.modify(s.as_raw_fd(), IN, token)?;
                connected += 1;
                if connected == n {
                    let local = conns[0].local.map(|a| a.ip().to_string());
                    writeln!(out, "{}", json!({ "connected": n, "local": local }))?;
                    out.flush()?;
                }
                continue;
            }
            let was_echoing = c.echoed > 0;
            match read_echoes(c, &mut chunk, &mut stats) {
                Ok(echoes) => {
                    for (seq, sent, recv) in echoes {
                        if c.verify_seq.is_some_and(|v| seq >= v) {
                            c.verify_seq = None;
                            verify_answered(&mut out, &mut verifying, true)?;
                        }
                        if !armed || c.measured {
                            continue;
                        }
                        match mark {
                            Some(t) if sent >= t => {
                                report(&mut out, i, c, sent, recv, &mut measured)?
                            }
                            Some(_) => {}
                            None => c.armed.push((sent, recv)),
                        }
                    }
                }
                Err(e) => fail(i, c, &epoll, &mut out, &mut failed, &mut verifying, &e)?,
            }
            if !was_echoing && c.echoed > 0 {
                echoing += 1;
                if echoing == n {
                    writeln!(out, "{}", json!({ "echoing": n }))?;
                }
            }
            out.flush()?;
        }
    }
}

fn report(
    out: &mut impl Write,
    i: usize,
    c: &mut Conn,
    sent: u64,
    recv: u64,
    measured: &mut usize,
) -> io::Result<()> {
    c.measured = true;
    *measured += 1;
    let local = c.local.map(|a| a.to_string());
    writeln!(
        out,
        "{}",
        json!({ "conn": i, "local": local, "sent_ns": sent, "recv_ns": recv })
    )
}

/// One connection asked by `verify` is done with: its echo came back
/// (`back`) or it failed. The last one reports how many came back.
fn verify_answered(
    out: &mut impl Write,
    verifying: &mut Option<(usize, usize, usize)>,
    back: bool,
) -> io::Result<()> {
    if let Some((asked, due, echoed)) = verifying.as_mut() {
        *due -= 1;
        *echoed += usize::from(back);
        if *due == 0 {
            writeln!(out, "{}", json!({ "verified": *echoed, "of": *asked }))?;
            *verifying = None;
        }
    }
    Ok(())
}

/// A connection failed: reported, and no longer waited for (a `verify`
/// under way counts it as not verified).
fn fail(
    i: usize,
    c: &mut Conn,
    epoll: &Epoll,
    out: &mut impl Write,
    failed: &mut usize,
    verifying: &mut Option<(usize, usize, usize)>,
    e: &io::Error,
) -> io::Result<()> {
    c.failed = true;
    *failed += 1;
    if c.verify_seq.take().is_some() {
        verify_answered(out, verifying, false)?;
    }
    if let Some(s) = c.stream.as_ref() {
        let _ = epoll.delete(s.as_raw_fd());
    }
    let local = c.local.map(|a| a.to_string());
    writeln!(
        out,
        "{}",
        json!({ "conn": i, "local": local, "error": e.to_string() })
    )?;
    out.flush()
}

/// Writes the connection's next message (or what is left of the last one)
/// without blocking; a tick whose message the socket did not take at all is
/// skipped, so every send time is when its bytes entered the socket.
fn write_message(c: &mut Conn, stats: &mut Stats) -> io::Result<()> {
    let s = c.stream.as_mut().expect("connected");
    if !c.pending.is_empty() {
        write_some(s, &mut c.pending)?;
        stats.skipped += 1;
        return Ok(());
    }
    let mut m = [0u8; MSG_LEN];
    m[..8].copy_from_slice(&c.seq.to_le_bytes());
    m[8..].copy_from_slice(&monotonic_ns().to_le_bytes());
    c.pending.extend_from_slice(&m);
    if write_some(s, &mut c.pending)? == 0 {
        c.pending.clear();
        stats.skipped += 1;
    } else {
        c.seq += 1;
        stats.written += 1;
    }
    Ok(())
}

fn write_some(s: &mut TcpStream, pending: &mut Vec<u8>) -> io::Result<usize> {
    match s.write(pending) {
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

/// Reads what is there; returns the complete echoes (sequence, write time,
/// arrival time), checked to come back in order.
fn read_echoes(
    c: &mut Conn,
    chunk: &mut [u8],
    stats: &mut Stats,
) -> io::Result<Vec<(u64, u64, u64)>> {
    let s = c.stream.as_mut().expect("connected");
    let n = match s.read(chunk) {
        Ok(0) => {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the echo server closed the connection",
            ))
        }
        Ok(n) => n,
        Err(e)
            if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted =>
        {
            return Ok(Vec::new())
        }
        Err(e) => return Err(e),
    };
    let recv = monotonic_ns();
    c.inbuf.extend_from_slice(&chunk[..n]);
    let whole = c.inbuf.len() / MSG_LEN * MSG_LEN;
    let mut out = Vec::with_capacity(whole / MSG_LEN);
    for m in c.inbuf[..whole].chunks_exact(MSG_LEN) {
        let seq = u64::from_le_bytes(m[..8].try_into().expect("8 bytes"));
        let sent = u64::from_le_bytes(m[8..].try_into().expect("8 bytes"));
        if seq != c.echoed {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "echo out of order: message {seq} came back where {} was due",
                    c.echoed
                ),
            ));
        }
        c.echoed += 1;
        stats.echoes += 1;
        stats.rtt_ns.push(recv.saturating_sub(sent));
        out.push((seq, sent, recv));
    }
    c.inbuf.drain(..whole);
    Ok(out)
}
