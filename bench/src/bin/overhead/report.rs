//! The overhead benchmark's result: one JSON object (bench/results/
//! overhead.json, and stdout with `--json`) and a table made from it.

use serde_json::{json, Map, Value};
use vnat_bench::stats::{median, median_ci95, percent, Summary};

use super::{bed::Case, Point, Results};

/// The targets, in percent against (a).
const TRANSLATED_TPUT_LOSS: f64 = 3.0;
const TRANSLATED_LATENCY_CPU: f64 = 2.0;
const SETUP_SLOWER: f64 = 3.0;
/// The smallest noise band for (b) against (a), in percent.
const MIN_NOISE: f64 = 1.0;

/// The paper's VNAT-only overheads (section 6.1-6.3), in percent.
fn paper() -> Value {
    json!({
        "source": "VNAT tech report, section 6.1-6.3 (netperf, 100 Mbit/s, message sizes 64-8192 B): VNAT2 against Netfilter",
        "throughput_loss_percent": [4.0, 6.0],
        "throughput_sender_cpu_percent": [4.0, 7.0],
        "throughput_receiver_cpu_percent": [2.0, 3.0],
        "latency_percent": [4.0, 6.0],
        "latency_sender_cpu_percent": [2.0, 7.0],
        "latency_receiver_cpu_percent": [5.0, 6.0],
        "setup_percent": [2.0, 3.0],
        "vs_vanilla": {
            "throughput_loss_percent": [9.0, 13.0],
            "latency_percent": [14.0, 20.0],
            "setup_percent": [11.0, 18.0]
        }
    })
}

fn summary(points: &[Point], f: impl Fn(&Point) -> Option<f64>) -> Option<Summary> {
    Summary::of(&points.iter().filter_map(f).collect::<Vec<_>>())
}

/// Per case and size: the medians (with spread) of one kind of measurement.
fn kind(res: &Results, data: &[Vec<Vec<Point>>], with_pct: bool) -> Value {
    let mut cases = Map::new();
    for (ci, case) in Case::ALL.iter().enumerate() {
        let rows: Vec<Value> = res
            .sizes
            .iter()
            .enumerate()
            .filter(|(si, _)| !data[ci][*si].is_empty())
            .map(|(si, size)| {
                let p = &data[ci][si];
                let mut row = json!({
                    "size": size,
                    "value": summary(p, |x| Some(x.value)),
                    "client_cpu_percent": summary(p, |x| Some(x.client_cpu)),
                    "server_cpu_percent": summary(p, |x| Some(x.server_cpu)),
                });
                if with_pct {
                    row["p50"] = json!(summary(p, |x| x.p50));
                    row["p99"] = json!(summary(p, |x| x.p99));
                }
                row
            })
            .collect();
        cases.insert(
            case.key().to_string(),
            json!({ "label": case.label(), "by_size": rows }),
        );
    }
    Value::Object(cases)
}

/// Median change of `case` against (a) per size, in percent: value, client
/// CPU, server CPU.
fn deltas(res: &Results, data: &[Vec<Vec<Point>>], ci: usize) -> Vec<(u32, f64, f64, f64)> {
    res.sizes
        .iter()
        .enumerate()
        .filter(|(si, _)| !data[ci][*si].is_empty() && !data[0][*si].is_empty())
        .map(|(si, &size)| {
            let m = |c: usize, f: fn(&Point) -> f64| {
                median(&data[c][si].iter().map(f).collect::<Vec<_>>()).unwrap_or(0.0)
            };
            let d = |f: fn(&Point) -> f64| percent(m(ci, f) - m(0, f), m(0, f));
            (
                size,
                d(|p| p.value),
                d(|p| p.client_cpu),
                d(|p| p.server_cpu),
            )
        })
        .collect()
}

/// The noise band of a kind: the largest spread of (a) over the sizes.
fn noise(res: &Results, data: &[Vec<Vec<Point>>]) -> f64 {
    res.sizes
        .iter()
        .enumerate()
        .filter_map(|(si, _)| summary(&data[0][si], |p| Some(p.value)))
        .map(|s| s.spread_percent())
        .fold(MIN_NOISE, f64::max)
}

fn delta_json(d: &[(u32, f64, f64, f64)]) -> Value {
    json!(d
        .iter()
        .map(|(size, v, c, s)| json!({"size": size, "value_percent": v, "client_cpu_percent": c, "server_cpu_percent": s}))
        .collect::<Vec<_>>())
}

fn worst(d: &[(u32, f64, f64, f64)], f: impl Fn(&(u32, f64, f64, f64)) -> f64) -> f64 {
    d.iter().map(f).fold(f64::NEG_INFINITY, f64::max)
}

