//! Listing recorded connections with their owners, and keeping UDP
//! records complete and current.

use super::*;
use vnat_common::{
    GuestKey, ORIGIN_TCP_ADOPTED, ORIGIN_TCP_PASSIVE, ORIGIN_UDP_ADOPTED, ORIGIN_UDP_RECVMSG,
    UDP_DIR_RECV, UDP_IDLE_NS,
};

use super::budgets;

mod accepted;

use crate::datapath::GuestInfo;

impl KernelDatapath {
    /// Complete UDP flows whose connect() ran before the socket had a local
    /// port (within their owner's budget); drop UDP records whose socket is
    /// gone, and those of an unconnected socket idle for [`UDP_IDLE_NS`]
    /// (a spoofed source's, or a peer sent to once: a local user's
    /// `sendto` to many addresses leaves no record behind for long); then
    /// recount the UDP records, in all and per socket, and what every
    /// owner holds, for the eBPF recorders' budgets. The daemon calls this
    /// periodically; `connections()` shows pending flows either way.
    ///
    /// The sockets are indexed by local port, so the pass costs the
    /// records plus the sockets, not their product.
    pub fn sync_udp(&mut self) -> Result<(), DatapathError> {
        let completed = self.completed_udp(true);
        let mut granted: StdHashMap<(u32, bool), u32> = StdHashMap::new();
        for (cookie, key, rec) in completed {
            let _ = self.loaded.maps.udp_pending.remove(&cookie);
            let guest = rec.netns_cookie != self.loaded.netns_cookie;
            let taken = granted.entry((rec.owner_uid, guest)).or_default();
            if *taken >= self.udp_room(rec.owner_uid, guest) {
                continue;
            }
            *taken += 1;
            if !guest {
                let _ = self.loaded.maps.conns.insert(key, rec, 0);
            } else {
                let guest = GuestKey {
                    netns_cookie: rec.netns_cookie,
                    flow: key,
                };
                let _ = self.loaded.maps.guests.insert(guest, rec, 0);
            }
        }
        self.drop_closed_udp_guests();
        let sockets = udp_sockets_now();
        let translated: std::collections::HashSet<FlowKey> =
            self.egress_entries()?.iter().map(|(k, _)| *k).collect();
        let now_ns = boottime_ns();
        let all: Vec<(FlowKey, ConnRecord)> =
            super::batch::read_all(&self.loaded.maps.conns).map_err(map_err(MAP_CONNS))?;
        let udp: Vec<&(FlowKey, ConnRecord)> =
            all.iter().filter(|(k, _)| k.proto == PROTO_UDP).collect();
        let mut stale = std::collections::HashSet::new();
        let mut per_sock: StdHashMap<u64, u32> = StdHashMap::new();
        // A record whose socket seems gone is dropped only if a second
        // reading misses it too: dropping it removes a live connection's
        // translation (see [`udp_sockets_now`]).
        let mut again: Option<UdpSockets> = None;
        for (k, rec) in &udp {
            let Some((local, remote)) = key_endpoints(k) else {
                continue;
            };
            let (alive, connected) =
                udp_socket_confirmed(&sockets, &mut again, local, remote, udp_sockets_now);
            let idle = !connected
                && now_ns.saturating_sub(rec.last_seen_ns) > UDP_IDLE_NS
                && !translated.contains(k);
            if !alive || idle {
                stale.insert(*k);
            } else {
                *per_sock.entry(rec.cookie).or_default() += 1;
            }
        }
        for k in &stale {
            let _ = self.loaded.maps.conns.remove(k);
        }
        let kept = (udp.len() - stale.len()) as u64;
        let _ = self.loaded.maps.udp_count.set(0, kept, 0);
        // Per socket: the counts of sockets that lost records (the others
        // are right, give or take a concurrent insert).
        let touched: std::collections::HashSet<u64> = udp
            .iter()
            .filter(|(k, _)| stale.contains(k))
            .map(|(_, r)| r.cookie)
            .collect();
        for cookie in touched {
            match per_sock.get(&cookie) {
                Some(n) => {
                    let _ = self.loaded.maps.udp_per_sock.insert(cookie, *n, 0);
                }
                None => {
                    let _ = self.loaded.maps.udp_per_sock.remove(&cookie);
                }
            }
        }
        // What every owner holds now.
        let guests: Vec<ConnRecord> = self
            .loaded
            .maps
            .guests
            .iter()
            .filter_map(Result::ok)
            .map(|(_, r)| r)
            .collect();
        let connecting: Vec<u32> = self
            .loaded
            .maps
            .connecting
            .iter()
            .filter_map(Result::ok)
            .map(|(_, o)| o.uid)
            .chain(
                // UDP sockets connected before they had a port, not yet
                // completed above, count as connecting too.
                self.loaded
                    .maps
                    .udp_pending
                    .iter()
                    .filter_map(Result::ok)
                    .map(|(_, p)| p.record.owner_uid),
            )
            .collect();
        let counts = budgets::count_records(
            all.iter()
                .filter(|(k, _)| !stale.contains(k))
                .map(|(k, r)| (k.proto, r)),
            guests.iter(),
            connecting,
        );
        self.write_owner_counts(&counts)
    }

