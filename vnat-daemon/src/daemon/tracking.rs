//! Which recorded connections vnatd tracks in the core, without I/O: the
//! driver lists the datapath's records and this host's addresses, and
//! [`Tracking::sync`] says which connections are new to the core, which are
//! refused (and why), and which of the core's are gone. Beside that
//! decision it keeps the per-connection facts the moves need: the exported
//! and imported connections, the ones an operator placed (`vnatctl
//! migrate`), the routed containers' anchors and each connection's cgroup.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use super::mobility;
use super::restart_state::Placed;
use crate::datapath::{ConnectionInfo, VirtualFlow};
use crate::vcmp::{Binding, Timestamp};

/// How long an imported connection may wait for its process to restore
/// the socket on this host before it is forgotten.
pub const IMPORT_GRACE: Duration = Duration::from_secs(60);

/// A recorded connection the core does not track yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NewConn {
    pub flow: VirtualFlow,
    pub local_phys: SocketAddr,
    pub remote_phys: SocketAddr,
    pub binding: Binding,
}

/// What one look at the records found.
#[derive(Debug, Default)]
pub struct Synced {
    /// Every recorded connection vnatd could move (tracked or not).
    pub live: HashSet<VirtualFlow>,
    /// To add to the core, in listing order.
    pub new: Vec<NewConn>,
    /// Refused for the first time because their local address is not one
    /// of this host's (with the owning process, for the warning).
    pub not_ours: Vec<(VirtualFlow, Option<u32>)>,
}

/// What the listing says of a live connection.
#[derive(Clone, Copy, Debug)]
struct LiveFacts {
    /// Its cgroup id (0: unknown), for its conflict policy.
    cgroup: u64,
    /// When it was recorded (CLOCK_BOOTTIME ns): its age, for the conflict
    /// policy's "older".
    recorded_ns: u64,
    /// Its socket cookie, which names its socket in what outlasts a
    /// restart of vnatd (`restart_state`).
    cookie: u64,
}

#[derive(Default)]
pub struct Tracking {
    /// Imported flows not yet seen in this host's records, since when: the
    /// migrated process restores its socket after the import (the import
    /// puts the connection's address in place first), so they are kept
    /// meanwhile, for [`IMPORT_GRACE`].
    imported: HashMap<VirtualFlow, Timestamp>,
    /// Exported flows: their process is being checkpointed to another host,
    /// so they are not tracked again here while their socket still exists.
    exported: HashSet<VirtualFlow>,
    /// Recorded connections vnatd refuses to manage, with the reason.
    refused: HashMap<VirtualFlow, &'static str>,
    /// Connections an operator moved (`vnatctl migrate`), to the address
    /// given: automatic mode leaves them there while it exists.
    placed: HashMap<VirtualFlow, IpAddr>,
    /// Containers' connections on addresses this host routes to them (not
    /// NATed), with this host's address that stands for their network
    /// (`mobility::Tracked::anchor`).
    anchors: HashMap<VirtualFlow, IpAddr>,
    /// What the listing says of each live connection. One table, not one
    /// per fact: at 100,000 connections each table keyed by a flow costs
    /// about 10 MB (issue 33, item 1).
    live: HashMap<VirtualFlow, LiveFacts>,
    /// Placements a previous vnatd left (`restart_state`), applied when
    /// the listing shows their socket where it was placed.
    left_placed: HashMap<VirtualFlow, Placed>,
    /// The routed containers' addresses whose VCMP datagrams the datapath
    /// was last told to deliver here (`Datapath::receive_vcmp_at`); `None`
    /// until it was told once (rules a previous vnatd left go then).
    pub receiving_vcmp_at: Option<std::collections::BTreeSet<IpAddr>>,
}

impl Tracking {
    /// Gives back the room of connections that closed
    /// (`vnat_vcmp::room`).
    pub fn shrink_sparse(&mut self) {
        use vnat_vcmp::room::Shrink;
        self.imported.shrink_sparse();
        self.exported.shrink_sparse();
        self.refused.shrink_sparse();
        self.placed.shrink_sparse();
        self.anchors.shrink_sparse();
        self.live.shrink_sparse();
    }

