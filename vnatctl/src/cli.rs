//! vnatctl's command line.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use vnat_daemon::{
    control::DEFAULT_CONTROL_PATH,
    datapath::{ConnState, Proto},
};

const LONG_ABOUT: &str = "\
vnatctl talks to vnatd, the vnat daemon, over its control socket: it shows
what vnat has loaded and which connections it records, and chooses which
cgroups' connections vnat manages. It usually needs root, because the socket
is only open to its owner.

Examples:

    vnatctl status
    vnatctl ls --state translated
    vnatctl --json ls | jq '.[] | select(.proto == \"tcp\") | .virtual_remote'
    vnatctl enable --cgroup /sys/fs/cgroup/unified/system.slice/app.service
    vnatctl --control /run/vnat/ns1.sock status     # a second vnatd

With --json, results are printed to stdout as JSON; errors are printed to
stdout as {\"error\":{\"kind\":...,\"message\":...}} and, for people, to stderr.

Exit status: 0 success, 1 vnatd reported an error, 2 usage error,
3 vnatd cannot be reached.";

#[derive(Debug, Parser)]
#[command(name = "vnatctl", version, about = "Control vnatd, the vnat daemon.", long_about = LONG_ABOUT)]
pub struct Cli {
    /// vnatd's control socket.
    #[arg(long, global = true, value_name = "PATH", env = "VNAT_CONTROL", default_value = DEFAULT_CONTROL_PATH)]
    pub control: PathBuf,
    /// Print results (and errors) as JSON on stdout, for scripts.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// What vnatd has loaded and attached: cgroups, tc attachments, counts and counters.
    Status,
    /// The recorded connections with their virtual and physical endpoints.
    #[command(visible_alias = "list")]
    Ls {
        /// Only this protocol.
        #[arg(long, value_enum)]
        proto: Option<ProtoArg>,
        /// Only connections in this state (translated = moved and rewritten).
        #[arg(long, value_enum)]
        state: Option<StateArg>,
    },
    /// Start managing the connections of a cgroup v2 directory.
    Enable {
        /// cgroup v2 directory (relative paths are made absolute).
        #[arg(long, value_name = "DIR")]
        cgroup: PathBuf,
    },
    /// Stop recording new connections of a cgroup (translated ones keep working).
    Disable {
        /// cgroup v2 directory given to `enable`.
        #[arg(long, value_name = "DIR")]
        cgroup: PathBuf,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ProtoArg {
    Tcp,
    Udp,
}

impl From<ProtoArg> for Proto {
    fn from(p: ProtoArg) -> Proto {
        match p {
            ProtoArg::Tcp => Proto::Tcp,
            ProtoArg::Udp => Proto::Udp,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    Native,
    Translated,
}

impl From<StateArg> for ConnState {
    fn from(s: StateArg) -> ConnState {
        match s {
            StateArg::Native => ConnState::Native,
            StateArg::Translated => ConnState::Translated,
        }
    }
}
