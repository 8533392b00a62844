//! Typed counters: every datagram or record that is refused is counted under
//! a [`Reject`] reason, other notable events under a [`Counter`], so that
//! tests and `vnatctl status` can tell what happened and why. Both are plain
//! arrays indexed by the enums: counting is an increment, and a misspelt
//! name does not compile.

/// A notable event the core counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Counter {
    BindAgain,
    BindDivertFailed,
    BindRequestsDropped,
    BindRequestsResent,
    BindRequestsSent,
    BindsBound,
    BindsRebound,
    BindsSent,
    ClaimGaveUp,
    ClaimUnanswered,
    ClaimUnmatched,
    ClaimsBound,
    ClaimsSent,
    DatagramsReceived,
    FamilyChanged,
    HelpAnswered,
    HelpRequested,
    HelpUnanswered,
    KeepalivesSent,
    KeyxRolledBack,
    KeyxUnanswered,
    LocationFound,
    LookupsServed,
    MigrationAborted,
    MigrationCompleted,
    NatRemapSuspected,
    PairCookieEchoed,
    PairCookiesSent,
    PairCrossingIgnored,
    PairDhComputed,
    PairFinResent,
    PairRespResent,
    PairRetransmit,
    Paired,
    PairingDeferred,
    PairingRenewed,
    PairingRetried,
    PairingRetryScheduled,
    PairingTimedOut,
    PathValidated,
    PeerBehindNat,
    PeerError,
    PeersForgotten,
    ProbeAnswers,
    ProbesAnswered,
    ProbesSent,
    ProofsAccepted,
    ProofsAnswered,
    ProofsAsked,
    RecordsAccepted,
    RecordsSent,
    Rekeyed,
    Retransmit,
    SentUnvalidated,
    StoresServed,
    StrangerDropped,
    StrangerPaired,
    StrangerPromoted,
    SwitchConfirmed,
    SwitchUnconfirmed,
    SwitchedSent,
    ValidationFailed,
}

impl Counter {
    /// Every value, in name order.
    pub const ALL: [Counter; 62] = [
        Counter::BindAgain,
        Counter::BindDivertFailed,
        Counter::BindRequestsDropped,
        Counter::BindRequestsResent,
        Counter::BindRequestsSent,
        Counter::BindsBound,
        Counter::BindsRebound,
        Counter::BindsSent,
        Counter::ClaimGaveUp,
        Counter::ClaimUnanswered,
        Counter::ClaimUnmatched,
        Counter::ClaimsBound,
        Counter::ClaimsSent,
        Counter::DatagramsReceived,
        Counter::FamilyChanged,
        Counter::HelpAnswered,
        Counter::HelpRequested,
        Counter::HelpUnanswered,
        Counter::KeepalivesSent,
        Counter::KeyxRolledBack,
        Counter::KeyxUnanswered,
        Counter::LocationFound,
        Counter::LookupsServed,
        Counter::MigrationAborted,
        Counter::MigrationCompleted,
        Counter::NatRemapSuspected,
        Counter::PairCookieEchoed,
        Counter::PairCookiesSent,
        Counter::PairCrossingIgnored,
        Counter::PairDhComputed,
        Counter::PairFinResent,
        Counter::PairRespResent,
        Counter::PairRetransmit,
        Counter::Paired,
        Counter::PairingDeferred,
        Counter::PairingRenewed,
        Counter::PairingRetried,
        Counter::PairingRetryScheduled,
        Counter::PairingTimedOut,
        Counter::PathValidated,
        Counter::PeerBehindNat,
        Counter::PeerError,
        Counter::PeersForgotten,
        Counter::ProbeAnswers,
        Counter::ProbesAnswered,
        Counter::ProbesSent,
        Counter::ProofsAccepted,
        Counter::ProofsAnswered,
        Counter::ProofsAsked,
        Counter::RecordsAccepted,
        Counter::RecordsSent,
        Counter::Rekeyed,
        Counter::Retransmit,
        Counter::SentUnvalidated,
        Counter::StoresServed,
        Counter::StrangerDropped,
        Counter::StrangerPaired,
        Counter::StrangerPromoted,
        Counter::SwitchConfirmed,
        Counter::SwitchUnconfirmed,
        Counter::SwitchedSent,
        Counter::ValidationFailed,
    ];

