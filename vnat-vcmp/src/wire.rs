//! VCMP wire format: explicit big-endian encoding, exact parsing.
//!
//! Every datagram starts with an 8-byte header:
//!
//! ```text
//!  0        8        16       24       32
//! +--------+--------+--------+--------+
//! |version |  kind  | family | count  |   family/count: record messages
//! +--------+--------+--------+--------+
//! |            request id             |   echoed by replies
//! +--------+--------+--------+--------+
//! ```
//!
//! Record messages (SUSP_PRIMARY, SUSP_SECONDARY, UPD, UPD_R, KEYX, LOOKUP,
//! LOOKUP_R, STORE, CHALLENGE, RESPONSE) then carry `count` records of one
//! fixed size. The first 20 bytes of an IPv4 record are the 32-bit aligned
//! per-connection layout of the paper's Figures 3-6 and 3-7 (section
//! 3.3.2.3); the IPv6 record keeps the same word order with 128-bit
//! addresses. A kind-specific extension (an x25519 public value or a
//! challenge nonce), a 12-byte trailer (protocol, flags, sequence number)
//! and a 16-byte HMAC-SHA256 tag follow:
//!
//! ```text
//! version(8) command(8) R_Vir_Port(16)
//! R_Vir_Addr (32 or 128)
//! L_Vir_Addr (32 or 128)
//! L_Phys_Addr (32 or 128)
//! L_Vir_Port(16) L_Phys_Port(16)
//! extension (0, 16 or 32 bytes)
//! proto(8) flags(8) reserved(16)
//! sequence number (64)
//! tag (128)
//! ```
//!
//! "L" is always the sender of the record and "R" its receiver, as in the
//! paper. An IPv4 connection carried over IPv6 (`vcmp::family`) has an
//! IPv6 record whose two virtual addresses are IPv4-mapped; no other mix
//! of families is a record. A PROBE also tells its sender's addresses
//! (see [`Message::Probe`]). Parsing checks the version, the kind, the exact length for the
//! kind and count, and that reserved bits are zero, so that every accepted
//! datagram has exactly one encoding (the MAC is computed over that
//! encoding).

use crate::stats::Reject;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use crate::flow::Proto;

mod kind;
mod record;
pub use kind::Kind;
use record::decode_record;
pub use record::{Ext, Record, MAX_SIGNED_LEN};

/// VCMP protocol version carried in every header and record.
pub const VERSION: u8 = 1;
/// Length of the datagram header.
pub const HEADER_LEN: usize = 8;
/// Length of the truncated HMAC-SHA256 tag on each record (RFC 4868 style
/// truncation to 128 bits keeps more records in one datagram).
pub const TAG_LEN: usize = 16;
/// Length of the full HMAC-SHA256 tags in the pairing handshake.
pub const PAIR_TAG_LEN: usize = 32;
/// Length of a pairing cookie (`PAIR_COOKIE`).
pub const COOKIE_LEN: usize = 16;
/// Length of the record trailer (proto, flags, reserved, sequence).
pub const TRAILER_LEN: usize = 12;
/// Length of a challenge nonce.
pub const NONCE_LEN: usize = 16;
/// Length of a location locator (STORE, LOOKUP): the capability under
/// which a connection's location is kept, known to its two ends only.
pub const LOCATOR_LEN: usize = 16;
/// Most records one datagram can carry (the count field is 8 bits).
pub const MAX_RECORDS: usize = 255;
/// Most entries one CLAIM carries: 8 + 32 + 20 * 54 + 32 = 1,152 bytes,
/// within IPv6's minimum MTU.
pub const MAX_CLAIMS: usize = 20;
/// Length of one CLAIM entry: commitment, protocol, flags, the two ports
/// and the two addresses (IPv4 as IPv4-mapped IPv6; all zero when the
/// entry carries no names).
pub const CLAIM_ENTRY_LEN: usize = TAG_LEN + 2 + 4 + 32;
/// CLAIM entry flag: the entry carries the sender's names for the
/// connection. Without it the ports and addresses are zero.
pub const CLAIM_ENTRY_F_NAMED: u8 = 1;

