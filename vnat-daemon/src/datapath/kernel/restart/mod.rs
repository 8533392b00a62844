//! Restart a TCP flow whose timer backed off during an outage (DESIGN.md
//! §3, the last of the kernel facts).
//!
//! During an outage a socket backs off one of two timers, doubling it each
//! time up to TCP_RTO_MAX = 120 s, and after the translation is in place it
//! only notices that the path works at the next backed-off expiry:
//!
//! - the retransmission timer (RFC 6298 §5.5), when segments were in flight;
//! - the zero-window probe timer, when nothing was in flight and new data
//!   could not be sent because the host had no route (the laptop's cable is
//!   out): tcp_write_xmit fails, tcp_check_probe_timer arms ICSK_TIME_PROBE0
//!   and tcp_send_probe0 backs it off like the retransmission timer. Not
//!   yet backed off it still waits a full RTO (200 ms or more): after one
//!   failed send, such as a send that vnat's hold dropped while the
//!   connection's own end was moving (`NAT_F_HOLD`). That is the same
//!   stall, shorter, and gets the same lever, sent once without waiting
//!   for the socket to act (`RestartOutcome::Probed`).
//!
//! **Retransmission timer: RFC 6069 (TCP-LD), which Linux implements.** An
//! ICMP destination unreachable (IPv4 net or host unreachable, ICMPv6 "no
//! route") quoting the oldest unacknowledged segment of a socket in backoff
//! makes tcp_v4_err / tcp_v6_err call tcp_ld_RTO_revert. That undoes one
//! backoff step, recomputes the timeout from when the segment was last sent,
//! and if the reverted timeout has already passed calls tcp_retransmit_timer
//! at once. So we inject such messages into the local stack, one per step,
//! until the kernel retransmits. It is keyed on the exact socket and its
//! exact `snd_una` (tcp_v4_err drops it unless `snd_una <= seq <= snd_nxt`;
//! tcp_ld_RTO_revert ignores it unless `seq == snd_una` and the socket has
//! retransmitted and backed off), so it cannot touch another or a healthy
//! socket. The messages come from a raw socket bound to the flow's local
//! virtual address and are sent to that address, so they are routed over
//! loopback and received by icmp_rcv / icmpv6_rcv as incoming ICMP.
//!
//! **Probe timer: ask the peer for an ACK.** tcp_v4_err does nothing for a
//! socket without segments in flight, but any acceptable ACK does: tcp_ack
//! calls tcp_ack_probe, which clears the backoff and the probe timer when
//! the window has room, and tcp_rcv_established then sends the waiting data
//! (tcp_data_snd_check). We send the peer one segment from the socket's
//! virtual endpoints with a sequence number far below its window, exactly
//! what a keepalive probe (tcp_xmit_probe_skb) relies on: the peer's
//! tcp_validate_incoming answers any out-of-window segment with an ACK
//! (tcp_send_dupack) without looking at anything else in it. The segment
//! leaves through the flow's translation like the socket's own packets, and
//! the real peer's ACK carries its real state, so nothing is forged towards
//! the local socket.
//!
//! **Queued data: push it.** When the socket's own process is known (it
//! called connect()), a socket on its probe timer is un-corked on the
//! process's behalf (`push.rs`): the kernel sends what it queued at once,
//! with no round trip to the peer and no dependence on the peer's
//! rate-limited answers. The probe to the peer remains the fallback
//! (accepted sockets, whose process the recorder does not know, and the
//! levers of a mass move).
//!
//! Other levers considered: pidfd_getfd + setsockopt cannot force a
//! retransmission; an ACK that acknowledges nothing does not re-arm the
//! retransmission timer and duplicate ACKs do not retransmit in the Loss
//! state; the zero-window persist responder of the VTL paper must be set up
//! *before* the outage, this works after the fact.
//!
//! `snd_una` and `rcv_nxt` come from sock_diag's tcp_info (bytes acked and
//! received) plus bases that sock_ops records at establishment
//! (`ConnRecord::snd_una_base`); sock_ops also records `snd_una` at every
//! retransmission timeout (`rto_snd_una`), tried if the first is ignored.
//! The socket's timers are read with sock_diag before and after each
//! message, so nothing is sent to a socket that is not backed off and
//! nothing after it has resumed.
//!
//! Side effects: tcp_v4_err / tcp_v6_err store the ICMP's EHOSTUNREACH as the
//! socket's *soft* error, reported only if the connection later times out
//! and cleared by the next valid ACK (tcp_ack); a socket with IP_RECVERR /
//! IPV6_RECVERR gets it once as a hard error instead (as it would from any
//! router's unreachable during the outage). A socket with TCP-MD5 or TCP-AO
//! drops the unsigned probe; its probe timer then runs as before. Both ends'
//! translations must be installed first, or the peer answers the probe with
//! a reset.

