//! One element of the `list` answer ([`ListedConnection`]) and how a
//! client reads a whole answer of 100,000 of them quickly: through one flat
//! struct per element and without the envelope's buffering.

use std::net::{IpAddr, SocketAddr};

use serde::{Deserialize, Serialize};

use crate::datapath::ConnectionInfo;
use crate::monitor::LastMove;

/// One element of the `list` answer: the datapath's record plus what VCMP
/// knows of it. Flattened, so the record's keys stay where they were.
///
/// Read through `ListedWire`, the same keys in one flat struct: serde's
/// `flatten` would first copy each element into a buffer of its own, which
/// made reading a list of 100,000 connections take most of a second.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ListedWire")]
pub struct ListedConnection {
    #[serde(flatten)]
    pub info: ConnectionInfo,
    /// VCMP holds keys for it, so it can move. False for a peer that runs no
    /// vnatd, before pairing completes, and when vnatd runs without VCMP.
    /// Defaults to false so that answers of a vnatd from before this field
    /// (same protocol version: the change only adds a key) still parse.
    #[serde(default)]
    pub mobile: bool,
    /// The address and port the peer sees for our end, when a NAT between
    /// the ends makes it differ from `virtual_local`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seen_by_peer_as: Option<SocketAddr>,
    /// Why it cannot move, in a few words, when it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why_not_mobile: Option<String>,
    /// The role a suspension settled for this end: "primary" (it moves)
    /// or "secondary" (its peer does); none before any suspension.
    #[serde(default)]
    pub role: Option<String>,
    /// A move of it is under way (the peer is validating its new address).
    #[serde(default)]
    pub moving: bool,
    /// Suspended: vnatd turned its TCP keepalive off until resume.
    #[serde(default)]
    pub keepalive_held: bool,
    /// An operator placed it at this local address (`vnatctl migrate`):
    /// automatic mode leaves it there while the address exists, also
    /// across restarts of vnatd.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placed: Option<IpAddr>,
    /// Keep-alive helpers asked of the peer until it works again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub helpers_asked: Vec<String>,
    /// Keep-alive helpers this host runs for the absent peer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub helping: Vec<String>,
    /// Its last move (this host's or the peer's) since vnatd started, and
    /// how it ended; `outcome` null while it is under way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_move: Option<LastMove>,
}

/// [`ListedConnection`] as it is written: every key of [`ConnectionInfo`]
/// and of the VCMP part side by side, each with its type and its default.
/// `every_listed_key_is_read` checks that the two keep the same keys (in
/// tests an unknown key is an error; in use it is skipped, as before).
#[derive(Deserialize)]
#[cfg_attr(test, serde(deny_unknown_fields))]
struct ListedWire {
    id: u64,
    proto: crate::datapath::Proto,
    virtual_local: SocketAddr,
    virtual_remote: SocketAddr,
    physical_local: SocketAddr,
    physical_remote: SocketAddr,
    state: crate::datapath::ConnState,
    cookie: u64,
    cgroup_id: u64,
    cgroup: Option<String>,
    pid: Option<u32>,
    command: Option<String>,
    age_secs: u64,
    #[serde(default)]
    udp_inbound_only: bool,
    #[serde(default)]
    adopted: bool,
    #[serde(default)]
    hide_location: bool,
    #[serde(default)]
    guest: Option<crate::datapath::GuestInfo>,
    #[serde(default)]
    mobile: bool,
    #[serde(default)]
    seen_by_peer_as: Option<SocketAddr>,
    #[serde(default)]
    why_not_mobile: Option<String>,
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    moving: bool,
    #[serde(default)]
    keepalive_held: bool,
    #[serde(default)]
    placed: Option<IpAddr>,
    #[serde(default)]
    helpers_asked: Vec<String>,
    #[serde(default)]
    helping: Vec<String>,
    #[serde(default)]
    last_move: Option<LastMove>,
}

impl From<ListedWire> for ListedConnection {
    fn from(w: ListedWire) -> Self {
        ListedConnection {
            info: ConnectionInfo {
                id: w.id,
                proto: w.proto,
                virtual_local: w.virtual_local,
                virtual_remote: w.virtual_remote,
                physical_local: w.physical_local,
                physical_remote: w.physical_remote,
                state: w.state,
                cookie: w.cookie,
                cgroup_id: w.cgroup_id,
                cgroup: w.cgroup,
                pid: w.pid,
                command: w.command,
                age_secs: w.age_secs,
                // Never written (vnatd's own).
                recorded_ns: 0,
                tcp_isns: None,
                udp_inbound_only: w.udp_inbound_only,
                adopted: w.adopted,
                hide_location: w.hide_location,
                guest: w.guest,
            },
            mobile: w.mobile,
            seen_by_peer_as: w.seen_by_peer_as,
            why_not_mobile: w.why_not_mobile,
            role: w.role,
            moving: w.moving,
            keepalive_held: w.keepalive_held,
            placed: w.placed,
            helpers_asked: w.helpers_asked,
            helping: w.helping,
            last_move: w.last_move,
        }
    }
}

