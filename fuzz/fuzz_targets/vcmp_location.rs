//! The location store of a vnatd serving as a location server, through its
//! receive path: STORE and LOOKUP datagrams with fuzzer-chosen records from
//! fuzzer-chosen sources, replays, and time passing. A genuine owner stored
//! its record first, from its own address, which the fuzzer never uses.
//! Invariants: no panic; the store never holds more than its limit; while
//! the genuine record is within its lifetime, a LOOKUP for its connection
//! returns it, whatever the fuzzer stored (forged records may sit beside
//! it, never in its place), even knowing its locator (an on-path forger
//! that saw the STORE).
#![no_main]

use std::net::SocketAddr;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use vnat_vcmp::crypto::{DrbgRng, HostIdentity};
use vnat_vcmp::flow::Proto;
use vnat_vcmp::location::StoreLimits;
use vnat_vcmp::wire::{Ext, Family, Kind, Message, Record};
use vnat_vcmp::{Config, Endpoint, Timestamp};

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("address")
}

const OWNER: &str = "10.0.0.1:40000";
const OTHER: &str = "10.0.0.2:443";
const OWNER_SRC: &str = "10.0.5.1:2031";
/// The genuine connection's locator.
const LOCATOR: [u8; 16] = [0xc4; 16];

fn store(rec: Record, id: u32) -> Vec<u8> {
    Message::Records {
        kind: Kind::Store,
        request_id: id,
        family: Family::V4,
        records: vec![rec],
    }
    .encode()
    .expect("encode")
}

fn lookup(owner: SocketAddr, other: SocketAddr, id: u32) -> Vec<u8> {
    Message::Records {
        kind: Kind::Lookup,
        request_id: id,
        family: Family::V4,
        records: vec![Record {
            command: Kind::Lookup,
            proto: Proto::Tcp,
            // A LOOKUP names the owner as the receiver: "where is it?".
            receiver_vir: owner,
            sender_vir: other,
            sender_phys: other,
            ext: Ext::Locator(LOCATOR),
            seq: 0,
            tag: [0; 16],
        }],
    }
    .encode()
    .expect("encode")
}

fuzz_target!(|data: &[u8]| {
    let mut rng = DrbgRng::from_seed(3);
    let limits = StoreLimits {
        max_entries: 64,
        max_per_key: vnat_vcmp::location::MAX_RECORDS_PER_KEY,
        max_per_source: 16,
        ttl: Duration::from_secs(600),
    };
    let cfg = Config {
        store: limits,
        ..Config::default()
    };
    let mut server = Endpoint::new(cfg, HostIdentity::from_bytes([9; 32]));
    let start = Timestamp(1_000_000_000);
    let mut now = start;
    let genuine = Record {
        command: Kind::Store,
        proto: Proto::Tcp,
        receiver_vir: sa(OTHER),
        sender_vir: sa(OWNER),
        sender_phys: sa(OWNER_SRC),
        ext: Ext::Locator(LOCATOR),
        seq: 1000,
        tag: [0x5a; 16],
    };
    server.handle_datagram(now, &mut rng, sa(OWNER_SRC), &store(genuine, 1));
    assert_eq!(server.stored_locations(), 1);
    let mut i = 0usize;
    let mut id = 2u32;
    while i + 12 <= data.len() {
        let d = &data[i..i + 12];
        i += 12;
        id = id.wrapping_add(1);
        // Sources: 10.0.0.x or 10.0.1.x, ports as given; never the owner's.
        let src = SocketAddr::new(
            [10, 0, d[0] & 1, d[1] | 2].into(),
            u16::from_be_bytes([d[2], d[3]]),
        );
        match d[4] % 4 {
            0 | 1 => {
                // A record under the genuine locator or one nearby, with
                // any addresses, sequence number and tag.
                let (key_owner, locator) = if d[4] & 0x10 != 0 {
                    (sa(OWNER), LOCATOR)
                } else {
                    (
                        SocketAddr::new([10, 0, 0, d[5]].into(), u16::from(d[6])),
                        [d[5]; 16],
                    )
                };
                let rec = Record {
                    command: Kind::Store,
                    proto: if d[4] & 0x20 != 0 {
                        Proto::Udp
                    } else {
                        Proto::Tcp
                    },
                    receiver_vir: sa(OTHER),
                    sender_vir: key_owner,
                    sender_phys: SocketAddr::new([10, 9, d[7], d[8]].into(), 2031),
                    ext: Ext::Locator(locator),
                    seq: u64::from(u32::from_be_bytes([d[8], d[9], d[10], d[11]])),
                    tag: [d[9]; 16],
                };
                server.handle_datagram(now, &mut rng, src, &store(rec, id));
            }
            2 => {
                // Arbitrary bytes behind a STORE header.
                let mut b = vec![1, Kind::Store as u8, 4, 1, 0, 0, 0, 1];
                b.extend_from_slice(d);
                server.handle_datagram(now, &mut rng, src, &b);
            }
            _ => {
                let secs = u64::from(d[5]);
                now = now.plus(Duration::from_secs(secs));
                server.handle_timeout(now, &mut rng);
            }
        }
        assert!(
            server.stored_locations() <= limits.max_entries,
            "{} records stored, limit {}",
            server.stored_locations(),
            limits.max_entries
        );
        while server.poll_event().is_some() {}
        while server.poll_transmit(now).is_some() {}
    }
    // The genuine record is still found while it lives.
    // (The asker first sends enough for the answer to fit within the
    // anti-amplification budget of 3x what it sent.)
    let asker = sa("10.0.0.2:2031");
    server.handle_datagram(now, &mut rng, asker, &[0u8; 1200]);
    while server.poll_transmit(now).is_some() {}
    server.handle_datagram(now, &mut rng, asker, &lookup(sa(OWNER), sa(OTHER), 7));
    let mut found = false;
    while let Some(t) = server.poll_transmit(now) {
        if t.dst != asker {
            continue;
        }
        if let Ok(Message::Records {
            kind: Kind::LookupR,
            records,
            ..
        }) = Message::decode(&t.payload)
        {
            found |= records
                .iter()
                .any(|r| r.tag == genuine.tag && r.seq == genuine.seq);
        }
    }
    if now.since(start) < limits.ttl {
        assert!(found, "a LOOKUP no longer returns the genuine record");
    }
});
