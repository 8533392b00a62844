//! `vnatctl criu-hook` exports only the dumped tree's own connections
//! (issue 31, item 6). A tenant whose process is checkpointed gives its own
//! network namespace's `lo` a host connection's two addresses and connects
//! them from the same ports, so that its socket table shows that
//! connection's tuple. The hook, run at post-dump for the tenant's tree,
//! must not export the host's connection (its keys would go into the
//! tenant's images, and vnatd forgets an exported connection: the host's
//! connection would stop being mobile).
//!
//! CRIU itself is not needed: the hook is run as CRIU runs it, with the
//! tenant's pid in CRTOOLS_INIT_PID.

use std::{
    net::SocketAddr,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use vnat_tests::{
    bin_path, EchoServer, LaptopAndServer, LaptopRouterServer, Netns, ProcessGroup, StreamClient,
    StreamOptions, Vnatd,
};

/// In the tenant's namespace: listen on argv[1]:argv[2], connect to it from
/// argv[3]:argv[4], accept, write its pid to argv[5] and hold both sockets.
const TENANT: &str = r#"
import os, socket, sys, time
l = socket.socket()
l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
l.bind((sys.argv[1], int(sys.argv[2])))
l.listen(1)
c = socket.socket()
c.bind((sys.argv[3], int(sys.argv[4])))
c.connect((sys.argv[1], int(sys.argv[2])))
a, _ = l.accept()
with open(sys.argv[5], "w") as f:
    f.write("%d\n" % os.getpid())
while True:
    time.sleep(1)
"#;

/// The server's row for its connection to `remote`'s address.
fn row(d: &Vnatd, remote: std::net::IpAddr) -> serde_json::Value {
    let ls = d.ctl(&["ls", "--proto", "tcp"]).expect("ls");
    ls.as_array()
        .and_then(|a| {
            a.iter()
                .find(|r| {
                    r["virtual_remote"]
                        .as_str()
                        .and_then(|s| s.parse::<SocketAddr>().ok())
                        .is_some_and(|s| s.ip() == remote)
                })
                .cloned()
        })
        .unwrap_or_else(|| panic!("the server lists no connection to {remote}: {ls}"))
}

#[test]
fn a_tenant_reproducing_a_host_connections_tuple_does_not_get_it_exported() {
    let tag = "crt";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let h = LaptopAndServer::new(&topo, tag);
    let server = SocketAddr::new(topo.server_addr.v4.into(), 7100);
    let _echo = EchoServer::tcp_in(&h.srv, server);
    let lapd = Vnatd::start(&h.lap, h.lap_dir.path());
    let srvd = Vnatd::start(&h.srv, h.srv_dir.path());
    let mut cmd = StreamOptions::tcp(server)
        .rate(100_000)
        .command(&topo.laptop);
    h.lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(20_000, Duration::from_secs(10));
    let a = topo.laptop_a_addr.v4.into();
    lapd.wait_mobile_to("tcp", server.ip());
    srvd.wait_mobile_to("tcp", a);
    let host = row(&srvd, a);
    assert_eq!(host["mobile"], true, "{host}");
    let remote: SocketAddr = host["virtual_remote"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("the connection's remote end");

    // The tenant, in a namespace of its own, with the same tuple on lo.
    let tenant_ns = Netns::new(&format!("{tag}t"));
    for ip in [server.ip(), remote.ip()] {
        tenant_ns.run(&["ip", "addr", "add", &format!("{ip}/32"), "dev", "lo"]);
    }
    let pidfile = h.work.path().join("tenant.pid");
    let mut cmd = tenant_ns.cmd("python3");
    cmd.args([
        "-c",
        TENANT,
        &server.ip().to_string(),
        &server.port().to_string(),
        &remote.ip().to_string(),
        &remote.port().to_string(),
    ])
    .arg(&pidfile)
    .stdin(Stdio::null())
    .stdout(Stdio::null());
    let _tenant = ProcessGroup::spawn(cmd, "the tenant");
    let deadline = Instant::now() + Duration::from_secs(10);
    let pid = loop {
        if let Some(p) = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
        {
            break p;
        }
        assert!(Instant::now() < deadline, "the tenant never connected");
        std::thread::sleep(Duration::from_millis(50));
    };

    // The hook, as CRIU runs it at post-dump for the tenant's tree.
    let images = h.work.path().join("images");
    std::fs::create_dir(&images).expect("the images directory");
    let key = srvd.ctl(&["status"]).expect("status")["vcmp"]["host_key"]
        .as_str()
        .expect("host key")
        .to_string();
    let out = Command::new(bin_path("vnatctl"))
        .arg("criu-hook")
        .env("CRTOOLS_SCRIPT_ACTION", "post-dump")
        .env("CRTOOLS_INIT_PID", pid.to_string())
        .env("CRTOOLS_IMAGE_DIR", &images)
        .env("VNAT_CRIU_TO", &key)
        .env("VNAT_CONTROL", &srvd.control)
        .output()
        .expect("running vnatctl criu-hook");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("criu_tenant: the hook said: {said}");
    let export = images.join("vnat-connections.json");
    assert!(
        !export.exists(),
        "the hook exported the host's connection into the tenant's images: {}\n{said}",
        std::fs::read_to_string(&export).unwrap_or_default()
    );
    assert!(out.status.success(), "the hook failed: {said}");
    let after = row(&srvd, a);
    assert_eq!(
        after["mobile"], true,
        "the host's connection is no longer mobile after the tenant's dump: {after}"
    );
    let end = client.stop();
    assert!(end.error.is_none(), "the host's stream failed: {end:?}");
}
