//! Reading /proc/self/mounts (shared by the daemon's defaults and the
//! datapath's cgroup lookups).

use std::path::PathBuf;

/// The mount point of the first cgroup2 filesystem in a mounts file's text.
pub fn cgroup2_root_in(mounts: &str) -> Option<PathBuf> {
    mounts.lines().find_map(|line| {
        let mut fields = line.split(' ');
        let (_source, target, fstype) = (fields.next()?, fields.next()?, fields.next()?);
        (fstype == "cgroup2").then(|| PathBuf::from(unescape(target)))
    })
}

/// The kernel writes space, tab, newline and backslash in mount points as
/// three-digit octal escapes (`mangle` in fs/proc_namespace.c).
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|b| (b'0'..=b'7').contains(b)));
        match (bytes[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup2 mount point of this mount namespace, if any.
pub fn cgroup2_mount() -> Option<PathBuf> {
    cgroup2_root_in(&std::fs::read_to_string("/proc/self/mounts").ok()?)
}
