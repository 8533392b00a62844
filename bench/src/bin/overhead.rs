//! `cargo xtask bench overhead`: what vnat costs a connection, beside the
//! VNAT paper's Figures 6-1 to 6-5 (section 6.1-6.3), for the paper's eight
//! message sizes (64 to 8192 bytes).
//!
//! The three cases of the throughput benchmark, each on its own pair of
//! namespace hosts on one veth (`throughput/bed.rs`):
//!  (a) no vnat (the paper's Vanilla);
//!  (b) vnat attached, the measured flow not translated (VNAT1): recorders
//!      on both hosts' cgroups, tc on both eth0 kept by an unrelated
//!      translation, so every packet pays the lookup;
//!  (c) the measured flow translated on both hosts (VNAT2).
//!
//! Per message size and case:
//!  - throughput (Figure 6-1) and the sender's and receiver's CPU use
//!    (Figure 6-2): `iperf3 -l SIZE`, which reports both processes' CPU;
//!  - request/response latency (Figure 6-3) and CPU (Figure 6-4):
//!    `sockperf ping-pong -m SIZE` over TCP (half the round trip, as
//!    sockperf reports it); the client's CPU from wait4(2), the server's
//!    from /proc over the run;
//!  - connection setup (Figure 6-5): transactions per second of a new
//!    connection per request/response (netperf's TCP_CRR; `overhead crr-*`,
//!    our own tool since Debian has no netperf). As in the paper, only (a)
//!    and (b): a connection is set up before it can have moved.
//!
//! Senders and clients run on CPU 0, receivers and servers on CPU 1 (left to
//! the scheduler, where the pair landed decided the result more than vnat).
//! Runs are interleaved (every size and case, then again) and medians with
//! their spread are reported. Targets (issue 5): (b) within noise of (a);
//! (c) at most 3% less throughput and at most 2% more latency and CPU; setup
//! at most 3% slower. A missed target is a result (exit 0).

use std::{
    io::Read,
    net::SocketAddr,
    process::{Child, ExitCode, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use vnat_bench::env;
use vnat_tests::{Family, SameLink};

#[allow(dead_code)]
#[path = "throughput/bed.rs"]
mod bed;
#[path = "overhead/crr.rs"]
mod crr;
#[path = "overhead/report.rs"]
mod report;

use bed::{Bed, Case};

/// The paper's message sizes (section 6: "64 to 8192 bytes").
const SIZES: [u32; 8] = [64, 128, 256, 512, 1024, 2048, 4096, 8192];
const SOCKPERF_PORT: u16 = 11111;
const CRR_PORT: u16 = 11112;
/// sockperf's client ports: one per measurement (TIME_WAIT), below the
/// ephemeral range.
const SOCKPERF_CPORT_BASE: u16 = 24000;

#[derive(Parser)]
#[command(
    about = "Throughput, request/response latency, connection setup and CPU use for message sizes 64-8192 bytes: \
             (a) no vnat, (b) vnat attached, flow not translated, (c) flow translated (the paper's Figures 6-1 to 6-5). \
             Writes bench/results/overhead.json.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    tool: Option<Tool>,
    #[command(flatten)]
    args: Args,
}

#[derive(Subcommand)]
enum Tool {
    /// (internal) The connection-setup server, run in the server's namespace.
    #[command(hide = true)]
    CrrServer {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        size: usize,
    },
    /// (internal) The connection-setup client, run in the laptop's namespace.
    #[command(hide = true)]
    CrrClient {
        #[arg(long)]
        connect: SocketAddr,
        #[arg(long)]
        size: usize,
        #[arg(long)]
        seconds: f64,
    },
}

#[derive(clap::Args)]
pub struct Args {
    /// Runs per size and case.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
    pub runs: u16,
    /// Length of each measurement, in seconds.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=600))]
    pub seconds: u64,
    /// Message sizes in bytes, comma-separated [default: the paper's 64,128,...,8192].
    #[arg(long, value_delimiter = ',', value_parser = clap::value_parser!(u32).range(14..=65536))]
    pub sizes: Vec<u32>,
    /// Measure over IPv6 instead of IPv4.
    #[arg(long)]
    pub ipv6: bool,
    /// In (b), translate nothing on either host (tc attached but idle: the
    /// common case of a host none of whose connections has moved) instead
    /// of one unrelated flow (every packet looked up and missed).
    #[arg(long)]
    pub attached_idle: bool,
    /// Measure only these kinds, comma-separated [default: all three]. With
    /// `setup` alone, many runs fit in a few minutes: `--only setup --runs 30`.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub only: Vec<Kind>,
    /// Print one JSON object on stdout (the table goes to stderr).
    #[arg(long)]
    pub json: bool,
}

/// What a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    /// iperf3's throughput and CPU.
    Throughput,
    /// sockperf's request/response latency and CPU.
    Latency,
    /// New connections per second (TCP_CRR), cases (a) and (b).
    Setup,
}

