//! vnat-stream: a traffic checker for the tests and the demo.
//!
//! ```text
//! vnat-stream client --connect ADDR:PORT [--udp] [--rate-bytes-per-sec N]
//!                    [--duration-secs S] [--bind IP [--bind-port N]] [--datagram-size N] [--drain-secs S]
//! vnat-stream client --connect ADDR:PORT --receive-only
//! vnat-stream source [--rate-bytes-per-sec N]
//! ```
//!
//! `--receive-only` (TCP): send nothing, and verify that what the peer
//! sends is the stream from its first byte, as `vnat-stream source` writes
//! it (behind socat `EXEC:` on the server): a download, where the peer's
//! sends are the only traffic. `source` writes the stream to stdout at the
//! rate until stdout closes.
//!
//! Sends a deterministic byte stream over ONE socket to an echo peer (socat
//! `EXEC:cat` for TCP, `PIPE` for UDP), verifies every echoed byte, and
//! prints one JSON status line about every 100 ms:
//! `{"t_ms","sent","verified","max_gap_ms","local","remote","error","final"}`.
//! It stops on SIGTERM/SIGINT or after --duration-secs, waits up to
//! --drain-secs (default 5) for the echo of what it sent, and prints a last
//! line with `"final":true`. Exit status 0 only if nothing went wrong.
//!
//! TCP: byte i of the stream is byte (i mod 8) of splitmix64(i / 8), so a
//! lost, duplicated or shifted byte is caught at once with its offset. A
//! reset, an early EOF, a mismatch or an unfinished echo after the stop is an
//! error. UDP: each datagram is an 8-byte big-endian sequence number followed
//! by pattern bytes derived from it; a corrupted or unknown datagram is an
//! error, losses, duplicates and reordering are counted (UDP may lose).
//!
//! `max_gap_ms` is the longest time during which bytes were outstanding and
//! none came back verified: the outage a user would have seen.
use std::{
    collections::HashSet,
    io::{self, Read, Write},
    net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpStream, UdpSocket},
    os::fd::{FromRawFd, IntoRawFd},
    process::exit,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use nix::sys::{
    signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal},
    socket::{self, AddressFamily, SockFlag, SockType, SockaddrStorage},
};
use serde_json::json;

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

const USAGE: &str =
    "usage: vnat-stream client --connect ADDR:PORT [--udp] [--rate-bytes-per-sec N] \
[--duration-secs S] [--bind IP [--bind-port N]] [--datagram-size N] [--drain-secs S] [--exit-on-send-error] \
[--receive-only]\n       vnat-stream source [--rate-bytes-per-sec N]";
const STATUS_INTERVAL: Duration = Duration::from_millis(100);
/// Socket timeouts: how often blocked I/O comes back to look at the stop flag.
const IO_TICK: Duration = Duration::from_millis(100);

struct Opts {
    connect: SocketAddr,
    udp: bool,
    rate: u64,
    duration: Option<Duration>,
    bind: Option<IpAddr>,
    /// With `bind`: the local port (0: the kernel's choice).
    bind_port: u16,
    datagram_size: usize,
    drain: Duration,
    /// UDP: stop at the first failed send, as many applications do,
    /// instead of counting it and going on.
    exit_on_send_error: bool,
    /// TCP: send nothing; verify what the peer sends (`source`).
    receive_only: bool,
}

