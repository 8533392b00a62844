//! `cargo xtask bench handover`: how long a live TCP connection is without
//! a path when the laptop's address changes (issue 4, item 10).
//!
//! Hosts as in the demo: laptop, router, server (network namespaces), a real
//! vnatd on the laptop and on the server, a socat echo server in the server's
//! cgroup. The round trip is made 3 ms (`--rtt-ms`) by a userspace delay
//! line spliced into the router-server link (`vnat_bench::delayline`; this
//! kernel has no netem), and checked by timing TCP handshakes through it.
//!
//! A probe client (`handover probe`, run in the laptop's namespace and
//! cgroup) writes a 16-byte probe every millisecond on one TCP connection and
//! timestamps every echo on CLOCK_MONOTONIC. Then the laptop moves:
//!  - no outage: subnet A's address is removed and its link goes down, B's
//!    link comes up with B's address and the default route (the demo's move);
//!  - outage: A goes away, nothing for `--outage-secs` (120 s; 10 s with
//!    `--quick`), then B comes up as above.
//!
//! `t_usable` is when the last command configuring B (the default route)
//! returned. Per run:
//!  - `first_byte_ms`: from `t_usable` to the arrival of the echo of the
//!    first probe *written* at or after `t_usable`. It contains vnatd noticing
//!    the change, VCMP between the daemons, the translations, TCP sending
//!    again (its retransmission timer or vnat's restart of it), delivery of
//!    any data queued before that probe, and that probe's own echo round trip
//!    through the delay line (one RTT plus socat).
//!  - `handover_ms`: `first_byte_ms` minus the measured RTT: when the new
//!    path carried the connection's data.
//!  - target (issue): `handover_ms` at most 1 RTT + 10 ms, i.e. `first_byte_ms`
//!    at most 2 RTT + 10 ms.
//!
//! Also reported: the first echo of any probe after `t_usable`, vnatd's own
//! steps from its logs (move started, translations installed) and the
//! laptop socket's timers at `t_usable` (`ss -tino`), and how many segments
//! the laptop's TCP sent again in the run (none when nothing in flight was
//! lost at the move). vnatd's logs of every
//! run are kept in bench/results/ (`handover-SCENARIO-RUN-{laptop,server}.log`)
//! and `--capture` adds a pcap of the router's view, to see where the time
//! went. A missed target is a result (exit 0); a run that fails ends the
//! benchmark with one sentence.
//!
//! `--movers both` moves the server too, in the same instant: from subnet C
//! to E (its old address gone from the network, see
//! `vnat_tests::OldServerAddress::Gone`), E's link delayed like C's. Neither
//! old location answers, so only the location server can tell either end
//! where the other went: a vnatd on a third host behind the router (no
//! delay on its link, so the laptop reaches it at once and the server
//! across the delay line), given to both with `--location-server`. With an
//! outage, both are without a network for its length. Target (issue 5):
//! `handover_ms` at most 2 RTT plus one round trip to the location server
//! (the server's, the longer: one RTT here).

use std::{
    net::SocketAddr,
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use serde::Serialize;
use serde_json::Value;
use vnat_bench::{
    delayline::{self, monotonic_ns, realtime_ns, DelayLine, DirectionStats},
    env,
    stats::Summary,
};
use vnat_tests::{
    add_location_host, add_server_link_e, move_server_to_e, plug_server_e, unplug_server_c,
    EchoServer, Host, LaptopRouterServer, OldServerAddress, TempDir,
};

// Shared with restore, which uses more of it.
#[allow(dead_code)]
#[path = "handover/daemon.rs"]
mod daemon;
#[path = "handover/flood.rs"]
mod flood;
#[path = "handover/measure.rs"]
mod measure;
#[path = "handover/probe.rs"]
mod probe;
#[path = "handover/report.rs"]
mod report;

use daemon::Daemon;
use measure::measure;
use probe::Probe;

const SERVER_PORT: u16 = 5001;
/// vnatd's VCMP port (its default), where the location server listens.
const VCMP_PORT: u16 = 2031;
/// TCP handshakes timed to measure the round trip.
const RTT_SAMPLES: usize = 20;
/// The self-check: the measured RTT must be this close to `--rtt-ms`.
const RTT_TOLERANCE_MS: f64 = 1.0;
/// The allowance on top of one RTT.
const TARGET_SLACK_MS: f64 = 10.0;
/// How long a run waits for the first echo after the move.
const RESUME_LIMIT: Duration = Duration::from_secs(30);

#[derive(Parser)]
#[command(
    about = "Time from a new address being usable to the first byte on the new path, at 3 ms RTT, \
             with and without a long outage. Writes bench/results/handover.json.",
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
    /// The probe client (run by the benchmark in the laptop's namespace).
    #[command(hide = true)]
    Probe {
        #[arg(long)]
        connect: SocketAddr,
        #[arg(long, default_value_t = 1000)]
        interval_us: u64,
    },
}

