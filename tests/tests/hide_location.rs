//! Hide location (issue 18, item 2; paper section 3.4.1): an FTP client
//! keeps its control connection to a real vsftpd (Debian's package, with
//! Debian's default configuration; only the port and anonymous access are
//! set on its command line) across the laptop's move, and fetches another
//! file over a new data connection afterwards.
//!
//! vsftpd refuses a data connection that does not come from the control
//! connection's peer address ("425 Security: Bad IP connecting.") and a
//! PORT/EPRT naming another address. The control connection keeps the
//! laptop's virtual address; new data connections come from where the
//! laptop is now. With `enable --hide-location` on the server's cgroup,
//! vsftpd is shown the laptop's virtual address for them (passive mode).
//! Without it, passive mode fails as it does without vnat. Active mode
//! after the move fails even with it on both hosts: vsftpd's connect goes
//! to a port of the old address that the laptop never held there (issue
//! 31, item 4).

use std::{
    fs,
    io::{BufRead, BufReader, Write},
    net::{IpAddr, SocketAddr},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{killpg, Signal},
    unistd::Pid,
};
use vnat_tests::{Host, LaptopAndServer, LaptopRouterServer, ProcessGroup, TempDir, Vnatd};

const FTP_PORT: u16 = 2121;

/// vsftpd with Debian's /etc/vsftpd.conf, anonymous read access to `root`,
/// in `srv`'s namespace and cgroup; waits until it listens.
fn vsftpd(srv: &Host, root: &Path, log: &Path) -> ProcessGroup {
    fs::create_dir_all("/var/run/vsftpd/empty").expect("creating vsftpd's secure_chroot_dir");
    assert!(
        Path::new("/etc/vsftpd.conf").exists(),
        "vsftpd is not installed (cargo xtask prereq installs it)"
    );
    let mut cmd = srv.command("vsftpd");
    cmd.arg("/etc/vsftpd.conf")
        .arg(format!("-olisten_port={FTP_PORT}"))
        .arg("-oanonymous_enable=YES")
        .arg(format!("-oanon_root={}", root.display()))
        .arg(format!("-ovsftpd_log_file={}", log.display()))
        .arg("-obackground=NO")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let server = ProcessGroup::spawn(cmd, "vsftpd");
    let deadline = Instant::now() + Duration::from_secs(10);
    let filter = format!("sport = :{FTP_PORT}");
    loop {
        let out = srv.ns.try_run(&["ss", "-H", "-ltn", &filter]);
        if out.status.success() && !out.stdout.iter().all(u8::is_ascii_whitespace) {
            return server;
        }
        assert!(Instant::now() < deadline, "vsftpd is not listening");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An interactive `ftp` (tnftp) in the laptop's cgroup, driven through
/// its stdin; everything it prints is collected.
struct Ftp {
    child: Child,
    stdin: ChildStdin,
    out: Arc<Mutex<String>>,
}

impl Ftp {
    fn start(lap: &Host, server: IpAddr, active: bool) -> Ftp {
        let mut cmd = lap.command("sh");
        cmd.arg("-c")
            .arg(format!(
                "exec tnftp -n -v {} {server} {FTP_PORT} 2>&1",
                if active { "-A" } else { "-p" }
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0);
        let mut child = cmd.spawn().expect("starting ftp");
        let stdin = child.stdin.take().expect("ftp's stdin");
        let stdout = child.stdout.take().expect("ftp's stdout");
        let out = Arc::new(Mutex::new(String::new()));
        let sink = out.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let mut o = sink.lock().unwrap();
                o.push_str(&line);
                o.push('\n');
            }
        });
        let mut ftp = Ftp { child, stdin, out };
        if let Err(line) = ftp.ask("user anonymous vnat@", &["230 "], &["530 "], "login") {
            panic!("vsftpd refused the anonymous login: {line}");
        }
        ftp.send("binary");
        ftp
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").expect("writing to ftp");
        self.stdin.flush().expect("writing to ftp");
    }

    fn output(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    /// Send `line`, then wait until what ftp printed since (the answer may
    /// be there before we look) shows one of `good` (Ok, the line) or of
    /// `bad` (Err, the line), at most 30 s.
    fn ask(
        &mut self,
        line: &str,
        good: &[&str],
        bad: &[&str],
        what: &str,
    ) -> Result<String, String> {
        let from = self.output().len();
        self.send(line);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let all = self.output();
            for line in all[from..].lines() {
                if good.iter().any(|g| line.starts_with(g)) {
                    return Ok(line.to_string());
                }
                if bad.iter().any(|b| line.starts_with(b)) {
                    return Err(line.to_string());
                }
            }
            assert!(
                Instant::now() < deadline,
                "{what}: no answer from ftp after 30 s; it printed:\n{all}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `get NAME LOCAL`: Ok once "226 Transfer complete", Err with the
    /// failure vsftpd or ftp reported.
    fn get(&mut self, name: &str, local: &Path) -> Result<String, String> {
        let _ = fs::remove_file(local);
        self.ask(
            &format!("get {name} {}", local.display()),
            &["226 "],
            &["425 ", "426 ", "500 ", "501 ", "550 ", "ftp: "],
            &format!("get {name}"),
        )
    }
}

impl Drop for Ftp {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

struct Setup<'a> {
    topo: &'a LaptopRouterServer,
    lap: Host<'a>,
    _srv: Host<'a>,
    lapd: Vnatd,
    srvd: Vnatd,
    root: PathBuf,
    _dirs: (TempDir, TempDir, TempDir),
    _vsftpd: ProcessGroup,
}

/// Both vnatds, the files to fetch, vsftpd; hide location turned on for
/// the server's cgroup and, if `laptop_hides`, for the laptop's.
fn setup<'a>(
    topo: &'a LaptopRouterServer,
    tag: &str,
    server_hides: bool,
    laptop_hides: bool,
) -> Setup<'a> {
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (ldir, sdir, fdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
        TempDir::new(&format!("{tag}f")),
    );
    // vsftpd refuses an anonymous root that its unprivileged user can write.
    let root = fdir.path().join("pub");
    fs::create_dir_all(&root).unwrap();
    for (name, size) in [("before", 200_000), ("after", 300_000), ("again", 100_000)] {
        let body: Vec<u8> = (0..size).map(|i| (i * 7 + size) as u8).collect();
        fs::write(root.join(name), body).unwrap();
    }
    use std::os::unix::fs::PermissionsExt;
    for d in [fdir.path(), root.as_path()] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o755)).unwrap();
    }
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());
    for (d, host, on) in [(&srvd, &srv, server_hides), (&lapd, &lap, laptop_hides)] {
        if on {
            let cg = host.cgroup.path().display().to_string();
            let r = d
                .ctl(&["enable", "--cgroup", &cg, "--hide-location"])
                .expect("vnatctl enable --hide-location failed");
            assert_eq!(r["hide_location"], true, "{r}");
        }
    }
    let vsftpd = vsftpd(&srv, &root, &fdir.path().join("vsftpd.log"));
    Setup {
        topo,
        lap,
        _srv: srv,
        lapd,
        srvd,
        root,
        _dirs: (ldir, sdir, fdir),
        _vsftpd: vsftpd,
    }
}

