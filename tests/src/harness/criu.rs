//! Real CRIU for the process-migration tests and benchmark: finding a
//! working `criu`, dumping and restoring a process tree in a namespace host
//! with `vnatctl criu-hook` as its action script, and the client-side TCP
//! figures (retransmissions) around a migration.
use std::{
    fs,
    net::SocketAddr,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use super::{bin_path, ss_endpoint, Host, Netns};

/// Where `cargo xtask prereq` installs Debian sid's CRIU (4.2) with its own
/// loader and libraries, when no `criu` of 4.2 or later is installed; the
/// wrapper is `CRIU_PREFIX/criu`. Keep in sync with xtask/src/criu.rs.
pub const CRIU_PREFIX: &str = "/opt/vnat-criu";

/// The oldest CRIU that dumps and restores an established TCP socket on
/// the kernels vnat is developed on (6.18): Debian 12's 3.17 fails `criu
/// check`, Debian 13's 4.1.1 fails to dump the socket.
const MIN_VERSION: (u32, u32) = (4, 2);

/// A `criu` that runs here and passes `criu check`.
#[derive(Clone, Debug)]
pub struct Criu {
    pub path: PathBuf,
    pub version: String,
}

/// `criu --version` prints "Version: 4.2.1" (and a GitID line).
fn parse_version(text: &str) -> Option<(u32, u32)> {
    let v = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Version:"))?
        .trim();
    let mut parts = v.split('.');
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

impl Criu {
    /// The CRIU a test needs, or None after saying, where `cargo test`
    /// shows it, that `test` did not run for want of one; fails the test
    /// instead when `VNAT_REQUIRE_CRIU` is set (CI). See [`super::not_run`].
    pub fn for_test(test: &str) -> Option<Criu> {
        match Criu::find() {
            Ok(c) => {
                eprintln!("{test}: using CRIU {} at {}", c.version, c.path.display());
                Some(c)
            }
            Err(why) => {
                super::not_run(test, "VNAT_REQUIRE_CRIU", &why);
                None
            }
        }
    }

    /// `$VNAT_CRIU` when set (that one only: a user who names a CRIU means
    /// it), otherwise the first of `CRIU_PREFIX/criu` and `criu` on PATH,
    /// that is 4.2 or later and passes `criu check`; otherwise why none
    /// does (the sentence a skipped test prints).
    pub fn find() -> Result<Criu, String> {
        let candidates: Vec<PathBuf> = match std::env::var_os("VNAT_CRIU") {
            Some(p) => vec![p.into()],
            None => vec![Path::new(CRIU_PREFIX).join("criu"), "criu".into()],
        };
        let mut why = Vec::new();
        for path in candidates {
            let out = match Command::new(&path).arg("--version").output() {
                Ok(o) if o.status.success() => o,
                Ok(o) => {
                    why.push(format!(
                        "{}: --version exited with {}",
                        path.display(),
                        o.status
                    ));
                    continue;
                }
                Err(e) => {
                    why.push(format!("{}: {e}", path.display()));
                    continue;
                }
            };
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let Some(version) = parse_version(&text) else {
                why.push(format!("{}: unreadable version {text:?}", path.display()));
                continue;
            };
            if version < MIN_VERSION {
                why.push(format!(
                    "{}: version {}.{} (4.2 or later dumps a TCP socket on this kernel)",
                    path.display(),
                    version.0,
                    version.1
                ));
                continue;
            }
            let check = Command::new(&path)
                .arg("check")
                .output()
                .map_err(|e| format!("{}: {e}", path.display()))?;
            if !check.status.success() {
                why.push(format!(
                    "{}: `criu check` failed: {}",
                    path.display(),
                    tail(&check, 3)
                ));
                continue;
            }
            return Ok(Criu {
                path,
                version: format!("{}.{}", version.0, version.1),
            });
        }
        Err(format!(
            "no usable CRIU ({}); `cargo xtask prereq` installs one into {CRIU_PREFIX}",
            why.join("; ")
        ))
    }

    /// `criu dump` of the tree rooted at `pid`, in `ns`, into `images`, with
    /// `hook` as the action script and `env` for it; locks the network with
    /// nftables (this kernel's hosts have no iptables). Returns its wall
    /// time; panics with the end of CRIU's log if it fails.
    pub fn dump(
        &self,
        ns: &Netns,
        pid: u32,
        images: &Path,
        hook: &Path,
        env: &[(&str, &str)],
    ) -> Duration {
        let cmd = self.dump_command(ns, pid, images, hook, env);
        self.run(cmd, images, "dump", "dump.log")
    }

    /// [`Criu::dump`] that is expected to fail: its wall time, or the end
    /// of CRIU's output and log (what it said) when it failed.
    pub fn try_dump(
        &self,
        ns: &Netns,
        pid: u32,
        images: &Path,
        hook: &Path,
        env: &[(&str, &str)],
    ) -> Result<Duration, String> {
        let mut cmd = self.dump_command(ns, pid, images, hook, env);
        let start = Instant::now();
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.path.display()));
        if out.status.success() {
            return Ok(start.elapsed());
        }
        let log = fs::read_to_string(images.join("dump.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        Err(format!(
            "{} | {}",
            tail(&out, 5),
            lines[lines.len().saturating_sub(15)..].join("\n")
        ))
    }

    fn dump_command(
        &self,
        ns: &Netns,
        pid: u32,
        images: &Path,
        hook: &Path,
        env: &[(&str, &str)],
    ) -> Command {
        let mut cmd = ns.cmd(&self.path);
        cmd.args(["dump", "-t", &pid.to_string(), "-D"])
            .arg(images)
            .args(["--tcp-established", "--network-lock", "nftables"])
            .arg("--action-script")
            .arg(hook)
            .args(["-v4", "-o", "dump.log"])
            .envs(env.iter().copied());
        cmd
    }

    /// `criu restore -d` of `images` on `host`: run inside the host's
    /// cgroup, which the restored tree inherits (`--manage-cgroups ignore`:
    /// the dumped cgroup is the old host's), so that its vnatd records the
    /// restored sockets. Returns the wall time and the restored root's pid.
    pub fn restore(
        &self,
        host: &Host,
        images: &Path,
        hook: &Path,
        env: &[(&str, &str)],
    ) -> (Duration, u32) {
        let pidfile = images.join("restored.pid");
        let _ = fs::remove_file(&pidfile);
        let mut cmd = host.command(self.path.to_str().expect("criu path is UTF-8"));
        cmd.args(["restore", "-d", "-D"])
            .arg(images)
            // The network lock's method is the dump's (in the images).
            .args(["--tcp-established", "--manage-cgroups=ignore"])
            .arg("--action-script")
            .arg(hook)
            .arg("--pidfile")
            .arg(&pidfile)
            .args(["-v4", "-o", "restore.log"])
            .envs(env.iter().copied());
        let took = self.run(cmd, images, "restore", "restore.log");
        let pid = fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| panic!("criu restore wrote no pid to {}", pidfile.display()));
        (took, pid)
    }

    fn run(&self, mut cmd: Command, images: &Path, what: &str, log_file: &str) -> Duration {
        let start = Instant::now();
        let out = cmd
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.path.display()));
        let took = start.elapsed();
        if !out.status.success() {
            let log = fs::read_to_string(images.join(log_file)).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let errors: Vec<&str> = lines
                .iter()
                .copied()
                .filter(|l| l.contains("Error") || l.contains("rror ("))
                .collect();
            panic!(
                "criu {what} failed ({}): {}\n--- errors in {}:\n{}\n--- its end:\n{}",
                out.status,
                tail(&out, 10),
                images.join(log_file).display(),
                errors.join("\n"),
                lines[lines.len().saturating_sub(40)..].join("\n")
            );
        }
        took
    }
}

