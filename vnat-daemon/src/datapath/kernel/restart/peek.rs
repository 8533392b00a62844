//! The sequence numbers of a TCP connection sock_ops never saw (issue 18,
//! item 6: adoption). A connection opened before vnatd started, or before
//! its cgroup was enabled, has no record of its first sequence numbers, and
//! vnat needs them: they name the connection to the peer's vnatd (a strong
//! binding, `vcmp::Binding::tcp`) and give the restart levers the socket's
//! `snd_una` and `rcv_nxt` (with tcp_info's byte counters).
//!
//! No interface reads a live socket's sequence numbers without side
//! effects (TCP_REPAIR, which CRIU uses, makes the application's reads fail
//! and turns its writes into receive-queue data while it is on), so vnatd
//! asks the socket itself, as a peer could: a segment from the peer's end
//! with a sequence number outside the receive window makes the socket
//! answer with a duplicate ACK (tcp_validate_incoming -> tcp_send_dupack)
//! whose sequence number is `snd_nxt` and acknowledgement `rcv_nxt`, and
//! changes nothing else. The segment is delivered to the local stack over
//! loopback (as the restart levers' are), and the answer is read as it
//! leaves, from a packet socket with a filter for the socket's port. The
//! peer gets one duplicate ACK. Around it sock_diag gives `write_seq -
//! snd_una` and `write_seq - snd_nxt`, hence `snd_una`, and the byte
//! counters; a reading whose counters moved (data sent, acknowledged or
//! received meanwhile) does not count and is tried again.
//!
//! Keepalive and zero-window probes carry `snd_una - 1`, below `snd_nxt`:
//! of the pure ACKs seen, the highest sequence number is taken. A socket
//! waiting on its probe timer is left for later.
//!
//! That probe is the fallback. Where the kernel loads `vnat_peek`
//! (vnat-ebpf/src/peek.rs, Linux 5.1's `bpf_tcp_sock`), vnatd runs it
//! with BPF_PROG_TEST_RUN instead: it finds the socket by its tuple and reads
//! `snd_una`, `rcv_nxt` and both byte counters nanoseconds apart, with no
//! segment sent and no window in which the connection must hold still.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    time::{Duration, Instant},
};

use vnat_common::{
    PeekAnswer, PeekRequest, PEEK_ANSWER_OFF, PEEK_FOUND, PEEK_PACKET_LEN, PEEK_REQUEST_OFF,
    PEEK_STEADY,
};

use super::*;
use crate::datapath::kernel::testrun;

/// `TCP_ESTABLISHED` (include/net/tcp_states.h).
const TCP_ESTABLISHED: u32 = 1;

/// What sock_ops would have recorded at establishment: `snd_una -
/// bytes_acked` and `rcv_nxt - bytes_received` (mod 2^32), constant for the
/// connection's life (see `ConnRecord::snd_una_base`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SequenceBases {
    pub snd_una_base: u32,
    pub rcv_nxt_base: u32,
}

/// Readings tried before giving up until the next look. A reading takes
/// well under a millisecond when the socket answers at once, so even a busy
/// connection's counters hold still for most.
const MAX_TRIES: u32 = 3;
/// How long to wait for the socket's answer.
const ANSWER_WAIT: Duration = Duration::from_millis(100);
/// Between two tries: the socket answers out-of-window segments at most
/// once per tcp_invalid_ratelimit (500 ms by default).
const RETRY_AFTER: Duration = Duration::from_millis(550);
/// `idiag_timer` of a pending keepalive timer.
const TIMER_KEEPALIVE: u8 = 2;

/// Readings of `vnat_peek` tried before giving up until the next look:
/// one is torn only if a segment is processed on another CPU during the
/// few loads between its two halves.
const PROGRAM_TRIES: u32 = 8;

/// The bases of `flow`'s established socket (with `cookie`), or `None` if
/// it is gone, or no reading held still. `program`: the loaded
/// `vnat_peek`, if the kernel took it.
pub(super) fn sequence_bases(
    flow: &VirtualFlow,
    cookie: u64,
    program: Option<RawFd>,
) -> Result<Option<SequenceBases>, DatapathError> {
    if flow.local.is_ipv4() != flow.remote.is_ipv4() {
        return Ok(None);
    }
    let mut diag = SockDiag::open()?;
    if let Some(fd) = program {
        return by_program(fd, &mut diag, flow, cookie);
    }
    by_probe(&mut diag, flow, cookie)
}

