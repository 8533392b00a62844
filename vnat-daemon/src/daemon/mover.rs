//! The move choreography, without I/O (DESIGN.md section 3; STYLE.md, the
//! sans-IO core and its driver): what the datapath must do, and in which
//! order, for the core's events and the address watch's moves. The driver
//! asks it, runs what it returns against the datapath in one trip (with
//! `super::moveops`, which does each step's datapath work in the rule's
//! order), and reports the outcome back; every decision and every piece of
//! move bookkeeping is here, unit-tested with the fake datapath without
//! root.
//!
//! The rule it keeps: no kernel ever sees an untranslated packet for a
//! socket it lacks. So a receive side is prepared before anyone may send to
//! it (the peer's announced address, before the core's UPD_R and RESPONSE
//! leave; our own new address, before our UPD leaves), a moving TCP
//! connection (or a UDP flow through a NAT) is held until the peer sends
//! to its new address, and a send side switches only to a validated pair.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use super::mobility::{self, Move};
use crate::datapath::{DatapathError, Proto, Translation, VirtualFlow};
use crate::vcmp::{ConnectionView, Event};

/// Longest a moving connection's send side is held (its packets dropped).
/// A socket whose sends keep failing locally probes every 500 ms and the
/// kernel gives up on it after some seconds (seen as aborts in a
/// 100,000-connection move whose exchange took 15 s): after this, its
/// packets leave untranslated until its move completes, which puts them
/// into vnat's sink while the old address is only on `lo`
/// (`vnat_common::MAP_GONE`): sent and lost, as on a link that went dark.
pub const HOLD_LIMIT: Duration = Duration::from_secs(2);

/// One connection's send side switched to (local, remote) physical
/// endpoints, then the restart levers. `peer_moved`: the peer's address
/// changed (it waits for our SWITCHED). `solicit`: also have our socket
/// send the peer an ACK (`solicit_ack`): when the peer moved, because the
/// ACKs our socket sent meanwhile went to its old address; after our own
/// move, because the ones it sent while held were dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Switch {
    pub flow: VirtualFlow,
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub peer_moved: bool,
    pub solicit: bool,
    pub budget: Budget,
}

/// What a switch does about the anti-amplification budget of a peer
/// address that is not validated yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Budget {
    /// No limit: the address is validated (or it is our own end that
    /// moved).
    None,
    /// Send to the peer's address while it is being validated: at most
    /// this many bytes plus three times what comes from there
    /// ([`Event::SendUnvalidated`]).
    Unvalidated(u32),
    /// The address the flow already sends to under a budget was validated:
    /// the limit goes, nothing else changes (no restart levers, no
    /// SWITCHED: both were done when it started sending there).
    Lift,
    /// The peer sent its update for the address the flow already sends to
    /// under a budget again (it has not heard our answer): the allowance
    /// starts again at this many bytes, as a new install's would, and
    /// SWITCHED goes again (it may be what was lost); nothing else, no
    /// install, no restart levers. At 100,000 connections the peer's
    /// retries made the server install each translation three times.
    Again(u32),
}

/// The switch of `flow`'s send side to the peer's new address `remote`,
/// from wherever our end is now, soliciting an ACK (the ones our socket
/// sent meanwhile went to the old address).
fn peer_moved_to(
    flow: VirtualFlow,
    view: Option<&ConnectionView>,
    remote: SocketAddr,
    budget: Budget,
) -> Step {
    Step::Switch(Switch {
        flow,
        local: view.map_or(flow.local, |v| v.local_phys),
        remote,
        peer_moved: true,
        solicit: true,
        budget,
    })
}

impl Switch {
    /// Whether the peer is told (SWITCHED) once this switch took effect:
    /// its moved connection waits for that before it sends. Not for a UDP
    /// flow whose new NAT port is still to come in its BIND (remote port
    /// 0): the mover stays held until the port is known, since its
    /// datagrams would only be dropped here meanwhile.
    pub fn confirms(&self) -> bool {
        if self.budget == Budget::Lift {
            return false;
        }
        let moved = self.peer_moved || self.remote != self.flow.remote;
        let port_unknown = self.flow.proto == Proto::Udp && self.remote.port() == 0;
        moved && !port_unknown
    }
}

