//! A real vnatd in a namespace host, and `vnatctl --json` against it.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value;

use super::{bin_path, Host};

/// vnatd's files for one test host; removed on drop.
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("vnat-test-{tag}-{}", super::unique_suffix()));
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("creating {}: {e}", p.display()));
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether an `ls --json` listing has a mobile connection whose virtual
/// remote end is at `remote`.
fn lists_mobile(ls: Option<Value>, remote: std::net::IpAddr) -> bool {
    ls.and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .any(|r| {
            r["mobile"] == Value::Bool(true)
                && r["virtual_remote"]
                    .as_str()
                    .and_then(|s| s.parse::<std::net::SocketAddr>().ok())
                    .is_some_and(|a| a.ip() == remote)
        })
}

/// vnatd running in `host`'s namespace with its pins and cgroup; killed on
/// drop.
pub struct Vnatd {
    child: Child,
    /// Its namespace (`/run/netns/NAME`), for what a failing test prints.
    netns: PathBuf,
    pub control: PathBuf,
    /// `--state-dir`: identity.key and peers.json.
    pub state_dir: PathBuf,
}

impl Vnatd {
    pub fn start(host: &Host, dir: &Path) -> Vnatd {
        Vnatd::start_with(host, dir, &[])
    }

    /// Start with extra flags (e.g. `--listen`).
    pub fn start_with(host: &Host, dir: &Path, extra: &[&str]) -> Vnatd {
        Vnatd::start_with_env(host, dir, extra, &[])
    }

