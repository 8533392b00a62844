//! `vnat-repair`: a TCP echo server whose live connection can be
//! checkpointed in one network namespace and restored in another, with
//! Linux's TCP_REPAIR (what CRIU does for sockets), to emulate a process
//! that migrates to another host.
//!
//!   vnat-repair serve --listen ADDR:PORT --state FILE
//!       accept one connection and echo it; on SIGUSR1 checkpoint the socket
//!       into FILE (sequence numbers, queues, options, window) and stay
//!       frozen until killed (a socket closed in repair mode is silent).
//!   vnat-repair restore --state FILE
//!       recreate the socket from FILE (bound to the same local address,
//!       which must be local here) and go on echoing.
//!
//! Each prints one JSON line when ready: {"ready":true,...}.

use std::{
    io::{Read, Write},
    mem::size_of,
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd, FromRawFd, RawFd},
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use serde_json::{json, Value};

const TCP_REPAIR: libc::c_int = 19;
const TCP_REPAIR_QUEUE: libc::c_int = 20;
const TCP_QUEUE_SEQ: libc::c_int = 21;
const TCP_REPAIR_OPTIONS: libc::c_int = 22;
const TCP_TIMESTAMP: libc::c_int = 24;
const TCP_REPAIR_WINDOW: libc::c_int = 29;
const TCP_RECV_QUEUE: libc::c_int = 1;
const TCP_SEND_QUEUE: libc::c_int = 2;
const TCPOPT_MAXSEG: u32 = 2;
const TCPOPT_WINDOW: u32 = 3;
const TCPOPT_SACK_PERM: u32 = 4;
const TCPOPT_TIMESTAMP: u32 = 8;
const TCPI_OPT_TIMESTAMPS: u8 = 1;
const TCPI_OPT_SACK: u8 = 2;
const TCPI_OPT_WSCALE: u8 = 4;

static CHECKPOINT: AtomicBool = AtomicBool::new(false);

extern "C" fn on_usr1(_: libc::c_int) {
    CHECKPOINT.store(true, Ordering::SeqCst);
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct RepairWindow {
    snd_wl1: u32,
    snd_wnd: u32,
    max_window: u32,
    rcv_wnd: u32,
    rcv_wup: u32,
}

fn die(msg: String) -> ! {
    eprintln!("vnat-repair: {msg}");
    std::process::exit(1)
}

fn setsockopt<T>(fd: RawFd, opt: libc::c_int, v: &T, what: &str) {
    // SAFETY: `v` is a live T and exactly size_of::<T>() bytes are passed,
    // so the kernel reads only within it. A bad `fd` only makes the call
    // fail.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_TCP,
            opt,
            (v as *const T).cast(),
            size_of::<T>() as u32,
        )
    };
    if rc != 0 {
        die(format!(
            "setsockopt({what}): {}",
            std::io::Error::last_os_error()
        ));
    }
}

fn getsockopt<T: Default>(fd: RawFd, opt: libc::c_int, what: &str) -> T {
    let mut v = T::default();
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: the kernel writes at most `len` = size_of::<T>() bytes into
    // `v`, a live T. Whatever it writes must be a valid T: every caller
    // asks for an option whose C type is plain integers (u32, i32,
    // RepairWindow), for which any bytes are valid.
    let rc =
        unsafe { libc::getsockopt(fd, libc::SOL_TCP, opt, (&mut v as *mut T).cast(), &mut len) };
    if rc != 0 {
        die(format!(
            "getsockopt({what}): {}",
            std::io::Error::last_os_error()
        ));
    }
    v
}

/// The bytes of one queue (socket in repair mode, queue selected): a
/// non-blocking peek returns them without consuming anything.
fn peek_queue(fd: RawFd, queue: libc::c_int) -> Vec<u8> {
    setsockopt(fd, TCP_REPAIR_QUEUE, &queue, "TCP_REPAIR_QUEUE");
    let mut buf = vec![0u8; 8 << 20];
    // SAFETY: recv writes at most buf.len() bytes into `buf`; a bad `fd`
    // only makes it fail.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EAGAIN) {
            return Vec::new();
        }
        die(format!("peeking queue {queue}: {e}"));
    }
    buf.truncate(n as usize);
    buf
}

