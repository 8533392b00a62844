//! `cargo xtask demo`: a laptop roams to another subnet and its live TCP
//! connection to a server carries on.
//!
//! Hosts are network namespaces (laptop, router, server; the laptop has a
//! link into subnet A and one into subnet B). A real vnatd runs on the laptop
//! and on the server, and a real echo server (socat) on the server;
//! vnat-stream on the laptop sends a numbered byte stream and checks every
//! echoed byte. Halfway, the laptop leaves subnet A and joins B (its address
//! changes); nobody tells vnat anything: the laptop's vnatd sees the address
//! change, the two daemons agree the new mapping over VCMP, and the same
//! socket carries on. Everything is removed at the end, also after Ctrl-C.

use std::{
    net::SocketAddr,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use vnat_tests::{
    EchoServer, Family, Host, LaptopRouterServer, StreamClient, StreamOptions, StreamStatus,
    TempDir, Vnatd,
};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

struct Args {
    family: Family,
    seconds_before: u64,
    seconds_after: u64,
    delay_ms: Option<u64>,
}

const USAGE: &str = "usage: vnat-demo [--ipv6] [--before SECS] [--after SECS] [--delay-ms MS]

Builds laptop, router and server namespaces, streams TCP data from the laptop
to an echo server, moves the laptop from subnet A to subnet B, and shows the
same connection carrying on. Needs root; run it through `cargo xtask demo`.";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        family: Family::V4,
        seconds_before: 3,
        seconds_after: 3,
        delay_ms: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> Result<u64, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{name} needs a whole number"))
        };
        match arg.as_str() {
            "--ipv6" => a.family = Family::V6,
            "--before" => a.seconds_before = num("--before")?,
            "--after" => a.seconds_after = num("--after")?,
            "--delay-ms" => a.delay_ms = Some(num("--delay-ms")?),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

/// Sleep for `d` while printing progress; false if interrupted.
fn watch(client: &StreamClient, d: Duration) -> bool {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if INTERRUPTED.load(Ordering::SeqCst) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(500));
        if let Some(s) = client.latest() {
            println!(
                "    {:>6.1} s  {:>10} bytes echoed and verified   {} -> {}",
                s.t_ms as f64 / 1000.0,
                s.verified,
                s.local,
                s.remote
            );
        }
    }
    true
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("vnat-demo: {e}\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    if !nix::unistd::geteuid().is_root() {
        eprintln!("vnat-demo creates network namespaces and loads eBPF programs: run it as root (sudo -E cargo xtask demo).");
        std::process::exit(1);
    }
    // SAFETY: the handler only stores to an atomic, which is
    // async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let code = run(&args);
    // Everything created in run() has been dropped (removed) by now.
    println!("\nCleaned up: namespaces, cgroups and pinned eBPF objects removed.");
    std::process::exit(code);
}

