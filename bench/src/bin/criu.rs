//! `cargo xtask bench criu`: how long a process migrated with CRIU and
//! vnat is frozen, as its peer sees it, over repeated migrations.
//!
//! Each run is `vnat_tests::move_echo_server_with_criu_opts` on fresh
//! hosts: a socat echo server with a live client stream (200 kB/s) is
//! dumped by CRIU on one server and restored on another with a different
//! address, with `vnatctl criu-hook` as the action script on both sides.
//! Between the dump and the restore the images (the hook's export inside)
//! go from the first server to the second over the network, tar through
//! one TCP connection between the two hosts as scp would carry them, so
//! the freeze includes their transfer (`--local-images`: the restore reads
//! the dump's directory instead). Each case is run `--runs` times: TCP and
//! UDP, over IPv4 and IPv6 (`--case` picks some).
//!
//! Per run: the freeze (the client's longest wait for an echo, from the
//! last echo before the dump to the first after the restore), the dump's,
//! the transfer's and the restore's wall times, the images' size, and for
//! TCP the client's retransmission timeouts and retransmitted segments.
//! Reported per case: p50 and p99 (nearest rank), min and max.
//!
//! Reference: PodMotion (2026, CRIU + eBPF) reports a median freeze of
//! 312 ms and a p99 of 487 ms. Nothing here asserts on timing.

use std::process::ExitCode;

use anyhow::{bail, ensure};
use clap::Parser;
use serde_json::json;
use vnat_bench::{env, stats::Summary};
use vnat_tests::{become_child_subreaper, move_echo_server_with_criu_opts, Criu, CriuMoveOptions};

