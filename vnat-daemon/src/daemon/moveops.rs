//! The datapath work of a move, in the order the rule needs (see
//! `super::mover`): no kernel may ever see an untranslated packet for a
//! socket it lacks. The mover decides what to do, and the driver writes
//! that as a list of typed operations ([`Op`]); [`run`] does them against the [`Datapath`] seam, in
//! order, so that the order is unit-tested with the fake datapath, without
//! root. The driver runs each list on the datapath's own thread, in one
//! trip, and hands the outcomes back.

use std::collections::HashMap;
use std::net::SocketAddr;

use super::{
    conflict, mobility,
    mover::{Budget, Start, Switch},
};
use crate::datapath::{Datapath, DatapathError, Proto, Translation, VirtualFlow};

/// One piece of the datapath work of moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Hold our send side (if the mover says so) and prepare our receive
    /// side at the new address ([`start_one`]); `preempt`: this connection
    /// may reset an older one in its way (`daemon::conflict`).
    Start { start: Start, preempt: bool },
    /// A peer announced a new address: accept its packets from there
    /// already ([`prepare_peer_receive_side`]).
    PrepareReceive(Translation),
    /// Switch the send side ([`translate_one`]); with `verified`, the
    /// restart levers that watch the socket act right after.
    Switch { switch: Switch, verified: bool },
    /// The restart levers alone, without waits (a mass move's, after the
    /// flush).
    Restart { flow: VirtualFlow, solicit: bool },
    /// A hold past the mover's limit: release it and push what its socket
    /// queued meanwhile.
    ReleaseOverdue(VirtualFlow),
    /// The core aborted the flow's migration: release its hold.
    ReleaseAborted(VirtualFlow),
}

/// How one [`Op`] went.
#[derive(Debug)]
pub enum Outcome {
    /// A [`Op::Start`].
    Started(Started),
    /// Any other operation.
    Done(Result<(), DatapathError>),
}

impl Outcome {
    /// The error, if the operation failed.
    pub fn error(&self) -> Option<&DatapathError> {
        match self {
            Outcome::Started(s) => s.result.as_ref().err(),
            Outcome::Done(r) => r.as_ref().err(),
        }
    }
}

/// Do `ops` in order. `preempting`: the connections a preempting move may
/// reset (`daemon::conflict`), with when each was recorded (the older of
/// two is reset); only [`Op::Start`] uses it.
pub fn run(
    dp: &mut dyn Datapath,
    ops: Vec<Op>,
    preempting: &HashMap<VirtualFlow, u64>,
) -> Vec<(Op, Outcome)> {
    ops.into_iter()
        .map(|op| {
            let outcome = match &op {
                Op::Start { start, preempt } => {
                    Outcome::Started(start_one(dp, start, *preempt, |o| {
                        preempting.get(o).copied()
                    }))
                }
                Op::PrepareReceive(t) => Outcome::Done(prepare_peer_receive_side(dp, t)),
                Op::Switch {
                    switch: s,
                    verified,
                } => {
                    // Already sending there under a budget: credited again,
                    // nothing installed (see `Budget::Again`). A repeat whose
                    // allowance is gone, or could not be credited, is
                    // installed as the first was.
                    let credited = match s.budget {
                        Budget::Again(a) => dp.credit_unvalidated(&s.flow, a).unwrap_or(false),
                        _ => false,
                    };
                    if credited {
                        Outcome::Done(Ok(()))
                    } else {
                        dp.limit_until_validated(
                            &s.flow,
                            match s.budget {
                                Budget::Unvalidated(allowed) | Budget::Again(allowed) => {
                                    Some(allowed)
                                }
                                Budget::None | Budget::Lift => None,
                            },
                        );
                        // Packets over the allowance that went to the last
                        // validated placement were likely lost: retransmit
                        // them now, not when TCP's backed-off timer says.
                        let diverted =
                            s.budget == Budget::Lift && dp.diverted_while_unvalidated(&s.flow);
                        let r = translate_one(dp, s.flow, s.local, s.remote);
                        // Not left for a later install, whatever became of
                        // this one (a failure, a removal, a rebind).
                        dp.limit_until_validated(&s.flow, None);
                        if *verified && r.is_ok() && s.budget != Budget::Lift {
                            restart_one(dp, s.flow, s.solicit, true);
                        } else if diverted && r.is_ok() {
                            restart_one(dp, s.flow, false, false);
                        }
                        Outcome::Done(r)
                    }
                }
                Op::Restart { flow, solicit } => {
                    restart_one(dp, *flow, *solicit, false);
                    Outcome::Done(Ok(()))
                }
                Op::ReleaseOverdue(f) => Outcome::Done(dp.hold_send_side(f, false).map(|()| {
                    restart_one(dp, *f, false, false);
                })),
                Op::ReleaseAborted(f) => Outcome::Done(dp.hold_send_side(f, false)),
            };
            (op, outcome)
        })
        .collect()
}