    /// Start with extra flags and environment variables (e.g. the fault
    /// injection of `VNAT_TEST_CRASH_AT`).
    pub fn start_with_env(host: &Host, dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Vnatd {
        let cgroup = host.cgroup.path().display().to_string();
        let mut args = vec!["--cgroup", &cgroup, "--config", "/dev/null"];
        args.extend_from_slice(extra);
        Vnatd::start_raw(host, dir, &args, env)
    }

    /// Start with extra flags, its log written to `log` instead of the
    /// test's stderr (for tests that look for what vnatd says).
    pub fn start_logging(host: &Host, dir: &Path, extra: &[&str], log: &Path) -> Vnatd {
        Vnatd::start_logging_config(host, dir, Path::new("/dev/null"), extra, log)
    }

    /// `start_logging` with the config file `config` (the host's cgroup
    /// given by flag).
    pub fn start_logging_config(
        host: &Host,
        dir: &Path,
        config: &Path,
        extra: &[&str],
        log: &Path,
    ) -> Vnatd {
        let cgroup = host.cgroup.path().display().to_string();
        let config = config.display().to_string();
        let mut args = vec!["--cgroup", &cgroup, "--config", &config];
        args.extend_from_slice(extra);
        let file = std::fs::File::create(log).expect("vnatd's log file");
        Vnatd::start_raw_to(host, dir, &args, &[], Stdio::from(file))
    }

    /// Start with the config file `config` (which names the cgroups) and
    /// extra flags.
    pub fn start_with_config(host: &Host, dir: &Path, config: &Path, extra: &[&str]) -> Vnatd {
        let config = config.display().to_string();
        let mut args = vec!["--config", &config];
        args.extend_from_slice(extra);
        Vnatd::start_raw(host, dir, &args, &[])
    }

    fn start_raw(host: &Host, dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Vnatd {
        Vnatd::start_raw_to(host, dir, args, env, Stdio::inherit())
    }

    fn start_raw_to(
        host: &Host,
        dir: &Path,
        args: &[&str],
        env: &[(&str, &str)],
        stderr: Stdio,
    ) -> Vnatd {
        let ns = host.ns;
        let control = dir.join("vnatd.sock");
        let child = ns
            .cmd(bin_path("vnatd"))
            .arg("--control")
            .arg(&control)
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--bpffs")
            .arg(host.pins.path())
            .args(args)
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("starting vnatd");
        let d = Vnatd {
            child,
            netns: ns.path(),
            control,
            state_dir: dir.join("state"),
        };
        // 60 s: in a VM without KVM (cargo xtask test --kernel) loading and
        // verifying the programs alone takes several seconds.
        let deadline = Instant::now() + Duration::from_secs(60);
        while d.ctl(&["status"]).is_none() {
            assert!(
                Instant::now() < deadline,
                "vnatd did not come up within 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        d
    }

    /// Whether `vnatctl ls` shows a mobile connection of `proto` ("tcp" or
    /// "udp") whose virtual remote end is at `remote`.
    pub fn mobile_to(&self, proto: &str, remote: std::net::IpAddr) -> bool {
        lists_mobile(self.ctl(&["ls", "--proto", proto]), remote)
    }

    /// Whether `vnatctl ls` shows a mobile connection of `proto` with an
    /// end (virtual, local or remote) at port `port`: for a peer that names
    /// the other end otherwise (behind a NAT, a port forward).
    pub fn mobile_on(&self, proto: &str, port: u16) -> bool {
        let suffix = format!(":{port}");
        self.ctl(&["ls", "--proto", proto])
            .and_then(|v| v.as_array().cloned())
            .is_some_and(|rows| {
                rows.iter().any(|r| {
                    r["mobile"] == true
                        && [&r["virtual_local"], &r["virtual_remote"]]
                            .iter()
                            .any(|a| a.as_str().is_some_and(|a| a.ends_with(&suffix)))
                })
            })
    }

    /// Wait (at most 20 s) until [`Vnatd::mobile_to`]: paired with the
    /// peer's vnatd, which names the connection alike. Panics with the
    /// listing otherwise.
    pub fn wait_mobile_to(&self, proto: &str, remote: std::net::IpAddr) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.mobile_to(proto, remote) {
            assert!(
                Instant::now() < deadline,
                "the {proto} connection to {remote} never became mobile: {:?}",
                self.ctl(&["ls"])
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Wait (at most 20 s) until `vnatctl ls` shows a `proto` connection
    /// whose peer's move to `to` ended well (`last_move`: side "peer",
    /// outcome "moved"). That is after this host validated the address:
    /// what it shows hiding applications of the peer's new connections
    /// (hide location) is written by then. A physical remote at `to` alone
    /// is not: packets go there, within a budget, while it is validated.
    /// Returns that row; panics with the listing otherwise.
    pub fn wait_peer_moved_to(&self, proto: &str, to: std::net::IpAddr) -> Value {
        self.wait_ls_row(
            &["ls", "--proto", proto],
            &format!("no {proto} connection's peer was seen moved to {to}"),
            |r| {
                let m = &r["last_move"];
                m["side"] == "peer"
                    && m["outcome"] == "moved"
                    && m["to"]
                        .as_str()
                        .and_then(|s| s.parse::<std::net::SocketAddr>().ok())
                        .is_some_and(|a| a.ip() == to)
            },
        )
    }

    /// Poll `vnatctl --json ARGS` (an `ls`) every 100 ms, for at most 20 s,
    /// until a row satisfies `pred`, and return that row; panics with
    /// `what` and the last listing otherwise.
    pub fn wait_ls_row(&self, args: &[&str], what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let ls = self.ctl(args);
            let row = ls
                .as_ref()
                .and_then(|v| v.as_array())
                .and_then(|rows| rows.iter().find(|r| pred(r)).cloned());
            if let Some(row) = row {
                return row;
            }
            assert!(Instant::now() < deadline, "{what}: {ls:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// [`Vnatd::mobile_to`], false if vnatd does not answer (it may be
    /// dying: the crash-safety tests).
    pub fn try_mobile_to(&self, proto: &str, remote: std::net::IpAddr) -> bool {
        lists_mobile(self.try_ctl(&["ls", "--proto", proto]), remote)
    }

    /// How many connections `vnatctl ls` shows sent to a physical remote
    /// address `ip`, and the listing (for a failure message).
    pub fn sending_to(&self, ip: std::net::IpAddr) -> (usize, Value) {
        let ls = self.ctl(&["ls"]).unwrap_or(Value::Null);
        let prefix = std::net::SocketAddr::new(ip, 0).to_string();
        let prefix = &prefix[..prefix.len() - 1];
        let n = ls.as_array().map_or(0, |rows| {
            rows.iter()
                .filter(|r| {
                    r["physical_remote"]
                        .as_str()
                        .is_some_and(|a| a.starts_with(prefix))
                })
                .count()
        });
        (n, ls)
    }

    /// Run `vnatctl --json ARGS` against this vnatd.
    fn run_ctl(&self, args: &[&str]) -> std::process::Output {
        self.ctl_command(args).output().expect("running vnatctl")
    }

    /// `vnatctl --control <this vnatd's socket> --json ARGS`, not started.
    fn ctl_command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin_path("vnatctl"));
        cmd.arg("--control")
            .arg(&self.control)
            .arg("--json")
            .args(args);
        cmd
    }

    /// `vnatctl --json ARGS` whatever its outcome: its exit status and what
    /// it printed (null if not JSON), for commands expected to fail.
    pub fn ctl_status(&self, args: &[&str]) -> (i32, Value) {
        let out = self.run_ctl(args);
        let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        (out.status.code().unwrap_or(-1), v)
    }

    /// `vnatctl --json ARGS`, None if it failed in any way: for a vnatd
    /// that may die while it answers (the crash-safety tests).
    pub fn try_ctl(&self, args: &[&str]) -> Option<Value> {
        let out = self.run_ctl(args);
        out.status
            .success()
            .then(|| serde_json::from_slice(&out.stdout).ok())
            .flatten()
    }

    /// `vnatctl --json ARGS`, None if it could not reach vnatd.
    pub fn ctl(&self, args: &[&str]) -> Option<Value> {
        let out = self.run_ctl(args);
        if out.status.code() == Some(3) {
            return None;
        }
        assert!(
            out.status.success(),
            "vnatctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(serde_json::from_slice(&out.stdout).expect("vnatctl printed invalid JSON"))
    }

    /// A clean stop: SIGTERM, then wait for vnatd to exit (SIGKILL after
    /// 10 s, which fails the test). The pins stay, as after any clean stop.
    pub fn stop(mut self) -> std::process::ExitStatus {
        use nix::{
            sys::signal::{kill, Signal},
            unistd::Pid,
        };
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).expect("SIGTERM vnatd");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().expect("waiting for vnatd") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("vnatd did not exit within 10 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Wait (at most 20 s) until `vnatctl peers` lists `addr` among the
    /// addresses a paired host told (its keepalives): where this host
    /// carries an IPv4 connection over IPv6.
    pub fn wait_told(&self, addr: std::net::IpAddr) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let peers = self.ctl(&["peers"]).unwrap_or(Value::Null);
            if peers_told(&peers, addr) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{addr} never listed among the peers' addresses: {peers}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Wait (at most 15 s) until this vnatd has pinned a peer's key, i.e.
    /// paired with the other end of a connection.
    pub fn wait_paired(&self, what: &str) {
        let peers = self.state_dir.join("peers.json");
        let deadline = Instant::now() + Duration::from_secs(15);
        while !std::fs::read_to_string(&peers).is_ok_and(|s| s.len() > 4) {
            assert!(
                Instant::now() < deadline,
                "{what} never paired with its peer"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Freeze (SIGSTOP) or thaw (SIGCONT) vnatd: frozen, it answers
    /// nothing, while the kernel keeps its connections and translations.
    pub fn freeze(&self, frozen: bool) {
        use nix::{
            sys::signal::{kill, Signal},
            unistd::Pid,
        };
        let sig = if frozen {
            Signal::SIGSTOP
        } else {
            Signal::SIGCONT
        };
        kill(Pid::from_raw(self.child.id() as i32), sig).expect("signalling vnatd");
    }

    /// Send `sig` to vnatd (e.g. SIGHUP to reload its config).
    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), sig)
            .expect("signalling vnatd");
    }

    /// Whether the vnatd process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn kill9(mut self) {
        self.child.kill().expect("SIGKILL vnatd");
        self.child.wait().expect("reaping vnatd");
    }
}

impl Drop for Vnatd {
    fn drop(&mut self) {
        // A failing test: what this vnatd counted and listed (drops, holds,
        // translations) is the first thing to read, so it is printed
        // before vnatd goes.
        if std::thread::panicking() {
            // Nothing here may panic (a panic while panicking aborts the
            // test binary): every failure prints as "(no answer)".
            let ctl = |args: &[&str]| -> String {
                self.ctl_command(args)
                    .output()
                    .ok()
                    .filter(|o| o.status.success())
                    .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                    .unwrap_or_else(|| "(no answer)".into())
            };
            let mut ls = ctl(&["ls"]);
            if ls.len() > 4000 {
                let cut = (0..=4000)
                    .rev()
                    .find(|i| ls.is_char_boundary(*i))
                    .unwrap_or(0);
                ls.truncate(cut);
                ls.push_str(" ...(cut)");
            }
            eprintln!(
                "vnatd {} at the failure:\nstatus {}\nls {}",
                self.control.display(),
                ctl(&["status"]),
                ls,
            );
            // Its namespace's sockets (queues, drops, owners) and the
            // kernel's non-zero UDP and IP error counters.
            let net = format!("--net={}", self.netns.display());
            let run = |args: &[&str]| {
                Command::new("nsenter")
                    .arg(&net)
                    .args(args)
                    .output()
                    .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                    .unwrap_or_default()
            };
            let sockets: Vec<String> = run(&["ss", "-tuanpem"])
                .lines()
                .take(40)
                .map(String::from)
                .collect();
            let errors: Vec<String> = run(&["nstat", "-asz"])
                .lines()
                .filter(|l| {
                    let mut f = l.split_whitespace();
                    let (name, value) = (f.next().unwrap_or(""), f.next().unwrap_or("0"));
                    value != "0"
                        && (name.starts_with("Udp")
                            || name.contains("Error")
                            || name.contains("NoPorts")
                            || name.contains("ReversePath")
                            || name.contains("NoRoutes")
                            || name.contains("Retrans")
                            || name.contains("Discard"))
                })
                .map(String::from)
                .collect();
            // Where its packets go: the addresses (vnat keeps moved and
            // vanished ones on lo), the policy rules (the moved flows' own
            // and the kept addresses' fallback to the sink) and the routes.
            let routing: Vec<String> = [
                &["ip", "-br", "addr"][..],
                &["ip", "rule"][..],
                &["ip", "route", "show", "table", "all"][..],
            ]
            .iter()
            .flat_map(|args| {
                let out: Vec<String> = run(args).lines().take(30).map(String::from).collect();
                std::iter::once(format!("$ {}", args.join(" "))).chain(out)
            })
            .filter(|l| !l.contains("table local"))
            .collect();
            eprintln!(
                "sockets:\n{}\ncounters: {}\nrouting:\n{}",
                sockets.join("\n"),
                errors.join("; "),
                routing.join("\n")
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether `vnatctl --json peers` output `peers` lists `addr` among the
/// addresses a peer told (`addresses`).
pub fn peers_told(peers: &Value, addr: std::net::IpAddr) -> bool {
    let want = addr.to_string();
    peers.as_array().is_some_and(|ps| {
        ps.iter().any(|p| {
            p["addresses"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x.as_str() == Some(want.as_str())))
        })
    })
}
