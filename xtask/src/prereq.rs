//! `cargo xtask prereq`: check the machine and install what is missing.
//!
//! Idempotent and fast when nothing is missing: every check is a file read or
//! one short command (`dpkg-query`, `rustup component list`,
//! `bpf-linker --version`); the slow installers run only for what is missing.
use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

/// The nightly that builds the eBPF programs (`-Z build-std=core` for
/// bpfel-unknown-none). Keep in sync with `vnat-daemon/build.rs`.
pub const EBPF_TOOLCHAIN: &str = "nightly-2026-05-20";
/// bpf-linker links the eBPF object; 0.13.0 is the release built against LLVM 22,
/// the LLVM of the pinned nightly.
pub const BPF_LINKER_VERSION: &str = "0.13.0";
/// LLVM major version bpf-linker is built against (Debian `llvm-22-dev`).
pub const LLVM_MAJOR: u32 = 22;

/// Debian packages the tests, the demo and the bpf-linker build need.
/// llvm/polly are bpf-linker's build and run-time dependencies (it links
/// libLLVM dynamically); the rest are the real peers and tools the integration
/// tests drive (socat and iperf3 as servers, sshd, nc, tcpdump for debugging,
/// nsenter from util-linux to enter namespaces without `ip netns exec`,
/// nftables for real NAT between namespace hosts, conntrack to make such
/// a NAT forget its mappings (a NAT reboot), python3 for the UDP
/// collector of the recorders' flood test, vsftpd and the ftp client for
/// hide location's FTP test, dbus-daemon for the system bus of the sleep
/// test's stand-in logind, etcd-server and etcd-client for the three-member
/// etcd clusters of the location-store tests, protobuf-compiler for
/// etcd-client's build, which compiles etcd's .proto files with protoc,
/// and libprotobuf-dev for the well-known types they import
/// (google/protobuf/descriptor.proto: without it protoc fails with "File
/// not found" on a machine that has only the compiler),
/// gdb for the backtraces of a test that hangs, which `cargo xtask test`
/// prints before it kills that test: xtask/src/files.rs).
const DEBIAN_PACKAGES: &[&str] = &[
    "iproute2",
    "nftables",
    "conntrack",
    "socat",
    "iperf3",
    "openssh-server",
    "openssh-client",
    "netcat-openbsd",
    "ethtool",
    "tcpdump",
    "util-linux",
    "python3",
    "vsftpd",
    "tnftp",
    "dbus-daemon",
    "etcd-server",
    "etcd-client",
    "protobuf-compiler",
    "libprotobuf-dev",
    "gdb",
    "llvm-22-dev",
    "libpolly-22-dev",
];

/// Debian packages only the benchmarks need (installed by `cargo xtask
/// bench`, so that CI's test run does not pay for them): sockperf for the
/// request/response latency of `overhead`, matplotlib for every benchmark's
/// PNG plots.
pub const BENCH_PACKAGES: &[&str] = &["sockperf", "python3-matplotlib"];

/// Debian packages only `--kernel` needs (the VM runs of `cargo xtask test`
/// and `demo`): qemu to run the VM, a static busybox for virtme-ng's
/// initramfs, kmod for depmod on the unpacked kernel, and the archive keyring
/// that the private apt configuration checks the kernel packages with.
pub const VM_PACKAGES: &[&str] = &[
    "qemu-system-x86",
    "busybox-static",
    "kmod",
    "debian-archive-keyring",
];

/// Install the benchmarks' Debian packages if any is missing.
pub fn bench_packages() -> Result<()> {
    ensure_packages(BENCH_PACKAGES)
}

/// What `cargo xtask package --verify` checks the package with: the
/// shells its completions load in, man, and objdump (the libc6 version).
pub const PACKAGE_CHECK_PACKAGES: &[&str] = &["zsh", "fish", "man-db", "binutils"];

/// Install the package check's Debian packages if any is missing.
pub fn package_check_packages() -> Result<()> {
    ensure_packages(PACKAGE_CHECK_PACKAGES)
}

