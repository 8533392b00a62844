//! The test, demo, bench and fuzz flows: thin wrappers around cargo that
//! print which phase runs and how long it took.
use std::{
    ffi::OsString,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use crate::prereq::EBPF_TOOLCHAIN;

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Phase {
    /// Unprivileged tests only (`cargo test`, default members).
    Unit,
    /// Privileged integration tests only (vnat-tests).
    Integration,
    /// Both, in that order.
    All,
}

pub fn workspace_root() -> Result<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .map(Path::to_path_buf)
        .context("xtask's manifest directory has no parent")
}

pub(crate) fn cargo(root: &Path) -> Command {
    // `cargo` from PATH (the rustup proxy), run in the workspace so that
    // rust-toolchain.toml picks the pinned stable toolchain.
    let mut cmd = Command::new("cargo");
    cmd.current_dir(root);
    cmd
}

pub(crate) fn warn_build_skip() {
    if std::env::var_os("AYA_BUILD_SKIP").is_some() {
        println!(
            "warning: AYA_BUILD_SKIP is set: vnat-daemon is built without its eBPF programs, so anything that loads them will fail"
        );
    }
}

/// Runs `cmd`, inheriting the terminal; Ok(false) if it ran and failed.
fn status(cmd: &mut Command) -> Result<bool> {
    let shown = describe(cmd);
    println!("+ {shown}");
    let st = cmd
        .status()
        .with_context(|| format!("cannot run `{shown}`"))?;
    Ok(st.success())
}

/// Like [`status`], and keeps the lines that say which tests failed and
/// why (`panics`), to be printed again where a CI log is read.
fn status_keeping_failures(cmd: &mut Command) -> Result<(bool, Vec<String>)> {
    use std::{
        process::Stdio,
        sync::{mpsc, Arc, Mutex},
    };
    let shown = describe(cmd);
    println!("+ {shown}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run `{shown}`"))?;
    let collectors = [
        Arc::new(Mutex::new(crate::panics::Collector::default())),
        Arc::new(Mutex::new(crate::panics::Collector::default())),
    ];
    let (done_tx, done) = mpsc::channel();
    if let Some(out) = child.stdout.take() {
        crate::panics::tee(
            out,
            std::io::stdout(),
            collectors[0].clone(),
            done_tx.clone(),
        );
    }
    if let Some(err) = child.stderr.take() {
        crate::panics::tee(err, std::io::stderr(), collectors[1].clone(), done_tx);
    }
    let st = child
        .wait()
        .with_context(|| format!("waiting for `{shown}`"))?;
    let why = crate::panics::finish(&collectors, done);
    Ok((st.success(), why))
}

