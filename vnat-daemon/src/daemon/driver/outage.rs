//! The driver's side of unannounced outages (`daemon::outage`): the holds
//! this host starts when it loses a connection's address or route without
//! warning, and the zero-window help it starts for a paired host that went
//! silent.

use super::*;
use crate::daemon::helping::{self as rules, AfterAnswer, Helping};
use crate::daemon::outage::{self, Action, SilenceWatch};
use crate::datapath::PeerAnswer;
use crate::datapath::{PeerSilence, Proto};
use crate::vcmp::help::Help;
use std::time::Instant;

/// How often the held retransmission timeouts are looked at for release.
const OWN_CHECK_EVERY: Duration = Duration::from_millis(500);
/// Most sockets asked whether they wait for their peer in one look (one
/// sock_diag query each, about once a second): with more connections they
/// take turns.
const SILENCE_LOOKS_MAX: usize = 512;

/// Where VCMP has a connection: its local physical endpoint, whether it is
/// moving, its peer's physical address.
type Where = (SocketAddr, bool, IpAddr);

/// What the driver keeps about unannounced outages.
pub(super) struct Outages {
    /// This host's own TCP_USER_TIMEOUTs held while it is cut off (so that
    /// `tcp_retries2` does not end a connection whose data waits): the
    /// value to give back, and the hold (released by the keepalive hold's
    /// rule).
    pub(super) own_timeouts: HashMap<VirtualFlow, (u32, mobility::HeldKeepalive)>,
    next_own_check: Instant,
    silence: SilenceWatch,
    /// Connections helped because their host went silent (not because it
    /// asked), that host, and since when.
    silent_help: HashMap<VirtualFlow, ([u8; 32], Instant)>,
    /// When the sockets are next looked at, and where that look starts
    /// (they take turns).
    next_look: Instant,
    turn: usize,
    /// Connections a vnatd that died held for this host's outage: mobile
    /// then, though this one could not pair for them yet (offline).
    inherited: HashSet<VirtualFlow>,
    /// Stranded connections whose own socket this host answers for its
    /// unreachable peer with a zero window (see [`Driver::answer_while_away`]),
    /// and when they are next answered.
    answering: HashMap<VirtualFlow, Helping>,
    next_answer: Instant,
}

impl Default for Outages {
    fn default() -> Self {
        Outages {
            own_timeouts: HashMap::new(),
            next_own_check: Instant::now(),
            silence: SilenceWatch::default(),
            silent_help: HashMap::new(),
            next_look: Instant::now(),
            turn: 0,
            inherited: HashSet::new(),
            answering: HashMap::new(),
            next_answer: Instant::now(),
        }
    }
}

impl Driver {
    /// Automatic mode found `tracked` at `addrs`, with a route to the peers
    /// in `sources`, and starts `moves`: hold the keepalive and the
    /// retransmission timeout of the mobile TCP connections that no move
    /// can carry now (`outage::stranded`), until they work again.
    pub(super) async fn hold_stranded(
        &mut self,
        tracked: &[Tracked],
        addrs: &HashSet<IpAddr>,
        sources: &HashMap<IpAddr, Option<IpAddr>>,
        moves: &[Move],
    ) {
        // What a vnatd that died left on these sockets is given back first
        // (`undo_left_changes`): a hold taken over it would find the
        // keepalive already off and record the raised timeout as the
        // application's. Its connections were mobile: they are held again
        // (next turn) although this vnatd could not pair yet, offline.
        let left = self.restart_state.left_holds();
        if !left.is_empty() {
            self.outages.inherited.extend(left.iter().map(|h| h.flow));
            return;
        }
        let moving: HashSet<VirtualFlow> = moves.iter().map(|m| m.flow).collect();
        let stranded: Vec<VirtualFlow> = tracked
            .iter()
            .filter(|t| t.flow.proto == Proto::Tcp)
            .filter(|t| !self.outages.answering.contains_key(&t.flow))
            .filter(|t| !moving.contains(&t.flow))
            .filter(|t| {
                let routed = sources
                    .get(&t.remote_phys.ip())
                    .copied()
                    .flatten()
                    .is_some();
                outage::stranded(t, addrs, routed)
            })
            .filter(|t| {
                self.outages.inherited.contains(&t.flow)
                    || self
                        .endpoint
                        .connection(&t.flow)
                        .is_some_and(|v| v.has_keys)
            })
            .map(|t| t.flow)
            .collect();
        if stranded.is_empty() {
            return;
        }
        tracing::info!(
            connections = stranded.len(),
            "this host lost the address or route of mobile connections without warning: their keepalives and retransmission timeouts are held until they work again"
        );
        let fresh: Vec<VirtualFlow> = stranded
            .iter()
            .filter(|f| !self.helpers.keepalive_held.contains_key(f))
            .copied()
            .collect();
        self.hold_keepalives(&stranded).await;
        // Nobody suspended them: they go back on as soon as they work
        // where they are, as after `resume`.
        for f in &fresh {
            if let Some(h) = self.helpers.keepalive_held.get_mut(f) {
                h.resume_asked = true;
            }
        }
        self.hold_own_timeouts(&stranded, true).await;
        let now_i = Instant::now();
        let help = crate::vcmp::help::Help {
            zero_window: true,
            ..Default::default()
        };
        for f in stranded {
            self.outages
                .answering
                .insert(f, Helping::new(help.clone(), now_i));
        }
        self.outages.next_answer = now_i + outage::FIRST_ANSWER_AFTER;
    }

