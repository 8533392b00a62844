//! `cargo xtask`: the developer entry points of vnat.
//!
//! Everything a contributor or CI needs goes through here so that the README
//! can name two commands (`cargo xtask demo`, `cargo xtask test`) and every
//! machine-specific step (Debian packages, the eBPF toolchain, bpffs) lives in
//! one place: `prereq.rs`. This crate builds with the stable toolchain and only
//! `anyhow` + `clap`, so `.ci/run` can use it on a fresh machine before
//! anything else is installed.
mod criu;
mod prereq;
mod run;

use std::ffi::OsString;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    about = "vnat's developer tasks: prerequisites, tests, the demo, benchmarks and fuzzing.",
    long_about = "vnat's developer tasks: prerequisites, tests, the demo, benchmarks and fuzzing.\n\n\
        prereq, test, demo and bench need root: vnat's tests and demo load eBPF programs \
        and build hosts out of network namespaces. Run them as `sudo -E cargo xtask <command>`; \
        `prereq --check` and `fuzz` need no root.\n\n\
        Typical use:\n  \
        cargo xtask prereq          install what is missing (Debian packages, eBPF toolchain, bpffs)\n  \
        cargo xtask test            unit tests, then the privileged integration tests\n  \
        cargo xtask demo            build and run the roaming demo\n  \
        cargo xtask bench NAME      run one benchmark from bench/src/bin\n  \
        cargo xtask fuzz TARGET     fuzz one parser for a minute (cargo-fuzz, pinned nightly)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check and install what building and testing vnat needs (idempotent).
    ///
    /// Checks: running as root, cgroup v2 mounted, kernel BTF, kernel version
    /// and eBPF support. Installs when missing: the Debian packages (iproute2,
    /// socat, iperf3, openssh, netcat, ethtool, tcpdump, util-linux,
    /// llvm-22-dev, libpolly-22-dev), the pinned eBPF nightly toolchain with
    /// rust-src, bpf-linker, and mounts bpffs at /sys/fs/bpf. For the CRIU
    /// migration test only, CRIU 4.2 from Debian sid into /opt/vnat-criu when
    /// no CRIU 4.2+ passes `criu check` (a failure there is a warning: that
    /// test then skips). Prints one line per thing it installs; takes well
    /// under two seconds when nothing is missing.
    Prereq {
        /// Only report what is missing; install nothing and need no root.
        #[arg(long)]
        check: bool,
    },
    /// Run the tests: prereq, the unprivileged tests, then the privileged
    /// integration tests (crate vnat-tests).
    ///
    /// Phase 1 runs `cargo test --no-fail-fast` on the workspace's default
    /// members (no root needed, no eBPF attached). Phase 2 builds vnatd and
    /// vnatctl and runs `cargo test --no-fail-fast -p vnat-tests --
    /// --test-threads=N`, which creates network
    /// namespaces, cgroups and bpffs pins. Arguments after `--` are passed to
    /// the test binaries of both phases, e.g. a name filter:
    /// `cargo xtask test -- roam`.
    Test {
        /// Which phases to run.
        #[arg(long, value_enum, default_value = "all")]
        phase: run::Phase,
        /// Parallel tests in the privileged phase (each test builds its own
        /// namespaces; a few at a time is what 2-core machines take).
        #[arg(long, default_value_t = 4)]
        test_threads: u32,
        /// Skip the prerequisite check (for repeated runs on a prepared machine).
        #[arg(long)]
        no_prereq: bool,
        /// Extra arguments for the test binaries (after `--`).
        #[arg(last = true)]
        args: Vec<OsString>,
    },
    /// Build everything in release mode and run the demo (`vnat-demo` from
    /// the vnat-tests crate): a laptop roams between two networks while its
    /// live TCP connection to a server carries on, moved by real vnatd on
    /// both hosts.
    ///
    /// Arguments after `--` go to the demo; see `cargo xtask demo -- --help`.
    Demo {
        /// Skip the prerequisite check.
        #[arg(long)]
        no_prereq: bool,
        /// Arguments for vnat-demo (after `--`).
        #[arg(last = true)]
        args: Vec<OsString>,
    },
    /// Run one benchmark: `cargo run --release -p vnat-bench --bin NAME -- ARGS`.
    ///
    /// The names are the files in bench/src/bin; an unknown name lists them.
    /// Benchmarks print machine-readable results (see bench/).
    Bench {
        /// The benchmark to run (a file name in bench/src/bin without `.rs`).
        name: String,
        /// Skip the prerequisite check.
        #[arg(long)]
        no_prereq: bool,
        /// Arguments for the benchmark.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Fuzz one target of fuzz/ with cargo-fuzz and the pinned nightly:
    /// `cargo +NIGHTLY fuzz run TARGET -- -max_total_time=SECONDS`.
    ///
    /// Needs cargo-fuzz (`cargo install cargo-fuzz`); no root.
    Fuzz {
        /// The fuzz target (see `cargo +nightly-2026-05-20 fuzz list` in fuzz/).
        target: String,
        /// Stop after this many seconds.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Extra arguments for libFuzzer.
        #[arg(last = true)]
        args: Vec<OsString>,
    },
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = dispatch(cli) {
        // `{:#}` puts the whole context chain on one line after the sentence
        // that names what failed.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    let root = run::workspace_root()?;
    match cli.command {
        Command::Prereq { check } => prereq::run(check),
        Command::Test {
            phase,
            test_threads,
            no_prereq,
            args,
        } => {
            if !no_prereq {
                prereq::run(false)?;
            }
            run::test(&root, phase, test_threads, &args)
        }
        Command::Demo { no_prereq, args } => {
            if !no_prereq {
                prereq::run(false)?;
            }
            run::demo(&root, &args)
        }
        Command::Bench {
            name,
            no_prereq,
            args,
        } => {
            // Check the name before the (possibly slow) prerequisites.
            run::check_bench_name(&root, &name)?;
            if !no_prereq {
                prereq::run(false)?;
                prereq::bench_packages()?;
            }
            run::bench(&root, &name, &args)
        }
        Command::Fuzz {
            target,
            seconds,
            args,
        } => run::fuzz(&root, &target, seconds, &args),
    }
}