fn tail(out: &Output, n: usize) -> String {
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join(" | ")
}

/// The two-line action script a user installs: CRIU runs it without
/// arguments, and it runs `vnatctl criu-hook` (this build's) with them.
pub fn write_criu_hook(dir: &Path) -> PathBuf {
    let path = dir.join("criu-hook");
    fs::write(
        &path,
        format!(
            "#!/bin/sh\nexec {} criu-hook\n",
            bin_path("vnatctl").display()
        ),
    )
    .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755))
        .unwrap_or_else(|e| panic!("chmod {}: {e}", path.display()));
    path
}

/// The nftables tables CRIU's network lock made in `ns` (`inet CRIU-<id>`).
/// A dump leaves its table on the old host: it drops the dumped
/// connections' packets, which the kernel would otherwise answer with a
/// reset now that their sockets are gone.
pub fn criu_lock_tables(ns: &Netns) -> Vec<String> {
    let out = ns.try_run(&["nft", "list", "tables"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_prefix("table inet "))
        .filter(|t| t.starts_with("CRIU-"))
        .map(str::to_string)
        .collect()
}

/// Delete CRIU's lock tables in `ns`.
pub fn remove_criu_lock_tables(ns: &Netns) {
    for t in criu_lock_tables(ns) {
        ns.run(&["nft", "delete", "table", "inet", &t]);
    }
}

/// Make this process the reaper of its orphans: a process `criu restore
/// -d` leaves behind is reparented here (not to PID 1, which may reap it
/// late), so the test can wait for it and free its pid for the next
/// restore.
pub fn become_child_subreaper() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) takes integers only and
    // changes nothing but this process's reaper flag.
    let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    assert_eq!(
        r,
        0,
        "prctl(PR_SET_CHILD_SUBREAPER): {}",
        std::io::Error::last_os_error()
    );
}

