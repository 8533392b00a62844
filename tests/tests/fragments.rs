//! Fragments of translated flows (issue 16, item 9). A UDP flow whose
//! datagrams are larger than the path MTU (3,000 bytes over 1,500) travels
//! as IP fragments, and only the first fragment carries the ports the tc
//! translators match on. Before, the later fragments passed untranslated
//! (`pass_fragment`), so after a move no datagram could be reassembled and
//! the flow went silent. Now the first fragment's flow is remembered by the
//! datagram's identification and the later ones are translated with it.
//!
//! Real vnatd on both hosts, automatic mode, IPv4 and IPv6: the laptop
//! moves while echoing 3,000-byte datagrams, and every datagram after the
//! move comes back whole.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, TempDir, Vnatd,
};

const SIZE: usize = 3000;

fn counter(d: &Vnatd, name: &str) -> u64 {
    d.ctl(&["status"]).unwrap_or_default()["datapath"]["counters"][name]
        .as_u64()
        .unwrap_or(0)
}

fn large_datagrams_survive_the_move(tag: &str, v6: bool) {
    let topo = LaptopRouterServer::builder().tag(tag).ipv6(v6).build();
    let (lap_dir, srv_dir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (server_ip, laptop_ip): (IpAddr, IpAddr) = if v6 {
        (topo.server_addr.v6().into(), topo.laptop_a_addr.v6().into())
    } else {
        (topo.server_addr.v4.into(), topo.laptop_a_addr.v4.into())
    };
    let lapd = Vnatd::start(&lap, lap_dir.path());
    let srvd = Vnatd::start(&srv, srv_dir.path());
    let server = SocketAddr::new(server_ip, 5003);
    let _echo = EchoServer::udp_sized_in(&srv, server, SIZE);
    let mut cmd = StreamOptions::udp(server)
        .datagram_size(SIZE)
        .rate(600_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    client.wait_verified_at_least(100_000, Duration::from_secs(10));
    let t = Instant::now();
    while !(lapd.mobile_to("udp", server_ip) && srvd.mobile_to("udp", laptop_ip)) {
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "the UDP flow never became mobile: {}",
            lapd.ctl(&["ls"]).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let at_move = client.latest().expect("status").verified;
    topo.move_laptop_to_b();
    let after = client.wait_verified_at_least(at_move + 1_500_000, Duration::from_secs(20));
    let fin = client.stop();
    assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
    let (lap_frag, srv_frag) = (
        counter(&lapd, "fragment_translated"),
        counter(&srvd, "fragment_translated"),
    );
    eprintln!(
        "{tag}: {} bytes verified after the move; fragments translated: laptop {lap_frag}, \
         server {srv_frag}; passed untranslated: laptop {}, server {}",
        after.verified - at_move,
        counter(&lapd, "pass_fragment"),
        counter(&srvd, "pass_fragment")
    );
    // Both ends translate the later fragments, both ways.
    assert!(
        lap_frag > 100 && srv_frag > 100,
        "fragments were not translated"
    );
}

#[test]
fn ipv4_fragments_of_a_moved_udp_flow_are_translated() {
    large_datagrams_survive_the_move("frg4", false);
}

#[test]
fn ipv6_fragments_of_a_moved_udp_flow_are_translated() {
    large_datagrams_survive_the_move("frg6", true);
}