fn parse_args() -> Result<Opts, String> {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("client") => {}
        Some("-h" | "--help") => {
            println!("{USAGE}");
            exit(0)
        }
        _ => return Err(USAGE.to_string()),
    }
    let mut connect = None;
    let mut o = Opts {
        connect: SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        udp: false,
        rate: 100_000,
        duration: None,
        bind: None,
        bind_port: 0,
        datagram_size: 512, // harness::UDP_DATAGRAM_SIZE
        drain: Duration::from_secs(5),
        exit_on_send_error: false,
        receive_only: false,
    };
    while let Some(flag) = args.next() {
        let mut value = |name: &str| args.next().ok_or(format!("{name} needs a value"));
        match flag.as_str() {
            "--connect" => {
                let v = value("--connect")?;
                connect = Some(
                    v.parse()
                        .map_err(|_| format!("--connect: `{v}` is not ADDR:PORT"))?,
                );
            }
            "--udp" => o.udp = true,
            "--exit-on-send-error" => o.exit_on_send_error = true,
            "--receive-only" => o.receive_only = true,
            "--rate-bytes-per-sec" => o.rate = num(&value(&flag)?, &flag)?,
            "--duration-secs" => {
                o.duration = Some(Duration::from_secs_f64(num::<f64>(&value(&flag)?, &flag)?))
            }
            "--drain-secs" => o.drain = Duration::from_secs_f64(num::<f64>(&value(&flag)?, &flag)?),
            "--bind" => o.bind = Some(num(&value(&flag)?, &flag)?),
            "--bind-port" => o.bind_port = num(&value(&flag)?, &flag)?,
            "--datagram-size" => {
                o.datagram_size = num(&value(&flag)?, &flag)?;
                if !(16..=65000).contains(&o.datagram_size) {
                    return Err("--datagram-size must be between 16 and 65000".into());
                }
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                exit(0)
            }
            other => return Err(format!("unknown argument `{other}`\n{USAGE}")),
        }
    }
    o.connect = connect.ok_or(format!("--connect is required\n{USAGE}"))?;
    if o.receive_only && o.udp {
        return Err("--receive-only is for TCP".into());
    }
    Ok(o)
}

fn num<T: std::str::FromStr>(v: &str, flag: &str) -> Result<T, String> {
    v.parse()
        .map_err(|_| format!("{flag}: `{v}` is not a valid value"))
}

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Byte `i` of the stream.
fn pattern(i: u64) -> u8 {
    (splitmix64(i >> 3) >> ((i & 7) * 8)) as u8
}

fn fill(buf: &mut [u8], offset: u64) {
    for (k, b) in buf.iter_mut().enumerate() {
        *b = pattern(offset + k as u64);
    }
}

/// Counters shared by the sender, the receiver and the reporter.
struct State {
    start: Instant,
    sent: u64,
    /// Upper bound of what the kernel may have taken (bytes for TCP,
    /// datagrams for UDP): set before each write, because the echo can come
    /// back before the writer records the write's return value.
    writing_upto: u64,
    verified: u64,
    /// When the current wait for an echo began: the last progress, or the
    /// moment bytes became outstanding after none were.
    gap_start: Instant,
    max_gap: Duration,
    error: Option<String>,
    /// The receiver finished (EOF after a clean stop, error, or drain over).
    done: bool,
    // UDP only.
    dgrams_sent: u64,
    dgrams_verified: u64,
    duplicates: u64,
    reordered: u64,
    transient_errors: u64,
    last_transient_error: Option<String>,
}

impl State {
    fn new() -> Self {
        let now = Instant::now();
        State {
            start: now,
            sent: 0,
            writing_upto: 0,
            verified: 0,
            gap_start: now,
            max_gap: Duration::ZERO,
            error: None,
            done: false,
            dgrams_sent: 0,
            dgrams_verified: 0,
            duplicates: 0,
            reordered: 0,
            transient_errors: 0,
            last_transient_error: None,
        }
    }

    /// Called just before a write that may take the stream up to `upto`.
    fn begin_write(&mut self, upto: u64) {
        if self.sent <= self.verified {
            // Nothing was outstanding: the wait for an echo starts now (not
            // at the last progress, which would count idle time as a gap).
            self.gap_start = Instant::now();
        }
        self.writing_upto = upto;
    }

    fn on_sent(&mut self, n: u64) {
        self.sent += n;
    }

    fn on_verified(&mut self, n: u64) {
        let now = Instant::now();
        self.max_gap = self.max_gap.max(now - self.gap_start);
        self.gap_start = now;
        self.verified += n;
    }

    fn current_max_gap(&self) -> Duration {
        if self.sent > self.verified {
            self.max_gap.max(self.gap_start.elapsed())
        } else {
            self.max_gap
        }
    }

    fn fail(&mut self, msg: String) {
        if self.error.is_none() {
            self.error = Some(msg);
        }
    }
}

type Shared = Arc<Mutex<State>>;

