//! `--kernel`: the demo and the privileged integration tests on Debian's
//! stock kernels, in a VM.
//!
//! vnat is developed on a recent kernel, but the kernels its users run are
//! Debian 12's 6.1 (no TCX: the tc programs attach with clsact) and Debian
//! 13's 6.12, whose verifiers and helpers differ. `--kernel` boots the real
//! Debian kernel, unmodified, with virtme-ng: qemu (TCG, since KVM guests hang
//! on the machines vnat is developed and tested on) with this machine's root
//! filesystem shared read-write, so the VM runs the binaries that were just
//! built here, as root, with the same tools installed.
//!
//! The kernel packages are fetched and unpacked under target/kernels by
//! `kernels.rs`; nothing is installed into the system. The VM's command writes
//! its exit status to a file under target/kernels/run-PID: vng's own exit
//! status says nothing about the command, and a missing file means that the
//! VM did not boot or died, which must never pass as success.
use std::{
    ffi::OsString,
    fs,
    io::{BufRead as _, BufReader, IsTerminal as _, Write as _},
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::mpsc::{self, RecvTimeoutError},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

pub use crate::kernels::Kernel;
use crate::kernels::{kernel_tree, Unpacked};
use crate::{files, prereq, run};

mod sets;
pub use sets::{Selection, CORE_TESTS, SMOKE_TESTS};

/// The virtme-ng release that boots the VMs (from PyPI, `python3 -m pip`).
/// Pinned: its command line and console behaviour (`--verbose` is what shows
/// the command's output) have changed between releases.
pub const VIRTME_NG_VERSION: &str = "1.42";

/// Kernel modules the tests and the demo need. virtme-ng mounts its own
/// /lib/modules, so they are loaded explicitly from the unpacked package with
/// `modprobe -d TREE` rather than relying on the kernel's autoloading: veth
/// and tun for the namespace hosts, nftables with NAT, masquerade and
/// conntrack matches for the routers and containers (nf_conntrack_netlink
/// for conntrack lookups), clsact/ingress and cls_bpf for the tc programs on
/// kernels without TCX, netem for the delay tests, and the sock_diag modules
/// for `ss`.
const VM_MODULES: &[&str] = &[
    "veth",
    "tun",
    "nf_tables",
    "nft_nat",
    "nft_masq",
    "nft_chain_nat",
    "nft_ct",
    "nf_conntrack_netlink",
    "sch_ingress",
    "sch_netem",
    "cls_bpf",
    "inet_diag",
    "tcp_diag",
    "udp_diag",
];

/// The workspace's binaries the tests start (`bin_path` in the harness),
/// copied into the VM's memory before the tests run.
const VM_BINARIES: &[&str] = &[
    "vnatd",
    "vnatctl",
    "vnat-stream",
    "vnat-repair",
    "vnat-freebind",
    "vnat-login1",
    "vnat-demo",
];

/// CPUs and memory of the VM: the machine has 2 cores, and the tests run two
/// at a time.
const VM_CPUS: &str = "2";
const VM_MEMORY: &str = "4G";

/// How long the VM may take to reach its command. A TCG boot takes about
/// 15 s; far longer means it hangs.
const BOOT_LIMIT: Duration = Duration::from_secs(300);

/// Default limits for the command inside the VM, in seconds.
pub const TEST_TIMEOUT_SECS: u64 = 3600;
pub const DEMO_TIMEOUT_SECS: u64 = 900;

/// The line the in-VM script prints first: everything before it is the
/// boot, which goes to the console log only.
const STARTED_MARKER: &str = "@@vnat-vm: started@@";

/// Everything a VM run needs on the host: the kernel and a `vng` to boot it.
struct Vm {
    kernel: Kernel,
    unpacked: Unpacked,
    vng: PathBuf,
    target: PathBuf,
}

/// `cargo xtask demo --kernel K`: build the release binaries on the host,
/// then run vnat-demo in the VM.
pub fn demo(root: &Path, kernel: Kernel, timeout_secs: u64, args: &[OsString]) -> Result<()> {
    let vm = prepare(root, kernel)?;
    run::build_demo(root)?;
    let demo = vm.target.join("release/vnat-demo");
    let mut body = String::new();
    body.push_str(&format!("cd {}\n", sh_quote(&path_str(root)?)));
    body.push_str(&format!(
        "{} --config /dev/null --check || echo '==> vnatd --check: vnatd cannot run on this kernel'\n",
        sh_quote(&path_str(&vm.target.join("release/vnatd"))?)
    ));
    body.push_str(&format!(
        "timeout -k 10 {timeout_secs} {}{}\n",
        sh_quote(&path_str(&demo)?),
        sh_args(args)?
    ));
    body.push_str("rc=$?\n");
    body.push_str(&format!(
        "if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo '==> the demo timed out after {timeout_secs} s'; fi\n\
         (exit $rc)\n"
    ));
    let what = format!("demo on {}", kernel.describe());
    println!("\n==> {what}");
    let t = Instant::now();
    let outcome = vm.boot(root, &body, timeout_secs)?;
    let ok = outcome.status == 0;
    footer(&what, t, ok);
    if !ok {
        bail!(
            "the demo failed on {} (exit status {}; console log: {})",
            kernel.describe(),
            outcome.status,
            shown(root, &outcome.log)
        );
    }
    outcome.clean_up();
    Ok(())
}

/// `cargo xtask test --kernel K`: build vnatd, vnatctl and the test binaries
/// on the host, then run the selected test binaries in the VM, one after the
/// other, each with `--test-threads=N` and the user's arguments.
pub fn test(
    root: &Path,
    kernel: Kernel,
    selection: Selection,
    test_threads: u32,
    timeout_secs: u64,
    file_limit_secs: u64,
    args: &[OsString],
) -> Result<()> {
    // Check the names before anything slow.
    let available = run::rs_names(&root.join("tests/tests"))?;
    // (file, the tests of it to run: all when empty).
    let from_set = |set: &[(&str, &[&str])]| -> Vec<(String, Vec<String>)> {
        set.iter()
            .map(|(f, t)| (f.to_string(), t.iter().map(|s| s.to_string()).collect()))
            .collect()
    };
    let chosen: Vec<(String, Vec<String>)> = match selection {
        Selection::Core => from_set(CORE_TESTS),
        Selection::Smoke => from_set(SMOKE_TESTS),
        Selection::Named(names) => names.into_iter().map(|n| (n, Vec::new())).collect(),
        Selection::All => available.iter().map(|n| (n.clone(), Vec::new())).collect(),
    };
    let names: Vec<String> = chosen.iter().map(|(n, _)| n.clone()).collect();
    let unknown: Vec<&str> = names
        .iter()
        .filter(|n| !available.contains(n))
        .map(String::as_str)
        .collect();
    if !unknown.is_empty() {
        bail!(
            "unknown test file(s) {}: the test files in tests/tests are {}",
            unknown.join(", "),
            available.join(", ")
        );
    }
    if names.is_empty() {
        bail!("no test file selected: name some with --tests NAME,NAME");
    }

    let vm = prepare(root, kernel)?;
    run::warn_build_skip();
    println!("==> building vnatd, vnatctl and the integration tests (debug)");
    run::must(run::cargo(root).args(["build", "-p", "vnat-daemon", "-p", "vnatctl", "--bins"]))?;
    let executables = files::test_executables(root, &names)?;

    let tests_dir = path_str(&root.join("tests"))?;
    let user_args = sh_args(args)?;
    let mut body = String::new();
    // One function per file: it runs the binary within its own limit and
    // what is left of the time budget, and records the outcome, so that a
    // hung file is reported by name, with what its processes wait on
    // (files.rs), and the files after it still run.
    body.push_str(files::HANG_REPORT_SH);
    body.push_str(&format!(
        "deadline=$(( $(date +%s) + {timeout_secs} ))\n\
         failed=''\n\
         bin=/tmp/vnat-bin\n\
         mkdir -p \"$bin/tests\"\n\
         cd {}\n\
         run_file() {{\n\
         \x20 name=\"$1\"; exe=\"$2\"; shift 2\n\
         \x20 left=$(( deadline - $(date +%s) ))\n\
         \x20 if [ $left -le 0 ]; then echo \"==> $name: not run (out of time)\"; failed=\"$failed $name\"; return; fi\n\
         \x20 limit={file_limit_secs}; [ $left -lt $limit ] && limit=$left\n\
         \x20 echo \"==> $name\"\n\
         \x20 start=$(date +%s)\n\
         \x20 cp \"$exe\" \"$bin/tests/$name\" && exe=\"$bin/tests/$name\"\n\
         \x20 \"$exe\" --test-threads={test_threads} \"$@\"{user_args} &\n\
         \x20 pid=$!\n\
         \x20 timed_out=''\n\
         \x20 while kill -0 $pid 2>/dev/null && [ -z \"$timed_out\" ]; do\n\
         \x20   if [ $(( $(date +%s) - start )) -ge $limit ]; then\n\
         \x20     timed_out=1\n\
         \x20     echo \"==> $name: TIMED OUT: still running after $limit s (the test running is the one above without a result). What the processes wait on:\"\n\
         \x20     hang_report $pid\n\
         \x20     kill_tree $pid\n\
         \x20   else\n\
         \x20     sleep 1\n\
         \x20   fi\n\
         \x20 done\n\
         \x20 wait $pid\n\
         \x20 rc=$?\n\
         \x20 rm -f \"$bin/tests/$name\"\n\
         \x20 secs=$(( $(date +%s) - start ))\n\
         \x20 if [ -n \"$timed_out\" ]; then echo \"==> $name: TIMED OUT after $secs s\"; failed=\"$failed $name\"\n\
         \x20 elif [ $rc -eq 0 ]; then echo \"==> $name: passed in $secs s\"\n\
         \x20 else echo \"==> $name: FAILED (exit status $rc) after $secs s\"; failed=\"$failed $name\"; fi\n\
         }}\n",
        sh_quote(&tests_dir)
    ));
    // The workspace's binaries run from a copy in the VM's own memory
    // (its /tmp is a tmpfs): the shared root is 9p without a page cache
    // (sync, cache=none), so every start of a binary there reads it over
    // 9p again, a second or two for a debug vnatctl, and the tests start
    // vnatctl, vnatd and vnat-stream hundreds of times. The harness finds
    // them through VNAT_BIN_DIR; the test executables are copied one at a
    // time (`run_file`), as together they would fill the VM's memory.
    body.push_str(&format!(
        "from=\"${{VNAT_BIN_DIR:-}}\"; [ -n \"$from\" ] || from={}\n\
         for b in {}; do [ -f \"$from/$b\" ] && cp \"$from/$b\" \"$bin/\"; done\n\
         export VNAT_BIN_DIR=\"$bin\"\n",
        sh_quote(&path_str(&vm.target.join("debug"))?),
        VM_BINARIES.join(" ")
    ));
    // What this kernel offers, as vnatd sees it, first in the log.
    let vnatd = "\"$bin/vnatd\"";
    let vnatctl = "\"$bin/vnatctl\"";
    body.push_str(&format!(
        "{vnatd} --config /dev/null --check || echo '==> vnatd --check: vnatd cannot run on this kernel'\n"
    ));
    // The cgroup BPF static keys stay on for the whole run, as the tc ones
    // do (see `Vm::script`): the tests attach and detach cgroup programs
    // all the time, and each first attach or last detach of a type
    // rewrites kernel code live, which TCG with two vCPUs can turn into an
    // oops or a hang. A vnatd of the VM's own, recording (and hiding
    // location for) an empty cgroup, keeps one program of each type
    // attached. It is in the VM's root namespace, which no test uses.
    body.push_str(&format!(
        "keys=/tmp/vnat-vm-keys\n\
         mkdir -p $keys /sys/fs/cgroup/vnat-vm-keys\n\
         {vnatd} --config /dev/null --bpffs /sys/fs/bpf/vnat-vm-keys --state-dir $keys/state \\\n\
         \x20   --control $keys/vnatd.sock --listen 127.0.0.1:2999 --cgroup /sys/fs/cgroup/vnat-vm-keys \\\n\
         \x20   --hide-location-cgroup /sys/fs/cgroup/vnat-vm-keys --no-sleep-inhibit --log-level warn \\\n\
         \x20   > $keys/log 2>&1 &\n\
         for i in $(seq 1 240); do {vnatctl} --control $keys/vnatd.sock status > /dev/null 2>&1 && break; sleep 0.5; done\n\
         {vnatctl} --control $keys/vnatd.sock status > /dev/null 2>&1 \\\n\
         \x20   || {{ echo 'warning: the vnatd that holds the cgroup static keys on did not start:'; tail -n 5 $keys/log; }}\n"
    ));
    for (name, tests) in &chosen {
        let exe = executables
            .iter()
            .find(|(n, _)| n == name)
            .with_context(|| format!("cargo built no test executable for tests/tests/{name}.rs"))?;
        // Named tests run by their exact names (a filter is a substring).
        let mut filters = String::new();
        for t in tests {
            filters.push(' ');
            filters.push_str(&sh_quote(t));
        }
        if !tests.is_empty() {
            filters.push_str(" --exact");
        }
        body.push_str(&format!(
            "run_file {} {}{filters}\n",
            sh_quote(name),
            sh_quote(&path_str(&exe.1)?)
        ));
    }
    body.push_str("echo \"$failed\" > \"$run/failed\"\n");
    body.push_str(
        "[ -z \"$failed\" ] && echo '==> every test file passed' || echo \"==> failed:$failed\"\n",
    );
    body.push_str("[ -z \"$failed\" ]\n");

    let what = format!("privileged integration tests on {}", kernel.describe());
    println!(
        "\n==> {what}: {} test file(s): {}",
        names.len(),
        names.join(", ")
    );
    let t = Instant::now();
    let outcome = vm.boot(root, &body, timeout_secs)?;
    let ok = outcome.status == 0;
    footer(&what, t, ok);
    if !ok {
        let failed = fs::read_to_string(outcome.dir.join("failed")).unwrap_or_default();
        let failed: Vec<&str> = failed.split_whitespace().collect();
        // Again at the end, where a CI log is read.
        if !outcome.panics.is_empty() {
            println!("==> why:");
            for line in &outcome.panics {
                println!("    {line}");
            }
        }
        bail!(
            "{} test file(s) failed on {}: {} (console log: {})",
            failed.len(),
            kernel.describe(),
            failed.join(", "),
            shown(root, &outcome.log)
        );
    }
    outcome.clean_up();
    Ok(())
}

fn footer(what: &str, started: Instant, ok: bool) {
    let verdict = if ok { "passed" } else { "FAILED" };
    println!(
        "==> {what}: {verdict} in {:.0} s",
        started.elapsed().as_secs_f64()
    );
}

/// Host prerequisites and the kernel: Debian packages, virtme-ng, and the
/// newest build of the kernel series, unpacked.
fn prepare(root: &Path, kernel: Kernel) -> Result<Vm> {
    if std::env::consts::ARCH != "x86_64" {
        bail!(
            "--kernel boots Debian's amd64 kernels and needs an x86_64 machine (this one is {})",
            std::env::consts::ARCH
        );
    }
    for dir in ["/tmp", "/var/tmp"] {
        if root.starts_with(dir) {
            bail!(
                "the workspace is under {dir}, which the VM does not share (it has its own): move it elsewhere to use --kernel"
            );
        }
    }
    prereq::vm_packages()?;
    let vng = virtme_ng()?;
    let target = target_dir(root);
    let unpacked = kernel_tree(&target.join("kernels"), kernel)?;
    Ok(Vm {
        kernel,
        unpacked,
        vng,
        target,
    })
}

fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) => root.join(d),
        None => root.join("target"),
    }
}

