//! What a benchmark needs from the machine, checked up front so that a
//! missing piece is one clear sentence instead of a failure halfway through,
//! and facts about the machine that belong next to its numbers.
use std::{io::ErrorKind, process::Command};

use anyhow::{bail, Context, Result};

/// Fails unless running as root (namespaces, cgroups and eBPF need it).
pub fn require_root(bench: &str) -> Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!(
            "{bench} needs root (it builds hosts from network namespaces and loads eBPF programs): \
             run it as `sudo -E cargo xtask bench {bench}`"
        );
    }
    Ok(())
}

/// Runs `program --version` and returns its first line, or fails with how to
/// install it.
pub fn require_program(program: &str, package: &str) -> Result<String> {
    match Command::new(program).arg("--version").output() {
        Ok(out) => Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .trim()
            .to_string()),
        Err(e) if e.kind() == ErrorKind::NotFound => bail!(
            "{program} is not installed: install the Debian package {package} \
             (`cargo xtask prereq` does)"
        ),
        Err(e) => Err(e).with_context(|| format!("running `{program} --version`")),
    }
}

/// The kernel release (`uname -r`).
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Online CPUs.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The 1-minute load average: on a shared machine it tells how much of the
/// spread between runs came from other work.
pub fn loadavg_1min() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The machine a benchmark ran on, for its JSON report: kernel, CPUs and
/// their model, memory, and the load before and after.
pub fn machine(load_before: Option<f64>) -> serde_json::Value {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo.lines().find_map(|l| {
        l.strip_prefix("model name")?
            .split_once(':')
            .map(|(_, m)| m.trim().to_string())
    });
    let mem_kib = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        m.lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
    });
    serde_json::json!({
        "kernel": kernel_release(),
        "cpus": cpus(),
        "cpu_model": model,
        "memory_gib": mem_kib.map(|k| (k as f64 / 1048576.0 * 10.0).round() / 10.0),
        "loadavg_1min_before": load_before,
        "loadavg_1min_after": loadavg_1min(),
    })
}
