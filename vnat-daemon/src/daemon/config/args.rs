//! vnatd's command line (clap): every setting as a flag, each optional so
//! that "not given" falls back to the config file, and the flags that do
//! something else and exit (`--check`, `--cleanup`, the hidden
//! `--generate`).

use std::{net::SocketAddr, path::PathBuf};

use serde::Deserialize;

use super::about::LONG_ABOUT;
use super::{
    DEFAULT_BPFFS, DEFAULT_CONFIG_PATH, DEFAULT_LISTEN, DEFAULT_LOG_LEVEL, DEFAULT_STATE_DIR,
};
use crate::{control::DEFAULT_CONTROL_PATH, datapath::TcAttach};

/// How log lines are written (to stderr, which systemd sends to the journal).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

/// What `vnatd --generate` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Generate {
    /// vnatd(8).
    Man,
    /// vnatd.toml(5).
    ManConfig,
    /// The example config file (`keys::example_file`).
    Config,
    Bash,
    Zsh,
    Fish,
}

/// The command line. Every setting is optional here so that "not given" can
/// fall back to the config file.
#[derive(Clone, Debug, clap::Parser)]
#[command(name = "vnatd", version, about = "The vnat daemon: keeps connections alive when endpoints move.", long_about = LONG_ABOUT)]
pub struct Args {
    /// Config file (TOML). A missing default file is fine; a missing file given here is an error.
    #[arg(long, value_name = "FILE", help = format!("Config file (TOML) [default: {DEFAULT_CONFIG_PATH}]"))]
    pub config: Option<PathBuf>,
    /// Control socket that vnatctl talks to.
    #[arg(long, value_name = "PATH", help = format!("Control socket that vnatctl talks to [default: {DEFAULT_CONTROL_PATH}]"))]
    pub control: Option<PathBuf>,
    /// Directory for vnatd's saved state (created mode 0700).
    #[arg(long, value_name = "DIR", help = format!("Directory for saved state, created 0700 [default: {DEFAULT_STATE_DIR}]"))]
    pub state_dir: Option<PathBuf>,
    /// bpffs directory where programs and maps are pinned.
    #[arg(long, value_name = "DIR", help = format!("bpffs directory for the pinned programs and maps [default: {DEFAULT_BPFFS}]"))]
    pub bpffs: Option<PathBuf>,
    /// Address and port for VCMP with peers' vnatd.
    #[arg(long, value_name = "ADDR:PORT", value_parser = parse_listen,
          help = format!("Address and port for VCMP with peers (not used yet) [default: {DEFAULT_LISTEN}]"))]
    pub listen: Option<SocketAddr>,
    /// cgroup v2 directory whose connections vnat manages; repeat for several.
    #[arg(
        long = "cgroup",
        value_name = "DIR",
        help = "cgroup v2 directory whose connections vnat manages; repeatable [default: the cgroup2 mount root, i.e. the whole host]"
    )]
    pub cgroups: Vec<PathBuf>,
    /// cgroup v2 directory whose connections preempt older ones in a
    /// virtual-address conflict; repeat for several.
    #[arg(
        long = "preempt-cgroup",
        value_name = "DIR",
        help = "cgroup v2 directory whose connections, in a virtual-address conflict, reset the older connection instead of giving up their move; repeatable [default: none, every conflict aborts the move]"
    )]
    pub preempt_cgroups: Vec<PathBuf>,
    /// cgroup v2 directory whose applications keep seeing moved hosts at
    /// their virtual addresses; repeat for several.
    #[arg(
        long = "hide-location-cgroup",
        value_name = "DIR",
        help = "cgroup v2 directory whose applications keep seeing moved hosts at their old addresses in new connections too (FTP-like applications; vnatctl enable --hide-location); enabled if no --cgroup covers it; repeatable [default: none]"
    )]
    pub hide_location_cgroups: Vec<PathBuf>,
    /// Keep-alive helpers a peer may ask of this host.
    #[arg(
        long = "peer-helper",
        value_name = "NAME",
        help = "keep-alive helper this host runs when a peer about to be away asks for it: zero-window, stop or hold; repeatable; none for none [default: zero-window and hold]"
    )]
    pub peer_helpers: Vec<String>,
    /// Where installed keep-alive helpers are.
    #[arg(
        long = "helpers-dir",
        value_name = "DIR",
        help = "directory of the installed keep-alive helpers that peer_helpers may name [default: /etc/vnat/helpers]"
    )]
    pub helpers_dir: Option<PathBuf>,
    /// Log filter.
    #[arg(long, value_name = "FILTER",
          help = format!("Log level or filter, e.g. debug or info,vnat_daemon=trace [default: RUST_LOG, else {DEFAULT_LOG_LEVEL}]"))]
    pub log_level: Option<String>,
    /// Log line format.
    #[arg(
        long,
        value_enum,
        value_name = "FORMAT",
        help = "Log line format [default: text]"
    )]
    pub log_format: Option<LogFormat>,
    /// vnatd asked last where a moved peer is; repeat for several.
    #[arg(
        long = "location-server",
        value_name = "ADDR:PORT",
        value_parser = parse_location_server,
        help = "Another vnatd to ask where a peer went when both ends moved (paper 3.3.2.1 P(3)/S(3)); repeatable, replaces the file's list [default: none]"
    )]
    pub location_servers: Vec<SocketAddr>,
    /// Where location records are kept: the embedded store, or etcd too.
    #[arg(
        long = "location-store",
        value_enum,
        value_name = "STORE",
        help = "Where this host keeps and looks up location records: embedded (its own store, kept across restarts) or etcd (an etcd cluster's v3 API; see etcd_endpoints and the etcd_* keys) [default: embedded]"
    )]
    pub location_store: Option<super::store::StoreKind>,
    /// etcd members' client URLs; repeat for several.
    #[arg(
        long = "etcd-endpoint",
        value_name = "URL",
        help = "An etcd member's client URL (http://HOST:PORT or https://HOST:PORT) for location_store = etcd; repeatable, replaces the file's etcd_endpoints"
    )]
    pub etcd_endpoints: Vec<String>,
    /// Keep tc attached everywhere while connections are paired (the
    /// default; the flag overrides `standby_tc = false` in the file).
    #[arg(
        long = "standby-tc",
        help = "Keep the tc translators attached to every interface while connections are paired, so a move does not wait 10-25 ms for the kernel to attach them [default: on]"
    )]
    pub standby_tc: bool,
    /// Attach tc only where moved connections need it.
    #[arg(
        long = "no-standby-tc",
        conflicts_with = "standby_tc",
        help = "Attach the tc translators only to interfaces that moved connections use: nothing on other packets, 10-25 ms more per move"
    )]
    pub no_standby_tc: bool,
    /// Take logind's sleep inhibitor (the default; the flag overrides
    /// `sleep_inhibit = false` in the file).
    #[arg(
        long = "sleep-inhibit",
        help = "Hold a logind delay inhibitor for sleep: before the host sleeps, settle roles and keys of every mobile connection with its peer while the network is up (as vnatctl suspend --all), resume at wake [default: on, when there is a system bus with logind]"
    )]
    pub sleep_inhibit: bool,
    /// Leave sleep to vnatctl suspend/resume.
    #[arg(
        long = "no-sleep-inhibit",
        conflicts_with = "sleep_inhibit",
        help = "Do not watch sleep through logind: connections are suspended and resumed only by vnatctl suspend/resume or by automatic mode"
    )]
    pub no_sleep_inhibit: bool,
    /// Check the kernel and exit.
    #[arg(
        long,
        group = "report",
        help = "Check this kernel's features and vnatd's other requirements, print each as ok, MISSING or degraded (with what it affects), and exit: 0 when vnatd can run (degraded capabilities listed), 1 when it cannot. Changes nothing on the host"
    )]
    pub check: bool,
    /// `--check` or `--cleanup` as JSON.
    #[arg(
        long,
        requires = "report",
        help = "With --check: print the report as one JSON object (kernel, can_run, items with name, status, needs, affects, detail). With --cleanup: what was done and what failed (done and failed, each item with kind and what; failed with error)"
    )]
    pub json: bool,
    /// How the tc translators attach.
    #[arg(
        long = "tc-attach",
        env = "VNAT_TC_ATTACH",
        value_enum,
        value_name = "HOW",
        help = "How the tc translators attach to interfaces: auto (TCX where the kernel has it, Linux 6.6, else clsact), tcx, or clsact (cls_bpf filters on a clsact qdisc, any kernel) [default: auto]"
    )]
    pub tc_attach: Option<TcAttach>,
    /// Remove what vnatd changed on this host, when no vnatd runs.
    #[arg(
        long,
        group = "report",
        conflicts_with = "check",
        help = "Remove everything vnatd changed on this host (its policy rules and routes, the addresses it kept on lo, the sink interface, its tc and cgroup attachments, the pinned programs and maps under --bpffs; the sysctls it changed go back to their values before), print each, and exit: 0 when nothing of vnat's is left, 1 when something could not be removed. Refused while a vnatd answers on --control. Keeps --state-dir (keys, peers). Connections that moved lose their translation. The package runs it when it is purged"
    )]
    pub cleanup: bool,
    /// Write a man page, the example config or a shell completion to
    /// stdout (for packaging; hidden).
    #[arg(long, value_enum, value_name = "WHAT", hide = true)]
    pub generate: Option<Generate>,
    /// NAT keepalive interval.
    #[arg(
        long = "keepalive-secs",
        value_name = "SECS",
        value_parser = clap::value_parser!(u32).range(0..=3600),
        help = "Seconds between keepalives a host behind a NAT sends each peer it holds mobile connections with, so the NAT keeps its mapping; 0 turns them off [default: 25]"
    )]
    pub keepalive_secs: Option<u32>,
}

fn parse_location_server(s: &str) -> Result<SocketAddr, String> {
    let a: SocketAddr = s.parse().map_err(|_| {
        "expected ADDR:PORT such as 192.0.2.7:2031 or [2001:db8::7]:2031".to_string()
    })?;
    if !usable_location_server(&a) {
        return Err(format!(
            "{a} cannot be asked: give the address and port another vnatd listens on, such as 192.0.2.7:2031"
        ));
    }
    Ok(a)
}

/// A location server is a destination: an unspecified address or port 0
/// would send the queries nowhere.
pub(super) fn usable_location_server(a: &SocketAddr) -> bool {
    !a.ip().is_unspecified() && !a.ip().is_multicast() && a.port() != 0
}

fn parse_listen(s: &str) -> Result<SocketAddr, String> {
    s.parse()
        .map_err(|_| format!("expected ADDR:PORT such as {DEFAULT_LISTEN} or [::]:2031"))
}