    /// The stable name shown by `vnatctl status` and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Counter::BindAgain => "bind_again",
            Counter::BindDivertFailed => "bind_divert_failed",
            Counter::BindRequestsDropped => "bind_requests_dropped",
            Counter::BindRequestsResent => "bind_requests_resent",
            Counter::BindRequestsSent => "bind_requests_sent",
            Counter::BindsBound => "binds_bound",
            Counter::BindsRebound => "binds_rebound",
            Counter::BindsSent => "binds_sent",
            Counter::ClaimGaveUp => "claim_gave_up",
            Counter::ClaimUnanswered => "claim_unanswered",
            Counter::ClaimUnmatched => "claim_unmatched",
            Counter::ClaimsBound => "claims_bound",
            Counter::ClaimsSent => "claims_sent",
            Counter::DatagramsReceived => "datagrams_received",
            Counter::FamilyChanged => "family_changed",
            Counter::HelpAnswered => "help_answered",
            Counter::HelpRequested => "help_requested",
            Counter::HelpUnanswered => "help_unanswered",
            Counter::KeepalivesSent => "keepalives_sent",
            Counter::KeyxRolledBack => "keyx_rolled_back",
            Counter::KeyxUnanswered => "keyx_unanswered",
            Counter::LocationFound => "location_found",
            Counter::LookupsServed => "lookups_served",
            Counter::MigrationAborted => "migration_aborted",
            Counter::MigrationCompleted => "migration_completed",
            Counter::NatRemapSuspected => "nat_remap_suspected",
            Counter::PairCookieEchoed => "pair_cookie_echoed",
            Counter::PairCookiesSent => "pair_cookies_sent",
            Counter::PairCrossingIgnored => "pair_crossing_ignored",
            Counter::PairDhComputed => "pair_dh_computed",
            Counter::PairFinResent => "pair_fin_resent",
            Counter::PairRespResent => "pair_resp_resent",
            Counter::PairRetransmit => "pair_retransmit",
            Counter::Paired => "paired",
            Counter::PairingDeferred => "pairing_deferred",
            Counter::PairingRenewed => "pairing_renewed",
            Counter::PairingRetried => "pairing_retried",
            Counter::PairingRetryScheduled => "pairing_retry_scheduled",
            Counter::PairingTimedOut => "pairing_timed_out",
            Counter::PathValidated => "path_validated",
            Counter::PeerBehindNat => "peer_behind_nat",
            Counter::PeerError => "peer_error",
            Counter::PeersForgotten => "peers_forgotten",
            Counter::ProbeAnswers => "probe_answers",
            Counter::ProbesAnswered => "probes_answered",
            Counter::ProbesSent => "probes_sent",
            Counter::ProofsAccepted => "proofs_accepted",
            Counter::ProofsAnswered => "proofs_answered",
            Counter::ProofsAsked => "proofs_asked",
            Counter::RecordsAccepted => "records_accepted",
            Counter::RecordsSent => "records_sent",
            Counter::Rekeyed => "rekeyed",
            Counter::Retransmit => "retransmit",
            Counter::SentUnvalidated => "sent_unvalidated",
            Counter::StoresServed => "stores_served",
            Counter::StrangerDropped => "stranger_dropped",
            Counter::StrangerPaired => "stranger_paired",
            Counter::StrangerPromoted => "stranger_promoted",
            Counter::SwitchConfirmed => "switch_confirmed",
            Counter::SwitchUnconfirmed => "switch_unconfirmed",
            Counter::SwitchedSent => "switched_sent",
            Counter::ValidationFailed => "validation_failed",
        }
    }
}

