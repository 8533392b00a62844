//! The driver's side of the keep-alive helpers (see `daemon::helping`):
//! asking the peers at suspend and telling them the end is back, and
//! helping a peer that is away.

use super::*;
use crate::daemon::helping::{self, AfterAnswer, Helping};
use crate::datapath::PeerAnswer;
use crate::vcmp::help::Help;
use std::sync::atomic::Ordering;

/// Runs of an installed helper that may wait per connection.
const MAX_QUEUED_RUNS: usize = 4;
/// Installed helpers running at once.
pub(super) const HELPER_SLOTS: usize = 4;

/// A TCP_USER_TIMEOUT held for a helped peer or for this host's own
/// outage: the value to give back; the bytes the peer had acknowledged by
/// the help's last look, or when this host's connection was found working
/// again (`None`: read at the first look after); since when. The value goes
/// back once the peer acknowledges more: the retransmissions of the
/// absence then count from anew. Never a baseline from before the absence:
/// acknowledgments that came before it (a suspend precedes the departure)
/// would give the value back while the absence's data is still
/// unacknowledged.
type HeldTimeout = (u32, Option<u64>, std::time::Instant);

/// The bytes `flow`'s peer has acknowledged so far (`None`: no such TCP
/// socket, or it cannot be read).
pub(super) fn acked_now(dp: &mut dyn Datapath, flow: &VirtualFlow) -> Option<u64> {
    match dp.answer_for_peer(flow, 0, Some(helping::READ_ONLY)) {
        Ok(PeerAnswer::PeerActive { counters }) => Some(counters.0),
        _ => None,
    }
}

/// The driver's helper state: keepalives held at suspend, the helpers
/// asked of the peers and those this host gives them, installed helpers'
/// runs, and the requests waiting for the peers' confirmations.
pub(super) struct Helpers {
    /// Suspended connections whose keepalive vnatd turned off until they
    /// work again (`Datapath::hold_keepalive`,
    /// `mobility::keepalive_release_due`).
    pub(super) keepalive_held: HashMap<VirtualFlow, mobility::HeldKeepalive>,
    /// When held keepalives are next looked at.
    pub(super) next_keepalive_check: std::time::Instant,
    /// Connections whose peers this host asked for keep-alive helpers at
    /// suspend, until they work again (`daemon::helping`).
    pub(super) help_asked: HashMap<VirtualFlow, (mobility::HeldKeepalive, crate::vcmp::help::Help)>,
    /// Connections whose absent peer this host helps.
    pub(super) helping: HashMap<VirtualFlow, Helping>,
    /// When the absent peers are next answered for.
    pub(super) next_help_answer: std::time::Instant,
    /// TCP_USER_TIMEOUTs held for helped peers, to give back: (the value,
    /// the bytes acknowledged when first looked at, since when).
    pub(super) timeout_restore: HashMap<VirtualFlow, HeldTimeout>,
    /// Installed helpers' runs per connection, and the slots they share.
    pub(super) helper_runs: HashMap<VirtualFlow, HelperQueue>,
    pub(super) helper_slots: std::sync::Arc<tokio::sync::Semaphore>,
    /// `AskHelp` requests waiting for their peers' confirmations: the
    /// flows asked, until when, where the answer goes.
    pub(super) help_waits: Vec<HelpWait>,
}

impl Helpers {
    pub(super) fn new() -> Helpers {
        let now = std::time::Instant::now();
        Helpers {
            keepalive_held: HashMap::new(),
            next_keepalive_check: now,
            help_asked: HashMap::new(),
            helping: HashMap::new(),
            next_help_answer: now,
            timeout_restore: HashMap::new(),
            helper_runs: HashMap::new(),
            helper_slots: std::sync::Arc::new(tokio::sync::Semaphore::new(HELPER_SLOTS)),
            help_waits: Vec::new(),
        }
    }
}

