//! cgroup v2 directories for tests: vnat is enabled per cgroup, so a test
//! puts its client processes in a fresh cgroup and enables vnat for that one
//! only, leaving every other test (and the host) untouched.
use std::{
    ffi::CString,
    fs, io,
    os::unix::{fs::MetadataExt, process::CommandExt},
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
    thread,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{kill, Signal},
    unistd::Pid,
};

use super::unique_suffix;

/// The cgroup v2 mount point: `/sys/fs/cgroup` on unified-only systems,
/// `/sys/fs/cgroup/unified` on hybrid ones. Found in /proc/mounts and checked
/// with statfs (CGROUP2_SUPER_MAGIC) so a tmpfs or v1 mount is never taken
/// for it.
pub fn cgroup2_mount() -> &'static Path {
    static MOUNT: OnceLock<PathBuf> = OnceLock::new();
    MOUNT.get_or_init(|| {
        let mounts = fs::read_to_string("/proc/mounts").expect("reading /proc/mounts");
        let candidates = mounts
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let _src = f.next()?;
                let dir = f.next()?;
                (f.next()? == "cgroup2").then(|| PathBuf::from(dir))
            })
            .chain(["/sys/fs/cgroup", "/sys/fs/cgroup/unified"].map(PathBuf::from));
        for dir in candidates {
            if let Ok(st) = nix::sys::statfs::statfs(&dir) {
                if st.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC {
                    return dir;
                }
            }
        }
        panic!("no cgroup v2 hierarchy is mounted (see /proc/mounts): run `cargo xtask prereq`")
    })
}

/// A cgroup `<cgroup2 mount>/vnat-test-<pid>-<n>`. Dropping it kills the
/// processes still in it (moving the test process itself back out first) and
/// removes the directory.
pub struct Cgroup {
    path: PathBuf,
}

impl Cgroup {
    pub fn new(tag: &str) -> Cgroup {
        let path = cgroup2_mount().join(format!("vnat-test-{tag}-{}", unique_suffix()));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("creating cgroup {}: {e}", path.display()));
        Cgroup { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cgroup id, as BPF helpers (`bpf_get_current_cgroup_id`,
    /// `bpf_skb_cgroup_id`) report it: on cgroup v2 it is the inode number of
    /// the directory.
    pub fn id(&self) -> u64 {
        fs::metadata(&self.path)
            .unwrap_or_else(|e| panic!("stat {}: {e}", self.path.display()))
            .ino()
    }

    /// Moves process `pid` (all its threads) into this cgroup.
    ///
    /// A process is in exactly one cgroup, so moving the test process itself
    /// here fights with every other test running in parallel: prefer
    /// [`Cgroup::join_on_spawn`] for the processes whose connections vnat
    /// should handle.
    pub fn add_pid(&self, pid: u32) {
        let procs = self.path.join("cgroup.procs");
        fs::write(&procs, pid.to_string())
            .unwrap_or_else(|e| panic!("moving pid {pid} into {}: {e}", self.path.display()));
    }

    /// Makes `cmd`'s process join this cgroup before it execs, so that it is
    /// inside from its first instruction (no window in which it could open a
    /// connection outside the cgroup).
    pub fn join_on_spawn<'a>(&self, cmd: &'a mut Command) -> &'a mut Command {
        let procs = CString::new(
            self.path
                .join("cgroup.procs")
                .into_os_string()
                .into_encoded_bytes(),
        )
        .expect("cgroup path contains a NUL byte");
        // SAFETY: open/write/close are async-signal-safe and the path was
        // allocated before fork; writing "0" moves the writing process.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if n != 1 {
                    return Err(err);
                }
                Ok(())
            });
        }
        cmd
    }

    /// Pids currently in this cgroup.
    pub fn procs(&self) -> Vec<u32> {
        read_procs(&self.path)
    }
}

fn read_procs(dir: &Path) -> Vec<u32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        let me = std::process::id();
        if read_procs(&self.path).contains(&me) {
            // The test put itself here; rmdir needs it out, and killing
            // everything inside must not kill the test. The parent directory
            // is where it came from in the common case of add_pid(self).
            let parent = self.path.parent().unwrap_or(cgroup2_mount());
            if let Err(e) = fs::write(parent.join("cgroup.procs"), me.to_string()) {
                eprintln!(
                    "warning: moving the test process out of {}: {e}",
                    self.path.display()
                );
            }
        }
        // cgroup.kill (Linux 5.14) kills everything atomically, also
        // processes forking right now; fall back to signalling each pid.
        if fs::write(self.path.join("cgroup.kill"), "1").is_err() {
            for pid in read_procs(&self.path) {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match fs::remove_dir(&self.path) {
                Ok(()) => return,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return,
                // EBUSY until the killed processes are reaped from the cgroup.
                Err(e) if Instant::now() > deadline => {
                    eprintln!("warning: removing cgroup {}: {e}", self.path.display());
                    return;
                }
                Err(_) => thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}