    /// Pending UDP connects matched to their now-bound socket: the socket
    /// (sock_diag) connected to the same peer and held by the same process
    /// (with `guests`, also those of other namespaces, in their process's
    /// /proc/PID/net).
    pub(super) fn completed_udp(&self, guests: bool) -> Vec<(u64, FlowKey, ConnRecord)> {
        let own = self.loaded.netns_cookie;
        let pending: Vec<_> = self
            .loaded
            .maps
            .udp_pending
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, p)| guests || p.record.netns_cookie == own)
            .collect();
        if pending.is_empty() {
            return Vec::new();
        }
        // UDP sockets by peer, this namespace's and each guest process's
        // (read once per pass, not once per pending flow).
        type ByPeer = StdHashMap<SocketAddr, Vec<(SocketAddr, u64)>>;
        let by_peer = |all: StdHashMap<(Proto, SocketAddr, SocketAddr), u64>| -> ByPeer {
            let mut m: ByPeer = StdHashMap::new();
            for ((p, l, r), inode) in all {
                if p == Proto::Udp {
                    m.entry(r).or_default().push((l, inode));
                }
            }
            m
        };
        let sockets = by_peer(connected_udp_inodes());
        let mut theirs: StdHashMap<u32, ByPeer> = StdHashMap::new();
        let owners = procfs::inode_owners();
        let mut out = Vec::new();
        for (cookie, p) in pending {
            let Some((_, remote)) = key_endpoints(&p.key) else {
                continue;
            };
            // A guest's socket is in its own namespace: its process's view.
            let sockets = if p.record.netns_cookie == own {
                &sockets
            } else {
                theirs.entry(p.record.pid).or_insert_with(|| {
                    by_peer(procfs::udp_socket_inodes_in(&format!(
                        "/proc/{}/net",
                        p.record.pid
                    )))
                })
            };
            let matches: Vec<SocketAddr> = sockets
                .get(&remote)
                .into_iter()
                .flatten()
                .filter(|(_, inode)| owners.get(inode) == Some(&p.record.pid))
                .map(|(l, _)| *l)
                .collect();
            if let [local] = matches[..] {
                let key = crate::datapath::flow_key(Proto::Udp, local, remote);
                out.push((cookie, key, p.record));
            }
        }
        out
    }

    /// With `with_owners == false`, pid, command and cgroup are left out
    /// unless the record carries the pid (and /proc is not read at all).
    pub(super) fn list(&self, with_owners: bool) -> Result<Vec<ConnectionInfo>, DatapathError> {
        let mut records: Vec<(FlowKey, ConnRecord)> =
            super::batch::read_all(&self.loaded.maps.conns).map_err(map_err(MAP_CONNS))?;
        // Guests' completed flows are listed once housekeeping has moved
        // them to the guest map (under their public names).
        records.extend(
            self.completed_udp(false)
                .into_iter()
                .map(|(_, k, r)| (k, r)),
        );
        let mut guests: StdHashMap<FlowKey, GuestInfo> = StdHashMap::new();
        for g in self.guests(with_owners)? {
            records.push((g.key, g.rec));
            guests.insert(g.key, g.info);
        }
        let translations: StdHashMap<FlowKey, Translation> = self
            .egress_entries()?
            .iter()
            .filter_map(|(k, v)| Some((*k, translation_of(k, v)?)))
            .collect();
        let now_ns = boottime_ns();
        // The /proc scans are only done when some record lacks an owner.
        let mut sockets: Option<StdHashMap<(Proto, SocketAddr, SocketAddr), u64>> = None;
        let mut owners: Option<StdHashMap<u64, u32>> = None;
        let mut out = Vec::with_capacity(records.len());
        // A UDP socket bound to the wildcard address records 0.0.0.0 / :: as
        // its local address; its packets carry the source the kernel routes
        // from, which is what a translation must match. Asked once per peer
        // and kept for [`SOURCE_TTL`] across listings (each resync lists):
        // a user's wildcard socket sending to thousands of peers costs a
        // route lookup per peer now and then, not per listing.
        let mut cache = self.listing.borrow_mut();
        let now = std::time::Instant::now();
        cache
            .sources
            .retain(|_, (_, at)| now.duration_since(*at) < SOURCE_TTL);
        // This namespace's accepted connections carry their listener's
        // cgroup, which their records lack; and, for `ls`, the inode that
        // names their process.
        let own = self.loaded.netns_cookie;
        let unowned: Vec<u64> = records
            .iter()
            .filter(|(_, r)| {
                r.cgroup_id == 0 && r.origin == ORIGIN_TCP_PASSIVE && r.netns_cookie == own
            })
            .map(|(_, r)| r.cookie)
            .collect();
        cache.accepted.resolve(&unowned, accepted::dump);
        // One process usually owns many connections: read its /proc entries
        // once per listing, not once per connection.
        let mut procs: StdHashMap<u32, (Option<String>, Option<String>)> = StdHashMap::new();
        // The cgroups under a hiding one, and whether each owner's is.
        let hiding = if with_owners {
            self.hiding_tree()
        } else {
            Default::default()
        };
        let mut hides: StdHashMap<String, bool> = StdHashMap::new();
        for (key, rec) in records {
            let Some(mut flow) = VirtualFlow::from_key(&key) else {
                continue;
            };
            if flow.local.ip().is_unspecified() {
                let remote = flow.remote.ip();
                let src = cache
                    .sources
                    .entry(remote)
                    .or_insert_with(|| {
                        (
                            net::route_get(remote, None).ok().and_then(|r| r.prefsrc),
                            now,
                        )
                    })
                    .0;
                match src {
                    Some(ip) => flow.local = SocketAddr::new(ip, flow.local.port()),
                    None => continue,
                }
            }
            let key = flow.to_key();
            let t = translations.get(&key);
            let guest = guests.remove(&key);
            let cgroup_id = match rec.cgroup_id {
                0 if rec.origin == ORIGIN_TCP_PASSIVE => cache.accepted.cgroup(rec.cookie),
                id => id,
            };
            let mut pid = (rec.pid != 0).then_some(rec.pid);
            // A guest's socket is not in this namespace's /proc/net.
            if pid.is_none() && with_owners && guest.is_none() {
                pid = match cache.accepted.inode(rec.cookie) {
                    // Found by sock_diag (accepted connections: all that
                    // lack a pid but the adopted ones).
                    Some(inode) => super::restart::fds::holder(inode).map(|(pid, _)| pid),
                    None => {
                        let s = sockets.get_or_insert_with(procfs::socket_inodes);
                        let o = owners.get_or_insert_with(procfs::inode_owners);
                        s.get(&(flow.proto, flow.local, flow.remote))
                            .and_then(|i| o.get(i))
                            .copied()
                    }
                };
            }
            let (comm, cgroup) = pid.filter(|_| with_owners).map_or((None, None), |p| {
                procs
                    .entry(p)
                    .or_insert_with(|| (procfs::comm(p), procfs::cgroup_of(p)))
                    .clone()
            });
            let hide_location = !hiding.is_empty()
                && (hiding.contains(&cgroup_id)
                    || cgroup.as_ref().is_some_and(|c| {
                        *hides.entry(c.clone()).or_insert_with(|| {
                            attach::cgroup2_mount()
                                .and_then(|m| {
                                    std::fs::metadata(m.join(c.trim_start_matches('/'))).ok()
                                })
                                .is_some_and(|md| {
                                    use std::os::unix::fs::MetadataExt;
                                    hiding.contains(&md.ino())
                                })
                        })
                    }));
            let command = comm.or_else(|| {
                let end = rec
                    .comm
                    .iter()
                    .position(|b| *b == 0)
                    .unwrap_or(rec.comm.len());
                (end > 0).then(|| String::from_utf8_lossy(&rec.comm[..end]).into_owned())
            });
            out.push(ConnectionInfo {
                id: flow.id(),
                proto: flow.proto,
                virtual_local: flow.local,
                virtual_remote: flow.remote,
                physical_local: t.map_or(flow.local, |t| t.physical_local),
                physical_remote: t.map_or(flow.remote, |t| t.physical_remote),
                state: if t.is_some() {
                    ConnState::Translated
                } else {
                    ConnState::Native
                },
                cookie: rec.cookie,
                cgroup_id,
                cgroup,
                pid,
                command,
                age_secs: now_ns.saturating_sub(rec.first_seen_ns) / 1_000_000_000,
                recorded_ns: rec.first_seen_ns,
                // snd_nxt and rcv_nxt at establishment are both ends' first
                // sequence numbers after the SYNs (the callbacks run before
                // any data is sent or queued), recorded crosswise at the
                // two ends. (snd_una_base is not: the SYN's ACK counts in
                // bytes_acked at one end only.)
                tcp_isns: (flow.proto == Proto::Tcp).then_some([rec.snd_nxt, rec.rcv_nxt]),
                adopted: matches!(rec.origin, ORIGIN_TCP_ADOPTED | ORIGIN_UDP_ADOPTED),
                udp_inbound_only: flow.proto == Proto::Udp
                    && rec.origin == ORIGIN_UDP_RECVMSG
                    && rec.udp_dirs == UDP_DIR_RECV,
                hide_location,
                guest,
            });
        }
        out.sort_by_key(|c| (c.proto, c.virtual_local, c.virtual_remote));
        Ok(out)
    }
}

