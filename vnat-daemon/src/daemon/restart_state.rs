//! What must last across a restart of vnatd (issue 32, item 4), beside
//! what the pins keep (the translations): where an operator placed a
//! connection (`vnatctl migrate`), so that automatic mode does not take it
//! back once a new vnatd starts, and what vnatd changed on applications'
//! sockets while helping them across an outage (SO_KEEPALIVE turned off,
//! TCP_USER_TIMEOUT raised) and to the processes behind them (the stop
//! helper's SIGSTOP), so that a vnatd that starts after one that died
//! (SIGKILL, OOM) gives the sockets their settings back and lets the
//! processes go on.
//!
//! Kept in the state directory (`restart.json`), written atomically. A
//! change to a socket is written *before* it is made: a vnatd killed right
//! after the change still leaves the record. Each entry names its socket
//! by the flow and the kernel's socket cookie, so a new socket that reuses
//! the 4-tuple is never taken for the old one; a file of an earlier boot
//! is dropped (its sockets are gone). No I/O here but the file's and
//! the processes' (their start time, SIGCONT); the sockets are the
//! datapath's.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::datapath::VirtualFlow;

/// The file's name in the state directory.
pub const FILE: &str = "restart.json";

/// A connection an operator placed at `at` (`vnatctl migrate`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placed {
    pub flow: VirtualFlow,
    pub cookie: u64,
    pub at: IpAddr,
}

/// What to put back on a socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "undo", rename_all = "snake_case")]
pub enum Undo {
    /// vnatd turned SO_KEEPALIVE off (the suspend's keepalive hold): on
    /// again.
    KeepaliveOn,
    /// vnatd raised TCP_USER_TIMEOUT (a peer's zero-window help): this
    /// value again, in ms; `None`: not yet known when the record was
    /// written (vnatd died between the record and the change), so the
    /// kernel's default (0) is given back.
    UserTimeout { before: Option<u32> },
    /// vnatd stopped the connection's process (the stop helper): SIGCONT,
    /// if the process with `pid` is still the one that started at
    /// `start_time` (clock ticks since boot, /proc/PID/stat), whether its
    /// socket still exists or not.
    Continue { pid: u32, start_time: u64 },
}

/// SIGCONT to process `pid` if it is still the one that started at
/// `started`: through a pidfd opened before the check, so that no
/// process that takes the pid after the check gets the signal. Whether it
/// was sent.
pub fn let_go_on(pid: u32, started: u64) -> bool {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if p <= 1 {
        return false;
    }
    // SAFETY: pidfd_open takes no pointers; the result is owned at once
    // below or is -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p, 0) };
    if fd < 0 {
        return false;
    }
    // SAFETY: `fd` is the fresh descriptor pidfd_open just returned.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd as libc::c_int) };
    if start_time(pid) != Some(started) {
        return false;
    }
    // SAFETY: pidfd_send_signal reads no memory here (a null siginfo); the
    // pidfd is open (owned by `pidfd`).
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGCONT,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    r == 0
}

/// The start time of process `pid` (field 22 of /proc/PID/stat, clock
/// ticks since boot), `None` if it is gone.
pub fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) state ppid ...": the command may hold spaces and
    // parens, so the fields are counted from its last closing paren; the
    // state is field 3, the start time field 22.
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// One change to a socket to undo.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hold {
    pub flow: VirtualFlow,
    pub cookie: u64,
    #[serde(flatten)]
    pub undo: Undo,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct File {
    boot_id: String,
    #[serde(default)]
    placed: Vec<Placed>,
    #[serde(default)]
    holds: Vec<Hold>,
}

/// The file as last written, and what the previous vnatd left in it.
#[derive(Debug, Default)]
pub struct RestartState {
    /// `None`: in memory only (tests).
    path: Option<PathBuf>,
    written: File,
    /// Placements the previous vnatd left, until the connections are seen
    /// ([`RestartState::take_left_placements`]).
    left_placed: Vec<Placed>,
    /// Changes the previous vnatd left on sockets, until undone or their
    /// socket is known to be gone.
    left_holds: Vec<Hold>,
}

impl RestartState {
    pub fn in_memory() -> RestartState {
        RestartState::default()
    }

