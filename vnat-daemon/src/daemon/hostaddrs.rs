//! Which addresses this host has had, and when: the evidence vnatd needs
//! before it manages a connection (DESIGN.md §8, "local users").
//!
//! A local user can bind a socket to any address with IP_FREEBIND or
//! IP_TRANSPARENT and send from it. Managed, such a flow would look moved
//! (its address is not here), and vnatd, which runs as root, would put that
//! address on `lo` and route it: the user's listener on it would then
//! receive other users' connections to it. So a connection is managed only
//! if its local address was on an interface of this host when the kernel
//! recorded it.
//!
//! The record says when (CLOCK_BOOTTIME); this book says when each address
//! was here. It is kept in the state directory (`addresses.json`), so a
//! vnatd started after the host moved (a crash in the middle of a move, a
//! restart while on another network) still knows that a connection's
//! vanished address was the host's, and takes it over. A book of another
//! boot is dropped: the records it would vouch for are gone too.

use std::{
    collections::{BTreeMap, HashSet},
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::identity;

/// Slack on each side of a stretch, in seconds: records are stamped to the
/// second (`age_secs`), and vnatd sees an address come or go a moment after
/// the kernel does.
pub const GRACE_SECS: u64 = 5;

/// Stretches kept per address, and addresses kept (the oldest go first).
const STRETCHES_PER_ADDRESS: usize = 4;
const ADDRESSES_MAX: usize = 1024;

/// One stretch of time an address was on an interface, CLOCK_BOOTTIME
/// seconds; `until: None` while it still is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Stretch {
    from: u64,
    until: Option<u64>,
}

#[derive(Default, Serialize, Deserialize)]
struct File {
    boot_id: String,
    addresses: BTreeMap<IpAddr, Vec<Stretch>>,
}

/// This host's addresses now, and the stretches each one was here.
#[derive(Debug, Default)]
pub struct HostAddresses {
    /// Where the book is kept; `None`: in memory only (tests).
    path: Option<PathBuf>,
    boot_id: String,
    book: BTreeMap<IpAddr, Vec<Stretch>>,
    current: HashSet<IpAddr>,
    /// No update yet in this process: what changed since the book was
    /// written happened while no vnatd was looking.
    fresh: bool,
    /// Changed since it was last written ([`HostAddresses::save_if_changed`]).
    dirty: bool,
    /// A thread that writes what it is sent (the latest of what is
    /// waiting), so that the driver never waits for the fsyncs; `None`:
    /// written at once (tests).
    writer: Option<std::sync::mpsc::Sender<Vec<u8>>>,
}

pub(super) fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

impl HostAddresses {
    /// A book kept in memory only.
    pub fn in_memory() -> HostAddresses {
        HostAddresses {
            fresh: true,
            ..HostAddresses::default()
        }
    }

    /// The book of `state_dir`; a missing or unreadable one, or one of an
    /// earlier boot, starts empty (with a warning if it was unreadable).
    pub fn load(state_dir: &Path) -> HostAddresses {
        let path = state_dir.join("addresses.json");
        let boot_id = boot_id();
        let book = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<File>(&bytes) {
                Ok(f) if f.boot_id == boot_id && !boot_id.is_empty() => f.addresses,
                Ok(_) => BTreeMap::new(),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "ignoring an unreadable address book; connections whose address already left this host are not managed");
                    BTreeMap::new()
                }
            },
            Err(_) => BTreeMap::new(),
        };
        HostAddresses {
            path: Some(path),
            boot_id,
            book,
            current: HashSet::new(),
            fresh: true,
            dirty: false,
            writer: None,
        }
    }

    /// Write the book from a thread of its own from now on.
    pub fn in_background(mut self) -> HostAddresses {
        let Some(path) = self.path.clone() else {
            return self;
        };
        let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
        let spawned = std::thread::Builder::new()
            .name("vnat-addrbook".into())
            .spawn(move || {
                while let Ok(mut bytes) = rx.recv() {
                    while let Ok(newer) = rx.try_recv() {
                        bytes = newer;
                    }
                    write_book(&path, &bytes);
                }
            });
        match spawned {
            Ok(_) => self.writer = Some(tx),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the address book's writer; writing it in line")
            }
        }
        self
    }

    /// Take a fresh list of the interfaces' addresses at `now` (CLOCK_BOOTTIME
    /// seconds). The book is written by [`HostAddresses::save_if_changed`]:
    /// an address change is when a move starts, and the write (with its
    /// fsyncs) must not delay that move's first datagram.
    pub fn update(&mut self, now: u64, addrs: HashSet<IpAddr>) {
        let mut changed = false;
        for ip in &addrs {
            let stretches = self.book.entry(*ip).or_default();
            if stretches.last().is_some_and(|s| s.until.is_none()) {
                continue;
            }
            // Seen for the first time: since now, unless no vnatd was
            // looking, in which case since it last could have (its last
            // stretch's end), or since boot if the book never saw it.
            let from = if self.fresh {
                stretches.last().and_then(|s| s.until).unwrap_or(0)
            } else {
                now
            };
            stretches.push(Stretch { from, until: None });
            if stretches.len() > STRETCHES_PER_ADDRESS {
                stretches.remove(0);
            }
            changed = true;
        }
        for (ip, stretches) in self.book.iter_mut() {
            if addrs.contains(ip) {
                continue;
            }
            if let Some(open) = stretches.last_mut().filter(|s| s.until.is_none()) {
                open.until = Some(now);
                changed = true;
            }
        }
        if self.book.len() > ADDRESSES_MAX {
            let mut gone: Vec<(u64, IpAddr)> = self
                .book
                .iter()
                .filter_map(|(ip, s)| Some((s.last()?.until?, *ip)))
                .collect();
            gone.sort();
            for (_, ip) in gone.iter().take(self.book.len() - ADDRESSES_MAX) {
                self.book.remove(ip);
            }
        }
        self.current = addrs;
        self.fresh = false;
        self.dirty |= changed;
    }

    /// Write the book if it changed since it was last written.
    pub fn save_if_changed(&mut self) {
        if !std::mem::take(&mut self.dirty) {
            return;
        }
        let Some(path) = &self.path else {
            return;
        };
        let file = File {
            boot_id: self.boot_id.clone(),
            addresses: self.book.clone(),
        };
        let bytes = match serde_json::to_vec_pretty(&file) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode the address book");
                return;
            }
        };
        match &self.writer {
            Some(tx) => {
                if let Err(e) = tx.send(bytes) {
                    // The writer is gone: write in line from now on.
                    self.writer = None;
                    write_book(path, &e.0);
                }
            }
            None => write_book(path, &bytes),
        }
    }

    /// Whether a connection at local address `ip`, recorded at
    /// `recorded_at` (CLOCK_BOOTTIME seconds), may be managed: `ip` is on an
    /// interface of this host, or was when the connection was recorded.
    pub fn may_manage(&self, ip: IpAddr, recorded_at: u64) -> bool {
        self.current.contains(&ip)
            || self.book.get(&ip).is_some_and(|stretches| {
                stretches.iter().any(|s| {
                    s.from <= recorded_at.saturating_add(GRACE_SECS)
                        && s.until
                            .is_none_or(|u| recorded_at <= u.saturating_add(GRACE_SECS))
                })
            })
    }
}