/// Log in, fetch a file, move the laptop to subnet B once the control
/// connection is mobile on both ends and the server shows it moved; then
/// fetch another file over a new data connection. Returns that fetch's
/// outcome and the ftp client, still logged in.
fn fetch_across_a_move(s: &Setup, active: bool, v6: bool) -> (Result<String, String>, Ftp) {
    let pick = |d: &vnat_tests::harness::Dual| -> IpAddr {
        if v6 {
            d.v6().into()
        } else {
            d.v4.into()
        }
    };
    let server = pick(&s.topo.server_addr);
    let mut ftp = Ftp::start(&s.lap, server, active);
    let got = s.lap.ns.name().to_string();
    let local = std::env::temp_dir().join(format!("vnat-hide-{got}"));
    let first = ftp.get("before", &local);
    assert!(
        first.is_ok(),
        "the fetch before the move failed: {first:?}\n{}",
        ftp.output()
    );
    assert_eq!(
        fs::read(&local).unwrap(),
        fs::read(s.root.join("before")).unwrap()
    );
    s.lapd.wait_paired("the laptop's vnatd");
    s.srvd.wait_paired("the server's vnatd");
    s.lapd.wait_mobile_to("tcp", server);
    s.srvd.wait_mobile_to("tcp", pick(&s.topo.laptop_a_addr));
    s.topo.move_laptop_to_b();
    let b = pick(&s.topo.laptop_b_addr);
    // The control connection, as the server has it, now comes from B, and
    // the server validated B (only then are the laptop's new connections
    // shown from A).
    let control = s.srvd.wait_peer_moved_to("tcp", b);
    assert!(
        control["virtual_local"]
            .as_str()
            .is_some_and(|l| l.ends_with(&format!(":{FTP_PORT}"))),
        "the peer's move the server shows is not the control connection's: {control}"
    );
    let after = ftp.get("after", &local);
    if after.is_ok() {
        assert_eq!(
            fs::read(&local).unwrap(),
            fs::read(s.root.join("after")).unwrap(),
            "the file fetched after the move differs"
        );
    }
    (after, ftp)
}

