use super::*;

#[test]
fn icmp4_message_layout_and_checksums() {
    let m = icmp4_unreachable(
        "198.18.1.2".parse().unwrap(),
        40000,
        "198.18.3.2".parse().unwrap(),
        5001,
        0xdead_beef,
    );
    assert_eq!(m.len(), 8 + 20 + 20);
    assert_eq!(
        &m[..2],
        &[3, 1],
        "destination unreachable / host unreachable"
    );
    assert_eq!(checksum(&m), 0, "ICMP checksum does not verify");
    assert_eq!(
        checksum(&m[8..28]),
        0,
        "quoted IP header checksum does not verify"
    );
    assert_eq!(
        &m[8 + 12..8 + 20],
        &[198, 18, 1, 2, 198, 18, 3, 2],
        "quoted src must be the local end"
    );
    assert_eq!(m[8 + 9], 6, "quoted protocol must be TCP");
    let tcp = &m[28..];
    assert_eq!(&tcp[..8], &[0x9c, 0x40, 0x13, 0x89, 0xde, 0xad, 0xbe, 0xef]);
}

#[test]
fn icmp6_message_layout() {
    let m = icmp6_unreachable(
        "fd00:5e:1::2".parse().unwrap(),
        1,
        "fd00:5e:3::2".parse().unwrap(),
        2,
        7,
    );
    assert_eq!(m.len(), 8 + 40 + 20);
    assert_eq!(&m[..2], &[1, 0], "destination unreachable / no route");
    assert_eq!(m[8] >> 4, 6);
    assert_eq!(u16::from_be_bytes([m[12], m[13]]), 20, "payload length");
    assert_eq!(m[14], 6, "next header must be TCP");
    assert_eq!(m[8 + 8 + 15], 2, "quoted src must be the local end");
    assert_eq!(&m[48..56], &[0, 1, 0, 2, 0, 0, 0, 7]);
}

#[test]
fn checksum_matches_rfc1071_example() {
    // RFC 1071 §3: the one's complement sum of these bytes is 0xddf2.
    let b = [0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7];
    assert_eq!(checksum(&b), !0xddf2);
    assert_eq!(
        checksum(&[0xab]),
        !0xab00,
        "odd length pads with a zero byte"
    );
}

/// An in-band datagram's UDP header and checksum, as a receiver checks
/// them: the sum over the pseudo-header and the whole datagram, checksum
/// included, is all ones (checksum() of it is 0).
#[test]
fn udp_datagrams_carry_valid_checksums() {
    for (l, r) in [
        ("192.168.1.10:40000", "198.18.3.2:5001"),
        ("[fd00::10]:40000", "[2001:db8::2]:53"),
    ] {
        let (l, r): (std::net::SocketAddr, std::net::SocketAddr) =
            (l.parse().unwrap(), r.parse().unwrap());
        for payload in [&b"odd"[..], &[0u8; 134][..], &[0xff; 7][..]] {
            let u = udp_datagram(l, r, payload).unwrap();
            assert_eq!(u.len(), 8 + payload.len());
            assert_eq!(&u[..2], &l.port().to_be_bytes());
            assert_eq!(&u[2..4], &r.port().to_be_bytes());
            assert_eq!(&u[8..], payload);
            assert_ne!(&u[6..8], &[0, 0], "a checksum is always sent");
            let mut all = pseudo_header(l.ip(), r.ip(), 17, u.len());
            all.extend_from_slice(&u);
            assert_eq!(checksum(&all), 0, "{l} -> {r}, {} bytes", payload.len());
        }
    }
    let mixed = udp_datagram(
        "10.0.0.1:1".parse().unwrap(),
        "[::1]:2".parse().unwrap(),
        b"x",
    );
    assert!(mixed.is_none());
}

#[test]
fn udp_is_never_stalled_and_unknown_tcp_is_an_error() {
    let udp = VirtualFlow {
        proto: Proto::Udp,
        local: "198.18.1.2:1".parse().unwrap(),
        remote: "198.18.3.2:2".parse().unwrap(),
    };
    assert_eq!(
        restart_flow(&udp, None, None).unwrap(),
        RestartOutcome::NotStalled
    );
    let tcp = VirtualFlow {
        proto: Proto::Tcp,
        ..udp
    };
    assert!(matches!(
        restart_flow(&tcp, None, None),
        Err(DatapathError::NoSuchConnection { .. })
    ));
}

