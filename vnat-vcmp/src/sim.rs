//! Deterministic network simulator for the protocol core: virtual time,
//! seeded loss, duplication, reordering and delay. Hosts are endpoints at
//! IP addresses; a datagram reaches whichever live host is at its
//! destination address when it arrives, otherwise it is lost.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use rand_core::RngCore;

use super::binding::Binding;
use super::crypto::{DrbgRng, HostIdentity};
use super::endpoint::{Config, Endpoint, Event};
use super::Timestamp;
use crate::flow::{Proto, VirtualFlow};

pub struct Host {
    pub ep: Endpoint,
    /// The host key's secret, for [`Sim::restart_host`].
    key: [u8; 32],
    pub ip: IpAddr,
    /// More addresses that reach this host (one of the other family).
    pub also: Vec<IpAddr>,
    /// Addresses that reach this host only from itself: the old address a
    /// moved vnatd keeps on `lo`, which the network no longer routes here.
    pub local_only: Vec<IpAddr>,
    /// Addresses this host routes to guests of its own (a routed
    /// container's): datagrams to them at its VCMP port reach its vnatd,
    /// as the rule vnatd installs for them makes the kernel do (a PROVE,
    /// `vcmp::proof`); others go on to the guest, where nothing answers.
    pub routes: Vec<IpAddr>,
    pub alive: bool,
    pub events: Vec<(Timestamp, Event)>,
    /// Play vnatd's part after a switch: once the endpoint tells the
    /// datapath to send to a peer's new address (`SetRemote`, `SendUnvalidated`,
    /// `Reverted`), confirm it
    /// to the peer with SWITCHED, as the driver does after installing the
    /// translation. Off by default: a peer that never confirms (an older
    /// vnatd, a lost datagram).
    pub confirms_switch: bool,
    /// Behind a NAT: its datagrams leave from this public endpoint, and
    /// datagrams to it reach this host (one mapping, for its VCMP port).
    pub nat: Option<SocketAddr>,
    /// The NAT's mappings of this host's UDP flows (physical local endpoint
    /// to public one): where an in-band BIND sent on a flow comes from.
    pub flow_nat: std::collections::HashMap<SocketAddr, SocketAddr>,
    /// Addresses whose in-band BINDs this host's datapath diverts to its
    /// vnatd (after `DivertBinds`).
    pub diverting: std::collections::HashSet<IpAddr>,
    /// In-band BINDs that reached an application here instead (a bug).
    pub binds_to_app: u32,
    /// Everything this host sends is lost (it still receives): one
    /// direction of a path down.
    pub mute: bool,
    /// This many of the next in-band datagrams (BINDs) it sends are lost.
    pub lose_in_band: u32,
    /// The next datagram of this kind (its kind byte) it sends is lost,
    /// and only that one: a single loss at a chosen point.
    pub lose_next: Option<u8>,
    /// Every datagram its vnatd received: (source, bytes), to check what
    /// a host was told.
    pub inbox: Vec<(SocketAddr, Vec<u8>)>,
    /// Flows its datapath sends to an unvalidated address, and that
    /// address (`SendUnvalidated`): their validation only lifts the limit,
    /// which the driver does not confirm again.
    pub limited: std::collections::HashMap<VirtualFlow, SocketAddr>,
}

/// Link behaviour, applied to every datagram independently.
#[derive(Clone, Copy, Debug)]
pub struct Link {
    pub delay: Duration,
    /// Extra uniformly random delay (reorders datagrams).
    pub jitter: Duration,
    /// Probability of loss (per direction, per datagram), in percent.
    pub loss_pct: u64,
    pub dup_pct: u64,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            delay: Duration::from_micros(1500),
            jitter: Duration::ZERO,
            loss_pct: 0,
            dup_pct: 0,
        }
    }
}

struct InFlight {
    at: Timestamp,
    seq: u64,
    from: SocketAddr,
    to: SocketAddr,
    payload: Vec<u8>,
}

