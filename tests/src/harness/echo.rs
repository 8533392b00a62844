//! A real echo peer: socat, as the integration tests' server side.
use std::{
    net::SocketAddr,
    os::unix::process::CommandExt,
    process::{Child, Stdio},
    thread,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{killpg, Signal},
    unistd::Pid,
};

use super::{Cgroup, Host, Netns};

/// vnat-stream's default `--datagram-size`.
pub const UDP_DATAGRAM_SIZE: usize = 512;

/// `socat` echoing everything back, in a namespace. TCP:
/// `socat TCP-LISTEN:PORT,bind=ADDR,reuseaddr,fork EXEC:cat`; UDP:
/// `socat -T 600 -b SIZE UDP-LISTEN:PORT,bind=ADDR,fork PIPE`. Construction
/// returns once the socket is listening; drop kills socat and its forked
/// children.
pub struct EchoServer {
    child: Child,
    pub addr: SocketAddr,
    pub udp: bool,
}

impl EchoServer {
    /// TCP echo on `addr` (an unspecified IP listens on all addresses of
    /// that family).
    pub fn tcp(ns: &Netns, addr: SocketAddr) -> EchoServer {
        let listen = format!(
            "{}-LISTEN:{},{},reuseaddr,fork",
            family(addr, "TCP"),
            addr.port(),
            bind(addr)
        );
        Self::start(ns, addr, false, &[&listen, "EXEC:cat"])
    }

    /// UDP echo on `addr` for datagrams of vnat-stream's default size (512
    /// bytes); socat forks one child per peer address, which lives until
    /// 600 s without traffic.
    pub fn udp(ns: &Netns, addr: SocketAddr) -> EchoServer {
        Self::udp_sized(ns, addr, UDP_DATAGRAM_SIZE)
    }

    /// UDP echo for datagrams of `size` bytes (vnat-stream's
    /// `--datagram-size`). PIPE is a byte stream: with socat's default 8 KiB
    /// buffer, datagrams queued in the pipe come back merged into one (or cut
    /// across two). Reading exactly `size` bytes at a time keeps every echoed
    /// datagram identical to the one sent.
    pub fn udp_sized(ns: &Netns, addr: SocketAddr, size: usize) -> EchoServer {
        let (size, listen) = (size.to_string(), udp_listen(addr));
        Self::start(ns, addr, true, &["-T", "600", "-b", &size, &listen, "PIPE"])
    }

    /// TCP echo inside a [`Host`]'s namespace *and cgroup*, so that the
    /// host's vnatd records (and can move) the accepted connections.
    pub fn tcp_in(host: &Host, addr: SocketAddr) -> EchoServer {
        Self::tcp_in_with(host, addr, false)
    }

    /// [`EchoServer::tcp_in`], optionally with TCP_NODELAY on the accepted
    /// sockets (socat's `nodelay`), as interactive servers such as sshd set
    /// it: without it, Nagle's algorithm holds a small echo while earlier
    /// data is unacknowledged.
    pub fn tcp_in_with(host: &Host, addr: SocketAddr, nodelay: bool) -> EchoServer {
        let listen = format!(
            "{}-LISTEN:{},{},reuseaddr,fork{}",
            family(addr, "TCP"),
            addr.port(),
            bind(addr),
            if nodelay { ",nodelay" } else { "" }
        );
        Self::echo_in(host, addr, false, &listen)
    }

    /// TCP echo of one connection inside a [`Host`]'s namespace and cgroup:
    /// socat without `fork` closes its listener once it has accepted, as
    /// `nc -l` or an FTP data port does.
    pub fn tcp_once_in(host: &Host, addr: SocketAddr) -> EchoServer {
        let listen = format!(
            "{}-LISTEN:{},{},reuseaddr",
            family(addr, "TCP"),
            addr.port(),
            bind(addr)
        );
        Self::echo_in(host, addr, false, &listen)
    }

    /// TCP echo on a dual-stack socket (`[::]:PORT`, IPV6_V6ONLY off, as
    /// the listeners of Go, Node.js, Java and iperf3 are by default) inside a
    /// [`Host`]'s namespace and cgroup: IPv4 clients reach it as
    /// `::ffff:a.b.c.d`, on an AF_INET6 socket.
    pub fn tcp_dual_stack_in(host: &Host, port: u16) -> EchoServer {
        let listen = format!("TCP6-LISTEN:{port},ipv6only=0,reuseaddr,fork");
        Self::echo_in(host, dual_stack(port), false, &listen)
    }

    /// UDP echo on a dual-stack socket (`[::]:PORT`, IPV6_V6ONLY off) inside
    /// a [`Host`]'s namespace and cgroup.
    pub fn udp_dual_stack_in(host: &Host, port: u16) -> EchoServer {
        let listen = format!("UDP6-LISTEN:{port},ipv6only=0,fork");
        Self::echo_in(host, dual_stack(port), true, &listen)
    }

    /// UDP echo inside a [`Host`]'s namespace and cgroup.
    pub fn udp_in(host: &Host, addr: SocketAddr) -> EchoServer {
        Self::echo_in(host, addr, true, &udp_listen(addr))
    }

