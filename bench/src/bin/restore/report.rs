//! The restoration benchmark's outputs: a line per run, the tables (ours
//! beside the paper's Table 1, and where the time went) and the JSON of
//! bench/results/restore.json.

use std::fmt::Write;

use serde_json::{json, Value};
use vnat_bench::{env, stats::Summary};

use super::{phases::Phases, Args, RunResult, PAPER};

fn paper(n: usize) -> Option<(f64, f64, f64)> {
    PAPER.iter().find(|p| p.0 == n).map(|p| (p.1, p.2, p.3))
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.digits$}"))
}

pub fn run_line(r: &RunResult) -> String {
    let p = &r.phases;
    let status = if r.complete {
        format!(
            "total {:.3} s ({:.2} ms per connection)",
            r.total_s.unwrap_or(0.0),
            r.per_conn_ms.unwrap_or(0.0)
        )
    } else if r.restored == r.conns {
        format!(
            "INCOMPLETE: every connection echoed, then {} failed",
            r.failed
        )
    } else {
        format!(
            "INCOMPLETE: {} of {} restored within {:.0} s ({} failed)",
            r.restored, r.conns, r.timeout_s, r.failed
        )
    };
    let aborted = if p.aborted > 0 {
        format!("; {} migrations ABORTED by VCMP", p.aborted)
    } else {
        String::new()
    };
    let harness = match (r.harness_s, r.vnat_s) {
        (Some(h), Some(v)) => format!(
            "; the harness alone {:.1} ms, vnat's share {:.1} ms",
            h * 1e3,
            v * 1e3
        ),
        (Some(h), None) => format!("; the harness alone {:.1} ms", h * 1e3),
        _ => String::new(),
    };
    format!(
        "rtt {:.2} ms; {status}{harness}{aborted}; first/median/last connection {}/{}/{} ms (messages written {}); \
         vnatd: first resume {} ms, laptop installs {}..{} ms, server installs {}..{} ms; verified {}; \
         CPU before the move {}; during it {}; kernel backlog {} packets per CPU, {} dropped during the move",
        r.rtt_ms,
        opt(r.first_ms, 1),
        opt(r.median_ms, 1),
        opt(r.last_ms, 1),
        r.written_ms.map_or_else(
            || "-".into(),
            |(a, m, b)| format!("{a:.1}/{m:.1}/{b:.1} ms after t0")
        ),
        opt(p.detect_ms, 1),
        opt(p.laptop_translated.first_ms, 1),
        opt(p.laptop_translated.last_ms, 1),
        opt(p.server_translated.first_ms, 1),
        opt(p.server_translated.last_ms, 1),
        r.verified.map_or_else(|| "-".into(), |v| format!("{v}/{}", r.conns)),
        r.cpu_steady.line(),
        r.cpu_move.line(),
        r.netdev_max_backlog,
        r.backlog_drops_move
            .map_or_else(|| "?".into(), |d| d.to_string()),
    )
}

fn summary(runs: &[RunResult], f: impl Fn(&RunResult) -> Option<f64>) -> Option<Summary> {
    Summary::of(&runs.iter().filter_map(f).collect::<Vec<_>>())
}

fn median_total(results: &[(usize, Vec<RunResult>)], n: usize) -> Option<f64> {
    let (_, runs) = results.iter().find(|(k, _)| *k == n)?;
    summary(runs, |r| r.total_s).map(|s| s.median)
}

fn summary_json(s: Option<Summary>) -> Value {
    match s {
        Some(s) => json!({
            "median": s.median, "min": s.min, "max": s.max,
            "spread_percent": s.spread_percent(), "samples": s.samples,
        }),
        None => Value::Null,
    }
}

/// Reads one phase's figure out of a run's phases.
type PhaseField = fn(&Phases) -> Option<f64>;

/// The phase fields summarised over runs, by name.
fn phase_fields() -> Vec<(&'static str, PhaseField)> {
    vec![
        ("detect_ms", |p| p.detect_ms),
        ("laptop_prepare_ms", |p| p.laptop_prepare_ms),
        ("laptop_prepare_per_conn_ms", |p| {
            p.laptop_prepare_per_conn_ms
        }),
        ("exchange_ms", |p| p.exchange_ms),
        ("server_install_ms", |p| p.server_install_ms),
        ("server_install_per_conn_ms", |p| {
            p.server_install_per_conn_ms
        }),
        ("switched_ms", |p| p.switched_ms),
        ("laptop_install_ms", |p| p.laptop_install_ms),
        ("laptop_install_per_conn_ms", |p| {
            p.laptop_install_per_conn_ms
        }),
        ("drain_ms", |p| p.drain_ms),
        ("laptop_levers_ms", |p| Some(p.laptop_levers_ms)),
        ("server_levers_ms", |p| Some(p.server_levers_ms)),
        ("echo_after_install_median_ms", |p| {
            p.echo_after_install_median_ms
        }),
        ("echo_after_install_max_ms", |p| p.echo_after_install_max_ms),
    ]
}