/// What listings keep between them (`KernelDatapath::list`).
#[derive(Default)]
pub(super) struct ListingCache {
    /// The source address the kernel routes from to a peer, and when it
    /// was asked.
    sources: StdHashMap<IpAddr, (Option<IpAddr>, std::time::Instant)>,
    /// The cgroups of accepted connections (`listing/accepted.rs`).
    accepted: accepted::AcceptedCgroups,
}

/// How long a source address found for a peer is used. Short: after a
/// move the answer changes, and the listing must follow within a resync.
const SOURCE_TTL: std::time::Duration = std::time::Duration::from_secs(1);

/// CLOCK_BOOTTIME in ns, the clock the eBPF side stamps records with.
pub(super) fn boottime_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given, which is
    // a live local; CLOCK_BOOTTIME exists on every Linux vnat runs on.
    unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// UDP sockets by local port: (local, remote) of each, the remote
/// unspecified (port 0) for an unconnected one.
pub(super) type UdpSockets = StdHashMap<u16, Vec<(SocketAddr, SocketAddr)>>;

pub(super) fn udp_sockets_by_port(
    sockets: impl IntoIterator<Item = (Proto, SocketAddr, SocketAddr)>,
) -> UdpSockets {
    let mut out: UdpSockets = StdHashMap::new();
    for (p, l, r) in sockets {
        if p == Proto::Udp {
            out.entry(l.port()).or_default().push((l, r));
        }
    }
    out
}

