//! Unannounced outages (issue 32, item 1): the laptop's network goes away
//! without `vnatctl suspend` (its address removed, its link down) while
//! two connections between it and the server are idle, one the laptop
//! opened and one it accepted. Both ends' applications keep TCP keepalive
//! on (10 s idle, 3 probes 3 s apart: a peer silent for about 19 s is given
//! up) and write during the outage; the laptop comes back on subnet B.
//!
//! - The laptop's vnatd holds the keepalives (and the retransmission
//!   timeouts) of both connections as soon as their address is gone, the
//!   accepted one's too (its owner found by inode), and turns them on
//!   again once the connections work. The laptop's `tcp_retries2` is 3:
//!   data it writes while offline would end its connections within
//!   seconds (as the default 15 does after about 13 minutes) unless its
//!   own retransmissions are held too.
//! - The server's vnatd notices on its own that the laptop went silent
//!   (its sockets' probes unanswered, a VCMP probe unanswered) and answers
//!   for it with a zero window until it is back.
//! - Every byte arrives in order on both sides, and neither application
//!   sees an error.
//!
//! - Once they work, each end's socket has its keepalive on again and its
//!   TCP_USER_TIMEOUT as the application left it (0), as the application
//!   itself reads them.
//!
//! The outage lasts `VNAT_TEST_OUTAGE_SECS` seconds (the issue's 600 by
//! default; 40 is enough to see what it checks). A second test kills the
//! laptop's vnatd (SIGKILL) a few seconds into a 45 s outage and starts a
//! new one: it gives back what the dead one changed on the sockets, holds
//! them again while the laptop is away, and nothing stays held after.

mod support;

use std::{
    io::{BufRead, BufReader, Write},
    net::SocketAddr,
    process::{ChildStdin, ChildStdout, Stdio},
    time::{Duration, Instant},
};

use vnat_tests::{wait_until, Host, LaptopRouterServer, ProcessGroup, TempDir, Vnatd};

/// Silent for this long at the outage's start: longer than the
/// applications' keepalive lets an unanswered peer live (about 19 s).
const IDLE_AT_START: Duration = Duration::from_secs(30);
/// Lines each side writes every [`WRITE_EVERY`] after that.
const LINES: u32 = 5;
const WRITE_EVERY: Duration = Duration::from_secs(10);
/// The outage of the test that kills the laptop's vnatd.
const KILL_OUTAGE: Duration = Duration::from_secs(45);

fn outage() -> Duration {
    let secs = std::env::var("VNAT_TEST_OUTAGE_SECS")
        .ok()
        .map(|s| {
            s.parse::<u64>().unwrap_or_else(|_| {
                panic!("VNAT_TEST_OUTAGE_SECS={s:?} is not a number of seconds")
            })
        })
        .unwrap_or(600);
    Duration::from_secs(secs).max(IDLE_AT_START + WRITE_EVERY)
}

/// One end of a connection: connects or listens (and accepts one), keeps
/// TCP keepalive on, writes numbered lines when told to (`send N`), checks
/// that the lines it reads are numbered 0, 1, 2... and says on `status`
/// how many it read and wrote, its socket's SO_KEEPALIVE and
/// TCP_USER_TIMEOUT, and the first error it saw.
const PEER: &str = r#"
import socket, sys, threading
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
fam = socket.AF_INET6 if ':' in host else socket.AF_INET
if mode == 'listen':
    ls = socket.socket(fam, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((host, port))
    ls.listen(1)
    print('listening', flush=True)
    s, _ = ls.accept()
    ls.close()
else:
    s = socket.create_connection((host, port))
s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 3)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
print('connected', flush=True)
st = {'recv': 0, 'sent': 0, 'queued': 0, 'err': None}
lock = threading.Condition()
def fail(e):
    with lock:
        if st['err'] is None:
            st['err'] = e
def reader():
    try:
        for line in s.makefile('rb'):
            n = int(line.split()[0])
            with lock:
                if n != st['recv'] and st['err'] is None:
                    st['err'] = 'line %d after %d' % (n, st['recv'])
                st['recv'] += 1
        fail('end of stream')
    except Exception as e:
        fail('receive: %s' % e)
def writer():
    try:
        while True:
            with lock:
                while st['queued'] == st['sent']:
                    lock.wait()
                n = st['sent']
            s.sendall(('%d %s\n' % (n, 'x' * 90)).encode())
            with lock:
                st['sent'] += 1
    except Exception as e:
        fail('send: %s' % e)
threading.Thread(target=reader, daemon=True).start()
threading.Thread(target=writer, daemon=True).start()
for cmd in sys.stdin:
    w = cmd.split()
    if w and w[0] == 'send':
        with lock:
            st['queued'] += int(w[1])
            lock.notify_all()
    elif w and w[0] == 'status':
        ka = s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        uto = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        with lock:
            print('%d %d %d %d %s' % (st['recv'], st['sent'], ka, uto, st['err'] or 'none'), flush=True)
"#;

