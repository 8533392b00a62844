//! Selectors (`all`, connection ids, pid, cgroup): which recorded
//! connections a mobility request names. An empty match is an error, so
//! that a typo never turns into "did nothing, successfully".

use std::path::{Path, PathBuf};

use super::proto::Selector;
use crate::datapath::ConnectionInfo;

/// Why a selector matched nothing, or cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    #[error("no connection matches {selector}; list the connections with: vnatctl ls")]
    NoMatch { selector: String },
    #[error(
        "no connection has id {}; list the connections with: vnatctl ls",
        join(missing)
    )]
    UnknownIds { missing: Vec<u64> },
    #[error("give at least one connection id")]
    NoIds,
    #[error("the cgroup path {} is relative; pass an absolute path (vnatctl makes paths absolute for you)", path.display())]
    RelativeCgroup { path: PathBuf },
}

fn join(ids: &[u64]) -> String {
    let ids: Vec<String> = ids.iter().map(u64::to_string).collect();
    ids.join(", ")
}

/// The recorded connections a selector names. `cgroup_mount` is where
/// cgroup2 is mounted (the selector may name a directory under it, or give
/// the mount-relative form that `list` shows). An empty match is an error,
/// so that a typo never turns into "did nothing, successfully".
pub fn resolve(
    selector: &Selector,
    connections: &[ConnectionInfo],
    cgroup_mount: Option<&Path>,
) -> Result<Vec<ConnectionInfo>, SelectError> {
    let selected: Vec<ConnectionInfo> = match selector {
        Selector::All => connections.to_vec(),
        Selector::Conns(ids) => {
            if ids.is_empty() {
                return Err(SelectError::NoIds);
            }
            let mut missing: Vec<u64> = ids
                .iter()
                .copied()
                .filter(|id| !connections.iter().any(|c| c.id == *id))
                .collect();
            if !missing.is_empty() {
                missing.dedup();
                return Err(SelectError::UnknownIds { missing });
            }
            connections
                .iter()
                .filter(|c| ids.contains(&c.id))
                .cloned()
                .collect()
        }
        Selector::Pid(pid) => connections
            .iter()
            .filter(|c| c.pid == Some(*pid))
            .cloned()
            .collect(),
        Selector::Cgroup(path) => {
            if !path.is_absolute() {
                return Err(SelectError::RelativeCgroup { path: path.clone() });
            }
            let relative = mount_relative(path, cgroup_mount);
            connections
                .iter()
                .filter(|c| {
                    c.cgroup
                        .as_deref()
                        .is_some_and(|cg| cgroup_contains(&relative, Path::new(cg)))
                })
                .cloned()
                .collect()
        }
    };
    if selected.is_empty() {
        return Err(SelectError::NoMatch {
            selector: selector.to_string(),
        });
    }
    Ok(selected)
}

/// `/sys/fs/cgroup/system.slice` -> `/system.slice` when cgroup2 is mounted
/// at `/sys/fs/cgroup`; a path outside the mount is taken as already in the
/// mount-relative form (`/system.slice`, as `vnatctl ls` prints it).
fn mount_relative(path: &Path, mount: Option<&Path>) -> PathBuf {
    match mount.and_then(|m| path.strip_prefix(m).ok()) {
        Some(rest) => Path::new("/").join(rest),
        None => path.to_path_buf(),
    }
}

/// Whether the connection's cgroup `cg` is `dir` or below it (whole path
/// components: `/a` does not contain `/ab`).
fn cgroup_contains(dir: &Path, cg: &Path) -> bool {
    cg.starts_with(dir)
}