/// How starting one move went: the receive side's preparation, and
/// whether the send side is held now.
#[derive(Debug)]
pub struct Started {
    pub result: Result<(), DatapathError>,
    pub held: bool,
}

/// Start one move of our own end: hold its send side first (if the mover
/// says so), then prepare the receive side at the new address; if that
/// fails, the send side is released again and nothing changed.
///
/// Held first because preparing puts the old address back on lo, and from
/// then on the socket can send again: a packet that left unheld in between
/// would reach the peer from the new network, untranslated (a UDP server
/// takes it for a new peer's). `preempt` and `preemptible` are the
/// conflict policy (`conflict::prepare_resolving`).
pub fn start_one(
    dp: &mut dyn Datapath,
    st: &Start,
    preempt: bool,
    preemptible: impl Fn(&VirtualFlow) -> Option<u64>,
) -> Started {
    let m = st.mv;
    let mut held = false;
    if st.hold {
        match dp.hold_send_side(&m.flow, true) {
            Ok(()) => held = true,
            Err(e) => {
                tracing::warn!(id = m.flow.id(), flow = %m.flow, error = %e, "cannot hold the connection's packets during its move")
            }
        }
    }
    let result = if m.new_local != m.flow.local {
        let t = Translation {
            flow: m.flow,
            physical_local: m.new_local,
            physical_remote: m.remote_phys,
        };
        conflict::prepare_resolving(dp, &t, preempt, preemptible)
    } else {
        Ok(())
    };
    if result.is_err() && held {
        // Not moving after all: back as it was.
        let _ = dp.hold_send_side(&m.flow, false);
        held = false;
    }
    Started { result, held }
}

/// Make the datapath translate `flow` to (local, remote), or stop
/// translating it when both are its virtual endpoints again. Installing
/// releases a held send side. When both ends moved, the old address's
/// receive side is prepared too ([`prepare_old_address`]).
pub fn translate_one(
    dp: &mut dyn Datapath,
    flow: VirtualFlow,
    local: SocketAddr,
    remote: SocketAddr,
) -> Result<(), DatapathError> {
    if local == flow.local && remote == flow.remote {
        match dp.remove_translation(&flow) {
            Err(DatapathError::NoSuchTranslation { .. }) => Ok(()),
            r => r,
        }
    } else {
        dp.install_translation(&Translation {
            flow,
            physical_local: local,
            physical_remote: remote,
        })?;
        prepare_old_address(dp, flow, local, remote);
        Ok(())
    }
}

/// After an outage TCP has backed off its retransmission timer; make it
/// retransmit now rather than tens of seconds later (DESIGN.md §3, "no
/// stall"); and with `solicit`, have the socket send its peer an ACK (see
/// `mover::Switch`). `wait`: the verified levers, which watch the socket
/// act (and try again).
pub fn restart_one(dp: &mut dyn Datapath, flow: VirtualFlow, solicit: bool, wait: bool) {
    if flow.proto != Proto::Tcp {
        return;
    }
    let r = if wait {
        crate::datapath::restart_verified(dp, &flow, solicit).map(|r| format!("{r:?}"))
    } else {
        dp.kick_flow(&flow, solicit).map(|k| format!("{k:?}"))
    };
    match r {
        Ok(sent) => tracing::debug!(id = flow.id(), %flow, %sent, "restart"),
        Err(e) => {
            tracing::debug!(id = flow.id(), %flow, error = %e, "could not restart the flow's retransmissions")
        }
    }
}

/// When both ends moved, the peer may still send to our old (virtual)
/// address, which stays local here: take those packets in as well (receive
/// side only), or the kernel would answer them with a reset that the peer's
/// translation delivers into its socket. See
/// [`mobility::old_address_receive_side`].
pub fn prepare_old_address(
    dp: &mut dyn Datapath,
    flow: VirtualFlow,
    local: SocketAddr,
    remote: SocketAddr,
) {
    if let Some(t) = mobility::old_address_receive_side(flow, local, remote) {
        if let Err(e) = dp.prepare_translation(&t) {
            tracing::debug!(id = flow.id(), %flow, error = %e, "cannot take in the peer's packets to our old address");
        }
    }
}

