//! Adoption (issue 18, item 6): connections of an enabled cgroup that the
//! recorders never saw, because they were opened before vnatd started,
//! before their cgroup was enabled, or before a vnatd that lost its pins
//! started again. sock_ops records a TCP connection only when it is
//! established, and the UDP recorders only see later connects and sends to
//! an address, so without adoption such a connection is never moved.
//!
//! vnatd lists this namespace's established TCP sockets and connected UDP
//! sockets with sock_diag, which gives each one's cgroup (the cgroup it was
//! made in; an accepted socket: its listener's), cookie and inode, and
//! records those in an enabled cgroup that have no record, as sock_ops and
//! the UDP recorders would have:
//! - TCP: the sequence numbers sock_ops reads at establishment are read
//!   back from the live socket (`restart::sequence_bases`, repair mode): the
//!   first sequence numbers after the SYNs are `snd_una - bytes_acked` and
//!   `rcv_nxt - bytes_received`, with one exception: an active opener's
//!   bytes_acked counts its SYN, a passive one's does not. A socket is
//!   passive when a listener holds its local port. The record's origin is
//!   `ORIGIN_TCP_ADOPTED`: no state callback will remove it, so
//!   [`KernelDatapath::drop_closed_adopted`] does once the socket is gone.
//! - UDP: the connected pair, used both ways (`ORIGIN_UDP_ADOPTED`);
//!   `sync_udp` drops it with its socket like any UDP record.
//!
//! The owner (pid and command) is the first process found holding the
//! socket. Containers' sockets (other namespaces) are not adopted.

use std::collections::HashSet;

use vnat_common::{ORIGIN_TCP_ADOPTED, ORIGIN_UDP_ADOPTED, UDP_DIR_RECV, UDP_DIR_SEND};

use super::*;
use listing::boottime_ns;
use restart::Listed;

const TCP_ESTABLISHED: u8 = 1;
const TCP_LISTEN: u8 = 10;
/// The states in which sock_ops would still hold the record: it removes it
/// at TCP_CLOSE, which a closing socket reaches when it enters TIME_WAIT.
const TCP_ALIVE: u32 = 1 << TCP_ESTABLISHED
    | 1 << 4 // FIN_WAIT1
    | 1 << 5 // FIN_WAIT2
    | 1 << 8 // CLOSE_WAIT
    | 1 << 9 // LAST_ACK
    | 1 << 11; // CLOSING

/// How often the periodic housekeeping looks for connections to adopt
/// besides when vnatd starts and when a cgroup is enabled (the times
/// unrecorded connections appear).
pub(super) const ADOPT_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

