//! Settings merging and the run loop with the fake datapath.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU32, Ordering},
};

use clap::Parser;

use super::{
    config::{load_file_or, parse_file, Args, ConfigError, FileConfig, LogFormat, Settings},
    run, DaemonError,
};
use crate::{
    control::{ControlClient, ServerError},
    datapath::{fake::FakeDatapath, Datapath, DatapathError},
};

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("vnatd-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn args(flags: &[&str]) -> Args {
    Args::try_parse_from(std::iter::once("vnatd").chain(flags.iter().copied()))
        .unwrap_or_else(|e| panic!("flags {flags:?} refused: {e}"))
}

fn resolve(flags: &[&str], file: FileConfig) -> Result<Settings, ConfigError> {
    Settings::resolve(args(flags), None, file, None, || Ok(PathBuf::from("/cg2")))
}

#[test]
fn defaults_without_flags_or_file() {
    let s = resolve(&[], FileConfig::default()).expect("defaults are valid");
    assert_eq!(s.control, Path::new("/run/vnat/vnatd.sock"));
    assert_eq!(s.state_dir, Path::new("/var/lib/vnat"));
    assert_eq!(s.bpffs, Path::new("/sys/fs/bpf/vnat"));
    assert_eq!(s.listen, "0.0.0.0:2031".parse().expect("addr"));
    assert_eq!(
        s.cgroups,
        vec![PathBuf::from("/cg2")],
        "default cgroup is the cgroup2 root"
    );
    assert_eq!(
        (s.log_level.as_str(), s.log_format),
        ("info", LogFormat::Text)
    );
}

#[test]
fn flags_override_the_file_which_overrides_defaults() {
    let text = r#"
        control = "/run/a.sock"
        state_dir = "/var/lib/a"
        listen = "[::]:4000"
        cgroups = ["/cg2/a", "/cg2/b"]
        log_level = "debug"
        log_format = "json"
    "#;
    let file = parse_file(Path::new("t.toml"), text).expect("valid file");
    let s = resolve(
        &[
            "--control",
            "/run/b.sock",
            "--cgroup",
            "/cg2/c",
            "--log-level",
            "warn",
        ],
        file,
    )
    .expect("valid");
    assert_eq!(s.control, Path::new("/run/b.sock"), "flag wins");
    assert_eq!(
        s.state_dir,
        Path::new("/var/lib/a"),
        "file wins over default"
    );
    assert_eq!(s.bpffs, Path::new("/sys/fs/bpf/vnat"), "default");
    assert_eq!(s.listen, "[::]:4000".parse().expect("addr"));
    assert_eq!(
        s.cgroups,
        vec![PathBuf::from("/cg2/c")],
        "--cgroup replaces the file's list"
    );
    assert_eq!(
        (s.log_level.as_str(), s.log_format),
        ("warn", LogFormat::Json)
    );
}

#[test]
fn relative_flag_paths_are_made_absolute() {
    let s = resolve(
        &["--control", "x.sock", "--cgroup", "cg"],
        FileConfig::default(),
    )
    .expect("valid");
    let cwd = std::env::current_dir().expect("cwd");
    assert_eq!(s.control, cwd.join("x.sock"));
    assert_eq!(s.cgroups, vec![cwd.join("cg")]);
}

#[test]
fn bad_files_are_one_sentence_usage_errors() {
    let p = Path::new("/etc/vnat/vnatd.toml");
    let unknown =
        parse_file(p, "control = \"/a\"\nlisten_addr = \"1.2.3.4:5\"\n").expect_err("unknown key");
    let msg = unknown.to_string();
    assert!(
        msg.contains("line 2") && msg.contains("listen_addr"),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "one line: {msg:?}");
    let relative = parse_file(p, "state_dir = \"var/lib\"").expect_err("relative path");
    assert!(relative.to_string().contains("state_dir"), "{relative}");
    let listen = parse_file(p, "listen = \"nope\"").expect_err("bad address");
    assert!(
        listen.to_string().contains("invalid socket address"),
        "{listen}"
    );
    for e in [unknown, relative, listen] {
        assert!(e.is_usage());
        assert_eq!(DaemonError::Config(e).exit_code(), 2);
    }
    let level =
        resolve(&["--log-level", "info,=[bad"], FileConfig::default()).expect_err("bad level");
    assert_eq!(DaemonError::Config(level).exit_code(), 2);
    assert_eq!(
        DaemonError::Config(ConfigError::NoCgroup2Mount).exit_code(),
        1
    );
    assert_eq!(
        DaemonError::Datapath(DatapathError::NoEbpfObject).exit_code(),
        1
    );
}

#[test]
fn bad_listen_flag_is_refused_by_clap() {
    let e = Args::try_parse_from(["vnatd", "--listen", "2031"]).expect_err("port only");
    assert!(
        e.to_string().contains("ADDR:PORT such as 0.0.0.0:2031"),
        "{e}"
    );
    assert_eq!(e.exit_code(), 2);
}

#[test]
fn json_goes_with_check_or_cleanup_which_exclude_each_other() {
    assert!(args(&["--check", "--json"]).json);
    assert!(args(&["--cleanup", "--json"]).cleanup);
    for flags in [&["--json"][..], &["--check", "--cleanup"]] {
        let e = Args::try_parse_from(std::iter::once("vnatd").chain(flags.iter().copied()))
            .expect_err("refused");
        assert_eq!(e.exit_code(), 2, "{flags:?}: {e}");
    }
}

