//! The result of the throughput benchmark: one JSON object (printed with
//! `--json`, written to bench/results/throughput.json) and, made from it, a
//! table for people.

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};
use vnat_bench::{
    env,
    host::Counters,
    stats::{median, percent, Summary},
};
use vnat_tests::Family;

use super::{Case, Sample, MIN_NOISE, TRANSLATED_MAX_LOSS};

/// How the samples were taken.
pub struct Setup<'a> {
    pub runs: u16,
    pub seconds: u64,
    pub family: Family,
    pub iperf_version: &'a str,
    pub load_before: Option<f64>,
    /// Largest skb payload on eth0 (GSO/GRO), the unit of the (c) proof.
    pub max_skb: u64,
}

/// `samples[i]` are the runs of `Case::ALL[i]`, in the order measured.
pub fn build(setup: &Setup, samples: &[Vec<Sample>]) -> Result<Value> {
    let gbps = |i: usize| -> Vec<f64> {
        samples[i]
            .iter()
            .map(|s| s.run.received_bps / 1e9)
            .collect()
    };
    let base_runs = gbps(0);
    let base = Summary::of(&base_runs).context("no runs were measured")?;
    let noise = base.spread_percent().max(MIN_NOISE);
    let mut cases = Map::new();
    let mut deltas = Vec::new();
    for (i, case) in Case::ALL.iter().enumerate() {
        let runs = gbps(i);
        let g = Summary::of(&runs).context("no runs were measured")?;
        let delta = percent(g.median - base.median, base.median);
        deltas.push(delta);
        // Run k of every case ran back to back, so the ratio within a round
        // cancels drift that is slower than a round.
        let paired: Vec<f64> = runs
            .iter()
            .zip(&base_runs)
            .map(|(x, a)| percent(x - a, *a))
            .collect();
        let pick = |f: fn(&Sample) -> f64| median(&samples[i].iter().map(f).collect::<Vec<_>>());
        cases.insert(
            case.key().into(),
            json!({
                "label": case.label(),
                "gbit_per_s": g,
                "spread_percent": g.spread_percent(),
                "sender_cpu_percent_median": pick(|s| s.run.sender_cpu_percent),
                "receiver_cpu_percent_median": pick(|s| s.run.receiver_cpu_percent),
                "retransmits_median": pick(|s| s.run.retransmits as f64),
                "delta_vs_native_percent": delta,
                "paired_delta_vs_native_percent": Summary::of(&paired),
                "proof": proof(&samples[i]),
                "runs": samples[i].iter().map(run_json).collect::<Vec<_>>(),
            }),
        );
    }
    Ok(json!({
        "benchmark": "throughput",
        "setup": {
            "topology": "SameLink: two network namespaces on one veth pair",
            "family": family_name(setup.family),
            "runs_per_case": setup.runs,
            "seconds_per_run": setup.seconds,
            "order": "interleaved a, b, c, a, b, c, ...",
            "iperf3": setup.iperf_version,
            "kernel": env::kernel_release(),
            "cpus": env::cpus(),
            "max_skb_bytes": setup.max_skb,
            "loadavg_1min_before": setup.load_before,
            "loadavg_1min_after": env::loadavg_1min(),
            "unix_time": std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        },
        "cases": cases,
        "noise_percent": noise,
        "noise_definition": "max((max - min) / median of (a), 1%)",
        "targets": {
            "attached_within_noise": {
                "delta_percent": deltas[1],
                "limit_percent": noise,
                "met": deltas[1].abs() <= noise,
            },
            "translated_at_most_3_percent_below": {
                "delta_percent": deltas[2],
                "limit_percent": -TRANSLATED_MAX_LOSS,
                "met": deltas[2] >= -TRANSLATED_MAX_LOSS,
            },
        },
    }))
}

fn family_name(f: Family) -> &'static str {
    match f {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    }
}

/// What the counters showed over all runs of a case (each run was already
/// checked on its own; this is the summary for the reader).
fn proof(samples: &[Sample]) -> Value {
    let deltas = || samples.iter().filter_map(|s| s.deltas.as_ref());
    let min_of = |f: fn(&Counters, &Counters) -> u64| deltas().map(|(l, s)| f(l, s)).min();
    let translated: u64 = deltas()
        .flat_map(|(l, s)| [l, s])
        .map(|c| c.get("egress_translated") + c.get("ingress_translated"))
        .sum();
    // Data packets translated over the fewest packets that could have
    // carried the bytes received: at least 1 in every run means all of them.
    let coverage = samples
        .iter()
        .filter_map(|s| {
            let (l, srv) = s.deltas.as_ref()?;
            let n = l
                .get("egress_translated")
                .min(srv.get("ingress_translated"));
            Some(n as f64 / s.min_packets?.max(1) as f64)
        })
        .min_by(f64::total_cmp);
    json!({
        "translated_packets_all_runs": translated,
        "min_per_run": {
            "laptop_egress_translated": min_of(|l, _| l.get("egress_translated")),
            "laptop_ingress_translated": min_of(|l, _| l.get("ingress_translated")),
            "server_egress_translated": min_of(|_, s| s.get("egress_translated")),
            "server_ingress_translated": min_of(|_, s| s.get("ingress_translated")),
            "laptop_sockops_recorded": min_of(|l, _| l.get("sockops_recorded")),
            "server_sockops_recorded": min_of(|_, s| s.get("sockops_recorded")),
        },
        "min_translated_over_needed_data_packets": coverage,
    })
}

