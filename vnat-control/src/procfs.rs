//! The socket tables of a network namespace, /proc/PID/net/{tcp,udp}{,6}:
//! the socket inode of each (protocol, local, remote) endpoint pair. vnatd
//! reads them to name a connection's owner, `vnatctl criu-hook` to find the
//! connections of the process tree CRIU dumps.

use std::{
    collections::HashMap,
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use crate::datapath::Proto;

/// (proto, local, remote) to socket inode, for this network namespace.
pub fn socket_inodes() -> HashMap<(Proto, SocketAddr, SocketAddr), u64> {
    socket_inodes_in("/proc/thread-self/net")
}

/// [`socket_inodes`] of the network namespace whose `net` directory is
/// `dir` (`/proc/PID/net` shows the sockets of PID's namespace).
pub fn socket_inodes_in(dir: &str) -> HashMap<(Proto, SocketAddr, SocketAddr), u64> {
    inodes_in(dir, &[Proto::Tcp, Proto::Udp])
}

/// [`socket_inodes`] of UDP sockets only. The TCP tables are the costly
/// ones to read (the kernel formats a line per socket: seconds at 100,000
/// connections), and a UDP question need not pay for them.
pub fn udp_socket_inodes() -> HashMap<(Proto, SocketAddr, SocketAddr), u64> {
    udp_socket_inodes_in("/proc/thread-self/net")
}

/// [`udp_socket_inodes`] of the namespace whose `net` directory is `dir`.
pub fn udp_socket_inodes_in(dir: &str) -> HashMap<(Proto, SocketAddr, SocketAddr), u64> {
    inodes_in(dir, &[Proto::Udp])
}

fn inodes_in(dir: &str, protos: &[Proto]) -> HashMap<(Proto, SocketAddr, SocketAddr), u64> {
    let mut map = HashMap::new();
    for (proto, file) in [
        (Proto::Tcp, "tcp"),
        (Proto::Tcp, "tcp6"),
        (Proto::Udp, "udp"),
        (Proto::Udp, "udp6"),
    ] {
        if !protos.contains(&proto) {
            continue;
        }
        let Ok(text) = fs::read_to_string(format!("{dir}/{file}")) else {
            continue;
        };
        for line in text.lines().skip(1) {
            if let Some((l, r, inode)) = parse_line(line) {
                if inode != 0 {
                    map.insert((proto, l, r), inode);
                }
            }
        }
    }
    map
}

fn parse_line(line: &str) -> Option<(SocketAddr, SocketAddr, u64)> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let local = parse_endpoint(f.get(1)?)?;
    let remote = parse_endpoint(f.get(2)?)?;
    let inode = f.get(9)?.parse().ok()?;
    Some((local, remote, inode))
}

