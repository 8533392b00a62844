//! Keep-alive helpers (paper 3.3.1.3; VTL's zero-window persist): a host
//! about to be away (`vnatctl suspend --helper NAME`) asks the peer's vnatd
//! to help its connections survive the absence, and tells it when it is
//! back. Beyond the paper's messages: HELP carries what is asked (the
//! built-in helpers as flags, and the name of one helper the peer's
//! administrator installed), HELP_R echoes it. Both are records,
//! authenticated under the connection's keys like any other, so only the
//! connection's own peer host can ask for help with it. An empty request
//! ends the help.
//!
//! The core only carries the request; what helping means is the daemon's:
//! [`Event::HelpRequested`] tells it.

use crate::stats::{Counter, Reject};
use std::net::SocketAddr;

use super::endpoint::{Ctx, Endpoint, Event};
use super::wire::{Ext, Kind, Record};
use crate::flow::VirtualFlow;

/// Length of HELP's record extension: flags, the name's length, the name
/// (at most [`HELP_NAME_MAX`] bytes), zero padding.
pub const HELP_LEN: usize = 16;
/// The longest helper name.
pub const HELP_NAME_MAX: usize = HELP_LEN - 2;
/// The built-in helper that answers for the absent end with a zero window.
pub const ZERO_WINDOW: &str = "zero-window";
/// The built-in helper that stops the peer's processes of the connection.
pub const STOP: &str = "stop";
/// The built-in helper that holds the peer's packets of the connection
/// (queued in its socket, not sent) until this end is back.
pub const HOLD: &str = "hold";
const F_ZERO_WINDOW: u8 = 1;
const F_STOP: u8 = 2;
const F_HOLD: u8 = 4;

/// What a host asks its peer to do for a connection while it is away.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Help {
    /// Answer for the absent end with a zero window, so that the peer's
    /// TCP waits in persist mode instead of retransmitting to death.
    pub zero_window: bool,
    /// Stop (SIGSTOP) the peer's processes of the connection until the end
    /// is back (SIGCONT).
    pub stop: bool,
    /// Hold the peer's packets of the connection in its socket (nothing is
    /// sent, so nothing is lost on the way) until the end is back or has
    /// moved: for an end that is about to freeze (a process checkpointed
    /// by CRIU), whose host would drop them.
    pub hold: bool,
    /// A helper the peer's administrator installed, by name.
    pub user: Option<String>,
}

impl Help {
    /// Nothing asked: the end is back.
    pub fn is_none(&self) -> bool {
        *self == Help::default()
    }

    /// A helper name that fits the wire and names a file, not a path:
    /// 1 to 14 of `a-z`, `0-9`, `-`, `_`, not starting with `-`.
    pub fn valid_name(name: &str) -> bool {
        (1..=HELP_NAME_MAX).contains(&name.len())
            && !name.starts_with('-')
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
    }

    /// The helpers named on `vnatctl suspend --helper NAME`: the built-in
    /// [`ZERO_WINDOW`] and [`STOP`], and at most one installed on the peer.
    /// The error says what is wrong, for the user.
    pub fn from_names(names: &[String]) -> Result<Help, String> {
        let mut help = Help::default();
        for n in names {
            match n.as_str() {
                ZERO_WINDOW => help.zero_window = true,
                STOP => help.stop = true,
                HOLD => help.hold = true,
                other if !Help::valid_name(other) => {
                    return Err(format!(
                        "{other:?} is not a keep-alive helper: use {ZERO_WINDOW:?}, {STOP:?}, {HOLD:?} or the name of a helper installed on the peer (1 to {HELP_NAME_MAX} of a-z, 0-9, '-', '_')"
                    ));
                }
                other => match &help.user {
                    Some(u) if u != other => {
                        return Err(format!(
                            "at most one installed helper per suspend ({u:?} and {other:?} were named)"
                        ));
                    }
                    _ => help.user = Some(other.to_string()),
                },
            }
        }
        Ok(help)
    }

    /// The names [`Help::from_names`] takes back.
    pub fn names(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.zero_window {
            out.push(ZERO_WINDOW.to_string());
        }
        if self.stop {
            out.push(STOP.to_string());
        }
        if self.hold {
            out.push(HOLD.to_string());
        }
        out.extend(self.user.clone());
        out
    }

    pub(crate) fn encode(&self) -> [u8; HELP_LEN] {
        let mut b = [0u8; HELP_LEN];
        b[0] = (u8::from(self.zero_window) * F_ZERO_WINDOW)
            | (u8::from(self.stop) * F_STOP)
            | (u8::from(self.hold) * F_HOLD);
        if let Some(n) = &self.user {
            b[1] = n.len() as u8;
            b[2..2 + n.len()].copy_from_slice(n.as_bytes());
        }
        b
    }

