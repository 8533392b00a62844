//! `cargo xtask`: the developer entry points of vnat.
//!
//! Everything a contributor or CI needs goes through here so that the README
//! can name two commands (`cargo xtask demo`, `cargo xtask test`) and every
//! machine-specific step (Debian packages, the eBPF toolchain, bpffs) lives in
//! one place: `prereq.rs`. This crate builds with the stable toolchain and only
//! `anyhow` + `clap`, so `.ci/run` can use it on a fresh machine before
//! anything else is installed.
mod criu;
mod files;
mod fuzz;
mod kernels;
mod package;
mod package_check;
mod panics;
mod prereq;
mod run;
mod vm;

use std::ffi::OsString;

use anyhow::{bail, Result};
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
        cargo xtask test --kernel 6.1   the core integration tests on Debian 12's kernel, in a VM\n  \
        cargo xtask demo --kernel 6.12  the demo on Debian 13's kernel, in a VM\n  \
        cargo xtask bench NAME      run one benchmark from bench/src/bin\n  \
        cargo xtask package         build target/debian/vnat_<version>_amd64.deb\n  \
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
    /// members (no root needed, no eBPF attached). Phase 2 builds vnatd,
    /// vnatctl and the tests of vnat-tests, then runs each test executable
    /// with `--test-threads=N`; they create network namespaces, cgroups and
    /// bpffs pins. Each file has a time limit (`--file-timeout`): a file
    /// still running then fails, after a report of what every process
    /// waits on (state, kernel stacks, gdb backtraces when gdb is
    /// installed). Arguments after `--` are passed to the test binaries of
    /// both phases, e.g. a name filter: `cargo xtask test -- roam`.
    ///
    /// With `--kernel`, only the privileged phase runs, inside a VM that
    /// boots Debian's stock kernel of that version (qemu without KVM through
    /// virtme-ng, sharing this machine's root filesystem): vnatd, vnatctl
    /// and the test binaries are built here, then a core set of test files
    /// runs in the VM (see CORE_TESTS in xtask/src/vm/sets.rs), or the ones named
    /// by `--tests`, or all with `--all-tests`. The kernel package is fetched
    /// into target/kernels; qemu, busybox-static, kmod and virtme-ng are
    /// installed when missing.
    Test {
        /// Which phases to run (with --kernel: the privileged one only).
        #[arg(long, value_enum, default_value = "all")]
        phase: run::Phase,
        /// Parallel tests in the privileged phase (each test builds its own
        /// namespaces; a few at a time is what 2-core machines take).
        /// Default: 4, or 1 in a --kernel VM (qemu without KVM is slow enough that two at once miss the tests' deadlines).
        #[arg(long)]
        test_threads: Option<u32>,
        /// Run the privileged tests on Debian's stock kernel of this version,
        /// in a VM: 6.1 is Debian 12's, 6.12 Debian 13's.
        #[arg(long, value_enum)]
        kernel: Option<vm::Kernel>,
        /// The test files of the privileged phase to run (names of
        /// tests/tests/*.rs, comma-separated): all of them by default, the
        /// core set with --kernel.
        #[arg(long, value_delimiter = ',', conflicts_with = "all_tests")]
        tests: Option<Vec<String>>,
        /// With --kernel: run every test file instead of the core set.
        #[arg(long, requires = "kernel")]
        all_tests: bool,
        /// With --kernel: run the smoke set instead of the core set (SMOKE_TESTS
        /// in xtask/src/vm/sets.rs: every program through the verifier, the tc
        /// rewrite, a TCP and a UDP move, a move between NATs by real vnatd;
        /// about a fifth of the core set's time). CI runs it on 6.12.
        #[arg(long, requires = "kernel", conflicts_with_all = ["tests", "all_tests"])]
        smoke: bool,
        /// Fail a test file of the privileged phase that is still running
        /// after this many seconds (a hung test), after reporting what its
        /// processes wait on. Default: 600 s plus the unannounced-outage
        /// test's outage (VNAT_TEST_OUTAGE_SECS, 600 unless set) on the
        /// host; 1200 s in a --kernel VM.
        #[arg(long, value_name = "SECS")]
        file_timeout: Option<u64>,
        /// With --kernel: stop the tests in the VM after this many seconds.
        #[arg(long, requires = "kernel", default_value_t = vm::TEST_TIMEOUT_SECS)]
        vm_timeout: u64,
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
    /// With `--kernel`, the demo runs in a VM on Debian's stock kernel of
    /// that version (see `cargo xtask test --help`).
    Demo {
        /// Skip the prerequisite check.
        #[arg(long)]
        no_prereq: bool,
        /// Run the demo on Debian's stock kernel of this version, in a VM:
        /// 6.1 is Debian 12's, 6.12 Debian 13's.
        #[arg(long, value_enum)]
        kernel: Option<vm::Kernel>,
        /// With --kernel: stop the demo in the VM after this many seconds.
        #[arg(long, requires = "kernel", default_value_t = vm::DEMO_TIMEOUT_SECS)]
        vm_timeout: u64,
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
    /// Build the Debian package: target/debian/vnat_<version>_amd64.deb.
    ///
    /// Release binaries (vnatd with its eBPF programs built in, vnatctl),
    /// the systemd unit, /etc/vnat/vnatd.toml (every key commented out with
    /// its default), man pages vnatd(8), vnatctl(8), vnatd.toml(5) and
    /// bash, zsh and fish completions generated from the same clap
    /// definitions as --help, and iproute2 names for vnat's route protocol
    /// and table. Install it with `apt install ./target/debian/vnat_*.deb`.
    Package {
        /// Skip the prerequisite check.
        #[arg(long)]
        no_prereq: bool,
        /// Then install it into a scratch root and check it: files,
        /// conffiles, the installed binaries, man pages, completions in
        /// their shells, the unit (systemd-analyze verify), upgrade,
        /// removal and purge. Needs root.
        #[arg(long)]
        verify: bool,
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
        /// Stop after the fuzzer has used this many seconds of CPU instead
        /// (at nice 19, corpus kept in fuzz/corpus/TARGET): "one CPU-hour"
        /// is --cpu-seconds 3600 whatever else runs on the machine.
        #[arg(long, conflicts_with = "seconds")]
        cpu_seconds: Option<u64>,
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
            kernel,
            tests,
            all_tests,
            smoke,
            vm_timeout,
            file_timeout,
            no_prereq,
            args,
        } => {
            if file_timeout == Some(0) {
                bail!(
                    "--file-timeout 0 would fail every test file: give a number of seconds above 0"
                );
            }
            if kernel.is_some() && phase == run::Phase::Unit {
                bail!("--kernel runs the privileged integration tests only: the unprivileged ones have nothing kernel-specific");
            }
            if !no_prereq {
                prereq::run(false)?;
            }
            match kernel {
                Some(kernel) => {
                    let selection = match (tests, all_tests, smoke) {
                        (Some(names), _, _) => vm::Selection::Named(names),
                        (None, true, _) => vm::Selection::All,
                        (None, false, true) => vm::Selection::Smoke,
                        (None, false, false) => vm::Selection::Core,
                    };
                    let threads = test_threads.unwrap_or(1);
                    let file_limit = file_timeout.unwrap_or(files::VM_FILE_LIMIT_SECS);
                    vm::test(
                        &root, kernel, selection, threads, vm_timeout, file_limit, &args,
                    )
                }
                None => {
                    if all_tests {
                        bail!("--all-tests is for --kernel runs (without --kernel every test file runs)");
                    }
                    let files = tests.unwrap_or_default();
                    let available = run::rs_names(&root.join("tests/tests"))?;
                    if let Some(bad) = files.iter().find(|f| !available.contains(f)) {
                        bail!(
                            "unknown test file {bad}: the test files in tests/tests are {}",
                            available.join(", ")
                        );
                    }
                    let file_limit = file_timeout.unwrap_or_else(files::host_file_limit);
                    run::test(
                        &root,
                        phase,
                        test_threads.unwrap_or(4),
                        &files,
                        file_limit,
                        &args,
                    )
                }
            }
        }
        Command::Demo {
            no_prereq,
            kernel,
            vm_timeout,
            args,
        } => {
            if !no_prereq {
                prereq::run(false)?;
            }
            match kernel {
                Some(kernel) => vm::demo(&root, kernel, vm_timeout, &args),
                None => run::demo(&root, &args),
            }
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
            cpu_seconds,
            args,
        } => run::fuzz(&root, &target, seconds, cpu_seconds, &args),
        Command::Package { no_prereq, verify } => {
            if !no_prereq {
                prereq::run(false)?;
            }
            let deb = package::build(&root)?;
            if verify {
                package::verify(&root, &deb)?;
            }
            Ok(())
        }
    }
}
