//! vnatd's command line: help, exit status and one-sentence errors for bad
//! flags and config. (Nothing here starts the datapath: that needs root.)

use std::process::{Command, Output};

fn vnatd(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_vnatd"))
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("running vnatd")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn help_teaches_with_examples() {
    let o = vnatd(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let out = String::from_utf8_lossy(&o.stdout);
    for needle in [
        "Examples:",
        "--cgroup <DIR>",
        "/run/vnat/vnatd.sock",
        "/sys/fs/bpf/vnat",
        "0.0.0.0:2031",
        "Exit status",
    ] {
        assert!(out.contains(needle), "--help lacks {needle:?}:\n{out}");
    }
}

#[test]
fn usage_and_config_errors_exit_2_with_one_sentence() {
    let dir = std::env::temp_dir().join(format!("vnatd-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        "control = \"/run/x.sock\"\ncontrol_socket = \"/run/y.sock\"\n",
    )
    .expect("write");
    let missing = dir.join("missing.toml");
    let cases: [(Vec<&str>, &str); 4] = [
        (vec!["--listen", "2031"], "expected ADDR:PORT"),
        (
            vec!["--config", missing.to_str().expect("utf-8")],
            "cannot read the config file",
        ),
        (
            vec!["--config", bad.to_str().expect("utf-8")],
            "line 2: unknown field `control_socket`",
        ),
        (vec!["--log-level", "info,=[x"], "invalid log level"),
    ];
    for (args, needle) in cases {
        let o = vnatd(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
    let _ = std::fs::remove_dir_all(&dir);
}
