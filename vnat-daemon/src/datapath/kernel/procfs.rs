//! Who owns a socket: /proc/net/{tcp,udp}{,6} give the socket inode of a
//! 4-tuple (`vnat_control::procfs`, which vnatctl's criu-hook reads too),
//! /proc/<pid>/fd gives the process holding that inode.

use std::{collections::HashMap, fs};

pub use vnat_control::procfs::{
    socket_inodes, socket_inodes_in, udp_socket_inodes, udp_socket_inodes_in,
};

/// Socket inode to owning pid, scanning every process's fd table.
pub fn inode_owners() -> HashMap<u64, u32> {
    socket_fds()
        .into_iter()
        .map(|(inode, (pid, _))| (inode, pid))
        .collect()
}

/// Socket inode to the first process holding it and its descriptor there,
/// scanning every process's fd table.
pub fn socket_fds() -> HashMap<u64, (u32, i32)> {
    let mut out = HashMap::new();
    let Ok(procs) = fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        if let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) {
            add_socket_fds(pid, &mut out);
        }
    }
    out
}

/// [`socket_fds`] of process `pid` alone.
pub fn socket_fds_of(pid: u32) -> HashMap<u64, (u32, i32)> {
    let mut out = HashMap::new();
    add_socket_fds(pid, &mut out);
    out
}

fn add_socket_fds(pid: u32, out: &mut HashMap<u64, (u32, i32)>) {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return;
    };
    for fd in fds.flatten() {
        let Some(n) = fd.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(target) = fs::read_link(fd.path()) else {
            continue;
        };
        let t = target.to_string_lossy();
        if let Some(inode) = t
            .strip_prefix("socket:[")
            .and_then(|s| s.strip_suffix(']'))
            .and_then(|s| s.parse::<u64>().ok())
        {
            out.entry(inode).or_insert((pid, n));
        }
    }
}

/// Whether process `pid` holds the socket with `inode` (one of its
/// descriptors is `socket:[INODE]`).
pub fn holds_socket(pid: u32, inode: u64) -> bool {
    let want = format!("socket:[{inode}]");
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten()
        .any(|fd| fs::read_link(fd.path()).is_ok_and(|t| t.as_os_str() == want.as_str()))
}

pub fn comm(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_string())
}

/// The process's cgroup v2 path (relative to the cgroup2 mount).
pub fn cgroup_of(pid: u32) -> Option<String> {
    let text = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::to_string)
}
