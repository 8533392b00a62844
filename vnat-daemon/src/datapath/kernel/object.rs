//! Loading the eBPF object with its maps pinned under the bpffs directory.

use std::{
    fs,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, HashMap, MapData, PerCpuArray},
    programs::{CgroupSock, CgroupSockAddr, SchedClassifier, SockOps},
    Ebpf, EbpfLoader,
};
use vnat_common::{
    ConnRecord, DatapathConfig, FlowKey, GuestKey, HideKey, HideValue, NatRewrite, RebindKey,
    RebindValue, UdpPending, UnvalidatedBudget, ABI_VERSION, CFG_F_HIDE, CFG_F_NAT_EMPTY,
    CFG_F_NETNS_FILTER, MAP_CONFIG, MAP_CONNS, MAP_EGRESS_NAT, MAP_GUESTS, MAP_HIDE_ADDRS,
    MAP_HIDE_CGROUPS, MAP_HIDE_FLOWS, MAP_INGRESS_NAT, MAP_REBIND, MAP_STATS, MAP_UDP_COUNT,
    MAP_UDP_PENDING, MAP_UDP_PER_SOCK, PROG_HIDE_BIND4, PROG_HIDE_BIND6, PROG_HIDE_GETPEERNAME4,
    PROG_HIDE_GETPEERNAME6, PROG_HIDE_GETSOCKNAME4, PROG_HIDE_GETSOCKNAME6, PROG_PEEK,
    PROG_SOCKOPS, PROG_TC_EGRESS, PROG_TC_EGRESS_L3, PROG_TC_INGRESS, PROG_TC_INGRESS_L3,
    PROG_UDP_CONNECT4, PROG_UDP_CONNECT6, PROG_UDP_RECVMSG4, PROG_UDP_RECVMSG6, PROG_UDP_RELEASE,
    PROG_UDP_SENDMSG4, PROG_UDP_SENDMSG6,
};

use crate::datapath::DatapathError;

/// The eBPF object built by build.rs (empty when built with AYA_BUILD_SKIP).
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vnat"));

/// The cgroup sock_addr programs, in attach order.
pub const SOCK_ADDR_PROGRAMS: [&str; 12] = [
    PROG_UDP_CONNECT4,
    PROG_UDP_CONNECT6,
    PROG_UDP_SENDMSG4,
    PROG_UDP_SENDMSG6,
    PROG_UDP_RECVMSG4,
    PROG_UDP_RECVMSG6,
    PROG_HIDE_GETPEERNAME4,
    PROG_HIDE_GETPEERNAME6,
    PROG_HIDE_GETSOCKNAME4,
    PROG_HIDE_GETSOCKNAME6,
    PROG_HIDE_BIND4,
    PROG_HIDE_BIND6,
];

/// The programs only hide location uses: a kernel that refuses them runs
/// vnat without hide location.
pub const HIDE_PROGRAMS: [&str; 6] = [
    PROG_HIDE_GETPEERNAME4,
    PROG_HIDE_GETPEERNAME6,
    PROG_HIDE_GETSOCKNAME4,
    PROG_HIDE_GETSOCKNAME6,
    PROG_HIDE_BIND4,
    PROG_HIDE_BIND6,
];

/// The tc translators of interfaces with Ethernet headers, in load order:
/// loaded at open.
pub const TC_LOADED: [&str; 2] = [PROG_TC_EGRESS, PROG_TC_INGRESS];

/// The tc translators of interfaces without a link-layer header (WireGuard,
/// tun, PPP, some cellular modems): loaded at open only when the namespace
/// has such an interface, else when one is first attached
/// ([`load_tc_on_demand`]). After the Ethernet pair they are the costliest
/// programs to verify (about 40% of what opening costs the kernel: 0.4 s
/// on Linux 6.18 here, 5 s in an emulated VM on 6.1), and many hosts and
/// every container namespace have no such interface. `vnatd --check`
/// loads them.
pub const TC_L3: [&str; 2] = [PROG_TC_EGRESS_L3, PROG_TC_INGRESS_L3];