/// One connection in a CLAIM: the commitment to its binding, and, only
/// when the connection is bound to the receiver already, how the sender
/// names it (its own end first). A claim for a connection the receiver has
/// not shown it holds carries the commitment alone: a host that shares an
/// address with the connection's peer (a NAT) must learn nothing of it
/// (issue 31). Through a NAT the two ends name a connection differently;
/// the names are how each learns the other's, so that records named the
/// peer's way find the connection, and how a host learns the address and
/// port its end has on the peer's side of a NAT. In the answer to an
/// in-band BIND (`vcmp::bind`) the commitment field carries the proof of
/// the BIND's token instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimEntry {
    pub commitment: [u8; TAG_LEN],
    pub proto: Proto,
    /// (the sender's end, the receiver's end), as the sender names them.
    pub names: Option<[SocketAddr; 2]>,
}
/// CLAIM and PROBE flag: this answers one of the peer's (no answer to it).
pub const CLAIM_F_ANSWER: u8 = 1;
/// Length of a PROBE without addresses: header, host key, sequence number,
/// the observed address (16 bytes, IPv4 as IPv4-mapped) and port, tag.
/// The sender's own addresses (header byte 3 says how many, 16 bytes each)
/// come before the tag.
pub const PROBE_LEN: usize = HEADER_LEN + 32 + 8 + 18 + PAIR_TAG_LEN;
/// Most addresses a PROBE tells of its sender.
pub const MAX_PROBE_ADDRS: usize = 8;
/// IPv4 + UDP header overhead, subtracted from the path MTU.
const V4_OVERHEAD: usize = 28;
/// IPv6 + UDP header overhead.
const V6_OVERHEAD: usize = 48;

/// Address family of the records in one datagram.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn code(self) -> u8 {
        match self {
            Family::V4 => 4,
            Family::V6 => 6,
        }
    }
    fn addr_len(self) -> usize {
        match self {
            Family::V4 => 4,
            Family::V6 => 16,
        }
    }
    pub fn of(addr: &SocketAddr) -> Family {
        if addr.is_ipv4() {
            Family::V4
        } else {
            Family::V6
        }
    }
}

/// Size of one record of `kind` in `family`, tag included.
pub fn record_len(family: Family, kind: Kind) -> usize {
    4 + 3 * family.addr_len() + 4 + kind.record_command().ext_len() + TRAILER_LEN + TAG_LEN
}

/// How many records of `kind` fit in one datagram on a path with `mtu`
/// (at least one, at most [`MAX_RECORDS`]).
pub fn records_per_datagram(mtu: usize, family: Family, kind: Kind) -> usize {
    let overhead = match family {
        Family::V4 => V4_OVERHEAD,
        Family::V6 => V6_OVERHEAD,
    };
    let room = mtu.saturating_sub(overhead + HEADER_LEN);
    (room / record_len(family, kind)).clamp(1, MAX_RECORDS)
}

/// Error codes of the ERROR message. Errors are unauthenticated, so they are
/// advisory: counted and reported, never acted upon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    UnsupportedVersion = 1,
    UnknownConnection = 2,
    Busy = 3,
    PeerKeyMismatch = 4,
}

impl ErrorCode {
    fn from_u16(v: u16) -> Option<ErrorCode> {
        Some(match v {
            1 => ErrorCode::UnsupportedVersion,
            2 => ErrorCode::UnknownConnection,
            3 => ErrorCode::Busy,
            4 => ErrorCode::PeerKeyMismatch,
            _ => return None,
        })
    }
}

/// A decoded VCMP datagram.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Any record-carrying kind. `records` is empty only for a LOOKUP_R that
    /// found nothing.
    Records {
        kind: Kind,
        request_id: u32,
        family: Family,
        records: Vec<Record>,
    },
    /// Acknowledges a STORE; `accepted` records were kept.
    StoreR {
        request_id: u32,
        accepted: u8,
    },
    /// Pairing, message 1: initiator's host key and ephemeral value, and
    /// the responder's cookie if it asked for one (byte 2 is then 1).
    PairInit {
        request_id: u32,
        static_pub: [u8; 32],
        eph_pub: [u8; 32],
        cookie: Option<[u8; COOKIE_LEN]>,
    },
    /// A loaded responder's demand for proof of address: PAIR_INIT again
    /// with this cookie (`request_id` is the PAIR_INIT's).
    PairCookie {
        request_id: u32,
        cookie: [u8; COOKIE_LEN],
    },
    /// Pairing, message 2: responder's host key, ephemeral value, and its
    /// confirmation tag over the transcript.
    PairResp {
        request_id: u32,
        static_pub: [u8; 32],
        eph_pub: [u8; 32],
        tag: [u8; PAIR_TAG_LEN],
    },
    /// Pairing, message 3: initiator's confirmation tag.
    PairFin {
        request_id: u32,
        tag: [u8; PAIR_TAG_LEN],
    },
    /// The sender's host key and its commitments to connections it holds
    /// with the receiver, tagged under the pairing's claim key over every
    /// byte before the tag.
    Claim {
        answer: bool,
        static_pub: [u8; 32],
        entries: Vec<ClaimEntry>,
        tag: [u8; PAIR_TAG_LEN],
    },
    /// A keepalive (`observed: None`) or its answer, which carries the
    /// address and port the keepalive came from. Tagged under the
    /// pairing's claim key over every byte before the tag.
    /// Both carry the sender's own addresses (at most
    /// [`MAX_PROBE_ADDRS`]): where the peer may reach it in the other
    /// family when a connection's own is gone (`vcmp::probe`).
    Probe {
        static_pub: [u8; 32],
        seq: u64,
        observed: Option<SocketAddr>,
        addrs: Vec<IpAddr>,
        tag: [u8; PAIR_TAG_LEN],
    },
    Error {
        request_id: u32,
        code: ErrorCode,
    },
}

