//! `vnatctl criu-hook`: CRIU's action script (`criu dump|restore
//! --action-script FILE`).
//!
//! CRIU runs the script with no arguments and tells it what is happening
//! through the environment (criu/action-scripts.c): `CRTOOLS_SCRIPT_ACTION`
//! (`pre-dump`, `post-dump`, `pre-restore`, `post-restore`, ...),
//! `CRTOOLS_IMAGE_DIR` (the images directory, as `/proc/<criu>/fd/N`) and,
//! except at `pre-restore`, `CRTOOLS_INIT_PID` (the root of the dumped
//! tree). A non-zero exit fails the operation: after a failed `post-dump`
//! CRIU unlocks the network and lets the frozen tree run on
//! (cr-dump.c, `cr_dump_finish`), so a failed export leaves the process
//! where it was, with its connections.
//!
//! These actions do something:
//! - `pre-dump`: the tree still runs. Ask the peers of its connections to
//!   hold their packets (the "hold" helper) until the connections have
//!   moved, and wait up to a second for them to confirm, so that nothing
//!   they send meets the frozen host (whose network lock drops it). A
//!   connection that cannot move fails the dump here, before any freeze.
//!   A peer that does not confirm is no reason to fail: its packets are
//!   dropped during the freeze and resent after, as without the hold. If
//!   the dump fails after this, the peers hold their packets until the
//!   hold's limit (3.75 s by default): CRIU runs no action for a failed
//!   dump.
//! - `post-dump`: the tree is dumped and still frozen. Export the
//!   connections its processes own, sealed for the target host, into
//!   [`EXPORT_FILE`] in the images directory, so whatever carries the
//!   images to the target carries them too.
//! - `pre-restore`: import that file, before CRIU restores the sockets:
//!   the import puts each connection's old address in place on this host,
//!   which the restored socket binds to (without it the restore fails with
//!   EADDRNOTAVAIL).
//! - `post-restore`: the sockets exist now (the tasks are not running yet):
//!   ask vnatd to look at once (`resume`), so that the moves start now
//!   rather than at its next periodic look, up to a second later. Never
//!   fails: the restore is done, and vnatd finds the sockets anyway.

use std::{
    collections::{BTreeSet, HashSet},
    fs, io,
    net::SocketAddr,
    path::{Path, PathBuf},
};

use vnat_control::{datapath::Proto, procfs, ListedConnection};

/// A socket by its own (virtual) endpoints.
pub type SocketTuple = (Proto, SocketAddr, SocketAddr);

/// How long the hook waits at pre-dump for the peers to confirm that they
/// hold their packets (one round trip, and the resends of a lost one).
pub const HOLD_CONFIRM_MS: u32 = 1000;

/// The export's name in CRIU's images directory.
pub const EXPORT_FILE: &str = "vnat-connections.json";

/// What the hook does for one `CRTOOLS_SCRIPT_ACTION`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    PreDump,
    PostDump,
    PreRestore,
    PostRestore,
    /// Any other action (network-lock, post-resume, ...): nothing. (At
    /// the restore's post-resume the connections are moving already; the
    /// peers' holds end with that move.)
    Ignored(String),
}

impl Action {
    pub fn parse(action: &str) -> Action {
        match action {
            "pre-dump" => Action::PreDump,
            "post-dump" => Action::PostDump,
            "pre-restore" => Action::PreRestore,
            "post-restore" => Action::PostRestore,
            other => Action::Ignored(other.to_string()),
        }
    }
}

/// Why the hook failed (CRIU then aborts the dump or the restore).
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("CRTOOLS_SCRIPT_ACTION is not set: `vnatctl criu-hook` is run by CRIU as its action script (criu dump|restore --action-script FILE, where FILE runs `exec vnatctl criu-hook`); see `vnatctl criu-hook --help`")]
    NotRunByCriu,
    #[error("CRIU did not say where its images are ({variable} is not set)")]
    NoImageDir { variable: &'static str },
    #[error("CRIU did not name the dumped process (CRTOOLS_INIT_PID is {value:?}); the dump is aborted and the process keeps running here")]
    NoInitPid { value: Option<String> },
    #[error("criu-hook needs the key of the host the process will be restored on: set VNAT_CRIU_TO to it (the `host key` its `vnatctl status` shows) or pass --to; the dump is aborted and the process keeps running here")]
    NoTarget,
    #[error("cannot read the process tree of pid {pid} in /proc: {source}; the dump is aborted and the process keeps running here")]
    Tree {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("{} connection(s) of the dumped process cannot move, so it would lose them on another host: {list}; the dump is aborted and the process keeps running here", count)]
    NotMobile { count: usize, list: String },
    #[error("the export in the images ({}) names no sender: pass --from KEY or set VNAT_CRIU_FROM to the dumping host's key", path.display())]
    NoSender { path: PathBuf },
}