/// Typed handles on the pinned maps.
pub struct Maps {
    pub conns: HashMap<MapData, FlowKey, ConnRecord>,
    pub guests: HashMap<MapData, GuestKey, ConnRecord>,
    pub egress: HashMap<MapData, FlowKey, NatRewrite>,
    pub ingress: HashMap<MapData, FlowKey, NatRewrite>,
    pub stats: PerCpuArray<MapData, u64>,
    pub config: Array<MapData, DatapathConfig>,
    pub udp_pending: HashMap<MapData, u64, UdpPending>,
    /// UDP records in `conns` (one slot) and per socket cookie: vnatd
    /// recounts both at each housekeeping pass.
    pub udp_count: Array<MapData, u64>,
    pub udp_per_sock: HashMap<MapData, u64, u32>,
    pub rebind: HashMap<MapData, RebindKey, RebindValue>,
    /// What flows sending to an unvalidated peer address may still send
    /// there (`vnat_common::NAT_F_BUDGET`).
    pub unvalidated: HashMap<MapData, FlowKey, UnvalidatedBudget>,
    /// NAT guards (`vnat_common::natguard`, `natguard.rs`).
    pub guard: HashMap<MapData, RebindKey, vnat_common::GuardValue>,
    /// Addresses this host has only on `lo` now, to the device their
    /// untranslated packets are redirected to: none
    /// (`vnat_common::MAP_GONE`, `gone.rs`).
    pub gone: HashMap<MapData, FlowKey, u32>,
    /// Hide location: the hiding cgroups, the addresses, the translated
    /// flows connect() and sendmsg() leave alone (`hide.rs`).
    pub hide_cgroups: HashMap<MapData, u64, u32>,
    pub hide_addrs: HashMap<MapData, HideKey, HideValue>,
    pub hide_flows: HashMap<MapData, FlowKey, u32>,
    /// The endpoints moved peers held, and those the programs showed (an
    /// LRU map), to where they are now (`vnat_common`'s `hidereach`).
    pub hide_reach: HashMap<MapData, vnat_common::HideReachKey, vnat_common::HideReachValue>,
    pub hide_seen: HashMap<MapData, vnat_common::HideReachKey, vnat_common::HideReachValue>,
    /// What each owner holds of the recorders' maps, and the budgets
    /// (`budgets.rs`).
    pub owners: HashMap<MapData, u32, vnat_common::OwnerCounts>,
    pub budgets: Array<MapData, vnat_common::Budgets>,
    /// Owners of TCP sockets still connecting (counted into `owners`).
    pub connecting: HashMap<MapData, u64, vnat_common::Owner>,
}

pub struct Loaded {
    /// The owner's lock on the pin directory; None for an observer
    /// (`KernelDatapath::observe`), which writes nothing.
    pub _lock: Option<super::pinlock::PinLock>,
    pub ebpf: Ebpf,
    pub maps: Maps,
    pub netns_cookie: u64,
    /// Whether some cgroup hides location (`CFG_F_HIDE`), as last written.
    pub hide: bool,
    /// Whether some address is gone (`CFG_F_GONE`), as last written.
    pub gone: bool,
    /// Why hide location is off on this kernel (its programs were refused
    /// or `VNAT_KERNEL_LACKS` says so); None when it is available.
    pub hide_unavailable: Option<String>,
    /// Whether `vnat_peek` loaded (adoption's sequence-number reader).
    pub peek: bool,
}

fn map_err(map: &'static str) -> impl FnOnce(aya::maps::MapError) -> DatapathError {
    move |e| DatapathError::Map {
        map,
        source: Box::new(e),
    }
}

fn load_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> DatapathError {
    DatapathError::Load {
        source: Box::new(e),
    }
}

/// A program's load error as one sentence: the verifier's verdict (the last
/// line of its log that is not a statistic) and the kernel's release, with
/// the whole log at debug level for whoever reports it.
fn refused(program: &'static str) -> impl FnOnce(aya::programs::ProgramError) -> DatapathError {
    move |e| match e {
        aya::programs::ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            tracing::debug!(program, %io_error, "the verifier's log:\n{log}");
            DatapathError::ProgramRefused {
                program,
                kernel: kernel_release(),
                verdict: verifier_verdict(&log)
                    .map(str::to_string)
                    .unwrap_or_else(|| io_error.to_string()),
            }
        }
        other => load_err(other),
    }
}

/// The line of a verifier log that says why it refused the program: the
/// last one that is not one of the statistics it ends with.
pub fn verifier_verdict(log: &str) -> Option<&str> {
    const STATS: [&str; 4] = [
        "verification time",
        "stack depth",
        "processed ",
        "Live regs",
    ];
    log.lines()
        .map(str::trim)
        .rev()
        .find(|l| !l.is_empty() && !STATS.iter().any(|s| l.starts_with(s)))
}

