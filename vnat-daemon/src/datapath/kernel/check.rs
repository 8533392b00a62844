//! `vnatd --check`: every kernel requirement of vnat, each asked of this
//! kernel (a program loaded, a link tried, an attribute echoed back), as
//! ok, missing (vnatd cannot run) or degraded (one capability is off).
//!
//! The probes that change the kernel's network state run in a network
//! namespace of their own, made for the check and gone with it: nothing on
//! the host's interfaces is touched. Programs are loaded with their maps
//! pinned in a scratch directory on bpffs, removed afterwards.

use std::{
    fs,
    net::{IpAddr, Ipv4Addr},
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
};

use aya::{
    programs::{
        tc::{qdisc_add_clsact, NlOptions, TcAttachOptions},
        SchedClassifier, TcAttachType,
    },
    EbpfLoader,
};
use serde::Serialize;
use vnat_common::{PROG_SOCKOPS, PROG_TC_EGRESS, PROG_TC_INGRESS, PROG_UDP_RELEASE};

use super::{
    clsact,
    features::{self, Feature},
    object::{
        self, verifier_verdict, EBPF_OBJECT, HIDE_PROGRAMS, SOCK_ADDR_PROGRAMS, TC_L3, TC_LOADED,
    },
    rtnl,
};
use crate::datapath::TcAttach;
use CheckStatus::{Degraded, Missing};

/// One requirement's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckStatus {
    Ok,
    /// vnatd cannot run without it.
    Missing,
    /// vnatd runs; the capability named in `affects` is off or weaker.
    Degraded,
}

/// One line of `vnatd --check`.
#[derive(Clone, Debug, Serialize)]
pub struct CheckItem {
    /// A stable name (`tcx`, `program:vnat_sockops`, ...).
    pub name: String,
    pub status: CheckStatus,
    /// The kernel (or setting) it needs.
    pub needs: String,
    /// What in vnat uses it.
    pub affects: String,
    /// What was found, and what to do when it is not ok.
    pub detail: String,
}

/// `vnatd --check`'s answer.
#[derive(Clone, Debug, Serialize)]
pub struct CheckReport {
    /// `uname -r`.
    pub kernel: String,
    /// Whether vnatd can run here (nothing is missing).
    pub can_run: bool,
    pub items: Vec<CheckItem>,
    /// Names in `VNAT_KERNEL_LACKS` taken as missing.
    pub simulated_missing: Vec<String>,
}

fn item(
    name: impl Into<String>,
    status: CheckStatus,
    needs: &str,
    affects: &str,
    detail: impl Into<String>,
) -> CheckItem {
    CheckItem {
        name: name.into(),
        status,
        needs: needs.into(),
        affects: affects.into(),
        detail: detail.into(),
    }
}

