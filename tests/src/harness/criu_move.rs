//! The CRIU migration scenario, shared by `tests/tests/criu_migration.rs`
//! (which asserts on what it observed) and `cargo xtask bench criu` (which
//! repeats it): a socat echo server with a live client is dumped by CRIU on
//! one server and restored on another server with a different address,
//! with `vnatctl criu-hook` as the action script on both sides.
use std::{
    net::{IpAddr, SocketAddr},
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use super::{
    add_location_host, criu_lock_tables, kill_and_reap, remove_criu_lock_tables, tcp_ext_counter,
    tcp_info, write_criu_hook, Criu, Host, LaptopRouterServer, LocationHost, Netns, StreamClient,
    StreamOptions, StreamStatus, TempDir, Vnatd,
};

/// What a migration moves and how.
#[derive(Clone, Copy, Debug)]
pub struct CriuMoveOptions {
    /// The connection over IPv6 (the hosts have both families).
    pub ipv6: bool,
    /// A UDP echo (socat's connected UDP socket) instead of TCP.
    pub udp: bool,
    /// Carry the images from the first server to the second over the
    /// network (tar through a TCP connection between the two namespaces)
    /// between the dump and the restore, inside the freeze; otherwise the
    /// restore reads the dump's directory.
    pub transfer: bool,
    /// The hook's `VNAT_CRIU_UNLOCK_AFTER` (seconds; 0 keeps CRIU's lock).
    pub unlock_after_secs: u64,
}

impl Default for CriuMoveOptions {
    fn default() -> Self {
        CriuMoveOptions {
            ipv6: false,
            udp: false,
            transfer: false,
            unlock_after_secs: 2,
        }
    }
}

/// What one migration showed, from the client's side and the hosts'.
#[derive(Clone, Debug)]
pub struct CriuMove {
    /// Wall time of `criu dump` (the hook's export included).
    pub dump: Duration,
    /// Wall time of `criu restore` (the hook's import included).
    pub restore: Duration,
    /// Wall time of carrying the images over the network (zero without
    /// `transfer`), and their size in bytes.
    pub transfer: Duration,
    pub image_bytes: u64,
    /// The client's longest wait for an echo, from its start until 100 kB
    /// after the dump were echoed: the freeze as the client saw it (the
    /// stream is steady before and after).
    pub max_gap_ms: u64,
    /// The client namespace's retransmission timeouts during the migration
    /// (TcpExt TCPTimeouts; the client socket is its only TCP socket).
    pub client_rtos: u64,
    /// Segments the client retransmitted during it (tcpi_total_retrans).
    pub client_retransmitted: u64,
    /// Permissions of the export the hook wrote into the images.
    pub export_mode: u32,
    /// CRIU's lock table was still on the old host after the dump.
    pub lock_left_on_old_host: bool,
    /// CRIU's lock tables still on the old host `unlock_after_secs` + 2 s
    /// after the dump (the hook's remover should have deleted them).
    pub lock_tables_later: Vec<String>,
    /// The server's address and port before the move (what the client's
    /// socket is connected to) and the new server's.
    pub server: SocketAddr,
    pub new_server: SocketAddr,
    /// Where the client's vnatd sends the connection's packets afterwards.
    pub client_sends_to: Option<String>,
    /// The restored socket is established on the new server.
    pub restored_on_new_host: bool,
    /// The client's local endpoint before the dump and at the end.
    pub socket_before: String,
    pub socket_after: String,
    /// Bytes verified after the dump (the client waits for 100,000).
    pub verified_after_dump: u64,
    /// The stream's error (a reset, a corrupt byte), if any.
    pub stream_error: Option<String>,
}

fn host_key(d: &Vnatd) -> String {
    d.ctl(&["status"]).expect("vnatd unreachable")["vcmp"]["host_key"]
        .as_str()
        .expect("status shows the host key")
        .to_string()
}

fn wait_mobile(d: &Vnatd, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let ls = d.ctl(&["ls"]).expect("vnatd unreachable");
        if ls
            .as_array()
            .is_some_and(|a| a.iter().any(|r| r["mobile"] == true))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the connection never became mobile: {ls}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The namespaces of a CRIU migration: the laptop, router and first
/// server, and the second server (another address) beside them.
pub struct CriuNet {
    pub new_host: LocationHost,
    pub topo: LaptopRouterServer,
}

impl CriuNet {
    pub fn new(tag: &str, opts: CriuMoveOptions) -> CriuNet {
        let topo = LaptopRouterServer::builder()
            .tag(tag)
            .ipv6(opts.ipv6)
            .build();
        let new_host = add_location_host(&topo, tag);
        CriuNet { new_host, topo }
    }
}

/// The hosts of a CRIU migration on `net`, with a socat echo server on the
/// first server and a live client stream to it, ready to dump. Fields drop
/// in order: the client and the daemons before the hosts.
pub struct CriuScene<'a> {
    pub client: StreamClient,
    /// The client's status once the stream ran and both ends were mobile.
    pub before: StreamStatus,
    /// The socat echo server (the tree to dump) on the first server.
    pub socat: Child,
    pub lapd: Vnatd,
    pub s1d: Vnatd,
    pub s2d: Vnatd,
    pub s1_key: String,
    pub s2_key: String,
    /// The echo server's address on the first server.
    pub server: SocketAddr,
    /// The images directory of the dump, and the action-script wrapper.
    pub images: PathBuf,
    pub hook: PathBuf,
    pub work: TempDir,
    _dirs: [TempDir; 3],
    pub lap: Host<'a>,
    pub s1: Host<'a>,
    pub s2: Host<'a>,
    pub topo: &'a LaptopRouterServer,
    pub new_host: &'a LocationHost,
    pub opts: CriuMoveOptions,
}

impl<'a> CriuScene<'a> {
    /// Hosts tagged `tag` on `net`, the echo server and its client; waits
    /// until the stream runs and the connection is mobile at both ends.
    pub fn new(net: &'a CriuNet, tag: &str, opts: CriuMoveOptions) -> CriuScene<'a> {
        let (topo, new_host) = (&net.topo, &net.new_host);
        let lap = Host::new(&topo.laptop, &format!("{tag}l"));
        let s1 = Host::new(&topo.server, &format!("{tag}1"));
        let s2 = Host::new(&new_host.ns, &format!("{tag}2"));
        let dirs = [
            TempDir::new(&format!("{tag}l")),
            TempDir::new(&format!("{tag}1")),
            TempDir::new(&format!("{tag}2")),
        ];
        let work = TempDir::new(&format!("{tag}w"));
        let lapd = Vnatd::start(&lap, dirs[0].path());
        let s1d = Vnatd::start(&s1, dirs[1].path());
        let s2d = Vnatd::start(&s2, dirs[2].path());
        let (s1_key, s2_key) = (host_key(&s1d), host_key(&s2d));

        // The server: socat echoing one connection, in the first server's
        // namespace and vnatd's cgroup, in a session of its own with no
        // terminal (CRIU then needs no --shell-job). For UDP, socat's
        // UDP-LISTEN connects its socket to the first client.
        let ip: IpAddr = if opts.ipv6 {
            topo.server_addr.v6().into()
        } else {
            topo.server_addr.v4.into()
        };
        let server = SocketAddr::new(ip, 7100);
        let (listen, bind) = match (opts.udp, opts.ipv6) {
            (false, false) => ("TCP-LISTEN", ip.to_string()),
            (false, true) => ("TCP6-LISTEN", format!("[{ip}]")),
            (true, false) => ("UDP-LISTEN", ip.to_string()),
            (true, true) => ("UDP6-LISTEN", format!("[{ip}]")),
        };
        let mut socat = s1.command("socat");
        if opts.udp {
            // As the harness's UDP echo: a child per peer on a socket
            // connected to it, datagrams of the stream's size.
            socat.args(["-T", "600", "-b", &super::UDP_DATAGRAM_SIZE.to_string()]);
        } else {
            // socat writes its PIPE (which only it reads) blocking, once
            // select says the pipe has room: room for a page, not for its
            // default 8 KiB. When a burst came at once (the client's
            // backlog after a hold) socat blocked in that write for good,
            // the socket's window at zero (criu_abort, about 1 run in 5).
            // A page at most always fits.
            socat.args(["-b", "4096"]);
        }
        let fork = if opts.udp { ",fork" } else { "" };
        socat
            .arg(format!(
                "{listen}:{},bind={bind},reuseaddr{fork}",
                server.port()
            ))
            .arg("PIPE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: setsid(2) is async-signal-safe and allocates nothing.
        unsafe {
            socat.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                Ok(())
            });
        }
        let socat = socat.spawn().expect("starting socat");
        let ss = if opts.udp { "-Hlun" } else { "-Hltn" };
        let deadline = Instant::now() + Duration::from_secs(10);
        while topo
            .server
            .run_stdout(&["ss", ss, &format!("sport = :{}", server.port())])
            .trim()
            .is_empty()
        {
            assert!(Instant::now() < deadline, "socat never listened");
            std::thread::sleep(Duration::from_millis(20));
        }

        let stream = if opts.udp {
            StreamOptions::udp(server)
        } else {
            StreamOptions::tcp(server)
        };
        let mut cmd = stream.rate(200_000).command(&topo.laptop);
        lap.cgroup.join_on_spawn(&mut cmd);
        let client = StreamClient::from_command(cmd);
        let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
        wait_mobile(&s1d, "first server");
        wait_mobile(&lapd, "client");
        let images = work.path().join("images");
        std::fs::create_dir(&images).expect("creating the images directory");
        let hook = write_criu_hook(work.path());
        CriuScene {
            client,
            before,
            socat,
            lapd,
            s1d,
            s2d,
            s1_key,
            s2_key,
            server,
            images,
            hook,
            work,
            _dirs: dirs,
            lap,
            s1,
            s2,
            new_host,
            topo,
            opts,
        }
    }

    /// The client's local endpoint.
    pub fn client_addr(&self) -> SocketAddr {
        self.before.local.parse().expect("client's local address")
    }

    /// The environment the dump's hook gets on the first server.
    pub fn dump_env(&self) -> Vec<(String, String)> {
        vec![
            (
                "VNAT_CONTROL".into(),
                self.s1d.control.to_str().unwrap().to_string(),
            ),
            ("VNAT_CRIU_TO".into(), self.s2_key.clone()),
            (
                "VNAT_CRIU_UNLOCK_AFTER".into(),
                self.opts.unlock_after_secs.to_string(),
            ),
        ]
    }

    /// Where the client's vnatd sends the connection's packets now.
    pub fn client_sends_to(&self) -> Option<String> {
        let server = self.server.to_string();
        self.lapd.ctl(&["ls"]).and_then(|ls| {
            ls.as_array()?
                .iter()
                .find(|r| r["virtual_remote"] == server.as_str())
                .and_then(|r| r["physical_remote"].as_str().map(str::to_string))
        })
    }
}

/// Carry `from` (in `src`) to `to` (in `dst`, at `dst_ip`) with tar over
/// one TCP connection, as scp would; returns the wall time.
fn carry_images(src: &Netns, from: &Path, dst: &Netns, dst_ip: IpAddr, to: &Path) -> Duration {
    std::fs::create_dir_all(to).expect("creating the target images directory");
    let port = 7199;
    let listen = match dst_ip {
        IpAddr::V4(a) => format!("TCP-LISTEN:{port},bind={a},reuseaddr"),
        IpAddr::V6(a) => format!("TCP6-LISTEN:{port},bind=[{a}],reuseaddr"),
    };
    let connect = match dst_ip {
        IpAddr::V4(a) => format!("TCP:{a}:{port}"),
        IpAddr::V6(a) => format!("TCP6:[{a}]:{port}"),
    };
    let mut rx = dst
        .cmd("sh")
        .arg("-c")
        .arg(format!(
            "socat -u {listen} STDOUT | tar -x -C '{}'",
            to.display()
        ))
        .stdin(Stdio::null())
        .spawn()
        .expect("starting the images' receiver");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !dst
        .run_stdout(&["ss", "-Hltn", &format!("sport = :{port}")])
        .contains("LISTEN")
    {
        assert!(
            Instant::now() < deadline,
            "the images' receiver never listened"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let start = Instant::now();
    let sent = src
        .cmd("sh")
        .arg("-c")
        .arg(format!(
            "tar -c -C '{}' . | socat -u STDIN {connect}",
            from.display()
        ))
        .stdin(Stdio::null())
        .status()
        .expect("sending the images");
    let got = rx.wait().expect("the images' receiver");
    let took = start.elapsed();
    assert!(
        sent.success() && got.success(),
        "carrying the images failed (sender {sent}, receiver {got})"
    );
    took
}

/// The children of `pid` (all its threads'), from /proc.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Run the scenario once on fresh hosts tagged `tag` with the default
/// options (TCP over IPv4, images in a local directory).
pub fn move_echo_server_with_criu(criu: &Criu, tag: &str) -> CriuMove {
    move_echo_server_with_criu_opts(criu, tag, CriuMoveOptions::default())
}

/// Run the scenario once on fresh hosts tagged `tag`. The caller must be a
/// child subreaper ([`super::become_child_subreaper`]): the restored socat
/// is reparented to it. Panics when a step cannot be done (CRIU fails, the
/// stream does not resume within 30 s), saying which.
pub fn move_echo_server_with_criu_opts(criu: &Criu, tag: &str, opts: CriuMoveOptions) -> CriuMove {
    let net = CriuNet::new(tag, opts);
    let mut sc = CriuScene::new(&net, tag, opts);
    let server = sc.server;
    let client_addr = sc.client_addr();
    let tcp = !opts.udp;
    let info_before = if tcp {
        tcp_info(&sc.topo.laptop, client_addr, server).expect("client socket")
    } else {
        Default::default()
    };
    let rtos_before = tcp_ext_counter(&sc.topo.laptop, "TCPTimeouts");

    // Dump on the first server; the hook seals the connections for the
    // second server's key into the images.
    let env = sc.dump_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    // socat's UDP child per peer: dumped and killed with it, then ours to
    // reap (we are the subreaper), so that its pid is free to restore.
    let children = children_of(sc.socat.id());
    let dumped_at = Instant::now();
    let dump = criu.dump(&sc.topo.server, sc.socat.id(), &sc.images, &sc.hook, &env);
    let at_dump = sc.client.latest().expect("status").verified;
    // CRIU killed the dumped socat (its socket, in repair mode, closed
    // without a word to the client); reap it so its pid is free to restore.
    sc.socat.wait().expect("reaping the dumped socat");
    for c in children {
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(c as i32), None);
    }
    let export_mode = std::fs::metadata(sc.images.join("vnat-connections.json"))
        .map_or(0, |m| m.permissions().mode() & 0o7777);
    let lock_left_on_old_host = !criu_lock_tables(&sc.topo.server).is_empty();

    // The images go to the second server, over the network when asked.
    let (images, transfer) = if opts.transfer {
        let to = sc.work.path().join("images-received");
        let dst_ip: IpAddr = if opts.ipv6 {
            sc.new_host.addr.v6().into()
        } else {
            sc.new_host.addr.v4.into()
        };
        let took = carry_images(&sc.topo.server, &sc.images, &sc.new_host.ns, dst_ip, &to);
        (to, took)
    } else {
        (sc.images.clone(), Duration::ZERO)
    };
    let image_bytes = dir_bytes(&images);

    // Restore on the second server, in its vnatd's cgroup; the hook
    // imports the connections first (checked against the first server's key).
    let control2 = sc.s2d.control.to_str().unwrap().to_string();
    let (restore, restored_pid) = criu.restore(
        &sc.s2,
        &images,
        &sc.hook,
        &[("VNAT_CONTROL", &control2), ("VNAT_CRIU_FROM", &sc.s1_key)],
    );
    let after = sc
        .client
        .wait_verified_at_least(at_dump + 100_000, Duration::from_secs(30));
    let info_after = if tcp {
        tcp_info(&sc.topo.laptop, client_addr, server).unwrap_or_default()
    } else {
        Default::default()
    };
    let client_rtos = tcp_ext_counter(&sc.topo.laptop, "TCPTimeouts") - rtos_before;

    let new_ip: IpAddr = if opts.ipv6 {
        sc.new_host.addr.v6().into()
    } else {
        sc.new_host.addr.v4.into()
    };
    let new_server = SocketAddr::new(new_ip, server.port());
    let client_sends_to = sc.client_sends_to();
    let restored_on_new_host = if tcp {
        tcp_info(&sc.new_host.ns, server, client_addr).is_some()
    } else {
        !sc.new_host
            .ns
            .run_stdout(&["ss", "-Hun", "state", "established"])
            .trim()
            .is_empty()
    };
    // The hook's remover deletes CRIU's lock unlock_after_secs after the
    // export; look a little later.
    let lock_tables_later = if opts.unlock_after_secs > 0 {
        let due = dumped_at + dump + Duration::from_secs(opts.unlock_after_secs + 2);
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        criu_lock_tables(&sc.topo.server)
    } else {
        Vec::new()
    };
    let fin = sc.client.stop_in_place();
    kill_and_reap(restored_pid);
    remove_criu_lock_tables(&sc.topo.server);
    CriuMove {
        dump,
        restore,
        transfer,
        image_bytes,
        // As of 100 kB after the dump: a UDP stream that lost datagrams
        // during the freeze keeps them outstanding for good, so its final
        // figure would also count the second vnat-stream waits for them
        // when it stops.
        max_gap_ms: after.max_gap_ms,
        client_rtos,
        client_retransmitted: info_after
            .total_retrans
            .saturating_sub(info_before.total_retrans),
        export_mode,
        lock_left_on_old_host,
        lock_tables_later,
        server,
        new_server,
        client_sends_to,
        restored_on_new_host,
        socket_before: sc.before.local.clone(),
        socket_after: fin.local,
        verified_after_dump: after.verified - at_dump,
        stream_error: fin.error,
    }
}
