//! Network namespaces, entered without `ip netns exec`.
//!
//! `ip netns exec` remounts /sys in a private mount namespace, which hides
//! bpffs and the cgroup2 mount from the program it runs; vnatd and the tests
//! need both. Child processes therefore enter a namespace with setns(2) in a
//! `pre_exec` hook (no remount, no extra process), and in-process work runs on
//! a thread that setns'd (setns(CLONE_NEWNET) changes only the calling thread).
use std::{
    ffi::OsStr,
    fs::{self, File, OpenOptions},
    io,
    net::{IpAddr, SocketAddr, TcpStream},
    os::{
        fd::AsRawFd,
        unix::{fs::MetadataExt, process::CommandExt},
    },
    path::{Path, PathBuf},
    process::{Command, Output},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use nix::{
    mount::{mount, umount2, MntFlags, MsFlags},
    sched::{setns, unshare, CloneFlags},
    sys::signal::{kill, Signal},
    unistd::Pid,
};

use super::{rtnl::Rtnl, unique_suffix};

/// A uniquely named network namespace (`vt-<tag>-<pid>-<n>`) with `lo` up.
/// Dropping it kills the processes still inside and deletes it.
pub struct Netns {
    pub(super) name: String,
    /// Kept open for setns; shared with `pre_exec` closures of commands that
    /// may outlive a borrow of `self`.
    pub(super) fd: Arc<File>,
    /// A NETLINK_ROUTE socket created inside the namespace, so it talks to
    /// this namespace from any thread (see `links`).
    pub(super) rtnl: Mutex<Rtnl>,
}

impl Netns {
    /// Creates `vt-<tag>-<pid>-<n>`. Keep `tag` short and plain (letters,
    /// digits, `-`).
    pub fn new(tag: &str) -> Netns {
        let name = format!("vt-{tag}-{}", unique_suffix());
        let path = PathBuf::from(NETNS_DIR).join(&name);
        let (fd, rtnl) = create(&path).unwrap_or_else(|e| panic!("creating netns {name}: {e}"));
        let ns = Netns {
            name,
            fd: Arc::new(fd),
            rtnl: Mutex::new(rtnl),
        };
        ns.link_up("lo");
        // Make the namespace independent of the host's defaults (a new netns
        // copies init_net's settings when net.core.devconf_inherit_init_net is
        // set): no reverse-path filter, so translated packets are judged only
        // by vnat; no IPv6 DAD, so addresses and link-local routes are usable
        // at once (set before any veth is created here, which inherits
        // `default`).
        ns.set_sysctl("net/ipv4/conf/all/rp_filter", "0");
        ns.set_sysctl("net/ipv4/conf/default/rp_filter", "0");
        ns.set_sysctl("net/ipv6/conf/all/accept_dad", "0");
        ns.set_sysctl("net/ipv6/conf/default/accept_dad", "0");
        ns
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `/run/netns/<name>`, for `nsenter --net=<path>` or `--netns` options.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(NETNS_DIR).join(&self.name)
    }

    /// A command that runs `program` inside this namespace (setns in the
    /// child before exec; /sys, bpffs and cgroup2 stay visible). Add
    /// arguments, stdio, more `pre_exec` hooks as with any `Command`.
    pub fn cmd(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new(program);
        let fd = Arc::clone(&self.fd);
        // SAFETY: the hook only calls setns(2), which is async-signal-safe,
        // and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd
    }

    /// Runs `args[0]` with `args[1..]` inside the namespace and returns its
    /// output; panics with the command and its stderr if it fails.
    pub fn run<S: AsRef<OsStr>>(&self, args: &[S]) -> Output {
        let out = self.try_run(args);
        if !out.status.success() {
            panic!(
                "in netns {}: `{}` failed ({}): {}",
                self.name,
                show(args),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        out
    }

    /// Like [`Netns::run`] but returns the output whatever the exit status.
    pub fn try_run<S: AsRef<OsStr>>(&self, args: &[S]) -> Output {
        assert!(!args.is_empty(), "Netns::run needs a program");
        self.cmd(&args[0])
            .args(&args[1..])
            .output()
            .unwrap_or_else(|e| panic!("in netns {}: cannot run `{}`: {e}", self.name, show(args)))
    }

    /// Wait (at most 10 s) until something listens on TCP `port` in this
    /// namespace: a server just spawned may take a while to get there on a
    /// loaded machine or in a slow VM, and a client started before would
    /// be refused.
    pub fn wait_tcp_listening(&self, port: u16) {
        let filter = format!("sport = :{port}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while self
            .run_stdout(&["ss", "-H", "-ltn", &filter])
            .trim()
            .is_empty()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "in netns {}: nothing listens on TCP port {port} after 10 s",
                self.name
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Stdout of a successful [`Netns::run`], as a string.
    pub fn run_stdout<S: AsRef<OsStr>>(&self, args: &[S]) -> String {
        String::from_utf8_lossy(&self.run(args).stdout).into_owned()
    }

    /// Runs `f` on a fresh thread that has entered this namespace, and
    /// returns its result (a panic in `f` is re-raised here). Sockets, BPF
    /// attachments by ifindex and /proc/sys/net writes made by `f` apply to
    /// this namespace.
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let fd = &self.fd;
        let name = &self.name;
        thread::scope(|s| {
            let handle = s.spawn(move || {
                setns(fd.as_ref(), CloneFlags::CLONE_NEWNET)
                    .unwrap_or_else(|e| panic!("setns into netns {name}: {e}"));
                f()
            });
            match handle.join() {
                Ok(v) => v,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }

    /// Runs `f` on a new thread that has entered this namespace and may
    /// outlive this borrow (it keeps the namespace open).
    pub fn spawn_in<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> thread::JoinHandle<T> {
        let fd = Arc::clone(&self.fd);
        let name = self.name.clone();
        thread::spawn(move || {
            setns(fd.as_ref(), CloneFlags::CLONE_NEWNET)
                .unwrap_or_else(|e| panic!("setns into netns {name}: {e}"));
            f()
        })
    }

    /// Writes `/proc/sys/<key>` inside the namespace, e.g.
    /// `set_sysctl("net/ipv4/ip_forward", "1")` (dots work too).
    pub fn set_sysctl(&self, key: &str, value: &str) {
        let path = sysctl_path(key);
        self.run_in(|| {
            std::fs::write(&path, value).unwrap_or_else(|e| {
                panic!(
                    "in netns {}: writing {value} to {}: {e}",
                    self.name,
                    path.display()
                )
            })
        });
    }

    /// Reads `/proc/sys/<key>` inside the namespace (trimmed).
    pub fn sysctl(&self, key: &str) -> String {
        let path = sysctl_path(key);
        self.run_in(|| {
            std::fs::read_to_string(&path)
                .unwrap_or_else(|e| {
                    panic!("in netns {}: reading {}: {e}", self.name, path.display())
                })
                .trim()
                .to_string()
        })
    }

    /// IPv4 and IPv6 forwarding on (for routers).
    pub fn enable_forwarding(&self) {
        self.set_sysctl("net/ipv4/ip_forward", "1");
        self.set_sysctl("net/ipv6/conf/all/forwarding", "1");
    }

    /// Pids of the processes whose network namespace this is (as `ip netns
    /// pids` finds them: /proc/<pid>/ns/net is this namespace's inode).
    pub fn pids(&self) -> Vec<i32> {
        let (Ok(ns), Ok(procs)) = (self.fd.metadata(), fs::read_dir("/proc")) else {
            return Vec::new();
        };
        procs
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .filter(|pid: &i32| {
                fs::metadata(format!("/proc/{pid}/ns/net"))
                    .is_ok_and(|m| (m.dev(), m.ino()) == (ns.dev(), ns.ino()))
            })
            .collect()
    }

    /// True if a TCP connection attempt from this namespace to `addr` is
    /// answered (accepted or refused) within `timeout`: plain reachability
    /// without ping (iputils is not a dependency) and without a listener.
    pub fn reachable(&self, addr: IpAddr, timeout: Duration) -> bool {
        // Port 9 (discard) is normally closed: a RST is the answer we expect.
        let target = SocketAddr::new(addr, 9);
        self.run_in(|| match TcpStream::connect_timeout(&target, timeout) {
            Ok(_) => true,
            Err(e) => e.kind() == io::ErrorKind::ConnectionRefused,
        })
    }

    /// Waits up to `timeout` for [`Netns::reachable`]; panics if it never is.
    pub fn wait_reachable(&self, addr: IpAddr, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if self.reachable(addr, Duration::from_millis(500)) {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "from netns {}: {addr} is not reachable after {timeout:?}",
                    self.name
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Processes left inside (servers, clients of a failed test) would keep
        // the namespace and its veths alive: stop them, gently first.
        let me = std::process::id() as i32;
        for signal in [Signal::SIGTERM, Signal::SIGKILL] {
            let pids: Vec<i32> = self.pids().into_iter().filter(|&p| p != me).collect();
            if pids.is_empty() {
                break;
            }
            for pid in &pids {
                let _ = kill(Pid::from_raw(*pid), signal);
            }
            let deadline = Instant::now() + Duration::from_millis(500);
            while Instant::now() < deadline && self.pids().iter().any(|p| *p != me) {
                thread::sleep(Duration::from_millis(20));
            }
        }
        // Never panic in drop (a second panic during unwinding aborts). The
        // namespace itself goes when its last user does (the open `fd`, the
        // processes killed above), as after `ip netns del`.
        if let Err(e) = remove(&self.path()) {
            eprintln!("warning: deleting netns {}: {e}", self.name);
        }
    }
}

/// Where `ip netns` keeps named namespaces: a file each, on which the
/// namespace is bind-mounted so that it lives without a process in it.
const NETNS_DIR: &str = "/run/netns";

/// Creates a network namespace bind-mounted on `path`, as `ip netns add`
/// does, and returns it open (for setns) with a netlink socket inside it.
fn create(path: &Path) -> io::Result<(File, Rtnl)> {
    fs::create_dir_all(NETNS_DIR)?;
    // The mount point; an existing file is someone else's namespace.
    OpenOptions::new().write(true).create_new(true).open(path)?;
    // unshare(CLONE_NEWNET) moves only the calling thread, which then ends:
    // the bind mount keeps the namespace.
    let created = thread::scope(|s| {
        s.spawn(|| -> io::Result<(File, Rtnl)> {
            unshare(CloneFlags::CLONE_NEWNET)?;
            mount(
                Some("/proc/thread-self/ns/net"),
                path,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )?;
            Ok((File::open(path)?, Rtnl::open()?))
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    });
    if created.is_err() {
        let _ = remove(path);
    }
    created
}

/// Unmounts a namespace from its file and deletes the file (`ip netns del`).
fn remove(path: &Path) -> io::Result<()> {
    // MNT_DETACH: processes that still have it open (nsenter, a shell) do
    // not make this fail.
    let unmounted = umount2(path, MntFlags::MNT_DETACH);
    fs::remove_file(path)?;
    unmounted.map_err(io::Error::from)
}

fn sysctl_path(key: &str) -> PathBuf {
    let key = key.trim_start_matches('/').trim_start_matches("proc/sys/");
    // net.ipv4.ip_forward style keys; interface names may contain dots only
    // in the slash form.
    let key = if key.contains('/') {
        key.to_string()
    } else {
        key.replace('.', "/")
    };
    PathBuf::from("/proc/sys").join(key)
}

fn show<S: AsRef<OsStr>>(args: &[S]) -> String {
    args.iter()
        .map(|a| a.as_ref().to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// `bytes_received` of the established TCP socket `local -> remote` in `ns`
/// (`ss -tin`; 0 when ss leaves it out). Panics if there is no such socket:
/// the connection did not survive.
pub fn tcp_bytes_received(
    ns: &Netns,
    local: std::net::SocketAddr,
    remote: std::net::SocketAddr,
) -> usize {
    tcp_info_field(ns, local, remote, "bytes_received") as usize
}

/// Segments the TCP socket `local` -> `remote` in `ns` has received
/// (`segs_in`), duplicates included: what shows that a peer's packets
/// arrive, where the bytes it may resend (already received) would not.
pub fn tcp_segs_received(
    ns: &Netns,
    local: std::net::SocketAddr,
    remote: std::net::SocketAddr,
) -> u64 {
    tcp_info_field(ns, local, remote, "segs_in")
}

/// The counter `name` that `ss -tin` shows for the established TCP socket
/// `local -> remote` in `ns` (0 when ss leaves it out, as it does a zero).
fn tcp_info_field(
    ns: &Netns,
    local: std::net::SocketAddr,
    remote: std::net::SocketAddr,
    name: &str,
) -> u64 {
    let filter = format!("src {} and dst {}", ss_endpoint(local), ss_endpoint(remote));
    let out = ns.run_stdout(&["ss", "-tinoH", "state", "established", &filter]);
    assert!(
        !out.trim().is_empty(),
        "no established socket {local} -> {remote} in {}: the connection did not survive",
        ns.name()
    );
    let prefix = format!("{name}:");
    out.split_whitespace()
        .find_map(|w| w.strip_prefix(prefix.as_str()))
        .map_or(0, |n| {
            n.parse().unwrap_or_else(|e| panic!("{name} in {out}: {e}"))
        })
}

/// An endpoint as `ss` filters take it: IPv6 addresses in brackets.
pub fn ss_endpoint(a: std::net::SocketAddr) -> String {
    match a {
        std::net::SocketAddr::V4(a) => a.to_string(),
        std::net::SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    }
}