/// Why a datagram could not be parsed or built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("datagram of {len} bytes is shorter than the {HEADER_LEN}-byte header")]
    Truncated { len: usize },
    #[error("unsupported VCMP version {0}")]
    BadVersion(u8),
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("{kind:?} must be {expected} bytes long, got {got}")]
    BadLength {
        kind: Kind,
        expected: usize,
        got: usize,
    },
    #[error("unknown address family code {0}")]
    BadFamily(u8),
    #[error("{kind:?} may not carry {count} records")]
    BadCount { kind: Kind, count: usize },
    #[error("record command {got} inside a {kind:?} datagram")]
    CommandMismatch { kind: Kind, got: u8 },
    #[error("record version {0} differs from the datagram's")]
    RecordVersion(u8),
    #[error("unknown transport protocol number {0}")]
    BadProto(u8),
    #[error("reserved bits are not zero")]
    Reserved,
    #[error("unknown error code {0}")]
    BadErrorCode(u16),
    #[error("a record's addresses mix families as no connection can (only an IPv4 connection is carried over IPv6)")]
    MixedFamilies,
    #[error("record extension does not match command {kind:?}")]
    BadExtension { kind: Kind },
}

impl WireError {
    /// Stable name for counters.
    pub fn reason(&self) -> Reject {
        match self {
            WireError::Truncated { .. } => Reject::Truncated,
            WireError::BadVersion(_) => Reject::BadVersion,
            WireError::UnknownKind(_) => Reject::UnknownKind,
            WireError::BadLength { .. } => Reject::BadLength,
            WireError::BadFamily(_) => Reject::BadFamily,
            WireError::BadCount { .. } => Reject::BadCount,
            WireError::CommandMismatch { .. } => Reject::CommandMismatch,
            WireError::RecordVersion(_) => Reject::RecordVersion,
            WireError::BadProto(_) => Reject::BadProto,
            WireError::Reserved => Reject::ReservedBits,
            WireError::BadErrorCode(_) => Reject::BadErrorCode,
            WireError::MixedFamilies => Reject::MixedFamilies,
            WireError::BadExtension { .. } => Reject::BadExtension,
        }
    }
}

fn header(out: &mut Vec<u8>, kind: Kind, b2: u8, b3: u8, request_id: u32) {
    out.extend_from_slice(&[VERSION, kind as u8, b2, b3]);
    out.extend_from_slice(&request_id.to_be_bytes());
}

/// Start a record datagram; records are appended with [`push_record`].
/// The count byte is patched by [`push_record`].
pub fn begin_records(out: &mut Vec<u8>, kind: Kind, family: Family, request_id: u32) {
    header(out, kind, family.code(), 0, request_id);
}

/// Append one record whose signed bytes are `signed` and tag is `tag` to a
/// datagram started with [`begin_records`].
pub fn push_record(out: &mut Vec<u8>, signed: &[u8], tag: &[u8; TAG_LEN]) -> Result<(), WireError> {
    let count = out.get(3).copied().unwrap_or(u8::MAX);
    if out.len() < HEADER_LEN || usize::from(count) >= MAX_RECORDS {
        return Err(WireError::BadCount {
            kind: Kind::Upd,
            count: MAX_RECORDS + 1,
        });
    }
    out.extend_from_slice(signed);
    out.extend_from_slice(tag);
    out[3] = count + 1;
    Ok(())
}

