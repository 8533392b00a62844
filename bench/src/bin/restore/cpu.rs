//! Whose CPU a run used: the whole machine's busy time (`/proc/stat`) and
//! each vnatd's (`/proc/PID/stat`) between two marks. What is busy and not
//! vnatd is the harness: the echo clients and servers, the delay line, and
//! the kernel's work on their packets (softirq time is charged to whatever
//! runs when it comes, so some of it lands on vnatd too). On these 2-core
//! machines the harness alone can fill both cores at 30,000 connections, and
//! then a figure says more about the harness than about vnat.

use serde::Serialize;

/// CPU counters at one moment, in clock ticks (`USER_HZ`).
#[derive(Clone, Copy, Debug)]
pub struct Mark {
    at: std::time::Instant,
    busy: u64,
    laptop: u64,
    server: u64,
}

/// CPU seconds between two marks.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Share {
    /// Wall-clock seconds between the marks.
    pub window_s: f64,
    /// What the machine could give in that time: cores x window.
    pub capacity_s: f64,
    /// Busy (not idle, not waiting for I/O) on all cores.
    pub busy_s: f64,
    pub vnatd_laptop_s: f64,
    pub vnatd_server_s: f64,
    /// Busy and not vnatd: the harness and the kernel's work for it.
    pub harness_s: f64,
}

impl Mark {
    /// Read the counters now; a process that is gone counts 0.
    pub fn now(laptop_pid: u32, server_pid: u32) -> Mark {
        Mark {
            at: std::time::Instant::now(),
            busy: machine_busy().unwrap_or(0),
            laptop: process_ticks(laptop_pid).unwrap_or(0),
            server: process_ticks(server_pid).unwrap_or(0),
        }
    }

    /// From this mark to `later`.
    pub fn to(&self, later: &Mark) -> Share {
        let hz = ticks_per_second();
        let s = |a: u64, b: u64| b.saturating_sub(a) as f64 / hz;
        let window_s = later.at.duration_since(self.at).as_secs_f64();
        let busy_s = s(self.busy, later.busy);
        let vnatd_laptop_s = s(self.laptop, later.laptop);
        let vnatd_server_s = s(self.server, later.server);
        Share {
            window_s,
            capacity_s: window_s * cores() as f64,
            busy_s,
            vnatd_laptop_s,
            vnatd_server_s,
            harness_s: (busy_s - vnatd_laptop_s - vnatd_server_s).max(0.0),
        }
    }
}

impl Share {
    /// "busy 27.1 of 28.0 core-s: vnatd 6.3 + 8.1, harness 12.7".
    pub fn line(&self) -> String {
        format!(
            "busy {:.1} of {:.1} core-s: vnatd {:.1} (laptop) + {:.1} (server), harness {:.1}",
            self.busy_s, self.capacity_s, self.vnatd_laptop_s, self.vnatd_server_s, self.harness_s
        )
    }
}

fn ticks_per_second() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { nix::libc::sysconf(nix::libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as f64
    } else {
        100.0
    }
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// All cores' ticks that were neither idle nor waiting for I/O.
fn machine_busy() -> Option<u64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    busy_of(stat.lines().next()?)
}

/// The first line of /proc/stat: "cpu user nice system idle iowait irq
/// softirq steal ...", guest time being counted in user already.
fn busy_of(line: &str) -> Option<u64> {
    let mut f = line.split_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = f.take(8).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    if v.len() < 8 {
        return None;
    }
    Some(v.iter().sum::<u64>() - v[3] - v[4])
}

/// A process's user and system ticks, all its threads.
fn process_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    ticks_of(&stat)
}

/// utime and stime, the 14th and 15th fields, counted after the command
/// name (which may hold spaces and parentheses, so from its last ')').
fn ticks_of(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After ')': state is field 3, so utime (14) is index 11.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_leaves_out_idle_and_iowait() {
        assert_eq!(
            busy_of("cpu  100 5 50 1000 20 3 7 0 0 0"),
            Some(100 + 5 + 50 + 3 + 7)
        );
        assert_eq!(busy_of("cpu0 1 2 3 4 5 6 7 8"), None);
        assert_eq!(busy_of("cpu 1 2"), None);
    }

    #[test]
    fn process_ticks_are_read_after_the_name() {
        let stat =
            "4242 (tokio (rt) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 37 12 0 0 20 0 9 0 55 0 0";
        assert_eq!(ticks_of(stat), Some(37 + 12));
        assert_eq!(ticks_of("garbage"), None);
    }
}
