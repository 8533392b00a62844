//! Virtual-address conflicts (the paper's section 3.4.3). A connection's
//! virtual endpoints travel with it, so a move (its own end's, its peer's,
//! or an import) can land on the endpoints of another connection of this
//! host; the kernel could not tell the two apart. The datapath refuses such
//! a move (`DatapathError::Conflict`); for a move this host makes (its own
//! end's, or an import) the moving connection's cgroup decides what then
//! happens: `abort` (the default: the move is refused and says why) or
//! `preempt` (the older of the two connections is reset), for the cgroups
//! listed in `preempt_cgroups` and those below them. "Older" is the
//! connection's age: when the datapath recorded it (at establishment, or
//! when it was adopted). The other one older: it is reset and the move goes
//! on; the moving one older: it is reset, and its move ends there (the
//! paper's preemption of "the existing connection" (3.4.2) made no sense of
//! a newer connection that a returning older one would have destroyed). A
//! peer's move always aborts: a peer with valid keys could otherwise name
//! the endpoints of a neighbour's connection and have it reset.

use std::{collections::HashSet, path::PathBuf};

use crate::datapath::{Datapath, DatapathError, Proto, Translation, VirtualFlow};

/// The ids of the cgroups at and below `dirs` (on cgroup v2 a cgroup's id
/// is its directory's inode number, what the recorders store). A directory
/// that is not on a cgroup v2 filesystem counts for nothing (its inode
/// numbers would name unrelated cgroups), with a warning.
pub fn cgroup_ids_under(dirs: &[PathBuf]) -> HashSet<u64> {
    ids_under(dirs, true)
}

fn ids_under(dirs: &[PathBuf], cgroup2_only: bool) -> HashSet<u64> {
    let mut out = HashSet::new();
    for d in dirs {
        if cgroup2_only && crate::datapath::kernel::cgroup_id(d).is_err() {
            tracing::warn!(dir = %d.display(), "preempt_cgroups: not a cgroup v2 directory; ignored");
            continue;
        }
        crate::datapath::kernel::cgroup_tree_ids(d, &mut out);
    }
    out
}

