//! A rogue peer: a VCMP endpoint of vnat's own protocol core, driven by the
//! test instead of by vnatd, with its own host key, its own VCMP socket and
//! its own UDP flow to a server, for which it holds valid keys once the
//! server's vnatd binds it. The test then makes it do what a well-keyed
//! host acting in bad faith could: claim other hosts' connections, move
//! its own flow around, refuse to finish what it started.

use std::{
    net::{SocketAddr, UdpSocket},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use vnat_daemon::{
    datapath::{Proto, VirtualFlow},
    vcmp::{
        binding::Binding,
        crypto::{DrbgRng, HostIdentity},
        endpoint::{Config, Endpoint, Event},
        Timestamp,
    },
};

use serde_json::Value;

use super::{wait_until, Netns, Vnatd};

struct State {
    ep: Endpoint,
    rng: DrbgRng,
    start: Instant,
    vcmp: UdpSocket,
    /// The rogue's own UDP flow's socket, once opened.
    flow: Option<(VirtualFlow, UdpSocket)>,
    /// Whether BINDs the core asks to send go out (on the flow's socket).
    answer_binds: bool,
    events: Vec<Event>,
}

impl State {
    fn now(&self) -> Timestamp {
        Timestamp::from_nanos(self.start.elapsed().as_nanos() as u64)
    }

    /// One turn of what vnatd's driver does.
    fn pump(&mut self) {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = self.vcmp.recv_from(&mut buf) {
            let now = self.now();
            self.ep.handle_datagram(now, &mut self.rng, from, &buf[..n]);
        }
        let now = self.now();
        if self.ep.poll_timeout().is_some_and(|t| t <= now) {
            self.ep.handle_timeout(now, &mut self.rng);
        }
        while let Some(e) = self.ep.poll_event() {
            match &e {
                Event::DivertBinds { toward } => self.ep.binds_diverted(*toward, true),
                Event::SendInBand { local, payload, .. } => {
                    if let Some((_, sock)) = &self.flow {
                        if self.answer_binds && sock.local_addr().ok() == Some(*local) {
                            let _ = sock.send(payload);
                        }
                    }
                }
                _ => {}
            }
            self.events.push(e);
        }
        while let Some(t) = self.ep.poll_transmit(self.now()) {
            let _ = self.vcmp.send_to(&t.payload, t.dst);
        }
    }
}

/// The server's `vnatctl ls` row of a rogue's UDP flow `flow` (found by
/// the rogue's end, which is the server's remote virtual endpoint).
pub fn server_row(srvd: &Vnatd, flow: &VirtualFlow) -> Option<Value> {
    let ls = srvd.ctl(&["ls", "--proto", "udp"])?;
    ls.as_array()?
        .iter()
        .find(|r| r["virtual_remote"].as_str() == Some(&flow.local.to_string()))
        .cloned()
}

/// See the module documentation. Stops when dropped.
pub struct Rogue {
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    pump: Option<JoinHandle<()>>,
}

impl Rogue {
    /// A rogue with a fresh host key whose VCMP listens on `port` in `ns`.
    pub fn start(ns: &Netns, port: u16) -> Rogue {
        let seed = u64::from(std::process::id()) << 32 ^ u64::from(port);
        let mut rng = DrbgRng::from_seed(seed);
        let identity = HostIdentity::generate(&mut rng);
        let vcmp = ns.run_in(|| UdpSocket::bind(("0.0.0.0", port)).expect("rogue VCMP socket"));
        vcmp.set_nonblocking(true).expect("nonblocking");
        let ep = Endpoint::new(Config::default(), identity);
        let state = Arc::new(Mutex::new(State {
            ep,
            rng,
            start: Instant::now(),
            vcmp,
            flow: None,
            answer_binds: true,
            events: Vec::new(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let pump = {
            let (state, stop) = (state.clone(), stop.clone());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    state.lock().unwrap_or_else(|p| p.into_inner()).pump();
                    thread::sleep(Duration::from_millis(5));
                }
            })
        };
        Rogue {
            state,
            stop,
            pump: Some(pump),
        }
    }

    /// The rogue's host key.
    pub fn public_key(&self) -> [u8; 32] {
        self.lock().ep.public_key()
    }

    /// Open the rogue's own UDP flow to `server` from `ns` (it sends one
    /// datagram, so the server records it) and give it to the core.
    pub fn open_udp_flow(&self, ns: &Netns, server: SocketAddr) -> VirtualFlow {
        let sock = ns.run_in(|| {
            let s = UdpSocket::bind(("0.0.0.0", 0)).expect("rogue flow socket");
            s.connect(server).expect("connect");
            s
        });
        sock.send(b"rogue hello").expect("send");
        let flow = VirtualFlow {
            proto: Proto::Udp,
            local: sock.local_addr().expect("local"),
            remote: server,
        };
        self.add(flow);
        self.lock().flow = Some((flow, sock));
        flow
    }

    /// [`Rogue::open_udp_flow`], then wait until the rogue holds keys for
    /// the flow and the server's vnatd `srvd` lists it as mobile (both
    /// within 30 s, or the test fails saying which did not happen).
    pub fn open_bound_udp_flow(&self, ns: &Netns, server: SocketAddr, srvd: &Vnatd) -> VirtualFlow {
        let own = self.open_udp_flow(ns, server);
        wait_until(
            Duration::from_secs(30),
            || self.has_keys(&own),
            || format!("the rogue's own flow was never bound: {:?}", self.events()),
        );
        wait_until(
            Duration::from_secs(10),
            || server_row(srvd, &own).is_some_and(|r| r["mobile"] == Value::Bool(true)),
            || {
                format!(
                    "the server never listed the rogue's flow as mobile: {:?}",
                    srvd.ctl(&["ls"])
                )
            },
        );
        own
    }

    /// Tell the core of a connection it has, named `flow` (its own, or one
    /// it pretends to have), bound by its endpoints or by `tcp_isns`.
    pub fn add(&self, flow: VirtualFlow) {
        self.add_with(flow, Binding::endpoints(&flow));
    }

    /// [`Rogue::add`] with a chosen binding.
    pub fn add_with(&self, flow: VirtualFlow, binding: Binding) {
        let mut s = self.lock();
        let now = s.now();
        let State { ep, rng, .. } = &mut *s;
        ep.connection_added(now, rng, flow, flow.local, flow.remote, binding)
            .expect("rogue connection_added");
    }

    /// Whether the core has keys for `flow`.
    /// Send another datagram on the rogue's own UDP flow, as a client whose
    /// first datagrams went unanswered does (a server guarding other
    /// connections from the same NAT holds a new port's datagrams for a
    /// few seconds).
    pub fn send_again(&self) {
        if let Some((_, sock)) = &self.lock().flow {
            let _ = sock.send(b"rogue hello");
        }
    }

    pub fn has_keys(&self, flow: &VirtualFlow) -> bool {
        self.lock().ep.connection(flow).is_some_and(|v| v.has_keys)
    }

    /// Whether BINDs go out when the core asks (default yes).
    pub fn answer_binds(&self, yes: bool) {
        self.lock().answer_binds = yes;
    }

    /// Announce that `flow`'s end moved to `new_local` (an update that is
    /// authentic, for a move that never happened).
    pub fn resume(&self, flow: VirtualFlow, new_local: SocketAddr) {
        let mut s = self.lock();
        let now = s.now();
        let State { ep, rng, .. } = &mut *s;
        ep.resume(now, rng, &[(flow, new_local)])
            .expect("rogue resume");
    }

    /// Datagrams that reached the rogue's own flow's socket since the last
    /// call (what it could read of others' traffic, if anything).
    pub fn flow_received(&self) -> Vec<Vec<u8>> {
        let s = self.lock();
        let Some((_, sock)) = &s.flow else {
            return Vec::new();
        };
        let _ = sock.set_nonblocking(true);
        let mut out = Vec::new();
        let mut buf = [0u8; 65536];
        while let Ok(n) = sock.recv(&mut buf) {
            out.push(buf[..n].to_vec());
        }
        out
    }

    /// Events the core has emitted so far.
    pub fn events(&self) -> Vec<Event> {
        self.lock().events.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for Rogue {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(p) = self.pump.take() {
            let _ = p.join();
        }
    }
}