    /// When the loop must wake next to answer for the unreachable peers.
    pub(super) fn next_answer_wake(&self) -> Option<Instant> {
        (!self.outages.answering.is_empty()).then_some(self.outages.next_answer)
    }

    /// While this host is cut off, answer for the unreachable peer on each
    /// stranded connection's own socket with a zero window, every
    /// [`rules::ANSWER_EVERY`] (the zero-window helper's answers, given
    /// here to our own socket): data written meanwhile waits in persist
    /// mode, whose unanswered window probes each answer clears. Without
    /// it, each send failing for want of a route counts as a window probe,
    /// and `tcp_retries2` of them end the connection, whatever its
    /// TCP_USER_TIMEOUT (seen: 4 s with tcp_retries2 = 3). The address is
    /// kept on `lo` meanwhile (`update_kept`), so that the answer reaches
    /// the socket. Ends once the connection moves or works again.
    async fn answer_while_away(&mut self) {
        let now_i = Instant::now();
        if self.outages.answering.is_empty() || now_i < self.outages.next_answer {
            return;
        }
        self.outages.next_answer = now_i + rules::ANSWER_EVERY;
        let mut moving = Vec::new();
        let mut due = Vec::new();
        for (f, h) in &self.outages.answering {
            match self.endpoint.connection(f) {
                Some(v) if v.migrating => moving.push(*f),
                Some(_) => due.push((*f, h.deliver_if_still_at())),
                None => moving.push(*f),
            }
        }
        for f in moving {
            self.stop_answering(f, true).await;
        }
        let answers = with_dp(&self.dp, move |dp| {
            due.into_iter()
                .map(|(f, at)| (f, dp.answer_for_peer(&f, 0, Some(at))))
                .collect::<Vec<_>>()
        })
        .await;
        for (f, a) in answers {
            let Ok(a) = a else { continue };
            let Some(h) = self.outages.answering.get_mut(&f) else {
                continue;
            };
            match h.answered(a) {
                AfterAnswer::Keep => {}
                // Heard from its peer after all, or the answer does not
                // take: the socket's own view goes on.
                AfterAnswer::PeerBack | AfterAnswer::NotTaken => {
                    self.stop_answering(f, false).await;
                }
                AfterAnswer::Gone => {
                    self.outages.answering.remove(&f);
                }
            }
        }
    }

    /// Stop answering for `flow`'s peer: with `reopen`, deliver the window
    /// the peer advertised last (its own ACKs are on their way only once
    /// the connection works); then restart the socket's timers.
    async fn stop_answering(&mut self, flow: VirtualFlow, reopen: bool) {
        let Some(h) = self.outages.answering.remove(&flow) else {
            return;
        };
        if !h.quiet {
            return;
        }
        let window = h.reopen_window().filter(|_| reopen);
        let r = with_dp(&self.dp, move |dp| {
            if let Some(w) = window {
                if dp.answer_for_peer(&flow, w, None)? == PeerAnswer::Gone {
                    return Ok(());
                }
            }
            dp.restart_flow(&flow).map(|_| ())
        })
        .await;
        if let Err(e) = r {
            tracing::warn!(id = flow.id(), %flow, error = %e, "cannot restart a connection this host answered for while away");
        }
    }