/// Run every check. `bpffs` is where vnatd would pin (`--bpffs`);
/// `tc_attach` the configured way to attach tc.
pub fn check(bpffs: &Path, tc_attach: TcAttach) -> CheckReport {
    let mut items = Vec::new();
    let root = nix::unistd::geteuid().is_root();
    items.push(item(
        "root",
        if root { CheckStatus::Ok } else { Missing },
        "root (CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN)",
        "everything: vnatd loads eBPF programs and changes routes",
        if root {
            "running as root".to_string()
        } else {
            "not root: run vnatd (and vnatd --check) as root".to_string()
        },
    ));
    let bpf_syscall = Path::new("/proc/sys/kernel/unprivileged_bpf_disabled").exists();
    items.push(item(
        "bpf",
        if bpf_syscall {
            CheckStatus::Ok
        } else {
            Missing
        },
        "CONFIG_BPF_SYSCALL",
        "everything",
        if bpf_syscall {
            "the bpf() system call is there"
        } else {
            "this kernel has no bpf() system call (CONFIG_BPF_SYSCALL): vnat needs eBPF"
        },
    ));
    let cgroup2 = crate::mounts::cgroup2_mount();
    items.push(item(
        "cgroup2",
        if cgroup2.is_some() { CheckStatus::Ok } else { Missing },
        "a mounted cgroup v2 hierarchy",
        "recording connections (sock_ops, sock_addr hooks)",
        match &cgroup2 {
            Some(p) => format!("mounted at {}", p.display()),
            None => "no cgroup v2 hierarchy is mounted: mount one (mount -t cgroup2 none /sys/fs/cgroup)".into(),
        },
    ));
    let pin_root = bpffs_mount(bpffs);
    items.push(item(
        "bpffs",
        if pin_root.is_some() { CheckStatus::Ok } else { Missing },
        "a mounted bpf filesystem",
        "keeping translations while vnatd restarts (pinned maps and links)",
        match &pin_root {
            Some(p) => format!("mounted at {}", p.display()),
            None => format!(
                "{} is on no bpf filesystem: mount one (mount -t bpf bpf /sys/fs/bpf) or pass --bpffs",
                bpffs.display()
            ),
        },
    ));
    let netns_cookie =
        !features::simulated_missing(Feature::NetnsCookie) && object::own_netns_cookie().is_ok();
    items.push(item(
        Feature::NetnsCookie.name(),
        if netns_cookie { CheckStatus::Ok } else { Missing },
        Feature::NetnsCookie.needs(),
        "telling this namespace's connections from containers'",
        if netns_cookie {
            "ok".to_string()
        } else {
            "this kernel cannot tell a socket's network namespace (SO_NETNS_COOKIE, Linux 5.14): vnat needs Linux 5.15 or newer".to_string()
        },
    ));
    let mut tc_fd_ok = false;
    match (&pin_root, root && bpf_syscall) {
        (Some(dir), true) => {
            let (progs, tcx) = check_programs(dir);
            tc_fd_ok = progs
                .iter()
                .any(|i| i.name == format!("program:{PROG_TC_INGRESS}") && i.status == CheckStatus::Ok);
            items.extend(progs);
            items.push(tcx_item(tcx, tc_attach));
        }
        _ => items.push(item(
            "programs",
            Missing,
            "root, bpf() and bpffs",
            "everything",
            "not checked: vnatd's eBPF programs can be loaded only as root with bpf() and bpffs (see above)",
        )),
    }
    if root {
        items.extend(scratch_netns_checks(pin_root.filter(|_| tc_fd_ok)));
    }
    items.push(tcp_info_item());
    let can_run = items.iter().all(|i| i.status != Missing);
    CheckReport {
        kernel: object::kernel_release(),
        can_run,
        items,
        simulated_missing: std::env::var(features::LACKS_ENV)
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// The bpf filesystem `dir` is on (or would be on, once created), if any.
fn bpffs_mount(dir: &Path) -> Option<PathBuf> {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    let mut at = dir;
    loop {
        if at.exists() {
            let st = nix::sys::statfs::statfs(at).ok()?;
            return (st.filesystem_type().0 as i64 == BPF_FS_MAGIC).then(|| at.to_path_buf());
        }
        at = at.parent()?;
    }
}

/// Load every program (maps pinned in a scratch directory under
/// `pin_root`), and ask whether the kernel has TCX with the loaded tc
/// program.
fn check_programs(pin_root: &Path) -> (Vec<CheckItem>, Option<bool>) {
    let scratch = pin_root.join(format!("vnat-check-{}", std::process::id()));
    let mut items = Vec::new();
    if fs::create_dir_all(&scratch).is_err() {
        items.push(item(
            "programs",
            Missing,
            "a writable bpffs",
            "everything",
            format!(
                "cannot create {} to load the programs in",
                scratch.display()
            ),
        ));
        return (items, None);
    }
    let mut tcx = None;
    match EbpfLoader::new()
        .default_map_pin_directory(&scratch)
        .load(EBPF_OBJECT)
    {
        Err(e) => items.push(item(
            "programs",
            Missing,
            "eBPF maps of vnat's kinds (hash, LRU hash, array, per-CPU array)",
            "everything",
            format!("the kernel refused vnat's maps: {e}"),
        )),
        Ok(mut ebpf) => {
            let mut names: Vec<&'static str> = vec![PROG_SOCKOPS, PROG_UDP_RELEASE];
            names.extend(SOCK_ADDR_PROGRAMS);
            names.extend(TC_LOADED);
            names.extend(TC_L3);
            for name in names {
                let hide = HIDE_PROGRAMS.contains(&name);
                let simulated = hide && features::simulated_missing(Feature::SockAddrNameHooks);
                let r = if simulated {
                    Err("VNAT_KERNEL_LACKS names sock-addr-name-hooks".to_string())
                } else {
                    load_one(&mut ebpf, name)
                };
                let (status, needs, affects) = match (hide, r.is_ok()) {
                    (_, true) => (CheckStatus::Ok, "", ""),
                    (true, false) => (
                        Degraded,
                        Feature::SockAddrNameHooks.needs(),
                        "hide location (vnatctl enable --hide-location)",
                    ),
                    (false, false) => (Missing, "", "everything"),
                };
                let needs = if needs.is_empty() {
                    program_needs(name)
                } else {
                    needs
                };
                let affects = if affects.is_empty() {
                    program_affects(name)
                } else {
                    affects
                };
                items.push(item(
                    format!("program:{name}"),
                    status,
                    needs,
                    affects,
                    match r {
                        Ok(()) => "loads".to_string(),
                        Err(why) if hide => format!("refused ({why}): hide location is off"),
                        Err(why) => format!(
                            "this kernel refused it ({why}); vnat cannot run on it: report it with `vnatd --check --json`"
                        ),
                    },
                ));
            }
            if let Ok(p) = object::prog::<SchedClassifier>(&mut ebpf, PROG_TC_INGRESS) {
                if let Ok(fd) = p.fd() {
                    tcx = Some(features::probe_tcx(fd.as_fd()));
                }
            }
        }
    }
    let _ = fs::remove_dir_all(&scratch);
    (items, tcx)
}

fn load_one(ebpf: &mut aya::Ebpf, name: &'static str) -> Result<(), String> {
    fn verdict(e: aya::programs::ProgramError) -> String {
        match e {
            aya::programs::ProgramError::LoadError {
                io_error,
                verifier_log,
            } => {
                let log = verifier_log.to_string();
                verifier_verdict(&log)
                    .map(|v| format!("the verifier said \"{v}\""))
                    .unwrap_or_else(|| io_error.to_string())
            }
            other => other.to_string(),
        }
    }
    let p = ebpf
        .program_mut(name)
        .ok_or_else(|| format!("{name} is missing from the eBPF object"))?;
    match p {
        aya::programs::Program::SockOps(p) => p.load().map_err(verdict),
        aya::programs::Program::CgroupSockAddr(p) => p.load().map_err(verdict),
        aya::programs::Program::CgroupSock(p) => p.load().map_err(verdict),
        aya::programs::Program::SchedClassifier(p) => p.load().map_err(verdict),
        _ => Err(format!("{name} is of a kind vnat does not load")),
    }
}

fn program_needs(name: &str) -> &'static str {
    match name {
        PROG_SOCKOPS => "sock_ops programs with bpf_get_netns_cookie (Linux 5.15)",
        PROG_UDP_RELEASE => "cgroup sock_release programs (Linux 5.9)",
        n if n.starts_with("vnat_tc") => "tc programs with bpf_redirect_neigh (Linux 5.10)",
        _ => "cgroup sock_addr programs with bpf_get_netns_cookie (Linux 5.7)",
    }
}

fn program_affects(name: &str) -> &'static str {
    match name {
        PROG_SOCKOPS => "recording TCP connections",
        PROG_UDP_RELEASE => "forgetting closed UDP sockets",
        n if n.starts_with("vnat_tc") => "translating moved connections' packets",
        _ => "recording UDP flows and who opened TCP connections",
    }
}

