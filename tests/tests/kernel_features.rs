//! The kernels users run: `vnatd --check`, the fallbacks a missing feature
//! takes (simulated with `VNAT_KERNEL_LACKS`, the switch the fallbacks and
//! the check go through), and the clsact attachment next to another
//! program's filter.

mod support;

use std::{
    net::SocketAddr,
    process::{Command, Output},
};

use vnat_daemon::datapath::{
    kernel::{KernelDatapath, KernelOptions},
    Datapath, Proto, TcAttach, Translation, VirtualFlow,
};
use vnat_tests::{bin_path, Cgroup, Host, LaptopRouterServer, SameLink, TempDir, Vnatd};

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn vnatd_check(lacks: &str, json: bool) -> Output {
    vnatd_check_pid(lacks, json).1
}

/// `vnatd --check`, with the pid it ran as.
fn vnatd_check_pid(lacks: &str, json: bool) -> (u32, Output) {
    let mut cmd = Command::new(bin_path("vnatd"));
    cmd.args(["--config", "/dev/null", "--check"]);
    if json {
        cmd.arg("--json");
    }
    let child = cmd
        .env("VNAT_KERNEL_LACKS", lacks)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running vnatd --check");
    let pid = child.id();
    (
        pid,
        child.wait_with_output().expect("waiting for vnatd --check"),
    )
}

fn json_of(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "vnatd --check --json printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn status_of<'a>(report: &'a serde_json::Value, name: &str) -> &'a str {
    report["items"]
        .as_array()
        .expect("items")
        .iter()
        .find(|i| i["name"] == name)
        .unwrap_or_else(|| panic!("vnatd --check lists no {name}: {report:#}"))["status"]
        .as_str()
        .expect("a status")
}

#[test]
fn check_lists_every_requirement_and_says_vnatd_can_run() {
    let (pid, out) = vnatd_check_pid("", true);
    let report = json_of(&out);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    assert_eq!(report["can_run"], true);
    for p in [
        "program:vnat_sockops",
        "program:vnat_udp_connect4",
        "program:vnat_udp_release",
        "program:vnat_tc_ingress",
        "program:vnat_tc_egress",
    ] {
        assert_eq!(status_of(&report, p), "ok", "{report:#}");
    }
    // This kernel may or may not have TCX (the VM kernels lack it), but
    // either way vnatd attaches tc, so it is never missing under auto.
    assert!(
        ["ok", "degraded"].contains(&status_of(&report, "tcx")),
        "{report:#}"
    );
    assert_eq!(status_of(&report, "clsact"), "ok", "{report:#}");
    // The text form ends with the verdict.
    let text = vnatd_check("", false);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.starts_with("vnat requirements on Linux "), "{text}");
    assert!(
        text.trim_end()
            .lines()
            .last()
            .unwrap_or("")
            .starts_with("vnatd can run here"),
        "{text}"
    );
    // The check leaves no scratch pins behind (other tests' checks may be
    // running: only this one's are looked for).
    let left: Vec<_> = std::fs::read_dir("/sys/fs/bpf")
        .unwrap()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(&format!("vnat-check-{pid}"))
        })
        .map(|e| e.file_name())
        .collect();
    assert!(
        left.is_empty(),
        "vnatd --check left {left:?} in /sys/fs/bpf"
    );
}

#[test]
fn a_missing_feature_is_one_sentence_and_the_check_exits_1() {
    let out = vnatd_check("netns-cookie", false);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("MISSING   netns-cookie") && text.contains("SO_NETNS_COOKIE, Linux 5.14"),
        "{text}"
    );
    assert!(
        text.trim_end()
            .ends_with("vnatd cannot run on this machine: see the MISSING lines above"),
        "{text}"
    );
    // A capability's feature degrades, and the check still exits 0.
    let out = vnatd_check("tcx,sock-addr-name-hooks,ifa-proto,tcp-info-windows", true);
    let report = json_of(&out);
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    for f in [
        "tcx",
        "ifa-proto",
        "tcp-info-windows",
        "program:vnat_hide_getpeername4",
    ] {
        assert_eq!(status_of(&report, f), "degraded", "{report:#}");
    }
    // A name that is no feature is refused, not ignored.
    let out = vnatd_check("tcxx", false);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("names no kernel feature: tcxx"), "{err}");
}

