//! Golden-byte tests: every message is checked against bytes written out by
//! hand, field by field, in both directions.

use super::*;

fn sa(s: &str) -> SocketAddr {
    s.parse().expect("test address")
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// Assert both directions: encode(msg) == bytes and decode(bytes) == msg.
fn golden(msg: &Message, bytes: &[u8]) {
    let enc = msg.encode().expect("golden message must encode");
    assert_eq!(
        enc, bytes,
        "encoding of {msg:?} differs from the golden bytes"
    );
    let dec = Message::decode(bytes).expect("golden bytes must decode");
    assert_eq!(&dec, msg, "decoding the golden bytes gave another message");
}

const TAG: [u8; 16] = [0xAA; 16];

/// An IPv4 record: client 10.0.0.1:40000 (sender, now at 192.168.1.7:40001)
/// talking to server 10.0.0.2:22.
fn rec4(command: Kind, ext: Ext, seq: u64) -> Record {
    Record {
        command,
        proto: Proto::Tcp,
        receiver_vir: sa("10.0.0.2:22"),
        sender_vir: sa("10.0.0.1:40000"),
        sender_phys: sa("192.168.1.7:40001"),
        ext,
        seq,
        tag: TAG,
    }
}

/// Hand-written bytes of `rec4` (Figure 3-6 layout, then extension,
/// trailer, tag).
fn rec4_bytes(command: u8, ext: &[u8], seq: u8) -> Vec<u8> {
    cat(&[
        &[1, command, 0x00, 0x16], // version, command, R_Vir_Port 22
        &[10, 0, 0, 2],            // R_Vir_Addr
        &[10, 0, 0, 1],            // L_Vir_Addr
        &[192, 168, 1, 7],         // L_Phys_Addr
        &[0x9c, 0x40, 0x9c, 0x41], // L_Vir_Port 40000, L_Phys_Port 40001
        ext,
        &[6, 0, 0, 0],               // proto TCP, flags, reserved
        &[0, 0, 0, 0, 0, 0, 0, seq], // sequence number
        &TAG,
    ])
}

/// Request id used in the tests: location kinds carry one, the others zero.
fn rid(kind: Kind) -> u32 {
    if kind.uses_request_id() {
        0x01020304
    } else {
        0
    }
}

/// Header bytes for a record datagram written out by hand.
fn hdr(kind: Kind, family: u8, count: u8) -> Vec<u8> {
    let mut h = vec![1, kind as u8, family, count];
    h.extend_from_slice(&rid(kind).to_be_bytes());
    h
}

fn records(kind: Kind, family: Family, records: Vec<Record>) -> Message {
    Message::Records {
        kind,
        request_id: rid(kind),
        family,
        records,
    }
}

#[test]
fn golden_simple_record_kinds_v4() {
    for (kind, code) in [
        (Kind::SuspPrimary, 1u8),
        (Kind::SuspSecondary, 2),
        (Kind::Upd, 3),
        (Kind::UpdR, 4),
        (Kind::Switched, 16),
    ] {
        let msg = records(kind, Family::V4, vec![rec4(kind, Ext::None, 7)]);
        let bytes = cat(&[&hdr(kind, 4, 1), &rec4_bytes(code, &[], 7)]);
        assert_eq!(bytes.len(), 8 + 48, "{kind:?}");
        golden(&msg, &bytes);
    }
}

/// STORE and LOOKUP carry the connection's 16-byte locator after the ports;
/// without one (or with another extension) they do not encode.
#[test]
fn golden_store_and_lookup_carry_a_locator() {
    for (kind, code) in [(Kind::Lookup, 6u8), (Kind::Store, 8)] {
        let msg = records(
            kind,
            Family::V4,
            vec![rec4(kind, Ext::Locator([0x3c; 16]), 7)],
        );
        let bytes = cat(&[&hdr(kind, 4, 1), &rec4_bytes(code, &[0x3c; 16], 7)]);
        assert_eq!(bytes.len(), 8 + 64, "{kind:?}");
        golden(&msg, &bytes);
        for ext in [Ext::None, Ext::Nonce([0x3c; 16])] {
            let bad = records(kind, Family::V4, vec![rec4(kind, ext, 7)]);
            assert!(bad.encode().is_err(), "{kind:?} with {ext:?} encoded");
        }
    }
}

#[test]
fn golden_upd_two_records_v4() {
    let mut second = rec4(Kind::Upd, Ext::None, 9);
    second.proto = Proto::Udp;
    let msg = records(
        Kind::Upd,
        Family::V4,
        vec![rec4(Kind::Upd, Ext::None, 8), second],
    );
    let mut r2 = rec4_bytes(3, &[], 9);
    r2[20] = 17; // proto UDP
    let bytes = cat(&[&[1, 3, 4, 2, 0, 0, 0, 0], &rec4_bytes(3, &[], 8), &r2]);
    golden(&msg, &bytes);
}

#[test]
fn golden_keyx_v4() {
    let msg = records(
        Kind::KeyX,
        Family::V4,
        vec![rec4(Kind::KeyX, Ext::Key([0x55; 32]), 3)],
    );
    let bytes = cat(&[&[1, 5, 4, 1, 0, 0, 0, 0], &rec4_bytes(5, &[0x55; 32], 3)]);
    assert_eq!(bytes.len(), 8 + 80);
    golden(&msg, &bytes);
}

#[test]
fn golden_challenge_and_response_v4() {
    for (kind, code) in [(Kind::Challenge, 10u8), (Kind::Response, 11)] {
        let msg = records(
            kind,
            Family::V4,
            vec![rec4(kind, Ext::Nonce([0x11; 16]), 2)],
        );
        let bytes = cat(&[
            &[1, code, 4, 1, 0, 0, 0, 0],
            &rec4_bytes(code, &[0x11; 16], 2),
        ]);
        golden(&msg, &bytes);
    }
}

#[test]
fn golden_lookup_r_carries_store_records() {
    let msg = records(
        Kind::LookupR,
        Family::V4,
        vec![rec4(Kind::Store, Ext::Locator([0x3c; 16]), 5)],
    );
    let bytes = cat(&[&[1, 7, 4, 1, 1, 2, 3, 4], &rec4_bytes(8, &[0x3c; 16], 5)]);
    golden(&msg, &bytes);
    let empty = records(Kind::LookupR, Family::V4, vec![]);
    golden(&empty, &[1, 7, 4, 0, 1, 2, 3, 4]);
}

#[test]
fn golden_upd_v6() {
    let rec = Record {
        command: Kind::Upd,
        proto: Proto::Udp,
        receiver_vir: sa("[2001:db8::2]:53"),
        sender_vir: sa("[2001:db8::1]:5353"),
        sender_phys: sa("[fd00::7]:6000"),
        ext: Ext::None,
        seq: 0x0102030405060708,
        tag: TAG,
    };
    let msg = records(Kind::Upd, Family::V6, vec![rec]);
    let mut a2 = [0u8; 16];
    a2[0..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
    let mut a1 = a2;
    a2[15] = 2;
    a1[15] = 1;
    let mut p = [0u8; 16];
    p[0] = 0xfd;
    p[15] = 7;
    let bytes = cat(&[
        &[1, 3, 6, 1, 0, 0, 0, 0],
        &[1, 3, 0x00, 0x35],
        &a2,
        &a1,
        &p,
        &[0x14, 0xe9, 0x17, 0x70],
        &[17, 0, 0, 0],
        &[1, 2, 3, 4, 5, 6, 7, 8],
        &TAG,
    ]);
    assert_eq!(bytes.len(), 8 + 84);
    golden(&msg, &bytes);
}

#[test]
fn golden_store_r_pairing_and_error() {
    golden(
        &Message::StoreR {
            request_id: 0xdeadbeef,
            accepted: 3,
        },
        &[1, 9, 0, 3, 0xde, 0xad, 0xbe, 0xef],
    );
    golden(
        &Message::PairInit {
            request_id: 5,
            static_pub: [0x01; 32],
            eph_pub: [0x02; 32],
            cookie: None,
        },
        &cat(&[&[1, 12, 0, 0, 0, 0, 0, 5], &[0x01; 32], &[0x02; 32]]),
    );
    golden(
        &Message::PairInit {
            request_id: 5,
            static_pub: [0x01; 32],
            eph_pub: [0x02; 32],
            cookie: Some([0x0c; 16]),
        },
        &cat(&[
            &[1, 12, 1, 0, 0, 0, 0, 5],
            &[0x01; 32],
            &[0x02; 32],
            &[0x0c; 16],
        ]),
    );
    golden(
        &Message::PairCookie {
            request_id: 5,
            cookie: [0x0d; 16],
        },
        &cat(&[&[1, 21, 0, 0, 0, 0, 0, 5], &[0x0d; 16]]),
    );
    golden(
        &Message::PairResp {
            request_id: 5,
            static_pub: [0x03; 32],
            eph_pub: [0x04; 32],
            tag: [0x05; 32],
        },
        &cat(&[
            &[1, 13, 0, 0, 0, 0, 0, 5],
            &[0x03; 32],
            &[0x04; 32],
            &[0x05; 32],
        ]),
    );
    golden(
        &Message::PairFin {
            request_id: 5,
            tag: [0x06; 32],
        },
        &cat(&[&[1, 14, 0, 0, 0, 0, 0, 5], &[0x06; 32]]),
    );
    golden(
        &Message::Error {
            request_id: 9,
            code: ErrorCode::UnknownConnection,
        },
        &[1, 15, 0, 0, 0, 0, 0, 9, 0, 2, 0, 0],
    );
}

#[test]
fn rejects_malformed() {
    let good = cat(&[&[1, 3, 4, 1, 0, 0, 0, 0], &rec4_bytes(3, &[], 7)]);
    assert!(Message::decode(&good).is_ok(), "baseline must parse");
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (good[..7].to_vec(), "truncated"),
        (cat(&[&[2], &good[1..]]), "bad_version"),
        (cat(&[&[1, 99], &good[2..]]), "unknown_kind"),
        (good[..good.len() - 1].to_vec(), "bad_length"),
        (cat(&[&good, &[0]]), "bad_length"),
        (cat(&[&[1, 3, 5], &good[3..]]), "bad_family"),
        (cat(&[&[1, 3, 4, 0], &good[4..8]]), "bad_count"),
        (cat(&[&[1, 3, 4, 2], &good[4..]]), "bad_length"),
        (cat(&[&good[..9], &[4], &good[10..]]), "command_mismatch"),
        (cat(&[&good[..8], &[9], &good[9..]]), "record_version"),
        (cat(&[&good[..28], &[1], &good[29..]]), "bad_proto"),
        (cat(&[&good[..29], &[1], &good[30..]]), "reserved_bits"),
        (vec![1, 9, 1, 0, 0, 0, 0, 0], "reserved_bits"),
        (vec![1, 15, 0, 0, 0, 0, 0, 9, 0, 77, 0, 0], "bad_error_code"),
        (vec![1, 15, 0, 0, 0, 0, 0, 9, 0, 2, 0, 1], "reserved_bits"),
        (vec![1, 14, 0, 0, 0, 0, 0, 9], "bad_length"),
        // PAIR_INIT: a cookie flag without the cookie, a cookie without the
        // flag, a flag other than 0 or 1, and byte 3 set.
        (cat(&[&[1, 12, 1, 0, 0, 0, 0, 9], &[7; 64]]), "bad_length"),
        (cat(&[&[1, 12, 0, 0, 0, 0, 0, 9], &[7; 80]]), "bad_length"),
        (
            cat(&[&[1, 12, 2, 0, 0, 0, 0, 9], &[7; 80]]),
            "reserved_bits",
        ),
        (
            cat(&[&[1, 12, 1, 1, 0, 0, 0, 9], &[7; 80]]),
            "reserved_bits",
        ),
        // PAIR_COOKIE: short, long, reserved bytes.
        (cat(&[&[1, 21, 0, 0, 0, 0, 0, 9], &[7; 15]]), "bad_length"),
        (cat(&[&[1, 21, 0, 0, 0, 0, 0, 9], &[7; 17]]), "bad_length"),
        (
            cat(&[&[1, 21, 0, 1, 0, 0, 0, 9], &[7; 16]]),
            "reserved_bits",
        ),
        (cat(&[&good[..7], &[1], &good[8..]]), "reserved_bits"),
    ];
    for (bytes, reason) in cases {
        let err = Message::decode(&bytes).expect_err("malformed datagram must be refused");
        assert_eq!(err.reason().name(), reason, "{bytes:?} gave {err}");
    }
}

#[test]
fn encode_refuses_inconsistent_records() {
    // An IPv4 connection carried over IPv6 has an IPv6 record: not in an
    // IPv4 datagram.
    let mut mixed = rec4(Kind::Upd, Ext::None, 1);
    mixed.sender_phys = sa("[::1]:5");
    assert_eq!(
        records(Kind::Upd, Family::V4, vec![mixed]).encode(),
        Err(WireError::MixedFamilies)
    );
    // And an IPv6 connection is never carried over IPv4.
    let mut v6 = mixed;
    v6.receiver_vir = sa("[2001:db8::2]:22");
    v6.sender_vir = sa("[2001:db8::1]:40000");
    v6.sender_phys = sa("192.0.2.1:5");
    assert_eq!(
        records(Kind::Upd, Family::V6, vec![v6]).encode(),
        Err(WireError::MixedFamilies)
    );
    let wrong_ext = rec4(Kind::Upd, Ext::Key([0; 32]), 1);
    assert!(records(Kind::Upd, Family::V4, vec![wrong_ext])
        .encode()
        .is_err());
    assert!(records(Kind::Upd, Family::V4, vec![]).encode().is_err());
}

#[test]
fn batch_sizes_follow_the_mtu() {
    assert_eq!(record_len(Family::V4, Kind::Upd), 48);
    assert_eq!(record_len(Family::V6, Kind::Upd), 84);
    assert_eq!(
        records_per_datagram(1500, Family::V4, Kind::Upd),
        (1500 - 36) / 48
    );
    assert_eq!(
        records_per_datagram(1280, Family::V6, Kind::Upd),
        (1280 - 56) / 84
    );
    assert_eq!(records_per_datagram(100, Family::V6, Kind::Upd), 1);
    assert_eq!(
        records_per_datagram(65535, Family::V4, Kind::Upd),
        MAX_RECORDS
    );
}

#[test]
fn golden_claim_and_its_limits() {
    let entry = |c: u8, proto: Proto, l: &str, r: &str| ClaimEntry {
        commitment: [c; TAG_LEN],
        proto,
        names: Some([sa(l), sa(r)]),
    };
    let msg = Message::Claim {
        answer: true,
        static_pub: [0xAA; 32],
        entries: vec![
            entry(0x11, Proto::Tcp, "192.168.1.10:40000", "203.0.113.5:443"),
            entry(0x22, Proto::Udp, "[2001:db8::1]:53", "[2001:db8::2]:5353"),
        ],
        tag: [0xEE; PAIR_TAG_LEN],
    };
    let mapped = |a: [u8; 4]| {
        let mut o = [0u8; 16];
        o[10] = 0xff;
        o[11] = 0xff;
        o[12..].copy_from_slice(&a);
        o
    };
    let v6 = |s: &str| s.parse::<Ipv6Addr>().expect("v6").octets();
    let bytes = cat(&[
        &[1, 17, CLAIM_F_ANSWER, 2, 0, 0, 0, 0],
        &[0xAA; 32],
        &[0x11; 16],
        &[6, CLAIM_ENTRY_F_NAMED, 0x9c, 0x40, 0x01, 0xbb],
        &mapped([192, 168, 1, 10]),
        &mapped([203, 0, 113, 5]),
        &[0x22; 16],
        &[17, CLAIM_ENTRY_F_NAMED, 0, 53, 0x14, 0xe9],
        &v6("2001:db8::1"),
        &v6("2001:db8::2"),
        &[0xEE; 32],
    ]);
    golden(&msg, &bytes);
    // A claim of a connection not yet bound to the receiver: the
    // commitment alone, its name bytes zero.
    let bare = Message::Claim {
        answer: false,
        static_pub: [0xAA; 32],
        entries: vec![ClaimEntry {
            commitment: [0x33; TAG_LEN],
            proto: Proto::Tcp,
            names: None,
        }],
        tag: [0xEE; PAIR_TAG_LEN],
    };
    let bare_bytes = cat(&[
        &[1, 17, 0, 1, 0, 0, 0, 0],
        &[0xAA; 32],
        &[0x33; 16],
        &[6, 0],
        &[0; 36],
        &[0xEE; 32],
    ]);
    golden(&bare, &bare_bytes);
    // Unnamed with a name byte set, or an unknown entry flag: refused.
    let mut stray = bare_bytes.clone();
    stray[HEADER_LEN + 32 + TAG_LEN + 5] = 1;
    assert_eq!(Message::decode(&stray), Err(WireError::Reserved));
    let mut unknown = bare_bytes;
    unknown[HEADER_LEN + 32 + TAG_LEN + 1] = 2;
    assert_eq!(Message::decode(&unknown), Err(WireError::Reserved));
    // No entry, too many, a length that disagrees with the count, an
    // unknown flag, a request id, a bad protocol, mixed families: all
    // refused.
    let none = Message::Claim {
        answer: false,
        static_pub: [0; 32],
        entries: vec![],
        tag: [0; 32],
    };
    assert!(none.encode().is_err());
    let many = Message::Claim {
        answer: false,
        static_pub: [0; 32],
        entries: vec![entry(0, Proto::Tcp, "10.0.0.1:1", "10.0.0.2:2"); MAX_CLAIMS + 1],
        tag: [0; 32],
    };
    assert!(many.encode().is_err());
    let mut short = bytes.clone();
    short.pop();
    assert!(Message::decode(&short).is_err());
    let mut count = bytes.clone();
    count[3] = 3;
    assert!(Message::decode(&count).is_err());
    let mut zero = bytes.clone();
    zero[3] = 0;
    assert!(Message::decode(&zero).is_err());
    let mut flag = bytes.clone();
    flag[2] = 2;
    assert_eq!(Message::decode(&flag), Err(WireError::Reserved));
    let mut id = bytes.clone();
    id[7] = 1;
    assert_eq!(Message::decode(&id), Err(WireError::Reserved));
    let first = HEADER_LEN + 32 + TAG_LEN;
    let mut proto = bytes.clone();
    proto[first] = 1;
    assert_eq!(Message::decode(&proto), Err(WireError::BadProto(1)));
    let mut mixed = bytes;
    // The second entry's local address becomes IPv4-mapped: one v4, one v6.
    let second_local = first + CLAIM_ENTRY_LEN + 6;
    mixed[second_local..second_local + 16].copy_from_slice(&mapped([10, 0, 0, 1]));
    assert!(Message::decode(&mixed).is_err());
}

#[test]
fn golden_probe_and_its_answer() {
    let probe = Message::Probe {
        static_pub: [0xAB; 32],
        seq: 7,
        observed: None,
        addrs: vec![],
        tag: [0xCD; PAIR_TAG_LEN],
    };
    let bytes = cat(&[
        &[1, 18, 0, 0, 0, 0, 0, 0],
        &[0xAB; 32],
        &7u64.to_be_bytes(),
        &[0; 18],
        &[0xCD; 32],
    ]);
    golden(&probe, &bytes);
    let answer = Message::Probe {
        static_pub: [0xAB; 32],
        seq: 7,
        observed: Some(sa("198.51.100.7:40001")),
        addrs: vec![],
        tag: [0xCD; PAIR_TAG_LEN],
    };
    let mut mapped = [0u8; 16];
    mapped[10] = 0xff;
    mapped[11] = 0xff;
    mapped[12..].copy_from_slice(&[198, 51, 100, 7]);
    let abytes = cat(&[
        &[1, 18, CLAIM_F_ANSWER, 0, 0, 0, 0, 0],
        &[0xAB; 32],
        &7u64.to_be_bytes(),
        &mapped,
        &40001u16.to_be_bytes(),
        &[0xCD; 32],
    ]);
    golden(&answer, &abytes);
    // A probe that is no answer carries no address; reserved bytes, a
    // request id and a wrong length are refused.
    let mut stray = bytes.clone();
    stray[HEADER_LEN + 40] = 1;
    assert_eq!(Message::decode(&stray), Err(WireError::Reserved));
    // Byte 3 counts the sender's addresses: one more than there are is a
    // wrong length.
    let mut b3 = bytes.clone();
    b3[3] = 1;
    assert!(matches!(
        Message::decode(&b3),
        Err(WireError::BadLength { .. })
    ));
    let mut id = bytes.clone();
    id[4] = 1;
    assert_eq!(Message::decode(&id), Err(WireError::Reserved));
    assert!(Message::decode(&bytes[..bytes.len() - 1]).is_err());
}

/// 16 bytes of `::ffff:a.b.c.d`.
fn mapped4(a: [u8; 4]) -> [u8; 16] {
    let mut m = [0u8; 16];
    m[10] = 0xff;
    m[11] = 0xff;
    m[12..].copy_from_slice(&a);
    m
}

#[test]
fn golden_probe_that_tells_the_senders_addresses() {
    let probe = Message::Probe {
        static_pub: [0xAB; 32],
        seq: 9,
        observed: None,
        addrs: vec![
            "192.0.2.10".parse().unwrap(),
            "2001:db8::a".parse().unwrap(),
        ],
        tag: [0xCD; PAIR_TAG_LEN],
    };
    let mut v6 = [0u8; 16];
    v6[0..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
    v6[15] = 0x0a;
    let bytes = cat(&[
        &[1, 18, 0, 2, 0, 0, 0, 0],
        &[0xAB; 32],
        &9u64.to_be_bytes(),
        &[0; 18],
        &mapped4([192, 0, 2, 10]),
        &v6,
        &[0xCD; 32],
    ]);
    assert_eq!(bytes.len(), PROBE_LEN + 32);
    golden(&probe, &bytes);
    // More than MAX_PROBE_ADDRS is refused both ways.
    let mut many = bytes.clone();
    many[3] = (MAX_PROBE_ADDRS + 1) as u8;
    assert!(matches!(
        Message::decode(&many),
        Err(WireError::BadCount { .. })
    ));
    let too_many = Message::Probe {
        static_pub: [0xAB; 32],
        seq: 9,
        observed: None,
        addrs: vec!["192.0.2.10".parse().unwrap(); MAX_PROBE_ADDRS + 1],
        tag: [0xCD; PAIR_TAG_LEN],
    };
    assert!(too_many.encode().is_err());
    // A count that disagrees with the length is refused.
    assert!(Message::decode(&bytes[..bytes.len() - 16]).is_err());
}

/// An IPv4 connection whose sender is on a network with only IPv6: an
/// IPv6 record whose virtual addresses are IPv4-mapped.
fn rec_across() -> Record {
    Record {
        command: Kind::Upd,
        proto: Proto::Tcp,
        receiver_vir: sa("10.0.0.2:22"),
        sender_vir: sa("10.0.0.1:40000"),
        sender_phys: sa("[2001:db8::7]:40000"),
        ext: Ext::None,
        seq: 5,
        tag: TAG,
    }
}

#[test]
fn golden_upd_of_an_ipv4_connection_carried_over_ipv6() {
    let rec = rec_across();
    assert_eq!(rec.family(), Family::V6);
    let msg = records(Kind::Upd, Family::V6, vec![rec]);
    let mut p = [0u8; 16];
    p[0..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
    p[15] = 7;
    let bytes = cat(&[
        &[1, 3, 6, 1, 0, 0, 0, 0],
        &[1, 3, 0x00, 0x16],
        &mapped4([10, 0, 0, 2]),
        &mapped4([10, 0, 0, 1]),
        &p,
        &[0x9c, 0x40, 0x9c, 0x40],
        &[6, 0, 0, 0],
        &5u64.to_be_bytes(),
        &TAG,
    ]);
    golden(&msg, &bytes);
}

#[test]
fn records_that_mix_families_otherwise_are_refused() {
    let at = HEADER_LEN + 4;
    let good = records(Kind::Upd, Family::V6, vec![rec_across()])
        .encode()
        .unwrap();
    // One virtual address mapped, the other not.
    let mut half = good.clone();
    half[at..at + 16].copy_from_slice(&"2001:db8::2".parse::<Ipv6Addr>().unwrap().octets());
    assert_eq!(Message::decode(&half), Err(WireError::MixedFamilies));
    // An IPv4 physical address written mapped: a second encoding of an
    // IPv4 record.
    let mut phys = good.clone();
    phys[at + 32..at + 48].copy_from_slice(&mapped4([192, 0, 2, 7]));
    assert_eq!(Message::decode(&phys), Err(WireError::MixedFamilies));
    // Nothing carries an IPv6 connection over IPv4, nor encodes one.
    let mut v6_over_v4 = rec_across();
    v6_over_v4.receiver_vir = sa("[2001:db8::2]:22");
    v6_over_v4.sender_vir = sa("[2001:db8::1]:40000");
    v6_over_v4.sender_phys = sa("192.0.2.7:40000");
    let mut buf = [0u8; MAX_SIGNED_LEN];
    assert_eq!(
        v6_over_v4.write_signed(&mut buf),
        Err(WireError::MixedFamilies)
    );
    let mut one_each = rec_across();
    one_each.receiver_vir = sa("[2001:db8::2]:22");
    assert_eq!(
        one_each.write_signed(&mut buf),
        Err(WireError::MixedFamilies)
    );
    // An IPv4 record stays one: all three addresses IPv4.
    let v4 = rec4(Kind::Upd, Ext::None, 1);
    assert_eq!(v4.family(), Family::V4);
}