/// A peer announced a new address (still being validated): accept its
/// packets from there already, and, when our end moved too, at our old
/// address as well. A peer's move never preempts: a peer with valid keys
/// could name the endpoints of a neighbour's connection as its new address
/// and have this host reset it; the conflict refuses the move.
pub fn prepare_peer_receive_side(
    dp: &mut dyn Datapath,
    t: &Translation,
) -> Result<(), DatapathError> {
    conflict::prepare_resolving(dp, t, false, |_| None)?;
    prepare_old_address(dp, t.flow, t.physical_local, t.physical_remote);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::mobility::Move;
    use crate::datapath::fake::FakeDatapath;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn flow(local: &str, remote: &str) -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: sa(local),
            remote: sa(remote),
        }
    }

    fn start(f: VirtualFlow, new_local: &str, hold: bool) -> Start {
        Start {
            mv: Move {
                flow: f,
                new_local: sa(new_local),
                remote_phys: f.remote,
            },
            from: f.local,
            hold,
        }
    }

    #[test]
    fn a_move_holds_then_prepares_the_new_receive_side() {
        let mut dp = FakeDatapath::new();
        let f = flow("10.0.1.5:40000", "10.0.9.1:22");
        dp.add_connection(f, None);
        let s = start_one(&mut dp, &start(f, "10.0.2.5:40000", true), false, |_| None);
        assert!(s.result.is_ok() && s.held, "{s:?}");
        assert!(dp.held.contains(&f));
        assert_eq!(
            dp.prepared.get(&f).map(|t| t.physical_local),
            Some(sa("10.0.2.5:40000"))
        );
        // The switch installs the translation, which releases the hold.
        translate_one(&mut dp, f, sa("10.0.2.5:40000"), f.remote).expect("install");
        assert!(!dp.held.contains(&f) && dp.prepared.is_empty());
    }

    #[test]
    fn a_lifted_budget_restarts_only_a_socket_whose_packets_went_elsewhere() {
        let mut dp = FakeDatapath::new();
        let (a, b) = (
            flow("10.0.9.1:22", "10.0.1.5:40000"),
            flow("10.0.9.1:22", "10.0.1.6:40000"),
        );
        let to = |f: VirtualFlow, budget| Switch {
            flow: f,
            local: f.local,
            remote: SocketAddr::new(sa("10.0.2.9:1").ip(), f.remote.port()),
            peer_moved: true,
            solicit: true,
            budget,
        };
        for f in [a, b] {
            dp.add_connection(f, None);
        }
        let unvalidated = [a, b]
            .map(|f| Op::Switch {
                switch: to(f, Budget::Unvalidated(1200)),
                verified: false,
            })
            .into();
        run(&mut dp, unvalidated, &HashMap::new());
        assert_eq!(dp.limited.len(), 2);
        // Only a's packets went over its allowance, to the old address.
        dp.diverted.insert(a);
        dp.restarted.clear();
        let lifts = [a, b]
            .map(|f| Op::Switch {
                switch: to(f, Budget::Lift),
                verified: true,
            })
            .into();
        run(&mut dp, lifts, &HashMap::new());
        assert!(dp.limited.is_empty());
        assert_eq!(
            dp.restarted,
            vec![a],
            "the lift restarts the socket whose packets were diverted, and no other"
        );
    }

    #[test]
    fn a_move_onto_another_connections_endpoints_changes_nothing() {
        let mut dp = FakeDatapath::new();
        let f = flow("10.0.1.5:40000", "10.0.9.1:22");
        let other = flow("10.0.2.5:40000", "10.0.9.1:22");
        dp.add_connection(f, None);
        dp.add_connection(other, None);
        let s = start_one(&mut dp, &start(f, "10.0.2.5:40000", true), false, |_| None);
        assert!(
            matches!(s.result, Err(DatapathError::Conflict { .. })),
            "{s:?}"
        );
        // The hold taken first is given back: the connection sends as before.
        assert!(!s.held && dp.held.is_empty() && dp.prepared.is_empty());
        // With preempt (both listed), the older connection is reset and
        // the move goes on.
        let s = start_one(&mut dp, &start(f, "10.0.2.5:40000", true), true, |o| {
            Some(if *o == other { 1 } else { 2 })
        });
        assert!(s.result.is_ok() && s.held, "{s:?}");
        assert_eq!(dp.reset, vec![other]);
    }

    #[test]
    fn a_hold_that_fails_does_not_stop_the_move_and_a_stay_prepares_nothing() {
        let mut dp = FakeDatapath::new();
        let f = flow("10.0.1.5:40000", "10.0.9.1:22");
        dp.add_connection(f, None);
        dp.fail_next = Some(DatapathError::NoEbpfObject);
        let s = start_one(&mut dp, &start(f, "10.0.2.5:40000", true), false, |_| None);
        assert!(s.result.is_ok() && !s.held, "{s:?}");
        assert!(dp.prepared.contains_key(&f));
        // Back at its own address (the peer moved, or a move back): held
        // only, no receive side to prepare.
        let mut dp = FakeDatapath::new();
        dp.add_connection(f, None);
        let s = start_one(&mut dp, &start(f, "10.0.1.5:40000", true), false, |_| None);
        assert!(s.result.is_ok() && s.held);
        assert!(dp.prepared.is_empty());
        let done = run(&mut dp, vec![Op::ReleaseAborted(f)], &HashMap::new());
        assert!(done[0].1.error().is_none() && dp.held.is_empty());
    }

    #[test]
    fn a_peers_move_never_resets_another_connection_and_overdue_holds_are_released() {
        let mut dp = FakeDatapath::new();
        let f = flow("10.0.9.1:22", "10.0.1.5:40000");
        let neighbour = flow("10.0.9.1:22", "10.0.2.5:40000");
        dp.add_connection(f, None);
        dp.add_connection(neighbour, None);
        // The peer claims the neighbour's endpoints as its new address.
        let t = Translation {
            flow: f,
            physical_local: f.local,
            physical_remote: neighbour.remote,
        };
        assert!(matches!(
            prepare_peer_receive_side(&mut dp, &t),
            Err(DatapathError::Conflict { .. })
        ));
        assert!(dp.reset.is_empty() && dp.prepared.is_empty());
        let ok = Translation {
            physical_remote: sa("10.0.3.5:40000"),
            ..t
        };
        prepare_peer_receive_side(&mut dp, &ok).expect("prepared");
        assert_eq!(dp.prepared.get(&f), Some(&ok));
        dp.hold_send_side(&f, true).unwrap();
        let done = run(&mut dp, vec![Op::ReleaseOverdue(f)], &HashMap::new());
        assert!(done[0].1.error().is_none());
        assert!(dp.held.is_empty());
        // A TCP socket released from a hold gets its levers.
        assert_eq!(dp.restarted, vec![f]);
    }

    #[test]
    fn both_ends_moved_takes_in_the_old_address_too_and_back_home_untranslates() {
        let mut dp = FakeDatapath::new();
        let f = flow("10.0.1.5:40000", "10.0.9.1:22");
        dp.add_connection(f, None);
        translate_one(&mut dp, f, sa("10.0.2.5:40000"), sa("10.0.8.1:22")).expect("install");
        assert_eq!(dp.translations().unwrap().len(), 1);
        // The peer's packets to our old address are taken in as well.
        assert_eq!(
            dp.prepared
                .get(&f)
                .map(|t| (t.physical_local, t.physical_remote)),
            Some((f.local, sa("10.0.8.1:22")))
        );
        translate_one(&mut dp, f, f.local, f.remote).expect("remove");
        assert!(dp.translations().unwrap().is_empty());
        // Nothing to remove is no error.
        translate_one(&mut dp, f, f.local, f.remote).expect("nothing to remove");
    }

    #[test]
    fn a_list_of_ops_runs_in_order_and_one_failure_stops_no_other() {
        let mut dp = FakeDatapath::new();
        let ours = flow("10.0.1.5:40000", "10.0.9.1:22");
        let theirs = flow("10.0.1.5:40001", "10.0.9.2:22");
        let blocked = flow("10.0.1.5:40002", "10.0.9.3:22");
        let neighbour = flow("10.0.2.5:40002", "10.0.9.3:22");
        for f in [ours, theirs, blocked, neighbour] {
            dp.add_connection(f, None);
        }
        let peer_new = Translation {
            flow: theirs,
            physical_local: theirs.local,
            physical_remote: sa("10.0.8.2:22"),
        };
        let switch = Switch {
            flow: theirs,
            local: theirs.local,
            remote: sa("10.0.8.2:22"),
            peer_moved: true,
            solicit: true,
            budget: crate::daemon::mover::Budget::None,
        };
        let ops = vec![
            Op::Start {
                start: start(ours, "10.0.2.5:40000", true),
                preempt: false,
            },
            // Onto the neighbour's endpoints, not preempting: refused.
            Op::Start {
                start: start(blocked, "10.0.2.5:40002", true),
                preempt: false,
            },
            Op::PrepareReceive(peer_new),
            Op::Switch {
                switch,
                verified: true,
            },
        ];
        let done = run(&mut dp, ops.clone(), &HashMap::new());
        assert_eq!(
            done.iter().map(|(op, _)| op.clone()).collect::<Vec<_>>(),
            ops
        );
        assert!(matches!(&done[0].1, Outcome::Started(s) if s.held && s.result.is_ok()));
        assert!(matches!(
            done[1].1.error(),
            Some(DatapathError::Conflict { .. })
        ));
        assert!(done[2].1.error().is_none() && done[3].1.error().is_none());
        // Ours: held, its new receive side ready; the blocked one: as
        // before; theirs: switched (its receive side was prepared first and
        // the install replaced it), the verified levers run.
        assert!(dp.held.contains(&ours) && !dp.held.contains(&blocked));
        assert!(dp.prepared.contains_key(&ours) && !dp.prepared.contains_key(&blocked));
        assert_eq!(dp.translations().unwrap().len(), 1);
        assert_eq!(dp.restarted, vec![theirs]);
        assert!(dp.reset.is_empty());
    }
}
