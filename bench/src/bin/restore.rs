//! `cargo xtask bench restore`: how long vnat takes to restore N live TCP
//! connections when the laptop's address changes (issue 5, item 2), beside
//! the VNAT paper's Table 1 (section 6.4: 10/50/100/500 connections in
//! 0.434/2.374/4.856/24.657 s at about 3.1 ms RTT).
//!
//! Targets (issue 5): 500 connections in under 50 ms, at most 10 µs per
//! extra connection, 10,000 in under 1 s; the JSON says which were met.
//!
//! Hosts as in the demo: laptop, router, server (network namespaces), a real
//! vnatd on the laptop and on the server; the round trip is made `--rtt-ms`
//! (3) by the userspace delay line on the router-server link
//! (`vnat_bench::delayline`; this kernel has no netem) and checked with
//! timed TCP handshakes. Two helpers of this binary run in the hosts'
//! namespaces and cgroups (so each vnatd records its side of every
//! connection): `restore echo`, one epoll thread echoing every connection,
//! and `restore client`, which opens N connections and every 10 ms writes a
//! timestamped 16-byte message on each (see `restore/client.rs`).
//!
//! A run waits until both vnatd list all N connections as mobile
//! (`vnatctl --json ls`), lets them run a second, then moves the laptop
//! (`move_laptop_to_b`: A's address removed, link down, B up with its
//! address and default route; with `--outage-secs S`, S seconds without
//! any network between losing A and getting B). `t0` is when the last of
//! those commands returned (the new address is usable). A connection counts as restored
//! when the echo of a message *written* at or after `t0` arrives; `total_s`
//! is from `t0` to the last connection restored, `per_conn_ms` =
//! total_s * 1000 / N (the paper's column). A run that has not restored
//! every connection within `--timeout-s` (120 s + 0.2 s per connection) is
//! reported as incomplete with how many were restored.
//!
//! Where the time goes comes from vnatd's own logs (info level, kept as
//! `bench/results/restore-nN-rR-{laptop,server}.log`): the laptop logs
//! "resuming connection at a new address" per connection after preparing its
//! receive side, each vnatd logs "translation updated" per connection after
//! installing a translation (for more than 16 in one batch, the restart
//! levers follow after vnatd has sent what VCMP queued). See
//! `restore/phases.rs`.
//!
//! How much of each figure is the harness's own: before the move, each run
//! sends the client the same `mark` with the laptop staying put and times
//! the echo of one message written after it on every connection
//! (`harness_s`). That is what the client, the delay line and the echo
//! server take by themselves on these 2 cores; a move cannot restore
//! faster, and `vnat_s` = `total_s` - `harness_s` is vnat's share.
//!
//! Each run also says whose CPU the second of steady traffic before the
//! move and the move itself used: the machine's busy time, each vnatd's,
//! and the rest, the harness's (`restore/cpu.rs`). At tens of thousands of
//! connections the harness fills most of the 2 cores by itself.

use std::{
    net::SocketAddr,
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, Subcommand};
use serde::Serialize;
use serde_json::Value;
use vnat_bench::{
    delayline::{self, monotonic_ns, realtime_ns, DirectionStats},
    env,
    stats::Summary,
};
use vnat_tests::{Host, LaptopRouterServer, TempDir};

#[path = "restore/backlog.rs"]
mod backlog;
#[path = "restore/client.rs"]
mod client;
#[path = "restore/cpu.rs"]
mod cpu;
// Shared with the handover benchmark (vnatd with JSON logs in a file);
// this one does not read events by message.
#[allow(dead_code)]
#[path = "handover/daemon.rs"]
mod daemon;
#[path = "restore/echo.rs"]
mod echo;
#[path = "restore/helpers.rs"]
mod helpers;
#[path = "restore/phases.rs"]
mod phases;
#[path = "restore/report.rs"]
mod report;
#[path = "restore/scale.rs"]
mod scale;
#[path = "restore/sys.rs"]
mod sys;

use daemon::Daemon;
pub use helpers::Restored;
use helpers::{Helper, Helpers};
use phases::Phases;

const SERVER_PORT: u16 = 5001;
/// TCP handshakes timed to measure the round trip.
const RTT_SAMPLES: usize = 20;
/// The self-check: the measured RTT must be this close to `--rtt-ms`.
const RTT_TOLERANCE_MS: f64 = 1.0;

