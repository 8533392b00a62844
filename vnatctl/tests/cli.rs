//! The vnatctl binary without a daemon: usage errors, help, what it checks
//! before it asks vnatd anything, and an unreachable vnatd. Against a
//! control server backed by the fake datapath, it is tested in
//! vnat-daemon's `tests/vnatctl.rs` (this crate does not depend on the
//! daemon).

use std::{
    path::Path,
    process::{Command, Output},
};

use serde_json::Value;

fn vnatctl(control: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vnatctl"))
        .arg("--control")
        .arg(control)
        .args(args)
        .env_remove("VNAT_CONTROL")
        .output()
        .expect("running vnatctl")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("UTF-8 stdout")
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).expect("UTF-8 stderr")
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", stdout(o)))
}

#[test]
fn daemon_not_running() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("absent.sock");
    let o = vnatctl(&socket, &["status"]);
    assert_eq!(
        o.status.code(),
        Some(3),
        "exit status for an unreachable daemon"
    );
    assert!(o.stdout.is_empty(), "nothing on stdout without --json");
    assert_eq!(
        stderr(&o).trim_end(),
        format!(
            "vnatctl: cannot reach vnatd at {}: No such file or directory; is vnatd running? (start it with: systemctl start vnatd)",
            socket.display()
        )
    );
    let o = vnatctl(&socket, &["ls", "--json"]);
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(json(&o)["error"]["kind"], "unreachable");

    // A socket file nobody listens on (vnatd killed): refused, also exit 3.
    drop(std::os::unix::net::UnixListener::bind(&socket).expect("stale socket"));
    let o = vnatctl(&socket, &["ls"]);
    assert_eq!(o.status.code(), Some(3), "stderr: {}", stderr(&o));
    assert!(
        stderr(&o).contains("Connection refused; is vnatd running?"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn usage_errors_and_version() {
    let nowhere = Path::new("/nonexistent/vnatd.sock");
    let o = vnatctl(nowhere, &["ls", "--proto", "sctp"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("sctp"), "{}", stderr(&o));
    let o = vnatctl(nowhere, &["--json", "frobnicate"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(json(&o)["error"]["kind"], "usage");
    let o = vnatctl(nowhere, &["enable"]);
    assert_eq!(o.status.code(), Some(2), "--cgroup is required");

    let o = Command::new(env!("CARGO_BIN_EXE_vnatctl"))
        .arg("--version")
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(
        stdout(&o).trim(),
        format!("vnatctl {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn selector_usage_errors() {
    let nowhere = Path::new("/nonexistent/vnatd.sock");
    for args in [
        vec!["suspend"],
        vec!["resume", "--all", "--pid", "1"],
        vec!["export", "--conn"],
        vec!["suspend", "--conn", "x"],
        vec!["resume", "--cgroup", "/a", "--conn", "1"],
        vec!["import"],
    ] {
        let o = vnatctl(nowhere, &args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
    let o = vnatctl(nowhere, &["--json", "suspend"]);
    assert_eq!(json(&o)["error"]["kind"], "usage");

    // Bad import files are usage errors found before vnatd is contacted.
    let dir = tempfile::tempdir().expect("temp dir");
    let missing = dir.path().join("missing.json");
    let o = vnatctl(nowhere, &["import", &missing.display().to_string()]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("cannot read the export"),
        "{}",
        stderr(&o)
    );
    let garbage = dir.path().join("garbage.json");
    std::fs::write(&garbage, b"not json").expect("write");
    let o = vnatctl(
        nowhere,
        &["--json", "import", &garbage.display().to_string()],
    );
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert_eq!(json(&o)["error"]["kind"], "usage");
    assert!(
        stderr(&o).contains("is not a vnat export"),
        "{}",
        stderr(&o)
    );

    // An existing output file is never overwritten, and nothing is exported.
    let existing = dir.path().join("existing.json");
    std::fs::write(&existing, b"keep me").expect("write");
    let o = vnatctl(
        nowhere,
        &[
            "export",
            "--all",
            "--output",
            &existing.display().to_string(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("nothing was exported"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read(&existing).expect("read"), b"keep me");
}

#[test]
fn help_teaches_selectors_and_secrets() {
    let help = |cmd: &str| {
        let o = Command::new(env!("CARGO_BIN_EXE_vnatctl"))
            .args([cmd, "--help"])
            .output()
            .expect("run");
        assert_eq!(o.status.code(), Some(0));
        stdout(&o)
    };
    for cmd in ["suspend", "resume", "export"] {
        let text = help(cmd);
        for needle in ["--all", "--conn", "--pid", "--cgroup", "Examples:"] {
            assert!(
                text.contains(needle),
                "{cmd} --help lacks {needle}:\n{text}"
            );
        }
    }
    let export = help("export");
    assert!(
        export.contains("secret keys") && export.contains("0600"),
        "{export}"
    );
    assert!(help("import").contains("vnatctl import -"));
    assert!(help("peers").contains("MOBILE"));
}

/// `criu-hook` as CRIU runs it: what it needs is checked before vnatd is
/// asked anything, actions it has nothing to do for succeed without vnatd,
/// and its help teaches the wrapper and both sides' commands.
#[test]
fn criu_hook_checks_its_environment_first() {
    let images = tempfile::tempdir().expect("temp dir");
    let hook = |env: &[(&str, &str)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vnatctl"));
        cmd.args(["--control", "/nonexistent/vnatd.sock", "criu-hook"])
            .env_remove("CRTOOLS_SCRIPT_ACTION")
            .env_remove("VNAT_CRIU_TO")
            .env_remove("VNAT_CRIU_FROM")
            .env("CRTOOLS_IMAGE_DIR", images.path())
            .envs(env.iter().copied());
        cmd.output().expect("run")
    };
    let o = hook(&[]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--action-script"), "{}", stderr(&o));

    for action in ["post-resume", "network-unlock"] {
        let o = hook(&[("CRTOOLS_SCRIPT_ACTION", action)]);
        assert_eq!(o.status.code(), Some(0), "{action}: {}", stderr(&o));
        assert_eq!(stdout(&o), "", "{action}");
    }
    // pre-dump asks the peers to hold their packets: it needs the dumped
    // tree, and vnatd (whose absence would fail the export anyway).
    let o = hook(&[("CRTOOLS_SCRIPT_ACTION", "pre-dump")]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("CRTOOLS_INIT_PID"), "{}", stderr(&o));
    let me = std::process::id().to_string();
    let o = hook(&[
        ("CRTOOLS_SCRIPT_ACTION", "pre-dump"),
        ("CRTOOLS_INIT_PID", me.as_str()),
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    // No export in the images: nothing to import or hurry, no vnatd needed.
    for action in ["pre-restore", "post-restore"] {
        let o = hook(&[("CRTOOLS_SCRIPT_ACTION", action)]);
        assert_eq!(o.status.code(), Some(0), "{action}: {}", stderr(&o));
    }

    // The dump must not go on without knowing where the process goes.
    let o = hook(&[
        ("CRTOOLS_SCRIPT_ACTION", "post-dump"),
        ("CRTOOLS_INIT_PID", &std::process::id().to_string()),
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("VNAT_CRIU_TO") && err.contains("keeps running here"),
        "{err}"
    );
    // With the key, vnatd is the next thing it needs.
    let o = hook(&[
        ("CRTOOLS_SCRIPT_ACTION", "post-dump"),
        ("CRTOOLS_INIT_PID", &std::process::id().to_string()),
        ("VNAT_CRIU_TO", &"ab".repeat(32)),
    ]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(!images.path().join("vnat-connections.json").exists());

    let help = Command::new(env!("CARGO_BIN_EXE_vnatctl"))
        .args(["criu-hook", "--help"])
        .output()
        .expect("run");
    let text = stdout(&help);
    for needle in [
        "exec vnatctl criu-hook",
        "criu dump",
        "criu restore",
        "VNAT_CRIU_TO",
        "0600",
    ] {
        assert!(
            text.contains(needle),
            "criu-hook --help lacks {needle}:\n{text}"
        );
    }
}
