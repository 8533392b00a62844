//! Debian's stock kernels for `--kernel` (`vm.rs`): which packages make a
//! series, fetching the newest build through a private apt configuration
//! under target/kernels (never the system's sources), and unpacking it there
//! with `dpkg -x` and `depmod`. Nothing is installed into the system.

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::prereq;

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Kernel {
    /// Debian 12 (bookworm): linux-image-6.1.0-N-amd64-unsigned.
    #[value(name = "6.1")]
    Linux6_1,
    /// Debian 13 (trixie): linux-image-6.12.N+deb13-amd64-unsigned.
    #[value(name = "6.12")]
    Linux6_12,
}

/// Where a kernel series comes from: the Debian release whose stock kernel it
/// is, and the package names of its builds (`PREFIX<number>SUFFIX`, where
/// the number grows with every new build: the ABI number for 6.1, the patch
/// level for 6.12). Only the generic flavour matches: cloud and rt kernels
/// have other suffixes.
struct Series {
    short: &'static str,
    debian: &'static str,
    suite: &'static str,
    prefix: &'static str,
    suffix: &'static str,
}

impl Kernel {
    fn series(self) -> Series {
        match self {
            Kernel::Linux6_1 => Series {
                short: "6.1",
                debian: "Debian 12",
                suite: "bookworm",
                prefix: "linux-image-6.1.0-",
                suffix: "-amd64-unsigned",
            },
            Kernel::Linux6_12 => Series {
                short: "6.12",
                debian: "Debian 13",
                suite: "trixie",
                prefix: "linux-image-6.12.",
                suffix: "+deb13-amd64-unsigned",
            },
        }
    }

    /// "Linux 6.1 (Debian 12's stock kernel)".
    pub fn describe(self) -> String {
        let s = self.series();
        format!("Linux {} ({}'s stock kernel)", s.short, s.debian)
    }

    pub fn short(self) -> &'static str {
        self.series().short
    }
}

/// An unpacked kernel package: `tree` holds boot/vmlinuz-VERSION and
/// lib/modules/VERSION with depmod's indexes.
pub(crate) struct Unpacked {
    pub package: String,
    pub tree: PathBuf,
    pub version: String,
}

impl Unpacked {
    pub fn image(&self) -> PathBuf {
        self.tree
            .join("boot")
            .join(format!("vmlinuz-{}", self.version))
    }
}

/// A private apt configuration for one Debian suite under `dir`: its own
/// sources, lists and cache, no dpkg status and no pinning, so that the
/// system's sources and package state are neither used nor touched.
fn apt_private(program: &str, dir: &Path) -> Command {
    let mut cmd = Command::new(program);
    let opt = |k: &str, v: &Path| format!("{k}={}", v.display());
    cmd.env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .args([
            "-o",
            &opt("Dir::Etc::SourceList", &dir.join("sources.list")),
        ])
        .args(["-o", "Dir::Etc::SourceParts=/nonexistent"])
        .args(["-o", "Dir::Etc::Preferences=/dev/null"])
        .args(["-o", "Dir::Etc::PreferencesParts=/nonexistent"])
        .args(["-o", &opt("Dir::State::Lists", &dir.join("lists"))])
        .args(["-o", &opt("Dir::Cache", &dir.join("cache"))])
        .args(["-o", "Dir::State::status=/dev/null"])
        // Downloads land in target/, which apt's sandbox user cannot write.
        .args(["-o", "APT::Sandbox::User=root"])
        .args([
            "-o",
            "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false",
        ])
        .args(["-o", "Acquire::Languages=none"]);
    cmd
}