/// This kernel's release (`uname -r`), for messages.
pub fn kernel_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "of unknown release".to_string())
}

/// Make sure `dir` is a directory on bpffs (creating it if needed).
pub fn prepare_bpffs(dir: &Path) -> Result<(), DatapathError> {
    const BPF_FS_MAGIC: i64 = 0xcafe4a11;
    let bad = |reason: String| DatapathError::Bpffs {
        path: dir.to_path_buf(),
        reason,
    };
    fs::create_dir_all(dir).map_err(|e| bad(format!("cannot create it: {e}")))?;
    let st = nix::sys::statfs::statfs(dir).map_err(|e| bad(format!("statfs failed: {e}")))?;
    if st.filesystem_type().0 as i64 != BPF_FS_MAGIC {
        return Err(bad("it is not on a bpf filesystem".into()));
    }
    fs::create_dir_all(dir.join("links")).map_err(|e| bad(format!("cannot create links/: {e}")))?;
    Ok(())
}

/// The network namespace cookie of the calling thread's namespace.
pub fn own_netns_cookie() -> Result<u64, DatapathError> {
    let kernel = |what: &str, e: std::io::Error| DatapathError::Kernel {
        what: what.into(),
        source: e,
    };
    let sock = std::net::UdpSocket::bind("127.0.0.1:0")
        .or_else(|_| std::net::UdpSocket::bind("[::1]:0"))
        .map_err(|e| kernel("opening a socket to read the netns cookie", e))?;
    let unsupported = || DatapathError::Unsupported {
        what: "vnat".into(),
        needs: format!(
            "{} to tell this namespace's connections from other namespaces'",
            super::features::Feature::NetnsCookie.needs()
        ),
        kernel: kernel_release(),
        instead:
            "run vnat on Linux 5.15 or newer (Debian 12, Ubuntu 22.04, RHEL 9 and later have it)"
                .into(),
    };
    if super::features::simulated_missing(super::features::Feature::NetnsCookie) {
        return Err(unsupported());
    }
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SO_NETNS_COOKIE (71) since Linux 5.14.
    // SAFETY: `sock` is open for the call; `cookie` is a live u64 and `len`
    // says so, and the kernel writes at most `len` bytes (exactly 8 for this
    // option).
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            71,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOPROTOOPT) {
            return Err(unsupported());
        }
        return Err(kernel("getsockopt(SO_NETNS_COOKIE)", e));
    }
    Ok(cookie)
}

/// Load (or re-attach to) the datapath: maps come from the pins in `bpffs`
/// when they exist, so translations installed by an earlier process stay.
///
/// `own`: take the pin directory's lock (refused while another process
/// holds it) and write the config; otherwise only look: no lock, no write.
/// `tc`: whether the Ethernet tc translators are loaded now or at their
/// first use ([`load_tc_on_demand`]).
pub fn load(bpffs: &Path, own: bool, tc: super::TcLoad) -> Result<Loaded, DatapathError> {
    load_with(bpffs, own, Some(tc))
}

/// As [`load`] with `own` false, but without loading any program: the
/// pinned maps alone, to read. The verifier is what opening costs (about
/// half a second here, ten seconds in an emulated VM), and reading a map
/// needs none of it. Hide location is taken as available and `vnat_peek`
/// as absent; anything that attaches a program fails.
pub fn load_maps(bpffs: &Path) -> Result<Loaded, DatapathError> {
    load_with(bpffs, false, None)
}