#[test]
fn passive_ftp_fetches_after_the_client_moved_with_hide_location() {
    let topo = LaptopRouterServer::builder().tag("hlp").build();
    let s = setup(&topo, "hlp", true, false);
    let (after, mut ftp) = fetch_across_a_move(&s, false, false);
    assert!(
        after.is_ok(),
        "passive mode after the move failed with hide location on: {after:?}\n{}",
        ftp.output()
    );
    // And again: the control connection still works, each new data
    // connection is shown from the virtual address.
    let local = std::env::temp_dir().join("vnat-hide-again-p");
    let again = ftp.get("again", &local);
    assert!(again.is_ok(), "{again:?}\n{}", ftp.output());
    assert_eq!(
        fs::read(&local).unwrap(),
        fs::read(s.root.join("again")).unwrap()
    );
    // The server's listing says which connections hide location.
    let ls = s.srvd.ctl(&["ls", "--proto", "tcp"]).expect("ls");
    let rows = ls.as_array().expect("rows");
    let control = rows
        .iter()
        .find(|r| {
            r["virtual_local"]
                .as_str()
                .is_some_and(|l| l.ends_with(":2121"))
        })
        .expect("the control connection is listed");
    assert_eq!(control["hide_location"], true, "{control}");
    let st = s.srvd.ctl(&["status"]).expect("status");
    assert!(
        st["datapath"]["counters"]["hide_shown"].as_u64() >= Some(2),
        "vsftpd was not shown the virtual address: {}",
        st["datapath"]["counters"]
    );
    ftp.send("quit");
}

#[test]
fn passive_ftp_over_ipv6_fetches_after_the_client_moved_with_hide_location() {
    let topo = LaptopRouterServer::builder().tag("hl6").ipv6(true).build();
    let s = setup(&topo, "hl6", true, false);
    let (after, mut ftp) = fetch_across_a_move(&s, false, true);
    assert!(
        after.is_ok(),
        "passive mode over IPv6 after the move failed with hide location on: {after:?}\n{}",
        ftp.output()
    );
    ftp.send("quit");
}

#[test]
fn passive_ftp_fails_after_the_client_moved_without_hide_location() {
    let topo = LaptopRouterServer::builder().tag("hln").build();
    let s = setup(&topo, "hln", false, false);
    let (after, ftp) = fetch_across_a_move(&s, false, false);
    match after {
        Err(line) => assert!(
            line.starts_with("425 Security: Bad IP connecting"),
            "passive mode failed otherwise than vsftpd's address check: {line}\n{}",
            ftp.output()
        ),
        Ok(line) => panic!(
            "passive mode worked without hide location ({line}): the test no longer shows what the option is for"
        ),
    }
}

/// Active mode after the move: the laptop's data listener is bound where
/// the laptop is and announced (EPRT) at its old address, and vsftpd
/// connects there. That endpoint is not one the laptop held at its old
/// address (no connection of it was seen there), and the old address may
/// be another host's by now (issue 31, item 4): the server does not
/// redirect it, and the data connection fails as it does without vnat.
/// Before the move, active mode works; passive mode works after it.
#[test]
fn active_ftp_after_the_client_moved_is_not_redirected_to_an_endpoint_it_never_held() {
    let topo = LaptopRouterServer::builder().tag("hla").build();
    let s = setup(&topo, "hla", true, true);
    let (after, mut ftp) = fetch_across_a_move(&s, true, false);
    match after {
        Err(line) => assert!(
            line.starts_with("425 ") || line.starts_with("ftp: "),
            "active mode failed otherwise than by the data connection: {line}\n{}",
            ftp.output()
        ),
        Ok(line) => panic!(
            "active mode worked after the move ({line}): the server reached an endpoint the laptop never held at its old address"
        ),
    }
    let redirected = |d: &Vnatd| {
        d.ctl(&["status"]).expect("status")["datapath"]["counters"]["hide_redirected"]
            .as_u64()
            .unwrap_or(0)
    };
    // The laptop still binds its listener where it is (its own address).
    assert!(redirected(&s.lapd) >= 1, "the laptop rebound nothing");
    assert_eq!(redirected(&s.srvd), 0, "the server redirected a connection");
    ftp.send("quit");
}

