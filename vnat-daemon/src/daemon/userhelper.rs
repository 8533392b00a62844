//! Installed keep-alive helpers (issue 18, item 3): an executable in
//! `helpers_dir`, named by a peer's HELP and allowed by `peer_helpers`, run
//! when the peer goes away and again when it is back.
//!
//! It runs without privileges and can touch only its connection: as user
//! and group nobody (no supplementary groups), with no environment, in `/`,
//! with the connection's socket as descriptor 3 (a duplicate taken from
//! its process) and a JSON object on its standard input:
//! `{"event": "away" | "back", "proto", "local", "remote"}`. Its
//! output is discarded; it runs in a session of its own, which is killed
//! after [`RUN_LIMIT`], with no other descriptor of vnatd's and no way to
//! gain privileges (no_new_privs). vnatd runs only a regular file that
//! belongs to root, that neither its group nor others may write and that
//! is not set-uid or set-gid, in a directory (and parents) of the same
//! kind: anyone who could change it could otherwise run code as vnatd's
//! helper. Every helper runs as nobody: another process of that user could
//! reach it (and its descriptor 3) while it runs.

use std::{
    io::{self, Write},
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::{fs::MetadataExt, process::CommandExt},
    },
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use crate::datapath::VirtualFlow;

/// How long a helper may run.
pub const RUN_LIMIT: Duration = Duration::from_secs(10);
/// nobody / nogroup.
const NOBODY: u32 = 65534;

/// The helper `name` in `dir`, if it may be run (see the module
/// documentation); the error says why not.
pub fn executable(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let safe = |p: &Path, what: &str| -> Result<std::fs::Metadata, String> {
        let m = std::fs::symlink_metadata(p).map_err(|e| format!("{what} {}: {e}", p.display()))?;
        if m.file_type().is_symlink() {
            return Err(format!("{what} {} is a symbolic link", p.display()));
        }
        if m.uid() != 0 || m.mode() & 0o022 != 0 {
            return Err(format!(
                "{what} {} must belong to root and be writable by nobody else",
                p.display()
            ));
        }
        Ok(m)
    };
    safe(dir, "the helpers directory")?;
    // A parent anyone may write could have the directory swapped, unless
    // it is sticky (as /tmp is: only a file's owner may rename it there).
    for parent in dir.ancestors().skip(1) {
        let m = std::fs::metadata(parent)
            .map_err(|e| format!("the helpers directory's parent {}: {e}", parent.display()))?;
        if m.uid() != 0 || (m.mode() & 0o022 != 0 && m.mode() & 0o1000 == 0) {
            return Err(format!(
                "the helpers directory's parent {} must belong to root and be writable by nobody else",
                parent.display()
            ));
        }
    }
    let path = dir.join(name);
    let m = safe(&path, "the helper")?;
    if !m.file_type().is_file() || m.mode() & 0o111 == 0 {
        return Err(format!(
            "the helper {} is no executable file",
            path.display()
        ));
    }
    if m.mode() & 0o6000 != 0 {
        return Err(format!(
            "the helper {} is set-uid or set-gid",
            path.display()
        ));
    }
    Ok(path)
}

/// Run `path` for `event` on `flow` (see the module documentation), and
/// wait for it at most [`RUN_LIMIT`]. Blocking: call it from a thread of
/// its own.
pub fn run(
    path: &Path,
    event: &str,
    flow: &VirtualFlow,
    socket: Option<OwnedFd>,
) -> io::Result<std::process::ExitStatus> {
    let input = serde_json::json!({
        "event": event,
        "proto": flow.proto.to_string(),
        "local": flow.local.to_string(),
        "remote": flow.remote.to_string(),
    });
    let mut cmd = Command::new(path);
    cmd.env_clear()
        .current_dir("/")
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let fd = socket.as_ref().map(|s| s.as_raw_fd());
    // SAFETY: between fork and exec only async-signal-safe system calls are
    // made (setsid, prctl, dup2, fcntl, close_range), on descriptors open in
    // the child (`fd` is vnatd's duplicate, inherited by the fork). dup2
    // clears close-on-exec on descriptor 3 (fcntl does, when the duplicate
    // already is 3), so the helper gets the socket and, after close_range,
    // no other descriptor of vnatd's (std's own are close-on-exec).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 || libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            let moved = match fd {
                Some(3) => libc::fcntl(3, libc::F_SETFD, 0),
                Some(fd) => libc::dup2(fd, 3),
                None => 0,
            };
            if moved < 0 {
                return Err(io::Error::last_os_error());
            }
            let first: libc::c_uint = if fd.is_some() { 4 } else { 3 };
            libc::syscall(libc::SYS_close_range, first, libc::c_uint::MAX, 0);
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    drop(socket);
    if let Some(mut stdin) = child.stdin.take() {
        // One line, far below a pipe's buffer: never blocks.
        let _ = writeln!(stdin, "{input}");
    }
    // Its whole session: what it started in the background too.
    let kill_all = |child: &mut std::process::Child| {
        if let Ok(pid) = libc::pid_t::try_from(child.id()) {
            // SAFETY: kill takes no pointers; the group is the helper's own
            // session (setsid above), whose leader is not reaped yet.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
        let _ = child.kill();
    };
    let deadline = Instant::now() + RUN_LIMIT;
    loop {
        let done = match child.try_wait() {
            Ok(d) => d,
            Err(e) => {
                kill_all(&mut child);
                let _ = child.wait();
                return Err(e);
            }
        };
        if let Some(status) = done {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            kill_all(&mut child);
            let status = child.wait()?;
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("killed after {} s ({status})", RUN_LIMIT.as_secs()),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn only_roots_unwritable_executables_run() {
        let dir = std::env::temp_dir().join(format!("vnat-helpers-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let ok = dir.join("ok");
        std::fs::write(&ok, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&ok, std::fs::Permissions::from_mode(0o755)).unwrap();
        let writable = dir.join("writable");
        std::fs::write(&writable, "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&writable, std::fs::Permissions::from_mode(0o777)).unwrap();
        let plain = dir.join("plain");
        std::fs::write(&plain, "data").unwrap();
        std::fs::set_permissions(&plain, std::fs::Permissions::from_mode(0o644)).unwrap();
        // The unit tests run as root (the file is root's) or not (then no
        // helper may run at all).
        // SAFETY: geteuid takes nothing and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        assert_eq!(executable(&dir, "ok").is_ok(), root);
        assert!(executable(&dir, "writable")
            .unwrap_err()
            .contains("writable"));
        assert!(executable(&dir, "plain").is_err());
        assert!(executable(&dir, "missing").is_err());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(
            executable(&dir, "ok").is_err(),
            "a directory anyone may write"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
