//! The control server and client over real Unix sockets in temp dirs, with
//! the fake datapath.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
};

use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::UnixStream,
    sync::oneshot,
    task::JoinHandle,
};

use super::*;
use crate::datapath::{
    fake::FakeDatapath, owner::spawn, ConnState, Datapath, Proto, Translation, VirtualFlow,
};

/// A unique directory under the temp dir, removed on drop.
pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vnat-ctl-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        Self(dir)
    }
    pub(crate) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn flow(local: &str, remote: &str) -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Tcp,
        local: local.parse().expect("test address"),
        remote: remote.parse().expect("test address"),
    }
}

fn info(control: &Path) -> DaemonInfo {
    DaemonInfo {
        version: "test".into(),
        pid: 1,
        uptime_secs: 0,
        control: control.to_path_buf(),
        state_dir: "/var/lib/vnat".into(),
        listen: "0.0.0.0:2031".parse().expect("test address"),
        configured_cgroups: vec!["/sys/fs/cgroup/unified".into()],
    }
}

struct Running {
    path: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Running {
    async fn start(path: &Path, datapath: FakeDatapath) -> Running {
        let listener =
            ControlListener::bind(path).unwrap_or_else(|e| panic!("bind {}: {e}", path.display()));
        let handler = Handler::new(spawn(Box::new(datapath)).unwrap(), info(path));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(listener.serve(handler, async move {
            let _ = stopped.await;
        }));
        Running {
            path: path.to_path_buf(),
            stop: Some(stop),
            task,
        }
    }

    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        (&mut self.task).await.expect("server task panicked");
    }

    async fn client(&self) -> ControlClient {
        ControlClient::connect(&self.path)
            .await
            .unwrap_or_else(|e| panic!("connect: {e}"))
    }
}

/// Send raw bytes and read one response line.
async fn raw(stream: &mut BufReader<UnixStream>, bytes: &[u8]) -> ResponseEnvelope {
    stream
        .get_mut()
        .write_all(bytes)
        .await
        .expect("write to server");
    let mut line = String::new();
    stream.read_line(&mut line).await.expect("read from server");
    serde_json::from_str(&line)
        .unwrap_or_else(|e| panic!("server sent a non-response {line:?}: {e}"))
}

fn error_of(response: ResponseEnvelope) -> ErrorBody {
    match response.outcome {
        Outcome::Error(body) => body,
        Outcome::Ok(reply) => panic!("expected an error, got {reply:?}"),
    }
}

#[tokio::test]
async fn list_and_status_round_trip() {
    let dir = TempDir::new();
    let mut dp = FakeDatapath::new();
    let native = dp.add_connection(flow("198.18.1.2:40000", "198.18.3.2:5001"), Some(42));
    let moved = flow("[fd00:1::2]:40001", "[fd00:3::2]:22");
    let moved_id = dp.add_connection(moved, None);
    let t = Translation {
        flow: moved,
        physical_local: "[fd00:2::2]:40001".parse().expect("addr"),
        physical_remote: moved.remote,
    };
    dp.install_translation(&t).expect("fake install");
    let server = Running::start(&dir.path().join("vnatd.sock"), dp).await;

    let mut client = server.client().await;
    let conns = client.list().await.expect("list");
    assert_eq!(conns.len(), 2, "both connections listed: {conns:?}");
    assert!(
        conns.iter().all(|c| !c.mobile),
        "without a VCMP driver nothing is mobile: {conns:?}"
    );
    let by_id = |id| {
        &conns
            .iter()
            .find(|c| c.info.id == id)
            .unwrap_or_else(|| panic!("id {id} missing"))
            .info
    };
    assert_eq!(by_id(native).state, ConnState::Native);
    assert_eq!(by_id(native).pid, Some(42));
    assert_eq!(by_id(moved_id).state, ConnState::Translated);
    assert_eq!(by_id(moved_id).physical_local, t.physical_local);

    // The same connection carries several requests.
    let status = client.status().await.expect("status");
    assert_eq!(status.datapath.connections, 2);
    assert_eq!(status.datapath.translations, 1);
    assert_eq!(status.daemon.control, server.path);
    assert_eq!(status.daemon.listen.port(), 2031);
    server.stop().await;
}

#[tokio::test]
async fn hiding_a_cgroup_that_an_enabled_one_covers_attaches_nothing_more() {
    let dir = TempDir::new();
    let server = Running::start(&dir.path().join("vnatd.sock"), FakeDatapath::new()).await;
    let mut client = server.client().await;
    let app = Path::new("/sys/fs/cgroup/unified/app");
    let ftp = Path::new("/sys/fs/cgroup/unified/app/ftp");
    client.enable_cgroup(app).await.expect("enable");
    assert_eq!(
        client
            .enable_cgroup_hiding(ftp, Some(true))
            .await
            .expect("enable --hide-location"),
        (ftp.to_path_buf(), true)
    );
    let cgroups = client.status().await.expect("status").datapath.cgroups;
    let shown: Vec<(&Path, bool)> = cgroups
        .iter()
        .map(|c| (c.path.as_path(), c.hide_location))
        .collect();
    assert_eq!(shown, vec![(app, false), (ftp, true)], "{cgroups:?}");
    // A plain enable leaves hiding as it was and says so.
    assert_eq!(
        client
            .enable_cgroup_hiding(ftp, None)
            .await
            .expect("enable"),
        (ftp.to_path_buf(), true)
    );
    // Disabling it stops its hiding; the cgroup above stays enabled.
    assert_eq!(client.disable_cgroup(ftp).await.expect("disable"), ftp);
    let cgroups = client.status().await.expect("status").datapath.cgroups;
    assert_eq!(cgroups.len(), 1, "{cgroups:?}");
    assert!(!cgroups[0].hide_location);
}