/// Kill `pid` (a restored process, our orphan by [`become_child_subreaper`])
/// and reap it.
pub fn kill_and_reap(pid: u32) {
    let pid = nix::unistd::Pid::from_raw(pid as i32);
    let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
    let _ = nix::sys::wait::waitpid(pid, None);
}

/// The client side's TCP figures of one socket, from `ss -ti`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpInfo {
    /// tcpi_total_retrans: segments retransmitted over the socket's life.
    pub total_retrans: u64,
    /// The retransmission timeout now, in ms.
    pub rto_ms: u64,
    /// tcpi_backoff: how many times the timeout backed off in a row now.
    pub backoff: u64,
}

/// `ss -tinH` of the established socket `local -> remote` in `ns`.
pub fn tcp_info(ns: &Netns, local: SocketAddr, remote: SocketAddr) -> Option<TcpInfo> {
    let filter = format!("src {} and dst {}", ss_endpoint(local), ss_endpoint(remote));
    let out = ns.try_run(&["ss", "-tinH", "state", "established", &filter]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    if text.trim().is_empty() {
        return None;
    }
    let mut info = TcpInfo::default();
    for w in text.split_whitespace() {
        if let Some(v) = w.strip_prefix("retrans:") {
            // "retrans:OUTSTANDING/TOTAL"
            info.total_retrans = v
                .split('/')
                .nth(1)
                .and_then(|t| t.parse().ok())
                .unwrap_or(0);
        } else if let Some(v) = w.strip_prefix("rto:") {
            info.rto_ms = v.parse::<f64>().map_or(0, |f| f as u64);
        } else if let Some(v) = w.strip_prefix("backoff:") {
            info.backoff = v.parse().unwrap_or(0);
        }
    }
    Some(info)
}

/// The namespace's TcpExt counter `name` (`/proc/net/netstat`, read from
/// inside it): `TCPTimeouts` counts retransmission timeouts, which a
/// namespace holding one client socket attributes to that socket.
pub fn tcp_ext_counter(ns: &Netns, name: &str) -> u64 {
    let text = ns.run_stdout(&["cat", "/proc/net/netstat"]);
    parse_tcp_ext(&text, name).unwrap_or_else(|| panic!("no TcpExt {name} in /proc/net/netstat"))
}

fn parse_tcp_ext(text: &str, name: &str) -> Option<u64> {
    let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
    let (names, values) = (lines.next()?, lines.next()?);
    let i = names.split_whitespace().position(|n| n == name)?;
    values.split_whitespace().nth(i)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn criu_versions_parse() {
        assert_eq!(
            parse_version("Version: 4.2.1\nGitID: v4.2.1\n"),
            Some((4, 2))
        );
        assert_eq!(parse_version("Version: 3.17\n"), Some((3, 17)));
        assert_eq!(parse_version("criu"), None);
    }

    #[test]
    fn tcp_ext_counters_parse() {
        let text = "TcpExt: SyncookiesSent TCPTimeouts\nTcpExt: 0 7\nIpExt: InNoRoutes\nIpExt: 0\n";
        assert_eq!(parse_tcp_ext(text, "TCPTimeouts"), Some(7));
        assert_eq!(parse_tcp_ext(text, "Nope"), None);
    }
}
