//! Per-test directories on bpffs, so that each test's vnatd pins its maps and
//! links where no other test looks.
use std::{
    fs, io,
    path::{Path, PathBuf},
    process::Command,
    sync::Mutex,
};

use super::unique_suffix;

pub const BPFFS_ROOT: &str = "/sys/fs/bpf";

/// Mounts bpffs at /sys/fs/bpf unless it already is (it is not by default on
/// Debian without systemd).
pub fn ensure_bpffs_mounted() {
    // Parallel tests would otherwise stack several mounts on the same point.
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if bpffs_mounted() {
        return;
    }
    fs::create_dir_all(BPFFS_ROOT).unwrap_or_else(|e| panic!("creating {BPFFS_ROOT}: {e}"));
    let out = Command::new("mount")
        .args(["-t", "bpf", "bpf", BPFFS_ROOT])
        .output()
        .unwrap_or_else(|e| panic!("cannot run mount: {e}"));
    assert!(
        out.status.success() || bpffs_mounted(),
        "mounting bpffs at {BPFFS_ROOT} failed: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

fn bpffs_mounted() -> bool {
    fs::read_to_string("/proc/mounts")
        .map(|m| {
            m.lines().any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.len() > 2 && f[1] == BPFFS_ROOT && f[2] == "bpf"
            })
        })
        .unwrap_or(false)
}

/// `/sys/fs/bpf/vnat-test-<tag>-<pid>-<n>`, removed with everything pinned in
/// it on drop.
pub struct BpffsDir {
    path: PathBuf,
}

impl BpffsDir {
    pub fn new(tag: &str) -> BpffsDir {
        ensure_bpffs_mounted();
        let path = Path::new(BPFFS_ROOT).join(format!("vnat-test-{tag}-{}", unique_suffix()));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("creating {}: {e}", path.display()));
        BpffsDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for BpffsDir {
    fn drop(&mut self) {
        // Unlinking a pin drops its reference; the map or link goes away when
        // nothing else holds it.
        match fs::remove_dir_all(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => eprintln!("warning: removing {}: {e}", self.path.display()),
        }
    }
}