/// The `vng` of the pinned virtme-ng: the one on PATH if it is that
/// version, else installed with `python3 -m pip` (CI's python3 is pyenv's,
/// with pip) and run from that interpreter's scripts directory, which need
/// not be on PATH.
fn virtme_ng() -> Result<PathBuf> {
    if vng_version(Path::new("vng")).as_deref() == Some(VIRTME_NG_VERSION) {
        return Ok(PathBuf::from("vng"));
    }
    let out = Command::new("python3")
        .args([
            "-c",
            "import sysconfig; print(sysconfig.get_path('scripts'))",
        ])
        .stderr(Stdio::null())
        .output();
    let scripts = match out {
        Ok(out) if out.status.success() => {
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
        _ => bail!(
            "python3 is not on PATH: --kernel boots its VM with virtme-ng {VIRTME_NG_VERSION}, a Python program (install python3 with pip, or virtme-ng itself)"
        ),
    };
    let vng = scripts.join("vng");
    if vng_version(&vng).as_deref() == Some(VIRTME_NG_VERSION) {
        return Ok(vng);
    }
    println!("installing virtme-ng {VIRTME_NG_VERSION} (python3 -m pip; boots the kernel VMs)");
    prereq::run_quiet(
        Command::new("python3").args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("virtme-ng=={VIRTME_NG_VERSION}"),
        ]),
        &format!("installing virtme-ng {VIRTME_NG_VERSION} with python3 -m pip"),
    )?;
    if vng_version(&vng).as_deref() == Some(VIRTME_NG_VERSION) {
        return Ok(vng);
    }
    bail!(
        "virtme-ng {VIRTME_NG_VERSION} was installed with python3 -m pip, but {} is not it",
        vng.display()
    )
}