use std::{
    io,
    mem::size_of,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, Instant},
};

use vnat_common::ConnRecord;

use crate::datapath::{DatapathError, Kick, Proto, RestartOutcome, VirtualFlow};

/// At most this many ICMP messages per call. One message reverts one backoff
/// step and TCP backs off at most tcp_retries2 (15 by default) times before
/// it gives up on the connection.
const MAX_MESSAGES: u32 = 16;
/// Stop after this many messages in a row that changed nothing (a stale
/// sequence number, or the socket was locked by its process: tcp_ld_RTO_revert
/// returns early when sock_owned_by_user).
const MAX_INEFFECTIVE: u32 = 3;
/// How long to wait for the kernel to act on one ICMP message. Loopback
/// delivery normally happens before sendto() returns (the softirq runs on
/// the way out); this only covers a deferral to ksoftirqd.
const SETTLE: Duration = Duration::from_millis(20);
/// Probes sent to the peer, and how long to wait for its ACK after each. The
/// peer answers out-of-window segments at most once per
/// tcp_invalid_ratelimit (500 ms by default, tcp_oow_rate_limited), so a
/// second probe waits that long.
const MAX_PROBES: u32 = 2;
const PROBE_WAIT: Duration = Duration::from_millis(600);
/// How far below `snd_una` the probe's sequence number lies: more than any
/// receive window (at most 65535 << 14 < 2^30), so the peer always finds it
/// before its window (tcp_sequence: TCP_OLD_SEQUENCE) and only sends an ACK.
const PROBE_SEQ_BACK: u32 = 1 << 30;

/// ICMP destination unreachable / host unreachable (RFC 792). RFC 6069
/// accepts net and host unreachable; tcp_v4_err checks for both codes.
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_HOST_UNREACH: u8 = 1;
/// ICMPv6 destination unreachable / no route to destination (RFC 4443),
/// the one code tcp_v6_err passes to tcp_ld_RTO_revert.
const ICMPV6_DEST_UNREACH: u8 = 1;
const ICMPV6_NOROUTE: u8 = 0;

/// `wire`: the flow's endpoints on the wire where it is carried in the
/// other address family (see [`send_probe`]).
pub fn restart_flow(
    flow: &VirtualFlow,
    record: Option<&ConnRecord>,
    wire: Option<&VirtualFlow>,
) -> Result<RestartOutcome, DatapathError> {
    if flow.proto != Proto::Tcp {
        // UDP has no retransmission timer: the next datagram just goes out.
        return Ok(RestartOutcome::NotStalled);
    }
    let gone = || DatapathError::NoSuchConnection { flow: *flow };
    let record = record.ok_or_else(gone)?;
    let mut diag = SockDiag::open()?;
    let state = diag.query(flow, record.cookie)?.ok_or_else(gone)?;
    if state.rto_backed_off() {
        revert_backoff(&mut diag, flow, record, state)
    } else if state.probe_stuck() && pushed(&mut diag, flow, record, &state)? {
        Ok(RestartOutcome::Pushed {
            backoff: state.backoff,
        })
    } else if state.probe_stuck() && state.backoff > 0 {
        ask_peer_for_ack(&mut diag, flow, record, state, wire)
    } else if state.probe_stuck() {
        // Not backed off: one send just failed, and the timer is one RTO
        // away, no more. One probe, no wait: a wait per connection, when a
        // few are restarted together, would cost more than it saves.
        send_probe(flow, record, &state, wire)?;
        Ok(RestartOutcome::Probed)
    } else {
        Ok(RestartOutcome::NotStalled)
    }
}