/// The VNAT paper's Table 1: connections, total restoration time (s), per
/// connection (ms), average RTT (ms).
pub const PAPER: [(usize, f64, f64, f64); 4] = [
    (10, 0.434, 43.4, 3.104),
    (50, 2.374, 47.5, 3.134),
    (100, 4.856, 48.6, 3.159),
    (500, 24.657, 49.3, 3.147),
];

#[derive(Parser)]
#[command(
    about = "Time to restore N live TCP connections after the laptop's address changes, at 3 ms RTT, \
             beside the VNAT paper's Table 1. Writes bench/results/restore.json.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    sub: Option<Sub>,
    #[command(flatten)]
    args: Args,
}

#[derive(Subcommand)]
enum Sub {
    /// The echo server (run by the benchmark in the server's namespace).
    #[command(hide = true)]
    Echo {
        #[arg(long, required = true)]
        listen: Vec<SocketAddr>,
    },
    /// The measuring client (run by the benchmark in the laptop's namespace).
    #[command(hide = true)]
    Client {
        #[arg(long, required = true)]
        connect: Vec<SocketAddr>,
        #[arg(long)]
        conns: usize,
        #[arg(long, default_value_t = 10)]
        interval_ms: u64,
    },
}

#[derive(clap::Args)]
pub struct Args {
    /// Numbers of connections to restore (repeatable or a comma list).
    #[arg(long, value_delimiter = ',', default_values_t = [10usize, 50, 100, 500, 1000, 10000],
          value_parser = clap::value_parser!(usize))]
    conns: Vec<usize>,
    /// The round trip the delay line makes (half of it each way), in ms;
    /// 0: no delay line.
    #[arg(long, default_value_t = 3.0)]
    rtt_ms: f64,
    /// Runs per number of connections.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=100))]
    runs: u16,
    /// Give up on a run after this many seconds from the move [default:
    /// 120 + 0.001 per connection].
    #[arg(long)]
    timeout_s: Option<f64>,
    /// How often the client writes on every connection, in ms; at least
    /// N/10 ms for N connections (10,000 connections every 10 ms would be a
    /// million writes a second on this 2-core machine, and the client, not
    /// vnat, would be measured). The client also writes on every connection
    /// as soon as it learns t0, so the interval adds nothing to the figures.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=10000))]
    interval_ms: u64,
    /// Print one JSON object on stdout (the tables go to stderr).
    #[arg(long)]
    json: bool,
    /// Run both vnatd with `--no-standby-tc`: tc attached only once a
    /// connection moved, so the kernel's attachment (10-25 ms on each
    /// host) falls inside the move. The default keeps it attached ahead.
    #[arg(long)]
    no_standby_tc: bool,
    /// Seconds without any network between losing subnet A and getting B
    /// (0: the move is immediate). `t0` is still when B became usable; the
    /// targets are only judged without an outage.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=3600))]
    outage_secs: u64,
    /// Also write a pcap of the router's view (the servers' ports, VCMP,
    /// ICMP, ARP) per run, as `bench/results/restore-nN-rR.pcap`.
    #[arg(long)]
    capture: bool,
    /// The scale benchmark (`cargo xtask bench scale`): before the move,
    /// also time `vnatctl ls` on both hosts and read the daemons' memory and
    /// their maps' kernel memory; write bench/results/scale.json too.
    #[arg(long)]
    scale: bool,
    /// The kernel's per-CPU receive backlog (net.core.netdev_max_backlog)
    /// for the run, put back afterwards; 0 keeps the machine's. Every
    /// namespace of this machine queues into the same backlog, where the
    /// hosts of a real network would each have their own, and at tens of
    /// thousands of connections it overflows: TCP then retries every
    /// 500 ms and gives up after 7.5 s (see restore/backlog.rs) [default:
    /// the number of connections above 20,000, else the machine's]
    #[arg(long, value_name = "PACKETS")]
    netdev_backlog: Option<u64>,
}

/// Connections per server port: one laptop address has about 64,000
/// ports towards one server port (the laptop's range is widened to
/// 1024-65535 for large runs).
const CONNS_PER_PORT: usize = 50_000;

