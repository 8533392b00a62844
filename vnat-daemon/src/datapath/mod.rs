//! The datapath manager: the only code in vnat that touches the kernel.
//!
//! Everything above it (the control API, the VCMP driver) talks to the
//! [`Datapath`] trait. [`kernel::KernelDatapath`] is the real one (eBPF maps,
//! cgroup and tc attachments, addresses on `lo`, host routes);
//! [`fake::FakeDatapath`] keeps the same state in memory for unit tests of the
//! logic above it.

use std::net::IpAddr;

pub mod fake;
pub mod kernel;
pub mod owner;
mod types;

pub use types::*;

/// A NAT guard dropped packets from `nat` to our `local` endpoint: the NAT
/// may have re-mapped a connection there (`Datapath::nat_guard_drops`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuardDrop {
    pub nat: IpAddr,
    pub local: std::net::SocketAddr,
    pub proto: Proto,
}

/// What the daemon can ask of the kernel.
///
/// Every mutating call is all-or-nothing: on error the kernel state is as it
/// was before the call.
pub trait Datapath {
    /// What is loaded, attached and pinned, with the counters.
    fn status(&self) -> Result<DatapathStatus, DatapathError>;

    /// Every recorded connection of this network namespace, translated or not.
    fn connections(&self) -> Result<Vec<ConnectionInfo>, DatapathError>;

    /// [`Datapath::connections`] without the owners (pid, command,
    /// cgroup), which cost a walk of /proc for connections whose owner the
    /// recorder could not see (accepted ones): what the daemon's periodic
    /// resync needs, at a cost that stays small with 100,000 connections.
    fn connections_without_owners(&self) -> Result<Vec<ConnectionInfo>, DatapathError>;

    /// After a listing: make the containers' connections it found ready
    /// to move (the kernel datapath pins their NAT entries, `guests.rs`).
    /// The daemon's resync calls it right after its listing, so that a
    /// connection is ready within a resync of being seen.
    fn settle_guests(&mut self) -> Result<(), DatapathError> {
        Ok(())
    }

    /// After a listing: note which addresses this host now has only where
    /// vnat keeps them (the kernel datapath sends what leaves untranslated
    /// from them into a sink, `kernel/gone.rs`). The daemon's resync calls
    /// it with `settle_guests`.
    fn note_interfaces(&mut self) -> Result<(), DatapathError> {
        Ok(())
    }

    /// Start recording the sockets of processes in this cgroup v2 directory.
    fn enable_cgroup(&mut self, path: &std::path::Path) -> Result<(), DatapathError>;

    /// Stop recording them (recorded connections and translations stay),
    /// and stop hiding location for them.
    fn disable_cgroup(&mut self, path: &std::path::Path) -> Result<(), DatapathError>;

    /// Hide location (`vnatctl enable --hide-location`) for the processes
    /// of this cgroup and its descendants, or stop: they see moved hosts,
    /// this one and its peers, at their virtual addresses also in new
    /// connections and datagrams (what [`Datapath::set_hidden`] says).
    /// Returns whether anything changed.
    fn set_hide_location(
        &mut self,
        path: &std::path::Path,
        on: bool,
    ) -> Result<bool, DatapathError>;

    /// The ids of the cgroups that hide location.
    fn hiding_cgroups(&self) -> Result<Vec<u64>, DatapathError>;

    /// Write what the hiding cgroups' applications are shown, and where
    /// they reach, for each moved address (computed by `daemon::hide`).
    fn set_hidden(&mut self, table: &HideTable) -> Result<(), DatapathError>;

    /// Install (or replace) the translation of one flow: forward and reverse
    /// NAT entries, the tc attachment on the interface that reaches the
    /// remote physical endpoint, the moved-away local virtual address on `lo`
    /// and the host route for a moved remote virtual address, together.
    fn install_translation(&mut self, t: &Translation) -> Result<(), DatapathError>;

    /// Whether the next [`Datapath::install_translation`] of `flow` sends
    /// to a peer address that is not validated yet: `Some(allowed)`, with
    /// `allowed` bytes it may send there to begin with, and from then on
    /// three times what comes from there (the anti-amplification budget,
    /// enforced per packet by the datapath) until an install without it
    /// (the address validated, or the last validated one back). `None`:
    /// unlimited, the default.
    fn limit_until_validated(&mut self, flow: &VirtualFlow, allowed: Option<u32>);

    /// Whether some of `flow`'s packets went to its last validated
    /// placement instead of the unvalidated address it sends to, for
    /// being over the allowance there: they were lost if the peer had
    /// left it, and TCP's retransmission timer backed off for them.
    fn diverted_while_unvalidated(&self, flow: &VirtualFlow) -> bool {
        let _ = flow;
        false
    }