fn lock(s: &Shared) -> std::sync::MutexGuard<'_, State> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// `vnat-stream source`: the stream to stdout at `--rate-bytes-per-sec`
/// (default 100000), until stdout closes.
fn run_source() -> i32 {
    let mut args = std::env::args().skip(2);
    let mut rate: u64 = 100_000;
    while let Some(flag) = args.next() {
        let parsed = match flag.as_str() {
            "--rate-bytes-per-sec" => args
                .next()
                .ok_or(format!("{flag} needs a value"))
                .and_then(|v| num(&v, &flag)),
            other => Err(format!("unknown argument `{other}`\n{USAGE}")),
        };
        match parsed {
            Ok(r) if r > 0 => rate = r,
            Ok(_) => {
                eprintln!("vnat-stream: --rate-bytes-per-sec must be above 0");
                return 2;
            }
            Err(e) => {
                eprintln!("vnat-stream: {e}");
                return 2;
            }
        }
    }
    let start = Instant::now();
    let mut out = io::stdout().lock();
    let mut buf = vec![0u8; 16 * 1024];
    let mut sent: u64 = 0;
    loop {
        let allowed = (rate as f64 * start.elapsed().as_secs_f64()) as u64;
        let chunk = (buf.len() as u64).min(allowed.saturating_sub(sent)) as usize;
        if chunk == 0 {
            thread::sleep(Duration::from_millis(5));
            continue;
        }
        fill(&mut buf[..chunk], sent);
        if out
            .write_all(&buf[..chunk])
            .and_then(|()| out.flush())
            .is_err()
        {
            return 0;
        }
        sent += chunk as u64;
    }
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("source") {
        exit(run_source());
    }
    let opts = match parse_args() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("vnat-stream: {e}");
            exit(2)
        }
    };
    let handler = SigAction::new(
        SigHandler::Handler(on_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [Signal::SIGTERM, Signal::SIGINT] {
        // SAFETY: the handler only stores to an atomic.
        unsafe { sigaction(sig, &handler) }.expect("installing the signal handler");
    }
    let code = if opts.udp {
        run_udp(&opts)
    } else {
        run_tcp(&opts)
    };
    exit(code)
}

/// A socket of `connect`'s family, bound to `bind` if given, connected with
/// a 10 s timeout (connect(2) honours SO_SNDTIMEO).
fn connect_socket(opts: &Opts, ty: SockType) -> io::Result<std::os::fd::OwnedFd> {
    let family = if opts.connect.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket::socket(family, ty, SockFlag::SOCK_CLOEXEC, None)?;
    if let Some(ip) = opts.bind {
        if opts.bind_port != 0 {
            // Several clients may share one local port towards different
            // servers (the tests' virtual-address conflicts).
            socket::setsockopt(&fd, socket::sockopt::ReuseAddr, &true)?;
        }
        let local = SockaddrStorage::from(SocketAddr::new(ip, opts.bind_port));
        socket::bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &local)?;
    }
    let tv = nix::sys::time::TimeVal::new(10, 0);
    socket::setsockopt(&fd, socket::sockopt::SendTimeout, &tv)?;
    socket::connect(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(opts.connect),
    )?;
    Ok(fd)
}