/// What one core event asks of the datapath.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Switch the flow's translation now.
    Switch(Switch),
    /// The flow's migration was aborted: release its held send side.
    Release(VirtualFlow),
    /// Nothing yet, and why (for the log).
    Wait(VirtualFlow, &'static str),
    /// Not an event about moves.
    NotAMove,
}

/// A move to start: our receive side at `mv.new_local` first, and the send
/// side held if `hold`; then the core's resume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Start {
    pub mv: Move,
    /// Our physical endpoint before the move (for the log).
    pub from: SocketAddr,
    pub hold: bool,
}

/// Move bookkeeping of one vnatd.
#[derive(Default)]
pub struct Mover {
    /// Receive sides made ready for a peer's announced address, as (our
    /// physical endpoint, the peer's): if we move meanwhile, the pair
    /// changes and the receive side is prepared again for our new one.
    prepared: HashMap<VirtualFlow, (SocketAddr, SocketAddr)>,
    /// Receive sides whose preparation failed, tried again on the next
    /// turn while the core still has their address pending.
    retry: HashMap<VirtualFlow, Translation>,
    /// Receive sides that could not be prepared yet (warned once each).
    prepare_failed: HashSet<(VirtualFlow, SocketAddr)>,
    /// Connections translated in a mass move whose sockets get the restart
    /// levers after the flush, with whether to solicit an ACK.
    /// Oldest first, taken from the front a share at a time (a mass
    /// move at 100,000 connections queues as many).
    to_restart: std::collections::VecDeque<(VirtualFlow, bool)>,
    /// When each held flow was held, latest hold last; `hold_started` has
    /// the time of a flow's latest hold, so that an older entry does not
    /// end a newer hold.
    holds: VecDeque<(Instant, VirtualFlow)>,
    hold_started: HashMap<VirtualFlow, Instant>,
    /// Flows that send to a peer address still being validated, and that
    /// address (`Budget::Unvalidated`).
    limited: HashMap<VirtualFlow, SocketAddr>,
}

impl Mover {
    pub fn new() -> Mover {
        Mover::default()
    }

    /// Gives back the room a mass move's holds and retries left
    /// (`vnat_vcmp::room`).
    pub fn shrink_sparse(&mut self) {
        use vnat_vcmp::room::Shrink;
        self.retry.shrink_sparse();
        self.prepare_failed.shrink_sparse();
        self.to_restart.shrink_sparse();
        self.holds.shrink_sparse();
        self.hold_started.shrink_sparse();
        self.limited.shrink_sparse();
    }

    /// The receive sides to prepare for the peers' announced addresses
    /// that are still being validated (only sending waits for
    /// validation): those the core asked for in `events`
    /// ([`Event::PrepareReceive`]) and those that failed before, each only
    /// while the core (`view`) still has that address pending for our
    /// current end. Reads the core's view of those connections only, never
    /// of them all.
    pub fn receive_sides(
        &mut self,
        events: &[Event],
        view: impl Fn(&VirtualFlow) -> Option<ConnectionView>,
    ) -> Vec<Translation> {
        let mut asked: Vec<Translation> = std::mem::take(&mut self.retry).into_values().collect();
        asked.extend(events.iter().filter_map(|e| match *e {
            Event::PrepareReceive {
                flow,
                local,
                remote,
            } => Some(Translation {
                flow,
                physical_local: local,
                physical_remote: remote,
            }),
            _ => None,
        }));
        let mut work: Vec<Translation> = Vec::new();
        // What `work` holds, to skip a repeat without a search of it (a
        // search per update was 10^10 comparisons at 100,000 at once).
        let mut taken: std::collections::HashSet<Translation> = std::collections::HashSet::new();
        for t in asked {
            let pair = (t.physical_local, t.physical_remote);
            // The address being validated, or (a UDP flow, port 0) the
            // address the update came from, validated beside it: the peer
            // may have entered a NAT there (`ConnectionView::nat_candidate`).
            let current = view(&t.flow).is_some_and(|v| {
                let candidate = v.nat_candidate.map(|a| SocketAddr::new(a.ip(), 0));
                (v.pending_remote == Some(t.physical_remote)
                    || candidate == Some(t.physical_remote))
                    && v.local_phys == t.physical_local
            });
            if !current || self.prepared.get(&t.flow) == Some(&pair) || taken.contains(&t) {
                continue;
            }
            if t.physical_local == t.flow.local && t.physical_remote == t.flow.remote {
                // Back to its own addresses: nothing to translate.
                self.prepared.insert(t.flow, pair);
                continue;
            }
            taken.insert(t);
            work.push(t);
        }
        work
    }

