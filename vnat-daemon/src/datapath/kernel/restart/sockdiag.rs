//! sock_diag (inet_diag with INET_DIAG_INFO): the timer, backoff and
//! byte counts of one TCP socket.

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_packet_sock_diag::{
    inet::{nlas::Nla, ExtensionFlags, InetRequest, SocketId, StateFlags, Timer},
    SockDiagDestroy, SockDiagMessage, AF_INET, AF_INET6, IPPROTO_TCP, IPPROTO_UDP,
};
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket, SocketAddr as NlAddr};

use super::*;
use crate::datapath::kernel::rtnl::{recv_answer, request_socket, with_kept, Kept};

/// What sock_diag (inet_diag with INET_DIAG_INFO) says about one socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TcpState {
    /// `idiag_timer`: 1 while the retransmission timer is pending.
    pub(super) timer: u8,
    /// `idiag_expires`: milliseconds until that timer fires.
    pub(super) expires_ms: u32,
    /// `tcpi_retransmits` (icsk_retransmits): timeouts of the oldest segment.
    pub(super) retransmits: u8,
    /// `tcpi_probes` (icsk_probes_out): keepalive or window probes sent
    /// and not answered.
    pub(super) probes: u8,
    /// `tcpi_backoff` (icsk_backoff): how many times the timeout doubled.
    pub(super) backoff: u8,
    /// `tcpi_total_retrans`: grows with every retransmitted segment.
    pub(super) total_retrans: u32,
    /// `tcpi_bytes_acked`, `tcpi_bytes_received` (RFC 4898): with the bases
    /// recorded at establishment, `snd_una` and `rcv_nxt`.
    pub(super) bytes_acked: u64,
    pub(super) bytes_received: u64,
    /// `tcpi_rcv_wscale`.
    pub(super) rcv_wscale: u8,
    /// `tcpi_snd_wscale`: the shift of the peer's window field.
    pub(super) snd_wscale: u8,
    /// `idiag_wqueue`: `write_seq - snd_una`, everything written and not
    /// acknowledged.
    pub(super) send_queue: u32,
    /// `tcpi_bytes_sent`: grows with every byte sent, retransmissions too.
    pub(super) bytes_sent: u64,
    /// `tcpi_notsent_bytes`: written by the application, never sent.
    pub(super) notsent_bytes: u32,
    /// `tcpi_snd_wnd`, `tcpi_rcv_wnd` (Linux 5.19 / 6.2; `None` before).
    pub(super) snd_wnd: Option<u32>,
    pub(super) rcv_wnd: Option<u32>,
    /// `idiag_inode`: the socket's inode (0 if it has no file, such as a
    /// socket not yet accepted).
    pub(super) inode: u64,
}

impl TcpState {
    /// Waiting on a backed-off retransmission timer: the precondition of
    /// tcp_ld_RTO_revert (icsk_retransmits and icsk_backoff non-zero).
    pub(super) fn rto_backed_off(&self) -> bool {
        self.timer == TIMER_RETRANSMIT && self.retransmits > 0 && self.backoff > 0
    }

    /// Waiting on the probe timer although the peer's window is open:
    /// sending failed locally (no route, or vnat's hold during a move), not
    /// a zero window. Backed off or not: even the first wait is an RTO (200
    /// ms or more), where an ACK from the peer takes one round trip. With
    /// nothing in flight the probe timer is armed only when data could not
    /// be sent, so a healthy socket never matches. Against a real zero
    /// window an ACK would change nothing.
    pub(super) fn probe_stuck(&self) -> bool {
        self.timer == TIMER_PROBE0 && self.snd_wnd != Some(0)
    }

    /// The window field the socket itself would send (tcp_select_window).
    pub(super) fn advertised_window(&self) -> u16 {
        self.rcv_wnd.map_or(u16::MAX, |w| {
            (w >> self.rcv_wscale).min(u32::from(u16::MAX)) as u16
        })
    }