fn queue_seq(fd: RawFd, queue: libc::c_int) -> u32 {
    setsockopt(fd, TCP_REPAIR_QUEUE, &queue, "TCP_REPAIR_QUEUE");
    getsockopt::<u32>(fd, TCP_QUEUE_SEQ, "TCP_QUEUE_SEQ")
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| {
            u8::from_str_radix(&s[i * 2..i * 2 + 2], 16)
                .unwrap_or_else(|_| die("bad hex in state".into()))
        })
        .collect()
}

/// Freeze `s` and describe it completely.
fn checkpoint(s: &TcpStream) -> Value {
    let fd = s.as_raw_fd();
    let local = s
        .local_addr()
        .unwrap_or_else(|e| die(format!("local_addr: {e}")));
    let peer = s
        .peer_addr()
        .unwrap_or_else(|e| die(format!("peer_addr: {e}")));
    // Options must be read before repair mode (TCP_INFO is fine either way).
    // SAFETY: tcp_info is plain integers, so all-zero is a valid value and
    // so is whatever the kernel writes; it writes at most `len` bytes, the
    // size of `i`, and `fd` is open for the call (borrowed from `s`).
    let info: libc::tcp_info = unsafe {
        let mut i: libc::tcp_info = std::mem::zeroed();
        let mut len = size_of::<libc::tcp_info>() as libc::socklen_t;
        if libc::getsockopt(
            fd,
            libc::SOL_TCP,
            libc::TCP_INFO,
            (&mut i as *mut libc::tcp_info).cast(),
            &mut len,
        ) != 0
        {
            die(format!("TCP_INFO: {}", std::io::Error::last_os_error()));
        }
        i
    };
    let mss: i32 = getsockopt(fd, libc::TCP_MAXSEG, "TCP_MAXSEG");
    setsockopt(fd, TCP_REPAIR, &1i32, "TCP_REPAIR on");
    let snd_seq = queue_seq(fd, TCP_SEND_QUEUE);
    let rcv_seq = queue_seq(fd, TCP_RECV_QUEUE);
    let send_queue = peek_queue(fd, TCP_SEND_QUEUE);
    let recv_queue = peek_queue(fd, TCP_RECV_QUEUE);
    let window: RepairWindow = getsockopt(fd, TCP_REPAIR_WINDOW, "TCP_REPAIR_WINDOW");
    let ts: u32 = getsockopt(fd, TCP_TIMESTAMP, "TCP_TIMESTAMP");
    let wscale = info.tcpi_snd_rcv_wscale;
    json!({
        "local": local.to_string(), "peer": peer.to_string(),
        "snd_seq": snd_seq, "rcv_seq": rcv_seq,
        "send_queue": hex(&send_queue), "recv_queue": hex(&recv_queue),
        "mss": mss, "options": info.tcpi_options, "snd_wscale": wscale & 0xf, "rcv_wscale": wscale >> 4,
        "timestamp": ts,
        "window": [window.snd_wl1, window.snd_wnd, window.max_window, window.rcv_wnd, window.rcv_wup],
    })
}

