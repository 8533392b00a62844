//! vnatctl's command line.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use vnat_control::{
    datapath::{ConnState, Proto},
    DEFAULT_CONTROL_PATH,
};

const LONG_ABOUT: &str = "\
vnatctl talks to vnatd, the vnat daemon, over its control socket: it shows
what vnat has loaded and which connections it records, chooses which
cgroups' connections vnat manages, and drives planned moves. It usually needs
root, because the socket is only open to its owner.

vnatd moves connections by itself when the host's address changes (automatic
mode), and before the host sleeps it settles every mobile connection with its
peer through logind (sleep_inhibit), so closing the lid needs no command.
Where no logind runs, or for another move you plan, run `vnatctl suspend
--all` before and `vnatctl resume --all` after: the peers then agree fresh
keys and roles in advance, and the connections move as soon as you resume
instead of when vnatd notices the new address.

Examples:

    vnatctl status
    vnatctl ls --state translated
    vnatctl --json ls | jq '.[] | select(.proto == \"tcp\") | .virtual_remote'
    vnatctl enable --cgroup /sys/fs/cgroup/unified/system.slice/app.service
    vnatctl suspend --all     # before a planned move (vnatd does it before sleep)
    vnatctl resume --all      # after it
    vnatctl resume --all --wait --timeout 10s  # ... and wait for each move's outcome
    vnatctl monitor           # moves and pairings as they happen (--json: an object a line)
    vnatctl peers
    vnatctl export --pid 4242 --to NEWKEY --output conns.json  # before checkpointing 4242
    vnatctl import --from OLDKEY conns.json          # on the host it is restored on
                                                     # (NEWKEY, OLDKEY: `vnatctl status`, host key)
    vnatctl criu-hook                                # run by CRIU (--action-script): see criu-hook --help
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
    /// What vnatd has loaded and attached: cgroups, tc attachments, counts and counters,
    /// where it keeps locations and whether etcd answers.
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
    #[command(long_about = ENABLE_ABOUT)]
    Enable {
        /// cgroup v2 directory (relative paths are made absolute).
        #[arg(long, value_name = "DIR")]
        cgroup: PathBuf,
        /// Its applications keep seeing moved hosts at their old addresses, in new connections too (FTP).
        #[arg(long, conflicts_with = "no_hide_location")]
        hide_location: bool,
        /// Stop hiding location for it (the default for a cgroup enabled without --hide-location).
        #[arg(long)]
        no_hide_location: bool,
    },
    /// Stop recording new connections of a cgroup (translated ones keep working).
    Disable {
        /// cgroup v2 directory given to `enable`.
        #[arg(long, value_name = "DIR")]
        cgroup: PathBuf,
    },
    /// Prepare connections for a planned move: agree roles and fresh keys with their peers now.
    #[command(long_about = SUSPEND_ABOUT)]
    Suspend {
        #[command(flatten)]
        select: SelectArgs,
        /// Ask the peers to keep the connections alive while this host is away: zero-window, stop, hold; repeatable.
        #[arg(long = "helper", value_name = "NAME", value_parser = helper_name)]
        helpers: Vec<String>,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// After a planned move: re-read the host's addresses now and move the connections that lost theirs.
    #[command(long_about = RESUME_ABOUT)]
    Resume {
        #[command(flatten)]
        select: SelectArgs,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Move connections to another local address or interface while the current one stays up.
    #[command(long_about = MIGRATE_ABOUT)]
    Migrate {
        #[command(flatten)]
        select: SelectArgs,
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// The peer hosts vnatd has paired with: address, pinned key, connections, mobile connections.
    #[command(long_about = PEERS_ABOUT)]
    Peers {
        #[command(subcommand)]
        action: Option<PeersAction>,
    },
    /// Hand connections over to another host (with a checkpointed process); prints their keys.
    #[command(long_about = EXPORT_ABOUT)]
    Export {
        #[command(flatten)]
        select: SelectArgs,
        /// Write the export to FILE (created with mode 0600; must not exist) instead of stdout.
        #[arg(long, short, value_name = "FILE")]
        output: Option<PathBuf>,
        /// Seal the export for the host with this key (64 hex digits, the `host key`
        /// `vnatctl status` shows there): only that host can import it [default: this host].
        #[arg(long, value_name = "KEY")]
        to: Option<String>,
    },
    /// Take over connections exported by another vnatd (`vnatctl export`).
    #[command(long_about = IMPORT_ABOUT)]
    Import {
        /// The file `vnatctl export` wrote, or - for stdin.
        #[arg(value_name = "FILE")]
        file: PathBuf,
        /// The key of the host that exported it (its `vnatctl status`), which must
        /// have sealed it for this host [default: this host].
        #[arg(long, value_name = "KEY")]
        from: Option<String>,
        #[command(flatten)]
        wait: WaitArgs,
    },
    /// Print move and pairing events as they happen, until interrupted.
    #[command(long_about = MONITOR_ABOUT)]
    Monitor,
    /// CRIU's action script: export a dumped process's connections, import them before its restore.
    #[command(long_about = CRIU_HOOK_ABOUT)]
    CriuHook {
        /// At post-dump: seal the export for the host with this key, where the
        /// process will be restored (64 hex digits, its `vnatctl status` host key).
        #[arg(long, value_name = "KEY", env = "VNAT_CRIU_TO")]
        to: Option<String>,
        /// At pre-restore: the key of the host that dumped the process, which
        /// must have sealed the export (required: the key the export names
        /// is its writer's own claim).
        #[arg(long, value_name = "KEY", env = "VNAT_CRIU_FROM")]
        from: Option<String>,
        /// At post-dump: delete CRIU's network lock of the exported
        /// connections on this host this many seconds after the export (the
        /// peers send to the new host by then); 0 leaves it in place.
        #[arg(long, value_name = "SECS", env = "VNAT_CRIU_UNLOCK_AFTER",
              default_value_t = crate::criu_lock::UNLOCK_AFTER_DEFAULT_SECS)]
        unlock_after: u64,
    },
    /// Write the man page or a shell completion to stdout (for packaging).
    #[command(hide = true)]
    Generate {
        #[arg(value_enum)]
        what: Generate,
    },
}