/// One run's figures (milliseconds from `t0` unless named otherwise).
#[derive(Clone, Debug, Serialize)]
pub struct RunResult {
    pub conns: usize,
    /// How often the client wrote on every connection (ms).
    pub interval_ms: u64,
    /// Median TCP handshake time laptop -> server (through the delay line).
    pub rtt_ms: f64,
    /// The same before the line's delay was set (the path's own cost).
    pub base_rtt_ms: f64,
    /// The client's median echo round trip in the second before the move.
    pub echo_rtt_ms: Option<f64>,
    /// How long the client's write ticks ran late at worst then.
    pub tick_late_max_ms: Option<f64>,
    /// How long the move's own commands took.
    pub move_ms: f64,
    /// Every connection restored within the timeout, and none failed.
    pub complete: bool,
    pub restored: usize,
    /// Connections that failed (reset, closed, out of order).
    pub failed: usize,
    pub conn_errors: Vec<String>,
    /// t0 to the write of the measured message: first, median, last.
    pub written_ms: Option<(f64, f64, f64)>,
    /// t0 to the last connection restored (only when complete), and
    /// total_s * 1000 / N.
    pub total_s: Option<f64>,
    pub per_conn_ms: Option<f64>,
    /// The restored connections' times: first, median, 90th percentile, last.
    pub first_ms: Option<f64>,
    pub median_ms: Option<f64>,
    pub p90_ms: Option<f64>,
    pub last_ms: Option<f64>,
    /// After the run: connections that echoed one more message.
    pub verified: Option<usize>,
    /// The harness's own round, measured before the move on the same
    /// connections: a `mark` with the laptop staying put, and the time
    /// from it to the last connection's echo of a message written after
    /// it (the client learning the mark, writing on every connection, the
    /// delay line, the echo server, the client reading every echo). A move
    /// cannot restore faster than this; the rest of `total_s` is vnat's.
    pub harness_s: Option<f64>,
    pub harness_median_ms: Option<f64>,
    /// `total_s` less `harness_s`: vnat's share of the figure.
    pub vnat_s: Option<f64>,
    /// Whose CPU the harness's own round used.
    pub cpu_harness: cpu::Share,
    /// vnatd's steps, from its logs.
    pub phases: Phases,
    /// With `--scale`: listing times and memory, before the move.
    pub scale: Option<Value>,
    pub timeout_s: f64,
    /// Whose CPU the second of steady traffic before the move used, and
    /// the move (t0 to the last connection restored or the timeout): how
    /// much of the machine the harness took from vnatd (`restore/cpu.rs`).
    pub cpu_steady: cpu::Share,
    pub cpu_move: cpu::Share,
    /// The kernel's per-CPU backlog during the run, and the packets the
    /// backlogs dropped during the move (`restore/backlog.rs`).
    pub netdev_max_backlog: u64,
    pub backlog_drops_move: Option<u64>,
    pub delay_line: Vec<DirectionStats>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.sub {
        Some(Sub::Echo { listen }) => return ExitCode::from(echo::run(&listen) as u8),
        Some(Sub::Client {
            connect,
            conns,
            interval_ms,
        }) => {
            return ExitCode::from(
                client::run(&connect, conns, Duration::from_millis(interval_ms)) as u8,
            )
        }
        None => {}
    }
    vnat_bench::catch_interrupts();
    vnat_bench::run_main("restore", || run(&cli.args))
}

fn run(args: &Args) -> Result<()> {
    env::require_root("restore")?;
    if args.rtt_ms > 0.0 {
        env::require_program("ethtool", "ethtool")?;
    }
    ensure!(
        (0.0..=1000.0).contains(&args.rtt_ms),
        "--rtt-ms must be between 0 and 1000, not {}",
        args.rtt_ms
    );
    ensure!(
        args.conns.iter().all(|n| (1..=200_000).contains(n)),
        "--conns must be between 1 and 200000, not {:?}",
        args.conns
    );
    let load_before = env::loadavg_1min();
    let mut results: Vec<(usize, Vec<RunResult>)> = Vec::new();
    for &n in &args.conns {
        let mut done = Vec::new();
        for i in 0..args.runs {
            eprintln!("{n} connections: run {}/{} ...", i + 1, args.runs);
            let r = measure(n, args, &format!("restore-n{n}-r{}", i + 1))
                .with_context(|| format!("{n} connections, run {}", i + 1))?;
            eprintln!("  {}", report::run_line(&r));
            done.push(r);
        }
        results.push((n, done));
        // What is known so far is on disk if a later size fails or hangs.
        vnat_bench::write_json(
            &vnat_bench::results_path("restore"),
            &report::json(args, &results, load_before, env::loadavg_1min()),
        )?;
    }
    let load_after = env::loadavg_1min();
    let report = report::json(args, &results, load_before, load_after);
    let table = report::table(args, &results);
    vnat_bench::emit("restore", args.json, &table, &report)?;
    if args.scale {
        let s = scale::summary(&results, &report);
        eprint!("{}", scale::table(&s));
        vnat_bench::write_json(&vnat_bench::results_path("scale"), &s)?;
    }
    Ok(())
}

