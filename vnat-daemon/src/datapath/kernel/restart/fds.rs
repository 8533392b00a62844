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
//! every [`TTL`] (or that tenfold duration). `ls` finds the processes of
//! accepted connections here too. A descriptor found here is only a hint:
//! the caller checks the inode of what it took (`socket_of`) and falls back
//! to reading the process's own table.

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
    /// One table per process, for a lever that knows the socket's process
    /// (the push lever): reading that process's descriptors, not every
    /// process's (3 to 4 ms on a quiet host, paid by the first lever of a
    /// one-connection move).
    static BY_PID: RefCell<HashMap<u32, Table>> = RefCell::new(HashMap::new());
}

/// The shared table's answer for `inode` as it stands, without reading
/// anything (a hint, like every answer here).
pub(in crate::datapath::kernel) fn known(inode: u64) -> Option<(u32, i32)> {
    TABLE.with(|t| t.borrow().by_inode.get(&inode).copied())
}

/// The descriptor under which process `pid` holds the socket `inode`, from
/// that process's table (read again on the rules of the shared one).
pub(in crate::datapath::kernel) fn holder_in(pid: u32, inode: u64) -> Option<i32> {
    BY_PID.with(|t| {
        let mut t = t.borrow_mut();
        let now = Instant::now();
        // A table older than TTL would be read again anyway: dropping it
        // loses nothing and keeps exited processes from piling up.
        t.retain(|p, tab| {
            *p == pid
                || tab.read.is_some_and(|(at, took)| {
                    now.saturating_duration_since(at) < TTL.max(took * 10)
                })
        });
        t.entry(pid)
            .or_default()
            .holder(inode, now, || super::super::procfs::socket_fds_of(pid))
            .map(|(_, fd)| fd)
    })
}

/// The process and descriptor holding the socket `inode`, from the table
/// (see the module's comment).
pub(in crate::datapath::kernel) fn holder(inode: u64) -> Option<(u32, i32)> {
    TABLE.with(|t| {
        t.borrow_mut()
            .holder(inode, Instant::now(), super::super::procfs::socket_fds)
    })
}

impl Table {
    fn holder(
        &mut self,
        inode: u64,
        now: Instant,
        scan: impl FnOnce() -> HashMap<u64, (u32, i32)>,
    ) -> Option<(u32, i32)> {
        let stale = match self.read {
            None => true,
            Some((at, took)) => {
                let age = now.saturating_duration_since(at);
                // At most a tenth of the time spent reading, whatever asks.
                let spacing = took * 10;
                age >= TTL.max(spacing)
                    || (age >= RESCAN.max(spacing) && !self.by_inode.contains_key(&inode))
            }
        };
        if stale {
            let started = Instant::now();
            self.by_inode = scan();
            self.read = Some((now, started.elapsed()));
        }
        self.by_inode.get(&inode).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_read_again_only_for_a_new_inode_and_not_too_often() {
        let scans = std::cell::Cell::new(0);
        let scan = |m: &[(u64, u32)]| {
            scans.set(scans.get() + 1);
            m.iter()
                .map(|&(i, p)| (i, (p, 3)))
                .collect::<HashMap<u64, (u32, i32)>>()
        };
        let of = |t: &mut Table, inode, at| t.holder(inode, at, HashMap::new).map(|(p, _)| p);
        let t0 = Instant::now();
        let mut t = Table::default();
        assert_eq!(t.holder(1, t0, || scan(&[(1, 10), (2, 20)])), Some((10, 3)));
        assert_eq!((of(&mut t, 2, t0), scans.get()), (Some(20), 1));
        // All known: no read, however often asked.
        for s in 1..9 {
            t.holder(1, t0 + Duration::from_millis(s * 100), || scan(&[]));
        }
        assert_eq!(scans.get(), 1);
        // A new inode: read again once RESCAN has passed, not before.
        assert_eq!(t.holder(3, t0 + RESCAN / 2, || scan(&[])), None);
        assert_eq!(scans.get(), 1);
        let t1 = t0 + RESCAN;
        assert_eq!(t.holder(3, t1, || scan(&[(1, 10), (3, 30)])), Some((30, 3)));
        assert_eq!((of(&mut t, 2, t1), scans.get()), (None, 2));
        // A read that took long (a 100,000-descriptor server) is not done
        // again for ten times as long.
        t.read = Some((t1, Duration::from_millis(300)));
        t.holder(4, t1 + Duration::from_millis(2900), || scan(&[]));
        assert_eq!(scans.get(), 2);
        let t2 = t1 + Duration::from_secs(3);
        assert_eq!(t.holder(4, t2, || scan(&[(3, 30), (4, 40)])), Some((40, 3)));
        assert_eq!(scans.get(), 3);
        // A socket passed to another process shows within TTL.
        assert_eq!(t.holder(3, t2 + TTL, || scan(&[(3, 31)])), Some((31, 3)));
        assert_eq!(scans.get(), 4);
    }
}
