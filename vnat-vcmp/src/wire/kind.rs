//! The `command` byte of VCMP datagrams and records.

use super::{LOCATOR_LEN, NONCE_LEN};

/// Message kinds (the `command` byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    SuspPrimary = 1,
    SuspSecondary = 2,
    Upd = 3,
    UpdR = 4,
    KeyX = 5,
    Lookup = 6,
    LookupR = 7,
    Store = 8,
    StoreR = 9,
    Challenge = 10,
    Response = 11,
    PairInit = 12,
    PairResp = 13,
    PairFin = 14,
    Error = 15,
    /// Beyond the paper: "my send side now goes to your new address". Sent
    /// by the peer of a moved connection once its datapath switched, so the
    /// mover can restart its backed-off TCP sockets without their
    /// retransmission reaching a peer that would still answer at the old
    /// address (see `vcmp::switched`).
    Switched = 16,
    /// Beyond the paper: "these connections are mine". Binds connections
    /// to a paired host by commitments to facts both ends see (see
    /// `vcmp::binding`), authenticated under the pairing.
    Claim = 17,
    /// Beyond the paper: an authenticated keepalive between paired hosts,
    /// whose answer carries the address and port the probe came from (as
    /// STUN's reflexive address): a host learns how its peer sees it, and
    /// a host behind NAT keeps its mapping open (see `vcmp::probe`).
    Probe = 18,
    /// Beyond the paper: a loaded responder's answer to a PAIR_INIT, in
    /// place of any state or Diffie-Hellman: a cookie that only the
    /// initiator's address receives, to be echoed in its PAIR_INIT (see
    /// `vcmp::pairing`). Kind 21.
    PairCookie = 21,
    /// Beyond the paper: "I am about to be away; help this connection
    /// survive it" (keep-alive helpers, see `vcmp::help`); empty: "I am
    /// back". Kind 22.
    Help = 22,
    /// The answer to a HELP, echoing it. Kind 23.
    HelpR = 23,
    // 19 (BIND) and 20 (BIND_REQ) bind a UDP flow through a NAT that
    // changes its port; they have their own codec in `vcmp::bind`, because
    // a BIND travels on the flow's own 5-tuple, not between the daemons.
}

impl Kind {
    pub fn from_u8(b: u8) -> Option<Kind> {
        use Kind::*;
        Some(match b {
            1 => SuspPrimary,
            2 => SuspSecondary,
            3 => Upd,
            4 => UpdR,
            5 => KeyX,
            6 => Lookup,
            7 => LookupR,
            8 => Store,
            9 => StoreR,
            10 => Challenge,
            11 => Response,
            12 => PairInit,
            13 => PairResp,
            14 => PairFin,
            15 => Error,
            16 => Switched,
            17 => Claim,
            18 => Probe,
            21 => PairCookie,
            22 => Help,
            23 => HelpR,
            _ => return None,
        })
    }

    /// Whether datagrams of this kind carry connection records.
    pub fn carries_records(self) -> bool {
        use Kind::*;
        matches!(
            self,
            SuspPrimary
                | SuspSecondary
                | Upd
                | UpdR
                | KeyX
                | Lookup
                | LookupR
                | Store
                | Challenge
                | Response
                | Switched
                | Help
                | HelpR
        )
    }

    /// The command byte records inside a datagram of this kind must carry:
    /// a LOOKUP_R returns the STORE records it holds, verbatim, so that the
    /// looker can check the storer's MAC (paper section 3.3.2.1).
    pub fn record_command(self) -> Kind {
        match self {
            Kind::LookupR => Kind::Store,
            k => k,
        }
    }

    /// Whether the request id is used (location requests and their
    /// replies). Other record kinds are matched by connection and sequence
    /// number and must carry zero, so that no unauthenticated bit of them
    /// can vary.
    pub fn uses_request_id(self) -> bool {
        matches!(self, Kind::Lookup | Kind::LookupR | Kind::Store)
    }

    /// Length of the kind-specific record extension.
    pub fn ext_len(self) -> usize {
        match self {
            Kind::KeyX => 32,
            Kind::Challenge | Kind::Response => NONCE_LEN,
            Kind::Store | Kind::Lookup => LOCATOR_LEN,
            Kind::Help | Kind::HelpR => crate::help::HELP_LEN,
            _ => 0,
        }
    }
}