impl Message {
    /// Encode into bytes. Record tags must already be filled in.
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let mut out = Vec::with_capacity(128);
        match self {
            Message::Records {
                kind,
                request_id,
                family,
                records,
            } => {
                if *request_id != 0 && !kind.uses_request_id() {
                    return Err(WireError::Reserved);
                }
                if !kind.carries_records()
                    || records.len() > MAX_RECORDS
                    || (records.is_empty() && *kind != Kind::LookupR)
                {
                    return Err(WireError::BadCount {
                        kind: *kind,
                        count: records.len(),
                    });
                }
                begin_records(&mut out, *kind, *family, *request_id);
                let mut buf = [0u8; MAX_SIGNED_LEN];
                for r in records {
                    if r.command != kind.record_command() {
                        return Err(WireError::CommandMismatch {
                            kind: *kind,
                            got: r.command as u8,
                        });
                    }
                    let n = r.write_signed(&mut buf)?;
                    if r.family() != *family {
                        return Err(WireError::MixedFamilies);
                    }
                    push_record(&mut out, &buf[..n], &r.tag)?;
                }
                if records.is_empty() {
                    out[3] = 0;
                }
            }
            Message::StoreR {
                request_id,
                accepted,
            } => header(&mut out, Kind::StoreR, 0, *accepted, *request_id),
            Message::PairInit {
                request_id,
                static_pub,
                eph_pub,
                cookie,
            } => {
                let flag = u8::from(cookie.is_some());
                header(&mut out, Kind::PairInit, flag, 0, *request_id);
                out.extend_from_slice(static_pub);
                out.extend_from_slice(eph_pub);
                if let Some(c) = cookie {
                    out.extend_from_slice(c);
                }
            }
            Message::PairCookie { request_id, cookie } => {
                header(&mut out, Kind::PairCookie, 0, 0, *request_id);
                out.extend_from_slice(cookie);
            }
            Message::PairResp {
                request_id,
                static_pub,
                eph_pub,
                tag,
            } => {
                header(&mut out, Kind::PairResp, 0, 0, *request_id);
                out.extend_from_slice(static_pub);
                out.extend_from_slice(eph_pub);
                out.extend_from_slice(tag);
            }
            Message::PairFin { request_id, tag } => {
                header(&mut out, Kind::PairFin, 0, 0, *request_id);
                out.extend_from_slice(tag);
            }
            Message::Claim {
                answer,
                static_pub,
                entries,
                tag,
            } => {
                if entries.is_empty() || entries.len() > MAX_CLAIMS {
                    return Err(WireError::BadCount {
                        kind: Kind::Claim,
                        count: entries.len(),
                    });
                }
                let flags = if *answer { CLAIM_F_ANSWER } else { 0 };
                header(&mut out, Kind::Claim, flags, entries.len() as u8, 0);
                out.extend_from_slice(static_pub);
                for e in entries {
                    encode_claim_entry(&mut out, e);
                }
                out.extend_from_slice(tag);
            }
            Message::Probe {
                static_pub,
                seq,
                observed,
                addrs,
                tag,
            } => {
                let flags = if observed.is_some() {
                    CLAIM_F_ANSWER
                } else {
                    0
                };
                if addrs.len() > MAX_PROBE_ADDRS {
                    return Err(WireError::BadCount {
                        kind: Kind::Probe,
                        count: addrs.len(),
                    });
                }
                header(&mut out, Kind::Probe, flags, addrs.len() as u8, 0);
                out.extend_from_slice(static_pub);
                out.extend_from_slice(&seq.to_be_bytes());
                match observed {
                    Some(a) => {
                        out.extend_from_slice(&v6_bytes(a.ip()));
                        out.extend_from_slice(&a.port().to_be_bytes());
                    }
                    None => out.extend_from_slice(&[0; 18]),
                }
                for a in addrs {
                    out.extend_from_slice(&v6_bytes(*a));
                }
                out.extend_from_slice(tag);
            }
            Message::Error { request_id, code } => {
                header(&mut out, Kind::Error, 0, 0, *request_id);
                out.extend_from_slice(&(*code as u16).to_be_bytes());
                out.extend_from_slice(&[0, 0]);
            }
        }
        Ok(out)
    }

    /// Parse one datagram. Never panics; checks version, kind and the exact
    /// length before looking at anything else.
    pub fn decode(b: &[u8]) -> Result<Message, WireError> {
        if b.len() < HEADER_LEN {
            return Err(WireError::Truncated { len: b.len() });
        }
        if b[0] != VERSION {
            return Err(WireError::BadVersion(b[0]));
        }
        let kind = Kind::from_u8(b[1]).ok_or(WireError::UnknownKind(b[1]))?;
        let request_id = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
        let exact = |expected: usize| {
            if b.len() == expected {
                Ok(())
            } else {
                Err(WireError::BadLength {
                    kind,
                    expected,
                    got: b.len(),
                })
            }
        };
        if kind.carries_records() {
            let family = match b[2] {
                4 => Family::V4,
                6 => Family::V6,
                other => return Err(WireError::BadFamily(other)),
            };
            if request_id != 0 && !kind.uses_request_id() {
                return Err(WireError::Reserved);
            }
            let count = usize::from(b[3]);
            if count == 0 && kind != Kind::LookupR {
                return Err(WireError::BadCount { kind, count });
            }
            let rlen = record_len(family, kind);
            exact(HEADER_LEN + count * rlen)?;
            let mut records = Vec::with_capacity(count);
            for chunk in b[HEADER_LEN..].chunks_exact(rlen) {
                records.push(decode_record(chunk, kind, family)?);
            }
            return Ok(Message::Records {
                kind,
                request_id,
                family,
                records,
            });
        }
        let key = |at: usize| -> [u8; 32] {
            let mut k = [0u8; 32];
            k.copy_from_slice(&b[at..at + 32]);
            k
        };
        match kind {
            Kind::StoreR => {
                exact(HEADER_LEN)?;
                if b[2] != 0 {
                    return Err(WireError::Reserved);
                }
                Ok(Message::StoreR {
                    request_id,
                    accepted: b[3],
                })
            }
            Kind::PairInit => {
                let cookie = match (b[2], b[3]) {
                    (0, 0) => None,
                    (1, 0) => {
                        exact(HEADER_LEN + 64 + COOKIE_LEN)?;
                        let mut c = [0u8; COOKIE_LEN];
                        c.copy_from_slice(&b[HEADER_LEN + 64..]);
                        Some(c)
                    }
                    _ => return Err(WireError::Reserved),
                };
                if cookie.is_none() {
                    exact(HEADER_LEN + 64)?;
                }
                Ok(Message::PairInit {
                    request_id,
                    static_pub: key(8),
                    eph_pub: key(40),
                    cookie,
                })
            }
            Kind::PairCookie => {
                exact(HEADER_LEN + COOKIE_LEN)?;
                zero_pair(b)?;
                let mut cookie = [0u8; COOKIE_LEN];
                cookie.copy_from_slice(&b[HEADER_LEN..]);
                Ok(Message::PairCookie { request_id, cookie })
            }
            Kind::PairResp => {
                exact(HEADER_LEN + 64 + PAIR_TAG_LEN)?;
                zero_pair(b)?;
                Ok(Message::PairResp {
                    request_id,
                    static_pub: key(8),
                    eph_pub: key(40),
                    tag: key(72),
                })
            }
            Kind::PairFin => {
                exact(HEADER_LEN + PAIR_TAG_LEN)?;
                zero_pair(b)?;
                Ok(Message::PairFin {
                    request_id,
                    tag: key(8),
                })
            }
            Kind::Claim => {
                let count = usize::from(b[3]);
                if count == 0 || count > MAX_CLAIMS {
                    return Err(WireError::BadCount { kind, count });
                }
                exact(HEADER_LEN + 32 + count * CLAIM_ENTRY_LEN + PAIR_TAG_LEN)?;
                if b[2] & !CLAIM_F_ANSWER != 0 || request_id != 0 {
                    return Err(WireError::Reserved);
                }
                let at = HEADER_LEN + 32;
                let entries = b[at..at + count * CLAIM_ENTRY_LEN]
                    .chunks_exact(CLAIM_ENTRY_LEN)
                    .map(decode_claim_entry)
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Message::Claim {
                    answer: b[2] & CLAIM_F_ANSWER != 0,
                    static_pub: key(8),
                    entries,
                    tag: key(b.len() - PAIR_TAG_LEN),
                })
            }
            Kind::Probe => {
                let n = usize::from(b[3]);
                if n > MAX_PROBE_ADDRS {
                    return Err(WireError::BadCount {
                        kind: Kind::Probe,
                        count: n,
                    });
                }
                exact(PROBE_LEN + 16 * n)?;
                if b[2] & !CLAIM_F_ANSWER != 0 || request_id != 0 {
                    return Err(WireError::Reserved);
                }
                let at = HEADER_LEN + 32;
                let mut seq = [0u8; 8];
                seq.copy_from_slice(&b[at..at + 8]);
                let obs = &b[at + 8..at + 26];
                let observed = if b[2] & CLAIM_F_ANSWER != 0 {
                    let mut o = [0u8; 16];
                    o.copy_from_slice(&obs[..16]);
                    let ip = IpAddr::V6(Ipv6Addr::from(o)).to_canonical();
                    Some(SocketAddr::new(ip, u16::from_be_bytes([obs[16], obs[17]])))
                } else {
                    if obs.iter().any(|x| *x != 0) {
                        return Err(WireError::Reserved);
                    }
                    None
                };
                let addrs = b[at + 26..at + 26 + 16 * n]
                    .chunks_exact(16)
                    .map(|c| {
                        let mut o = [0u8; 16];
                        o.copy_from_slice(c);
                        IpAddr::V6(Ipv6Addr::from(o)).to_canonical()
                    })
                    .collect();
                Ok(Message::Probe {
                    static_pub: key(8),
                    seq: u64::from_be_bytes(seq),
                    observed,
                    addrs,
                    tag: key(b.len() - PAIR_TAG_LEN),
                })
            }
            Kind::Error => {
                exact(HEADER_LEN + 4)?;
                zero_pair(b)?;
                if b[10] != 0 || b[11] != 0 {
                    return Err(WireError::Reserved);
                }
                let v = u16::from_be_bytes([b[8], b[9]]);
                let code = ErrorCode::from_u16(v).ok_or(WireError::BadErrorCode(v))?;
                Ok(Message::Error { request_id, code })
            }
            // Record kinds were handled above.
            _ => Err(WireError::UnknownKind(b[1])),
        }
    }
}

