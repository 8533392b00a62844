//! The host's NAT state for containers' connections, through conntrack's
//! netlink interface (netlink-packet-netfilter).
//!
//! A container behind this host reaches its peers through the host's NAT:
//! its socket is (private address, remote), its peer sees (the host's
//! address and the NAT's port, remote). The host's conntrack entry for the
//! flow is what ties the two, so vnat reads the public endpoint from it
//! (never from the container) and manages the connection under that name.
//!
//! Masquerade forgets its mappings when the address they use leaves the
//! interface (nf_nat_masquerade flushes the entries of that address), and
//! the container's next packet is then mapped to the new address and reset
//! by the peer. An entry made over ctnetlink with the same mapping as an
//! explicit source NAT is not masquerade's, so it survives the move:
//! [`pin_snat`] swaps the one for the other while the address is still
//! here. With the old address kept on `lo` and vnat's usual translation on
//! the uplink, the container's packets keep leaving as (old address, port)
//! and the uplink rewrites them, as for the host's own sockets.

use std::{
    io,
    net::SocketAddr,
    sync::atomic::{AtomicU32, Ordering},
};

use netlink_packet_core::{
    DefaultNla, Emitable, NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, Nla,
    NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST,
};
use netlink_packet_netfilter::{
    conntrack::{
        ConntrackAttribute, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple,
        Protocol, Status, TCPFlags, Tuple,
    },
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr as NlAddr};

use super::rtnl::{recv_answer, request_socket, with_kept, Kept};
use crate::datapath::Proto;

/// `CTA_NAT_SRC` and its members (linux/netfilter/nfnetlink_conntrack.h),
/// which the crate has no types for.
const CTA_NAT_SRC: u16 = 6;
const CTA_NAT_V4_MINIP: u16 = 1;
const CTA_NAT_V4_MAXIP: u16 = 2;
const CTA_NAT_PROTO: u16 = 3;
const CTA_NAT_V6_MINIP: u16 = 4;
const CTA_NAT_V6_MAXIP: u16 = 5;
const CTA_PROTONAT_PORT_MIN: u16 = 1;
const CTA_PROTONAT_PORT_MAX: u16 = 2;
const NLA_F_NESTED: u16 = 0x8000;
/// Attributes of an entry that a copy made over ctnetlink would not carry
/// the same way: a helper (FTP, SIP), sequence adjustment, a zone.
const CTA_HELP: u16 = 5;
const CTA_ZONE: u16 = 18;
const CTA_SEQ_ADJ_ORIG: u16 = 15;
const CTA_SEQ_ADJ_REPLY: u16 = 16;
/// `IP_CT_TCP_FLAG_*` that describe the connection and may be copied to a
/// new entry (window scale, SACK, liberal); the others are the tracker's.
const TCP_FLAGS_COPIED: u8 = 0x01 | 0x02 | 0x08;

/// One conntrack entry: its tuples (the original direction's packet and
/// the reply's, after NAT), whether it is source- or destination-NATed,
/// and what a copy of it needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub proto: Proto,
    pub orig: (SocketAddr, SocketAddr),
    pub reply: (SocketAddr, SocketAddr),
    pub snat: bool,
    pub dnat: bool,
    status: Status,
    timeout: u32,
    mark: Option<u32>,
    tcp: Vec<ProtoInfoTCP>,
    /// Why a copy would not be the same entry (a helper, sequence
    /// adjustment), if so.
    uncopyable: Option<&'static str>,
}

/// Which way a guest's connection crossed the host's NAT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// The guest connected out: its socket's tuple is the original one.
    Out,
    /// A peer connected in (a published port): the socket's tuple is the
    /// reply one.
    In,
}

impl Entry {
    /// The connection of a guest's socket as its peer sees it: (our end,
    /// the peer's end), both after the host's NAT.
    pub fn public(&self, dir: Direction) -> (SocketAddr, SocketAddr) {
        match dir {
            Direction::Out => (self.reply.1, self.reply.0),
            Direction::In => (self.orig.1, self.orig.0),
        }
    }
}

