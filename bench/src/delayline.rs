//! A userspace delay line: a fixed one-way delay on an L2 link, for kernels
//! without netem (such as the 6.18 kernel vnat is developed on, which has
//! only pfifo and htb).
//!
//! The line lives in its own network namespace between two veth ends, `d0`
//! and `d1`. One AF_PACKET socket per end (SOCK_RAW, ETH_P_ALL, bound to the
//! interface, promiscuous) reads every frame that arrives there, and a thread
//! per direction writes it, byte for byte, out of the other end once the
//! delay has passed. Nothing is parsed or rewritten, so the two sides see
//! one Ethernet segment (ARP, IPv6 neighbour discovery, TCP, VCMP all cross
//! it unchanged), only later: all but ARP, which crosses at once. The line
//! stands for the wide-area part of the path, and a host's ARP for its
//! gateway never crosses that: delayed, a host that has just come up on a
//! link (a server moving to a new subnet) would wait one whole round trip
//! for its gateway's address before its first packet.
//!
//! Offloads are turned off on all four veth ends (`ethtool -K`): with TSO/GSO
//! a veth hands 64 KiB super-frames to packet sockets, which could not be
//! sent again on a 1500-byte link, and with checksum offload the frames carry
//! partial checksums that only the original skb knew how to finish.
//!
//! [`delay_server_link`] splices a line into a
//! [`LaptopRouterServer`](vnat_tests::LaptopRouterServer) between the router
//! and the server, so every laptop-server packet is delayed once per
//! direction whichever subnet the laptop is on.

use std::{
    collections::VecDeque,
    ffi::CString,
    io, mem,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use anyhow::{bail, Context, Result};
use nix::libc;
use serde::Serialize;
use vnat_tests::{veth, LaptopRouterServer, Netns, ServerLinkE};

/// The longest frame the line expects: a 1500-byte MTU plus the Ethernet
/// header and a VLAN tag. Anything longer means an offload is still on.
const MAX_FRAME: usize = 1522;
/// The Ethernet type of ARP, which the line does not delay.
const ETHERTYPE_ARP: [u8; 2] = [0x08, 0x06];
/// How often an idle direction looks at the stop flag.
const IDLE_WAKE: Duration = Duration::from_millis(50);
/// Receive buffer per socket: a few hundred frames of headroom if a
/// direction thread is descheduled for a moment.
const RCVBUF: libc::c_int = 4 << 20;

/// CLOCK_MONOTONIC in nanoseconds: the same clock in every namespace and
/// process, so timestamps taken here, in the probe and in the benchmark
/// compare directly.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CLOCK_REALTIME in nanoseconds (to place wall-clock log timestamps on the
/// monotonic clock).
pub fn realtime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as above.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Makes the calling thread's sleeps end when asked (the default timer slack
/// of 50 µs would add to every delay), and tries to run it SCHED_FIFO so that
/// other work on a busy machine does not delay its wake-ups. Returns whether
/// the real-time policy was granted.
pub fn precise_thread() -> bool {
    // SAFETY: prctl(PR_SET_TIMERSLACK) and sched_setscheduler(0, ...) only
    // change the calling thread's scheduling attributes.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0);
        let param = libc::sched_param { sched_priority: 10 };
        libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) == 0
    }
}

/// What one direction of the line did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DirectionStats {
    pub frames: u64,
    pub bytes: u64,
    /// Frames longer than an MTU-sized frame (an offload left on).
    pub oversize: u64,
    /// Frames the kernel refused to send.
    pub send_errors: u64,
    /// How late frames left after their due time: mean, 99th percentile
    /// (to 10 µs) and worst, in µs.
    pub late_mean_us: f64,
    pub late_p99_us: f64,
    pub late_max_us: f64,
    /// Whether the direction's thread ran SCHED_FIFO.
    pub realtime: bool,
}

/// A running delay line; dropping it stops both directions.
pub struct DelayLine {
    stop: Arc<AtomicBool>,
    /// The one-way delay in ns, read by both directions for every frame.
    delay_ns: Arc<AtomicU64>,
    threads: Vec<JoinHandle<DirectionStats>>,
}

