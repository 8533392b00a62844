//! What ties a connection to a peer host (DESIGN.md section 4, identity).
//!
//! A peer is its host key, never its address: several hosts may share one
//! public address (NAT), and an address may pass from one host to another
//! (DHCP). So a connection is bound to a pairing only when the paired host
//! shows that it holds the other end, by facts that both ends see
//! identically and that an off-path host cannot know:
//!
//! - TCP: the initial sequence numbers of both directions. A NAT rewrites
//!   addresses and ports, not sequence numbers (a NAT that does is a
//!   documented limit), and Linux picks them from a keyed hash of the
//!   4-tuple and a clock (RFC 6528), so only the two ends and whoever is on
//!   the path know them: stealing a binding is as hard as injecting into
//!   the TCP connection itself.
//! - UDP (and TCP whose sequence numbers were not recorded): the two
//!   virtual endpoints. Weak, since all but a port can be guessed and its
//!   commitment lets whoever holds the claim key test port guesses: such a
//!   binding is never sent or taken in a CLAIM. A UDP flow is bound by an
//!   in-band BIND on its own path (`vcmp::bind`), with names both ends pick
//!   alike (`Binding::udp`); a TCP connection without recorded sequence
//!   numbers stays not mobile. Never taken away from a host that holds it.
//!
//! Neither side sends the facts themselves: a CLAIM carries a commitment, an
//! HMAC of the binding under a key of the pairing, so a host that shares a
//! NAT address with another learns nothing of the other's connections from
//! the claims it receives.

use std::net::SocketAddr;

use sha2::{Digest, Sha256};

use super::crypto::endpoint_bytes;
use crate::flow::{Proto, VirtualFlow};

/// The binding facts of one connection, hashed: equal at both ends (and
/// compared by that digest only).
#[derive(Clone, Copy)]
pub struct Binding {
    digest: [u8; 32],
    strong: bool,
    /// TCP: (our initial sequence number, the peer's), which name the two
    /// directions of the connection's keys the same way at both ends
    /// whatever addresses each end sees.
    isns: Option<[u32; 2]>,
    /// Otherwise: the (local, remote) endpoints it was made of, which name
    /// the directions. A flow's own names, or, for a UDP flow bound through
    /// a NAT by an in-band BIND (`vcmp::bind`), the peer's names turned to
    /// our side, so that both ends label the directions alike.
    ends: Option<[SocketAddr; 2]>,
}

impl PartialEq for Binding {
    fn eq(&self, o: &Binding) -> bool {
        self.digest == o.digest
    }
}
impl Eq for Binding {}

impl std::fmt::Debug for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The digest stands for secret facts: not in logs.
        f.debug_struct("Binding")
            .field("strong", &self.strong)
            .finish_non_exhaustive()
    }
}

impl Binding {
    /// A TCP connection's binding from the numbers this end recorded at
    /// establishment: its own first sequence number after the SYN and the
    /// peer's (`snd_una - bytes_acked`, `rcv_nxt - bytes_received`). The
    /// peer records the same two numbers the other way round, so they are
    /// taken in order of size.
    pub fn tcp(sent_isn: u32, received_isn: u32) -> Binding {
        let (a, b) = if sent_isn <= received_isn {
            (sent_isn, received_isn)
        } else {
            (received_isn, sent_isn)
        };
        let mut h = Sha256::new();
        h.update(b"vnat binding tcp isn v1");
        h.update(a.to_be_bytes());
        h.update(b.to_be_bytes());
        Binding {
            digest: h.finalize().into(),
            strong: true,
            isns: Some([sent_isn, received_isn]),
            ends: None,
        }
    }

    /// The binding of a flow named the same way at both ends (no NAT
    /// between them): its protocol and its two virtual endpoints, in a
    /// canonical order.
    pub fn endpoints(flow: &VirtualFlow) -> Binding {
        let (a, b) = ordered(flow.local, flow.remote);
        let mut h = Sha256::new();
        h.update(b"vnat binding endpoints v1");
        h.update([flow.proto.number()]);
        h.update(endpoint_bytes(&a));
        h.update(endpoint_bytes(&b));
        Binding {
            digest: h.finalize().into(),
            strong: false,
            isns: None,
            ends: Some([flow.local, flow.remote]),
        }
    }

    /// The binding of a UDP flow bound by an in-band BIND (`vcmp::bind`):
    /// `own` is the flow as this end names it, `named` as the peer names it
    /// turned to our side (its name for our end as `local`). Each end may
    /// be the first to bind (on the peer's BIND, or on the answer to its
    /// own), so both must pick the same names: of the two, the pair of
    /// endpoints that sorts first.
    pub fn udp(own: &VirtualFlow, named: &VirtualFlow) -> Binding {
        let key = |f: &VirtualFlow| {
            let (a, b) = ordered(f.local, f.remote);
            (endpoint_bytes(&a), endpoint_bytes(&b))
        };
        if key(own) <= key(named) {
            Binding::endpoints(own)
        } else {
            Binding::endpoints(named)
        }
    }