fn run_tcp(opts: &Opts) -> i32 {
    let stream = match connect_socket(opts, SockType::Stream) {
        // SAFETY: `into_raw_fd` gives up the OwnedFd's ownership of the
        // connected socket, so the TcpStream becomes its only owner.
        Ok(fd) => unsafe { TcpStream::from_raw_fd(fd.into_raw_fd()) },
        Err(e) => return fatal(opts, &format!("connecting to {}: {e}", opts.connect)),
    };
    let _ = stream.set_read_timeout(Some(IO_TICK));
    let _ = stream.set_write_timeout(Some(IO_TICK));
    let state: Shared = Arc::new(Mutex::new(State::new()));
    let sender_done = Arc::new(AtomicBool::new(false));

    let writer = {
        let mut stream = stream.try_clone().expect("cloning the socket handle");
        let state = Arc::clone(&state);
        let sender_done = Arc::clone(&sender_done);
        let (rate, duration) = (opts.rate, opts.duration);
        let receive_only = opts.receive_only;
        thread::spawn(move || {
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                let (sent, start, failed) = {
                    let s = lock(&state);
                    (s.sent, s.start, s.error.is_some())
                };
                if failed
                    || STOP.load(Ordering::SeqCst)
                    || duration.is_some_and(|d| start.elapsed() >= d)
                {
                    break;
                }
                if receive_only {
                    thread::sleep(Duration::from_millis(20));
                    continue;
                }
                let mut chunk = buf.len() as u64;
                if rate > 0 {
                    let allowed = (rate as f64 * start.elapsed().as_secs_f64()) as u64;
                    chunk = chunk.min(allowed.saturating_sub(sent));
                    if chunk == 0 {
                        thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                }
                let chunk = &mut buf[..chunk as usize];
                fill(chunk, sent);
                lock(&state).begin_write(sent + chunk.len() as u64);
                match stream.write(chunk) {
                    Ok(n) => lock(&state).on_sent(n as u64),
                    Err(e) if is_tick(&e) => {}
                    Err(e) => {
                        lock(&state)
                            .fail(format!("send failed after {sent} bytes: {}", describe(&e)));
                        break;
                    }
                }
            }
            // Mark the stop *before* sending EOF: on a short path the peer's
            // FIN can arrive before the next statement runs, and the reader
            // must then take it as the clean end, not an early close.
            sender_done.store(true, Ordering::SeqCst);
            // EOF to the peer: cat exits after echoing the rest, socat closes.
            let _ = stream.shutdown(Shutdown::Write);
        })
    };

    let reader = {
        let mut stream = stream.try_clone().expect("cloning the socket handle");
        let state = Arc::clone(&state);
        let sender_done = Arc::clone(&sender_done);
        let drain = opts.drain;
        let receive_only = opts.receive_only;
        thread::spawn(move || {
            let mut buf = vec![0u8; 64 * 1024];
            let mut drain_deadline: Option<Instant> = None;
            loop {
                if lock(&state).error.is_some() {
                    break;
                }
                if receive_only && sender_done.load(Ordering::SeqCst) {
                    // A download has no echo to wait for.
                    break;
                }
                if sender_done.load(Ordering::SeqCst) {
                    let deadline = *drain_deadline.get_or_insert_with(|| Instant::now() + drain);
                    if Instant::now() > deadline {
                        let s = lock(&state);
                        let msg = format!(
                            "echo incomplete {} s after the stop: sent {}, verified {}",
                            drain.as_secs_f64(),
                            s.sent,
                            s.verified
                        );
                        drop(s);
                        lock(&state).fail(msg);
                        break;
                    }
                }
                match stream.read(&mut buf) {
                    Ok(0) => {
                        let mut s = lock(&state);
                        if !sender_done.load(Ordering::SeqCst)
                            || (!receive_only && s.verified != s.sent)
                        {
                            let msg = format!(
                                "the peer closed the connection (EOF) after {} verified of {} sent bytes",
                                s.verified, s.sent
                            );
                            s.fail(msg);
                        }
                        break;
                    }
                    Ok(n) => {
                        let mut s = lock(&state);
                        let offset = s.verified;
                        let limit = s.sent.max(s.writing_upto);
                        if !receive_only && offset + n as u64 > limit {
                            let msg = format!(
                                "the peer echoed {n} bytes at offset {offset} but only {limit} were sent (duplication)"
                            );
                            s.fail(msg);
                            break;
                        }
                        if let Some(k) = (0..n).find(|&k| buf[k] != pattern(offset + k as u64)) {
                            let at = offset + k as u64;
                            let msg = format!(
                                "mismatch at offset {at}: expected 0x{:02x}, got 0x{:02x}",
                                pattern(at),
                                buf[k]
                            );
                            s.verified += k as u64;
                            s.fail(msg);
                            break;
                        }
                        s.on_verified(n as u64);
                    }
                    Err(e) if is_tick(&e) => {}
                    Err(e) => {
                        let mut s = lock(&state);
                        let msg = format!(
                            "receive failed after {} verified bytes: {}",
                            s.verified,
                            describe(&e)
                        );
                        s.fail(msg);
                        break;
                    }
                }
            }
            lock(&state).done = true;
        })
    };

    let local = stream.local_addr().ok();
    let remote = stream.peer_addr().ok();
    report_until_done(
        &state,
        || {
            // Looked up each time: a "hide location" mode may change what the
            // socket reports.
            (
                stream.local_addr().ok().or(local),
                stream.peer_addr().ok().or(remote),
            )
        },
        false,
    );
    let _ = stream.shutdown(Shutdown::Both);
    let _ = writer.join();
    let _ = reader.join();
    let code = i32::from(lock(&state).error.is_some());
    print_status(&lock(&state), local, remote, false, true);
    code
}

