//! vnat-login1: a stand-in for systemd-logind's sleep interface, for the
//! sleep test (no logind runs on the test hosts).
//!
//! ```text
//! vnat-login1 --delay-ms N        (the bus: DBUS_SYSTEM_BUS_ADDRESS)
//! ```
//!
//! Owns `org.freedesktop.login1` on the system bus and serves, at
//! `/org/freedesktop/login1`, what vnatd uses of
//! `org.freedesktop.login1.Manager`: the `InhibitDelayMaxUSec` property (N
//! ms), `Inhibit`, which returns one end of a pipe and watches the other
//! (the lock holds until every copy of the returned end is closed), and the
//! `PrepareForSleep` signal. Reads commands on stdin, one per line:
//! `sleep` sends `PrepareForSleep(true)`, `wake` sends
//! `PrepareForSleep(false)`. Prints on stdout, one line each:
//!
//! ```text
//! ready
//! inhibited WHO MODE
//! slept|woke              (the signal was sent)
//! released WHO AFTER_MS   (ms since the last `sleep`; -1 before any)
//! ```
//!
//! Exits at the end of stdin.

use std::{
    io::{BufRead, Read, Write},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use zbus::object_server::SignalEmitter;

const PATH: &str = "/org/freedesktop/login1";

/// When the last `sleep` was sent.
type SleptAt = Arc<Mutex<Option<Instant>>>;

struct Manager {
    delay: Duration,
    slept_at: SleptAt,
}

/// One line on stdout, flushed at once (the test reads as it goes).
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

#[zbus::interface(name = "org.freedesktop.login1.Manager")]
impl Manager {
    async fn inhibit(
        &self,
        what: &str,
        who: &str,
        _why: &str,
        mode: &str,
    ) -> zbus::fdo::Result<zbus::zvariant::OwnedFd> {
        if what != "sleep" {
            return Err(zbus::fdo::Error::NotSupported(format!(
                "this stand-in inhibits sleep only, not {what}"
            )));
        }
        let (read_end, write_end) = nix::unistd::pipe()
            .map_err(|e| zbus::fdo::Error::Failed(format!("cannot make a pipe: {e}")))?;
        say(&format!("inhibited {who} {mode}"));
        let (who, slept_at) = (who.to_string(), self.slept_at.clone());
        // The read end sees EOF once every copy of the write end is closed:
        // ours goes with the reply, the client's when it releases the lock.
        std::thread::spawn(move || {
            let mut pipe = std::fs::File::from(read_end);
            let mut buf = [0u8; 64];
            while matches!(pipe.read(&mut buf), Ok(n) if n > 0) {}
            let after = slept_at
                .lock()
                .ok()
                .and_then(|t| *t)
                .map_or(-1, |t| t.elapsed().as_millis() as i64);
            say(&format!("released {who} {after}"));
        });
        Ok(zbus::zvariant::OwnedFd::from(write_end))
    }

    #[zbus(property, name = "InhibitDelayMaxUSec")]
    fn inhibit_delay_max_usec(&self) -> u64 {
        self.delay.as_micros() as u64
    }

    #[zbus(signal)]
    async fn prepare_for_sleep(emitter: &SignalEmitter<'_>, start: bool) -> zbus::Result<()>;
}

fn delay_from_args() -> Result<Duration, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [flag, ms] if flag == "--delay-ms" => ms
            .parse()
            .map(Duration::from_millis)
            .map_err(|_| format!("--delay-ms takes milliseconds, not {ms:?}")),
        _ => Err("usage: vnat-login1 --delay-ms N".into()),
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let delay = delay_from_args().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let slept_at = SleptAt::default();
    let manager = Manager {
        delay,
        slept_at: slept_at.clone(),
    };
    let conn = async {
        zbus::connection::Builder::system()?
            .name("org.freedesktop.login1")?
            .serve_at(PATH, manager)?
            .build()
            .await
    }
    .await
    .unwrap_or_else(|e| {
        eprintln!("vnat-login1: cannot serve org.freedesktop.login1 on the system bus: {e}");
        std::process::exit(1)
    });
    let emitter = SignalEmitter::new(&conn, PATH).unwrap_or_else(|e| {
        eprintln!("vnat-login1: {e}");
        std::process::exit(1)
    });
    say("ready");
    // stdin in a thread: the bus is served on this one meanwhile.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    while let Some(line) = rx.recv().await {
        let start = match line.trim() {
            "sleep" => true,
            "wake" => false,
            other => {
                eprintln!("vnat-login1: unknown command {other:?} (sleep or wake)");
                continue;
            }
        };
        if start {
            if let Ok(mut t) = slept_at.lock() {
                *t = Some(Instant::now());
            }
        }
        match Manager::prepare_for_sleep(&emitter, start).await {
            Ok(()) => say(if start { "slept" } else { "woke" }),
            Err(e) => eprintln!("vnat-login1: cannot send PrepareForSleep: {e}"),
        }
    }
}