impl DelayLine {
    /// Forwards every frame between `a` and `b` (interfaces of `ns`) after
    /// `one_way`, in both directions.
    pub fn start(ns: &Netns, a: &str, b: &str, one_way: Duration) -> Result<DelayLine> {
        let (a_name, b_name) = (a.to_string(), b.to_string());
        // Packet sockets belong to the namespace they were created in, so
        // they are opened on a thread inside it and then used from anywhere.
        let (fa, fb) = ns.run_in(move || -> Result<(OwnedFd, OwnedFd)> {
            Ok((packet_socket(&a_name)?, packet_socket(&b_name)?))
        })?;
        let (fa, fb) = (Arc::new(fa), Arc::new(fb));
        let stop = Arc::new(AtomicBool::new(false));
        let delay_ns = Arc::new(AtomicU64::new(one_way.as_nanos() as u64));
        let mut threads = Vec::new();
        for (name, from, to) in [
            (format!("delay {a}>{b}"), fa.clone(), fb.clone()),
            (format!("delay {b}>{a}"), fb, fa),
        ] {
            let (stop, delay_ns) = (stop.clone(), delay_ns.clone());
            let t = std::thread::Builder::new()
                .name(name)
                .spawn(move || forward(&from, &to, &delay_ns, &stop))
                .context("starting a delay-line thread")?;
            threads.push(t);
        }
        Ok(DelayLine {
            stop,
            delay_ns,
            threads,
        })
    }

    pub fn one_way(&self) -> Duration {
        Duration::from_nanos(self.delay_ns.load(Ordering::Relaxed))
    }