#[derive(Parser)]
#[command(
    about = "Freeze of a process migrated with CRIU and vnat, as its peer sees it, with the images sent over the network.",
    after_help = "Example: cargo xtask bench criu -- --runs 50 --case tcp4,udp6"
)]
struct Args {
    /// Migrations to measure per case (each on fresh hosts).
    #[arg(long, default_value_t = 50)]
    runs: u32,
    /// Cases to run, comma-separated: tcp4, tcp6, udp4, udp6.
    #[arg(long, value_delimiter = ',', default_value = "tcp4,tcp6,udp4,udp6")]
    case: Vec<String>,
    /// Restore from the dump's directory instead of carrying the images
    /// over the network (the freeze then leaves their transfer out).
    #[arg(long)]
    local_images: bool,
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

/// (udp, ipv6) of a case's name.
fn parse_case(name: &str) -> anyhow::Result<(bool, bool)> {
    Ok(match name {
        "tcp4" => (false, false),
        "tcp6" => (false, true),
        "udp4" => (true, false),
        "udp6" => (true, true),
        other => bail!("unknown case `{other}`: the cases are tcp4, tcp6, udp4 and udp6"),
    })
}

/// One case's samples, in ms (counts for the TCP figures).
#[derive(Default)]
struct Samples {
    freeze: Vec<f64>,
    dump: Vec<f64>,
    transfer: Vec<f64>,
    restore: Vec<f64>,
    image_kib: Vec<f64>,
    rtos: Vec<f64>,
    retrans: Vec<f64>,
    /// Why each failed run failed.
    failed: Vec<String>,
}

fn main() -> ExitCode {
    vnat_bench::run_main("criu", || {
        let args = Args::parse();
        env::require_root("criu")?;
        ensure!(args.runs > 0, "--runs must be at least 1");
        let cases: Vec<(String, bool, bool)> = args
            .case
            .iter()
            .map(|c| parse_case(c).map(|(u, v6)| (c.clone(), u, v6)))
            .collect::<anyhow::Result<_>>()?;
        let criu = Criu::find().map_err(|why| anyhow::anyhow!("{why}"))?;
        // vnatd's info lines would bury the table; warnings still show.
        if std::env::var_os("RUST_LOG").is_none() {
            std::env::set_var("RUST_LOG", "warn");
        }
        become_child_subreaper();
        vnat_bench::catch_interrupts();
        let load_before = env::loadavg_1min();
        let mut results = Vec::new();
        for (name, udp, ipv6) in &cases {
            let opts = CriuMoveOptions {
                ipv6: *ipv6,
                udp: *udp,
                transfer: !args.local_images,
                // The lock's removal comes after the freeze; the scenario
                // removes it itself rather than waiting for it.
                unlock_after_secs: 0,
            };
            let mut s = Samples::default();
            for i in 0..args.runs {
                ensure!(!vnat_bench::interrupted(), "interrupted");
                // A run that fails (a step that panics: CRIU, a daemon that
                // does not answer under load; or a connection that did not
                // survive) is counted and reported, not hidden: the other
                // runs go on.
                let run = std::panic::catch_unwind(|| {
                    move_echo_server_with_criu_opts(&criu, "bcriu", opts)
                });
                let m = match run {
                    Ok(m) if m.stream_error.is_none() && m.socket_after == m.socket_before => m,
                    Ok(m) => {
                        let why = format!(
                            "the client's connection did not survive: {:?}",
                            m.stream_error
                        );
                        eprintln!("{name} run {:>3}: FAILED: {why}", i + 1);
                        s.failed.push(why);
                        continue;
                    }
                    Err(panic) => {
                        let why = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "a step failed".into());
                        let why = why.lines().next().unwrap_or("").to_string();
                        eprintln!("{name} run {:>3}: FAILED: {why}", i + 1);
                        s.failed.push(why);
                        continue;
                    }
                };
                eprintln!(
                    "{name} run {:>3}: freeze {:>4} ms  dump {:>4.0} ms  transfer {:>4.0} ms ({} KiB)  restore {:>4.0} ms  client RTOs {}  retransmitted {}",
                    i + 1,
                    m.max_gap_ms,
                    m.dump.as_secs_f64() * 1e3,
                    m.transfer.as_secs_f64() * 1e3,
                    m.image_bytes / 1024,
                    m.restore.as_secs_f64() * 1e3,
                    m.client_rtos,
                    m.client_retransmitted
                );
                s.freeze.push(m.max_gap_ms as f64);
                s.dump.push(m.dump.as_secs_f64() * 1e3);
                s.transfer.push(m.transfer.as_secs_f64() * 1e3);
                s.restore.push(m.restore.as_secs_f64() * 1e3);
                s.image_kib.push(m.image_bytes as f64 / 1024.0);
                s.rtos.push(m.client_rtos as f64);
                s.retrans.push(m.client_retransmitted as f64);
            }
            results.push((name.clone(), s));
        }
        let row = |name: &str, v: &[f64]| {
            format!(
                "  {name:<26} {:>8.0} {:>8.0} {:>8.0} {:>8.0}\n",
                percentile(v, 50.0),
                percentile(v, 99.0),
                v.iter().copied().fold(f64::INFINITY, f64::min),
                v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
            )
        };
        let mut table = format!(
            "CRIU {} migration of a socat echo server with a live client, {} runs per case, images {} (ms unless counted)\n",
            criu.version,
            args.runs,
            if args.local_images { "in a local directory" } else { "sent over the network inside the freeze" }
        );
        let mut json_cases = Vec::new();
        for (name, s) in &results {
            if s.freeze.is_empty() {
                table.push_str(&format!("{name}: every run failed ({})\n", s.failed.len()));
                json_cases.push(json!({"case": name, "failed": s.failed}));
                continue;
            }
            if !s.failed.is_empty() {
                table.push_str(&format!(
                    "{name}: {} of {} runs failed (first: {})\n",
                    s.failed.len(),
                    args.runs,
                    s.failed[0]
                ));
            }
            table.push_str(&format!(
                "{name:<28} {:>8} {:>8} {:>8} {:>8}\n",
                "p50", "p99", "min", "max"
            ));
            table.push_str(&row("freeze (client's view)", &s.freeze));
            table.push_str(&row("criu dump (with export)", &s.dump));
            table.push_str(&row("images over the network", &s.transfer));
            table.push_str(&row("criu restore (with import)", &s.restore));
            table.push_str(&row("images (KiB)", &s.image_kib));
            if name.starts_with("tcp") {
                table.push_str(&row("client RTOs (count)", &s.rtos));
                table.push_str(&row("client retransmitted segs", &s.retrans));
            }
            json_cases.push(json!({
                "case": name,
                "freeze_ms": Summary::of(&s.freeze),
                "freeze_p50_ms": percentile(&s.freeze, 50.0),
                "freeze_p99_ms": percentile(&s.freeze, 99.0),
                "dump_ms": Summary::of(&s.dump),
                "transfer_ms": Summary::of(&s.transfer),
                "restore_ms": Summary::of(&s.restore),
                "image_kib": Summary::of(&s.image_kib),
                "client_rtos": Summary::of(&s.rtos),
                "client_retransmitted": Summary::of(&s.retrans),
                "failed": s.failed,
            }));
        }
        table.push_str(&format!(
            "PodMotion (2026) reports a {PODMOTION_MEDIAN_MS:.0} ms median and {PODMOTION_P99_MS:.0} ms p99 freeze\n"
        ));
        let report = json!({
            "benchmark": "criu",
            "criu": criu.version,
            "runs": args.runs,
            "images_over_network": !args.local_images,
            "cases": json_cases,
            "reference": {"podmotion_median_ms": PODMOTION_MEDIAN_MS, "podmotion_p99_ms": PODMOTION_P99_MS},
            "machine": env::machine(load_before),
        });
        vnat_bench::emit("criu", args.json, &table, &report)
    })
}

#[cfg(test)]
mod tests {
    use super::{parse_case, percentile};

    #[test]
    fn cases_name_the_protocol_and_the_family() {
        assert_eq!(parse_case("udp6").unwrap(), (true, true));
        assert_eq!(parse_case("tcp4").unwrap(), (false, false));
        assert!(parse_case("sctp4").is_err());
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 99.0), 3.0);
        assert_eq!(percentile(&[7.0], 0.0), 7.0);
    }
}