#[derive(clap::Args)]
struct Args {
    /// Runs per scenario [default: 5 without outage, 1 with the outage].
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=100))]
    runs: Option<u16>,
    /// Which moves to measure.
    #[arg(long, value_enum, default_value_t = Scenarios::Both)]
    scenario: Scenarios,
    /// Who moves: `one` (the laptop) or `both` (the server as well, found
    /// through a location server); `one,both` measures each in turn.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Movers::One])]
    movers: Vec<Movers>,
    /// With `--movers both`: where the movers find each other, a vnatd as
    /// location server or etcd; `vnatd,etcd` measures each in turn.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [Location::Vnatd])]
    location: Vec<Location>,
    /// Length of the outage, in seconds [default: 120; 10 with --quick].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=3600))]
    outage_secs: Option<u64>,
    /// A short outage (10 s) instead of two minutes.
    #[arg(long)]
    quick: bool,
    /// The round trip the delay line makes (half of it each way), in ms.
    #[arg(long, default_value_t = 3.0)]
    rtt_ms: f64,
    /// Print one JSON object on stdout (the table goes to stderr).
    #[arg(long)]
    json: bool,
    /// Also record every laptop-server and VCMP packet on the router
    /// (tcpdump -i any) to bench/results/handover-SCENARIO-RUN.pcap.
    #[arg(long)]
    capture: bool,
    /// Run both vnatd with `--no-standby-tc`: tc attached only once a
    /// connection moved, so the kernel's attachment (10-25 ms on each
    /// host) falls inside the move. The default keeps it attached ahead.
    #[arg(long)]
    no_standby_tc: bool,
    /// Echo with Nagle's algorithm on (socat's default) instead of
    /// TCP_NODELAY (what interactive servers such as sshd set). With Nagle,
    /// the server holds new echo data behind its segments lost during the
    /// move, so the echo resumes only at its retransmission timeout.
    #[arg(long)]
    nagle_echo: bool,
    /// The laptop behind a NAT on both of its networks (nftables source
    /// NAT on the router, random ports, one public address per network):
    /// it moves from one NAT to another, and the server's datapath learns
    /// the new NAT's port from the connection's first packet. One end
    /// moving only.
    #[arg(long)]
    nat: bool,
    /// The laptop moves from a routed address (network A, no NAT) to
    /// behind a NAT (network B, nftables source NAT with random ports):
    /// the server validates the NAT's address and learns its port from the
    /// connection's TCP BIND. One end moving only.
    #[arg(long, conflicts_with = "nat")]
    into_nat: bool,
    /// The laptop moves to a network where it has only IPv6 (network B
    /// without its IPv4 address); the server has both: its IPv4
    /// connection goes on over IPv6 between the two hosts' IPv6 addresses.
    /// One end moving only.
    #[arg(long, conflicts_with_all = ["nat", "into_nat"])]
    v6_only: bool,
    /// Junk and forged VCMP datagrams at the server's port 2031 from an
    /// off-path host, this many a second, from just before the move until
    /// the run ends (forged UPDs for the connection, PAIR_INITs, random
    /// bytes): the move must still complete, in at most twice its time
    /// without them.
    #[arg(long, default_value_t = 0)]
    flood_pps: u32,
    /// Measure the grid of issue 5 instead: every RTT of --sweep-rtts with
    /// every outage of --sweep-outages (one end moving), --runs runs per
    /// cell [default: 3 without outage, 1 with]; adds `sweep` to the JSON.
    #[arg(long)]
    sweep: bool,
    /// RTTs of the sweep, ms.
    #[arg(long, value_delimiter = ',', default_values_t = [1.0, 3.0, 30.0, 100.0])]
    sweep_rtts: Vec<f64>,
    /// Outages of the sweep, s (0: none).
    #[arg(long, value_delimiter = ',', default_values_t = [0u64, 10, 120])]
    sweep_outages: Vec<u64>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenarios {
    Both,
    NoOutage,
    Outage,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Movers {
    One,
    Both,
}

/// Where both movers find each other (`--location`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum Location {
    /// A vnatd on a host of its own, given with `--location-server`.
    Vnatd,
    /// A three-member etcd cluster on that host (`location_store = "etcd"`).
    Etcd,
}

