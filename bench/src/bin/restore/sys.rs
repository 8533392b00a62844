//! The few system calls the restoration benchmark's client and echo server
//! need beyond std: epoll (one thread watches thousands of sockets), a
//! non-blocking connect, and a higher open-file limit.

use std::{
    io, mem,
    net::{SocketAddr, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
};

use nix::libc;

/// Readable, or the peer closed its side.
pub const IN: u32 = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
pub const OUT: u32 = libc::EPOLLOUT as u32;

/// A level-triggered epoll set whose events carry a `u64` token.
pub struct Epoll(OwnedFd);

impl Epoll {
    pub fn new() -> io::Result<Epoll> {
        // SAFETY: epoll_create1 returns a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor that nothing else owns.
        Ok(Epoll(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn buffer(n: usize) -> Vec<libc::epoll_event> {
        vec![libc::epoll_event { events: 0, u64: 0 }; n]
    }

    fn ctl(&self, op: libc::c_int, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        let mut ev = libc::epoll_event { events, u64: token };
        // SAFETY: a valid epoll descriptor and a live epoll_event.
        if unsafe { libc::epoll_ctl(self.0.as_raw_fd(), op, fd, &mut ev) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    pub fn add(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_ADD, fd, events, token)
    }

    pub fn modify(&self, fd: RawFd, events: u32, token: u64) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_MOD, fd, events, token)
    }

    pub fn delete(&self, fd: RawFd) -> io::Result<()> {
        self.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0)
    }

    /// Waits up to `timeout_ms` (-1: for ever) and returns (token, events)
    /// of the ready descriptors; an interrupted wait returns none.
    pub fn wait(
        &self,
        buf: &mut [libc::epoll_event],
        timeout_ms: i32,
    ) -> io::Result<Vec<(u64, u32)>> {
        // SAFETY: buf is a live, writable array of buf.len() events.
        let n = unsafe {
            libc::epoll_wait(
                self.0.as_raw_fd(),
                buf.as_mut_ptr(),
                buf.len() as libc::c_int,
                timeout_ms,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return if e.kind() == io::ErrorKind::Interrupted {
                Ok(Vec::new())
            } else {
                Err(e)
            };
        }
        Ok(buf[..n as usize]
            .iter()
            .map(|e| (e.u64, e.events))
            .collect())
    }
}

/// Raises this process's RLIMIT_NOFILE as far as it may: both limits to
/// fs.nr_open when it can (root; 100,000 connections need more than the
/// usual hard limit), else the soft limit to the hard one (a thousand
/// connections already exceed the usual soft limit of 1024).
pub fn raise_nofile_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    let nr_open: u64 = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    // SAFETY: getrlimit/setrlimit read and write the rlimit given.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return Err(io::Error::last_os_error());
        }
        if nr_open > lim.rlim_max {
            let all = libc::rlimit {
                rlim_cur: nr_open,
                rlim_max: nr_open,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &all) == 0 {
                return Ok(nr_open);
            }
        }
        lim.rlim_cur = lim.rlim_max;
        if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(lim.rlim_cur)
}

/// Starts a non-blocking TCP connect to `to` (IPv4 or IPv6); it completes
/// when the socket becomes writable (then check [`take_error`]).
pub fn connect_nonblocking(to: SocketAddr) -> io::Result<TcpStream> {
    let family = if to.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: socket() returns a new descriptor or -1; the sockaddr passed
    // to connect() is a live value of the length given.
    unsafe {
        let fd = libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        let rc = match to {
            SocketAddr::V4(a) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: a.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from_ne_bytes(a.ip().octets()),
                    },
                    sin_zero: [0; 8],
                };
                libc::connect(
                    fd,
                    (&sin as *const libc::sockaddr_in).cast(),
                    mem::size_of_val(&sin) as libc::socklen_t,
                )
            }
            SocketAddr::V6(a) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: a.port().to_be(),
                    sin6_flowinfo: 0,
                    sin6_addr: libc::in6_addr {
                        s6_addr: a.ip().octets(),
                    },
                    sin6_scope_id: a.scope_id(),
                };
                libc::connect(
                    fd,
                    (&sin6 as *const libc::sockaddr_in6).cast(),
                    mem::size_of_val(&sin6) as libc::socklen_t,
                )
            }
        };
        if rc != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINPROGRESS) {
                return Err(e);
            }
        }
        Ok(stream)
    }
}