/// A UDP echo in Python on one unconnected socket, which writes the
/// source recvfrom() gave for each datagram to `log` and answers there.
const UDP_ECHO: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
log = open(sys.argv[3], "a", buffering=1)
while True:
    data, src = s.recvfrom(2048)
    log.write("%s:%d\n" % src)
    s.sendto(b"echo:" + data, src)
"#;

/// A new UDP socket that sends one datagram and prints the answer
/// (retrying for 5 s); exits 1 without one.
const UDP_PROBE: &str = r#"
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(0.5)
for _ in range(10):
    s.sendto(b"probe", (sys.argv[1], int(sys.argv[2])))
    try:
        print(s.recv(2048).decode(), s.getsockname()[1])
        sys.exit(0)
    except socket.timeout:
        pass
sys.exit(1)
"#;

/// A long-lived UDP flow: a connected socket that sends every 200 ms and
/// reads the echoes, so that the laptop has a moved flow with the server.
const UDP_SESSION: &str = r#"
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((sys.argv[1], int(sys.argv[2])))
s.setblocking(False)
while True:
    try:
        s.send(b"session")
    except OSError:
        pass
    time.sleep(0.2)
    try:
        while s.recv(2048):
            pass
    except OSError:
        pass
"#;

/// The laptop's [`UDP_SESSION`] with the server's [`UDP_ECHO`] (which logs
/// the sources it sees to `log`), hide location turned on for the
/// server's cgroup, moved from subnet A to B; returned once the server has
/// the session's flow at B.
struct MovedUdpSession<'a> {
    // Dropped in this order: the processes and vnatds before their hosts.
    _session: ProcessGroup,
    _echo: ProcessGroup,
    srvd: Vnatd,
    _lapd: Vnatd,
    h: LaptopAndServer<'a>,
    /// The server's cgroup, as `vnatctl enable --cgroup` takes it.
    cg: String,
    log: PathBuf,
    server: IpAddr,
    /// The laptop's addresses on subnets A and B.
    a: IpAddr,
    b: IpAddr,
}

