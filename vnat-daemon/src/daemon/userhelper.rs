//! Installed keep-alive helpers (issue 18, item 3): an executable in
//! `helpers_dir`, named by a peer's HELP and allowed by `peer_helpers`, run
//! when the peer goes away and again when it is back.
//!
//! It runs without privileges and can touch only its connection: as user
//! and group nobody (no supplementary groups), with no environment, in `/`,
//! with the connection's socket as descriptor 3 (a duplicate taken from
//! its process) and a JSON object on its standard input:
//! `{"event": "away" | "back", "proto", "local", "remote"}`. Its
//! output is discarded; it is killed after [`RUN_LIMIT`]. vnatd runs only a
//! regular file that belongs to root and that neither its group nor others
//! may write, in a directory of the same kind: anyone who could change it
//! could otherwise run code as vnatd's helper.

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
        if m.uid() != 0 || m.mode() & 0o022 != 0 {
            return Err(format!(
                "{what} {} must belong to root and be writable by nobody else",
                p.display()
            ));
        }
        Ok(m)
    };
    safe(dir, "the helpers directory")?;
    let path = dir.join(name);
    let m = safe(&path, "the helper")?;
    if !m.file_type().is_file() || m.mode() & 0o111 == 0 {
        return Err(format!(
            "the helper {} is no executable file",
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
    if let Some(sock) = &socket {
        let fd = sock.as_raw_fd();
        // SAFETY: between fork and exec only dup2 is called, which is
        // async-signal-safe, on descriptors that are open in the child
        // (`fd` is vnatd's duplicate, inherited by the fork); dup2 clears
        // close-on-exec on descriptor 3, so the helper gets the socket.
        unsafe {
            cmd.pre_exec(move || {
                if libc::dup2(fd, 3) < 0 {
                    return Err(io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn()?;
    drop(socket);
    if let Some(mut stdin) = child.stdin.take() {
        let _ = writeln!(stdin, "{input}");
    }
    let deadline = Instant::now() + RUN_LIMIT;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
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
