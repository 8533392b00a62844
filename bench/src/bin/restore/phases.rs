//! Where a restoration's time went, from vnatd's own logs (JSON, info).
//!
//! vnatd's driver (vnat-daemon/src/daemon/driver.rs) reads up to 64 queued
//! VCMP datagrams per loop turn, does the datapath work they call for in one
//! batch, then sends what VCMP queued, then runs the TCP restart levers. A
//! move of N connections therefore runs in a few batches of per-connection
//! steps, three of which it logs per connection:
//! 1. laptop, "resuming connection at a new address": after the address
//!    change was noticed (a resync that lists the connections and
//!    addresses) and this connection's receive side was prepared
//!    (`prepare_translation`). Batched `UPD`s follow the last.
//! 2. server, "translation updated": the server answered the `UPD`s with
//!    `UPD_R` and one `CHALLENGE` for the new address (after preparing its
//!    own receive side for every connection of the batch); on the laptop's
//!    `RESPONSE` it installs each translation, restarts the flows (an ACK
//!    solicited from each socket, since the peer moved), and sends one
//!    `SWITCHED` for the batch.
//! 3. laptop, "translation updated": its TCP connections were held (their
//!    packets dropped before they leave) since step 1; on `SWITCHED` the
//!    laptop installs each translation, then restarts the flows ("restart
//!    levers sent", one line per batch; a batch of 16 or fewer gets them
//!    right after each install). Only now can the connection carry data
//!    both ways.
//!
//! Phases (ms, from the first and last line of each step; t0 is when the
//! new address became usable): `detect` (t0 to the first laptop line),
//! `laptop_prepare`, `exchange` (last laptop prepare to the server's first
//! install: UPD, the server's receive-side prepares, UPD_R and CHALLENGE,
//! RESPONSE), `server_install`, `switched` (the server's last install to
//! the laptop's first: SWITCHED; negative when batches overlap),
//! `laptop_install`, and `drain` (the later of the two last installs to
//! the last echo). Per connection: a step's span over its lines, and each
//! connection's echo after the later of its two installs. Connections are
//! matched across the logs and the client's report by the laptop's port.

use std::{collections::HashMap, path::Path};

use serde::Serialize;
use serde_json::Value;

use super::{daemon::parse_rfc3339_ns, Restored};

const RESUMING: &str = "resuming connection at a new address";
const TRANSLATED: &str = "translation updated";
const LEVERS: &str = "restart levers sent";

/// One step's log lines: how many, the first and the last (ms from t0).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Step {
    pub count: usize,
    pub first_ms: Option<f64>,
    pub last_ms: Option<f64>,
}

impl Step {
    fn of(times: &[f64]) -> Step {
        Step {
            count: times.len(),
            first_ms: times.iter().copied().reduce(f64::min),
            last_ms: times.iter().copied().reduce(f64::max),
        }
    }