    /// The kernel did not act on a message in between.
    pub(super) fn same_as(&self, o: &TcpState) -> bool {
        (
            self.timer,
            self.backoff,
            self.retransmits,
            self.total_retrans,
        ) == (o.timer, o.backoff, o.retransmits, o.total_retrans)
    }
}

/// A NETLINK_SOCK_DIAG socket in the caller's network namespace, and the
/// buffer its answers are read into.
pub(super) struct SockDiag {
    socket: Socket,
    buf: Vec<u8>,
}

/// `idiag_timer` values (inet_sk_diag_fill): ICSK_TIME_RETRANS (and the
/// loss-probe and reordering timers) is 1, ICSK_TIME_PROBE0 is 4.
pub(super) const TIMER_RETRANSMIT: u8 = 1;
pub(super) const TIMER_PROBE0: u8 = 4;
/// Offsets in struct tcp_info (include/uapi/linux/tcp.h). It is read by
/// offset, not as netlink-packet-sock-diag's `TcpInfo`: that one ends
/// before `tcpi_rcv_wnd` (Linux 6.2) and rejects the shorter struct of
/// kernels older than its own.
pub(super) const TCPI_RETRANSMITS: usize = 2;
pub(super) const TCPI_PROBES: usize = 3;
pub(super) const TCPI_BACKOFF: usize = 4;
/// `tcpi_snd_wscale : 4, tcpi_rcv_wscale : 4`: rcv in the high nibble.
pub(super) const TCPI_WSCALE: usize = 6;
pub(super) const TCPI_TOTAL_RETRANS: usize = 100;
pub(super) const TCPI_BYTES_ACKED: usize = 120;
pub(super) const TCPI_BYTES_RECEIVED: usize = 128;
pub(super) const TCPI_NOTSENT_BYTES: usize = 144;
pub(super) const TCPI_BYTES_SENT: usize = 200;
pub(super) const TCPI_SND_WND: usize = 228;
pub(super) const TCPI_RCV_WND: usize = 232;

impl SockDiag {
    pub(super) fn open() -> Result<SockDiag, DatapathError> {
        Ok(SockDiag {
            socket: request_socket(NETLINK_SOCK_DIAG)
                .map_err(kernel_err("opening a sock_diag netlink socket"))?,
            buf: Vec::with_capacity(8192),
        })
    }

    /// Run `f` with this thread's kept socket (see `rtnl::with_kept`): a
    /// move of thousands of connections makes one query per connection, and
    /// a socket each cost more than the query.
    pub(super) fn with_shared<T>(
        f: impl FnOnce(&mut SockDiag) -> Result<T, DatapathError>,
    ) -> Result<T, DatapathError> {
        thread_local! {
            static KEPT: Kept<SockDiag> = const { std::cell::RefCell::new(None) };
        }
        with_kept(
            &KEPT,
            kernel_err("finding this thread's network namespace"),
            SockDiag::open,
            f,
        )
    }