/// An `AskHelp` waiting for its peers' confirmations.
pub(super) struct HelpWait {
    asked: Vec<VirtualFlow>,
    until: std::time::Instant,
    reply: tokio::sync::oneshot::Sender<(Vec<VirtualFlow>, Vec<VirtualFlow>)>,
}

/// The runs of one connection's installed helper, one at a time.
#[derive(Clone, Default)]
pub(super) struct HelperQueue {
    lock: std::sync::Arc<tokio::sync::Mutex<()>>,
    pending: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}
use std::os::fd::FromRawFd;

impl Driver {
    /// When the loop must wake next for the helpers: the next answer for an
    /// absent peer, the next look at whether asked help can end.
    pub(super) fn next_helper_wake(&self) -> Option<std::time::Instant> {
        let answer = (!self.helpers.helping.is_empty() || !self.helpers.timeout_restore.is_empty())
            .then_some(self.helpers.next_help_answer);
        let asked =
            (!self.helpers.help_asked.is_empty()).then_some(self.helpers.next_keepalive_check);
        let waits = self.helpers.help_waits.iter().map(|w| w.until).min();
        let holds = self
            .helpers
            .helping
            .values()
            .filter_map(|h| h.held_until)
            .min();
        answer
            .into_iter()
            .chain(asked)
            .chain(waits)
            .chain(holds)
            .chain(self.next_answer_wake())
            .min()
    }

    /// `AskHelp`: ask the peers of `flows` for `help` (empty: this host is
    /// back), without the suspend's keepalive hold or the back-when-working
    /// rule (what is asked ends with a move, the peer's limits, or an empty
    /// request); answer once every peer confirmed or after `wait`.
    pub(super) fn ask_help_now(
        &mut self,
        flows: &[VirtualFlow],
        help: &Help,
        wait: std::time::Duration,
        reply: tokio::sync::oneshot::Sender<(Vec<VirtualFlow>, Vec<VirtualFlow>)>,
    ) {
        let asked: Vec<VirtualFlow> = flows
            .iter()
            .filter(|f| self.endpoint.connection(f).is_some_and(|v| v.has_keys))
            .copied()
            .collect();
        let asked = match self.endpoint.request_help(now(), &mut OsRng, &asked, help) {
            Ok(_) => asked,
            Err(e) => {
                tracing::warn!(error = %e, "cannot ask the peers for helpers");
                Vec::new()
            }
        };
        if help.is_none() {
            // Back: nothing of ours is asked of them any more.
            for f in &asked {
                self.helpers.help_asked.remove(f);
            }
        }
        tracing::info!(connections = asked.len(), helpers = ?help.names(), "asked the peers for keep-alive helpers");
        self.helpers.help_waits.push(HelpWait {
            asked,
            until: std::time::Instant::now() + wait,
            reply,
        });
        self.answer_help_waits();
    }

    /// Answer the `AskHelp` requests whose peers all confirmed, or whose
    /// wait is over.
    pub(super) fn answer_help_waits(&mut self) {
        if self.helpers.help_waits.is_empty() {
            return;
        }
        let now_i = std::time::Instant::now();
        let waits = std::mem::take(&mut self.helpers.help_waits);
        for w in waits {
            let confirmed: Vec<VirtualFlow> = w
                .asked
                .iter()
                .filter(|f| self.endpoint.help_confirmed(f))
                .copied()
                .collect();
            if confirmed.len() == w.asked.len() || now_i >= w.until || w.reply.is_closed() {
                let _ = w.reply.send((w.asked, confirmed));
            } else {
                self.helpers.help_waits.push(w);
            }
        }
    }

