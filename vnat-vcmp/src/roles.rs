//! Migration roles (paper section 3.3.1.2, Figure 3-4).
//!
//! The host about to move claims primary with SUSP_PRIMARY; a peer that has
//! not claimed itself answers SUSP_SECONDARY (Figure 3-4(a)). When the two
//! claims cross, each side decides alone, with no further message, that the
//! host with the higher address is primary (Figure 3-4(b)). With nothing
//! negotiated (cable pulled) both sides act as primary (end of 3.3.2.1).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Role of the local end of one connection during a migration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    Primary,
    Secondary,
}

/// Per-connection role negotiation state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleState {
    /// The negotiated role, if any.
    pub negotiated: Option<Role>,
    /// We claimed primary at this suspension.
    pub claimed: bool,
    /// We sent SUSP_PRIMARY and have not yet seen the outcome.
    pub claim_pending: bool,
}

/// What to do after a SUSP_PRIMARY arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// Accept secondary and answer SUSP_SECONDARY.
    AnswerSecondary,
    /// The claims crossed; the role was arbitrated; send nothing.
    Arbitrated(Role),
}

/// Compare the two ends of a connection: the end with the higher address
/// (then port) is primary. Both ends compute the same answer because they
/// compare the same pair of virtual endpoints.
pub fn arbitrate(local: &SocketAddr, remote: &SocketAddr) -> Role {
    let key = |a: &SocketAddr| (a.ip(), a.port());
    if key(local) > key(remote) {
        Role::Primary
    } else {
        Role::Secondary
    }
}

impl RoleState {
    /// The role to use when resuming: the negotiated one or, with nothing
    /// negotiated, primary.
    pub fn effective(&self) -> Role {
        self.negotiated.unwrap_or(Role::Primary)
    }

    /// We are about to suspend and claim primary.
    pub fn claim(&mut self) {
        self.claimed = true;
        self.claim_pending = true;
        self.negotiated = Some(Role::Primary);
    }

    /// The peer claimed primary.
    pub fn on_claim(&mut self, local: &SocketAddr, remote: &SocketAddr) -> ClaimOutcome {
        // Arbitrate whenever we claimed too, also for a retransmitted claim
        // that arrives after the first one was arbitrated: the answer is the
        // same each time and nothing is sent.
        if self.claimed {
            let role = arbitrate(local, remote);
            self.claim_pending = false;
            self.negotiated = Some(role);
            ClaimOutcome::Arbitrated(role)
        } else {
            self.negotiated = Some(Role::Secondary);
            ClaimOutcome::AnswerSecondary
        }
    }

    /// The peer accepted secondary: our claim stands.
    pub fn on_accept(&mut self) {
        self.claim_pending = false;
        self.negotiated = Some(Role::Primary);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().expect("addr")
    }

    #[test]
    fn one_claim_makes_the_other_secondary() {
        let (a, b) = (sa("10.0.0.1:1"), sa("10.0.0.2:2"));
        let mut mover = RoleState::default();
        let mut peer = RoleState::default();
        mover.claim();
        assert_eq!(peer.on_claim(&b, &a), ClaimOutcome::AnswerSecondary);
        mover.on_accept();
        assert_eq!(mover.effective(), Role::Primary);
        assert_eq!(peer.effective(), Role::Secondary);
    }

    #[test]
    fn crossing_claims_pick_the_higher_address() {
        let (a, b) = (sa("10.0.0.1:1"), sa("10.0.0.2:2"));
        let (mut sa_, mut sb) = (RoleState::default(), RoleState::default());
        sa_.claim();
        sb.claim();
        assert_eq!(
            sa_.on_claim(&a, &b),
            ClaimOutcome::Arbitrated(Role::Secondary)
        );
        assert_eq!(sb.on_claim(&b, &a), ClaimOutcome::Arbitrated(Role::Primary));
        // Same host (loopback tests): the port decides.
        assert_ne!(
            arbitrate(&sa("10.0.0.1:5"), &sa("10.0.0.1:6")),
            arbitrate(&sa("10.0.0.1:6"), &sa("10.0.0.1:5"))
        );
    }

    #[test]
    fn default_is_primary() {
        assert_eq!(RoleState::default().effective(), Role::Primary);
    }
}
