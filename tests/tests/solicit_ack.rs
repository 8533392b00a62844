//! `solicit_ack`: vnatd makes a socket send one ACK when its peer's address
//! changed, so that a peer waiting for ACKs lost during the move (a full
//! congestion window) sends again at once instead of at its retransmission
//! timeout.
//!
//! An idle TCP connection between the laptop and the server (socat with
//! `sleep` on both ends, so neither sends data or keepalives). The server's
//! vnatd-side datapath is asked to solicit an ACK; the server's socket must
//! then have sent exactly one segment more and the laptop's received one
//! more, the connection must still be established with nothing queued, and
//! a second request within the kernel's rate limit sends nothing.

use std::{
    net::SocketAddr,
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use vnat_daemon::datapath::{Datapath, Proto, VirtualFlow};
use vnat_tests::{ss_endpoint, Capture, Family, Host, LaptopRouterServer, Netns};

const PORT: u16 = 5011;

fn socat_addr(a: SocketAddr) -> String {
    match a {
        SocketAddr::V4(a) => format!("{}:{}", a.ip(), a.port()),
        SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    }
}

/// `segs_out`, `segs_in` and the send queue of the established socket
/// `local -> remote`, from `ss -tinH`.
fn segs(ns: &Netns, local: SocketAddr, remote: SocketAddr) -> (u64, u64, u64) {
    let filter = format!("src {} and dst {}", ss_endpoint(local), ss_endpoint(remote));
    let out = ns.run_stdout(&["ss", "-tinH", "state", "established", &filter]);
    let words: Vec<&str> = out.split_whitespace().collect();
    assert!(
        !words.is_empty(),
        "no established socket {local} -> {remote} in {}",
        ns.name()
    );
    // ss leaves out counters that are still 0.
    let field = |name: &str| -> u64 {
        words
            .iter()
            .find_map(|w| w.strip_prefix(name))
            .map_or(0, |n| {
                n.parse().unwrap_or_else(|e| panic!("{name} in {out}: {e}"))
            })
    };
    // `ss -H`: State Recv-Q Send-Q ... for a filtered state, Recv-Q first.
    let send_q: u64 = words[1].parse().unwrap_or(0);
    (field("segs_out:"), field("segs_in:"), send_q)
}

fn check(family: Family, tag: &str) {
    let topo = LaptopRouterServer::builder()
        .tag(tag)
        .ipv6(family == Family::V6)
        .build();
    let lap = Host::new(&topo.laptop, &format!("{tag}l"));
    let srv = Host::new(&topo.server, &format!("{tag}s"));
    let server = SocketAddr::new(topo.server_addr.get(family), PORT);
    let listen = match server {
        SocketAddr::V4(a) => format!("TCP4-LISTEN:{},bind={},reuseaddr", a.port(), a.ip()),
        SocketAddr::V6(a) => format!(
            "TCP6-LISTEN:{},bind=[{}],ipv6only=1,reuseaddr",
            a.port(),
            a.ip()
        ),
    };
    let _server = srv.socat(&[&listen, "SYSTEM:sleep 60"], Stdio::null());
    topo.server.wait_tcp_listening(PORT);
    let connect = format!("TCP:{}", socat_addr(server));
    let _client = lap.socat(&[&connect, "SYSTEM:sleep 60"], Stdio::null());

    let conn = lap.wait_connection("the client's idle connection", |c| {
        c.proto == Proto::Tcp && c.virtual_remote == server
    });
    let flow = VirtualFlow {
        proto: Proto::Tcp,
        local: server,
        remote: conn.virtual_local,
    };
    srv.wait_connection("the server's accepted connection", move |c| {
        c.proto == Proto::Tcp && c.virtual_local == server && c.virtual_remote == flow.remote
    });
    // Let the handshake's last ACKs settle.
    thread::sleep(Duration::from_millis(300));
    let (srv_out, _, _) = segs(&topo.server, flow.local, flow.remote);
    let (_, lap_in, _) = segs(&topo.laptop, flow.remote, flow.local);
    // What reaches the laptop's link from the server's port, from now on.
    let wire = Capture::start(
        &topo.laptop,
        &topo.laptop_if_a,
        &format!("tcp and src port {PORT}"),
    );

    // Two requests back to back: within tcp_invalid_ratelimit (500 ms)
    // the kernel answers no second out-of-window segment, so the second
    // call is harmless and sends nothing. (Both from one opening of the
    // datapath: opening it again loads the programs, which on a loaded
    // machine took longer than the kernel's 500 ms.)
    let (solicited, again) = srv.datapath(move |dp| (dp.solicit_ack(&flow), dp.solicit_ack(&flow)));
    let solicited = solicited.unwrap_or_else(|e| panic!("solicit_ack({flow:?}): {e}"));
    again.expect("second solicit_ack");
    assert!(
        solicited,
        "solicit_ack found no established socket for {flow:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(2);
    let (srv_out2, lap_in2) = loop {
        let (o, _, q) = segs(&topo.server, flow.local, flow.remote);
        let (_, i, _) = segs(&topo.laptop, flow.remote, flow.local);
        assert_eq!(
            q, 0,
            "the server socket has data queued after the ACK request"
        );
        if i > lap_in || Instant::now() > deadline {
            break (o, i);
        }
        thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        (srv_out2 - srv_out, lap_in2 - lap_in),
        (1, 1),
        "the server socket should have sent exactly one segment (an ACK) for the two requests, and the laptop received it"
    );
    // On the wire: that segment is a pure ACK from the server's endpoint to
    // the laptop's, no data, no reset.
    let line = wire.wait_for(
        // tcpdump -nn writes an endpoint as ADDRESS.PORT.
        &format!("> {}.{}: Flags [.]", flow.remote.ip(), flow.remote.port()),
        Duration::from_secs(2),
    );
    assert!(
        line.ends_with("length 0"),
        "the solicited segment carries data: {line}"
    );

    // Nothing more follows the one ACK.
    thread::sleep(Duration::from_millis(200));
    let (srv_out3, _, _) = segs(&topo.server, flow.local, flow.remote);
    assert_eq!(
        srv_out3, srv_out2,
        "the second request within 500 ms sent a segment"
    );
    assert_eq!(
        wire.lines().len(),
        1,
        "exactly one segment from the server reached the laptop's link: {:?}",
        wire.lines()
    );

    // UDP flows and unknown connections are not touched.
    let udp = VirtualFlow {
        proto: Proto::Udp,
        ..flow
    };
    assert!(!srv.datapath(move |dp| dp.solicit_ack(&udp)).expect("udp"));
    let unknown = VirtualFlow {
        remote: SocketAddr::new(flow.remote.ip(), 1),
        ..flow
    };
    assert!(!srv
        .datapath(move |dp| dp.solicit_ack(&unknown))
        .expect("unknown"));
}

#[test]
fn solicits_one_ack_v4() {
    check(Family::V4, "sak4");
}

#[test]
fn solicits_one_ack_v6() {
    check(Family::V6, "sak6");
}