/// Install the VM runs' Debian packages if any is missing.
pub fn vm_packages() -> Result<()> {
    ensure_packages(VM_PACKAGES)
}

fn ensure_packages(wanted: &[&str]) -> Result<()> {
    let missing = missing_packages(wanted)?;
    if !missing.is_empty() {
        if !is_root()? {
            bail!("{ROOT_SENTENCE}");
        }
        install_debian_packages(&missing)?;
    }
    Ok(())
}

const ROOT_SENTENCE: &str = "vnat's tests and demo load eBPF programs and create network \
    namespaces: run as root (sudo -E cargo xtask test)";

/// Runs every check; with `check_only` it installs nothing and fails if
/// something is missing.
pub fn run(check_only: bool) -> Result<()> {
    if !check_only && !is_root()? {
        bail!("{ROOT_SENTENCE}");
    }

    let mut missing = Vec::new();

    let packages = missing_debian_packages()?;
    if !packages.is_empty() {
        if check_only {
            missing.push(format!("Debian packages: {}", packages.join(" ")));
        } else {
            install_debian_packages(&packages)?;
            if packages.iter().any(|p| p == "vsftpd") {
                stop_vsftpd_service();
            }
            if packages.iter().any(|p| p == "etcd-server") {
                stop_etcd_service();
            }
        }
    }

    if !ebpf_toolchain_installed()? {
        if check_only {
            missing.push(format!("the {EBPF_TOOLCHAIN} toolchain with rust-src"));
        } else {
            install_ebpf_toolchain()?;
        }
    }

    match bpf_linker_version() {
        Some(v) if v == BPF_LINKER_VERSION => {}
        found => {
            if check_only {
                missing.push(format!(
                    "bpf-linker {BPF_LINKER_VERSION} (found: {})",
                    found.as_deref().unwrap_or("none")
                ));
            } else {
                install_bpf_linker()?;
            }
        }
    }

    if !bpffs_mounted()? {
        if check_only {
            missing.push("bpffs mounted at /sys/fs/bpf".to_string());
        } else {
            mount_bpffs()?;
        }
    }

    // Only for the CRIU migration test, which skips without it: never a
    // reason to stop here.
    crate::criu::ensure(check_only);

    if check_only {
        if !missing.is_empty() {
            bail!(
                "missing: {}; run `sudo -E cargo xtask prereq` to install them",
                missing.join(", ")
            );
        }
        println!("prereq: everything is in place");
    }
    // The kernel is vnatd's to judge: once it is built, ask it (cargo
    // xtask test and demo ask right after building it).
    match built_vnatd() {
        Some(vnatd) if is_root()? => kernel_check(&vnatd)?,
        Some(_) => println!("note: run as root to check the kernel with `vnatd --check`"),
        None => println!(
            "note: the kernel is checked by `vnatd --check` once vnatd is built (cargo xtask test and demo check it after building)"
        ),
    }
    Ok(())
}

/// Effective uid 0, read from /proc so that xtask needs no libc binding.
fn is_root() -> Result<bool> {
    let status = fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let uid_line = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .context("no Uid line in /proc/self/status")?;
    // Fields: real, effective, saved, filesystem.
    let euid = uid_line
        .split_whitespace()
        .nth(1)
        .context("malformed Uid line in /proc/self/status")?;
    Ok(euid == "0")
}

/// What the kernel offers vnat, as vnatd itself asks it (`vnatd --check`,
/// the same probes vnatd runs at start, never a guess from the version):
/// its report is printed, and a kernel vnatd cannot run on stops here.
pub fn kernel_check(vnatd: &Path) -> Result<()> {
    println!(
        "==> the kernel, as vnatd sees it ({} --check)",
        vnatd.display()
    );
    let st = Command::new(vnatd)
        .args(["--config", "/dev/null", "--check"])
        .status()
        .with_context(|| format!("cannot run {}", vnatd.display()))?;
    match st.code() {
        Some(0) => Ok(()),
        Some(1) => {
            bail!("vnatd cannot run on this kernel: see the MISSING lines of `vnatd --check` above")
        }
        _ => bail!("`{} --check` failed ({st})", vnatd.display()),
    }
}