    /// Hold the TCP_USER_TIMEOUT of `flows` (this host's own) high while
    /// this host is away: a socket whose data waits counts the absence
    /// against `tcp_retries2` (about 15 minutes) otherwise. `unannounced`:
    /// released as soon as each works again where it is; else (a suspend)
    /// after `resume` or a move.
    pub(super) async fn hold_own_timeouts(&mut self, flows: &[VirtualFlow], unannounced: bool) {
        let todo: Vec<(VirtualFlow, SocketAddr)> = flows
            .iter()
            .filter(|f| f.proto == Proto::Tcp && !self.outages.own_timeouts.contains_key(f))
            .filter_map(|f| Some((*f, self.endpoint.connection(f)?.local_phys)))
            .collect();
        if todo.is_empty() {
            return;
        }
        // On disk before the sockets change (see `restart_state`): a vnatd
        // killed while this host is away leaves the next one the value.
        let undo: Vec<_> = todo
            .iter()
            .map(|(f, _)| {
                let before = self.helpers.timeout_restore.get(f).map(|r| r.0);
                (
                    *f,
                    crate::daemon::restart_state::Undo::UserTimeout { before },
                )
            })
            .collect();
        if !self.record_before_change(undo) {
            return;
        }
        let held = with_dp(&self.dp, move |dp| {
            todo.into_iter()
                .filter_map(|(f, local)| match dp.set_user_timeout(&f, rules::USER_TIMEOUT_HOLD) {
                    Ok(Some(before)) => Some((f, local, before)),
                    Ok(None) => None,
                    Err(e) => {
                        tracing::warn!(id = f.id(), flow = %f, error = %e, "cannot hold the connection's retransmission timeout while this host is away");
                        None
                    }
                })
                .collect::<Vec<_>>()
        })
        .await;
        let since = Instant::now();
        for (f, local, before) in held {
            // A timeout still being given back from an earlier hold is the
            // application's.
            let before = self
                .helpers
                .timeout_restore
                .remove(&f)
                .map_or(before, |r| r.0);
            self.outages.own_timeouts.insert(
                f,
                (
                    before,
                    mobility::HeldKeepalive {
                        since,
                        local_at_hold: local,
                        resume_asked: unannounced,
                    },
                ),
            );
        }
    }

    /// `vnatctl resume`: the held timeouts go back once each connection
    /// works again.
    pub(super) fn resume_own_timeouts(&mut self) {
        for (_, h) in self.outages.own_timeouts.values_mut() {
            h.resume_asked = true;
        }
    }

    /// Give back the held timeouts of the connections that work again (the
    /// keepalive hold's rule), through the give-back of the helpers'
    /// (`timeout_restore`: once the peer has acknowledged data again, so
    /// that the retransmissions of the outage do not count); all of them
    /// with `all` (vnatd stops). Closed connections' are forgotten.
    pub(super) async fn release_own_timeouts(&mut self, all: bool) {
        if all {
            for f in self.outages.answering.keys().copied().collect::<Vec<_>>() {
                self.stop_answering(f, true).await;
            }
        } else {
            self.answer_while_away().await;
        }
        if self.outages.own_timeouts.is_empty() {
            return;
        }
        let now_i = Instant::now();
        if !all && now_i < self.outages.next_own_check {
            return;
        }
        self.outages.next_own_check = now_i + OWN_CHECK_EVERY;
        let state: Vec<(VirtualFlow, mobility::HeldKeepalive, Option<Where>)> = self
            .outages
            .own_timeouts
            .iter()
            .map(|(f, (_, h))| {
                let c = self
                    .endpoint
                    .connection(f)
                    .map(|v| (v.local_phys, v.migrating, v.remote_phys.ip()));
                (*f, *h, c)
            })
            .collect();
        let due = with_dp(&self.dp, move |dp| {
            let Ok(a) = dp.interface_addresses() else {
                return Vec::new();
            };
            let addrs: HashSet<IpAddr> = a.into_iter().map(|(ip, _)| ip).collect();
            state
                .into_iter()
                .filter(|(_, h, c)| match c {
                    None => true,
                    Some((local, migrating, remote)) => {
                        let routed = dp.source_address_for(*remote).ok().flatten().is_some();
                        all || mobility::keepalive_release_due(
                            h, *local, *migrating, &addrs, routed, now_i,
                        )
                    }
                })
                .map(|(f, _, c)| (f, c.is_some()))
                .collect::<Vec<_>>()
                .into_iter()
                // What the peer has acknowledged as the connection is found
                // working: the timeout goes back once it acknowledges more.
                // (Read at the give-back's first look instead, up to a
                // second later, it could already count every
                // acknowledgment there will be.)
                .map(|(f, live)| {
                    (
                        f,
                        live,
                        live.then(|| super::helping::acked_now(dp, &f)).flatten(),
                    )
                })
                .collect::<Vec<_>>()
        })
        .await;
        for (f, live, acked) in due {
            self.outages.inherited.remove(&f);
            self.stop_answering(f, live).await;
            let Some((before, _)) = self.outages.own_timeouts.remove(&f) else {
                continue;
            };
            if live {
                self.helpers
                    .timeout_restore
                    .insert(f, (before, acked, Instant::now()));
                tracing::debug!(id = f.id(), flow = %f, "the connection works again: its retransmission timeout is given back once the peer acknowledges data");
            }
        }
    }