/// Per size: the change of `case` against (a) run by run (runs are
/// interleaved, so run i of both was measured minutes apart at most), in
/// percent, with the median of those changes and its 95% confidence
/// interval: the effect and how sure of it these runs make us, which the
/// spread of each case alone does not say.
fn paired(res: &Results, data: &[Vec<Vec<Point>>], ci: usize) -> Value {
    json!(res
        .sizes
        .iter()
        .enumerate()
        .filter(|(si, _)| !data[ci][*si].is_empty() && !data[0][*si].is_empty())
        .map(|(si, size)| {
            let changes: Vec<f64> = data[0][si]
                .iter()
                .zip(&data[ci][si])
                .map(|(a, x)| percent(x.value - a.value, a.value))
                .collect();
            json!({
                "size": size,
                "runs": changes.len(),
                "median_percent": median(&changes),
                "ci95_percent": median_ci95(&changes).map(|(lo, hi)| [lo, hi]),
                "changes_percent": changes,
            })
        })
        .collect::<Vec<_>>())
}

/// A target over a kind that was measured: met or not; one that was not
/// (`--only`) is `null`, never "met".
fn met(d: &[(u32, f64, f64, f64)], ok: bool) -> Value {
    if d.is_empty() {
        Value::Null
    } else {
        json!(ok)
    }
}

pub fn build(setup: &Value, res: &Results) -> Value {
    let (att, tr) = (1, 2);
    let tput_noise = noise(res, &res.tput);
    let rr_noise = noise(res, &res.rr);
    let crr_noise = noise(res, &res.crr);
    let t_b = deltas(res, &res.tput, att);
    let t_c = deltas(res, &res.tput, tr);
    let r_b = deltas(res, &res.rr, att);
    let r_c = deltas(res, &res.rr, tr);
    let c_b = deltas(res, &res.crr, att);
    // Throughput: a loss is a negative change; latency: a rise is positive.
    let tput_loss_c = worst(&t_c, |d| -d.1);
    let cpu_c = worst(&t_c, |d| d.2.max(d.3)).max(worst(&r_c, |d| d.2.max(d.3)));
    let lat_c = worst(&r_c, |d| d.1);
    let setup_b = worst(&c_b, |d| -d.1);
    // Within noise either way: a (b) faster than (a) by more than the
    // noise says the measurement, not vnat, moved.
    let within = |d: &[(u32, f64, f64, f64)], n: f64| d.iter().all(|x| x.1.abs() <= n);
    json!({
        "benchmark": "overhead",
        "what": "per message size: iperf3 throughput (Gbit/s) with sender/receiver CPU, sockperf TCP ping-pong \
                 latency (µs, half a round trip) with client/server CPU, connection setup (transactions/s, a \
                 new TCP connection per request/response) with client/server CPU; medians over the runs",
        "setup": setup,
        "sizes": res.sizes,
        "throughput_gbps": kind(res, &res.tput, false),
        "latency_us": kind(res, &res.rr, true),
        "setup_per_s": kind(res, &res.crr, false),
        "deltas_vs_native": {
            "attached": {
                "throughput": delta_json(&t_b),
                "latency": delta_json(&r_b),
                "setup": delta_json(&c_b),
            },
            "translated": {
                "throughput": delta_json(&t_c),
                "latency": delta_json(&r_c),
            },
        },
        "setup_paired_vs_native": paired(res, &res.crr, att),
        "noise_percent": { "throughput": tput_noise, "latency": rr_noise, "setup": crr_noise },
        "targets": {
            "attached_within_noise": {
                "throughput": met(&t_b, within(&t_b, tput_noise)),
                "latency": met(&r_b, within(&r_b, rr_noise)),
                "setup": met(&c_b, within(&c_b, crr_noise)),
            },
            "translated_throughput_loss_max_percent": TRANSLATED_TPUT_LOSS,
            "translated_throughput_loss_worst_percent": tput_loss_c,
            "translated_throughput_met": met(&t_c, tput_loss_c <= TRANSLATED_TPUT_LOSS),
            "translated_latency_max_percent": TRANSLATED_LATENCY_CPU,
            "translated_latency_worst_percent": lat_c,
            "translated_latency_met": met(&r_c, lat_c <= TRANSLATED_LATENCY_CPU),
            "translated_cpu_max_percent": TRANSLATED_LATENCY_CPU,
            "translated_cpu_worst_percent": cpu_c,
            "translated_cpu_met": met(&t_c, cpu_c <= TRANSLATED_LATENCY_CPU),
            "setup_slower_max_percent": SETUP_SLOWER,
            "setup_slower_worst_percent": setup_b,
            "setup_met": met(&c_b, setup_b <= SETUP_SLOWER),
        },
        "paper": paper(),
    })
}