#[test]
fn vnatd_refuses_to_start_without_a_required_feature_in_one_sentence() {
    let topo = LaptopRouterServer::new();
    let lap = Host::new(&topo.laptop, "kfreq");
    let dir = TempDir::new("kfreq");
    let dir = dir.path();
    let cgroup = lap.cgroup.path().display().to_string();
    for (lacks, flags, expect) in [
        ("netns-cookie", vec![], "SO_NETNS_COOKIE (Linux 5.14)"),
        (
            "tcx",
            vec!["--tc-attach", "tcx"],
            "tc_attach = \"tcx\" needs TCX (Linux 6.6)",
        ),
    ] {
        let out = lap
            .ns
            .cmd(bin_path("vnatd"))
            .args(["--config", "/dev/null", "--cgroup", &cgroup])
            .arg("--control")
            .arg(dir.join("sock"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--bpffs")
            .arg(lap.pins.path())
            .args(&flags)
            .env("VNAT_KERNEL_LACKS", lacks)
            .output()
            .expect("running vnatd");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{lacks}: {err}");
        let last = err.trim_end().lines().last().unwrap_or("");
        assert!(
            last.starts_with("vnatd: ") && last.contains(expect),
            "{lacks}: the last line should say why in one sentence: {err}"
        );
    }
}

#[test]
fn without_tcx_or_the_name_hooks_vnatd_runs_with_clsact_and_says_what_is_off() {
    let topo = LaptopRouterServer::new();
    let lap = Host::new(&topo.laptop, "kfdeg");
    let dir = TempDir::new("kfdeg");
    let dir = dir.path();
    let d = Vnatd::start_with_env(
        &lap,
        dir,
        &[],
        &[("VNAT_KERNEL_LACKS", "tcx,sock-addr-name-hooks")],
    );
    let status = d.ctl(&["status"]).expect("vnatctl status");
    assert_eq!(status["datapath"]["tc_mode"], "clsact", "{status:#}");
    let degraded: Vec<&str> = status["datapath"]["degraded"]
        .as_array()
        .expect("degraded")
        .iter()
        .filter_map(|g| g["feature"].as_str())
        .collect();
    assert!(
        degraded.contains(&"tcx") && degraded.contains(&"sock-addr-name-hooks"),
        "{status:#}"
    );
    let text = Command::new(bin_path("vnatctl"))
        .arg("--control")
        .arg(&d.control)
        .arg("status")
        .output()
        .expect("vnatctl status");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("tc attaches with clsact") && text.contains("hide location is off"),
        "{text}"
    );
    // Hide location is refused in one sentence, and nothing changes.
    let hiding = Cgroup::new("kfdeg-hide");
    let (code, answer) = d.ctl_status(&[
        "enable",
        "--hide-location",
        "--cgroup",
        &hiding.path().display().to_string(),
    ]);
    assert_ne!(code, 0, "enable --hide-location succeeded: {answer:#}");
    let message = answer["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("needs the getsockname/getpeername cgroup hooks (Linux 5.8)"),
        "{answer:#}"
    );
    let after = d.ctl(&["status"]).expect("vnatctl status");
    assert!(
        after["datapath"]["cgroups"]
            .as_array()
            .expect("cgroups")
            .iter()
            .all(|c| c["hide_location"] == false),
        "{after:#}"
    );
}

/// The clsact datapath of `h`, whatever `VNAT_TC_ATTACH` says.
fn with_clsact<T: Send>(h: &Host, f: impl FnOnce(&mut KernelDatapath) -> T + Send) -> T {
    let opts = KernelOptions {
        tc_attach: TcAttach::Clsact,
        ..h.options()
    };
    h.ns.run_in(move || {
        let mut dp = KernelDatapath::open(&opts).unwrap_or_else(|e| panic!("opening: {e}"));
        f(&mut dp)
    })
}

fn filters(h: &Host, dir: &str) -> String {
    h.ns.run_stdout(&["tc", "filter", "show", "dev", "eth0", dir])
}

fn has_clsact(h: &Host) -> bool {
    h.ns.run_stdout(&["tc", "qdisc", "show", "dev", "eth0"])
        .contains("clsact")
}

#[test]
fn clsact_keeps_another_filter_and_removes_only_what_vnat_added() {
    let topo = SameLink::new("kfcls", false);
    let lap = Host::new(&topo.laptop, "kfclsl");
    let srv = Host::new(&topo.server, "kfclss");
    // Another program's filters, ahead of vnat's on both hooks (a
    // classic-BPF filter that matches nothing, so packets go on).
    srv.ns.run(&["tc", "qdisc", "add", "dev", "eth0", "clsact"]);
    for dir in ["ingress", "egress"] {
        srv.ns.run(&[
            "tc",
            "filter",
            "add",
            "dev",
            "eth0",
            dir,
            "prio",
            "1",
            "handle",
            "7",
            "bpf",
            "bytecode",
            "1,6 0 0 0,",
        ]);
    }
    topo.move_laptop();
    let flow = VirtualFlow {
        proto: Proto::Tcp,
        local: sa("198.18.1.2:40000"),
        remote: sa("198.18.1.3:5001"),
    };
    let t = Translation {
        flow,
        physical_local: sa("198.18.1.9:40000"),
        physical_remote: flow.remote,
    };
    let back_flow = VirtualFlow {
        proto: Proto::Tcp,
        local: flow.remote,
        remote: flow.local,
    };
    let back = Translation {
        flow: back_flow,
        physical_local: flow.remote,
        physical_remote: t.physical_local,
    };
    with_clsact(&lap, move |dp| dp.install_translation(&t)).expect("installing on the laptop");
    with_clsact(&srv, move |dp| dp.install_translation(&back)).expect("installing on the server");
    for (h, name) in [(&lap, "laptop"), (&srv, "server")] {
        let status = with_clsact(h, |dp| dp.status().expect("status"));
        assert_eq!(
            status
                .tc
                .iter()
                .map(|t| (t.ifname.as_str(), t.mode.to_string()))
                .collect::<Vec<_>>(),
            vec![("eth0", "clsact".to_string())],
            "{name}"
        );
        for dir in ["ingress", "egress"] {
            let shown = filters(h, dir);
            assert!(
                shown.contains(&format!("vnat_tc_{dir}")),
                "{name} {dir}: {shown}"
            );
        }
    }
    for dir in ["ingress", "egress"] {
        assert!(
            filters(&srv, dir).contains("handle 0x7"),
            "the other filter went: {dir}"
        );
    }
    // Opening again (a restarted vnatd) swaps its programs into the same
    // filters: still one of vnat's per hook.
    with_clsact(&srv, |_| ());
    let shown = filters(&srv, "egress");
    assert_eq!(
        shown
            .lines()
            .filter(|l| l.contains("vnat_tc_egress"))
            .count(),
        1,
        "{shown}"
    );

    // A vnatd restarted with tc_attach = "auto" (TCX on a kernel that has
    // it) keeps translating through those filters and adds no TCX link
    // beside them, which would translate twice.
    let opts = KernelOptions {
        tc_attach: TcAttach::Auto,
        ..srv.options()
    };
    let modes = srv.ns.run_in(move || {
        let dp = KernelDatapath::open(&opts).unwrap_or_else(|e| panic!("opening: {e}"));
        let st = dp.status().expect("status");
        st.tc.iter().map(|t| t.mode.to_string()).collect::<Vec<_>>()
    });
    assert_eq!(modes, vec!["clsact".to_string()]);
    let links = std::fs::read_dir(srv.pins.path().join("links"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("tc"))
        .collect::<Vec<_>>();
    assert!(
        links.is_empty(),
        "TCX links beside the clsact filters: {links:?}"
    );

    with_clsact(&lap, move |dp| dp.remove_translation(&flow)).expect("removing on the laptop");
    with_clsact(&srv, move |dp| dp.remove_translation(&back_flow)).expect("removing on the server");
    // vnat's filters are gone; the other program's filters and the qdisc
    // it was on stay on the server; the laptop's qdisc, which vnat added,
    // goes with vnat's filters.
    for dir in ["ingress", "egress"] {
        let shown = filters(&srv, dir);
        assert!(!shown.contains("vnat_tc"), "{dir}: {shown}");
        assert!(
            shown.contains("handle 0x7"),
            "the other filter went: {dir}: {shown}"
        );
        assert!(!filters(&lap, dir).contains("vnat_tc"));
    }
    assert!(
        has_clsact(&srv),
        "the server's own clsact qdisc was removed"
    );
    assert!(
        !has_clsact(&lap),
        "the clsact qdisc vnat added stayed on the laptop"
    );
}
