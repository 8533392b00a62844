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
    path::{Path, PathBuf},
};

use vnat_control::{procfs, ListedConnection};

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
    #[error("cannot tell which sockets process {pid} of the tree holds: {source}; the dump is aborted and the process keeps running here")]
    Sockets {
        pid: u32,
        #[source]
        source: io::Error,
    },
    #[error("the restore needs the key of the host that dumped the process, to check the export in the images ({}) against: set VNAT_CRIU_FROM to it (the `host key` its `vnatctl status` shows) or pass --from; the key the export names is its writer's own claim", path.display())]
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
            HookError::NoInitPid { .. }
            | HookError::Tree { .. }
            | HookError::Sockets { .. }
            | HookError::NotMobile { .. } => 1,
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

/// The cookies of every socket the tree's processes hold (each taken from
/// the process and checked by inode, `procfs::held_socket_cookies`).
/// A socket is named by its cookie alone, as vnatd's records name it: not
/// by its endpoints, which a process can reproduce in a namespace of its
/// own (the host's addresses on its `lo`), nor by the pid vnatd recorded
/// at connect(), which a process of the tree may have taken since.
/// vnatd names one owner per connection, the first process it finds
/// holding the socket; during a dump CRIU holds the dumped sockets too,
/// so the owner alone would miss the tree's connection.
pub fn tree_cookies(proc: &Path, tree: &BTreeSet<u32>) -> Result<HashSet<u64>, HookError> {
    let mut out = HashSet::new();
    for pid in tree {
        out.extend(
            procfs::held_socket_cookies(proc, *pid)
                .map_err(|source| HookError::Sockets { pid: *pid, source })?,
        );
    }
    Ok(out)
}

