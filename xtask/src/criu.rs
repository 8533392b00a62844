//! CRIU for the process-migration test (`tests/tests/criu_migration.rs`)
//! and `cargo xtask bench criu`, installed only for them.
//!
//! The test needs a CRIU that dumps and restores an established TCP socket
//! on this kernel: 4.2 or later (Debian 12's 3.17 fails `criu check` on
//! 6.18, Debian 13's 4.1.1 fails to dump the socket). When no such `criu`
//! is installed, prereq fetches Debian sid's `criu` and the closure of its
//! dependencies with `apt-get download` under a private apt configuration
//! (its own sources list, lists, cache and an empty dpkg status, so that
//! the host's package database is neither read nor changed and apt
//! resolves the whole closure), unpacks them into [`CRIU_PREFIX`], and
//! writes a wrapper that runs sid's `criu` with sid's own loader and
//! libraries (sid's libc is newer than the host's). vnat itself uses
//! whatever `criu` the user has; nothing outside the prefix changes.
//!
//! A failure here is a warning, not a prereq failure: the CRIU test then
//! skips and says why.
use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

/// Where the test's CRIU goes; keep in sync with the harness
/// (tests/src/harness/criu.rs).
pub const CRIU_PREFIX: &str = "/opt/vnat-criu";
/// The oldest CRIU that dumps a TCP socket on the kernels vnat runs on.
const MIN_VERSION: (u32, u32) = (4, 2);
/// The suite that has it (4.2.1 when this was written).
const SOURCE: &str =
    "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main";
const MULTIARCH_LIBS: &str = "usr/lib/x86_64-linux-gnu";

/// Install CRIU into [`CRIU_PREFIX`] unless a usable one is there or on
/// PATH; a failure is printed as a warning. With `check_only`, only say
/// whether the CRIU test will run.
pub fn ensure(check_only: bool) {
    if let Some(path) = usable_criu() {
        if check_only {
            println!("prereq: CRIU for the migration test: {}", path.display());
        }
        return;
    }
    if check_only {
        println!(
            "note: no CRIU 4.2 or later passes `criu check` here: the CRIU migration test will skip (`sudo -E cargo xtask prereq` installs one into {CRIU_PREFIX})"
        );
        return;
    }
    if std::env::consts::ARCH != "x86_64" {
        println!("warning: not installing CRIU (only x86_64 is supported here): the CRIU migration test will skip");
        return;
    }
    println!(
        "installing CRIU 4.2 from Debian sid into {CRIU_PREFIX} for the CRIU migration test only (criu and its libraries, about 26 packages, with their own loader; the host's packages are not touched)"
    );
    match install(Path::new(CRIU_PREFIX)) {
        Ok(version) => println!("installed {version} at {CRIU_PREFIX}/criu"),
        Err(e) => println!(
            "warning: installing CRIU into {CRIU_PREFIX} failed, so the CRIU migration test will skip: {e:#}"
        ),
    }
}

/// The first of `CRIU_PREFIX/criu` and `criu` on PATH that is recent enough
/// and passes `criu check` (what the test itself looks for).
fn usable_criu() -> Option<PathBuf> {
    [Path::new(CRIU_PREFIX).join("criu"), PathBuf::from("criu")]
        .into_iter()
        .find(|p| version_of(p).is_some_and(|v| v >= MIN_VERSION) && passes_check(p))
}

fn version_of(criu: &Path) -> Option<(u32, u32)> {
    let out = Command::new(criu)
        .arg("--version")
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    parse_version(&String::from_utf8_lossy(&out.stdout))
}

