//! Budgets per owner in the maps the recorders fill (issue 31, item 3).
//!
//! With the whole host enabled, every user's sockets are recorded. So that
//! one user cannot fill a map and leave everyone else's connections
//! unrecorded (never mobile), each record is charged to its owner, the uid
//! of the process that made it ([`crate::ConnRecord::owner_uid`]), and an
//! owner may hold only a share of each map. TCP connections accepted from
//! other hosts (sock_ops runs in softirq and cannot tell whose listener
//! accepted them) share one owner, [`OWNER_ACCEPTED`], with half the map;
//! connections whose connect() left no owner (over its owner's budget of
//! sockets still connecting, [`MAP_CONNECTING`]) share [`OWNER_UNSEEN`],
//! with a user's share. Root is charged to nothing: it can unload vnat
//! anyway.

use crate::{FlowKey, AF_INET, AF_INET6, CONNS_MAX_ENTRIES, GUESTS_MAX_ENTRIES, UDP_MAX_RECORDS};

/// Per-owner counts, owner uid (u32) to [`OwnerCounts`]. The programs add
/// and (for what they remove themselves) take away; vnatd recounts every
/// owner at each housekeeping pass, which also corrects what concurrent
/// updates may miss.
pub const MAP_OWNERS: &str = "VNAT_OWNERS";
/// Owners tracked at once: a uid the map has no room for records nothing.
pub const OWNERS_MAX_ENTRIES: u32 = 65_536;
/// One slot: the [`Budgets`] vnatd derived from the maps' real sizes.
pub const MAP_BUDGETS: &str = "VNAT_BUDGETS";

/// [`crate::ConnRecord::owner_uid`] of a TCP connection accepted from
/// another host.
pub const OWNER_ACCEPTED: u32 = u32::MAX;
/// [`crate::ConnRecord::owner_uid`] of a TCP connection this host made
/// whose connect() left no owner in [`MAP_CONNECTING`] (its user held its
/// budget of sockets connecting): charged apart from the accepted ones, so
/// that a user's connections beyond its budgets never take their room.
pub const OWNER_UNSEEN: u32 = u32::MAX - 1;

/// Who called connect() on a TCP socket, by socket cookie (u64) to
/// [`Owner`], for sock_ops to copy into the record at ACTIVE_ESTABLISHED
/// (which usually runs in softirq, where "current" is whoever was
/// interrupted). Written by the connect4/connect6 hooks, removed at
/// establishment or when the socket is released. Not an LRU map: one
/// user's sockets that never connect would evict everyone's owners; each
/// owner holds at most [`Budgets::connecting_per_owner`] entries.
pub const MAP_CONNECTING: &str = "VNAT_CONNECTING";
pub const CONNECTING_MAX_ENTRIES: u32 = 16_384;

/// Value of [`MAP_CONNECTING`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    pub cgroup_id: u64,
    pub pid: u32,
    /// The connecting process's uid (in the initial user namespace), whose
    /// budgets the entry and the record count against.
    pub uid: u32,
    pub comm: [u8; 16],
}
const _: () = assert!(core::mem::size_of::<Owner>() == 32);
/// The owner charged to no budget.
pub const OWNER_ROOT: u32 = 0;

/// Value of [`MAP_OWNERS`]: what one owner holds.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnerCounts {
    /// TCP records in [`crate::MAP_CONNS`].
    pub tcp: u32,
    /// UDP records in [`crate::MAP_CONNS`].
    pub udp: u32,
    /// Records in [`crate::MAP_GUESTS`] (TCP and UDP).
    pub guests: u32,
    /// Entries in [`MAP_CONNECTING`] and [`crate::MAP_UDP_PENDING`].
    pub connecting: u32,
}
const _: () = assert!(core::mem::size_of::<OwnerCounts>() == 16);

/// Value of [`MAP_BUDGETS`]: the most one owner may hold of each.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Budgets {
    /// TCP records of one user in [`crate::MAP_CONNS`].
    pub tcp_per_owner: u32,
    /// TCP records charged to [`OWNER_ACCEPTED`].
    pub tcp_accepted: u32,
    /// UDP records of one user in [`crate::MAP_CONNS`].
    pub udp_per_owner: u32,
    /// UDP records of everyone in [`crate::MAP_CONNS`] (what
    /// `VNAT_UDP_COUNT` counts).
    pub udp_total: u32,
    /// Records of one user in [`crate::MAP_GUESTS`].
    pub guests_per_owner: u32,
    /// Sockets of one user connecting at once ([`MAP_CONNECTING`], and UDP
    /// sockets connected before they had a port, [`crate::MAP_UDP_PENDING`]).
    pub connecting_per_owner: u32,
}
const _: () = assert!(core::mem::size_of::<Budgets>() == 24);

impl Budgets {
    /// The budgets for a connection map of `conns` entries and a guests'
    /// map of `guests`: a user may take an eighth of the TCP room, a 32nd
    /// of the map for UDP (an eighth of UDP's quarter), an eighth of the
    /// guests' map; accepted connections half of the map.
    pub const fn for_sizes(conns: u32, guests: u32) -> Budgets {
        Budgets {
            tcp_per_owner: conns / 8,
            tcp_accepted: conns / 2,
            udp_per_owner: conns / 32,
            udp_total: conns / 4,
            guests_per_owner: guests / 8,
            connecting_per_owner: CONNECTING_MAX_ENTRIES / 8,
        }
    }

