//! CRIU's network lock on the dumping host, and its removal by the hook.
//!
//! `criu dump --tcp-established --network-lock nftables` locks each dumped
//! TCP connection while it dumps it (criu/net.c, netfilter.c): a table
//! `inet CRIU-<id>` whose sets `conns4`/`conns6` hold the connection's
//! tuple both ways, dropped at input and output. After a successful dump
//! CRIU leaves the table: the sockets are gone, so without it the kernel
//! would answer the peer's next segment with a reset. After a failed dump
//! CRIU deletes it itself (`cr_dump_finish` -> `network_unlock`).
//!
//! Nobody removed the table after a successful dump, so the peers' packets
//! of a connection whose process was never restored were silently dropped
//! until their TCP gave up (`tcp_retries2`, about 15 minutes), and the
//! tuple stayed blackholed on the old host for good (a process moved back
//! with the same connection could not use it). The lock is needed only
//! until the peers send to the new host: they hold their packets from
//! pre-dump until the connection has moved, typically well under a second
//! after the restore. So at post-dump, once the export is written, the hook
//! starts a detached process that deletes the tables locking the exported
//! connections after `--unlock-after` seconds: late enough for a restore
//! (with the transfer of the images) to have happened, and from then on a
//! peer whose connection did not move is told at once (a reset) instead of
//! hanging. The hook never deletes a table that locks anything else.
use std::{
    net::SocketAddr,
    process::{Command, Stdio},
    time::Duration,
};

/// How long the dumping host keeps CRIU's lock after the export, by
/// default: a restore with the images carried over a network takes
/// seconds; the peers hold their packets meanwhile (up to their limit).
pub const UNLOCK_AFTER_DEFAULT_SECS: u64 = 30;

/// The tables CRIU's nftables lock made, from `nft list tables`.
pub fn lock_tables(list_tables: &str) -> Vec<String> {
    list_tables
        .lines()
        .filter_map(|l| l.trim().strip_prefix("table inet "))
        .map(str::trim)
        .filter(|t| t.starts_with("CRIU-") && valid_name(t))
        .map(str::to_string)
        .collect()
}

