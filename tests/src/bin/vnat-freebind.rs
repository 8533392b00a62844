//! vnat-freebind: what an unprivileged local user can do with IP_FREEBIND,
//! for the tests of vnatd's trust boundary (issue 16, item 1).
//!
//! ```text
//! vnat-freebind --bind ADDR:PORT --to ADDR:PORT [--uid N] [--hold-secs S]
//! ```
//!
//! Drops to uid/gid N (default 65534, nobody) first, then opens a UDP
//! socket with IP_FREEBIND (IPV6_FREEBIND for IPv6), binds it to ADDR:PORT,
//! which need not be an address of this host, sends one datagram to the
//! destination (the kernel may refuse to route it; the cgroup hooks see it
//! either way), prints `sent` or `send failed: ...`, and keeps the socket
//! open for S seconds (default 30) so that its flow stays recorded.
use std::{
    net::{SocketAddr, UdpSocket},
    os::fd::FromRawFd,
    process::exit,
    thread,
    time::Duration,
};

use nix::{
    sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage},
    unistd::{setgid, setgroups, setuid, Gid, Uid},
};

const USAGE: &str =
    "usage: vnat-freebind --bind ADDR:PORT --to ADDR:PORT [--uid N] [--hold-secs S]";

fn fail(msg: &str) -> ! {
    eprintln!("vnat-freebind: {msg}");
    exit(2)
}

fn main() {
    let mut bind: Option<SocketAddr> = None;
    let mut to: Option<SocketAddr> = None;
    let mut uid: u32 = 65534;
    let mut hold = 30u64;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| fail(USAGE));
        match a.as_str() {
            "--bind" => bind = Some(value().parse().unwrap_or_else(|_| fail(USAGE))),
            "--to" => to = Some(value().parse().unwrap_or_else(|_| fail(USAGE))),
            "--uid" => uid = value().parse().unwrap_or_else(|_| fail(USAGE)),
            "--hold-secs" => hold = value().parse().unwrap_or_else(|_| fail(USAGE)),
            _ => fail(USAGE),
        }
    }
    let (Some(bind), Some(to)) = (bind, to) else {
        fail(USAGE)
    };
    // Unprivileged from here on: whatever follows, any local user can do.
    let id = Gid::from_raw(uid);
    setgroups(&[id]).unwrap_or_else(|e| fail(&format!("setgroups: {e}")));
    setgid(id).unwrap_or_else(|e| fail(&format!("setgid: {e}")));
    setuid(Uid::from_raw(uid)).unwrap_or_else(|e| fail(&format!("setuid: {e}")));

    let family = if bind.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket::socket(family, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None)
        .unwrap_or_else(|e| fail(&format!("socket: {e}")));
    if bind.is_ipv4() {
        socket::setsockopt(&fd, sockopt::IpFreebind, &true)
            .unwrap_or_else(|e| fail(&format!("IP_FREEBIND: {e}")));
    } else {
        // IPV6_FREEBIND (Linux 4.15); nix has no wrapper for it.
        let on: libc::c_int = 1;
        // SAFETY: fd is an open socket owned by this function; the option
        // value is a c_int that lives across the call, and its size is
        // passed.
        let r = unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                libc::SOL_IPV6,
                78, // IPV6_FREEBIND
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            fail(&format!(
                "IPV6_FREEBIND: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    socket::bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrStorage::from(bind),
    )
    .unwrap_or_else(|e| fail(&format!("bind {bind}: {e}")));
    // SAFETY: the descriptor is a bound UDP socket that nothing else owns;
    // UdpSocket takes it over (and closes it).
    let sock = unsafe { UdpSocket::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
    match sock.send_to(b"vnat freebind probe", to) {
        Ok(_) => println!("sent"),
        Err(e) => println!("send failed: {e}"),
    }
    thread::sleep(Duration::from_secs(hold));
}