    /// How preparing `t` went. Returns whether a failure is new (to warn
    /// about once); a failed one is tried again on the next turn, before
    /// any RESPONSE lets the peer send there.
    pub fn receive_side_done(&mut self, t: &Translation, r: &Result<(), DatapathError>) -> bool {
        match r {
            Ok(()) => {
                self.prepared
                    .insert(t.flow, (t.physical_local, t.physical_remote));
                self.prepare_failed.remove(&(t.flow, t.physical_remote));
                false
            }
            Err(_) => {
                self.retry.insert(t.flow, *t);
                self.prepare_failed.insert((t.flow, t.physical_remote))
            }
        }
    }

    /// A connection went away.
    pub fn forget(&mut self, flow: &VirtualFlow) {
        self.prepared.remove(flow);
        self.retry.remove(flow);
        self.limited.remove(flow);
    }

    /// What `ev` asks of the datapath; `view` is the core's view of the
    /// event's connection now.
    pub fn step(&mut self, ev: &Event, view: Option<&ConnectionView>) -> Step {
        match *ev {
            Event::SetRemote { flow, remote } | Event::Reverted { flow, remote, .. } => {
                self.prepared.remove(&flow);
                let limited_to = self.limited.remove(&flow);
                if limited_to == Some(remote) && matches!(ev, Event::SetRemote { .. }) {
                    // Validated where it already sends.
                    return Step::Switch(Switch {
                        flow,
                        local: view.map_or(flow.local, |v| v.local_phys),
                        remote,
                        peer_moved: false,
                        solicit: false,
                        budget: Budget::Lift,
                    });
                }
                if view.is_some_and(|v| v.migrating) {
                    // Our own move is not acknowledged yet, so the peer
                    // may have no receive side for our new address:
                    // sending from it would meet a kernel that answers
                    // with a reset (both ends moving). `Resumed` follows
                    // and switches the send side to (our new, its
                    // validated) pair.
                    return Step::Wait(
                        flow,
                        "the peer's new address is validated; our send side switches once our own move is acknowledged",
                    );
                }
                peer_moved_to(flow, view, remote, Budget::None)
            }
            Event::SendUnvalidated {
                flow,
                remote,
                allowed,
            } => {
                // The switch installs the whole translation to `remote`,
                // its receive side with the budget's bit (each packet from
                // there adds to the allowance). A receive side prepared
                // again for the same pair (the peer's update sent again,
                // its first answer late) would replace that entry with one
                // without the bit: the allowance would stop growing, and
                // everything over it would go to the old address until the
                // validation ended. So the pair counts as prepared.
                let local = view.map_or(flow.local, |v| v.local_phys);
                self.prepared.insert(flow, (local, remote));
                // Also while our own move is under way: the core asks for
                // this then only when the peer's update came to our new
                // address, so the peer's receive side is ready for it
                // (unlike `SetRemote` above, which may follow an update
                // that reached us at our old address).
                let again = self.limited.insert(flow, remote) == Some(remote);
                let budget = if again {
                    Budget::Again(allowed)
                } else {
                    Budget::Unvalidated(allowed)
                };
                peer_moved_to(flow, view, remote, budget)
            }
            Event::Resumed {
                flow,
                switch_now: false,
                ..
            } => Step::Wait(
                flow,
                "our move is acknowledged; the send side switches once the peer sends to our new address",
            ),
            Event::Resumed { flow, .. } | Event::PeerSwitched { flow, .. } => {
                // Only a peer that said it switched is asked for an ACK:
                // otherwise it might still answer at our old address.
                let solicit = matches!(
                    ev,
                    Event::PeerSwitched {
                        confirmed: true,
                        ..
                    }
                );
                let local = view.map_or(flow.local, |v| v.local_phys);
                let remote = view.map_or(flow.remote, |v| v.remote_phys);
                let pending = view.and_then(|v| v.pending_remote);
                match mobility::send_side_after_resume(local, remote, pending) {
                    Some((local, remote)) => Step::Switch(Switch {
                        flow,
                        local,
                        remote,
                        peer_moved: false,
                        solicit,
                        budget: Budget::None,
                    }),
                    None => Step::Wait(
                        flow,
                        "our move is done but the peer moved too: the send side switches once its new address is validated",
                    ),
                }
            }
            Event::MigrationAborted { flow, .. } => {
                self.hold_started.remove(&flow);
                Step::Release(flow)
            }
            _ => Step::NotAMove,
        }
    }