/// Recreate the socket described by `st`, ready to use.
fn restore(st: &Value) -> TcpStream {
    let get = |k: &str| {
        st[k]
            .as_u64()
            .unwrap_or_else(|| die(format!("state lacks {k}")))
    };
    let local: SocketAddr = st["local"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| die("bad local".into()));
    let peer: SocketAddr = st["peer"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| die("bad peer".into()));
    let domain = if local.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: socket(2) takes no pointers. The descriptor it returns is
    // ours alone: it is used by number below and handed to a TcpStream,
    // which owns it, at the end (on every failure in between the process
    // exits).
    let fd = unsafe { libc::socket(domain, libc::SOCK_STREAM, 0) };
    if fd < 0 {
        die(format!("socket: {}", std::io::Error::last_os_error()));
    }
    setsockopt(fd, TCP_REPAIR, &1i32, "TCP_REPAIR on");
    let one = 1i32;
    // SAFETY: `one` is a live i32 and its size, 4, is passed.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&one as *const i32).cast(),
            4,
        )
    };
    let (sa, len) = sockaddr(local);
    // SAFETY: `sa` is a live sockaddr_storage and `len`, the size of the
    // sockaddr_in or sockaddr_in6 in it, is no more than its size.
    if unsafe { libc::bind(fd, (&sa as *const libc::sockaddr_storage).cast(), len) } != 0 {
        die(format!(
            "bind {local} (is the address local here?): {}",
            std::io::Error::last_os_error()
        ));
    }
    // TCP_QUEUE_SEQ reads the sequence number *after* each queue
    // (write_seq, rcv_nxt); restoring the queue's bytes below advances it
    // again, so it is set to the sequence number of the queue's first byte.
    let send_queue = unhex(st["send_queue"].as_str().unwrap_or(""));
    let recv_queue = unhex(st["recv_queue"].as_str().unwrap_or(""));
    let snd_start = (get("snd_seq") as u32).wrapping_sub(send_queue.len() as u32);
    let rcv_start = (get("rcv_seq") as u32).wrapping_sub(recv_queue.len() as u32);
    setsockopt(fd, TCP_REPAIR_QUEUE, &TCP_SEND_QUEUE, "queue");
    setsockopt(fd, TCP_QUEUE_SEQ, &snd_start, "snd seq");
    setsockopt(fd, TCP_REPAIR_QUEUE, &TCP_RECV_QUEUE, "queue");
    setsockopt(fd, TCP_QUEUE_SEQ, &rcv_start, "rcv seq");
    // In repair mode connect() only records the peer: no SYN is sent.
    let (pa, plen) = sockaddr(peer);
    // SAFETY: as for bind: a live address of at least `plen` bytes.
    if unsafe { libc::connect(fd, (&pa as *const libc::sockaddr_storage).cast(), plen) } != 0 {
        die(format!(
            "repair connect {peer}: {}",
            std::io::Error::last_os_error()
        ));
    }
    let opts = get("options") as u8;
    let mut ropts: Vec<[u32; 2]> = vec![[TCPOPT_MAXSEG, get("mss") as u32]];
    if opts & TCPI_OPT_WSCALE != 0 {
        ropts.push([
            TCPOPT_WINDOW,
            get("snd_wscale") as u32 | ((get("rcv_wscale") as u32) << 16),
        ]);
    }
    if opts & TCPI_OPT_SACK != 0 {
        ropts.push([TCPOPT_SACK_PERM, 0]);
    }
    if opts & TCPI_OPT_TIMESTAMPS != 0 {
        ropts.push([TCPOPT_TIMESTAMP, 0]);
    }
    // SAFETY: `ropts` holds ropts.len() pairs of u32, laid out as the
    // kernel's struct tcp_repair_opt array (8 bytes each), and exactly that
    // many bytes are passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_TCP,
            TCP_REPAIR_OPTIONS,
            ropts.as_ptr().cast(),
            (ropts.len() * 8) as u32,
        )
    };
    if rc != 0 {
        die(format!(
            "TCP_REPAIR_OPTIONS: {}",
            std::io::Error::last_os_error()
        ));
    }
    if opts & TCPI_OPT_TIMESTAMPS != 0 {
        setsockopt(
            fd,
            TCP_TIMESTAMP,
            &(get("timestamp") as u32),
            "TCP_TIMESTAMP",
        );
    }
    for (queue, key, data) in [
        (TCP_RECV_QUEUE, "recv_queue", recv_queue),
        (TCP_SEND_QUEUE, "send_queue", send_queue),
    ] {
        if data.is_empty() {
            continue;
        }
        setsockopt(fd, TCP_REPAIR_QUEUE, &queue, "queue");
        // SAFETY: `data` is live for the call and its length is passed.
        let n = unsafe { libc::send(fd, data.as_ptr().cast(), data.len(), 0) };
        if n != data.len() as isize {
            die(format!(
                "restoring {key}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    let w: Vec<u32> = st["window"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_u64().map(|x| x as u32))
                .collect()
        })
        .unwrap_or_default();
    if let [snd_wl1, snd_wnd, max_window, rcv_wnd, rcv_wup] = w[..] {
        setsockopt(
            fd,
            TCP_REPAIR_WINDOW,
            &RepairWindow {
                snd_wl1,
                snd_wnd,
                max_window,
                rcv_wnd,
                rcv_wup,
            },
            "TCP_REPAIR_WINDOW",
        );
    }
    // Leaving repair mode makes the socket live (the kernel sends a window
    // probe so the peer learns it is there).
    setsockopt(fd, TCP_REPAIR, &0i32, "TCP_REPAIR off");
    // SAFETY: `fd` is the open socket created above; nothing has closed it
    // or taken ownership of it, so the TcpStream becomes its only owner.
    unsafe { TcpStream::from_raw_fd(fd) }
}

fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain integers, for which all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as u16,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and at
            // least as aligned, so the write stays inside `ss`.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin) };
            (ss, size_of::<libc::sockaddr_in>() as u32)
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as u16,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write((&mut ss as *mut libc::sockaddr_storage).cast(), sin6) };
            (ss, size_of::<libc::sockaddr_in6>() as u32)
        }
    }
}

