//! A real server process moves to another host with real CRIU: a socat
//! echo server with a live client is dumped on the first server (`criu
//! dump --tcp-established --network-lock nftables`) and restored on a
//! second server with a different address (`criu restore`), with `vnatctl
//! criu-hook` as CRIU's action script on both sides: at post-dump it
//! exports the dumped process's connections, sealed for the second server,
//! into the images; at pre-restore it imports them there, which puts the
//! old address in place for the restored socket to bind to. The client's
//! connection carries on: same socket, byte-exact, no reset, now
//! translated to the second server's address.
//!
//! It prints what a user would want to know about the freeze: the dump's
//! and the restore's wall times, the longest time the client saw no echo,
//! and the client's retransmissions during it. `cargo xtask bench criu`
//! repeats it for medians.
//!
//! Skipped, saying why, only where no CRIU of 4.2 or later passes `criu
//! check` (`cargo xtask prereq` installs one into /opt/vnat-criu).

use std::{
    net::SocketAddr,
    os::unix::process::CommandExt as _,
    process::Stdio,
    time::{Duration, Instant},
};

use vnat_tests::{
    add_location_host, become_child_subreaper, criu_lock_tables, kill_and_reap,
    remove_criu_lock_tables, tcp_ext_counter, tcp_info, write_criu_hook, Criu, Host,
    LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

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

fn host_key(d: &Vnatd) -> String {
    d.ctl(&["status"]).expect("vnatd unreachable")["vcmp"]["host_key"]
        .as_str()
        .expect("status shows the host key")
        .to_string()
}

#[test]
fn server_process_migrates_to_another_host_with_criu() {
    let criu = match Criu::find() {
        Ok(c) => c,
        Err(why) => {
            eprintln!("SKIPPED criu_migration: {why}");
            return;
        }
    };
    eprintln!(
        "criu_migration: using CRIU {} at {}",
        criu.version,
        criu.path.display()
    );
    // The restored socat is left to us by `criu restore -d`: reap it here,
    // not by PID 1, so that its pid is free as soon as it is killed.
    become_child_subreaper();

    let topo = LaptopRouterServer::builder().tag("crmig").build();
    let new_host = add_location_host(&topo, "crmig");
    let lap = Host::new(&topo.laptop, "crmigl");
    let s1 = Host::new(&topo.server, "crmig1");
    let s2 = Host::new(&new_host.ns, "crmig2");
    let (dl, d1, d2, work) = (
        TempDir::new("crmigl"),
        TempDir::new("crmig1"),
        TempDir::new("crmig2"),
        TempDir::new("crmigw"),
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
        .args([
            &format!(
                "TCP-LISTEN:{},bind={},reuseaddr",
                server.port(),
                server.ip()
            ),
            "PIPE",
        ])
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
    let timeouts_before = tcp_ext_counter(&topo.laptop, "TCPTimeouts");

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
    let export = images.join("vnat-connections.json");
    let meta = std::fs::metadata(&export).expect("the hook wrote the export into the images");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o777,
        0o600,
        "the export holds keys: mode 0600"
    );
    // What keeps the first server's kernel from resetting the client's
    // packets until they go to the second server: CRIU's lock, left behind.
    assert!(
        !criu_lock_tables(&topo.server).is_empty(),
        "CRIU left no network lock on the first server"
    );

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
    let info_after = tcp_info(&topo.laptop, client_addr, server)
        .expect("the client's socket is still established");
    let timeouts = tcp_ext_counter(&topo.laptop, "TCPTimeouts") - timeouts_before;

    let ls = lapd
        .ctl(&["ls", "--state", "translated"])
        .expect("client vnatd unreachable");
    let new_server = SocketAddr::new(new_host.addr.v4.into(), server.port());
    assert!(
        ls.as_array()
            .unwrap()
            .iter()
            .any(|r| r["virtual_remote"] == server.to_string()
                && r["physical_remote"] == new_server.to_string()),
        "the client does not translate to the new server host: {ls}"
    );
    assert!(
        tcp_info(&new_host.ns, server, client_addr).is_some(),
        "the restored socket {server} -> {client_addr} is not established on the second server"
    );
    let fin = client.stop();
    eprintln!(
        "criu_migration: dump {:.0} ms, restore {:.0} ms, client's longest wait for an echo {} ms, \
         client retransmission timeouts {timeouts}, segments retransmitted {} (rto now {} ms)",
        dump.as_secs_f64() * 1000.0,
        restore.as_secs_f64() * 1000.0,
        fin.max_gap_ms,
        info_after.total_retrans - info_before.total_retrans,
        info_after.rto_ms,
    );
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= after.verified);

    kill_and_reap(restored_pid);
    remove_criu_lock_tables(&topo.server);
}
