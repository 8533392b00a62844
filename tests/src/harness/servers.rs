//! Real servers beyond socat: iperf3 and sshd, started in a namespace and
//! stopped on drop.
use std::{
    fs,
    net::SocketAddr,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{killpg, Signal},
    unistd::Pid,
};

use super::{unique_suffix, Netns};

/// Spawns `cmd` in its own process group and waits until something listens
/// on TCP `port` in `ns`; panics with the program's name if it exits or
/// takes more than 10 s.
fn spawn_listening(ns: &Netns, mut cmd: Command, port: u16, what: &str) -> Child {
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    // Own group, so drop reaches the children (sshd's per-connection ones).
    cmd.process_group(0);
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {what} in netns {}: {e}", ns.name()));
    let filter = format!("sport = :{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{what} in netns {} exited at once: {status}", ns.name());
        }
        let out = ns.try_run(&["ss", "-H", "-ltn", &filter]);
        if out.status.success() && !out.stdout.iter().all(u8::is_ascii_whitespace) {
            return child;
        }
        if Instant::now() > deadline {
            let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.wait();
            panic!(
                "{what} in netns {} is not listening on port {port} after 10 s",
                ns.name()
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn stop_group(child: &mut Child) {
    let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
    let _ = child.wait();
}

/// A program (socat and the like) in its own process group, killed with its
/// children on drop.
pub struct ProcessGroup(pub Child);

impl ProcessGroup {
    /// Spawn `cmd`, with the stdio it was given, as a new group's leader.
    pub fn spawn(mut cmd: Command, what: &str) -> ProcessGroup {
        cmd.process_group(0);
        ProcessGroup(
            cmd.spawn()
                .unwrap_or_else(|e| panic!("cannot start {what}: {e}")),
        )
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        stop_group(&mut self.0);
    }
}

/// `iperf3 -s -B ADDR -p PORT` in a namespace.
pub struct Iperf3Server {
    child: Child,
    pub addr: SocketAddr,
}

impl Iperf3Server {
    pub fn start(ns: &Netns, addr: SocketAddr) -> Iperf3Server {
        let mut cmd = ns.cmd("iperf3");
        cmd.args([
            "-s",
            "-B",
            &addr.ip().to_string(),
            "-p",
            &addr.port().to_string(),
        ]);
        let child = spawn_listening(ns, cmd, addr.port(), "iperf3 -s");
        Iperf3Server { child, addr }
    }

    /// iperf3 as users run it: no `-B`, so it listens on `[::]:PORT` with a
    /// dual-stack socket and sees IPv4 clients as `::ffff:a.b.c.d`; inside
    /// `cgroup`, so that the host's vnatd records its connections. Clients
    /// made with [`Iperf3Server::client_cmd`] connect to `connect_to`.
    pub fn start_dual_stack(
        ns: &Netns,
        cgroup: &super::Cgroup,
        connect_to: SocketAddr,
    ) -> Iperf3Server {
        let mut cmd = ns.cmd("iperf3");
        cmd.args(["-s", "-p", &connect_to.port().to_string()]);
        cgroup.join_on_spawn(&mut cmd);
        let child = spawn_listening(ns, cmd, connect_to.port(), "iperf3 -s (dual-stack)");
        Iperf3Server {
            child,
            addr: connect_to,
        }
    }

    /// `iperf3 -c ADDR -p PORT -J ARGS` to run in `ns` (JSON report on
    /// stdout; add e.g. `-t 5`, `-u -b 10M`, `-R`).
    pub fn client_cmd(&self, ns: &Netns, args: &[&str]) -> Command {
        let mut cmd = ns.cmd("iperf3");
        cmd.args([
            "-c",
            &self.addr.ip().to_string(),
            "-p",
            &self.addr.port().to_string(),
            "-J",
        ]);
        cmd.args(args);
        cmd
    }
}

impl Drop for Iperf3Server {
    fn drop(&mut self) {
        stop_group(&mut self.child);
    }
}

/// An sshd of its own (own config, host key and authorized client key in a
/// temporary directory) listening on ADDR:PORT in a namespace, accepting
/// root logins with the generated key only.
pub struct SshServer {
    child: Child,
    pub addr: SocketAddr,
    dir: PathBuf,
}

impl SshServer {
    pub fn start(ns: &Netns, addr: SocketAddr) -> SshServer {
        let dir = std::env::temp_dir().join(format!("vnat-test-ssh-{}", unique_suffix()));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        // sshd refuses to start without its privilege-separation directory.
        fs::create_dir_all("/run/sshd").unwrap_or_else(|e| panic!("creating /run/sshd: {e}"));
        for key in ["host_key", "client_key"] {
            keygen(&dir.join(key));
        }
        fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys"))
            .unwrap_or_else(|e| panic!("writing authorized_keys in {}: {e}", dir.display()));
        let listen = match addr {
            SocketAddr::V4(a) => a.ip().to_string(),
            SocketAddr::V6(a) => format!("[{}]", a.ip()),
        };
        let config = format!(
            "Port {port}\nListenAddress {listen}\nHostKey {dir}/host_key\n\
             AuthorizedKeysFile {dir}/authorized_keys\nPidFile none\nUsePAM no\n\
             PasswordAuthentication no\nKbdInteractiveAuthentication no\n\
             PermitRootLogin prohibit-password\nStrictModes no\nPrintMotd no\nLogLevel ERROR\n",
            port = addr.port(),
            dir = dir.display(),
        );
        fs::write(dir.join("sshd_config"), config)
            .unwrap_or_else(|e| panic!("writing sshd_config: {e}"));
        let mut cmd = ns.cmd("/usr/sbin/sshd");
        // -D: stay in the foreground (so drop can stop it), -e: log to stderr.
        cmd.args(["-D", "-e", "-f"]).arg(dir.join("sshd_config"));
        SshServer {
            child: spawn_listening(ns, cmd, addr.port(), "sshd"),
            addr,
            dir,
        }
    }

    /// `ssh ... root@ADDR REMOTE_COMMAND` to run in `ns` with the generated
    /// key, no host key checks and no prompts. Add `-o` options with
    /// [`SshServer::client_cmd_with`].
    pub fn client_cmd(&self, ns: &Netns, remote_command: &str) -> Command {
        self.client_cmd_with(ns, &[], remote_command)
    }

    /// Like [`SshServer::client_cmd`] with extra ssh options (before the
    /// destination), e.g. `["-o", "ServerAliveInterval=1"]`.
    pub fn client_cmd_with(&self, ns: &Netns, options: &[&str], remote_command: &str) -> Command {
        let mut cmd = ns.cmd("ssh");
        cmd.arg("-i").arg(self.dir.join("client_key"));
        cmd.args([
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
            "-p",
            &self.addr.port().to_string(),
        ]);
        cmd.args(options);
        cmd.arg(format!("root@{}", self.addr.ip()))
            .arg(remote_command);
        cmd
    }

    /// The temporary directory with the keys and the config.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

fn keygen(path: &Path) {
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("cannot run ssh-keygen: {e}"));
    assert!(
        out.status.success(),
        "ssh-keygen failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

impl Drop for SshServer {
    fn drop(&mut self) {
        stop_group(&mut self.child);
        let _ = fs::remove_dir_all(&self.dir);
    }
}