    /// The peer sent its update for the unvalidated address `flow`
    /// already sends to again: its allowance starts again at `allowed`
    /// bytes (what an install with [`Datapath::limit_until_validated`]
    /// would give it), and nothing else changes (its placement, its
    /// fallback and its wait, what it diverted). Returns whether the flow
    /// had such an allowance; without one nothing changes.
    fn credit_unvalidated(
        &mut self,
        flow: &VirtualFlow,
        allowed: u32,
    ) -> Result<bool, DatapathError>;

    /// Phase one of a move: accept packets from the new physical endpoints
    /// (reverse entry, tc attachment, address on `lo`, host route) without
    /// sending from them yet; [`Datapath::install_translation`] completes it.
    ///
    /// Why two phases: if one end starts sending from (or to) the new
    /// address before the other end translates it, the other kernel finds no
    /// socket for the packet and answers with a reset that kills the
    /// connection. When both ends are receive-ready before either sends,
    /// no untranslated packet ever reaches a socket lookup.
    fn prepare_translation(&mut self, t: &Translation) -> Result<(), DatapathError>;

    /// Remove the translation of the flow whose virtual endpoints are given,
    /// undoing everything [`Datapath::install_translation`] set up for it
    /// that no other translation still needs.
    fn remove_translation(&mut self, flow: &VirtualFlow) -> Result<(), DatapathError>;

    /// Guard `flow`, whose peer is behind a NAT at `nat`, against that NAT
    /// re-mapping it (`vnat_common::natguard`): packets from `nat` to the
    /// connection's port that nothing owns, which our kernel would reset
    /// or take for a new peer's, are dropped and counted. Kept while the
    /// connection is recorded; a later call moves it to another address.
    fn guard_nat(&mut self, flow: &VirtualFlow, nat: IpAddr) -> Result<(), DatapathError>;

    /// The guards that dropped packets since the last call.
    fn nat_guard_drops(&mut self) -> Result<Vec<GuardDrop>, DatapathError>;

    /// The installed translations.
    fn translations(&self) -> Result<Vec<Translation>, DatapathError>;

    /// Every flow the NAT maps hold an entry for: translated, prepared
    /// (receive side only) or held. Those whose socket is gone are what a
    /// vnatd that died left behind, for the next one to remove.
    fn flows_with_entries(&self) -> Result<Vec<VirtualFlow>, DatapathError>;

    /// Hold (`true`) or release the send side of a flow whose own end is
    /// moving: while held, every packet it sends is dropped before it
    /// leaves, which its socket takes as a failed transmission (the data
    /// stays queued, as with no route). From the start of a move until the
    /// peer sends to the new address: anything that left earlier would
    /// reach a peer that still answers at the old address. Installing or
    /// removing the flow's translation releases it too. A hold ends by
    /// itself in the datapath after the mover's `HOLD_LIMIT`, should vnatd
    /// not get round to releasing it.
    fn hold_send_side(&mut self, flow: &VirtualFlow, hold: bool) -> Result<(), DatapathError>;

    /// [`Datapath::hold_send_side`] with a limit of its own (the "hold"
    /// helper's, for its peer). A flow already held keeps the later end.
    fn hold_send_side_for(
        &mut self,
        flow: &VirtualFlow,
        limit: std::time::Duration,
    ) -> Result<(), DatapathError> {
        let _ = limit;
        self.hold_send_side(flow, true)
    }

    /// Release every held send side (at start: what held them was a vnatd
    /// that is gone, and a new move holds again). Returns how many.
    fn release_held(&mut self) -> Result<usize, DatapathError>;

    /// Addresses configured on this host's interfaces other than `lo` (the
    /// addresses a moved connection could use), with the interface index.
    fn interface_addresses(&self) -> Result<Vec<(IpAddr, u32)>, DatapathError>;

    /// The source address a connection to `dst` would move to: the one the
    /// kernel would use, if it has a route and the address is on the
    /// interface that route leaves by (or the route names it as its own
    /// source). An address the kernel borrows from another interface,
    /// while the route's own has none, is no place to move to.
    fn source_address_for(&self, dst: IpAddr) -> Result<Option<IpAddr>, DatapathError>;

    /// Periodic housekeeping (the daemon calls it every few seconds):
    /// complete UDP records whose socket was unbound at connect(), drop
    /// UDP records whose socket is gone and the records of adopted TCP
    /// connections that closed, and look for connections of the enabled
    /// cgroups that have no record, to adopt them: at the first call, then
    /// once a minute (and at once when a cgroup is enabled).
    fn maintain(&mut self) -> Result<(), DatapathError>;

