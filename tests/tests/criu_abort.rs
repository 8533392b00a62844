//! A CRIU export that fails leaves the process running where it was, its
//! connections untouched (issue 32, item 6), with real CRIU: a socat echo
//! server with a live client is dumped with `vnatctl criu-hook` as the
//! action script, and the hook fails
//! - at pre-dump, because it cannot reach vnatd (its control socket is
//!   gone): CRIU aborts before it freezes anything;
//! - at post-dump, because vnatd, which answered at pre-dump, is gone
//!   (the hook's control socket does not exist then): the tree is frozen,
//!   its sockets dumped and CRIU's network lock in place; CRIU must unlock
//!   the network and let the tree run on (cr_dump_finish). The peers asked
//!   at pre-dump hold their packets until their limit (3.75 s), as nobody
//!   can tell them otherwise.
//!
//! Either way `criu dump` fails, and then: socat runs, the client's stream
//! goes on byte-exact on the same socket to the same server (vnatd still
//! lists the connection as mobile there), and no CRIU lock is left.
//!
//! Without CRIU it fails where VNAT_REQUIRE_CRIU is set (CI) and
//! otherwise does not run, saying so (see criu_migration.rs).

use std::{
    io::Write as _,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use vnat_tests::{
    become_child_subreaper, bin_path, criu_lock_tables, remove_criu_lock_tables, Criu,
    CriuMoveOptions, CriuNet, CriuScene,
};

/// The action script with `VNAT_CONTROL` pointed at a socket that does not
/// exist for the `broken` action (all actions when None).
fn hook_unreaching_vnatd_at(dir: &Path, broken: Option<&str>) -> PathBuf {
    let path = dir.join("criu-hook-broken");
    let test = match broken {
        Some(a) => format!("[ \"$CRTOOLS_SCRIPT_ACTION\" = {a} ] && "),
        None => String::new(),
    };
    let mut f = std::fs::File::create(&path).expect("writing the hook");
    write!(
        f,
        "#!/bin/sh\n{test}export VNAT_CONTROL={}/no-vnatd.sock\nexec {} criu-hook\n",
        dir.display(),
        bin_path("vnatctl").display()
    )
    .expect("writing the hook");
    drop(f);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .and_then(|(_, r)| r.split_whitespace().next().map(str::to_string))
        })
        .is_some_and(|state| state != "Z" && state != "X")
}

/// Dump `sc`'s socat with `hook` and `env`, expect CRIU to fail, and check
/// that nothing changed for the process and its client.
fn dump_fails_and_nothing_moves(
    criu: &Criu,
    sc: &mut CriuScene,
    hook: &Path,
    env: &[(String, String)],
) {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let pid = sc.socat.id();
    let at = sc.client.latest().expect("status").verified;
    let started = Instant::now();
    let result = criu.try_dump(&sc.topo.server, pid, &sc.images, hook, &env);
    let took = started.elapsed();
    let said = match result {
        Ok(_) => panic!("criu dump succeeded although the hook failed"),
        Err(said) => said,
    };
    eprintln!(
        "criu_abort: criu dump failed after {} ms, as it should: {}",
        took.as_millis(),
        said.lines().next().unwrap_or("")
    );
    assert!(
        alive(pid),
        "socat ({pid}) is not running on the first server after the failed dump"
    );
    let locks = criu_lock_tables(&sc.topo.server);
    assert!(
        locks.is_empty(),
        "CRIU's network lock is left on the first server after the failed dump: {locks:?}"
    );
    // The stream goes on: 100 kB more echoed and verified (half a second
    // at its rate, plus any hold the peers had been asked for).
    let after = sc
        .client
        .wait_verified_at_least(at + 100_000, Duration::from_secs(15));
    assert_eq!(after.local, sc.before.local, "the client's socket changed");
    assert_eq!(
        sc.client_sends_to().as_deref(),
        Some(sc.server.to_string().as_str()),
        "the client's vnatd no longer sends to the first server"
    );
    let ls = sc.s1d.ctl(&["ls"]).expect("the first server's vnatd");
    assert!(
        ls.as_array()
            .is_some_and(|a| a.iter().any(|r| r["mobile"] == true)),
        "the first server's vnatd no longer lists the connection as mobile: {ls}"
    );
    assert!(alive(pid), "socat stopped during the stream");
    let fin = sc.client.stop_in_place();
    assert_eq!(fin.error, None, "the client's stream failed");
    eprintln!(
        "criu_abort: the client's longest wait for an echo was {} ms",
        fin.max_gap_ms
    );
    remove_criu_lock_tables(&sc.topo.server);
}

#[test]
fn a_dump_whose_hook_cannot_reach_vnatd_leaves_the_process_running_with_its_connection() {
    let Some(criu) = Criu::for_test("criu_abort") else {
        return;
    };
    become_child_subreaper();
    let opts = CriuMoveOptions::default();
    let net = CriuNet::new("crab1", opts);
    let mut sc = CriuScene::new(&net, "crab1", opts);
    let hook = hook_unreaching_vnatd_at(sc.work.path(), None);
    let env = sc.dump_env();
    dump_fails_and_nothing_moves(&criu, &mut sc, &hook, &env);
}

#[test]
fn an_export_that_fails_after_the_freeze_leaves_the_process_running_with_its_connection() {
    let Some(criu) = Criu::for_test("criu_abort") else {
        return;
    };
    become_child_subreaper();
    let opts = CriuMoveOptions::default();
    let net = CriuNet::new("crab2", opts);
    let mut sc = CriuScene::new(&net, "crab2", opts);
    // vnatd answers at pre-dump (the peers are asked to hold) and is gone
    // at post-dump, after the freeze: the export cannot be made.
    let hook = hook_unreaching_vnatd_at(sc.work.path(), Some("post-dump"));
    let env = sc.dump_env();
    dump_fails_and_nothing_moves(&criu, &mut sc, &hook, &env);
}
