//! Counters in [`crate::MAP_STATS`], a per-CPU array indexed by these.
//!
//! Every verdict other than a plain "not ours, pass" is counted under one of
//! these names, so an operator can tell *why* a packet was dropped or
//! redirected without per-packet logs.

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident = $idx:literal, $text:literal;)*) => {
        $($(#[$doc])* pub const $name: u32 = $idx;)*
        /// Number of counters.
        pub const STAT_COUNT: u32 = 0 $(+ { let _ = $idx; 1 })*;
        /// Stable names of the counters, indexed like the constants.
        pub const STAT_NAMES: [&str; STAT_COUNT as usize] = [$($text),*];
    };
}

counters! {
    /// An outgoing packet was rewritten from virtual to physical endpoints.
    STAT_EGRESS_TRANSLATED = 0, "egress_translated";
    /// An incoming packet was rewritten from physical to virtual endpoints.
    STAT_INGRESS_TRANSLATED = 1, "ingress_translated";
    /// A translated packet was redirected to re-resolve its next hop.
    STAT_EGRESS_REDIRECTED = 2, "egress_redirected";
    /// Dropped: a translated packet could not be rewritten (store failed);
    /// sending it half-rewritten would be worse.
    STAT_DROP_REWRITE_FAILED = 3, "drop_rewrite_failed";
    /// Dropped: the checksum update helper failed.
    STAT_DROP_CSUM_FAILED = 4, "drop_csum_failed";
    /// Dropped: bpf_redirect_neigh refused the target interface.
    STAT_DROP_REDIRECT_FAILED = 5, "drop_redirect_failed";
    /// Passed untranslated: a fragment after the first (IPv4 or IPv6) of a
    /// datagram whose first fragment was not seen translated here (it came
    /// later, or its flow is not translated): it has no ports to match.
    STAT_PASS_FRAGMENT = 6, "pass_fragment";
    /// Passed untranslated: an outgoing IPv6 packet with more extension
    /// headers than the tc parser walks.
    STAT_PASS_IPV6_EXTHDR = 7, "pass_ipv6_exthdr";
    /// A TCP connection was recorded by sock_ops.
    STAT_SOCKOPS_RECORDED = 8, "sockops_recorded";
    /// A TCP connection record was removed on close.
    STAT_SOCKOPS_REMOVED = 9, "sockops_removed";
    /// A TCP connection could not be recorded: the map is full.
    STAT_CONNS_MAP_FULL = 10, "conns_map_full";
    /// A socket of another network namespace was ignored.
    STAT_OTHER_NETNS = 11, "other_netns";
    /// A UDP flow was recorded (first time seen).
    STAT_UDP_RECORDED = 12, "udp_recorded";
    /// Passed untranslated: the packet was too short for its headers.
    STAT_PASS_TRUNCATED = 13, "pass_truncated";
    /// A retransmission timeout of a recorded TCP connection was recorded
    /// (its `snd_una`, for restarting it after an outage).
    STAT_SOCKOPS_RTO = 14, "sockops_rto";
    /// Dropped on purpose: an outgoing packet of a flow held while its own
    /// end moves (`NAT_F_HOLD`); its socket keeps the data and sends again.
    STAT_DROP_HELD = 15, "drop_held";
    /// A rebinding TCP flow learned its peer's new NAT port from its TCP
    /// BIND, whose token proved it the peer's (see `RebindValue`).
    STAT_REBIND_LEARNED = 16, "rebind_learned";
    /// A TCP BIND from a rebinding flow's public address to its port
    /// carried a token that is not the flow's: taken for nothing, dropped.
    STAT_REBIND_REFUSED = 17, "rebind_refused";
    /// An in-band BIND (a peer behind NAT naming its UDP flow's public
    /// port) was diverted from the flow's port to vnatd (`CFG_F_BIND_DIVERT`).
    STAT_BIND_DIVERTED = 18, "bind_diverted";
    /// Dropped on purpose: a UDP datagram or TCP segment (not a SYN) from
    /// a rebinding flow's new NAT address to its port that no recorded flow
    /// owns. The flow's new NAT port is taken only from its authenticated
    /// BIND, never from a packet anyone behind that NAT could send, so
    /// until then no socket may receive it as a new peer's (TCP: nor
    /// answer the moved peer's first segments with a reset).
    STAT_DROP_REBINDING = 19, "drop_rebinding";
    /// Dropped: a datagram shaped as an in-band BIND sent to vnatd's VCMP
    /// port itself. Only BINDs the tc program diverted from a flow's port
    /// (writing that port into them) may reach vnatd.
    STAT_DROP_BIND_DIRECT = 20, "drop_bind_direct";
    /// A UDP flow not recorded: UDP records fill their share of the
    /// connection map (`UDP_MAX_RECORDS`), kept for TCP.
    STAT_UDP_BUDGET_FULL = 21, "udp_budget_full";
    /// A UDP flow not recorded: its socket has `UDP_PER_SOCKET_MAX` flows
    /// recorded already (a server flooded from many sources).
    STAT_UDP_SOCKET_FULL = 22, "udp_socket_full";
    /// A fragment after the first of a datagram whose first fragment was
    /// translated, translated by that datagram's flow (addresses only).
    STAT_FRAGMENT_TRANSLATED = 23, "fragment_translated";
    /// A TCP connection of an enabled cgroup's socket in another network
    /// namespace (a container) was recorded in the guest map.
    STAT_GUEST_RECORDED = 24, "guest_recorded";
    /// A guest connection could not be recorded: the guest map is full.
    STAT_GUESTS_MAP_FULL = 25, "guests_map_full";
    /// Hide location: an application was shown a moved host's virtual
    /// address instead of its physical one (getpeername, accept, recvmsg,
    /// getsockname).
    STAT_HIDE_SHOWN = 26, "hide_shown";
    /// Hide location: a connect(), sendmsg() or bind() naming a moved
    /// host's virtual address went to its physical one.
    STAT_HIDE_REDIRECTED = 27, "hide_redirected";
    /// A connection or flow with a loopback address at either end was not
    /// recorded: it never leaves the host, so there is nothing to move.
    STAT_LOOPBACK_IGNORED = 28, "loopback_ignored";
    /// A TCP connection whose two ends are sockets of this host (in one
    /// network namespace) was not recorded, nor kept recorded at its
    /// connecting end: it does not leave the host either.
    STAT_LOCAL_PAIR_IGNORED = 29, "local_pair_ignored";
    /// A connection or flow not recorded: its owner (a user, or the
    /// connections accepted from other hosts) holds its budget of the map
    /// already (`Budgets`), which leaves the rest to the others.
    STAT_OWNER_BUDGET_FULL = 30, "owner_budget_full";
    /// Dropped: an incoming IPv6 packet with more extension headers than
    /// the tc parser walks (what they hide may be a BIND or a rebinding
    /// flow's datagram).
    STAT_DROP_IPV6_EXTHDR = 31, "drop_ipv6_exthdr";
    /// An ICMP or ICMPv6 error quoting a translated flow's packet was
    /// translated (its addresses and the quoted header).
    STAT_ICMP_TRANSLATED = 32, "icmp_translated";
    /// A rebinding TCP flow stopped learning: too many TCP BINDs from its
    /// NAT's address to its port carried a wrong token (a guesser).
    STAT_REBIND_STOPPED = 33, "rebind_stopped";
    /// A first fragment did not take the place of another flow's live
    /// fragment entry (same addresses, same identification): a spoof.
    STAT_FRAGMENT_COLLISION = 34, "fragment_collision";
    /// Dropped: a TCP BIND that reached the tc ingress (taken, refused, or
    /// for a flow no longer rebinding): it carries nothing for a socket.
    STAT_TCP_BIND_CONSUMED = 35, "tcp_bind_consumed";
    /// A packet of a flow carried in the other address family
    /// (`NAT_F_FAMILY`) was translated between IPv4 and IPv6 (counted
    /// besides `egress_translated` or `ingress_translated`).
    STAT_FAMILY_TRANSLATED = 36, "family_translated";
    /// Dropped: a packet of a flow carried in the other address family
    /// that cannot be translated between IPv4 and IPv6 here: a fragment,
    /// IPv4 options, IPv6 extension headers (a socket's own packets carry
    /// none of them; the translated route's MTU keeps them unfragmented).
    STAT_DROP_FAMILY_UNTRANSLATABLE = 37, "drop_family_untranslatable";
    /// Dropped: a UDP-over-IPv4 datagram without checksum (legal in IPv4,
    /// not in IPv6) of a flow carried over IPv6.
    STAT_DROP_UDP_ZERO_CSUM = 38, "drop_udp_zero_csum";
    /// Dropped: `bpf_skb_change_proto` refused to change a packet's IP
    /// version (a GSO type it cannot carry over, no room).
    STAT_DROP_FAMILY_FAILED = 39, "drop_family_failed";
    /// Dropped: an ICMP or ICMPv6 error quoting a packet of a flow carried
    /// in the other address family (not translated between ICMP and
    /// ICMPv6; the flow's route MTU already allows for the larger header).
    STAT_DROP_ICMP_FAMILY = 40, "drop_icmp_family";
    /// Dropped by a NAT guard (`natguard`): a TCP segment from a peer's NAT
    /// address to a guarded port that our kernel would have reset (no
    /// socket but a listener), or a held UDP datagram from an unknown port
    /// there: maybe the peer's connection, re-mapped by its NAT.
    STAT_DROP_NAT_GUARD = 41, "drop_nat_guard";
    /// A NAT guard let an unknown UDP source port through after holding it
    /// (`GUARD_UDP_HOLD_NS`): no BIND claimed it, another host's new flow.
    STAT_NAT_GUARD_RELEASED = 42, "nat_guard_released";
    /// A rebinding TCP connection's TCP BIND with the right token came on
    /// the recorded 4-tuple: its NAT did not re-map it; nothing to learn.
    STAT_REBIND_UNCHANGED = 43, "rebind_unchanged";
    /// An outgoing packet of a flow held while its own end moves passed:
    /// the hold outlived the limit it was made with (vnatd had not
    /// released it).
    STAT_HOLD_EXPIRED = 44, "hold_expired";
    /// Dropped on purpose: an outgoing packet of a flow whose peer address
    /// is not validated yet (`NAT_F_BUDGET`) that would have sent there more
    /// than three times what came from there. The socket sends it again
    /// later (after the validation, or once more came in).
    STAT_DROP_UNVALIDATED = 45, "drop_unvalidated";
    /// An outgoing packet of a flow whose peer address is not validated
    /// yet, over its allowance there, went to the flow's last validated
    /// placement instead (`UnvalidatedBudget::fallback`; counted besides
    /// `egress_translated` when that placement is translated).
    STAT_UNVALIDATED_FALLBACK = 46, "unvalidated_fallback";
    /// An outgoing packet of a flow without translation, from an address
    /// this host has only on `lo` now (it left the address's network,
    /// [`crate::MAP_GONE`]), went nowhere: the sending socket sees a
    /// transmission, as on a link that went dark, instead of the packet
    /// leaving into the new network with the address of the old one.
    STAT_GONE_DISCARDED = 47, "gone_discarded";
}
