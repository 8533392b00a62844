//! A system bus of the test's own (a real dbus-daemon on a socket in a
//! temporary directory) and the stand-in logind on it (`vnat-login1`), for
//! vnatd's sleep inhibitor. The socket is a path, so a vnatd in any network
//! namespace reaches it through `DBUS_SYSTEM_BUS_ADDRESS`.

use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use super::{bin_path, TempDir};

/// A dbus-daemon that lets anyone on it own `org.freedesktop.login1` and
/// talk to it; killed and removed on drop.
pub struct SystemBus {
    child: Child,
    socket: PathBuf,
    _dir: TempDir,
}

impl SystemBus {
    pub fn start(tag: &str) -> SystemBus {
        let dir = TempDir::new(&format!("{tag}-bus"));
        let socket = dir.path().join("system_bus_socket");
        let config = dir.path().join("bus.conf");
        std::fs::write(&config, bus_config(&socket))
            .unwrap_or_else(|e| panic!("writing {}: {e}", config.display()));
        let child = Command::new("dbus-daemon")
            .arg(format!("--config-file={}", config.display()))
            .args(["--nofork", "--nopidfile", "--nosyslog"])
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting dbus-daemon (cargo xtask prereq installs it)");
        let bus = SystemBus {
            child,
            socket,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !bus.socket.exists() {
            assert!(
                Instant::now() < deadline,
                "dbus-daemon did not listen within 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        bus
    }

    /// What `DBUS_SYSTEM_BUS_ADDRESS` says to reach it.
    pub fn address(&self) -> String {
        format!("unix:path={}", self.socket.display())
    }
}

impl Drop for SystemBus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The bus's configuration: no user switch, no activation, and a policy
/// that allows the stand-in's name, calls to it, its answers and signals
/// (dbus-daemon refuses what no rule allows, answers included).
fn bus_config(socket: &Path) -> String {
    format!(
        r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="org.freedesktop.login1"/>
    <allow send_destination="org.freedesktop.login1"/>
    <allow send_destination="org.freedesktop.DBus"/>
    <allow send_type="signal"/>
    <allow send_type="method_return"/>
    <allow send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
  </policy>
</busconfig>
"#,
        socket.display()
    )
}

/// What the stand-in logind reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LogindEvent {
    Inhibited {
        who: String,
        mode: String,
    },
    /// The lock was released this long after the last `sleep` (None
    /// before any).
    Released {
        who: String,
        after: Option<Duration>,
    },
    Slept,
    Woke,
}

/// `vnat-login1` on a [`SystemBus`]; killed on drop.
pub struct StandInLogind {
    child: Child,
    stdin: ChildStdin,
    events: mpsc::Receiver<LogindEvent>,
}

impl StandInLogind {
    /// Serve logind's sleep interface with this `InhibitDelayMaxUSec`.
    pub fn start(bus: &SystemBus, delay: Duration) -> StandInLogind {
        let mut child = Command::new(bin_path("vnat-login1"))
            .args(["--delay-ms", &delay.as_millis().to_string()])
            .env("DBUS_SYSTEM_BUS_ADDRESS", bus.address())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("starting vnat-login1");
        let stdin = child.stdin.take().expect("vnat-login1's stdin");
        let stdout = child.stdout.take().expect("vnat-login1's stdout");
        let (ready_tx, ready) = mpsc::channel();
        let (tx, events) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line == "ready" {
                    let _ = ready_tx.send(());
                } else if let Some(e) = parse_event(&line) {
                    let _ = tx.send(e);
                } else {
                    eprintln!("vnat-login1 said {line:?}");
                }
            }
        });
        ready
            .recv_timeout(Duration::from_secs(10))
            .expect("vnat-login1 did not own org.freedesktop.login1 within 10 s");
        StandInLogind {
            child,
            stdin,
            events,
        }
    }

    fn command(&mut self, what: &str) {
        writeln!(self.stdin, "{what}")
            .and_then(|()| self.stdin.flush())
            .expect("writing to vnat-login1");
    }

    /// Send `PrepareForSleep(true)`.
    pub fn sleep(&mut self) {
        self.command("sleep");
    }

    /// Send `PrepareForSleep(false)`.
    pub fn wake(&mut self) {
        self.command("wake");
    }

    /// The next event `pick` takes (the others are dropped), within
    /// `timeout`; panics naming `what` otherwise.
    pub fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut pick: impl FnMut(LogindEvent) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.events.recv_timeout(left) {
                Ok(e) => {
                    if let Some(t) = pick(e) {
                        return t;
                    }
                }
                Err(_) => panic!("vnat-login1: no {what} within {timeout:?}"),
            }
        }
    }
}

impl Drop for StandInLogind {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn parse_event(line: &str) -> Option<LogindEvent> {
    let words: Vec<&str> = line.split_whitespace().collect();
    match words.as_slice() {
        ["inhibited", who, mode] => Some(LogindEvent::Inhibited {
            who: who.to_string(),
            mode: mode.to_string(),
        }),
        ["released", who, ms] => Some(LogindEvent::Released {
            who: who.to_string(),
            after: ms.parse::<u64>().ok().map(Duration::from_millis),
        }),
        ["slept"] => Some(LogindEvent::Slept),
        ["woke"] => Some(LogindEvent::Woke),
        _ => None,
    }
}
