//! Why a test file failed, repeated where CI's log is read: at its end.
//!
//! A test file's output runs to thousands of lines (every vnatd it starts
//! logs to it), and a CI report keeps only the last screenful. So while a
//! test executable's output is passed through, the lines that say why a test
//! failed (each panic's first line and its message) are kept, and the run's
//! summary prints them again under the file's name.
use std::{
    io::{Read, Write},
    sync::{mpsc, Arc, Mutex},
    thread,
    time::Duration,
};

/// Lines kept per panic: the `panicked at` line and the message after it.
const LINES_PER_PANIC: usize = 8;
/// Lines kept per test file, all panics together.
const LINES_PER_FILE: usize = 60;
/// A kept line is cut to this many characters.
const LINE_CHARS: usize = 400;

/// Finds panics in a stream of lines.
#[derive(Default)]
pub struct Collector {
    kept: Vec<String>,
    /// Lines still to keep of the panic being read.
    open: usize,
    /// Tests that ran (passed or failed), from libtest's `test result:`
    /// lines.
    ran: u64,
    /// libtest's `test NAME ... FAILED` lines: which tests failed, kept
    /// apart from the panics (a panic line names a thread, not always the
    /// test).
    failed: Vec<String>,
}

impl Collector {
    pub fn line(&mut self, line: &str) {
        let line = line.trim_end_matches(['\n', '\r']);
        if let Some(n) = tests_in_result(line) {
            self.ran += n;
        }
        if line.starts_with("test ") && line.ends_with(" ... FAILED") {
            if self.failed.len() < LINES_PER_FILE {
                self.failed.push(line.chars().take(LINE_CHARS).collect());
            }
            return;
        }
        // `thread 'NAME' panicked at FILE:LINE:COL:`, with the thread's id
        // after its name since Rust 1.90 (`thread 'NAME' (4290) panicked`).
        if (line.starts_with("thread '") && line.contains(" panicked at "))
            || line.starts_with("panicked at ")
        {
            self.open = LINES_PER_PANIC;
        } else if self.open > 0
            && (line.is_empty()
                || line.starts_with("note: run with `RUST_BACKTRACE")
                || line.starts_with("stack backtrace:"))
        {
            self.open = 0;
        }
        if self.open == 0 {
            return;
        }
        self.open -= 1;
        if self.kept.len() < LINES_PER_FILE {
            let mut l: String = line.chars().take(LINE_CHARS).collect();
            if l.len() < line.len() {
                l.push_str(" ...");
            }
            self.kept.push(l);
        }
    }

    /// The failed tests' lines first, then the panics; the count of tests
    /// that ran stays (a caller may read it after this).
    pub fn take_lines(&mut self) -> Vec<String> {
        let mut lines = std::mem::take(&mut self.failed);
        lines.append(&mut self.kept);
        lines
    }
}

/// The tests that ran, of libtest's `test result: ok. 3 passed; 1 failed;
/// 0 ignored; ...` (passed and failed; ignored and filtered out did not).
fn tests_in_result(line: &str) -> Option<u64> {
    let rest = line.strip_prefix("test result: ")?;
    let count = |what: &str| {
        rest.split(';').find_map(|part| {
            part.trim()
                .strip_suffix(what)?
                .rsplit(' ')
                .next()?
                .parse::<u64>()
                .ok()
        })
    };
    Some(count(" passed")? + count(" failed")?)
}

/// How many tests ran, by the collectors' `test result:` lines (call after
/// [`finish`], which waits for the streams to end).
pub fn ran(collectors: &[Arc<Mutex<Collector>>]) -> u64 {
    collectors
        .iter()
        .map(|c| c.lock().unwrap_or_else(|e| e.into_inner()).ran)
        .sum()
}

/// Copies `from` to `to` as it comes (a line's start too: libtest writes
/// `test NAME ... ` before the test runs, which is what names a test that
/// hangs), and feeds each whole line to the collector; says on `done` when
/// `from` ends.
pub fn tee(
    mut from: impl Read + Send + 'static,
    mut to: impl Write + Send + 'static,
    collector: Arc<Mutex<Collector>>,
    done: mpsc::Sender<()>,
) {
    thread::spawn(move || {
        let mut chunk = [0u8; 8192];
        let mut line = Vec::new();
        let feed = |line: &[u8]| {
            if let Ok(mut c) = collector.lock() {
                c.line(&String::from_utf8_lossy(line));
            }
        };
        loop {
            let n = match from.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            let _ = to.write_all(&chunk[..n]);
            let _ = to.flush();
            for part in chunk[..n].split_inclusive(|b| *b == b'\n') {
                line.extend_from_slice(part);
                if line.ends_with(b"\n") {
                    feed(&line);
                    line.clear();
                }
            }
        }
        if !line.is_empty() {
            feed(&line);
        }
        let _ = done.send(());
    });
}

