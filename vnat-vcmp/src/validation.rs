//! Path validations under way: a CHALLENGE sent to a peer's announced new
//! address, waiting for its RESPONSE. An owned part of the endpoint, with
//! its deadlines in order (the next one is the first entry, the due ones a
//! prefix) and its validations by nonce (a RESPONSE finds its own at once),
//! so that neither the loop's next deadline nor an answer is a scan of
//! every validation: a move of thousands of keyless connections makes one
//! each.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use crate::{crypto, flow::VirtualFlow, Timestamp};

/// Path validations are batched per (new address, peer host): one
/// CHALLENGE covers every connection of that host that claimed the address.
/// Connections whose host is unknown (imported ones) are validated alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Group {
    Host([u8; 32]),
    Conn(VirtualFlow),
}

pub(crate) type ValidationKey = (IpAddr, Group);

pub(crate) struct Validation {
    pub anchor: VirtualFlow,
    /// Where the challenge goes: the peer's VCMP at the new address, or
    /// behind a NAT the address its update came from.
    pub dst: SocketAddr,
    pub nonce: [u8; 16],
    pub flows: HashSet<VirtualFlow>,
    pub tries: u32,
    pub deadline: Timestamp,
    /// When the last CHALLENGE left.
    pub sent: Timestamp,
}

/// What [`Validations::join`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Join {
    /// No validation of that key is under way.
    None,
    /// The flow joined the validation under way.
    Added,
    /// The flow was in it already: its peer retried its update, so it has
    /// not heard our answer, and may not have had our CHALLENGE either.
    Again,
}

#[derive(Default)]
pub(crate) struct Validations {
    live: HashMap<ValidationKey, Validation>,
    by_nonce: HashMap<[u8; 16], ValidationKey>,
    order: BTreeSet<(Timestamp, ValidationKey)>,
}

impl Validations {
    /// Gives back room a burst left (`crate::room`).
    pub fn shrink_sparse(&mut self) {
        use crate::room::Shrink;
        self.live.shrink_sparse();
        self.by_nonce.shrink_sparse();
    }

    /// Add `flow` to the validation of `key` if one is under way.
    pub fn join(&mut self, key: &ValidationKey, flow: VirtualFlow) -> Join {
        let Some(v) = self.live.get_mut(key) else {
            return Join::None;
        };
        if v.flows.insert(flow) {
            Join::Added
        } else {
            Join::Again
        }
    }

    /// The validation of `key` sends its CHALLENGE again now, unless one
    /// left less than `gap` ago, and waits at least `wait` for the answer
    /// (its deadline moves no earlier; its tries are not counted: this
    /// send answers the peer's, it is not a timeout's). Returns the anchor,
    /// nonce and destination to send it with.
    pub fn again(
        &mut self,
        key: &ValidationKey,
        now: Timestamp,
        gap: Duration,
        wait: Duration,
    ) -> Option<(VirtualFlow, [u8; 16], SocketAddr)> {
        let v = self.live.get(key)?;
        if now.since(v.sent) < gap {
            return None;
        }
        let mut v = self.remove(key)?;
        v.sent = now;
        v.deadline = v.deadline.max(now.plus(wait));
        let out = (v.anchor, v.nonce, v.dst);
        self.start(*key, v);
        Some(out)
    }

    /// Start (or, after a retry's new deadline, resume) the validation of
    /// `key`, in place of any other of that key.
    pub fn start(&mut self, key: ValidationKey, v: Validation) {
        self.remove(&key);
        self.by_nonce.insert(v.nonce, key);
        self.order.insert((v.deadline, key));
        self.live.insert(key, v);
    }

    fn remove(&mut self, key: &ValidationKey) -> Option<Validation> {
        let v = self.live.remove(key)?;
        self.by_nonce.remove(&v.nonce);
        self.order.remove(&(v.deadline, *key));
        Some(v)
    }

    /// The validation that a RESPONSE for `flow` echoing `nonce` answers,
    /// taken out; `None` if it answers none (a stale, forged or replayed
    /// RESPONSE, or one for another connection's challenge).
    pub fn answered(
        &mut self,
        flow: &VirtualFlow,
        nonce: &[u8; 16],
    ) -> Option<(ValidationKey, Validation)> {
        let key = *self.by_nonce.get(nonce)?;
        let v = self.live.get(&key)?;
        if v.anchor != *flow || !crypto::tags_equal16(&v.nonce, nonce) {
            return None;
        }
        Some((key, self.remove(&key)?))
    }

    /// The validations whose deadline is at or before `now`, taken out,
    /// earliest first.
    pub fn take_due(&mut self, now: Timestamp) -> Vec<(ValidationKey, Validation)> {
        let due: Vec<ValidationKey> = self
            .order
            .iter()
            .take_while(|(t, _)| *t <= now)
            .map(|(_, k)| *k)
            .collect();
        due.into_iter()
            .filter_map(|k| Some((k, self.remove(&k)?)))
            .collect()
    }

    /// The most tries any validation under way has made.
    #[cfg(test)]
    pub fn most_tries(&self) -> u32 {
        self.live.values().map(|v| v.tries).max().unwrap_or(0)
    }