/// An address in 16 bytes: IPv6 as is, IPv4 as IPv4-mapped IPv6.
fn v6_bytes(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// Append one CLAIM entry ([`CLAIM_ENTRY_LEN`] bytes).
pub(crate) fn encode_claim_entry(out: &mut Vec<u8>, e: &ClaimEntry) {
    out.extend_from_slice(&e.commitment);
    match e.names {
        Some([local, remote]) => {
            out.extend_from_slice(&[e.proto.number(), CLAIM_ENTRY_F_NAMED]);
            out.extend_from_slice(&local.port().to_be_bytes());
            out.extend_from_slice(&remote.port().to_be_bytes());
            out.extend_from_slice(&v6_bytes(local.ip()));
            out.extend_from_slice(&v6_bytes(remote.ip()));
        }
        None => {
            out.extend_from_slice(&[e.proto.number(), 0]);
            out.extend_from_slice(&[0; 36]);
        }
    }
}

/// One CLAIM entry of exactly [`CLAIM_ENTRY_LEN`] bytes. Named, its two
/// addresses are of one family; unnamed, its name bytes are zero.
pub(crate) fn decode_claim_entry(c: &[u8]) -> Result<ClaimEntry, WireError> {
    let mut commitment = [0u8; TAG_LEN];
    commitment.copy_from_slice(&c[..TAG_LEN]);
    let at = TAG_LEN;
    let proto = Proto::from_number(c[at]).ok_or(WireError::BadProto(c[at]))?;
    let names = match c[at + 1] {
        0 if c[at + 2..at + 38].iter().all(|b| *b == 0) => None,
        CLAIM_ENTRY_F_NAMED => {
            let port = |i: usize| u16::from_be_bytes([c[i], c[i + 1]]);
            let addr = |i: usize| {
                let mut o = [0u8; 16];
                o.copy_from_slice(&c[i..i + 16]);
                IpAddr::V6(Ipv6Addr::from(o)).to_canonical()
            };
            let (local, remote) = (addr(at + 6), addr(at + 22));
            if local.is_ipv4() != remote.is_ipv4() {
                return Err(WireError::BadFamily(0));
            }
            Some([
                SocketAddr::new(local, port(at + 2)),
                SocketAddr::new(remote, port(at + 4)),
            ])
        }
        _ => return Err(WireError::Reserved),
    };
    Ok(ClaimEntry {
        commitment,
        proto,
        names,
    })
}

fn zero_pair(b: &[u8]) -> Result<(), WireError> {
    if b[2] != 0 || b[3] != 0 {
        return Err(WireError::Reserved);
    }
    Ok(())
}

#[cfg(test)]
#[path = "wire_tests.rs"]
mod tests;