    /// The budgets of the maps as the programs declare them.
    pub const DEFAULT: Budgets = {
        let b = Budgets::for_sizes(CONNS_MAX_ENTRIES, GUESTS_MAX_ENTRIES);
        assert!(b.udp_total as u64 == UDP_MAX_RECORDS);
        // One share of sockets connecting covers both maps that hold them.
        assert!(crate::UDP_PENDING_MAX_ENTRIES >= CONNECTING_MAX_ENTRIES);
        b
    };
}

#[cfg(feature = "user")]
// SAFETY: both are repr(C), made only of u32 fields, with the padding
// spelled out (sizes asserted above): every bit pattern is a valid value.
unsafe impl aya::Pod for OwnerCounts {}
#[cfg(feature = "user")]
// SAFETY: as above.
unsafe impl aya::Pod for Budgets {}
#[cfg(feature = "user")]
// SAFETY: repr(C), integers and an array of bytes, no padding (32 bytes:
// 8 + 4 + 4 + 16, asserted above).
unsafe impl aya::Pod for Owner {}

/// Whether an IPv4 address (network order, as in a [`FlowKey`]) is in
/// 127.0.0.0/8 (RFC 1122 section 3.2.1.3).
#[inline(always)]
pub const fn is_loopback_v4(addr_be: u32) -> bool {
    addr_be.to_ne_bytes()[0] == 127
}

/// Whether an IPv6 address is `::1` (RFC 4291 section 2.5.3).
#[inline(always)]
pub const fn is_loopback_v6(addr_be: &[u32; 4]) -> bool {
    addr_be[0] == 0 && addr_be[1] == 0 && addr_be[2] == 0 && addr_be[3] == 1u32.to_be()
}

impl FlowKey {
    /// Whether either end of the flow is a loopback address: 127.0.0.0/8,
    /// `::1`, or 127.0.0.0/8 v4-mapped (`::ffff:127.0.0.1`). Such a flow
    /// never leaves its host, so there is nothing to move: the recorders
    /// skip it (a local user once filled the connection map with them).
    #[inline(always)]
    pub const fn is_loopback(&self) -> bool {
        match self.family {
            AF_INET => is_loopback_v4(self.src_addr_be[0]) || is_loopback_v4(self.dst_addr_be[0]),
            AF_INET6 => {
                let src = match crate::v4_of_mapped(&self.src_addr_be) {
                    Some(v4) => is_loopback_v4(v4),
                    None => is_loopback_v6(&self.src_addr_be),
                };
                let dst = match crate::v4_of_mapped(&self.dst_addr_be) {
                    Some(v4) => is_loopback_v4(v4),
                    None => is_loopback_v6(&self.dst_addr_be),
                };
                src || dst
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::PROTO_TCP;

    fn key(src: &str, dst: &str) -> FlowKey {
        let words = |s: &str| -> (u8, [u32; 4]) {
            match s.parse::<std::net::IpAddr>().unwrap() {
                std::net::IpAddr::V4(a) => (AF_INET, [u32::from_ne_bytes(a.octets()), 0, 0, 0]),
                std::net::IpAddr::V6(a) => {
                    let b = a.octets();
                    (
                        AF_INET6,
                        core::array::from_fn(|i| {
                            u32::from_ne_bytes(b[i * 4..i * 4 + 4].try_into().unwrap())
                        }),
                    )
                }
            }
        };
        let (family, s) = words(src);
        let (_, d) = words(dst);
        FlowKey {
            src_addr_be: s,
            dst_addr_be: d,
            family,
            proto: PROTO_TCP,
            ..FlowKey::default()
        }
    }

    #[test]
    fn loopback_at_either_end_in_every_form() {
        for (src, dst) in [
            ("127.0.0.1", "127.0.0.1"),
            ("127.3.4.5", "198.18.1.2"),
            ("198.18.1.2", "127.0.0.53"),
            ("::1", "::1"),
            ("2001:db8::1", "::1"),
            ("::ffff:127.0.0.1", "::ffff:127.0.0.1"),
            ("::ffff:198.18.1.2", "::ffff:127.0.0.1"),
        ] {
            assert!(key(src, dst).is_loopback(), "{src} -> {dst}");
        }
        for (src, dst) in [
            ("198.18.1.2", "198.18.3.2"),
            ("0.0.0.0", "10.0.0.1"),
            ("128.0.0.1", "126.255.255.255"),
            ("2001:db8::1", "2001:db8::2"),
            ("::", "2001:db8::2"),
            ("::2", "::ffff:10.0.0.1"),
            ("::127.0.0.1", "2001:db8::2"),
        ] {
            assert!(!key(src, dst).is_loopback(), "{src} -> {dst}");
        }
    }

    #[test]
    fn budgets_leave_room_for_others() {
        let b = Budgets::for_sizes(2048, 1024);
        assert_eq!(
            (
                b.tcp_per_owner,
                b.tcp_accepted,
                b.udp_per_owner,
                b.udp_total,
                b.guests_per_owner
            ),
            (256, 1024, 64, 512, 128)
        );
        // One user's TCP and UDP together stay well below the map.
        assert!(b.tcp_per_owner + b.udp_per_owner < 2048 / 4);
        assert_eq!(Budgets::DEFAULT.udp_total as u64, UDP_MAX_RECORDS);
    }
}