/// The newest build of `kernel` from Debian's archive, unpacked under
/// `kernels` (reused when that build is already there). Without the archive
/// (no network), the newest build already unpacked is used.
pub(crate) fn kernel_tree(kernels: &Path, kernel: Kernel) -> Result<Unpacked> {
    let series = kernel.series();
    let apt_dir = kernels.join(format!("apt-{}", series.suite));
    for d in ["lists/partial", "cache/archives/partial"] {
        fs::create_dir_all(apt_dir.join(d))
            .with_context(|| format!("creating {}", apt_dir.join(d).display()))?;
    }
    let sources = format!(
        "# Written by cargo xtask (--kernel): {debian}'s stock kernel.\n\
         deb [signed-by={KEYRING}] http://deb.debian.org/debian {s} main\n\
         deb [signed-by={KEYRING}] http://deb.debian.org/debian {s}-updates main\n\
         deb [signed-by={KEYRING}] http://deb.debian.org/debian-security {s}-security main\n",
        debian = series.debian,
        s = series.suite,
    );
    fs::write(apt_dir.join("sources.list"), sources)
        .with_context(|| format!("writing {}", apt_dir.join("sources.list").display()))?;

    let cached = newest_unpacked(kernels, kernel)?;
    let update = prereq::run_quiet(
        apt_private("apt-get", &apt_dir).args(["-q", "update"]),
        &format!(
            "updating the package lists of Debian {} (apt-get update, private configuration)",
            series.suite
        ),
    );
    if let Err(e) = update {
        return match cached {
            Some(u) => {
                println!(
                    "note: Debian's archive is out of reach, so {} uses the kernel already unpacked: {}",
                    kernel.describe(),
                    u.package
                );
                Ok(u)
            }
            None => Err(e),
        };
    }
    let out = apt_private("apt-cache", &apt_dir)
        .args(["pkgnames", series.prefix])
        .stderr(Stdio::null())
        .output()
        .context("cannot run apt-cache")?;
    let names = String::from_utf8_lossy(&out.stdout);
    let Some(package) = newest_package(names.lines(), &series) else {
        bail!(
            "Debian {}'s package lists have no {}N{} package",
            series.suite,
            series.prefix,
            series.suffix
        );
    };
    if let Some(u) = cached.filter(|u| u.package == package) {
        return Ok(u);
    }
    unpack(kernels, &apt_dir, kernel, &package)
}

const KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// The build number of a package name of `series`, if it is one.
fn build_number(name: &str, series: &Series) -> Option<u32> {
    let middle = name
        .strip_prefix(series.prefix)?
        .strip_suffix(series.suffix)?;
    if middle.is_empty() || !middle.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    middle.parse().ok()
}

fn newest_package<'a>(names: impl Iterator<Item = &'a str>, series: &Series) -> Option<String> {
    names
        .map(str::trim)
        .filter_map(|n| build_number(n, series).map(|b| (b, n)))
        .max_by_key(|(b, _)| *b)
        .map(|(_, n)| n.to_string())
}

/// The newest package of `kernel` already unpacked under `kernels`.
fn newest_unpacked(kernels: &Path, kernel: Kernel) -> Result<Option<Unpacked>> {
    let series = kernel.series();
    let mut best: Option<(u32, Unpacked)> = None;
    for (package, tree) in unpacked_trees(kernels, &series)? {
        let Some(version) = image_version(&tree) else {
            continue;
        };
        let b = build_number(&package, &series).unwrap_or(0);
        if best.as_ref().is_none_or(|(bb, _)| b > *bb) {
            best = Some((
                b,
                Unpacked {
                    package,
                    tree,
                    version,
                },
            ));
        }
    }
    Ok(best.map(|(_, u)| u))
}

/// (package, directory) of every unpacked tree of `series` under `kernels`.
fn unpacked_trees(kernels: &Path, series: &Series) -> Result<Vec<(String, PathBuf)>> {
    let mut found = Vec::new();
    let entries = match fs::read_dir(kernels) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(e).with_context(|| format!("listing {}", kernels.display())),
    };
    for entry in entries {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if path.is_dir() && build_number(name, series).is_some() {
            found.push((name.to_string(), path.clone()));
        }
    }
    Ok(found)
}

