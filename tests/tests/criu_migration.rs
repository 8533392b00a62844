//! A real server process moves to another host with real CRIU: a socat
//! echo server with a live client is dumped on the first server (`criu
//! dump --tcp-established --network-lock nftables`) and restored on a
//! second server with a different address (`criu restore`), with `vnatctl
//! criu-hook` as CRIU's action script on both sides: at post-dump it
//! exports the dumped process's connections, sealed for the second server,
//! into the images; at pre-restore it imports them there, which puts the
//! old address in place for the restored socket to bind to. The client's
//! connection carries on: same socket, byte-exact, no reset, now
//! translated to the second server's address. (The scenario itself is
//! `vnat_tests::move_echo_server_with_criu`, which the benchmark repeats.)
//!
//! It prints what a user would want to know about the freeze: the dump's
//! and the restore's wall times, the longest time the client saw no echo,
//! and the client's retransmissions during it, which must be none: the
//! hook's pre-dump has the client's vnatd hold its packets meanwhile. `cargo xtask bench criu`
//! repeats it for medians.
//!
//! Without a CRIU of 4.2 or later that passes `criu check` (`cargo xtask
//! prereq` installs one into /opt/vnat-criu) it fails where
//! VNAT_REQUIRE_CRIU is set (CI), and otherwise does not run, saying so on
//! stderr past libtest's capture and in `cargo xtask test`'s summary.

use vnat_tests::{become_child_subreaper, move_echo_server_with_criu, Criu};

#[test]
fn server_process_migrates_to_another_host_with_criu() {
    let Some(criu) = Criu::for_test("criu_migration") else {
        return;
    };
    // The restored socat is left to us by `criu restore -d`: reap it here,
    // not by PID 1, so that its pid is free as soon as it is killed.
    become_child_subreaper();

    let m = move_echo_server_with_criu(&criu, "crmig");
    eprintln!(
        "criu_migration: dump {:.0} ms, restore {:.0} ms, client's longest wait for an echo {} ms, \
         client retransmission timeouts {}, segments retransmitted {}",
        m.dump.as_secs_f64() * 1000.0,
        m.restore.as_secs_f64() * 1000.0,
        m.max_gap_ms,
        m.client_rtos,
        m.client_retransmitted,
    );
    // Nothing the client sent was lost on the way: at pre-dump the hook had
    // its vnatd hold the client's packets in its socket until the
    // connection moved, so none met CRIU's network lock on the old host
    // (without the hold, 20 to 38 segments did and were resent).
    assert_eq!(
        m.client_retransmitted, 0,
        "the client retransmitted segments: its packets were not held during the freeze"
    );
    // The client's stream: no reset, no wrong byte, the same socket, and it
    // went on after the restore.
    assert_eq!(m.stream_error, None, "the client's stream failed");
    assert_eq!(
        m.socket_after, m.socket_before,
        "the client's socket changed"
    );
    assert!(m.verified_after_dump >= 100_000);
    // It now talks to the second server, whose restored socket still
    // names the first server's address.
    assert_eq!(
        m.client_sends_to.as_deref(),
        Some(m.new_server.to_string().as_str()),
        "the client does not send to the new server host ({})",
        m.server
    );
    assert!(
        m.restored_on_new_host,
        "the restored socket ({} -> the client) is not established on the second server",
        m.server
    );
    // The export carried in the images holds keys.
    assert_eq!(m.export_mode, 0o600, "the hook's export in the images");
    // What kept the first server's kernel from resetting the client's
    // packets until they went to the second server: CRIU's lock, left behind.
    assert!(
        m.lock_left_on_old_host,
        "CRIU left no network lock on the first server"
    );
    // And once the connection has moved it is not needed: the hook's
    // remover deletes it (VNAT_CRIU_UNLOCK_AFTER, 2 s here), so the
    // connection's tuple is not blackholed on the first server for good.
    assert!(
        m.lock_tables_later.is_empty(),
        "CRIU's network lock is still on the first server after the move: {:?}",
        m.lock_tables_later
    );
}
