//! VCMP micro-benchmark (issue 3, item 8): restore N connections (default
//! 10,000) between two hosts whose protocol cores talk directly (no
//! sockets), and report the local work per record, the cost of verifying
//! one full batched datagram, the records per datagram, the round trips,
//! and the protocol core's resident memory per paired connection.
//!
//! Run: `cargo run --release -p vnat-bench --bin vcmp -- [--connections N] [--json]`
//! (wired as `cargo xtask bench vcmp`). The targets (constant round
//! trips, <= 5 us per record, <= 50 us per batched datagram) are printed next
//! to the figures; nothing here asserts on timing.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use vnat_daemon::datapath::{Proto, VirtualFlow};
use vnat_daemon::vcmp::crypto::{DrbgRng, HostIdentity};
use vnat_daemon::vcmp::stats::Counter;
use vnat_daemon::vcmp::wire::{self, Family, Kind};
use vnat_daemon::vcmp::{Binding, Config, Endpoint, Event, Timestamp};

#[derive(Parser)]
#[command(about = "VCMP protocol-core micro-benchmark")]
struct Args {
    /// Connections restored to one peer.
    #[arg(long, default_value_t = 10_000)]
    connections: u32,
    /// Repetitions of the single-datagram verification.
    #[arg(long, default_value_t = 20_000)]
    iterations: u32,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

const A_VCMP: &str = "10.0.0.1:2031";
const A_NEW_VCMP: &str = "10.1.0.1:2031";
const B_VCMP: &str = "10.0.0.2:2031";

fn sa(s: &str) -> Result<SocketAddr> {
    s.parse().with_context(|| format!("bad address {s}"))
}

/// Local (CPU) time spent inside the protocol cores.
#[derive(Default)]
struct Clock {
    spent: Duration,
}

impl Clock {
    fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.spent += t.elapsed();
        out
    }
}

/// CPU time of this thread in nanoseconds (first field of
/// /proc/thread-self/schedstat), so that the figures hold on a loaded host
/// where wall-clock time also counts other processes' turns.
fn thread_cpu_ns() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    s.split_whitespace().next()?.parse().ok()
}

/// This process's resident memory (VmRSS), bytes.
fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

fn cpu_us_since(start: Option<u64>) -> Option<f64> {
    Some((thread_cpu_ns()?.checked_sub(start?)?) as f64 / 1e3)
}

fn drain(ep: &mut Endpoint, now: Timestamp, clock: &mut Clock) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    while let Some(t) = clock.time(|| ep.poll_transmit(now)) {
        out.push(t.payload);
    }
    out
}