fn write_book(path: &Path, bytes: &[u8]) {
    if let Err(e) = identity::write_atomic(path, bytes) {
        tracing::warn!(error = %e, "cannot write the address book; after a restart, connections whose address already left this host will not be managed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addrs(list: &[&str]) -> HashSet<IpAddr> {
        list.iter().map(|a| a.parse().expect("ip")).collect()
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("ip")
    }

    #[test]
    fn only_connections_recorded_at_this_host_s_addresses_are_managed() {
        let mut h = HostAddresses::in_memory();
        h.update(100, addrs(&["198.18.1.2", "fd00:1::2"]));
        assert!(h.may_manage(ip("198.18.1.2"), 100));
        assert!(h.may_manage(ip("fd00:1::2"), 100));
        // A freebind socket on an address the host never had.
        assert!(!h.may_manage(ip("198.18.1.77"), 100));
        assert!(!h.may_manage(ip("fd00:1::77"), 100));
        // The laptop moved at 200: connections recorded before still
        // count, whenever vnatd first sees them; a socket bound to the old
        // address afterwards does not.
        h.update(200, addrs(&["198.18.2.2"]));
        assert!(h.may_manage(ip("198.18.1.2"), 150));
        assert!(h.may_manage(ip("198.18.1.2"), 200 + GRACE_SECS));
        assert!(!h.may_manage(ip("198.18.1.2"), 200 + GRACE_SECS + 1));
        // B arrived at 200 with this vnatd watching: a connection recorded
        // long before at B's address was a socket bound while it was not
        // here.
        h.update(300, addrs(&[]));
        assert!(h.may_manage(ip("198.18.2.2"), 250));
        assert!(!h.may_manage(ip("198.18.2.2"), 100));
    }

    #[test]
    fn a_restarted_vnatd_remembers_what_the_host_had() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut h = HostAddresses::load(dir.path());
        h.update(100, addrs(&["198.18.1.2"]));
        h.save_if_changed();
        // vnatd dies; the laptop moves meanwhile; a new vnatd starts.
        let mut h = HostAddresses::load(dir.path());
        h.update(400, addrs(&["198.18.2.2"]));
        h.save_if_changed();
        assert!(
            h.may_manage(ip("198.18.1.2"), 120),
            "a connection recorded while A was here"
        );
        assert!(
            !h.may_manage(ip("198.18.1.2"), 400 + GRACE_SECS + 1),
            "a socket bound to A after the new vnatd saw it gone"
        );
        // A book of another boot vouches for nothing.
        let path = dir.path().join("addresses.json");
        let mut f: File = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        f.boot_id = "another boot".into();
        std::fs::write(&path, serde_json::to_vec(&f).unwrap()).unwrap();
        let mut h = HostAddresses::load(dir.path());
        h.update(500, addrs(&["198.18.2.2"]));
        assert!(!h.may_manage(ip("198.18.1.2"), 120));
        // A corrupt one neither, and is not fatal.
        std::fs::write(&path, b"{").unwrap();
        let mut h = HostAddresses::load(dir.path());
        h.update(500, addrs(&["198.18.2.2"]));
        assert!(!h.may_manage(ip("198.18.1.2"), 120));
    }

    #[test]
    fn the_book_is_bounded() {
        let mut h = HostAddresses::in_memory();
        for t in 0..10u64 {
            h.update(t * 10, addrs(&["198.18.1.2"]));
            h.update(t * 10 + 5, addrs(&[]));
        }
        assert_eq!(h.book[&ip("198.18.1.2")].len(), STRETCHES_PER_ADDRESS);
        for n in 0..(ADDRESSES_MAX as u32 + 10) {
            let a = std::net::Ipv4Addr::from(0x0a00_0000 + n).to_string();
            h.update(1000 + u64::from(n), addrs(&[&a]));
        }
        assert!(h.book.len() <= ADDRESSES_MAX + 1);
    }
}