/// The host's entry for a guest's socket `local -> remote`, and which way
/// it crossed; `None` if the host tracks no such flow (a namespace that
/// is not behind this host, or a flow not seen yet). The kernel finds an
/// entry by either of its tuples, so the answer says which one it was.
pub fn find(
    proto: Proto,
    local: SocketAddr,
    remote: SocketAddr,
) -> io::Result<Option<(Entry, Direction)>> {
    let msg = ConntrackMessage::Get(vec![tuple_attr(Which::Orig, proto, local, remote)]);
    match call(msg, 0, local.is_ipv4())? {
        Ok(Some(attrs)) => Ok(parse(&attrs).and_then(|e| {
            let dir = if e.orig == (local, remote) {
                Direction::Out
            } else if e.reply == (local, remote) {
                Direction::In
            } else {
                return None;
            };
            Some((e, dir))
        })),
        Ok(None) | Err(libc::ENOENT) => Ok(None),
        Err(errno) => Err(io::Error::from_raw_os_error(errno)),
    }
}

/// Replace `e`, a source-NATed entry, with a copy that maps the same way as
/// an explicit source NAT (see the module's comment). The removal and the
/// creation go in one datagram, which the kernel handles one right after
/// the other: a packet of the flow can find no entry only within those
/// microseconds (on another CPU), not for a round trip through vnatd. An
/// entry that a copy would not reproduce (destination NAT too, a helper,
/// sequence adjustment, a zone) is left as it is.
pub fn pin_snat(e: &Entry) -> io::Result<()> {
    // A packet the container sends between the delete and the copy makes
    // a new (unpinned) entry with the same tuples, and the copy is then
    // refused for good (EEXIST, seen on 6.12 in a VM under a busy stream):
    // delete that one and copy again, a few times.
    let mut result = pin_snat_once(e);
    for _ in 0..3 {
        match &result {
            Err(err) if err.raw_os_error() == Some(libc::EEXIST) => result = pin_snat_once(e),
            _ => break,
        }
    }
    result
}

fn pin_snat_once(e: &Entry) -> io::Result<()> {
    let attrs = pinned(e).map_err(|why| io::Error::new(io::ErrorKind::Unsupported, why))?;
    let v4 = e.orig.0.is_ipv4();
    let answers = exchange(
        vec![
            (
                ConntrackMessage::Delete(vec![tuple_attr(
                    Which::Orig,
                    e.proto,
                    e.orig.0,
                    e.orig.1,
                )]),
                NLM_F_ACK,
            ),
            (
                ConntrackMessage::New(attrs),
                NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
            ),
        ],
        v4,
    )?;
    match (&answers[0], &answers[1]) {
        (_, Ok(_)) => Ok(()),
        (Err(d), Err(_)) if *d != libc::ENOENT => Err(io::Error::from_raw_os_error(*d)),
        // Before Linux 6.5 or so a deleted entry can stay in the table,
        // dying, until its destroy event is delivered, and a new entry
        // with its tuples is refused (EEXIST, seen on Debian 12's 6.1): the
        // copy goes in once it has left, a few milliseconds later.
        (Ok(_), Err(libc::EEXIST)) => {
            for wait_ms in [1, 2, 5, 10, 20, 50] {
                std::thread::sleep(std::time::Duration::from_millis(wait_ms));
                let attrs =
                    pinned(e).map_err(|why| io::Error::new(io::ErrorKind::Unsupported, why))?;
                match call(
                    ConntrackMessage::New(attrs),
                    NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
                    v4,
                )? {
                    Ok(_) => return Ok(()),
                    Err(libc::EEXIST) => continue,
                    Err(c) => return Err(io::Error::from_raw_os_error(c)),
                }
            }
            Err(io::Error::from_raw_os_error(libc::EEXIST))
        }
        (_, Err(c)) => Err(io::Error::from_raw_os_error(*c)),
    }
}

