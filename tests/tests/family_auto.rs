//! Automatic mode carries an IPv4 connection over IPv6 (issue 32, item 3):
//! real vnatd on both hosts, nobody gives a command. The laptop leaves for
//! a network where it has only IPv6 (the server has both), and comes back.
//! Its vnatd learnt the server's IPv6 address from the server's keepalives
//! (`vnatctl peers` lists it), moves the connection there, and the
//! server's vnatd follows into IPv6 at the address the update came to.
//! Same socket, every byte in order, no error, TCP and UDP; both vnatds
//! list the connection over IPv6 while it is there and untranslated once
//! back. (`family_move.rs` tests the datapath's part alone.)

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use serde_json::Value;
use vnat_tests::{
    EchoServer, Host, LaptopRouterServer, StreamClient, StreamOptions, StreamStatus, TempDir, Vnatd,
};

/// Fast enough that a few hundred kB are in flight across each move.
const RATE: u64 = 2_000_000;

/// The one `ls` row of `proto` whose virtual remote end is `remote`.
fn row(d: &Vnatd, proto: &str, remote: SocketAddr) -> Option<Value> {
    d.ctl(&["ls", "--proto", proto])?
        .as_array()?
        .iter()
        .find(|r| r["virtual_remote"].as_str() == Some(remote.to_string().as_str()))
        .cloned()
}

/// Wait (at most `secs`) until the row of `proto` to `remote` is sent
/// from `local` to `phys_remote` (physical addresses, ports aside).
fn wait_placed(
    d: &Vnatd,
    what: &str,
    proto: &str,
    remote: SocketAddr,
    local: IpAddr,
    phys_remote: IpAddr,
    secs: u64,
) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let r = row(d, proto, remote);
        let at = |k: &str| {
            r.as_ref()
                .and_then(|r| r[k].as_str())
                .and_then(|s| s.parse::<SocketAddr>().ok())
                .map(|a| a.ip())
        };
        if at("physical_local") == Some(local) && at("physical_remote") == Some(phys_remote) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: the {proto} connection to {remote} is not sent from {local} to {phys_remote}: {r:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What each test here runs on: real vnatd on both hosts (the server with
/// IPv4 and, if `server_v6`, IPv6), the server's echo and the laptop's
/// stream to it over IPv4, mobile at both ends.
struct Bed<'a> {
    topo: &'a LaptopRouterServer,
    lapd: Vnatd,
    srvd: Vnatd,
    client: StreamClient,
    /// The stream's status once it ran, before anything moved.
    before: StreamStatus,
    /// The server's end, IPv4.
    server: SocketAddr,
    /// The laptop's end as the server names it.
    laptop_end: SocketAddr,
}

impl Bed<'_> {
    /// Wait until the stream has verified `bytes` more, within `secs`.
    fn goes_on(&self, bytes: u64, secs: u64) -> StreamStatus {
        let at = self
            .client
            .latest()
            .expect("no status from the stream")
            .verified;
        self.client
            .wait_verified_at_least(at + bytes, Duration::from_secs(secs))
    }
}

