//! Wakes the driver when addresses, links or routes change: an rtnetlink
//! socket subscribed to those groups. Messages are only sorted into vnat's
//! own changes (its host routes, the addresses it keeps on `lo`), which a
//! move of many connections makes by the hundred and which must not each
//! cost a full resync, and everything else; any other change (or an
//! overflow, ENOBUFS, which means changes were lost) makes the driver re-read
//! the full state, so nothing can be missed or misapplied.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

use tokio::io::unix::AsyncFd;

use crate::datapath::kernel::{notifications_matter, ROUTE_PROTO};

const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;

pub struct AddrWatch {
    fd: AsyncFd<OwnedFd>,
    lo: u32,
}

impl AddrWatch {
    /// Subscribe in the calling thread's network namespace.
    pub fn new() -> io::Result<AddrWatch> {
        // SAFETY: socket(2) takes no pointers; it returns a new descriptor,
        // owned at once below, or -1.
        let raw = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is the descriptor socket(2) just returned; nothing
        // else owns it, so the OwnedFd is its only owner and closes it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: sockaddr_nl is plain integers, for which all-zero is valid
        // (pid 0 is the kernel).
        let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        sa.nl_family = libc::AF_NETLINK as u16;
        sa.nl_groups = RTMGRP_LINK
            | RTMGRP_IPV4_IFADDR
            | RTMGRP_IPV6_IFADDR
            | RTMGRP_IPV4_ROUTE
            | RTMGRP_IPV6_ROUTE;
        // SAFETY: `fd` is open (owned above), and `sa` is a live sockaddr_nl
        // whose exact size is passed, so the kernel reads only within it.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sa as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is an OwnedFd moved into the AsyncFd, so it stays open
        // and is the same descriptor for the AsyncFd's whole life.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)?;
        // The loopback device is index 1 in every namespace; asked anyway.
        let lo = nix::net::if_::if_nametoindex("lo").unwrap_or(1);
        Ok(AddrWatch { fd, lo })
    }

    /// Wait for the next change that matters (draining everything queued).
    pub async fn changed(&self) -> io::Result<()> {
        loop {
            let mut guard = self.fd.readable().await?;
            let mut buf = [0u8; 16384];
            let mut got = false;
            loop {
                // SAFETY: the descriptor is owned by the AsyncFd and open
                // while `self` lives; recv writes at most buf.len() bytes
                // into `buf`, a live stack array.
                let n = unsafe {
                    libc::recv(
                        self.fd.get_ref().as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        0,
                    )
                };
                if n >= 0 {
                    // A datagram that filled the buffer may have been cut
                    // short, and what was cut off may matter.
                    let n = n as usize;
                    got = got
                        || n == buf.len()
                        || notifications_matter(&buf[..n], self.lo, ROUTE_PROTO);
                    continue;
                }
                let e = io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::EAGAIN) => break,
                    // The kernel dropped notifications: resync all the same.
                    Some(libc::ENOBUFS) => got = true,
                    Some(libc::EINTR) => continue,
                    _ => return Err(e),
                }
            }
            guard.clear_ready();
            if got {
                return Ok(());
            }
        }
    }
}
