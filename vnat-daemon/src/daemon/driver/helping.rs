//! The driver's side of the keep-alive helpers (see `daemon::helping`):
//! asking the peers at suspend and telling them the end is back, and
//! helping a peer that is away.

use super::*;
use crate::daemon::helping::{self, AfterAnswer, Helping};
use crate::datapath::PeerAnswer;
use crate::vcmp::help::Help;

impl Driver {
    /// When the loop must wake next for the helpers: the next answer for an
    /// absent peer, the next look at whether asked help can end.
    pub(super) fn next_helper_wake(&self) -> Option<std::time::Instant> {
        let answer = (!self.helping.is_empty()).then_some(self.next_help_answer);
        let asked = (!self.help_asked.is_empty()).then_some(self.next_keepalive_check);
        answer.into_iter().chain(asked).min()
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
                self.help_asked.insert(
                    *f,
                    mobility::HeldKeepalive {
                        since,
                        local_at_hold: v.local_phys,
                        resume_asked: false,
                    },
                );
            }
        }
        tracing::info!(connections = asked.len(), helpers = ?help.names(), "asked the peers for keep-alive helpers until the connections work again");
        asked
    }

    /// Tell the peers whose help this host asked for that it is back, once
    /// each connection works again (the keepalive hold's rule).
    pub(super) async fn end_asked_help(&mut self, addrs: &HashSet<IpAddr>) {
        let now_i = std::time::Instant::now();
        let back: Vec<VirtualFlow> = self
            .help_asked
            .iter()
            .filter(|(f, h)| match self.endpoint.connection(f) {
                Some(v) => {
                    mobility::keepalive_release_due(h, v.local_phys, v.migrating, addrs, now_i)
                }
                None => true,
            })
            .map(|(f, _)| *f)
            .collect();
        if back.is_empty() {
            return;
        }
        for f in &back {
            self.help_asked.remove(f);
        }
        let known: Vec<VirtualFlow> = back
            .into_iter()
            .filter(|f| self.endpoint.connection(f).is_some())
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
            self.end_helping(flow, true).await;
            return;
        }
        let help = helping::allowed(&asked, &self.cfg.peer_helpers);
        if help != asked {
            tracing::info!(%flow, asked = ?asked.names(), allowed = ?self.cfg.peer_helpers,
                "a peer asked for keep-alive helpers this host does not run (peer_helpers); running only the allowed ones");
        }
        if help.is_none() {
            return;
        }
        if self.helping.get(&flow).is_some_and(|h| h.help == help) {
            return; // a retransmission
        }
        self.end_helping(flow, false).await;
        let mut h = Helping::new(help.clone(), std::time::Instant::now());
        if help.stop {
            h.stopped = self.stop_processes(&flow).await;
        }
        tracing::info!(%flow, helpers = ?help.names(), stopped = ?h.stopped, "helping a peer that is away");
        self.helping.insert(flow, h);
        self.next_help_answer = std::time::Instant::now();
    }

    /// Answer for the absent peers (zero-window), at most every
    /// [`helping::ANSWER_EVERY`], and end what is over.
    pub(super) async fn answer_for_absent_peers(&mut self) {
        if self.helping.is_empty() || std::time::Instant::now() < self.next_help_answer {
            return;
        }
        self.next_help_answer = std::time::Instant::now() + helping::ANSWER_EVERY;
        let now_i = std::time::Instant::now();
        let expired: Vec<VirtualFlow> = self
            .helping
            .iter()
            .filter(|(_, h)| h.expired(now_i))
            .map(|(f, _)| *f)
            .collect();
        for f in expired {
            tracing::info!(flow = %f, "the peer has been away for the longest help; ending it");
            self.end_helping(f, true).await;
        }
        let due: Vec<(VirtualFlow, (u64, u64))> = self
            .helping
            .iter()
            .filter(|(_, h)| h.help.zero_window)
            .map(|(f, h)| (*f, h.deliver_if_still_at()))
            .collect();
        if due.is_empty() {
            return;
        }
        let answers = with_dp(&self.dp, move |dp| {
            due.into_iter()
                .map(|(f, last)| (f, dp.answer_for_peer(&f, 0, Some(last))))
                .collect::<Vec<_>>()
        })
        .await;
        for (f, a) in answers {
            let a = match a {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(flow = %f, error = %e, "cannot answer for the absent peer");
                    continue;
                }
            };
            let Some(h) = self.helping.get_mut(&f) else {
                continue;
            };
            match h.answered(a) {
                AfterAnswer::Keep => {}
                AfterAnswer::PeerBack => {
                    tracing::info!(flow = %f, "the absent peer is heard from again; help ends");
                    self.end_helping(f, false).await;
                }
                AfterAnswer::Gone => {
                    self.end_helping(f, false).await;
                }
            }
        }
    }

    /// End the help for `flow`, if any: reopen the window (`reopen`: the
    /// end is back by its word or by a move, and may not have sent anything
    /// yet) and restart the socket's timers, and let stopped processes go
    /// on.
    pub(super) async fn end_helping(&mut self, flow: VirtualFlow, reopen: bool) {
        let Some(h) = self.helping.remove(&flow) else {
            return;
        };
        if h.help.zero_window && reopen {
            let window = h.reopen_window();
            let r = with_dp(&self.dp, move |dp| {
                let a = dp.answer_for_peer(&flow, window, None)?;
                if a == PeerAnswer::Gone {
                    return Ok(a);
                }
                dp.restart_flow(&flow)?;
                Ok::<_, crate::datapath::DatapathError>(a)
            })
            .await;
            if let Err(e) = r {
                tracing::warn!(%flow, error = %e, "cannot reopen the window of a helped connection");
            }
        }
        for pid in &h.stopped {
            signal(*pid, libc::SIGCONT);
        }
        tracing::info!(%flow, helpers = ?h.help.names(), "stopped helping: the peer is back or the connection is over");
    }

    /// The "stop" helper: SIGSTOP the local process of `flow` (the one the
    /// datapath lists as its owner), never vnatd itself or init.
    async fn stop_processes(&mut self, flow: &VirtualFlow) -> Vec<u32> {
        let flow = *flow;
        let pid = with_dp(&self.dp, move |dp| {
            dp.connections().ok()?.into_iter().find_map(|c| {
                (c.proto == flow.proto
                    && c.virtual_local == flow.local
                    && c.virtual_remote == flow.remote)
                    .then_some(c.pid)
                    .flatten()
            })
        })
        .await;
        match pid {
            Some(p) if p > 1 && p != std::process::id() => {
                signal(p, libc::SIGSTOP);
                vec![p]
            }
            _ => {
                tracing::info!(%flow, "no local process to stop for the absent peer");
                Vec::new()
            }
        }
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill takes no pointers; a pid that is gone only makes it fail.
    if unsafe { libc::kill(p, sig) } < 0 {
        tracing::debug!(pid, sig, error = %std::io::Error::last_os_error(), "cannot signal a helped connection's process");
    }
}