fn timeout_for(args: &Args, n: usize) -> Duration {
    // 20,120 s at 100,000 connections before: a failed run held 200,000
    // sockets for hours (and slowed whatever ran beside it).
    Duration::from_secs_f64(args.timeout_s.unwrap_or(120.0 + 0.001 * n as f64))
}

/// One run on fresh hosts; vnatd's logs are kept as
/// `bench/results/DIAG-{laptop,server}.log`.
fn measure(n: usize, args: &Args, diag: &str) -> Result<RunResult> {
    let machine_backlog = backlog::current()?;
    let netdev_max_backlog = backlog::for_run(n, args.netdev_backlog, machine_backlog);
    let _backlog = backlog::raise(netdev_max_backlog)?;
    let topo = LaptopRouterServer::builder().tag("rst").build();
    let delay = if args.rtt_ms > 0.0 {
        Some(delayline::delay_server_link(&topo, "rstd", Duration::ZERO)?)
    } else {
        None
    };
    // Calibration: what the path costs without delay; the line adds the
    // rest, half each way.
    let base = delayline::handshake_rtts(&topo, topo.server_addr.v4.into(), RTT_SAMPLES)?;
    let base_rtt = Summary::of(&base).expect("RTT samples").median;
    if let Some(d) = &delay {
        d.line.set_one_way(Duration::from_secs_f64(
            (args.rtt_ms - base_rtt).max(0.0) / 2000.0,
        ));
    }
    let lap = Host::new(&topo.laptop, "rstl");
    let srv = Host::new(&topo.server, "rsts");
    let server = SocketAddr::new(topo.server_addr.v4.into(), SERVER_PORT);
    let _capture =
        vnat_bench::capture::Tcpdump::for_run(args.capture, &topo.router, diag, SERVER_PORT)?;
    // Connections per helper process: each holds one descriptor per
    // connection, and a process may hold no more than its open-file limit
    // (20,000 where root may not raise it, as on this benchmark's VMs).
    let per_process = conns_per_process()?;
    let shares = split(n, per_process);
    // Each client/echo pair gets its own server ports.
    let mut next_port = SERVER_PORT;
    let port_sets: Vec<Vec<String>> = shares
        .iter()
        .map(|&k| {
            (0..k.div_ceil(CONNS_PER_PORT))
                .map(|_| {
                    let a = SocketAddr::new(server.ip(), next_port);
                    next_port += 1;
                    a.to_string()
                })
                .collect()
        })
        .collect();
    let ports = usize::from(next_port - SERVER_PORT);
    if n > 20_000 {
        topo.laptop
            .set_sysctl("net/ipv4/ip_local_port_range", "1024 65535");
    }
    let mut echo_servers = Vec::new();
    for set in &port_sets {
        let mut echo_args = vec!["echo"];
        for s in set {
            echo_args.extend(["--listen", s.as_str()]);
        }
        echo_servers.push(Helper::spawn(&srv, &echo_args, false)?);
    }
    let echo_servers = Helpers(echo_servers);
    echo_servers.wait_for("the echo servers to listen", Duration::from_secs(10), |h| {
        h.all(|l| l.listening)
    })?;
    let (ldir, sdir) = (TempDir::new("rstl"), TempDir::new("rsts"));
    let lapd = Daemon::start(&lap, ldir.path(), !args.no_standby_tc)?;
    let srvd = Daemon::start(&srv, sdir.path(), !args.no_standby_tc)?;
    let _logs = KeepLogs(vec![
        (
            lapd.log.clone(),
            vnat_bench::results_path(&format!("{diag}-laptop")).with_extension("log"),
        ),
        (
            srvd.log.clone(),
            vnat_bench::results_path(&format!("{diag}-server")).with_extension("log"),
        ),
    ]);

    let rtt = if delay.is_some() {
        let rtts = delayline::handshake_rtts(&topo, server.ip(), RTT_SAMPLES)?;
        let rtt = Summary::of(&rtts).expect("RTT samples").median;
        ensure!(
            (rtt - args.rtt_ms).abs() <= RTT_TOLERANCE_MS,
            "the delay line should make a {} ms round trip but TCP handshakes through it took {rtt:.2} ms \
             (median of {RTT_SAMPLES}; samples {rtts:.2?}): the machine is too busy for this benchmark or the line is broken",
            args.rtt_ms
        );
        rtt
    } else {
        base_rtt
    };

    let interval_ms = args.interval_ms.max(n as u64 / 10);
    let interval_s = interval_ms.to_string();
    let mut clients = Vec::new();
    for (&k, set) in shares.iter().zip(&port_sets) {
        let conns_s = k.to_string();
        let mut client_args = vec!["client", "--conns", &conns_s, "--interval-ms", &interval_s];
        for s in set {
            client_args.extend(["--connect", s.as_str()]);
        }
        clients.push(Helper::spawn(&lap, &client_args, true)?);
    }
    let mut client = Helpers(clients);
    let setup = Duration::from_secs_f64(30.0 + 0.05 * n as f64);
    client.wait_for(&format!("{n} connections to be established"), setup, |h| {
        h.all(|l| l.connected.is_some())
    })?;
    client.wait_for(&format!("all {n} connections to echo"), setup, |h| {
        h.all(|l| l.echoing)
    })?;
    wait_mobile(&lapd, &srvd, n, server, ports, setup)?;
    let scale = if args.scale {
        Some(scale::measure(&lapd, &srvd, &mut client, n)?)
    } else {
        None
    };
    // What the harness alone takes to carry one message on every
    // connection, then back to the steady ticks.
    let harness_mark = cpu::Mark::now(lapd.pid(), srvd.pid());
    let harness = harness_round(&mut client, n, setup)?;
    let cpu_harness = harness_mark.to(&cpu::Mark::now(lapd.pid(), srvd.pid()));
    // A second of steady traffic: the echo round trip before the move.
    let steady_mark = cpu::Mark::now(lapd.pid(), srvd.pid());
    vnat_bench::sleep_checked(Duration::from_secs(1))?;
    let cpu_steady = steady_mark.to(&cpu::Mark::now(lapd.pid(), srvd.pid()));
    // The first client's view (they all run the same schedule).
    let steady = client.0[0].log().stats.last().cloned();

    // The move.
    client.send("arm")?;
    let t_start = monotonic_ns();
    if args.outage_secs == 0 {
        topo.move_laptop_to_b();
    } else {
        // As move_laptop_to_b, with the outage between leaving A and B.
        let l = &topo.laptop;
        for (a, p) in topo.laptop_a_addr.with_prefixes() {
            l.del_addr(&topo.laptop_if_a, a, p);
        }
        l.link_down(&topo.laptop_if_a);
        vnat_bench::sleep_checked(Duration::from_secs(args.outage_secs))?;
        topo.plug_laptop_b();
        l.default_route(topo.router_b_addr.v4.into(), &topo.laptop_if_b);
        if topo.ipv6 {
            l.default_route(topo.router_b_addr.v6().into(), &topo.laptop_if_b);
        }
    }
    let t0 = monotonic_ns();
    let t0_mark = cpu::Mark::now(lapd.pid(), srvd.pid());
    let t0_drops = backlog::drops();
    client.send(&format!("mark {t0}"))?;
    let real_offset = realtime_ns() as i128 - monotonic_ns() as i128;

    let timeout = timeout_for(args, n);
    let deadline = Instant::now() + timeout;
    loop {
        if client.sum(|l| l.restored.len() + l.conn_errors.len()) >= n {
            break;
        }
        if let Some(e) = client.error() {
            bail!("the client failed after the move: {e}");
        }
        if Instant::now() >= deadline {
            break;
        }
        ensure!(!vnat_bench::interrupted(), "interrupted");
        std::thread::sleep(Duration::from_millis(5));
    }
    let cpu_move = t0_mark.to(&cpu::Mark::now(lapd.pid(), srvd.pid()));
    let backlog_drops_move = t0_drops
        .zip(backlog::drops())
        .map(|(a, b)| b.saturating_sub(a));
    // Every connection echoed after the move and none failed, before or
    // after its echo (a reset then is a connection lost all the same).
    // Still the same connections, carrying bytes: one more echo on each.
    let complete =
        client.sum(|l| l.restored.len()) == n && client.sum(|l| l.conn_errors.len()) == 0;
    let verified = if complete {
        client.send("verify")?;
        let limit = Duration::from_secs_f64(10.0 + 0.01 * n as f64);
        client
            .wait_for("the check after the run", limit, |h| {
                h.all(|l| l.verified.is_some())
            })
            .ok()
            .map(|_| client.sum(|l| l.verified.map_or(0, |v| v.0)))
    } else {
        None
    };
    // With every connection moved, 10 s after the check (the daemons give
    // back a move's room at their next resync): the memory a move leaves.
    let mut scale = scale;
    if let Some(Value::Object(m)) = scale.as_mut() {
        vnat_bench::sleep_checked(Duration::from_secs(10))?;
        m.insert(
            "rss_laptop_after_move_mib".into(),
            scale::rss_mib(lapd.pid()).into(),
        );
        m.insert(
            "rss_server_after_move_mib".into(),
            scale::rss_mib(srvd.pid()).into(),
        );
    }
    let log = client.stop();
    drop(echo_servers);
    // A connection that failed during the check after the run is lost too.
    let complete = complete && log.conn_errors.is_empty();

    // ms from t0, sorted, of each restored connection's echo (`recv`) or
    // of its measured message's write (`sent`).
    let sorted_from_t0 = |at: fn(&Restored) -> u64| {
        let mut v: Vec<f64> = log
            .restored
            .iter()
            .map(|r| ms_signed(at(r) as i128 - t0 as i128))
            .collect();
        v.sort_by(f64::total_cmp);
        v
    };
    let times = sorted_from_t0(|r| r.recv);
    let pick = |q: f64| {
        (!times.is_empty()).then(|| times[((times.len() - 1) as f64 * q).round() as usize])
    };
    let total_s = complete.then(|| times.last().copied().unwrap_or(0.0) / 1000.0);
    // How long after t0 the measured messages were written: the client's
    // own delay (it learns t0 through a pipe), which counts in the figures.
    let written = sorted_from_t0(|r| r.sent);
    let laptop_ip = topo.laptop_a_addr.v4.to_string();
    let phases = Phases::from_logs(
        &lapd.log,
        &srvd.log,
        t_start,
        t0,
        real_offset,
        &log.restored,
        &laptop_ip,
    );
    Ok(RunResult {
        conns: n,
        interval_ms,
        rtt_ms: rtt,
        base_rtt_ms: base_rtt,
        echo_rtt_ms: steady
            .as_ref()
            .and_then(|s| s["echo_rtt_median_ms"].as_f64()),
        tick_late_max_ms: steady.as_ref().and_then(|s| s["tick_late_max_ms"].as_f64()),
        move_ms: ms_signed(t0 as i128 - t_start as i128),
        complete,
        restored: log.restored.len(),
        failed: log.conn_errors.len(),
        conn_errors: log.conn_errors.iter().take(10).cloned().collect(),
        total_s,
        per_conn_ms: total_s.map(|t| t * 1000.0 / n as f64),
        written_ms: (!written.is_empty()).then(|| {
            (
                written[0],
                written[written.len() / 2],
                written[written.len() - 1],
            )
        }),
        first_ms: pick(0.0),
        median_ms: pick(0.5),
        p90_ms: pick(0.9),
        last_ms: pick(1.0),
        verified,
        harness_s: harness.last().map(|ms| ms / 1000.0),
        harness_median_ms: harness.get(harness.len() / 2).copied(),
        vnat_s: total_s.zip(harness.last()).map(|(t, h)| t - h / 1000.0),
        cpu_harness,
        phases,
        scale,
        timeout_s: timeout.as_secs_f64(),
        cpu_steady,
        cpu_move,
        netdev_max_backlog,
        backlog_drops_move,
        delay_line: delay.map_or_else(Vec::new, |d| {
            let delayline::ServerLinkDelay { line, ns: _ns } = d;
            line.stop()
        }),
    })
}