#[derive(Clone, Copy, Debug)]
enum Scenario {
    NoOutage,
    Outage(Duration),
}

impl Scenario {
    fn key(self) -> &'static str {
        match self {
            Scenario::NoOutage => "no_outage",
            Scenario::Outage(_) => "outage",
        }
    }

    fn label(self) -> String {
        match self {
            Scenario::NoOutage => "no outage".into(),
            Scenario::Outage(d) => format!("{} s outage", d.as_secs()),
        }
    }

    fn outage_s(self) -> u64 {
        match self {
            Scenario::NoOutage => 0,
            Scenario::Outage(d) => d.as_secs(),
        }
    }
}

/// What one series of runs measures: who moves, and how.
#[derive(Clone, Copy, Debug)]
struct Case {
    movers: Movers,
    scenario: Scenario,
    /// The laptop moves from one NAT to another (`--nat`).
    nat: bool,
    /// The laptop moves from a routed address into a NAT (`--into-nat`).
    into_nat: bool,
    /// The laptop moves to a network with only IPv6 (`--v6-only`).
    v6_only: bool,
    /// Where both movers find each other.
    location: Location,
}

impl Case {
    fn key(self) -> String {
        let nat = match (self.nat, self.into_nat, self.v6_only) {
            (true, _, _) => "nat_",
            (_, true, _) => "into_nat_",
            (_, _, true) => "v6_only_",
            _ => "",
        };
        match (self.movers, self.location) {
            (Movers::One, _) => format!("{nat}{}", self.scenario.key()),
            (Movers::Both, Location::Vnatd) => format!("{nat}both_{}", self.scenario.key()),
            (Movers::Both, Location::Etcd) => format!("{nat}both_etcd_{}", self.scenario.key()),
        }
    }

    fn label(self) -> String {
        let nat = match (self.nat, self.into_nat, self.v6_only) {
            (true, _, _) => "behind NAT, ",
            (_, true, _) => "into a NAT, ",
            (_, _, true) => "to IPv6 only, ",
            _ => "",
        };
        match (self.movers, self.location) {
            (Movers::One, _) => format!("{nat}{}", self.scenario.label()),
            (Movers::Both, Location::Vnatd) => format!("{nat}both, {}", self.scenario.label()),
            (Movers::Both, Location::Etcd) => {
                format!("{nat}both via etcd, {}", self.scenario.label())
            }
        }
    }
}

/// How one run is set up.
struct RunSetup<'a> {
    case: Case,
    rtt_ms: f64,
    /// Names the kept logs and capture.
    diag: &'a str,
    capture: bool,
    standby_tc: bool,
    nodelay_echo: bool,
    flood_pps: u32,
}