pub fn table(r: &Value) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let med = |v: &Value| v["median"].as_f64();
    let cell = |kind: &str, case: &str, si: usize, field: &str| -> String {
        r[kind][case]["by_size"]
            .as_array()
            .and_then(|rows| rows.iter().find(|row| row["size"] == r["sizes"][si]))
            .and_then(|row| med(&row[field]))
            .map_or("-".into(), |x| {
                if x >= 100.0 {
                    format!("{x:.0}")
                } else {
                    format!("{x:.2}")
                }
            })
    };
    let delta = |case: &str, kind: &str, si: usize| -> String {
        r["deltas_vs_native"][case][kind]
            .as_array()
            .and_then(|rows| rows.iter().find(|row| row["size"] == r["sizes"][si]))
            .and_then(|row| row["value_percent"].as_f64())
            .map_or("-".into(), |x| format!("{x:+.1}%"))
    };
    let sizes = r["sizes"].as_array().map_or(0, |a| a.len());
    let _ = writeln!(
        s,
        "overhead: medians per message size; (a) no vnat, (b) vnat attached, flow not translated ({}), (c) translated",
        r["setup"]["attached"].as_str().unwrap_or("one unrelated flow translated on both hosts")
    );
    let _ = writeln!(
        s,
        "{:>6} | {:>7} {:>7} {:>7} {:>7} {:>7} | {:>7} {:>7} {:>7} {:>7} {:>7} | {:>7} {:>7} {:>7} | {:>5} {:>5} {:>5}",
        "bytes", "Gb/s a", "b", "c", "Δb", "Δc", "lat µs a", "b", "c", "Δb", "Δc", "conn/s a", "b", "Δb", "cpu a", "b", "c"
    );
    for si in 0..sizes {
        let _ = writeln!(
            s,
            "{:>6} | {:>7} {:>7} {:>7} {:>7} {:>7} | {:>8} {:>7} {:>7} {:>7} {:>7} | {:>8} {:>7} {:>7} | {:>5} {:>5} {:>5}",
            r["sizes"][si].as_u64().unwrap_or(0),
            cell("throughput_gbps", "native", si, "value"),
            cell("throughput_gbps", "attached", si, "value"),
            cell("throughput_gbps", "translated", si, "value"),
            delta("attached", "throughput", si),
            delta("translated", "throughput", si),
            cell("latency_us", "native", si, "value"),
            cell("latency_us", "attached", si, "value"),
            cell("latency_us", "translated", si, "value"),
            delta("attached", "latency", si),
            delta("translated", "latency", si),
            cell("setup_per_s", "native", si, "value"),
            cell("setup_per_s", "attached", si, "value"),
            delta("attached", "setup", si),
            cell("throughput_gbps", "native", si, "server_cpu_percent"),
            cell("throughput_gbps", "attached", si, "server_cpu_percent"),
            cell("throughput_gbps", "translated", si, "server_cpu_percent"),
        );
    }
    let t = &r["targets"];
    let yn = |v: &Value| match v.as_bool() {
        Some(true) => "met",
        Some(false) => "NOT met",
        None => "not measured",
    };
    for row in r["setup_paired_vs_native"].as_array().into_iter().flatten() {
        let pct = |v: &Value| v.as_f64().map_or("-".to_string(), |x| format!("{x:+.1}%"));
        let ci = row["ci95_percent"]
            .as_array()
            .map_or("95% interval needs 6 runs or more".to_string(), |a| {
                format!("95% interval {} … {}", pct(&a[0]), pct(&a[1]))
            });
        let _ = writeln!(
            s,
            "setup, (b) against (a) run by run, {:>5} B: median {} over {} runs ({ci})",
            row["size"].as_u64().unwrap_or(0),
            pct(&row["median_percent"]),
            row["runs"].as_u64().unwrap_or(0),
        );
    }
    let _ = writeln!(
        s,
        "noise (largest spread of (a)): throughput {:.1}%, latency {:.1}%, setup {:.1}%",
        r["noise_percent"]["throughput"].as_f64().unwrap_or(0.0),
        r["noise_percent"]["latency"].as_f64().unwrap_or(0.0),
        r["noise_percent"]["setup"].as_f64().unwrap_or(0.0)
    );
    let _ = writeln!(
        s,
        "targets: (b) within noise: throughput {}, latency {}, setup {}; (c) throughput loss <= 3%: {} (worst {:.1}%); \
         (c) latency <= +2%: {} (worst {:+.1}%); (c) CPU <= +2%: {} (worst {:+.1}%); setup <= 3% slower: {} (worst {:.1}%)",
        yn(&t["attached_within_noise"]["throughput"]),
        yn(&t["attached_within_noise"]["latency"]),
        yn(&t["attached_within_noise"]["setup"]),
        yn(&t["translated_throughput_met"]),
        t["translated_throughput_loss_worst_percent"].as_f64().unwrap_or(0.0),
        yn(&t["translated_latency_met"]),
        t["translated_latency_worst_percent"].as_f64().unwrap_or(0.0),
        yn(&t["translated_cpu_met"]),
        t["translated_cpu_worst_percent"].as_f64().unwrap_or(0.0),
        yn(&t["setup_met"]),
        t["setup_slower_worst_percent"].as_f64().unwrap_or(0.0),
    );
    s
}
