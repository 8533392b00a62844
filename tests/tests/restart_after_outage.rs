//! After a long outage the data flow restarts within about one round trip of
//! the translation, not at TCP's next backed-off retransmission timeout.
//!
//! A TCP stream runs from the laptop to an echo server; the laptop's link
//! goes away (subnet A down) for an outage long enough that both sockets
//! back off their retransmission timers several times (RFC 6298 §5.5); then
//! the laptop comes up on subnet B and the flow is translated. With
//! `restart_flow` on both hosts the verified bytes resume within
//! [`RESUME_LIMIT`]; in the control run, without it, they resume only at the
//! next backed-off timeout. Both figures are printed (run with
//! `--nocapture`).

use std::{
    net::SocketAddr,
    os::unix::process::CommandExt,
    process::{Child, Stdio},
    thread,
    time::{Duration, Instant},
};

use nix::{
    sys::signal::{killpg, Signal},
    unistd::Pid,
};
use vnat_daemon::datapath::{Datapath, Proto, RestartOutcome, VirtualFlow};
use vnat_tests::{
    move_flow, ss_endpoint, Family, Host, LaptopRouterServer, OnDatapath, StreamClient,
    StreamOptions,
};

const RATE: u64 = 400_000;
/// What "within about one round trip" must mean on a veth topology, with
/// room for a loaded machine running the suite (the datapaths are held
/// open, as vnatd holds its own).
const RESUME_LIMIT: Duration = Duration::from_secs(2);
const SERVER_PORT: u16 = 5001;
/// See [`Outage::AfterTimeout`].
const AFTER_TIMEOUT_MARGIN: Duration = Duration::from_secs(3);

/// A socat TCP echo server started in the server host's cgroup, so that its
/// accepted connection is recorded and can be restarted from the server side
/// too (the harness's `EchoServer` runs outside any vnat cgroup).
struct Echo(Child);