/// What `vnatctl generate` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Generate {
    /// vnatctl(8).
    Man,
    Bash,
    Zsh,
    Fish,
}

/// `--wait [--timeout DURATION]` of the commands that move connections.
#[derive(Clone, Debug, PartialEq, Eq, Args)]
pub struct WaitArgs {
    /// Return once each affected connection has an outcome, print it, and exit with status 1 if any failed or timed out.
    #[arg(long)]
    pub wait: bool,
    /// With --wait: stop waiting after this long (500ms, 10s, 2m; a plain number is seconds).
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = crate::wait::parse_duration, requires = "wait")]
    pub timeout: std::time::Duration,
}

impl WaitArgs {
    /// How long to wait, if --wait was given.
    pub fn limit(&self) -> Option<std::time::Duration> {
        self.wait.then_some(self.timeout)
    }
}

const MONITOR_ABOUT: &str = "\
Print vnatd's move and pairing events as they happen, one line each, until
interrupted (Ctrl-C) or vnatd stops: each move's start (this host's end or
the peer's, from and to, the peer) and end (moved, with its handover time
from start until both ends translate; or failed, with the reason), each
planned suspension settled or not, each pairing with a peer host.

With --json, each event is one JSON object on its own line, with the fields
event (move_started, move_ended, suspend_ended, paired, lost), time_ms
(milliseconds since the Unix epoch), id, proto, side (local or peer), from,
to, peer (the host key), peer_address, and for an ended move outcome (moved
or failed) with handover_ms or reason; docs/monitor.md describes them.