    /// Last minus first, divided by the gaps between lines: the time one
    /// connection took in this step when the step is sequential.
    fn per_conn_ms(&self) -> Option<f64> {
        if self.count < 2 {
            return None;
        }
        Some((self.last_ms? - self.first_ms?) / (self.count - 1) as f64)
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Phases {
    pub laptop_resuming: Step,
    pub server_translated: Step,
    pub laptop_translated: Step,
    /// See the module documentation for each phase.
    pub detect_ms: Option<f64>,
    pub laptop_prepare_ms: Option<f64>,
    pub laptop_prepare_per_conn_ms: Option<f64>,
    pub exchange_ms: Option<f64>,
    pub server_install_ms: Option<f64>,
    pub server_install_per_conn_ms: Option<f64>,
    pub switched_ms: Option<f64>,
    pub laptop_install_ms: Option<f64>,
    pub laptop_install_per_conn_ms: Option<f64>,
    pub drain_ms: Option<f64>,
    /// Time each vnatd spent on the TCP restart levers after t0, summed
    /// over its batches (part of `drain` on the laptop: its levers follow
    /// its installs, the last step).
    pub laptop_levers_ms: f64,
    pub server_levers_ms: f64,
    /// Per connection: from the later of its two installs to its echo
    /// (median, max): TCP sending again plus one echo round trip.
    pub echo_after_install_median_ms: Option<f64>,
    pub echo_after_install_max_ms: Option<f64>,
    /// Connections whose migration VCMP gave up on ("VCMP migration
    /// aborted"), on either host. Such a connection may still echo: the
    /// server's translation suffices while the laptop's packets keep their
    /// old source address and nothing on the path filters it (the
    /// benchmark's router does not), which a real network may not allow.
    pub aborted: usize,
    /// Warnings and errors vnatd logged after the move (count, first few).
    pub warnings: usize,
    pub warning_samples: Vec<String>,
}

struct Line {
    /// ms from t0.
    at: f64,
    message: String,
    level: String,
    /// The laptop's port of the flow, if the line names one.
    port: Option<u16>,
    /// `elapsed_ms` of a "restart levers sent" line.
    elapsed_ms: Option<f64>,
}

impl Phases {
    /// `t_start`, `t0`: CLOCK_MONOTONIC ns of the move's start and end;
    /// `real_offset`: CLOCK_REALTIME - CLOCK_MONOTONIC in ns (the logs carry
    /// wall-clock times).
    pub fn from_logs(
        laptop_log: &Path,
        server_log: &Path,
        t_start: u64,
        t0: u64,
        real_offset: i128,
        restored: &[Restored],
        laptop_ip: &str,
    ) -> Phases {
        let lap = read(laptop_log, t_start, t0, real_offset, laptop_ip);
        let srv = read(server_log, t_start, t0, real_offset, laptop_ip);
        let times = |lines: &[Line], msg: &str| -> Vec<f64> {
            lines
                .iter()
                .filter(|l| l.message == msg)
                .map(|l| l.at)
                .collect()
        };
        let mut p = Phases {
            laptop_resuming: Step::of(&times(&lap, RESUMING)),
            server_translated: Step::of(&times(&srv, TRANSLATED)),
            laptop_translated: Step::of(&times(&lap, TRANSLATED)),
            ..Phases::default()
        };
        let gap = |a: Option<f64>, b: Option<f64>| Some(b? - a?);
        p.detect_ms = p.laptop_resuming.first_ms;
        p.laptop_prepare_ms = gap(p.laptop_resuming.first_ms, p.laptop_resuming.last_ms);
        p.laptop_prepare_per_conn_ms = p.laptop_resuming.per_conn_ms();
        p.exchange_ms = gap(p.laptop_resuming.last_ms, p.server_translated.first_ms);
        p.server_install_ms = gap(p.server_translated.first_ms, p.server_translated.last_ms);
        p.server_install_per_conn_ms = p.server_translated.per_conn_ms();
        p.switched_ms = gap(p.server_translated.last_ms, p.laptop_translated.first_ms);
        p.laptop_install_ms = gap(p.laptop_translated.first_ms, p.laptop_translated.last_ms);
        p.laptop_install_per_conn_ms = p.laptop_translated.per_conn_ms();
        let last_echo = restored
            .iter()
            .map(|r| ms_from(r.recv as i128, t0))
            .reduce(f64::max);
        let last_install = match (p.server_translated.last_ms, p.laptop_translated.last_ms) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        p.drain_ms = gap(last_install, last_echo);
        let levers = |lines: &[Line]| -> f64 {
            lines
                .iter()
                .filter(|l| l.message == LEVERS && l.at >= 0.0)
                .filter_map(|l| l.elapsed_ms)
                .sum()
        };
        p.laptop_levers_ms = levers(&lap);
        p.server_levers_ms = levers(&srv);

        let installs = |lines: &[Line]| -> HashMap<u16, f64> {
            lines
                .iter()
                .filter(|l| l.message == TRANSLATED)
                .filter_map(|l| Some((l.port?, l.at)))
                .collect()
        };
        let (lap_at, srv_at) = (installs(&lap), installs(&srv));
        let mut after: Vec<f64> = restored
            .iter()
            .filter_map(|r| {
                let port = r.local?.port();
                let both = lap_at.get(&port)?.max(*srv_at.get(&port)?);
                Some(ms_from(r.recv as i128, t0) - both)
            })
            .collect();
        after.sort_by(f64::total_cmp);
        p.echo_after_install_median_ms = after.get(after.len() / 2).copied();
        p.echo_after_install_max_ms = after.last().copied();

        for (host, l) in lap
            .iter()
            .map(|l| ("laptop", l))
            .chain(srv.iter().map(|l| ("server", l)))
        {
            if l.message == "VCMP migration aborted" {
                p.aborted += 1;
            }
            if l.level == "WARN" || l.level == "ERROR" {
                p.warnings += 1;
                let s = format!("{host}: {}", l.message);
                if p.warning_samples.len() < 5 && !p.warning_samples.contains(&s) {
                    p.warning_samples.push(s);
                }
            }
        }
        p
    }
}

fn ms_from(ns: i128, t0: u64) -> f64 {
    (ns - t0 as i128) as f64 / 1e6
}

/// The log's lines from `t_start` on, timed in ms from t0.
fn read(path: &Path, t_start: u64, t0: u64, real_offset: i128, laptop_ip: &str) -> Vec<Line> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let key = format!("{laptop_ip}:");
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            let real = v["timestamp"].as_str().and_then(parse_rfc3339_ns)? as i128;
            let mono = real - real_offset;
            if mono < t_start as i128 {
                return None;
            }
            let fields = &v["fields"];
            let port = fields["flow"].as_str().and_then(|f| {
                let rest = &f[f.find(&key)? + key.len()..];
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            });
            Some(Line {
                at: ms_from(mono, t0),
                message: fields["message"].as_str().unwrap_or_default().to_string(),
                level: v["level"].as_str().unwrap_or_default().to_string(),
                port,
                elapsed_ms: fields["elapsed_ms"].as_f64(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::Step;

    #[test]
    fn per_connection_time_divides_by_the_gaps() {
        let s = Step::of(&[10.0, 12.0, 14.0, 16.0]);
        assert_eq!(
            (s.count, s.first_ms, s.last_ms),
            (4, Some(10.0), Some(16.0))
        );
        assert_eq!(s.per_conn_ms(), Some(2.0));
        assert_eq!(Step::of(&[5.0]).per_conn_ms(), None);
    }
}
