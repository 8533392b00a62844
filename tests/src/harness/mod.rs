//! The namespace-host harness; see the crate documentation.
mod attacker;
mod bpffs;
mod capture;
mod cgroup;
mod container;
mod criu;
mod criu_move;
mod daemon;
mod echo;
mod etcd;
mod host;
mod links;
mod logind;
mod nat;
mod netns;
mod not_run;
mod rogue;
mod rtnl;
mod server_move;
mod servers;
mod stream;
mod topology;

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
};

pub use attacker::{
    attach_attacker, attach_attacker_beside_server, ATTACKER_ADDR, ATTACKER_F_ADDR, ROUTER_D_ADDR,
    ROUTER_IF_D, SERVER_F_ADDR, SERVER_IF_F,
};
pub use bpffs::{ensure_bpffs_mounted, BpffsDir, BPFFS_ROOT};
pub use capture::Capture;
pub use cgroup::{cgroup2_mount, Cgroup};
pub use container::Container;
pub use criu::{
    become_child_subreaper, criu_lock_tables, kill_and_reap, remove_criu_lock_tables,
    tcp_ext_counter, tcp_info, write_criu_hook, Criu, TcpInfo, CRIU_PREFIX,
};
pub use criu_move::{
    move_echo_server_with_criu, move_echo_server_with_criu_opts, CriuMove, CriuMoveOptions,
    CriuNet, CriuScene,
};
pub use daemon::{peers_told, TempDir, Vnatd};
pub use echo::{EchoServer, UDP_DATAGRAM_SIZE};
pub use etcd::{CertKey, EtcdCluster, EtcdTls, ROLELESS_USER, TOKEN_TTL, VNAT_PASSWORD, VNAT_USER};
pub use host::{move_flow, Host, LaptopAndServer, OnDatapath, OpenDatapath};
pub use links::veth;
pub use logind::{LogindEvent, StandInLogind, SystemBus};
pub use nat::{
    nat_router, nat_router_b_only, nat_router_with, nat_subnet_d_as_a, port_forward,
    port_forward_mapped, NatPorts, NAT_PUBLIC_A, NAT_PUBLIC_B, SERVER_PUBLIC,
};
pub use netns::{ss_endpoint, tcp_bytes_received, tcp_segs_received, Netns};
pub use not_run::{not_run, skip_line, SKIP_REPORT_VAR};
pub use rogue::{server_row as rogue_row, Rogue};
pub use rtnl::{Address, Link, Route, Rule};
pub use server_move::{
    add_location_host, add_server_link_e, move_server_to_e, plug_server_e, unplug_server_c,
    LocationHost, OldServerAddress, ServerLinkE,
};
pub use servers::{Iperf3Server, ProcessGroup, SshServer};
pub use stream::{StreamClient, StreamOptions, StreamStatus};
pub use topology::{netem_available, LaptopRouterServer, LaptopRouterServerBuilder, SameLink};

/// Poll `f` every 100 ms until it holds; after `timeout`, fail with the
/// message `why` builds then (it may read state for the diagnosis).
pub fn wait_until(
    timeout: std::time::Duration,
    mut f: impl FnMut() -> bool,
    why: impl Fn() -> String,
) {
    let deadline = std::time::Instant::now() + timeout;
    while !f() {
        if std::time::Instant::now() >= deadline {
            panic!("{} (after {timeout:?})", why());
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// How the tests attach tc: `VNAT_TC_ATTACH` (auto, tcx or clsact), which
/// the vnatd they start read too (`--tc-attach`'s variable), so that
/// `VNAT_TC_ATTACH=clsact cargo xtask test` runs the suite on clsact.
pub fn tc_attach() -> vnat_daemon::datapath::TcAttach {
    vnat_daemon::datapath::TcAttach::from_env().unwrap_or_else(|e| panic!("{e}"))
}

/// `<pid>-<n>`: unique among everything this process creates, and across
/// processes (cargo runs test binaries one after another, but a demo or a
/// second `cargo test` may run beside them).
pub fn unique_suffix() -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{}-{}", std::process::id(), n)
}

/// Path of a binary of this workspace (`vnatd`, `vnatctl`, `vnat-stream`,
/// ...) built in the same target directory and profile as the running
/// executable.
///
/// Integration tests run from `target/<profile>/deps/`, binaries such as the
/// demo from `target/<profile>/`; both find their siblings in
/// `target/<profile>/`. `VNAT_BIN_DIR` overrides the directory. Cargo builds a
/// package's own binaries before its integration tests, but not other
/// packages' binaries: `cargo xtask test` builds vnatd and vnatctl first.
pub fn bin_path(name: &str) -> PathBuf {
    let dir = match std::env::var_os("VNAT_BIN_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let exe =
                std::env::current_exe().expect("cannot find the path of the running executable");
            let mut dir = exe
                .parent()
                .expect("the running executable has no directory")
                .to_path_buf();
            if dir.ends_with("deps") {
                dir.pop();
            }
            dir
        }
    };
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} does not exist: build it first (cargo build -p vnat-daemon -p vnatctl -p vnat-tests --bins, \
         same profile), or point VNAT_BIN_DIR at the directory that holds it",
        path.display()
    );
    path
}

/// Address family, for tests that run once per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

/// One host's address on one subnet: always IPv4, IPv6 when the topology was
/// built with IPv6.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dual {
    pub v4: Ipv4Addr,
    pub v6: Option<Ipv6Addr>,
}

impl Dual {
    /// The IPv6 address; panics if the topology was built without IPv6.
    pub fn v6(&self) -> Ipv6Addr {
        self.v6
            .expect("this topology was built without IPv6: use the builder's .ipv6(true)")
    }

    pub fn get(&self, family: Family) -> IpAddr {
        match family {
            Family::V4 => IpAddr::V4(self.v4),
            Family::V6 => IpAddr::V6(self.v6()),
        }
    }

    /// Every configured address with its prefix length (24 for IPv4, 64 for IPv6).
    pub fn with_prefixes(&self) -> Vec<(IpAddr, u8)> {
        let mut v = vec![(IpAddr::V4(self.v4), 24)];
        if let Some(v6) = self.v6 {
            v.push((IpAddr::V6(v6), 64));
        }
        v
    }
}