/// One measurement of one kind, for one size, case and run.
#[derive(Clone, Debug, Default)]
pub struct Point {
    /// Throughput (Gbit/s), mean latency (µs) or transactions per second.
    pub value: f64,
    /// Median latency (µs), for request/response only.
    pub p50: Option<f64>,
    pub p99: Option<f64>,
    /// CPU use in percent of one CPU (client or sender, server or receiver).
    pub client_cpu: f64,
    pub server_cpu: f64,
}

/// All measurements: `[kind][case][size index]` -> runs.
pub struct Results {
    pub sizes: Vec<u32>,
    pub tput: Vec<Vec<Vec<Point>>>,
    pub rr: Vec<Vec<Vec<Point>>>,
    pub crr: Vec<Vec<Vec<Point>>>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.tool {
        Some(Tool::CrrServer { listen, size }) => {
            vnat_bench::run_main("overhead crr-server", || crr::serve(listen, size))
        }
        Some(Tool::CrrClient {
            connect,
            size,
            seconds,
        }) => vnat_bench::run_main("overhead crr-client", || {
            crr::client(connect, size, seconds)
        }),
        None => {
            vnat_bench::catch_interrupts();
            vnat_bench::run_main("overhead", || run(&cli.args))
        }
    }
}

/// A long-running server process, killed on drop.
struct Server {
    child: Child,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// CPU seconds (user + system) the server has used so far (/proc).
    fn cpu_seconds(&self) -> Result<f64> {
        proc_cpu_seconds(self.child.id())
    }
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).max(1) as f64
}

fn proc_cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("reading /proc/{pid}/stat"))?;
    // Fields after the command (which may hold spaces) start at ") ".
    let rest = stat
        .rsplit_once(") ")
        .map(|(_, r)| r)
        .context("malformed /proc/PID/stat")?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after ") ".
    let ticks = |i: usize| -> Result<f64> {
        f.get(i)
            .context("short /proc/PID/stat")?
            .parse::<f64>()
            .context("utime/stime")
    };
    Ok((ticks(11)? + ticks(12)?) / clock_ticks())
}

/// Start `cmd` (a server) and wait until `port` listens in `ns`.
fn start_server(
    mut cmd: std::process::Command,
    ns: &vnat_tests::Netns,
    port: u16,
) -> Result<Server> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let child = cmd.spawn().context("starting a server")?;
    let mut server = Server { child };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let out = ns.run_stdout(&["ss", "-ltnH", "sport", "=", &format!(":{port}")]);
        if !out.trim().is_empty() {
            return Ok(server);
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            bail!("the server for port {port} exited at once ({status})");
        }
        ensure!(
            Instant::now() < deadline,
            "the server for port {port} did not listen within 5 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run `cmd` to completion; its stdout and its CPU seconds (wait4 rusage).
fn run_measured(mut cmd: std::process::Command, timeout: Duration) -> Result<(String, f64)> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().context("starting a client")?;
    let pid = child.id() as libc::pid_t;
    let mut out = child.stdout.take().context("client stdout")?;
    let mut err = child.stderr.take().context("client stderr")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let killer_pid = pid;
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if rx.recv_timeout(timeout).is_err() {
            // SAFETY: kill(2) takes no pointers, so memory safety is not at
            // stake. `killer_pid` is our child until the main thread's
            // wait4 reaps it; if the timeout ends between that reap and the
            // message on the channel, the pid is already free and, were it
            // reused at once, another process would be killed. The window
            // is that short and pids are handed out in sequence.
            unsafe { libc::kill(killer_pid, libc::SIGKILL) };
        }
    });
    let mut status = 0;
    // SAFETY: rusage is plain integers, for which all-zero is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: wait4 on our own child, with live out-pointers for the
    // status and the rusage.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    let _ = tx.send(());
    let _ = watchdog.join();
    ensure!(rc == pid, "waiting for the client failed");
    let stdout = reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    ensure!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the client failed (status {status}): {}",
        stderr.trim()
    );
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    // The Child handle must not reap a second time.
    std::mem::forget(child);
    Ok((stdout, secs(ru.ru_utime) + secs(ru.ru_stime)))
}

