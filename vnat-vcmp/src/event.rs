//! What the protocol core reports: events for the datapath and the control
//! API, abort reasons, and the errors of its commands.

use std::net::{IpAddr, SocketAddr};

use super::location::Step;
use super::roles::Role;
use super::wire;
use crate::flow::VirtualFlow;

/// Why a migration was given up.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AbortReason {
    #[error(
        "the peer's location could not be determined: no answer to queries or stores at {tried:?}"
    )]
    LocationUnknown { tried: Vec<SocketAddr> },
    #[error("stored our location {rounds} times but the peer never arrived")]
    PeerNeverArrived { rounds: u32 },
}

/// Outputs for the datapath and the control API.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Translate `flow` to the remote physical endpoint `remote`: the peer
    /// moved there and proved that it receives there.
    SetRemote {
        flow: VirtualFlow,
        remote: SocketAddr,
    },
    /// A peer announced, in an authenticated update, that `flow`'s remote
    /// end is now at `remote`, which is still being validated: make the
    /// receive side ready for packets from there to our physical `local`
    /// now (only sending waits for validation), before anything the core
    /// queued with this event leaves, since that may let the peer send.
    /// Emitted again with our new `local` if our own end moves meanwhile.
    /// Never dropped for a full event queue. `remote` with port 0: the
    /// peer's port behind a NAT is not known yet; for a UDP flow that may
    /// have entered one (`ConnectionView::nat_candidate`), drop its
    /// datagrams from that address to `local` that no recorded flow owns.
    PrepareReceive {
        flow: VirtualFlow,
        local: SocketAddr,
        remote: SocketAddr,
    },
    /// A peer announced, in an authenticated update that came from there,
    /// that `flow`'s remote end is now at `remote`, which is being
    /// validated: send there now, but at most `allowed` bytes plus three
    /// times what arrives from there (the anti-amplification budget, RFC
    /// 9000 section 8), until `SetRemote` (validated: no limit) or
    /// `Reverted` (not: back to the last validated address). Follows the
    /// flow's `PrepareReceive` for `remote`; like `SetRemote`, it is
    /// followed by a SWITCHED once it took effect, which lets the peer
    /// send from there.
    SendUnvalidated {
        flow: VirtualFlow,
        remote: SocketAddr,
        allowed: u32,
    },
    /// Path validation of `attempted` failed; `flow` stays at (or returns
    /// to) the last validated endpoint `remote`, and the receive side
    /// prepared for `attempted` goes. Never dropped for a full event queue.
    Reverted {
        flow: VirtualFlow,
        remote: SocketAddr,
        attempted: SocketAddr,
    },
    /// Our move of `flow` is complete: the peer acknowledged that our end is
    /// now at `local`. `switch_now`: the send side may switch at once,
    /// because the peer moved too (and waits for us), or because the flow
    /// is UDP (never held: a datagram that reaches the peer early is simply
    /// delivered, and there is no timer to upset). Otherwise it waits for
    /// `PeerSwitched`, which tells that the peer now sends to `local`.
    Resumed {
        flow: VirtualFlow,
        local: SocketAddr,
        switch_now: bool,
    },
    /// After `Resumed` (without `switch_now`): the peer now sends to our
    /// new address (`confirmed`), or it did not say so within the wait and
    /// we go ahead anyway. Only now may `flow` send from its new address and
    /// a backed-off TCP socket be made to retransmit: earlier, the peer's
    /// answer could still go to our old address.
    PeerSwitched { flow: VirtualFlow, confirmed: bool },
    /// Our location is stored at `step` and nobody knows the peer's yet: the
    /// connection stays suspended until the peer arrives.
    Parked { flow: VirtualFlow, step: Step },
    /// The migration of `flow` was aborted.
    MigrationAborted {
        flow: VirtualFlow,
        reason: AbortReason,
    },
    /// A role was settled at suspend time.
    RoleDecided { flow: VirtualFlow, role: Role },
    /// The suspension of `flow` that [`Endpoint::suspend`] started is over:
    /// the peer answered its role claim and its key agreement (`answered`),
    /// or one of them was given up after its last resend, or the
    /// connection went (moved, exported or closed) first. One per suspension,
    /// however often `suspend` was called meanwhile.
    ///
    /// [`Endpoint::suspend`]: crate::Endpoint::suspend
    SuspendSettled { flow: VirtualFlow, answered: bool },
    /// The peer of `flow` asks for `help` while it is away (`vcmp::help`);
    /// an empty `help`: it is back, stop helping.
    HelpRequested {
        flow: VirtualFlow,
        help: super::help::Help,
    },
    /// Pairing with the host `key`, from `peer`, completed.
    Paired { peer: IpAddr, key: [u8; 32] },
    /// The paired host `claimant`, at `peer`, claimed connections that are
    /// bound to another host, `holder`; they stay with `holder`. After a
    /// peer's reinstall (a new key on the same host), `forget_peer(holder)`
    /// lets the new key claim them.
    ClaimConflict {
        peer: IpAddr,
        claimant: [u8; 32],
        holder: [u8; 32],
        connections: usize,
    },
    /// A host at `peer` presented a key other than the one pre-configured
    /// for that address. Refused.
    PeerKeyChanged {
        peer: IpAddr,
        pinned: [u8; 32],
        offered: [u8; 32],
    },
    /// The connection's keys are ready (after pairing).
    KeysReady { flow: VirtualFlow },
    /// The suspend-time key agreement replaced the connection's keys.
    Rekeyed { flow: VirtualFlow },
    /// Divert in-band BINDs arriving from `toward` to our VCMP port
    /// (`Datapath::divert_binds`), then call `binds_diverted`: a paired
    /// host behind NAT there is to send some on its UDP flows (`vcmp::bind`).
    DivertBinds { toward: IpAddr },
    /// Send `payload` as a UDP datagram from `local` to `remote`, the
    /// physical endpoints of one of our UDP flows, so that it crosses a NAT
    /// with that flow's mapping (a BIND, `vcmp::bind`).
    SendInBand {
        local: SocketAddr,
        remote: SocketAddr,
        payload: Vec<u8>,
    },
    /// Our BIND request for the rebinding TCP connection `flow` (its peer
    /// moved behind a NAT) went out: its peer's TCP BIND may carry `token`
    /// from now on (`Datapath::expect_tcp_bind`, after the connection's
    /// rebind is installed). If the datapath says the connection is not
    /// rebinding any more, call `tcp_bind_settled`.
    ExpectTcpBind { flow: VirtualFlow, token: [u8; 8] },
    /// Send a TCP BIND carrying `token` on our TCP connection `flow`, from
    /// `local` to `remote` (its physical endpoints), so that it crosses our
    /// NAT with the connection's mapping (`vcmp::bind`).
    SendTcpBind {
        flow: VirtualFlow,
        local: SocketAddr,
        remote: SocketAddr,
        token: [u8; 8],
    },
    /// `flow`'s peer is behind a NAT at `nat` (it names its end otherwise
    /// than we do): guard the connection against that NAT re-mapping it
    /// (`Datapath::guard_nat`), and report what the guard drops with
    /// `Endpoint::nat_guard_dropped`.
    GuardNat { flow: VirtualFlow, nat: IpAddr },
    /// The paired host `key` answered a probe that
    /// [`Endpoint::probe_host`] sent: its vnatd is there.
    ///
    /// [`Endpoint::probe_host`]: crate::Endpoint::probe_host
    ProbeAnswered { key: [u8; 32] },
    /// The peer sent an (unauthenticated, advisory) error.
    PeerError {
        from: SocketAddr,
        code: wire::ErrorCode,
    },
}

/// Errors of the commands.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("connection {0:?} is not known to VCMP; add it with connection_added first")]
    UnknownConnection(VirtualFlow),
    #[error("connection {0:?} is already known")]
    DuplicateConnection(VirtualFlow),
    #[error("too many connections ({limit}); raise max_connections or close some")]
    TooManyConnections { limit: usize },
    #[error("too many connections with peer {peer} ({limit})")]
    TooManyForPeer { peer: IpAddr, limit: usize },
    #[error("endpoints of {0:?} are not all of one address family")]
    MixedFamilies(VirtualFlow),
    #[error("connection {0:?} has no keys yet; wait for pairing with the peer")]
    NoKeys(VirtualFlow),
    #[error("export format version {0} is not supported")]
    ExportVersion(u32),
    #[error("exported key is not 64 hex digits")]
    ExportKey,
}
