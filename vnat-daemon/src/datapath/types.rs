//! Userspace views of the kernel state, independent of the map layouts.
//! Those the control protocol carries (connections, translations, status)
//! live in `vnat-control`, which vnatctl shares, and are re-exported here.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use serde::{Deserialize, Serialize};

pub use vnat_control::datapath::{
    CgroupAttachment, ConnState, ConnectionInfo, DatapathStatus, Degraded, GuestInfo, TcAttachment,
    TcMode, Translation,
};
pub use vnat_vcmp::flow::{flow_key, key_endpoints, v4_words, v6_words, Proto, VirtualFlow};

/// What [`super::Datapath::kick_flow`] sent (nothing is waited for).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kick {
    /// Nothing: UDP, or a healthy socket whose peer did not move.
    Nothing,
    /// `messages` RFC 6069 unreachables for a backed-off retransmission
    /// timer (one per backoff step, for each candidate `snd_una`), and an
    /// ACK solicited if the peer moved.
    Unreachables { messages: u32, backoff: u8 },
    /// One out-of-window probe to the peer for a backed-off probe timer
    /// (and an ACK solicited if the peer moved).
    Probe { backoff: u8 },
    /// The socket was asked for an ACK (its peer moved).
    AckSolicited,
}

/// Whether a TCP socket waits for its peer
/// ([`super::Datapath::peer_silence`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerSilence {
    /// No such TCP socket here (closed, UDP, or not this host's).
    Gone,
    /// Nothing the socket sent waits for an answer.
    Answering,
    /// The socket waits for its peer: keepalive or window probes are
    /// unanswered, or its oldest segment has been retransmitted.
    Unanswered,
}

/// What [`super::Datapath::answer_for_peer`] found and did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerAnswer {
    /// No such TCP socket here (closed, UDP, or not this host's).
    Gone,
    /// The socket's counters (bytes acknowledged, received) are not the
    /// ones given: the peer was heard from since. Nothing was delivered.
    PeerActive { counters: (u64, u64) },
    /// An open window (`window` > 0) was not delivered: the socket has
    /// unacknowledged data and has been retransmitting towards the zero
    /// window all along, so with the window open its next retransmission
    /// would find the time for `tcp_retries2` long past and give up. Its
    /// retransmission towards the zero window reaches the peer instead,
    /// whose own ACK opens the window.
    Retransmitting,
    /// The ACK was delivered. `counters` (bytes acknowledged, received) are
    /// for the next call; `peer_window` is the window the peer last
    /// advertised, in bytes, as the socket had it before this ACK.
    Answered {
        counters: (u64, u64),
        peer_window: Option<u32>,
    },
}

/// What [`super::restart_verified`] did: the restart levers, which watch
/// the socket act, and whether an ACK was solicited (when the peer moved).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restarted {
    pub outcome: RestartOutcome,
    pub ack_solicited: Option<bool>,
}

/// What [`crate::datapath::Datapath::restart_flow`] did to a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "outcome")]
pub enum RestartOutcome {
    /// Nothing was sent: the flow is UDP, or its TCP socket is not waiting
    /// on a backed-off retransmission or probe timer. A healthy connection
    /// is never touched.
    NotStalled,
    /// The kernel retransmitted the oldest unacknowledged segment at once,
    /// after `messages` ICMP unreachables (one reverted backoff step each).
    /// `backoff` is the socket's backoff before the first one.
    Retransmitted { messages: u32, backoff: u8 },
    /// The backoff was reverted but the oldest segment went out so recently
    /// that no retransmission was due yet: the timer now fires in
    /// `next_retransmit_ms` instead of at the backed-off time.
    Rearmed {
        messages: u32,
        backoff: u8,
        next_retransmit_ms: u32,
    },
    /// The socket had nothing in flight and new data waiting behind its
    /// backed-off probe timer (sending had failed locally): the peer was
    /// asked for an ACK `probes` times, and on receiving it the socket sent.
    Resumed { probes: u32, backoff: u8 },
    /// The socket had new data waiting behind a probe timer that had not
    /// backed off yet (one send had failed locally, such as a send dropped
    /// while the connection was held during its move): the peer was asked
    /// for an ACK once, without waiting for the answer, so that many such
    /// sockets are restarted in one round trip, not one after another. If
    /// the probe is lost, the timer (one RTO) sends the data anyway.
    Probed,
    /// The socket had new data waiting behind its probe timer (sending had
    /// failed locally): vnatd un-corked it on its process's behalf, which
    /// makes the kernel send what it queued at once, without the round trip
    /// of asking the peer for an ACK. `backoff`: the probe timer's.
    Pushed { backoff: u8 },
    /// Nothing changed after `messages` ICMP messages or probes: the
    /// sequence number was stale, or the peer did not answer. The socket
    /// goes on at its own timer.
    Ignored { messages: u32, backoff: u8 },
    /// This datapath cannot restart flows (the in-memory fake).
    Unsupported,
}