/// Prepare the receive side of `t` (see `Datapath::prepare_translation`).
/// If it lands on another connection's endpoints, `preempt` is set and
/// `preemptible` gives that connection's recording time (it is under the
/// same policy, in this namespace; `None`: it may not be reset), reset the
/// older of the two: the other one, then try once more; or the moving one
/// (its recording time from `preemptible` too), which ends its move
/// ([`DatapathError::ResetAsOlder`]). Unknown or equal ages reset the other
/// one. Otherwise the conflict is the answer. Only TCP preempts: a UDP
/// socket may serve many peers, and one that is reset stays bound and may
/// send again.
pub fn prepare_resolving(
    dp: &mut dyn Datapath,
    t: &Translation,
    preempt: bool,
    preemptible: impl Fn(&VirtualFlow) -> Option<u64>,
) -> Result<(), DatapathError> {
    match dp.prepare_translation(t) {
        Err(e @ DatapathError::Conflict { .. }) => {
            let DatapathError::Conflict { other, .. } = &e else {
                unreachable!()
            };
            let other = **other;
            let other_at = preemptible(&other).filter(|_| preempt && t.flow.proto == Proto::Tcp);
            if let Some(other_at) = other_at {
                if preemptible(&t.flow).is_some_and(|at| at < other_at) {
                    tracing::warn!(id = t.flow.id(), flow = %t.flow, %other, "virtual-address conflict: resetting the moving connection, the older of the two (both are in preempt_cgroups)");
                    dp.reset_connection(&t.flow)?;
                    return Err(DatapathError::ResetAsOlder {
                        flow: t.flow,
                        other: Box::new(other),
                    });
                }
                tracing::warn!(id = t.flow.id(), flow = %t.flow, %other, "virtual-address conflict: resetting the older connection (both are in preempt_cgroups)");
                if dp.reset_connection(&other)? {
                    return dp.prepare_translation(t);
                }
            }
            tracing::warn!(id = t.flow.id(), flow = %t.flow, error = %e, "virtual-address conflict: the move is refused");
            Err(e)
        }
        r => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::{fake::FakeDatapath, Proto, VirtualFlow};

    fn flow(local: &str, remote: &str) -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: local.parse().unwrap(),
            remote: remote.parse().unwrap(),
        }
    }

    /// The laptop migrates `moving` (A:40000) to B:40000, where `older`
    /// already talks to the same server port, both of `proto`.
    fn setup_of(proto: Proto) -> (FakeDatapath, Translation, VirtualFlow) {
        let mut dp = FakeDatapath::new();
        let moving = VirtualFlow {
            proto,
            ..flow("198.18.1.2:40000", "198.18.3.2:5001")
        };
        let older = VirtualFlow {
            proto,
            ..flow("198.18.2.2:40000", "198.18.3.2:5001")
        };
        dp.add_connection(moving, None);
        dp.add_connection(older, None);
        let t = Translation {
            flow: moving,
            physical_local: older.local,
            physical_remote: moving.remote,
        };
        (dp, t, older)
    }

    fn setup() -> (FakeDatapath, Translation, VirtualFlow) {
        setup_of(Proto::Tcp)
    }

    #[test]
    fn abort_refuses_the_move_and_touches_nothing() {
        let (mut dp, t, older) = setup();
        let r = prepare_resolving(&mut dp, &t, false, |_| Some(0));
        assert!(
            matches!(&r, Err(DatapathError::Conflict { other, .. }) if **other == older),
            "{r:?}"
        );
        assert!(dp.reset.is_empty());
        assert!(dp.prepared.is_empty());
        let text = r.unwrap_err().to_string();
        assert!(
            text.contains("preempt_cgroups"),
            "the refusal says how to preempt: {text}"
        );
    }

    #[test]
    fn preempt_resets_the_older_connection_then_moves() {
        let (mut dp, t, older) = setup();
        // Recorded at 5, the moving one at 9.
        let at = |f: &VirtualFlow| Some(if *f == older { 5 } else { 9 });
        prepare_resolving(&mut dp, &t, true, at).expect("preempted");
        assert_eq!(dp.reset, vec![older]);
        assert_eq!(dp.prepared.get(&t.flow), Some(&t));
    }

    #[test]
    fn preempt_resets_the_moving_connection_when_it_is_the_older() {
        let (mut dp, t, other) = setup();
        let at = |f: &VirtualFlow| Some(if *f == other { 9 } else { 5 });
        let r = prepare_resolving(&mut dp, &t, true, at);
        assert!(
            matches!(&r, Err(DatapathError::ResetAsOlder { flow, other: o }) if *flow == t.flow && **o == other),
            "{r:?}"
        );
        assert_eq!(dp.reset, vec![t.flow], "the newer one is left alone");
        assert!(dp.prepared.is_empty());
        let text = r.unwrap_err().to_string();
        assert!(text.contains("older") && text.contains("reset"), "{text}");
        // Its own age unknown (not under the policy): the other one goes.
        let (mut dp, t, other) = setup();
        let at = |f: &VirtualFlow| (*f == other).then_some(9);
        prepare_resolving(&mut dp, &t, true, at).expect("preempted");
        assert_eq!(dp.reset, vec![other]);
    }

    #[test]
    fn an_older_connection_outside_the_policy_or_udp_is_never_reset() {
        let (mut dp, t, _) = setup();
        assert!(matches!(
            prepare_resolving(&mut dp, &t, true, |_| None),
            Err(DatapathError::Conflict { .. })
        ));
        assert!(dp.reset.is_empty() && dp.prepared.is_empty());
        let (mut dp, t, _) = setup_of(Proto::Udp);
        assert!(prepare_resolving(&mut dp, &t, true, |_| Some(0)).is_err());
        assert!(dp.reset.is_empty(), "a UDP socket is never reset");
    }

    #[test]
    fn cgroup_ids_cover_the_directory_and_everything_below() {
        let base = std::env::temp_dir().join(format!("vnat-conflict-{}", std::process::id()));
        let deep = base.join("a/b");
        std::fs::create_dir_all(&deep).unwrap();
        let other = std::env::temp_dir().join(format!("vnat-conflict-o-{}", std::process::id()));
        std::fs::create_dir_all(&other).unwrap();
        let ino = |p: &std::path::Path| {
            std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).unwrap())
        };
        let ids = ids_under(&[base.join("a")], false);
        assert!(ids.contains(&ino(&base.join("a"))) && ids.contains(&ino(&deep)));
        assert!(!ids.contains(&ino(&base)) && !ids.contains(&ino(&other)));
        assert!(cgroup_ids_under(&[]).is_empty());
        // Not a cgroup v2 directory: its inode numbers name nothing.
        assert!(cgroup_ids_under(&[base.join("a")]).is_empty());
        let _ = std::fs::remove_dir_all(&base);
        let _ = std::fs::remove_dir_all(&other);
    }
}