/// The newest vnatd built in `target/` (release or debug), if any.
fn built_vnatd() -> Option<std::path::PathBuf> {
    let root = crate::run::workspace_root().ok()?;
    ["target/release/vnatd", "target/debug/vnatd"]
        .iter()
        .map(|p| root.join(p))
        .filter_map(|p| Some((fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
}

/// (mount point, fstype) pairs from /proc/mounts.
fn mounts() -> Result<Vec<(String, String)>> {
    let text = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    Ok(text
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let _source = f.next()?;
            Some((f.next()?.to_string(), f.next()?.to_string()))
        })
        .collect())
}

fn bpffs_mounted() -> Result<bool> {
    Ok(mounts()?
        .iter()
        .any(|(p, ty)| p == "/sys/fs/bpf" && ty == "bpf"))
}

fn mount_bpffs() -> Result<()> {
    println!("mounting bpffs at /sys/fs/bpf");
    fs::create_dir_all("/sys/fs/bpf").context("creating /sys/fs/bpf")?;
    run_quiet(
        Command::new("mount").args(["-t", "bpf", "bpf", "/sys/fs/bpf"]),
        "mounting bpffs at /sys/fs/bpf",
    )
}

fn missing_debian_packages() -> Result<Vec<String>> {
    missing_packages(DEBIAN_PACKAGES)
}

fn missing_packages(wanted: &[&str]) -> Result<Vec<String>> {
    let out = match Command::new("dpkg-query")
        .args(["-W", "-f=${Package} ${db:Status-Status}\n"])
        .args(wanted)
        .stderr(Stdio::null())
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "this is not a Debian-like machine (no dpkg-query): install these packages by hand, then re-run: {}",
            wanted.join(" ")
        ),
        Err(e) => return Err(e).context("running dpkg-query"),
    };
    // dpkg-query exits 1 when some package is unknown; stdout still lists the
    // known ones, so the exit status carries no extra information here.
    let text = String::from_utf8_lossy(&out.stdout);
    let installed: Vec<&str> = text
        .lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(_, status)| *status == "installed")
        .map(|(name, _)| name.split(':').next().unwrap_or(name))
        .collect();
    Ok(wanted
        .iter()
        .filter(|p| !installed.contains(p))
        .map(|p| p.to_string())
        .collect())
}

fn install_debian_packages(packages: &[String]) -> Result<()> {
    println!("installing Debian packages: {}", packages.join(" "));
    run_quiet(
        apt().args(["-q", "update"]),
        "updating the Debian package lists (apt-get update)",
    )?;
    run_quiet(
        apt()
            .args(["-q", "-y", "--no-install-recommends", "install"])
            .args(packages),
        &format!("installing the Debian packages {}", packages.join(" ")),
    )
}

/// The tests run their own vsftpd in a namespace; the package's service
/// (an FTP server on port 21 of the host, local logins allowed) is not
/// wanted, so on a machine run by systemd it is stopped and disabled right
/// after the install that brought it. An install by the user is left alone.
/// Debian's etcd-server starts a system etcd on 2379/2380; the tests run
/// their own members in their namespaces, and a host running vnat's tests
/// has no use for it.
fn stop_etcd_service() {
    if !Path::new("/run/systemd/system").exists() {
        return;
    }
    match Command::new("systemctl")
        .args(["disable", "--now", "etcd.service"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(st) if st.success() => {
            println!("stopped and disabled etcd.service (the tests start their own etcd members)")
        }
        _ => println!(
            "note: could not stop etcd.service; stop it with `systemctl disable --now etcd` if this host should not run etcd"
        ),
    }
}

fn stop_vsftpd_service() {
    if !Path::new("/run/systemd/system").exists() {
        return;
    }
    match Command::new("systemctl")
        .args(["disable", "--now", "vsftpd.service"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(st) if st.success() => {
            println!("stopped and disabled vsftpd.service (the tests start their own vsftpd)")
        }
        _ => println!(
            "note: could not stop vsftpd.service; stop it with `systemctl disable --now vsftpd` if this host should not serve FTP"
        ),
    }
}

fn apt() -> Command {
    let mut cmd = Command::new("apt-get");
    // CI has no terminal: never ask (iperf3 and openssh-server have debconf questions).
    cmd.env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null());
    cmd
}

fn ebpf_toolchain_installed() -> Result<bool> {
    let out = match Command::new("rustup")
        .args(["component", "list", "--installed", "--toolchain", EBPF_TOOLCHAIN])
        .stderr(Stdio::null())
        .output()
    {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "rustup is not installed: the eBPF programs need the {EBPF_TOOLCHAIN} toolchain, which xtask installs with rustup (https://rustup.rs)"
        ),
        Err(e) => return Err(e).context("running rustup"),
    };
    // A toolchain that is not installed makes rustup fail: that is "missing".
    Ok(out.status.success()
        && String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l.trim() == "rust-src"))
}