/// Echo until SIGUSR1 (returns true) or EOF (false).
fn echo(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_millis(50))).ok();
    let mut buf = vec![0u8; 65536];
    loop {
        if CHECKPOINT.load(Ordering::SeqCst) {
            return true;
        }
        match s.read(&mut buf) {
            Ok(0) => return false,
            Ok(n) => {
                if s.write_all(&buf[..n]).is_err() {
                    return false;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(e) => die(format!("echo: {e}")),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |name: &str| -> String {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| die(format!("missing {name}")))
    };
    // SAFETY: the handler only stores to an atomic, which is
    // async-signal-safe, and is installed before any other thread exists.
    unsafe { libc::signal(libc::SIGUSR1, on_usr1 as *const () as libc::sighandler_t) };
    match args.first().map(String::as_str) {
        Some("serve") => {
            let listener =
                TcpListener::bind(arg("--listen")).unwrap_or_else(|e| die(format!("listen: {e}")));
            println!("{}", json!({"ready": true, "listen": arg("--listen")}));
            let (mut s, _) = listener
                .accept()
                .unwrap_or_else(|e| die(format!("accept: {e}")));
            drop(listener);
            if echo(&mut s) {
                let st = checkpoint(&s);
                std::fs::write(arg("--state"), st.to_string())
                    .unwrap_or_else(|e| die(format!("writing state: {e}")));
                println!(
                    "{}",
                    json!({"checkpointed": true, "local": st["local"], "peer": st["peer"]})
                );
                // Like a frozen process, keep the socket (in repair mode) until
                // killed: while it exists no reset answers the peer's packets,
                // and closing it in repair mode later sends neither FIN nor RST.
                loop {
                    std::thread::sleep(Duration::from_secs(3600));
                }
            }
        }
        Some("restore") => {
            let text = std::fs::read_to_string(arg("--state"))
                .unwrap_or_else(|e| die(format!("reading state: {e}")));
            let st: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| die(format!("bad state: {e}")));
            let mut s = restore(&st);
            println!(
                "{}",
                json!({"ready": true, "restored": true, "local": st["local"], "peer": st["peer"]})
            );
            echo(&mut s);
        }
        _ => die(
            "usage: vnat-repair serve --listen ADDR:PORT --state FILE | restore --state FILE"
                .into(),
        ),
    }
}