    /// Look at the datapath's records `conns`. `vcmp_port`: vnatd's own
    /// (never moved). `in_core`: whether the core tracks a flow.
    /// `may_manage(ip, recorded_at)`: whether `ip` is (or was when the
    /// connection was recorded, CLOCK_BOOTTIME seconds) one of this host's
    /// addresses; `boot_secs` is now on that clock.
    pub fn sync(
        &mut self,
        conns: Vec<ConnectionInfo>,
        vcmp_port: u16,
        in_core: impl Fn(&VirtualFlow) -> bool,
        may_manage: impl Fn(IpAddr, u64) -> bool,
        boot_secs: u64,
        now: Timestamp,
    ) -> Synced {
        let mut out = Synced::default();
        // A listing may name a flow twice (a record and a guest's): added
        // once.
        let mut adding = HashSet::new();
        for c in conns {
            let flow = VirtualFlow {
                proto: c.proto,
                local: c.virtual_local,
                remote: c.virtual_remote,
            };
            if !mobility::is_mobile_candidate(&flow, vcmp_port) {
                continue;
            }
            out.live.insert(flow);
            self.live.insert(
                flow,
                LiveFacts {
                    cgroup: c.cgroup_id,
                    recorded_ns: c.recorded_ns,
                    cookie: c.cookie,
                },
            );
            if let Some(p) = self.left_placed.remove(&flow) {
                // The same socket, still where it was put (not moved on by
                // a vnatd that died in the middle of another move).
                if p.cookie == c.cookie && p.at == c.physical_local.ip() {
                    tracing::info!(id = flow.id(), %flow, at = %p.at, "connection placed by migrate before vnatd restarted: it stays there");
                    self.placed.insert(flow, p.at);
                }
            }
            // A routed container's connection counts as on the host's
            // address its network is reached by, until it moves.
            let anchor = c.guest.as_ref().and_then(|g| g.routed_via);
            match anchor {
                Some(a) => self.anchors.insert(flow, a),
                None => self.anchors.remove(&flow),
            };
            let on = match anchor {
                Some(a) if c.physical_local == c.virtual_local => a,
                _ => c.physical_local.ip(),
            };
            if in_core(&flow) || self.exported.contains(&flow) || adding.contains(&flow) {
                continue;
            }
            // Physical: a connection that moved before a restart of vnatd
            // uses its new address; its virtual one is on `lo`.
            if !self.imported.contains_key(&flow)
                && !may_manage(on, boot_secs.saturating_sub(c.age_secs))
            {
                if self
                    .refused
                    .insert(flow, mobility::NOT_OUR_ADDRESS)
                    .is_none()
                {
                    out.not_ours.push((flow, c.pid));
                }
                continue;
            }
            if c.udp_inbound_only {
                // Only received from (anyone can spoof a source): no
                // pairing with it until this host answers it.
                self.refused.insert(flow, mobility::INBOUND_ONLY);
                continue;
            }
            // Refused before (inbound only, or on an address that is ours
            // only now): no longer.
            self.refused.remove(&flow);
            adding.insert(flow);
            out.new.push(NewConn {
                flow,
                local_phys: c.physical_local,
                remote_phys: c.physical_remote,
                binding: Binding::of(&flow, c.tcp_isns),
            });
        }
        let live = &out.live;
        self.exported.retain(|f| live.contains(f));
        self.refused.retain(|f, _| live.contains(f));
        self.imported
            .retain(|f, since| !live.contains(f) && now.since(*since) < IMPORT_GRACE);
        self.anchors.retain(|f, _| live.contains(f));
        self.live.retain(|f, _| live.contains(f));
        // A placement whose socket is not listed is gone with it.
        self.left_placed.clear();
        out
    }