/// The push lever (see `push.rs`), and whether the socket then sent some
/// of what it had queued. `Ok(false)` if it could not be pushed or sent
/// nothing (the caller asks the peer for an ACK instead, if it can).
fn pushed(
    diag: &mut SockDiag,
    flow: &VirtualFlow,
    record: &ConnRecord,
    state: &TcpState,
) -> Result<bool, DatapathError> {
    match push::push_queued(record.pid, state.inode) {
        Ok(true) => {}
        Ok(false) => return Ok(false),
        Err(e) => {
            tracing::debug!(id = flow.id(), %flow, pid = record.pid, error = %e, "cannot push the socket's queued data");
            return Ok(false);
        }
    }
    // tcp_push_pending_frames ran inside setsockopt: no wait.
    let now = diag
        .query(flow, record.cookie)?
        .ok_or(DatapathError::NoSuchConnection { flow: *flow })?;
    Ok(now.notsent_bytes < state.notsent_bytes)
}

/// The socket's `snd_una` from sock_diag and the recorded base, and the one
/// sock_ops recorded at the last retransmission timeout if different: the
/// sequence numbers an RFC 6069 unreachable may quote.
fn snd_una_candidates(record: &ConnRecord, state: &TcpState) -> Vec<u32> {
    let mut candidates = vec![record.snd_una_base.wrapping_add(state.bytes_acked as u32)];
    if record.rto_count != 0 && record.rto_snd_una != candidates[0] {
        candidates.push(record.rto_snd_una);
    }
    candidates
}

/// The out-of-window segment that makes the peer send an ACK (see
/// [`ask_peer_for_ack`]), for the socket's current state.
fn probe_segment(flow: &VirtualFlow, record: &ConnRecord, state: &TcpState) -> Vec<u8> {
    let snd_una = record.snd_una_base.wrapping_add(state.bytes_acked as u32);
    let rcv_nxt = record
        .rcv_nxt_base
        .wrapping_add(state.bytes_received as u32);
    tcp_probe(
        flow,
        snd_una.wrapping_sub(PROBE_SEQ_BACK),
        rcv_nxt,
        state.advertised_window(),
    )
}

/// Send a [`probe_segment`] to the peer, from a raw socket opened for it
/// alone: a raw TCP socket gets a copy of every incoming TCP segment of the
/// namespace while it is open.
///
/// A flow carried in the other address family (`wire`: its endpoints on
/// the wire) gets its probe in that form, with an IP header of our own:
/// its virtual one would be routed without ports, which the flow's own
/// rule matches on, and a host with only IPv6 has no IPv4 route for it.
fn send_probe(
    flow: &VirtualFlow,
    record: &ConnRecord,
    state: &TcpState,
    wire: Option<&VirtualFlow>,
) -> Result<(), DatapathError> {
    match wire {
        None => RawSocket::open(flow.local.ip(), RawKind::Tcp)?
            .send(&probe_segment(flow, record, state), flow.remote.ip()),
        Some(w) => rawsock::send_ip(
            w.local.ip(),
            w.remote.ip(),
            libc::IPPROTO_TCP as u8,
            &probe_segment(w, record, state),
            || format!("sending a restart message from {} to {}", w.local, w.remote),
        ),
    }
}