/// The bases read by `vnat_peek`, for the socket with `cookie` only.
fn by_program(
    fd: RawFd,
    diag: &mut SockDiag,
    flow: &VirtualFlow,
    cookie: u64,
) -> Result<Option<SequenceBases>, DatapathError> {
    // The tuple names one socket at a time: the one with `cookie`, if
    // sock_diag still lists it as established.
    if diag.query(flow, cookie)?.is_none() {
        return Ok(None);
    }
    let packet = peek_packet(flow);
    for _ in 0..PROGRAM_TRIES {
        let run = testrun::run(fd, &packet)
            .map_err(kernel_err("running vnat_peek (BPF_PROG_TEST_RUN)"))?;
        let Some(a) = answer_of(&run.packet) else {
            return Ok(None);
        };
        if a.found & PEEK_FOUND == 0 || a.state != TCP_ESTABLISHED {
            return Ok(None);
        }
        if a.found & PEEK_STEADY != 0 {
            return Ok(Some(bases_of(&a)));
        }
    }
    Ok(None)
}

/// What sock_ops records at establishment, from a reading of the socket.
fn bases_of(a: &PeekAnswer) -> SequenceBases {
    SequenceBases {
        snd_una_base: a.snd_una.wrapping_sub(a.bytes_acked as u32),
        rcv_nxt_base: a.rcv_nxt.wrapping_sub(a.bytes_received as u32),
    }
}

/// The test-run packet asking for `flow`'s socket (vnat-common's peek.rs).
fn peek_packet(flow: &VirtualFlow) -> Vec<u8> {
    fn words(ip: IpAddr) -> [u32; 4] {
        let mut w = [0u32; 4];
        match ip.to_canonical() {
            IpAddr::V4(a) => w[0] = u32::from_ne_bytes(a.octets()),
            IpAddr::V6(a) => {
                for (i, c) in a.octets().chunks_exact(4).enumerate() {
                    w[i] = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
        w
    }
    let req = PeekRequest {
        family: u32::from(if flow.local.ip().to_canonical().is_ipv4() {
            vnat_common::AF_INET
        } else {
            vnat_common::AF_INET6
        }),
        remote_addr_be: words(flow.remote.ip()),
        local_addr_be: words(flow.local.ip()),
        remote_port_be: flow.remote.port().to_be(),
        local_port_be: flow.local.port().to_be(),
    };
    let mut p = vec![0u8; PEEK_PACKET_LEN];
    // SAFETY: PeekRequest is repr(C) of integers with no padding (its size
    // is asserted in vnat-common), so its bytes are all initialized.
    let bytes = unsafe {
        std::slice::from_raw_parts(
            (&req as *const PeekRequest).cast::<u8>(),
            size_of::<PeekRequest>(),
        )
    };
    p[PEEK_REQUEST_OFF..PEEK_ANSWER_OFF].copy_from_slice(bytes);
    p
}

/// The answer `vnat_peek` wrote into the packet.
fn answer_of(packet: &[u8]) -> Option<PeekAnswer> {
    let b = packet.get(PEEK_ANSWER_OFF..PEEK_ANSWER_OFF + size_of::<PeekAnswer>())?;
    // SAFETY: `b` holds exactly size_of::<PeekAnswer>() bytes, and every bit
    // pattern is a valid PeekAnswer (integers only); read_unaligned copes
    // with the Vec's byte alignment.
    Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<PeekAnswer>()) })
}