fn with_bed(tag: &str, proto: &str, server_v6: bool, test: impl FnOnce(Bed<'_>)) {
    let topo = LaptopRouterServer::builder().tag(tag).ipv6(true).build();
    if !server_v6 {
        topo.server
            .del_addr(&topo.server_if, topo.server_addr.v6().into(), 64);
    }
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let (lap_dir, srv_dir) = (
        TempDir::new(&format!("{tag}l")),
        TempDir::new(&format!("{tag}s")),
    );
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = match proto {
        "tcp" => EchoServer::tcp_in(&srv, server),
        _ => EchoServer::udp_in(&srv, server),
    };
    let lapd = Vnatd::start(&lap, lap_dir.path());
    let srvd = Vnatd::start(&srv, srv_dir.path());
    let opts = match proto {
        "tcp" => StreamOptions::tcp(server),
        _ => StreamOptions::udp(server),
    }
    .rate(RATE);
    let mut cmd = opts.command(lap.ns);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = StreamClient::from_command(cmd);
    let before = client.wait_verified_at_least(200_000, Duration::from_secs(15));
    lapd.wait_mobile_to(proto, server.ip());
    srvd.wait_mobile_to(proto, topo.laptop_a_addr.v4.into());
    if server_v6 {
        // The server told the laptop its addresses, IPv6 included.
        lapd.wait_told(topo.server_addr.v6().into());
    }
    let laptop_end = before.local.parse().expect("the stream's local address");
    test(Bed {
        topo: &topo,
        lapd,
        srvd,
        client,
        before,
        server,
        laptop_end,
    });
}

fn v4_connection_goes_over_v6_and_back(proto: &str, tag: &str) {
    with_bed(tag, proto, true, |bed| {
        let Bed {
            topo,
            lapd,
            srvd,
            client,
            before,
            server,
            laptop_end,
        } = bed;
        let server_v6: IpAddr = topo.server_addr.v6().into();
        let laptop_v4: IpAddr = topo.laptop_a_addr.v4.into();
        let laptop_v6: IpAddr = topo.laptop_b_addr.v6().into();
        // To the IPv6-only network.
        let t0 = Instant::now();
        topo.move_laptop_to_b_v6_only();
        let at = client.latest().expect("no status from the stream").verified;
        let after = client.wait_verified_at_least(at + 1_000_000, Duration::from_secs(30));
        eprintln!(
            "{tag}: 1 MB verified {:?} after the laptop lost IPv4",
            t0.elapsed()
        );
        wait_placed(&lapd, "laptop", proto, server, laptop_v6, server_v6, 10);
        wait_placed(&srvd, "server", proto, laptop_end, server_v6, laptop_v6, 10);
        let after =
            client.wait_verified_at_least(after.verified + 500_000, Duration::from_secs(20));
        // The server's end is in IPv6 because the laptop moved there: its own
        // IPv4 address never went, and its vnatd must not take that for a
        // return home (it did: a move of its own to IPv4, where the laptop
        // has nothing, held its packets for 2 s). Its plans run every second
        // or so: after a few of them the row is as it was, moved by the peer.
        std::thread::sleep(Duration::from_secs(3));
        let r = row(&srvd, proto, laptop_end).expect("the server lists the connection");
        let server_end = SocketAddr::new(server_v6, server.port()).to_string();
        assert_eq!(
            (
                r["physical_local"].as_str(),
                r["last_move"]["side"].as_str()
            ),
            (Some(server_end.as_str()), Some("peer")),
            "the server moved its own end: {r}"
        );
        let after = client.wait_verified_at_least(after.verified + 500_000, Duration::from_secs(5));

        // Back to A: IPv4 again, no translation left at either end.
        let t1 = Instant::now();
        topo.move_laptop_to_a();
        let at = client
            .latest()
            .expect("no status from the stream")
            .verified
            .max(after.verified);
        let back = client.wait_verified_at_least(at + 1_000_000, Duration::from_secs(30));
        eprintln!(
            "{tag}: 1 MB verified {:?} after the laptop came back",
            t1.elapsed()
        );
        wait_placed(&lapd, "laptop", proto, server, laptop_v4, server.ip(), 10);
        wait_placed(
            &srvd,
            "server",
            proto,
            laptop_end,
            server.ip(),
            laptop_v4,
            10,
        );

        let fin = client.stop();
        assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
        assert_eq!(fin.local, before.local, "the client's socket changed");
        assert!(fin.verified >= back.verified);
    });
}

#[test]
fn tcp_v4_connection_goes_over_v6_by_itself_and_back() {
    v4_connection_goes_over_v6_and_back("tcp", "fat");
}

#[test]
fn udp_v4_flow_goes_over_v6_by_itself_and_back() {
    v4_connection_goes_over_v6_and_back("udp", "fau");
}

/// `vnatctl migrate` puts one IPv4 connection onto the laptop's IPv6
/// address while IPv4 stays up (a link that gives only IPv6, such as a
/// cellular one, chosen for this connection), and back by the same
/// command: carried over IPv6 between the two hosts' IPv6 addresses, the
/// stream goes on byte-exact; `migrate --wait` reports each move done.
#[test]
fn migrate_puts_a_v4_connection_on_ipv6_and_back() {
    with_bed("fam", "tcp", true, |bed| {
        let (topo, server) = (bed.topo, bed.server);
        let server_v6: IpAddr = topo.server_addr.v6().into();
        let laptop_v4: IpAddr = topo.laptop_a_addr.v4.into();
        let laptop_v6: IpAddr = topo.laptop_a_addr.v6().into();
        let id = row(&bed.lapd, "tcp", server).expect("the laptop lists the connection")["id"]
            .to_string();
        for (to, server_to) in [(laptop_v6, server_v6), (laptop_v4, server.ip())] {
            let out = bed
                .lapd
                .ctl(&["migrate", "--conn", &id, "--wait", "--to", &to.to_string()])
                .expect("vnatd answers");
            assert_eq!(
                out["moves"][0]["outcome"], "moved",
                "migrate --to {to}: {out}"
            );
            wait_placed(&bed.lapd, "laptop", "tcp", server, to, server_to, 10);
            wait_placed(
                &bed.srvd,
                "server",
                "tcp",
                bed.laptop_end,
                server_to,
                to,
                10,
            );
            bed.goes_on(500_000, 20);
        }
        let fin = bed.client.stop();
        assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
        assert_eq!(fin.local, bed.before.local, "the client's socket changed");
    });
}

/// An IPv4 connection told to move onto an IPv6 address whose peer has no
/// IPv6 address: `migrate` refuses it in one sentence that says why, and
/// the connection stays where it was, working.
#[test]
fn migrate_onto_ipv6_without_a_peer_address_there_says_so_and_changes_nothing() {
    // The server has only IPv4: it tells no IPv6 address.
    with_bed("fan", "tcp", false, |bed| {
        let server = bed.server;
        let laptop_v6: IpAddr = bed.topo.laptop_a_addr.v6().into();
        let id = row(&bed.lapd, "tcp", server).expect("the laptop lists the connection")["id"]
            .to_string();
        let (code, out) =
            bed.lapd
                .ctl_status(&["migrate", "--conn", &id, "--to", &laptop_v6.to_string()]);
        let text = out.to_string();
        assert!(
            code != 0 && text.contains("has told no IPv6 address"),
            "expected a refusal that says the peer has no IPv6 address, got {code}: {text}"
        );
        let r = row(&bed.lapd, "tcp", server).expect("the laptop lists the connection");
        assert_eq!(r["physical_local"], bed.before.local.as_str(), "{r}");
        bed.goes_on(200_000, 10);
        let fin = bed.client.stop();
        assert_eq!(fin.error, None, "the stream broke: {:?}", fin.json);
    });
}
