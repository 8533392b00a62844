//! After the laptop leaves a network, nothing leaves it untranslated with
//! that network's address (`vnat_common::MAP_GONE`), and once it is back
//! there, everything does again.
//!
//! vnat keeps a moved connection's old address on `lo`, so that its socket
//! can go on sending from it. Every other socket of that address can then
//! send too, and the laptop's new default route takes their packets into
//! the new network with the old address: a connection vnat does not manage,
//! or one whose move a mass move has not reached yet. The peer answers to
//! the old network, where the answer is lost, so such a packet only costs
//! both hosts and the network work (at 100,000 connections it filled both
//! cores for seconds), and it shows the new network where the laptop was.
//! Now the tc egress program redirects it to no device, where it is lost as
//! over a link that went dark: the socket keeps its data and retransmits
//! later, as without vnat, where its address would simply be gone.

use std::{net::SocketAddr, thread, time::Duration};

use vnat_tests::{
    tcp_segs_received, EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir,
    Vnatd,
};

fn gone_discarded(d: &Vnatd) -> u64 {
    d.ctl(&["status"]).expect("vnatd unreachable")["datapath"]["counters"]["gone_discarded"]
        .as_u64()
        .unwrap_or(0)
}

#[test]
fn after_a_move_an_unmoved_connection_sends_nothing_with_the_old_address_until_the_laptop_is_back()
{
    let topo = LaptopRouterServer::builder().tag("gone").build();
    let lap = Host::new(&topo.laptop, "gonel");
    let srv = Host::new(&topo.server, "gones");
    let (ldir, sdir) = (TempDir::new("gonel"), TempDir::new("gones"));
    let moved_srv = SocketAddr::new(topo.server_addr.v4.into(), 5031);
    let stay_srv = SocketAddr::new(topo.server_addr.v4.into(), 5032);
    let _e1 = EchoServer::tcp_in(&srv, moved_srv);
    let _e2 = EchoServer::tcp_in(&srv, stay_srv);
    let lapd = Vnatd::start(&lap, ldir.path());
    let _srvd = Vnatd::start(&srv, sdir.path());

    // One connection vnat manages (its process is in the enabled cgroup)
    // and one it does not: both from the laptop's address on network A.
    let mut cmd = StreamOptions::tcp(moved_srv)
        .rate(100_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let moved = StreamClient::from_command(cmd);
    let stay = StreamClient::spawn(&topo.laptop, &StreamOptions::tcp(stay_srv).rate(100_000));
    let m0 = moved.wait_verified_at_least(20_000, Duration::from_secs(10));
    let s0 = stay.wait_verified_at_least(20_000, Duration::from_secs(10));
    let stay_local: SocketAddr = s0.local.parse().expect("the client's local address");
    lapd.wait_mobile_to("tcp", moved_srv.ip());
    assert_eq!(gone_discarded(&lapd), 0, "nothing is gone before the move");

    topo.move_laptop_to_b();
    // The managed connection moved: its old address is on lo now, and on
    // no other interface.
    moved.wait_progress(&m0, 20_000, Duration::from_secs(10));
    // Segments, not bytes: a retransmission of what the server has already
    // would show as a segment received, not as a byte.
    thread::sleep(Duration::from_millis(500));
    let before = tcp_segs_received(&topo.server, stay_srv, stay_local);
    thread::sleep(Duration::from_secs(3));
    let after = tcp_segs_received(&topo.server, stay_srv, stay_local);
    assert_eq!(
        after, before,
        "the unmanaged connection's packets left the laptop into network B with its address on A"
    );
    assert!(
        gone_discarded(&lapd) > 0,
        "the laptop's datapath counted none of them as discarded"
    );
    // Discarded without a device of vnat's: the sink (a veth pair) is for
    // mobile UDP flows' last-resort route alone, and creating it cost a
    // TCP move a millisecond before its first message to the peer.
    assert!(
        topo.laptop.link("vnat-sink").is_none(),
        "vnatd created its sink for a move of TCP connections alone"
    );
    assert_eq!(
        stay.wait_error(Duration::ZERO),
        None,
        "the unmanaged connection failed while its address was gone"
    );

    // Back on A: its address is on its interface again, and the connection
    // vnat never touched goes on where it was.
    let s1 = stay.latest().expect("a status of the unmanaged client");
    topo.move_laptop_to_a();
    stay.wait_progress(&s1, 20_000, Duration::from_secs(30));
    let m1 = moved.latest().expect("a status of the managed client");
    moved.wait_progress(&m1, 20_000, Duration::from_secs(30));
    drop(stay);
    drop(moved);
}