/// The retransmission timer: RFC 6069 unreachables quoting `snd_una`.
fn revert_backoff(
    diag: &mut SockDiag,
    flow: &VirtualFlow,
    record: &ConnRecord,
    before: TcpState,
) -> Result<RestartOutcome, DatapathError> {
    let backoff = before.backoff;
    let candidates = snd_una_candidates(record, &before);
    let injector = RawSocket::open(flow.local.ip(), RawKind::Icmp)?;
    let mut messages = 0;
    let mut last = before;
    for seq in candidates {
        let message = unreachable_for(flow, seq);
        let mut ineffective = 0;
        while messages < MAX_MESSAGES && ineffective < MAX_INEFFECTIVE {
            injector.send(&message, flow.local.ip())?;
            messages += 1;
            let now = diag
                .wait_for_change(flow, record.cookie, &last, SETTLE)?
                .ok_or(DatapathError::NoSuchConnection { flow: *flow })?;
            if now.total_retrans != before.total_retrans {
                return Ok(RestartOutcome::Retransmitted { messages, backoff });
            }
            if !now.rto_backed_off() {
                // Every step reverted (or an ACK arrived meanwhile) with no
                // retransmission due yet: the timer now fires soon.
                return Ok(RestartOutcome::Rearmed {
                    messages,
                    backoff,
                    next_retransmit_ms: now.expires_ms,
                });
            }
            ineffective = if now.same_as(&last) {
                ineffective + 1
            } else {
                0
            };
            last = now;
        }
    }
    Ok(if last.backoff < backoff {
        RestartOutcome::Rearmed {
            messages,
            backoff,
            next_retransmit_ms: last.expires_ms,
        }
    } else {
        RestartOutcome::Ignored { messages, backoff }
    })
}

/// The probe timer: one out-of-window segment to the peer, whose ACK
/// restarts the socket (tcp_ack_probe).
fn ask_peer_for_ack(
    diag: &mut SockDiag,
    flow: &VirtualFlow,
    record: &ConnRecord,
    before: TcpState,
    wire: Option<&VirtualFlow>,
) -> Result<RestartOutcome, DatapathError> {
    let backoff = before.backoff;
    let mut last = before;
    for probes in 1..=MAX_PROBES {
        send_probe(flow, record, &before, wire)?;
        let now = diag.wait_for_change(flow, record.cookie, &last, PROBE_WAIT)?;
        match now {
            None => return Err(DatapathError::NoSuchConnection { flow: *flow }),
            Some(s) if !s.probe_stuck() => return Ok(RestartOutcome::Resumed { probes, backoff }),
            // The probe timer fired by itself meanwhile, or no answer yet.
            Some(s) => last = s,
        }
    }
    Ok(RestartOutcome::Ignored {
        messages: MAX_PROBES,
        backoff,
    })
}

/// The levers of [`restart_flow`] and [`solicit_ack`] without waiting to
/// see the socket act, for when thousands of connections move at once: a
/// wait of 20 ms (or 600 ms for a probe) per connection would hold up the
/// whole move. Each message is one the waiting versions would send first;
/// the unreachables for all backoff steps go out back to back (loopback
/// delivers each before sendto returns), so a socket whose timer is then
/// due retransmits at once and later ones are ignored by the kernel.
pub fn kick(
    flow: &VirtualFlow,
    record: &ConnRecord,
    peer_moved: bool,
    wire: Option<&VirtualFlow>,
) -> Result<Kick, DatapathError> {
    if flow.proto != Proto::Tcp || flow.local.is_ipv4() != flow.remote.is_ipv4() {
        return Ok(Kick::Nothing);
    }
    let Some(state) = SockDiag::with_shared(|d| d.query(flow, record.cookie))? else {
        return Ok(Kick::Nothing);
    };
    if state.rto_backed_off() {
        let candidates = snd_una_candidates(record, &state);
        let injector = RawSocket::open(flow.local.ip(), RawKind::Icmp)?;
        let steps = u32::from(state.backoff).min(MAX_MESSAGES);
        let mut messages = 0;
        for seq in candidates {
            let message = unreachable_for(flow, seq);
            for _ in 0..steps {
                injector.send(&message, flow.local.ip())?;
                messages += 1;
            }
        }
        if peer_moved {
            solicit_from_state(flow, record, &state)?;
        }
        return Ok(Kick::Unreachables {
            messages,
            backoff: state.backoff,
        });
    }
    if state.probe_stuck() {
        send_probe(flow, record, &state, wire)?;
        if peer_moved {
            solicit_from_state(flow, record, &state)?;
        }
        return Ok(Kick::Probe {
            backoff: state.backoff,
        });
    }
    if peer_moved {
        solicit_from_state(flow, record, &state)?;
        return Ok(Kick::AckSolicited);
    }
    Ok(Kick::Nothing)
}