    /// Look at the sockets of the paired hosts' connections (about once a
    /// second): a host whose sockets wait for it, while this host is fine,
    /// is probed, and answered for with a zero window once found silent.
    pub(super) async fn watch_silence(&mut self) {
        let now_i = Instant::now();
        // Once a second, or when a watched host's next step is due (not on
        // every loop turn: a flood of VCMP datagrams makes thousands).
        let step_due = self.outages.silence.next_step().is_some_and(|t| now_i >= t);
        if !step_due && now_i < self.outages.next_look {
            return;
        }
        self.outages.next_look = now_i + outage::PROBE_EVERY;
        // Help started for a silent host ends with its help (the host was
        // heard from, moved, or the connection closed).
        let helping = &self.helpers.helping;
        self.outages
            .silent_help
            .retain(|f, _| helping.contains_key(f));
        // Nobody asked for it: after [`outage::SILENT_HELP_MAX`] this
        // host's TCP is left to its own timeouts again.
        let over: Vec<VirtualFlow> = self
            .outages
            .silent_help
            .iter()
            .filter(|(_, (_, since))| now_i.duration_since(*since) >= outage::SILENT_HELP_MAX)
            .map(|(f, _)| *f)
            .collect();
        if !over.is_empty() {
            tracing::info!(
                connections = over.len(),
                "a silent host has not come back within the longest unasked help: its connections are left to their own timeouts"
            );
        }
        for f in over {
            self.outages.silent_help.remove(&f);
            self.end_helping(f, helping::End::Reopen).await;
        }
        let candidates: Vec<(VirtualFlow, [u8; 32])> = self
            .endpoint
            .connections()
            .filter(|f| f.proto == Proto::Tcp)
            .filter(|f| {
                !self.helpers.helping.contains_key(f)
                    && !self.helpers.keepalive_held.contains_key(f)
                    && !self.outages.own_timeouts.contains_key(f)
            })
            .filter_map(|f| self.endpoint.connection(f))
            .filter(|v| v.has_keys && !v.migrating)
            .filter_map(|v| Some((v.flow, v.peer_key?)))
            .collect();
        if candidates.is_empty() && !self.outages.silence.busy() {
            return;
        }
        let n = candidates.len();
        let start = if n == 0 { 0 } else { self.outages.turn % n };
        let looked: Vec<(VirtualFlow, [u8; 32])> = candidates
            .iter()
            .cycle()
            .skip(start)
            .take(n.min(SILENCE_LOOKS_MAX))
            .copied()
            .collect();
        self.outages.turn = start + looked.len();
        let waiting: HashSet<[u8; 32]> = with_dp(&self.dp, move |dp| {
            looked
                .into_iter()
                .filter(|(f, _)| {
                    let s = dp.peer_silence(f);
                    tracing::trace!(id = f.id(), flow = %f, silence = ?s, "does the socket wait for its peer");
                    matches!(s, Ok(PeerSilence::Unanswered))
                })
                .map(|(_, k)| k)
                .collect()
        })
        .await;
        for a in self.outages.silence.tick(now_i, &waiting) {
            self.silence_action(a).await;
        }
    }