fn tcx_item(tcx: Option<bool>, want: TcAttach) -> CheckItem {
    let needs = Feature::Tcx.needs();
    let affects = "attaching the tc translators";
    match (tcx, want) {
        (Some(true), TcAttach::Clsact) => item(
            "tcx",
            CheckStatus::Ok,
            needs,
            affects,
            "available; tc_attach = \"clsact\" attaches with clsact all the same",
        ),
        (Some(true), _) => item("tcx", CheckStatus::Ok, needs, affects, "available: tc attaches with TCX"),
        (Some(false), TcAttach::Tcx) => item(
            "tcx",
            Missing,
            needs,
            affects,
            "this kernel has no TCX but tc_attach = \"tcx\": use tc_attach = \"auto\" or \"clsact\"",
        ),
        (Some(false), _) => item(
            "tcx",
            Degraded,
            needs,
            affects,
            "this kernel has no TCX: tc attaches as clsact filters (same translation; another program on the same hook must pass packets on for vnat's to see them)",
        ),
        (None, _) => item(
            "tcx",
            Missing,
            needs,
            affects,
            "not checked: the tc programs did not load",
        ),
    }
}

/// Whether TCP_INFO has the window fields (tcpi_snd_wnd 5.19,
/// tcpi_rcv_wnd 6.2): how many bytes the kernel gives for it.
pub fn tcp_info_windows_available() -> bool {
    /// Offset of tcpi_rcv_wnd in struct tcp_info, plus its 4 bytes.
    const RCV_WND_END: usize = 236;
    // The kernel does not change under a running process: asked once.
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        !features::simulated_missing(Feature::TcpInfoWindows)
            && tcp_info_len().is_some_and(|n| n >= RCV_WND_END)
    })
}

