//! Kernel features that vnat uses and that a supported kernel may lack,
//! each probed by asking the kernel (never guessed from its version).
//!
//! `VNAT_KERNEL_LACKS` (a comma-separated list of [`Feature`] names) makes
//! vnatd treat those features as missing whatever the kernel says: the same
//! switch the fallbacks and `vnatd --check` go through, so that a test on a
//! new kernel can show what happens on an old one.

use std::os::fd::{AsRawFd, BorrowedFd};

use serde::{Deserialize, Serialize};

use super::{check, object};
use crate::datapath::{DatapathError, Degraded, TcAttach, TcMode};

/// The environment variable that makes vnatd treat features as missing.
pub const LACKS_ENV: &str = "VNAT_KERNEL_LACKS";

/// A kernel feature vnat probes for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Feature {
    /// TCX links for tc programs (Linux 6.6).
    Tcx,
    /// The getsockname/getpeername cgroup hooks (Linux 5.8), for hide
    /// location.
    SockAddrNameHooks,
    /// `IFA_PROTO` on addresses (Linux 6.1): tells vnat's own addresses on
    /// `lo` from the others.
    IfaProto,
    /// `SO_NETNS_COOKIE` (Linux 5.14).
    NetnsCookie,
    /// The window fields of `tcp_info` (`tcpi_rcv_wnd`, Linux 6.2).
    TcpInfoWindows,
}

impl Feature {
    pub const ALL: [Feature; 5] = [
        Feature::Tcx,
        Feature::SockAddrNameHooks,
        Feature::IfaProto,
        Feature::NetnsCookie,
        Feature::TcpInfoWindows,
    ];

    /// Its name in `VNAT_KERNEL_LACKS` and in `vnatd --check --json`.
    pub fn name(self) -> &'static str {
        match self {
            Feature::Tcx => "tcx",
            Feature::SockAddrNameHooks => "sock-addr-name-hooks",
            Feature::IfaProto => "ifa-proto",
            Feature::NetnsCookie => "netns-cookie",
            Feature::TcpInfoWindows => "tcp-info-windows",
        }
    }

    /// What it is and the kernel that brought it, as every message says it.
    pub fn needs(self) -> &'static str {
        match self {
            Feature::Tcx => "TCX (Linux 6.6)",
            Feature::SockAddrNameHooks => "the getsockname/getpeername cgroup hooks (Linux 5.8)",
            Feature::IfaProto => "IFA_PROTO on addresses (Linux 6.1)",
            Feature::NetnsCookie => "SO_NETNS_COOKIE (Linux 5.14)",
            Feature::TcpInfoWindows => "tcp_info's receive window (Linux 6.2)",
        }
    }

    pub fn from_name(name: &str) -> Option<Feature> {
        Feature::ALL.into_iter().find(|f| f.name() == name)
    }
}

/// Whether `VNAT_KERNEL_LACKS` names `f` (read once: some callers are on
/// per-socket paths).
pub fn simulated_missing(f: Feature) -> bool {
    static LACKS: std::sync::OnceLock<Vec<Feature>> = std::sync::OnceLock::new();
    LACKS
        .get_or_init(|| {
            std::env::var(LACKS_ENV)
                .map(|v| {
                    v.split(',')
                        .filter_map(|n| Feature::from_name(n.trim()))
                        .collect()
                })
                .unwrap_or_default()
        })
        .contains(&f)
}

/// The names in `VNAT_KERNEL_LACKS` that name no feature (a typo would
/// otherwise simulate nothing without a word).
pub fn unknown_simulated() -> Vec<String> {
    std::env::var(LACKS_ENV)
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|n| !n.is_empty() && Feature::from_name(n).is_none())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// `BPF_LINK_CREATE` (bpf(2) command 28).
const BPF_LINK_CREATE: libc::c_long = 28;
/// `BPF_TCX_INGRESS` (enum bpf_attach_type, Linux 6.6).
const BPF_TCX_INGRESS: u32 = 46;

