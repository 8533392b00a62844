//! Wakes the driver when addresses, links or routes change: an rtnetlink
//! socket subscribed to those groups. Messages are only sorted into vnat's
//! own changes (its host routes, the addresses it keeps on `lo`, its sink
//! appearing), which a move of many connections makes by the hundred and
//! which must not each cost a full resync, and everything else; any other
//! change (or an overflow, ENOBUFS, which means changes were lost) makes the
//! driver re-read the full state, so nothing can be missed or misapplied.

use std::io;

use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};
use tokio::io::unix::AsyncFd;

use crate::datapath::kernel::{notifications_matter, ROUTE_PROTO, SINK_DEV, SINK_PEER};

const RTMGRP_LINK: u32 = 0x1;
const RTMGRP_IPV4_IFADDR: u32 = 0x10;
const RTMGRP_IPV4_ROUTE: u32 = 0x40;
const RTMGRP_IPV6_IFADDR: u32 = 0x100;
const RTMGRP_IPV6_ROUTE: u32 = 0x400;

pub struct AddrWatch {
    socket: AsyncFd<Socket>,
    lo: u32,
}

impl AddrWatch {
    /// Subscribe in the calling thread's network namespace.
    pub fn new() -> io::Result<AddrWatch> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind(&SocketAddr::new(
            0,
            RTMGRP_LINK
                | RTMGRP_IPV4_IFADDR
                | RTMGRP_IPV6_IFADDR
                | RTMGRP_IPV4_ROUTE
                | RTMGRP_IPV6_ROUTE,
        ))?;
        socket.set_non_blocking(true)?;
        // SAFETY: the socket is moved into the AsyncFd, so its descriptor
        // stays open, and is the same one, for the AsyncFd's whole life.
        let socket = unsafe { AsyncFd::register(socket) }.map_err(|e| e.into_parts().1)?;
        // The loopback device is index 1 in every namespace; asked anyway.
        let lo = nix::net::if_::if_nametoindex("lo").unwrap_or(1);
        Ok(AddrWatch { socket, lo })
    }

    /// Wait for the next change that matters (draining everything queued).
    pub async fn changed(&self) -> io::Result<()> {
        let mut buf = Vec::with_capacity(BUF);
        loop {
            let mut guard = self.socket.readable().await?;
            let mut got = false;
            loop {
                buf.clear();
                match self.socket.get_ref().recv(&mut buf, 0) {
                    Ok(n) => {
                        // A datagram that filled the buffer may have been
                        // cut short, and what was cut off may matter.
                        got = got
                            || n >= BUF
                            || notifications_matter(
                                &buf,
                                self.lo,
                                ROUTE_PROTO,
                                &[SINK_DEV, SINK_PEER],
                            );
                        continue;
                    }
                    Err(e) => match e.raw_os_error() {
                        Some(libc::EAGAIN) => break,
                        // The kernel dropped notifications: resync all the
                        // same.
                        Some(libc::ENOBUFS) => got = true,
                        Some(libc::EINTR) => continue,
                        _ => return Err(e),
                    },
                }
            }
            guard.clear_ready();
            if got {
                return Ok(());
            }
        }
    }
}

/// One read: notifications come one message per datagram, far below this.
const BUF: usize = 16384;