impl PartialEq for InFlight {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for InFlight {}
impl PartialOrd for InFlight {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for InFlight {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

pub struct Sim {
    pub now: Timestamp,
    pub hosts: Vec<Host>,
    pub link: Link,
    rng: DrbgRng,
    net: DrbgRng,
    queue: BinaryHeap<Reverse<InFlight>>,
    seq: u64,
    /// (send time, from, to, kind byte) of every datagram put on the wire.
    pub wire_log: Vec<(Timestamp, SocketAddr, SocketAddr, u8)>,
    /// Datagrams the link dropped.
    pub lost: u64,
}

pub fn sa(s: &str) -> SocketAddr {
    s.parse().expect("simulator address")
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("simulator ip")
}

/// A TCP flow as seen from the host at `local`.
pub fn tcp(local: &str, remote: &str) -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Tcp,
        local: sa(local),
        remote: sa(remote),
    }
}

pub fn udp(local: &str, remote: &str) -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Udp,
        ..tcp(local, remote)
    }
}

pub fn reverse(f: &VirtualFlow) -> VirtualFlow {
    VirtualFlow {
        proto: f.proto,
        local: f.remote,
        remote: f.local,
    }
}

impl Sim {
    pub fn new(seed: u64, link: Link) -> Sim {
        Sim {
            now: Timestamp(1_000_000_000),
            hosts: Vec::new(),
            link,
            rng: DrbgRng::from_seed(seed),
            net: DrbgRng::from_seed(seed ^ 0x5eed_f0e7),
            queue: BinaryHeap::new(),
            seq: 0,
            wire_log: Vec::new(),
            lost: 0,
        }
    }

    /// Add a host at `ip` and return its index.
    pub fn add_host(&mut self, ip_: &str, cfg: Config) -> usize {
        let mut key = [0u8; 32];
        self.rng.fill_bytes(&mut key);
        self.hosts.push(Host {
            ep: Endpoint::new(cfg, HostIdentity::from_bytes(key)),
            key,
            ip: ip(ip_),
            also: Vec::new(),
            local_only: Vec::new(),
            routes: Vec::new(),
            alive: true,
            events: Vec::new(),
            confirms_switch: false,
            nat: None,
            flow_nat: Default::default(),
            diverting: Default::default(),
            binds_to_app: 0,
            mute: false,
            lose_in_band: 0,
            lose_next: None,
            inbox: Vec::new(),
            limited: std::collections::HashMap::new(),
        });
        self.hosts.len() - 1
    }

    /// Run `f` on host `h` and return the datagrams it produced instead of
    /// putting them on the wire (to replay, forge or reflect them).
    pub fn capture(
        &mut self,
        h: usize,
        f: impl FnOnce(&mut Endpoint, Timestamp, &mut DrbgRng),
    ) -> Vec<super::tx::Transmit> {
        let now = self.now;
        f(&mut self.hosts[h].ep, now, &mut self.rng);
        let mut out = Vec::new();
        while let Some(t) = self.hosts[h].ep.poll_transmit(now) {
            out.push(t);
        }
        while let Some(e) = self.hosts[h].ep.poll_event() {
            self.hosts[h].events.push((now, e));
        }
        out
    }

    /// Run `f` on host `h` with the simulator's clock and generator, then
    /// collect what it produced.
    pub fn with<T>(
        &mut self,
        h: usize,
        f: impl FnOnce(&mut Endpoint, Timestamp, &mut DrbgRng) -> T,
    ) -> T {
        let now = self.now;
        let out = f(&mut self.hosts[h].ep, now, &mut self.rng);
        self.collect(h);
        out
    }

    /// Add the two ends of a connection that each end names its own way (a
    /// NAT between them): `fa` as host `a` names it, `fb` as host `b` does.
    pub fn connect_named(&mut self, a: usize, b: usize, fa: VirtualFlow, fb: VirtualFlow) {
        let (ba, mut bb) = self.bindings(&fa);
        if fa.proto == Proto::Udp {
            // Each end knows a UDP flow only by its own names.
            bb = Binding::endpoints(&fb);
        }
        self.with(a, |ep, now, rng| {
            ep.connection_added(now, rng, fa, fa.local, fa.remote, ba)
                .expect("add flow on a")
        });
        self.with(b, |ep, now, rng| {
            ep.connection_added(now, rng, fb, fb.local, fb.remote, bb)
                .expect("add flow on b")
        });
    }

    /// Add the two ends of a connection between hosts `a` (local endpoint
    /// `fa.local`) and `b`. A TCP connection gets fresh initial sequence
    /// numbers, recorded crosswise at the two ends as the kernel does; a
    /// UDP one is bound by its endpoints.
    pub fn connect(&mut self, a: usize, b: usize, fa: VirtualFlow) {
        self.connect_named(a, b, fa, reverse(&fa));
    }