/// One run's figures (milliseconds unless named otherwise).
#[derive(Clone, Debug, Serialize)]
struct RunResult {
    movers: Movers,
    /// Median TCP handshake time laptop -> server through the delay line.
    rtt_ms: f64,
    /// Both moving: the same to the location server's host, from the end
    /// farther from it (the server, whose link has the delay line).
    location_server_rtt_ms: Option<f64>,
    /// The same with the line's delay at 0 (calibration), and the one-way
    /// delay then set: (target - base) / 2.
    base_rtt_ms: f64,
    one_way_delay_ms: f64,
    /// Median echo round trip of the probes in the second before the move
    /// (the RTT plus socat's echo).
    echo_rtt_ms: f64,
    /// How long the move's own commands took (no outage), or the outage.
    move_ms: f64,
    first_byte_ms: f64,
    handover_ms: f64,
    /// One end: RTT + 10 ms; both: 2 RTT + the location server's RTT.
    target_ms: f64,
    target_met: bool,
    /// The first echo of any probe (possibly one queued before the move).
    first_echo_ms: f64,
    /// How long after `t_usable` the probe behind `first_byte_ms` was
    /// written (it waits while the socket's send buffer is full).
    first_byte_probe_written_ms: f64,
    /// The application's view: last echo before the move to first after it.
    echo_gap_ms: f64,
    /// Probes not written because the send buffer was full.
    probes_skipped: u64,
    /// Segments the laptop's TCP retransmitted in the whole run (its
    /// namespace's TcpRetransSegs): 0 when nothing in flight was lost at
    /// the move, 1 or more when TCP had to send something again (about
    /// one round trip more: see RESULTS.md, the forty-second session).
    laptop_tcp_retransmits: Option<u64>,
    /// vnatd's steps relative to `t_usable`, from its logs: the laptop
    /// starts the move, the server installs its translation, the laptop
    /// installs its own (each log line follows the translation and the
    /// restart of the flow).
    laptop_move_started_ms: Option<f64>,
    /// Both moving: the server's vnatd starts its own move.
    server_move_started_ms: Option<f64>,
    server_translated_ms: Option<f64>,
    laptop_translated_ms: Option<f64>,
    /// The laptop's socket at `t_usable` (`ss -tino`): its retransmission
    /// timer and backoff.
    laptop_socket_at_usable: String,
    delay_line: Vec<DirectionStats>,
    /// `--flood-pps`: datagrams the flood sent during the run, and their
    /// rate; the server's VCMP rejections meanwhile.
    flood_sent: Option<u64>,
    flood_per_sec: Option<f64>,
    server_rejected_during_flood: Option<u64>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Sub::Probe {
        connect,
        interval_us,
    }) = cli.sub
    {
        let code = probe::run(connect, Duration::from_micros(interval_us.max(100)));
        return ExitCode::from(code as u8);
    }
    vnat_bench::catch_interrupts();
    vnat_bench::run_main("handover", || run(&cli.args))
}

fn run(args: &Args) -> Result<()> {
    env::require_root("handover")?;
    env::require_program("socat", "socat")?;
    env::require_program("ethtool", "ethtool")?;
    ensure!(
        args.rtt_ms > 0.0 && args.rtt_ms <= 1000.0,
        "--rtt-ms must be between 0 and 1000, not {}",
        args.rtt_ms
    );
    let outage = Duration::from_secs(
        args.outage_secs
            .unwrap_or(if args.quick { 10 } else { 120 }),
    );
    if args.sweep {
        return sweep(args);
    }
    let mut scenarios = Vec::new();
    if args.scenario != Scenarios::Outage {
        scenarios.push((Scenario::NoOutage, args.runs.unwrap_or(5)));
    }
    if args.scenario != Scenarios::NoOutage {
        scenarios.push((Scenario::Outage(outage), args.runs.unwrap_or(1)));
    }
    let load_before = env::loadavg_1min();
    let mut results: Vec<(Case, Vec<RunResult>)> = Vec::new();
    let cases: Vec<(Case, u16)> = movers(args)
        .flat_map(|m| {
            // Where they meet matters only when both move.
            let locations = match m {
                Movers::One => vec![Location::Vnatd],
                Movers::Both => args.location.clone(),
            };
            let scenarios = &scenarios;
            locations.into_iter().flat_map(move |location| {
                scenarios.iter().map(move |(scenario, runs)| {
                    (
                        Case {
                            movers: m,
                            scenario: *scenario,
                            nat: args.nat,
                            into_nat: args.into_nat,
                            v6_only: args.v6_only,
                            location,
                        },
                        *runs,
                    )
                })
            })
        })
        .collect();
    for (case, runs) in cases {
        let mut done = Vec::new();
        for i in 0..runs {
            eprintln!("{}: run {}/{runs} ...", case.label(), i + 1);
            let diag = format!("handover-{}-{}", case.key(), i + 1);
            let r = measure(&RunSetup {
                case,
                rtt_ms: args.rtt_ms,
                diag: &diag,
                capture: args.capture,
                standby_tc: !args.no_standby_tc,
                nodelay_echo: !args.nagle_echo,
                flood_pps: args.flood_pps,
            })
            .with_context(|| format!("{}, run {}", case.label(), i + 1))?;
            eprintln!(
                "  rtt {:.2} ms, first byte {:.1} ms, handover {:.1} ms (vnatd: move started {}, server translated {}, laptop translated {}; laptop TCP retransmitted {})",
                r.rtt_ms,
                r.first_byte_ms,
                r.handover_ms,
                opt_ms(r.laptop_move_started_ms),
                opt_ms(r.server_translated_ms),
                opt_ms(r.laptop_translated_ms),
                r.laptop_tcp_retransmits
                    .map_or_else(|| "?".to_string(), |n| format!("{n} segment(s)")),
            );
            if let (Some(n), Some(pps)) = (r.flood_sent, r.flood_per_sec) {
                eprintln!(
                    "  flood: {n} datagrams at {pps:.0}/s; the server rejected {} meanwhile",
                    r.server_rejected_during_flood.unwrap_or(0)
                );
            }
            done.push(r);
        }
        results.push((case, done));
    }
    let load_after = env::loadavg_1min();

    let summary = report::report(args, &results, load_before, load_after);
    let table = report::table(args, &results);
    if args.json {
        eprint!("{table}");
        println!("{summary}");
    } else {
        print!("{table}");
    }
    vnat_bench::write_json(&vnat_bench::results_path("handover"), &summary)?;
    Ok(())
}

