//! The binding path of a server paired with one genuine peer: CLAIM,
//! BIND_REQ, in-band BIND, PROVE and PROVE_R. The fuzzer adds connections
//! at both ends (its choice of protocol, ports, addresses and whether the
//! two ends' facts agree), so that the peer's claims and BINDs, which only
//! it can tag, carry entries the fuzzer chose; it decides what is
//! delivered, from which source (the peer's VCMP address, a flow's
//! endpoint, a third address), with bytes changed or made up, and when
//! time passes. Everything goes through the public entry points
//! (`handle_datagram`, `handle_timeout`, `connection_added`), so the
//! target follows changes to the protocol's insides.
//!
//! Invariants: no panic; a connection of the server is only ever bound to
//! the peer's key; no TCP connection whose remote address is one the peer
//! never held (nothing the server sends there reaches the peer) is bound
//! to it; every datagram fits the MTU.
#![no_main]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use vnat_vcmp::binding::Binding;
use vnat_vcmp::crypto::{DrbgRng, HostIdentity};
use vnat_vcmp::flow::{Proto, VirtualFlow};
use vnat_vcmp::{Config, Endpoint, Event, Timestamp};

/// The server (S) and the peer (P); X is an address where nothing runs.
const S_IP: &str = "10.0.0.2";
const P_IP: &str = "10.0.0.1";
const X_IP: &str = "10.0.0.9";
const PORT: u16 = 2031;

/// Takes bytes off the front of the input.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes([self.byte()?, self.byte()?]))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes([
            self.byte()?,
            self.byte()?,
            self.byte()?,
            self.byte()?,
        ]))
    }
}

/// A datagram on its way: source, destination, bytes.
type Wire = Vec<(SocketAddr, SocketAddr, Vec<u8>)>;

/// Take what `ep` (at `own`) has to send, and its events; the driver's
/// part: a DivertBinds is answered at once, an in-band BIND leaves from
/// the flow's endpoint.
fn drain(ep: &mut Endpoint, own: IpAddr, now: Timestamp, out: &mut Wire, events: &mut Vec<Event>) {
    while let Some(e) = ep.poll_event() {
        match &e {
            Event::DivertBinds { toward } => ep.binds_diverted(*toward, true),
            Event::SendInBand {
                local,
                remote,
                payload,
            } => out.push((*local, *remote, payload.clone())),
            _ => {}
        }
        events.push(e);
    }
    while let Some(t) = ep.poll_transmit(now) {
        assert!(t.payload.len() <= 1500 - 48, "datagram larger than the MTU");
        out.push((SocketAddr::new(own, PORT), t.dst, t.payload));
    }
    out.truncate(256);
}

/// Deliver `w` to `ep` as its host's network would: to its VCMP port, or a
/// BIND to another port of its address with that port written in (the tc
/// divert); anything else reaches no vnatd.
fn deliver(
    ep: &mut Endpoint,
    rng: &mut DrbgRng,
    now: Timestamp,
    from: SocketAddr,
    to: SocketAddr,
    b: &[u8],
) {
    if to.port() == PORT {
        ep.handle_datagram(now, rng, from, b);
    } else if b.len() > 4 {
        let mut b = b.to_vec();
        b[2..4].copy_from_slice(&to.port().to_be_bytes());
        ep.handle_datagram(now, rng, from, &b);
    }
}

fn ip_of(sel: u8) -> IpAddr {
    match sel % 3 {
        0 => P_IP,
        1 => X_IP,
        _ => "10.0.0.7",
    }
    .parse()
    .expect("ip")
}

