//! The whole receive path of a paired endpoint: handle_datagram,
//! handle_timeout and the poll functions, on datagrams that are arbitrary,
//! or genuine ones from the peer with bytes changed, in any order and at
//! any time. Invariants: no panic, nothing sent larger than the MTU, and no
//! binding moves to an address nobody validated.
#![no_main]

use std::net::SocketAddr;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use vnat_vcmp::crypto::{DrbgRng, HostIdentity};
use vnat_vcmp::export::{ConnectionExport, HexKey, EXPORT_VERSION};
use vnat_vcmp::flow::{Proto, VirtualFlow};
use vnat_vcmp::replay::ReplayWindow;
use vnat_vcmp::roles::RoleState;
use vnat_vcmp::{Config, Endpoint, Event, Timestamp};

const A: &str = "10.0.0.1:2031";

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("address")
}

fn flow(i: u16) -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Tcp,
        local: sa(&format!("10.0.0.1:{}", 40000 + i)),
        remote: sa("10.0.0.2:22"),
    }
}

fn rev(f: &VirtualFlow) -> VirtualFlow {
    VirtualFlow {
        proto: f.proto,
        local: f.remote,
        remote: f.local,
    }
}

/// Both ends' keys without a pairing handshake (whose DH would dominate
/// the run time): the connections are imported with one root key, as if
/// they had migrated here.
fn import(ep: &mut Endpoint, f: VirtualFlow) {
    let e = ConnectionExport {
        version: EXPORT_VERSION,
        flow: f,
        local_phys: f.local,
        remote_phys: f.remote,
        peer_key: None,
        root_key: HexKey("5a".repeat(32)),
        send_seq: 0,
        replay: ReplayWindow::default(),
        binding_seq: 0,
        location_seq: 0,
        role: RoleState::default(),
        tcp_isns: None,
        udp_ends: None,
        peer_named: None,
        prev_root_key: None,
        send_prev: false,
        keyx_answer: None,
    };
    ep.import_connection(&e).expect("import");
}

fuzz_target!(|data: &[u8]| {
    let mut rng = DrbgRng::from_seed(7);
    let mut a = Endpoint::new(Config::default(), HostIdentity::from_bytes([1; 32]));
    let mut b = Endpoint::new(Config::default(), HostIdentity::from_bytes([2; 32]));
    let mut now = Timestamp(1_000_000_000);
    for i in 0..2 {
        import(&mut a, flow(i));
        import(&mut b, rev(&flow(i)));
    }
    // Genuine messages from A: suspend-time claims and key agreement, then
    // the resume-time LOOKUP, STORE and UPD.
    let flows = [flow(0), flow(1)];
    a.suspend(now, &mut rng, &flows).expect("suspend");
    let mut genuine = Vec::new();
    while let Some(t) = a.poll_transmit(now) {
        genuine.push(t.payload);
    }
    let moves: Vec<_> = flows
        .iter()
        .map(|f| (*f, sa(&format!("10.0.1.1:{}", f.local.port()))))
        .collect();
    a.resume(now, &mut rng, &moves).expect("resume");
    while let Some(t) = a.poll_transmit(now) {
        genuine.push(t.payload);
    }
    while b.poll_event().is_some() {}

    let mut i = 0;
    while i < data.len() {
        let op = data[i];
        i += 1;
        match op % 4 {
            0 => {
                // Arbitrary datagram.
                let len = usize::from(*data.get(i).unwrap_or(&0));
                i += 1;
                let start = i.min(data.len());
                let end = (i + len).min(data.len());
                let src = if op & 0x80 != 0 {
                    sa("10.0.1.1:2031")
                } else {
                    sa(A)
                };
                b.handle_datagram(now, &mut rng, src, &data[start..end]);
                i = end;
            }
            1 => {
                // A genuine datagram, with up to two bytes changed.
                let (Some(&which), Some(&at), Some(&x)) =
                    (data.get(i), data.get(i + 1), data.get(i + 2))
                else {
                    break;
                };
                i += 3;
                let mut d = genuine[usize::from(which) % genuine.len()].clone();
                let pos = usize::from(at) % d.len();
                d[pos] ^= x;
                let src = if op & 0x80 != 0 {
                    sa("10.0.1.1:2031")
                } else {
                    sa(A)
                };
                b.handle_datagram(now, &mut rng, src, &d);
            }
            2 => {
                let step = u64::from(*data.get(i).unwrap_or(&1));
                i += 1;
                now = now.plus(Duration::from_millis(step * 50));
                b.handle_timeout(now, &mut rng);
            }
            _ => {
                if let Some(&which) = data.get(i) {
                    i += 1;
                    let d = genuine[usize::from(which) % genuine.len()].clone();
                    b.handle_datagram(now, &mut rng, sa("10.0.1.1:2031"), &d);
                }
            }
        }
        while let Some(t) = b.poll_transmit(now) {
            assert!(
                t.payload.len() <= 1500 - 28,
                "datagram larger than the path MTU"
            );
        }
        while let Some(e) = b.poll_event() {
            if let Event::SetRemote { remote, .. } = e {
                // Only A's genuine new address (or its old one) may be bound.
                assert!(
                    remote.ip() == sa("10.0.1.1:1").ip() || remote.ip() == sa(A).ip(),
                    "binding moved to an address A never claimed: {remote}"
                );
            }
        }
        let _ = b.poll_timeout();
    }
});