    /// Poll until the socket's state differs from `last` or `wait` passes.
    pub(super) fn wait_for_change(
        &mut self,
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
    pub(super) fn query(
        &mut self,
        flow: &VirtualFlow,
        cookie: u64,
    ) -> Result<Option<TcpState>, DatapathError> {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST;
        let mut req = NetlinkMessage::new(
            header,
            NetlinkPayload::from(SockDiagMessage::InetRequest(request(flow, cookie))),
        );
        req.finalize();
        let mut bytes = vec![0u8; req.buffer_len()];
        req.serialize(&mut bytes);
        self.socket
            .send_to(&bytes, &NlAddr::new(0, 0), 0)
            .map_err(kernel_err("querying sock_diag"))?;
        self.buf.clear();
        self.buf.reserve(8192);
        recv_answer(&self.socket, &mut self.buf)
            .map_err(kernel_err("reading the sock_diag answer"))?;
        parse_answer(&self.buf).map_err(kernel_err("reading the sock_diag answer"))
    }
}

/// Destroy the socket of `flow` (SOCK_DESTROY, as `ss -K` does: the kernel
/// aborts it, a TCP socket with a reset to its peer). `cookie` 0 matches
/// any socket with the tuple. Returns false if there is none.
pub(super) fn destroy(flow: &VirtualFlow, cookie: u64) -> Result<bool, DatapathError> {
    let mut req = request(flow, cookie);
    if flow.proto == Proto::Udp {
        req.protocol = IPPROTO_UDP;
    }
    req.extensions = ExtensionFlags::empty();
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_ACK;
    let mut msg = NetlinkMessage::new(
        header,
        NetlinkPayload::from(SockDiagDestroy::new(SockDiagMessage::InetRequest(req))),
    );
    msg.finalize();
    let mut bytes = vec![0u8; msg.buffer_len()];
    msg.serialize(&mut bytes);
    let socket = request_socket(NETLINK_SOCK_DIAG)
        .map_err(kernel_err("opening a sock_diag netlink socket"))?;
    socket
        .send_to(&bytes, &NlAddr::new(0, 0), 0)
        .map_err(kernel_err("asking sock_diag to destroy a socket"))?;
    let mut buf = Vec::with_capacity(4096);
    recv_answer(&socket, &mut buf).map_err(kernel_err("reading the sock_diag answer"))?;
    let answer = NetlinkMessage::<SockDiagDestroy>::deserialize(&buf)
        .map_err(bad)
        .map_err(kernel_err("reading the sock_diag answer"))?;
    match answer.payload {
        NetlinkPayload::Error(e) => match e.code.map(|c| -c.get()) {
            None => Ok(true),
            // Gone, or another socket has the tuple now (the cookie differs).
            Some(libc::ENOENT) | Some(libc::ESTALE) => Ok(false),
            Some(libc::EOPNOTSUPP) => Err(DatapathError::Kernel {
                what: format!(
                    "destroying the socket of {flow} (the kernel lacks CONFIG_INET_DIAG_DESTROY)"
                ),
                source: std::io::Error::from_raw_os_error(libc::EOPNOTSUPP),
            }),
            Some(errno) => Err(DatapathError::Kernel {
                what: format!("destroying the socket of {flow}"),
                source: std::io::Error::from_raw_os_error(errno),
            }),
        },
        _ => Err(DatapathError::Kernel {
            what: format!("destroying the socket of {flow}"),
            source: std::io::Error::other("sock_diag answered with no acknowledgement"),
        }),
    }
}

/// One socket of a sock_diag dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listed {
    /// The socket's ends; an IPv6 socket's IPv4-mapped ends as IPv4, as
    /// the recorders key them.
    pub local: std::net::SocketAddr,
    pub remote: std::net::SocketAddr,
    /// `idiag_state` (TCP_ESTABLISHED is 1, TCP_LISTEN 10; a connected UDP
    /// socket is "established").
    pub state: u8,
    /// `sock_gen_cookie`, as `bpf_get_socket_cookie`.
    pub cookie: u64,
    pub inode: u64,
    /// INET_DIAG_CGROUP_ID: the cgroup the socket was made in (an accepted
    /// socket: its listener's), 0 if the kernel did not say.
    pub cgroup_id: u64,
}

/// INET_DIAG_CGROUP_ID (Linux 5.7), which the crate does not name: sent
/// with every answer.
const INET_DIAG_CGROUP_ID: u16 = 21;

