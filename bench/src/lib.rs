//! Shared pieces of vnat's benchmarks (`bench/src/bin/*`): checks of the
//! environment, namespace hosts with their own datapath, an iperf3 driver,
//! a userspace delay line and summary statistics.
//!
//! Benchmarks build their hosts with the integration tests' harness
//! (`vnat-tests`), so they need root. Their numbers always come from the run
//! that prints them.
pub mod capture;
pub mod delayline;
pub mod env;
pub mod host;
pub mod iperf;
pub mod lines;
pub mod stats;

use std::path::PathBuf;

/// `bench/results/<name>.json`: where a benchmark writes its last result
/// (the directory is gitignored).
pub fn results_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("results")
        .join(format!("{name}.json"))
}

/// Writes `value` as pretty JSON to `path`, creating its directory.
pub fn write_json(path: &std::path::Path, value: &serde_json::Value) -> anyhow::Result<()> {
    use anyhow::Context;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(value)? + "\n";
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_signal(_: nix::libc::c_int) {
    INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Make SIGINT and SIGTERM set a flag instead of killing the benchmark, so
/// that it stops between runs and its Drops remove the namespaces.
pub fn catch_interrupts() {
    // SAFETY: the handler only stores to an atomic.
    unsafe {
        nix::libc::signal(
            nix::libc::SIGINT,
            on_signal as *const () as nix::libc::sighandler_t,
        );
        nix::libc::signal(
            nix::libc::SIGTERM,
            on_signal as *const () as nix::libc::sighandler_t,
        );
    }
}

/// Whether SIGINT or SIGTERM arrived since [`catch_interrupts`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst)
}

/// A benchmark's `main`: run `f`; an error or a panic (the harness reports
/// setup failures by panicking) is printed as one sentence prefixed with
/// `name`, after the Drops have cleaned up, and gives a failing exit status.
pub fn run_main(
    name: &'static str,
    f: impl FnOnce() -> anyhow::Result<()>,
) -> std::process::ExitCode {
    use std::panic::{self, AssertUnwindSafe};
    panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("a panic without a message");
        eprintln!("{name}: {msg}");
    }));
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => std::process::ExitCode::SUCCESS,
        Ok(Err(e)) => {
            eprintln!("{name}: {e:#}");
            std::process::ExitCode::FAILURE
        }
        Err(_) => std::process::ExitCode::FAILURE,
    }
}

/// The end of every benchmark: the table on stdout, or with `json` the
/// report on stdout and the table on stderr; then the report written to
/// `bench/results/NAME.json`.
pub fn emit(name: &str, json: bool, table: &str, report: &serde_json::Value) -> anyhow::Result<()> {
    if json {
        eprint!("{table}");
        println!("{}", serde_json::to_string(report)?);
    } else {
        print!("{table}");
    }
    let path = results_path(name);
    write_json(&path, report)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// Sleeps `d`, but ends with an error as soon as Ctrl-C was pressed (see
/// [`catch_interrupts`]), so a long wait in a benchmark stops promptly.
pub fn sleep_checked(d: std::time::Duration) -> anyhow::Result<()> {
    let end = std::time::Instant::now() + d;
    while std::time::Instant::now() < end {
        anyhow::ensure!(!interrupted(), "interrupted");
        std::thread::sleep(
            (end - std::time::Instant::now()).min(std::time::Duration::from_millis(100)),
        );
    }
    Ok(())
}