#[tokio::test]
async fn enable_disable_and_datapath_errors() {
    let dir = TempDir::new();
    let server = Running::start(&dir.path().join("vnatd.sock"), FakeDatapath::new()).await;
    let mut client = server.client().await;
    let cg = Path::new("/sys/fs/cgroup/unified/app");
    assert_eq!(client.enable_cgroup(cg).await.expect("enable"), cg);
    let status = client.status().await.expect("status");
    assert_eq!(
        status
            .datapath
            .cgroups
            .iter()
            .map(|c| c.path.as_path())
            .collect::<Vec<_>>(),
        vec![cg]
    );
    assert_eq!(client.disable_cgroup(cg).await.expect("disable"), cg);
    match client.disable_cgroup(cg).await {
        Err(ClientError::Daemon {
            kind: ErrorKind::Datapath,
            message,
        }) => {
            assert!(message.contains("is not enabled"), "{message}")
        }
        other => panic!("disabling twice must be a datapath error, got {other:?}"),
    }
    match client.enable_cgroup(Path::new("relative/dir")).await {
        Err(ClientError::Daemon {
            kind: ErrorKind::InvalidArgument,
            message,
        }) => {
            assert!(message.contains("absolute"), "{message}")
        }
        other => panic!("a relative path must be refused, got {other:?}"),
    }
    assert!(
        client
            .status()
            .await
            .expect("status")
            .datapath
            .cgroups
            .is_empty(),
        "bad input changed state"
    );
    server.stop().await;
}

#[tokio::test]
async fn malformed_input_gets_an_error_and_the_server_stays_up() {
    let dir = TempDir::new();
    let server = Running::start(&dir.path().join("vnatd.sock"), FakeDatapath::new()).await;
    let mut s = BufReader::new(UnixStream::connect(&server.path).await.expect("connect"));

    let e = error_of(raw(&mut s, b"this is not json\n").await);
    assert_eq!(e.kind, ErrorKind::BadRequest);
    assert!(e.message.contains("not valid JSON"), "{}", e.message);
    let e = error_of(raw(&mut s, b"[1,2]\n").await);
    assert_eq!(e.kind, ErrorKind::BadRequest);
    let e = error_of(
        raw(
            &mut s,
            b"{\"version\":1,\"request\":{\"type\":\"rm_rf\"}}\n",
        )
        .await,
    );
    assert_eq!(e.kind, ErrorKind::UnknownRequest);
    assert!(
        e.message.contains(
            "status, list, enable_cgroup, disable_cgroup, suspend, resume, ask_help, migrate, peers, forget_peer, export, import"
        ),
        "{}",
        e.message
    );
    let e = error_of(
        raw(
            &mut s,
            b"{\"version\":1,\"request\":{\"type\":\"enable_cgroup\"}}\n",
        )
        .await,
    );
    assert_eq!(e.kind, ErrorKind::BadRequest);
    assert!(e.message.contains("path"), "{}", e.message);
    let e = error_of(
        raw(
            &mut s,
            b"{\"version\":99,\"request\":{\"type\":\"list\"}}\n",
        )
        .await,
    );
    assert_eq!(e.kind, ErrorKind::UnsupportedVersion);
    let e = error_of(raw(&mut s, b"\xff\xfe\n").await);
    assert_eq!(e.kind, ErrorKind::BadRequest);

    // Same connection, then a fresh one: still served.
    let ok = raw(
        &mut s,
        b"\n{\"version\":1,\"request\":{\"type\":\"list\"}}\n",
    )
    .await;
    assert!(
        matches!(ok.outcome, Outcome::Ok(Reply::Connections { .. })),
        "{ok:?}"
    );
    server
        .client()
        .await
        .status()
        .await
        .expect("server still up");
    server.stop().await;
}

#[tokio::test]
async fn oversize_line_is_refused_and_the_server_stays_up() {
    let dir = TempDir::new();
    let server = Running::start(&dir.path().join("vnatd.sock"), FakeDatapath::new()).await;
    let mut s = BufReader::new(UnixStream::connect(&server.path).await.expect("connect"));
    let mut huge = vec![b' '; MAX_REQUEST_LINE + 10];
    huge.push(b'\n');
    let e = error_of(raw(&mut s, &huge).await);
    assert_eq!(e.kind, ErrorKind::RequestTooLarge);
    assert!(e.message.contains("1048576"), "{}", e.message);
    let mut rest = String::new();
    assert_eq!(
        s.read_line(&mut rest).await.expect("read"),
        0,
        "connection closed after an oversize line"
    );
    server.client().await.list().await.expect("server still up");
    server.stop().await;
}

