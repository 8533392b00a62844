//! The scale benchmark's part of a restore run (`--scale`): `vnatctl ls`
//! on both hosts with the harness's traffic running and with it paused,
//! the daemons' and their maps' memory with every connection recorded, and
//! the summary `cargo xtask bench scale` writes (bench/results/scale.json).

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use serde_json::Value;
use vnat_bench::stats::Summary;

use super::{cpu, Daemon, Helpers, RunResult};

/// The scale benchmark's result from the restore runs that measured it.
pub fn summary(results: &[(usize, Vec<RunResult>)], restore: &Value) -> Value {
    let runs: Vec<&RunResult> = results.iter().flat_map(|(_, r)| r).collect();
    let pick = |f: &dyn Fn(&Value) -> Option<f64>| -> Option<Summary> {
        Summary::of(
            &runs
                .iter()
                .filter_map(|r| r.scale.as_ref().and_then(f))
                .collect::<Vec<_>>(),
        )
    };
    let resume = Summary::of(&runs.iter().filter_map(|r| r.total_s).collect::<Vec<_>>());
    let harness = Summary::of(&runs.iter().filter_map(|r| r.harness_s).collect::<Vec<_>>());
    let mem = |k: &str| pick(&|s: &Value| s[k].as_f64()).map(|s| s.median);
    serde_json::json!({
        "benchmark": "scale",
        "what": "N live TCP connections between two namespace hosts through vnatd: the time vnatctl ls takes \
                 (table and --json) on both hosts, with the harness's traffic running and with its clients paused \
                 (_harness_quiet), the daemons' resident memory (before the listings, after them, and 10 s after the move) and their BPF maps' kernel \
                 memory (fdinfo memlock) with all N recorded, and the time to resume all N after the laptop \
                 moves (as the restore benchmark measures it)",
        "conns": runs.first().map(|r| r.conns),
        "complete_runs": runs.iter().filter(|r| r.complete).count(),
        "restored_min": runs.iter().map(|r| r.restored).min(),
        "times_s": {
            "vnatctl_ls_laptop": pick(&|s: &Value| s["ls_laptop_s"].as_f64()),
            "vnatctl_ls_json_laptop": pick(&|s: &Value| s["ls_json_laptop_s"].as_f64()),
            "vnatctl_ls_server": pick(&|s: &Value| s["ls_server_s"].as_f64()),
            "vnatctl_ls_laptop_harness_quiet": pick(&|s: &Value| s["ls_quiet_laptop_s"].as_f64()),
            "vnatctl_ls_json_laptop_harness_quiet": pick(&|s: &Value| s["ls_quiet_json_laptop_s"].as_f64()),
            "vnatctl_ls_server_harness_quiet": pick(&|s: &Value| s["ls_quiet_server_s"].as_f64()),
            "resume_all": resume,
            // The same measure with nothing moving: the harness's own share.
            "resume_all_harness_alone": harness,
        },
        "memory_mib": {
            "vnatd_laptop_rss_before_ls": mem("rss_laptop_before_ls_mib"),
            "vnatd_server_rss_before_ls": mem("rss_server_before_ls_mib"),
            "vnatd_laptop_rss": mem("rss_laptop_mib"),
            "vnatd_server_rss": mem("rss_server_mib"),
            "vnatd_laptop_rss_after_move": mem("rss_laptop_after_move_mib"),
            "vnatd_server_rss_after_move": mem("rss_server_after_move_mib"),
            "maps_laptop_kernel": mem("maps_laptop_mib"),
            "maps_server_kernel": mem("maps_server_mib"),
        },
        "per_run": runs.iter().map(|r| r.scale.clone()).collect::<Vec<_>>(),
        "restore": restore.clone(),
    })
}

/// The summary as the benchmark prints it.
pub fn table(s: &Value) -> String {
    use std::fmt::Write;
    let mut t = String::new();
    let _ = writeln!(t, "scale: {} connections", s["conns"]);
    for (k, v) in s["times_s"].as_object().into_iter().flatten() {
        let _ = writeln!(
            t,
            "  {k:<38} {:>10} s",
            v["median"]
                .as_f64()
                .map_or("-".into(), |x| format!("{x:.3}"))
        );
    }
    for (k, v) in s["memory_mib"].as_object().into_iter().flatten() {
        let _ = writeln!(
            t,
            "  {k:<38} {:>10} MiB",
            v.as_f64().map_or("-".into(), |x| format!("{x:.1}"))
        );
    }
    t
}