/// The answer to a `list` request, read without buffering it first (an
/// internally tagged [`Reply`] is read twice: once into a buffer to find
/// its `type`, then from it). Only for an answer whose `ok.type` is
/// `connections`; see [`AnswerHead`].
#[derive(Deserialize)]
pub(crate) struct ConnectionsAnswer {
    pub(crate) ok: ConnectionsOk,
}

#[derive(Deserialize)]
pub(crate) struct ConnectionsOk {
    pub(crate) connections: Vec<ListedConnection>,
}

/// What a response line is, read without reading the rest: its version
/// and, for a success, its reply's type.
#[derive(Deserialize)]
pub(crate) struct AnswerHead {
    pub(crate) version: u32,
    #[serde(default)]
    pub(crate) ok: Option<ReplyType>,
}

#[derive(Deserialize)]
pub(crate) struct ReplyType {
    #[serde(rename = "type", default)]
    pub(crate) kind: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listed connection with every optional key present.
    fn full_listing() -> ListedConnection {
        use crate::datapath::{ConnState, GuestInfo, Proto};
        use crate::monitor::{EndOutcome, Side};
        let a = |s: &str| -> SocketAddr { s.parse().expect("an address") };
        ListedConnection {
            info: ConnectionInfo {
                id: 7,
                proto: Proto::Udp,
                virtual_local: a("10.0.0.1:4000"),
                virtual_remote: a("[2001:db8::2]:53"),
                physical_local: a("10.0.2.1:4001"),
                physical_remote: a("[2001:db8::3]:8053"),
                state: ConnState::Translated,
                cookie: 99,
                cgroup_id: 1234,
                cgroup: Some("/apps/a".into()),
                pid: Some(4321),
                command: Some("dig".into()),
                age_secs: 12,
                recorded_ns: 0,
                tcp_isns: None,
                udp_inbound_only: true,
                adopted: true,
                hide_location: true,
                guest: Some(GuestInfo {
                    netns_cookie: 5,
                    netns: Some("net:[4026531840]".into()),
                    private_local: a("172.17.0.2:4000"),
                    private_remote: a("[2001:db8::2]:53"),
                    routed_via: Some("10.0.2.1".parse().expect("an address")),
                }),
            },
            mobile: true,
            seen_by_peer_as: Some(a("198.51.100.1:61000")),
            why_not_mobile: Some("not paired".into()),
            role: Some("primary".into()),
            moving: true,
            keepalive_held: true,
            placed: Some("10.0.2.1".parse().expect("an address")),
            helpers_asked: vec!["keepalive".into()],
            helping: vec!["zero-window".into()],
            last_move: Some(LastMove {
                side: Side::Peer,
                from: a("10.0.0.1:4000"),
                to: a("10.0.2.1:4001"),
                outcome: Some(EndOutcome::Moved),
                handover_ms: Some(11),
                reason: Some("address gone".into()),
                started_ms: 1,
                ended_ms: Some(2),
            }),
        }
    }

    #[test]
    fn every_listed_key_is_read() {
        // Every key written is one the flat form knows (it refuses others
        // in tests), and each comes back as it went.
        let listed = full_listing();
        let line = serde_json::to_string(&listed).expect("serializable");
        let back: ListedConnection = serde_json::from_str(&line).expect("parses back");
        assert_eq!(back, listed);
        // The keys stay where they were: the record's at the top level.
        let v: serde_json::Value = serde_json::from_str(&line).expect("JSON");
        assert_eq!(v["virtual_local"], "10.0.0.1:4000");
        assert_eq!(v["guest"]["netns_cookie"], 5);
        assert_eq!(v["last_move"]["handover_ms"], 11);
    }

    #[test]
    fn a_listing_from_an_older_vnatd_still_reads() {
        // Only the keys every vnatd wrote: the rest take their defaults.
        let line = r#"{"id":1,"proto":"tcp","virtual_local":"10.0.0.1:1","virtual_remote":"10.0.0.2:2",
            "physical_local":"10.0.0.1:1","physical_remote":"10.0.0.2:2","state":"native",
            "cookie":3,"cgroup_id":0,"cgroup":null,"pid":null,"command":null,"age_secs":0}"#;
        let c: ListedConnection = serde_json::from_str(line).expect("an old listing");
        assert!(!c.mobile && !c.info.hide_location && c.last_move.is_none());
        assert_eq!(c.info.cookie, 3);
    }
}
