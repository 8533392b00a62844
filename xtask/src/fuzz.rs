//! `cargo xtask fuzz TARGET --cpu-seconds N`: fuzz one target until it has
//! used N seconds of CPU (not of the clock), at the lowest priority, so that
//! "an hour of fuzzing" means the same on a machine other work shares, and
//! the corpus (fuzz/corpus/TARGET, kept between runs) carries each run's
//! progress into the next.

use std::{
    ffi::OsString,
    fs,
    path::Path,
    process::Command,
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use crate::prereq::EBPF_TOOLCHAIN;

/// The triple cargo-fuzz builds for on this machine.
const TRIPLE: &str = "x86_64-unknown-linux-gnu";
/// How often the fuzzer's CPU time is read.
const POLL: Duration = Duration::from_secs(5);

pub fn fuzz_cpu(root: &Path, target: &str, cpu_seconds: u64, args: &[OsString]) -> Result<()> {
    let dir = root.join("fuzz");
    println!("==> building {target} (cargo fuzz build -O)");
    let built = Command::new("cargo")
        .current_dir(&dir)
        .env("AYA_BUILD_SKIP", "1")
        .args([&format!("+{EBPF_TOOLCHAIN}"), "fuzz", "build", "-O", target])
        .status()
        .context("running cargo fuzz build")?;
    if !built.success() {
        bail!("cargo fuzz build -O {target} failed");
    }
    let bin = dir.join("target").join(TRIPLE).join("release").join(target);
    let corpus = dir.join("corpus").join(target);
    let artifacts = dir.join("artifacts").join(target);
    fs::create_dir_all(&corpus).with_context(|| format!("creating {}", corpus.display()))?;
    fs::create_dir_all(&artifacts).with_context(|| format!("creating {}", artifacts.display()))?;
    println!(
        "==> fuzzing {target} for {cpu_seconds} CPU-seconds (nice 19; corpus {})",
        corpus.display()
    );
    let mut child = Command::new("nice")
        .args(["-n", "19"])
        .arg(&bin)
        .arg(&corpus)
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .args(args)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let pid = child.id();
    let ticks = clock_ticks();
    let started = Instant::now();
    let mut stopped = false;
    let mut used = 0;
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for the fuzzer")? {
            break status;
        }
        if let Some(t) = cpu_ticks(pid) {
            used = t / ticks;
        }
        if used >= cpu_seconds && !stopped {
            // libFuzzer prints its final stats on SIGINT and exits.
            let _ = Command::new("kill")
                .args(["-INT", &pid.to_string()])
                .status();
            stopped = true;
        }
        sleep(POLL);
    };
    println!(
        "==> {target}: {used} CPU-seconds in {} s of the clock",
        started.elapsed().as_secs()
    );
    if !stopped && !status.success() {
        bail!(
            "the fuzzer stopped on its own ({status}): look for a crash in {}",
            artifacts.display()
        );
    }
    Ok(())
}

/// utime + stime of `pid`, in clock ticks (proc(5), fields 14 and 15).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command may hold spaces and parentheses: the fields start after
    // the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // Field 3 (state) is rest[0]: 14 and 15 are rest[11] and rest[12].
    let u: u64 = fields.get(11)?.parse().ok()?;
    let s: u64 = fields.get(12)?.parse().ok()?;
    Some(u + s)
}

/// The kernel's clock ticks per second (`getconf CLK_TCK`; 100 if unknown).
fn clock_ticks() -> u64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|t| *t > 0)
        .unwrap_or(100)
}
