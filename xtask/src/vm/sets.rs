//! Which privileged tests `cargo xtask test --kernel` runs in the VM: the
//! named sets (core, smoke) and the choice between them. The VM itself
//! (booting, the script inside, the results) is `vm.rs`.

/// The tests that `cargo xtask test --kernel` runs unless `--all-tests` or
/// `--tests` says otherwise: (test file, its tests to run by exact name; all
/// of them when empty). TCG runs CPU-bound code about 18 times slower than
/// the host (a namespace test takes 40 s or so there, one at a time), so
/// the whole suite would take hours; these exercise what differs between
/// kernels: the tc translators and their attach mode (clsact before 6.6,
/// TCX after), the sock_ops and sock_addr programs, conntrack and nftables
/// NAT, the recorders, a container's cgroup, crash cleanup of tc, adoption
/// and the hide-location programs. Everything else runs on the host kernel.
/// A file or test name that does not exist fails a unit test below.
pub const CORE_TESTS: &[(&str, &[&str])] = &[
    // The tc translators in the kernel (BPF_PROG_TEST_RUN): the verifier's
    // verdict on the oldest kernel, and the rewrite itself.
    ("tc_rewrite", &[]),
    // The same on what the translators parse and guard (issue 31): IPv6
    // extension headers, ICMP errors, spoofed fragments, TCP rebinding.
    ("tc_ipv6_ext", &[]),
    ("tc_icmp", &[]),
    ("tc_frag_spoof", &[]),
    ("tc_rebind", &[]),
    // Issue 32: an IPv4 flow carried over IPv6 (bpf_skb_change_proto, whose
    // GSO handling changed in 5.14) and the NAT guard (bpf_skc_lookup_tcp).
    ("tc_family", &[]),
    ("tc_nat_guard", &[]),
    // Issue 33: the anti-amplification budget of an unvalidated address.
    ("tc_budget", &[]),
    // Whole-map reads in batches (BPF_MAP_LOOKUP_BATCH), which listing,
    // housekeeping and status use.
    ("map_batch", &[]),
    // What vnatd --check says of this kernel (the fallbacks themselves are
    // simulated on the host: they do not depend on the kernel).
    (
        "kernel_features",
        &["check_lists_every_requirement_and_says_vnatd_can_run"],
    ),
    (
        "recorders",
        &[
            "tcp_recorded_only_in_enabled_cgroup_and_removed_on_close",
            "udp_v4_connected_sender_is_recorded",
        ],
    ),
    // TCP and UDP roams over IPv4 and IPv6.
    (
        "move_conn",
        &[
            "tcp_v4_laptop_changes_subnet",
            "tcp_v6_laptop_changes_subnet",
            "udp_v4_laptop_changes_subnet",
            "udp_v6_laptop_changes_subnet",
        ],
    ),
    ("nat", &["tcp_moves_from_one_nat_to_another"]),
    // Two real vnatd carry an IPv4 connection over IPv6 and back (the
    // RFC 5549 route and the translators on this kernel; issue 32).
    (
        "family_auto",
        &["tcp_v4_connection_goes_over_v6_by_itself_and_back"],
    ),
    // A move's hold ends by itself in tc (bpf_ktime_get_boot_ns in the
    // translators), on a real socket.
    (
        "hold_send_side",
        &["a_hold_nobody_releases_ends_by_itself_and_the_connection_lives"],
    ),
    // Suspend and resume.
    ("planned_mode", &[]),
    (
        "containers",
        &["a_containers_connection_moves_in_planned_mode"],
    ),
    ("crash_safety", &["laptop_killed_after_attaching_tc"]),
    // Adoption: reading a live socket's sequence numbers (vnat_peek, with
    // bpf_tcp_sock) and the sock_diag listing of sockets vnat never saw,
    // TCP and UDP (the other two adoption tests, 110 s more on 6.1, run on
    // the host kernel).
    (
        "adoption",
        &[
            "a_connection_opened_before_vnatd_started_on_both_hosts_moves",
            "a_connected_udp_socket_opened_before_vnatd_started_moves",
        ],
    ),
    (
        "hide_location",
        &["passive_ftp_fetches_after_the_client_moved_with_hide_location"],
    ),
];

/// `--smoke`: the least that shows a kernel runs vnat, for a kernel between
/// the oldest one supported (which runs the CORE_TESTS) and the host's (which
/// runs everything), where a whole core set would double CI's time: every
/// program through this kernel's verifier and what `vnatd --check` makes of
/// it, the tc rewrite on IPv4 and IPv6 and across families
/// (bpf_skb_change_proto), TCP over IPv4 and UDP over IPv6 moved through
/// the datapath, and a TCP connection moved by two real vnatd between NATs.
pub const SMOKE_TESTS: &[(&str, &[&str])] = &[
    (
        "kernel_features",
        &["check_lists_every_requirement_and_says_vnatd_can_run"],
    ),
    (
        "tc_rewrite",
        &[
            "ipv4_tcp_egress_rewrites_source_of_moved_laptop",
            "ipv4_with_options_udp_ingress_restores_virtual_endpoints",
            "ipv6_tcp_both_ends_moved_with_new_ports",
        ],
    ),
    (
        "tc_family",
        &["ipv4_tcp_leaves_as_ipv6_and_comes_back_as_ipv4"],
    ),
    (
        "move_conn",
        &[
            "tcp_v4_laptop_changes_subnet",
            "udp_v6_laptop_changes_subnet",
        ],
    ),
    ("nat", &["tcp_moves_from_one_nat_to_another"]),
];

/// What to run inside the VM for `cargo xtask test --kernel`.
pub enum Selection {
    /// The CORE_TESTS.
    Core,
    /// The SMOKE_TESTS.
    Smoke,
    /// Every test file.
    All,
    /// The named test files.
    Named(Vec<String>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn core_and_smoke_tests_exist() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/tests");
        for (name, tests) in CORE_TESTS.iter().chain(SMOKE_TESTS) {
            let path = dir.join(format!("{name}.rs"));
            let src = std::fs::read_to_string(&path).unwrap_or_else(|_| {
                panic!("CORE_TESTS names {name}, but there is no tests/tests/{name}.rs")
            });
            // A renamed test would otherwise match nothing and pass.
            for t in tests.iter() {
                assert!(
                    src.contains(&format!("fn {t}(")) || src.contains(&format!("{t}: \"")),
                    "CORE_TESTS names {name}::{t}, which tests/tests/{name}.rs does not define"
                );
            }
        }
    }
}