/// `programs`: None loads no program; otherwise when the Ethernet tc
/// translators are.
fn load_with(
    bpffs: &Path,
    own: bool,
    programs: Option<super::TcLoad>,
) -> Result<Loaded, DatapathError> {
    if EBPF_OBJECT.is_empty() {
        return Err(DatapathError::NoEbpfObject);
    }
    prepare_bpffs(bpffs)?;
    let lock = if own {
        Some(super::pinlock::PinLock::take(bpffs)?)
    } else {
        None
    };
    let mut loader = EbpfLoader::new();
    loader.default_map_pin_directory(bpffs);
    super::sizes::apply(&mut loader)?;
    let mut ebpf = loader.load(EBPF_OBJECT).map_err(load_err)?;

    let (hide_unavailable, peek) = match programs {
        Some(tc) => load_programs(&mut ebpf, tc)?,
        None => (None, false),
    };

    let take = |ebpf: &mut Ebpf, name: &'static str| {
        ebpf.take_map(name).ok_or_else(|| DatapathError::Load {
            source: format!("map {name} missing from the eBPF object").into(),
        })
    };
    let conns = take(&mut ebpf, MAP_CONNS)?;
    let guests = take(&mut ebpf, MAP_GUESTS)?;
    let sizes = super::budgets::sizes(&conns, &guests);
    let maps = Maps {
        conns: HashMap::try_from(conns).map_err(map_err(MAP_CONNS))?,
        guests: HashMap::try_from(guests).map_err(map_err(MAP_GUESTS))?,
        egress: HashMap::try_from(take(&mut ebpf, MAP_EGRESS_NAT)?)
            .map_err(map_err(MAP_EGRESS_NAT))?,
        ingress: HashMap::try_from(take(&mut ebpf, MAP_INGRESS_NAT)?)
            .map_err(map_err(MAP_INGRESS_NAT))?,
        stats: PerCpuArray::try_from(take(&mut ebpf, MAP_STATS)?).map_err(map_err(MAP_STATS))?,
        config: Array::try_from(take(&mut ebpf, MAP_CONFIG)?).map_err(map_err(MAP_CONFIG))?,
        udp_pending: HashMap::try_from(take(&mut ebpf, MAP_UDP_PENDING)?)
            .map_err(map_err(MAP_UDP_PENDING))?,
        rebind: HashMap::try_from(take(&mut ebpf, MAP_REBIND)?).map_err(map_err(MAP_REBIND))?,
        unvalidated: HashMap::try_from(take(&mut ebpf, vnat_common::MAP_UNVALIDATED)?)
            .map_err(map_err(vnat_common::MAP_UNVALIDATED))?,
        guard: HashMap::try_from(take(&mut ebpf, vnat_common::MAP_GUARD)?)
            .map_err(map_err(vnat_common::MAP_GUARD))?,
        gone: HashMap::try_from(take(&mut ebpf, vnat_common::MAP_GONE)?)
            .map_err(map_err(vnat_common::MAP_GONE))?,
        udp_count: Array::try_from(take(&mut ebpf, MAP_UDP_COUNT)?)
            .map_err(map_err(MAP_UDP_COUNT))?,
        udp_per_sock: HashMap::try_from(take(&mut ebpf, MAP_UDP_PER_SOCK)?)
            .map_err(map_err(MAP_UDP_PER_SOCK))?,
        hide_cgroups: HashMap::try_from(take(&mut ebpf, MAP_HIDE_CGROUPS)?)
            .map_err(map_err(MAP_HIDE_CGROUPS))?,
        hide_addrs: HashMap::try_from(take(&mut ebpf, MAP_HIDE_ADDRS)?)
            .map_err(map_err(MAP_HIDE_ADDRS))?,
        hide_flows: HashMap::try_from(take(&mut ebpf, MAP_HIDE_FLOWS)?)
            .map_err(map_err(MAP_HIDE_FLOWS))?,
        hide_reach: HashMap::try_from(take(&mut ebpf, vnat_common::MAP_HIDE_REACH)?)
            .map_err(map_err(vnat_common::MAP_HIDE_REACH))?,
        hide_seen: HashMap::try_from(take(&mut ebpf, vnat_common::MAP_HIDE_SEEN)?)
            .map_err(map_err(vnat_common::MAP_HIDE_SEEN))?,
        owners: HashMap::try_from(take(&mut ebpf, vnat_common::MAP_OWNERS)?)
            .map_err(map_err(vnat_common::MAP_OWNERS))?,
        budgets: Array::try_from(take(&mut ebpf, vnat_common::MAP_BUDGETS)?)
            .map_err(map_err(vnat_common::MAP_BUDGETS))?,
        connecting: HashMap::try_from(take(&mut ebpf, vnat_common::MAP_CONNECTING)?)
            .map_err(map_err(vnat_common::MAP_CONNECTING))?,
    };
    let hide = maps.hide_cgroups.keys().next().is_some();
    // Entries a vnatd before this one left stand until the first
    // `sync_gone`, which checks each against the interfaces.
    let gone = maps.gone.keys().next().is_some();
    let mut loaded = Loaded {
        _lock: lock,
        ebpf,
        maps,
        netns_cookie: own_netns_cookie()?,
        hide,
        gone,
        hide_unavailable,
        peek,
    };
    if !own {
        check_abi(bpffs, &loaded)?;
        return Ok(loaded);
    }
    check_and_set_config(bpffs, &mut loaded)?;
    super::budgets::set(&mut loaded.maps, sizes)?;
    Ok(loaded)
}

