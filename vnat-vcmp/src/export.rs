//! Export and import of one connection's VCMP state (keys, sequence
//! numbers, replay window, mappings), so that it travels with a process
//! that is checkpointed on one host and restored on another (paper section
//! 3.3.1.1: "the secret key is part of the connection state saved and
//! transported by the migration mechanism").
//!
//! The export holds the connection's root key: whoever holds it can move
//! the connection. The daemon must keep it with the same care as the
//! process image it travels with. The exporting host forgets the
//! connection, so the two hosts never both use the keys.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};
use zeroize::{Zeroize, ZeroizeOnDrop, Zeroizing};

use super::binding::Binding;
use super::crypto::{self, key_hex, parse_key_hex, ConnKeys, SecretKey};
use super::endpoint::{Conn, Endpoint, EndpointError};
use super::replay::ReplayWindow;
use super::roles::RoleState;
use crate::flow::VirtualFlow;

/// Version of the export format. 2: keys derived from the connection's
/// binding (`tcp_isns`), not from its addresses.
pub const EXPORT_VERSION: u32 = 2;

/// A key written as 64 hex digits; wiped when dropped.
#[derive(Clone, Serialize, Deserialize, Zeroize, ZeroizeOnDrop)]
#[serde(transparent)]
pub struct HexKey(pub String);

/// One connection's portable state (serde, e.g. JSON).
#[derive(Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionExport {
    pub version: u32,
    pub flow: VirtualFlow,
    pub local_phys: SocketAddr,
    pub remote_phys: SocketAddr,
    /// Host key of the peer the keys were paired with (hex).
    pub peer_key: Option<String>,
    /// The connection's root key (hex); wiped when this value is dropped.
    pub root_key: HexKey,
    pub send_seq: u64,
    pub replay: ReplayWindow,
    pub binding_seq: u64,
    pub location_seq: u64,
    pub role: RoleState,
    /// TCP: the initial sequence numbers the exporting end recorded (its
    /// own, the peer's), which name the directions of the keys (see
    /// `vcmp::binding`). Absent for UDP.
    #[serde(default)]
    pub tcp_isns: Option<[u32; 2]>,
    /// UDP bound through a NAT (`vcmp::bind`): the (local, remote)
    /// endpoints its binding was made of, the peer's names turned to this
    /// end, where they differ from `flow`'s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp_ends: Option<[SocketAddr; 2]>,
    /// How the peer names the connection (from our side), where a NAT
    /// makes that differ from `flow`: its records are named so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_named: Option<VirtualFlow>,
    /// The root key before the last suspend-time ratchet, while the peer
    /// may still use it (hex; wiped when dropped), and whether records are
    /// still signed with it (the peer has not been seen with the new one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev_root_key: Option<HexKey>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub send_prev: bool,
    /// Our answer to the peer's last KEYX while it may come again: (the
    /// peer's value, ours, both hex, and the KEYX's sequence number).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keyx_answer: Option<(String, String, u64)>,
}