    /// The earliest deadline of any validation.
    pub fn next_deadline(&self) -> Option<Timestamp> {
        self.order.first().map(|(t, _)| *t)
    }

    /// Make the validation of `key` due by `at` at the latest (no later
    /// than it was).
    pub fn due_by(&mut self, key: &ValidationKey, at: Timestamp) {
        if self.live.get(key).is_some_and(|v| v.deadline > at) {
            if let Some(mut v) = self.remove(key) {
                v.deadline = at;
                self.start(*key, v);
            }
        }
    }

    /// Make every validation that covers `flow` due at `now`: its RESPONSE
    /// would come back to an address we just left.
    pub fn hurry(&mut self, flow: &VirtualFlow, now: Timestamp) {
        let keys: Vec<ValidationKey> = self
            .live
            .iter()
            .filter(|(_, v)| v.flows.contains(flow) && v.deadline > now)
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            if let Some(mut v) = self.remove(&k) {
                v.deadline = now;
                self.start(k, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::Proto;

    fn flow(port: u16) -> VirtualFlow {
        VirtualFlow {
            proto: Proto::Tcp,
            local: SocketAddr::from(([198, 18, 1, 2], port)),
            remote: "198.18.3.2:5001".parse().unwrap(),
        }
    }

    fn validation(anchor: VirtualFlow, nonce: u8, deadline: u64) -> Validation {
        Validation {
            anchor,
            dst: "198.18.4.2:4790".parse().unwrap(),
            nonce: [nonce; 16],
            flows: HashSet::from([anchor]),
            tries: 1,
            deadline: Timestamp(deadline),
            sent: Timestamp(0),
        }
    }

    #[test]
    fn deadlines_answers_and_hurries_find_their_validation() {
        let ip: IpAddr = "198.18.4.2".parse().unwrap();
        let (a, b) = (flow(1000), flow(1001));
        let mut vs = Validations::default();
        vs.start((ip, Group::Conn(a)), validation(a, 1, 300));
        vs.start((ip, Group::Conn(b)), validation(b, 2, 100));
        assert_eq!(vs.join(&(ip, Group::Conn(b)), a), Join::Added);
        assert_eq!(vs.join(&(ip, Group::Conn(b)), a), Join::Again);
        assert_eq!(vs.join(&(ip, Group::Host([7; 32])), a), Join::None);
        assert_eq!(vs.next_deadline(), Some(Timestamp(100)));

        // Only the anchor's RESPONSE with the right nonce answers.
        assert!(vs.answered(&a, &[2; 16]).is_none());
        assert!(vs.answered(&b, &[9; 16]).is_none());
        let (key, v) = vs.answered(&b, &[2; 16]).expect("answered");
        assert_eq!(key, (ip, Group::Conn(b)));
        assert!(v.flows.contains(&a));
        assert!(vs.answered(&b, &[2; 16]).is_none(), "answered once");
        assert_eq!(vs.next_deadline(), Some(Timestamp(300)));

        // A hurried validation is due now; taken out, it is gone.
        assert!(vs.take_due(Timestamp(200)).is_empty());
        vs.hurry(&a, Timestamp(200));
        assert_eq!(vs.next_deadline(), Some(Timestamp(200)));
        let due = vs.take_due(Timestamp(200));
        assert_eq!(due.len(), 1);
        assert_eq!(vs.next_deadline(), None);
        assert!(vs.answered(&a, &[1; 16]).is_none());
    }

    #[test]
    fn a_validation_sent_again_keeps_its_tries_and_waits_for_the_answer() {
        let ip: IpAddr = "198.18.4.2".parse().unwrap();
        let a = flow(1000);
        let key = (ip, Group::Conn(a));
        let mut vs = Validations::default();
        vs.start(key, validation(a, 1, 300));
        let (gap, wait) = (Duration::from_nanos(50), Duration::from_nanos(200));

        // Sent at 0: again at 30 is too soon, at 250 it goes, and its
        // answer has until 450, past the deadline of 300.
        assert_eq!(vs.again(&key, Timestamp(30), gap, wait), None);
        let (anchor, nonce, dst) = vs.again(&key, Timestamp(250), gap, wait).expect("sent");
        assert_eq!((anchor, nonce), (a, [1; 16]));
        assert_eq!(dst, "198.18.4.2:4790".parse().unwrap());
        assert_eq!(vs.next_deadline(), Some(Timestamp(450)));
        assert_eq!(vs.again(&key, Timestamp(260), gap, wait), None);

        // A deadline further away stays where it was.
        assert_eq!(vs.take_due(Timestamp(450)).len(), 1);
        vs.start(key, validation(a, 2, 1000));
        vs.again(&key, Timestamp(100), gap, wait).expect("sent");
        assert_eq!(vs.next_deadline(), Some(Timestamp(1000)));
        let (_, v) = vs.take_due(Timestamp(1000)).pop().expect("due");
        assert_eq!(v.tries, 1, "a send that answers the peer is not a try");
        assert_eq!(v.sent, Timestamp(100));

        // Nothing to send for a key with no validation.
        assert_eq!(
            vs.again(&(ip, Group::Host([7; 32])), Timestamp(5000), gap, wait),
            None
        );
    }
}