/// Whether a UDP socket holds the flow `local` to `remote` (on that
/// address or the wildcard, connected to that peer or to none), and
/// whether one is connected to exactly that peer.
pub(super) fn udp_socket_of(
    sockets: &UdpSockets,
    local: SocketAddr,
    remote: SocketAddr,
) -> (bool, bool) {
    let mut alive = false;
    let mut connected = false;
    for (l, r) in sockets.get(&local.port()).into_iter().flatten() {
        if l.ip() == local.ip() || l.ip().is_unspecified() {
            if *r == remote {
                alive = true;
                connected = true;
            } else if r.port() == 0 {
                alive = true;
            }
        }
    }
    (alive, connected)
}

/// This namespace's UDP sockets, from sock_diag, or from /proc/net/udp*
/// if the kernel cannot list them so (no udp_diag).
///
/// sock_diag is the one to trust: its dump resumes at a hash slot and a
/// position within it, while /proc/net/udp is read a page at a time and
/// each read finds its place again by counting lines from the table's
/// start, so a socket closed meanwhile ahead of that place makes the next
/// read skip a live socket's line. With 3,000 UDP sockets opened and
/// closed meanwhile, /proc/net/udp missed a live socket in 55 of 969
/// readings, sock_diag in none.
pub(super) fn udp_sockets_now() -> UdpSockets {
    // TCP_ESTABLISHED (connected) and TCP_CLOSE (unconnected).
    const STATES: u32 = 1 << 1 | 1 << 7;
    match super::restart::list_sockets(Proto::Udp, STATES) {
        Ok(listed) => {
            udp_sockets_by_port(listed.into_iter().map(|s| (Proto::Udp, s.local, s.remote)))
        }
        Err(e) => {
            tracing::debug!(error = %e, "cannot list UDP sockets with sock_diag; reading /proc/net/udp");
            udp_sockets_by_port(procfs::udp_socket_inodes().into_keys())
        }
    }
}