    /// Changes the delay for frames read from now on.
    pub fn set_one_way(&self, one_way: Duration) {
        self.delay_ns
            .store(one_way.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Stops both directions and returns what each did (a>b, then b>a).
    pub fn stop(mut self) -> Vec<DirectionStats> {
        self.join()
    }

    fn join(&mut self) -> Vec<DirectionStats> {
        self.stop.store(true, Ordering::SeqCst);
        self.threads
            .drain(..)
            .map(|t| t.join().unwrap_or_default())
            .collect()
    }
}

impl Drop for DelayLine {
    fn drop(&mut self) {
        self.join();
    }
}

/// One direction: frames read from `from` leave through `to` `delay_ns`
/// after they were read.
fn forward(
    from: &OwnedFd,
    to: &OwnedFd,
    delay_ns: &AtomicU64,
    stop: &AtomicBool,
) -> DirectionStats {
    let mut stats = DirectionStats {
        realtime: precise_thread(),
        ..DirectionStats::default()
    };
    let mut queue: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
    let mut buf = vec![0u8; 65536];
    let mut late_sum_ns = 0u64;
    // Lateness in 10 µs buckets up to 10 ms (the last one holds the rest).
    let mut late_hist = vec![0u64; 1001];
    while !stop.load(Ordering::Relaxed) {
        let now = monotonic_ns();
        while queue.front().is_some_and(|(due, _)| *due <= now) {
            let (due, frame) = queue.pop_front().expect("checked non-empty");
            // SAFETY: `to` is open (the caller holds it); `frame` is live
            // for the call and its length is passed.
            let n = unsafe { libc::send(to.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
            if n < 0 {
                stats.send_errors += 1;
                continue;
            }
            let late = monotonic_ns().saturating_sub(due);
            late_sum_ns += late;
            late_hist[(late / 10_000).min(1000) as usize] += 1;
            stats.late_max_us = stats.late_max_us.max(late as f64 / 1000.0);
            stats.frames += 1;
            stats.bytes += frame.len() as u64;
        }
        let wait = match queue.front() {
            Some((due, _)) => {
                Duration::from_nanos(due.saturating_sub(monotonic_ns())).min(IDLE_WAKE)
            }
            None => IDLE_WAKE,
        };
        if !readable(from, wait) {
            continue;
        }
        // Drain everything that is queued; all of it was read "now".
        loop {
            // SAFETY: sockaddr_ll is plain integers, for which all-zero is
            // valid.
            let mut from_addr: libc::sockaddr_ll = unsafe { mem::zeroed() };
            let mut len = mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t;
            // SAFETY: `from` is open (the caller holds it); recvfrom writes
            // at most buf.len() bytes into `buf` (MSG_TRUNC only makes it
            // report a longer frame's full length) and at most `len` bytes,
            // the size of `from_addr`, of address.
            let n = unsafe {
                libc::recvfrom(
                    from.as_raw_fd(),
                    buf.as_mut_ptr().cast(),
                    buf.len(),
                    libc::MSG_DONTWAIT | libc::MSG_TRUNC,
                    (&mut from_addr as *mut libc::sockaddr_ll).cast(),
                    &mut len,
                )
            };
            if n < 0 {
                break;
            }
            let read_at = monotonic_ns();
            // Our own transmissions on this interface (the other
            // direction's output) must not loop back into the line.
            if from_addr.sll_pkttype == libc::PACKET_OUTGOING {
                continue;
            }
            let n = n as usize;
            if n > MAX_FRAME {
                stats.oversize += 1;
            }
            let n = n.min(buf.len());
            if n >= 14 && buf[12..14] == ETHERTYPE_ARP {
                // SAFETY: `to` is open; `n` is at most buf.len() (clamped
                // above), so the kernel reads only within `buf`.
                let sent = unsafe { libc::send(to.as_raw_fd(), buf.as_ptr().cast(), n, 0) };
                if sent < 0 {
                    stats.send_errors += 1;
                } else {
                    stats.frames += 1;
                    stats.bytes += n as u64;
                }
                continue;
            }
            queue.push_back((
                read_at + delay_ns.load(Ordering::Relaxed),
                buf[..n].to_vec(),
            ));
        }
    }
    if stats.frames > 0 {
        stats.late_mean_us = late_sum_ns as f64 / stats.frames as f64 / 1000.0;
        let rank = (stats.frames * 99).div_ceil(100);
        let mut seen = 0;
        for (i, n) in late_hist.iter().enumerate() {
            seen += n;
            if seen >= rank {
                stats.late_p99_us = (i as f64 + 1.0) * 10.0;
                break;
            }
        }
    }
    stats
}

/// Waits up to `wait` for `fd` to become readable.
fn readable(fd: &OwnedFd, wait: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ts = libc::timespec {
        tv_sec: wait.as_secs() as libc::time_t,
        tv_nsec: wait.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `pfd` is one live pollfd (count 1) for a descriptor the
    // caller holds open, `ts` a live timespec, and a null signal mask means
    // "leave the mask alone".
    let rc = unsafe { libc::ppoll(&mut pfd, 1, &ts, std::ptr::null()) };
    rc > 0 && pfd.revents & libc::POLLIN != 0
}

/// An AF_PACKET socket that sees every frame arriving on `ifname` (in the
/// calling thread's namespace) and sends raw frames out of it.
fn packet_socket(ifname: &str) -> Result<OwnedFd> {
    let cname = CString::new(ifname).context("interface name")?;
    // SAFETY: if_nametoindex reads the NUL-terminated `cname`; socket(2)
    // returns a fresh descriptor, owned at once by `fd`; every setsockopt
    // and bind below gets a pointer to a live local with its exact size
    // (`setopt` passes on the pointer and length it is given); mem::zeroed
    // is a valid sockaddr_ll, which is plain integers.
    unsafe {
        let ifindex = libc::if_nametoindex(cname.as_ptr());
        if ifindex == 0 {
            bail!("no interface {ifname} in the delay line's namespace");
        }
        // Protocol 0 until bound: the socket receives nothing from other
        // interfaces in between.
        let raw = libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0);
        if raw < 0 {
            return Err(io::Error::last_os_error()).context("creating an AF_PACKET socket");
        }
        let fd = OwnedFd::from_raw_fd(raw);
        let setopt =
            |level, name, value: *const libc::c_void, len: usize, what: &str| -> Result<()> {
                if libc::setsockopt(fd.as_raw_fd(), level, name, value, len as libc::socklen_t) != 0
                {
                    return Err(io::Error::last_os_error()).with_context(|| {
                        format!("setting {what} on the packet socket of {ifname}")
                    });
                }
                Ok(())
            };
        let one: libc::c_int = 1;
        // The kernel would otherwise queue a copy of every frame this socket
        // sends back to it (and to the other direction's socket).
        setopt(
            libc::SOL_PACKET,
            libc::PACKET_IGNORE_OUTGOING,
            (&one as *const libc::c_int).cast(),
            mem::size_of::<libc::c_int>(),
            "PACKET_IGNORE_OUTGOING",
        )?;
        setopt(
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&RCVBUF as *const libc::c_int).cast(),
            mem::size_of::<libc::c_int>(),
            "SO_RCVBUFFORCE",
        )?;
        let mut sll: libc::sockaddr_ll = mem::zeroed();
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
        sll.sll_ifindex = ifindex as libc::c_int;
        if libc::bind(
            fd.as_raw_fd(),
            (&sll as *const libc::sockaddr_ll).cast(),
            mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        ) != 0
        {
            return Err(io::Error::last_os_error())
                .with_context(|| format!("binding a packet socket to {ifname}"));
        }
        // Frames for the other side's MAC addresses are not for this
        // interface: without promiscuous mode a real NIC would filter them.
        let mreq = libc::packet_mreq {
            mr_ifindex: ifindex as libc::c_int,
            mr_type: libc::PACKET_MR_PROMISC as libc::c_ushort,
            mr_alen: 0,
            mr_address: [0; 8],
        };
        setopt(
            libc::SOL_PACKET,
            libc::PACKET_ADD_MEMBERSHIP,
            (&mreq as *const libc::packet_mreq).cast(),
            mem::size_of::<libc::packet_mreq>(),
            "PACKET_MR_PROMISC",
        )?;
        Ok(fd)
    }
}

/// `ethtool -K DEV gro off tso off gso off tx off rx off` in `ns`: frames
/// stay MTU-sized with complete checksums (see the module documentation).
pub fn offloads_off(ns: &Netns, dev: &str) -> Result<()> {
    let out = ns.try_run(&[
        "ethtool", "-K", dev, "gro", "off", "tso", "off", "gso", "off", "tx", "off", "rx", "off",
    ]);
    if !out.status.success() {
        bail!(
            "`ethtool -K {dev} ... off` failed in {}: {}",
            ns.name(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// A delay line spliced between a topology's router and server. Dropping
/// it stops the line, then deletes its namespace (and with it the links,
/// which the server and router lose too).
pub struct ServerLinkDelay {
    /// Declared first: the threads stop before the namespace goes.
    pub line: DelayLine,
    pub ns: Netns,
}

/// The same for the server's second link (subnet E, see
/// `vnat_tests::add_server_link_e`): router `re` - `e0` [delay line] `e1` -
/// server `eth1`, in the namespace of the first line (`ns`), so that a
/// server that moves to E keeps the round trip. The server's side stays
/// down and without addresses until the move.
pub fn delay_server_link_e(
    topo: &LaptopRouterServer,
    e: &ServerLinkE,
    ns: &Netns,
    one_way: Duration,
) -> Result<DelayLine> {
    topo.server.link_del(&e.server_if);
    veth(&topo.router, &e.router_if, ns, "e0");
    veth(ns, "e1", &topo.server, &e.server_if);
    offloads_off(&topo.router, &e.router_if)?;
    offloads_off(ns, "e0")?;
    offloads_off(ns, "e1")?;
    offloads_off(&topo.server, &e.server_if)?;
    for (a, p) in e.router_addr.with_prefixes() {
        topo.router.add_addr(&e.router_if, a, p);
    }
    topo.server.link_down(&e.server_if);
    DelayLine::start(ns, "e0", "e1", one_way)
}

/// Replaces the router-server veth of `topo` (`rc` - `eth0`) by
/// router `rc` - `d0` [delay line] `d1` - server `eth0`, with the same
/// addresses and server default routes as before. Call it before anything
/// uses the server's link (the old veth is deleted).
pub fn delay_server_link(
    topo: &LaptopRouterServer,
    tag: &str,
    one_way: Duration,
) -> Result<ServerLinkDelay> {
    let ns = Netns::new(tag);
    // The line's own ends take no part in IP: no link-local addresses, no
    // router or neighbour solicitations of their own on the segment.
    ns.set_sysctl("net/ipv6/conf/all/disable_ipv6", "1");
    ns.set_sysctl("net/ipv6/conf/default/disable_ipv6", "1");
    topo.server.link_del(&topo.server_if);
    veth(&topo.router, &topo.router_if_c, &ns, "d0");
    veth(&ns, "d1", &topo.server, &topo.server_if);
    offloads_off(&topo.router, &topo.router_if_c)?;
    offloads_off(&ns, "d0")?;
    offloads_off(&ns, "d1")?;
    offloads_off(&topo.server, &topo.server_if)?;
    for (a, p) in topo.router_c_addr.with_prefixes() {
        topo.router.add_addr(&topo.router_if_c, a, p);
    }
    for (a, p) in topo.server_addr.with_prefixes() {
        topo.server.add_addr(&topo.server_if, a, p);
    }
    topo.server
        .default_route(topo.router_c_addr.v4.into(), &topo.server_if);
    if topo.ipv6 {
        topo.server
            .default_route(topo.router_c_addr.v6().into(), &topo.server_if);
    }
    let line = DelayLine::start(&ns, "d0", "d1", one_way)?;
    Ok(ServerLinkDelay { line, ns })
}

/// Times `n` TCP handshakes from the laptop to a closed port of the server
/// (SYN out, RST back: one round trip, no listener, no connection for vnat
/// to record), in milliseconds.
pub fn handshake_rtts(
    topo: &vnat_tests::LaptopRouterServer,
    server: std::net::IpAddr,
    n: usize,
) -> anyhow::Result<Vec<f64>> {
    handshake_rtts_from(&topo.laptop, server, n)
}

/// [`handshake_rtts`] from any namespace `from`.
pub fn handshake_rtts_from(
    from: &Netns,
    server: std::net::IpAddr,
    n: usize,
) -> anyhow::Result<Vec<f64>> {
    let target = std::net::SocketAddr::new(server, 9);
    from.run_in(|| {
        // The first handshake also resolves the router's MAC: not timed.
        let _ = std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2));
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let t = monotonic_ns();
            let r = std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2));
            let took = (monotonic_ns() - t) as f64 / 1e6;
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => out.push(took),
                Ok(_) => anyhow::bail!("something listens on {target}: the RTT probe expects a closed port"),
                Err(e) => anyhow::bail!("the server {server} is not reachable from the laptop through the delay line: {e}"),
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(out)
    })
}