    /// The state `state_dir` holds. A missing file, or one of an earlier
    /// boot, leaves nothing; an unreadable one is ignored with a warning.
    pub fn load(state_dir: &Path) -> RestartState {
        let path = state_dir.join(FILE);
        let boot_id = super::hostaddrs::boot_id();
        let file = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<File>(&bytes) {
                Ok(f) if f.boot_id == boot_id && !boot_id.is_empty() => f,
                Ok(_) => File::default(),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "ignoring an unreadable restart state; connections placed by migrate may move, and sockets whose keepalive the last vnatd held keep it off");
                    File::default()
                }
            },
            Err(_) => File::default(),
        };
        if !file.holds.is_empty() || !file.placed.is_empty() {
            tracing::info!(
                placed = file.placed.len(),
                socket_changes = file.holds.len(),
                "the previous vnatd left placements and socket changes to take over"
            );
        }
        RestartState {
            path: Some(path),
            left_placed: file.placed.clone(),
            left_holds: file.holds.clone(),
            written: File { boot_id, ..file },
        }
    }

    /// The placements the previous vnatd left (once: the caller applies
    /// them to the connections it lists).
    pub fn take_left_placements(&mut self) -> Vec<Placed> {
        std::mem::take(&mut self.left_placed)
    }

    /// The socket changes the previous vnatd left and nobody undid yet.
    pub fn left_holds(&self) -> &[Hold] {
        &self.left_holds
    }

    /// Forget the left changes for which `done` holds (undone, or their
    /// socket is gone).
    pub fn forget_left(&mut self, done: impl Fn(&Hold) -> bool) {
        self.left_holds.retain(|h| !done(h));
    }

    /// Record `placed` and `holds` (this vnatd's, plus what is left of
    /// the previous one's), if they differ from what the file holds. A
    /// caller about to change a socket must not change it when this fails
    /// (the record must be on disk first); otherwise a failure is retried
    /// at the next save.
    pub fn save(
        &mut self,
        mut placed: Vec<Placed>,
        mut holds: Vec<Hold>,
    ) -> Result<(), super::identity::StateError> {
        // Placements left by the previous vnatd stay until applied: a
        // restart before the first listing must not lose them.
        placed.extend(self.left_placed.iter().copied());
        holds.extend(self.left_holds.iter().copied());
        placed.sort_by_key(|p| (p.flow, p.cookie));
        placed.dedup();
        holds.sort_by_key(|h| (h.flow, h.cookie, undo_rank(&h.undo)));
        holds.dedup();
        if placed == self.written.placed && holds == self.written.holds {
            return Ok(());
        }
        let next = File {
            boot_id: self.written.boot_id.clone(),
            placed,
            holds,
        };
        if let Some(path) = &self.path {
            let bytes = serde_json::to_vec_pretty(&next).unwrap_or_default();
            super::identity::write_atomic(path, &bytes)?;
        }
        self.written = next;
        Ok(())
    }

    /// What the file holds now (tests).
    #[cfg(test)]
    fn written(&self) -> (&[Placed], &[Hold]) {
        (&self.written.placed, &self.written.holds)
    }
}

fn undo_rank(u: &Undo) -> u8 {
    match u {
        Undo::KeepaliveOn => 0,
        Undo::UserTimeout { .. } => 1,
        Undo::Continue { .. } => 2,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::Proto;

    fn flow(port: u16) -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: format!("198.18.1.2:{port}").parse().unwrap(),
            remote: "198.18.3.2:5001".parse().unwrap(),
        }
    }

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vnat-restart-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn what_one_vnatd_saved_the_next_one_takes_over() {
        let d = dir("over");
        let placed = Placed {
            flow: flow(40000),
            cookie: 7,
            at: "198.18.2.2".parse().unwrap(),
        };
        let hold = Hold {
            flow: flow(40001),
            cookie: 8,
            undo: Undo::UserTimeout { before: Some(5000) },
        };
        let mut s = RestartState::load(&d);
        s.save(vec![placed], vec![hold]).unwrap();
        // Killed: the next one finds both.
        let mut next = RestartState::load(&d);
        assert_eq!(next.left_holds(), &[hold]);
        // Saved again before the placements were applied: still there.
        next.save(Vec::new(), Vec::new()).unwrap();
        let mut third = RestartState::load(&d);
        assert_eq!(third.take_left_placements(), vec![placed]);
        // Undone and applied: nothing is left for a later one.
        third.forget_left(|_| true);
        third.save(Vec::new(), Vec::new()).unwrap();
        let last = RestartState::load(&d);
        assert!(last.left_holds().is_empty() && last.left_placed.is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_file_of_another_boot_or_unreadable_leaves_nothing() {
        let d = dir("boot");
        let other = File {
            boot_id: "not-this-boot".into(),
            placed: Vec::new(),
            holds: vec![Hold {
                flow: flow(1),
                cookie: 1,
                undo: Undo::KeepaliveOn,
            }],
        };
        std::fs::write(d.join(FILE), serde_json::to_vec(&other).unwrap()).unwrap();
        assert!(RestartState::load(&d).left_holds().is_empty());
        std::fs::write(d.join(FILE), b"{not json").unwrap();
        assert!(RestartState::load(&d).left_holds().is_empty());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn unchanged_state_is_not_written_again_and_the_order_does_not_matter() {
        let mut s = RestartState::in_memory();
        let h = |p, undo| Hold {
            flow: flow(p),
            cookie: 1,
            undo,
        };
        let a = h(2, Undo::KeepaliveOn);
        let b = h(1, Undo::UserTimeout { before: None });
        s.save(Vec::new(), vec![a, b]).unwrap();
        assert_eq!(s.written().1, &[b, a]);
        s.save(Vec::new(), vec![b, a, a]).unwrap();
        assert_eq!(s.written().1, &[b, a]);
    }

    #[test]
    fn a_process_is_named_by_its_start_time() {
        let me = std::process::id();
        let t = start_time(me).expect("this process's start time");
        assert_eq!(start_time(me), Some(t), "stable");
        assert!(start_time(u32::MAX).is_none());
        let h = Hold {
            flow: flow(1),
            cookie: 1,
            undo: Undo::Continue {
                pid: me,
                start_time: t,
            },
        };
        let v = serde_json::to_value(h).unwrap();
        assert_eq!(v["undo"], "continue");
        assert_eq!(serde_json::from_value::<Hold>(v).unwrap(), h);
    }

    #[test]
    fn the_file_format_is_readable() {
        let h = Hold {
            flow: flow(40000),
            cookie: 3,
            undo: Undo::UserTimeout { before: Some(0) },
        };
        let v = serde_json::to_value(h).unwrap();
        assert_eq!(v["undo"], "user_timeout");
        assert_eq!(v["before"], 0);
        assert_eq!(v["cookie"], 3);
        assert_eq!(serde_json::from_value::<Hold>(v).unwrap(), h);
    }
}