fn run_udp(opts: &Opts) -> i32 {
    let socket = match connect_socket(opts, SockType::Datagram) {
        // SAFETY: `into_raw_fd` gives up the OwnedFd's ownership of the
        // connected socket, so the UdpSocket becomes its only owner.
        Ok(fd) => unsafe { UdpSocket::from_raw_fd(fd.into_raw_fd()) },
        Err(e) => return fatal(opts, &format!("connecting to {}: {e}", opts.connect)),
    };
    let _ = socket.set_read_timeout(Some(IO_TICK));
    let _ = socket.set_write_timeout(Some(IO_TICK));
    let size = opts.datagram_size;
    let state: Shared = Arc::new(Mutex::new(State::new()));
    let sender_done = Arc::new(AtomicBool::new(false));

    let writer = {
        let socket = socket.try_clone().expect("cloning the socket handle");
        let state = Arc::clone(&state);
        let sender_done = Arc::clone(&sender_done);
        let (rate, duration) = (opts.rate, opts.duration);
        let exit_on_send_error = opts.exit_on_send_error;
        thread::spawn(move || {
            let mut buf = vec![0u8; size];
            loop {
                let (seq, start, failed) = {
                    let s = lock(&state);
                    (s.dgrams_sent, s.start, s.error.is_some())
                };
                if failed
                    || STOP.load(Ordering::SeqCst)
                    || duration.is_some_and(|d| start.elapsed() >= d)
                {
                    break;
                }
                if rate > 0 {
                    let allowed =
                        (rate as f64 * start.elapsed().as_secs_f64()) as u64 / size as u64;
                    if seq >= allowed {
                        thread::sleep(Duration::from_millis(2));
                        continue;
                    }
                }
                datagram(&mut buf, seq);
                // The echo may beat the bookkeeping after send(2).
                lock(&state).begin_write(seq + 1);
                match socket.send(&buf) {
                    Ok(_) => {
                        let mut s = lock(&state);
                        s.on_sent(size as u64);
                        s.dgrams_sent += 1;
                    }
                    Err(e) if is_tick(&e) => {}
                    Err(e) if exit_on_send_error => {
                        lock(&state).fail(format!("send: {}", describe(&e)));
                        break;
                    }
                    Err(e) => {
                        // During a move the route or the peer may be gone
                        // for a while (ENETUNREACH, ECONNREFUSED from an ICMP
                        // error): UDP applications keep sending.
                        let mut s = lock(&state);
                        s.transient_errors += 1;
                        s.last_transient_error = Some(describe(&e));
                        drop(s);
                        thread::sleep(Duration::from_millis(10));
                    }
                }
            }
            sender_done.store(true, Ordering::SeqCst);
        })
    };

    let reader = {
        let socket = socket.try_clone().expect("cloning the socket handle");
        let state = Arc::clone(&state);
        let sender_done = Arc::clone(&sender_done);
        // Lost datagrams never come back: wait at most a second for the tail.
        let drain = opts.drain.min(Duration::from_secs(1));
        thread::spawn(move || {
            let mut buf = vec![0u8; 65536];
            let mut seen = HashSet::new();
            let mut highest: Option<u64> = None;
            let mut drain_deadline: Option<Instant> = None;
            loop {
                if sender_done.load(Ordering::SeqCst) {
                    let deadline = *drain_deadline.get_or_insert_with(|| Instant::now() + drain);
                    let s = lock(&state);
                    if Instant::now() > deadline
                        || s.dgrams_verified == s.dgrams_sent
                        || s.error.is_some()
                    {
                        break;
                    }
                }
                match socket.recv(&mut buf) {
                    Ok(n) => {
                        let mut s = lock(&state);
                        let limit = s.dgrams_sent.max(s.writing_upto);
                        match check_datagram(&buf[..n], size, limit) {
                            Ok(seq) => {
                                if !seen.insert(seq) {
                                    s.duplicates += 1;
                                    continue;
                                }
                                if highest.is_some_and(|h| seq < h) {
                                    s.reordered += 1;
                                }
                                highest = highest.max(Some(seq));
                                s.dgrams_verified += 1;
                                s.on_verified(size as u64);
                            }
                            Err(msg) => {
                                s.fail(msg);
                                break;
                            }
                        }
                    }
                    Err(e) if is_tick(&e) => {}
                    Err(e) => {
                        let mut s = lock(&state);
                        s.transient_errors += 1;
                        s.last_transient_error = Some(describe(&e));
                    }
                }
            }
            lock(&state).done = true;
        })
    };

    let local = socket.local_addr().ok();
    let remote = socket.peer_addr().ok();
    report_until_done(
        &state,
        || {
            (
                socket.local_addr().ok().or(local),
                socket.peer_addr().ok().or(remote),
            )
        },
        true,
    );
    let _ = writer.join();
    let _ = reader.join();
    let s = lock(&state);
    print_status(&s, socket.local_addr().ok().or(local), remote, true, true);
    i32::from(s.error.is_some())
}