fuzz_target!(|data: &[u8]| {
    let mut rng = DrbgRng::from_seed(23);
    let s_ip: IpAddr = S_IP.parse().expect("ip");
    let p_ip: IpAddr = P_IP.parse().expect("ip");
    let x_ip: IpAddr = X_IP.parse().expect("ip");
    let p_key = HostIdentity::from_bytes([1; 32]).public();
    let mut p = Endpoint::new(Config::default(), HostIdentity::from_bytes([1; 32]));
    let mut s = Endpoint::new(Config::default(), HostIdentity::from_bytes([2; 32]));
    let mut now = Timestamp(1_000_000_000);
    let mut s_events = Vec::new();
    let mut p_events = Vec::new();
    let (mut to_s, mut to_p): (Wire, Wire) = (Vec::new(), Vec::new());

    // One TCP connection both ends know, so that they pair first.
    let f = VirtualFlow {
        proto: Proto::Tcp,
        local: SocketAddr::new(p_ip, 40000),
        remote: SocketAddr::new(s_ip, 443),
    };
    let back = VirtualFlow {
        proto: Proto::Tcp,
        local: f.remote,
        remote: f.local,
    };
    p.connection_added(now, &mut rng, f, f.local, f.remote, Binding::tcp(7, 9))
        .expect("add on p");
    s.connection_added(
        now,
        &mut rng,
        back,
        back.local,
        back.remote,
        Binding::tcp(9, 7),
    )
    .expect("add on s");
    for _ in 0..8 {
        drain(&mut p, p_ip, now, &mut to_s, &mut p_events);
        for (from, to, b) in std::mem::take(&mut to_s) {
            if to.ip() == s_ip {
                deliver(&mut s, &mut rng, now, from, to, &b);
            }
        }
        drain(&mut s, s_ip, now, &mut to_p, &mut s_events);
        for (from, to, b) in std::mem::take(&mut to_p) {
            if to.ip() == p_ip {
                deliver(&mut p, &mut rng, now, from, to, &b);
            }
        }
    }

    let mut input = Input(data);
    let mut added = 0u32;
    while let Some(op) = input.byte() {
        match op % 8 {
            0 | 1 => {
                // A connection at both ends (or at one), with facts that
                // agree or not: the peer claims it, maybe asks for BINDs.
                let (Some(sel), Some(pport), Some(sport), Some(isn)) =
                    (input.byte(), input.u16(), input.u16(), input.u32())
                else {
                    break;
                };
                if added >= 32 {
                    continue;
                }
                added += 1;
                let proto = if sel & 1 == 0 { Proto::Tcp } else { Proto::Udp };
                let remote_ip = ip_of(sel >> 1);
                let pf = VirtualFlow {
                    proto,
                    local: SocketAddr::new(remote_ip, pport.max(1)),
                    remote: SocketAddr::new(s_ip, sport.max(1)),
                };
                let sf = VirtualFlow {
                    proto,
                    local: pf.remote,
                    remote: pf.local,
                };
                let agree = sel & 0x10 == 0;
                let (pb, sb) = match proto {
                    Proto::Tcp => (
                        Binding::tcp(isn, isn ^ 0x5a5a),
                        Binding::tcp(isn ^ 0x5a5a, if agree { isn } else { !isn }),
                    ),
                    Proto::Udp => (Binding::endpoints(&pf), Binding::endpoints(&sf)),
                };
                if op % 8 == 0 || sel & 0x20 == 0 {
                    let _ = s.connection_added(now, &mut rng, sf, sf.local, sf.remote, sb);
                }
                if op % 8 == 1 || sel & 0x20 == 0 {
                    let _ = p.connection_added(now, &mut rng, pf, pf.local, pf.remote, pb);
                }
            }
            2 => {
                // The peer's datagrams reach the server from where they
                // were sent.
                for (from, to, b) in std::mem::take(&mut to_s) {
                    if to.ip() == s_ip {
                        deliver(&mut s, &mut rng, now, from, to, &b);
                    }
                }
            }
            3 => {
                // The server's datagrams reach the peer, if sent to it:
                // what goes to another address (a PROVE there) is lost.
                for (from, to, b) in std::mem::take(&mut to_p) {
                    if to.ip() == p_ip {
                        deliver(&mut p, &mut rng, now, from, to, &b);
                    }
                }
            }
            4 => {
                // One of the peer's datagrams, maybe changed, from a source
                // of the fuzzer's choice (forged), to the server.
                let (Some(which), Some(at), Some(x), Some(src)) =
                    (input.byte(), input.byte(), input.byte(), input.byte())
                else {
                    break;
                };
                if to_s.is_empty() {
                    continue;
                }
                let (from, to, mut b) = to_s[usize::from(which) % to_s.len()].clone();
                if !b.is_empty() && x != 0 {
                    let pos = usize::from(at) % b.len();
                    b[pos] ^= x;
                }
                let from = match src % 3 {
                    0 => from,
                    1 => SocketAddr::new(x_ip, from.port()),
                    _ => SocketAddr::new(ip_of(src >> 2), u16::from(src)),
                };
                deliver(
                    &mut s,
                    &mut rng,
                    now,
                    from,
                    SocketAddr::new(s_ip, to.port()),
                    &b,
                );
            }
            5 => {
                // Bytes of the fuzzer's, under a header of the binding
                // path's kinds (CLAIM 17, BIND 19, BIND_REQ 20, PROVE 24,
                // PROVE_R 25), to the server or the peer.
                let (Some(kind), Some(len), Some(src)) = (input.byte(), input.byte(), input.byte())
                else {
                    break;
                };
                let mut b = vec![1u8, [17, 19, 20, 24, 25][usize::from(kind) % 5]];
                b.extend((0..usize::from(len)).filter_map(|_| input.byte()));
                let from = SocketAddr::new(ip_of(src), if src & 0x80 != 0 { PORT } else { 40000 });
                if kind & 0x80 == 0 {
                    deliver(&mut s, &mut rng, now, from, SocketAddr::new(s_ip, PORT), &b);
                } else {
                    p.handle_datagram(now, &mut rng, SocketAddr::new(s_ip, PORT), &b);
                }
            }
            6 => {
                let step = u64::from(input.byte().unwrap_or(1));
                now = now.plus(Duration::from_millis(step * 50));
                s.handle_timeout(now, &mut rng);
                p.handle_timeout(now, &mut rng);
            }
            _ => {
                // A connection goes away at one end.
                let (Some(which), Some(side)) = (input.byte(), input.byte()) else {
                    break;
                };
                let ep = if side & 1 == 0 { &mut s } else { &mut p };
                let flows: Vec<VirtualFlow> = ep.connections().copied().collect();
                if !flows.is_empty() {
                    let f = flows[usize::from(which) % flows.len()];
                    ep.connection_removed(&f);
                }
            }
        }
        drain(&mut p, p_ip, now, &mut to_s, &mut p_events);
        drain(&mut s, s_ip, now, &mut to_p, &mut s_events);
        s_events.clear();
        p_events.clear();
        let _ = (s.poll_timeout(), p.poll_timeout());
        for f in s.connections() {
            let Some(c) = s.connection(f) else { continue };
            if let Some(k) = c.peer_key {
                assert_eq!(k, p_key, "bound to a key nobody paired with");
                assert!(
                    !(f.proto == Proto::Tcp
                        && c.remote_phys.ip() != p_ip
                        && c.remote_phys == f.remote),
                    "{f} bound to the peer, which never received at {}",
                    c.remote_phys.ip()
                );
            }
        }
    }
});