impl<'a> MovedUdpSession<'a> {
    fn start(topo: &'a LaptopRouterServer, tag: &str) -> MovedUdpSession<'a> {
        let h = LaptopAndServer::new(topo, tag);
        let lapd = Vnatd::start(&h.lap, h.lap_dir.path());
        let srvd = Vnatd::start(&h.srv, h.srv_dir.path());
        let cg = h.srv.cgroup.path().display().to_string();
        srvd.ctl(&["enable", "--cgroup", &cg, "--hide-location"])
            .expect("enable --hide-location");
        let server: IpAddr = topo.server_addr.v4.into();
        let (a, b): (IpAddr, IpAddr) = (topo.laptop_a_addr.v4.into(), topo.laptop_b_addr.v4.into());
        let log = h.work.path().join("sources");
        let mut echo = h.srv.command("python3");
        echo.args(["-c", UDP_ECHO, &server.to_string(), "5300"])
            .arg(&log)
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let echo = ProcessGroup::spawn(echo, "the UDP echo");
        let mut session = h.lap.command("python3");
        session
            .args(["-c", UDP_SESSION, &server.to_string(), "5300"])
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        let session = ProcessGroup::spawn(session, "the UDP session");
        lapd.wait_mobile_to("udp", server);
        srvd.wait_mobile_to("udp", a);
        topo.move_laptop_to_b();
        // The server has the session's flow at B, validated.
        srvd.wait_peer_moved_to("udp", b);
        MovedUdpSession {
            _session: session,
            _echo: echo,
            srvd,
            _lapd: lapd,
            h,
            cg,
            log,
            server,
            a,
            b,
        }
    }
}

#[test]
fn a_udp_server_sees_new_datagrams_of_the_moved_laptop_from_its_old_address() {
    let topo = LaptopRouterServer::builder().tag("hlu").build();
    let s = MovedUdpSession::start(&topo, "hlu");
    let (server, a, b, srvd) = (s.server, s.a, s.b, &s.srvd);
    let probe = |what: &str| -> String {
        let out =
            s.h.lap
                .command("python3")
                .args(["-c", UDP_PROBE, &server.to_string(), "5300"])
                .output()
                .expect("running the UDP probe");
        assert!(
            out.status.success(),
            "{what}: the new socket got no answer: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let said = String::from_utf8_lossy(&out.stdout).to_string();
        let port = match said.split_whitespace().collect::<Vec<_>>()[..] {
            ["echo:probe", port] => port.to_string(),
            _ => panic!("{what}: the probe printed {said:?}"),
        };
        // The source the server logged for the probe's port (the session
        // is logged too, from another port).
        let sources = fs::read_to_string(&s.log).expect("the echo's log");
        sources
            .lines()
            .rfind(|l| l.ends_with(&format!(":{port}")))
            .unwrap_or_else(|| {
                panic!("{what}: the server logged no source with port {port}:\n{sources}")
            })
            .to_string()
    };
    let counter = |name: &str| {
        srvd.ctl(&["status"]).expect("status")["datapath"]["counters"][name]
            .as_u64()
            .unwrap_or(0)
    };
    // A new socket on the laptop, after the move: recvfrom() shows the
    // server the laptop's old address, and its answer to that address
    // reaches the laptop where it is.
    let (shown, redirected) = (counter("hide_shown"), counter("hide_redirected"));
    let seen = probe("with hide location");
    let seen: SocketAddr = seen.parse().expect("ip:port");
    assert_eq!(seen.ip(), a, "recvfrom() did not show the old address");
    assert!(counter("hide_shown") > shown, "nothing was shown");
    assert!(
        counter("hide_redirected") > redirected,
        "the answer to the old address was not redirected"
    );
    // Turned off: the server sees the truth again.
    srvd.ctl(&["enable", "--cgroup", &s.cg, "--no-hide-location"])
        .expect("enable --no-hide-location");
    let seen: SocketAddr = probe("without hide location").parse().expect("ip:port");
    assert_eq!(
        seen.ip(),
        b,
        "without hide location the true source is shown"
    );
}

/// Issue 31, item 4: what a hiding application reaches at a moved peer's
/// old address is only what the peer held there. Once the laptop left A,
/// another host may answer at A (A passed on by DHCP, or a NAT's address
/// that other hosts share, which a peer can name as its own): here the
/// router takes A and serves port 7000, and the laptop listens on 7000
/// too. A new connection from the server's hiding cgroup to A:7000, an
/// endpoint the laptop never held, reaches the router; the laptop's own
/// flow's endpoint at A still reaches the laptop.
#[test]
fn a_hiding_application_reaches_at_the_old_address_only_what_the_moved_peer_held() {
    let topo = LaptopRouterServer::builder().tag("hlh").build();
    let s = MovedUdpSession::start(&topo, "hlh");
    let a = s.a;
    // Another host answers at A now; the laptop serves the same port.
    topo.router
        .run(&["ip", "addr", "add", &format!("{a}/32"), "dev", "lo"]);
    let banner = |ns: &vnat_tests::Netns, bind: &str, text: &str| {
        let mut cmd = ns.cmd("socat");
        cmd.arg(format!("TCP-LISTEN:7000,bind={bind},reuseaddr,fork"))
            .arg(format!("SYSTEM:echo {text}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        ProcessGroup::spawn(cmd, "a banner service")
    };
    let _router_service = banner(&topo.router, &a.to_string(), "router");
    let _laptop_service = banner(&topo.laptop, "0.0.0.0", "laptop");
    topo.router.wait_tcp_listening(7000);
    topo.laptop.wait_tcp_listening(7000);
    let fetch = || -> String {
        let out =
            s.h.srv
                .command("python3")
                .args([
                    "-c",
                    "import socket, sys\n\
                 s = socket.create_connection((sys.argv[1], 7000), timeout=5)\n\
                 print(s.recv(100).decode().strip())",
                    &a.to_string(),
                ])
                .output()
                .expect("running the client");
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout).trim(),
            if out.status.success() {
                String::new()
            } else {
                format!(" (failed: {})", String::from_utf8_lossy(&out.stderr).trim())
            }
        )
    };
    assert_eq!(
        fetch(),
        "router",
        "a hiding application's new connection to {a}:7000, which the moved laptop never held, was sent to the laptop"
    );
    let _ = topo
        .router
        .try_run(&["ip", "addr", "del", &format!("{a}/32"), "dev", "lo"]);
}