/// Names are passed to `nft` (not through a shell), but a name with
/// anything else than CRIU's letters, digits and dashes is not CRIU's.
fn valid_name(t: &str) -> bool {
    t.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

/// The set element CRIU adds for the tuple (`nft list table` prints
/// `198.18.3.2 . 7100 . 198.18.1.2 . 55696`).
fn element(local: SocketAddr, remote: SocketAddr) -> String {
    format!(
        "{} . {} . {} . {}",
        local.ip(),
        local.port(),
        remote.ip(),
        remote.port()
    )
}

/// Whether the table listed as `table_text` locks only connections among
/// `tuples` (`local`, `remote`) and at least one of them: the tables the
/// hook may delete. A table locking any other tuple (another dump's) is
/// left alone.
pub fn locks_only(table_text: &str, tuples: &[(SocketAddr, SocketAddr)]) -> bool {
    let ours: Vec<String> = tuples
        .iter()
        .flat_map(|(l, r)| [element(*l, *r), element(*r, *l)])
        .collect();
    let mut any = false;
    for e in elements(table_text) {
        if !ours.contains(&e) {
            return false;
        }
        any = true;
    }
    any
}

/// The elements of the sets in a table's listing: what stands between
/// `elements = {` and `}`, split at commas, across lines.
fn elements(table_text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = table_text;
    while let Some(start) = rest.find("elements = {") {
        let after = &rest[start + "elements = {".len()..];
        let Some(end) = after.find('}') else { break };
        out.extend(
            after[..end]
                .split(',')
                .map(|e| e.split_whitespace().collect::<Vec<_>>().join(" "))
                .filter(|e| !e.is_empty()),
        );
        rest = &after[end..];
    }
    out
}

/// Why the lock could not be handed to a remover (the dump goes on: the
/// lock then stays, as without the hook).
#[derive(Debug, thiserror::Error)]
pub enum UnlockError {
    #[error("cannot run nft to find CRIU's network lock ({0}); delete the table inet CRIU-... by hand once the process runs on the new host")]
    Nft(std::io::Error),
    #[error("cannot start the process that removes CRIU's network lock ({0}); delete the table inet CRIU-... by hand once the process runs on the new host")]
    Spawn(std::io::Error),
}

fn nft(args: &[&str]) -> Result<String, UnlockError> {
    let out = Command::new("nft")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(UnlockError::Nft)?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The lock tables that lock only the exported `tuples` (in this network
/// namespace, the hook's, which is the dumped tree's).
pub fn find(tuples: &[(SocketAddr, SocketAddr)]) -> Result<Vec<String>, UnlockError> {
    let mut out = Vec::new();
    for t in lock_tables(&nft(&["list", "tables"])?) {
        if locks_only(&nft(&["list", "table", "inet", &t])?, tuples) {
            out.push(t);
        }
    }
    Ok(out)
}

/// Start a process, in a session of its own and outlasting the hook (CRIU
/// waits for the hook), that deletes `tables` after `after`.
pub fn remove_later(tables: &[String], after: Duration) -> Result<(), UnlockError> {
    if tables.is_empty() {
        return Ok(());
    }
    let mut script = format!("sleep {}", after.as_secs_f64());
    for t in tables {
        // `t` is letters, digits and dashes only (lock_tables).
        script.push_str(&format!("; nft delete table inet {t}"));
    }
    // setsid(1) -f: a session of its own, forked, so CRIU's wait for the
    // hook ends now and the remover is nobody's zombie.
    let status = Command::new("setsid")
        .args(["-f", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(UnlockError::Spawn)?;
    if !status.success() {
        return Err(UnlockError::Spawn(std::io::Error::other(format!(
            "setsid exited with {status}"
        ))));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `nft list table` printed for CRIU 4.2's lock of one connection.
    const TABLE: &str = "table inet CRIU-6379e225-eb8f-4312-bc {
\tset conns4 {
\t\ttype ipv4_addr . inet_service . ipv4_addr . inet_service
\t\telements = { 198.18.3.2 . 7100 . 198.18.1.2 . 55696,
\t\t\t     198.18.1.2 . 55696 . 198.18.3.2 . 7100 }
\t}
\tset conns6 {
\t\ttype ipv6_addr . inet_service . ipv6_addr . inet_service
\t}
\tchain input {
\t\ttype filter hook input priority filter; policy accept;
\t\tmeta mark 0x0000c114 accept
\t\tip saddr . tcp sport . ip daddr . tcp dport @conns4 drop
\t}
}
";

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn criu_lock_tables_are_found_by_name() {
        let list = "table inet CRIU-6379e225-eb8f-4312-bc\ntable ip nat\ntable inet CRIU-x;rm\ntable inet filter\n";
        assert_eq!(lock_tables(list), vec!["CRIU-6379e225-eb8f-4312-bc"]);
    }

    #[test]
    fn only_a_table_locking_nothing_but_the_exported_connections_is_removed() {
        let ours = [(a("198.18.3.2:7100"), a("198.18.1.2:55696"))];
        assert!(locks_only(TABLE, &ours));
        // Another dump's connection in the same table: leave it.
        let other = [(a("198.18.3.2:7100"), a("198.18.1.2:55697"))];
        assert!(!locks_only(TABLE, &other));
        // A table locking nothing is no lock of ours.
        let empty = TABLE.replace(
            "elements = { 198.18.3.2 . 7100 . 198.18.1.2 . 55696,\n\t\t\t     198.18.1.2 . 55696 . 198.18.3.2 . 7100 }",
            "",
        );
        assert!(!locks_only(&empty, &ours));
        let v6 = "set conns6 {\n elements = { 2001:db8:3::2 . 7100 . 2001:db8:1::2 . 40000,\n 2001:db8:1::2 . 40000 . 2001:db8:3::2 . 7100 }\n}";
        assert!(locks_only(
            v6,
            &[(a("[2001:db8:3::2]:7100"), a("[2001:db8:1::2]:40000"))]
        ));
    }
}
