//! `vnatd --help`'s long text: what vnatd does, the config file's keys and
//! what each setting means.

pub(super) const LONG_ABOUT: &str = "\
vnatd keeps this host's TCP and UDP connections alive when an endpoint moves
to another IP address (roaming, suspend and resume elsewhere, process
migration). eBPF programs record the connections of the enabled cgroups and
rewrite the packets of connections that moved; vnatd manages them and serves
vnatctl on its control socket.

Settings come from the config file, and flags override it. Paths given as
flags may be relative to the current directory; paths in the file must be
absolute.

Config file (every key optional; these are the defaults):

    control   = \"/run/vnat/vnatd.sock\"
    state_dir = \"/var/lib/vnat\"
    bpffs     = \"/sys/fs/bpf/vnat\"
    listen    = \"0.0.0.0:2031\"
    cgroups   = [\"/sys/fs/cgroup/unified\"]   # default: the cgroup2 mount root
    preempt_cgroups = []                     # see below
    hide_location_cgroups = []               # see below
    log_level = \"info\"                       # or a filter: \"info,vnat_daemon=debug\"
    log_format = \"text\"                      # or \"json\"
    location_servers = []                    # e.g. [\"192.0.2.7:2031\"]
    standby_tc = true                        # see below
    keepalive_secs = 25                      # 0: no NAT keepalives
    sleep_inhibit = true                     # see below
    peer_helpers = [\"zero-window\", \"hold\"] # see below
    helpers_dir = \"/etc/vnat/helpers\"

location_servers (or --location-server, repeatable) are other vnatd asked
where a peer went when both ends of a connection moved and neither old
location answers (paper section 3.3.2.1, steps P(3)/S(3)). Every vnatd
already serves as one: point both hosts of a connection at the same one.
A moving vnatd stores its new location there and looks the peer up from
the start of every move (one small datagram each way per 30 connections),
so two ends that moved at once find each other in one round trip to it.

keepalive_secs (or --keepalive-secs) is how often a host behind a NAT
probes each peer it holds mobile connections with, so that its NAT keeps
the mapping through which the peer's vnatd reaches it (to validate a new
address, to answer an update). The answers tell it where the peer sees it
(`vnatctl peers`, column NAT). 0 turns keepalives off; a host that is not
behind a NAT sends none.

preempt_cgroups (or --preempt-cgroup, repeatable) decides virtual-address
conflicts (paper section 3.4.3): when a connection would move (its own end,
or an import) onto the endpoints of another connection of this host, which
the kernel could not tell apart, the move is refused (abort, the default)
unless the moving connection's cgroup is one of these or below one; then
the older connection is reset (preempt). A peer's move onto such endpoints
is always refused.

hide_location_cgroups (or --hide-location-cgroup, repeatable) hide
location (paper section 3.4.1) for applications that compare addresses,
such as FTP: after a move, the applications of these cgroups (and of the
cgroups below) keep seeing the host that moved, this one or a peer, at its
old address in new connections and datagrams too, and their connections
and datagrams to that address reach it where it is now. Each is enabled
too unless one of `cgroups` is it or above it. `vnatctl enable --cgroup
DIR --hide-location` does the same at run time.

peer_helpers (or --peer-helper, repeatable; --peer-helper none for none)
are the keep-alive helpers this host runs when a peer about to be away
asks for them (`vnatctl suspend --helper NAME` on the peer): zero-window
answers for the absent end so that this host's TCP waits instead of giving
up; stop stops (SIGSTOP) this host's processes of the connection until the
peer is back (SIGCONT); hold keeps this host's packets of the connection
in its socket, unsent, until the peer is back or has moved, for at most
half of what this host's TCP would take to give up (3.75 s with the
default tcp_retries2); a peer whose process is about to be checkpointed by
CRIU asks for it, so that none of them is dropped by the frozen host. Any other name is an
installed helper: the
executable of that name in helpers_dir (--helpers-dir), which must belong to
root and be writable by nobody else. vnatd runs it as user nobody, with no
environment, the connection's socket as descriptor 3 and a JSON object on
its standard input ({\"event\": \"away\" or \"back\", \"proto\", \"local\",
\"remote\"}), and kills it after 10 s. A helper not listed is not
run.

standby_tc keeps the translators attached to every network interface while
this host has connections paired with a peer, so that a move does not wait
the 10 to 25 ms the kernel needs to attach them (an RCU grace period each,
on both hosts). While nothing is translated on the host they pass packets
without looking at them (about 20 ns a packet); once some connection moved,
every packet on those interfaces pays one map lookup (about 70 ns). With
standby_tc = false (or --no-standby-tc) they are attached only to the
interfaces moved connections use, and packets elsewhere pay nothing.

sleep_inhibit (or --no-sleep-inhibit) holds a logind delay inhibitor for
sleep on the system bus. When the host is about to sleep, vnatd does what
`vnatctl suspend --all` does while the network is still up, waits for the
peers to settle roles and keys, and releases the inhibitor at most one
second before logind's InhibitDelayMaxSec (5 s by default) runs out, even
if a peer never answers; at wake it resumes (`vnatctl resume --all`) and
takes a new inhibitor. Without a system bus or logind (containers) vnatd
says so once and leaves sleep to vnatctl suspend and resume.

Examples:

    # the whole host, default paths (what the systemd unit runs)
    vnatd

    # only one service's connections, verbose
    vnatd --cgroup /sys/fs/cgroup/unified/system.slice/app.service --log-level debug

    # a second instance for another network namespace: its own socket, state and pins
    vnatd --control /run/vnat/ns1.sock --state-dir /var/lib/vnat/ns1 --bpffs /sys/fs/bpf/vnat-ns1

    # both ends may move at once: ask the vnatd at 192.0.2.7 where the peer went
    vnatd --location-server 192.0.2.7:2031

Stopping vnatd (SIGTERM or Ctrl-C) leaves the eBPF programs and maps pinned,
so connections that moved keep being translated until vnatd starts again.

Exit status: 0 after a clean stop, 1 on a runtime error, 2 on a usage or
config error.";