vnatd never waits for a monitor: one that reads too slowly loses the oldest
events and is told how many (a lost event with count). Like every command,
monitor needs access to the control socket (root): it shows nothing `ls`
would not.

Examples:

    vnatctl monitor
    vnatctl --json monitor | jq -c 'select(.event == \"move_ended\")'
    vnatctl --json monitor > moves.log &   # a record of every move";

/// Where `migrate` moves connections: exactly one of these.
#[derive(Clone, Debug, PartialEq, Eq, Args)]
#[group(id = "target", required = true, multiple = false)]
pub struct TargetArgs {
    /// This local address (a global address of one of the host's interfaces).
    #[arg(long, value_name = "ADDR")]
    pub to: Option<std::net::IpAddr>,
    /// The interface's address of each connection's family (IPv4 or IPv6).
    #[arg(long, value_name = "IFACE")]
    pub dev: Option<String>,
}

/// Which connections a command is about: exactly one of these.
#[derive(Clone, Debug, PartialEq, Eq, Args)]
#[group(id = "selector", required = true, multiple = false)]
pub struct SelectArgs {
    /// Every connection vnatd records.
    #[arg(long)]
    pub all: bool,
    /// Connections by the ID column of `vnatctl ls` (several: --conn 1 --conn 2, or --conn 1 2).
    #[arg(long = "conn", value_name = "ID", num_args = 1..)]
    pub conn: Vec<u64>,
    /// Connections owned by this process.
    #[arg(long, value_name = "PID")]
    pub pid: Option<u32>,
    /// Connections of processes in this cgroup v2 directory or below it (relative paths are made absolute).
    #[arg(long, value_name = "DIR")]
    pub cgroup: Option<PathBuf>,
}

/// `--helper NAME`: a name the wire can carry (see `vcmp::help`).
fn helper_name(s: &str) -> Result<String, String> {
    vnat_control::vcmp::help::Help::from_names(&[s.to_string()]).map(|_| s.to_string())
}

const ENABLE_ABOUT: &str = "\
Start managing the connections of a cgroup v2 directory and of every cgroup
below it: vnat records their TCP and UDP connections (those open already
too) so that they survive a move of this host or of their peer.

--hide-location (paper section 3.4.1) is for applications that compare
addresses, such as FTP: after a move, the applications of the cgroup keep
seeing the host that moved, this one or a peer, at the address it had
before, in new connections and datagrams too. accept(), getpeername() and
recvmsg() show a moved peer's old address, getsockname() this host's; a
connect() or sendto() to a moved peer's old address reaches it where it is
now, and a bind() to this host's old address binds where its connections
went. Without it, new connections show the true addresses, as TCP and UDP
always do. An FTP server needs it for passive mode; active mode needs it on
both hosts. Given again without either flag, `enable` leaves the setting as
it was; --no-hide-location turns it off. vnatd refuses to hide location for
a cgroup that holds vnatd itself (its own VCMP socket must see true
addresses): name the application's own cgroup. A cgroup below one that is
enabled already only has its hiding set; `disable` stops it.

Examples:
  vnatctl enable --cgroup /sys/fs/cgroup/system.slice/vsftpd.service --hide-location
  vnatctl enable --cgroup /sys/fs/cgroup/system.slice/vsftpd.service --no-hide-location";

const SUSPEND_ABOUT: &str = "\
Prepare connections for a planned move (paper section 3.3.1): this host claims
the primary role and agrees fresh keys with each peer's vnatd, while both
hosts can still reach each other. Optional: a move without it works too, but
a suspend makes the resume faster and its keys fresh.

Only connections whose peer runs vnatd can move (`vnatctl ls` shows them as
mobile); the others are listed as skipped. It is an error if none can move.

Choose the connections with exactly one of --all, --conn ID..., --pid PID or
--cgroup DIR. A selector that matches no connection is an error and changes
nothing.

