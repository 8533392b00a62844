//! A NAT that changes the mapping of a connection that did not move
//! (issue 32, item 2): a home router that reboots, a carrier-grade NAT
//! that re-maps idle flows. The laptop stays where it is, behind a
//! `fully-random` NAT; mid-stream the NAT forgets every mapping
//! (`conntrack -F` on the router), so the laptop's next packets reach the
//! server from a new public port: for TCP the server's kernel sees a
//! 4-tuple it has no socket for, for UDP another peer than the server's
//! socket was talking to.
//!
//! What happens: the server's vnatd guards each connection whose peer is
//! behind a NAT (`vnat_common::natguard`): its tc ingress drops the
//! re-mapped segments its kernel would reset, and holds the re-mapped
//! datagrams its application would take for a new peer's, and vnatd, which
//! reads the guard's drops every 250 ms, asks the laptop for the
//! connection's BIND, as after a move behind a new NAT (`vcmp::remap`).
//! The NAT forgot the laptop's VCMP mapping too, so the request reaches the
//! laptop once its next keepalive (1 s here, `--keepalive-secs`) has come
//! from the new one; the BIND (TCP BIND, UDP in-band BIND) then teaches the
//! server the new port. The application's socket stays the same at both
//! ends and every byte arrives, within about 1.5 s of the flush.
//!
//! A carrier-grade NAT that re-maps the connection alone (`conntrack -D`
//! of its entry: the VCMP mapping, kept by keepalives, stays) is crossed
//! at once: the server's request reaches the laptop within the guard's
//! 250 ms poll and a round trip, whatever the keepalive interval (25 s,
//! the default, in those tests).

use std::{net::SocketAddr, time::Duration};

use vnat_tests::{
    nat_router, EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
    NAT_PUBLIC_A,
};

fn wait_for(what: &str, secs: u64, f: impl FnMut() -> bool) {
    vnat_tests::wait_until(Duration::from_secs(secs), f, || what.to_string());
}

/// The server's rows for its flows at port 5001: (virtual remote, physical
/// remote, mobile).
fn server_rows(srvd: &Vnatd, proto: &str) -> Vec<(String, String, bool)> {
    srvd.ctl(&["ls", "--proto", proto])
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|r| {
            r["virtual_local"]
                .as_str()
                .is_some_and(|l| l.ends_with(":5001"))
        })
        .map(|r| {
            (
                r["virtual_remote"].as_str().unwrap_or("").to_string(),
                r["physical_remote"].as_str().unwrap_or("").to_string(),
                r["mobile"] == true,
            )
        })
        .collect()
}

fn laptop_mobile(lapd: &Vnatd, proto: &str) -> bool {
    lapd.ctl(&["ls", "--proto", proto])
        .and_then(|v| v.as_array().cloned())
        .is_some_and(|rows| {
            rows.iter().any(|r| {
                r["mobile"] == true
                    && r["virtual_remote"]
                        .as_str()
                        .is_some_and(|a| a.ends_with(":5001"))
            })
        })
}

/// What the NAT forgets mid-stream.
#[derive(Clone, Copy, PartialEq)]
enum Forget {
    /// Every mapping (a reboot): `conntrack -F`.
    All,
    /// The connection's mapping alone (a carrier-grade NAT re-mapping an
    /// idle flow): `conntrack -D` of the flow's entry.
    TheFlow,
}

fn survives_a_nat_remap(tag: &str, proto: &str, forget: Forget) {
    let topo = LaptopRouterServer::builder().tag(tag).build();
    nat_router(&topo).unwrap_or_else(|e| panic!("{e}"));
    let (ldir, sdir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = if proto == "tcp" {
        EchoServer::tcp_in(&srv, server)
    } else {
        EchoServer::udp_in(&srv, server)
    };
    // A reboot forgets the laptop's VCMP mapping too: the server reaches
    // the laptop again after its next keepalive.
    let keepalive = if forget == Forget::All { "1" } else { "25" };
    let lapd = Vnatd::start_with(&lap, ldir.path(), &["--keepalive-secs", keepalive]);
    let srvd = Vnatd::start(&srv, sdir.path());
    let opts = if proto == "tcp" {
        StreamOptions::tcp(server)
    } else {
        StreamOptions::udp(server)
    };
    let mut cmd = opts.rate(100_000).command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(20_000, Duration::from_secs(10));
    wait_for(
        &format!("{tag}: the {proto} flow never became mobile on the laptop"),
        30,
        || laptop_mobile(&lapd, proto),
    );
    wait_for(
        &format!("{tag}: the {proto} flow never became mobile on the server"),
        30,
        || server_rows(&srvd, proto).iter().any(|r| r.2),
    );
    let before = client.latest().expect("status");
    let rows = server_rows(&srvd, proto);
    assert_eq!(rows.len(), 1, "{tag}: one flow at the server: {rows:?}");
    let virtual_remote = rows[0].0.clone();
    assert!(
        virtual_remote.starts_with(&format!("{NAT_PUBLIC_A}:")),
        "{tag}: {rows:?}"
    );

    // The NAT forgets every mapping: the laptop's next packets leave it
    // from another random port.
    match forget {
        Forget::All => topo.router.run(&["conntrack", "-F"]),
        Forget::TheFlow => topo
            .router
            .run(&["conntrack", "-D", "-p", proto, "--dport", "5001"]),
    };
    let at_flush = client.latest().expect("status").verified;
    client.wait_verified_at_least(at_flush + 100_000, Duration::from_secs(20));

    // The server's application still has its one socket for the flow,
    // named as before, now reached at the NAT's new port.
    let rows = server_rows(&srvd, proto);
    assert_eq!(
        rows.len(),
        1,
        "{tag}: the server's application saw another peer: {rows:?}"
    );
    assert_eq!(rows[0].0, virtual_remote, "{tag}: {rows:?}");
    assert!(
        rows[0].1.starts_with(&format!("{NAT_PUBLIC_A}:")) && rows[0].1 != virtual_remote,
        "{tag}: the server does not send to the NAT's new mapping: {rows:?}"
    );
    let fin = client.stop();
    // How long the stream stood still (what the laptop's user sees).
    eprintln!("{tag}: longest gap {} ms", fin.max_gap_ms);
    assert_eq!(fin.error, None, "{tag}: the stream broke: {:?}", fin.json);
    assert_eq!(
        fin.local, before.local,
        "{tag}: the client's socket changed"
    );
    drop(lapd);
}

#[test]
fn a_tcp_stream_survives_its_nat_forgetting_the_mapping() {
    survives_a_nat_remap("nrmt", "tcp", Forget::All);
}

#[test]
fn a_udp_flow_survives_its_nat_forgetting_the_mapping() {
    survives_a_nat_remap("nrmu", "udp", Forget::All);
}

#[test]
fn a_tcp_stream_survives_a_cgnat_re_mapping_it_alone() {
    survives_a_nat_remap("nrct", "tcp", Forget::TheFlow);
}

#[test]
fn a_udp_flow_survives_a_cgnat_re_mapping_it_alone() {
    survives_a_nat_remap("nrcu", "udp", Forget::TheFlow);
}