/// Whether the kernel keeps IFA_PROTO on addresses: asked in a network
/// namespace of its own, so the host's addresses are not touched.
pub fn ifa_proto_available() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).is_ok() && ifa_proto_probe()
        })
        .join()
        .unwrap_or(false)
    })
}

/// The window fields of tcp_info: see [`tcp_info_windows_available`].
fn tcp_info_item() -> CheckItem {
    let has = tcp_info_windows_available();
    item(
        Feature::TcpInfoWindows.name(),
        if has { CheckStatus::Ok } else { Degraded },
        Feature::TcpInfoWindows.needs(),
        "restarting a stalled TCP connection after an outage",
        if has {
            "ok"
        } else {
            "this kernel does not report a socket's receive window: the restart probe advertises 65535 bytes instead of the socket's window"
        },
    )
}

fn tcp_info_len() -> Option<usize> {
    let sock = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).ok()?;
    let mut buf = [0u8; 512];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: `buf` is a live buffer of `len` bytes; the kernel writes at
    // most `len` bytes and sets `len` to what it wrote.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            buf.as_mut_ptr().cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(len as usize)
}

/// The checks that change network state, in a namespace of their own:
/// clsact (a qdisc and one of vnat's filters on that namespace's `lo`) and
/// IFA_PROTO (an address added with it, read back).
fn scratch_netns_checks(pin_root: Option<PathBuf>) -> Vec<CheckItem> {
    let run = std::thread::spawn(move || -> Result<(Option<String>, bool), String> {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("cannot make a network namespace to check in: {e}"))?;
        let clsact = pin_root.map(|root| {
            let scratch = root.join(format!("vnat-check-{}-tc", std::process::id()));
            let r = clsact_probe(&scratch).err().unwrap_or_default();
            let _ = fs::remove_dir_all(&scratch);
            r
        });
        let ifa = ifa_proto_probe();
        Ok((clsact, ifa))
    })
    .join();
    let mut items = Vec::new();
    let (clsact, ifa) = match run {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            items.push(item(
                "scratch-netns",
                Degraded,
                "unshare(CLONE_NEWNET)",
                "these checks",
                e,
            ));
            return items;
        }
        Err(_) => return items,
    };
    if let Some(err) = clsact {
        let ok = err.is_empty();
        items.push(item(
            "clsact",
            if ok { CheckStatus::Ok } else { Degraded },
            "the clsact qdisc and cls_bpf (sch_ingress, cls_bpf)",
            "attaching the tc translators where TCX is missing",
            if ok {
                "a filter running vnat's tc program attaches to a clsact qdisc".to_string()
            } else {
                format!("cannot attach a tc filter ({err}): where TCX is missing too, vnatd cannot translate moved connections")
            },
        ));
    }
    items.push(item(
        Feature::IfaProto.name(),
        if ifa { CheckStatus::Ok } else { Degraded },
        Feature::IfaProto.needs(),
        "removing the addresses a crashed vnatd left on lo",
        if ifa {
            "ok"
        } else {
            "this kernel does not keep who added an address (IFA_PROTO): addresses a crashed vnatd left on lo are not removed at its next start (remove them with `ip addr del ADDR/32 dev lo`)"
        },
    ));
    items
}