/// `criu --version` prints "Version: 4.2.1".
fn parse_version(text: &str) -> Option<(u32, u32)> {
    let v = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?
        .trim();
    let mut parts = v.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn passes_check(criu: &Path) -> bool {
    Command::new(criu)
        .arg("check")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Fetch and unpack into `prefix` (built beside it and renamed into place,
/// so a failed install never looks installed); returns `criu --version`.
fn install(prefix: &Path) -> Result<String> {
    let work = PathBuf::from(format!("{}.apt", prefix.display()));
    let staging = PathBuf::from(format!("{}.new", prefix.display()));
    let result = fetch_and_unpack(&work, &staging).and_then(|()| {
        write_wrapper(&staging)?;
        if prefix.exists() {
            fs::remove_dir_all(prefix)
                .with_context(|| format!("removing the old {}", prefix.display()))?;
        }
        fs::rename(&staging, prefix)
            .with_context(|| format!("moving {} into place", staging.display()))?;
        let criu = prefix.join("criu");
        let version = version_of(&criu).context("the installed criu does not run")?;
        if !passes_check(&criu) {
            bail!(
                "the installed criu fails `criu check` on this kernel ({}/criu check says why)",
                prefix.display()
            );
        }
        Ok(format!("CRIU {}.{}", version.0, version.1))
    });
    let _ = fs::remove_dir_all(&work);
    let _ = fs::remove_dir_all(&staging);
    result
}

fn fetch_and_unpack(work: &Path, staging: &Path) -> Result<()> {
    let _ = fs::remove_dir_all(work);
    let _ = fs::remove_dir_all(staging);
    for d in [
        "lists/partial",
        "cache/archives/partial",
        "etc/sources.list.d",
        "etc/preferences.d",
        "debs",
    ] {
        fs::create_dir_all(work.join(d)).with_context(|| format!("creating {}", work.display()))?;
    }
    fs::create_dir_all(staging).with_context(|| format!("creating {}", staging.display()))?;
    fs::write(work.join("etc/sources.list"), format!("{SOURCE}\n"))?;
    // An empty status: apt believes nothing is installed and resolves the
    // whole closure, which must all come from sid (its libc included).
    fs::write(work.join("status"), "")?;
    let w = work.display();
    fs::write(
        work.join("apt.conf"),
        format!(
            "Dir::Etc::sourcelist \"{w}/etc/sources.list\";\n\
             Dir::Etc::sourceparts \"{w}/etc/sources.list.d\";\n\
             Dir::Etc::preferencesparts \"{w}/etc/preferences.d\";\n\
             Dir::State::Lists \"{w}/lists\";\n\
             Dir::State::status \"{w}/status\";\n\
             Dir::Cache \"{w}/cache\";\n\
             APT::Architecture \"amd64\";\n\
             APT::Architectures {{ \"amd64\"; }};\n"
        ),
    )?;
    let apt = |program: &str| {
        let mut c = Command::new(program);
        c.env("APT_CONFIG", work.join("apt.conf"))
            .current_dir(work.join("debs"));
        c
    };
    output(
        apt("apt-get").args(["-q", "update"]),
        "apt-get update (Debian sid's lists, private)",
    )?;
    let depends = output(
        apt("apt-cache").args([
            "depends",
            "--recurse",
            "--no-recommends",
            "--no-suggests",
            "--no-conflicts",
            "--no-breaks",
            "--no-replaces",
            "--no-enhances",
            "criu",
        ]),
        "apt-cache depends criu",
    )?;
    let packages = closure(&depends);
    if !packages.iter().any(|p| p == "criu") {
        bail!("Debian sid has no criu package");
    }
    output(
        apt("apt-get").arg("download").args(&packages),
        &format!("apt-get download {}", packages.join(" ")),
    )?;
    for deb in fs::read_dir(work.join("debs"))? {
        let deb = deb?.path();
        if deb.extension().is_some_and(|e| e == "deb") {
            output(
                Command::new("dpkg-deb").arg("-x").arg(&deb).arg(staging),
                &format!("dpkg-deb -x {}", deb.display()),
            )?;
        }
    }
    Ok(())
}

/// The package names of `apt-cache depends --recurse`: the unindented
/// lines, without virtual packages (`<name>`), each once.
fn closure(depends: &str) -> Vec<String> {
    let mut names: Vec<String> = depends
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with('<') && !l.trim().is_empty())
        .map(|l| l.trim().to_string())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// `PREFIX/criu`: sid's criu through sid's loader, with sid's libraries
/// first (the host's libc is older than the one it was built against).
fn write_wrapper(prefix: &Path) -> Result<()> {
    let loader = prefix.join(MULTIARCH_LIBS).join("ld-linux-x86-64.so.2");
    if !loader.exists() || !prefix.join("usr/sbin/criu").exists() {
        bail!("the unpacked packages have no usr/sbin/criu or no loader");
    }
    let path = prefix.join("criu");
    fs::write(
        &path,
        format!(
            "#!/bin/sh\n\
             # Debian sid's criu with its own loader and libraries, installed by\n\
             # `cargo xtask prereq` for vnat's CRIU migration test only.\n\
             P=$(dirname \"$(readlink -f \"$0\")\")\n\
             L=$P/{MULTIARCH_LIBS}\n\
             exec \"$L/ld-linux-x86-64.so.2\" --library-path \"$L:$P/usr/lib\" \"$P/usr/sbin/criu\" \"$@\"\n"
        ),
    )?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Run, and return stdout; on failure an error naming `what` with the tail
/// of the output.
fn output(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("{what}: cannot run it"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        let mut text = stdout;
        text.push_str(&String::from_utf8_lossy(&out.stderr));
        let lines: Vec<&str> = text.lines().collect();
        bail!(
            "{what} failed ({}): {}",
            out.status,
            lines[lines.len().saturating_sub(5)..].join(" | ")
        );
    }
    Ok(stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_and_the_closure_parse() {
        assert_eq!(
            parse_version("Version: 4.2.1\nGitID: v4.2.1\n"),
            Some((4, 2))
        );
        assert_eq!(parse_version("nothing"), None);
        let depends = "criu\n  Depends: libc6\n  Depends: <python3:any>\nlibc6\n  Depends: libgcc-s1\n<python3:any>\nlibc6\nlibgcc-s1\n";
        assert_eq!(closure(depends), vec!["criu", "libc6", "libgcc-s1"]);
    }

    /// The harness looks for the test's CRIU where prereq puts it.
    #[test]
    fn prefix_matches_the_test_harness() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/src/harness/criu.rs");
        let harness = fs::read_to_string(&path).expect("reading the harness");
        assert!(
            harness.contains(&format!("\"{CRIU_PREFIX}\"")),
            "tests/src/harness/criu.rs does not name {CRIU_PREFIX}: keep CRIU_PREFIX in sync"
        );
    }
}