#[test]
fn tcp_probe_checksums_verify() {
    for (l, r) in [
        ("198.18.1.2:40000", "198.18.3.2:5001"),
        ("[fd00:5e:1::2]:40000", "[fd00:5e:3::2]:5001"),
    ] {
        let flow = VirtualFlow {
            proto: Proto::Tcp,
            local: l.parse().unwrap(),
            remote: r.parse().unwrap(),
        };
        let t = tcp_probe(&flow, 0x0102_0304, 0x0506_0708, 512);
        assert_eq!(t.len(), 20);
        assert_eq!(
            &t[..16],
            &[0x9c, 0x40, 0x13, 0x89, 1, 2, 3, 4, 5, 6, 7, 8, 0x50, 0x10, 2, 0]
        );
        let mut pseudo = Vec::new();
        match (flow.local.ip(), flow.remote.ip()) {
            (IpAddr::V4(s), IpAddr::V4(d)) => {
                pseudo.extend_from_slice(&s.octets());
                pseudo.extend_from_slice(&d.octets());
                pseudo.extend_from_slice(&[0, 6, 0, 20]);
            }
            (s, d) => {
                pseudo.extend_from_slice(&to_v6(s).octets());
                pseudo.extend_from_slice(&to_v6(d).octets());
                pseudo.extend_from_slice(&[0, 0, 0, 20, 0, 0, 0, 6]);
            }
        }
        pseudo.extend_from_slice(&t);
        assert_eq!(
            checksum(&pseudo),
            0,
            "TCP checksum of {flow:?} does not verify"
        );
    }
}

/// The kernel's layout, written out here so that the test checks the
/// crate's reading of it: the netlink header, `struct inet_diag_msg`, and
/// the message type of an inet_diag answer.
const NLMSG_HDRLEN: usize = 16;
const MSG_LEN: usize = 72;
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const INET_DIAG_INFO: u16 = 2;

fn answer(kind: u16, body: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes());
    b.extend_from_slice(&kind.to_ne_bytes());
    b.extend_from_slice(&[0; 10]);
    b.extend_from_slice(body);
    b
}

#[test]
fn parses_inet_diag_answers() {
    let mut body = vec![0u8; MSG_LEN];
    body[0] = libc::AF_INET as u8;
    body[2] = 1;
    body[52..56].copy_from_slice(&4321u32.to_ne_bytes());
    body[60..64].copy_from_slice(&1234u32.to_ne_bytes());
    body[68..72].copy_from_slice(&987_654u32.to_ne_bytes());
    let mut info = vec![0u8; 240];
    info[TCPI_RETRANSMITS] = 6;
    info[TCPI_PROBES] = 3;
    info[TCPI_BACKOFF] = 7;
    info[TCPI_WSCALE] = 0x7a;
    info[TCPI_TOTAL_RETRANS..TCPI_TOTAL_RETRANS + 4].copy_from_slice(&9u32.to_ne_bytes());
    info[TCPI_BYTES_ACKED..TCPI_BYTES_ACKED + 8].copy_from_slice(&0x1_0000_0005u64.to_ne_bytes());
    info[TCPI_BYTES_RECEIVED..TCPI_BYTES_RECEIVED + 8].copy_from_slice(&6u64.to_ne_bytes());
    info[TCPI_NOTSENT_BYTES..TCPI_NOTSENT_BYTES + 4].copy_from_slice(&77u32.to_ne_bytes());
    info[TCPI_BYTES_SENT..TCPI_BYTES_SENT + 8].copy_from_slice(&0x2_0000_0003u64.to_ne_bytes());
    info[TCPI_SND_WND..TCPI_SND_WND + 4].copy_from_slice(&1000u32.to_ne_bytes());
    info[TCPI_RCV_WND..TCPI_RCV_WND + 4].copy_from_slice(&(300u32 << 7).to_ne_bytes());
    // An unrelated attribute first, with a length that needs padding.
    body.extend_from_slice(&5u16.to_ne_bytes());
    body.extend_from_slice(&8u16.to_ne_bytes());
    body.extend_from_slice(&[1, 0, 0, 0]);
    body.extend_from_slice(&((4 + info.len()) as u16).to_ne_bytes());
    body.extend_from_slice(&INET_DIAG_INFO.to_ne_bytes());
    body.extend_from_slice(&info);
    let s = parse_answer(&answer(SOCK_DIAG_BY_FAMILY, &body))
        .unwrap()
        .unwrap();
    assert_eq!(
        s,
        TcpState {
            timer: 1,
            expires_ms: 4321,
            retransmits: 6,
            probes: 3,
            backoff: 7,
            total_retrans: 9,
            bytes_acked: 0x1_0000_0005,
            bytes_received: 6,
            rcv_wscale: 7,
            snd_wscale: 10,
            send_queue: 1234,
            bytes_sent: 0x2_0000_0003,
            notsent_bytes: 77,
            snd_wnd: Some(1000),
            rcv_wnd: Some(300 << 7),
            inode: 987_654,
        }
    );
    assert!(s.rto_backed_off() && !s.probe_stuck());
    assert_eq!(s.advertised_window(), 300);
    let probing = TcpState {
        timer: TIMER_PROBE0,
        retransmits: 0,
        ..s
    };
    assert!(probing.probe_stuck() && !probing.rto_backed_off());
    assert!(
        TcpState {
            backoff: 0,
            ..probing
        }
        .probe_stuck(),
        "one failed send (a held packet) already waits a whole RTO"
    );
    assert!(
        !TcpState {
            snd_wnd: Some(0),
            ..probing
        }
        .probe_stuck(),
        "a real zero window is left alone"
    );

    let gone = answer(libc::NLMSG_ERROR as u16, &(-libc::ENOENT).to_ne_bytes());
    assert_eq!(parse_answer(&gone).unwrap(), None);
    let denied = answer(libc::NLMSG_ERROR as u16, &(-libc::EPERM).to_ne_bytes());
    assert!(parse_answer(&denied).is_err());
    assert!(
        parse_answer(&[1, 2, 3]).is_err(),
        "short input is an error, not a panic"
    );
}