pub fn json(
    args: &Args,
    results: &[(usize, Vec<RunResult>)],
    load_before: Option<f64>,
    load_after: Option<f64>,
) -> Value {
    let rows: Vec<Value> = results
        .iter()
        .map(|(n, runs)| {
            let total = summary(runs, |r| r.total_s);
            let p = paper(*n);
            let mut phases = serde_json::Map::new();
            for (name, f) in phase_fields() {
                phases.insert(name.into(), summary_json(summary(runs, |r| f(&r.phases))));
            }
            json!({
                "conns": n,
                "rtt_ms": summary(runs, |r| Some(r.rtt_ms)).map(|s| s.median),
                "runs": runs.len(),
                "complete_runs": runs.iter().filter(|r| r.complete).count(),
                "restored_min": runs.iter().map(|r| r.restored).min(),
                "aborted_migrations_max": runs.iter().map(|r| r.phases.aborted).max(),
                "total_s": summary_json(total.clone()),
                "per_conn_ms": summary_json(summary(runs, |r| r.per_conn_ms)),
                "harness_s": summary_json(summary(runs, |r| r.harness_s)),
                "vnat_s": summary_json(summary(runs, |r| r.vnat_s)),
                "first_conn_ms": summary_json(summary(runs, |r| r.first_ms)),
                "median_conn_ms": summary_json(summary(runs, |r| r.median_ms)),
                "p90_conn_ms": summary_json(summary(runs, |r| r.p90_ms)),
                "last_conn_ms": summary_json(summary(runs, |r| r.last_ms)),
                "echo_rtt_ms": summary_json(summary(runs, |r| r.echo_rtt_ms)),
                "paper_total_s": p.map(|p| p.0),
                "paper_per_conn_ms": p.map(|p| p.1),
                "paper_rtt_ms": p.map(|p| p.2),
                "total_vs_paper": p.zip(total.as_ref()).map(|(p, t)| t.median / p.0),
                "phases": phases,
                "per_run": runs,
            })
        })
        .collect();
    json!({
        "benchmark": "restore",
        "what": "s from t0 (the laptop's new address configured: A removed, B up with address and default route) \
                 until every one of N TCP connections has echoed a message written at or after t0 (total_s); \
                 per_conn_ms = total_s * 1000 / N, the paper's Table 1 column; harness_s: the same measure before the move \
                 with nothing moving (the harness's own share), vnat_s = total_s - harness_s",
        "rtt_target_ms": args.rtt_ms,
        "delay": if args.rtt_ms > 0.0 { "userspace L2 delay line (AF_PACKET) on the router-server link, half the RTT each way" } else { "none" },
        "interval_ms": args.interval_ms,
        "outage_s": args.outage_secs,
        "standby_tc": !args.no_standby_tc,
        "targets": {
            "500_conns_total_s": 0.05,
            "10000_conns_total_s": 1.0,
            "per_extra_conn_us": 10.0,
            // Judged on the medians of this run's sizes; null when the size
            // was not run.
            "500_met": median_total(results, 500).filter(|_| args.outage_secs == 0).map(|t| t < 0.05),
            "10000_met": median_total(results, 10_000).filter(|_| args.outage_secs == 0).map(|t| t < 1.0),
        },
        "paper": PAPER.iter().map(|p| json!({"conns": p.0, "total_s": p.1, "per_conn_ms": p.2, "rtt_ms": p.3})).collect::<Vec<_>>(),
        "machine": {
            "kernel": env::kernel_release(),
            "cpus": env::cpus(),
            "loadavg_1min_before": load_before,
            "loadavg_1min_after": load_after,
        },
        "results": rows,
    })
}