/// The harness's own round: `mark` sent with nothing moving, as the move
/// sends it, and every connection's echo of a message written after it
/// awaited. Returns the ms from the mark to each echo, sorted, and leaves
/// the client writing at its ticks again.
fn harness_round(client: &mut Helpers, n: usize, limit: Duration) -> Result<Vec<f64>> {
    client.send("arm")?;
    let t = monotonic_ns();
    client.send(&format!("mark {t}"))?;
    client.wait_for(
        &format!("one echo on each of the {n} connections without a move"),
        limit,
        |h| h.sum(|l| l.restored.len() + l.conn_errors.len()) >= n,
    )?;
    let errors: Vec<String> = client
        .0
        .iter()
        .flat_map(|h| h.log().conn_errors.clone())
        .collect();
    ensure!(
        errors.is_empty(),
        "{} connections failed before the move (first: {})",
        errors.len(),
        errors[0]
    );
    let mut times: Vec<f64> = client
        .0
        .iter()
        .flat_map(|h| std::mem::take(&mut h.log().restored))
        .map(|r| ms_signed(r.recv as i128 - t as i128))
        .collect();
    times.sort_by(f64::total_cmp);
    client.send("reset")?;
    Ok(times)
}

/// Copies vnatd's logs next to the results when a run ends, whichever way.
struct KeepLogs(Vec<(std::path::PathBuf, std::path::PathBuf)>);

