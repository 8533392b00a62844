//! `cargo xtask package --verify`: the package as a user meets it.
//!
//! It is installed with dpkg into a scratch root (`dpkg --root`, its
//! maintainer scripts run with DPKG_ROOT set, as Debian's tools support),
//! whose package database knows this machine's libc6 and
//! init-system-helpers. Then: the file list and conffiles are what the
//! package says, the unit is enabled, the installed vnatd and vnatctl run,
//! each man page renders, each completion loads in its shell, systemd
//! accepts the unit, `ip route` names vnat's protocol and table with the
//! package's iproute2 files, and removal and purge leave what Debian
//! expects (the conffile until purge, no state after it).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use crate::run;

/// Runs `cmd`, which must succeed; its stdout and stderr together.
fn run_ok(cmd: &mut Command) -> Result<String> {
    let out = run::output_ok(cmd)?;
    Ok(format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

fn check(what: &str, ok: bool, detail: impl FnOnce() -> String) -> Result<()> {
    if ok {
        println!("    ok: {what}");
        Ok(())
    } else {
        bail!("{what}: {}", detail())
    }
}

/// An empty dpkg database under `root` that knows the host's `deps`.
fn scratch_root(root: &Path, deps: &[&str]) -> Result<()> {
    if root.exists() {
        fs::remove_dir_all(root)?;
    }
    let db = root.join("var/lib/dpkg");
    for d in ["info", "updates", "triggers"] {
        fs::create_dir_all(db.join(d))?;
    }
    let mut status = String::new();
    for dep in deps {
        status.push_str(&run_ok(Command::new("dpkg-query").args(["-s", dep]))?);
        status.push('\n');
    }
    fs::write(db.join("status"), status)?;
    fs::write(db.join("available"), "")?;
    Ok(())
}

fn dpkg(root: &Path, args: &[&str]) -> Result<String> {
    run_ok(
        Command::new("dpkg")
            .arg(format!("--root={}", root.display()))
            .args(["--force-script-chrootless", "--log=/dev/null"])
            .args(args),
    )
}

pub fn run(repo: &Path, deb: &Path, files: &[String], conffiles: &[&str]) -> Result<()> {
    crate::prereq::package_check_packages()?;
    let root: PathBuf = repo.join("target/debian/scratch-root");
    println!("==> installing {} into {}", deb.display(), root.display());
    scratch_root(&root, &["libc6", "init-system-helpers"])?;
    let deb_s = deb.display().to_string();
    dpkg(&root, &["-i", &deb_s])?;

    let listed = dpkg(&root, &["-L", "vnat"])?;
    for f in files {
        let path = format!("/{f}");
        check(
            &format!("installed {path}"),
            listed.lines().any(|l| l == path) && root.join(f).exists(),
            || format!("not in `dpkg -L vnat` or not on disk:\n{listed}"),
        )?;
    }
    let declared = run_ok(
        Command::new("dpkg-query")
            .arg(format!("--root={}", root.display()))
            .args(["-W", "-f=${Conffiles}", "vnat"]),
    )?;
    for c in conffiles {
        check(
            &format!("conffile {c}"),
            declared
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{c} "))),
            || format!("dpkg does not keep it as a conffile: {declared}"),
        )?;
    }
    let config = fs::read_to_string(root.join("etc/vnat/vnatd.toml"))?;
    check(
        "/etc/vnat/vnatd.toml sets nothing (every key commented out)",
        config
            .lines()
            .all(|l| l.trim().is_empty() || l.starts_with('#')),
        || config.clone(),
    )?;
    let wants = root.join("etc/systemd/system/multi-user.target.wants/vnatd.service");
    check(
        "vnatd.service enabled at install",
        wants.symlink_metadata().is_ok(),
        || format!("no {}", wants.display()),
    )?;

    let version = run_ok(Command::new(root.join("usr/sbin/vnatd")).arg("--version"))?;
    check(
        "installed vnatd --version",
        version.starts_with("vnatd "),
        || version.clone(),
    )?;
    let help = run_ok(Command::new(root.join("usr/bin/vnatctl")).arg("--help"))?;
    check(
        "installed vnatctl --help",
        help.contains("Usage: vnatctl"),
        || help.clone(),
    )?;

    for page in [
        "man8/vnatd.8.gz",
        "man8/vnatctl.8.gz",
        "man5/vnatd.toml.5.gz",
    ] {
        let file = root.join("usr/share/man").join(page);
        let shown = run_ok(
            Command::new("man")
                .arg("-l")
                .arg(&file)
                .env("MANPAGER", "cat")
                .env("MANWIDTH", "80")
                .env("LC_ALL", "C.UTF-8"),
        )?;
        check(
            &format!("man -l {page}"),
            shown.contains("NAME") && shown.contains("DESCRIPTION"),
            || shown.chars().take(400).collect(),
        )?;
    }

    let comp = root.join("usr/share");
    for bin in ["vnatd", "vnatctl"] {
        let bash = comp.join(format!("bash-completion/completions/{bin}"));
        let out = run_ok(
            Command::new("bash")
                .arg("--norc")
                .arg("-c")
                .arg(format!("source '{}' && complete -p {bin}", bash.display())),
        )?;
        check(
            &format!("bash completion of {bin}"),
            out.contains(bin),
            || out.clone(),
        )?;

        let zsh = comp.join(format!("zsh/vendor-completions/_{bin}"));
        let out = run_ok(Command::new("zsh").arg("-f").arg("-c").arg(format!(
            "autoload -U compinit && compinit -u -D && source '{}' && print -r -- ${{_comps[{bin}]}}",
            zsh.display()
        )))?;
        check(
            &format!("zsh completion of {bin}"),
            out.trim() == format!("_{bin}"),
            || out.clone(),
        )?;

        let fish = comp.join(format!("fish/vendor_completions.d/{bin}.fish"));
        let probe = if bin == "vnatctl" {
            "vnatctl st"
        } else {
            "vnatd --con"
        };
        let want = if bin == "vnatctl" {
            "status"
        } else {
            "--control"
        };
        let out = run_ok(
            Command::new("fish")
                .arg("--no-config")
                .arg("-c")
                .arg(format!(
                    "source '{}'; complete -C '{probe}'",
                    fish.display()
                )),
        )?;
        check(
            &format!("fish completion of {bin}"),
            out.contains(want),
            || out.clone(),
        )?;
    }

    // systemd checks the installed unit against this host's systemd, with
    // the binary at its scratch-root path (the unit's own path is not on
    // this host) and without the man pages, which `man -l` checked above.
    let unit = fs::read_to_string(root.join("usr/lib/systemd/system/vnatd.service"))?;
    let here = root.join("usr/sbin/vnatd").display().to_string();
    let probe_dir = repo.join("target/debian/unit-check");
    fs::create_dir_all(&probe_dir)?;
    let probe = probe_dir.join("vnatd.service");
    fs::write(&probe, unit.replace("/usr/sbin/vnatd", &here))?;
    let verified = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&probe)
        .output()
        .context("cannot run systemd-analyze")?;
    let said = String::from_utf8_lossy(&verified.stderr).into_owned();
    check(
        "systemd-analyze verify vnatd.service",
        verified.status.success() && !said.contains("vnatd.service"),
        || said.clone(),
    )?;

    // iproute2 reads /etc/iproute2: the package's files, in a mount and
    // network namespace of their own.
    let shown = run_ok(
        Command::new("unshare")
            .args(["--mount", "--net", "sh", "-ec"])
            .arg(format!(
                "mount --bind '{}' /etc/iproute2; ip link set lo up; \
         ip route add local 192.0.2.1 dev lo proto 157 table 1986985983; \
         ip route show table all | grep 192.0.2.1",
                root.join("etc/iproute2").display()
            )),
    )?;
    check(
        "ip route shows `proto vnat` and `table vnat-fallback`",
        shown.contains("proto vnat") && shown.contains("table vnat-fallback"),
        || shown.clone(),
    )?;

    // An upgrade (the same version again) keeps it enabled.
    dpkg(&root, &["-i", &deb_s])?;
    check(
        "still enabled after an upgrade",
        wants.symlink_metadata().is_ok(),
        String::new,
    )?;

    fs::create_dir_all(root.join("var/lib/vnat"))?;
    fs::write(root.join("var/lib/vnat/identity.key"), "scratch")?;
    dpkg(&root, &["-r", "vnat"])?;
    check(
        "removal leaves the conffile and the state",
        root.join("etc/vnat/vnatd.toml").exists()
            && root.join("var/lib/vnat/identity.key").exists(),
        String::new,
    )?;
    check(
        "removal takes the binaries",
        !root.join("usr/sbin/vnatd").exists(),
        String::new,
    )?;
    dpkg(&root, &["-P", "vnat"])?;
    for gone in [
        "etc/vnat",
        "var/lib/vnat",
        "etc/systemd/system/multi-user.target.wants/vnatd.service",
    ] {
        check(
            &format!("purge removes /{gone}"),
            root.join(gone).symlink_metadata().is_err(),
            String::new,
        )?;
    }
    println!("==> the package installs, runs, upgrades, is removed and purged as expected");
    Ok(())
}