/// The attributes of the explicit-NAT copy of `e`: both tuples as they
/// were before NAT (the kernel derives the reply from the NAT range), the
/// mapping to exactly the address and port the peer knows, and the rest of
/// its state as it was; or why a copy would not be the same.
fn pinned(e: &Entry) -> Result<Vec<ConntrackAttribute>, &'static str> {
    if let Some(why) = e.uncopyable {
        return Err(why);
    }
    if e.dnat {
        return Err("it is destination-NATed too");
    }
    let public = e.reply.1;
    let mut range = match public {
        SocketAddr::V4(a) => vec![
            DefaultNla::new(CTA_NAT_V4_MINIP, a.ip().octets().to_vec()),
            DefaultNla::new(CTA_NAT_V4_MAXIP, a.ip().octets().to_vec()),
        ],
        SocketAddr::V6(a) => vec![
            DefaultNla::new(CTA_NAT_V6_MINIP, a.ip().octets().to_vec()),
            DefaultNla::new(CTA_NAT_V6_MAXIP, a.ip().octets().to_vec()),
        ],
    };
    let port = public.port().to_be_bytes().to_vec();
    range.push(nested(
        CTA_NAT_PROTO,
        &[
            DefaultNla::new(CTA_PROTONAT_PORT_MIN, port.clone()),
            DefaultNla::new(CTA_PROTONAT_PORT_MAX, port),
        ],
    ));
    // CONFIRMED is required of an entry made from userspace; whether a
    // reply was seen and the entry assured is copied, not made up.
    let status = Status::Confirmed | (e.status & (Status::SeenReply | Status::Assured));
    let mut attrs = vec![
        tuple_attr(Which::Orig, e.proto, e.orig.0, e.orig.1),
        tuple_attr(Which::Reply, e.proto, e.orig.1, e.orig.0),
        ConntrackAttribute::Other(nested(CTA_NAT_SRC, &range)),
        ConntrackAttribute::CtaStatus(status),
        ConntrackAttribute::CtaTimeout(e.timeout.max(1)),
    ];
    if let Some(mark) = e.mark {
        attrs.push(ConntrackAttribute::CtaMark(mark));
    }
    if e.proto == Proto::Tcp {
        attrs.push(ConntrackAttribute::CtaProtoInfo(vec![ProtoInfo::TCP(
            liberal(&e.tcp),
        )]));
    }
    Ok(attrs)
}

/// `IP_CT_TCP_FLAG_BE_LIBERAL`: conntrack does not judge the direction's
/// packets by their window.
const TCP_FLAG_BE_LIBERAL: u8 = 0x08;

/// The TCP state of a copy: as it was, with both directions liberal. A
/// copy starts without the tracker's window data (ctnetlink cannot set
/// it), and the kernel picks it up from the next packet; a packet already
/// in flight in the other direction can then fall outside that guess, be
/// marked invalid and so skip NAT: the reply reaches this host unNATed,
/// which answers with a reset (seen on Debian 12's 6.1 with a busy flow).
/// Liberal tracking, as `nf_conntrack_tcp_be_liberal` gives every flow,
/// leaves window checks to the two ends.
fn liberal(tcp: &[ProtoInfoTCP]) -> Vec<ProtoInfoTCP> {
    let with = |f: Option<&TCPFlags>| {
        let flags = f.map_or(0, |f| f.flags) | TCP_FLAG_BE_LIBERAL;
        TCPFlags::parse(&[flags & TCP_FLAGS_COPIED, TCP_FLAGS_COPIED])
            .expect("two bytes are a TCP flags attribute")
    };
    let mut out: Vec<ProtoInfoTCP> = tcp
        .iter()
        .filter(|f| {
            !matches!(
                f,
                ProtoInfoTCP::OriginalFlags(_) | ProtoInfoTCP::ReplyFlags(_)
            )
        })
        .cloned()
        .collect();
    let orig = tcp.iter().find_map(|f| match f {
        ProtoInfoTCP::OriginalFlags(fl) => Some(fl),
        _ => None,
    });
    let reply = tcp.iter().find_map(|f| match f {
        ProtoInfoTCP::ReplyFlags(fl) => Some(fl),
        _ => None,
    });
    out.push(ProtoInfoTCP::OriginalFlags(with(orig)));
    out.push(ProtoInfoTCP::ReplyFlags(with(reply)));
    out
}

fn nested(kind: u16, nlas: &[DefaultNla]) -> DefaultNla {
    let mut value = vec![0u8; nlas.buffer_len()];
    nlas.emit(&mut value);
    DefaultNla::new(kind | NLA_F_NESTED, value)
}