/// `0100007F:0050` is 127.0.0.1:80: each 32-bit word is printed as the host
/// (little-endian here) integer of its network-order bytes.
fn parse_endpoint(s: &str) -> Option<SocketAddr> {
    let (addr, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(addr.get(i * 8..i * 8 + 8)?, 16)
                .ok()?
                .to_ne_bytes(),
        )
    };
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut b = [0u8; 16];
            for i in 0..4 {
                b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            // A dual-stack socket's IPv4 connection (::ffff:a.b.c.d) is
            // the IPv4 flow vnat's records name.
            IpAddr::V6(Ipv6Addr::from(b)).to_canonical()
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The cookie of the socket `fd` (`SO_COOKIE`, Linux 4.12): the number
/// vnatd's records name the socket by, the same in every namespace.
pub fn socket_cookie(fd: &impl std::os::fd::AsFd) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    let mut cookie: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as nix::libc::socklen_t;
    // SAFETY: the descriptor is borrowed open for the call; `cookie` and
    // `len` are live and `len` is `cookie`'s size, which the kernel writes
    // at most.
    let r = unsafe {
        nix::libc::getsockopt(
            fd.as_fd().as_raw_fd(),
            nix::libc::SOL_SOCKET,
            nix::libc::SO_COOKIE,
            (&mut cookie as *mut u64).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cookie)
}

/// The cookies of the sockets process `pid` holds (its descriptors, as
/// `proc`/PID/fd lists them), each taken with pidfd_getfd (Linux 5.6,
/// CAP_SYS_PTRACE over the process) and checked by inode, since a
/// descriptor number may be reused between the listing and the take.
/// Empty if the process is gone; a descriptor closed meanwhile is left out.
pub fn held_socket_cookies(
    proc: &std::path::Path,
    pid: u32,
) -> std::io::Result<std::collections::HashSet<u64>> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let gone = |e: &std::io::Error| {
        matches!(
            e.raw_os_error(),
            Some(nix::libc::ESRCH) | Some(nix::libc::ENOENT) | Some(nix::libc::EBADF)
        )
    };
    let mut out = std::collections::HashSet::new();
    let entries = match fs::read_dir(proc.join(pid.to_string()).join("fd")) {
        Ok(e) => e,
        Err(e) if gone(&e) => return Ok(out),
        Err(e) => return Err(e),
    };
    let held: Vec<(nix::libc::c_int, u64)> = entries
        .flatten()
        .filter_map(|e| {
            let target = fs::read_link(e.path()).ok()?;
            let inode = target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()?;
            Some((e.file_name().to_str()?.parse().ok()?, inode))
        })
        .collect();
    if held.is_empty() {
        return Ok(out);
    }
    let Ok(p) = nix::libc::pid_t::try_from(pid) else {
        return Ok(out);
    };
    // SAFETY: pidfd_open takes no pointers; -1 or a new descriptor, owned
    // at once below.
    let pidfd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, p, 0) };
    if pidfd < 0 {
        let e = std::io::Error::last_os_error();
        return if gone(&e) { Ok(out) } else { Err(e) };
    }
    // SAFETY: the fresh descriptor pidfd_open returned; nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as nix::libc::c_int) };
    for (fd, inode) in held {
        // SAFETY: no pointers: `fd` is a number in the other process's
        // table, which the kernel looks up there; -1 or a new descriptor
        // (close-on-exec) in ours, owned at once below.
        let dup =
            unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
        if dup < 0 {
            let e = std::io::Error::last_os_error();
            if gone(&e) {
                continue;
            }
            return Err(e);
        }
        // SAFETY: the fresh descriptor pidfd_getfd returned.
        let dup = unsafe { OwnedFd::from_raw_fd(dup as nix::libc::c_int) };
        let same = nix::sys::stat::fstat(dup.as_raw_fd()).is_ok_and(|st| st.st_ino == inode);
        if same {
            out.insert(socket_cookie(&dup)?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_net_endpoints() {
        assert_eq!(
            parse_endpoint("0100007F:0050"),
            Some("127.0.0.1:80".parse().unwrap())
        );
        assert_eq!(
            parse_endpoint("000080FE00000000FF57B0A0CB31D2FE:1F90"),
            Some("[fe80::a0b0:57ff:fed2:31cb]:8080".parse().unwrap())
        );
        // A dual-stack socket's IPv4 peer in /proc/net/tcp6 is the IPv4
        // endpoint, as vnat's records name it.
        assert_eq!(
            parse_endpoint("0000000000000000FFFF0000020112C6:1389"),
            Some("198.18.1.2:5001".parse().unwrap())
        );
        assert_eq!(
            parse_endpoint("00000000000000000000000000000000:1389"),
            Some("[::]:5001".parse().unwrap())
        );
        assert_eq!(parse_endpoint("zz:1"), None);
        let line = "   0: 0201A8C0:0016 0301A8C0:D431 01 00000000:00000000 02:000A 00000000     0        0 4242 2 0";
        let (l, r, inode) = parse_line(line).unwrap();
        assert_eq!(
            (l.to_string(), r.to_string(), inode),
            ("192.168.1.2:22".into(), "192.168.1.3:54321".into(), 4242)
        );
    }
}