    /// Restart the data flow of a TCP connection whose socket on this host
    /// backed off its retransmission or probe timer during an outage, so
    /// that it sends now instead of at the next backed-off expiry (tens of
    /// seconds after a long outage). Call it once the flow's translation is
    /// installed on both hosts, on both hosts: each end's socket may be
    /// backed off.
    ///
    /// Does nothing to a socket that is not backed off, or to a UDP flow.
    fn restart_flow(&mut self, flow: &VirtualFlow) -> Result<RestartOutcome, DatapathError>;

    /// Make the TCP socket of `flow` on this host send one ACK now, through
    /// the flow's current translation. Call it when the peer's address
    /// changed: the ACKs this socket sent during the move went to the old
    /// address, and until one arrives the peer's socket may sit on a full
    /// congestion window waiting for its retransmission timer (200 ms at
    /// least). Returns whether an ACK was solicited (false for UDP, for a
    /// socket that is not established).
    fn solicit_ack(&mut self, flow: &VirtualFlow) -> Result<bool, DatapathError>;

    /// Turn the TCP keepalive of `flow`'s socket off (`hold`) or on again,
    /// while its host is away (`vnatctl suspend`): unanswered keepalive
    /// probes would otherwise kill the connection the suspension carries.
    /// Returns whether it was changed (holding: whether it was on).
    fn hold_keepalive(&mut self, flow: &VirtualFlow, hold: bool) -> Result<bool, DatapathError>;

    /// Whether `flow`'s TCP socket waits for its peer now (probes out,
    /// retransmissions): how vnatd notices, without being told, that a
    /// paired host went silent (issue 32).
    fn peer_silence(&mut self, flow: &VirtualFlow) -> Result<PeerSilence, DatapathError>;

    /// Answer for this host's absent peer on `flow` (the zero-window
    /// helper, `vcmp::help`): deliver to the local TCP socket, as from the
    /// peer, an ACK of what the peer last acknowledged with a window of
    /// `window` bytes. With 0 the socket waits in persist mode, probing,
    /// where it would retransmit until it gave up; it survives as long as
    /// such ACKs come. Nothing is delivered if the socket's counters are
    /// not `unless_moved_from` (the peer was heard from since; counters no
    /// socket can have make this a reading only).
    fn answer_for_peer(
        &mut self,
        flow: &VirtualFlow,
        window: u32,
        unless_moved_from: Option<(u64, u64)>,
    ) -> Result<PeerAnswer, DatapathError>;

    /// Set TCP_USER_TIMEOUT (milliseconds; 0: the kernel's default, from
    /// `tcp_retries2`) of `flow`'s socket, and return the value it had
    /// (`None`: no such TCP socket or owner here). The zero-window helper
    /// holds it high while it answers for an absent peer: a socket that
    /// retransmitted before the window closed counts the whole absence
    /// against `tcp_retries2` once the window opens again.
    fn set_user_timeout(
        &mut self,
        flow: &VirtualFlow,
        ms: u32,
    ) -> Result<Option<u32>, DatapathError>;

    /// A duplicate of `flow`'s socket, taken from the process that holds
    /// it (for an installed keep-alive helper, which gets that connection
    /// and nothing else); `None` if there is no such socket or owner.
    fn connection_socket(
        &mut self,
        flow: &VirtualFlow,
    ) -> Result<Option<std::os::fd::OwnedFd>, DatapathError>;

    /// The process that holds `flow`'s TCP socket now: the one recorded at
    /// connect() if it still holds the socket (checked by its inode in the
    /// process's descriptors), else the first found holding it. `None` if
    /// there is no such socket or holder. A pid recorded at connect() alone
    /// proves nothing: the process may have handed the socket on, or died
    /// and its pid gone to another process.
    fn socket_holder(&mut self, flow: &VirtualFlow) -> Result<Option<u32>, DatapathError>;

    /// Reset the connection `flow` of this host (SOCK_DESTROY: its
    /// application sees ECONNABORTED, a TCP peer gets a reset), for a
    /// conflict whose policy is to preempt it. Returns false if no such
    /// socket exists.
    fn reset_connection(&mut self, flow: &VirtualFlow) -> Result<bool, DatapathError>;

    /// Keep the tc translators attached to exactly these interfaces besides
    /// the ones translations use (the `standby_tc` setting); an empty list
    /// returns to attaching only where used.
    fn set_standby(&mut self, ifindexes: &[u32]) -> Result<(), DatapathError>;

    /// Keep the addresses `mobile` (those of the mobile connections)
    /// local, with a last-resort route for packets from them: when one
    /// vanishes from its interface, its connections' sends then fail
    /// neither for a source that is no longer local nor for a missing
    /// route until vnatd has moved them. Addresses kept before are
    /// released when neither in `mobile` nor in `in_use` (the addresses of
    /// every tracked connection: after a restart, its connections are
    /// tracked before pairing makes them mobile again), unless a
    /// translation keeps them on `lo`. Called again with the same sets
    /// after a route change, it renews the IPv6 last-resort route, which
    /// IPv6 sockets that sent while there was no route keep cached.
    fn keep_local(&mut self, mobile: &[IpAddr], in_use: &[IpAddr]) -> Result<(), DatapathError>;