/// The bases read by probing the socket (see the module's comment).
fn by_probe(
    diag: &mut SockDiag,
    flow: &VirtualFlow,
    cookie: u64,
) -> Result<Option<SequenceBases>, DatapathError> {
    for attempt in 0..MAX_TRIES {
        if attempt > 0 {
            std::thread::sleep(RETRY_AFTER);
        }
        let Some(before) = diag.query(flow, cookie)? else {
            return Ok(None);
        };
        // A window or keepalive probe (sequence number snd_una - 1) due
        // while the answer is awaited would pass for it.
        if before.timer == TIMER_PROBE0
            || (before.timer == TIMER_KEEPALIVE && before.expires_ms < 300)
        {
            return Ok(None);
        }
        let capture = Capture::open(flow).map_err(kernel_err("opening a packet socket"))?;
        let reversed = VirtualFlow {
            proto: flow.proto,
            local: flow.remote,
            remote: flow.local,
        };
        let [seq, ack] = random_words();
        inject_from_peer(flow, &tcp_probe(&reversed, seq, ack, u16::MAX))?;
        let answer = capture
            .highest_ack(flow, ANSWER_WAIT)
            .map_err(kernel_err("reading the socket's answer"))?;
        let Some(after) = diag.query(flow, cookie)? else {
            return Ok(None);
        };
        let (Some((snd_nxt, rcv_nxt)), true) = (answer, still(&before, &after)) else {
            continue;
        };
        let unacked = before.send_queue.wrapping_sub(before.notsent_bytes);
        // An ACK's sequence number is snd_nxt unless the peer's window
        // shrank below what is in flight (tcp_acceptable_seq).
        if before.snd_wnd.is_some_and(|w| w < unacked) {
            return Ok(None);
        }
        let snd_una = snd_nxt.wrapping_sub(unacked);
        return Ok(Some(SequenceBases {
            snd_una_base: snd_una.wrapping_sub(before.bytes_acked as u32),
            rcv_nxt_base: rcv_nxt.wrapping_sub(before.bytes_received as u32),
        }));
    }
    Ok(None)
}

/// Nothing was sent, acknowledged, received or queued between two
/// readings.
fn still(a: &TcpState, b: &TcpState) -> bool {
    (
        a.bytes_acked,
        a.bytes_received,
        a.bytes_sent,
        a.send_queue,
        a.notsent_bytes,
        a.total_retrans,
    ) == (
        b.bytes_acked,
        b.bytes_received,
        b.bytes_sent,
        b.send_queue,
        b.notsent_bytes,
        b.total_retrans,
    )
}

/// Sequence and acknowledgement numbers for the probe: any will do, as long
/// as the sequence number is outside the socket's window (it is, but for a
/// chance of window/2^32; then the segment is dropped or answered with a
/// challenge ACK, which carries the same numbers).
fn random_words() -> [u32; 2] {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most `b.len()` bytes into `b`, a live
    // local; a failure leaves it zeroed, which is still a valid probe.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    [
        u32::from_ne_bytes([b[0], b[1], b[2], b[3]]),
        u32::from_ne_bytes([b[4], b[5], b[6], b[7]]),
    ]
}

/// A packet socket seeing every IPv4 and IPv6 TCP packet with one source
/// port, leaving or arriving, on every interface of this namespace.
struct Capture(OwnedFd);

const ETH_P_ALL: u16 = 0x0003;

impl Capture {
    fn open(flow: &VirtualFlow) -> io::Result<Capture> {
        // SAFETY: socket() takes no pointers; the result is owned at once
        // below or is -1. Protocol 0: nothing is received until bind(), so
        // no packet gets past before the filter is in place.
        let fd = cvt(unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                0,
            )
        })?;
        // SAFETY: `fd` is the fresh descriptor socket() just returned.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let filter = port_filter(flow.local.port(), flow.remote.port());
        let prog = libc::sock_fprog {
            len: filter.len() as u16,
            filter: filter.as_ptr() as *mut libc::sock_filter,
        };
        setsockopt(&fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &prog)?;
        // SAFETY: all-zero is a valid sockaddr_ll.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = ETH_P_ALL.to_be();
        // SAFETY: `fd` is open; `sll` is a live sockaddr_ll and its size is
        // passed, so the kernel reads only within it.
        cvt(unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&sll as *const libc::sockaddr_ll).cast(),
                size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        })?;
        Ok(Capture(fd))
    }

    /// The highest sequence number, and the acknowledgement number, of the
    /// pure ACKs `flow`'s socket has sent, once it has sent one (waiting at
    /// most `wait`): the sooner the second reading follows, the likelier
    /// a busy connection's counters held still.
    fn highest_ack(&self, flow: &VirtualFlow, wait: Duration) -> io::Result<Option<(u32, u32)>> {
        let deadline = Instant::now() + wait;
        let mut best: Option<(u32, u32)> = None;
        let mut buf = [0u8; 256];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || best.is_some() {
                return Ok(best);
            }
            let mut pfd = libc::pollfd {
                fd: self.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: `pfd` is one live pollfd and 1 is passed as the count.
            let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().max(1) as libc::c_int) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Ok(best);
            }
            loop {
                // SAFETY: `buf` is live and its length is passed; the kernel
                // writes at most that many bytes (a longer packet is
                // truncated, and only its headers are read).
                let got = unsafe {
                    libc::recv(
                        self.0.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                if got < 0 {
                    break;
                }
                if let Some((seq, ack)) = pure_ack_of(&buf[..got as usize], flow) {
                    best = match best {
                        Some((s, _)) if (seq.wrapping_sub(s) as i32) <= 0 => best,
                        _ => Some((seq, ack)),
                    };
                }
            }
        }
    }
}