    /// UDP echo of datagrams of `size` bytes inside a [`Host`]'s namespace
    /// and cgroup (see [`EchoServer::udp_sized`]).
    pub fn udp_sized_in(host: &Host, addr: SocketAddr, size: usize) -> EchoServer {
        let (size, listen) = (size.to_string(), udp_listen(addr));
        let args = ["-T", "600", "-b", &size, &listen, "PIPE"];
        Self::start_in(host.ns, Some(&host.cgroup), addr, true, &args)
    }

    /// TCP echo inside a container: its own namespace and cgroup
    /// ([`super::Container`]), with nothing of vnat's there.
    pub fn tcp_in_container(c: &super::Container, addr: SocketAddr) -> EchoServer {
        let listen = format!("TCP-LISTEN:{},reuseaddr,fork", addr.port());
        Self::start_in(&c.ns, Some(&c.cgroup), addr, false, &[&listen, "EXEC:cat"])
    }

    /// UDP echo inside a container on all its addresses (the wildcard, as
    /// a UDP server listens), one child per peer.
    pub fn udp_in_container(c: &super::Container, port: u16) -> EchoServer {
        let size = UDP_DATAGRAM_SIZE.to_string();
        let listen = format!("UDP4-LISTEN:{port},fork");
        let args = ["-T", "600", "-b", &size, &listen, "PIPE"];
        Self::start_in(&c.ns, Some(&c.cgroup), c.endpoint(port), true, &args)
    }

    /// Not an echo: a TCP server inside a [`Host`]'s namespace and cgroup
    /// that sends each connection `vnat-stream source`'s stream at `rate`
    /// bytes per second and reads nothing, for a client run with
    /// [`super::StreamOptions::receive_only`] (a download).
    pub fn tcp_source_in(host: &Host, addr: SocketAddr, rate: u64) -> EchoServer {
        let listen = format!(
            "{}-LISTEN:{},{},reuseaddr,fork",
            family(addr, "TCP"),
            addr.port(),
            bind(addr)
        );
        let exec = format!(
            "EXEC:{} source --rate-bytes-per-sec {rate}",
            super::bin_path("vnat-stream").display()
        );
        Self::start_in(host.ns, Some(&host.cgroup), addr, false, &[&listen, &exec])
    }

    /// socat listening with `listen` inside `host`'s namespace and cgroup:
    /// `EXEC:cat` for TCP, `PIPE` with datagrams of [`UDP_DATAGRAM_SIZE`]
    /// and a 600 s idle timeout for UDP.
    fn echo_in(host: &Host, addr: SocketAddr, udp: bool, listen: &str) -> EchoServer {
        let size = UDP_DATAGRAM_SIZE.to_string();
        let args: Vec<&str> = if udp {
            vec!["-T", "600", "-b", &size, listen, "PIPE"]
        } else {
            vec![listen, "EXEC:cat"]
        };
        Self::start_in(host.ns, Some(&host.cgroup), addr, udp, &args)
    }

    fn start(ns: &Netns, addr: SocketAddr, udp: bool, args: &[&str]) -> EchoServer {
        Self::start_in(ns, None, addr, udp, args)
    }

    fn start_in(
        ns: &Netns,
        cgroup: Option<&Cgroup>,
        addr: SocketAddr,
        udp: bool,
        args: &[&str],
    ) -> EchoServer {
        let mut cmd = ns.cmd("socat");
        if let Some(cg) = cgroup {
            cg.join_on_spawn(&mut cmd);
        }
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null());
        // Own process group, so that drop also reaches the children that
        // socat forks per connection.
        cmd.process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start socat in netns {}: {e}", ns.name()));
        let mut server = EchoServer { child, addr, udp };
        server.wait_listening(ns);
        server
    }

    fn wait_listening(&mut self, ns: &Netns) {
        let proto = if self.udp { "-lun" } else { "-ltn" };
        let filter = format!("sport = :{}", self.addr.port());
        // 20 s: under a VM without KVM on a busy machine, starting socat
        // alone once took over 5 s (it passes at once otherwise).
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "socat ({}) in netns {} exited at once: {status}",
                    self.describe(),
                    ns.name()
                );
            }
            let out = ns.try_run(&["ss", "-H", proto, &filter]);
            if out.status.success() && !out.stdout.iter().all(u8::is_ascii_whitespace) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "socat ({}) in netns {} is not listening after 20 s",
                self.describe(),
                ns.name()
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} echo on {}",
            if self.udp { "UDP" } else { "TCP" },
            self.addr
        )
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// The address a dual-stack listener on `port` binds: `[::]:port`.
fn dual_stack(port: u16) -> SocketAddr {
    SocketAddr::new(std::net::Ipv6Addr::UNSPECIFIED.into(), port)
}

/// socat's address for a UDP echo listening at `addr`, a child per peer.
fn udp_listen(addr: SocketAddr) -> String {
    format!(
        "{}-LISTEN:{},{},fork",
        family(addr, "UDP"),
        addr.port(),
        bind(addr)
    )
}

fn family(addr: SocketAddr, proto: &str) -> String {
    format!("{proto}{}", if addr.is_ipv4() { "4" } else { "6" })
}

fn bind(addr: SocketAddr) -> String {
    match addr {
        SocketAddr::V4(a) => format!("bind={}", a.ip()),
        // ipv6only: an IPv6 listener must not also take IPv4 connections as
        // v4-mapped addresses, which would be a different socket family for
        // vnat's programs than a real IPv4 peer.
        SocketAddr::V6(a) => format!("bind=[{}],ipv6only=1", a.ip()),
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
        let _ = self.child.wait();
    }
}