/// Hold (`hold`: turn off) or release (turn on again) the keepalive of
/// `flow`'s socket (see `keepalive.rs`). `Ok(true)`: it was changed.
pub fn hold_keepalive(
    flow: &VirtualFlow,
    record: &ConnRecord,
    hold: bool,
) -> Result<bool, DatapathError> {
    // Its holder now, found by inode when none was recorded (an accepted
    // socket's) or the recorded one handed it on.
    let Some((pid, inode)) = owner_of(flow, record)? else {
        return Ok(false);
    };
    keepalive::set_keepalive(pid, inode, !hold)
        .map_err(kernel_err("changing the socket's keepalive"))
}

/// The owner and inode of `flow`'s TCP socket: the recorded process if it
/// still holds the socket (by inode in its descriptors), else the one
/// found holding the inode. The recorded pid alone is stale once the
/// process hands the socket on or dies and its pid is reused.
fn owner_of(flow: &VirtualFlow, record: &ConnRecord) -> Result<Option<(u32, u64)>, DatapathError> {
    if flow.proto != Proto::Tcp {
        return Ok(None);
    }
    let Some(state) = SockDiag::with_shared(|d| d.query(flow, record.cookie))? else {
        return Ok(None);
    };
    if state.inode == 0 {
        return Ok(None);
    }
    // One table of every process's sockets for a whole batch of levers
    // (`fds`), not a read of /proc per connection.
    let pid = match fds::holder(state.inode) {
        Some((pid, _)) => pid,
        None if record.pid != 0 && super::procfs::holds_socket(record.pid, state.inode) => {
            record.pid
        }
        None => 0,
    };
    Ok((pid != 0).then_some((pid, state.inode)))
}

/// The process holding `flow`'s TCP socket now (see
/// `Datapath::socket_holder`).
pub fn socket_holder(
    flow: &VirtualFlow,
    record: &ConnRecord,
) -> Result<Option<u32>, DatapathError> {
    Ok(owner_of(flow, record)?.map(|(pid, _)| pid))
}

/// A duplicate of `flow`'s TCP socket (see `Datapath::connection_socket`).
pub fn connection_socket(
    flow: &VirtualFlow,
    record: &ConnRecord,
) -> Result<Option<OwnedFd>, DatapathError> {
    let Some((pid, inode)) = owner_of(flow, record)? else {
        return Ok(None);
    };
    push::socket_of(pid, inode).map_err(kernel_err(
        "taking the connection's socket from its process",
    ))
}

/// Set TCP_USER_TIMEOUT of `flow`'s socket to `ms` (see
/// `vnatd --cleanup`: turn the keepalive of `pid`'s socket `inode` on
/// again, and give it its TCP_USER_TIMEOUT `user_timeout` back, as the
/// previous vnatd recorded before changing them (`restart_state`).
/// Whether the keepalive was off.
pub fn give_back(
    pid: u32,
    inode: u64,
    keepalive: bool,
    user_timeout: Option<u32>,
) -> Result<bool, DatapathError> {
    let mut changed = false;
    if keepalive {
        changed = keepalive::set_keepalive(pid, inode, true)
            .map_err(kernel_err("turning the socket's keepalive on"))?;
    }
    if let Some(ms) = user_timeout {
        keepalive::set_user_timeout(pid, inode, ms)
            .map_err(kernel_err("giving the socket its user timeout back"))?;
    }
    Ok(changed)
}

/// `Datapath::set_user_timeout`); the value it had. The socket is taken
/// from the recorded process, or from the one holding its inode (an
/// accepted socket's).
pub fn set_user_timeout(
    flow: &VirtualFlow,
    record: &ConnRecord,
    ms: u32,
) -> Result<Option<u32>, DatapathError> {
    let Some((pid, inode)) = owner_of(flow, record)? else {
        return Ok(None);
    };
    keepalive::set_user_timeout(pid, inode, ms)
        .map_err(kernel_err("changing the socket's user timeout"))
}

