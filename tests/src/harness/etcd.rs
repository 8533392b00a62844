//! A real etcd cluster for the location-store tests (issue 34): three
//! members of Debian's etcd-server, each on an address of its own in one
//! namespace, with their data under a temporary directory. Members can be
//! killed one by one; `Drop` kills what is left.

use std::{
    fs::File,
    net::IpAddr,
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use super::Netns;

pub struct EtcdCluster {
    ns_path: PathBuf,
    /// The namespace's handle, for `etcdctl` there.
    fd: Arc<File>,
    members: Vec<Option<Child>>,
    /// Client URLs, one per member, in order.
    pub endpoints: Vec<String>,
}

/// The client port (etcd's own) and peer port.
const CLIENT_PORT: u16 = 2379;
const PEER_PORT: u16 = 2380;

impl EtcdCluster {
    /// Start three members, at `addrs` (on `ns`, already configured), with
    /// their data and logs under `dir`, and wait until each is healthy.
    pub fn start(ns: &Netns, addrs: [IpAddr; 3], dir: &Path, token: &str) -> EtcdCluster {
        let url = |a: &IpAddr, p: u16| match a {
            IpAddr::V4(_) => format!("http://{a}:{p}"),
            IpAddr::V6(_) => format!("http://[{a}]:{p}"),
        };
        let initial: Vec<String> = addrs
            .iter()
            .enumerate()
            .map(|(i, a)| format!("m{i}={}", url(a, PEER_PORT)))
            .collect();
        let initial = initial.join(",");
        let mut members = Vec::new();
        for (i, a) in addrs.iter().enumerate() {
            let data = dir.join(format!("etcd-m{i}"));
            let log =
                std::fs::File::create(dir.join(format!("etcd-m{i}.log"))).expect("etcd log file");
            let child = ns
                .cmd("etcd")
                .args(["--name", &format!("m{i}")])
                .arg("--data-dir")
                .arg(&data)
                .args(["--listen-client-urls", &url(a, CLIENT_PORT)])
                .args(["--advertise-client-urls", &url(a, CLIENT_PORT)])
                .args(["--listen-peer-urls", &url(a, PEER_PORT)])
                .args(["--initial-advertise-peer-urls", &url(a, PEER_PORT)])
                .args(["--initial-cluster", &initial])
                .args(["--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", token])
                // Elections in well under a second, as on a LAN.
                .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
                .args(["--logger", "zap", "--log-level", "warn"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("starting etcd (Debian etcd-server; cargo xtask prereq installs it)");
            members.push(Some(child));
        }
        let c = EtcdCluster {
            ns_path: ns.path(),
            members,
            endpoints: addrs.iter().map(|a| url(a, CLIENT_PORT)).collect(),
            fd: Arc::clone(&ns.fd),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = c.etcdctl(&["endpoint", "health"]);
            if out.status.success() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the etcd cluster did not become healthy within 30 s: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        c
    }

    /// `etcdctl` against every live member.
    pub fn etcdctl(&self, args: &[&str]) -> std::process::Output {
        let eps: Vec<&str> = self
            .endpoints
            .iter()
            .zip(&self.members)
            .filter(|(_, m)| m.is_some())
            .map(|(e, _)| e.as_str())
            .collect();
        cmd_in(&self.fd, "etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", eps.join(",")))
            .args(["--command-timeout=5s"])
            .args(args)
            .output()
            .expect("running etcdctl (Debian etcd-client)")
    }

    /// The keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let out = self.etcdctl(&["get", "--prefix", "--keys-only", prefix]);
        assert!(
            out.status.success(),
            "etcdctl get: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Kill member `i` (SIGKILL, as a crashed machine).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kill every member.
    pub fn kill_all(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }

    /// The `--location-store etcd --etcd-endpoint ...` flags for vnatd.
    pub fn vnatd_flags(&self) -> Vec<String> {
        let mut f = vec!["--location-store".to_string(), "etcd".to_string()];
        for e in &self.endpoints {
            f.push("--etcd-endpoint".into());
            f.push(e.clone());
        }
        f
    }

    pub fn netns_path(&self) -> &Path {
        &self.ns_path
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.kill_all();
    }
}

/// `program` in the namespace of `fd` (as `Netns::cmd`).
fn cmd_in(fd: &Arc<File>, program: &str) -> Command {
    let mut cmd = Command::new(program);
    let fd = Arc::clone(fd);
    // SAFETY: the hook only calls setns(2), which is async-signal-safe,
    // and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}