    /// At suspend: ask the peers of `flows` for `help`; the ones with keys
    /// are asked and returned.
    pub(super) fn ask_help(&mut self, flows: &[VirtualFlow], help: &Help) -> Vec<VirtualFlow> {
        let asked: Vec<VirtualFlow> = flows
            .iter()
            .filter(|f| self.endpoint.connection(f).is_some_and(|v| v.has_keys))
            .copied()
            .collect();
        if asked.is_empty() {
            return asked;
        }
        if let Err(e) = self.endpoint.request_help(now(), &mut OsRng, &asked, help) {
            tracing::warn!(error = %e, "cannot ask the peers for helpers");
            return Vec::new();
        }
        let since = std::time::Instant::now();
        for f in &asked {
            if let Some(v) = self.endpoint.connection(f) {
                self.helpers.help_asked.insert(
                    *f,
                    (
                        mobility::HeldKeepalive {
                            since,
                            local_at_hold: v.local_phys,
                            resume_asked: false,
                        },
                        help.clone(),
                    ),
                );
            }
        }
        tracing::info!(connections = asked.len(), helpers = ?help.names(), "asked the peers for keep-alive helpers until the connections work again");
        asked
    }

    /// Tell the peers whose help this host asked for that it is back, once
    /// each connection works again (the keepalive hold's rule).
    pub(super) async fn end_asked_help(
        &mut self,
        addrs: &HashSet<IpAddr>,
        routed: &HashSet<IpAddr>,
    ) {
        let now_i = std::time::Instant::now();
        let back: Vec<VirtualFlow> = self
            .helpers
            .help_asked
            .iter()
            .filter(|(f, (h, _))| match self.endpoint.connection(f) {
                Some(v) => {
                    let to_peer = routed.contains(&v.remote_phys.ip());
                    mobility::keepalive_release_due(
                        h,
                        v.local_phys,
                        v.migrating,
                        addrs,
                        to_peer,
                        now_i,
                    )
                }
                None => true,
            })
            .map(|(f, _)| *f)
            .collect();
        if back.is_empty() {
            return;
        }
        for f in &back {
            self.helpers.help_asked.remove(f);
        }
        let known: Vec<VirtualFlow> = back
            .into_iter()
            .filter(|f| self.endpoint.has_connection(f))
            .collect();
        if let Err(e) = self
            .endpoint
            .request_help(now(), &mut OsRng, &known, &Help::default())
        {
            tracing::debug!(error = %e, "cannot tell the peers the connections are back");
        } else if !known.is_empty() {
            tracing::info!(
                connections = known.len(),
                "told the peers the connections work again: their helpers end"
            );
        }
    }