While this host is away, the connections' TCP keepalives are held (turned
off) until each connection works again. --helper NAME also asks each peer's
vnatd to keep its end alive meanwhile, if the peer allows it (its
peer_helpers setting):
  zero-window  answer for this host with a zero window, so that the peer's
               TCP waits (window probes) instead of retransmitting until it
               gives up (after net.ipv4.tcp_retries2 tries, about 15 minutes
               by default); the window reopens when this host is back
  stop         stop (SIGSTOP) the peer's process of the connection until
               this host is back (SIGCONT)
  hold         hold the peer's packets of the connection in its socket
               (not sent, so none is lost on the way) until this host is
               back or has moved, for at most half of what the peer's
               TCP would take to give up (3.75 s by default): for a host
               about to freeze (vnatctl criu-hook asks for it before a
               checkpoint)
The peers are told this host is back once each connection works again (a
resume, or a move by automatic mode).

With --wait, suspend returns once each peer has agreed the roles and keys
(settled) or given up (not_settled, with the reason), or at --timeout.

Examples:

    vnatctl suspend --all
    vnatctl suspend --all --wait
    vnatctl suspend --all --helper zero-window
    vnatctl suspend --conn 48211 --conn 9120
    vnatctl --json suspend --cgroup /sys/fs/cgroup/system.slice/app.service";

const RESUME_ABOUT: &str = "\
After a planned move: vnatd re-reads the host's addresses now, and every
connection whose address is gone continues from the address the host now
uses towards its peer; both vnatds update their translations. Automatic mode
does the same when it notices the change, so resume is harmless when the
connections have moved already (it then reports 0 moves started).

vnatd moves every connection that lost its address; the selector names the
connections you expect to move and must match at least one. Choose exactly
one of --all, --conn ID..., --pid PID or --cgroup DIR.

vnatctl resume --all --wait waits for the moves under way once the host's
addresses are read, whoever started them (automatic mode often does first).

With --wait, the command returns once every connection it affected has an
outcome, or at --timeout (30s by default; 500ms, 10s, 2m), and prints each
one's: moved (with its handover time), not_moved (with the reason),
still_moving (the timeout came first) or closed. The exit status is 1 if
any did not end well. On a terminal, a wait longer than a second shows its
progress on stderr. Nothing that ends between the command and the wait is
missed: vnatctl subscribes to vnatd's events (`vnatctl monitor`) before it
sends the command.

Examples:

    vnatctl resume --all
    vnatctl resume --all --wait --timeout 10s
    vnatctl --json resume --pid 4242";

const MIGRATE_ABOUT: &str = "\
Move connections to another address of this host while their current one
stays up: a laptop with Wi-Fi and a wired or cellular link moves a download
or an ssh session from one to the other. The peer's vnatd validates the new
address as for any move; the application notices nothing. Packets then leave
through the new address's interface, by the best route through it (the host
needs one there, such as a second default route with a higher metric, which
NetworkManager and systemd-networkd add for every link). vnatd leaves the
connection there while that address exists, also when the old one is still
up; if the new address goes away, the connection moves on as any other.
Migrating to the connection's original (virtual) address takes it back.

Choose the connections with exactly one of --all, --conn ID..., --pid PID or
--cgroup DIR, and the place with --to ADDR or --dev IFACE (its address of
each connection's family; an IPv4 connection also goes to an IPv6 address
when the place has no IPv4 one, carried over IPv6 if its peer told an IPv6
address in `vnatctl peers`). Only connections whose peer runs vnatd can move
(`vnatctl ls` shows them as mobile); the others are listed as skipped. It is
an error if none moves.

Without --wait, migrate returns once the moves started; `vnatctl ls` shows
each as `moving` in its STATE column until it completes.

With --wait, the command returns once every connection it affected has an
outcome, or at --timeout (30s by default; 500ms, 10s, 2m), and prints each
one's: moved (with its handover time), not_moved (with the reason),
still_moving (the timeout came first) or closed. The exit status is 1 if
any did not end well. On a terminal, a wait longer than a second shows its
progress on stderr. Nothing that ends between the command and the wait is
missed: vnatctl subscribes to vnatd's events (`vnatctl monitor`) before it
sends the command.

