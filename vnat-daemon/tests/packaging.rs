//! The shipped example config and service files are what vnatd accepts.

use std::path::Path;

use vnat_daemon::daemon::config::parse_file;

fn repo(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

#[test]
fn example_config_parses_and_states_the_defaults() {
    let path = repo("packaging/vnatd.toml");
    let text = std::fs::read_to_string(&path).expect("packaging/vnatd.toml is missing");
    parse_file(&path, &text).unwrap_or_else(|e| panic!("the example config is refused: {e}"));
    for key in [
        "control = \"/run/vnat/vnatd.sock\"",
        "state_dir = \"/var/lib/vnat\"",
        "bpffs = \"/sys/fs/bpf/vnat\"",
        "listen = \"0.0.0.0:2031\"",
        "sleep_inhibit = true",
    ] {
        assert!(
            text.contains(key),
            "the example config does not show the default {key}"
        );
    }
}

#[test]
fn unit_runs_the_daemon_with_the_config() {
    let unit = std::fs::read_to_string(repo("packaging/systemd/vnatd.service")).unwrap();
    // Where the package installs vnatd and its config (xtask/src/package.rs).
    assert!(unit.contains("ExecStart=/usr/sbin/vnatd --config /etc/vnat/vnatd.toml"));
    // vnatd sends READY=1, RELOADING=1 and STATUS= (daemon/systemd.rs);
    // notify-reload needs systemd 253, newer than Debian 12's.
    let setting = |key: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("the unit has no {key}="))
    };
    assert_eq!(setting("Type"), "notify");
    assert_eq!(setting("NotifyAccess"), "main");
    // What the package installs for `systemctl help vnatd`.
    let docs: Vec<&str> = setting("Documentation").split_whitespace().collect();
    assert_eq!(
        docs,
        [
            "man:vnatd(8)",
            "man:vnatctl(8)",
            "man:vnatd.toml(5)",
            "file:/usr/share/doc/vnat/README.md"
        ]
    );
    assert!(unit.contains("CapabilityBoundingSet=") && unit.contains("NoNewPrivileges=yes"));
    // The restart lever's pidfd_getfd (push.rs) is outside @system-service:
    // without it in the filter, the first push would kill vnatd (SIGSYS).
    let filter = unit
        .lines()
        .find_map(|l| l.strip_prefix("SystemCallFilter="))
        .expect("the unit filters system calls");
    assert!(
        filter.split_whitespace().any(|c| c == "pidfd_getfd"),
        "SystemCallFilter={filter} does not allow pidfd_getfd"
    );
    assert!(unit.contains("CAP_SYS_PTRACE"));
    // Raw and packet sockets (restart levers, zero-window answers,
    // adoption), signals and setuid for the helpers.
    let caps = unit
        .lines()
        .find_map(|l| l.strip_prefix("CapabilityBoundingSet="))
        .expect("the unit bounds capabilities");
    for cap in ["CAP_NET_RAW", "CAP_KILL", "CAP_SETUID", "CAP_SETGID"] {
        assert!(
            caps.split_whitespace().any(|c| c == cap),
            "CapabilityBoundingSet={caps} lacks {cap}"
        );
    }
    let families = unit
        .lines()
        .find_map(|l| l.strip_prefix("RestrictAddressFamilies="))
        .expect("the unit restricts address families");
    assert!(
        families.split_whitespace().any(|f| f == "AF_PACKET"),
        "RestrictAddressFamilies={families} lacks AF_PACKET (adoption)"
    );
    for call in ["pidfd_open", "pidfd_send_signal"] {
        assert!(
            filter.split_whitespace().any(|c| c == call),
            "SystemCallFilter={filter} does not allow {call}"
        );
    }
    // Containers' connections are judged from inside their network
    // namespace (setns): "yes" would refuse that and manage no container.
    let ns = unit
        .lines()
        .find_map(|l| l.strip_prefix("RestrictNamespaces="))
        .expect("the unit restricts namespaces");
    assert_eq!(
        ns.trim(),
        "net",
        "RestrictNamespaces={ns} must allow entering network namespaces"
    );
    // systemctl reload: SIGHUP reloads the config; it must not stop vnatd.
    assert!(unit.contains("ExecReload=/bin/kill -HUP $MAINPID"));
    // vnatd settles connections before sleep through logind (sleep_inhibit):
    // a system-sleep hook would run after the network went down.
    assert!(
        !repo("packaging/systemd/vnat-sleep").exists(),
        "the system-sleep hook is gone: vnatd holds a logind inhibitor instead"
    );
}