#[test]
fn inet_diag_requests_name_the_socket_as_the_kernel_keys_it() {
    use netlink_packet_core::Emitable;
    let bytes = |flow: &VirtualFlow, cookie| {
        let r = request(flow, cookie);
        let mut b = vec![0u8; r.buffer_len()];
        r.emit(&mut b);
        b
    };
    let v4 = VirtualFlow {
        proto: Proto::Tcp,
        local: "198.18.1.2:40000".parse().unwrap(),
        remote: "198.18.3.4:22".parse().unwrap(),
    };
    let b = bytes(&v4, 0x1122_3344_5566_7788);
    // inet_diag_req_v2: family, protocol, ext (tcp_info), pad, states.
    assert_eq!(b.len(), 56);
    assert_eq!(
        &b[..4],
        &[libc::AF_INET as u8, 6, 1 << (INET_DIAG_INFO - 1), 0]
    );
    assert_eq!(&b[4..8], &u32::MAX.to_ne_bytes()[..], "every state");
    // inet_diag_sockid: ports in network order, the local end first.
    assert_eq!(&b[8..12], &[0x9c, 0x40, 0, 22]);
    assert_eq!(&b[12..16], &[198, 18, 1, 2]);
    assert_eq!(&b[28..32], &[198, 18, 3, 4]);
    assert_eq!(&b[44..48], &[0; 4], "any interface");
    // The cookie as the kernel reads it: two u32, low half first.
    assert_eq!(&b[48..52], &0x5566_7788u32.to_ne_bytes());
    assert_eq!(&b[52..56], &0x1122_3344u32.to_ne_bytes());
    assert_eq!(&bytes(&v4, 0)[48..56], &[0xff; 8], "unknown cookie");

    // A pair of mixed families is an IPv6 socket: IPv4-mapped addresses.
    let mixed = VirtualFlow {
        remote: "[2001:db8::9]:22".parse().unwrap(),
        ..v4
    };
    let b = bytes(&mixed, 0);
    assert_eq!(b[0], libc::AF_INET6 as u8);
    let mapped: std::net::Ipv6Addr = "::ffff:198.18.1.2".parse().unwrap();
    assert_eq!(&b[12..28], &mapped.octets());
    let remote: std::net::Ipv6Addr = "2001:db8::9".parse().unwrap();
    assert_eq!(&b[28..44], &remote.octets());
}