#[test]
fn missing_default_config_is_fine_missing_explicit_one_is_not() {
    let dir = TempDir::new();
    let absent = dir.0.join("absent.toml");
    let (used, _) = load_file_or(None, &absent).expect("missing default is fine");
    assert_eq!(used, None);
    match load_file_or(Some(&absent), &absent) {
        Err(e @ ConfigError::Read { .. }) => assert!(e.to_string().contains("No such file"), "{e}"),
        other => panic!("a missing --config must be an error, got {other:?}"),
    }
    let present = dir.0.join("vnatd.toml");
    std::fs::write(&present, "bpffs = \"/sys/fs/bpf/x\"\n").expect("write config");
    let (used, file) = load_file_or(None, &present).expect("default file read");
    assert_eq!(used.as_deref(), Some(present.as_path()));
    assert_eq!(file.bpffs.as_deref(), Some(Path::new("/sys/fs/bpf/x")));
}

fn settings_in(dir: &TempDir) -> Settings {
    let root = dir.0.display().to_string();
    let flags = [
        "--control",
        &format!("{root}/run/vnatd.sock"),
        "--state-dir",
        &format!("{root}/state/vnat"),
        "--cgroup",
        "/cg2",
    ];
    resolve(&flags, FileConfig::default()).expect("valid")
}

#[tokio::test]
async fn run_serves_until_shutdown_then_removes_only_the_socket() {
    let dir = TempDir::new();
    let settings = settings_in(&dir);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let open = |s: &Settings| -> Result<Box<dyn Datapath + Send>, DaemonError> {
        let mut dp = FakeDatapath::new();
        for c in &s.cgroups {
            dp.enable_cgroup(c)?;
        }
        Ok(Box::new(dp))
    };
    let s = settings.clone();
    let daemon = tokio::spawn(async move {
        run(
            &s,
            open,
            async move {
                let _ = stopped.await;
            },
            tokio::sync::mpsc::channel(1).1,
        )
        .await
    });
    let mut client = None;
    for _ in 0..100 {
        if let Ok(c) = ControlClient::connect(&settings.control).await {
            client = Some(c);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let mut client = client.expect("vnatd never became reachable");
    let status = client.status().await.expect("status");
    assert_eq!(
        status.daemon.configured_cgroups,
        vec![PathBuf::from("/cg2")]
    );
    assert_eq!(status.datapath.cgroups.len(), 1);
    let mode = std::fs::metadata(&settings.state_dir)
        .expect("state dir created")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "state dir mode");

    let _ = stop.send(());
    daemon.await.expect("run panicked").expect("run failed");
    assert!(!settings.control.exists(), "control socket left behind");
    assert!(settings.state_dir.exists(), "state dir must stay");
}

#[tokio::test]
async fn datapath_failure_removes_the_socket_and_second_daemon_is_refused() {
    let dir = TempDir::new();
    let settings = settings_in(&dir);
    let failing = |_: &Settings| -> Result<Box<dyn Datapath + Send>, DaemonError> {
        Err(DatapathError::NoEbpfObject.into())
    };
    let e = run(
        &settings,
        failing,
        std::future::pending(),
        tokio::sync::mpsc::channel(1).1,
    )
    .await
    .expect_err("must fail");
    assert!(e.to_string().contains("without its eBPF programs"), "{e}");
    assert_eq!(e.exit_code(), 1);
    assert!(
        !settings.control.exists(),
        "socket left behind after a failed start"
    );

    // A live daemon on the socket: the second one fails before opening its datapath.
    let live = crate::control::ControlListener::bind(&settings.control).expect("first bind");
    let must_not_open = |_: &Settings| -> Result<Box<dyn Datapath + Send>, DaemonError> {
        panic!("the datapath was opened although another vnatd is live")
    };
    match run(
        &settings,
        must_not_open,
        std::future::pending(),
        tokio::sync::mpsc::channel(1).1,
    )
    .await
    {
        Err(DaemonError::Control(ServerError::AlreadyRunning { .. })) => {}
        other => panic!("expected AlreadyRunning, got {other:?}"),
    }
    assert!(settings.control.exists(), "the live socket must stay");
    drop(live);
}

#[test]
fn a_state_directory_others_may_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    super::prepare_state_dir(&state).expect("a new state directory is made");
    assert_eq!(
        std::fs::metadata(&state).unwrap().permissions().mode() & 0o777,
        0o700
    );
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    super::prepare_state_dir(&state).expect("readable by others: a warning, not a refusal");
    for mode in [0o777, 0o770, 0o1777] {
        std::fs::set_permissions(&state, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = super::prepare_state_dir(&state).expect_err("writable by others must be refused");
        assert!(
            matches!(e, DaemonError::StateDirUnsafe { .. }),
            "mode {mode:o}: {e}"
        );
        assert!(e.to_string().contains("chmod 700"), "{e}");
    }
    // A symlink in its place is not a directory.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(dir.path(), &link).unwrap();
    assert!(matches!(
        super::prepare_state_dir(&link),
        Err(DaemonError::StateDirNotADirectory { .. })
    ));
}

#[test]
fn writing_state_never_follows_a_planted_link() {
    let dir = tempfile::tempdir().expect("tempdir");
    let victim = dir.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let target = dir.path().join("peers.json");
    std::os::unix::fs::symlink(&victim, dir.path().join("peers.tmp")).unwrap();
    super::identity::write_atomic(&target, b"{}").expect("write");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    assert_eq!(std::fs::read(&target).unwrap(), b"{}");
}