    /// `None` for anything but what [`Help::encode`] writes: unknown flags,
    /// a bad name, bytes after it.
    pub(crate) fn decode(b: &[u8; HELP_LEN]) -> Option<Help> {
        if b[0] & !(F_ZERO_WINDOW | F_STOP | F_HOLD) != 0 {
            return None;
        }
        let n = usize::from(b[1]);
        if n > HELP_NAME_MAX || b[2 + n..].iter().any(|&x| x != 0) {
            return None;
        }
        let user = match n {
            0 => None,
            _ => {
                let name = std::str::from_utf8(&b[2..2 + n]).ok()?;
                Help::valid_name(name).then(|| name.to_string())?;
                Some(name.to_string())
            }
        };
        Some(Help {
            zero_window: b[0] & F_ZERO_WINDOW != 0,
            stop: b[0] & F_STOP != 0,
            hold: b[0] & F_HOLD != 0,
            user,
        })
    }
}

/// Our HELP for a connection until the peer echoes it.
pub(crate) struct HelpOut {
    pub bytes: [u8; HELP_LEN],
    pub tries: u32,
    pub deadline: crate::Timestamp,
}

impl Endpoint {
    pub(crate) fn start_help(&mut self, ctx: &mut Ctx, flow: &VirtualFlow, help: &Help) {
        let rto = self.rto(ctx, 0);
        let Some(dst) = self.conns.get(flow).map(|c| self.vcmp_addr(c)) else {
            return;
        };
        let bytes = help.encode();
        if let Some(c) = self.conns.get_mut(flow) {
            c.help = Some(Box::new(HelpOut {
                bytes,
                tries: 1,
                deadline: ctx.now.plus(rto),
            }));
        }
        if self.send_record(ctx, flow, Kind::Help, Ext::Help(bytes), dst) {
            self.stats.count(Counter::HelpRequested);
        }
        self.rearm(flow);
    }

    pub(crate) fn help_timeouts(&mut self, ctx: &mut Ctx) {
        let now = ctx.now;
        let max = self.cfg.max_tries;
        let due: Vec<VirtualFlow> = self
            .conn_timers
            .due(now)
            .into_iter()
            .filter(|f| {
                self.conns
                    .get(f)
                    .is_some_and(|c| c.help.as_ref().is_some_and(|h| h.deadline <= now))
            })
            .collect();
        for f in due {
            let Some(dst) = self.conns.get(&f).map(|c| self.vcmp_addr(c)) else {
                continue;
            };
            let tries = self
                .conns
                .get(&f)
                .and_then(|c| c.help.as_ref())
                .map_or(max, |h| h.tries);
            if tries >= max {
                if let Some(c) = self.conns.get_mut(&f) {
                    c.help = None;
                }
                self.stats.count(Counter::HelpUnanswered);
            } else {
                let d = now.plus(self.rto(ctx, tries));
                let Some(h) = self.conns.get_mut(&f).and_then(|c| c.help.as_mut()) else {
                    continue;
                };
                h.tries += 1;
                h.deadline = d;
                let bytes = h.bytes;
                self.send_record(ctx, &f, Kind::Help, Ext::Help(bytes), dst);
                self.stats.count(Counter::Retransmit);
            }
            self.rearm(&f);
        }
    }

    /// HELP from the connection's peer: echo it, and tell the daemon what
    /// is asked (again for a retransmission: the daemon's state is keyed
    /// by connection, so a repeat changes nothing).
    pub(crate) fn on_help(
        &mut self,
        ctx: &mut Ctx,
        from: SocketAddr,
        flow: &VirtualFlow,
        rec: &Record,
    ) -> Result<(), Reject> {
        let Ext::Help(bytes) = rec.ext else {
            return Err(Reject::BadExtension);
        };
        let help = Help::decode(&bytes).ok_or(Reject::BadExtension)?;
        let c = self.conns.get_mut(flow).ok_or(Reject::UnknownConnection)?;
        // Older than one taken already (the replay window lets a delayed
        // one in): echoed, so that its sender stops resending, but not
        // news (a HELP sent before an empty one must not restart help).
        let news = rec.seq > c.help_seq;
        if news {
            c.help_seq = rec.seq;
        }
        self.send_record(ctx, flow, Kind::HelpR, Ext::Help(bytes), from);
        self.stats.count(Counter::HelpAnswered);
        if news {
            self.emit(Event::HelpRequested { flow: *flow, help });
        }
        Ok(())
    }

