//! Attaching programs to cgroups and interfaces, with every link pinned under
//! `<bpffs>/links/` so the attachment outlives the process that made it.
//!
//! Pin names: `cg<cgroup id>_<program>` and `tc<ifindex>_<egress|ingress>`.
//! A restarted vnatd replaces each pinned link with one running its own
//! program (new link first, then rename over the old pin), so nothing is ever
//! left unattached in between.

use std::{
    fs, io,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use aya::{
    programs::{
        links::{FdLink, PinnedLink},
        tc::{
            qdisc_add_clsact, NlOptions, SchedClassifierLink, TcAttachOptions, TcError, TcHandle,
        },
        CgroupAttachMode, CgroupSock, CgroupSockAddr, LinkOrder, SchedClassifier, SockOps,
        TcAttachType,
    },
    Ebpf,
};
use vnat_common::{
    PROG_SOCKOPS, PROG_TC_EGRESS, PROG_TC_EGRESS_L3, PROG_TC_INGRESS, PROG_TC_INGRESS_L3,
    PROG_UDP_RELEASE,
};

use super::{
    clsact, net,
    object::{self, links_dir, prog, SOCK_ADDR_PROGRAMS},
};
use crate::datapath::{DatapathError, TcMode};

const CGROUP2_SUPER_MAGIC: i64 = 0x63677270;

fn attach_err<E: std::error::Error + Send + Sync + 'static>(
    program: &'static str,
    target: &str,
) -> impl FnOnce(E) -> DatapathError {
    let target = target.to_string();
    move |e| DatapathError::Attach {
        program,
        target,
        source: Box::new(e),
    }
}

/// The cgroup v2 id of a directory (its kernfs inode number).
pub fn cgroup_id(path: &Path) -> Result<u64, DatapathError> {
    let not = || DatapathError::NotACgroup {
        path: path.to_path_buf(),
    };
    let st = nix::sys::statfs::statfs(path).map_err(|_| not())?;
    if st.filesystem_type().0 as i64 != CGROUP2_SUPER_MAGIC {
        return Err(not());
    }
    let md = fs::metadata(path).map_err(|_| not())?;
    if !md.is_dir() {
        return Err(not());
    }
    Ok(md.ino())
}

pub use crate::mounts::cgroup2_mount;

/// Add the ids of the cgroup directory `dir` and of every directory below
/// it (on cgroup v2 a cgroup's id is its directory's inode number, what
/// the recorders and sock_diag give) to `out`. Stays on `dir`'s filesystem.
pub fn cgroup_tree_ids(dir: &Path, out: &mut std::collections::HashSet<u64>) {
    fn walk(dir: &Path, dev: u64, out: &mut std::collections::HashSet<u64>, depth: usize) {
        let Ok(meta) = fs::symlink_metadata(dir) else {
            return;
        };
        if !meta.is_dir() || meta.dev() != dev || !out.insert(meta.ino()) || depth > 64 {
            return;
        }
        if let Ok(entries) = fs::read_dir(dir) {
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    walk(&e.path(), dev, out, depth + 1);
                }
            }
        }
    }
    if let Ok(meta) = fs::metadata(dir) {
        walk(dir, meta.dev(), out, 0);
    }
}

/// Find the directory of a cgroup id under the cgroup2 mount (for display).
pub fn cgroup_path(id: u64) -> Option<PathBuf> {
    fn walk(dir: &Path, id: u64, depth: u32) -> Option<PathBuf> {
        if fs::metadata(dir).ok()?.ino() == id {
            return Some(dir.to_path_buf());
        }
        if depth == 0 {
            return None;
        }
        for e in fs::read_dir(dir).ok()?.flatten() {
            if e.file_type().ok()?.is_dir() {
                if let Some(p) = walk(&e.path(), id, depth - 1) {
                    return Some(p);
                }
            }
        }
        None
    }
    walk(&cgroup2_mount()?, id, 8)
}

/// Pin `link` at `dst` atomically replacing whatever was pinned there.
fn pin_replace(link: FdLink, dst: &Path, program: &'static str) -> Result<(), DatapathError> {
    // bpffs refuses names with a dot ("reserved for future use", EPERM).
    let mut tmp = dst.as_os_str().to_owned();
    tmp.push("_new");
    let tmp = PathBuf::from(tmp);
    let _ = fs::remove_file(&tmp);
    let target = dst.display().to_string();
    link.pin(&tmp).map_err(attach_err(program, &target))?;
    fs::rename(&tmp, dst).map_err(|e| DatapathError::Kernel {
        what: format!("renaming pin {target}"),
        source: e,
    })
}

