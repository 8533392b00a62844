//! The driver's side of what outlasts a restart of vnatd
//! (`daemon::restart_state`): the placements of `vnatctl migrate` and the
//! changes made to applications' sockets, written when they change (a
//! socket change before it is made), and the changes a vnatd that died
//! left, undone at start-up.

use super::*;
use crate::daemon::restart_state::{Hold, RestartState, Undo};

impl Driver {
    /// The changes this vnatd made to sockets and has not undone: held
    /// keepalives, TCP_USER_TIMEOUTs held for absent peers, for this
    /// host's own absence, or waiting to be given back, and the processes
    /// stopped for absent peers.
    fn socket_changes(&self) -> Vec<Hold> {
        let h = &self.helpers;
        let keepalives = h.keepalive_held.keys().map(|f| (*f, Undo::KeepaliveOn));
        let helped = h.helping.iter().filter_map(|(f, help)| {
            let before = help.user_timeout?;
            Some((
                *f,
                Undo::UserTimeout {
                    before: Some(before),
                },
            ))
        });
        let restoring = h.timeout_restore.iter().map(|(f, (before, _, _))| {
            (
                *f,
                Undo::UserTimeout {
                    before: Some(*before),
                },
            )
        });
        let own = self.outages.own_timeouts.iter().map(|(f, (before, _))| {
            (
                *f,
                Undo::UserTimeout {
                    before: Some(*before),
                },
            )
        });
        let stopped = h.helping.iter().filter_map(|(f, help)| {
            let s = help.stopped.as_ref()?;
            let (pid, start_time) = (s.pid, s.start_time);
            Some((*f, Undo::Continue { pid, start_time }))
        });
        keepalives
            .chain(helped)
            .chain(stopped)
            .chain(own)
            .chain(restoring)
            .filter_map(|(flow, undo)| self.hold_of(flow, undo))
            .collect()
    }

    fn hold_of(&self, flow: VirtualFlow, undo: Undo) -> Option<Hold> {
        Some(Hold {
            flow,
            cookie: self.tracking.cookie(&flow)?,
            undo,
        })
    }

    /// Write what must outlast this vnatd if it changed since the last
    /// write (once per loop turn; nothing is written while nothing
    /// changes).
    pub(super) fn save_restart_state(&mut self) {
        let holds = self.socket_changes();
        if let Err(e) = self.restart_state.save(self.tracking.placements(), holds) {
            tracing::warn!(error = %e, "cannot write what must outlast a restart of vnatd; tried again at the next change");
        }
    }

    /// Before changing sockets: record `changes` with everything else, so
    /// that a vnatd killed right after the change leaves the record for
    /// the next one. False (with a warning): not recorded, so the caller
    /// must not make the change.
    pub(super) fn record_before_change(
        &mut self,
        changes: impl IntoIterator<Item = (VirtualFlow, Undo)>,
    ) -> bool {
        let mut holds = self.socket_changes();
        holds.extend(changes.into_iter().filter_map(|(f, u)| self.hold_of(f, u)));
        match self.restart_state.save(self.tracking.placements(), holds) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "not changing the sockets' keepalive or timeout: vnatd cannot first record how to undo it after a crash");
                false
            }
        }
    }

    /// At start-up: give back to the sockets that still exist what a
    /// previous vnatd that died changed on them (keepalive turned off, a
    /// raised TCP_USER_TIMEOUT). A socket that is gone takes its record
    /// with it; a listing that fails leaves the records for the next turn.
    pub(super) async fn undo_left_changes(&mut self) {
        let left: Vec<Hold> = self.restart_state.left_holds().to_vec();
        if left.is_empty() {
            return;
        }
        // A stopped process goes on whatever became of its socket.
        let (procs, left): (Vec<Hold>, Vec<Hold>) = left
            .into_iter()
            .partition(|h| matches!(h.undo, Undo::Continue { .. }));
        for h in &procs {
            if let Undo::Continue { pid, start_time } = h.undo {
                if crate::daemon::restart_state::let_go_on(pid, start_time) {
                    tracing::info!(pid, id = h.flow.id(), flow = %h.flow, "let go on a process the previous vnatd stopped for an absent peer");
                }
            }
        }
        let n = left.len();
        let done = with_dp(&self.dp, move |dp| {
            let conns = match dp.connections_without_owners() {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot list connections to undo what the previous vnatd changed on their sockets; trying again");
                    return None;
                }
            };
            let live: HashMap<VirtualFlow, u64> = conns
                .iter()
                .map(|c| {
                    let f = VirtualFlow {
                        proto: c.proto,
                        local: c.virtual_local,
                        remote: c.virtual_remote,
                    };
                    (f, c.cookie)
                })
                .collect();
            let mut undone = 0usize;
            for h in &left {
                if live.get(&h.flow) != Some(&h.cookie) {
                    continue; // the socket is gone
                }
                let r = match h.undo {
                    Undo::KeepaliveOn => dp.hold_keepalive(&h.flow, false).map(|_| ()),
                    Undo::UserTimeout { before } => dp
                        .set_user_timeout(&h.flow, before.unwrap_or(0))
                        .map(|_| ()),
                    Undo::Continue { .. } => Ok(()),
                };
                match r {
                    Ok(()) => undone += 1,
                    Err(e) => {
                        tracing::warn!(id = h.flow.id(), flow = %h.flow, undo = ?h.undo, error = %e, "cannot undo what the previous vnatd changed on the connection's socket")
                    }
                }
            }
            Some(undone)
        })
        .await;
        let Some(undone) = done else {
            return;
        };
        tracing::info!(
            sockets = undone,
            left = n,
            "gave back to the sockets what the previous vnatd changed on them (keepalive, user timeout)"
        );
        self.restart_state.forget_left(|_| true);
        self.save_restart_state();
    }
}

/// The state file of `state_dir`, and the placements it holds handed to
/// `tracking` (applied when their connections are listed).
pub(super) fn load(
    state_dir: &std::path::Path,
    tracking: &mut crate::daemon::tracking::Tracking,
) -> RestartState {
    let mut s = RestartState::load(state_dir);
    tracking.restore_placements(s.take_left_placements());
    s
}