/// clsact on this (scratch) namespace's `lo`: the qdisc, then a filter
/// with vnat's tc program, loaded anew here with its maps pinned in
/// `scratch`.
fn clsact_probe(scratch: &Path) -> Result<(), String> {
    if let Err(e) = qdisc_add_clsact("lo") {
        return Err(format!("adding a clsact qdisc: {e}"));
    }
    fs::create_dir_all(scratch).map_err(|e| format!("creating {}: {e}", scratch.display()))?;
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(scratch)
        .load(EBPF_OBJECT)
        .map_err(|e| format!("loading the eBPF object: {e}"))?;
    let p: &mut SchedClassifier =
        object::prog(&mut ebpf, PROG_TC_EGRESS).map_err(|e| e.to_string())?;
    p.load().map_err(|e| e.to_string())?;
    let opts = TcAttachOptions::Netlink(NlOptions {
        priority: clsact::PRIORITY,
        handle: aya::programs::tc::TcHandle::new(0, clsact::HANDLE as u16),
        classid: None,
    });
    p.attach_with_options("lo", TcAttachType::Egress, opts)
        .map_err(|e| format!("attaching a filter: {e}"))?;
    let seen = clsact::filters(1, true).map_err(|e| format!("listing the filters: {e}"))?;
    if !seen.iter().any(clsact::Filter::is_vnats) {
        return Err("the filter attached but the kernel does not list it".into());
    }
    Ok(())
}

/// Whether an address added with IFA_PROTO comes back with it.
fn ifa_proto_probe() -> bool {
    if features::simulated_missing(Feature::IfaProto) {
        return false;
    }
    let a = IpAddr::V4(Ipv4Addr::new(127, 255, 31, 1));
    if rtnl::add_address(a, 1, super::ROUTE_PROTO).is_err() {
        return false;
    }
    rtnl::addresses().is_ok_and(|all| {
        all.iter()
            .any(|x| x.addr == a && x.protocol == super::ROUTE_PROTO)
    })
}

/// The report as `vnatd --check` prints it: one line per requirement, like
/// `criu check`, and a last line with the verdict.
pub fn render(r: &CheckReport) -> String {
    let mut out = format!("vnat requirements on Linux {}\n", r.kernel);
    for i in &r.items {
        let status = match i.status {
            CheckStatus::Ok => "ok",
            CheckStatus::Missing => "MISSING",
            CheckStatus::Degraded => "degraded",
        };
        out.push_str(&format!("{status:<9} {:<34} {}\n", i.name, i.detail));
        if i.status != CheckStatus::Ok {
            out.push_str(&format!(
                "{:<9} {:<34} needs {}; used for {}\n",
                "", "", i.needs, i.affects
            ));
        }
    }
    if !r.simulated_missing.is_empty() {
        out.push_str(&format!(
            "note: {} taken as missing ({})\n",
            r.simulated_missing.join(", "),
            features::LACKS_ENV
        ));
    }
    let degraded: Vec<&str> = r
        .items
        .iter()
        .filter(|i| i.status == CheckStatus::Degraded)
        .map(|i| i.affects.as_str())
        .collect();
    out.push_str(&if !r.can_run {
        "vnatd cannot run on this machine: see the MISSING lines above\n".to_string()
    } else if degraded.is_empty() {
        "vnatd can run here with every capability\n".to_string()
    } else {
        format!("vnatd can run here; degraded: {}\n", degraded.join("; "))
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(statuses: &[CheckStatus]) -> CheckReport {
        let items: Vec<CheckItem> = statuses
            .iter()
            .enumerate()
            .map(|(n, s)| item(format!("f{n}"), *s, "Linux 9.9", "a capability", "detail"))
            .collect();
        CheckReport {
            kernel: "9.9.0".into(),
            can_run: items.iter().all(|i| i.status != CheckStatus::Missing),
            items,
            simulated_missing: vec![],
        }
    }

    #[test]
    fn the_last_line_says_whether_vnatd_can_run_and_what_is_degraded() {
        let all = render(&report(&[CheckStatus::Ok, CheckStatus::Ok]));
        assert!(
            all.ends_with("vnatd can run here with every capability\n"),
            "{all}"
        );
        let some = render(&report(&[CheckStatus::Ok, Degraded]));
        assert!(some.contains("degraded  f1"), "{some}");
        assert!(
            some.contains("needs Linux 9.9; used for a capability"),
            "{some}"
        );
        assert!(
            some.ends_with("vnatd can run here; degraded: a capability\n"),
            "{some}"
        );
        let none = render(&report(&[Missing, Degraded]));
        assert!(none.contains("MISSING   f0"), "{none}");
        assert!(
            none.ends_with("vnatd cannot run on this machine: see the MISSING lines above\n"),
            "{none}"
        );
    }
}