    /// The moves to start among `moves` (decided by
    /// [`mobility::plan_moves`]), with whether each one's send side is
    /// held; and those that cannot move (no keys: the peer runs no vnatd
    /// or pairing has not completed).
    pub fn starts(
        &self,
        moves: Vec<Move>,
        view: impl Fn(&VirtualFlow) -> Option<ConnectionView>,
    ) -> (Vec<Start>, Vec<Move>) {
        let (mut go, mut stuck) = (Vec::new(), Vec::new());
        for mv in moves {
            let Some(v) = view(&mv.flow) else { continue };
            if !v.has_keys {
                stuck.push(mv);
                continue;
            }
            // Nothing of a TCP connection leaves until the peer sends to
            // the new address (`PeerSwitched`), nor of a UDP flow until our
            // move is acknowledged (it switches at once then): a datagram
            // that left from the old placement after the peer switched to
            // the new one (its receive side for the old one gone) would
            // reach the peer's socket untranslated, which a UDP server takes
            // for a new peer's; through a NAT, the peer learns the new port
            // only from our BIND. The datagrams held meanwhile (one round
            // trip) are lost, and a UDP socket never sees the hold fail a
            // send.
            let hold = true;
            go.push(Start {
                mv,
                from: v.local_phys,
                hold,
            });
        }
        (go, stuck)
    }

    /// Whether `flow`'s send side is held for a move of our own end (a
    /// hold for a peer, `daemon::helping`, must not end it).
    pub fn holding(&self, flow: &VirtualFlow) -> bool {
        self.hold_started.contains_key(flow)
    }

    /// `flow`'s send side was held at `at`.
    pub fn held(&mut self, flow: VirtualFlow, at: Instant) {
        self.holds.push_back((at, flow));
        self.hold_started.insert(flow, at);
        // Our own end moves: the peer address's validation, if one is
        // under way, switches our new placement in full, not just lifting
        // a budget from a placement that is gone.
        self.limited.remove(&flow);
    }

    /// A switch took effect (installing the translation ended any hold).
    /// `verified`: its restart levers ran with it; otherwise they are
    /// queued for [`Mover::take_restarts`]. In a mass move only the end
    /// whose peer moved solicits: each ACK costs the injecting syscall the
    /// packet's whole trip (tens of microseconds).
    pub fn switched(&mut self, s: &Switch, verified: bool) {
        self.hold_started.remove(&s.flow);
        if matches!(s.budget, Budget::Lift | Budget::Again(_)) {
            return;
        }
        if !verified {
            self.to_restart
                .push_back((s.flow, s.solicit && s.peer_moved));
        }
    }

    /// The restart levers queued by mass switches, to run after the flush:
    /// the `most` queued first (the rest wait for the next turn).
    pub fn take_restarts(&mut self, most: usize) -> Vec<(VirtualFlow, bool)> {
        let n = most.min(self.to_restart.len());
        self.to_restart.drain(..n).collect()
    }

    /// Whether restart levers are still queued.
    pub fn restarts_queued(&self) -> bool {
        !self.to_restart.is_empty()
    }

    /// When the oldest hold reaches [`HOLD_LIMIT`], if any is kept.
    pub fn next_hold_deadline(&self) -> Option<Instant> {
        self.holds.front().map(|(t, _)| *t + HOLD_LIMIT)
    }

    /// The holds older than [`HOLD_LIMIT`] at `now`, to release (each
    /// once; an older entry of a flow held again since is not one).
    pub fn overdue_holds(&mut self, now: Instant) -> Vec<VirtualFlow> {
        let mut overdue = Vec::new();
        while let Some(&(at, flow)) = self.holds.front() {
            if at + HOLD_LIMIT > now {
                break;
            }
            self.holds.pop_front();
            if self.hold_started.get(&flow) == Some(&at) {
                self.hold_started.remove(&flow);
                overdue.push(flow);
            }
        }
        overdue
    }
}

#[cfg(test)]
#[path = "mover_tests.rs"]
pub(crate) mod tests;