/// `--movers` without repeats, in the order given.
fn movers(args: &Args) -> impl Iterator<Item = Movers> + '_ {
    let mut seen = Vec::new();
    args.movers.iter().copied().filter(move |m| {
        let new = !seen.contains(m);
        seen.push(*m);
        new
    })
}

/// The grid: every RTT with every outage, for each of `--movers`.
fn sweep(args: &Args) -> Result<()> {
    ensure!(
        args.sweep_rtts.iter().all(|r| *r > 0.0 && *r <= 1000.0),
        "--sweep-rtts must be between 0 and 1000 ms"
    );
    let load_before = env::loadavg_1min();
    let mut rows = Vec::new();
    let grid: Vec<(Movers, Location, f64, u64)> = movers(args)
        .flat_map(|m| {
            let locations = match m {
                Movers::One => vec![Location::Vnatd],
                Movers::Both => args.location.clone(),
            };
            locations.into_iter().flat_map(move |l| {
                args.sweep_rtts
                    .iter()
                    .flat_map(move |&rtt| args.sweep_outages.iter().map(move |&o| (m, l, rtt, o)))
            })
        })
        .collect();
    for (movers, location, rtt, outage_s) in grid {
        let scenario = if outage_s == 0 {
            Scenario::NoOutage
        } else {
            Scenario::Outage(Duration::from_secs(outage_s))
        };
        let case = Case {
            movers,
            scenario,
            nat: args.nat,
            into_nat: args.into_nat,
            v6_only: args.v6_only,
            location,
        };
        let runs = args.runs.unwrap_or(if outage_s == 0 { 3 } else { 1 });
        let mut done = Vec::new();
        for i in 0..runs {
            eprintln!("rtt {rtt} ms, {}: run {}/{runs} ...", case.label(), i + 1);
            // The outage's length is in the name: the 10 s and the
            // 120 s runs of one RTT would otherwise share their logs.
            let diag = format!(
                "handover-sweep-rtt{rtt}-{}{}-{}",
                case.key(),
                if outage_s == 0 {
                    String::new()
                } else {
                    format!("{outage_s}s")
                },
                i + 1
            );
            let r = measure(&RunSetup {
                case,
                rtt_ms: rtt,
                diag: &diag,
                capture: args.capture,
                standby_tc: !args.no_standby_tc,
                nodelay_echo: !args.nagle_echo,
                flood_pps: args.flood_pps,
            })
            .with_context(|| format!("rtt {rtt} ms, {}, run {}", case.label(), i + 1))?;
            eprintln!(
                "  rtt {:.2} ms, first byte {:.1} ms, handover {:.1} ms",
                r.rtt_ms, r.first_byte_ms, r.handover_ms
            );
            done.push(r);
        }
        rows.push(report::sweep_row(rtt, case, &done));
        // What is known so far is on disk if a later cell fails.
        vnat_bench::write_json(
            &vnat_bench::results_path("handover"),
            &report::sweep_report(args, &rows, load_before),
        )?;
    }
    let summary = report::sweep_report(args, &rows, load_before);
    let table = report::sweep_table(&rows);
    if args.json {
        eprint!("{table}");
        println!("{summary}");
    } else {
        print!("{table}");
    }
    vnat_bench::write_json(&vnat_bench::results_path("handover"), &summary)?;
    Ok(())
}

fn opt_ms(v: Option<f64>) -> String {
    v.map_or_else(|| "?".into(), |v| format!("{v:.1} ms"))
}
