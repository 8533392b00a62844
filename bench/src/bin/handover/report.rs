//! The handover benchmark's summary: one JSON object and the table.

use serde_json::{json, Value};
use vnat_bench::{env, stats::Summary};

use super::{Args, Case, RunResult};

/// The median of the runs' own targets (each from its measured RTTs).
fn target(runs: &[RunResult]) -> f64 {
    Summary::of(&runs.iter().map(|r| r.target_ms).collect::<Vec<_>>()).map_or(0.0, |s| s.median)
}

const TARGETS: &str = "target: handover_ms <= RTT + 10 ms with one end moving, \
                       <= 2 RTT + the location server's RTT with both";

fn summary_json(runs: &[RunResult], f: impl Fn(&RunResult) -> Option<f64>) -> Value {
    let v: Vec<f64> = runs.iter().filter_map(f).collect();
    match Summary::of(&v) {
        Some(s) => json!({
            "median": s.median, "min": s.min, "max": s.max,
            "spread_percent": s.spread_percent(), "samples": s.samples,
        }),
        None => Value::Null,
    }
}

pub fn report(
    args: &Args,
    results: &[(Case, Vec<RunResult>)],
    load_before: Option<f64>,
    load_after: Option<f64>,
) -> Value {
    let mut scenarios = serde_json::Map::new();
    for (case, runs) in results {
        let met = runs.iter().filter(|r| r.target_met).count();
        let target = target(runs);
        let median_handover = Summary::of(&runs.iter().map(|r| r.handover_ms).collect::<Vec<_>>())
            .map_or(f64::INFINITY, |s| s.median);
        scenarios.insert(
            case.key(),
            json!({
                "label": case.label(),
                "movers": case.movers,
                "outage_s": case.scenario.outage_s(),
                "runs": runs.len(),
                "first_byte_ms": summary_json(runs, |r| Some(r.first_byte_ms)),
                "handover_ms": summary_json(runs, |r| Some(r.handover_ms)),
                "first_echo_ms": summary_json(runs, |r| Some(r.first_echo_ms)),
                "rtt_ms": summary_json(runs, |r| Some(r.rtt_ms)),
                "echo_rtt_ms": summary_json(runs, |r| Some(r.echo_rtt_ms)),
                "location_server_rtt_ms": summary_json(runs, |r| r.location_server_rtt_ms),
                "laptop_move_started_ms": summary_json(runs, |r| r.laptop_move_started_ms),
                "server_move_started_ms": summary_json(runs, |r| r.server_move_started_ms),
                "server_translated_ms": summary_json(runs, |r| r.server_translated_ms),
                "laptop_translated_ms": summary_json(runs, |r| r.laptop_translated_ms),
                "target_ms": target,
                "target_met_runs": met,
                "target_met_median": median_handover <= target,
                "per_run": runs,
            }),
        );
    }
    json!({
        "benchmark": "handover",
        "what": format!("ms from the new address being usable (t_usable: B's address and default route configured, \
                 and E's when both move) to the echo of the first probe written at or after t_usable (first_byte_ms); \
                 handover_ms = first_byte_ms - measured RTT; {TARGETS}"),
        "rtt_target_ms": args.rtt_ms,
        "delay": "userspace L2 delay line (AF_PACKET) on the router-server link, half the RTT each way",
        "probe_interval_ms": 1.0,
        "machine": {
            "kernel": env::kernel_release(),
            "cpus": env::cpus(),
            "loadavg_1min_before": load_before,
            "loadavg_1min_after": load_after,
        },
        "scenarios": scenarios,
    })
}