    /// A peer asks for help with `flow` while it is away (or, with an empty
    /// request, says it is back).
    pub(super) async fn help_requested(&mut self, flow: VirtualFlow, asked: Help) {
        if asked.is_none() {
            self.end_helping(flow, End::Reopen).await;
            return;
        }
        let help = helping::allowed(&asked, &self.cfg.peer_helpers);
        if help != asked {
            tracing::info!(id = flow.id(), %flow, asked = ?asked.names(), allowed = ?self.cfg.peer_helpers,
                "a peer asked for keep-alive helpers this host does not run (peer_helpers); running only the allowed ones");
        }
        if self
            .helpers
            .helping
            .get(&flow)
            .is_some_and(|h| h.help == help)
        {
            return; // a retransmission
        }
        let now_i = std::time::Instant::now();
        // A changed request keeps the help's age (the 24 h limit holds
        // whatever a peer asks) and what it stopped.
        let old = self.helpers.helping.remove(&flow);
        // A request without zero-window any more: the socket must not be
        // left with the zero window we delivered.
        if let Some(o) = old.as_ref().filter(|o| o.help.zero_window && o.quiet) {
            if !help.zero_window {
                self.restart_socket(flow, o.reopen_window()).await;
            }
        }
        let kept = old
            .as_ref()
            .filter(|o| o.help.zero_window && help.zero_window)
            .map(|o| (o.quiet, o.peer_window, o.counters));
        let old_user = old.as_ref().and_then(|o| o.help.user.clone());
        let old_held = old.as_ref().and_then(|o| o.held_until);
        // "hold": the connection's packets stay in its socket until the
        // peer is back or has moved (or the limit), also when this request
        // ends every other help.
        // Only a TCP socket keeps what it could not send (a UDP socket's
        // held datagrams would be lost); and only where tc is attached to
        // every interface (`standby_tc`): a connection that never moved
        // has no translator on its interface otherwise.
        let can_hold = flow.proto == crate::datapath::Proto::Tcp && self.cfg.standby_tc;
        if help.hold && !can_hold && old_held.is_none() {
            tracing::info!(id = flow.id(), %flow, standby_tc = self.cfg.standby_tc, "not holding a connection's packets for its peer: only TCP connections, and only with standby_tc on");
        }
        let held_until = match (help.hold && can_hold, old_held) {
            (true, Some(t)) => Some(t),
            (true, None) => self
                .hold_for_peer(flow, true)
                .await
                .then(|| now_i + helping::hold_limit(tcp_retries2())),
            (false, Some(_)) => {
                self.hold_for_peer(flow, false).await;
                None
            }
            (false, None) => None,
        };
        // The bytes acknowledged at the last look: a timeout given back
        // below waits for the peer to acknowledge more.
        let old_acked = old.as_ref().and_then(|o| o.counters).map(|c| c.0);
        let (since, mut stopped, mut old_timeout) = match old {
            Some(old) => (old.since, old.stopped, old.user_timeout),
            None => (now_i, None, None),
        };
        if !help.zero_window {
            if let Some(prev) = old_timeout.take() {
                self.helpers
                    .timeout_restore
                    .insert(flow, (prev, old_acked, std::time::Instant::now()));
            }
        }
        let user_before = old_user;
        if help.user != user_before {
            if let Some(name) = &user_before {
                self.run_user_helper(flow, name, "back").await;
            }
            if let Some(name) = &help.user {
                self.run_user_helper(flow, name, "away").await;
            }
        }
        if help.is_none() {
            if let Some(s) = stopped.take() {
                resume_process(&s);
            }
            return;
        }
        if help.stop && stopped.is_none() {
            stopped = self.stop_process(&flow).await;
        } else if !help.stop {
            if let Some(s) = stopped.take() {
                resume_process(&s);
            }
        }
        let mut h = Helping::new(help.clone(), since);
        h.stopped = stopped;
        h.user_timeout = old_timeout;
        h.held_until = held_until;
        if help.zero_window && h.user_timeout.is_none() {
            h.user_timeout = self.hold_user_timeouts(&[flow]).await[0];
        }
        if let Some((quiet, peer_window, counters)) = kept {
            (h.quiet, h.peer_window, h.counters) = (quiet, peer_window, counters);
        }
        tracing::info!(id = flow.id(), %flow, helpers = ?help.names(), stopped = ?h.stopped.as_ref().map(|s| s.pid), "helping a peer that is away");
        self.helpers.helping.insert(flow, h);
        self.helpers.next_help_answer = now_i;
    }

    /// Raise the retransmission timeout of `flows`' sockets for an absent
    /// peer (zero-window help); for each, the value to give back later
    /// (`Helping::user_timeout`). One record on disk of how to undo them
    /// all, before any socket changes (see `restart_state`), and one trip
    /// to the datapath: the record is the whole file, so one write per
    /// connection cost a silent host's 100,000 connections minutes of the
    /// driver's loop.
    pub(super) async fn hold_user_timeouts(&mut self, flows: &[VirtualFlow]) -> Vec<Option<u32>> {
        // Given back by a restore still pending? Then that value.
        let pending: Vec<Option<u32>> = flows
            .iter()
            .map(|f| self.helpers.timeout_restore.remove(f).map(|r| r.0))
            .collect();
        let undo = flows.iter().zip(&pending).map(|(f, before)| {
            (
                *f,
                crate::daemon::restart_state::Undo::UserTimeout { before: *before },
            )
        });
        if !self.record_before_change(undo) {
            return pending;
        }
        let asked = flows.to_vec();
        let results = with_dp(&self.dp, move |dp| {
            asked
                .iter()
                .map(|f| dp.set_user_timeout(f, helping::USER_TIMEOUT_HOLD))
                .collect::<Vec<_>>()
        })
        .await;
        flows
            .iter()
            .zip(pending)
            .zip(results)
            .map(|((flow, pending), r)| match r {
                Ok(prev) => pending.or(prev),
                Err(e) => {
                    tracing::warn!(id = flow.id(), %flow, error = %e, "cannot hold the socket's retransmission timeout for the absent peer");
                    pending
                }
            })
            .collect()
    }

