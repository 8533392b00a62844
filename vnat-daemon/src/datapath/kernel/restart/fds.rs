//! Which process holds a socket inode, and under which descriptor, for the
//! levers that act on a socket through its process (`push`, `keepalive`,
//! `owner_of`).
//!
//! Each of those used to read `/proc/PID/fd` (and, for an accepted socket,
//! every process's) once per connection: a lever pulled on 100,000
//! connections of a server holding 100,000 descriptors was 10^10 readlinks,
//! and the peer's helper (TCP_USER_TIMEOUT for each connection of a host
//! gone silent) kept vnatd's datapath thread busy for minutes. One table of
//! every process's socket descriptors serves a whole batch: kept between
//! calls, read again when an inode asked for is missing but no sooner than
//! [`RESCAN`] nor ten times the last read's duration after it, and at least
//! every [`TTL`]. A descriptor found here is only a hint: the caller checks
//! the inode of what it took (`socket_of`) and falls back to reading the
//! process's own table.

use std::{
    cell::RefCell,
    collections::HashMap,
    time::{Duration, Instant},
};

const RESCAN: Duration = Duration::from_millis(100);
const TTL: Duration = Duration::from_secs(1);

#[derive(Default)]
struct Table {
    /// Socket inode to (pid, descriptor).
    by_inode: HashMap<u64, (u32, i32)>,
    /// When the last read ended, and what it took.
    read: Option<(Instant, Duration)>,
}

thread_local! {
    static TABLE: RefCell<Table> = RefCell::new(Table::default());
}

/// The process and descriptor holding the socket `inode`, from the table
/// (see the module's comment).
pub(super) fn holder(inode: u64) -> Option<(u32, i32)> {
    TABLE.with(|t| {
        let mut t = t.borrow_mut();
        let now = Instant::now();
        let stale = match t.read {
            None => true,
            Some((at, took)) => {
                let age = now.saturating_duration_since(at);
                age >= TTL || (age >= RESCAN.max(took * 10) && !t.by_inode.contains_key(&inode))
            }
        };
        if stale {
            t.by_inode = super::super::procfs::socket_fds();
            t.read = Some((Instant::now(), now.elapsed()));
        }
        t.by_inode.get(&inode).copied()
    })
}