pub fn table(args: &Args, results: &[(Case, Vec<RunResult>)]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nhandover at {} ms RTT (delay line), first byte after the new address is usable; {TARGETS}",
        args.rtt_ms
    );
    let _ = writeln!(
        s,
        "(medians, ms; first byte = echo of the first probe written after t_usable; handover = first byte - rtt; \
         echo rtt = probe round trip before the move, socat included; lap. transl. = laptop vnatd's translation logged)"
    );
    let _ = writeln!(
        s,
        "{:<22} {:>4} {:>7} {:>9} {:>22} {:>22} {:>11} {:>12} {:>10}",
        "scenario",
        "runs",
        "rtt ms",
        "echo rtt",
        "first byte ms (range)",
        "handover ms (range)",
        "first echo",
        "lap. transl.",
        "target met"
    );
    for (case, runs) in results {
        let sum = |f: &dyn Fn(&RunResult) -> Option<f64>| {
            Summary::of(&runs.iter().filter_map(f).collect::<Vec<_>>())
        };
        let fmt = |x: Option<Summary>| {
            x.map_or_else(
                || "-".into(),
                |x| format!("{:.1} ({:.1}-{:.1})", x.median, x.min, x.max),
            )
        };
        let med = |x: Option<Summary>| x.map_or_else(|| "-".into(), |x| format!("{:.1}", x.median));
        let _ = writeln!(
            s,
            "{:<22} {:>4} {:>7} {:>9} {:>22} {:>22} {:>11} {:>12} {:>10}",
            case.label(),
            runs.len(),
            sum(&|r| Some(r.rtt_ms)).map_or("-".into(), |x| format!("{:.2}", x.median)),
            sum(&|r| Some(r.echo_rtt_ms)).map_or("-".into(), |x| format!("{:.2}", x.median)),
            fmt(sum(&|r| Some(r.first_byte_ms))),
            fmt(sum(&|r| Some(r.handover_ms))),
            med(sum(&|r| Some(r.first_echo_ms))),
            med(sum(&|r| r.laptop_translated_ms)),
            format!(
                "{}/{}",
                runs.iter().filter(|r| r.target_met).count(),
                runs.len()
            ),
        );
    }
    s
}

/// One cell of the sweep.
pub fn sweep_row(rtt_target_ms: f64, case: Case, runs: &[RunResult]) -> Value {
    let target = target(runs);
    let median_handover = Summary::of(&runs.iter().map(|r| r.handover_ms).collect::<Vec<_>>())
        .map_or(f64::INFINITY, |s| s.median);
    json!({
        "rtt_ms": rtt_target_ms,
        "outage_s": case.scenario.outage_s(),
        "movers": case.movers,
        "runs": runs.len(),
        "measured_rtt_ms": summary_json(runs, |r| Some(r.rtt_ms)),
        "handover_ms": summary_json(runs, |r| Some(r.handover_ms)),
        "first_byte_ms": summary_json(runs, |r| Some(r.first_byte_ms)),
        "location_server_rtt_ms": summary_json(runs, |r| r.location_server_rtt_ms),
        "laptop_move_started_ms": summary_json(runs, |r| r.laptop_move_started_ms),
        "server_move_started_ms": summary_json(runs, |r| r.server_move_started_ms),
        "server_translated_ms": summary_json(runs, |r| r.server_translated_ms),
        "target_ms": target,
        "target_met_median": median_handover <= target,
        "per_run": runs,
    })
}

pub fn sweep_report(args: &Args, rows: &[Value], load_before: Option<f64>) -> Value {
    json!({
        "benchmark": "handover",
        "what": format!("handover_ms = ms from the new address being usable to the echo of the first probe written after it, \
                 minus the measured RTT; movers: one (the laptop) or both (the server too, found through the location \
                 server); {TARGETS}"),
        "standby_tc": !args.no_standby_tc,
        "echo": if args.nagle_echo { "socat, Nagle on" } else { "socat with TCP_NODELAY" },
        "delay": "userspace L2 delay line (AF_PACKET) on the router-server link, half the RTT each way",
        "machine": env::machine(load_before),
        "sweep": rows,
    })
}

pub fn sweep_table(rows: &[Value]) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(s, "handover sweep (medians, ms; {TARGETS})");
    let _ = writeln!(
        s,
        "{:>6} {:>7} {:>8} {:>5} {:>12} {:>12} {:>9} {:>6}",
        "movers", "rtt ms", "outage s", "runs", "first byte", "handover", "target", "met"
    );
    for r in rows {
        let m = |k: &str| {
            r[k]["median"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.1}"))
        };
        let _ = writeln!(
            s,
            "{:>6} {:>7} {:>8} {:>5} {:>12} {:>12} {:>9.1} {:>6}",
            r["movers"].as_str().unwrap_or("?"),
            r["rtt_ms"].as_f64().unwrap_or(0.0),
            r["outage_s"].as_u64().unwrap_or(0),
            r["runs"].as_u64().unwrap_or(0),
            m("first_byte_ms"),
            m("handover_ms"),
            r["target_ms"].as_f64().unwrap_or(0.0),
            if r["target_met_median"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            }
        );
    }
    s
}
