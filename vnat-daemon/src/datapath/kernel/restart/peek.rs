//! The sequence numbers of a TCP connection sock_ops never saw (issue 18,
//! item 6: adoption). A connection opened before vnatd started, or before
//! its cgroup was enabled, has no record of its first sequence numbers, and
//! vnat needs them: they name the connection to the peer's vnatd (a strong
//! binding, `vcmp::Binding::tcp`) and give the restart levers the socket's
//! `snd_una` and `rcv_nxt` (with tcp_info's byte counters).
//!
//! No interface reads a live socket's sequence numbers except TCP_REPAIR
//! (what CRIU uses): in repair mode TCP_QUEUE_SEQ reads `rcv_nxt` (receive
//! queue selected) or `write_seq` (send queue), and SIOCOUTQ gives
//! `write_seq - snd_una` at any time. vnatd takes a duplicate of the socket
//! from its process (pidfd_getfd, as the push lever does), turns repair on,
//! reads, and turns it off without the window probe (TCP_REPAIR_OFF_NO_WP).
//!
//! What repair mode does meanwhile, and what is done about it:
//! - Leaving it sets the socket's SO_REUSEADDR to off; the value read
//!   before is set again.
//! - While the send queue is selected (two system calls), data the
//!   application writes is queued as sent without being sent
//!   (tcp_write_xmit); it goes out at the next retransmission timeout. The
//!   send queue is selected only for the one read.
//! - A socket already in repair mode (being checkpointed) is left alone.
//!
//! Each value is read under the socket's lock, but not all at once: an ACK
//! or data arriving, or a write, between two reads would mix two moments.
//! So tcp_info's byte counters are read before and after, and a round whose
//! counters changed does not count; two rounds must agree.

use std::io;

use super::*;

const TCP_REPAIR_OFF_NO_WP: libc::c_int = -1;
const TCP_NO_QUEUE: libc::c_int = 0;
const TCP_RECV_QUEUE: libc::c_int = 1;
const TCP_SEND_QUEUE: libc::c_int = 2;
/// `tcpi_state`: the first byte of tcp_info.
const TCPI_STATE: usize = 0;
const TCP_ESTABLISHED: u8 = 1;
/// Rounds tried before giving up (until the next look).
const MAX_ROUNDS: usize = 6;

/// What sock_ops would have recorded at establishment: `snd_una -
/// bytes_acked` and `rcv_nxt - bytes_received` (mod 2^32), constant for the
/// connection's life (see `ConnRecord::snd_una_base`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequenceBases {
    pub snd_una_base: u32,
    pub rcv_nxt_base: u32,
}

/// The bases of the established TCP socket of `pid` with `inode`, or `None`
/// when the process no longer holds it, it is not established, it is in
/// repair mode already, or its counters never held still for two rounds.
pub(super) fn sequence_bases(pid: u32, inode: u64) -> io::Result<Option<SequenceBases>> {
    if pid == 0 || inode == 0 {
        return Ok(None);
    }
    let Some(sock) = push::socket_of(pid, inode)? else {
        return Ok(None);
    };
    if getsockopt_int(&sock, libc::IPPROTO_TCP, libc::TCP_REPAIR)? != 0 {
        return Ok(None);
    }
    let reuse = getsockopt_int(&sock, libc::SOL_SOCKET, libc::SO_REUSEADDR)?;
    setsockopt(
        &sock,
        libc::IPPROTO_TCP,
        libc::TCP_REPAIR,
        &1 as &libc::c_int,
    )?;
    let repair = Repair { sock: &sock, reuse };
    let mut last = None;
    for _ in 0..MAX_ROUNDS {
        let Some(now) = repair.round()? else {
            continue;
        };
        if last == Some(now) {
            return Ok(Some(now));
        }
        last = Some(now);
    }
    Ok(None)
}

/// A socket in repair mode; leaving it restores what entering changed.
struct Repair<'a> {
    sock: &'a OwnedFd,
    reuse: libc::c_int,
}

impl Repair<'_> {
    /// One reading, `None` if the counters moved during it (or the socket
    /// is no longer established).
    fn round(&self) -> io::Result<Option<SequenceBases>> {
        let before = self.counters()?;
        let Some((acked, received)) = before else {
            return Ok(None);
        };
        let rcv_nxt = self.queue_seq(TCP_RECV_QUEUE)?;
        let write_seq = self.queue_seq(TCP_SEND_QUEUE);
        setsockopt(
            self.sock,
            libc::IPPROTO_TCP,
            libc::TCP_REPAIR_QUEUE,
            &TCP_NO_QUEUE,
        )?;
        let write_seq = write_seq?;
        let mut outq: libc::c_int = 0;
        // SAFETY: `sock` is open (borrowed); TIOCOUTQ (SIOCOUTQ) writes one
        // int, into the live `outq`.
        cvt(unsafe { libc::ioctl(self.sock.as_raw_fd(), libc::TIOCOUTQ, &mut outq) })?;
        if self.counters()? != before {
            return Ok(None);
        }
        let snd_una = (write_seq as u32).wrapping_sub(outq as u32);
        Ok(Some(SequenceBases {
            snd_una_base: snd_una.wrapping_sub(acked as u32),
            rcv_nxt_base: (rcv_nxt as u32).wrapping_sub(received as u32),
        }))
    }

    fn queue_seq(&self, queue: libc::c_int) -> io::Result<libc::c_int> {
        setsockopt(self.sock, libc::IPPROTO_TCP, libc::TCP_REPAIR_QUEUE, &queue)?;
        getsockopt_int(self.sock, libc::IPPROTO_TCP, libc::TCP_QUEUE_SEQ)
    }

    /// tcp_info's bytes acked and received, `None` unless established.
    fn counters(&self) -> io::Result<Option<(u64, u64)>> {
        let mut info = [0u8; 256];
        let mut len = info.len() as libc::socklen_t;
        // SAFETY: `sock` is open (borrowed); the kernel writes at most `len`
        // bytes into `info`, which has that many, and stores the length it
        // wrote in the live `len`.
        cvt(unsafe {
            libc::getsockopt(
                self.sock.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_INFO,
                info.as_mut_ptr().cast(),
                &mut len,
            )
        })?;
        let info = &info[..(len as usize).min(info.len())];
        if info.get(TCPI_STATE) != Some(&TCP_ESTABLISHED) {
            return Ok(None);
        }
        let short = || io::Error::new(io::ErrorKind::InvalidData, "short tcp_info");
        Ok(Some((
            sockdiag::u64_at(info, sockdiag::TCPI_BYTES_ACKED).ok_or_else(short)?,
            sockdiag::u64_at(info, sockdiag::TCPI_BYTES_RECEIVED).ok_or_else(short)?,
        )))
    }
}

impl Drop for Repair<'_> {
    fn drop(&mut self) {
        let _ = setsockopt(
            self.sock,
            libc::IPPROTO_TCP,
            libc::TCP_REPAIR_QUEUE,
            &TCP_NO_QUEUE,
        );
        if let Err(e) = setsockopt(
            self.sock,
            libc::IPPROTO_TCP,
            libc::TCP_REPAIR,
            &TCP_REPAIR_OFF_NO_WP,
        ) {
            tracing::error!(error = %e, "could not take an adopted socket out of repair mode");
        }
        let _ = setsockopt(self.sock, libc::SOL_SOCKET, libc::SO_REUSEADDR, &self.reuse);
    }
}