impl HookError {
    /// 2 for a hook that is not set up right, 1 for what vnatd or the
    /// process made impossible.
    pub fn exit_code(&self) -> u8 {
        match self {
            HookError::NotRunByCriu
            | HookError::NoImageDir { .. }
            | HookError::NoTarget
            | HookError::NoSender { .. } => 2,
            HookError::NoInitPid { .. } | HookError::Tree { .. } | HookError::NotMobile { .. } => 1,
        }
    }
}

/// The environment CRIU gives an action script, read once.
#[derive(Clone, Debug, Default)]
pub struct CriuEnv {
    pub action: Option<String>,
    pub image_dir: Option<PathBuf>,
    pub init_pid: Option<String>,
}

impl CriuEnv {
    pub fn from_process() -> CriuEnv {
        let var = |k| std::env::var_os(k);
        CriuEnv {
            action: var("CRTOOLS_SCRIPT_ACTION").map(|v| v.to_string_lossy().into_owned()),
            image_dir: var("CRTOOLS_IMAGE_DIR").map(PathBuf::from),
            init_pid: var("CRTOOLS_INIT_PID").map(|v| v.to_string_lossy().into_owned()),
        }
    }

    pub fn action(&self) -> Result<Action, HookError> {
        self.action
            .as_deref()
            .map(Action::parse)
            .ok_or(HookError::NotRunByCriu)
    }

    /// Where the export goes in (or comes from) the images directory.
    pub fn export_path(&self) -> Result<PathBuf, HookError> {
        self.image_dir
            .as_ref()
            .map(|d| d.join(EXPORT_FILE))
            .ok_or(HookError::NoImageDir {
                variable: "CRTOOLS_IMAGE_DIR",
            })
    }

    pub fn init_pid(&self) -> Result<u32, HookError> {
        self.init_pid
            .as_deref()
            .and_then(|p| p.trim().parse().ok())
            .filter(|p| *p > 0)
            .ok_or_else(|| HookError::NoInitPid {
                value: self.init_pid.clone(),
            })
    }
}

/// The pids of the tree rooted at `root` (threads' children included),
/// from `proc`'s `PID/task/TID/children` (Linux 3.5+, which CRIU needs
/// anyway). The tree is frozen at post-dump, so it cannot change meanwhile;
/// at pre-dump it runs, and a child that exits while it is read is left
/// out.
pub fn process_tree(proc: &Path, root: u32) -> Result<BTreeSet<u32>, HookError> {
    let mut tree = BTreeSet::new();
    let mut todo = vec![root];
    while let Some(pid) = todo.pop() {
        if !tree.insert(pid) {
            continue;
        }
        let tasks = proc.join(pid.to_string()).join("task");
        let entries = match fs::read_dir(&tasks) {
            Ok(e) => e,
            // A child that exited while we read (at pre-dump the tree still
            // runs) is no part of it any more.
            Err(e) if pid != root && e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(HookError::Tree { pid, source }),
        };
        for task in entries {
            let task = task.map_err(|source| HookError::Tree { pid, source })?;
            // A thread that exits while we read has no file any more.
            let Ok(children) = fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            todo.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            );
        }
    }
    Ok(tree)
}

/// The endpoints of every socket the tree's processes hold: the socket
/// inodes of their fd tables, looked up in their namespace's
/// `/proc/PID/net/{tcp,udp}{,6}`. vnatd names one owner per connection,
/// the first process it finds holding the socket; during a dump CRIU
/// holds the dumped sockets too, and once pids wrap CRIU's may come first,
/// so the owner alone would miss the tree's connection.
pub fn tree_sockets(proc: &Path, tree: &BTreeSet<u32>) -> HashSet<SocketTuple> {
    let mut out = HashSet::new();
    for pid in tree {
        let dir = proc.join(pid.to_string());
        let Ok(fds) = fs::read_dir(dir.join("fd")) else {
            continue;
        };
        let inodes: HashSet<u64> = fds
            .flatten()
            .filter_map(|fd| fs::read_link(fd.path()).ok())
            .filter_map(|t| {
                t.to_str()?
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .parse()
                    .ok()
            })
            .collect();
        if inodes.is_empty() {
            continue;
        }
        let net = dir.join("net");
        for (tuple, inode) in procfs::socket_inodes_in(&net.to_string_lossy()) {
            if inodes.contains(&inode) {
                out.insert(tuple);
            }
        }
    }
    out
}

