//! A peer's vnatd sends to an address announced in an authenticated update
//! before validating it, but never more than three times what came from
//! there, and goes back to the last validated address when the validation
//! fails (issue 33, item 3).
//!
//! A rogue peer behind the router (vnat's own protocol core driven by the
//! test, with valid keys for its own UDP flow to a UDP echo server) has a
//! second address V on its link. Its VCMP leaves from V; its flow's socket
//! stays bound to its first address. It announces that its flow moved to
//! V, in an update sent from V, and V never answers the server's challenge
//! (an nftables rule in V's namespace drops it: a host at V that never
//! asked for anything). Then the rogue sends 200 datagrams on its flow from
//! its first address, which the server's echo answers to the flow's
//! virtual endpoint, so to V while the server sends there:
//!  - the echoes that reach V carry at most three times the bytes V sent
//!    (the update), IP headers included, and at least one reaches it (the
//!    server did send before validating);
//!  - the echoes over the budget go to the flow's last validated address,
//!    the rogue's first one, where its socket receives them (counted as
//!    `unvalidated_fallback`), not to V;
//!  - once the validation fails, the flow is back at its validated
//!    address, where the rogue receives the echoes again.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    thread,
    time::Duration,
};

use vnat_tests::{
    attach_attacker, wait_until, EchoServer, Host, LaptopRouterServer, Netns, Rogue, TempDir, Vnatd,
};

/// The rogue's second address: the victim the server must not flood.
const V: Ipv4Addr = Ipv4Addr::new(198, 18, 4, 77);

use vnat_tests::rogue_row as row;

/// Bytes of nftables counter `name` in table `inet vnatbudget` of `ns`.
fn nft_bytes(ns: &Netns, name: &str) -> u64 {
    let out = ns.run_stdout(&["nft", "list", "counter", "inet", "vnatbudget", name]);
    out.split_whitespace()
        .skip_while(|w| *w != "bytes")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in {out}"))
}

#[test]
fn an_unvalidated_address_receives_at_most_three_times_what_it_sent() {
    let tag = "uvb";
    let topo = LaptopRouterServer::builder().tag(tag).build();
    let (attacker, _attacker_ip) = attach_attacker(&topo, &format!("{tag}-a"));
    attacker.add_addr("eth0", V.into(), 24);

    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let sdir = TempDir::new(&format!("{tag}s"));
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5002);
    let _echo = EchoServer::udp_in(&srv, server);
    let srvd = Vnatd::start(&srv, sdir.path());
    attacker.wait_reachable(topo.server_addr.v4.into(), Duration::from_secs(5));

    let rogue = Rogue::start(&attacker, 2031);
    let own = rogue.open_bound_udp_flow(&attacker, server, &srvd);
    // The echo works at the flow's own address before anything.
    rogue.flow_received();
    rogue.send_again();
    wait_until(
        Duration::from_secs(5),
        || !rogue.flow_received().is_empty(),
        || "the echo server never answered the rogue".to_string(),
    );

    // V counts what it sends and receives, and never answers a challenge.
    let v = V.to_string();
    let port = own.local.port().to_string();
    let rules = format!(
        "table inet vnatbudget {{
            counter sent {{}}
            counter flow_in {{}}
            counter vcmp_in {{}}
            chain output {{ type filter hook output priority 0; ip saddr {v} counter name sent; }}
            chain input {{
                type filter hook input priority 0;
                ip daddr {v} udp dport {port} counter name flow_in
                ip daddr {v} udp dport 2031 counter name vcmp_in drop
            }}
        }}"
    );
    let out = attacker.run(&["nft", &rules]);
    assert!(
        out.status.success(),
        "nft: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    attacker.run(&[
        "ip",
        "route",
        "replace",
        "default",
        "via",
        "198.18.4.1",
        "dev",
        "eth0",
        "src",
        &v,
    ]);
    let dropped_before = srv.counter("drop_unvalidated");

    let at_v = SocketAddr::new(IpAddr::V4(V), own.local.port());
    rogue.resume(own, at_v);
    wait_until(
        Duration::from_secs(10),
        || nft_bytes(&attacker, "vcmp_in") > 0,
        || "the server never challenged V (or never answered the update there)".to_string(),
    );
    let fell_back_before = srv.counter("unvalidated_fallback");
    rogue.flow_received();
    for _ in 0..200 {
        rogue.send_again();
        thread::sleep(Duration::from_millis(2));
    }
    thread::sleep(Duration::from_millis(500));
    let (sent, flow_in) = (
        nft_bytes(&attacker, "sent"),
        nft_bytes(&attacker, "flow_in"),
    );
    let dropped = srv.counter("drop_unvalidated") - dropped_before;
    let fell_back = srv.counter("unvalidated_fallback") - fell_back_before;
    let at_validated = rogue.flow_received().len();
    eprintln!(
        "unvalidated_budget: V sent {sent} bytes, received {flow_in} bytes of the flow; the server \
         sent {fell_back} packets over the budget to the validated address ({at_validated} echoes \
         received there) and dropped {dropped}"
    );
    assert!(
        flow_in > 0,
        "nothing of the flow reached V: the server did not send before validating"
    );
    assert!(
        flow_in <= 3 * sent,
        "V received {flow_in} bytes of the flow, more than three times the {sent} it sent"
    );
    assert!(
        fell_back > 0 && at_validated > 0,
        "the echoes over V's budget did not reach the flow's last validated address \
         ({fell_back} sent there, {at_validated} received)"
    );
    assert_eq!(
        dropped, 0,
        "with a validated address to go to, nothing over the budget is dropped"
    );

    // The validation fails (V never answers): back to the validated
    // address, where the echoes reach the rogue again.
    wait_until(
        Duration::from_secs(40),
        || row(&srvd, &own).is_some_and(|r| r["physical_remote"] == own.local.to_string()),
        || {
            format!(
                "the flow never went back to its validated address: {:?}",
                row(&srvd, &own)
            )
        },
    );
    rogue.flow_received();
    wait_until(
        Duration::from_secs(10),
        || {
            rogue.send_again();
            thread::sleep(Duration::from_millis(100));
            !rogue.flow_received().is_empty()
        },
        || "after the revert, the echoes never reached the rogue's first address".to_string(),
    );
    let flow_in_end = nft_bytes(&attacker, "flow_in");
    let sent_end = nft_bytes(&attacker, "sent");
    assert!(
        flow_in_end <= 3 * sent_end,
        "in all, V received {flow_in_end} bytes of the flow for {sent_end} sent"
    );
    drop((srvd, rogue));
}
