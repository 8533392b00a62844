//! sock_diag (inet_diag with INET_DIAG_INFO): the timer, backoff and
//! byte counts of one TCP socket.

use super::*;
use crate::datapath::kernel::rtnl::{with_kept, Kept};

/// What sock_diag (inet_diag with INET_DIAG_INFO) says about one socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TcpState {
    /// `idiag_timer`: 1 while the retransmission timer is pending.
    pub(super) timer: u8,
    /// `idiag_expires`: milliseconds until that timer fires.
    pub(super) expires_ms: u32,
    /// `tcpi_retransmits` (icsk_retransmits): timeouts of the oldest segment.
    pub(super) retransmits: u8,
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

/// A NETLINK_SOCK_DIAG socket in the caller's network namespace.
pub(super) struct SockDiag {
    pub(super) fd: OwnedFd,
}

pub(super) const SOCK_DIAG_BY_FAMILY: u16 = 20;
pub(super) const INET_DIAG_INFO: u16 = 2;
/// sizeof(struct inet_diag_req_v2), sizeof(struct inet_diag_msg).
pub(super) const REQ_LEN: usize = 56;
pub(super) const MSG_LEN: usize = 72;
pub(super) const NLMSG_HDRLEN: usize = 16;
/// `idiag_timer` values (inet_sk_diag_fill): ICSK_TIME_RETRANS (and the
/// loss-probe and reordering timers) is 1, ICSK_TIME_PROBE0 is 4.
pub(super) const TIMER_RETRANSMIT: u8 = 1;
pub(super) const TIMER_PROBE0: u8 = 4;
/// Offsets in struct tcp_info (include/uapi/linux/tcp.h).
pub(super) const TCPI_RETRANSMITS: usize = 2;
pub(super) const TCPI_BACKOFF: usize = 4;
/// `tcpi_snd_wscale : 4, tcpi_rcv_wscale : 4`: rcv in the high nibble.
pub(super) const TCPI_WSCALE: usize = 6;
pub(super) const TCPI_TOTAL_RETRANS: usize = 100;
pub(super) const TCPI_BYTES_ACKED: usize = 120;
pub(super) const TCPI_BYTES_RECEIVED: usize = 128;
pub(super) const TCPI_NOTSENT_BYTES: usize = 144;
pub(super) const TCPI_SND_WND: usize = 228;
pub(super) const TCPI_RCV_WND: usize = 232;

impl SockDiag {
    pub(super) fn open() -> Result<SockDiag, DatapathError> {
        // SAFETY: socket(2) takes no pointers; it returns a new descriptor,
        // owned at once below, or -1 (which `cvt` turns into an error).
        let raw = cvt(unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_SOCK_DIAG,
            )
        })
        .map_err(kernel_err("opening a sock_diag netlink socket"))?;
        // SAFETY: `raw` is the fresh descriptor socket(2) just returned;
        // nothing else owns it.
        Ok(SockDiag {
            fd: unsafe { OwnedFd::from_raw_fd(raw) },
        })
    }

    /// Run `f` with this thread's kept socket (see `rtnl::with_kept`): a
    /// move of thousands of connections makes one query per connection, and
    /// a socket each cost more than the query.
    pub(super) fn with_shared<T>(
        f: impl FnOnce(&SockDiag) -> Result<T, DatapathError>,
    ) -> Result<T, DatapathError> {
        thread_local! {
            static KEPT: Kept<SockDiag> = const { std::cell::RefCell::new(None) };
        }
        with_kept(
            &KEPT,
            kernel_err("finding this thread's network namespace"),
            SockDiag::open,
            |d| f(d),
        )
    }

    /// Poll until the socket's state differs from `last` or `wait` passes.
    pub(super) fn wait_for_change(
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
    pub(super) fn query(
        &self,
        flow: &VirtualFlow,
        cookie: u64,
    ) -> Result<Option<TcpState>, DatapathError> {
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
        // SAFETY: `fd` is owned by `self`, so open for the call; `req` and
        // `to` are live and their exact lengths are passed.
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
        // SAFETY: `fd` is owned by `self`, so open; recv writes at most
        // buf.len() bytes into `buf`.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(kernel_err("reading the sock_diag answer")(
                io::Error::last_os_error(),
            ));
        }
        parse_answer(&buf[..n as usize]).map_err(kernel_err("reading the sock_diag answer"))
    }
}

pub(super) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

pub(super) fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

pub(super) fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

/// One netlink answer to an exact inet_diag request: an inet_diag_msg with
/// attributes, or an NLMSG_ERROR (ENOENT / ESTALE when the socket is gone).
pub(super) fn parse_answer(b: &[u8]) -> io::Result<Option<TcpState>> {
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
    let inode = u32_at(msg, 68).ok_or_else(|| bad("short inet_diag_msg"))?;
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
                notsent_bytes: u32_at(info, TCPI_NOTSENT_BYTES).ok_or_else(short)?,
                snd_wnd: u32_at(info, TCPI_SND_WND),
                rcv_wnd: u32_at(info, TCPI_RCV_WND),
                inode: u64::from(inode),
            }));
        }
        at += (alen + 3) & !3;
    }
    Err(bad("no tcp_info in the sock_diag answer"))
}