impl Drop for KeepLogs {
    fn drop(&mut self) {
        for (from, to) in &self.0 {
            if let Some(dir) = to.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            let _ = std::fs::copy(from, to);
        }
    }
}

pub fn ms_signed(ns: i128) -> f64 {
    ns as f64 / 1e6
}

/// Waits until both vnatd list all `n` connections to `server` as mobile
/// (VCMP has keys for them): only then can they move.
fn wait_mobile(
    lapd: &Daemon,
    srvd: &Daemon,
    n: usize,
    server: SocketAddr,
    ports: usize,
    limit: Duration,
) -> Result<()> {
    let deadline = Instant::now() + limit;
    let servers: std::collections::HashSet<String> = (0..ports)
        .map(|i| SocketAddr::new(server.ip(), server.port() + i as u16).to_string())
        .collect();
    let mobile = |d: &Daemon, key: &str| -> usize {
        d.ctl(&["ls", "--proto", "tcp"]).map_or(0, |v| {
            v.as_array().map_or(0, |a| {
                a.iter()
                    .filter(|c| {
                        c[key].as_str().is_some_and(|s| servers.contains(s))
                            && c["mobile"] == Value::Bool(true)
                    })
                    .count()
            })
        })
    };
    loop {
        let (l, s) = (
            mobile(lapd, "virtual_remote"),
            mobile(srvd, "virtual_local"),
        );
        if l == n && s == n {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the two vnatd did not list all {n} connections as mobile within {limit:?} (laptop {l}, server {s}; \
             paired: laptop {}, server {})",
            lapd.paired(),
            srvd.paired()
        );
        ensure!(!vnat_bench::interrupted(), "interrupted");
        // A listing of 100,000 connections is work for both vnatd (their
        // datapath thread, which claims wait on too): not four a second.
        std::thread::sleep(Duration::from_millis((n as u64 / 20).max(250)));
    }
}