/// The sockets of `proto` in one of `states` (bit `1 << state`) in this
/// thread's network namespace (see [`sockdiag::dump`]).
pub fn list_sockets(proto: Proto, states: u32) -> Result<Vec<Listed>, DatapathError> {
    let protocol = match proto {
        Proto::Tcp => libc::IPPROTO_TCP as u8,
        Proto::Udp => libc::IPPROTO_UDP as u8,
    };
    sockdiag::dump(protocol, states)
}

/// Deliver to `flow`'s socket, as from its peer, an ACK of what the peer
/// last acknowledged (`snd_una`, at `rcv_nxt`) with `window` bytes of window
/// (see `Datapath::answer_for_peer`). In window and acceptable, it updates
/// the socket's view of the peer's window (tcp_ack_update_window: the
/// sequence number is not older than the last update's), clears the count
/// of unanswered window probes and refreshes the time the peer was last
/// heard from (tcp_ack), so that neither the persist timer nor a
/// retransmission towards a zero window (tcp_retransmit_timer, for 240 s
/// after the last ACK) gives up. It carries no data and no timestamp
/// (PAWS skips segments without one).
pub fn answer_for_peer(
    flow: &VirtualFlow,
    record: &ConnRecord,
    window: u32,
    unless_moved_from: Option<(u64, u64)>,
) -> Result<crate::datapath::PeerAnswer, DatapathError> {
    use crate::datapath::PeerAnswer;
    if flow.proto != Proto::Tcp || flow.local.is_ipv4() != flow.remote.is_ipv4() {
        return Ok(PeerAnswer::Gone);
    }
    let Some(state) = SockDiag::with_shared(|d| d.query(flow, record.cookie))? else {
        return Ok(PeerAnswer::Gone);
    };
    let counters = (state.bytes_acked, state.bytes_received);
    if unless_moved_from.is_some_and(|c| c != counters) {
        return Ok(PeerAnswer::PeerActive { counters });
    }
    if window > 0 && state.timer == sockdiag::TIMER_RETRANSMIT {
        return Ok(PeerAnswer::Retransmitting);
    }
    let snd_una = record.snd_una_base.wrapping_add(state.bytes_acked as u32);
    let rcv_nxt = record
        .rcv_nxt_base
        .wrapping_add(state.bytes_received as u32);
    let field = (window >> state.snd_wscale).min(u32::from(u16::MAX)) as u16;
    let reversed = VirtualFlow {
        proto: flow.proto,
        local: flow.remote,
        remote: flow.local,
    };
    inject_from_peer(flow, &tcp_probe(&reversed, rcv_nxt, snd_una, field))?;
    Ok(PeerAnswer::Answered {
        counters,
        peer_window: state.snd_wnd,
    })
}

/// Whether `flow`'s socket with `cookie` is still open (not closed, not in
/// TIME_WAIT).
pub fn socket_alive(flow: &VirtualFlow, cookie: u64) -> Result<bool, DatapathError> {
    Ok(SockDiag::with_shared(|d| d.query(flow, cookie))?.is_some())
}

/// The sequence bases of an established TCP socket sock_ops never saw (see
/// `peek.rs`): `None` if it is gone or never held still.
pub fn sequence_bases(
    flow: &VirtualFlow,
    cookie: u64,
    program: Option<std::os::fd::RawFd>,
) -> Result<Option<SequenceBases>, DatapathError> {
    peek::sequence_bases(flow, cookie, program)
}

/// Reset `flow`'s socket (see [`sockdiag::destroy`]); `cookie` 0: any
/// socket with the tuple.
pub fn reset(flow: &VirtualFlow, cookie: u64) -> Result<bool, DatapathError> {
    sockdiag::destroy(flow, cookie)
}