impl std::fmt::Debug for ConnectionExport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionExport")
            .field("flow", &self.flow)
            .field("send_seq", &self.send_seq)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// The seal of an export document's canonical bytes for the host `to`
    /// (this host's own key for an export it will import itself).
    pub fn seal_export(&self, to: &[u8; 32], body: &[u8]) -> Option<[u8; 32]> {
        let me = self.identity.public();
        crypto::export_seal(&self.identity, to, &me, to, body)
    }

    /// Whether `mac` seals `body` from the host `from` to this one.
    pub fn check_export_seal(&self, from: &[u8; 32], body: &[u8], mac: &[u8; 32]) -> bool {
        let me = self.identity.public();
        crypto::export_seal(&self.identity, from, from, &me, body)
            .is_some_and(|m| crypto::macs_equal(&m, mac))
    }

    /// Hand the connection over: returns its state and forgets it here.
    pub fn export_connection(
        &mut self,
        flow: &VirtualFlow,
    ) -> Result<ConnectionExport, EndpointError> {
        let c = self
            .conns
            .get(flow)
            .ok_or(EndpointError::UnknownConnection(*flow))?;
        let keys = c.keys.as_ref().ok_or(EndpointError::NoKeys(*flow))?;
        let out = ConnectionExport {
            version: EXPORT_VERSION,
            flow: *flow,
            local_phys: c.local_phys,
            remote_phys: c.remote_phys,
            peer_key: c.peer_key.as_ref().map(key_hex),
            root_key: HexKey(key_hex(keys.root.expose())),
            send_seq: c.send_seq,
            replay: c.replay,
            binding_seq: c.binding_seq,
            location_seq: c.location_seq,
            role: c.role,
            tcp_isns: c.binding.tcp_isns(),
            udp_ends: c.binding.ends().filter(|e| *e != [flow.local, flow.remote]),
            peer_named: c.peer_named().filter(|n| n != flow),
            prev_root_key: c
                .prev_keys
                .as_ref()
                .map(|k| HexKey(key_hex(k.root.expose()))),
            send_prev: c.send_prev && c.prev_keys.is_some(),
            keyx_answer: c
                .keyx_answer()
                .filter(|_| c.prev_keys.is_some())
                .map(|(peer, ours)| (key_hex(&peer), key_hex(&ours), c.keyx_answer_seq)),
        };
        self.index_connection(flow, false);
        self.drop_alias(flow);
        if let Some(c) = self.conns.remove(flow) {
            self.release(&c);
        }
        Ok(out)
    }

    /// Take over a connection exported by another host. Resume it next with
    /// its new local physical endpoint.
    pub fn import_connection(&mut self, e: &ConnectionExport) -> Result<(), EndpointError> {
        if e.version != EXPORT_VERSION {
            return Err(EndpointError::ExportVersion(e.version));
        }
        let root = Zeroizing::new(parse_key_hex(&e.root_key.0).ok_or(EndpointError::ExportKey)?);
        let peer_key = match &e.peer_key {
            Some(k) => Some(parse_key_hex(k).ok_or(EndpointError::ExportKey)?),
            None => None,
        };
        if self.conns.contains_key(&e.flow) {
            return Err(EndpointError::DuplicateConnection(e.flow));
        }
        self.admit(&e.flow)?;
        let binding = match e.udp_ends {
            Some([local, remote]) if e.tcp_isns.is_none() => Binding::endpoints(&VirtualFlow {
                proto: e.flow.proto,
                local,
                remote,
            }),
            _ => Binding::of(&e.flow, e.tcp_isns),
        };
        let mut c = Conn::new(e.flow, e.local_phys, e.remote_phys, binding);
        c.keys = Some(ConnKeys::from_root(
            SecretKey::from_bytes(*root),
            &e.flow,
            &binding,
        ));
        if let Some(prev) = &e.prev_root_key {
            let prev = Zeroizing::new(parse_key_hex(&prev.0).ok_or(EndpointError::ExportKey)?);
            c.prev_keys = Some(Box::new(ConnKeys::from_root(
                SecretKey::from_bytes(*prev),
                &e.flow,
                &binding,
            )));
            c.send_prev = e.send_prev;
            if let Some((peer, ours, seq)) = &e.keyx_answer {
                let peer = parse_key_hex(peer).ok_or(EndpointError::ExportKey)?;
                let ours = parse_key_hex(ours).ok_or(EndpointError::ExportKey)?;
                c.keyx_answer = Some(Box::new((peer, ours)));
                c.keyx_answer_seq = *seq;
            }
        }
        c.peer_key = peer_key;
        c.send_seq = e.send_seq;
        c.replay = e.replay;
        c.binding_seq = e.binding_seq;
        c.location_seq = e.location_seq;
        c.role = e.role;
        self.tx.trusted.insert(e.remote_phys.ip());
        self.conns.insert(e.flow, Box::new(c));
        if e.flow.proto == crate::flow::Proto::Udp {
            self.binds.track_udp(e.flow, e.remote_phys.ip());
        }
        self.rearm(&e.flow);
        self.index_connection(&e.flow, true);
        if let Some(named) = e.peer_named {
            self.learn_peer_view(&e.flow, [named.remote, named.local]);
        }
        Ok(())
    }
}