/// Resident memory of a process (VmRSS), MiB.
pub fn rss_mib(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

/// Kernel memory of the BPF maps a process holds open (fdinfo `memlock`,
/// each map counted once), MiB.
fn maps_mib(pid: u32) -> Option<f64> {
    let mut seen = std::collections::HashSet::new();
    let mut total = 0u64;
    for e in std::fs::read_dir(format!("/proc/{pid}/fdinfo"))
        .ok()?
        .flatten()
    {
        let Ok(info) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let field = |k: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
        };
        if let (Some(id), Some(mem)) = (field("map_id:"), field("memlock:")) {
            if seen.insert(id) {
                total += mem.parse::<u64>().unwrap_or(0);
            }
        }
    }
    Some(total as f64 / 1048576.0)
}

/// Wall time of `vnatctl ls` (with `--json` or as a table) and its row count.
fn time_ls(d: &Daemon, json: bool) -> Result<(f64, usize)> {
    let t = Instant::now();
    let out = d.ctl_raw(json, &["ls"])?;
    let secs = t.elapsed().as_secs_f64();
    let rows = if json {
        serde_json::from_slice::<Value>(&out)
            .ok()
            .and_then(|v| v.as_array().map(|a| a.len()))
            .unwrap_or(0)
    } else {
        out.split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .count()
            .saturating_sub(1)
    };
    Ok((secs, rows))
}

/// `vnatctl ls` on both hosts, the daemons' memory and their maps' with
/// all `n` connections open: first with the harness's traffic running (each
/// connection writes once a second, through the userspace delay line, which
/// on a 2-core machine keeps up to both cores busy), then with the clients
/// paused, which is what vnat's own share of the figure is.
pub fn measure(lapd: &Daemon, srvd: &Daemon, client: &mut Helpers, n: usize) -> Result<Value> {
    // A listing vnatctl gave up on (it waits 10 s) is a figure too, "over
    // 10 s", not the end of the run: the move is still to be measured.
    let timed = |d: &Daemon, json: bool, what: &str| match time_ls(d, json) {
        Ok((s, rows)) => (Some(s), rows, None),
        Err(e) => {
            eprintln!("restore: {what}: {e:#}");
            (None, 0, Some(format!("{e:#}")))
        }
    };
    // Before any listing: what the connections themselves cost, apart
    // from what answering `ls` leaves behind.
    let rss_before = (rss_mib(lapd.pid()), rss_mib(srvd.pid()));
    let mark = cpu::Mark::now(lapd.pid(), srvd.pid());
    let (ls_laptop, rows_l, err_l) = timed(lapd, false, "vnatctl ls on the laptop");
    let (ls_json_laptop, rows_lj, err_lj) = timed(lapd, true, "vnatctl --json ls on the laptop");
    let (ls_server, rows_s, err_s) = timed(srvd, false, "vnatctl ls on the server");
    let cpu_loaded = mark.to(&cpu::Mark::now(lapd.pid(), srvd.pid()));
    ensure!(
        err_lj.is_some() || rows_lj >= n,
        "vnatctl --json ls on the laptop listed {rows_lj} connections, fewer than the {n} open"
    );
    // The harness quiet: no writes, so no echoes and nothing through the
    // delay line (what is in flight drains in the first second).
    client.send("pause")?;
    vnat_bench::sleep_checked(Duration::from_secs(2))?;
    let mark = cpu::Mark::now(lapd.pid(), srvd.pid());
    let (quiet_laptop, _, _) = timed(lapd, false, "vnatctl ls on the laptop, harness quiet");
    let (quiet_json_laptop, _, _) =
        timed(lapd, true, "vnatctl --json ls on the laptop, harness quiet");
    let (quiet_server, _, _) = timed(srvd, false, "vnatctl ls on the server, harness quiet");
    let cpu_quiet = mark.to(&cpu::Mark::now(lapd.pid(), srvd.pid()));
    client.send("go")?;
    // Every connection writes again before anything is measured.
    vnat_bench::sleep_checked(Duration::from_secs(2))?;
    Ok(serde_json::json!({
        "ls_cpu_loaded": cpu_loaded,
        "ls_quiet_laptop_s": quiet_laptop,
        "ls_quiet_json_laptop_s": quiet_json_laptop,
        "ls_quiet_server_s": quiet_server,
        "ls_cpu_quiet": cpu_quiet,
        "ls_laptop_s": ls_laptop,
        "ls_laptop_rows": rows_l,
        "ls_laptop_error": err_l,
        "ls_json_laptop_s": ls_json_laptop,
        "ls_json_laptop_rows": rows_lj,
        "ls_json_laptop_error": err_lj,
        "ls_server_s": ls_server,
        "ls_server_rows": rows_s,
        "ls_server_error": err_s,
        "rss_laptop_before_ls_mib": rss_before.0,
        "rss_server_before_ls_mib": rss_before.1,
        "rss_laptop_mib": rss_mib(lapd.pid()),
        "rss_server_mib": rss_mib(srvd.pid()),
        "maps_laptop_mib": maps_mib(lapd.pid()),
        "maps_server_mib": maps_mib(srvd.pid()),
    }))
}
