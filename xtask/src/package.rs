//! `cargo xtask package`: the Debian package, `target/debian/vnat_<version>_amd64.deb`,
//! built with dpkg-deb from release binaries (the eBPF object is inside
//! vnatd), the files under packaging/, and the man pages and completions
//! that `vnatd --generate` and `vnatctl generate` print from their clap
//! definitions. `--verify` then installs it into a scratch root and checks
//! it as a user would (see [`verify`]).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, ensure, Context as _, Result};

use crate::run;

/// Where each packaged file comes from.
enum Source {
    /// A file of the repository.
    Repo(&'static str),
    /// What a built binary prints with `--generate WHAT`.
    Generated(&'static str, &'static str),
    /// A built binary.
    Binary(&'static str),
}

/// A file of the package: where it goes, its mode, what it is made of,
/// and whether it is gzipped (man pages).
struct Entry {
    path: &'static str,
    mode: u32,
    source: Source,
    gzip: bool,
}

const fn entry(path: &'static str, mode: u32, source: Source) -> Entry {
    Entry {
        path,
        mode,
        source,
        gzip: false,
    }
}

const fn man(path: &'static str, bin: &'static str, what: &'static str) -> Entry {
    Entry {
        path,
        mode: 0o644,
        source: Source::Generated(bin, what),
        gzip: true,
    }
}

/// Every file the package installs.
const FILES: &[Entry] = &[
    entry("usr/sbin/vnatd", 0o755, Source::Binary("vnatd")),
    entry("usr/bin/vnatctl", 0o755, Source::Binary("vnatctl")),
    entry(
        "usr/lib/systemd/system/vnatd.service",
        0o644,
        Source::Repo("packaging/systemd/vnatd.service"),
    ),
    entry(
        "etc/vnat/vnatd.toml",
        0o644,
        Source::Repo("packaging/vnatd.toml"),
    ),
    entry(
        "etc/iproute2/rt_protos.d/vnat.conf",
        0o644,
        Source::Repo("packaging/iproute2/rt_protos.d-vnat.conf"),
    ),
    entry(
        "etc/iproute2/rt_tables.d/vnat.conf",
        0o644,
        Source::Repo("packaging/iproute2/rt_tables.d-vnat.conf"),
    ),
    man("usr/share/man/man8/vnatd.8.gz", "vnatd", "man"),
    man("usr/share/man/man8/vnatctl.8.gz", "vnatctl", "man"),
    man("usr/share/man/man5/vnatd.toml.5.gz", "vnatd", "man-config"),
    entry(
        "usr/share/bash-completion/completions/vnatd",
        0o644,
        Source::Generated("vnatd", "bash"),
    ),
    entry(
        "usr/share/bash-completion/completions/vnatctl",
        0o644,
        Source::Generated("vnatctl", "bash"),
    ),
    entry(
        "usr/share/zsh/vendor-completions/_vnatd",
        0o644,
        Source::Generated("vnatd", "zsh"),
    ),
    entry(
        "usr/share/zsh/vendor-completions/_vnatctl",
        0o644,
        Source::Generated("vnatctl", "zsh"),
    ),
    entry(
        "usr/share/fish/vendor_completions.d/vnatd.fish",
        0o644,
        Source::Generated("vnatd", "fish"),
    ),
    entry(
        "usr/share/fish/vendor_completions.d/vnatctl.fish",
        0o644,
        Source::Generated("vnatctl", "fish"),
    ),
    entry(
        "usr/share/doc/vnat/README.md",
        0o644,
        Source::Repo("README.md"),
    ),
    entry(
        "usr/share/doc/vnat/copyright",
        0o644,
        Source::Repo("packaging/debian/copyright"),
    ),
];

/// The files dpkg keeps an administrator's changes of.
const CONFFILES: &[&str] = &[
    "/etc/vnat/vnatd.toml",
    "/etc/iproute2/rt_protos.d/vnat.conf",
    "/etc/iproute2/rt_tables.d/vnat.conf",
];

const SCRIPTS: &[&str] = &["postinst", "prerm", "postrm"];

/// The workspace's version (the package's).
fn version(root: &Path) -> Result<String> {
    let toml = fs::read_to_string(root.join("Cargo.toml"))?;
    toml.lines()
        .skip_while(|l| l.trim() != "[workspace.package]")
        .find_map(|l| {
            l.strip_prefix("version")
                .and_then(|v| v.trim().strip_prefix('='))
                .map(|v| v.trim().trim_matches('"').to_string())
        })
        .context("no version in [workspace.package] of Cargo.toml")
}

/// The package file `cargo xtask package` writes.
pub fn deb_path(root: &Path) -> Result<PathBuf> {
    Ok(root
        .join("target/debian")
        .join(format!("vnat_{}_amd64.deb", version(root)?)))
}

fn output(cmd: &mut Command) -> Result<Vec<u8>> {
    let shown = run::describe(cmd);
    let out = cmd
        .output()
        .with_context(|| format!("cannot run `{shown}`"))?;
    if !out.status.success() {
        bail!(
            "`{shown}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

/// The newest glibc symbol version the binaries need: the package's
/// dependency on libc6.
fn glibc_needed(bins: &[PathBuf]) -> Result<String> {
    let mut newest: (u32, u32) = (2, 17);
    for bin in bins {
        let text = String::from_utf8_lossy(&output(Command::new("objdump").arg("-T").arg(bin))?)
            .into_owned();
        for word in text.split_whitespace() {
            let Some(v) = word.strip_prefix("GLIBC_") else {
                continue;
            };
            let mut parts = v.split('.').map(|p| p.parse::<u32>());
            if let (Some(Ok(major)), Some(Ok(minor))) = (parts.next(), parts.next()) {
                newest = newest.max((major, minor));
            }
        }
    }
    Ok(format!("{}.{}", newest.0, newest.1))
}

/// Build the package; returns its path.
pub fn build(root: &Path) -> Result<PathBuf> {
    run::warn_build_skip();
    println!("==> building release binaries (vnatd with its eBPF programs, vnatctl)");
    let ok = run::cargo(root)
        .args([
            "build",
            "--release",
            "--locked",
            "-p",
            "vnat-daemon",
            "--bin",
            "vnatd",
            "-p",
            "vnatctl",
            "--bin",
            "vnatctl",
        ])
        .status()
        .context("cannot run cargo")?
        .success();
    ensure!(ok, "building the release binaries failed");
    let bin = |name: &str| root.join("target/release").join(name);
    let version = version(root)?;
    let stage = root.join(format!("target/debian/vnat_{version}_amd64"));
    if stage.exists() {
        fs::remove_dir_all(&stage).with_context(|| format!("cannot clear {}", stage.display()))?;
    }
    // The example config must be what vnatd says its keys are.
    let config = output(Command::new(bin("vnatd")).args(["--generate", "config"]))?;
    let shipped = fs::read(root.join("packaging/vnatd.toml"))?;
    ensure!(
        config == shipped,
        "packaging/vnatd.toml is not what vnatd's key table says: run `target/release/vnatd --generate config > packaging/vnatd.toml`"
    );
    for f in FILES {
        let dest = stage.join(f.path);
        fs::create_dir_all(dest.parent().expect("a packaged path has a directory"))?;
        let mut bytes = match f.source {
            Source::Repo(p) => {
                fs::read(root.join(p)).with_context(|| format!("cannot read {p}"))?
            }
            Source::Binary(b) => fs::read(bin(b))?,
            Source::Generated(b, what) => {
                // vnatd takes a flag, vnatctl (which has subcommands) a
                // hidden subcommand.
                let how = if b == "vnatctl" {
                    "generate"
                } else {
                    "--generate"
                };
                output(Command::new(bin(b)).args([how, what]))?
            }
        };
        if f.gzip {
            let raw = stage.join(format!("{}.raw", f.path));
            fs::write(&raw, &bytes)?;
            // -n: no name or time stamp, so the same input gives the same file.
            bytes = output(Command::new("gzip").args(["-9n", "-c"]).arg(&raw))?;
            fs::remove_file(&raw)?;
        }
        fs::write(&dest, bytes).with_context(|| format!("cannot write {}", dest.display()))?;
        fs::set_permissions(&dest, std::os::unix::fs::PermissionsExt::from_mode(f.mode))?;
    }
    let debian = stage.join("DEBIAN");
    fs::create_dir_all(&debian)?;
    for s in SCRIPTS {
        let dest = debian.join(s);
        fs::copy(root.join("packaging/debian").join(s), &dest)?;
        fs::set_permissions(&dest, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    }
    fs::write(debian.join("conffiles"), CONFFILES.join("\n") + "\n")?;
    let glibc = glibc_needed(&[bin("vnatd"), bin("vnatctl")])?;
    let size_kib = String::from_utf8_lossy(&output(Command::new("du").args(["-sk"]).arg(&stage))?)
        .split_whitespace()
        .next()
        .unwrap_or("0")
        .to_string();
    fs::write(
        debian.join("control"),
        format!(
            "Package: vnat\n\
             Version: {version}\n\
             Architecture: amd64\n\
             Maintainer: vnat developers <vnat@example.invalid>\n\
             Installed-Size: {size_kib}\n\
             Depends: libc6 (>= {glibc}), init-system-helpers (>= 1.52)\n\
             Recommends: iproute2\n\
             Suggests: criu\n\
             Section: net\n\
             Priority: optional\n\
             Description: keeps TCP and UDP connections alive when hosts move\n \
             vnatd keeps live connections working when an end host changes its IP\n \
             address: a laptop that roams or sleeps and wakes on another network, a\n \
             process restored on another host. Applications, kernels and protocols\n \
             stay unchanged; both ends run vnatd (UDP port 2031 between them).\n \
             .\n \
             This package has vnatd (eBPF programs built in), vnatctl, the systemd\n \
             unit, the configuration file, man pages and shell completions.\n"
        ),
    )?;
    let deb = deb_path(root)?;
    let ok = Command::new("dpkg-deb")
        .args(["--root-owner-group", "-Zxz", "--build"])
        .arg(&stage)
        .arg(&deb)
        .status()
        .context("cannot run dpkg-deb")?
        .success();
    ensure!(ok, "dpkg-deb failed");
    println!("==> wrote {}", deb.display());
    Ok(deb)
}

/// Install `deb` into a scratch root and check it as a user would:
/// `crate::package_check` does the checks.
pub fn verify(root: &Path, deb: &Path) -> Result<()> {
    crate::package_check::run(
        root,
        deb,
        &FILES.iter().map(|f| f.path).collect::<Vec<_>>(),
        CONFFILES,
    )
}
