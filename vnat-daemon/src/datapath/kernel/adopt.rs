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
//!   back from the live socket (`restart::sequence_bases`: its own answer
//!   to an out-of-window segment): the first sequence numbers after the
//!   SYNs are `snd_una - bytes_acked` and `rcv_nxt - bytes_received`, with
//!   one exception: an active opener's bytes_acked counts its SYN, a
//!   passive one's does not ([`accepted`]). The record's origin is
//!   `ORIGIN_TCP_ADOPTED`: no state callback will remove it, so
//!   [`KernelDatapath::drop_closed_adopted`] does once the socket is gone.
//! - UDP: the connected pair, used both ways (`ORIGIN_UDP_ADOPTED`);
//!   `sync_udp` drops it with its socket like any UDP record.
//!
//! The owner (pid and command) is the first process found holding the
//! socket. Containers' sockets (other namespaces) are not adopted.

use std::collections::HashSet;

use vnat_common::{
    ORIGIN_TCP_ADOPTED, ORIGIN_UDP_ADOPTED, PROG_PEEK, UDP_DIR_RECV, UDP_DIR_SEND, UDP_MAX_RECORDS,
    UDP_PER_SOCKET_MAX,
};

/// BPF_NOEXIST: insert only if the key is absent.
const BPF_NOEXIST: u64 = 1;

use super::*;
use listing::boottime_ns;
use restart::Listed;

const TCP_ESTABLISHED: u8 = 1;
const TCP_LISTEN: u8 = 10;
/// The first wait before a socket whose sequence numbers could not be read
/// is tried again (then doubling), and the tries before it is left alone.
const ADOPT_RETRY: std::time::Duration = std::time::Duration::from_millis(2500);
const ADOPT_TRIES: u32 = 8;

/// Sockets looked at in one pass at most (the rest at the next).
const MAX_CANDIDATES: usize = 256;