/// Classic BPF for a packet socket of type SOCK_DGRAM (the packet starts at
/// its IP header): accept IPv4 or IPv6 TCP from port `sport` to port
/// `dport` (IPv6 without extension headers), drop the rest.
fn port_filter(sport: u16, dport: u16) -> Vec<libc::sock_filter> {
    const LDB_ABS: u16 = 0x30; // BPF_LD | BPF_B | BPF_ABS
    const LDH_ABS: u16 = 0x28; // BPF_LD | BPF_H | BPF_ABS
    const LDH_IND: u16 = 0x48; // BPF_LD | BPF_H | BPF_IND
    const LDXB_MSH: u16 = 0xb1; // BPF_LDX | BPF_B | BPF_MSH
    const RSH_K: u16 = 0x74; // BPF_ALU | BPF_RSH | BPF_K
    const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    let i = |code, jt, jf, k| libc::sock_filter { code, jt, jf, k };
    let (s, d) = (u32::from(sport), u32::from(dport));
    // A jump's targets count from the next instruction.
    vec![
        i(LDB_ABS, 0, 0, 0),   // 0: A = first byte
        i(RSH_K, 0, 0, 4),     // 1: A = IP version
        i(JEQ_K, 0, 7, 4),     // 2: IPv4? 3 : 10
        i(LDB_ABS, 0, 0, 9),   // 3: A = protocol
        i(JEQ_K, 0, 13, 6),    // 4: TCP? 5 : 18
        i(LDXB_MSH, 0, 0, 0),  // 5: X = IPv4 header length
        i(LDH_IND, 0, 0, 0),   // 6: A = source port
        i(JEQ_K, 0, 10, s),    // 7: ours? 8 : 18
        i(LDH_IND, 0, 0, 2),   // 8: A = destination port
        i(JEQ_K, 7, 8, d),     // 9: the peer's? 17 : 18
        i(JEQ_K, 0, 7, 6),     // 10: IPv6 (A is still the version)? 11 : 18
        i(LDB_ABS, 0, 0, 6),   // 11: A = next header
        i(JEQ_K, 0, 5, 6),     // 12: TCP? 13 : 18
        i(LDH_ABS, 0, 0, 40),  // 13: A = source port
        i(JEQ_K, 0, 3, s),     // 14: ours? 15 : 18
        i(LDH_ABS, 0, 0, 42),  // 15: A = destination port
        i(JEQ_K, 0, 1, d),     // 16: the peer's? 17 : 18
        i(RET_K, 0, 0, 65535), // 17: accept
        i(RET_K, 0, 0, 0),     // 18: drop
    ]
}