fn main() -> Result<()> {
    let args = Args::parse();
    let n = args.connections;
    if n == 0 || n > 60_000 {
        bail!("--connections must be between 1 and 60000 (one port each)");
    }
    let mut rng = DrbgRng::from_seed(2031);
    let rss_before = rss_bytes();
    let mut a = Endpoint::new(Config::default(), HostIdentity::generate(&mut rng));
    let mut b = Endpoint::new(Config::default(), HostIdentity::generate(&mut rng));
    let mut now = Timestamp(1_000_000_000);
    let server = sa("10.0.0.2:22")?;
    let flows: Vec<VirtualFlow> = (0..n)
        .map(|i| {
            Ok(VirtualFlow {
                proto: Proto::Tcp,
                local: sa(&format!("10.0.0.1:{}", 1024 + i))?,
                remote: server,
            })
        })
        .collect::<Result<_>>()?;
    for (i, f) in flows.iter().enumerate() {
        let g = VirtualFlow {
            proto: f.proto,
            local: f.remote,
            remote: f.local,
        };
        // The sequence numbers the kernel would record, crosswise.
        let (x, y) = (i as u32, !(i as u32));
        a.connection_added(now, &mut rng, *f, f.local, f.remote, Binding::tcp(x, y))?;
        b.connection_added(now, &mut rng, g, g.local, g.remote, Binding::tcp(y, x))?;
    }
    // Pair the hosts (not part of the measurement).
    let mut setup = Clock::default();
    for _ in 0..8 {
        for d in drain(&mut a, now, &mut setup) {
            b.handle_datagram(now, &mut rng, sa(A_VCMP)?, &d);
        }
        for d in drain(&mut b, now, &mut setup) {
            a.handle_datagram(now, &mut rng, sa(B_VCMP)?, &d);
        }
    }
    for f in &flows {
        if !a.connection(f).is_some_and(|v| v.has_keys) {
            bail!("pairing did not give {f:?} keys");
        }
    }
    while a.poll_event().is_some() {}
    while b.poll_event().is_some() {}
    // What the two cores hold per paired connection (the flows list and
    // the allocator's slack included: an upper bound).
    let core_bytes_per_connection = rss_before
        .zip(rss_bytes())
        .map(|(b0, b1)| b1.saturating_sub(b0) / (2 * u64::from(n)));

    // Restore: A moved to 10.1.0.1. Count flights until both sides are done.
    let moves: Vec<_> = flows
        .iter()
        .map(|f| Ok((*f, sa(&format!("10.1.0.1:{}", f.local.port()))?)))
        .collect::<Result<_>>()?;
    let mut sender = Clock::default();
    let mut receiver = Clock::default();
    now = now.plus(Duration::from_millis(10));
    let cpu_start = thread_cpu_ns();
    sender.time(|| a.resume(now, &mut rng, &moves))?;
    let mut to_b = drain(&mut a, now, &mut sender);
    let upd_datagrams: Vec<Vec<u8>> = to_b
        .iter()
        .filter(|d| d[1] == Kind::Upd as u8)
        .cloned()
        .collect();
    let upd_records: usize = upd_datagrams.iter().map(|d| usize::from(d[3])).sum();
    let total_datagrams_first = to_b.len();
    let mut resumed = HashSet::new();
    let mut bound = HashSet::new();
    let (a_new, b_addr) = (sa(A_NEW_VCMP)?, sa(B_VCMP)?);
    let mut half_flights = 0u32;
    let mut datagrams = 0usize;
    let mut bytes = 0usize;
    while !to_b.is_empty() && half_flights < 20 {
        half_flights += 1;
        datagrams += to_b.len();
        bytes += to_b.iter().map(Vec::len).sum::<usize>();
        for d in &to_b {
            receiver.time(|| b.handle_datagram(now, &mut rng, a_new, d));
        }
        while let Some(e) = b.poll_event() {
            if let Event::SetRemote { flow, .. } = e {
                bound.insert(flow);
            }
        }
        let to_a = drain(&mut b, now, &mut receiver);
        if bound.len() == flows.len() && resumed.len() == flows.len() {
            break;
        }
        if to_a.is_empty() {
            break;
        }
        half_flights += 1;
        datagrams += to_a.len();
        bytes += to_a.iter().map(Vec::len).sum::<usize>();
        for d in &to_a {
            sender.time(|| a.handle_datagram(now, &mut rng, b_addr, d));
        }
        while let Some(e) = a.poll_event() {
            if let Event::Resumed { flow, .. } = e {
                resumed.insert(flow);
            }
        }
        to_b = drain(&mut a, now, &mut sender);
        if bound.len() == flows.len() && resumed.len() == flows.len() {
            break;
        }
    }
    // Includes the benchmark's own bookkeeping (copies, sets): an upper bound.
    let restore_cpu_us = cpu_us_since(cpu_start);
    if resumed.len() != flows.len() || bound.len() != flows.len() {
        bail!(
            "restoration incomplete: {} resumed on A, {} rebound on B of {}",
            resumed.len(),
            bound.len(),
            flows.len()
        );
    }

    // Verifying one full batched datagram: a UPD datagram delivered again is
    // decoded and every record's MAC verified before the replay window
    // refuses it, so its cost is the verification alone.
    let full = upd_datagrams
        .iter()
        .max_by_key(|d| d[3])
        .context("no UPD datagram")?;
    let per_datagram = usize::from(full[3]);
    let from = sa(A_NEW_VCMP)?;
    let t = Instant::now();
    let cpu = thread_cpu_ns();
    for _ in 0..args.iterations {
        b.handle_datagram(now, &mut rng, from, full);
    }
    let iters = f64::from(args.iterations);
    let verify_cpu_us = cpu_us_since(cpu).map(|c| c / iters);
    let verify_us = t.elapsed().as_secs_f64() * 1e6 / iters;
    while b.poll_transmit(now).is_some() {}

    // Records signed during the restoration, by both hosts (each one was
    // also verified by the other host).
    let records_sent = a.stats().get(Counter::RecordsSent) + b.stats().get(Counter::RecordsSent);
    let n_f = f64::from(n);
    let local_us_per_record =
        (sender.spent + receiver.spent).as_secs_f64() * 1e6 / records_sent as f64;
    let cpu_us_per_record = restore_cpu_us.map(|c| c / records_sent as f64);
    let show = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.2}"));
    let local_us = (sender.spent + receiver.spent).as_secs_f64() * 1e6 / n_f;
    let sender_us = sender.spent.as_secs_f64() * 1e6 / n_f;
    let receiver_us = receiver.spent.as_secs_f64() * 1e6 / n_f;
    let round_trips = f64::from(half_flights) / 2.0;
    let capacity = wire::records_per_datagram(1500, Family::V4, Kind::Upd);

    let j = serde_json::json!({
        "benchmark": "vcmp",
        "connections": n,
        "round_trips": round_trips,
        "datagrams": datagrams,
        "bytes": bytes,
        "first_flight_datagrams": total_datagrams_first,
        "upd_records": upd_records,
        "records_per_datagram": per_datagram,
        "records_per_datagram_capacity": capacity,
        "records": records_sent,
        "cpu_us_per_record": cpu_us_per_record,
        "verify_full_datagram_cpu_us": verify_cpu_us,
        "local_us_per_record": local_us_per_record,
        "local_us_per_connection": local_us,
        "sender_us_per_connection": sender_us,
        "receiver_us_per_connection": receiver_us,
        "verify_full_datagram_us": verify_us,
        "verify_us_per_record": verify_us / per_datagram as f64,
        "core_bytes_per_connection": core_bytes_per_connection,
        "targets": {"local_us_per_record": 5.0, "verify_full_datagram_us": 50.0},
    });
    vnat_bench::write_json(&vnat_bench::results_path("vcmp"), &j)?;
    if args.json {
        println!("{j}");
    } else {
        println!("VCMP micro-benchmark: restore {n} connections to one peer (IPv4, MTU 1500)");
        let row = |name: &str, value: String, target: &str| {
            println!("{name:<46} {value:>12} {target:>10}")
        };
        row("figure", "value".into(), "target");
        row(
            "round trips (A->B->A = 1)",
            format!("{round_trips:.1}"),
            "constant",
        );
        row("datagrams exchanged", datagrams.to_string(), "");
        row("bytes exchanged", bytes.to_string(), "");
        row("UPD records per datagram", per_datagram.to_string(), "");
        row(
            "records signed (each verified by the peer)",
            records_sent.to_string(),
            "",
        );
        row(
            "local CPU time per record, both hosts (us)",
            show(cpu_us_per_record),
            "<= 5",
        );
        row(
            "local wall time per record, both hosts (us)",
            format!("{local_us_per_record:.2}"),
            "<= 5",
        );
        row(
            "local wall time per connection (us)",
            format!("{local_us:.2}"),
            "",
        );
        row(
            "  mover: encode, MAC, handle replies (us)",
            format!("{sender_us:.2}"),
            "",
        );
        row(
            "  peer: verify, apply, answer (us)",
            format!("{receiver_us:.2}"),
            "",
        );
        row(
            "verify one full UPD datagram, CPU (us)",
            show(verify_cpu_us),
            "<= 50",
        );
        row(
            "verify one full UPD datagram, wall (us)",
            format!("{verify_us:.1}"),
            "<= 50",
        );
        row(
            "  per record, wall (us)",
            format!("{:.2}", verify_us / per_datagram as f64),
            "",
        );
        row(
            "protocol core's memory per paired connection (B)",
            core_bytes_per_connection.map_or("n/a".into(), |b| b.to_string()),
            "",
        );
        println!("(per connection: LOOKUP, STORE, UPD from the mover; UPD_R and a LOOKUP_R record from the peer; one CHALLENGE/RESPONSE per batch)");
    }
    Ok(())
}
