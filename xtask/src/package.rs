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

use anyhow::{ensure, Context as _, Result};

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
    path: String,
    mode: u32,
    source: Source,
    gzip: bool,
}

fn entry(path: &str, mode: u32, source: Source) -> Entry {
    Entry {
        path: path.to_string(),
        mode,
        source,
        gzip: false,
    }
}

/// Every file the package installs.
fn files() -> Vec<Entry> {
    let mut out = vec![
        entry("usr/sbin/vnatd", 0o755, Source::Binary("vnatd")),
        entry("usr/bin/vnatctl", 0o755, Source::Binary("vnatctl")),
    ];
    for (path, from) in [
        (
            "usr/lib/systemd/system/vnatd.service",
            "packaging/systemd/vnatd.service",
        ),
        ("etc/vnat/vnatd.toml", "packaging/vnatd.toml"),
        (
            "etc/iproute2/rt_protos.d/vnat.conf",
            "packaging/iproute2/rt_protos.d-vnat.conf",
        ),
        (
            "etc/iproute2/rt_tables.d/vnat.conf",
            "packaging/iproute2/rt_tables.d-vnat.conf",
        ),
        ("usr/share/doc/vnat/README.md", "README.md"),
        ("usr/share/doc/vnat/copyright", "packaging/debian/copyright"),
    ] {
        out.push(entry(path, 0o644, Source::Repo(from)));
    }
    for (path, bin, what) in [
        ("usr/share/man/man8/vnatd.8.gz", "vnatd", "man"),
        ("usr/share/man/man8/vnatctl.8.gz", "vnatctl", "man"),
        ("usr/share/man/man5/vnatd.toml.5.gz", "vnatd", "man-config"),
    ] {
        out.push(Entry {
            gzip: true,
            ..entry(path, 0o644, Source::Generated(bin, what))
        });
    }
    // Where each shell looks for a vendor's completion of command BIN.
    for bin in ["vnatd", "vnatctl"] {
        for (shell, path) in [
            (
                "bash",
                format!("usr/share/bash-completion/completions/{bin}"),
            ),
            ("zsh", format!("usr/share/zsh/vendor-completions/_{bin}")),
            (
                "fish",
                format!("usr/share/fish/vendor_completions.d/{bin}.fish"),
            ),
        ] {
            out.push(entry(&path, 0o644, Source::Generated(bin, shell)));
        }
    }
    out
}

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

/// stdout of `cmd`, which must succeed.
fn output(cmd: &mut Command) -> Result<Vec<u8>> {
    Ok(run::output_ok(cmd)?.stdout)
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
    run::must(run::cargo(root).args([
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
    ]))?;
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
    for f in files() {
        let dest = stage.join(&f.path);
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
    run::must(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(&stage)
            .arg(&deb),
    )?;
    println!("==> wrote {}", deb.display());
    Ok(deb)
}

/// Install `deb` into a scratch root and check it as a user would:
/// `crate::package_check` does the checks.
pub fn verify(root: &Path, deb: &Path) -> Result<()> {
    let paths: Vec<String> = files().into_iter().map(|f| f.path).collect();
    crate::package_check::run(root, deb, &paths, CONFFILES)
}