impl KernelDatapath {
    /// Record the connections of the enabled cgroups in this namespace that
    /// have no record (see the module documentation). Returns how many were
    /// adopted.
    pub(super) fn adopt(&mut self) -> Result<usize, DatapathError> {
        self.last_adoption = Some(std::time::Instant::now());
        let mut enabled = HashSet::new();
        for id in attach::pinned_cgroups(&self.bpffs) {
            if let Some(p) = attach::cgroup_path(id) {
                attach::cgroup_tree_ids(&p, &mut enabled);
            }
        }
        if enabled.is_empty() {
            return Ok(0);
        }
        let tcp = restart::list_sockets(Proto::Tcp, 1 << TCP_ESTABLISHED | 1 << TCP_LISTEN)?;
        let udp = restart::list_sockets(Proto::Udp, 1 << TCP_ESTABLISHED)?;
        let listeners: Vec<SocketAddr> = tcp
            .iter()
            .filter(|s| s.state == TCP_LISTEN)
            .map(|s| s.local)
            .collect();
        let unrecorded = |proto: Proto, s: &Listed| {
            s.state == TCP_ESTABLISHED
                && s.remote.port() != 0
                && enabled.contains(&s.cgroup_id)
                && !self
                    .loaded
                    .maps
                    .conns
                    .get(&flow_key(proto, s.local, s.remote), 0)
                    .is_ok_and(|r| r.cookie == s.cookie || proto == Proto::Udp)
        };
        let candidates: Vec<(Proto, Listed)> = tcp
            .iter()
            .filter(|s| unrecorded(Proto::Tcp, s))
            .map(|s| (Proto::Tcp, *s))
            .chain(
                udp.iter()
                    .filter(|s| unrecorded(Proto::Udp, s))
                    .map(|s| (Proto::Udp, *s)),
            )
            .collect();
        if candidates.is_empty() {
            return Ok(0);
        }
        let owners = procfs::inode_owners();
        let now = boottime_ns();
        let mut adopted = 0;
        for (proto, s) in candidates {
            let pid = owners.get(&s.inode).copied().unwrap_or(0);
            let mut rec = ConnRecord {
                cookie: s.cookie,
                cgroup_id: s.cgroup_id,
                netns_cookie: self.loaded.netns_cookie,
                first_seen_ns: now,
                last_seen_ns: now,
                pid,
                ..ConnRecord::default()
            };
            if let Some(comm) = procfs::comm(pid).filter(|_| pid != 0) {
                let n = comm.len().min(rec.comm.len() - 1);
                rec.comm[..n].copy_from_slice(&comm.as_bytes()[..n]);
            }
            match proto {
                Proto::Tcp => {
                    let bases = match restart::sequence_bases(pid, s.inode) {
                        Ok(Some(b)) => b,
                        Ok(None) => {
                            tracing::debug!(local = %s.local, remote = %s.remote, pid, "not adopting a TCP connection yet: its sequence numbers could not be read (no owner found, or never still)");
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!(local = %s.local, remote = %s.remote, pid, error = %e, "not adopting a TCP connection");
                            continue;
                        }
                    };
                    let passive = listeners.iter().any(|l| {
                        l.port() == s.local.port()
                            && (l.ip() == s.local.ip() || l.ip().is_unspecified())
                    });
                    rec.origin = ORIGIN_TCP_ADOPTED;
                    rec.snd_una_base = bases.snd_una_base;
                    rec.rcv_nxt_base = bases.rcv_nxt_base;
                    rec.snd_nxt = bases.snd_una_base.wrapping_add(u32::from(!passive));
                    rec.rcv_nxt = bases.rcv_nxt_base;
                }
                Proto::Udp => {
                    rec.origin = ORIGIN_UDP_ADOPTED;
                    rec.udp_dirs = UDP_DIR_SEND | UDP_DIR_RECV;
                }
            }
            let key = flow_key(proto, s.local, s.remote);
            match self.loaded.maps.conns.insert(key, rec, 0) {
                Ok(()) => {
                    adopted += 1;
                    tracing::info!(%proto, local = %s.local, remote = %s.remote, pid, "adopted a connection opened before vnat recorded its cgroup");
                }
                Err(e) => {
                    tracing::warn!(%proto, local = %s.local, remote = %s.remote, error = %e, "could not record an adopted connection (the connection map is full?)");
                }
            }
        }
        Ok(adopted)
    }

    /// [`KernelDatapath::adopt`], where a failure only delays adoption to
    /// the next look: it is logged.
    pub(super) fn adopt_logged(&mut self) {
        if let Err(e) = self.adopt() {
            tracing::warn!(error = %e, "could not look for connections to adopt; trying again later");
        }
    }

    /// Drop the records of adopted TCP connections whose socket has closed
    /// (sock_ops removes the others itself).
    pub(super) fn drop_closed_adopted(&mut self) -> Result<(), DatapathError> {
        let adopted: Vec<(FlowKey, u64)> = self
            .loaded
            .maps
            .conns
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, r)| r.origin == ORIGIN_TCP_ADOPTED)
            .map(|(k, r)| (k, r.cookie))
            .collect();
        if adopted.is_empty() {
            return Ok(());
        }
        let alive: HashSet<u64> = restart::list_sockets(Proto::Tcp, TCP_ALIVE)?
            .iter()
            .map(|s| s.cookie)
            .collect();
        for (key, cookie) in adopted {
            if !alive.contains(&cookie) {
                let _ = self.loaded.maps.conns.remove(&key);
            }
        }
        Ok(())
    }
}
