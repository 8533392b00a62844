//! Per connection and direction replay window (the sliding bitmap of RFC
//! 4303 section 3.4.3, 128 sequence numbers wide).
//!
//! Checking and committing are separate so that a record can be refused for
//! another reason (a stale update) after the window check without leaving a
//! trace: "no state change" on every rejection.

use serde::{Deserialize, Serialize};

/// Width of the window in sequence numbers.
pub const WINDOW: u64 = 128;

/// Why a sequence number was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error("sequence number {0} is older than the replay window")]
    TooOld(u64),
    #[error("sequence number {0} was already seen")]
    Duplicate(u64),
}

/// The highest sequence number seen and a bitmap of the `WINDOW` numbers
/// ending at it (bit 0 = `highest`). Sequence numbers start at 1.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplayWindow {
    highest: u64,
    bitmap: u128,
}

impl ReplayWindow {
    pub fn highest(&self) -> u64 {
        self.highest
    }

    /// Would `seq` be accepted? Does not change the window.
    pub fn check(&self, seq: u64) -> Result<(), ReplayError> {
        if seq == 0 {
            return Err(ReplayError::TooOld(seq));
        }
        if seq > self.highest {
            return Ok(());
        }
        let back = self.highest - seq;
        if back >= WINDOW {
            return Err(ReplayError::TooOld(seq));
        }
        if self.bitmap & (1u128 << back) != 0 {
            return Err(ReplayError::Duplicate(seq));
        }
        Ok(())
    }

    /// Record `seq` as seen. Call only after `check` accepted it.
    pub fn commit(&mut self, seq: u64) {
        if seq > self.highest {
            let shift = seq - self.highest;
            self.bitmap = if shift >= WINDOW {
                0
            } else {
                self.bitmap << shift
            };
            self.bitmap |= 1;
            self.highest = seq;
        } else {
            let back = self.highest - seq;
            if back < WINDOW {
                self.bitmap |= 1u128 << back;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// The simple model: a number is accepted if it was never accepted
    /// before and is within WINDOW of the highest accepted number.
    struct Model {
        seen: HashSet<u64>,
        highest: u64,
    }

    impl Model {
        fn accept(&mut self, s: u64) -> bool {
            let ok = s != 0 && !self.seen.contains(&s) && s + WINDOW > self.highest;
            if ok {
                self.seen.insert(s);
                self.highest = self.highest.max(s);
            }
            ok
        }
    }

    proptest! {
        #[test]
        fn window_agrees_with_model(seqs in proptest::collection::vec(0u64..400, 1..300)) {
            let mut w = ReplayWindow::default();
            let mut m = Model { seen: HashSet::new(), highest: 0 };
            for s in seqs {
                let got = w.check(s).is_ok();
                if got {
                    w.commit(s);
                }
                prop_assert_eq!(got, m.accept(s), "disagreement at {}", s);
            }
        }
    }

    #[test]
    fn edges() {
        let mut w = ReplayWindow::default();
        assert_eq!(w.check(0), Err(ReplayError::TooOld(0)));
        w.commit(1000);
        assert_eq!(w.check(1000), Err(ReplayError::Duplicate(1000)));
        assert_eq!(
            w.check(1000 - WINDOW),
            Err(ReplayError::TooOld(1000 - WINDOW))
        );
        assert!(w.check(1000 - WINDOW + 1).is_ok());
        assert!(w.check(u64::MAX).is_ok());
    }
}