Examples:

    vnatctl migrate --conn 48211 --dev eth0 --wait
    vnatctl migrate --all --to 192.0.2.7
    vnatctl --json migrate --pid 4242 --dev wwan0 --wait --timeout 30s";

const PEERS_ABOUT: &str = "\
The hosts whose vnatd this one has paired with, one row per host key: KEY is
the host's x25519 key (hex; kept in peers.json in vnatd's state directory),
ADDRESS where it last paired from, CONNECTIONS the connections bound to it
and MOBILE how many of them have keys and so can move. A row without a key
counts connections at that address that no paired host has claimed yet.
`--json` also lists the `addresses` each host told (in its keepalives):
where its IPv4 connections continue over IPv6 when this host has no IPv4.

A peer is its key, never its address: several hosts behind one NAT are
several rows, and a host that gets another's old address (DHCP) is a new
row with only its own connections. A connection belongs to the host that
proved it holds the other end (its TCP initial sequence numbers) and stays
with that key for life. If a peer's vnatd is reinstalled with a new key, its
live connections stay bound to the old key (vnatd logs a claim conflict):
`vnatctl peers forget OLDKEY` releases them to the new key.

Examples:

    vnatctl peers
    vnatctl --json peers | jq '.[] | select(.mobile > 0) | .address'
    vnatctl peers forget 3f1c...e9 (the 64 hex digits of the old key)";

/// `vnatctl peers ACTION`.
#[derive(Subcommand, Debug)]
pub enum PeersAction {
    /// Forget a peer host key: its pairing, and its hold on its connections, which the host now at their address can then claim.
    #[command(long_about = FORGET_ABOUT)]
    Forget {
        /// The host key to forget: 64 hex digits, as `vnatctl peers` shows it.
        key: String,
    },
}

const FORGET_ABOUT: &str = "\
Forget a peer host key. vnatd drops its pairing and removes it from
peers.json; the connections bound to it stop being mobile and are claimed
again by whichever paired host proves it holds them (a reinstalled peer's
new key). Use it after reinstalling a peer, or to revoke a key.

Example:

    vnatctl peers forget 3f1c...e9";

const EXPORT_ABOUT: &str = "\
Hand connections over to another host, for a process that is checkpointed
here and restored there: prints (or writes to --output) a JSON document with
each connection's VCMP state, its keys included, and its current translation.
This vnatd forgets the connections' keys: export just before the checkpoint.

The export holds the connections' secret keys: whoever has it can move the
connections. With --output FILE it is written to a new file of mode 0600;
keep it with the same care as the process image, and delete it after the
import. Only mobile connections (`vnatctl ls`) can be exported; if any
selected one cannot, nothing is exported.

The export is sealed for one host, the one named by --to (this host by
default): a MAC under a key only this host and that one can derive. That
host imports it with --from naming this host, and refuses it if anything in
it changed. The seal authenticates the file; it does not encrypt it: the
keys in it are readable by whoever can read the file.

Choose exactly one of --all, --conn ID..., --pid PID or --cgroup DIR.

Examples:

    vnatctl export --pid 4242 --output /root/app-conns.json   # restored on this host
    vnatctl export --pid 4242 --to 5f2c...e1 --output /root/app-conns.json
    vnatctl export --conn 48211 --to NEWKEY | ssh root@new-host vnatctl import --from OLDKEY -";