/// Every socket of `protocol` (IPPROTO_TCP or IPPROTO_UDP) in one of
/// `states` (bit `1 << state`), both families, in this thread's network
/// namespace.
pub(super) fn dump(protocol: u8, states: u32) -> Result<Vec<Listed>, DatapathError> {
    // A dump the crate cannot read to its end (no DONE recognised) must not
    // block the datapath thread for ever: the socket's reads time out.
    let socket = request_socket(NETLINK_SOCK_DIAG)
        .map_err(kernel_err("opening a sock_diag netlink socket"))?;
    let mut out = Vec::new();
    let mut buf = Vec::with_capacity(64 * 1024);
    for (seq, family) in [(1, AF_INET), (2, AF_INET6)] {
        let req = InetRequest {
            family,
            protocol,
            extensions: ExtensionFlags::empty(),
            states: StateFlags::from_bits_retain(states),
            socket_id: if family == AF_INET {
                SocketId::new_v4()
            } else {
                SocketId::new_v6()
            },
        };
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        header.sequence_number = seq;
        let mut msg = NetlinkMessage::new(
            header,
            NetlinkPayload::from(SockDiagMessage::InetRequest(req)),
        );
        msg.finalize();
        let mut bytes = vec![0u8; msg.buffer_len()];
        msg.serialize(&mut bytes);
        socket
            .send_to(&bytes, &NlAddr::new(0, 0), 0)
            .map_err(kernel_err("asking sock_diag for a socket list"))?;
        'answer: loop {
            buf.clear();
            buf.reserve(64 * 1024);
            recv_answer(&socket, &mut buf)
                .map_err(kernel_err("reading the sock_diag socket list"))?;
            for (s, m) in crate::datapath::kernel::rtnl::messages::<SockDiagMessage>(&buf) {
                if s != seq {
                    continue;
                }
                let Ok(m) = m else { continue };
                match m.payload {
                    NetlinkPayload::Done(_) => break 'answer,
                    NetlinkPayload::Error(e) => {
                        let Some(code) = e.code else { break 'answer };
                        let errno = code.get().wrapping_neg();
                        return Err(DatapathError::Kernel {
                            what: "listing sockets with sock_diag".into(),
                            source: io::Error::from_raw_os_error(errno),
                        });
                    }
                    NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                        out.push(listed(&r));
                    }
                    _ => {}
                }
            }
        }
    }
    Ok(out)
}