/// Make the local socket of `flow` send an ACK at once (see
/// [`crate::datapath::Datapath::solicit_ack`]): inject into it, over
/// loopback, a segment that carries the peer's virtual endpoints and a
/// sequence number far before its receive window. tcp_validate_incoming
/// answers such a segment with a duplicate ACK (tcp_send_dupack) and drops
/// it without looking at anything else, so the socket's state is untouched;
/// the ACK leaves through the route and translation to the peer's new
/// address. Out-of-window answers to segments without data are limited to
/// one per tcp_invalid_ratelimit (500 ms) per socket, which a single call
/// per move stays within. A socket with TCP-MD5 or TCP-AO drops the
/// unsigned segment, and nothing happens.
pub fn solicit_ack(flow: &VirtualFlow, record: &ConnRecord) -> Result<bool, DatapathError> {
    if flow.proto != Proto::Tcp || flow.local.is_ipv4() != flow.remote.is_ipv4() {
        return Ok(false);
    }
    let Some(state) = SockDiag::with_shared(|d| d.query(flow, record.cookie))? else {
        return Ok(false);
    };
    solicit_from_state(flow, record, &state)?;
    Ok(true)
}

fn solicit_from_state(
    flow: &VirtualFlow,
    record: &ConnRecord,
    state: &TcpState,
) -> Result<(), DatapathError> {
    let snd_una = record.snd_una_base.wrapping_add(state.bytes_acked as u32);
    let rcv_nxt = record
        .rcv_nxt_base
        .wrapping_add(state.bytes_received as u32);
    // The segment as the peer would send it: remote -> local, its sequence
    // space is our receive space.
    let reversed = VirtualFlow {
        proto: flow.proto,
        local: flow.remote,
        remote: flow.local,
    };
    let segment = tcp_probe(
        &reversed,
        rcv_nxt.wrapping_sub(PROBE_SEQ_BACK),
        snd_una,
        u16::MAX,
    );
    inject_from_peer(flow, &segment)
}

/// The ICMP message for `flow` (local virtual -> remote virtual) quoting
/// sequence number `seq`, for the family of the flow.
fn unreachable_for(flow: &VirtualFlow, seq: u32) -> Vec<u8> {
    match (flow.local, flow.remote) {
        (SocketAddr::V4(l), SocketAddr::V4(r)) => {
            icmp4_unreachable(*l.ip(), l.port(), *r.ip(), r.port(), seq)
        }
        (l, r) => icmp6_unreachable(to_v6(l.ip()), l.port(), to_v6(r.ip()), r.port(), seq),
    }
}