/// VERSION of the tree's boot/vmlinuz-VERSION.
fn image_version(tree: &Path) -> Option<String> {
    fs::read_dir(tree.join("boot"))
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_prefix("vmlinuz-")
                .map(str::to_string)
        })
        .next()
}

/// Download `package` with the private apt configuration, unpack it with
/// `dpkg -x` (never installed) and index its modules with depmod. The tree
/// is built beside its final place and renamed at the end, so an
/// interrupted unpack is never taken for a ready kernel. Older builds of the
/// same series are removed (about 400 MB each).
fn unpack(kernels: &Path, apt_dir: &Path, kernel: Kernel, package: &str) -> Result<Unpacked> {
    let series = kernel.series();
    println!(
        "fetching {} for {} (Debian {}; unpacked under {}, not installed)",
        package,
        kernel.describe(),
        series.suite,
        kernels.display()
    );
    let download = kernels.join("download");
    let _ = fs::remove_dir_all(&download);
    fs::create_dir_all(&download).with_context(|| format!("creating {}", download.display()))?;
    prereq::run_quiet(
        apt_private("apt-get", apt_dir)
            .current_dir(&download)
            .args(["-q", "download", package]),
        &format!("downloading {package} (apt-get download, private configuration)"),
    )?;
    let deb = fs::read_dir(&download)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| {
            format!(
                "apt-get download {package} left no .deb file in {}",
                download.display()
            )
        })?;

    let partial = kernels.join(format!("{package}.partial"));
    let _ = fs::remove_dir_all(&partial);
    prereq::run_quiet(
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&partial),
        &format!("unpacking {}", deb.display()),
    )?;
    // Debian 13's packages put the modules under usr/lib/modules; modprobe
    // -d and virtme-ng look under lib/modules.
    if !partial.join("lib").exists() {
        std::os::unix::fs::symlink("usr/lib", partial.join("lib"))
            .with_context(|| format!("linking lib to usr/lib in {}", partial.display()))?;
    }
    let version = image_version(&partial)
        .with_context(|| format!("{package} has no boot/vmlinuz-VERSION"))?;
    prereq::run_quiet(
        Command::new("depmod").arg("-b").arg(&partial).arg(&version),
        &format!("indexing the modules of {package} (depmod)"),
    )?;
    let tree = kernels.join(package);
    let _ = fs::remove_dir_all(&tree);
    fs::rename(&partial, &tree)
        .with_context(|| format!("renaming {} to {}", partial.display(), tree.display()))?;
    let _ = fs::remove_dir_all(&download);
    for (other, dir) in unpacked_trees(kernels, &series)? {
        if other != package {
            let _ = fs::remove_dir_all(dir);
        }
    }
    Ok(Unpacked {
        package: package.to_string(),
        tree,
        version,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newest_package_compares_numbers_not_strings() {
        let s = Kernel::Linux6_1.series();
        let names = [
            "linux-image-6.1.0-47-amd64-unsigned",
            "linux-image-6.1.0-50-amd64-unsigned",
            "linux-image-6.1.0-9-amd64-unsigned",
            "linux-image-6.1.0-56-cloud-amd64-unsigned",
            "linux-image-6.1.0-56-rt-amd64-unsigned",
        ];
        assert_eq!(
            newest_package(names.into_iter(), &s).as_deref(),
            Some("linux-image-6.1.0-50-amd64-unsigned")
        );
        let s = Kernel::Linux6_12.series();
        let names = [
            "linux-image-6.12.107+deb13-amd64-unsigned",
            "linux-image-6.12.117+deb13-amd64-unsigned",
            "linux-image-6.12.118+deb13-rt-amd64-unsigned",
            "linux-image-6.12.99+deb13-amd64-unsigned",
        ];
        assert_eq!(
            newest_package(names.into_iter(), &s).as_deref(),
            Some("linux-image-6.12.117+deb13-amd64-unsigned")
        );
    }
}