/// What the applications of the hiding cgroups see of moves
/// (`Datapath::set_hidden`, computed by `daemon::hide`). Addresses of one
/// family map to the same family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HideTable {
    /// A peer's address (where it is now, or a virtual address of a
    /// connection opened since it moved) -> the virtual address shown for
    /// it by getpeername(), accept() and recvmsg().
    pub remote_show: BTreeMap<IpAddr, IpAddr>,
    /// An endpoint a moved peer's connection had (its remote virtual
    /// endpoint) -> where it is now: where a connect() or sendmsg() to it
    /// goes. Never a whole address: another host may answer at its other
    /// ports.
    pub remote_reach: BTreeMap<(Proto, SocketAddr), SocketAddr>,
    /// This host's address -> the virtual address getsockname() shows.
    pub local_show: BTreeMap<IpAddr, IpAddr>,
    /// This host's moved-away address -> where a bind() to it binds.
    pub local_reach: BTreeMap<IpAddr, IpAddr>,
    /// Translated flows whose remote virtual address is in `remote_reach`:
    /// a sendmsg() to one (from the flow's local port) is left to the tc
    /// translation. (protocol, local port, remote virtual endpoint).
    pub translated: BTreeSet<(Proto, u16, SocketAddr)>,
}

impl HideTable {
    pub fn is_empty(&self) -> bool {
        self.remote_show.is_empty()
            && self.remote_reach.is_empty()
            && self.local_show.is_empty()
            && self.local_reach.is_empty()
            && self.translated.is_empty()
    }
}

/// How vnatd attaches the tc translators (`tc_attach`, `--tc-attach`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum TcAttach {
    /// TCX where the kernel has it (Linux 6.6), clsact elsewhere.
    #[default]
    Auto,
    /// TCX links only; vnatd does not start on a kernel without TCX.
    Tcx,
    /// cls_bpf filters on a clsact qdisc, on any kernel.
    Clsact,
}

impl TcAttach {
    /// The environment variable `--tc-attach` also reads.
    pub const ENV: &'static str = "VNAT_TC_ATTACH";

    /// `VNAT_TC_ATTACH` (auto when unset), for the tests and benchmarks
    /// that open a datapath in their own process.
    pub fn from_env() -> Result<TcAttach, String> {
        match std::env::var(Self::ENV).as_deref() {
            Err(_) | Ok("") | Ok("auto") => Ok(TcAttach::Auto),
            Ok("tcx") => Ok(TcAttach::Tcx),
            Ok("clsact") => Ok(TcAttach::Clsact),
            Ok(other) => Err(format!(
                "{}={other} is no way to attach tc: use auto, tcx or clsact",
                Self::ENV
            )),
        }
    }
}