/// Why an input (datagram, record, request) was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reject {
    AmplificationLimit,
    BadCount,
    BadErrorCode,
    BadExtension,
    BadFamily,
    BadLength,
    BadMac,
    BadProto,
    BadVersion,
    BindBadCommitment,
    BindBadTag,
    BindMalformed,
    BindMismatch,
    BindNoFlow,
    BindNotDiverted,
    BindReplayed,
    BindReqBadTag,
    BindReqMalformed,
    BindReqTooSoon,
    BindReqUnknown,
    BindReqUnpaired,
    BindRequestsFull,
    BindUnpaired,
    ClaimBadTag,
    ClaimConflict,
    ClaimNamesTaken,
    ClaimUnpaired,
    ClaimUnproven,
    ClaimWeakBinding,
    ClaimWrongAddress,
    ClaimWrongProtocol,
    CommandMismatch,
    EventQueueFull,
    LowOrderPoint,
    MixedFamilies,
    NoKeys,
    NoLocalInFamily,
    OwnLocation,
    PairBadCookie,
    PairBadTag,
    PairCookieUnsolicited,
    PairFinUnsolicited,
    PairReflected,
    PairRespUnsolicited,
    PairUnknownSource,
    PairWrongId,
    PairingTableFull,
    PeerKeyChanged,
    PeerOverBudget,
    ProbeBadTag,
    ProbeReplayed,
    ProbeUnexpectedAnswer,
    ProbeUnpaired,
    ProofMalformed,
    ProofRefused,
    ProofsCapped,
    RecordVersion,
    ReplayDuplicate,
    ReplayTooOld,
    RequestTableFull,
    ReservedBits,
    SendWithoutKeys,
    StaleLocation,
    StaleUpdate,
    StoreFull,
    StrangersFull,
    Truncated,
    TxQueueFull,
    TxRecordOverflow,
    UnencodableRecord,
    UnexpectedKind,
    UnexpectedResponse,
    UnknownConnection,
    UnknownKind,
    UnrequestedLocation,
    UnsolicitedLookupR,
    UnsolicitedStoreR,
    UnsolicitedSuspSecondary,
}

impl Reject {
    /// Every value, in name order.
    pub const ALL: [Reject; 78] = [
        Reject::AmplificationLimit,
        Reject::BadCount,
        Reject::BadErrorCode,
        Reject::BadExtension,
        Reject::BadFamily,
        Reject::BadLength,
        Reject::BadMac,
        Reject::BadProto,
        Reject::BadVersion,
        Reject::BindBadCommitment,
        Reject::BindBadTag,
        Reject::BindMalformed,
        Reject::BindMismatch,
        Reject::BindNoFlow,
        Reject::BindNotDiverted,
        Reject::BindReplayed,
        Reject::BindReqBadTag,
        Reject::BindReqMalformed,
        Reject::BindReqTooSoon,
        Reject::BindReqUnknown,
        Reject::BindReqUnpaired,
        Reject::BindRequestsFull,
        Reject::BindUnpaired,
        Reject::ClaimBadTag,
        Reject::ClaimConflict,
        Reject::ClaimNamesTaken,
        Reject::ClaimUnpaired,
        Reject::ClaimUnproven,
        Reject::ClaimWeakBinding,
        Reject::ClaimWrongAddress,
        Reject::ClaimWrongProtocol,
        Reject::CommandMismatch,
        Reject::EventQueueFull,
        Reject::LowOrderPoint,
        Reject::MixedFamilies,
        Reject::NoKeys,
        Reject::NoLocalInFamily,
        Reject::OwnLocation,
        Reject::PairBadCookie,
        Reject::PairBadTag,
        Reject::PairCookieUnsolicited,
        Reject::PairFinUnsolicited,
        Reject::PairReflected,
        Reject::PairRespUnsolicited,
        Reject::PairUnknownSource,
        Reject::PairWrongId,
        Reject::PairingTableFull,
        Reject::PeerKeyChanged,
        Reject::PeerOverBudget,
        Reject::ProbeBadTag,
        Reject::ProbeReplayed,
        Reject::ProbeUnexpectedAnswer,
        Reject::ProbeUnpaired,
        Reject::ProofMalformed,
        Reject::ProofRefused,
        Reject::ProofsCapped,
        Reject::RecordVersion,
        Reject::ReplayDuplicate,
        Reject::ReplayTooOld,
        Reject::RequestTableFull,
        Reject::ReservedBits,
        Reject::SendWithoutKeys,
        Reject::StaleLocation,
        Reject::StaleUpdate,
        Reject::StoreFull,
        Reject::StrangersFull,
        Reject::Truncated,
        Reject::TxQueueFull,
        Reject::TxRecordOverflow,
        Reject::UnencodableRecord,
        Reject::UnexpectedKind,
        Reject::UnexpectedResponse,
        Reject::UnknownConnection,
        Reject::UnknownKind,
        Reject::UnrequestedLocation,
        Reject::UnsolicitedLookupR,
        Reject::UnsolicitedStoreR,
        Reject::UnsolicitedSuspSecondary,
    ];