#[tokio::test]
async fn socket_is_0600_in_a_new_0700_directory_and_removed_at_shutdown() {
    let dir = TempDir::new();
    let path = dir.path().join("run").join("vnat").join("vnatd.sock");
    let server = Running::start(&path, FakeDatapath::new()).await;
    let mode = |p: &Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode(&path), 0o600, "socket mode");
    assert_eq!(
        mode(path.parent().expect("parent")),
        0o700,
        "created directory mode"
    );
    server.stop().await;
    assert!(!path.exists(), "socket left behind after shutdown");
}

#[tokio::test]
async fn second_server_on_a_live_socket_is_refused() {
    let dir = TempDir::new();
    let path = dir.path().join("vnatd.sock");
    let first = Running::start(&path, FakeDatapath::new()).await;
    match ControlListener::bind(&path) {
        Err(e @ ServerError::AlreadyRunning { .. }) => {
            assert!(e.to_string().contains("already running"), "{e}")
        }
        Err(e) => panic!("wrong error for a live socket: {e}"),
        Ok(_) => panic!("a second server bound a live socket"),
    }
    // The refused one must not have removed the live socket.
    first
        .client()
        .await
        .status()
        .await
        .expect("first server still reachable");
    first.stop().await;
}

#[tokio::test]
async fn stale_socket_is_replaced_and_other_files_are_not() {
    let dir = TempDir::new();
    let path = dir.path().join("vnatd.sock");
    // A socket file nobody listens on, as left by a killed vnatd.
    drop(std::os::unix::net::UnixListener::bind(&path).expect("stale socket"));
    assert!(path.exists());
    let server = Running::start(&path, FakeDatapath::new()).await;
    server
        .client()
        .await
        .status()
        .await
        .expect("new server reachable");
    server.stop().await;

    std::fs::write(&path, b"not a socket").expect("regular file");
    match ControlListener::bind(&path) {
        Err(ServerError::NotASocket { .. }) => {}
        Err(e) => panic!("wrong error for a regular file: {e}"),
        Ok(_) => panic!("bound over a regular file"),
    }
    assert_eq!(std::fs::read(&path).expect("file kept"), b"not a socket");
}

#[test]
fn bind_outside_a_runtime_is_an_error_not_a_panic() {
    let dir = TempDir::new();
    let path = dir.path().join("vnatd.sock");
    assert!(matches!(
        ControlListener::bind(&path),
        Err(ServerError::NoRuntime)
    ));
    assert!(!path.exists());
}

/// Whoever may write the socket's directory can swap the new socket file
/// for a link to another file between vnatd's bind and anything it then
/// does by path. vnatd must change nothing through such a link: a victim
/// file keeps its mode however often the race is run (a watcher thread
/// swaps the file as soon as inotify reports it created).
#[tokio::test(flavor = "current_thread")]
async fn a_socket_file_swapped_for_a_link_after_bind_changes_nothing_through_it() {
    use std::os::{
        fd::{AsRawFd, FromRawFd},
        unix::ffi::OsStrExt,
    };
    for round in 0..300 {
        let dir = TempDir::new();
        let path = dir.path().join("vnatd.sock");
        let victim = dir.path().join("victim");
        std::fs::write(&victim, b"someone else's file").expect("victim");
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&victim, &link).expect("symlink");
        // SAFETY: inotify_init1 takes no pointers; -1 or a new descriptor,
        // owned at once.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC) };
        assert!(
            fd >= 0,
            "inotify_init1: {}",
            std::io::Error::last_os_error()
        );
        // SAFETY: `fd` is the descriptor inotify_init1 just returned.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        let cdir = std::ffi::CString::new(dir.path().as_os_str().as_bytes()).expect("path");
        // SAFETY: `fd` is an open inotify descriptor and `cdir` a live C string.
        let w = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), cdir.as_ptr(), libc::IN_CREATE) };
        assert!(
            w >= 0,
            "inotify_add_watch: {}",
            std::io::Error::last_os_error()
        );
        let (p, l) = (path.clone(), link.clone());
        let swapper = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                // SAFETY: `buf` is live and as long as the length given.
                let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
                if n <= 0 {
                    return;
                }
                if buf[..n as usize].windows(9).any(|w| w == b"vnatd.soc") {
                    let _ = std::fs::rename(&l, &p);
                    return;
                }
            }
        });
        let bound = ControlListener::bind(&path);
        swapper.join().expect("the swapper");
        drop(bound);
        let mode = std::fs::metadata(&victim)
            .expect("victim")
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(
            mode, 0o644,
            "round {round}: vnatd changed the mode of the file a link planted at its socket's path points to"
        );
    }
}