/// Load the object's programs (the verifier's work), the tc translators
/// now or later as `tc` says: what [`Loaded::hide_unavailable`] and
/// [`Loaded::peek`] say.
fn load_programs(
    ebpf: &mut Ebpf,
    tc: super::TcLoad,
) -> Result<(Option<String>, bool), DatapathError> {
    {
        let p: &mut SockOps = prog(ebpf, PROG_SOCKOPS)?;
        p.load().map_err(refused(PROG_SOCKOPS))?;
    }
    let mut hide_unavailable = None;
    if super::features::simulated_missing(super::features::Feature::SockAddrNameHooks) {
        hide_unavailable = Some(format!(
            "{} names sock-addr-name-hooks",
            super::features::LACKS_ENV
        ));
    }
    for name in SOCK_ADDR_PROGRAMS {
        let hide = HIDE_PROGRAMS.contains(&name);
        if hide && hide_unavailable.is_some() {
            continue;
        }
        let p: &mut CgroupSockAddr = prog(ebpf, name)?;
        match p.load().map_err(refused(name)) {
            Ok(()) => {}
            // Only hide location needs these: vnat runs without it.
            Err(DatapathError::ProgramRefused { verdict, .. }) if hide => {
                hide_unavailable = Some(format!("the kernel refused {name}: {verdict}"));
            }
            Err(e) => return Err(e),
        }
    }
    if let Some(why) = &hide_unavailable {
        tracing::warn!(
            "hide location is off: it needs {} ({why})",
            super::features::Feature::SockAddrNameHooks.needs()
        );
    }
    {
        let p: &mut CgroupSock = prog(ebpf, PROG_UDP_RELEASE)?;
        p.load().map_err(refused(PROG_UDP_RELEASE))?;
    }
    if tc == super::TcLoad::AtOpen {
        for name in TC_LOADED {
            let p: &mut SchedClassifier = prog(ebpf, name)?;
            p.load().map_err(refused(name))?;
        }
    }
    // Now if an interface may need them (a move onto it must not wait for
    // the verifier), else at their first attachment.
    if tc == super::TcLoad::AtOpen && super::net::has_l3_interface() {
        for name in TC_L3 {
            let p: &mut SchedClassifier = prog(ebpf, name)?;
            p.load().map_err(refused(name))?;
        }
    }
    // Adoption reads sequence numbers with it where the kernel takes it,
    // else by probing the socket (restart/peek.rs): never fatal.
    let peek = {
        let p: &mut SchedClassifier = prog(ebpf, PROG_PEEK)?;
        match p.load() {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "the kernel refused {PROG_PEEK}: adoption reads sequence numbers by probing each socket instead, which a busy connection can delay");
                false
            }
        }
    };
    Ok((hide_unavailable, peek))
}

fn check_and_set_config(bpffs: &Path, l: &mut Loaded) -> Result<(), DatapathError> {
    check_abi(bpffs, l)?;
    // Not CFG_F_NAT_EMPTY yet: the NAT maps may hold pinned translations,
    // and until the caller has read them the programs must look them up.
    // Both gates open until the opener knows better (see KernelDatapath::open).
    set_config(l, false, true, 0)
}

/// Refuse pins made by another vnat (ABI) or in another namespace.
fn check_abi(bpffs: &Path, l: &Loaded) -> Result<(), DatapathError> {
    let existing = l.maps.config.get(&0, 0).map_err(map_err(MAP_CONFIG))?;
    if existing.abi_version != 0 && existing.abi_version != ABI_VERSION {
        return Err(DatapathError::AbiMismatch {
            path: bpffs.to_path_buf(),
            found: existing.abi_version,
            expected: ABI_VERSION,
        });
    }
    if existing.abi_version != 0 && existing.netns_cookie != l.netns_cookie {
        return Err(DatapathError::Bpffs {
            path: bpffs.to_path_buf(),
            reason: "its pins belong to a vnatd of another network namespace; give each namespace its own --bpffs".into(),
        });
    }
    Ok(())
}