/// Whether the kernel has TCX: a link of a loaded tc program (`prog`) to
/// the interface with index 0, which does not exist. A kernel with TCX
/// looks the interface up and answers ENODEV; one without it does not know
/// the attach type and answers EINVAL. Nothing is attached either way.
pub fn probe_tcx(prog: BorrowedFd<'_>) -> bool {
    if simulated_missing(Feature::Tcx) {
        return false;
    }
    // union bpf_attr's link_create: prog_fd, target_ifindex, attach_type,
    // flags, then the tcx part (relative fd or id, expected revision);
    // zeros for all but the first three.
    #[repr(C)]
    struct LinkCreate {
        prog_fd: u32,
        target_ifindex: u32,
        attach_type: u32,
        flags: u32,
        relative: u32,
        _pad: u32,
        expected_revision: u64,
        _rest: [u64; 4],
    }
    let attr = LinkCreate {
        prog_fd: prog.as_raw_fd() as u32,
        target_ifindex: 0,
        attach_type: BPF_TCX_INGRESS,
        flags: 0,
        relative: 0,
        _pad: 0,
        expected_revision: 0,
        _rest: [0; 4],
    };
    // SAFETY: bpf(2) reads `size` bytes of `attr`, a live, initialized
    // struct of exactly that size; with ifindex 0 it creates nothing (and
    // should it ever, the fd it returns is closed below).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_LINK_CREATE,
            &attr as *const LinkCreate,
            std::mem::size_of::<LinkCreate>(),
        )
    };
    if rc >= 0 {
        // SAFETY: a successful BPF_LINK_CREATE returns a new fd we own.
        unsafe { libc::close(rc as i32) };
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() == Some(libc::ENODEV)
}

/// `tc_attach` as this kernel allows: TCX where it has TCX (probed with
/// a loaded tc program), clsact where it does not or where asked.
pub(super) fn resolve_tc_attach(
    loaded: &mut object::Loaded,
    want: TcAttach,
) -> Result<TcMode, DatapathError> {
    use std::os::fd::AsFd;
    if want == TcAttach::Clsact {
        return Ok(TcMode::Clsact);
    }
    // Any loaded tc program serves: `vnat_peek` costs the verifier almost
    // nothing, where the translators may not be loaded yet (`TcLoad`).
    let probe = if loaded.peek {
        vnat_common::PROG_PEEK
    } else {
        object::load_tc_on_demand(&mut loaded.ebpf, vnat_common::PROG_TC_INGRESS)?;
        vnat_common::PROG_TC_INGRESS
    };
    let p: &mut aya::programs::SchedClassifier = object::prog(&mut loaded.ebpf, probe)?;
    let fd = p.fd().map_err(|e| DatapathError::Load {
        source: Box::new(e),
    })?;
    let tcx = probe_tcx(fd.as_fd());
    match (want, tcx) {
        (_, true) => Ok(TcMode::Tcx),
        (TcAttach::Tcx, false) => Err(DatapathError::Unsupported {
            what: "tc_attach = \"tcx\"".into(),
            needs: Feature::Tcx.needs().into(),
            kernel: object::kernel_release(),
            instead: "use tc_attach = \"auto\" or \"clsact\" (--tc-attach clsact)".into(),
        }),
        _ => {
            tracing::info!(
                "this kernel has no TCX (Linux 6.6): the tc translators attach as clsact filters"
            );
            Ok(TcMode::Clsact)
        }
    }
}

/// What this kernel weakens or turns off, each probed (see `features.rs`).
pub(super) fn degraded(loaded: &object::Loaded, want: TcAttach, mode: TcMode) -> Vec<Degraded> {
    let mut out = Vec::new();
    let mut add = |f: Feature, needs: &str, effect: &str| {
        out.push(Degraded {
            feature: f.name().into(),
            needs: needs.into(),
            effect: effect.into(),
        })
    };
    if want == TcAttach::Auto && mode == TcMode::Clsact {
        add(
            Feature::Tcx,
            Feature::Tcx.needs(),
            "the tc translators attach as clsact filters (the same translation)",
        );
    }
    if loaded.hide_unavailable.is_some() {
        add(
            Feature::SockAddrNameHooks,
            Feature::SockAddrNameHooks.needs(),
            "hide location is off: applications see moved peers at their new addresses",
        );
    }
    if !check::ifa_proto_available() {
        add(
            Feature::IfaProto,
            Feature::IfaProto.needs(),
            "addresses a crashed vnatd left on lo are not removed at the next start",
        );
    }
    if !check::tcp_info_windows_available() {
        add(
            Feature::TcpInfoWindows,
            Feature::TcpInfoWindows.needs(),
            "the probe that restarts a stalled TCP connection advertises 65535 bytes, not the socket's window",
        );
    }
    out
}
