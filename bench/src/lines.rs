//! Reading a helper process's report: the benchmarks run parts of
//! themselves (echo servers, clients, probes) as child processes in a
//! host's namespace, which print one JSON object per line.

use std::io::{BufRead, BufReader};
use std::process::ChildStdout;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use serde_json::Value;

/// A thread that hands each JSON line of `out` to `each`, with `log`
/// locked, skipping lines that do not parse; once the output ends (the
/// process exited or closed it), `ended` runs on the log.
pub fn read_json_lines<L: Send + 'static>(
    out: ChildStdout,
    log: Arc<Mutex<L>>,
    each: impl Fn(&mut L, &Value) + Send + 'static,
    ended: impl FnOnce(&mut L) + Send + 'static,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            let Ok(v) = serde_json::from_str::<Value>(&line) else {
                continue;
            };
            each(&mut log.lock().unwrap_or_else(|p| p.into_inner()), &v);
        }
        ended(&mut log.lock().unwrap_or_else(|p| p.into_inner()));
    })
}