fn listed(r: &netlink_packet_sock_diag::inet::InetResponse) -> Listed {
    use netlink_packet_core::Nla as _;
    let id = &r.header.socket_id;
    let c = &id.cookie;
    let cookie = u64::from(u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        | u64::from(u32::from_ne_bytes([c[4], c[5], c[6], c[7]])) << 32;
    let cgroup_id = r
        .nlas
        .iter()
        .find_map(|n| match n {
            Nla::Other(a) if a.kind() == INET_DIAG_CGROUP_ID && a.value_len() == 8 => {
                let mut v = [0u8; 8];
                a.emit_value(&mut v);
                Some(u64::from_ne_bytes(v))
            }
            _ => None,
        })
        .unwrap_or(0);
    Listed {
        local: std::net::SocketAddr::new(id.source_address.to_canonical(), id.source_port),
        remote: std::net::SocketAddr::new(
            id.destination_address.to_canonical(),
            id.destination_port,
        ),
        state: r.header.state,
        cookie,
        inode: u64::from(r.header.inode),
        cgroup_id,
    }
}

/// The exact inet_diag request for `flow`'s socket: every state, with
/// tcp_info. Both ends are given in the socket's family: a mixed pair is an
/// IPv6 socket with IPv4-mapped addresses.
pub(super) fn request(flow: &VirtualFlow, cookie: u64) -> InetRequest {
    let v6 = !(flow.local.is_ipv4() && flow.remote.is_ipv4());
    let addr = |a: IpAddr| match a {
        IpAddr::V4(v4) if v6 => IpAddr::V6(v4.to_ipv6_mapped()),
        a => a,
    };
    // The cookie (sock_gen_cookie, as bpf_get_socket_cookie) makes sure it
    // is the recorded socket and not a later one with the same 4-tuple
    // (sock_diag_check_cookie): two native-endian u32, low half first; all
    // ones means unknown.
    let mut id = [0xffu8; 8];
    if cookie != 0 {
        id[..4].copy_from_slice(&(cookie as u32).to_ne_bytes());
        id[4..].copy_from_slice(&((cookie >> 32) as u32).to_ne_bytes());
    }
    InetRequest {
        family: if v6 { AF_INET6 } else { AF_INET },
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::INFO,
        // Every state, also those newer than the crate (`all()` has only
        // the ones it names).
        states: StateFlags::from_bits_retain(u32::MAX),
        socket_id: SocketId {
            source_port: flow.local.port(),
            destination_port: flow.remote.port(),
            source_address: addr(flow.local.ip()),
            destination_address: addr(flow.remote.ip()),
            interface_id: 0,
            cookie: id,
        },
    }
}

pub(super) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

pub(super) fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

pub(super) fn bad(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// One netlink answer to an exact inet_diag request: an inet_diag_msg with
/// attributes, or an NLMSG_ERROR (ENOENT / ESTALE when the socket is gone).
pub(super) fn parse_answer(b: &[u8]) -> io::Result<Option<TcpState>> {
    let answer = NetlinkMessage::<SockDiagMessage>::deserialize(b).map_err(bad)?;
    let r = match answer.payload {
        NetlinkPayload::Error(e) => {
            return match e.code.map(|c| c.get().wrapping_neg()) {
                Some(libc::ENOENT) | Some(libc::ESTALE) => Ok(None),
                None => Err(bad("sock_diag acknowledged without an answer")),
                Some(e) => Err(io::Error::from_raw_os_error(e)),
            };
        }
        NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => r,
        _ => return Err(bad("unexpected netlink message type")),
    };
    // TIME_WAIT (a twsk, answered without tcp_info) and CLOSE: the
    // connection is over, as for the callers' purposes it is gone.
    if matches!(r.header.state, 6 | 7) {
        return Ok(None);
    }
    let (timer, expires) = match r.header.timer {
        None => (0, Duration::ZERO),
        Some(Timer::Retransmit(d, _)) => (TIMER_RETRANSMIT, d),
        Some(Timer::KeepAlive(d)) => (2, d),
        Some(Timer::TimeWait) => (3, Duration::ZERO),
        Some(Timer::Probe(d)) => (TIMER_PROBE0, d),
    };
    let info = r
        .nlas
        .iter()
        .find_map(|n| match n {
            Nla::TcpInfo(info) => Some(info),
            _ => None,
        })
        .ok_or_else(|| bad("no tcp_info in the sock_diag answer"))?;
    let short = || bad("short tcp_info");
    Ok(Some(TcpState {
        timer,
        expires_ms: u32::try_from(expires.as_millis()).unwrap_or(u32::MAX),
        retransmits: *info.get(TCPI_RETRANSMITS).ok_or_else(short)?,
        probes: *info.get(TCPI_PROBES).ok_or_else(short)?,
        backoff: *info.get(TCPI_BACKOFF).ok_or_else(short)?,
        total_retrans: u32_at(info, TCPI_TOTAL_RETRANS).ok_or_else(short)?,
        bytes_acked: u64_at(info, TCPI_BYTES_ACKED).ok_or_else(short)?,
        bytes_received: u64_at(info, TCPI_BYTES_RECEIVED).ok_or_else(short)?,
        rcv_wscale: info.get(TCPI_WSCALE).ok_or_else(short)? >> 4,
        snd_wscale: info.get(TCPI_WSCALE).ok_or_else(short)? & 0x0f,
        send_queue: r.header.send_queue,
        bytes_sent: u64_at(info, TCPI_BYTES_SENT).ok_or_else(short)?,
        notsent_bytes: u32_at(info, TCPI_NOTSENT_BYTES).ok_or_else(short)?,
        snd_wnd: u32_at(info, TCPI_SND_WND),
        rcv_wnd: u32_at(info, TCPI_RCV_WND).filter(|_| {
            !crate::datapath::kernel::features::simulated_missing(
                crate::datapath::kernel::features::Feature::TcpInfoWindows,
            )
        }),
        inode: u64::from(r.header.inode),
    }))
}