/// The ids of the connections the tree's processes own (by vnatd's owner
/// or by the sockets the tree holds), or why the dump must not go on: one
/// of them cannot move, and the restored process would find it dead.
/// Connections on loopback stay inside the host's (and the restored)
/// namespace and are not vnat's to move.
pub fn tree_connections(
    conns: &[ListedConnection],
    tree: &BTreeSet<u32>,
    sockets: &HashSet<SocketTuple>,
) -> Result<Vec<u64>, HookError> {
    let mine: Vec<&ListedConnection> = conns
        .iter()
        .filter(|c| {
            c.info.pid.is_some_and(|p| tree.contains(&p))
                || sockets.contains(&(c.info.proto, c.info.virtual_local, c.info.virtual_remote))
        })
        .filter(|c| {
            !(c.info.virtual_local.ip().is_loopback() && c.info.virtual_remote.ip().is_loopback())
        })
        .collect();
    let stuck: Vec<String> = mine
        .iter()
        .filter(|c| !c.mobile)
        .map(|c| {
            format!(
                "{} {} {} -> {} ({})",
                c.info.id,
                c.info.proto,
                c.info.virtual_local,
                c.info.virtual_remote,
                c.why_not_mobile.as_deref().unwrap_or("not mobile")
            )
        })
        .collect();
    if !stuck.is_empty() {
        return Err(HookError::NotMobile {
            count: stuck.len(),
            list: stuck.join("; "),
        });
    }
    Ok(mine.iter().map(|c| c.info.id).collect())
}

#[cfg(test)]
mod tests {
    use vnat_control::datapath::{ConnState, ConnectionInfo, Proto};

    use super::*;

    fn conn(
        id: u64,
        local: &str,
        remote: &str,
        pid: Option<u32>,
        mobile: bool,
    ) -> ListedConnection {
        let addr = |s: &str| {
            s.parse()
                .unwrap_or_else(|e| panic!("test address {s}: {e}"))
        };
        ListedConnection {
            info: ConnectionInfo {
                id,
                proto: Proto::Tcp,
                virtual_local: addr(local),
                virtual_remote: addr(remote),
                physical_local: addr(local),
                physical_remote: addr(remote),
                state: ConnState::Native,
                cookie: id,
                cgroup_id: 5,
                cgroup: None,
                pid,
                command: None,
                age_secs: 1,
                tcp_isns: None,
                adopted: false,
                hide_location: false,
                udp_inbound_only: false,
                guest: None,
            },
            mobile,
            seen_by_peer_as: None,
            why_not_mobile: (!mobile).then(|| "no vnatd answered at the peer's address".into()),
            role: None,
            moving: false,
            keepalive_held: false,
            helpers_asked: Vec::new(),
            helping: Vec::new(),
        }
    }

    #[test]
    fn only_pre_dump_post_dump_pre_restore_and_post_restore_act() {
        assert_eq!(Action::parse("post-dump"), Action::PostDump);
        assert_eq!(Action::parse("pre-restore"), Action::PreRestore);
        assert_eq!(Action::parse("post-restore"), Action::PostRestore);
        assert_eq!(Action::parse("pre-dump"), Action::PreDump);
        for other in ["network-lock", "post-resume", "setup-namespaces"] {
            assert_eq!(Action::parse(other), Action::Ignored(other.into()));
        }
        assert!(matches!(
            CriuEnv::default().action(),
            Err(HookError::NotRunByCriu)
        ));
    }

    #[test]
    fn the_environment_names_the_images_and_the_dumped_pid() {
        let env = CriuEnv {
            action: Some("post-dump".into()),
            image_dir: Some("/proc/77/fd/3".into()),
            init_pid: Some("4242".into()),
        };
        assert_eq!(
            env.export_path().unwrap(),
            Path::new("/proc/77/fd/3").join(EXPORT_FILE)
        );
        assert_eq!(env.init_pid().unwrap(), 4242);
        let no_pid = CriuEnv {
            init_pid: Some("0".into()),
            ..env
        };
        assert!(matches!(
            no_pid.init_pid(),
            Err(HookError::NoInitPid { .. })
        ));
    }