/// This namespace's connected UDP sockets with their inodes, from
/// sock_diag (see [`udp_sockets_now`] on why not /proc/net/udp), or from
/// /proc/net/udp* if the kernel cannot list them so.
fn connected_udp_inodes() -> StdHashMap<(Proto, SocketAddr, SocketAddr), u64> {
    const ESTABLISHED: u32 = 1 << 1;
    match super::restart::list_sockets(Proto::Udp, ESTABLISHED) {
        Ok(listed) => listed
            .into_iter()
            .map(|s| ((Proto::Udp, s.local, s.remote), s.inode))
            .collect(),
        Err(e) => {
            tracing::debug!(error = %e, "cannot list UDP sockets with sock_diag; reading /proc/net/udp");
            procfs::udp_socket_inodes()
        }
    }
}

/// [`udp_socket_of`] in `first`, and if no socket holds the flow there,
/// in a second reading of the sockets (`read`, made once and kept in
/// `again` for the records after): a reading of /proc/net/udp can miss a
/// live socket (see [`udp_sockets_now`]).
pub(super) fn udp_socket_confirmed(
    first: &UdpSockets,
    again: &mut Option<UdpSockets>,
    local: SocketAddr,
    remote: SocketAddr,
    read: impl FnOnce() -> UdpSockets,
) -> (bool, bool) {
    match udp_socket_of(first, local, remote) {
        (false, _) => udp_socket_of(again.get_or_insert_with(read), local, remote),
        found => found,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_udp_record_is_found_by_port_among_many_sockets() {
        let mut all: Vec<(Proto, SocketAddr, SocketAddr)> = (0..5000u16)
            .map(|i| {
                (
                    Proto::Udp,
                    a(&format!("10.0.0.1:{}", 20000 + i)),
                    a("0.0.0.0:0"),
                )
            })
            .collect();
        all.push((Proto::Udp, a("10.0.0.1:5060"), a("198.18.1.2:40000")));
        all.push((Proto::Udp, a("0.0.0.0:53"), a("0.0.0.0:0")));
        all.push((Proto::Tcp, a("10.0.0.1:7000"), a("198.18.1.2:1")));
        let s = udp_sockets_by_port(all);
        // Connected to that peer.
        assert_eq!(
            udp_socket_of(&s, a("10.0.0.1:5060"), a("198.18.1.2:40000")),
            (true, true)
        );
        // Connected to another peer: not this flow's socket.
        assert_eq!(
            udp_socket_of(&s, a("10.0.0.1:5060"), a("198.18.1.3:40000")),
            (false, false)
        );
        // Unconnected, on the wildcard: alive, not connected.
        assert_eq!(
            udp_socket_of(&s, a("10.0.0.9:53"), a("198.18.1.3:1")),
            (true, false)
        );
        assert_eq!(
            udp_socket_of(&s, a("10.0.0.1:24999"), a("203.0.113.1:9")),
            (true, false)
        );
        // No socket there; TCP sockets do not count.
        assert_eq!(
            udp_socket_of(&s, a("10.0.0.1:7000"), a("198.18.1.2:1")),
            (false, false)
        );
    }

    /// A socket the first reading missed (a line skipped) keeps its
    /// record when the second reading has it; one missing from both is
    /// gone. The second reading is made once per pass.
    #[test]
    fn a_udp_socket_missing_from_one_reading_is_read_again() {
        let first = udp_sockets_by_port([(Proto::Udp, a("10.0.0.1:9"), a("0.0.0.0:0"))]);
        let second = udp_sockets_by_port([
            (Proto::Udp, a("10.0.0.1:9"), a("0.0.0.0:0")),
            (Proto::Udp, a("10.0.0.1:5060"), a("198.18.1.2:40000")),
        ]);
        let mut again = None;
        let mut reads = 0;
        let mut check = |local: &str, remote: &str| {
            udp_socket_confirmed(&first, &mut again, a(local), a(remote), || {
                reads += 1;
                second.clone()
            })
        };
        assert_eq!(check("10.0.0.1:9", "198.18.1.7:53"), (true, false));
        assert_eq!(check("10.0.0.1:5060", "198.18.1.2:40000"), (true, true));
        assert_eq!(check("10.0.0.1:5061", "198.18.1.2:40000"), (false, false));
        assert_eq!(reads, 1, "read again once per pass, and only when needed");
    }
}