    /// The peer of `flow` was heard from (it moved it): not silent.
    pub(super) async fn peer_heard(&mut self, flow: VirtualFlow) {
        if let Some(k) = self.endpoint.connection(&flow).and_then(|v| v.peer_key) {
            self.probe_answered(k).await;
        }
    }

    /// A probe to `key` was answered: the host is there.
    pub(super) async fn probe_answered(&mut self, key: [u8; 32]) {
        tracing::trace!(key = %identity::key_hex(&key), "a paired host answered a probe");
        if let Some(a) = self.outages.silence.answered(&key, Instant::now()) {
            self.silence_action(a).await;
        }
    }

    async fn silence_action(&mut self, a: Action) {
        match a {
            Action::Probe(k) => {
                tracing::debug!(key = %identity::key_hex(&k), "probing a paired host whose connections here wait for it");
                if !self.endpoint.probe_host(&k) {
                    self.outages.silence.forget(&k);
                }
            }
            Action::Silent(k) => {
                let now_i = Instant::now();
                if outage::heard_lately(self.endpoint.last_heard(&k), now()) {
                    // Its vnatd spoke lately, though not to our probes.
                    tracing::debug!(key = %identity::key_hex(&k), "a paired host left probes unanswered but sent records lately: not silent");
                    if let Some(Action::Back(k)) = self.outages.silence.answered(&k, now_i) {
                        self.silent_host_back(k).await;
                    }
                    return;
                }
                // A move with that host under way (ours, or its address
                // being validated here) is no silence: a host busy moving
                // thousands of connections answers late, and answering for
                // it then took every connection's socket from the move (at
                // 100,000, each side took the other for silent mid-move).
                // A host that is really gone ends the move itself (its
                // updates and validations give up), and is looked at then.
                let moving = self.endpoint.connections().any(|f| {
                    self.endpoint.connection(f).is_some_and(|v| {
                        v.peer_key == Some(k) && (v.migrating || v.pending_remote.is_some())
                    })
                });
                if moving {
                    tracing::debug!(key = %identity::key_hex(&k), "a paired host left probes unanswered during a move with it: not silent");
                    if let Some(Action::Back(k)) = self.outages.silence.answered(&k, now_i) {
                        self.silent_host_back(k).await;
                    }
                    return;
                }
                let flows: Vec<VirtualFlow> = self
                    .endpoint
                    .connections()
                    .filter(|f| f.proto == Proto::Tcp && !self.helpers.helping.contains_key(f))
                    .filter_map(|f| self.endpoint.connection(f))
                    .filter(|v| v.has_keys && v.peer_key == Some(k))
                    .map(|v| v.flow)
                    .collect();
                tracing::info!(key = %identity::key_hex(&k), connections = flows.len(),
                    "a paired host went silent (its connections' probes and a VCMP probe unanswered): answering for it with a zero window until it is back");
                let asked = Help {
                    zero_window: true,
                    ..Help::default()
                };
                let help = rules::allowed(&asked, &self.cfg.peer_helpers);
                if !help.zero_window {
                    tracing::info!(allowed = ?self.cfg.peer_helpers, "not answering for the silent host: zero-window is not among this host's helpers (peer_helpers)");
                    return;
                }
                // All of them in one go (`help_requested` for each would
                // write the restart record once per connection), as
                // `help_requested` does for one that nobody helps yet.
                let timeouts = self.hold_user_timeouts(&flows).await;
                for (f, user_timeout) in flows.into_iter().zip(timeouts) {
                    let mut h = Helping::new(help.clone(), now_i);
                    h.user_timeout = user_timeout;
                    self.helpers.helping.insert(f, h);
                    self.outages.silent_help.insert(f, (k, now_i));
                }
                self.helpers.next_help_answer = now_i;
            }
            Action::Back(k) => self.silent_host_back(k).await,
        }
    }

    /// The host `k` that was silent was heard from: the help its silence
    /// started ends.
    async fn silent_host_back(&mut self, k: [u8; 32]) {
        let back: Vec<VirtualFlow> = self
            .outages
            .silent_help
            .iter()
            .filter(|(_, (h, _))| *h == k)
            .map(|(f, _)| *f)
            .collect();
        if !back.is_empty() {
            tracing::info!(key = %identity::key_hex(&k), connections = back.len(),
                "the silent host answers again: help ends");
        }
        for f in back {
            self.outages.silent_help.remove(&f);
            self.end_helping(f, helping::End::Reopen).await;
        }
    }
}