    /// The core's connections (`tracked`) whose socket is gone from
    /// `live`, except imports still waiting for theirs. They are forgotten
    /// here.
    pub fn gone<'a>(
        &mut self,
        tracked: impl Iterator<Item = &'a VirtualFlow>,
        live: &HashSet<VirtualFlow>,
    ) -> Vec<VirtualFlow> {
        let gone: Vec<VirtualFlow> = tracked
            .filter(|f| !live.contains(f) && !self.imported.contains_key(f))
            .copied()
            .collect();
        for f in &gone {
            self.placed.remove(f);
        }
        gone
    }

    /// `flow` was handed to another host: not tracked again here.
    pub fn exported(&mut self, flow: VirtualFlow) {
        self.exported.insert(flow);
        self.placed.remove(&flow);
    }

    /// `flow` was taken over from another host at `now`: kept while its
    /// process restores the socket.
    pub fn imported(&mut self, flow: VirtualFlow, now: Timestamp) {
        self.imported.insert(flow, now);
    }

    pub fn is_imported(&self, flow: &VirtualFlow) -> bool {
        self.imported.contains_key(flow)
    }

    /// The imports still waiting for their socket.
    pub fn imports(&self) -> impl Iterator<Item = &VirtualFlow> {
        self.imported.keys()
    }

    /// An operator moved `flow` to `to` (`None`: back to automatic mode).
    pub fn place(&mut self, flow: VirtualFlow, to: Option<IpAddr>) {
        match to {
            Some(ip) => self.placed.insert(flow, ip),
            None => self.placed.remove(&flow),
        };
    }

    /// Whether any connection is placed (see [`Tracking::place`]).
    pub fn any_placed(&self) -> bool {
        !self.placed.is_empty()
    }

    pub fn is_placed(&self, flow: &VirtualFlow) -> bool {
        self.placed.contains_key(flow)
    }

    /// Where an operator placed `flow`, if it stays there.
    pub fn placed_at(&self, flow: &VirtualFlow) -> Option<IpAddr> {
        self.placed.get(flow).copied()
    }

    /// The placements a previous vnatd left, to apply at the next
    /// [`Tracking::sync`] (and drop if their socket is not listed).
    pub fn restore_placements(&mut self, left: Vec<Placed>) {
        self.left_placed = left.into_iter().map(|p| (p.flow, p)).collect();
    }

    /// The placements to keep across a restart, each with its socket's
    /// cookie, and those still waiting to be applied.
    pub fn placements(&self) -> Vec<Placed> {
        let mut out: Vec<Placed> = self
            .placed
            .iter()
            .filter_map(|(f, at)| {
                Some(Placed {
                    flow: *f,
                    cookie: self.live.get(f)?.cookie,
                    at: *at,
                })
            })
            .collect();
        out.extend(self.left_placed.values().copied());
        out
    }

    /// When the live connection `flow` was recorded (CLOCK_BOOTTIME ns).
    pub fn recorded_ns(&self, flow: &VirtualFlow) -> Option<u64> {
        self.live.get(flow).map(|l| l.recorded_ns)
    }

    /// The socket cookie of the live connection `flow`.
    pub fn cookie(&self, flow: &VirtualFlow) -> Option<u64> {
        self.live.get(flow).map(|l| l.cookie)
    }

    pub fn anchor(&self, flow: &VirtualFlow) -> Option<IpAddr> {
        self.anchors.get(flow).copied()
    }

    /// The routed containers' connections (those with an anchor).
    pub fn routed(&self) -> impl Iterator<Item = &VirtualFlow> {
        self.anchors.keys()
    }

    /// Each live connection's cgroup id (0: unknown).
    pub fn cgroups(&self) -> impl Iterator<Item = (&VirtualFlow, u64)> {
        self.live.iter().map(|(f, l)| (f, l.cgroup))
    }

    /// The connections refused, with why.
    pub fn refused(&self) -> impl Iterator<Item = (&VirtualFlow, &'static str)> {
        self.refused.iter().map(|(f, why)| (f, *why))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::{ConnState, GuestInfo, Proto};

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn record(local: &str, remote: &str) -> ConnectionInfo {
        ConnectionInfo {
            id: 1,
            proto: Proto::Tcp,
            virtual_local: sa(local),
            virtual_remote: sa(remote),
            physical_local: sa(local),
            physical_remote: sa(remote),
            state: ConnState::Native,
            cookie: 1,
            cgroup_id: 7,
            cgroup: None,
            pid: Some(42),
            command: None,
            age_secs: 5,
            recorded_ns: 0,
            tcp_isns: Some([1, 2]),
            udp_inbound_only: false,
            adopted: false,
            hide_location: false,
            guest: None,
        }
    }

    fn flow_of(c: &ConnectionInfo) -> VirtualFlow {
        VirtualFlow {
            proto: c.proto,
            local: c.virtual_local,
            remote: c.virtual_remote,
        }
    }

    const OURS: &str = "10.0.0.1";

    fn ours(ip: IpAddr, _: u64) -> bool {
        ip == OURS.parse::<IpAddr>().unwrap()
    }

    fn sync(t: &mut Tracking, conns: Vec<ConnectionInfo>, in_core: &[VirtualFlow]) -> Synced {
        t.sync(
            conns,
            2031,
            |f| in_core.contains(f),
            ours,
            100,
            Timestamp(0),
        )
    }

    #[test]
    fn a_new_connection_on_our_address_is_added_and_one_on_another_is_refused_once() {
        let mut t = Tracking::default();
        let mine = record("10.0.0.1:40000", "10.0.0.2:22");
        let freebind = record("192.0.2.9:40001", "10.0.0.2:22");
        let s = sync(&mut t, vec![mine.clone(), freebind.clone()], &[]);
        assert_eq!(s.new.len(), 1);
        assert_eq!(s.new[0].flow, flow_of(&mine));
        assert_eq!(s.new[0].binding, Binding::of(&flow_of(&mine), Some([1, 2])));
        assert_eq!(s.not_ours, vec![(flow_of(&freebind), Some(42))]);
        // Warned once; still refused, and listed as such.
        let s = sync(
            &mut t,
            vec![mine.clone(), freebind.clone()],
            &[flow_of(&mine)],
        );
        assert!(s.new.is_empty() && s.not_ours.is_empty());
        let refused: Vec<_> = t.refused().collect();
        assert_eq!(
            refused,
            vec![(&flow_of(&freebind), mobility::NOT_OUR_ADDRESS)]
        );
        // Closed: forgotten, refusal and all.
        let s = sync(&mut t, vec![mine], &[]);
        assert_eq!(s.live.len(), 1);
        assert_eq!(t.refused().count(), 0);
    }

    #[test]
    fn a_connection_refused_for_its_address_is_added_once_the_address_is_ours() {
        let mut t = Tracking::default();
        let c = record("192.0.2.9:40000", "10.0.0.2:22");
        let f = flow_of(&c);
        assert_eq!(sync(&mut t, vec![c.clone()], &[]).not_ours.len(), 1);
        let now_ours = |ip: IpAddr, _: u64| ip == "192.0.2.9".parse::<IpAddr>().unwrap();
        let s = t.sync(
            vec![c.clone(), c],
            2031,
            |_| false,
            now_ours,
            100,
            Timestamp(0),
        );
        assert_eq!(
            s.new.iter().map(|n| n.flow).collect::<Vec<_>>(),
            vec![f],
            "once"
        );
        assert_eq!(t.refused().count(), 0, "no longer listed as refused");
    }

    #[test]
    fn an_address_is_ours_if_it_was_when_the_connection_was_recorded() {
        let mut t = Tracking::default();
        // Recorded 5 s ago (age 5 at boot clock 100): asked at 95.
        let asked = std::cell::Cell::new(None);
        let was_ours = |_: IpAddr, at: u64| {
            asked.set(Some(at));
            at == 95
        };
        let c = record("192.0.2.9:40000", "10.0.0.2:22");
        let s = t.sync(vec![c], 2031, |_| false, was_ours, 100, Timestamp(0));
        assert_eq!(asked.get(), Some(95));
        assert_eq!(s.new.len(), 1);
    }

    #[test]
    fn a_gone_connection_is_no_longer_placed() {
        let mut t = Tracking::default();
        let f = flow_of(&record("10.0.0.1:40000", "10.0.0.2:22"));
        t.place(f, OURS.parse().ok());
        assert!(t.is_placed(&f));
        let s = sync(&mut t, vec![], &[f]);
        assert_eq!(t.gone([f].iter(), &s.live), vec![f]);
        assert!(!t.is_placed(&f));
    }

    #[test]
    fn a_placement_a_previous_vnatd_left_applies_to_its_socket_where_it_was_put() {
        let mut t = Tracking::default();
        let b: IpAddr = "10.0.1.1".parse().unwrap();
        // Three connections the last vnatd placed at B: one still there,
        // one whose socket is new (another cookie), one not at B any more.
        let mut there = record("10.0.0.1:40000", "10.0.0.2:22");
        there.physical_local = SocketAddr::new(b, 40000);
        there.cookie = 11;
        let mut reused = record("10.0.0.1:40001", "10.0.0.2:22");
        reused.physical_local = SocketAddr::new(b, 40001);
        reused.cookie = 12;
        let elsewhere = record("10.0.0.1:40002", "10.0.0.2:22");
        let gone = flow_of(&record("10.0.0.1:40003", "10.0.0.2:22"));
        let left = |c: &ConnectionInfo, cookie| Placed {
            flow: flow_of(c),
            cookie,
            at: b,
        };
        t.restore_placements(vec![
            left(&there, 11),
            left(&reused, 99),
            left(&elsewhere, elsewhere.cookie),
            Placed {
                flow: gone,
                cookie: 5,
                at: b,
            },
        ]);
        // Until the records are listed, they are kept (and saved).
        assert_eq!(t.placements().len(), 4);
        sync(
            &mut t,
            vec![there.clone(), reused.clone(), elsewhere.clone()],
            &[],
        );
        assert_eq!(t.placed_at(&flow_of(&there)), Some(b));
        assert!(!t.is_placed(&flow_of(&reused)) && !t.is_placed(&flow_of(&elsewhere)));
        assert!(!t.is_placed(&gone));
        assert_eq!(t.placements(), vec![left(&there, 11)]);
        assert_eq!(t.cookie(&flow_of(&there)), Some(11));
    }

    #[test]
    fn vnat_s_own_port_and_loopback_are_never_tracked() {
        let mut t = Tracking::default();
        let mut own = record("10.0.0.1:2031", "10.0.0.2:2031");
        own.proto = Proto::Udp;
        let lo = record("127.0.0.1:40000", "127.0.0.1:22");
        let s = sync(&mut t, vec![own, lo], &[]);
        assert!(s.live.is_empty() && s.new.is_empty() && s.not_ours.is_empty());
    }

    #[test]
    fn an_inbound_only_udp_flow_waits_until_this_host_answers_it() {
        let mut t = Tracking::default();
        let mut c = record("10.0.0.1:5353", "10.0.0.2:40000");
        c.proto = Proto::Udp;
        c.udp_inbound_only = true;
        let s = sync(&mut t, vec![c.clone()], &[]);
        assert!(s.new.is_empty());
        assert_eq!(
            t.refused().next().map(|(_, w)| w),
            Some(mobility::INBOUND_ONLY)
        );
        c.udp_inbound_only = false;
        let s = sync(&mut t, vec![c.clone()], &[]);
        assert_eq!(s.new.len(), 1);
        assert_eq!(t.refused().count(), 0);
    }

    #[test]
    fn an_exported_connection_is_not_tracked_again_and_an_import_waits_for_its_socket() {
        let mut t = Tracking::default();
        let c = record("10.0.0.1:40000", "10.0.0.2:22");
        let f = flow_of(&c);
        t.place(f, Some("10.0.0.1".parse().unwrap()));
        t.exported(f);
        assert!(!t.is_placed(&f));
        let s = sync(&mut t, vec![c.clone()], &[]);
        assert!(s.new.is_empty(), "exported, still recorded here");
        // Its socket closed: no longer exported; a later record is new.
        sync(&mut t, vec![], &[]);
        assert_eq!(sync(&mut t, vec![c.clone()], &[]).new.len(), 1);

        // Imported on an address that is not ours (yet): added when its
        // socket appears, and not gone from the core before that.
        let moved = record("192.0.2.9:40000", "10.0.0.2:22");
        let g = flow_of(&moved);
        t.imported(g, Timestamp(0));
        let s = sync(&mut t, vec![], &[g]);
        assert!(t.gone([g].iter(), &s.live).is_empty());
        assert!(t.is_imported(&g));
        let s = sync(&mut t, vec![moved], &[]);
        assert_eq!(s.new.iter().map(|n| n.flow).collect::<Vec<_>>(), vec![g]);
        assert!(!t.is_imported(&g), "seen: no longer waiting");
    }

    #[test]
    fn an_import_whose_socket_never_comes_is_forgotten_after_the_grace() {
        let mut t = Tracking::default();
        let f = flow_of(&record("10.0.0.1:40000", "10.0.0.2:22"));
        t.imported(f, Timestamp(0));
        let late = Timestamp(0).plus(IMPORT_GRACE);
        let s = t.sync(vec![], 2031, |_| true, ours, 100, late);
        assert_eq!(t.gone([f].iter(), &s.live), vec![f]);
    }

    #[test]
    fn a_routed_container_s_connection_counts_on_the_host_address_it_is_reached_by() {
        let mut t = Tracking::default();
        let mut c = record("172.16.0.2:40000", "10.0.0.2:22");
        c.guest = Some(GuestInfo {
            netns_cookie: 9,
            netns: None,
            private_local: sa("172.16.0.2:40000"),
            private_remote: sa("10.0.0.2:22"),
            routed_via: Some(OURS.parse().unwrap()),
        });
        let s = sync(&mut t, vec![c.clone()], &[]);
        assert_eq!(
            s.new.len(),
            1,
            "managed: its network is reached by our address"
        );
        assert_eq!(t.anchor(&flow_of(&c)), OURS.parse().ok());
        assert_eq!(t.cgroups().collect::<Vec<_>>(), vec![(&flow_of(&c), 7)]);
        sync(&mut t, vec![], &[]);
        assert_eq!(t.anchor(&flow_of(&c)), None);
    }
}