#[derive(Clone, Copy)]
enum Which {
    Orig,
    Reply,
}

fn tuple_attr(which: Which, proto: Proto, src: SocketAddr, dst: SocketAddr) -> ConntrackAttribute {
    let t = vec![
        Tuple::Ip(vec![
            IPTuple::SourceAddress(src.ip()),
            IPTuple::DestinationAddress(dst.ip()),
        ]),
        Tuple::Proto(vec![
            ProtoTuple::Protocol(match proto {
                Proto::Tcp => Protocol::Tcp,
                Proto::Udp => Protocol::Udp,
            }),
            ProtoTuple::SourcePort(src.port()),
            ProtoTuple::DestinationPort(dst.port()),
        ]),
    ];
    match which {
        Which::Orig => ConntrackAttribute::CtaTupleOrig(t),
        Which::Reply => ConntrackAttribute::CtaTupleReply(t),
    }
}

fn endpoints(t: &[Tuple]) -> Option<(SocketAddr, SocketAddr)> {
    let (mut sa, mut da, mut sp, mut dp) = (None, None, None, None);
    for x in t {
        match x {
            Tuple::Ip(ips) => {
                for i in ips {
                    match i {
                        IPTuple::SourceAddress(a) => sa = Some(*a),
                        IPTuple::DestinationAddress(a) => da = Some(*a),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::SourcePort(v) => sp = Some(*v),
                        ProtoTuple::DestinationPort(v) => dp = Some(*v),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((SocketAddr::new(sa?, sp?), SocketAddr::new(da?, dp?)))
}

fn parse(attrs: &[ConntrackAttribute]) -> Option<Entry> {
    let (mut orig, mut reply, mut status, mut timeout, mut proto) = (None, None, None, 0, None);
    let (mut tcp, mut mark, mut uncopyable) = (Vec::new(), None, None);
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(t) => {
                orig = endpoints(t);
                proto = t.iter().find_map(|x| match x {
                    Tuple::Proto(ps) => ps.iter().find_map(|p| match p {
                        ProtoTuple::Protocol(Protocol::Tcp) => Some(Proto::Tcp),
                        ProtoTuple::Protocol(Protocol::Udp) => Some(Proto::Udp),
                        _ => None,
                    }),
                    _ => None,
                });
            }
            ConntrackAttribute::CtaTupleReply(t) => reply = endpoints(t),
            ConntrackAttribute::CtaStatus(s) => status = Some(*s),
            ConntrackAttribute::CtaTimeout(t) => timeout = *t,
            ConntrackAttribute::CtaMark(m) => mark = Some(*m),
            ConntrackAttribute::CtaProtoInfo(infos) => {
                for i in infos {
                    let ProtoInfo::TCP(fields) = i else { continue };
                    for f in fields {
                        match f {
                            ProtoInfoTCP::State(_)
                            | ProtoInfoTCP::OriginalWindowScale(_)
                            | ProtoInfoTCP::ReplyWindowScale(_) => tcp.push(f.clone()),
                            ProtoInfoTCP::OriginalFlags(fl) => {
                                tcp.push(ProtoInfoTCP::OriginalFlags(copied_flags(fl)?))
                            }
                            ProtoInfoTCP::ReplyFlags(fl) => {
                                tcp.push(ProtoInfoTCP::ReplyFlags(copied_flags(fl)?))
                            }
                            _ => {}
                        }
                    }
                }
            }
            ConntrackAttribute::Other(nla) => match nla.kind() & !NLA_F_NESTED {
                CTA_HELP => uncopyable = Some("a conntrack helper follows it"),
                CTA_SEQ_ADJ_ORIG | CTA_SEQ_ADJ_REPLY => {
                    uncopyable = Some("its sequence numbers are adjusted")
                }
                CTA_ZONE => uncopyable = Some("it is in a conntrack zone"),
                _ => {}
            },
            _ => {}
        }
    }
    let status = status?;
    Some(Entry {
        proto: proto?,
        orig: orig?,
        reply: reply?,
        snat: status.contains(Status::SrcNat),
        dnat: status.contains(Status::DstNat),
        status,
        timeout,
        mark,
        tcp,
        uncopyable,
    })
}

fn copied_flags(f: &TCPFlags) -> Option<TCPFlags> {
    TCPFlags::parse(&[f.flags & TCP_FLAGS_COPIED, TCP_FLAGS_COPIED]).ok()
}

thread_local! {
    static SOCKET: Kept<Socket> = const { std::cell::RefCell::new(None) };
}

static SEQ: AtomicU32 = AtomicU32::new(1);

/// The kernel's answer to one request: the entry's attributes for a get,
/// `None` for an acknowledgement, or the errno of an error answer.
type Answer = Result<Option<Vec<ConntrackAttribute>>, i32>;

/// Send `msg` and read its answer (see [`Answer`]); the outer error is the
/// socket's.
fn call(msg: ConntrackMessage, flags: u16, v4: bool) -> io::Result<Answer> {
    Ok(exchange(vec![(msg, flags)], v4)?.remove(0))
}

/// Send `msgs` in one datagram, which the kernel handles one right after
/// the other, and read an answer to each, in order.
fn exchange(msgs: Vec<(ConntrackMessage, u16)>, v4: bool) -> io::Result<Vec<Answer>> {
    let family = if v4 {
        NetfilterProtoFamily::IPv4
    } else {
        NetfilterProtoFamily::IPv6
    };
    let n = msgs.len();
    let first = SEQ.fetch_add(n as u32, Ordering::Relaxed);
    let mut bytes = Vec::new();
    for (i, (msg, flags)) in msgs.into_iter().enumerate() {
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = first.wrapping_add(i as u32);
        let mut req = NetlinkMessage::new(
            header,
            NetlinkPayload::from(NetfilterMessage::new(
                NetfilterHeader::new(family, 0, 0),
                msg,
            )),
        );
        req.finalize();
        let at = bytes.len();
        bytes.resize(at + req.buffer_len(), 0);
        req.serialize(&mut bytes[at..]);
    }
    // A socket that failed (not an error answer) may hold half an answer:
    // `with_kept` does not keep it.
    with_kept(
        &SOCKET,
        |e| e,
        || request_socket(NETLINK_NETFILTER),
        |s| {
            s.send_to(&bytes, &NlAddr::new(0, 0), 0)?;
            let mut answers: Vec<Option<Answer>> = (0..n).map(|_| None).collect();
            let mut buf = Vec::with_capacity(16384);
            while answers.iter().any(Option::is_none) {
                buf.clear();
                recv_answer(s, &mut buf)?;
                let mut at = 0;
                while at < buf.len() {
                    let Ok(nl) = NetlinkBuffer::new_checked(&buf[at..]) else {
                        break;
                    };
                    let len = nl.length() as usize;
                    let i = nl.sequence_number().wrapping_sub(first) as usize;
                    let one = &buf[at..at + len];
                    at += (len + 3) & !3;
                    // Another request's late answer.
                    let Some(slot) = answers.get_mut(i) else {
                        continue;
                    };
                    let answer = NetlinkMessage::<NetfilterMessage>::deserialize(one)
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                    *slot = Some(match answer.payload {
                        NetlinkPayload::Error(e) => match e.code {
                            Some(code) => Err(code.get().wrapping_neg()),
                            None => Ok(None),
                        },
                        NetlinkPayload::InnerMessage(NetfilterMessage {
                            inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)),
                            ..
                        }) => Ok(Some(attrs)),
                        _ => {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "unexpected conntrack answer",
                            ))
                        }
                    });
                }
            }
            Ok(answers
                .into_iter()
                .map(|a| a.unwrap_or(Err(libc::EIO)))
                .collect())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn masqueraded() -> Entry {
        Entry {
            proto: Proto::Tcp,
            orig: (sa("10.88.0.2:40000"), sa("198.18.3.2:5001")),
            reply: (sa("198.18.3.2:5001"), sa("198.18.1.2:40001")),
            snat: true,
            dnat: false,
            status: Status::Confirmed | Status::SeenReply | Status::Assured | Status::SrcNat,
            timeout: 431_999,
            mark: Some(0x42),
            tcp: vec![ProtoInfoTCP::State(3), ProtoInfoTCP::OriginalWindowScale(7)],
            uncopyable: None,
        }
    }

    #[test]
    fn the_public_end_is_the_nat_side_of_either_direction() {
        let out = masqueraded();
        assert_eq!(
            out.public(Direction::Out),
            (sa("198.18.1.2:40001"), sa("198.18.3.2:5001"))
        );
        // A published port: the peer connected to the host's 8080, which
        // the host forwards to the container's 80.
        let inbound = Entry {
            orig: (sa("198.18.3.2:5001"), sa("198.18.1.2:8080")),
            reply: (sa("10.88.0.2:80"), sa("198.18.3.2:5001")),
            snat: false,
            dnat: true,
            ..masqueraded()
        };
        assert_eq!(
            inbound.public(Direction::In),
            (sa("198.18.1.2:8080"), sa("198.18.3.2:5001"))
        );
    }

    #[test]
    fn a_pinned_copy_maps_to_exactly_the_public_end_and_reads_back() {
        let e = masqueraded();
        let attrs = pinned(&e).expect("a masquerade entry can be pinned");
        // What the kernel reads: tuples before NAT, the NAT range as one
        // address and one port, CONFIRMED, the timeout, TCP established.
        let ConntrackAttribute::Other(nat) = &attrs[2] else {
            panic!("no NAT attribute");
        };
        assert_eq!(nat.kind(), CTA_NAT_SRC | NLA_F_NESTED);
        let mut value = vec![0u8; nat.value_len()];
        nat.emit_value(&mut value);
        // V4_MINIP, V4_MAXIP (8 bytes each), then the nested port range.
        assert_eq!(&value[4..8], &[198, 18, 1, 2]);
        assert_eq!(&value[12..16], &[198, 18, 1, 2]);
        assert_eq!(&value[24..26], &40001u16.to_be_bytes());
        assert_eq!(&value[32..34], &40001u16.to_be_bytes());
        assert!(
            matches!(attrs[3], ConntrackAttribute::CtaStatus(s) if s.contains(Status::Confirmed))
        );
        // Everything but the NAT range parses back as the entry it copies
        // (the reply tuple before NAT is the inverse of the original).
        let back = parse(&attrs).expect("parses");
        assert_eq!(back.orig, e.orig);
        assert_eq!(back.reply, (e.orig.1, e.orig.0));
        assert_eq!(back.timeout, e.timeout);
        // TCP state and window scale copied; both directions liberal (the
        // copy has no window data to judge packets by, see `liberal`).
        let liberal = TCPFlags::parse(&[TCP_FLAG_BE_LIBERAL, TCP_FLAGS_COPIED]).unwrap();
        let mut expected = e.tcp.clone();
        expected.push(ProtoInfoTCP::OriginalFlags(liberal.clone()));
        expected.push(ProtoInfoTCP::ReplyFlags(liberal));
        assert_eq!(back.tcp, expected);
        assert_eq!(back.mark, Some(0x42), "the mark copied");
        assert_eq!(
            back.status,
            Status::Confirmed | Status::SeenReply | Status::Assured,
            "status copied, not made up (the kernel adds the NAT bits)"
        );
        // A UDP flow never answered stays unanswered in the copy.
        let unanswered = Entry {
            status: Status::Confirmed | Status::SrcNat,
            ..masqueraded()
        };
        let attrs = pinned(&unanswered).expect("pinnable");
        assert!(matches!(attrs[3], ConntrackAttribute::CtaStatus(s) if s == Status::Confirmed));
    }

    #[test]
    fn entries_a_copy_would_change_are_not_pinned() {
        let both = Entry {
            dnat: true,
            ..masqueraded()
        };
        assert!(pinned(&both).is_err(), "destination NAT would be lost");
        let helped = Entry {
            uncopyable: Some("a conntrack helper follows it"),
            ..masqueraded()
        };
        assert!(pinned(&helped).is_err());
        // What parse makes of a helper's attribute.
        let mut attrs = pinned(&masqueraded()).expect("pinnable");
        attrs.push(ConntrackAttribute::Other(DefaultNla::new(
            CTA_HELP | NLA_F_NESTED,
            vec![0; 4],
        )));
        assert!(parse(&attrs).expect("parses").uncopyable.is_some());
    }
}