struct Peer {
    _group: ProcessGroup,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    what: &'static str,
}

impl Peer {
    fn start(host: &Host, mode: &str, addr: SocketAddr, what: &'static str) -> Peer {
        let mut cmd = host.command("python3");
        cmd.args([
            "-c",
            PEER,
            mode,
            &addr.ip().to_string(),
            &addr.port().to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        let mut group = ProcessGroup::spawn(cmd, what);
        let stdin = group.0.stdin.take().expect("stdin");
        let out = BufReader::new(group.0.stdout.take().expect("stdout"));
        let mut p = Peer {
            _group: group,
            stdin,
            out,
            what,
        };
        if mode == "listen" {
            p.expect_line("listening");
        }
        p
    }

    fn expect_line(&mut self, want: &str) {
        let mut l = String::new();
        self.out.read_line(&mut l).expect("reading the peer");
        assert_eq!(l.trim(), want, "{} says", self.what);
    }

    fn send(&mut self, n: u32) {
        writeln!(self.stdin, "send {n}").expect("telling the peer to send");
        self.stdin.flush().expect("flush");
    }

    /// (lines read, lines written, the first error or "none").
    fn status(&mut self) -> (u32, u32, String) {
        let s = self.full_status();
        (s.0, s.1, s.4)
    }

    /// (read, written, SO_KEEPALIVE, TCP_USER_TIMEOUT, first error).
    fn full_status(&mut self) -> (u32, u32, u32, u32, String) {
        writeln!(self.stdin, "status").expect("asking the peer");
        self.stdin.flush().expect("flush");
        let mut l = String::new();
        self.out
            .read_line(&mut l)
            .expect("reading the peer's status");
        let mut w = l.trim().splitn(5, ' ');
        let mut num = || w.next().and_then(|s| s.parse().ok()).unwrap_or(u32::MAX);
        let (r, s, ka, uto) = (num(), num(), num(), num());
        (r, s, ka, uto, w.next().unwrap_or("no status").to_string())
    }
}

/// The ends of one connection: (this side, the other side).
struct Pair {
    a: Peer,
    b: Peer,
}

impl Pair {
    fn open(
        listener: (&Host, &'static str),
        connector: (&Host, &'static str),
        at: SocketAddr,
    ) -> Pair {
        let mut b = Peer::start(listener.0, "listen", at, listener.1);
        let mut a = Peer::start(connector.0, "connect", at, connector.1);
        a.expect_line("connected");
        b.expect_line("connected");
        Pair { a, b }
    }

    fn send(&mut self, n: u32) {
        self.a.send(n);
        self.b.send(n);
    }

    /// Both ends' sockets as their applications set them: keepalive on,
    /// TCP_USER_TIMEOUT 0 (what vnatd held is given back).
    fn wait_as_set(&mut self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let a = self.a.full_status();
            let b = self.b.full_status();
            if (a.2, a.3, b.2, b.3) == (1, 0, 1, 0) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "a socket is left as vnatd held it: {} has keepalive {} and user timeout {} ms, {} has {} and {} ms",
                self.a.what,
                a.2,
                a.3,
                self.b.what,
                b.2,
                b.3
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// No error on either side yet.
    fn check_no_error(&mut self, when: &str) {
        for p in [&mut self.a, &mut self.b] {
            let (_, _, err) = p.status();
            assert_eq!(err, "none", "{} saw an error {when}", p.what);
        }
    }

    /// Every line each side wrote (`sent` each) was read in order by the
    /// other, with no error on either side.
    fn wait_delivered(&mut self, sent: u32, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let (ra, sa, ea) = self.a.status();
            let (rb, sb, eb) = self.b.status();
            assert_eq!(ea, "none", "{} saw an error", self.a.what);
            assert_eq!(eb, "none", "{} saw an error", self.b.what);
            if (ra, sa, rb, sb) == (sent, sent, sent, sent) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not every line arrived: {} read {ra} and wrote {sa}, {} read {rb} and wrote {sb}, of {sent} each",
                self.a.what,
                self.b.what
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

/// The rows of `d`'s `ls` for TCP connections to or from `remote`.
fn rows(d: &Vnatd, remote: std::net::IpAddr) -> Vec<serde_json::Value> {
    let ls = d.ctl(&["ls", "--proto", "tcp"]).expect("ls answers");
    ls.as_array()
        .map(|a| {
            a.iter()
                .filter(|r| {
                    r["virtual_remote"]
                        .as_str()
                        .and_then(|s| s.parse::<SocketAddr>().ok())
                        .is_some_and(|s| s.ip() == remote)
                })
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

fn count(rows: &[serde_json::Value], f: impl Fn(&serde_json::Value) -> bool) -> usize {
    rows.iter().filter(|r| f(r)).count()
}

#[test]
fn idle_connections_with_keepalive_survive_an_unannounced_outage_of_the_laptop() {
    outage_scenario("uao", outage(), false);
}

#[test]
fn a_laptop_vnatd_killed_during_the_outage_leaves_nothing_held() {
    outage_scenario("uak", KILL_OUTAGE, true);
}

/// The laptop offline for `outage` with no command; with `kill`, its
/// vnatd is killed (SIGKILL) a few seconds in, once it holds, and a new
/// one started.
fn outage_scenario(tag: &str, outage: Duration, kill: bool) {
    let topo = LaptopRouterServer::builder().tag(tag).build();
    topo.laptop.set_sysctl("net/ipv4/tcp_retries2", "3");
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (dl, ds) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let mut lapd = Vnatd::start(&lap, dl.path());
    let srvd = Vnatd::start(&srv, ds.path());
    let server_ip = std::net::IpAddr::from(topo.server_addr.v4);
    let laptop_ip = std::net::IpAddr::from(topo.laptop_a_addr.v4);

    // The laptop opens one connection and accepts the other.
    let mut opened = Pair::open(
        (&srv, "the server's accepted end"),
        (&lap, "the laptop's connecting end"),
        SocketAddr::new(server_ip, 5001),
    );
    let mut accepted = Pair::open(
        (&lap, "the laptop's accepted end"),
        (&srv, "the server's connecting end"),
        SocketAddr::new(laptop_ip, 5002),
    );
    let mut sent = 10;
    opened.send(sent);
    accepted.send(sent);
    opened.wait_delivered(sent, Duration::from_secs(10));
    accepted.wait_delivered(sent, Duration::from_secs(10));
    wait_until(
        Duration::from_secs(20),
        || {
            let r = rows(&lapd, server_ip);
            r.len() == 2 && count(&r, |r| r["mobile"] == true) == 2
        },
        || {
            format!(
                "the laptop's connections never became mobile: {:?}",
                rows(&lapd, server_ip)
            )
        },
    );

    // The network goes, no command given.
    let started = Instant::now();
    for (a, p) in topo.laptop_a_addr.with_prefixes() {
        topo.laptop.del_addr(&topo.laptop_if_a, a, p);
    }
    topo.laptop.link_down(&topo.laptop_if_a);
    if kill {
        wait_until(
            Duration::from_secs(5),
            || count(&rows(&lapd, server_ip), |r| r["keepalive_held"] == true) == 2,
            || {
                format!(
                    "the laptop's vnatd does not hold: {:?}",
                    rows(&lapd, server_ip)
                )
            },
        );
        lapd.kill9();
        std::thread::sleep(Duration::from_secs(2));
        lapd = Vnatd::start(&lap, dl.path());
    }
    std::thread::sleep(IDLE_AT_START.saturating_sub(started.elapsed()));
    // Longer than either end's keepalive lets a silent peer live.
    opened.check_no_error("while the laptop was silent");
    accepted.check_no_error("while the laptop was silent");
    let held = rows(&lapd, server_ip);
    assert_eq!(
        count(&held, |r| r["keepalive_held"] == true),
        2,
        "the laptop's vnatd does not hold both keepalives while its address is gone: {held:?}"
    );
    let helped = rows(&srvd, laptop_ip);
    assert_eq!(
        count(&helped, |r| r["helping"]
            .as_array()
            .is_some_and(|h| h.iter().any(|n| n == "zero-window"))),
        2,
        "the server's vnatd does not answer for the silent laptop: {helped:?}"
    );
    // Both ends write at once and then every WRITE_EVERY until the
    // network is back: at least 10 s of data waiting while offline.
    loop {
        opened.send(LINES);
        accepted.send(LINES);
        sent += LINES;
        let left = outage.saturating_sub(started.elapsed());
        if left.is_zero() {
            break;
        }
        std::thread::sleep(left.min(WRITE_EVERY));
    }
    eprintln!(
        "outage: {:.0} s without network, {sent} lines written by each end",
        started.elapsed().as_secs_f64()
    );

    // Back, on another network.
    topo.plug_laptop_b();
    topo.laptop
        .default_route(topo.router_b_addr.v4.into(), &topo.laptop_if_b);
    opened.wait_delivered(sent, Duration::from_secs(30));
    accepted.wait_delivered(sent, Duration::from_secs(30));
    // The holds end once the connections work again: keepalive on again,
    // nobody answers for the laptop any more.
    wait_until(
        Duration::from_secs(10),
        || {
            count(&rows(&lapd, server_ip), |r| r["keepalive_held"] == true) == 0
                && count(&rows(&srvd, laptop_ip), |r| {
                    r["helping"].as_array().is_some_and(|h| !h.is_empty())
                }) == 0
        },
        || {
            format!(
                "holds left once the connections work: laptop {:?}, server {:?}",
                rows(&lapd, server_ip),
                rows(&srvd, laptop_ip)
            )
        },
    );
    // And the connections go on after it.
    opened.send(LINES);
    accepted.send(LINES);
    sent += LINES;
    opened.wait_delivered(sent, Duration::from_secs(10));
    accepted.wait_delivered(sent, Duration::from_secs(10));
    opened.wait_as_set(Duration::from_secs(10));
    accepted.wait_as_set(Duration::from_secs(10));
}
