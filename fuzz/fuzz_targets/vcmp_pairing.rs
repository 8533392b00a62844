//! The pairing handshake of a responder under arbitrary input: PAIR_INIT,
//! PAIR_RESP, PAIR_FIN and PAIR_COOKIE with fuzzer-chosen fields and
//! sources (the peer's address among them), the genuine initiator's
//! messages with bytes changed, its cookie echoes, and time passing.
//! Invariants: no panic; the only host the responder ever pairs with is
//! the genuine initiator (whose key only it holds); the handshake table
//! stays within its limit; the fuzzer's own PAIR_INITs cost a DH only
//! within the per-source limit or with a cookie it could not have seen.
#![no_main]

use std::net::SocketAddr;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use vnat_vcmp::binding::Binding;
use vnat_vcmp::crypto::{DrbgRng, HostIdentity};
use vnat_vcmp::flow::{Proto, VirtualFlow};
use vnat_vcmp::stats::Counter;
use vnat_vcmp::wire::Message;
use vnat_vcmp::{Config, Endpoint, Event, Timestamp};

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("address")
}

const A_VCMP: &str = "10.0.0.1:2031";

fn flow() -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Tcp,
        local: sa("10.0.0.2:443"),
        remote: sa("10.0.0.1:40000"),
    }
}

/// Takes bytes off the front of the input.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(*b)
    }
    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        if self.0.len() < N {
            return None;
        }
        let mut a = [0u8; N];
        a.copy_from_slice(&self.0[..N]);
        self.0 = &self.0[N..];
        Some(a)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut rng = DrbgRng::from_seed(11);
    let cfg = Config {
        max_pending_pairings: 8,
        ..Config::default()
    };
    let a_key = HostIdentity::from_bytes([1; 32]).public();
    let mut a = Endpoint::new(Config::default(), HostIdentity::from_bytes([1; 32]));
    let mut b = Endpoint::new(cfg, HostIdentity::from_bytes([2; 32]));
    let mut now = Timestamp(1_000_000_000);
    let f = flow();
    let rev = VirtualFlow {
        proto: f.proto,
        local: f.remote,
        remote: f.local,
    };
    b.connection_added(now, &mut rng, f, f.local, f.remote, Binding::endpoints(&f))
        .expect("add on b");
    a.connection_added(
        now,
        &mut rng,
        rev,
        rev.local,
        rev.remote,
        Binding::endpoints(&rev),
    )
    .expect("add on a");
    // What each has to say, kept off the wire: the fuzzer decides what
    // reaches whom.
    let mut to_b: Vec<Vec<u8>> = Vec::new();
    while let Some(t) = a.poll_transmit(now) {
        to_b.push(t.payload);
    }
    let mut to_a: Vec<Vec<u8>> = Vec::new();
    while let Some(t) = b.poll_transmit(now) {
        to_a.push(t.payload);
    }
    let mut own_inits = 0u64;
    let mut input = Input(data);
    while let Some(op) = input.byte() {
        match op % 6 {
            0 => {
                // A fuzzer-made pairing message, from A's address or another.
                let Some(kind) = input.byte() else { break };
                let Some(id) = input.array::<4>() else { break };
                let Some(k1) = input.array::<32>() else { break };
                let Some(k2) = input.array::<32>() else { break };
                let id = u32::from_be_bytes(id);
                let msg = match kind % 4 {
                    0 => {
                        own_inits += 1;
                        Message::PairInit {
                            request_id: id,
                            static_pub: k1,
                            eph_pub: k2,
                            cookie: (kind & 0x80 != 0).then(|| {
                                let mut c = [0u8; 16];
                                c.copy_from_slice(&k2[..16]);
                                c
                            }),
                        }
                    }
                    1 => Message::PairResp {
                        request_id: id,
                        static_pub: k1,
                        eph_pub: k2,
                        tag: k1,
                    },
                    2 => Message::PairFin {
                        request_id: id,
                        tag: k2,
                    },
                    _ => {
                        let mut c = [0u8; 16];
                        c.copy_from_slice(&k1[..16]);
                        Message::PairCookie {
                            request_id: id,
                            cookie: c,
                        }
                    }
                };
                let src = if kind & 0x40 != 0 {
                    sa(A_VCMP)
                } else {
                    sa(&format!("10.0.0.1:{}", 1000 + u16::from(kind)))
                };
                if let Ok(bytes) = msg.encode() {
                    b.handle_datagram(now, &mut rng, src, &bytes);
                }
            }
            1 => {
                // A's next message to B, maybe with a byte changed.
                let (Some(which), Some(at), Some(x)) = (input.byte(), input.byte(), input.byte())
                else {
                    break;
                };
                if to_b.is_empty() {
                    continue;
                }
                let mut d = to_b[usize::from(which) % to_b.len()].clone();
                let pos = usize::from(at) % d.len();
                d[pos] ^= x;
                b.handle_datagram(now, &mut rng, sa(A_VCMP), &d);
            }
            2 => {
                // B's messages reach A, and A answers (its replies queue).
                for d in std::mem::take(&mut to_a) {
                    a.handle_datagram(now, &mut rng, sa("10.0.0.2:2031"), &d);
                }
                while let Some(t) = a.poll_transmit(now) {
                    to_b.push(t.payload);
                }
            }
            3 => {
                // A's messages reach B unchanged.
                for d in std::mem::take(&mut to_b) {
                    b.handle_datagram(now, &mut rng, sa(A_VCMP), &d);
                }
            }
            4 => {
                let step = u64::from(input.byte().unwrap_or(1));
                now = now.plus(Duration::from_millis(step * 100));
                a.handle_timeout(now, &mut rng);
                b.handle_timeout(now, &mut rng);
                while let Some(t) = a.poll_transmit(now) {
                    to_b.push(t.payload);
                }
            }
            _ => {
                // A fuzzer-made datagram of any kind from A's address.
                let len = usize::from(input.byte().unwrap_or(0));
                let bytes: Vec<u8> = (0..len).filter_map(|_| input.byte()).collect();
                b.handle_datagram(now, &mut rng, sa(A_VCMP), &bytes);
            }
        }
        while let Some(t) = b.poll_transmit(now) {
            assert!(t.payload.len() <= 1500 - 48, "datagram larger than the MTU");
            if t.dst == sa(A_VCMP) {
                to_a.push(t.payload);
            }
        }
        while a.poll_event().is_some() {}
        while let Some(e) = b.poll_event() {
            if let Event::Paired { key, .. } = e {
                assert_eq!(key, a_key, "paired with a key only the fuzzer holds");
            }
        }
        to_a.truncate(64);
        to_b.truncate(64);
        let _ = b.poll_timeout();
    }
    // Each DH of B as responder is A's (a new attempt at most every 5 s),
    // one within the per-source limit (every source here is A's IP: a
    // burst of 5, then 2 a second), or a replay of A's own cookie-bearing
    // PAIR_INIT after its handshake ended (one per handshake lifetime,
    // about 15 s). The fuzzer cannot make a valid cookie of its own.
    let st = b.stats();
    let elapsed_s = now.since(Timestamp(1_000_000_000)).as_secs() + 1;
    let bound = 10 + 3 * elapsed_s;
    let dh = st.get(Counter::PairDhComputed);
    assert!(
        dh <= bound,
        "{dh} DH (at most {bound}) for {own_inits} fuzzer PAIR_INITs in {elapsed_s} s"
    );
});