const IMPORT_ABOUT: &str = "\
Take over connections that another vnatd exported (`vnatctl export`), just
before their process is restored on this host. Each connection whose address
is not one of this host's continues from the address this host uses towards
the peer: vnatd prepares that address at once and moves the connection (the
peer's vnatd is updated, as after a move) as soon as the restored socket
appears. All of the file is imported or nothing is.

The file must be sealed for this host (`vnatctl export --to` this host's key,
shown by `vnatctl status`) by the host --from names (this host by default);
an unsealed, edited or forged file is refused and nothing changes.

With --wait, import returns once each imported connection that moves has
moved, or at --timeout. Such a move needs the restored socket, so run the
restore while import waits (in the background, or from a CRIU hook).

Examples:

    vnatctl import /root/app-conns.json
    vnatctl import --wait --timeout 1m /root/app-conns.json & criu restore ...; wait
    vnatctl import --from 9a41...07 /root/app-conns.json
    ssh root@old-host vnatctl export --pid 4242 --to $(vnatctl --json status | jq -r .vcmp.host_key) \\
        | vnatctl import --from OLD-HOST-KEY -";

const CRIU_HOOK_ABOUT: &str = "\
Move a process with its live connections to another host with CRIU
(https://criu.org, 4.2 or later). CRIU runs this as its action script: at
post-dump (the process is dumped and still frozen) it exports the
connections of the dumped process tree, sealed for the target host, into
vnat-connections.json (mode 0600) in the images directory, so whatever
carries the images carries them too; at pre-restore on the target it
imports that file, which puts each connection's old address in place so the
restored sockets can bind to it, and vnatd moves them (the peers' vnatd are
updated) as soon as they are restored. Before that, at pre-dump (the
process still runs), it asks the peers' vnatd to hold their packets of those
connections in their sockets until the connections have moved (the hold
helper, which peers allow by default), and waits up to a second for them to
confirm: nothing they send then meets the frozen process's host, whose
network lock would drop it (if the dump fails after that, they hold them
for a few seconds at most). Other actions do nothing. If a connection of
the process cannot move, or vnatd is not running, the hook exits non-zero at
pre-dump or post-dump: CRIU then aborts the dump and the process runs on
here with its connections.

CRIU runs an action script without arguments, so give it a two-line wrapper
that sets what it needs:

    #!/bin/sh
    exec vnatctl criu-hook      # add --control PATH for a vnatd with another socket

Dump side (VNAT_CRIU_TO: the target host's key, `vnatctl status` there):

    VNAT_CRIU_TO=5f2c...e1 criu dump -t PID -D /srv/img --tcp-established \\
        --network-lock nftables --action-script /usr/local/lib/vnat/criu-hook

Then carry /srv/img to the target (the export inside holds the connections'
keys: keep the images as secret as the process's memory). Restore it there
into a cgroup vnatd manages, so that vnatd records the restored sockets: run
criu from that cgroup and let the tree inherit it (--manage-cgroups=ignore),
or map the dumped cgroup onto it with --cgroup-root. VNAT_CRIU_FROM is
the dumping host's key, which the export's seal must match (the key the
export names proves nothing: whoever wrote the images can name their own):

    echo $$ > /sys/fs/cgroup/app.slice/cgroup.procs
    VNAT_CRIU_FROM=9a41...07 criu restore -D /srv/img -d --tcp-established \\
        --manage-cgroups=ignore --action-script /usr/local/lib/vnat/criu-hook

At pre-restore the hook imports the connections (their old address goes
on lo here, for the restored sockets to bind to); at post-restore it asks
vnatd to move them at once. The old host keeps CRIU's network lock (an
nftables table inet CRIU-...) after the dump: it drops the peers' packets
there instead of resetting them until they send to the target. The hook
deletes it --unlock-after seconds (30) after the export, by then no longer
needed; a peer whose connection did not move then gets a reset rather than
silence for the minutes its TCP would retry. A table that locks anything
else than the exported connections is left alone.

Environment: VNAT_CRIU_TO (or --to), VNAT_CRIU_FROM (or --from),
VNAT_CRIU_UNLOCK_AFTER (or --unlock-after),
VNAT_CONTROL (or --control), and CRIU's CRTOOLS_SCRIPT_ACTION,
CRTOOLS_IMAGE_DIR, CRTOOLS_INIT_PID.";

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