/// The numbers sockperf prints after a ping-pong run (escape codes removed):
/// mean, median and 99th percentile latency, in µs (half a round trip).
fn parse_sockperf(text: &str) -> Result<(f64, f64, f64)> {
    let clean: String = {
        let mut out = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                // Skip an escape sequence up to its final letter.
                for d in chars.by_ref() {
                    if d.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    };
    let after = |key: &str| -> Option<f64> {
        let i = clean.find(key)? + key.len();
        let rest = clean[i..].trim_start();
        let end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        rest[..end].parse().ok()
    };
    let avg = after("avg-latency=").context("sockperf printed no avg-latency")?;
    let p50 = after("percentile 50.000 =").context("sockperf printed no median")?;
    let p99 = after("percentile 99.000 =").context("sockperf printed no 99th percentile")?;
    Ok((avg, p50, p99))
}

struct Servers {
    sockperf: Server,
    crr: Vec<Server>,
}

fn start_servers(bed: &Bed, sizes: &[u32]) -> Result<Servers> {
    let ip = bed.topo.server_addr.get(bed.family);
    // Servers on CPU 1, clients on CPU 0 (see `Bed::measure_sized`).
    let mut cmd = bed.server.command("taskset");
    cmd.args([
        "-c",
        "1",
        "sockperf",
        "sr",
        "--tcp",
        "-i",
        &ip.to_string(),
        "-p",
        &SOCKPERF_PORT.to_string(),
    ]);
    let sockperf = start_server(cmd, &bed.topo.server, SOCKPERF_PORT)?;
    let mut crr = Vec::new();
    if bed.case != Case::Translated {
        let exe = std::env::current_exe().context("finding this benchmark's executable")?;
        for (i, size) in sizes.iter().enumerate() {
            let port = CRR_PORT + 1 + i as u16;
            let mut cmd = bed.server.command("taskset");
            cmd.args([
                "-c",
                "1",
                exe.to_str().context("executable path")?,
                "crr-server",
                "--listen",
                &SocketAddr::new(ip, port).to_string(),
                "--size",
                &size.to_string(),
            ]);
            crr.push(start_server(cmd, &bed.topo.server, port)?);
        }
    }
    Ok(Servers { sockperf, crr })
}

fn measure_rr(bed: &Bed, srv: &Servers, index: u16, size: u32, seconds: u64) -> Result<Point> {
    let cport = SOCKPERF_CPORT_BASE + index;
    bed.with_flow(cport, SOCKPERF_PORT, |flow| {
        let mut cmd = bed.laptop.command("taskset");
        cmd.args([
            "-c",
            "0",
            "sockperf",
            "pp",
            "--tcp",
            "-i",
            &flow.remote.ip().to_string(),
            "-p",
            &SOCKPERF_PORT.to_string(),
            "-m",
            &size.to_string(),
            "-t",
            &seconds.to_string(),
            "--client_ip",
            &flow.local.ip().to_string(),
            "--client_port",
            &cport.to_string(),
        ]);
        let s0 = srv.sockperf.cpu_seconds()?;
        let t0 = Instant::now();
        let (out, client_cpu) = run_measured(cmd, Duration::from_secs(seconds + 30))?;
        let wall = t0.elapsed().as_secs_f64();
        let server_cpu = srv.sockperf.cpu_seconds()? - s0;
        let (avg, p50, p99) = parse_sockperf(&out)
            .with_context(|| format!("case {}, {size} bytes", bed.case.label()))?;
        Ok(Point {
            value: avg,
            p50: Some(p50),
            p99: Some(p99),
            client_cpu: client_cpu / wall * 100.0,
            server_cpu: server_cpu / wall * 100.0,
        })
    })
}

fn measure_crr(
    bed: &Bed,
    srv: &Servers,
    size_idx: usize,
    size: u32,
    seconds: u64,
) -> Result<Point> {
    let server = &srv.crr[size_idx];
    let connect = SocketAddr::new(
        bed.topo.server_addr.get(bed.family),
        CRR_PORT + 1 + size_idx as u16,
    );
    let exe = std::env::current_exe().context("finding this benchmark's executable")?;
    let mut cmd = bed.laptop.command("taskset");
    cmd.args([
        "-c",
        "0",
        exe.to_str().context("executable path")?,
        "crr-client",
        "--connect",
        &connect.to_string(),
        "--size",
        &size.to_string(),
        "--seconds",
        &seconds.to_string(),
    ]);
    let s0 = server.cpu_seconds()?;
    let (out, _) = run_measured(cmd, Duration::from_secs(seconds + 30))?;
    let server_cpu = server.cpu_seconds()? - s0;
    let v: Value = serde_json::from_str(out.trim()).context("the crr client's report")?;
    let n = v["transactions"].as_f64().context("transactions")?;
    let failed = v["failed"].as_u64().unwrap_or(0);
    ensure!(
        failed == 0,
        "case {}: {failed} of the connection-setup transactions failed",
        bed.case.label()
    );
    let secs = v["seconds"].as_f64().context("seconds")?;
    let cpu = v["cpu_user_s"].as_f64().unwrap_or(0.0) + v["cpu_system_s"].as_f64().unwrap_or(0.0);
    Ok(Point {
        value: n / secs,
        p50: None,
        p99: None,
        client_cpu: cpu / secs * 100.0,
        server_cpu: server_cpu / secs * 100.0,
    })
}

fn run(args: &Args) -> Result<()> {
    env::require_root("overhead")?;
    let iperf_version = env::require_program("iperf3", "iperf3")?;
    let sockperf_version = env::require_program("sockperf", "sockperf")?;
    let family = if args.ipv6 { Family::V6 } else { Family::V4 };
    let sizes: Vec<u32> = if args.sizes.is_empty() {
        SIZES.to_vec()
    } else {
        args.sizes.clone()
    };
    ensure!(
        usize::from(args.runs) * sizes.len() < 4000,
        "too many runs times sizes for the port ranges this benchmark uses"
    );
    let load_before = env::loadavg_1min();

    let topos: Vec<SameLink> = Case::ALL
        .iter()
        .map(|c| SameLink::new(&format!("o{}", c.tag()), args.ipv6))
        .collect();
    let beds = Case::ALL
        .iter()
        .zip(&topos)
        .map(|(c, t)| Bed::new(*c, t, family, args.attached_idle))
        .collect::<Result<Vec<_>>>()?;
    let servers = beds
        .iter()
        .map(|b| start_servers(b, &sizes))
        .collect::<Result<Vec<_>>>()?;

    let empty = || -> Vec<Vec<Vec<Point>>> {
        Case::ALL
            .iter()
            .map(|_| sizes.iter().map(|_| Vec::new()).collect())
            .collect()
    };
    let mut res = Results {
        sizes: sizes.clone(),
        tput: empty(),
        rr: empty(),
        crr: empty(),
    };
    let wants = |k: Kind| args.only.is_empty() || args.only.contains(&k);
    let started = Instant::now();
    for run in 0..args.runs {
        for (si, &size) in sizes.iter().enumerate() {
            let index = run * sizes.len() as u16 + si as u16;
            for (ci, (bed, srv)) in beds.iter().zip(&servers).enumerate() {
                ensure!(!vnat_bench::interrupted(), "interrupted");
                let tput = if wants(Kind::Throughput) {
                    let t = bed.measure_sized(index, args.seconds, Some(size))?;
                    Some(Point {
                        value: t.run.received_bps / 1e9,
                        p50: None,
                        p99: None,
                        client_cpu: t.run.sender_cpu_percent,
                        server_cpu: t.run.receiver_cpu_percent,
                    })
                } else {
                    None
                };
                let rr = if wants(Kind::Latency) {
                    Some(measure_rr(bed, srv, index, size, args.seconds)?)
                } else {
                    None
                };
                let crr = if wants(Kind::Setup) && bed.case != Case::Translated {
                    Some(measure_crr(bed, srv, si, size, args.seconds)?)
                } else {
                    None
                };
                if tput.is_none() && rr.is_none() && crr.is_none() {
                    continue;
                }
                eprintln!(
                    "run {}/{} {:>5} B {:<34} {}  {}  {}",
                    run + 1,
                    args.runs,
                    size,
                    bed.case.label(),
                    tput.as_ref()
                        .map_or("    -- Gbit/s".to_string(), |t| format!(
                            "{:>7.2} Gbit/s",
                            t.value
                        )),
                    rr.as_ref().map_or("rr     -- µs".to_string(), |r| format!(
                        "rr {:>7.2} µs",
                        r.value
                    )),
                    crr.as_ref()
                        .map_or("crr n/a".to_string(), |c| format!("crr {:>7.0}/s", c.value))
                );
                if let Some(t) = tput {
                    res.tput[ci][si].push(t);
                }
                if let Some(r) = rr {
                    res.rr[ci][si].push(r);
                }
                if let Some(c) = crr {
                    res.crr[ci][si].push(c);
                }
            }
        }
    }
    let setup = json!({
        "runs": args.runs,
        "seconds_per_measurement": args.seconds,
        "family": if args.ipv6 { "ipv6" } else { "ipv4" },
        "attached": if args.attached_idle { "idle: nothing translated on either host" } else { "one unrelated flow translated on both hosts" },
        "only": args.only.iter().map(|k| format!("{k:?}").to_lowercase()).collect::<Vec<_>>(),
        "iperf3": iperf_version,
        "sockperf": sockperf_version,
        "load_before": load_before,
        "duration_s": started.elapsed().as_secs_f64(),
        "machine": env::machine(load_before),
    });
    let report = report::build(&setup, &res);
    let table = report::table(&report);
    vnat_bench::emit("overhead", args.json, &table, &report)
}