/// The longest an adoption pass keeps the datapath thread.
const ADOPT_BUDGET: std::time::Duration = std::time::Duration::from_millis(1500);

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
        // A kernel without udp_diag still has its TCP connections adopted.
        let udp = restart::list_sockets(Proto::Udp, 1 << TCP_ESTABLISHED).unwrap_or_else(|e| {
            tracing::debug!(error = %e, "cannot list UDP sockets; adopting TCP only");
            Vec::new()
        });
        let listeners: Vec<SocketAddr> = tcp
            .iter()
            .filter(|s| s.state == TCP_LISTEN)
            .map(|s| s.local)
            .collect();
        // The records, read at once (a lookup per socket was one system
        // call each: 100,000 a pass at 100,000 connections).
        let recorded: std::collections::HashMap<FlowKey, u64> =
            super::batch::read_all(&self.loaded.maps.conns)
                .map_err(map_err(MAP_CONNS))?
                .into_iter()
                .map(|(k, r)| (k, r.cookie))
                .collect();
        let unrecorded = |proto: Proto, s: &Listed| {
            s.state == TCP_ESTABLISHED
                && s.remote.port() != 0
                && enabled.contains(&s.cgroup_id)
                && !recorded
                    .get(&flow_key(proto, s.local, s.remote))
                    .is_some_and(|cookie| *cookie == s.cookie || proto == Proto::Udp)
        };
        // With the UDP budget spent (a flood of sources), no UDP flow could
        // be recorded: none is looked at, nor counted as left to do.
        let udp_room = self.loaded.maps.udp_count.get(&0, 0).unwrap_or(0) < UDP_MAX_RECORDS;
        let candidates: Vec<(Proto, Listed)> = tcp
            .iter()
            .filter(|s| unrecorded(Proto::Tcp, s))
            .map(|s| (Proto::Tcp, *s))
            .chain(
                udp.iter()
                    .filter(|s| udp_room && unrecorded(Proto::Udp, s))
                    .map(|s| (Proto::Udp, *s)),
            )
            .take(MAX_CANDIDATES)
            .collect();
        // Sockets looked at before and not read yet wait their turn (the
        // backoff), and the ones gone are forgotten.
        let clock = std::time::Instant::now();
        self.adopt_backoff
            .retain(|cookie, _| candidates.iter().any(|(_, s)| s.cookie == *cookie));
        let candidates: Vec<(Proto, Listed)> = candidates
            .into_iter()
            .filter(|(_, s)| {
                self.adopt_backoff
                    .get(&s.cookie)
                    .is_none_or(|(_, next)| *next <= clock)
            })
            .collect();
        if candidates.is_empty() {
            self.retry_adoption_soon(clock);
            return Ok(0);
        }
        // The owners (pid, command) need a walk of every process's
        // descriptors: only for the TCP connections, whose owner the
        // helpers and levers use; a UDP flow's is found when listed.
        let owners = if candidates.iter().any(|(p, _)| *p == Proto::Tcp) {
            procfs::inode_owners()
        } else {
            Default::default()
        };
        // The datapath thread also serves moves: a pass takes at most this
        // long, and what it leaves is looked at again at the next
        // housekeeping (5 s).
        let budget = std::time::Instant::now() + ADOPT_BUDGET;
        let mut deferred = false;
        let ephemeral = local_port_range();
        let peek = self.peek_program_fd();
        let now = boottime_ns();
        let mut adopted = 0;
        for (proto, s) in candidates {
            if std::time::Instant::now() >= budget {
                deferred = true;
                break;
            }
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
            // Not moved: its virtual endpoints are its socket's, and its id
            // the one `vnatctl ls` lists once it is adopted.
            let flow = VirtualFlow {
                proto,
                local: s.local,
                remote: s.remote,
            };
            match proto {
                Proto::Tcp => {
                    let bases = match restart::sequence_bases(&flow, s.cookie, peek) {
                        Ok(Some(b)) => b,
                        Ok(None) => {
                            self.back_off_adoption(s.cookie, flow.id(), clock);
                            tracing::debug!(id = flow.id(), %flow, pid, "not adopting a TCP connection yet: its sequence numbers could not be read (busy, or on its probe timer); trying again later");
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!(id = flow.id(), %flow, pid, error = %e, "not adopting a TCP connection");
                            continue;
                        }
                    };
                    let passive = accepted(&listeners, s.local, s.remote, ephemeral);
                    rec.origin = ORIGIN_TCP_ADOPTED;
                    rec.snd_una_base = bases.snd_una_base;
                    rec.rcv_nxt_base = bases.rcv_nxt_base;
                    rec.snd_nxt = bases.snd_una_base.wrapping_add(u32::from(!passive));
                    rec.rcv_nxt = bases.rcv_nxt_base;
                }
                Proto::Udp => {
                    // The recorders' budgets (vnat-common): adoption never
                    // lets a cgroup's sockets past them.
                    let total = self.loaded.maps.udp_count.get(&0, 0).unwrap_or(0);
                    let on_socket = self.loaded.maps.udp_per_sock.get(&s.cookie, 0).unwrap_or(0);
                    if total >= UDP_MAX_RECORDS || on_socket >= UDP_PER_SOCKET_MAX {
                        tracing::debug!(id = flow.id(), %flow, "not adopting a UDP flow: the UDP record budget is spent");
                        continue;
                    }
                    rec.origin = ORIGIN_UDP_ADOPTED;
                    rec.udp_dirs = UDP_DIR_SEND | UDP_DIR_RECV;
                }
            }
            let key = flow_key(proto, s.local, s.remote);
            // UDP: never over a record the recorders made meanwhile.
            let flags = if proto == Proto::Udp { BPF_NOEXIST } else { 0 };
            match self.loaded.maps.conns.insert(key, rec, flags) {
                Ok(()) => {
                    if proto == Proto::Udp {
                        let total = self.loaded.maps.udp_count.get(&0, 0).unwrap_or(0);
                        let _ = self.loaded.maps.udp_count.set(0, total + 1, 0);
                        let n = self.loaded.maps.udp_per_sock.get(&s.cookie, 0).unwrap_or(0);
                        let _ = self.loaded.maps.udp_per_sock.insert(s.cookie, n + 1, 0);
                    }
                    adopted += 1;
                    tracing::info!(id = flow.id(), %flow, pid, "adopted a connection opened before vnat recorded its cgroup");
                }
                Err(aya::maps::MapError::SyscallError(e))
                    if proto == Proto::Udp && e.io_error.raw_os_error() == Some(libc::EEXIST) =>
                {
                    // Recorded meanwhile: by the recorders, or for another
                    // socket with the same endpoints (a server that forks a
                    // connected socket per peer can make two at once).
                    tracing::debug!(id = flow.id(), %flow, "a UDP flow to adopt is recorded already");
                }
                Err(e) => {
                    tracing::warn!(id = flow.id(), %flow, error = %e, "could not record an adopted connection (the connection map is full?)");
                }
            }
        }
        if deferred {
            // Again at the next housekeeping, not in a minute.
            self.last_adoption = None;
        } else {
            self.retry_adoption_soon(clock);
        }
        Ok(adopted)
    }

    /// A socket whose sequence numbers could not be read: the next try
    /// waits 5 s, doubling to 10 minutes; after [`ADOPT_TRIES`] it is left
    /// alone (each try costs the peer a duplicate ACK).
    /// `vnat_peek`'s fd, if the kernel took it (restart/peek.rs).
    fn peek_program_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::{AsFd, AsRawFd};
        if !self.loaded.peek {
            return None;
        }
        let p: &aya::programs::SchedClassifier =
            self.loaded.ebpf.program(PROG_PEEK)?.try_into().ok()?;
        Some(p.fd().ok()?.as_fd().as_raw_fd())
    }

    fn back_off_adoption(&mut self, cookie: u64, id: u64, now: std::time::Instant) {
        let tries = self.adopt_backoff.get(&cookie).map_or(0, |(t, _)| *t) + 1;
        let wait = if tries >= ADOPT_TRIES {
            tracing::info!(
                id,
                cookie,
                tries,
                "giving up adopting a connection whose sequence numbers could not be read"
            );
            std::time::Duration::from_secs(u64::from(u32::MAX))
        } else {
            (ADOPT_RETRY * (1 << tries.min(7))).min(std::time::Duration::from_secs(600))
        };
        self.adopt_backoff.insert(cookie, (tries, now + wait));
    }

    /// Look again at the next housekeeping (5 s) rather than in a minute
    /// when a socket's next try is due before then.
    fn retry_adoption_soon(&mut self, now: std::time::Instant) {
        if self
            .adopt_backoff
            .values()
            .any(|(_, next)| next.saturating_duration_since(now) < ADOPT_EVERY)
        {
            self.last_adoption = None;
        }
    }

    /// [`KernelDatapath::adopt`], where a failure only delays adoption to
    /// the next look: it is logged.
    pub(super) fn adopt_logged(&mut self) {
        if let Err(e) = self.adopt() {
            tracing::warn!(error = %e, "could not look for connections to adopt; trying again later");
        }
    }

    /// Drop the records of adopted TCP connections whose socket has closed
    /// (sock_ops removes the others itself): one exact sock_diag lookup
    /// each, and the record is removed only if it still is that socket's.
    pub(super) fn drop_closed_adopted(&mut self) -> Result<(), DatapathError> {
        let adopted: Vec<(FlowKey, u64)> = super::batch::read_all(&self.loaded.maps.conns)
            .map_err(map_err(MAP_CONNS))?
            .into_iter()
            .filter(|(_, r)| r.origin == ORIGIN_TCP_ADOPTED)
            .map(|(k, r)| (k, r.cookie))
            .collect();
        for (key, cookie) in adopted {
            let Some(flow) = VirtualFlow::from_key(&key) else {
                continue;
            };
            if restart::socket_alive(&flow, cookie)? {
                continue;
            }
            if self
                .loaded
                .maps
                .conns
                .get(&key, 0)
                .is_ok_and(|r| r.cookie == cookie)
            {
                let _ = self.loaded.maps.conns.remove(&key);
            }
        }
        Ok(())
    }
}