/// Waits (a short while: a process the test left behind may hold the pipe)
/// for the tees to end, then takes what each kept, in order. Each stream
/// has a collector of its own: a line of one stream must not fall inside a
/// panic's message read from the other.
pub fn finish(collectors: &[Arc<Mutex<Collector>>], done: mpsc::Receiver<()>) -> Vec<String> {
    for _ in collectors {
        if done.recv_timeout(Duration::from_secs(3)).is_err() {
            break;
        }
    }
    collectors
        .iter()
        .flat_map(|c| c.lock().unwrap_or_else(|e| e.into_inner()).take_lines())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tests_that_ran_are_read_from_libtests_result_line() {
        assert_eq!(
            tests_in_result("test result: ok. 3 passed; 0 failed; 0 ignored; 0 measured; 2 filtered out; finished in 1.2s"),
            Some(3)
        );
        assert_eq!(
            tests_in_result(
                "test result: FAILED. 1 passed; 2 failed; 1 ignored; 0 measured; 0 filtered out"
            ),
            Some(3)
        );
        assert_eq!(
            tests_in_result(
                "test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 9 filtered out"
            ),
            Some(0)
        );
        assert_eq!(tests_in_result("test foo ... ok"), None);
    }

    /// A sink the test reads while the tee writes to it.
    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn collect(text: &str) -> Vec<String> {
        let mut c = Collector::default();
        for l in text.lines() {
            c.line(l);
        }
        c.take_lines()
    }

    #[test]
    fn a_panic_and_its_message_are_kept_and_the_log_around_it_is_not() {
        let out = "\
2026-11-29T17:31:37Z  INFO vnatd started
---- server_killed_after_detaching_tc stdout ----
thread 'server_killed_after_detaching_tc' (4290) panicked at tests/tests/crash_safety.rs:231:13:
remove:tc: the server still has, 30 s after the connection closed:
routes [], tc [\"veth0\"]
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace

failures:
    server_killed_after_detaching_tc
";
        assert_eq!(
            collect(out),
            vec![
                "thread 'server_killed_after_detaching_tc' (4290) panicked at tests/tests/crash_safety.rs:231:13:",
                "remove:tc: the server still has, 30 s after the connection closed:",
                "routes [], tc [\"veth0\"]",
            ]
        );
    }

    #[test]
    fn the_failed_tests_are_named_before_the_panics() {
        let out = "\
test vcmp::ok_one ... ok
test vcmp::bad_one ... FAILED
---- vcmp::bad_one stdout ----
thread 'vcmp::bad_one' panicked at src/a.rs:3:5:
assertion failed
";
        assert_eq!(
            collect(out),
            vec![
                "test vcmp::bad_one ... FAILED",
                "thread 'vcmp::bad_one' panicked at src/a.rs:3:5:",
                "assertion failed",
            ]
        );
    }

    #[test]
    fn a_long_message_is_cut_and_a_file_keeps_a_bounded_number_of_lines() {
        let mut out = String::new();
        for i in 0..20 {
            out.push_str(&format!("thread 't{i}' panicked at a.rs:1:1:\n"));
            for j in 0..20 {
                out.push_str(&format!("line {j} {}\n", "x".repeat(1000)));
            }
        }
        let kept = collect(&out);
        assert_eq!(kept.len(), LINES_PER_FILE);
        assert_eq!(kept[0], "thread 't0' panicked at a.rs:1:1:");
        // The panic line and seven lines of its message, then the next one.
        assert_eq!(kept[LINES_PER_PANIC], "thread 't1' panicked at a.rs:1:1:");
        assert!(kept[1].ends_with(" ...") && kept[1].len() == LINE_CHARS + 4);
    }

    #[test]
    fn a_tee_passes_everything_through() {
        let c = Arc::new(Mutex::new(Collector::default()));
        let (tx, rx) = mpsc::channel();
        let sink = Arc::new(Mutex::new(Vec::new()));
        let input = "a\nthread 'x' panicked at b.rs:2:3:\nboom\n\nlast without newline";
        tee(input.as_bytes(), Shared(sink.clone()), c.clone(), tx);
        let kept = finish(&[c], rx);
        assert_eq!(&*sink.lock().unwrap(), input.as_bytes());
        assert_eq!(kept, vec!["thread 'x' panicked at b.rs:2:3:", "boom"]);
    }

    #[test]
    fn the_count_of_tests_that_ran_survives_finish() {
        // run_file reads it after waiting for a late tee (a loaded
        // machine): taking the panics must not take the count with them.
        let c = Arc::new(Mutex::new(Collector::default()));
        let (tx, rx) = mpsc::channel();
        let input = "test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 5 filtered out\n";
        tee(input.as_bytes(), Shared(Arc::default()), c.clone(), tx);
        assert!(finish(std::slice::from_ref(&c), rx).is_empty());
        assert_eq!(ran(&[c]), 2);
    }

    #[test]
    fn the_start_of_a_line_is_passed_on_before_its_end() {
        // libtest's `test NAME ... ` names a test that then hangs.
        struct Chunks(mpsc::Receiver<&'static [u8]>);
        impl Read for Chunks {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let Ok(c) = self.0.recv() else { return Ok(0) };
                buf[..c.len()].copy_from_slice(c);
                Ok(c.len())
            }
        }
        let (feed, chunks) = mpsc::channel();
        let sink = Arc::new(Mutex::new(Vec::new()));
        let c = Arc::new(Mutex::new(Collector::default()));
        let (tx, rx) = mpsc::channel();
        tee(Chunks(chunks), Shared(sink.clone()), c.clone(), tx);
        feed.send(b"test hangs ... ").unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while sink.lock().unwrap().as_slice() != b"test hangs ... " {
            assert!(std::time::Instant::now() < deadline, "not passed on");
            thread::sleep(Duration::from_millis(10));
        }
        feed.send(b"ok\n").unwrap();
        drop(feed);
        assert!(finish(&[c], rx).is_empty());
        assert_eq!(sink.lock().unwrap().as_slice(), b"test hangs ... ok\n");
    }
}
