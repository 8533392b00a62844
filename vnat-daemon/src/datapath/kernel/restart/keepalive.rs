//! The keepalive hold (issue 18, item 3): while a connection is suspended
//! (`vnatctl suspend`) its host may be offline for minutes, and a socket
//! with TCP keepalive on (redis-cli sets 15 s) would probe a peer it cannot
//! reach and give up after a few unanswered probes, although the suspension
//! exists to carry it across. vnatd turns SO_KEEPALIVE off on the socket
//! (a duplicate taken from its process with pidfd_getfd, checked by inode,
//! as the push lever does) and on again once the connection works again
//! (`mobility::keepalive_release_due`). The socket's keepalive times
//! (TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT) are not touched; turning it
//! on again arms the timer for a full idle time from then.

use std::io;

use super::*;

/// Set TCP_USER_TIMEOUT (ms) of the socket of `pid` with `inode` to `ms`;
/// the value it had, or `None` if the owner no longer holds the socket.
pub(super) fn set_user_timeout(pid: u32, inode: u64, ms: u32) -> io::Result<Option<u32>> {
    if pid == 0 || inode == 0 {
        return Ok(None);
    }
    let Some(sock) = push::socket_of(pid, inode)? else {
        return Ok(None);
    };
    let old = getsockopt_int(&sock, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT)?;
    let ms = libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX);
    setsockopt(&sock, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT, &ms)?;
    Ok(Some(old.max(0) as u32))
}

/// SO_KEEPALIVE of the socket of `pid` with `inode`: with `on == false`,
/// turn it off if it is on; with `on == true`, turn it on. `Ok(true)`: it
/// was changed (off: it was on). `Ok(false)`: nothing to do, or no owner
/// is known, or the owner no longer holds the socket; an owner that is
/// gone is an error (ENOENT).
pub(super) fn set_keepalive(pid: u32, inode: u64, on: bool) -> io::Result<bool> {
    if pid == 0 || inode == 0 {
        return Ok(false);
    }
    let Some(sock) = push::socket_of(pid, inode)? else {
        return Ok(false);
    };
    let cur = getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_KEEPALIVE)?;
    if (cur != 0) == on {
        return Ok(false);
    }
    setsockopt(
        &sock,
        libc::SOL_SOCKET,
        libc::SO_KEEPALIVE,
        &libc::c_int::from(on),
    )?;
    Ok(true)
}

/// Whether `flow`'s socket waits for its peer (see
/// `Datapath::peer_silence`): keepalive or window probes out
/// (icsk_probes_out), or its oldest segment retransmitted
/// (icsk_retransmits). Both are cleared by the peer's next ACK.
pub fn peer_silence(
    flow: &VirtualFlow,
    record: &ConnRecord,
) -> Result<crate::datapath::PeerSilence, DatapathError> {
    use crate::datapath::PeerSilence;
    if flow.proto != Proto::Tcp {
        return Ok(PeerSilence::Gone);
    }
    let Some(state) = SockDiag::with_shared(|d| d.query(flow, record.cookie))? else {
        return Ok(PeerSilence::Gone);
    };
    Ok(if state.probes > 0 || state.retransmits > 0 {
        PeerSilence::Unanswered
    } else {
        PeerSilence::Answering
    })
}