/// Whether the connection from `local` to `remote` was accepted here (a
/// passive open) rather than opened from here; the first sequence number
/// sock_ops records differs by one between the two. A listener on the
/// local port says accepted. Without one (it closed, as `nc -l` or an FTP
/// data port's does), the ports say it: the side whose port is in the
/// ephemeral range (`ip_local_port_range`) is the one that connected. When
/// both or neither are, it is taken as opened from here.
fn accepted(
    listeners: &[SocketAddr],
    local: SocketAddr,
    remote: SocketAddr,
    ephemeral: (u16, u16),
) -> bool {
    if listeners
        .iter()
        .any(|l| l.port() == local.port() && (l.ip() == local.ip() || l.ip().is_unspecified()))
    {
        return true;
    }
    let in_range = |p: u16| (ephemeral.0..=ephemeral.1).contains(&p);
    in_range(remote.port()) && !in_range(local.port())
}

/// net.ipv4.ip_local_port_range (it applies to IPv6 too), or Linux's
/// default.
fn local_port_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| {
            let mut it = s.split_whitespace().map(|w| w.parse::<u16>().ok());
            Some((it.next()??, it.next()??))
        })
        .unwrap_or((32768, 60999))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_opener_is_told_by_listener_then_by_ports() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        let range = (32768, 60999);
        let listeners = [a("0.0.0.0:5001"), a("[::]:22")];
        // A listener holds the local port: accepted.
        assert!(accepted(
            &listeners,
            a("10.0.0.1:5001"),
            a("10.0.0.2:40000"),
            range
        ));
        assert!(accepted(
            &listeners,
            a("[fd00::1]:22"),
            a("[fd00::2]:50000"),
            range
        ));
        // Opened from here to a server port.
        assert!(!accepted(
            &listeners,
            a("10.0.0.1:40000"),
            a("10.0.0.2:5001"),
            range
        ));
        // The listener is gone (nc -l): the peer's port is the ephemeral one.
        assert!(accepted(
            &[],
            a("10.0.0.1:7000"),
            a("10.0.0.2:45000"),
            range
        ));
        // Both ephemeral (an FTP data connection): taken as opened here.
        assert!(!accepted(
            &[],
            a("10.0.0.1:40001"),
            a("10.0.0.2:45000"),
            range
        ));
    }
}