    /// The stable name shown by `vnatctl status` and in logs.
    pub fn name(self) -> &'static str {
        match self {
            Reject::AmplificationLimit => "amplification_limit",
            Reject::BadCount => "bad_count",
            Reject::BadErrorCode => "bad_error_code",
            Reject::BadExtension => "bad_extension",
            Reject::BadFamily => "bad_family",
            Reject::BadLength => "bad_length",
            Reject::BadMac => "bad_mac",
            Reject::BadProto => "bad_proto",
            Reject::BadVersion => "bad_version",
            Reject::BindBadCommitment => "bind_bad_commitment",
            Reject::BindBadTag => "bind_bad_tag",
            Reject::BindMalformed => "bind_malformed",
            Reject::BindMismatch => "bind_mismatch",
            Reject::BindNoFlow => "bind_no_flow",
            Reject::BindNotDiverted => "bind_not_diverted",
            Reject::BindReplayed => "bind_replayed",
            Reject::BindReqBadTag => "bind_req_bad_tag",
            Reject::BindReqMalformed => "bind_req_malformed",
            Reject::BindReqTooSoon => "bind_req_too_soon",
            Reject::BindReqUnknown => "bind_req_unknown",
            Reject::BindReqUnpaired => "bind_req_unpaired",
            Reject::BindRequestsFull => "bind_requests_full",
            Reject::BindUnpaired => "bind_unpaired",
            Reject::ClaimBadTag => "claim_bad_tag",
            Reject::ClaimConflict => "claim_conflict",
            Reject::ClaimNamesTaken => "claim_names_taken",
            Reject::ClaimUnpaired => "claim_unpaired",
            Reject::ClaimUnproven => "claim_unproven",
            Reject::ClaimWeakBinding => "claim_weak_binding",
            Reject::ClaimWrongAddress => "claim_wrong_address",
            Reject::ClaimWrongProtocol => "claim_wrong_protocol",
            Reject::CommandMismatch => "command_mismatch",
            Reject::EventQueueFull => "event_queue_full",
            Reject::LowOrderPoint => "low_order_point",
            Reject::MixedFamilies => "mixed_families",
            Reject::NoKeys => "no_keys",
            Reject::NoLocalInFamily => "no_local_in_family",
            Reject::OwnLocation => "own_location",
            Reject::PairBadCookie => "pair_bad_cookie",
            Reject::PairBadTag => "pair_bad_tag",
            Reject::PairCookieUnsolicited => "pair_cookie_unsolicited",
            Reject::PairFinUnsolicited => "pair_fin_unsolicited",
            Reject::PairReflected => "pair_reflected",
            Reject::PairRespUnsolicited => "pair_resp_unsolicited",
            Reject::PairUnknownSource => "pair_unknown_source",
            Reject::PairWrongId => "pair_wrong_id",
            Reject::PairingTableFull => "pairing_table_full",
            Reject::PeerKeyChanged => "peer_key_changed",
            Reject::PeerOverBudget => "peer_over_budget",
            Reject::ProbeBadTag => "probe_bad_tag",
            Reject::ProbeReplayed => "probe_replayed",
            Reject::ProbeUnexpectedAnswer => "probe_unexpected_answer",
            Reject::ProbeUnpaired => "probe_unpaired",
            Reject::ProofMalformed => "proof_malformed",
            Reject::ProofRefused => "proof_refused",
            Reject::ProofsCapped => "proofs_capped",
            Reject::RecordVersion => "record_version",
            Reject::ReplayDuplicate => "replay_duplicate",
            Reject::ReplayTooOld => "replay_too_old",
            Reject::RequestTableFull => "request_table_full",
            Reject::ReservedBits => "reserved_bits",
            Reject::SendWithoutKeys => "send_without_keys",
            Reject::StaleLocation => "stale_location",
            Reject::StaleUpdate => "stale_update",
            Reject::StoreFull => "store_full",
            Reject::StrangersFull => "strangers_full",
            Reject::Truncated => "truncated",
            Reject::TxQueueFull => "tx_queue_full",
            Reject::TxRecordOverflow => "tx_record_overflow",
            Reject::UnencodableRecord => "unencodable_record",
            Reject::UnexpectedKind => "unexpected_kind",
            Reject::UnexpectedResponse => "unexpected_response",
            Reject::UnknownConnection => "unknown_connection",
            Reject::UnknownKind => "unknown_kind",
            Reject::UnrequestedLocation => "unrequested_location",
            Reject::UnsolicitedLookupR => "unsolicited_lookup_r",
            Reject::UnsolicitedStoreR => "unsolicited_store_r",
            Reject::UnsolicitedSuspSecondary => "unsolicited_susp_secondary",
        }
    }
}

