//! The CRIU migration scenario, shared by `tests/tests/criu_migration.rs`
//! (which asserts on what it observed) and `cargo xtask bench criu` (which
//! repeats it): a socat echo server with a live client is dumped by CRIU on
//! one server and restored on another server with a different address,
//! with `vnatctl criu-hook` as the action script on both sides.
use std::{
    net::SocketAddr,
    os::unix::{fs::PermissionsExt as _, process::CommandExt as _},
    process::Stdio,
    time::{Duration, Instant},
};

use super::{
    add_location_host, criu_lock_tables, kill_and_reap, remove_criu_lock_tables, tcp_ext_counter,
    tcp_info, write_criu_hook, Criu, Host, LaptopRouterServer, StreamClient, StreamOptions,
    TempDir, Vnatd,
};

/// What one migration showed, from the client's side and the hosts'.
#[derive(Clone, Debug)]
pub struct CriuMove {
    /// Wall time of `criu dump` (the hook's export included).
    pub dump: Duration,
    /// Wall time of `criu restore` (the hook's import included).
    pub restore: Duration,
    /// The client's longest wait for an echo over the whole stream: the
    /// freeze as the client saw it (the stream is steady before and after).
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

/// Run the scenario once on fresh hosts tagged `tag`. The caller must be a
/// child subreaper ([`super::become_child_subreaper`]): the restored socat
/// is reparented to it. Panics when a step cannot be done (CRIU fails, the
/// stream does not resume within 30 s), saying which.
pub fn move_echo_server_with_criu(criu: &Criu, tag: &str) -> CriuMove {
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let new_host = add_location_host(&topo, tag);
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let s1 = Host::new(&topo.server, &format!("{tag}1"));
    let s2 = Host::new(&new_host.ns, &format!("{tag}2"));
    let (dl, d1, d2, work) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}1")),
        TempDir::new(&format!("{tag}2")),
        TempDir::new(&format!("{tag}w")),
    );
    let lapd = Vnatd::start(&lap, dl.path());
    let s1d = Vnatd::start(&s1, d1.path());
    let s2d = Vnatd::start(&s2, d2.path());
    let (s1_key, s2_key) = (host_key(&s1d), host_key(&s2d));

    // The server: socat echoing one TCP connection, in the first server's
    // namespace and vnatd's cgroup, in a session of its own with no
    // terminal (CRIU then needs no --shell-job).
    let server = SocketAddr::new(topo.server_addr.v4.into(), 7100);
    let mut socat = s1.command("socat");
    socat
        .arg(format!(
            "TCP-LISTEN:{},bind={},reuseaddr",
            server.port(),
            server.ip()
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
    let mut socat = socat.spawn().expect("starting socat");
    let socat_pid = socat.id();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !topo
        .server
        .run_stdout(&["ss", "-Hltn", &format!("sport = :{}", server.port())])
        .contains("LISTEN")
    {
        assert!(Instant::now() < deadline, "socat never listened");
        std::thread::sleep(Duration::from_millis(20));
    }

    let mut cmd = StreamOptions::tcp(server)
        .rate(200_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(50_000, Duration::from_secs(10));
    wait_mobile(&s1d, "first server");
    wait_mobile(&lapd, "client");
    let client_addr: SocketAddr = before.local.parse().expect("client's local address");
    let info_before = tcp_info(&topo.laptop, client_addr, server).expect("client socket");
    let rtos_before = tcp_ext_counter(&topo.laptop, "TCPTimeouts");

    // Dump on the first server; the hook seals the connections for the
    // second server's key into the images.
    let images = work.path().join("images");
    std::fs::create_dir(&images).expect("creating the images directory");
    let hook = write_criu_hook(work.path());
    let control1 = s1d.control.to_str().unwrap().to_string();
    let dump = criu.dump(
        &topo.server,
        socat_pid,
        &images,
        &hook,
        &[("VNAT_CONTROL", &control1), ("VNAT_CRIU_TO", &s2_key)],
    );
    let at_dump = client.latest().expect("status").verified;
    // CRIU killed the dumped socat (its socket, in repair mode, closed
    // without a word to the client); reap it so its pid is free to restore.
    socat.wait().expect("reaping the dumped socat");
    let export_mode = std::fs::metadata(images.join("vnat-connections.json"))
        .map_or(0, |m| m.permissions().mode() & 0o7777);
    let lock_left_on_old_host = !criu_lock_tables(&topo.server).is_empty();

    // Restore on the second server, in its vnatd's cgroup; the hook
    // imports the connections first (checked against the first server's key).
    let control2 = s2d.control.to_str().unwrap().to_string();
    let (restore, restored_pid) = criu.restore(
        &s2,
        &images,
        &hook,
        &[("VNAT_CONTROL", &control2), ("VNAT_CRIU_FROM", &s1_key)],
    );
    let after = client.wait_verified_at_least(at_dump + 100_000, Duration::from_secs(30));
    let info_after = tcp_info(&topo.laptop, client_addr, server).unwrap_or_default();
    let client_rtos = tcp_ext_counter(&topo.laptop, "TCPTimeouts") - rtos_before;

    let new_server = SocketAddr::new(new_host.addr.v4.into(), server.port());
    let client_sends_to = lapd.ctl(&["ls"]).and_then(|ls| {
        ls.as_array()?
            .iter()
            .find(|r| r["virtual_remote"] == server.to_string())
            .and_then(|r| r["physical_remote"].as_str().map(str::to_string))
    });
    let restored_on_new_host = tcp_info(&new_host.ns, server, client_addr).is_some();
    let fin = client.stop();
    kill_and_reap(restored_pid);
    remove_criu_lock_tables(&topo.server);
    CriuMove {
        dump,
        restore,
        max_gap_ms: fin.max_gap_ms,
        client_rtos,
        client_retransmitted: info_after
            .total_retrans
            .saturating_sub(info_before.total_retrans),
        export_mode,
        lock_left_on_old_host,
        server,
        new_server,
        client_sends_to,
        restored_on_new_host,
        socket_before: before.local,
        socket_after: fin.local,
        verified_after_dump: after.verified - at_dump,
        stream_error: fin.error,
    }
}
