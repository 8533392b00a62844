//! Whole-map reads in batches (`BPF_MAP_LOOKUP_BATCH`, kernel/batch.rs):
//! every entry of a map of many thousands, each once, in the kernel that
//! runs the tests (the VMs' too). vnatd's listing, housekeeping and
//! `status` read the connection and NAT maps this way.

mod support;

use std::collections::HashSet;

use aya::maps::{HashMap, Map, MapData};
use vnat_common::{ConnRecord, FlowKey, AF_INET, MAP_CONNS, PROTO_TCP};
use vnat_daemon::datapath::{kernel::batch, Datapath};
use vnat_tests::{Host, Netns};

/// A distinct TCP key per `i`: 10.x.y.z to 192.0.2.1, port 40000 + i % 20000.
fn key(i: u32) -> FlowKey {
    FlowKey {
        src_addr_be: [(0x0a00_0000 | i).to_be(), 0, 0, 0],
        dst_addr_be: [u32::from_be_bytes([192, 0, 2, 1]).to_be(), 0, 0, 0],
        src_port_be: (40000 + (i % 20000) as u16).to_be(),
        dst_port_be: 443u16.to_be(),
        family: AF_INET,
        proto: PROTO_TCP,
        _pad: [0; 2],
    }
}

#[test]
fn a_batched_read_sees_every_entry_of_a_large_map_once() {
    const N: u32 = 20_000;
    let ns = Netns::new("mbat");
    let host = Host::new(&ns, "mbat");
    let pin = host.pins.path().join(MAP_CONNS);
    let data = MapData::from_pin(&pin).expect("the pinned connection map");
    let mut map: HashMap<MapData, FlowKey, ConnRecord> =
        HashMap::try_from(Map::HashMap(data)).expect("a hash map");
    let before: HashSet<FlowKey> = map.keys().map(|k| k.expect("a key")).collect();
    for i in 0..N {
        let rec = ConnRecord {
            cookie: u64::from(i) + 1,
            ..Default::default()
        };
        map.insert(key(i), rec, 0).expect("inserting a record");
    }

    let t = std::time::Instant::now();
    let read = batch::read_all(&map).expect("a batched read");
    let batched = t.elapsed();
    let keys: HashSet<FlowKey> = read.iter().map(|(k, _)| *k).collect();
    assert_eq!(read.len(), keys.len(), "an entry was read twice");
    let t = std::time::Instant::now();
    let pairs: Vec<(FlowKey, ConnRecord)> = map.iter().map(|e| e.expect("an entry")).collect();
    eprintln!(
        "{} entries read in batches in {batched:?}, one by one (aya) in {:?}",
        read.len(),
        t.elapsed()
    );
    let one_by_one: HashSet<FlowKey> = pairs.iter().map(|(k, _)| *k).collect();
    assert_eq!(keys, one_by_one, "the batches and aya's iterator differ");
    assert_eq!(keys.len(), before.len() + N as usize);
    // The values came with their keys.
    let cookies: std::collections::HashMap<FlowKey, u64> =
        (0..N).map(|i| (key(i), u64::from(i) + 1)).collect();
    for (k, v) in &read {
        if let Some(c) = cookies.get(k) {
            assert_eq!(v.cookie, *c, "the value of {k:?}");
        }
    }

    // What `vnatctl status` counts comes from the same read.
    let counted = host.read(|dp| dp.status().expect("status").connections);
    assert_eq!(counted, (before.len() + N as usize) as u64);

    for i in 0..N {
        let _ = map.remove(&key(i));
    }
}
