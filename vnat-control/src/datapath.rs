//! The datapath's state as the control protocol reports it: the recorded
//! connections (`vnatctl ls`), the translations an export carries, and the
//! attachments and counters of `vnatctl status`. Plain data; vnatd fills it
//! in from the kernel (`vnat_daemon::datapath`, which re-exports these).

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use serde::{Deserialize, Serialize};

pub use vnat_vcmp::flow::{Proto, VirtualFlow};

/// Whether a recorded flow currently goes through translation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConnState {
    /// Never moved: virtual and physical endpoints are the same, packets are
    /// not touched.
    Native,
    /// Moved: packets are rewritten between virtual and physical endpoints.
    Translated,
}

impl std::fmt::Display for ConnState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConnState::Native => "native",
            ConnState::Translated => "translated",
        })
    }
}

/// One recorded connection as `vnatctl ls` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionInfo {
    pub id: u64,
    pub proto: Proto,
    pub virtual_local: SocketAddr,
    pub virtual_remote: SocketAddr,
    pub physical_local: SocketAddr,
    pub physical_remote: SocketAddr,
    pub state: ConnState,
    /// Socket cookie (`SO_COOKIE`).
    pub cookie: u64,
    /// cgroup v2 id recorded by the kernel, 0 if it could not tell.
    pub cgroup_id: u64,
    /// cgroup path relative to the cgroup2 mount, when known.
    pub cgroup: Option<String>,
    /// Owning process, when the kernel can tell.
    pub pid: Option<u32>,
    pub command: Option<String>,
    /// Seconds since the connection was recorded (CLOCK_BOOTTIME).
    pub age_secs: u64,
    /// When it was recorded (CLOCK_BOOTTIME ns; for an adopted one, when
    /// it was adopted): the connection's age to the nanosecond, for the
    /// conflict policy's "older". Stays inside vnatd, as `tcp_isns`.
    #[serde(skip)]
    pub recorded_ns: u64,
    /// TCP: the first sequence numbers after the SYNs, (ours, the peer's),
    /// recorded at establishment. They tie the connection to its peer host
    /// (`vcmp::binding`) and stay inside vnatd: they are not part of any
    /// answer of the control API.
    #[serde(skip)]
    pub tcp_isns: Option<[u32; 2]>,
    /// UDP: this host has only received from the peer (a server's socket
    /// that never answered that source). Anyone can spoof a source, so such
    /// a flow is no pairing target until this host sends to it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub udp_inbound_only: bool,
    /// vnatd recorded it after the fact (adoption): it was opened before
    /// vnatd started or before its cgroup was enabled.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopted: bool,
    /// Its application's cgroup hides location (`enable --hide-location`):
    /// it sees moved hosts at their virtual addresses in new connections
    /// too. Listed with the owners only.
    #[serde(default)]
    pub hide_location: bool,
    /// A container's connection: its socket lives in another network
    /// namespace behind this host's NAT, and the endpoints above are the
    /// public ones, after the host's NAT, as the peer sees them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<GuestInfo>,
}

/// Where a container's connection lives (see [`ConnectionInfo::guest`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestInfo {
    /// `bpf_get_netns_cookie` of the socket's namespace.
    pub netns_cookie: u64,
    /// The namespace as `ip netns identify`/lsns name it (`net:[INODE]`),
    /// when a process of the connection is known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<String>,
    /// The socket's own ends, before the host's NAT.
    pub private_local: SocketAddr,
    pub private_remote: SocketAddr,
    /// Not NATed: the container's own address, which this host routes to
    /// it; this is the host's address on the network that routes it (the
    /// connection moves when that address goes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routed_via: Option<IpAddr>,
}

/// A translation for one flow (what `install_translation` takes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Translation {
    pub flow: VirtualFlow,
    /// Where the local end is now (equal to `flow.local` if it did not move).
    pub physical_local: SocketAddr,
    /// Where the remote end is now (equal to `flow.remote` if it did not move).
    pub physical_remote: SocketAddr,
}

impl Translation {
    pub fn local_moved(&self) -> bool {
        self.physical_local != self.flow.local
    }
    pub fn remote_moved(&self) -> bool {
        self.physical_remote != self.flow.remote
    }
}

/// A cgroup with the recorders attached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupAttachment {
    pub path: PathBuf,
    pub id: u64,
    /// Its applications do not see moves (`enable --hide-location`).
    #[serde(default)]
    pub hide_location: bool,
}

fn default_tc_mode() -> TcMode {
    TcMode::Tcx
}

/// How the translators of one interface are attached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TcMode {
    /// A pinned TCX link per hook (Linux 6.6).
    Tcx,
    /// A cls_bpf filter per hook on a clsact qdisc.
    Clsact,
}

impl std::fmt::Display for TcMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TcMode::Tcx => "tcx",
            TcMode::Clsact => "clsact",
        })
    }
}

/// An interface with the tc translators attached.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TcAttachment {
    pub ifname: String,
    pub ifindex: u32,
    /// How they are attached there.
    pub mode: TcMode,
    /// Number of translations that need this attachment.
    pub users: u32,
}

/// A capability this kernel weakens or turns off, and why (`vnatctl
/// status`, `vnatd --check`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Degraded {
    /// The missing feature's name (as in `VNAT_KERNEL_LACKS`).
    pub feature: String,
    /// What it needs ("TCX (Linux 6.6)").
    pub needs: String,
    /// One sentence: what vnat does without it.
    pub effect: String,
}

/// `vnatctl status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DatapathStatus {
    /// `uname -r`.
    #[serde(default)]
    pub kernel: String,
    /// How new tc attachments are made.
    #[serde(default = "default_tc_mode")]
    pub tc_mode: TcMode,
    /// Capabilities this kernel weakens or turns off.
    #[serde(default)]
    pub degraded: Vec<Degraded>,
    pub bpffs: PathBuf,
    pub netns_cookie: u64,
    pub programs_loaded: Vec<String>,
    pub cgroups: Vec<CgroupAttachment>,
    pub tc: Vec<TcAttachment>,
    pub connections: u64,
    pub translations: u64,
    /// Counter name to value, summed over CPUs, in `STAT_NAMES` order.
    pub counters: Vec<(String, u64)>,
}