    /// The bindings the two ends of `fa` would record (see `connect`).
    pub fn bindings(&mut self, fa: &VirtualFlow) -> (Binding, Binding) {
        match fa.proto {
            Proto::Tcp => {
                let (x, y) = (self.rng.next_u32(), self.rng.next_u32());
                (Binding::tcp(x, y), Binding::tcp(y, x))
            }
            Proto::Udp => (Binding::endpoints(fa), Binding::endpoints(&reverse(fa))),
        }
    }

    fn chance(&mut self, pct: u64) -> bool {
        pct > 0 && self.net.next_u64() % 100 < pct
    }

    /// Take the host's datagrams and events.
    fn collect(&mut self, h: usize) {
        let now = self.now;
        let mut switched = Vec::new();
        let mut inband = Vec::new();
        while let Some(e) = self.hosts[h].ep.poll_event() {
            match &e {
                Event::SetRemote { flow, remote } => {
                    // A validation that only lifts a budget is not
                    // confirmed again.
                    let lift = self.hosts[h].limited.remove(flow) == Some(*remote);
                    if !lift {
                        switched.push(*flow);
                    }
                }
                Event::Reverted { flow, .. } => {
                    self.hosts[h].limited.remove(flow);
                    switched.push(*flow);
                }
                Event::SendUnvalidated { flow, remote, .. } => {
                    self.hosts[h].limited.insert(*flow, *remote);
                    switched.push(*flow);
                }
                // As the driver does: the datapath diverts first, then the
                // core may ask for BINDs.
                Event::DivertBinds { toward } => {
                    self.hosts[h].diverting.insert(*toward);
                    self.hosts[h].ep.binds_diverted(*toward, true);
                }
                Event::SendInBand {
                    local,
                    remote,
                    payload,
                } => {
                    let from = self.hosts[h].flow_nat.get(local).copied().unwrap_or(*local);
                    if self.hosts[h].lose_in_band > 0 {
                        self.hosts[h].lose_in_band -= 1;
                    } else {
                        inband.push((from, *remote, payload.clone()));
                    }
                }
                _ => {}
            }
            self.hosts[h].events.push((now, e));
        }
        for (from, to, payload) in inband {
            self.seq += 1;
            self.queue.push(Reverse(InFlight {
                at: now.plus(self.link.delay),
                seq: self.seq,
                from,
                to,
                payload,
            }));
        }
        if self.hosts[h].confirms_switch && !switched.is_empty() {
            self.hosts[h]
                .ep
                .confirm_switched(now, &mut self.rng, &switched);
        }
        let from = self.hosts[h]
            .nat
            .unwrap_or_else(|| SocketAddr::new(self.hosts[h].ip, self.hosts[h].ep.cfg.port));
        while let Some(t) = self.hosts[h].ep.poll_transmit(now) {
            self.wire_log
                .push((now, from, t.dst, t.payload.get(1).copied().unwrap_or(0)));
            let kind = t.payload.get(1).copied();
            if kind.is_some() && self.hosts[h].lose_next == kind {
                self.hosts[h].lose_next = None;
                self.lost += 1;
                continue;
            }
            if !self.hosts[h].alive || self.hosts[h].mute || self.chance(self.link.loss_pct) {
                self.lost += 1;
                continue;
            }
            let copies = if self.chance(self.link.dup_pct) { 2 } else { 1 };
            for _ in 0..copies {
                let jitter_ns = u64::try_from(self.link.jitter.as_nanos()).unwrap_or(0);
                let extra = if jitter_ns > 0 {
                    self.net.next_u64() % jitter_ns
                } else {
                    0
                };
                let at = now.plus(self.link.delay).plus(Duration::from_nanos(extra));
                self.seq += 1;
                self.queue.push(Reverse(InFlight {
                    at,
                    seq: self.seq,
                    from,
                    to: t.dst,
                    payload: t.payload.clone(),
                }));
            }
        }
    }

    /// Deliver a datagram by hand (an attacker's), now, and return what the
    /// host sent in reply.
    pub fn inject(&mut self, h: usize, from: SocketAddr, bytes: &[u8]) -> Vec<super::tx::Transmit> {
        self.capture(h, |ep, now, rng| ep.handle_datagram(now, rng, from, bytes))
    }