    /// Answer for the absent peers (zero-window) at most every
    /// [`helping::ANSWER_EVERY`], look at the others' sockets, and end
    /// what is over.
    pub(super) async fn answer_for_absent_peers(&mut self) {
        // Holds end at their limit to the moment, not at the next answer:
        // the limit keeps the socket short of giving up.
        let now_i = std::time::Instant::now();
        let overdue: Vec<VirtualFlow> = self
            .helpers
            .helping
            .iter()
            .filter(|(_, h)| h.hold_overdue(now_i))
            .map(|(f, _)| *f)
            .collect();
        for f in overdue {
            tracing::info!(id = f.id(), flow = %f, "the peer is not back within the hold's limit; the connection's packets leave again");
            if !self.hold_for_peer(f, false).await {
                // Tried again in a while (not at once: the loop would spin).
                if let Some(h) = self.helpers.helping.get_mut(&f) {
                    h.held_until = Some(now_i + helping::ANSWER_EVERY);
                }
                continue;
            }
            // Spent: a new request for hold may arm it again; this one
            // is over (and so is the help, if it asked for nothing else).
            let nothing_left = self.helpers.helping.get_mut(&f).is_some_and(|h| {
                h.held_until = None;
                h.help.hold = false;
                h.help.is_none()
            });
            if nothing_left {
                self.end_helping(f, End::Restart).await;
            }
        }
        if (self.helpers.helping.is_empty() && self.helpers.timeout_restore.is_empty())
            || std::time::Instant::now() < self.helpers.next_help_answer
        {
            return;
        }
        self.helpers.next_help_answer = std::time::Instant::now() + helping::ANSWER_EVERY;
        self.give_back_user_timeouts().await;
        let now_i = std::time::Instant::now();
        let expired: Vec<VirtualFlow> = self
            .helpers
            .helping
            .iter()
            .filter(|(_, h)| h.expired(now_i))
            .map(|(f, _)| *f)
            .collect();
        for f in expired {
            tracing::info!(id = f.id(), flow = %f, "the peer has been away for the longest help; ending it");
            self.end_helping(f, End::Reopen).await;
        }
        // Zero-window: an answer where the peer stayed quiet; otherwise a
        // reading, to notice the connection closing.
        let due: Vec<(VirtualFlow, (u64, u64))> = self
            .helpers
            .helping
            .iter()
            .map(|(f, h)| {
                let at = if h.help.zero_window {
                    h.deliver_if_still_at()
                } else {
                    helping::READ_ONLY
                };
                (*f, at)
            })
            .collect();
        let answers = with_dp(&self.dp, move |dp| {
            due.into_iter()
                .map(|(f, at)| (f, dp.answer_for_peer(&f, 0, Some(at))))
                .collect::<Vec<_>>()
        })
        .await;
        for (f, a) in answers {
            let a = match a {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(id = f.id(), flow = %f, error = %e, "cannot answer for the absent peer");
                    continue;
                }
            };
            let Some(h) = self.helpers.helping.get_mut(&f) else {
                continue;
            };
            if !h.help.zero_window {
                if a == PeerAnswer::Gone {
                    self.end_helping(f, End::Quiet).await;
                }
                continue;
            }
            match h.answered(a) {
                AfterAnswer::Keep => {}
                AfterAnswer::PeerBack => {
                    tracing::info!(id = f.id(), flow = %f, "the absent peer is heard from again; help ends");
                    self.end_helping(f, End::Restart).await;
                }
                AfterAnswer::NotTaken => {
                    tracing::warn!(id = f.id(), flow = %f, "the socket sees an open window again although nothing moved: the peer is back, or the zero-window answers do not take here; help ends");
                    self.end_helping(f, End::Restart).await;
                }
                AfterAnswer::Gone => {
                    self.end_helping(f, End::Quiet).await;
                }
            }
        }
    }

    /// End the help for `flow`, if any, and let a stopped process go on.
    /// `End::Reopen`: the end is back by its word or by a move and may not
    /// have sent anything yet: deliver the window it last advertised (if a
    /// zero one was delivered and nothing is in flight, see
    /// `PeerAnswer::Retransmitting`) and restart the socket's timers;
    /// `End::Restart`: it was heard from (the window is its own): restart
    /// the timers only; `End::Quiet`: the connection is over.
    pub(super) async fn end_helping(&mut self, flow: VirtualFlow, how: End) {
        let Some(h) = self.helpers.helping.remove(&flow) else {
            return;
        };
        let reopen = match how {
            End::Reopen => h.reopen_window(),
            End::Restart | End::Quiet => None,
        };
        if h.help.zero_window && h.quiet && how != End::Quiet {
            self.restart_socket(flow, reopen).await;
        }
        if let Some(s) = &h.stopped {
            resume_process(s);
        }
        if h.held_until.is_some() {
            // After a move, installing the translation released it already.
            self.hold_for_peer(flow, false).await;
        }
        if let Some(name) = &h.help.user {
            self.run_user_helper(flow, name, "back").await;
        }
        if let Some(prev) = h.user_timeout.filter(|_| how != End::Quiet) {
            // Given back once the peer acknowledges data beyond what it had
            // at the help's last look. (Read at the first look after the
            // help instead, the baseline would miss every acknowledgment
            // that came before that look: a connection with nothing more to
            // send kept the held value for USER_TIMEOUT_GIVE_BACK.)
            let acked = h.counters.map(|c| c.0);
            self.helpers
                .timeout_restore
                .insert(flow, (prev, acked, std::time::Instant::now()));
        }
        tracing::info!(id = flow.id(), %flow, helpers = ?h.help.names(), "stopped helping: the peer is back or the connection is over");
    }

    /// Give the held TCP_USER_TIMEOUTs back once their peer has
    /// acknowledged data since the help ended (its retransmissions then
    /// count from anew), or after [`helping::USER_TIMEOUT_GIVE_BACK`].
    async fn give_back_user_timeouts(&mut self) {
        if self.helpers.timeout_restore.is_empty() {
            return;
        }
        let pending: Vec<(VirtualFlow, HeldTimeout)> = self
            .helpers
            .timeout_restore
            .iter()
            .map(|(f, r)| (*f, *r))
            .collect();
        let done = with_dp(&self.dp, move |dp| {
            let mut out = Vec::new();
            for (f, (prev, acked, since)) in pending {
                let now_acked = match dp.answer_for_peer(&f, 0, Some(helping::READ_ONLY)) {
                    Ok(PeerAnswer::PeerActive { counters }) => counters.0,
                    Ok(_) => {
                        out.push((f, None)); // gone
                        continue;
                    }
                    Err(_) => continue,
                };
                let due = acked.is_some_and(|a| now_acked > a)
                    || since.elapsed() >= helping::USER_TIMEOUT_GIVE_BACK;
                if due {
                    let _ = dp.set_user_timeout(&f, prev);
                    out.push((f, None));
                } else if acked.is_none() {
                    out.push((f, Some(now_acked)));
                }
            }
            out
        })
        .await;
        for (f, baseline) in done {
            match baseline {
                None => {
                    self.helpers.timeout_restore.remove(&f);
                }
                Some(a) => {
                    if let Some(r) = self.helpers.timeout_restore.get_mut(&f) {
                        r.1 = Some(a);
                    }
                }
            }
        }
    }

    /// Run the installed helper `name` for `event` on `flow` (see
    /// `daemon::userhelper`), in a thread of its own: the driver does not
    /// wait for it.
    async fn run_user_helper(&mut self, flow: VirtualFlow, name: &str, event: &'static str) {
        let path = match crate::daemon::userhelper::executable(&self.cfg.helpers_dir, name) {
            Ok(p) => p,
            Err(why) => {
                tracing::warn!(id = flow.id(), %flow, helper = name, "not running the installed helper: {why}");
                return;
            }
        };
        let socket = match with_dp(&self.dp, move |dp| dp.connection_socket(&flow)).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(id = flow.id(), %flow, error = %e, "cannot give the helper its connection's socket");
                None
            }
        };
        let name = name.to_string();
        // One run at a time per connection, in order (away before back),
        // a few queued at most, and a few at once overall: a peer that
        // keeps changing its request cannot make vnatd spawn without end.
        let q = self.helpers.helper_runs.entry(flow).or_default().clone();
        if q.pending.load(Ordering::Relaxed) >= MAX_QUEUED_RUNS {
            tracing::warn!(id = flow.id(), %flow, helper = %name, event, "not running the installed helper: too many runs of it are waiting");
            return;
        }
        q.pending.fetch_add(1, Ordering::Relaxed);
        let slots = self.helpers.helper_slots.clone();
        tokio::spawn(async move {
            let _order = q.lock.lock().await;
            let Ok(_slot) = slots.acquire_owned().await else {
                return;
            };
            let run = tokio::task::spawn_blocking(move || {
                crate::daemon::userhelper::run(&path, event, &flow, socket)
            })
            .await;
            match run {
                Ok(Ok(status)) => {
                    tracing::info!(id = flow.id(), %flow, helper = %name, event, %status, "installed helper ran")
                }
                Ok(Err(e)) => {
                    tracing::warn!(id = flow.id(), %flow, helper = %name, event, error = %e, "installed helper failed")
                }
                Err(e) => {
                    tracing::warn!(id = flow.id(), %flow, helper = %name, error = %e, "installed helper task failed")
                }
            }
            q.pending.fetch_sub(1, Ordering::Relaxed);
        });
    }

    /// Hold (or release) `flow`'s packets for its peer ("hold"): whether
    /// that took. A release leaves a hold of this host's own move alone
    /// (the two share the datapath's flag), and restarts the socket, whose
    /// sends failed while held.
    async fn hold_for_peer(&mut self, flow: VirtualFlow, on: bool) -> bool {
        if !on && self.mover.holding(&flow) {
            return true;
        }
        // The datapath ends the hold by itself at the helper's limit too.
        let limit = crate::daemon::helping::hold_limit(tcp_retries2());
        let r = with_dp(&self.dp, move |dp| {
            if on {
                dp.hold_send_side_for(&flow, limit)?;
            } else {
                dp.hold_send_side(&flow, false)?;
            }
            if !on {
                crate::daemon::moveops::restart_one(dp, flow, false, false);
            }
            Ok::<(), crate::datapath::DatapathError>(())
        })
        .await;
        match r {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(id = flow.id(), %flow, hold = on, error = %e, "cannot hold or release the connection's packets for its peer");
                false
            }
        }
    }

    /// After zero-window answers: deliver `reopen` as the peer's window if
    /// given (see `PeerAnswer::Retransmitting`), and restart the socket's
    /// timers.
    async fn restart_socket(&mut self, flow: VirtualFlow, reopen: Option<u32>) {
        let r = with_dp(&self.dp, move |dp| {
            if let Some(window) = reopen {
                if dp.answer_for_peer(&flow, window, None)? == PeerAnswer::Gone {
                    return Ok(());
                }
            }
            dp.restart_flow(&flow).map(|_| ())
        })
        .await;
        if let Err(e) = r {
            tracing::warn!(id = flow.id(), %flow, error = %e, "cannot restart a helped connection's socket");
        }
    }

    /// The "stop" helper: SIGSTOP the local process of `flow` (the one that
    /// holds its socket now, `Datapath::socket_holder`) through a pidfd
    /// kept for the SIGCONT. Not a process that serves other recorded
    /// connections too (a server process of many clients), nor init or
    /// vnatd, nor a UDP flow's. The holder is looked up again once the
    /// pidfd is open: a process that took the pid in between holds no such
    /// socket, and the pidfd of one that died refuses the signal.
    async fn stop_process(&mut self, flow: &VirtualFlow) -> Option<helping::Stopped> {
        let flow = *flow;
        if flow.proto != crate::datapath::Proto::Tcp {
            return None;
        }
        let holder =
            move |dp: &mut dyn crate::datapath::Datapath| dp.socket_holder(&flow).ok().flatten();
        let (pid, others) = with_dp(&self.dp, move |dp| {
            let pid = holder(dp)?;
            let all = dp.connections().ok()?;
            let others = all
                .iter()
                .filter(|c| c.pid == Some(pid))
                .filter(|c| {
                    !(c.proto == flow.proto
                        && c.virtual_local == flow.local
                        && c.virtual_remote == flow.remote)
                })
                .count();
            Some((pid, others))
        })
        .await?;
        if pid <= 1 || pid == std::process::id() {
            return None;
        }
        if others > 0 {
            tracing::info!(id = flow.id(), %flow, pid, others, "not stopping a process that serves other connections too");
            return None;
        }
        let Ok(p) = libc::pid_t::try_from(pid) else {
            return None;
        };
        // SAFETY: pidfd_open takes no pointers; the result is owned at once
        // below or is -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, p, 0) };
        if fd < 0 {
            return None;
        }
        // SAFETY: `fd` is the fresh descriptor pidfd_open just returned.
        let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as libc::c_int) };
        if with_dp(&self.dp, move |dp| holder(dp)).await != Some(pid) {
            tracing::info!(id = flow.id(), %flow, pid, "not stopping: the process no longer holds the connection's socket");
            return None;
        }
        // On disk before the process stops (see `restart_state`): a vnatd
        // killed meanwhile leaves the next one the process to let go on.
        let start_time = crate::daemon::restart_state::start_time(pid)?;
        let undo = crate::daemon::restart_state::Undo::Continue { pid, start_time };
        if !self.record_before_change([(flow, undo)]) {
            return None;
        }
        let s = helping::Stopped {
            pid,
            pidfd,
            start_time,
        };
        if !send_signal(&s, libc::SIGSTOP) {
            return None;
        }
        Some(s)
    }
}

/// This namespace's `net.ipv4.tcp_retries2` (15, the kernel's default,
/// if it cannot be read).
fn tcp_retries2() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_retries2")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(15)
}

/// How a help ends (see [`Driver::end_helping`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum End {
    Reopen,
    Restart,
    Quiet,
}

fn resume_process(s: &helping::Stopped) {
    send_signal(s, libc::SIGCONT);
}

/// `sig` to the process of `s`, through its pidfd: never to another
/// process that took its pid meanwhile.
fn send_signal(s: &helping::Stopped, sig: libc::c_int) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal reads no memory here (a null siginfo);
    // the pidfd is open (owned by `s`).
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            s.pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r < 0 {
        tracing::debug!(pid = s.pid, sig, error = %std::io::Error::last_os_error(), "cannot signal a helped connection's process");
    }
    r == 0
}