pub fn table(args: &Args, results: &[(usize, Vec<RunResult>)]) -> String {
    let mut s = String::new();
    let fmt = |x: Option<Summary>, d: usize| {
        x.map_or_else(
            || "-".into(),
            |x| format!("{:.d$} ({:.d$}-{:.d$})", x.median, x.min, x.max),
        )
    };
    let med = |x: Option<Summary>, d: usize| {
        x.map_or_else(|| "-".into(), |x| format!("{:.d$}", x.median))
    };
    let delay = if args.rtt_ms > 0.0 {
        "delay line"
    } else {
        "no delay line"
    };
    let outage = if args.outage_secs > 0 {
        format!(", after {} s without network", args.outage_secs)
    } else {
        String::new()
    };
    let _ = writeln!(
        s,
        "\nrestoring N TCP connections after the laptop's address changes, at {} ms RTT ({delay}){outage}",
        args.rtt_ms
    );
    let _ = writeln!(
        s,
        "total = new address usable -> every connection has echoed a message written after it; \
         medians over runs (min-max); harness alone = the same before the move, nothing moving \
         (client, delay line, echo server); vnat's share = total - harness alone; paper: VNAT tech report, Table 1"
    );
    let _ = writeln!(
        s,
        "{:>6} {:>7} {:>5} {:>26} {:>26} {:>26} {:>22} {:>24} {:>8} {:>9} {:>9}",
        "conns",
        "rtt ms",
        "done",
        "total s",
        "harness alone s",
        "vnat's share s",
        "per conn ms",
        "first/median/last ms",
        "paper s",
        "paper ms",
        "us/paper"
    );
    for (n, runs) in results {
        let total = summary(runs, |r| r.total_s);
        let p = paper(*n);
        let _ = writeln!(
            s,
            "{:>6} {:>7} {:>5} {:>26} {:>26} {:>26} {:>22} {:>24} {:>8} {:>9} {:>9}",
            n,
            med(summary(runs, |r| Some(r.rtt_ms)), 2),
            format!(
                "{}/{}",
                runs.iter().filter(|r| r.complete).count(),
                runs.len()
            ),
            fmt(total.clone(), 3),
            fmt(summary(runs, |r| r.harness_s), 3),
            fmt(summary(runs, |r| r.vnat_s), 3),
            fmt(summary(runs, |r| r.per_conn_ms), 2),
            format!(
                "{}/{}/{}",
                med(summary(runs, |r| r.first_ms), 0),
                med(summary(runs, |r| r.median_ms), 0),
                med(summary(runs, |r| r.last_ms), 0)
            ),
            p.map_or_else(|| "-".into(), |p| format!("{:.3}", p.0)),
            p.map_or_else(|| "-".into(), |p| format!("{:.1}", p.1)),
            p.zip(total)
                .map_or_else(|| "-".into(), |(p, t)| format!("{:.2}", t.median / p.0)),
        );
        for (i, r) in runs
            .iter()
            .enumerate()
            .filter(|(_, r)| r.phases.aborted > 0)
        {
            let _ = writeln!(
                s,
                "{:>6}   run {}: VCMP aborted {} of {} migrations (\"{}\"); those of them that echoed did so only \
                 because nothing filters the laptop's old source address",
                "",
                i + 1,
                r.phases.aborted,
                r.conns,
                r.phases.warning_samples.first().map_or("", String::as_str),
            );
        }
        for r in runs.iter().filter(|r| !r.complete) {
            let first = r
                .conn_errors
                .first()
                .map_or_else(String::new, |e| format!(" (first error: {e})"));
            let _ = if r.restored == r.conns {
                writeln!(
                    s,
                    "{:>6}   incomplete run: every connection echoed after the move, then {} failed{first}",
                    "", r.failed,
                )
            } else {
                writeln!(
                    s,
                    "{:>6}   incomplete run: {} of {} restored within {:.0} s, {} failed{first}",
                    "", r.restored, r.conns, r.timeout_s, r.failed,
                )
            };
        }
    }
    let _ = writeln!(
        s,
        "\nwhere the time goes (vnatd's logs, in the order it happens; medians over runs; ms; (/c) = per connection)"
    );
    let _ = writeln!(
        s,
        "{:>6} {:>7} {:>18} {:>9} {:>18} {:>10} {:>18} {:>7} {:>14} {:>13}",
        "conns",
        "detect",
        "lap.prepare (/c)",
        "exchange",
        "srv.install (/c)",
        "switched",
        "lap.install (/c)",
        "drain",
        "echo-install",
        "levers l/s"
    );
    for (n, runs) in results {
        let ph = |f: fn(&Phases) -> Option<f64>, d: usize| med(summary(runs, |r| f(&r.phases)), d);
        let _ = writeln!(
            s,
            "{:>6} {:>7} {:>18} {:>9} {:>18} {:>10} {:>18} {:>7} {:>14} {:>13}",
            n,
            ph(|p| p.detect_ms, 1),
            format!(
                "{} ({})",
                ph(|p| p.laptop_prepare_ms, 1),
                ph(|p| p.laptop_prepare_per_conn_ms, 2)
            ),
            ph(|p| p.exchange_ms, 1),
            format!(
                "{} ({})",
                ph(|p| p.server_install_ms, 1),
                ph(|p| p.server_install_per_conn_ms, 2)
            ),
            ph(|p| p.switched_ms, 1),
            format!(
                "{} ({})",
                ph(|p| p.laptop_install_ms, 1),
                ph(|p| p.laptop_install_per_conn_ms, 2)
            ),
            ph(|p| p.drain_ms, 1),
            format!(
                "{}/{}",
                ph(|p| p.echo_after_install_median_ms, 1),
                ph(|p| p.echo_after_install_max_ms, 1)
            ),
            format!(
                "{}/{}",
                ph(|p| Some(p.laptop_levers_ms), 1),
                ph(|p| Some(p.server_levers_ms), 1)
            ),
        );
    }
    let _ = writeln!(
        s,
        "(detect: t0 -> laptop's first prepare; exchange: UPD, server's receive-side prepares, UPD_R and \
         CHALLENGE, RESPONSE; switched: server's last install -> laptop's first (SWITCHED); drain: the last \
         install -> last echo; echo-install: per connection, later install -> its echo, median/max; \
         levers l/s: time the laptop's and the server's vnatd spent on the TCP restart levers, the laptop's \
         within drain)"
    );
    s
}