/// The ids of the connections whose sockets the tree holds (by cookie), or
/// why the dump must not go on: one of them cannot move, and the restored
/// process would find it dead. Connections on loopback stay inside the
/// host's (and the restored) namespace and are not vnat's to move.
pub fn tree_connections(
    conns: &[ListedConnection],
    cookies: &HashSet<u64>,
) -> Result<Vec<u64>, HookError> {
    let mine: Vec<&ListedConnection> = conns
        .iter()
        .filter(|c| cookies.contains(&c.info.cookie))
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

/// The connections of the tree rooted at the pids `tree` (see
/// [`tree_connections`]), with the sockets read from `proc`.
pub fn select_connections(
    proc: &Path,
    tree: &BTreeSet<u32>,
    conns: &[ListedConnection],
) -> Result<Vec<u64>, HookError> {
    tree_connections(conns, &tree_cookies(proc, tree)?)
}

/// At pre-restore: the key of the host that sealed the export, which the
/// import checks the seal against. Only the operator names it (--from or
/// VNAT_CRIU_FROM): the seal proves that the holder of the key it names
/// wrote the document, and whoever wrote the images can name their own.
pub fn restore_sender(from: Option<&str>, path: &Path) -> Result<String, HookError> {
    from.map(str::to_string).ok_or(HookError::NoSender {
        path: path.to_path_buf(),
    })
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
                recorded_ns: 0,
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
            placed: None,
            helpers_asked: Vec::new(),
            helping: Vec::new(),
            last_move: None,
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
        // The tree holds the sockets with cookies 1, 2 and 5 (conn() gives
        // each connection its id as cookie); 3's recorded pid is the
        // tree's, its socket is not.
        let cookies: HashSet<u64> = [1, 2, 5].into();
        let conns = vec![
            conn(1, "198.18.3.2:7100", "198.18.1.2:40000", Some(10), true),
            conn(2, "198.18.3.2:7101", "198.18.1.2:40001", None, true),
            conn(3, "198.18.3.2:7102", "198.18.1.2:40002", Some(20), false),
            conn(4, "198.18.3.2:7103", "198.18.1.2:40003", None, false),
            // Loopback stays on whichever host: not vnat's to move.
            conn(5, "127.0.0.1:6379", "127.0.0.1:50000", Some(10), false),
        ];
        assert_eq!(tree_connections(&conns, &cookies).unwrap(), vec![1, 2]);
        assert!(tree_connections(&conns, &[7].into()).unwrap().is_empty());

        let mut stuck = conns.clone();
        stuck.push(conn(
            6,
            "198.18.3.2:7104",
            "198.18.9.9:443",
            Some(20),
            false,
        ));
        match tree_connections(&stuck, &[1, 6].into()) {
            Err(e @ HookError::NotMobile { count: 1, .. }) => {
                let text = e.to_string();
                assert!(text.contains("198.18.9.9:443"), "{text}");
                assert!(text.contains("no vnatd answered"), "{text}");
                assert!(text.contains("keeps running here"), "{text}");
            }
            other => panic!("expected NotMobile, got {other:?}"),
        }
    }

    /// A tenant being checkpointed gives its own namespace's `lo` a host
    /// connection's addresses and connects them, so that its socket table
    /// shows that connection's tuple; and the connection's recorded pid is
    /// one the tenant's tree has since taken. Neither selects the host's
    /// connection: only the tree's own sockets do (here, a fake /proc where the
    /// tree's pid, one no process can have, holds a socket with that
    /// tuple; the host's connection is another socket).
    #[test]
    fn a_tree_reproducing_a_host_connections_tuple_or_pid_does_not_get_it() {
        // Above PID_MAX_LIMIT (2^22).
        const TENANT: u32 = 4_194_305;
        let proc = tempfile::tempdir().unwrap();
        let dir = proc.path().join(TENANT.to_string());
        fs::create_dir_all(dir.join("fd")).unwrap();
        fs::create_dir_all(dir.join("net")).unwrap();
        std::os::unix::fs::symlink("socket:[555]", dir.join("fd/3")).unwrap();
        fs::write(
            dir.join("net/tcp"),
            "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
             \x20  0: 020312C6:1BBC 020112C6:9C40 01 00000000:00000000 00:00000000 00000000     0        0 555 1\n",
        )
        .unwrap();
        let tree: BTreeSet<u32> = [TENANT].into();
        let host = vec![
            // The tuple the tenant reproduced.
            conn(1, "198.18.3.2:7100", "198.18.1.2:40000", None, true),
            // Recorded at connect() by a process whose pid the tree has now.
            conn(2, "198.18.3.2:7101", "198.18.1.2:40001", Some(TENANT), true),
        ];
        let got = select_connections(proc.path(), &tree, &host).unwrap();
        assert!(
            got.is_empty(),
            "the tenant's tree would export the host's connections {got:?}"
        );
    }

    /// The tree's own socket selects its connection, by the socket's
    /// cookie (the test process is the tree; what vnatd lists is the
    /// socket with that cookie, whatever its endpoints).
    #[test]
    fn the_trees_own_socket_selects_its_connection() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let cookie = vnat_control::procfs::socket_cookie(&c).expect("SO_COOKIE");
        let mut listed = conn(7, "198.18.3.2:7200", "198.18.1.2:41000", None, true);
        listed.info.cookie = cookie;
        let other = conn(8, "198.18.3.2:7201", "198.18.1.2:41001", None, true);
        let tree: BTreeSet<u32> = [std::process::id()].into();
        let got = select_connections(Path::new("/proc"), &tree, &[listed, other]).unwrap();
        assert_eq!(got, vec![7]);
        drop(c);
    }

    /// At pre-restore, a document whose seal names its own sender proves
    /// only that whoever wrote it holds that key: without --from (or
    /// VNAT_CRIU_FROM) it is refused, whatever key it names (the sender no
    /// longer comes from the document at all).
    #[test]
    fn a_document_naming_its_own_sender_is_refused_without_from() {
        let path = Path::new("/img/vnat-connections.json");
        match restore_sender(None, path) {
            Err(e @ HookError::NoSender { .. }) => {
                let text = e.to_string();
                assert!(text.contains("VNAT_CRIU_FROM"), "{text}");
            }
            other => panic!("the document's own sender was trusted: {other:?}"),
        }
        let key = "12".repeat(32);
        assert_eq!(restore_sender(Some(&key), path).unwrap(), key);
    }
}
