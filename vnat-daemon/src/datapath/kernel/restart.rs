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
//!   and tcp_send_probe0 backs it off like the retransmission timer.
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

use crate::datapath::{DatapathError, Proto, RestartOutcome, VirtualFlow};

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

pub fn restart_flow(
    flow: &VirtualFlow,
    record: Option<&ConnRecord>,
) -> Result<RestartOutcome, DatapathError> {
    if flow.proto != Proto::Tcp {
        // UDP has no retransmission timer: the next datagram just goes out.
        return Ok(RestartOutcome::NotStalled);
    }
    let gone = || DatapathError::NoSuchConnection { flow: *flow };
    let record = record.ok_or_else(gone)?;
    let diag = SockDiag::open()?;
    let state = diag.query(flow, record.cookie)?.ok_or_else(gone)?;
    if state.rto_backed_off() {
        revert_backoff(&diag, flow, record, state)
    } else if state.probe_backed_off() {
        ask_peer_for_ack(&diag, flow, record, state)
    } else {
        Ok(RestartOutcome::NotStalled)
    }
}

/// The retransmission timer: RFC 6069 unreachables quoting `snd_una`.
fn revert_backoff(
    diag: &SockDiag,
    flow: &VirtualFlow,
    record: &ConnRecord,
    before: TcpState,
) -> Result<RestartOutcome, DatapathError> {
    let backoff = before.backoff;
    let mut candidates = vec![record.snd_una_base.wrapping_add(before.bytes_acked as u32)];
    if record.rto_count != 0 && record.rto_snd_una != candidates[0] {
        candidates.push(record.rto_snd_una);
    }
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
    diag: &SockDiag,
    flow: &VirtualFlow,
    record: &ConnRecord,
    before: TcpState,
) -> Result<RestartOutcome, DatapathError> {
    let backoff = before.backoff;
    let snd_una = record.snd_una_base.wrapping_add(before.bytes_acked as u32);
    let rcv_nxt = record
        .rcv_nxt_base
        .wrapping_add(before.bytes_received as u32);
    let segment = tcp_probe(
        flow,
        snd_una.wrapping_sub(PROBE_SEQ_BACK),
        rcv_nxt,
        before.advertised_window(),
    );
    let mut last = before;
    for probes in 1..=MAX_PROBES {
        // Opened per probe: a raw TCP socket gets a copy of every incoming
        // TCP segment of the namespace while it is open.
        RawSocket::open(flow.local.ip(), RawKind::Tcp)?.send(&segment, flow.remote.ip())?;
        let now = diag.wait_for_change(flow, record.cookie, &last, PROBE_WAIT)?;
        match now {
            None => return Err(DatapathError::NoSuchConnection { flow: *flow }),
            Some(s) if !s.probe_backed_off() => {
                return Ok(RestartOutcome::Resumed { probes, backoff })
            }
            // The probe timer fired by itself meanwhile, or no answer yet.
            Some(s) => last = s,
        }
    }
    Ok(RestartOutcome::Ignored {
        messages: MAX_PROBES,
        backoff,
    })
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

fn kernel_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> DatapathError {
    let what = what.into();
    move |source| DatapathError::Kernel { what, source }
}

fn cvt(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

fn setsockopt<T>(fd: &OwnedFd, level: libc::c_int, name: libc::c_int, value: &T) -> io::Result<()> {
    // SAFETY: `value` points to a live T of the size passed.
    cvt(unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (value as *const T).cast(),
            size_of::<T>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}

/// sockaddr_in / sockaddr_in6 for `ip`, port 0 (raw sockets have none).
fn sockaddr(ip: IpAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match ip {
        IpAddr::V4(v4) => {
            // SAFETY: sockaddr_storage is large and aligned enough for any sockaddr.
            let sin = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>()
            };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_addr.s_addr = u32::from_ne_bytes(v4.octets());
            size_of::<libc::sockaddr_in>()
        }
        IpAddr::V6(v6) => {
            // SAFETY: as above.
            let sin6 = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_addr.s6_addr = v6.octets();
            size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum RawKind {
    /// ICMP (v4) or ICMPv6 messages, sent to the local virtual address.
    Icmp,
    /// TCP segments (we build the header), sent to the peer.
    Tcp,
}

/// A raw socket bound to the flow's local virtual address.
struct RawSocket {
    fd: OwnedFd,
}

impl RawSocket {
    fn open(local: IpAddr, kind: RawKind) -> Result<RawSocket, DatapathError> {
        let (family, proto) = match (local, kind) {
            (IpAddr::V4(_), RawKind::Icmp) => (libc::AF_INET, libc::IPPROTO_ICMP),
            (IpAddr::V6(_), RawKind::Icmp) => (libc::AF_INET6, libc::IPPROTO_ICMPV6),
            (IpAddr::V4(_), RawKind::Tcp) => (libc::AF_INET, libc::IPPROTO_TCP),
            (IpAddr::V6(_), RawKind::Tcp) => (libc::AF_INET6, libc::IPPROTO_TCP),
        };
        let raw = cvt(unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto) })
            .map_err(kernel_err("opening a raw socket (needs CAP_NET_RAW)"))?;
        // SAFETY: `raw` is a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        if kind == RawKind::Icmp {
            // Hop limit 255: a socket protected with IP_MINTTL /
            // IPV6_MINHOPCOUNT (RFC 5082) drops ICMP with a lower one
            // (tcp_v4_err, tcp_v6_err). Receive nothing: a raw ICMP socket
            // gets a copy of every ICMP message of the namespace.
            let hops: libc::c_int = 255;
            let opts = match local {
                IpAddr::V4(_) => setsockopt(&fd, libc::IPPROTO_IP, libc::IP_TTL, &hops)
                    .and_then(|_| setsockopt(&fd, libc::SOL_RAW, ICMP_FILTER, &u32::MAX)),
                IpAddr::V6(_) => {
                    setsockopt(&fd, libc::IPPROTO_IPV6, libc::IPV6_UNICAST_HOPS, &hops).and_then(
                        |_| setsockopt(&fd, libc::IPPROTO_ICMPV6, ICMP6_FILTER, &[u32::MAX; 8]),
                    )
                }
            };
            opts.map_err(kernel_err("setting up the raw ICMP socket"))?;
        }
        // Bound to the local virtual address: the bind fails unless the
        // address is local (raw_bind, rawv6_bind), so an ICMP message sent
        // to it is routed over loopback and comes back in as incoming ICMP
        // (it can never leave the host), and a probe leaves with the
        // socket's own source address, which tc then translates.
        let (sa, len) = sockaddr(local);
        cvt(unsafe { libc::bind(fd.as_raw_fd(), (&sa as *const libc::sockaddr_storage).cast(), len) }).map_err(
            kernel_err(format!(
                "binding a raw socket to {local} (the flow's local virtual address must be on this host: install the translation first)"
            )),
        )?;
        Ok(RawSocket { fd })
    }

    fn send(&self, message: &[u8], to: IpAddr) -> Result<(), DatapathError> {
        // For IPPROTO_TCP the kernel adds only the IP header (no IP_HDRINCL),
        // with the bound source; the TCP checksum is ours.
        let (sa, len) = sockaddr(to);
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                message.as_ptr().cast(),
                message.len(),
                0,
                (&sa as *const libc::sockaddr_storage).cast(),
                len,
            )
        };
        if n < 0 {
            return Err(kernel_err(format!("sending a restart message to {to}"))(
                io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// `ICMP_FILTER` (linux/icmp.h) at SOL_RAW: a bit mask of ICMP types to drop.
const ICMP_FILTER: libc::c_int = 1;
/// `ICMP6_FILTER` (linux/icmpv6.h) at IPPROTO_ICMPV6: a set bit blocks a type.
const ICMP6_FILTER: libc::c_int = 1;

/// What sock_diag (inet_diag with INET_DIAG_INFO) says about one socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TcpState {
    /// `idiag_timer`: 1 while the retransmission timer is pending.
    timer: u8,
    /// `idiag_expires`: milliseconds until that timer fires.
    expires_ms: u32,
    /// `tcpi_retransmits` (icsk_retransmits): timeouts of the oldest segment.
    retransmits: u8,
    /// `tcpi_backoff` (icsk_backoff): how many times the timeout doubled.
    backoff: u8,
    /// `tcpi_total_retrans`: grows with every retransmitted segment.
    total_retrans: u32,
    /// `tcpi_bytes_acked`, `tcpi_bytes_received` (RFC 4898): with the bases
    /// recorded at establishment, `snd_una` and `rcv_nxt`.
    bytes_acked: u64,
    bytes_received: u64,
    /// `tcpi_rcv_wscale`.
    rcv_wscale: u8,
    /// `tcpi_snd_wnd`, `tcpi_rcv_wnd` (Linux 5.19 / 6.2; `None` before).
    snd_wnd: Option<u32>,
    rcv_wnd: Option<u32>,
}

impl TcpState {
    /// Waiting on a backed-off retransmission timer: the precondition of
    /// tcp_ld_RTO_revert (icsk_retransmits and icsk_backoff non-zero).
    fn rto_backed_off(&self) -> bool {
        self.timer == TIMER_RETRANSMIT && self.retransmits > 0 && self.backoff > 0
    }

    /// Waiting on a backed-off probe timer although the peer's window is
    /// open: sending failed locally (no route), not a zero window. Against
    /// a real zero window an ACK would change nothing.
    fn probe_backed_off(&self) -> bool {
        self.timer == TIMER_PROBE0 && self.backoff > 0 && self.snd_wnd != Some(0)
    }

    /// The window field the socket itself would send (tcp_select_window).
    fn advertised_window(&self) -> u16 {
        self.rcv_wnd.map_or(u16::MAX, |w| {
            (w >> self.rcv_wscale).min(u32::from(u16::MAX)) as u16
        })
    }

    /// The kernel did not act on a message in between.
    fn same_as(&self, o: &TcpState) -> bool {
        (
            self.timer,
            self.backoff,
            self.retransmits,
            self.total_retrans,
        ) == (o.timer, o.backoff, o.retransmits, o.total_retrans)
    }
}

/// A NETLINK_SOCK_DIAG socket in the caller's network namespace.
struct SockDiag {
    fd: OwnedFd,
}

const SOCK_DIAG_BY_FAMILY: u16 = 20;
const INET_DIAG_INFO: u16 = 2;
/// sizeof(struct inet_diag_req_v2), sizeof(struct inet_diag_msg).
const REQ_LEN: usize = 56;
const MSG_LEN: usize = 72;
const NLMSG_HDRLEN: usize = 16;
/// `idiag_timer` values (inet_sk_diag_fill): ICSK_TIME_RETRANS (and the
/// loss-probe and reordering timers) is 1, ICSK_TIME_PROBE0 is 4.
const TIMER_RETRANSMIT: u8 = 1;
const TIMER_PROBE0: u8 = 4;
/// Offsets in struct tcp_info (include/uapi/linux/tcp.h).
const TCPI_RETRANSMITS: usize = 2;
const TCPI_BACKOFF: usize = 4;
/// `tcpi_snd_wscale : 4, tcpi_rcv_wscale : 4`: rcv in the high nibble.
const TCPI_WSCALE: usize = 6;
const TCPI_TOTAL_RETRANS: usize = 100;
const TCPI_BYTES_ACKED: usize = 120;
const TCPI_BYTES_RECEIVED: usize = 128;
const TCPI_SND_WND: usize = 228;
const TCPI_RCV_WND: usize = 232;

impl SockDiag {
    fn open() -> Result<SockDiag, DatapathError> {
        let raw = cvt(unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_SOCK_DIAG,
            )
        })
        .map_err(kernel_err("opening a sock_diag netlink socket"))?;
        // SAFETY: a fresh descriptor that nothing else owns.
        Ok(SockDiag {
            fd: unsafe { OwnedFd::from_raw_fd(raw) },
        })
    }

    /// Poll until the socket's state differs from `last` or `wait` passes.
    fn wait_for_change(
        &self,
        flow: &VirtualFlow,
        cookie: u64,
        last: &TcpState,
        wait: Duration,
    ) -> Result<Option<TcpState>, DatapathError> {
        let deadline = Instant::now() + wait;
        loop {
            let now = self.query(flow, cookie)?;
            match now {
                Some(s) if s.same_as(last) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                other => return Ok(other),
            }
        }
    }

    /// The socket of `flow` with this cookie (inet_diag exact lookup,
    /// inet_diag_find_one_icsk), or `None` if it is gone.
    fn query(&self, flow: &VirtualFlow, cookie: u64) -> Result<Option<TcpState>, DatapathError> {
        let key = flow.to_key();
        let family = if flow.local.is_ipv4() && flow.remote.is_ipv4() {
            libc::AF_INET
        } else {
            libc::AF_INET6
        };
        let mut req = Vec::with_capacity(NLMSG_HDRLEN + REQ_LEN);
        req.extend_from_slice(&((NLMSG_HDRLEN + REQ_LEN) as u32).to_ne_bytes());
        req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        req.extend_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
        req.extend_from_slice(&1u32.to_ne_bytes()); // sequence number
        req.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
        req.push(family as u8);
        req.push(libc::IPPROTO_TCP as u8);
        req.push(1 << (INET_DIAG_INFO - 1)); // idiag_ext: ask for tcp_info
        req.push(0);
        req.extend_from_slice(&u32::MAX.to_ne_bytes()); // every state
                                                        // inet_diag_sockid: ports and addresses in network order, exactly as
                                                        // in FlowKey; src is the socket's local end.
        req.extend_from_slice(&key.src_port_be.to_ne_bytes());
        req.extend_from_slice(&key.dst_port_be.to_ne_bytes());
        for w in key.src_addr_be.iter().chain(key.dst_addr_be.iter()) {
            req.extend_from_slice(&w.to_ne_bytes());
        }
        req.extend_from_slice(&0u32.to_ne_bytes()); // any interface
                                                    // The cookie (sock_gen_cookie, as bpf_get_socket_cookie) makes sure
                                                    // it is the recorded socket and not a later one with the same
                                                    // 4-tuple (sock_diag_check_cookie); 0 means unknown.
        let (lo, hi) = if cookie == 0 {
            (u32::MAX, u32::MAX)
        } else {
            (cookie as u32, (cookie >> 32) as u32)
        };
        req.extend_from_slice(&lo.to_ne_bytes());
        req.extend_from_slice(&hi.to_ne_bytes());

        let fd = self.fd.as_raw_fd();
        // SAFETY: all-zero is a valid sockaddr_nl (the kernel, pid 0).
        let mut to: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        to.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        let sent = unsafe {
            libc::sendto(
                fd,
                req.as_ptr().cast(),
                req.len(),
                0,
                (&to as *const libc::sockaddr_nl).cast(),
                size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if sent < 0 {
            return Err(kernel_err("querying sock_diag")(io::Error::last_os_error()));
        }
        let mut buf = vec![0u8; 8192];
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(kernel_err("reading the sock_diag answer")(
                io::Error::last_os_error(),
            ));
        }
        parse_answer(&buf[..n as usize]).map_err(kernel_err("reading the sock_diag answer"))
    }
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// One netlink answer to an exact inet_diag request: an inet_diag_msg with
/// attributes, or an NLMSG_ERROR (ENOENT / ESTALE when the socket is gone).
fn parse_answer(b: &[u8]) -> io::Result<Option<TcpState>> {
    if b.len() < NLMSG_HDRLEN {
        return Err(bad("short netlink message"));
    }
    let len = u32_at(b, 0).ok_or_else(|| bad("short netlink message"))? as usize;
    let kind = u16::from_ne_bytes([b[4], b[5]]);
    let b = b
        .get(..len)
        .ok_or_else(|| bad("truncated netlink message"))?;
    if kind == libc::NLMSG_ERROR as u16 {
        let errno = (u32_at(b, NLMSG_HDRLEN).ok_or_else(|| bad("short netlink error"))? as i32)
            .wrapping_neg();
        return match errno {
            libc::ENOENT | libc::ESTALE => Ok(None),
            0 => Err(bad("sock_diag acknowledged without an answer")),
            e => Err(io::Error::from_raw_os_error(e)),
        };
    }
    if kind != SOCK_DIAG_BY_FAMILY {
        return Err(bad("unexpected netlink message type"));
    }
    let msg = b
        .get(NLMSG_HDRLEN..NLMSG_HDRLEN + MSG_LEN)
        .ok_or_else(|| bad("short inet_diag_msg"))?;
    let timer = msg[2];
    let expires_ms = u32_at(msg, 52).ok_or_else(|| bad("short inet_diag_msg"))?;
    let mut at = NLMSG_HDRLEN + MSG_LEN;
    while at + 4 <= b.len() {
        let alen = u16::from_ne_bytes([b[at], b[at + 1]]) as usize;
        let atype = u16::from_ne_bytes([b[at + 2], b[at + 3]]);
        if alen < 4 {
            break;
        }
        if atype == INET_DIAG_INFO {
            let info = b
                .get(at + 4..at + alen)
                .ok_or_else(|| bad("truncated tcp_info"))?;
            let short = || bad("short tcp_info");
            return Ok(Some(TcpState {
                timer,
                expires_ms,
                retransmits: *info.get(TCPI_RETRANSMITS).ok_or_else(short)?,
                backoff: *info.get(TCPI_BACKOFF).ok_or_else(short)?,
                total_retrans: u32_at(info, TCPI_TOTAL_RETRANS).ok_or_else(short)?,
                bytes_acked: u64_at(info, TCPI_BYTES_ACKED).ok_or_else(short)?,
                bytes_received: u64_at(info, TCPI_BYTES_RECEIVED).ok_or_else(short)?,
                rcv_wscale: info.get(TCPI_WSCALE).ok_or_else(short)? >> 4,
                snd_wnd: u32_at(info, TCPI_SND_WND),
                rcv_wnd: u32_at(info, TCPI_RCV_WND),
            }));
        }
        at += (alen + 3) & !3;
    }
    Err(bad("no tcp_info in the sock_diag answer"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn icmp4_message_layout_and_checksums() {
        let m = icmp4_unreachable(
            "198.18.1.2".parse().unwrap(),
            40000,
            "198.18.3.2".parse().unwrap(),
            5001,
            0xdead_beef,
        );
        assert_eq!(m.len(), 8 + 20 + 20);
        assert_eq!(
            &m[..2],
            &[3, 1],
            "destination unreachable / host unreachable"
        );
        assert_eq!(checksum(&m), 0, "ICMP checksum does not verify");
        assert_eq!(
            checksum(&m[8..28]),
            0,
            "quoted IP header checksum does not verify"
        );
        assert_eq!(
            &m[8 + 12..8 + 20],
            &[198, 18, 1, 2, 198, 18, 3, 2],
            "quoted src must be the local end"
        );
        assert_eq!(m[8 + 9], 6, "quoted protocol must be TCP");
        let tcp = &m[28..];
        assert_eq!(&tcp[..8], &[0x9c, 0x40, 0x13, 0x89, 0xde, 0xad, 0xbe, 0xef]);
    }

    #[test]
    fn icmp6_message_layout() {
        let m = icmp6_unreachable(
            "fd00:5e:1::2".parse().unwrap(),
            1,
            "fd00:5e:3::2".parse().unwrap(),
            2,
            7,
        );
        assert_eq!(m.len(), 8 + 40 + 20);
        assert_eq!(&m[..2], &[1, 0], "destination unreachable / no route");
        assert_eq!(m[8] >> 4, 6);
        assert_eq!(u16::from_be_bytes([m[12], m[13]]), 20, "payload length");
        assert_eq!(m[14], 6, "next header must be TCP");
        assert_eq!(m[8 + 8 + 15], 2, "quoted src must be the local end");
        assert_eq!(&m[48..56], &[0, 1, 0, 2, 0, 0, 0, 7]);
    }

    #[test]
    fn checksum_matches_rfc1071_example() {
        // RFC 1071 §3: the one's complement sum of these bytes is 0xddf2.
        let b = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
        assert_eq!(checksum(&b), !0xddf2);
        assert_eq!(
            checksum(&[0xab]),
            !0xab00,
            "odd length pads with a zero byte"
        );
    }

    #[test]
    fn udp_is_never_stalled_and_unknown_tcp_is_an_error() {
        let udp = VirtualFlow {
            proto: Proto::Udp,
            local: "198.18.1.2:1".parse().unwrap(),
            remote: "198.18.3.2:2".parse().unwrap(),
        };
        assert_eq!(
            restart_flow(&udp, None).unwrap(),
            RestartOutcome::NotStalled
        );
        let tcp = VirtualFlow {
            proto: Proto::Tcp,
            ..udp
        };
        assert!(matches!(
            restart_flow(&tcp, None),
            Err(DatapathError::NoSuchConnection { .. })
        ));
    }

    #[test]
    fn tcp_probe_checksums_verify() {
        for (l, r) in [
            ("198.18.1.2:40000", "198.18.3.2:5001"),
            ("[fd00:5e:1::2]:40000", "[fd00:5e:3::2]:5001"),
        ] {
            let flow = VirtualFlow {
                proto: Proto::Tcp,
                local: l.parse().unwrap(),
                remote: r.parse().unwrap(),
            };
            let t = tcp_probe(&flow, 0x0102_0304, 0x0506_0708, 512);
            assert_eq!(t.len(), 20);
            assert_eq!(
                &t[..16],
                &[0x9c, 0x40, 0x13, 0x89, 1, 2, 3, 4, 5, 6, 7, 8, 0x50, 0x10, 2, 0]
            );
            let mut pseudo = Vec::new();
            match (flow.local.ip(), flow.remote.ip()) {
                (IpAddr::V4(s), IpAddr::V4(d)) => {
                    pseudo.extend_from_slice(&s.octets());
                    pseudo.extend_from_slice(&d.octets());
                    pseudo.extend_from_slice(&[0, 6, 0, 20]);
                }
                (s, d) => {
                    pseudo.extend_from_slice(&to_v6(s).octets());
                    pseudo.extend_from_slice(&to_v6(d).octets());
                    pseudo.extend_from_slice(&[0, 0, 0, 20, 0, 0, 0, 6]);
                }
            }
            pseudo.extend_from_slice(&t);
            assert_eq!(
                checksum(&pseudo),
                0,
                "TCP checksum of {flow:?} does not verify"
            );
        }
    }

    fn answer(kind: u16, body: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
        b.extend_from_slice(&kind.to_ne_bytes());
        b.extend_from_slice(&[0; 10]);
        b.extend_from_slice(body);
        b
    }

    #[test]
    fn parses_inet_diag_answers() {
        let mut body = vec![0u8; MSG_LEN];
        body[2] = 1;
        body[52..56].copy_from_slice(&4321u32.to_ne_bytes());
        let mut info = vec![0u8; 240];
        info[TCPI_RETRANSMITS] = 6;
        info[TCPI_BACKOFF] = 7;
        info[TCPI_WSCALE] = 0x7a;
        info[TCPI_TOTAL_RETRANS..TCPI_TOTAL_RETRANS + 4].copy_from_slice(&9u32.to_ne_bytes());
        info[TCPI_BYTES_ACKED..TCPI_BYTES_ACKED + 8]
            .copy_from_slice(&0x1_0000_0005u64.to_ne_bytes());
        info[TCPI_BYTES_RECEIVED..TCPI_BYTES_RECEIVED + 8].copy_from_slice(&6u64.to_ne_bytes());
        info[TCPI_SND_WND..TCPI_SND_WND + 4].copy_from_slice(&1000u32.to_ne_bytes());
        info[TCPI_RCV_WND..TCPI_RCV_WND + 4].copy_from_slice(&(300u32 << 7).to_ne_bytes());
        // An unrelated attribute first, with a length that needs padding.
        body.extend_from_slice(&5u16.to_ne_bytes());
        body.extend_from_slice(&8u16.to_ne_bytes());
        body.extend_from_slice(&[1, 0, 0, 0]);
        body.extend_from_slice(&((4 + info.len()) as u16).to_ne_bytes());
        body.extend_from_slice(&INET_DIAG_INFO.to_ne_bytes());
        body.extend_from_slice(&info);
        let s = parse_answer(&answer(SOCK_DIAG_BY_FAMILY, &body))
            .unwrap()
            .unwrap();
        assert_eq!(
            s,
            TcpState {
                timer: 1,
                expires_ms: 4321,
                retransmits: 6,
                backoff: 7,
                total_retrans: 9,
                bytes_acked: 0x1_0000_0005,
                bytes_received: 6,
                rcv_wscale: 7,
                snd_wnd: Some(1000),
                rcv_wnd: Some(300 << 7),
            }
        );
        assert!(s.rto_backed_off() && !s.probe_backed_off());
        assert_eq!(s.advertised_window(), 300);
        let probing = TcpState {
            timer: TIMER_PROBE0,
            retransmits: 0,
            ..s
        };
        assert!(probing.probe_backed_off() && !probing.rto_backed_off());
        assert!(
            !TcpState {
                snd_wnd: Some(0),
                ..probing
            }
            .probe_backed_off(),
            "a real zero window is left alone"
        );

        let gone = answer(libc::NLMSG_ERROR as u16, &(-libc::ENOENT).to_ne_bytes());
        assert_eq!(parse_answer(&gone).unwrap(), None);
        let denied = answer(libc::NLMSG_ERROR as u16, &(-libc::EPERM).to_ne_bytes());
        assert!(parse_answer(&denied).is_err());
        assert!(
            parse_answer(&[1, 2, 3]).is_err(),
            "short input is an error, not a panic"
        );
    }
}
