//! One run of the benchmark on fresh hosts (`measure`): topology, daemons,
//! probes, the flood if asked for, the move, and what the logs say.

use super::*;

/// One run on fresh hosts. vnatd's logs are kept as
/// `bench/results/DIAG-{laptop,server}.log`, the capture (if asked for) as
/// `DIAG.pcap`.
pub(super) fn measure(setup: &RunSetup) -> Result<RunResult> {
    let &RunSetup {
        case,
        rtt_ms,
        diag,
        capture,
        standby_tc,
        nodelay_echo,
        flood_pps,
    } = setup;
    let (scenario, both) = (case.scenario, case.movers == Movers::Both);
    let topo = LaptopRouterServer::builder()
        .tag("hov")
        .ipv6(case.v6_only)
        .build();
    let delay = delayline::delay_server_link(&topo, "hovd", Duration::ZERO)?;
    if case.nat {
        ensure!(
            !both,
            "--nat measures the laptop moving alone (--movers one)"
        );
        vnat_tests::nat_router(&topo).map_err(anyhow::Error::msg)?;
    }
    ensure!(
        !(case.v6_only && both),
        "--v6-only measures the laptop moving alone (--movers one)"
    );
    if case.into_nat {
        ensure!(
            !both,
            "--into-nat measures the laptop moving alone (--movers one)"
        );
        vnat_tests::nat_router_b_only(&topo, vnat_tests::NatPorts::FullyRandom)
            .map_err(anyhow::Error::msg)?;
    }
    // Both moving: the server's second link, delayed the same, and the
    // location server's host.
    let link_e = both.then(|| add_server_link_e(&topo));
    let delay_e = match &link_e {
        Some(e) => Some(delayline::delay_server_link_e(
            &topo,
            e,
            &delay.ns,
            Duration::ZERO,
        )?),
        None => None,
    };
    let loc = both.then(|| add_location_host(&topo, "hovx"));
    // Calibration: what the path costs without delay (veths, the router, the
    // line's own forwarding); the line adds the rest, half each way.
    let base = delayline::handshake_rtts(&topo, topo.server_addr.v4.into(), RTT_SAMPLES)?;
    let base_rtt = Summary::of(&base).expect("RTT samples").median;
    let one_way = Duration::from_secs_f64((rtt_ms - base_rtt).max(0.0) / 2000.0);
    delay.line.set_one_way(one_way);
    if let Some(d) = &delay_e {
        d.set_one_way(one_way);
    }
    let lap = Host::new(&topo.laptop, "hovl");
    let srv = Host::new(&topo.server, "hovs");
    let server = SocketAddr::new(topo.server_addr.v4.into(), SERVER_PORT);
    let _echo = EchoServer::tcp_in_with(&srv, server, nodelay_echo);
    let (ldir, sdir, xdir) = (
        TempDir::new("hovl"),
        TempDir::new("hovs"),
        TempDir::new("hovx"),
    );
    // The location server: a vnatd of its own with an empty cgroup (it
    // records nothing; it only answers LOOKUP and STORE).
    // Or, with `--location etcd`, a three-member etcd cluster there, each
    // member on an address of its own (`location_store = "etcd"`).
    let etcd = case.location == Location::Etcd;
    let loc_host = loc
        .as_ref()
        .filter(|_| !etcd)
        .map(|l| Host::new(&l.ns, "hovx"));
    let _locd = match &loc_host {
        Some(h) => Some(Daemon::start(h, xdir.path(), standby_tc)?),
        None => None,
    };
    let _cluster = match loc.as_ref().filter(|_| etcd) {
        Some(l) => {
            let members: [std::net::IpAddr; 3] = [
                l.addr.v4.into(),
                std::net::Ipv4Addr::new(198, 18, 6, 3).into(),
                std::net::Ipv4Addr::new(198, 18, 6, 4).into(),
            ];
            for m in &members[1..] {
                l.ns.add_addr(&l.ns_if, *m, 24);
            }
            Some(vnat_tests::EtcdCluster::start(
                &l.ns,
                members,
                xdir.path(),
                "hov",
            ))
        }
        None => None,
    };
    let extra: Vec<String> = match (&loc, &_cluster) {
        (_, Some(c)) => c.vnatd_flags(),
        (Some(l), None) => vec![
            "--location-server".into(),
            SocketAddr::new(l.addr.v4.into(), VCMP_PORT).to_string(),
        ],
        (None, None) => Vec::new(),
    };
    let lapd = Daemon::start_with(&lap, ldir.path(), standby_tc, &extra)?;
    let srvd = Daemon::start_with(&srv, sdir.path(), standby_tc, &extra)?;
    let _logs = KeepLogs(vec![
        (
            lapd.log.clone(),
            vnat_bench::results_path(&format!("{diag}-laptop")).with_extension("log"),
        ),
        (
            srvd.log.clone(),
            vnat_bench::results_path(&format!("{diag}-server")).with_extension("log"),
        ),
    ]);
    let _capture = vnat_bench::capture::Tcpdump::for_run(capture, &topo.router, diag, SERVER_PORT)?;

    // The self-check of the delay line: the round trip the benchmark claims.
    let rtts = delayline::handshake_rtts(&topo, server.ip(), RTT_SAMPLES)?;
    let rtt = Summary::of(&rtts).expect("RTT samples").median;
    ensure!(
        (rtt - rtt_ms).abs() <= RTT_TOLERANCE_MS,
        "the delay line should make a {rtt_ms} ms round trip but TCP handshakes through it took {rtt:.2} ms \
         (median of {RTT_SAMPLES}; samples {rtts:.2?}): the machine is too busy for this benchmark or the line is broken"
    );
    // The location server's round trip for the target: the slower of the
    // two ends' (the server's crosses the delay line, the laptop's not).
    let ls_rtt = match &loc {
        Some(l) => {
            let mut worst = 0.0f64;
            for ns in [&topo.laptop, &topo.server] {
                let v = delayline::handshake_rtts_from(ns, l.addr.v4.into(), RTT_SAMPLES)?;
                worst = worst.max(Summary::of(&v).expect("RTT samples").median);
            }
            Some(worst)
        }
        None => None,
    };

    let probe = Probe::spawn(&lap, server)?;
    let local = probe.wait_connected(Duration::from_secs(10))?;
    wait_mobile(&lapd, &srvd, local, case.nat)?;
    if case.v6_only {
        wait_told(&lapd, topo.server_addr.v6().into())?;
    }
    // A second of steady probing: the echo round trip before the move.
    vnat_bench::sleep_checked(Duration::from_secs(1))?;
    let now = monotonic_ns();
    let echo_rtt = {
        let log = probe.log();
        let recent: Vec<f64> = log
            .echoes
            .iter()
            .filter(|e| e.recv > now - 1_000_000_000)
            .map(|e| ms(e.recv - e.sent))
            .collect();
        ensure!(
            !recent.is_empty(),
            "no probe came back in the second before the move"
        );
        Summary::of(&recent).expect("non-empty").median
    };

    // The flood, from a host of its own linked straight to the server: the
    // delay line between router and server relays frames in userspace and
    // would drop most of a 100,000 datagram/s flood itself (the laptop's
    // update among them), so the figure would be the rig's, not vnatd's.
    let rejected = |d: &Daemon| -> u64 {
        d.ctl(&["status"]).map_or(0, |s| {
            s["vcmp"]["rejected"]
                .as_object()
                .map_or(0, |m| m.values().filter_map(Value::as_u64).sum())
        })
    };
    let attacker =
        (flood_pps > 0).then(|| vnat_tests::attach_attacker_beside_server(&topo, "hova").0);
    let flood = match &attacker {
        Some(ns) => {
            let flow = vnat_daemon::vcmp::flow::VirtualFlow {
                proto: vnat_daemon::vcmp::flow::Proto::Tcp,
                local,
                remote: server,
            };
            let target = SocketAddr::new(server.ip(), VCMP_PORT);
            let spoofed = SocketAddr::new(local.ip(), VCMP_PORT);
            let before = rejected(&srvd);
            let f = flood::Flood::start(ns, target, spoofed, flood_pps, flow)?;
            // Loaded before the move starts.
            vnat_bench::sleep_checked(Duration::from_millis(300))?;
            Some((f, before))
        }
        None => None,
    };

    // The move.
    let l = &topo.laptop;
    // The laptop socket's timers just before B comes up (`ss` is read then,
    // not at t_usable: starting a process on this 2-core machine in the
    // middle of the move would delay the daemons it measures).
    let socket_state = || {
        let out = l.try_run(&[
            "ss",
            "-tinoH",
            "state",
            "established",
            "dport",
            "=",
            &format!(":{SERVER_PORT}"),
        ]);
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    let t_start;
    let socket;
    match scenario {
        Scenario::NoOutage => {
            socket = socket_state();
            t_start = monotonic_ns();
            if let Some(e) = &link_e {
                move_server_to_e(&topo, e, OldServerAddress::Gone);
            }
            if case.v6_only {
                topo.move_laptop_to_b_v6_only();
            } else {
                topo.move_laptop_to_b();
            }
        }
        Scenario::Outage(d) => {
            t_start = monotonic_ns();
            for (a, p) in topo.laptop_a_addr.with_prefixes() {
                l.del_addr(&topo.laptop_if_a, a, p);
            }
            l.link_down(&topo.laptop_if_a);
            if link_e.is_some() {
                unplug_server_c(&topo);
            }
            vnat_bench::sleep_checked(d)?;
            socket = socket_state();
            if let Some(e) = &link_e {
                plug_server_e(&topo, e);
            }
            if case.v6_only {
                l.link_up(&topo.laptop_if_b);
                l.add_addr(&topo.laptop_if_b, topo.laptop_b_addr.v6().into(), 64);
                l.default_route(topo.router_b_addr.v6().into(), &topo.laptop_if_b);
            } else {
                topo.plug_laptop_b();
                l.default_route(topo.router_b_addr.v4.into(), &topo.laptop_if_b);
            }
        }
    }
    let t_usable = monotonic_ns();
    let real_offset = realtime_ns() as i128 - monotonic_ns() as i128;

    // The first echo of a probe written after t_usable.
    let deadline = Instant::now() + RESUME_LIMIT;
    let first = loop {
        {
            let log = probe.log();
            if let Some(e) = log.echoes.iter().find(|e| e.sent >= t_usable) {
                break *e;
            }
            if let Some(err) = &log.error {
                bail!("the probe connection failed after the move: {err}");
            }
        }
        ensure!(
            Instant::now() < deadline,
            "no probe written after the move came back within {} s: the connection did not resume",
            RESUME_LIMIT.as_secs()
        );
        ensure!(!vnat_bench::interrupted(), "interrupted");
        std::thread::sleep(Duration::from_millis(5));
    };
    // It carries on: more echoes, on the same socket, without an error.
    vnat_bench::sleep_checked(Duration::from_millis(500))?;
    let log = probe.stop();
    let laptop_tcp_retransmits = tcp_retransmits(l);
    if let Some(err) = &log.error {
        bail!("the probe connection failed after the move: {err}");
    }
    let flooded = flood.map(|(f, before)| (f.stop(), rejected(&srvd).saturating_sub(before)));
    let later = log.echoes.iter().filter(|e| e.recv > first.recv).count();
    ensure!(later >= 100, "only {later} probes came back in the 500 ms after the first one: the flow did not carry on");

    let first_echo = log
        .echoes
        .iter()
        .find(|e| e.recv > t_usable)
        .expect("the first-byte echo is one");
    let last_before = log
        .echoes
        .iter()
        .rev()
        .find(|e| e.recv <= t_start)
        .map_or(t_start, |e| e.recv);
    let rel = |real: u64| ms_signed(real as i128 - real_offset - t_usable as i128);
    let after_start = |v: Vec<u64>| {
        v.into_iter()
            .find(|r| (*r as i128 - real_offset) >= t_start as i128)
            .map(rel)
    };
    let first_byte = ms(first.recv - t_usable);
    let handover = first_byte - rtt;
    let target = match ls_rtt {
        Some(ls) => 2.0 * rtt + ls,
        None => rtt + TARGET_SLACK_MS,
    };
    Ok(RunResult {
        movers: case.movers,
        rtt_ms: rtt,
        location_server_rtt_ms: ls_rtt,
        base_rtt_ms: base_rtt,
        one_way_delay_ms: one_way.as_secs_f64() * 1000.0,
        echo_rtt_ms: echo_rtt,
        move_ms: ms(t_usable - t_start),
        first_byte_ms: first_byte,
        handover_ms: handover,
        target_ms: target,
        target_met: handover <= target,
        first_echo_ms: ms(first_echo.recv - t_usable),
        first_byte_probe_written_ms: ms(first.sent - t_usable),
        echo_gap_ms: ms(first_echo.recv - last_before),
        probes_skipped: log.skipped,
        laptop_tcp_retransmits,
        laptop_move_started_ms: after_start(lapd.events("resuming connection at a new address")),
        server_move_started_ms: both
            .then(|| after_start(srvd.events("resuming connection at a new address")))
            .flatten(),
        server_translated_ms: after_start(srvd.events("translation updated")),
        laptop_translated_ms: after_start(lapd.events("translation updated")),
        laptop_socket_at_usable: socket,
        flood_sent: flooded.as_ref().map(|(s, _)| s.datagrams),
        flood_per_sec: flooded.as_ref().map(|(s, _)| s.per_sec),
        server_rejected_during_flood: flooded.as_ref().map(|(_, r)| *r),
        delay_line: {
            let mut stats = delay_e.map(DelayLine::stop).unwrap_or_default();
            let delayline::ServerLinkDelay { line, ns: _ns } = delay;
            stats.splice(0..0, line.stop());
            stats
        },
    })
}

/// Copies vnatd's logs next to the results when a run ends, whichever way.
struct KeepLogs(Vec<(std::path::PathBuf, std::path::PathBuf)>);

impl Drop for KeepLogs {
    fn drop(&mut self) {
        for (from, to) in &self.0 {
            if let Some(dir) = to.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            let _ = std::fs::copy(from, to);
        }
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn ms_signed(ns: i128) -> f64 {
    ns as f64 / 1e6
}

/// Waits until both vnatd track the probe's connection with keys (`mobile`
/// in `vnatctl ls`): only then can it move.
/// Wait until both vnatd can move the probe's connection. Behind a NAT
/// the server names the laptop's end by the NAT's address and port.
fn wait_mobile(lapd: &Daemon, srvd: &Daemon, local: SocketAddr, nat: bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(15);
    let local_s = local.to_string();
    let has = |d: &Daemon, key: &str, want: &dyn Fn(&str) -> bool| {
        d.ctl(&["ls", "--proto", "tcp"]).is_some_and(|v| {
            v.as_array().is_some_and(|a| {
                a.iter()
                    .any(|c| c[key].as_str().is_some_and(want) && c["mobile"] == Value::Bool(true))
            })
        })
    };
    let nat_a = format!("{}:", vnat_tests::NAT_PUBLIC_A);
    let laptop_as_seen = |a: &str| {
        if nat {
            a.starts_with(&nat_a)
        } else {
            a == local_s
        }
    };
    loop {
        if lapd.paired()
            && srvd.paired()
            && has(lapd, "virtual_local", &|a| a == local_s)
            && has(srvd, "virtual_remote", &laptop_as_seen)
        {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the two vnatd did not pair or did not get keys for the probe's connection within 15 s (paired: laptop {}, server {})",
            lapd.paired(),
            srvd.paired()
        );
        ensure!(!vnat_bench::interrupted(), "interrupted");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Wait (at most 10 s) until the laptop's vnatd lists `addr` among the
/// addresses its peer told it (`vnatctl peers`): where it moves its
/// connection when IPv4 is gone.
fn wait_told(lapd: &Daemon, addr: std::net::IpAddr) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let peers = lapd.ctl(&["peers"]).unwrap_or(Value::Null);
        if vnat_tests::peers_told(&peers, addr) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "the laptop's vnatd never learnt the server's IPv6 address {addr}: {peers}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The segments TCP retransmitted in `ns` since it was made (each run's
/// laptop is a new namespace; `nstat -as` reads without keeping a
/// history). `None` if nstat cannot tell.
fn tcp_retransmits(ns: &vnat_tests::Netns) -> Option<u64> {
    let out = ns.try_run(&["nstat", "-asz", "TcpRetransSegs"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("TcpRetransSegs"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}
