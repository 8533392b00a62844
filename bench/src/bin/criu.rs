//! `cargo xtask bench criu`: how long a process migrated with CRIU and
//! vnat is frozen, as its TCP peer sees it, over repeated migrations.
//!
//! Each run is `vnat_tests::move_echo_server_with_criu` on fresh hosts: a
//! socat echo server with a live client stream (200 kB/s) is dumped by CRIU
//! on one server and restored on another with a different address, with
//! `vnatctl criu-hook` as the action script on both sides (the images go
//! through a local directory: no transfer time is included). Per run: the
//! freeze (the client's longest wait for an echo, from the last byte
//! before the dump's network lock to the first after the restore), the
//! dump's and the restore's wall times, and the client's retransmission
//! timeouts and retransmitted segments during it.
//!
//! Reference: PodMotion (2026, CRIU + eBPF) reports a median freeze of
//! 312 ms and a p99 of 487 ms. Nothing here asserts on timing.

use std::process::ExitCode;

use anyhow::ensure;
use clap::Parser;
use serde_json::json;
use vnat_bench::{env, stats::Summary};
use vnat_tests::{become_child_subreaper, move_echo_server_with_criu, Criu};

#[derive(Parser)]
#[command(
    about = "Freeze of a process migrated with CRIU and vnat, as its TCP peer sees it.",
    after_help = "Example: cargo xtask bench criu -- --runs 30"
)]
struct Args {
    /// Migrations to measure (each on fresh hosts).
    #[arg(long, default_value_t = 20)]
    runs: u32,
    /// Print one JSON object (the table goes to stderr).
    #[arg(long)]
    json: bool,
}

const PODMOTION_MEDIAN_MS: f64 = 312.0;
const PODMOTION_P99_MS: f64 = 487.0;

/// Nearest-rank percentile (`p` in 0..=100) of the samples.
fn percentile(samples: &[f64], p: f64) -> f64 {
    let mut s = samples.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

fn main() -> ExitCode {
    vnat_bench::run_main("criu", || {
        let args = Args::parse();
        env::require_root("criu")?;
        ensure!(args.runs > 0, "--runs must be at least 1");
        let criu = Criu::find().map_err(|why| anyhow::anyhow!("{why}"))?;
        // vnatd's info lines would bury the table; warnings still show.
        if std::env::var_os("RUST_LOG").is_none() {
            std::env::set_var("RUST_LOG", "warn");
        }
        become_child_subreaper();
        vnat_bench::catch_interrupts();
        let load_before = env::loadavg_1min();
        let (mut freeze, mut dump, mut restore, mut rtos, mut retrans) =
            (vec![], vec![], vec![], vec![], vec![]);
        for i in 0..args.runs {
            ensure!(!vnat_bench::interrupted(), "interrupted");
            let m = move_echo_server_with_criu(&criu, "bcriu");
            ensure!(
                m.stream_error.is_none() && m.socket_after == m.socket_before,
                "run {i}: the client's connection did not survive: {:?}",
                m.stream_error
            );
            eprintln!(
                "run {:>3}: freeze {:>4} ms  dump {:>4.0} ms  restore {:>4.0} ms  client RTOs {}  retransmitted {}",
                i + 1,
                m.max_gap_ms,
                m.dump.as_secs_f64() * 1e3,
                m.restore.as_secs_f64() * 1e3,
                m.client_rtos,
                m.client_retransmitted
            );
            freeze.push(m.max_gap_ms as f64);
            dump.push(m.dump.as_secs_f64() * 1e3);
            restore.push(m.restore.as_secs_f64() * 1e3);
            rtos.push(m.client_rtos as f64);
            retrans.push(m.client_retransmitted as f64);
        }
        let row = |name: &str, v: &[f64]| {
            let s = Summary::of(v).expect("at least one run");
            format!(
                "{name:<26} {:>8.0} {:>8.0} {:>8.0} {:>8.0}\n",
                s.median,
                percentile(v, 99.0),
                s.min,
                s.max
            )
        };
        let mut table = format!(
            "CRIU {} migration of a socat echo server with a live client, {} runs (ms unless counted)\n\
             {:<26} {:>8} {:>8} {:>8} {:>8}\n",
            criu.version, args.runs, "", "median", "p99", "min", "max"
        );
        table.push_str(&row("freeze (client's view)", &freeze));
        table.push_str(&row("criu dump (with export)", &dump));
        table.push_str(&row("criu restore (with import)", &restore));
        table.push_str(&row("client RTOs (count)", &rtos));
        table.push_str(&row("client retransmitted segs", &retrans));
        table.push_str(&format!(
            "PodMotion (2026) reports a {PODMOTION_MEDIAN_MS:.0} ms median and {PODMOTION_P99_MS:.0} ms p99 freeze\n"
        ));
        let report = json!({
            "benchmark": "criu",
            "criu": criu.version,
            "runs": args.runs,
            "freeze_ms": Summary::of(&freeze),
            "freeze_p99_ms": percentile(&freeze, 99.0),
            "dump_ms": Summary::of(&dump),
            "restore_ms": Summary::of(&restore),
            "client_rtos": Summary::of(&rtos),
            "client_retransmitted": Summary::of(&retrans),
            "reference": {"podmotion_median_ms": PODMOTION_MEDIAN_MS, "podmotion_p99_ms": PODMOTION_P99_MS},
            "machine": env::machine(load_before),
        });
        vnat_bench::emit("criu", args.json, &table, &report)
    })
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 99.0), 3.0);
        assert_eq!(percentile(&[7.0], 0.0), 7.0);
    }
}