/// The core's counters.
#[derive(Clone, PartialEq, Eq)]
pub struct Stats {
    events: [u64; Counter::ALL.len()],
    rejected: [u64; Reject::ALL.len()],
}

impl Default for Stats {
    fn default() -> Stats {
        Stats {
            events: [0; Counter::ALL.len()],
            rejected: [0; Reject::ALL.len()],
        }
    }
}

impl Stats {
    /// Count a notable event (sent, accepted, retransmitted...).
    pub fn count(&mut self, c: Counter) {
        self.count_n(c, 1);
    }
    /// Count `n` notable events at once.
    pub fn count_n(&mut self, c: Counter, n: u64) {
        let slot = &mut self.events[c as usize];
        *slot = slot.saturating_add(n);
    }
    /// Count an input refused for `reason`.
    pub fn reject(&mut self, reason: Reject) {
        let slot = &mut self.rejected[reason as usize];
        *slot = slot.saturating_add(1);
    }
    pub fn get(&self, c: Counter) -> u64 {
        self.events[c as usize]
    }
    pub fn rejected(&self, reason: Reject) -> u64 {
        self.rejected[reason as usize]
    }
    pub fn rejected_total(&self) -> u64 {
        self.rejected.iter().sum()
    }
    /// The events that happened at least once, by name.
    pub fn events(&self) -> impl Iterator<Item = (Counter, u64)> + '_ {
        Counter::ALL
            .iter()
            .map(|&c| (c, self.get(c)))
            .filter(|&(_, n)| n > 0)
    }
    /// The reasons that refused something at least once, by name.
    pub fn rejects(&self) -> impl Iterator<Item = (Reject, u64)> + '_ {
        Reject::ALL
            .iter()
            .map(|&r| (r, self.rejected(r)))
            .filter(|&(_, n)| n > 0)
    }
}

/// The counters that moved, by name.
impl std::fmt::Debug for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stats")
            .field(
                "events",
                &self
                    .events()
                    .map(|(c, n)| (c.name(), n))
                    .collect::<Vec<_>>(),
            )
            .field(
                "rejected",
                &self
                    .rejects()
                    .map(|(r, n)| (r.name(), n))
                    .collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// As before the counters were typed: `{"events": {name: n}, "rejected":
/// {name: n}}`, with only the counters that moved.
impl serde::Serialize for Stats {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let events: std::collections::BTreeMap<&str, u64> =
            self.events().map(|(c, n)| (c.name(), n)).collect();
        let rejected: std::collections::BTreeMap<&str, u64> =
            self.rejects().map(|(r, n)| (r.name(), n)).collect();
        let mut st = s.serialize_struct("Stats", 2)?;
        st.serialize_field("events", &events)?;
        st.serialize_field("rejected", &rejected)?;
        st.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_sorted_and_match_their_slot() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(*c as usize, i);
        }
        for (i, r) in Reject::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
        }
        assert!(Counter::ALL.windows(2).all(|w| w[0].name() < w[1].name()));
        assert!(Reject::ALL.windows(2).all(|w| w[0].name() < w[1].name()));
    }

    #[test]
    fn serializes_only_what_moved_by_name() {
        let mut st = Stats::default();
        st.count(Counter::Paired);
        st.count_n(Counter::RecordsSent, 3);
        st.reject(Reject::BadMac);
        st.reject(Reject::BadMac);
        assert_eq!(
            serde_json::to_value(&st).unwrap(),
            serde_json::json!({
                "events": {"paired": 1, "records_sent": 3},
                "rejected": {"bad_mac": 2},
            })
        );
        assert_eq!(st.rejected_total(), 2);
    }
}