/// The version `vng --version` prints ("virtme-ng 1.42"), or None.
fn vng_version(vng: &Path) -> Option<String> {
    let out = Command::new(vng)
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .nth(1)
        .map(str::to_string)
}

/// What a VM run left: the command's exit status and its files.
struct Outcome {
    status: i32,
    dir: PathBuf,
    log: PathBuf,
    /// Each panic of the tests and its message (`panics.rs`).
    panics: Vec<String>,
}

impl Outcome {
    /// The run's directory is kept only when something failed.
    fn clean_up(self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

impl Vm {
    /// Boot the kernel with `body` as the command: a shell script run as
    /// root in the VM after the common setup (bpffs, modules, PATH), whose
    /// last command's exit status is the outcome. The VM's console goes to
    /// target/kernels/run-PID/console.log; the command's own output (not the
    /// kernel's log lines) is shown live. `limit_secs` bounds the command
    /// inside the VM; the host kills the VM if it overruns that by a margin.
    fn boot(&self, root: &Path, body: &str, limit_secs: u64) -> Result<Outcome> {
        let dir = self
            .target
            .join("kernels")
            .join(format!("run-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let log_path = dir.join("console.log");
        let status_path = dir.join("status");
        let script_path = dir.join("vm.sh");
        fs::write(&script_path, self.script(&dir, body)?)
            .with_context(|| format!("writing {}", script_path.display()))?;
        let mut log = fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;

        let (reader, writer) = std::io::pipe().context("creating a pipe for the VM's console")?;
        let mut cmd = Command::new(&self.vng);
        cmd.current_dir(root)
            // 9p, not virtiofs: Debian 12's qemu ships a virtiofsd that
            // virtme-ng fails to start, and it then falls back to 9p after
            // several seconds of retries.
            .args(["--disable-kvm", "--verbose", "--rw", "--force-9p"])
            .args(["--cpus", VM_CPUS, "--memory", VM_MEMORY])
            .arg("--run")
            .arg(self.unpacked.image())
            .arg("--exec")
            .arg(format!("bash {}", sh_quote(&path_str(&script_path)?)))
            .stdin(Stdio::null())
            .stdout(writer.try_clone().context("duplicating the console pipe")?)
            .stderr(writer)
            // Its own process group, so that a timeout ends vng, qemu and
            // anything else they started, and nothing else.
            .process_group(0);
        println!(
            "==> booting {} in a VM ({}; qemu without KVM, so slow)",
            self.kernel.describe(),
            self.unpacked.package
        );
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", self.vng.display()))?;
        // The Command holds the pipe's write ends: drop it so that the
        // reader sees the end once the VM's processes are gone.
        drop(cmd);

        let (tx, rx) = mpsc::channel::<()>();
        let pgid = child.id();
        let run_limit = Duration::from_secs(limit_secs + 120);
        let watchdog = thread::spawn(move || -> Option<String> {
            match rx.recv_timeout(BOOT_LIMIT) {
                Ok(()) => {}
                Err(RecvTimeoutError::Disconnected) => return None,
                Err(RecvTimeoutError::Timeout) => {
                    kill_group(pgid);
                    return Some(format!("it did not boot within {} s", BOOT_LIMIT.as_secs()));
                }
            }
            match rx.recv_timeout(run_limit) {
                Err(RecvTimeoutError::Timeout) => {
                    kill_group(pgid);
                    Some(format!(
                        "it was stopped after running for {} s",
                        run_limit.as_secs()
                    ))
                }
                _ => None,
            }
        });

        let mut seen_start = false;
        let mut panics = crate::panics::Collector::default();
        // The first line of a kernel crash, to name it in the error.
        let mut crash: Option<String> = None;
        let mut reader = BufReader::new(reader);
        let mut raw = Vec::new();
        let stdout = std::io::stdout();
        loop {
            raw.clear();
            match reader.read_until(b'\n', &mut raw) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    let _ = writeln!(log, "xtask: reading the console failed: {e}");
                    break;
                }
            }
            let _ = log.write_all(&raw);
            let text = String::from_utf8_lossy(&raw);
            let line = text.trim_end_matches(['\n', '\r']);
            if !seen_start {
                if line.contains(STARTED_MARKER) {
                    seen_start = true;
                    let _ = tx.send(());
                    println!(
                        "==> the VM booted in {:.1} s",
                        started.elapsed().as_secs_f64()
                    );
                }
                continue;
            }
            if crash.is_none()
                && ["Kernel panic", "Oops:", "BUG:", "general protection fault"]
                    .iter()
                    .any(|p| line.contains(p))
            {
                crash = Some(line.trim().to_string());
            }
            if !is_kernel_log(line) {
                panics.line(line);
                let mut out = stdout.lock();
                let _ = writeln!(out, "{line}");
                let _ = out.flush();
            }
        }
        drop(tx);
        let _ = child.wait();
        let killed = watchdog.join().unwrap_or(None);
        let _ = log.flush();

        let linux = format!("the Linux {} VM", self.kernel.short());
        let shown_log = shown(root, &log_path);
        match fs::read_to_string(&status_path) {
            Ok(s) => {
                let status = s.trim().parse().with_context(|| {
                    format!("{linux} wrote an unreadable exit status `{}` (see {shown_log})", s.trim())
                })?;
                Ok(Outcome {
                    status,
                    dir,
                    log: log_path,
                    panics: panics.take_lines(),
                })
            }
            Err(_) if !seen_start => match killed {
                Some(why) => bail!("{linux} did not boot: {why} (see {shown_log})"),
                None => bail!("{linux} did not boot (see {shown_log})"),
            },
            Err(_) => match (killed, crash) {
                (Some(why), _) => {
                    bail!("{linux} did not finish its command: {why} (see {shown_log})")
                }
                (None, Some(crash)) => bail!(
                    "{linux}'s kernel crashed before its command finished: `{crash}` (see {shown_log})"
                ),
                (None, None) => bail!(
                    "{linux} stopped before its command finished, so it crashed or was killed (see {shown_log})"
                ),
            },
        }
    }

    /// The whole in-VM script: the start marker, the setup, `body`, and the
    /// exit status written where the host reads it.
    fn script(&self, run_dir: &Path, body: &str) -> Result<String> {
        let mut s = String::new();
        s.push_str(&format!(
            "#!/bin/bash\n\
             # Written by cargo xtask for one VM run on {}; runs as root in the VM.\n\
             echo '{STARTED_MARKER}'\n\
             run={}\n",
            self.kernel.describe(),
            sh_quote(&path_str(run_dir)?)
        ));
        s.push_str(
            "mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf || echo 'warning: cannot mount bpffs at /sys/fs/bpf'\n",
        );
        s.push_str(&format!(
            "modprobe -d {} -a {} || echo 'warning: some kernel modules did not load'\n",
            sh_quote(&path_str(&self.unpacked.tree)?),
            VM_MODULES.join(" ")
        ));
        // The kernel's tc static keys (tcx_needed_key; ingress and
        // egress_needed_key before 6.6) stay on for the whole run: the
        // tests attach and detach tc all the time, and each time the count
        // goes between 0 and 1 the kernel rewrites its own code live
        // (text_poke_bp). Under TCG with two vCPUs that rewrite can oops
        // the other vCPU ("Oops: int3" in __netif_receive_skb_core, seen
        // on 6.12). A clsact qdisc on the VM's own lo holds the keys on.
        s.push_str(
            "tc qdisc add dev lo clsact || echo 'warning: no clsact qdisc on lo: the tc static keys will be patched live'\n",
        );
        // The host's PATH (pyenv, ~/.cargo/bin: the same tools as a run on
        // the host), HOME, and the variables the harness and Rust's test
        // runner read. The VM starts with a minimal environment of its own.
        let mut path = std::env::var("PATH").unwrap_or_default();
        let cargo_bin = match std::env::var_os("CARGO_HOME") {
            Some(h) => PathBuf::from(h).join("bin"),
            None => PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
                .join(".cargo/bin"),
        };
        let cargo_bin = path_str(&cargo_bin)?;
        if !path.split(':').any(|p| p == cargo_bin) {
            path = format!("{cargo_bin}:{path}");
        }
        path.push_str(":/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
        s.push_str(&format!("export PATH={}\n", sh_quote(&path)));
        for (k, v) in std::env::vars() {
            if k == "HOME"
                || k.starts_with("VNAT_")
                || k.starts_with("RUST_")
                || k.starts_with("CARGO_TERM_")
            {
                s.push_str(&format!("export {k}={}\n", sh_quote(&v)));
            }
        }
        // On a terminal the command keeps the VM's console as its terminal
        // (colours, as on the host); for a log (CI) its output goes through
        // a pipe, so that neither the test runner nor vnatd colours it.
        if std::io::stdout().is_terminal() {
            s.push_str(body);
        } else {
            s.push_str("set -o pipefail\n{\n");
            s.push_str(body);
            s.push_str("\n} 2>&1 | cat");
        }
        s.push_str(
            "\nrc=$?\n\
             echo $rc > \"$run/status.tmp\" && mv \"$run/status.tmp\" \"$run/status\"\n\
             sync\n\
             echo \"==> exit status in the VM: $rc\"\n",
        );
        Ok(s)
    }
}

/// Kernel log lines on the console start with a `[   12.345678]` stamp.
fn is_kernel_log(line: &str) -> bool {
    let Some(rest) = line.trim_start().strip_prefix('[') else {
        return false;
    };
    let Some(end) = rest.find(']') else {
        return false;
    };
    let stamp = rest[..end].trim();
    !stamp.is_empty() && stamp.bytes().all(|b| b.is_ascii_digit() || b == b'.')
}

/// Kill the process group `pgid` (vng, qemu and their children): only the
/// processes this run started.
fn kill_group(pgid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pgid}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// `path` relative to the workspace when it is inside it: shorter in errors.
fn shown(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// " 'a' 'b'": the arguments quoted for sh, each after a space.
fn sh_args(args: &[OsString]) -> Result<String> {
    let mut s = String::new();
    for a in args {
        let a = a.to_str().with_context(|| {
            format!("the argument {a:?} is not UTF-8, so it cannot be passed into the VM")
        })?;
        s.push(' ');
        s.push_str(&sh_quote(a));
    }
    Ok(s)
}

fn path_str(p: &Path) -> Result<String> {
    p.to_str().map(str::to_string).with_context(|| {
        format!(
            "the path {} is not UTF-8, so the VM cannot be told it",
            p.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_log_lines_are_told_apart() {
        assert!(is_kernel_log("[   12.345678] veth: loaded"));
        assert!(is_kernel_log("[0.000000] Linux version 6.1.0"));
        assert!(!is_kernel_log("test result: ok. 3 passed; 0 failed"));
        assert!(!is_kernel_log("[recorders] flood"));
        assert!(!is_kernel_log("[]"));
    }

    #[test]
    fn shell_quoting() {
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's"), "'it'\\''s'");
    }
}