    /// HELP_R: the peer has our request. An echo of an older request (the
    /// help changed meanwhile) leaves the newer one waiting.
    pub(crate) fn on_help_r(&mut self, flow: &VirtualFlow, rec: &Record) -> Result<(), Reject> {
        let Ext::Help(bytes) = rec.ext else {
            return Err(Reject::BadExtension);
        };
        let c = self.conns.get_mut(flow).ok_or(Reject::UnknownConnection)?;
        if c.help.as_ref().is_some_and(|h| h.bytes == bytes) {
            c.help = None;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_round_trips_and_refuses_what_it_would_not_write() {
        for h in [
            Help::default(),
            Help {
                zero_window: true,
                ..Help::default()
            },
            Help {
                zero_window: true,
                stop: true,
                hold: false,
                user: Some("notify-send_2".into()),
            },
            Help {
                hold: true,
                ..Help::default()
            },
        ] {
            assert_eq!(Help::decode(&h.encode()), Some(h));
        }
        let mut b = Help::default().encode();
        b[0] = 8;
        assert_eq!(Help::decode(&b), None, "unknown flag");
        let mut b = Help::default().encode();
        b[1] = 15;
        assert_eq!(Help::decode(&b), None, "name too long");
        let mut b = Help::default().encode();
        b[5] = 1;
        assert_eq!(Help::decode(&b), None, "bytes after the name");
        let mut b = Help::default().encode();
        b[1] = 3;
        b[2..5].copy_from_slice(b"../");
        assert_eq!(Help::decode(&b), None, "a path");
        for bad in ["", "-x", "A", "a/b", "a.b", "fifteen-letters"] {
            assert!(!Help::valid_name(bad), "{bad:?}");
        }
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let h = Help::from_names(&names(&["zero-window", "stop", "hold", "notify"])).unwrap();
        assert!(h.zero_window && h.stop && h.hold && h.user.as_deref() == Some("notify"));
        assert_eq!(Help::from_names(&h.names()), Ok(h));
        assert!(
            Help::from_names(&names(&["a", "b"])).is_err(),
            "two installed"
        );
        for bad in ["../x", "Zero", ""] {
            let e = Help::from_names(&names(&[bad])).unwrap_err();
            assert!(e.contains("not a keep-alive helper"), "{e}");
        }
    }
}

#[cfg(all(test, feature = "sim"))]
mod sim_tests {
    use std::time::Duration;

    use super::Help;
    use crate::endpoint::{Config, Event};
    use crate::sim::{reverse, Link, Sim};
    use crate::sim_tests::setup;
    use crate::stats::Counter;

    fn asked(sim: &Sim, host: usize) -> Vec<Help> {
        sim.events(host, |e| matches!(e, Event::HelpRequested { .. }))
            .filter_map(|(_, e)| match e {
                Event::HelpRequested { help, .. } => Some(help.clone()),
                _ => None,
            })
            .collect()
    }

    /// The laptop asks the server for help, over a lossy link, and later
    /// ends it: the server hears both, once each as far as the daemon is
    /// concerned (a repeat is the same request), and the laptop stops
    /// resending once echoed.
    #[test]
    fn a_help_request_and_its_end_reach_the_peer() {
        let link = Link {
            loss_pct: 30,
            ..Link::default()
        };
        let (mut sim, flows) = setup(71, link, Config::default(), 1);
        let (a, b) = (0, 1);
        let f = flows[0];
        let help = Help {
            zero_window: true,
            stop: false,
            hold: true,
            user: Some("notify".into()),
        };
        let n = sim.with(a, |ep, now, rng| {
            ep.request_help(now, rng, &[f], &help).expect("request")
        });
        assert_eq!(n, 1);
        sim.run_for(Duration::from_secs(20));
        let got = asked(&sim, b);
        assert!(!got.is_empty(), "the server never heard the request");
        assert!(got.iter().all(|h| *h == help), "{got:?}");
        assert!(
            sim.events(
                b,
                |e| matches!(e, Event::HelpRequested { flow, .. } if *flow == reverse(&f))
            )
            .next()
            .is_some(),
            "the request names the connection as the server knows it"
        );
        assert_eq!(sim.hosts[a].ep.stats().get(Counter::HelpUnanswered), 0);
        sim.with(a, |ep, now, rng| {
            ep.request_help(now, rng, &[f], &Help::default())
                .expect("end")
        });
        sim.run_for(Duration::from_secs(20));
        assert!(
            asked(&sim, b).last().is_some_and(Help::is_none),
            "the server never heard that the laptop is back"
        );
    }

    /// A peer that never answers: the request is given up, counted.
    #[test]
    fn an_unanswered_help_request_is_given_up() {
        let (mut sim, flows) = setup(72, Link::default(), Config::default(), 1);
        sim.hosts[1].mute = true;
        sim.with(0, |ep, now, rng| {
            ep.request_help(
                now,
                rng,
                &[flows[0]],
                &Help {
                    zero_window: true,
                    ..Help::default()
                },
            )
            .expect("request")
        });
        sim.run_for(Duration::from_secs(120));
        assert_eq!(sim.hosts[0].ep.stats().get(Counter::HelpUnanswered), 1);
    }
}