pub(crate) fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs `cmd` with its output captured; an error naming the command, its
/// status and what it printed if it fails.
pub(crate) fn output_ok(cmd: &mut Command) -> Result<std::process::Output> {
    let shown = describe(cmd);
    let out = cmd
        .output()
        .with_context(|| format!("cannot run `{shown}`"))?;
    if !out.status.success() {
        bail!(
            "`{shown}` failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

pub(crate) fn must(cmd: &mut Command) -> Result<()> {
    if status(cmd)? {
        Ok(())
    } else {
        bail!("`{}` failed", describe(cmd))
    }
}

fn phase_header(n: usize, total: usize, what: &str) -> Instant {
    println!("\n==> phase {n}/{total}: {what}");
    Instant::now()
}

fn phase_footer(what: &str, started: Instant, ok: bool) {
    let verdict = if ok { "passed" } else { "FAILED" };
    println!(
        "==> {what}: {verdict} in {:.1} s",
        started.elapsed().as_secs_f64()
    );
}

/// `files`: the test files (tests/tests/NAME.rs) of the privileged phase to
/// run; all when empty.
pub fn test(
    root: &Path,
    phase: Phase,
    test_threads: u32,
    files: &[String],
    file_limit: u64,
    args: &[OsString],
) -> Result<()> {
    warn_build_skip();
    let mut failed = Vec::new();
    let mut not_run = String::new();
    let total = if phase == Phase::All { 2 } else { 1 };
    let mut n = 0;

    if phase != Phase::Integration {
        n += 1;
        let what = "unprivileged tests (cargo test on the default members)";
        let t = phase_header(n, total, what);
        // Plain `cargo test` = the workspace's default members; `--workspace`
        // would pull in vnat-ebpf and the privileged vnat-tests.
        // --no-fail-fast: one failing test binary must not hide the others'
        // results (CI shows every failure in one run).
        // Its output is passed through and its failures repeated at the
        // end (a CI report keeps only the log's last screenful).
        let mut cmd = cargo(root);
        cmd.args(["test", "--no-fail-fast", "--"]).args(args);
        let (ok, why) = status_keeping_failures(&mut cmd)?;
        if !ok {
            println!("==> why the unprivileged tests failed:");
            if why.is_empty() {
                println!("    (no failed test named: see the output above, a build error?)");
            }
            for line in &why {
                println!("    {line}");
            }
        }
        phase_footer("unprivileged tests", t, ok);
        if !ok {
            failed.push("unprivileged tests");
        }
    }

    if phase != Phase::Unit {
        n += 1;
        let what = "privileged integration tests (vnat-tests: network namespaces, eBPF)";
        let t = phase_header(n, total, what);
        // The tests start vnatd and vnatctl as real processes; cargo builds
        // only vnat-tests' own binaries for its tests, so build these first
        // (same profile, same target dir: the harness finds them beside its
        // own binaries).
        // Tests that cannot run here (no CRIU) append a line to this file
        // (tests/src/harness/not_run.rs); they are listed after the run,
        // not left to read "ok".
        let skipped = root
            .join("target")
            .join(format!("vnat-skipped-{}.txt", std::process::id()));
        let _ = fs::remove_file(&skipped);
        let ok =
            status(cargo(root).args(["build", "-p", "vnat-daemon", "-p", "vnatctl", "--bins"]))?
                && match crate::prereq::kernel_check(&root.join("target/debug/vnatd")) {
                    Ok(()) => true,
                    Err(e) => {
                        println!("error: {e:#}");
                        false
                    }
                };
        // Each test executable runs by itself within its limit (files.rs):
        // a hung test fails its file with a report instead of stopping the
        // run. Like `cargo test --no-fail-fast`, every file runs.
        let mut bad_files = Vec::new();
        let mut why: Vec<(String, Vec<String>)> = Vec::new();
        if ok {
            let mut executables = crate::files::test_executables(root, files)?;
            // The library's unit tests first, then the files by name, as
            // cargo test runs them.
            executables.sort_by_key(|(name, _)| (!name.ends_with("(lib)"), name.clone()));
            let limit = Duration::from_secs(file_limit);
            let mut ran = 0u64;
            println!(
                "==> {} test executable(s), each within {} s",
                executables.len(),
                file_limit
            );
            for (name, exe) in &executables {
                let mut cmd = Command::new(exe);
                // cargo runs a package's tests in its directory.
                cmd.current_dir(root.join("tests"))
                    .env("VNAT_SKIP_REPORT", &skipped)
                    .args(crate::files::test_args(test_threads, args));
                match crate::files::run_file(name, cmd, limit)? {
                    crate::files::Outcome::Passed { ran: n } => ran += n,
                    crate::files::Outcome::Failed { panics } => {
                        bad_files.push(name.clone());
                        why.push((name.clone(), panics));
                    }
                    crate::files::Outcome::TimedOut => {
                        bad_files.push(format!("{name} (timed out)"))
                    }
                }
            }
            // Again at the end, where a CI log is read: what failed and why.
            for (name, panics) in &why {
                println!("==> why {name} failed:");
                if panics.is_empty() {
                    println!("    (no panic message: see its output above)");
                }
                for line in panics {
                    println!("    {line}");
                }
            }
            if !bad_files.is_empty() {
                println!("==> failed: {}", bad_files.join(", "));
            }
            // A filter after `--` that matches nothing (a typo, a test
            // renamed) ran nothing: that is no pass.
            if bad_files.is_empty() && ran == 0 && !executables.is_empty() {
                println!(
                    "==> no test ran: the arguments after `--` ({}) matched no test in {}",
                    args.iter()
                        .map(|a| a.to_string_lossy())
                        .collect::<Vec<_>>()
                        .join(" "),
                    executables
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                bad_files.push("(no test matched)".to_string());
            }
        }
        let ok = ok && bad_files.is_empty();
        phase_footer("privileged integration tests", t, ok);
        if !ok {
            failed.push("privileged integration tests");
        }
        not_run = fs::read_to_string(&skipped).unwrap_or_default();
        let _ = fs::remove_file(&skipped);
    }

    let not_run: Vec<&str> = not_run.lines().filter(|l| !l.trim().is_empty()).collect();
    if !not_run.is_empty() {
        println!(
            "\n==> {} test(s) did NOT run (counted as passed by cargo test):",
            not_run.len()
        );
        for line in &not_run {
            println!("    {line}");
        }
    }

    if !failed.is_empty() {
        bail!("{} failed", failed.join(" and "));
    }
    if not_run.is_empty() {
        println!("\nall tests passed");
    } else {
        println!(
            "\nall tests that ran passed; {} did not run (listed above)",
            not_run.len()
        );
    }
    Ok(())
}

pub fn demo(root: &Path, args: &[OsString]) -> Result<()> {
    build_demo(root)?;
    crate::prereq::kernel_check(&root.join("target/release/vnatd"))?;
    must(
        cargo(root)
            .args([
                "run",
                "--quiet",
                "--release",
                "-p",
                "vnat-tests",
                "--bin",
                "vnat-demo",
                "--",
            ])
            .args(args),
    )
}

/// Build vnatd, vnatctl and vnat-demo in release mode (the demo starts the
/// daemons as separate processes from the same target directory).
pub(crate) fn build_demo(root: &Path) -> Result<()> {
    warn_build_skip();
    let t = Instant::now();
    println!("==> building vnatd, vnatctl and the demo (release)");
    must(cargo(root).args([
        "build",
        "--release",
        "-p",
        "vnat-daemon",
        "-p",
        "vnatctl",
        "-p",
        "vnat-tests",
        "--bins",
    ]))?;
    println!("==> built in {:.1} s", t.elapsed().as_secs_f64());
    Ok(())
}

/// Benchmarks are the binaries in bench/src/bin: `NAME.rs` or `NAME/main.rs`.
fn bench_names(root: &Path) -> Result<Vec<String>> {
    rs_names(&root.join("bench/src/bin"))
}

/// Names of the Rust targets in `dir`: `NAME.rs` files and `NAME/main.rs`.
pub(crate) fn rs_names(dir: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs") {
            if let Some(stem) = path.file_stem() {
                names.push(stem.to_string_lossy().into_owned());
            }
        } else if path.join("main.rs").is_file() {
            if let Some(name) = path.file_name() {
                names.push(name.to_string_lossy().into_owned());
            }
        }
    }
    names.sort();
    Ok(names)
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none yet".to_string()
    } else {
        names.join(", ")
    }
}

pub fn check_bench_name(root: &Path, name: &str) -> Result<()> {
    let names = bench_names(root)?;
    if names.iter().any(|n| n == name) {
        return Ok(());
    }
    let list = if names.is_empty() {
        "none yet".to_string()
    } else {
        names.join(", ")
    };
    bail!("unknown benchmark `{name}`: the available ones are {list}")
}

pub fn bench(root: &Path, name: &str, args: &[OsString]) -> Result<()> {
    warn_build_skip();
    println!("==> benchmark {name}");
    // The benchmarks start vnatd, vnatctl, the test tools and each other
    // (scale runs restore) as separate processes from the release target
    // directory, so build those first.
    must(cargo(root).args([
        "build",
        "--quiet",
        "--release",
        "-p",
        "vnat-daemon",
        "-p",
        "vnatctl",
        "-p",
        "vnat-tests",
        "-p",
        "vnat-bench",
        "--bins",
    ]))?;
    must(
        cargo(root)
            .args([
                "run",
                "--quiet",
                "--release",
                "-p",
                "vnat-bench",
                "--bin",
                name,
                "--",
            ])
            .args(args),
    )?;
    if args.iter().any(|a| a == "-h" || a == "--help") {
        return Ok(());
    }
    // Every benchmark writes bench/results/NAME.json; the plots are drawn
    // from it with Debian's python3-matplotlib (installed with the
    // benchmarks' packages), so Debian's interpreter, not whatever python3
    // comes first on PATH.
    must(
        Command::new("/usr/bin/python3")
            .arg(root.join("bench/plot.py"))
            .arg(name)
            .arg(root.join("bench/results")),
    )
}

pub fn fuzz(
    root: &Path,
    target: &str,
    seconds: u64,
    cpu_seconds: Option<u64>,
    args: &[OsString],
) -> Result<()> {
    let dir = root.join("fuzz");
    if !dir.join("Cargo.toml").is_file() {
        bail!(
            "there is no fuzz/ crate yet (expected {}), so there is nothing to fuzz",
            dir.join("Cargo.toml").display()
        );
    }
    let targets = rs_names(&dir.join("fuzz_targets"))?;
    if !targets.iter().any(|t| t == target) {
        bail!(
            "unknown fuzz target `{target}`: the available ones are {}",
            list(&targets)
        );
    }
    let has_cargo_fuzz = Command::new("cargo")
        .args([&format!("+{EBPF_TOOLCHAIN}"), "fuzz", "--version"])
        .current_dir(&dir)
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_cargo_fuzz {
        bail!("cargo-fuzz is not installed: run `cargo install cargo-fuzz`, then retry");
    }
    if let Some(cpu) = cpu_seconds {
        return crate::fuzz::fuzz_cpu(root, target, cpu, args);
    }
    println!("==> fuzzing {target} for {seconds} s");
    // cargo-fuzz needs nightly for -Z sanitizer; reuse the eBPF nightly so
    // that no second nightly is needed.
    must(
        Command::new("cargo")
            .current_dir(&dir)
            .args([&format!("+{EBPF_TOOLCHAIN}"), "fuzz", "run", target, "--"])
            .arg(format!("-max_total_time={seconds}"))
            .args(args),
    )
}