fn install_ebpf_toolchain() -> Result<()> {
    println!("installing Rust toolchain {EBPF_TOOLCHAIN} with rust-src (builds the eBPF programs)");
    run_quiet(
        Command::new("rustup").args([
            "toolchain",
            "install",
            EBPF_TOOLCHAIN,
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]),
        &format!("installing the Rust toolchain {EBPF_TOOLCHAIN} with rust-src"),
    )
}

/// The installed bpf-linker's version, from `bpf-linker --version`
/// ("bpf-linker 0.13.0"), or None when it is not on PATH.
fn bpf_linker_version() -> Option<String> {
    let out = Command::new("bpf-linker")
        .arg("--version")
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace().nth(1).map(str::to_string)
}

fn install_bpf_linker() -> Result<()> {
    println!("installing bpf-linker {BPF_LINKER_VERSION} (cargo install, about 2 minutes)");
    let llvm_prefix = format!("/usr/lib/llvm-{LLVM_MAJOR}");
    run_quiet(
        Command::new("cargo").env("LLVM_PREFIX", &llvm_prefix).args([
            "install",
            "bpf-linker",
            "--force",
            "--version",
            BPF_LINKER_VERSION,
            "--no-default-features",
            "--features",
            &format!("llvm-{LLVM_MAJOR}"),
        ]),
        &format!("installing bpf-linker {BPF_LINKER_VERSION} against LLVM {LLVM_MAJOR} (cargo install bpf-linker)"),
    )?;
    match bpf_linker_version() {
        Some(v) if v == BPF_LINKER_VERSION => Ok(()),
        Some(v) => bail!(
            "bpf-linker {BPF_LINKER_VERSION} was installed but `bpf-linker` on PATH is still version {v}: remove the other one or put ~/.cargo/bin first on PATH"
        ),
        None => bail!(
            "bpf-linker {BPF_LINKER_VERSION} was installed but is not on PATH: add ~/.cargo/bin (or $CARGO_HOME/bin) to PATH"
        ),
    }
}

/// Runs an installer with its output captured; on failure the error names
/// `what` and carries the tail of the output, so the one sentence comes first
/// and the details are still there to read.
pub(crate) fn run_quiet(cmd: &mut Command, what: &str) -> Result<()> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{what} failed: cannot run `{program}`"))?;
    if out.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    let tail = lines[lines.len().saturating_sub(25)..].join("\n");
    bail!(
        "{what} failed ({program} exited with {}); its last output:\n{tail}",
        out.status
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vnat-daemon/build.rs builds the eBPF crate with its own copy of the
    /// toolchain name; the two must agree or prereq installs the wrong one.
    #[test]
    fn ebpf_toolchain_matches_daemon_build_script() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vnat-daemon/build.rs");
        let build_rs = fs::read_to_string(&path).expect("reading vnat-daemon/build.rs");
        assert!(
            build_rs.contains(&format!("\"{EBPF_TOOLCHAIN}\"")),
            "vnat-daemon/build.rs does not name {EBPF_TOOLCHAIN}: keep EBPF_TOOLCHAIN in sync"
        );
    }
}