/// The config map's flags as last written: (NAT maps empty, some flow
/// rebinding, the VCMP port BINDs are diverted to or 0).
pub fn read_config(l: &Loaded) -> Result<(bool, bool, u16), DatapathError> {
    let c = l.maps.config.get(&0, 0).map_err(map_err(MAP_CONFIG))?;
    let divert = if c.flags & vnat_common::CFG_F_BIND_DIVERT != 0 {
        u16::from_be(c.vcmp_port_be)
    } else {
        0
    };
    Ok((
        c.flags & CFG_F_NAT_EMPTY != 0,
        c.flags & vnat_common::CFG_F_REBINDING != 0,
        divert,
    ))
}

/// Write this namespace's config: whether both NAT maps are empty
/// (`CFG_F_NAT_EMPTY`: the tc translators then pass packets unparsed),
/// whether some flow is rebinding, and the VCMP port in-band BINDs are
/// diverted to (0: none are); whether some cgroup hides location comes
/// from `l.hide`.
pub fn set_config(
    l: &mut Loaded,
    nat_empty: bool,
    rebinding: bool,
    bind_divert_port: u16,
) -> Result<(), DatapathError> {
    let flag = |on: bool, f: u32| if on { f } else { 0 };
    let cfg = DatapathConfig {
        netns_cookie: l.netns_cookie,
        flags: CFG_F_NETNS_FILTER
            | flag(nat_empty, CFG_F_NAT_EMPTY)
            | flag(rebinding, vnat_common::CFG_F_REBINDING)
            | flag(bind_divert_port != 0, vnat_common::CFG_F_BIND_DIVERT)
            | flag(l.hide, CFG_F_HIDE)
            | flag(l.gone, vnat_common::CFG_F_GONE),
        abi_version: ABI_VERSION,
        vcmp_port_be: bind_divert_port.to_be(),
        _pad: [0; 3],
    };
    l.maps.config.set(0, cfg, 0).map_err(map_err(MAP_CONFIG))
}

/// Turn the config's `flag` on or off and leave every other field as the
/// map holds it: a bit of this process's own, written without rewriting
/// the others from what this process last knew of them (a test's
/// datapath, or `vnatctl` in a tool's hands, may have written since).
pub fn set_config_flag(l: &mut Loaded, flag: u32, on: bool) -> Result<(), DatapathError> {
    let mut c = l.maps.config.get(&0, 0).map_err(map_err(MAP_CONFIG))?;
    c.flags = if on { c.flags | flag } else { c.flags & !flag };
    l.maps.config.set(0, c, 0).map_err(map_err(MAP_CONFIG))
}

/// Load tc translator `name` if this process has not yet (the ones of
/// [`TC_L3`], at their first attachment); a refusal says why, as at open.
pub fn load_tc_on_demand(ebpf: &mut Ebpf, name: &'static str) -> Result<(), DatapathError> {
    let p: &mut SchedClassifier = prog(ebpf, name)?;
    if p.fd().is_ok() {
        return Ok(());
    }
    let started = std::time::Instant::now();
    p.load().map_err(refused(name))?;
    tracing::debug!(
        program = name,
        took_ms = started.elapsed().as_millis() as u64,
        "loaded a tc translator on first use"
    );
    Ok(())
}

pub fn prog<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T, DatapathError>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program, Error = aya::programs::ProgramError>,
{
    let p = ebpf.program_mut(name).ok_or_else(|| DatapathError::Load {
        source: format!("program {name} missing from the eBPF object").into(),
    })?;
    p.try_into().map_err(load_err)
}

/// Where the link pins live.
pub fn links_dir(bpffs: &Path) -> PathBuf {
    bpffs.join("links")
}

#[cfg(test)]
#[path = "object_btf_tests.rs"]
mod btf_tests;

#[cfg(test)]
mod tests {
    use super::verifier_verdict;

    #[test]
    fn the_verdict_is_the_last_line_before_the_statistics() {
        let log = "0: R1=ctx() R10=fp0\n181: (85) call bpf_get_current_cgroup_id#80\n\
            unknown func bpf_get_current_cgroup_id#80\n\
            verification time 52666 usec\nstack depth 112+312+0\n\
            processed 2246 insns (limit 1000000) max_states_per_insn 4\n";
        assert_eq!(
            verifier_verdict(log),
            Some("unknown func bpf_get_current_cgroup_id#80")
        );
        assert_eq!(verifier_verdict("verification time 1 usec\n"), None);
        assert_eq!(verifier_verdict(""), None);
    }
}