fn to_v6(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// The first 20 bytes of the segment the socket sent: ports and `seq` are
/// what tcp_v4_err / tcp_v6_err read (the socket lookup and the snd_una
/// check); the rest is a plausible ACK header. RFC 792 asks for at least the
/// first 8 bytes of the datagram's payload.
fn quoted_tcp(sport: u16, dport: u16, seq: u32) -> [u8; 20] {
    let mut t = [0u8; 20];
    t[0..2].copy_from_slice(&sport.to_be_bytes());
    t[2..4].copy_from_slice(&dport.to_be_bytes());
    t[4..8].copy_from_slice(&seq.to_be_bytes());
    t[12] = 5 << 4; // data offset: 5 words, no options
    t[13] = 0x10; // ACK
    t
}

/// ICMP host unreachable quoting an IPv4 TCP segment `src -> dst` with
/// sequence number `seq`, checksum included (raw IPPROTO_ICMP sockets send
/// the message as given; icmp_rcv drops it if the checksum is wrong).
pub fn icmp4_unreachable(
    src: Ipv4Addr,
    sport: u16,
    dst: Ipv4Addr,
    dport: u16,
    seq: u32,
) -> Vec<u8> {
    let tcp = quoted_tcp(sport, dport, seq);
    let mut ip = [0u8; 20];
    ip[0] = 0x45; // version 4, IHL 5: icmp_unreach rejects IHL < 5
    ip[2..4].copy_from_slice(&(40u16).to_be_bytes());
    ip[6] = 0x40; // DF
    ip[8] = 64; // TTL
    ip[9] = libc::IPPROTO_TCP as u8;
    ip[12..16].copy_from_slice(&src.octets());
    ip[16..20].copy_from_slice(&dst.octets());
    let c = checksum(&ip);
    ip[10..12].copy_from_slice(&c.to_be_bytes());

    let mut m = Vec::with_capacity(8 + 40);
    m.extend_from_slice(&[ICMP_DEST_UNREACH, ICMP_HOST_UNREACH, 0, 0, 0, 0, 0, 0]);
    m.extend_from_slice(&ip);
    m.extend_from_slice(&tcp);
    let c = checksum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    m
}

/// ICMPv6 no-route unreachable quoting an IPv6 TCP segment. The checksum is
/// left 0: the kernel computes it for raw ICMPv6 sockets (RFC 3542 §3.1),
/// over a pseudo-header with the source address it picks.
pub fn icmp6_unreachable(
    src: Ipv6Addr,
    sport: u16,
    dst: Ipv6Addr,
    dport: u16,
    seq: u32,
) -> Vec<u8> {
    let tcp = quoted_tcp(sport, dport, seq);
    let mut m = Vec::with_capacity(8 + 40 + 20);
    m.extend_from_slice(&[ICMPV6_DEST_UNREACH, ICMPV6_NOROUTE, 0, 0, 0, 0, 0, 0]);
    m.extend_from_slice(&[0x60, 0, 0, 0]); // version 6, no traffic class or flow label
    m.extend_from_slice(&(tcp.len() as u16).to_be_bytes());
    m.push(libc::IPPROTO_TCP as u8); // next header: icmpv6_notify hands it to TCP
    m.push(64); // hop limit
    m.extend_from_slice(&src.octets());
    m.extend_from_slice(&dst.octets());
    m.extend_from_slice(&tcp);
    m
}

/// The probe segment of [`ask_peer_for_ack`]: local virtual -> remote
/// virtual, ACK flag, no data and no options (so no timestamp for the
/// peer's PAWS check to reject), checksum over the virtual endpoints (tc
/// updates it incrementally when it rewrites them).
fn tcp_probe(flow: &VirtualFlow, seq: u32, ack: u32, window: u16) -> Vec<u8> {
    let mut t = quoted_tcp(flow.local.port(), flow.remote.port(), seq).to_vec();
    t[8..12].copy_from_slice(&ack.to_be_bytes());
    t[14..16].copy_from_slice(&window.to_be_bytes());
    let mut pseudo = Vec::with_capacity(40 + t.len());
    match (flow.local.ip(), flow.remote.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            pseudo.extend_from_slice(&s.octets());
            pseudo.extend_from_slice(&d.octets());
            pseudo.extend_from_slice(&[0, libc::IPPROTO_TCP as u8]);
            pseudo.extend_from_slice(&(t.len() as u16).to_be_bytes());
        }
        (s, d) => {
            pseudo.extend_from_slice(&to_v6(s).octets());
            pseudo.extend_from_slice(&to_v6(d).octets());
            pseudo.extend_from_slice(&(t.len() as u32).to_be_bytes());
            pseudo.extend_from_slice(&[0, 0, 0, libc::IPPROTO_TCP as u8]);
        }
    }
    pseudo.extend_from_slice(&t);
    let c = checksum(&pseudo);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    t
}

/// The Internet checksum (RFC 1071).
pub fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = 0;
    let mut chunks = bytes.chunks_exact(2);
    for c in &mut chunks {
        sum += u32::from(u16::from_be_bytes([c[0], c[1]]));
    }
    if let [last] = chunks.remainder() {
        sum += u32::from(*last) << 8;
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

pub(super) mod fds;
mod keepalive;
pub use keepalive::peer_silence;
mod peek;
mod push;
mod rawsock;
mod sockdiag;
mod tcpbind;

pub use tcpbind::send_tcp_bind;
#[cfg(test)]
mod tests;

pub use peek::SequenceBases;
pub use rawsock::send_udp;
use rawsock::*;
pub use sockdiag::Listed;
use sockdiag::*;