    /// Divert in-band BINDs coming from `toward` to vnatd's VCMP port
    /// `vcmp_port` (see `vnat_common::BIND_LEN`): a paired host behind NAT
    /// is about to send one on its UDP flow, and no application may
    /// receive it. Returns once the divert is in place.
    fn divert_binds(&mut self, toward: IpAddr, vcmp_port: u16) -> Result<(), DatapathError>;

    /// Send `payload` as one UDP datagram from `local` to `remote`, the
    /// physical endpoints of one of our UDP flows, with our own headers, so
    /// that it crosses a NAT exactly as the flow's datagrams do (an in-band
    /// BIND; the flow's socket belongs to the application).
    fn send_in_band(
        &mut self,
        local: std::net::SocketAddr,
        remote: std::net::SocketAddr,
        payload: &[u8],
    ) -> Result<(), DatapathError>;

    /// Our BIND request for the rebinding TCP connection `flow` carries a
    /// nonce whose token (`vnat_vcmp::crypto::tcp_bind_token`) is `token`:
    /// its peer's TCP BIND may carry it (or the previous one) from now on.
    /// `Ok(false)`: the connection is not rebinding (any more).
    fn expect_tcp_bind(
        &mut self,
        flow: &VirtualFlow,
        token: [u8; 8],
    ) -> Result<bool, DatapathError>;

    /// Send a TCP BIND carrying `token` on our TCP connection `flow`'s path:
    /// a pure ACK from `local` to `remote` (its physical endpoints), with the
    /// socket's own sequence numbers, so that it crosses a NAT exactly as
    /// the connection's segments do (see `vnat_common::TCP_BIND_OPT`).
    fn send_tcp_bind(
        &mut self,
        flow: &VirtualFlow,
        local: std::net::SocketAddr,
        remote: std::net::SocketAddr,
        token: [u8; 8],
    ) -> Result<(), DatapathError>;

    /// Deliver to vnatd the UDP datagrams to `vcmp_port` of exactly these
    /// addresses of routed containers (a peer's PROVE that this host
    /// receives at a guest's address, `vnat_vcmp` `proof`), which would
    /// otherwise be forwarded to the guest; none for the others.
    fn receive_vcmp_at(
        &mut self,
        addrs: &std::collections::BTreeSet<std::net::IpAddr>,
        vcmp_port: u16,
    ) -> Result<(), DatapathError>;

    /// The calls up to [`Datapath::end_batch`] are one batch of work, made
    /// by one thread in one go (one trip of vnatd's driver to the
    /// datapath, milliseconds long): the datapath may answer a route lookup
    /// it made earlier in the batch from memory, and skip setting a route
    /// it already set, which is most of the cost of moving thousands of
    /// connections to one peer. Its own changes drop what it remembered; a
    /// change made by someone else during the batch is seen by the next one
    /// (vnatd resyncs on every change).
    fn begin_batch(&mut self);

    /// Forget what [`Datapath::begin_batch`] let the datapath remember.
    fn end_batch(&mut self);

    /// What vnatd does after it translated a TCP connection: the levers of
    /// [`Datapath::restart_flow`] for a backed-off socket, and
    /// [`Datapath::solicit_ack`] if `peer_moved`, sending each message
    /// without waiting to see the socket act (a move of thousands of
    /// connections cannot wait per connection). Returns what was sent.
    fn kick_flow(&mut self, flow: &VirtualFlow, peer_moved: bool) -> Result<Kick, DatapathError>;

    /// vnatd is stopping cleanly: put the sysctls vnat changed back to
    /// the values they had before, unless an address vnat keeps on `lo`
    /// still needs them (see [`SysctlsAtStop::Kept`]).
    fn restore_sysctls(&mut self) -> Result<SysctlsAtStop, DatapathError>;
}

/// The verified restart levers: [`Datapath::restart_flow`] (which watches
/// the socket act), then, if the peer moved, [`Datapath::solicit_ack`] in
/// any case: what the peer retransmitted may have reached us before our
/// send side switched, and our ACK of it went to its old address. Returns
/// what was done.
pub fn restart_verified<D: Datapath + ?Sized>(
    dp: &mut D,
    flow: &VirtualFlow,
    peer_moved: bool,
) -> Result<Restarted, DatapathError> {
    let restarted = dp.restart_flow(flow);
    let ack_solicited = if peer_moved {
        Some(dp.solicit_ack(flow)?)
    } else {
        None
    };
    Ok(Restarted {
        outcome: restarted?,
        ack_solicited,
    })
}
