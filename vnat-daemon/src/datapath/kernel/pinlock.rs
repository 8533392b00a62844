//! One owner per pin directory.
//!
//! The process that opens the datapath writes the config map, forgets the
//! NAT guards a previous vnatd left, reconciles held entries and routes, and
//! from then on keeps a copy of the NAT maps that only it writes. A second
//! process doing the same under a running vnatd (a second vnatd given its
//! own control socket but the same `--bpffs`, a tool) would undo what the
//! first set up: it marked the NAT maps empty while the first's copy said
//! otherwise, and the first's next translation then went unread by the tc
//! programs, its packets passing untranslated (the peer's reset followed).
//!
//! So the owner holds an exclusive `flock` on the pin directory for as long
//! as its datapath is open (the kernel drops it when the process ends, however
//! it ends). Readers that only look (`KernelDatapath::observe`) take no lock
//! and write nothing.

use std::{
    os::fd::OwnedFd,
    path::Path,
    time::{Duration, Instant},
};

use nix::fcntl::{Flock, FlockArg};

use crate::datapath::DatapathError;

/// How long an opener waits for the lock before saying who holds it: a tool
/// or a test that had the datapath open for a moment lets go within it.
const WAIT: Duration = Duration::from_secs(2);

/// The exclusive lock on a pin directory, held until dropped.
pub struct PinLock {
    _lock: Flock<OwnedFd>,
}

impl std::fmt::Debug for PinLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PinLock")
    }
}

impl PinLock {
    /// Take the lock on `dir` (which exists), waiting up to [`WAIT`].
    pub fn take(dir: &Path) -> Result<PinLock, DatapathError> {
        let deadline = Instant::now() + WAIT;
        loop {
            match Self::try_take(dir)? {
                Some(lock) => return Ok(lock),
                None if Instant::now() >= deadline => {
                    return Err(DatapathError::PinsInUse {
                        path: dir.to_path_buf(),
                    })
                }
                None => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Take the lock if nobody holds it (`None`: somebody does).
    pub fn try_take(dir: &Path) -> Result<Option<PinLock>, DatapathError> {
        let bad = |reason: String| DatapathError::Bpffs {
            path: dir.to_path_buf(),
            reason,
        };
        let fd: OwnedFd = std::fs::File::open(dir)
            .map_err(|e| bad(format!("cannot open it to lock it: {e}")))?
            .into();
        match Flock::lock(fd, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => Ok(Some(PinLock { _lock: lock })),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
            Err((_, e)) => Err(bad(format!("cannot lock it: {e}"))),
        }
    }

    /// Whether some process holds the lock on `dir` now (a directory that
    /// does not exist is held by nobody).
    pub fn held(dir: &Path) -> bool {
        if !dir.exists() {
            return false;
        }
        matches!(Self::try_take(dir), Ok(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_owner_at_a_time_and_the_lock_goes_with_it() {
        let dir = std::env::temp_dir().join(format!("vnat-pinlock-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert!(!PinLock::held(&dir));
        let first = PinLock::take(&dir).expect("the first owner");
        assert!(PinLock::held(&dir));
        assert!(PinLock::try_take(&dir).unwrap().is_none());
        let t = Instant::now();
        let refused = PinLock::take(&dir).expect_err("a second owner");
        assert!(t.elapsed() >= WAIT, "gave up before waiting");
        assert!(refused.to_string().contains("stop it first"), "{refused}");
        drop(first);
        assert!(!PinLock::held(&dir));
        let _second = PinLock::take(&dir).expect("once the first let go");
        assert!(!PinLock::held(&dir.join("missing")));
        std::fs::remove_dir(&dir).unwrap();
    }
}