impl Echo {
    fn start(host: &Host, addr: SocketAddr) -> Echo {
        let listen = match addr {
            SocketAddr::V4(a) => format!("TCP4-LISTEN:{},bind={},reuseaddr,fork", a.port(), a.ip()),
            SocketAddr::V6(a) => format!(
                "TCP6-LISTEN:{},bind=[{}],ipv6only=1,reuseaddr,fork",
                a.port(),
                a.ip()
            ),
        };
        let mut cmd = host.command("socat");
        cmd.args([listen.as_str(), "EXEC:cat"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // Own process group, so that drop also kills the per-connection child.
        cmd.process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start socat in {}: {e}", host.ns.name()));
        let echo = Echo(child);
        let filter = format!("sport = :{}", addr.port());
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let out = host.ns.try_run(&["ss", "-H", "-ltn", &filter]);
            if out.status.success() && !out.stdout.iter().all(u8::is_ascii_whitespace) {
                return echo;
            }
            assert!(
                Instant::now() < deadline,
                "socat is not listening on {addr} after 5 s"
            );
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        let _ = killpg(Pid::from_raw(self.0.id() as i32), Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

/// How the outage ends.
#[derive(Clone, Copy)]
enum Outage {
    /// Exactly this long.
    Fixed(Duration),
    /// At least this long, then until [`AFTER_TIMEOUT_MARGIN`] after the
    /// laptop socket's next timeout: a bad moment to come back, when the
    /// next timeout is almost a whole backed-off interval away. This makes the control
    /// run's delay deterministic instead of depending on where the outage
    /// ends in the backoff schedule.
    AfterTimeout(Duration),
}

/// Where the connection breaks, which decides the timer the laptop's
/// socket backs off.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// The laptop's link goes down with its addresses (the cable is pulled,
    /// Wi-Fi is lost): the laptop has no route, so new data fails locally.
    /// With nothing in flight its socket backs off the probe timer; with
    /// segments in flight, the retransmission timer.
    Laptop,
    /// Only the network beyond the laptop fails: the laptop's segments
    /// leave and are dropped silently, so its socket always backs off the
    /// retransmission timer. (Taking the router's link down instead would
    /// make the laptop's ARP for the router fail, and the laptop's own
    /// unreachables would revert its IPv4 backoff through RFC 6069 during
    /// the outage.) At the move the laptop leaves subnet A.
    Router,
}

struct Run {
    tag: &'static str,
    family: Family,
    cut: Cut,
    outage: Outage,
    restart: bool,
}

struct Report {
    outage: Duration,
    /// From the translation being installed to the first newly verified bytes.
    resumed: Duration,
    /// `restart_flow` on the laptop and on the server.
    outcomes: Option<(RestartOutcome, RestartOutcome)>,
}

fn restart(host: &impl OnDatapath, flow: VirtualFlow) -> RestartOutcome {
    host.on(move |dp| dp.restart_flow(&flow))
        .unwrap_or_else(|e| panic!("restart_flow({flow:?}): {e}"))
}

/// How many times the socket of `flow` (local side) backed off its timer
/// (`icsk_backoff`, retransmission or probe timer), as `ss -ti` shows it.
fn backoff(host: &Host, flow: VirtualFlow) -> u32 {
    let filter = format!(
        "src {} and dst {}",
        ss_endpoint(flow.local),
        ss_endpoint(flow.remote)
    );
    let out = host.ns.run_stdout(&["ss", "-tinH", &filter]);
    out.split_whitespace()
        .find_map(|w| w.strip_prefix("backoff:"))
        .map_or(0, |n| {
            n.parse()
                .unwrap_or_else(|e| panic!("ss printed backoff:{n}: {e}"))
        })
}

/// Both sockets as `ss` sees them (rto, backoff, retransmits), for the log.
fn sockets(host: &Host) -> String {
    host.ns
        .run_stdout(&["ss", "-tinH", "state", "established"])
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

fn outage_then_move(run: &Run) -> Report {
    let v6 = run.family == Family::V6;
    let topo = LaptopRouterServer::builder().tag(run.tag).ipv6(v6).build();
    let lap = Host::new(&topo.laptop, &format!("{}l", run.tag));
    let srv = Host::new(&topo.server, &format!("{}s", run.tag));
    let server = SocketAddr::new(topo.server_addr.get(run.family), SERVER_PORT);
    let _echo = Echo::start(&srv, server);

    let mut cmd = StreamOptions::tcp(server).rate(RATE).command(lap.ns);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(200_000, Duration::from_secs(15));
    let conn = lap.wait_connection("the client's flow", |c| {
        c.proto == Proto::Tcp && c.virtual_remote == server
    });
    let flow = VirtualFlow {
        proto: Proto::Tcp,
        local: conn.virtual_local,
        remote: conn.virtual_remote,
    };
    srv.wait_connection("the server's accepted flow", move |c| {
        c.proto == Proto::Tcp && c.virtual_local == server && c.virtual_remote == flow.local
    });
    let back = VirtualFlow {
        proto: Proto::Tcp,
        local: flow.remote,
        remote: flow.local,
    };

    // Each end's datapath open, as each end's vnatd holds it: the move and
    // the restart then take what they take a user, where opening the
    // datapath afresh for each call (loading its programs: seconds under a
    // loaded suite) could last until the laptop's own timer fires.
    let (lap_dp, srv_dp) = thread::scope(|s| {
        let srv_dp = s.spawn(|| srv.open());
        (
            lap.open(),
            srv_dp
                .join()
                .unwrap_or_else(|p| std::panic::resume_unwind(p)),
        )
    });
    if run.restart {
        // A healthy connection is never touched.
        assert_eq!(
            restart(&lap_dp, flow),
            RestartOutcome::NotStalled,
            "laptop, before the outage"
        );
        assert_eq!(
            restart(&srv_dp, back),
            RestartOutcome::NotStalled,
            "server, before the outage"
        );
        let s = client.latest().expect("no status from the stream").verified;
        client.wait_verified_at_least(s + 100_000, Duration::from_secs(10));
    }

    // The outage: neither end hears from the other until B comes up.
    let l = &topo.laptop;
    let unplug_a = || {
        for (a, p) in topo.laptop_a_addr.with_prefixes() {
            l.del_addr(&topo.laptop_if_a, a, p);
        }
        l.link_down(&topo.laptop_if_a);
    };
    // The router stops forwarding in both cases, so the network is silent:
    // no unreachable reaches either end, whose kernels would otherwise
    // revert their own backoff through RFC 6069 (a router that fails to
    // resolve the laptop sends host unreachables to the server) and make
    // the result depend on which segments happened to be in flight.
    topo.router.set_sysctl("net/ipv4/ip_forward", "0");
    topo.router.set_sysctl("net/ipv6/conf/all/forwarding", "0");
    if run.cut == Cut::Laptop {
        unplug_a();
    }
    let down = Instant::now();
    let rto_before = lap.counter("sockops_rto");
    match run.outage {
        Outage::Fixed(d) => thread::sleep(d),
        Outage::AfterTimeout(min) => {
            thread::sleep(min);
            let seen = backoff(&lap, flow);
            let deadline = Instant::now() + min * 2 + Duration::from_secs(30);
            while backoff(&lap, flow) == seen {
                assert!(
                    Instant::now() < deadline,
                    "the laptop's socket did not back off again after {min:?}: {}",
                    sockets(&lap)
                );
                thread::sleep(Duration::from_millis(20));
            }
            // The server's socket, if it has segments in flight, times out
            // on nearly the same schedule (its RTO base may differ by a few
            // ms, times 2^backoff): let its timeout pass too, so that
            // neither end is about to retransmit by itself at the move.
            thread::sleep(AFTER_TIMEOUT_MARGIN);
        }
    }
    let at_move = client.latest().expect("no status from the stream").verified;
    let rtos = lap.counter("sockops_rto") - rto_before;
    let laptop_backoff = backoff(&lap, flow);
    assert!(
        laptop_backoff >= 5,
        "the laptop's socket backed off only {laptop_backoff} times: {}",
        sockets(&lap)
    );
    eprintln!("{}: laptop before the move: {}", run.tag, sockets(&lap));
    eprintln!("{}: server before the move: {}", run.tag, sockets(&srv));

    // The laptop comes up on B; the flow is translated on both ends.
    topo.router.enable_forwarding();
    if run.cut == Cut::Router {
        unplug_a();
    }
    topo.plug_laptop_b();
    l.default_route(topo.router_b_addr.v4.into(), &topo.laptop_if_b);
    if v6 {
        l.default_route(topo.router_b_addr.v6().into(), &topo.laptop_if_b);
    }
    let outage = down.elapsed();
    let new_local = SocketAddr::new(topo.laptop_b_addr.get(run.family), flow.local.port());
    move_flow(&lap_dp, &srv_dp, flow, new_local);
    let translated = Instant::now();
    // What is measured is the lever against the laptop's backed-off timer:
    // had that timer fired since, the run would show nothing.
    let moved_backoff = backoff(&lap, flow);
    assert!(
        moved_backoff == laptop_backoff,
        "{}: the laptop's socket restarted by itself during the move ({:?}): {}",
        run.tag,
        translated.elapsed(),
        sockets(&lap)
    );
    // Each host restarts its own socket, independently, in parallel.
    let outcomes = run.restart.then(|| {
        thread::scope(|s| {
            let server = s.spawn(|| restart(&srv_dp, back));
            let laptop = restart(&lap_dp, flow);
            (
                laptop,
                server
                    .join()
                    .unwrap_or_else(|p| std::panic::resume_unwind(p)),
            )
        })
    });
    if let Some(o) = outcomes {
        eprintln!(
            "{}: restart_flow returned {:?} after the translation: laptop {:?}, server {:?}",
            run.tag,
            translated.elapsed(),
            o.0,
            o.1
        );
    }
    let restarted = translated.elapsed();
    let cap = Duration::from_secs(240);
    client.wait_until(cap, "bytes verified after the move", |s| {
        s.verified > at_move
    });
    let resumed = translated.elapsed();
    eprintln!(
        "{}: outage {outage:?} (laptop backoff {laptop_backoff}, {rtos} retransmission timeouts), {} restart_flow: data resumed {resumed:?} after the translation{}",
        run.tag,
        if run.restart { "with" } else { "without" },
        if run.restart { format!(", {:?} after restart_flow returned", resumed.saturating_sub(restarted)) } else { String::new() },
    );

    // The same connection carries on, byte-exact, with no reset.
    let after = client.wait_verified_at_least(at_move + 200_000, Duration::from_secs(30));
    let fin = client.stop();
    assert_eq!(
        fin.error, None,
        "the stream reported an error: {:?}",
        fin.json
    );
    assert_eq!(fin.local, before.local, "the client's socket changed");
    assert!(fin.verified >= after.verified);
    Report {
        outage,
        resumed,
        outcomes,
    }
}

fn assert_restarted(r: &Report) {
    let (lap, srv) = r.outcomes.expect("restart_flow was called");
    // The laptop's socket is always backed off: its retransmission timer if
    // it had segments in flight when the outage began, else its probe timer
    // (new data that could not be sent), which the lever pushes (the
    // laptop's process connected) or answers with a probe to the server. The server's is backed off if it
    // had segments in flight. Whichever end's restart acts first may
    // restart the other (its segment carries an ACK), which then finds
    // nothing to do.
    let acted = |o: RestartOutcome| {
        matches!(
            o,
            RestartOutcome::Retransmitted { .. }
                | RestartOutcome::Resumed { .. }
                | RestartOutcome::Pushed { .. }
        ) || matches!(o, RestartOutcome::Rearmed { next_retransmit_ms, .. } if next_retransmit_ms < 1000)
    };
    assert!(
        acted(lap) || acted(srv),
        "neither socket was restarted: laptop {lap:?}, server {srv:?}"
    );
    assert!(
        r.resumed < RESUME_LIMIT,
        "after a {:?} outage, data resumed {:?} after the translation even with restart_flow (limit {RESUME_LIMIT:?})",
        r.outage,
        r.resumed
    );
}

#[test]
fn tcp_v4_restarts_within_a_round_trip_after_outage() {
    let r = outage_then_move(&Run {
        tag: "rst4",
        family: Family::V4,
        cut: Cut::Laptop,
        outage: Outage::AfterTimeout(Duration::from_secs(20)),
        restart: true,
    });
    assert_restarted(&r);
}

/// The control: the same outage without `restart_flow`. The socket only
/// retransmits at its next backed-off timeout, a whole interval (about 25 s
/// after a 25 s outage) later.
#[test]
fn tcp_v4_without_restart_waits_for_the_backed_off_timer() {
    let r = outage_then_move(&Run {
        tag: "rstc4",
        family: Family::V4,
        cut: Cut::Laptop,
        outage: Outage::AfterTimeout(Duration::from_secs(20)),
        restart: false,
    });
    assert!(
        r.resumed > Duration::from_secs(5),
        "without restart_flow data resumed {:?} after a {:?} outage: the control shows nothing",
        r.resumed,
        r.outage
    );
}

/// The retransmission-timer case for IPv4: RFC 6069 unreachables.
#[test]
fn tcp_v4_restarts_after_outage_beyond_the_laptop() {
    let r = outage_then_move(&Run {
        tag: "rst4r",
        family: Family::V4,
        cut: Cut::Router,
        outage: Outage::Fixed(Duration::from_secs(20)),
        restart: true,
    });
    assert_restarted(&r);
}

/// The retransmission-timer case for IPv6: ICMPv6 no-route unreachables.
#[test]
fn tcp_v6_restarts_within_a_round_trip_after_outage() {
    let r = outage_then_move(&Run {
        tag: "rst6",
        family: Family::V6,
        cut: Cut::Router,
        outage: Outage::Fixed(Duration::from_secs(20)),
        restart: true,
    });
    assert_restarted(&r);
}

/// The case: the network was gone for two minutes. Slow (about
/// 2 minutes); run with `--ignored --nocapture`.
#[test]
#[ignore = "takes about 2 minutes"]
fn tcp_v4_restarts_after_two_minute_outage() {
    let r = outage_then_move(&Run {
        tag: "rst2m",
        family: Family::V4,
        cut: Cut::Laptop,
        outage: Outage::Fixed(Duration::from_secs(120)),
        restart: true,
    });
    assert_restarted(&r);
}

/// The two minutes with segments in flight: the retransmission timer has
/// backed off to 102.4 s and several RFC 6069 steps are needed.
#[test]
#[ignore = "takes about 2 minutes"]
fn tcp_v4_restarts_after_two_minute_outage_beyond_the_laptop() {
    let r = outage_then_move(&Run {
        tag: "rst2r",
        family: Family::V4,
        cut: Cut::Router,
        outage: Outage::Fixed(Duration::from_secs(120)),
        restart: true,
    });
    assert_restarted(&r);
}

/// Its control, a measurement (up to about 3.5 minutes): without
/// `restart_flow` the laptop's socket waits for its timeout after the one
/// at about 102 s, at about 205 s, unless the server's socket retransmits
/// earlier and its segment restarts the laptop's (tcp_ack_probe). With a
/// fixed outage that depends on where the server is in its own schedule,
/// so only the default control (aligned to the laptop's timeout) asserts.
#[test]
#[ignore = "takes up to 3.5 minutes"]
fn tcp_v4_without_restart_after_two_minute_outage() {
    let r = outage_then_move(&Run {
        tag: "rst2c",
        family: Family::V4,
        cut: Cut::Laptop,
        outage: Outage::Fixed(Duration::from_secs(120)),
        restart: false,
    });
    eprintln!(
        "rst2c: without restart_flow, data resumed {:?} after a {:?} outage",
        r.resumed, r.outage
    );
}
