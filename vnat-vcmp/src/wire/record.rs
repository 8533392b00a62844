//! The per-connection record of the record-carrying kinds (module
//! documentation of `vcmp::wire` has its layout): what is signed of it and
//! its exact parsing.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use super::{Family, Kind, WireError, LOCATOR_LEN, NONCE_LEN, TAG_LEN, TRAILER_LEN, VERSION};
use crate::flow::Proto;

/// Kind-specific record extension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ext {
    None,
    /// The sender's ephemeral x25519 public value (KEYX).
    Key([u8; 32]),
    /// A path-validation nonce (CHALLENGE/RESPONSE).
    Nonce([u8; NONCE_LEN]),
    /// The locator a location is stored and looked up under (STORE,
    /// LOOKUP): derived from the connection's keys, so only its two ends
    /// can name it (`crypto::locator`).
    Locator([u8; LOCATOR_LEN]),
    /// What a host asks its peer to do while it is away (HELP, HELP_R; see
    /// `vcmp::help`), as the bytes the daemon's request encodes to.
    Help([u8; crate::help::HELP_LEN]),
}

impl Ext {
    /// Whether this is the extension records of `command` carry.
    fn fits(&self, command: Kind) -> bool {
        match (command, self) {
            (Kind::KeyX, Ext::Key(_)) => true,
            (Kind::Challenge | Kind::Response, Ext::Nonce(_)) => true,
            (Kind::Store | Kind::Lookup, Ext::Locator(_)) => true,
            (Kind::Help | Kind::HelpR, Ext::Help(_)) => true,
            (k, Ext::None) => k.ext_len() == 0,
            _ => false,
        }
    }
}

/// One per-connection record. `sender_*` is the paper's `L_*`, `receiver_vir`
/// its `R_Vir_*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    pub command: Kind,
    pub proto: Proto,
    pub receiver_vir: SocketAddr,
    pub sender_vir: SocketAddr,
    pub sender_phys: SocketAddr,
    pub ext: Ext,
    pub seq: u64,
    pub tag: [u8; TAG_LEN],
}

/// Largest signed part of a record (IPv6 with a 32-byte extension).
pub const MAX_SIGNED_LEN: usize = 4 + 48 + 4 + 32 + TRAILER_LEN;

impl Record {
    /// The family the record is encoded in: IPv6 if any of its addresses
    /// is. An IPv4 connection carried over IPv6 (its sender's end on a
    /// network with only IPv6) has IPv4 virtual addresses and an IPv6
    /// physical one; its record is an IPv6 record whose virtual addresses
    /// are IPv4-mapped (`::ffff:a.b.c.d`, which no IPv6 packet carries, so
    /// the two cannot be confused).
    pub fn family(&self) -> Family {
        if self.sender_vir.is_ipv6() || self.sender_phys.is_ipv6() {
            Family::V6
        } else {
            Family::V4
        }
    }

    /// Write the bytes covered by the tag into `buf` and return their length.
    /// Fails when the virtual addresses are not of one family, or an IPv6
    /// connection names an IPv4 physical address (nothing carries IPv6
    /// over IPv4), or the extension does not match the command.
    pub fn write_signed(&self, buf: &mut [u8; MAX_SIGNED_LEN]) -> Result<usize, WireError> {
        let family = self.family();
        if Family::of(&self.receiver_vir) != Family::of(&self.sender_vir)
            || (self.sender_vir.is_ipv6() && self.sender_phys.is_ipv4())
        {
            return Err(WireError::MixedFamilies);
        }
        if !self.ext.fits(self.command)
            || !self.command.carries_records()
            || self.command == Kind::LookupR
        {
            return Err(WireError::BadExtension { kind: self.command });
        }
        let mut w = Writer { buf, at: 0, family };
        w.put(&[VERSION, self.command as u8]);
        w.put(&self.receiver_vir.port().to_be_bytes());
        w.ip(self.receiver_vir.ip());
        w.ip(self.sender_vir.ip());
        w.ip(self.sender_phys.ip());
        w.put(&self.sender_vir.port().to_be_bytes());
        w.put(&self.sender_phys.port().to_be_bytes());
        match &self.ext {
            Ext::None => {}
            Ext::Key(k) => w.put(k),
            Ext::Nonce(n) => w.put(n),
            Ext::Locator(l) => w.put(l),
            Ext::Help(h) => w.put(h),
        }
        w.put(&[self.proto.number(), 0, 0, 0]);
        w.put(&self.seq.to_be_bytes());
        Ok(w.at)
    }
}

