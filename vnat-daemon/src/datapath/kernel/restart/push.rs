//! The push lever: make a socket send the data it has queued, at once,
//! without a round trip to the peer.
//!
//! A send that failed locally (vnat's hold dropped it while the connection's
//! own end was moving, or there was no route) leaves the data at the head of
//! the socket's write queue and arms the probe timer; the socket sends again
//! when an ACK arrives (the peer's answer to a probe: one round trip) or when
//! the timer fires (an RTO, 200 ms or more). An application sends its queued
//! data at once by un-corking the socket: setsockopt(TCP_CORK, 0) clears the
//! cork bit and calls tcp_push_pending_frames, which sends what the peer's
//! window and the congestion window allow (__tcp_sock_set_cork). On a socket
//! that is not corked that is all it does, so vnatd does the same on the
//! application's behalf: it takes a duplicate of the socket from the process
//! recorded at connect() with pidfd_getfd (CAP_SYS_PTRACE), checks by inode
//! that it is the socket of the flow, leaves a corked socket alone, sets the
//! option and closes its duplicate. It never reads, writes or changes
//! anything else on the socket. Where it cannot (the owner is unknown, as for
//! accepted sockets, gone, or not ours to trace) the caller falls back to
//! asking the peer for an ACK.

use std::{fs, io, os::fd::OwnedFd};

use super::*;

/// The socket with `inode`, taken from process `pid`, if it still holds it.
pub(super) fn socket_of(pid: u32, inode: u64) -> io::Result<Option<OwnedFd>> {
    // The shared table if it knows the socket already (the levers that
    // found the process there), else the process's own, each kept between
    // calls: reading a 100,000-descriptor process's table once per
    // connection is what a batch of levers must not do.
    let hint = super::fds::known(inode)
        .filter(|(p, _)| *p == pid)
        .map(|(_, fd)| fd)
        .or_else(|| super::fds::holder_in(pid, inode));
    if let Some(fd) = hint {
        // A stale entry (closed, reused, the process gone) is a miss.
        if let Ok(Some(sock)) = take(pid, fd, inode) {
            return Ok(Some(sock));
        }
    }
    let want = format!("socket:[{inode}]");
    let Some(fd) = fs::read_dir(format!("/proc/{pid}/fd"))?
        .filter_map(Result::ok)
        .find(|e| fs::read_link(e.path()).is_ok_and(|l| l.as_os_str() == want.as_str()))
        .and_then(|e| e.file_name().to_str()?.parse::<libc::c_int>().ok())
    else {
        return Ok(None);
    };
    take(pid, fd, inode)
}

/// Descriptor `fd` of process `pid`, duplicated into ours, if it is the
/// socket `inode`.
fn take(pid: u32, fd: libc::c_int, inode: u64) -> io::Result<Option<OwnedFd>> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: pidfd_open takes no pointers; it returns a new descriptor,
    // owned at once below, or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `pidfd` is the fresh descriptor pidfd_open just returned;
    // nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as libc::c_int) };
    // SAFETY: pidfd_getfd takes no pointers: `pidfd` is open (owned above),
    // and `fd` is a number in the *other* process's table, which the kernel
    // looks up there and refuses if it is not open. The result is a new
    // descriptor in ours (close-on-exec), owned at once below, or -1.
    let dup = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if dup < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `dup` is the fresh descriptor pidfd_getfd just returned;
    // nothing else owns it.
    let dup = unsafe { OwnedFd::from_raw_fd(dup as libc::c_int) };
    // The descriptor number may have been reused since /proc was read:
    // only the same inode is the flow's socket.
    // SAFETY: struct stat is plain integers, for which all-zero is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `dup` is open (owned above); fstat writes only the live
    // `st` it is given.
    cvt(unsafe { libc::fstat(dup.as_raw_fd(), &mut st) })?;
    Ok((st.st_ino == inode).then_some(dup))
}

/// Un-cork the socket of `pid` with `inode` if it is not corked (see the
/// module documentation). `Ok(false)`: nothing was done.
pub(super) fn push_queued(pid: u32, inode: u64) -> io::Result<bool> {
    if pid == 0 || inode == 0 {
        return Ok(false);
    }
    let Some(sock) = socket_of(pid, inode)? else {
        return Ok(false);
    };
    let mut corked: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `sock` is open (owned here); `corked` and `len` are live and
    // sized for TCP_CORK's int, and the kernel writes at most `len` bytes.
    cvt(unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_CORK,
            (&mut corked as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    if corked != 0 {
        // The application holds its data back on purpose.
        return Ok(false);
    }
    setsockopt(&sock, libc::IPPROTO_TCP, libc::TCP_CORK, &0 as &libc::c_int)?;
    Ok(true)
}
