//! The kernel's per-CPU receive backlog, which every namespace of this
//! machine shares, and the packets it dropped.
//!
//! A veth hands each packet to the receiving CPU's backlog
//! (`netdev_max_backlog`, 1,000 packets by default), so the laptop, the
//! router, the delay line and the server all queue into the same two
//! queues here, where separate machines would each have their own. When a
//! mass move makes tens of thousands of sockets retransmit at once, those
//! queues overflow, and TCP reads the drop as local congestion: it retries
//! every 500 ms without backing off, and a socket whose unsent data waits
//! behind such failures (nothing in flight: TCP's probe timer) gives up
//! after `tcp_retries2` = 15 of them, 7.5 s, with ETIMEDOUT. At 100,000
//! connections that is what killed 13,000 to 27,000 of them (the laptop's
//! `TCPAbortOnTimeout`, with hundreds of thousands of backlog drops a
//! second); with the backlog raised to 100,000 none died. So the benchmark
//! raises it for large runs, says so, and counts the drops.

use std::path::Path;

use anyhow::{Context, Result};

const SYSCTL: &str = "/proc/sys/net/core/netdev_max_backlog";

/// The backlog set for a run, put back as it was when dropped.
pub struct Raised {
    before: u64,
}

/// The backlog now.
pub fn current() -> Result<u64> {
    read(Path::new(SYSCTL))
}

fn read(path: &Path) -> Result<u64> {
    let s = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    s.trim()
        .parse()
        .with_context(|| format!("{} holds {s:?}, not a number", path.display()))
}

/// Set the backlog to `to` for the run (nothing when it is that already);
/// the guard puts the old value back.
pub fn raise(to: u64) -> Result<Option<Raised>> {
    let before = current()?;
    if before == to {
        return Ok(None);
    }
    std::fs::write(SYSCTL, to.to_string())
        .with_context(|| format!("setting {SYSCTL} to {to} (needs root)"))?;
    Ok(Some(Raised { before }))
}

impl Drop for Raised {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(SYSCTL, self.before.to_string()) {
            eprintln!(
                "restore: could not put {SYSCTL} back to {}: {e}",
                self.before
            );
        }
    }
}

/// The backlog a run of `conns` connections gets: `given` when the user
/// chose (0: the machine's own), else the number of connections when more
/// than 20,000 and more than the machine's, else the machine's.
pub fn for_run(conns: usize, given: Option<u64>, machine: u64) -> u64 {
    match given {
        Some(0) => machine,
        Some(n) => n,
        None if conns > 20_000 => machine.max(conns as u64),
        None => machine,
    }
}

/// Packets all CPUs' backlogs dropped since boot (the second column of
/// /proc/net/softnet_stat, hexadecimal, one line per CPU).
pub fn drops() -> Option<u64> {
    drops_of(&std::fs::read_to_string("/proc/net/softnet_stat").ok()?)
}

fn drops_of(stat: &str) -> Option<u64> {
    stat.lines()
        .map(|l| u64::from_str_radix(l.split_whitespace().nth(1)?, 16).ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drops_are_the_second_hex_column_summed_over_cpus() {
        let stat = "0000a000 000003e8 00000001 00000000\n00000010 0000000a 00000000 00000000\n";
        assert_eq!(drops_of(stat), Some(1000 + 10));
        assert_eq!(drops_of("00000001\n"), None);
        assert_eq!(drops_of("0001 zz\n"), None);
    }

    #[test]
    fn large_runs_get_a_backlog_as_large_as_their_connections() {
        assert_eq!(for_run(100_000, None, 1000), 100_000);
        assert_eq!(for_run(100_000, None, 200_000), 200_000);
        assert_eq!(for_run(10_000, None, 1000), 1000);
        assert_eq!(for_run(100_000, Some(0), 1000), 1000);
        assert_eq!(for_run(500, Some(5000), 1000), 5000);
    }
}