/// Datagram `seq`: the sequence number, then pattern bytes that depend on it.
fn datagram(buf: &mut [u8], seq: u64) {
    buf[..8].copy_from_slice(&seq.to_be_bytes());
    let base = seq.wrapping_mul(buf.len() as u64);
    fill(&mut buf[8..], base);
}

fn check_datagram(d: &[u8], size: usize, sent: u64) -> Result<u64, String> {
    if d.len() != size {
        // The usual cause: an echo through a byte pipe (socat PIPE) without
        // `-b SIZE`, which merges or cuts datagrams.
        return Err(format!(
            "received a {}-byte datagram, sent only {size}-byte ones",
            d.len()
        ));
    }
    let seq = u64::from_be_bytes(d[..8].try_into().expect("8 bytes"));
    if seq >= sent {
        return Err(format!(
            "received datagram {seq}, but only {sent} were sent"
        ));
    }
    let base = seq.wrapping_mul(size as u64);
    if let Some(k) = (8..size).find(|&k| d[k] != pattern(base + (k - 8) as u64)) {
        return Err(format!("mismatch in datagram {seq} at byte {k}"));
    }
    Ok(seq)
}

fn report_until_done(
    state: &Shared,
    addrs: impl Fn() -> (Option<SocketAddr>, Option<SocketAddr>),
    udp: bool,
) {
    let mut next = Instant::now() + STATUS_INTERVAL;
    loop {
        thread::sleep(next.saturating_duration_since(Instant::now()));
        next += STATUS_INTERVAL;
        let s = lock(state);
        if s.done {
            return;
        }
        let (local, remote) = addrs();
        print_status(&s, local, remote, udp, false);
    }
}

fn print_status(
    s: &State,
    local: Option<SocketAddr>,
    remote: Option<SocketAddr>,
    udp: bool,
    last: bool,
) {
    let mut v = json!({
        "t_ms": s.start.elapsed().as_millis() as u64,
        "proto": if udp { "udp" } else { "tcp" },
        "sent": s.sent,
        "verified": s.verified,
        "max_gap_ms": s.current_max_gap().as_millis() as u64,
        "local": local.map(|a| a.to_string()),
        "remote": remote.map(|a| a.to_string()),
        "error": s.error,
        "final": last,
    });
    if udp {
        let extra = json!({
            "datagrams_sent": s.dgrams_sent,
            "datagrams_verified": s.dgrams_verified,
            "lost": s.dgrams_sent.saturating_sub(s.dgrams_verified),
            "duplicates": s.duplicates,
            "reordered": s.reordered,
            "transient_errors": s.transient_errors,
            "last_transient_error": s.last_transient_error,
        });
        if let (Some(m), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            m.extend(e.clone());
        }
    }
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{v}");
    let _ = out.flush();
}

/// A failure before any traffic: still one final JSON line, then exit 1.
fn fatal(opts: &Opts, msg: &str) -> i32 {
    let mut s = State::new();
    s.fail(msg.to_string());
    print_status(&s, None, Some(opts.connect), opts.udp, true);
    1
}

/// The I/O tick (SO_RCVTIMEO/SO_SNDTIMEO give EAGAIN) and EINTR from the
/// stop signal: not errors. ETIMEDOUT is a real TCP timeout and is one.
fn is_tick(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
    )
}

fn describe(e: &io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ECONNRESET) => "connection reset by peer (ECONNRESET)".to_string(),
        Some(libc::EPIPE) => "broken pipe (EPIPE): the connection was closed".to_string(),
        Some(libc::ETIMEDOUT) => "connection timed out (ETIMEDOUT)".to_string(),
        _ => e.to_string(),
    }
}