    /// A fake /proc: pid 10 holds socket 555 (fd 3) and a file; its
    /// namespace's tcp table lists 555 and another process's 556.
    #[test]
    fn the_trees_sockets_come_from_its_fd_tables() {
        let proc = tempfile::tempdir().unwrap();
        let dir = proc.path().join("10");
        fs::create_dir_all(dir.join("fd")).unwrap();
        fs::create_dir_all(dir.join("net")).unwrap();
        std::os::unix::fs::symlink("socket:[555]", dir.join("fd/3")).unwrap();
        std::os::unix::fs::symlink("/etc/hosts", dir.join("fd/4")).unwrap();
        fs::write(
            dir.join("net/tcp"),
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             \x20  0: 020312C6:1BBC 020112C6:9C40 01 00000000:00000000 00:00000000 00000000     0        0 555 1\n\
             \x20  1: 020312C6:1BBD 020112C6:9C41 01 00000000:00000000 00:00000000 00000000     0        0 556 1\n",
        )
        .unwrap();
        let got = tree_sockets(proc.path(), &[10, 11].into());
        let want: HashSet<SocketTuple> = [(
            Proto::Tcp,
            "198.18.3.2:7100".parse().unwrap(),
            "198.18.1.2:40000".parse().unwrap(),
        )]
        .into();
        assert_eq!(got, want);
    }

    /// A fake /proc: 10 has a thread 11 whose child is 20, which has a child 30.
    #[test]
    fn the_tree_follows_every_threads_children() {
        let proc = tempfile::tempdir().unwrap();
        let task = |pid: u32, tid: u32, children: &str| {
            let dir = proc.path().join(format!("{pid}/task/{tid}"));
            fs::create_dir_all(&dir).unwrap();
            fs::write(dir.join("children"), children).unwrap();
        };
        task(10, 10, "");
        task(10, 11, "20 ");
        // 40 exited after 20 listed it (a running tree, at pre-dump).
        task(20, 20, "30 40");
        task(30, 30, "");
        task(99, 99, "");
        let tree = process_tree(proc.path(), 10).unwrap();
        assert_eq!(tree.into_iter().collect::<Vec<_>>(), vec![10, 20, 30, 40]);
        assert!(matches!(
            process_tree(proc.path(), 5),
            Err(HookError::Tree { pid: 5, .. })
        ));
    }

    #[test]
    fn the_trees_connections_are_exported_and_an_immobile_one_stops_the_dump() {
        let tree: BTreeSet<u32> = [10, 20].into();
        let conns = vec![
            conn(1, "198.18.3.2:7100", "198.18.1.2:40000", Some(10), true),
            conn(2, "198.18.3.2:7101", "198.18.1.2:40001", Some(20), true),
            conn(3, "198.18.3.2:7102", "198.18.1.2:40002", Some(99), false),
            conn(4, "198.18.3.2:7103", "198.18.1.2:40003", None, false),
            // Loopback stays on whichever host: not vnat's to move.
            conn(5, "127.0.0.1:6379", "127.0.0.1:50000", Some(10), false),
        ];
        let none = HashSet::new();
        assert_eq!(tree_connections(&conns, &tree, &none).unwrap(), vec![1, 2]);
        assert!(tree_connections(&conns, &[7].into(), &none)
            .unwrap()
            .is_empty());
        // vnatd named another holder (CRIU's pid came first): the tree's
        // own socket still selects it.
        let held: HashSet<SocketTuple> = [(
            Proto::Tcp,
            "198.18.3.2:7102".parse().unwrap(),
            "198.18.1.2:40002".parse().unwrap(),
        )]
        .into();
        let mut criu_first = conns.clone();
        criu_first[2].mobile = true;
        assert_eq!(
            tree_connections(&criu_first, &tree, &held).unwrap(),
            vec![1, 2, 3]
        );

        let mut stuck = conns.clone();
        stuck.push(conn(
            6,
            "198.18.3.2:7104",
            "198.18.9.9:443",
            Some(20),
            false,
        ));
        match tree_connections(&stuck, &tree, &none) {
            Err(e @ HookError::NotMobile { count: 1, .. }) => {
                let text = e.to_string();
                assert!(text.contains("198.18.9.9:443"), "{text}");
                assert!(text.contains("no vnatd answered"), "{text}");
                assert!(text.contains("keeps running here"), "{text}");
            }
            other => panic!("expected NotMobile, got {other:?}"),
        }
    }
}
