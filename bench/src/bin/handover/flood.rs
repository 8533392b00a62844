//! `--flood-pps`: junk and forged VCMP datagrams at the server's port 2031
//! from an off-path host while the move happens (issue 16, item 12). A
//! third of them are UPD records for the real connection with made-up
//! tags (the expensive kind: each costs the server a MAC check), a third
//! PAIR_INITs with fresh keys, a third random bytes of random lengths.
//! Half of all of them claim to come from the laptop's own VCMP address
//! (IP_TRANSPARENT; the router does no reverse-path filtering), which the
//! server knows: its PAIR_INITs meet the cookie and the DH limit, not the
//! stranger check.

use std::{
    net::{SocketAddr, UdpSocket},
    os::fd::AsRawFd,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use vnat_daemon::vcmp::{
    crypto::{DrbgRng, HostIdentity},
    flow::{Proto, VirtualFlow},
    wire::{Ext, Family, Kind, Message, Record},
};
use vnat_tests::Netns;

/// Datagrams handed to the kernel per sendmmsg call.
const BATCH: usize = 32;

/// A running flood; `stop` ends it and says how much left.
pub struct Flood {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    started: Instant,
    handle: Option<JoinHandle<()>>,
}

/// What a flood sent.
pub struct Sent {
    pub datagrams: u64,
    pub per_sec: f64,
}

fn datagrams(flow: VirtualFlow, n: usize) -> Vec<Vec<u8>> {
    use rand_core::RngCore;
    let mut rng = DrbgRng::from_seed(2031);
    let family = if flow.local.is_ipv4() {
        Family::V4
    } else {
        Family::V6
    };
    (0..n)
        .map(|i| match i % 3 {
            0 => {
                let mut tag = [0u8; 16];
                rng.fill_bytes(&mut tag);
                let rec = Record {
                    command: Kind::Upd,
                    proto: Proto::Tcp,
                    receiver_vir: flow.remote,
                    sender_vir: flow.local,
                    sender_phys: flow.local,
                    ext: Ext::None,
                    seq: rng.next_u64(),
                    tag,
                };
                Message::Records {
                    kind: Kind::Upd,
                    request_id: 0,
                    family,
                    records: vec![rec],
                }
                .encode()
                .expect("a forged UPD encodes")
            }
            1 => {
                let mut k = [0u8; 32];
                rng.fill_bytes(&mut k);
                let static_pub = HostIdentity::from_bytes(k).public();
                Message::PairInit {
                    request_id: rng.next_u32(),
                    static_pub,
                    eph_pub: static_pub,
                    cookie: None,
                }
                .encode()
                .expect("a PAIR_INIT encodes")
            }
            _ => {
                let len = 1 + (rng.next_u32() % 200) as usize;
                let mut b = vec![0u8; len];
                rng.fill_bytes(&mut b);
                b
            }
        })
        .collect()
}

/// A UDP socket bound to an address this host does not have.
fn free_bind(addr: SocketAddr) -> std::io::Result<UdpSocket> {
    use std::os::fd::FromRawFd;
    let SocketAddr::V4(a) = addr else {
        return Err(std::io::Error::other("the spoofed address must be IPv4"));
    };
    // SAFETY: socket, setsockopt and bind on a descriptor this function
    // owns (wrapped at once, so it is closed on every path); the option
    // value and address are live locals of the sizes passed.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let sock = UdpSocket::from_raw_fd(fd);
        let one: libc::c_int = 1;
        // FREEBIND to bind it; TRANSPARENT for the route lookup to accept
        // a source address that is not local (IPv4 checks it otherwise).
        for opt in [libc::IP_FREEBIND, libc::IP_TRANSPARENT] {
            if libc::setsockopt(
                fd,
                libc::IPPROTO_IP,
                opt,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
        }
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(a.ip().octets()),
            },
            sin_zero: [0; 8],
        };
        if libc::bind(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        ) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(sock)
    }
}

impl Flood {
    /// Start sending `pps` datagrams a second from `attacker` to `target`,
    /// forging records for `flow` (named from the moving end).
    pub fn start(
        attacker: &Netns,
        target: SocketAddr,
        spoofed: SocketAddr,
        pps: u32,
        flow: VirtualFlow,
    ) -> Result<Flood> {
        let bind: SocketAddr = if target.is_ipv4() {
            "0.0.0.0:0".parse()?
        } else {
            "[::]:0".parse()?
        };
        let own = attacker
            .run_in(|| UdpSocket::bind(bind))
            .context("the flood's socket")?;
        own.connect(target)
            .context("connecting the flood's socket")?;
        let spoof = attacker
            .run_in(|| free_bind(spoofed))
            .context("the flood's spoofing socket")?;
        spoof
            .connect(target)
            .context("connecting the flood's spoofing socket")?;
        let socks = [own, spoof];
        let payloads = datagrams(flow, 3 * 64);
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let handle = {
            let (stop, sent) = (stop.clone(), sent.clone());
            std::thread::spawn(move || {
                let mut n: u64 = 0;
                let mut next = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    // Batches alternate: from the attacker, as the laptop.
                    let fd = socks[(next / BATCH) % 2].as_raw_fd();
                    let mut iov: Vec<libc::iovec> = (0..BATCH)
                        .map(|i| {
                            let p = &payloads[(next + i) % payloads.len()];
                            libc::iovec {
                                iov_base: p.as_ptr() as *mut libc::c_void,
                                iov_len: p.len(),
                            }
                        })
                        .collect();
                    next = (next + BATCH) % payloads.len();
                    let mut msgs: Vec<libc::mmsghdr> = iov
                        .iter_mut()
                        .map(|v| {
                            // SAFETY: an all-zero msghdr is valid (no name,
                            // no control data); the iovec is set below.
                            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
                            h.msg_hdr.msg_iov = v;
                            h.msg_hdr.msg_iovlen = 1;
                            h
                        })
                        .collect();
                    // SAFETY: `fd` is the connected socket this thread owns;
                    // `msgs` and the iovecs and payloads they point to live
                    // across the call.
                    let r =
                        unsafe { libc::sendmmsg(fd, msgs.as_mut_ptr(), BATCH as libc::c_uint, 0) };
                    if r > 0 {
                        n += r as u64;
                        sent.store(n, Ordering::Relaxed);
                    }
                    let due = started + Duration::from_secs_f64(n as f64 / f64::from(pps));
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                }
            })
        };
        Ok(Flood {
            stop,
            sent,
            started,
            handle: Some(handle),
        })
    }

    pub fn stop(mut self) -> Sent {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        let datagrams = self.sent.load(Ordering::Relaxed);
        Sent {
            datagrams,
            per_sec: datagrams as f64 / self.started.elapsed().as_secs_f64(),
        }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