fn cg_pins(bpffs: &Path, id: u64) -> Vec<PathBuf> {
    let mut names = vec![PROG_SOCKOPS, PROG_UDP_RELEASE];
    names.extend(SOCK_ADDR_PROGRAMS);
    names
        .iter()
        .map(|n| links_dir(bpffs).join(format!("cg{id}_{n}")))
        .collect()
}

// Links to cgroups are made with BPF_LINK_CREATE, which always attaches in
// multi mode and rejects BPF_F_ALLOW_MULTI in its flags (EINVAL): hence
// `CgroupAttachMode::Single` (flags 0) below, which does not mean exclusive.

/// Attach the recorders to one cgroup (or re-attach with this process's
/// programs). All or nothing.
pub fn attach_cgroup(ebpf: &mut Ebpf, bpffs: &Path, path: &Path) -> Result<u64, DatapathError> {
    let id = cgroup_id(path)?;
    let target = path.display().to_string();
    let dir = fs::File::open(path).map_err(|_| DatapathError::NotACgroup {
        path: path.to_path_buf(),
    })?;
    let mut new_links: Vec<(FdLink, &'static str)> = Vec::new();
    {
        let p: &mut SockOps = prog(ebpf, PROG_SOCKOPS)?;
        let l = p
            .attach(&dir, CgroupAttachMode::Single)
            .map_err(attach_err(PROG_SOCKOPS, &target))?;
        let l = p.take_link(l).map_err(attach_err(PROG_SOCKOPS, &target))?;
        new_links.push((
            FdLink::try_from(l).map_err(attach_err(PROG_SOCKOPS, &target))?,
            PROG_SOCKOPS,
        ));
    }
    for name in SOCK_ADDR_PROGRAMS {
        let p: &mut CgroupSockAddr = prog(ebpf, name)?;
        if p.fd().is_err() {
            // Not loaded: a hide location program this kernel refused.
            continue;
        }
        let l = p
            .attach(&dir, CgroupAttachMode::Single)
            .map_err(attach_err(name, &target))?;
        let l = p.take_link(l).map_err(attach_err(name, &target))?;
        new_links.push((
            FdLink::try_from(l).map_err(attach_err(name, &target))?,
            name,
        ));
    }
    {
        let p: &mut CgroupSock = prog(ebpf, PROG_UDP_RELEASE)?;
        let l = p
            .attach(&dir, CgroupAttachMode::Single)
            .map_err(attach_err(PROG_UDP_RELEASE, &target))?;
        let l = p
            .take_link(l)
            .map_err(attach_err(PROG_UDP_RELEASE, &target))?;
        new_links.push((
            FdLink::try_from(l).map_err(attach_err(PROG_UDP_RELEASE, &target))?,
            PROG_UDP_RELEASE,
        ));
    }
    // Every link exists (dropping them here would detach them all); only now
    // publish them as pins.
    for (link, name) in new_links {
        pin_replace(link, &links_dir(bpffs).join(format!("cg{id}_{name}")), name)?;
    }
    Ok(id)
}

/// Detach the recorders from a cgroup by removing its pins.
pub fn detach_cgroup(bpffs: &Path, id: u64) -> Result<(), DatapathError> {
    let mut found = false;
    for pin in cg_pins(bpffs, id) {
        if fs::remove_file(&pin).is_ok() {
            found = true;
        }
    }
    if !found {
        return Err(DatapathError::CgroupNotEnabled {
            path: cgroup_path(id).unwrap_or_else(|| PathBuf::from(format!("id {id}"))),
        });
    }
    Ok(())
}

/// Cgroup ids with pinned recorder links.
pub fn pinned_cgroups(bpffs: &Path) -> Vec<u64> {
    let mut ids: Vec<u64> = pinned_names(bpffs)
        .iter()
        .filter_map(|n| n.strip_prefix("cg")?.split_once('_')?.0.parse().ok())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn pinned_names(bpffs: &Path) -> Vec<String> {
    fs::read_dir(links_dir(bpffs))
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn tc_pin(bpffs: &Path, ifindex: u32, egress: bool) -> PathBuf {
    links_dir(bpffs).join(format!(
        "tc{ifindex}_{}",
        if egress { "egress" } else { "ingress" }
    ))
}

/// The pin that marks a clsact qdisc vnat added itself (see `clsact.rs`).
pub(super) fn qdisc_pin(bpffs: &Path, ifindex: u32) -> PathBuf {
    links_dir(bpffs).join(format!("clsact{ifindex}"))
}

/// Interfaces with pinned TCX links.
fn pinned_tcx(bpffs: &Path) -> Vec<u32> {
    let mut ids: Vec<u32> = pinned_names(bpffs)
        .iter()
        .filter_map(|n| n.strip_prefix("tc")?.split_once('_')?.0.parse().ok())
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Interfaces with the translators attached, and how: TCX links from their
/// pins, clsact filters from the kernel (a filter cannot be pinned).
pub fn tc_attachments(bpffs: &Path) -> Vec<(u32, TcMode)> {
    let mut out: Vec<(u32, TcMode)> = pinned_tcx(bpffs)
        .into_iter()
        .map(|i| (i, TcMode::Tcx))
        .collect();
    match clsact::attached() {
        Ok(ids) => {
            for i in ids {
                if !out.iter().any(|(t, _)| *t == i) {
                    out.push((i, TcMode::Clsact));
                }
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot list the clsact filters"),
    }
    out.sort_unstable_by_key(|(i, _)| *i);
    out
}

/// Interfaces with the translators attached, either way.
pub fn pinned_tc(bpffs: &Path) -> Vec<u32> {
    tc_attachments(bpffs).into_iter().map(|(i, _)| i).collect()
}

/// Attach both tc translators to an interface (TCX or clsact, as `mode`
/// says), or, when an earlier process attached them, swap this process's
/// programs into that attachment atomically (a TCX link stays TCX, a
/// clsact filter stays clsact, whatever `mode` says now).
pub fn attach_tc(
    ebpf: &mut Ebpf,
    bpffs: &Path,
    ifindex: u32,
    mode: TcMode,
) -> Result<(), DatapathError> {
    let ifname = net::ifname(ifindex)?;
    let programs = match net::link_layer(ifindex)? {
        net::LinkLayer::Ethernet => [(PROG_TC_INGRESS, false), (PROG_TC_EGRESS, true)],
        net::LinkLayer::None => [(PROG_TC_INGRESS_L3, false), (PROG_TC_EGRESS_L3, true)],
    };
    for (name, _) in programs {
        object::load_tc_on_demand(ebpf, name)?;
    }
    let has_tcx = programs
        .iter()
        .any(|(_, egress)| tc_pin(bpffs, ifindex, *egress).exists());
    // vnat's clsact filters left by a vnatd with tc_attach = "clsact": a
    // TCX link beside them would run the translators twice.
    let has_clsact = !has_tcx
        && mode == TcMode::Tcx
        && [false, true].iter().any(|&egress| {
            clsact::filters(ifindex, egress).is_ok_and(|fs| fs.iter().any(clsact::Filter::is_vnats))
        });
    if (mode == TcMode::Clsact && !has_tcx) || has_clsact {
        return attach_clsact(ebpf, bpffs, ifindex, &ifname, programs);
    }
    let mut made: Vec<PathBuf> = Vec::new();
    for (name, egress) in programs {
        let pin = tc_pin(bpffs, ifindex, egress);
        let r = attach_one_tcx(ebpf, name, egress, &ifname, &pin);
        match r {
            Ok(fresh) => {
                if fresh {
                    made.push(pin);
                }
            }
            Err(e) => {
                // All or nothing: undo a half attachment.
                for p in made {
                    let _ = fs::remove_file(p);
                }
                return Err(e);
            }
        }
    }
    Ok(())
}

fn attach_one_tcx(
    ebpf: &mut Ebpf,
    name: &'static str,
    egress: bool,
    ifname: &str,
    pin: &Path,
) -> Result<bool, DatapathError> {
    let p: &mut SchedClassifier = prog(ebpf, name)?;
    let (id, fresh) = match PinnedLink::from_pin(pin) {
        Ok(old) => {
            let link = SchedClassifierLink::try_from(FdLink::from(old))
                .map_err(attach_err(name, ifname))?;
            (
                p.attach_to_link(link).map_err(attach_err(name, ifname))?,
                false,
            )
        }
        Err(_) => {
            let kind = if egress {
                TcAttachType::Egress
            } else {
                TcAttachType::Ingress
            };
            // First on the hook, and passing on what it does not
            // translate (TCX_NEXT), so programs after it still run.
            let opts = TcAttachOptions::TcxOrder(LinkOrder::first());
            (
                p.attach_with_options(ifname, kind, opts)
                    .map_err(attach_err(name, ifname))?,
                true,
            )
        }
    };
    let link = p.take_link(id).map_err(attach_err(name, ifname))?;
    let link = FdLink::try_from(link).map_err(attach_err(name, ifname))?;
    pin_replace(link, pin, name)?;
    Ok(fresh)
}

/// The clsact way (see `clsact.rs`): add the qdisc if the interface has
/// none (marking it as vnat's), then put each program in vnat's filter,
/// replacing the program of a filter an earlier vnatd left there.
fn attach_clsact(
    ebpf: &mut Ebpf,
    bpffs: &Path,
    ifindex: u32,
    ifname: &str,
    programs: [(&'static str, bool); 2],
) -> Result<(), DatapathError> {
    let kernel = |what: String| move |source: io::Error| DatapathError::Kernel { what, source };
    match qdisc_add_clsact(ifname) {
        Ok(()) => {
            // Ours: marked so that it goes when vnat's filters do. The mark
            // is a pin of the program (bpffs holds nothing else).
            let p: &mut SchedClassifier = prog(ebpf, programs[1].0)?;
            let marker = qdisc_pin(bpffs, ifindex);
            let _ = fs::remove_file(&marker);
            p.pin(&marker).map_err(|e| DatapathError::Attach {
                program: programs[1].0,
                target: marker.display().to_string(),
                source: Box::new(e),
            })?;
        }
        // EEXIST: the interface has a clsact already (vnat's or another's).
        Err(TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
        Err(e) => {
            return Err(DatapathError::Attach {
                program: programs[0].0,
                target: format!("{ifname} (adding a clsact qdisc)"),
                source: Box::new(e),
            })
        }
    }
    for (name, egress) in programs {
        let existing = clsact::filters(ifindex, egress)
            .map_err(kernel(format!("listing the tc filters of {ifname}")))?;
        let slot = existing
            .iter()
            .find(|f| f.priority == clsact::PRIORITY && f.handle == clsact::HANDLE);
        if let Some(f) = slot {
            if !f.is_vnats() {
                return Err(DatapathError::Kernel {
                    what: format!(
                        "attaching {name} to {ifname}: another program ({}) has vnat's tc filter priority {} and handle {:#x} there",
                        f.program.as_deref().unwrap_or("not BPF"),
                        clsact::PRIORITY,
                        clsact::HANDLE
                    ),
                    source: io::Error::from_raw_os_error(libc::EEXIST),
                });
            }
        }
        let kind = if egress {
            TcAttachType::Egress
        } else {
            TcAttachType::Ingress
        };
        let p: &mut SchedClassifier = prog(ebpf, name)?;
        let id = if slot.is_some() {
            let link = SchedClassifierLink::attached(
                ifname,
                kind,
                clsact::PRIORITY,
                TcHandle::new((clsact::HANDLE >> 16) as u16, clsact::HANDLE as u16),
                None,
            )
            .map_err(attach_err(name, ifname))?;
            p.attach_to_link(link).map_err(attach_err(name, ifname))?
        } else {
            let opts = TcAttachOptions::Netlink(NlOptions {
                priority: clsact::PRIORITY,
                handle: TcHandle::new((clsact::HANDLE >> 16) as u16, clsact::HANDLE as u16),
                classid: None,
            });
            p.attach_with_options(ifname, kind, opts)
                .map_err(attach_err(name, ifname))?
        };
        // The filter stays when the link is dropped: taking it out of the
        // program keeps aya from detaching it when the program goes.
        let link = p.take_link(id).map_err(attach_err(name, ifname))?;
        std::mem::forget(link);
    }
    Ok(())
}

/// Remove both tc translators from an interface: its TCX pins, vnat's
/// clsact filters, and the clsact qdisc if vnat added it and nothing else
/// is on it.
pub fn detach_tc(bpffs: &Path, ifindex: u32) {
    for egress in [true, false] {
        let _ = fs::remove_file(tc_pin(bpffs, ifindex, egress));
    }
    let marker = qdisc_pin(bpffs, ifindex);
    match clsact::remove_ours(ifindex) {
        Ok(others) => {
            if marker.exists() && !others {
                if let Err(e) = clsact::del_qdisc(ifindex) {
                    tracing::warn!(ifindex, error = %e, "cannot remove the clsact qdisc vnat added");
                    return;
                }
            }
            let _ = fs::remove_file(&marker);
        }
        Err(e) => tracing::warn!(ifindex, error = %e, "cannot remove vnat's clsact filters"),
    }
}