    /// The binding of `flow` given what the datapath recorded of it.
    pub fn of(flow: &VirtualFlow, tcp_isns: Option<[u32; 2]>) -> Binding {
        match (flow.proto, tcp_isns) {
            (Proto::Tcp, Some([sent, received])) => Binding::tcp(sent, received),
            _ => Binding::endpoints(flow),
        }
    }

    /// Made from sequence numbers, which an off-path host cannot know.
    pub fn is_strong(&self) -> bool {
        self.strong
    }

    pub(crate) fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// TCP: the sequence numbers this end recorded (ours, the peer's).
    pub fn tcp_isns(&self) -> Option<[u32; 2]> {
        self.isns
    }

    /// Made of endpoints: the (local, remote) pair, as this end names them.
    pub fn ends(&self) -> Option<[SocketAddr; 2]> {
        self.ends
    }

    /// Labels of (our sending direction, our receiving direction), equal
    /// crosswise at the two ends: the initial sequence numbers for TCP, the
    /// endpoints the binding was made of otherwise.
    pub(crate) fn directions(&self, flow: &VirtualFlow) -> (Vec<u8>, Vec<u8>) {
        match (self.isns, self.ends) {
            (Some([sent, received]), _) => {
                (sent.to_be_bytes().to_vec(), received.to_be_bytes().to_vec())
            }
            (None, Some([local, remote])) => (endpoint_bytes(&local), endpoint_bytes(&remote)),
            (None, None) => (endpoint_bytes(&flow.local), endpoint_bytes(&flow.remote)),
        }
    }
}

fn ordered(x: SocketAddr, y: SocketAddr) -> (SocketAddr, SocketAddr) {
    if endpoint_bytes(&x) <= endpoint_bytes(&y) {
        (x, y)
    } else {
        (y, x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(l: &str, r: &str, proto: Proto) -> VirtualFlow {
        VirtualFlow {
            proto,
            local: l.parse().unwrap(),
            remote: r.parse().unwrap(),
        }
    }

    #[test]
    fn both_ends_compute_the_same_binding() {
        // Client and server record the two sequence numbers crosswise.
        assert_eq!(Binding::tcp(1000, 77), Binding::tcp(77, 1000));
        assert_ne!(Binding::tcp(1000, 77), Binding::tcp(1000, 78));
        let a = flow("10.0.0.1:4000", "10.0.0.2:53", Proto::Udp);
        let b = flow("10.0.0.2:53", "10.0.0.1:4000", Proto::Udp);
        assert_eq!(Binding::endpoints(&a), Binding::endpoints(&b));
        let tcp = VirtualFlow {
            proto: Proto::Tcp,
            ..a
        };
        assert_ne!(Binding::endpoints(&a), Binding::endpoints(&tcp));
    }

    #[test]
    fn a_nat_between_the_ends_changes_nothing_for_tcp() {
        // The client names the flow by its private address, the server by
        // the NAT's public one: the endpoints differ, the sequence numbers
        // do not.
        let client = flow("192.168.1.10:40000", "203.0.113.5:443", Proto::Tcp);
        let server = flow("203.0.113.5:443", "198.51.100.7:61234", Proto::Tcp);
        assert_ne!(Binding::endpoints(&client), Binding::endpoints(&server));
        assert_eq!(
            Binding::of(&client, Some([5, 9])),
            Binding::of(&server, Some([9, 5]))
        );
        assert!(Binding::of(&client, Some([5, 9])).is_strong());
        assert!(!Binding::of(&client, None).is_strong());
    }

    #[test]
    fn both_ends_of_a_udp_flow_through_a_nat_pick_the_same_names() {
        let client = flow("192.168.1.10:5000", "203.0.113.5:53", Proto::Udp);
        let server = flow("203.0.113.5:53", "198.51.100.7:61234", Proto::Udp);
        // Each end turns the other's names to its own side.
        let to_client = flow("198.51.100.7:61234", "203.0.113.5:53", Proto::Udp);
        let to_server = flow("203.0.113.5:53", "192.168.1.10:5000", Proto::Udp);
        let at_client = Binding::udp(&client, &to_client);
        let at_server = Binding::udp(&server, &to_server);
        assert_eq!(at_client, at_server);
        // And label the directions crosswise.
        let (cs, cr) = at_client.directions(&client);
        let (ss, sr) = at_server.directions(&server);
        assert_eq!((cs, cr), (sr, ss));
    }
}
