//! Listing recorded connections with their owners, and keeping UDP
//! records complete and current.

use super::*;
use vnat_common::{
    GuestKey, ORIGIN_TCP_ADOPTED, ORIGIN_UDP_ADOPTED, ORIGIN_UDP_RECVMSG, UDP_DIR_RECV, UDP_IDLE_NS,
};

use crate::datapath::GuestInfo;

impl KernelDatapath {
    /// Complete UDP flows whose connect() ran before the socket had a local
    /// port; drop UDP records whose socket is gone, and those of a source
    /// the socket has only ever received from, idle for [`UDP_IDLE_NS`] (a
    /// spoofed source's; a peer this host answered is kept while its socket
    /// lives, as before); then recount the UDP records, in
    /// all and per socket, for the eBPF recorders' budgets. The daemon calls
    /// this periodically; `connections()` shows pending flows either way.
    pub fn sync_udp(&mut self) -> Result<(), DatapathError> {
        let completed = self.completed_udp(true);
        for (cookie, key, rec) in completed {
            if rec.netns_cookie == self.loaded.netns_cookie {
                let _ = self.loaded.maps.conns.insert(key, rec, 0);
            } else {
                let guest = GuestKey {
                    netns_cookie: rec.netns_cookie,
                    flow: key,
                };
                let _ = self.loaded.maps.guests.insert(guest, rec, 0);
            }
            let _ = self.loaded.maps.udp_pending.remove(&cookie);
        }
        self.drop_closed_udp_guests();
        let sockets = procfs::socket_inodes();
        let translated: std::collections::HashSet<FlowKey> =
            self.egress_entries()?.iter().map(|(k, _)| *k).collect();
        let now_ns = boottime_ns();
        let udp: Vec<(FlowKey, ConnRecord)> = self
            .loaded
            .maps
            .conns
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, _)| k.proto == PROTO_UDP)
            .collect();
        let mut stale = std::collections::HashSet::new();
        let mut per_sock: StdHashMap<u64, u32> = StdHashMap::new();
        for (k, rec) in &udp {
            let Some((local, remote)) = key_endpoints(k) else {
                continue;
            };
            let alive = sockets.keys().any(|(p, l, r)| {
                *p == Proto::Udp
                    && l.port() == local.port()
                    && (l.ip() == local.ip() || l.ip().is_unspecified())
                    && (r.port() == 0 || *r == remote)
            });
            let idle = rec.origin == ORIGIN_UDP_RECVMSG
                && rec.udp_dirs == UDP_DIR_RECV
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
        Ok(())
    }

    /// Pending UDP connects matched to their now-bound socket: the socket in
    /// /proc/net/udp* connected to the same peer and held by the same process
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
        let sockets = procfs::socket_inodes();
        let owners = procfs::inode_owners();
        let mut out = Vec::new();
        for (cookie, p) in pending {
            let Some((_, remote)) = key_endpoints(&p.key) else {
                continue;
            };
            // A guest's socket is in its own namespace: its process's view.
            let theirs;
            let sockets = if p.record.netns_cookie == own {
                &sockets
            } else {
                theirs = procfs::socket_inodes_in(&format!("/proc/{}/net", p.record.pid));
                &theirs
            };
            let matches: Vec<SocketAddr> = sockets
                .iter()
                .filter(|((proto, _, r), inode)| {
                    *proto == Proto::Udp && *r == remote && owners.get(inode) == Some(&p.record.pid)
                })
                .map(|((_, l, _), _)| *l)
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
        let mut records: Vec<(FlowKey, ConnRecord)> = self
            .loaded
            .maps
            .conns
            .iter()
            .collect::<Result<_, _>>()
            .map_err(map_err(MAP_CONNS))?;
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
        // from, which is what a translation must match.
        let mut sources: StdHashMap<IpAddr, Option<IpAddr>> = StdHashMap::new();
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
                let src = *sources
                    .entry(remote)
                    .or_insert_with(|| net::route_get(remote, None).ok().and_then(|r| r.prefsrc));
                match src {
                    Some(ip) => flow.local = SocketAddr::new(ip, flow.local.port()),
                    None => continue,
                }
            }
            let key = flow.to_key();
            let t = translations.get(&key);
            let guest = guests.remove(&key);
            let mut pid = (rec.pid != 0).then_some(rec.pid);
            // A guest's socket is not in this namespace's /proc/net.
            if pid.is_none() && with_owners && guest.is_none() {
                let s = sockets.get_or_insert_with(procfs::socket_inodes);
                let o = owners.get_or_insert_with(procfs::inode_owners);
                pid = s
                    .get(&(flow.proto, flow.local, flow.remote))
                    .and_then(|i| o.get(i))
                    .copied();
            }
            let (comm, cgroup) = pid.filter(|_| with_owners).map_or((None, None), |p| {
                procs
                    .entry(p)
                    .or_insert_with(|| (procfs::comm(p), procfs::cgroup_of(p)))
                    .clone()
            });
            let hide_location = !hiding.is_empty()
                && (hiding.contains(&rec.cgroup_id)
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
                cgroup_id: rec.cgroup_id,
                cgroup,
                pid,
                command,
                age_secs: now_ns.saturating_sub(rec.first_seen_ns) / 1_000_000_000,
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