/// Connections one helper process may hold: its open-file limit, raised
/// as far as this process may (children inherit it), less room for the
/// process's other descriptors.
fn conns_per_process() -> Result<usize> {
    let limit = sys::raise_nofile_limit().context("raising the open-file limit")?;
    let room = usize::try_from(limit)
        .unwrap_or(usize::MAX)
        .saturating_sub(256);
    ensure!(
        room >= 1000,
        "the open-file limit ({limit}) leaves room for too few connections per process"
    );
    Ok(room)
}

/// `n` split into as few near-equal shares of at most `cap` as possible.
fn split(n: usize, cap: usize) -> Vec<usize> {
    let parts = n.div_ceil(cap).max(1);
    (0..parts)
        .map(|i| n / parts + usize::from(i < n % parts))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::split;

    #[test]
    fn shares_are_near_equal_within_the_cap() {
        assert_eq!(split(10, 19_744), vec![10]);
        assert_eq!(split(19_744, 19_744), vec![19_744]);
        let s = split(100_000, 19_744);
        assert_eq!(s.len(), 6);
        assert_eq!(s.iter().sum::<usize>(), 100_000);
        assert!(s.iter().all(|&k| (16_666..=16_667).contains(&k)));
        assert_eq!(split(0, 5), vec![0]);
    }
}