/// Errors of the datapath. Each names what went wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    #[error(
        "vnatd was built without its eBPF programs (AYA_BUILD_SKIP was set); rebuild without it"
    )]
    NoEbpfObject,
    #[error("loading the eBPF programs failed: {source}")]
    Load {
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The kernel's verifier refused one program: `verdict` is the line of
    /// its log that says why; the whole log is logged at debug level.
    #[error("this kernel (Linux {kernel}) refused vnat's eBPF program {program}: the verifier said \"{verdict}\"; run `vnatd --check` to see what this kernel lacks, and report it with the output of `vnatd --check --json`")]
    ProgramRefused {
        program: &'static str,
        kernel: String,
        verdict: String,
    },
    /// Something asked for needs a kernel feature this kernel lacks.
    #[error("{what} needs {needs}, which this kernel (Linux {kernel}) lacks: {instead}")]
    Unsupported {
        what: String,
        needs: String,
        kernel: String,
        instead: String,
    },
    #[error("{path} is not a cgroup v2 directory; pass a directory under the cgroup2 mount (e.g. /sys/fs/cgroup/unified/...)")]
    NotACgroup { path: PathBuf },
    #[error("cgroup {path} is not enabled")]
    CgroupNotEnabled { path: PathBuf },
    /// Hide location refused for a cgroup, and why.
    #[error("cannot hide location for cgroup {path}: {reason}")]
    CannotHide { path: PathBuf, reason: String },
    #[error("the bpffs directory {path} is unusable: {reason}; mount bpffs (mount -t bpf bpf /sys/fs/bpf) or pass --bpffs")]
    Bpffs { path: PathBuf, reason: String },
    /// Another process owns the pin directory (`pinlock.rs`).
    #[error("another process (a vnatd) has the datapath pinned in {path} open; stop it first (systemctl stop vnatd), or give this vnatd its own --bpffs (and --control and --state-dir)")]
    PinsInUse { path: PathBuf },
    #[error("the pins in {path} were made by an incompatible vnat (ABI {found}, this is {expected}); stop every vnatd using it and remove the directory")]
    AbiMismatch {
        path: PathBuf,
        found: u32,
        expected: u32,
    },
    #[error("invalid translation for {flow:?}: {reason}")]
    InvalidTranslation {
        flow: VirtualFlow,
        reason: &'static str,
    },
    /// A virtual-address conflict (the paper's section 3.4.3): the
    /// endpoints a connection would move to are those of another
    /// connection of this host, so the kernel could not tell the two apart.
    #[error("another connection of this host, {other}, has the endpoints {flow} would move to: the move is refused (for a move of this host's own end, preempt_cgroups listing both connections' cgroups resets the older TCP connection instead)")]
    Conflict {
        flow: VirtualFlow,
        /// Boxed: it would make every `DatapathError` larger.
        other: Box<VirtualFlow>,
    },
    /// Preempt (`preempt_cgroups`) resets the older of two conflicting
    /// connections, and the one that was to move was the older.
    #[error("{flow} was reset instead of moved: another connection of this host, {other}, has the endpoints it would move to, and preempt_cgroups resets the older of the two, which was this one")]
    ResetAsOlder {
        flow: VirtualFlow,
        other: Box<VirtualFlow>,
    },
    #[error("no translation is installed for {flow:?}")]
    NoSuchTranslation { flow: VirtualFlow },
    #[error("no recorded connection {flow:?} (or its socket is gone): only TCP connections of an enabled cgroup, established while vnat ran, can be restarted")]
    NoSuchConnection { flow: VirtualFlow },
    #[error("no route to {addr}: the kernel cannot reach the new physical endpoint")]
    NoRoute { addr: IpAddr },
    #[error("no route to {addr} leaves through {dev}, the interface of {from}: add one (for example a default route through that link's router, with a higher metric than the current default route's)")]
    NoRouteVia {
        addr: IpAddr,
        from: IpAddr,
        dev: String,
    },
    #[error("{what} failed: {source}")]
    Kernel {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("BPF map {map} operation failed: {source}")]
    Map {
        map: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("attaching {program} to {target} failed: {source}")]
    Attach {
        program: &'static str,
        target: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// Checks shared by every [`crate::datapath::Datapath`] implementation, so
/// the fake refuses exactly what the kernel one refuses.
pub fn validate_translation(t: &Translation) -> Result<(), DatapathError> {
    let bad = |reason| {
        Err(DatapathError::InvalidTranslation {
            flow: t.flow,
            reason,
        })
    };
    // The virtual endpoints are of one family and the physical ones of
    // one; an IPv4 connection may be carried over IPv6 (its host moved to
    // a network where it has only IPv6; the translators change the IP
    // version, `NAT_F_FAMILY`), not the other way round.
    let v4 = t.flow.local.is_ipv4();
    let phys_v4 = t.physical_local.is_ipv4();
    if t.flow.remote.is_ipv4() != v4 || t.physical_remote.is_ipv4() != phys_v4 {
        return bad("both virtual endpoints must be of one address family, and both physical ones");
    }
    if phys_v4 && !v4 {
        return bad("an IPv6 connection cannot be carried over IPv4");
    }
    for a in [
        t.flow.local,
        t.flow.remote,
        t.physical_local,
        t.physical_remote,
    ] {
        if a.port() == 0 {
            return bad("port 0 is not a valid endpoint");
        }
        if a.ip().is_unspecified() || a.ip().is_multicast() {
            return bad("endpoints must be unicast addresses");
        }
    }
    if !t.local_moved() && !t.remote_moved() {
        return bad("neither end moved; a flow that did not move needs no translation");
    }
    Ok(())
}

/// A sysctl vnat changed, when vnatd gives it back (a clean stop,
/// `vnatd --cleanup`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum SysctlRestore {
    /// Back at the value it had before vnat first changed it.
    PutBack { key: String, value: String },
    /// Someone changed it since vnat set it: left at their value.
    LeftChanged { key: String, value: String },
}

/// What a clean stop did with the sysctls vnat changed
/// ([`crate::datapath::Datapath::restore_sysctls`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SysctlsAtStop {
    /// vnat changed none since they were last given back.
    Unchanged,
    /// Given back, each as said.
    Restored(Vec<SysctlRestore>),
    /// Kept as vnat set them: this many IPv4 addresses stay kept on `lo`
    /// (their connections are translated while vnatd is down), and the
    /// host would answer ARP for them on its other links without them.
    Kept { lo_addresses: usize },
}
