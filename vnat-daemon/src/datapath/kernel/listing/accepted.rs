//! The cgroup of the connections this host accepted (issue 32, item 4).
//!
//! sock_ops records an accepted connection from the kernel's receive path
//! (tcp_rcv_state_process calls BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB in
//! softirq), where no process stands behind the packet: the connect hook
//! that names an active connection's owner never ran for it, and no helper
//! sock_ops may call on Linux 6.1 gives a socket's cgroup. So its record
//! says cgroup 0, and the per-cgroup policy (`preempt_cgroups`) never
//! applied to it. The socket itself belongs to its listener's cgroup (the
//! kernel clones the listener's cgroup into the child socket,
//! sk_clone_lock), and sock_diag says which (INET_DIAG_CGROUP_ID, sent with
//! every answer since Linux 5.7): looked up with one dump when such a record
//! is new, and kept per socket cookie while the record lives. The same
//! answer gives the socket's inode, which names its process (`/proc/PID/fd`)
//! without reading `/proc/net/tcp`, whose text takes seconds to make at
//! 100,000 sockets.

use std::collections::HashMap;

use crate::datapath::{DatapathError, Proto};

/// `TCP_ESTABLISHED` and `TCP_CLOSE_WAIT` (include/net/tcp_states.h):
/// the states of a recorded connection's socket.
const STATES: u32 = 1 << 1 | 1 << 8;

/// The cgroups and inodes found, by socket cookie (0: the kernel did not
/// say, or the socket was gone; not asked again).
#[derive(Debug, Default)]
pub(in crate::datapath::kernel) struct AcceptedCgroups {
    by_cookie: HashMap<u64, Found>,
}

/// What sock_diag said of one socket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(in crate::datapath::kernel) struct Found {
    pub cgroup_id: u64,
    pub inode: u64,
}

impl AcceptedCgroups {
    /// Find the cgroup of each socket of `cookies` (accepted connections
    /// recorded without one), with one sock_diag dump by `dump` if some
    /// cookie is new; the others are forgotten.
    pub(in crate::datapath::kernel) fn resolve(
        &mut self,
        cookies: &[u64],
        dump: impl FnOnce() -> Result<Vec<(u64, Found)>, DatapathError>,
    ) {
        // A set, not the slice: at 100,000 accepted connections a linear
        // `contains` per entry was 10^10 comparisons per listing.
        let wanted: std::collections::HashSet<u64> = cookies.iter().copied().collect();
        self.by_cookie.retain(|c, _| wanted.contains(c));
        if cookies.iter().any(|c| !self.by_cookie.contains_key(c)) {
            let found: HashMap<u64, Found> = match dump() {
                Ok(l) => l.into_iter().collect(),
                Err(e) => {
                    tracing::debug!(error = %e, "cannot ask sock_diag for accepted sockets' cgroups");
                    HashMap::new()
                }
            };
            for c in cookies {
                self.by_cookie
                    .entry(*c)
                    .or_insert_with(|| found.get(c).copied().unwrap_or_default());
            }
        }
    }

    /// The cgroup found for the socket `cookie` (0: none).
    pub(in crate::datapath::kernel) fn cgroup(&self, cookie: u64) -> u64 {
        self.by_cookie.get(&cookie).map_or(0, |f| f.cgroup_id)
    }

    /// The inode found for the socket `cookie`, if any.
    pub(in crate::datapath::kernel) fn inode(&self, cookie: u64) -> Option<u64> {
        self.by_cookie
            .get(&cookie)
            .map(|f| f.inode)
            .filter(|i| *i != 0)
    }
}

/// Every TCP socket of this namespace with its cookie, cgroup and inode.
pub(in crate::datapath::kernel) fn dump() -> Result<Vec<(u64, Found)>, DatapathError> {
    Ok(super::super::restart::list_sockets(Proto::Tcp, STATES)?
        .into_iter()
        .map(|s| {
            let found = Found {
                cgroup_id: s.cgroup_id,
                inode: s.inode,
            };
            (s.cookie, found)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_dump_for_new_sockets_and_none_while_nothing_is_new() {
        let mut a = AcceptedCgroups::default();
        let dumps = std::cell::Cell::new(0);
        let dump = || {
            dumps.set(dumps.get() + 1);
            let f = |cgroup_id| Found {
                cgroup_id,
                inode: cgroup_id + 1000,
            };
            Ok(vec![(1, f(71)), (2, f(72)), (9, f(79))])
        };
        a.resolve(&[1, 2, 3], dump);
        assert_eq!((a.cgroup(1), a.cgroup(2)), (71, 72));
        assert_eq!((a.inode(1), a.inode(3)), (Some(1071), None));
        // 3 was not listed: 0, and not asked again.
        a.resolve(&[1, 2, 3], dump);
        assert_eq!((a.cgroup(3), dumps.get()), (0, 1));
        // A closed socket is forgotten; a new one is asked for.
        a.resolve(&[2, 9], dump);
        assert!(!a.by_cookie.contains_key(&1));
        assert_eq!((a.cgroup(9), dumps.get()), (79, 2));
        // A failed dump leaves 0 (the record's own, unknown).
        a.resolve(&[4], || Err(DatapathError::NoEbpfObject));
        assert_eq!(a.cgroup(4), 0);
    }
}
