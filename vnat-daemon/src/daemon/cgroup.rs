//! Finding the cgroup v2 root, the default cgroup to enable (the whole host).

use std::path::PathBuf;

use super::config::ConfigError;

const MOUNTS: &str = "/proc/self/mounts";

/// The mount point of the first cgroup2 filesystem in this mount namespace:
/// `/sys/fs/cgroup` on unified hosts, `/sys/fs/cgroup/unified` on hybrid ones.
pub fn cgroup2_root() -> Result<PathBuf, ConfigError> {
    let text = std::fs::read_to_string(MOUNTS).map_err(|source| ConfigError::Mounts {
        path: MOUNTS.into(),
        source,
    })?;
    cgroup2_root_in(&text).ok_or(ConfigError::NoCgroup2Mount)
}

/// The same, from the text of a mounts file.
pub fn cgroup2_root_in(mounts: &str) -> Option<PathBuf> {
    crate::mounts::cgroup2_root_in(mounts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hybrid_host_root_is_the_unified_mount() {
        let mounts = "tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\n\
                      cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n\
                      cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n";
        assert_eq!(
            cgroup2_root_in(mounts),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
    }

    #[test]
    fn escaped_mount_point_and_no_cgroup2() {
        let mounts = "none /mnt/my\\040cg\\134x cgroup2 rw 0 0\n";
        assert_eq!(
            cgroup2_root_in(mounts),
            Some(PathBuf::from("/mnt/my cg\\x"))
        );
        assert_eq!(cgroup2_root_in("proc /proc proc rw 0 0\n"), None);
    }
}