struct Writer<'a> {
    buf: &'a mut [u8; MAX_SIGNED_LEN],
    at: usize,
    family: Family,
}

impl Writer<'_> {
    fn put(&mut self, b: &[u8]) {
        self.buf[self.at..self.at + b.len()].copy_from_slice(b);
        self.at += b.len();
    }
    fn ip(&mut self, ip: IpAddr) {
        match (ip, self.family) {
            (IpAddr::V4(v4), Family::V4) => self.put(&v4.octets()),
            (IpAddr::V4(v4), Family::V6) => self.put(&v4.to_ipv6_mapped().octets()),
            (IpAddr::V6(v6), _) => self.put(&v6.octets()),
        }
    }
}

/// Decode one record of exactly `record_len(family, kind)` bytes.
pub(super) fn decode_record(c: &[u8], kind: Kind, family: Family) -> Result<Record, WireError> {
    if c[0] != VERSION {
        return Err(WireError::RecordVersion(c[0]));
    }
    let command = kind.record_command();
    if c[1] != command as u8 {
        return Err(WireError::CommandMismatch { kind, got: c[1] });
    }
    let al = family.addr_len();
    let ip = |at: usize| -> IpAddr {
        match family {
            Family::V4 => IpAddr::V4(Ipv4Addr::new(c[at], c[at + 1], c[at + 2], c[at + 3])),
            Family::V6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(&c[at..at + 16]);
                IpAddr::V6(Ipv6Addr::from(o))
            }
        }
    };
    let port = |at: usize| u16::from_be_bytes([c[at], c[at + 1]]);
    let r_vir_port = port(2);
    let (r_vir, l_vir) = virtual_pair(ip(4), ip(4 + al))?;
    let l_phys = ip(4 + 2 * al);
    // A physical address that is IPv4 has an IPv4 record: written mapped
    // in an IPv6 one, it would be a second encoding of the same record.
    if matches!(l_phys, IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some()) {
        return Err(WireError::MixedFamilies);
    }
    let ports = 4 + 3 * al;
    let l_vir_port = port(ports);
    let l_phys_port = port(ports + 2);
    let mut at = ports + 4;
    let ext = match command {
        Kind::KeyX => {
            let mut k = [0u8; 32];
            k.copy_from_slice(&c[at..at + 32]);
            Ext::Key(k)
        }
        Kind::Challenge | Kind::Response => {
            let mut n = [0u8; NONCE_LEN];
            n.copy_from_slice(&c[at..at + NONCE_LEN]);
            Ext::Nonce(n)
        }
        Kind::Store | Kind::Lookup => {
            let mut l = [0u8; LOCATOR_LEN];
            l.copy_from_slice(&c[at..at + LOCATOR_LEN]);
            Ext::Locator(l)
        }
        Kind::Help | Kind::HelpR => {
            let mut h = [0u8; crate::help::HELP_LEN];
            h.copy_from_slice(&c[at..at + crate::help::HELP_LEN]);
            Ext::Help(h)
        }
        _ => Ext::None,
    };
    at += command.ext_len();
    let proto = Proto::from_number(c[at]).ok_or(WireError::BadProto(c[at]))?;
    if c[at + 1] != 0 || c[at + 2] != 0 || c[at + 3] != 0 {
        return Err(WireError::Reserved);
    }
    let mut s = [0u8; 8];
    s.copy_from_slice(&c[at + 4..at + 12]);
    let mut tag = [0u8; TAG_LEN];
    tag.copy_from_slice(&c[at + 12..at + 12 + TAG_LEN]);
    Ok(Record {
        command,
        proto,
        receiver_vir: SocketAddr::new(r_vir, r_vir_port),
        sender_vir: SocketAddr::new(l_vir, l_vir_port),
        sender_phys: SocketAddr::new(l_phys, l_phys_port),
        ext,
        seq: u64::from_be_bytes(s),
        tag,
    })
}

/// The two virtual addresses of a decoded record: IPv4-mapped in an IPv6
/// record, both are IPv4 (an IPv4 connection carried over IPv6); one
/// mapped and the other not is refused.
fn virtual_pair(r: IpAddr, l: IpAddr) -> Result<(IpAddr, IpAddr), WireError> {
    let mapped = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped(),
        IpAddr::V4(_) => None,
    };
    match (mapped(r), mapped(l)) {
        (Some(r4), Some(l4)) => Ok((IpAddr::V4(r4), IpAddr::V4(l4))),
        (None, None) => Ok((r, l)),
        _ => Err(WireError::MixedFamilies),
    }
}