    fn next_time(&self) -> Option<Timestamp> {
        let net = self.queue.peek().map(|Reverse(d)| d.at);
        let timers = self
            .hosts
            .iter()
            .filter(|h| h.alive)
            .filter_map(|h| h.ep.poll_timeout())
            .min();
        match (net, timers) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Run until nothing is left to do or `limit` of virtual time passed.
    pub fn run_for(&mut self, limit: Duration) {
        let end = self.now.plus(limit);
        for h in 0..self.hosts.len() {
            self.collect(h);
        }
        while let Some(t) = self.next_time() {
            if t > end {
                break;
            }
            self.now = self.now.max(t);
            while self.queue.peek().is_some_and(|Reverse(d)| d.at <= self.now) {
                let Some(Reverse(d)) = self.queue.pop() else {
                    break;
                };
                let (to, by) = (d.to.ip(), d.from.ip());
                let behind_nat = self
                    .hosts
                    .iter()
                    .position(|h| h.alive && h.nat == Some(d.to));
                // On a flow through a host's NAT: the mapping takes it to
                // the flow's socket (its private port).
                let on_flow_nat = self.hosts.iter().enumerate().find_map(|(i, h)| {
                    let local = h.flow_nat.iter().find(|(_, p)| **p == d.to)?.0;
                    h.alive.then_some((i, local.port()))
                });
                let Some(h) = behind_nat.or(on_flow_nat.map(|x| x.0)).or_else(|| {
                    self.hosts.iter().position(|h| {
                        h.alive
                            && h.nat.is_none_or(|n| n.ip() != to)
                            && (h.ip == to
                                || h.also.contains(&to)
                                || (h.local_only.contains(&to) && h.ip == by)
                                || (h.routes.contains(&to) && d.to.port() == h.ep.cfg.port))
                    })
                }) else {
                    continue;
                };
                let mut payload = d.payload;
                let to_port = on_flow_nat.map_or(d.to.port(), |x| x.1);
                if behind_nat.is_none()
                    && (on_flow_nat.is_some() || to_port != self.hosts[h].ep.cfg.port)
                {
                    // Sent on a flow, not to vnatd: the tc ingress diverts
                    // a BIND (writing the flow's port into it), or an
                    // application receives it.
                    let bind = payload.len() == vnat_common::BIND_LEN
                        && payload[..2] == vnat_common::BIND_HEAD;
                    if !bind || !self.hosts[h].diverting.contains(&d.from.ip()) {
                        self.hosts[h].binds_to_app += u32::from(bind);
                        continue;
                    }
                    payload[2..4].copy_from_slice(&to_port.to_be_bytes());
                }
                self.hosts[h].inbox.push((d.from, payload.clone()));
                // The address the host sees it arrive at (IP_PKTINFO): its
                // own, private one behind a NAT.
                let at = if behind_nat.is_some() || on_flow_nat.is_some() {
                    self.hosts[h].ip
                } else {
                    to
                };
                self.with(h, |ep, now, rng| {
                    ep.handle_datagram_at(now, rng, d.from, Some(at), &payload)
                });
            }
            for h in 0..self.hosts.len() {
                if self.hosts[h].alive
                    && self.hosts[h]
                        .ep
                        .poll_timeout()
                        .is_some_and(|t| t <= self.now)
                {
                    self.with(h, |ep, now, rng| ep.handle_timeout(now, rng));
                }
            }
        }
        self.now = self.now.max(end);
    }

    /// Events of host `h` matching `pred`.
    pub fn events<'a>(
        &'a self,
        h: usize,
        pred: impl Fn(&Event) -> bool + 'a,
    ) -> impl Iterator<Item = &'a (Timestamp, Event)> + 'a {
        self.hosts[h].events.iter().filter(move |(_, e)| pred(e))
    }

    /// Restart host `h`'s vnatd: a new endpoint with the same host key,
    /// which knows nothing of the old one's sessions and connections.
    pub fn restart_host(&mut self, h: usize, cfg: Config) {
        self.hosts[h].ep = Endpoint::new(cfg, HostIdentity::from_bytes(self.hosts[h].key));
    }

    /// Move host `h` to a new address (its old one becomes unreachable).
    pub fn move_host(&mut self, h: usize, new_ip: &str) {
        self.hosts[h].ip = ip(new_ip);
    }

    /// Move host `h` as vnatd does: its old address stays local (on `lo`),
    /// so datagrams the host sends there come back to itself, while nobody
    /// else's reach it (the network no longer routes it there).
    pub fn move_host_keeping_old_local(&mut self, h: usize, new_ip: &str) {
        let old = self.hosts[h].ip;
        self.move_host(h, new_ip);
        self.hosts[h].local_only.push(old);
    }
}