fn run_json(s: &Sample) -> Value {
    let r = &s.run;
    let mut v = json!({
        "gbit_per_s": r.received_bps / 1e9,
        "bytes_received": r.bytes_received,
        "retransmits": r.retransmits,
        "sender_cpu_percent": r.sender_cpu_percent,
        "receiver_cpu_percent": r.receiver_cpu_percent,
        "data_connection": format!("{} -> {}", r.local, r.remote),
    });
    if let Some((lap, srv)) = &s.deltas {
        let pick = |c: &Counters| -> Value {
            [
                "egress_translated",
                "ingress_translated",
                "egress_redirected",
                "sockops_recorded",
            ]
            .iter()
            .map(|k| (k.to_string(), json!(c.get(k))))
            .collect::<Map<_, _>>()
            .into()
        };
        v["counter_deltas"] = json!({ "laptop": pick(lap), "server": pick(srv) });
    }
    if let Some(n) = s.min_packets {
        v["min_data_packets"] = json!(n);
    }
    v
}

/// The report as a table for people.
pub fn table(r: &Value) -> String {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    let setup = &r["setup"];
    let mut out = format!(
        "\nthroughput: iperf3 over veth, {} runs x {} s per case, {}, interleaved; load {} -> {}\n",
        setup["runs_per_case"],
        setup["seconds_per_run"],
        setup["family"].as_str().unwrap_or("?"),
        setup["loadavg_1min_before"],
        setup["loadavg_1min_after"],
    );
    let row = |c: [&str; 9]| {
        format!(
            "{:<34} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>8} {:>8}\n",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8]
        )
    };
    out += &row([
        "case", "median", "min", "max", "spread", "snd CPU", "rcv CPU", "vs (a)", "paired",
    ]);
    out += &row(["", "Gbit/s", "Gbit/s", "Gbit/s", "%", "%", "%", "%", "%"]);
    for case in Case::ALL {
        let c = &r["cases"][case.key()];
        let g = &c["gbit_per_s"];
        out += &row([
            case.label(),
            &format!("{:.2}", f(&g["median"])),
            &format!("{:.2}", f(&g["min"])),
            &format!("{:.2}", f(&g["max"])),
            &format!("{:.1}", f(&c["spread_percent"])),
            &format!("{:.1}", f(&c["sender_cpu_percent_median"])),
            &format!("{:.1}", f(&c["receiver_cpu_percent_median"])),
            &format!("{:+.2}", f(&c["delta_vs_native_percent"])),
            &format!("{:+.2}", f(&c["paired_delta_vs_native_percent"]["median"])),
        ]);
    }
    let t = &r["targets"];
    let met = |v: &Value| match v["met"].as_bool() {
        Some(true) => "met",
        _ => "MISSED",
    };
    let (tb, tc) = (
        &t["attached_within_noise"],
        &t["translated_at_most_3_percent_below"],
    );
    out += &format!(
        "(\"vs (a)\": difference of medians; \"paired\": median over runs of the difference to the (a) run of the same round)\n\
         noise = max(spread of (a), 1%) = {:.2}%\n\
         target (b) within noise of (a):  {:+.2}% vs +-{:.2}%: {}\n\
         target (c) at most 3% below (a): {:+.2}% vs -3%: {}\n",
        f(&r["noise_percent"]),
        f(&tb["delta_percent"]),
        f(&tb["limit_percent"]),
        met(tb),
        f(&tc["delta_percent"]),
        met(tc),
    );
    let b = &r["cases"]["attached"]["proof"];
    let c = &r["cases"]["translated"]["proof"];
    out += &format!(
        "proof (b): vnat's tc programs on both eth0 in every run (BPF_PROG_QUERY); {} packets \
         translated in all runs; sock_ops recorded >= {} (laptop) / {} (server) of iperf3's \
         connections per run\n\
         proof (c): in every run laptop egress and server ingress translated >= {:.2}x the fewest \
         packets that could carry the bytes received ({} B each); ACKs translated >= {} (laptop \
         ingress) / {} (server egress) per run\n",
        b["translated_packets_all_runs"],
        n(&b["min_per_run"]["laptop_sockops_recorded"]),
        n(&b["min_per_run"]["server_sockops_recorded"]),
        f(&c["min_translated_over_needed_data_packets"]),
        setup["max_skb_bytes"],
        n(&c["min_per_run"]["laptop_ingress_translated"]),
        n(&c["min_per_run"]["server_egress_translated"]),
    );
    out
}
