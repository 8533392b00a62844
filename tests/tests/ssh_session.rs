//! An interactive ssh session survives the laptop's move (automatic mode,
//! real vnatd on both ends): a real OpenSSH server in the server host's
//! cgroup, a real `ssh -tt` client in the laptop's, driven through its
//! stdin. Output streams from the remote shell while the laptop moves; every
//! line arrives, in order, through the same ssh process, whose connection
//! the server still sees coming from the laptop's virtual address and port.

use std::{
    fs,
    io::{Read, Write},
    net::SocketAddr,
    os::unix::process::CommandExt,
    path::Path,
    process::{Child, ChildStdin, Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{killpg, Signal},
    unistd::Pid,
};
use vnat_tests::{Host, LaptopRouterServer, TempDir, Vnatd};

const SSH_PORT: u16 = 2222;

/// Kills a process group (sshd and its per-connection children) on drop.
struct Group(Child);
impl Drop for Group {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.0.id() as i32), Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

fn keygen(path: &Path) {
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(path)
        .output()
        .expect("running ssh-keygen");
    assert!(
        out.status.success(),
        "ssh-keygen failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// sshd with a generated host key and config, accepting root with the
/// generated client key only, in `srv`'s namespace and cgroup (so the
/// server's vnatd records the accepted connection).
fn sshd(srv: &Host, dir: &Path, addr: SocketAddr) -> Group {
    fs::create_dir_all("/run/sshd")
        .expect("creating /run/sshd (sshd's privilege separation directory)");
    keygen(&dir.join("host_key"));
    keygen(&dir.join("client_key"));
    fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys"))
        .expect("writing authorized_keys");
    let config = format!(
        "Port {port}\nListenAddress {ip}\nHostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\n\
         PidFile {d}/sshd.pid\nUsePAM no\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n\
         PermitRootLogin prohibit-password\nStrictModes no\nPrintMotd no\nPrintLastLog no\nLogLevel VERBOSE\n",
        port = addr.port(),
        ip = addr.ip(),
        d = dir.display()
    );
    fs::write(dir.join("sshd_config"), config).expect("writing sshd_config");
    let log = fs::File::create(dir.join("sshd.log")).expect("creating sshd.log");
    let mut cmd = srv.command("/usr/sbin/sshd");
    cmd.args(["-D", "-e", "-f"]).arg(dir.join("sshd_config"));
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .process_group(0);
    let mut child = Group(cmd.spawn().expect("starting sshd"));
    let filter = format!("sport = :{}", addr.port());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(st)) = child.0.try_wait() {
            panic!(
                "sshd exited at once ({st}): {}",
                fs::read_to_string(dir.join("sshd.log")).unwrap_or_default()
            );
        }
        let out = srv.ns.try_run(&["ss", "-H", "-ltn", &filter]);
        if !out.stdout.iter().all(u8::is_ascii_whitespace) {
            return child;
        }
        assert!(
            Instant::now() < deadline,
            "sshd is not listening on {addr} after 10 s"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// An `ssh -tt` session driven through stdin; stdout is collected.
struct Session {
    child: Child,
    stdin: ChildStdin,
    out: Arc<Mutex<String>>,
    /// Where the next `expect` starts looking.
    seen: usize,
}

impl Session {
    fn start(lap: &Host, dir: &Path, server: SocketAddr) -> Session {
        let mut cmd = lap.command("ssh");
        cmd.arg("-tt").arg("-i").arg(dir.join("client_key"));
        for o in [
            "StrictHostKeyChecking=no",
            "UserKnownHostsFile=/dev/null",
            "BatchMode=yes",
            "ConnectTimeout=10",
            "LogLevel=ERROR",
        ] {
            cmd.args(["-o", o]);
        }
        cmd.args([
            "-p",
            &server.port().to_string(),
            &format!("root@{}", server.ip()),
        ]);
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("starting ssh");
        let stdin = child.stdin.take().expect("piped stdin");
        let out = Arc::new(Mutex::new(String::new()));
        for mut pipe in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let o = Arc::clone(&out);
            thread::spawn(move || {
                let mut buf = [0u8; 8192];
                while let Ok(n) = pipe.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    o.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
        }
        Session {
            child,
            stdin,
            out,
            seen: 0,
        }
    }

    fn send(&mut self, line: &str) {
        self.assert_alive("before sending a command");
        self.stdin
            .write_all(format!("{line}\n").as_bytes())
            .expect("writing to ssh");
        self.stdin.flush().expect("flushing ssh's stdin");
    }

    fn assert_alive(&mut self, when: &str) {
        if let Some(st) = self.child.try_wait().expect("checking ssh") {
            panic!(
                "ssh exited ({st}) {when}; its output:\n{}",
                self.out.lock().unwrap()
            );
        }
    }

    /// Waits for `needle` in the output after the previous match and returns
    /// the text from there up to and including it.
    fn expect(&mut self, needle: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let out = self.out.lock().unwrap();
                if let Some(i) = out[self.seen..].find(needle) {
                    let end = self.seen + i + needle.len();
                    let text = out[self.seen..end].to_string();
                    self.seen = end;
                    return text;
                }
            }
            self.assert_alive(&format!("while waiting for {needle:?}"));
            if Instant::now() > deadline {
                panic!(
                    "no {needle:?} from ssh within {timeout:?}; output so far:\n{}",
                    self.out.lock().unwrap()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for `needle` after the previous match without consuming it.
    fn wait_for(&mut self, needle: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.out.lock().unwrap()[self.seen..].contains(needle) {
            self.assert_alive(&format!("while waiting for {needle:?}"));
            assert!(
                Instant::now() < deadline,
                "no {needle:?} from ssh within {timeout:?}; output so far:\n{}",
                self.out.lock().unwrap()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// `$SSH_CONNECTION` as the remote shell sees it: "client_ip client_port
    /// server_ip server_port".
    fn ssh_connection(&mut self, n: u32) -> String {
        // The sum is computed remotely, so the match is the output, not an
        // echo of the input.
        self.send(&format!("echo \"CONN<$SSH_CONNECTION>$(({n}+1000))\""));
        let text = self.expect(&format!(">{}", n + 1000), Duration::from_secs(10));
        let start = text.rfind("CONN<").expect("CONN< in the output") + 5;
        let end = text.rfind('>').unwrap();
        text[start..end].to_string()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Wait until `d` lists a connection matching `pred` (in `ls --json`).
fn wait_row(
    d: &Vnatd,
    args: &[&str],
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let ls = d.ctl(args).expect("vnatd unreachable");
        if let Some(r) = ls.as_array().expect("array").iter().find(|r| pred(r)) {
            return r.clone();
        }
        assert!(Instant::now() < deadline, "{what}: {ls}");
        thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn interactive_ssh_session_survives_the_laptops_move() {
    let tag = "sshm";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (ldir, sdir, keys) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
        TempDir::new(&format!("{tag}k")),
    );
    let server = SocketAddr::new(topo.server_addr.v4.into(), SSH_PORT);
    let _sshd = sshd(&srv, keys.path(), server);
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());

    let mut ssh = Session::start(&lap, keys.path(), server);
    // No echo of what we type, no prompt, no bracketed-paste escapes: only
    // the remote commands' output comes back, so the streamed lines can be
    // compared byte for byte.
    ssh.send("stty -echo; bind 'set enable-bracketed-paste off' 2>/dev/null; PS1=''; PS2=''; echo READY-$((40+2))");
    ssh.expect("READY-42", Duration::from_secs(20));
    let conn_before = ssh.ssh_connection(1);
    eprintln!("ssh: SSH_CONNECTION before the move: {conn_before}");
    let f: Vec<&str> = conn_before.split(' ').collect();
    assert_eq!(f.len(), 4, "unexpected SSH_CONNECTION {conn_before:?}");
    assert_eq!(
        f[0],
        topo.laptop_a_addr.v4.to_string(),
        "the client address seen by sshd"
    );
    let client_virtual = format!("{}:{}", f[0], f[1]);
    lapd.wait_paired("the laptop's vnatd");
    srvd.wait_paired("the server's vnatd");
    wait_row(
        &lapd,
        &["ls"],
        "the laptop's vnatd does not list the ssh connection",
        |r| r["virtual_local"] == client_virtual && r["virtual_remote"] == server.to_string(),
    );
    wait_row(
        &srvd,
        &["ls"],
        "the server's vnatd does not list the ssh connection",
        |r| r["virtual_local"] == server.to_string() && r["virtual_remote"] == client_virtual,
    );
    // Let both daemons derive the connection's keys.
    thread::sleep(Duration::from_secs(2));

    // The remote shell prints numbered lines, 20 ms apart, while the laptop
    // moves; each line carries a value computed remotely.
    const LINES: u32 = 300;
    ssh.send(&format!("for i in $(seq 1 {LINES}); do echo \"L$i=$((i*7919))\"; sleep 0.02; done; echo DONE-$((9*9))"));
    ssh.wait_for("L20=", Duration::from_secs(10));
    let t0 = Instant::now();
    topo.move_laptop_to_b();
    let streamed = ssh.expect("DONE-81", Duration::from_secs(90));
    eprintln!(
        "ssh: the streamed output finished {:?} after the move",
        t0.elapsed()
    );
    let got: Vec<String> = streamed
        .replace('\r', "")
        .lines()
        .filter(|l| l.starts_with('L') && l.contains('='))
        .map(str::to_string)
        .collect();
    let want: Vec<String> = (1..=LINES).map(|i| format!("L{i}={}", i * 7919)).collect();
    assert_eq!(
        got, want,
        "the remote output during the move is not byte-exact"
    );

    // The same ssh process, the same TCP connection: sshd still sees the
    // laptop's virtual address and port.
    let conn_after = ssh.ssh_connection(2);
    eprintln!("ssh: SSH_CONNECTION after the move: {conn_after}");
    assert_eq!(
        conn_after, conn_before,
        "sshd sees another connection after the move"
    );
    let new_local = format!("{}:{}", topo.laptop_b_addr.v4, f[1]);
    wait_row(
        &lapd,
        &["ls", "--state", "translated"],
        "the laptop's vnatd does not translate the ssh connection",
        |r| r["virtual_local"] == client_virtual && r["physical_local"] == new_local,
    );
    wait_row(
        &srvd,
        &["ls", "--state", "translated"],
        "the server's vnatd does not translate to the laptop's new address",
        |r| r["virtual_remote"] == client_virtual && r["physical_remote"] == new_local,
    );
    // Some interactive back and forth after the move.
    for n in 0..5u32 {
        ssh.send(&format!("echo after-$(({n}*1000+7))-marker"));
        ssh.expect(
            &format!("after-{}-marker", n * 1000 + 7),
            Duration::from_secs(10),
        );
    }
    ssh.send("exit 0");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(st) = ssh.child.try_wait().expect("waiting for ssh") {
            break st;
        }
        assert!(Instant::now() < deadline, "ssh did not exit after `exit 0`");
        thread::sleep(Duration::from_millis(50));
    };
    assert!(
        status.success(),
        "ssh exited with {status}; output:\n{}",
        ssh.out.lock().unwrap()
    );
}