/// A pure ACK (no data, no SYN or RST) from `flow.local` to `flow.remote`:
/// its sequence and acknowledgement numbers.
fn pure_ack_of(p: &[u8], flow: &VirtualFlow) -> Option<(u32, u32)> {
    let (src, dst, total, tcp) = match p.first()? >> 4 {
        4 => {
            let ihl = usize::from(p[0] & 0x0f) * 4;
            if p.len() < 20 || ihl < 20 || *p.get(9)? != 6 {
                return None;
            }
            let src = IpAddr::from(<[u8; 4]>::try_from(&p[12..16]).ok()?);
            let dst = IpAddr::from(<[u8; 4]>::try_from(&p[16..20]).ok()?);
            let total = usize::from(u16::from_be_bytes([p[2], p[3]]));
            (src, dst, total.checked_sub(ihl)?, p.get(ihl..)?)
        }
        6 => {
            if p.len() < 40 || p[6] != 6 {
                return None;
            }
            let src = IpAddr::from(<[u8; 16]>::try_from(&p[8..24]).ok()?);
            let dst = IpAddr::from(<[u8; 16]>::try_from(&p[24..40]).ok()?);
            let payload = usize::from(u16::from_be_bytes([p[4], p[5]]));
            (src, dst, payload, p.get(40..)?)
        }
        _ => return None,
    };
    if tcp.len() < 20 {
        return None;
    }
    let port = |at: usize| u16::from_be_bytes([tcp[at], tcp[at + 1]]);
    let word = |at: usize| u32::from_be_bytes([tcp[at], tcp[at + 1], tcp[at + 2], tcp[at + 3]]);
    let doff = usize::from(tcp[12] >> 4) * 4;
    let flags = tcp[13];
    const SYN: u8 = 0x02;
    const RST: u8 = 0x04;
    const ACK: u8 = 0x10;
    let ours = src.to_canonical() == flow.local.ip().to_canonical()
        && dst.to_canonical() == flow.remote.ip().to_canonical()
        && port(0) == flow.local.port()
        && port(2) == flow.remote.port();
    (ours && flags & ACK != 0 && flags & (SYN | RST) == 0 && total == doff)
        .then(|| (word(4), word(8)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow() -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: "198.18.1.2:40000".parse().unwrap(),
            remote: "198.18.3.2:5001".parse().unwrap(),
        }
    }

    fn v4_segment(flags: u8, payload: usize) -> Vec<u8> {
        let mut p = vec![0u8; 20 + 20 + payload];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&((40 + payload) as u16).to_be_bytes());
        p[9] = 6;
        p[12..16].copy_from_slice(&[198, 18, 1, 2]);
        p[16..20].copy_from_slice(&[198, 18, 3, 2]);
        p[20..22].copy_from_slice(&40000u16.to_be_bytes());
        p[22..24].copy_from_slice(&5001u16.to_be_bytes());
        p[24..28].copy_from_slice(&7u32.to_be_bytes());
        p[28..32].copy_from_slice(&9u32.to_be_bytes());
        p[32] = 5 << 4;
        p[33] = flags;
        p
    }

    /// The filter's verdict on `p`, run by a small classic-BPF interpreter
    /// for the instructions it uses.
    fn run(filter: &[libc::sock_filter], p: &[u8]) -> u32 {
        let (mut a, mut x, mut pc) = (0u32, 0u32, 0usize);
        let byte = |at: usize| u32::from(p.get(at).copied().unwrap_or(0));
        let half = |at: usize| byte(at) << 8 | byte(at + 1);
        loop {
            let f = filter[pc];
            let k = f.k as usize;
            pc += 1;
            match f.code {
                0x30 => a = byte(k),
                0x28 => a = half(k),
                0x48 => a = half(x as usize + k),
                0xb1 => x = (byte(k) & 0x0f) * 4,
                0x74 => a >>= f.k,
                0x15 => pc += usize::from(if a == f.k { f.jt } else { f.jf }),
                0x06 => return f.k,
                c => panic!("opcode {c:#x}"),
            }
        }
    }

    #[test]
    fn the_filter_takes_the_flows_tcp_packets_only() {
        let f = port_filter(40000, 5001);
        let v4 = v4_segment(0x10, 0);
        assert_ne!(run(&f, &v4), 0, "the flow's own IPv4 segment");
        let mut other = v4.clone();
        other[22..24].copy_from_slice(&5002u16.to_be_bytes());
        assert_eq!(run(&f, &other), 0, "another destination port");
        let mut other = v4.clone();
        other[20..22].copy_from_slice(&40001u16.to_be_bytes());
        assert_eq!(run(&f, &other), 0, "another source port");
        let mut udp = v4.clone();
        udp[9] = 17;
        assert_eq!(run(&f, &udp), 0, "UDP");
        let mut opts = vec![0u8; 44];
        opts[..20].copy_from_slice(&v4[..20]);
        opts[0] = 0x46; // 24-byte header
        opts[24..44].copy_from_slice(&v4[20..40]);
        assert_ne!(run(&f, &opts), 0, "an IPv4 header with options");
        let mut v6 = vec![0u8; 60];
        v6[0] = 0x60;
        v6[6] = 6;
        v6[40..42].copy_from_slice(&40000u16.to_be_bytes());
        v6[42..44].copy_from_slice(&5001u16.to_be_bytes());
        assert_ne!(run(&f, &v6), 0, "the flow's own IPv6 segment");
        v6[43] ^= 1;
        assert_eq!(run(&f, &v6), 0, "IPv6, another destination port");
        assert_eq!(run(&f, &[0x70]), 0, "neither family");
    }

    #[test]
    fn the_peek_request_names_the_socket_as_an_arriving_segment_would() {
        let p = peek_packet(&flow());
        assert_eq!(p.len(), PEEK_PACKET_LEN);
        let r = &p[PEEK_REQUEST_OFF..PEEK_ANSWER_OFF];
        assert_eq!(u32::from_ne_bytes(r[..4].try_into().unwrap()), 2, "AF_INET");
        assert_eq!(&r[4..8], &[198, 18, 3, 2], "source: the peer's end");
        assert_eq!(&r[20..24], &[198, 18, 1, 2], "destination: this host's");
        assert_eq!(&r[36..38], &5001u16.to_be_bytes(), "the peer's port");
        assert_eq!(&r[38..40], &40000u16.to_be_bytes(), "this host's port");
        assert!(
            p[PEEK_ANSWER_OFF..].iter().all(|&b| b == 0),
            "no answer yet"
        );

        let v6 = VirtualFlow {
            proto: Proto::Tcp,
            local: "[fd00:5e:1::2]:40000".parse().unwrap(),
            remote: "[fd00:5e:3::2]:5001".parse().unwrap(),
        };
        let p = peek_packet(&v6);
        let r = &p[PEEK_REQUEST_OFF..PEEK_ANSWER_OFF];
        assert_eq!(
            u32::from_ne_bytes(r[..4].try_into().unwrap()),
            10,
            "AF_INET6"
        );
        assert_eq!(
            r[4..20],
            "fd00:5e:3::2"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
        );
        assert_eq!(
            r[20..36],
            "fd00:5e:1::2"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
        );
    }

    #[test]
    fn bases_are_the_numbers_less_the_counters_mod_2_32() {
        let a = PeekAnswer {
            found: PEEK_FOUND | PEEK_STEADY,
            state: 1,
            snd_una: 100,
            snd_nxt: 200,
            rcv_nxt: 5,
            bytes_acked: (1 << 32) + 101,
            bytes_received: 10,
            ..PeekAnswer::default()
        };
        assert_eq!(
            bases_of(&a),
            SequenceBases {
                snd_una_base: u32::MAX,
                rcv_nxt_base: u32::MAX - 4,
            }
        );
        let mut p = vec![0u8; PEEK_PACKET_LEN];
        // SAFETY: PeekAnswer is plain integers with no padding.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (&a as *const PeekAnswer).cast::<u8>(),
                size_of::<PeekAnswer>(),
            )
        };
        p[PEEK_ANSWER_OFF..].copy_from_slice(bytes);
        assert_eq!(answer_of(&p), Some(a));
        assert_eq!(answer_of(&p[..PEEK_PACKET_LEN - 1]), None, "a short packet");
    }

    #[test]
    fn only_the_sockets_pure_acks_count() {
        assert_eq!(pure_ack_of(&v4_segment(0x10, 0), &flow()), Some((7, 9)));
        assert_eq!(pure_ack_of(&v4_segment(0x10, 3), &flow()), None, "data");
        assert_eq!(pure_ack_of(&v4_segment(0x12, 0), &flow()), None, "SYN");
        assert_eq!(pure_ack_of(&v4_segment(0x14, 0), &flow()), None, "RST");
        let mut other = v4_segment(0x10, 0);
        other[22..24].copy_from_slice(&5002u16.to_be_bytes());
        assert_eq!(pure_ack_of(&other, &flow()), None, "another flow");
        assert_eq!(pure_ack_of(&v4_segment(0x10, 0)[..30], &flow()), None);
        assert_eq!(pure_ack_of(&[], &flow()), None);
    }
}