fn run(args: &Args) -> i32 {
    let v6 = args.family == Family::V6;
    println!(
        "Building hosts: laptop, router, server (network namespaces){}",
        if v6 { ", IPv6" } else { "" }
    );
    let mut b = LaptopRouterServer::builder().tag("demo").ipv6(v6);
    if let Some(ms) = args.delay_ms {
        b = b.delay(Duration::from_millis(ms));
    }
    let topo = b.build();
    let lap = Host::new(&topo.laptop, "demol");
    let srv = Host::new(&topo.server, "demos");
    let server = SocketAddr::new(topo.server_addr.get(args.family), 5001);
    let old_ip = topo.laptop_a_addr.get(args.family);
    let new_ip = topo.laptop_b_addr.get(args.family);
    println!("  laptop  {old_ip} on subnet A (will move to {new_ip} on subnet B)");
    println!("  server  {server}: socat echoing everything back");
    let _echo = EchoServer::tcp_in(&srv, server);
    let (ldir, sdir) = (TempDir::new("demol"), TempDir::new("demos"));
    let lapd = Vnatd::start(&lap, ldir.path());
    let srvd = Vnatd::start(&srv, sdir.path());
    println!("  vnatd   running on the laptop and on the server (VCMP on UDP 2031)");

    let mut cmd = StreamOptions::tcp(server)
        .rate(1_000_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let first = client.wait_verified_at_least(1, Duration::from_secs(10));
    println!(
        "\nLive TCP stream {} -> {} (vnat-stream: numbered bytes, every echoed byte checked)",
        first.local, first.remote
    );
    if !wait_paired(&[&ldir, &sdir]) {
        println!("\nThe two vnatd did not pair within 15 s; see their log lines above.");
        return 1;
    }
    println!("  the two vnatd paired (each pinned the other's host key)");
    if !watch(&client, Duration::from_secs(args.seconds_before)) {
        return interrupted(client);
    }

    let before: StreamStatus = client.latest().expect("stream status");
    println!("\n>>> The laptop leaves subnet A and joins subnet B: {old_ip} -> {new_ip} (no command to vnat)");
    topo.move_laptop_to_b();
    // Wait for the flow to have clearly resumed: 200 kB echoed after the
    // move (a fifth of a second of the stream), so no byte that was already
    // in a socket buffer at the move can satisfy the check.
    client.wait_verified_at_least(before.verified + 200_000, Duration::from_secs(30));
    let gap_ms = client.latest().map_or(0, |s| s.max_gap_ms);
    println!(">>> handover: the echoes stopped for {gap_ms} ms (the longest gap, measured by the receiving client), then carried on");
    let new_local = SocketAddr::new(
        new_ip,
        first
            .local
            .parse::<SocketAddr>()
            .map(|a| a.port())
            .unwrap_or(0),
    );
    wait_translated(&lapd);
    show_ls("laptop", &lapd);
    show_ls("server", &srvd);
    if !watch(&client, Duration::from_secs(args.seconds_after)) {
        return interrupted(client);
    }

    let fin = client.stop();
    println!("\nResult");
    println!("  socket before the move  {}", first.local);
    println!(
        "  socket after the move   {}  ({})",
        fin.local,
        if fin.local == first.local {
            "the same connection"
        } else {
            "A DIFFERENT SOCKET"
        }
    );
    println!("  on the wire after       {new_local} -> {server}");
    println!("  bytes sent / verified   {} / {}", fin.sent, fin.verified);
    println!("  handover (longest gap)  {} ms", fin.max_gap_ms);
    match (
        &fin.error,
        fin.local == first.local && fin.verified > before.verified,
    ) {
        (None, true) => {
            println!("\nThe connection survived the move with every byte intact.");
            0
        }
        (err, _) => {
            println!(
                "\nThe connection did NOT survive: {}",
                err.as_deref().unwrap_or("no data after the move")
            );
            1
        }
    }
}

/// Wait until every vnatd has pinned its peer's key.
fn wait_paired(dirs: &[&TempDir]) -> bool {
    let end = Instant::now() + Duration::from_secs(15);
    while Instant::now() < end && !INTERRUPTED.load(Ordering::SeqCst) {
        let all = dirs.iter().all(|d| {
            std::fs::read_to_string(d.path().join("state").join("peers.json"))
                .map(|s| s.len() > 4)
                .unwrap_or(false)
        });
        if all {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// Wait (at most 5 s) until the laptop's vnatd shows a translated connection.
fn wait_translated(d: &Vnatd) {
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end {
        if d.ctl(&["ls", "--state", "translated"])
            .is_some_and(|v| v.as_array().is_some_and(|a| !a.is_empty()))
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Print `vnatctl ls` (the table) as a host's vnatd sees it.
fn show_ls(name: &str, d: &Vnatd) {
    let out = std::process::Command::new(vnat_tests::bin_path("vnatctl"))
        .arg("--control")
        .arg(&d.control)
        .args(["ls", "--proto", "tcp"])
        .output();
    if let Ok(out) = out {
        println!("    vnatctl ls on the {name}:");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            println!("      {line}");
        }
    }
}

fn interrupted(client: StreamClient) -> i32 {
    println!("\nInterrupted; cleaning up.");
    let _ = client.stop();
    130
}
