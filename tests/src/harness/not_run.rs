//! A test that cannot run here for want of a tool (CRIU) must not read
//! "ok" like one that ran. libtest has no run-time skip: a test that
//! returns early is reported as passed, and what it prints with
//! `eprintln!` is captured and thrown away. So such a test calls
//! [`not_run`], which
//! - fails the test when the environment says the tool is required (CI
//!   sets `VNAT_REQUIRE_CRIU=1`, after `cargo xtask prereq` installed it):
//!   there a missing tool is a broken machine, not a reason to skip;
//! - otherwise writes a `SKIPPED` line straight to the process's stderr,
//!   past libtest's capture, so it shows beside `test ... ok` in plain
//!   `cargo test` output, and appends the same line to the file
//!   `VNAT_SKIP_REPORT` names, from which `cargo xtask test` prints the
//!   tests that did not run at the end of the run, where a user looks.
use std::{io::Write as _, path::Path};

/// The variable `cargo xtask test` sets to the file it collects the
/// not-run tests in.
pub const SKIP_REPORT_VAR: &str = "VNAT_SKIP_REPORT";

/// The line a skipped test writes: one sentence naming the test and why.
pub fn skip_line(test: &str, why: &str) -> String {
    format!("SKIPPED (did not run) {test}: {why}")
}

/// `test` cannot run because `why`; `required` names the variable that,
/// when set, makes that a failure. Panics when it is set; otherwise
/// reports the skip (see the module) and returns, and the caller returns.
pub fn not_run(test: &str, required: &str, why: &str) {
    if std::env::var_os(required).is_some() {
        panic!("{required} is set, so {test} must run, but it cannot: {why}");
    }
    let line = skip_line(test, why);
    // std::io::stderr() itself is not captured by libtest (only the
    // print macros are), so this line reaches the terminal.
    let _ = writeln!(std::io::stderr(), "\n*** {line}");
    if let Some(path) = std::env::var_os(SKIP_REPORT_VAR) {
        record(Path::new(&path), &line);
    }
}

/// Append `line` to the report (one test per line; tests of several
/// binaries append to the same file, each line in one write).
fn record(path: &Path, line: &str) {
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
    if let Err(e) = written {
        let _ = writeln!(
            std::io::stderr(),
            "cannot record the skip in {}: {e}",
            path.display()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_skip_is_appended_to_the_report_one_line_per_test() {
        let path = std::env::temp_dir().join(format!("vnat-skipped-{}.txt", std::process::id()));
        let _ = std::fs::remove_file(&path);
        record(&path, &skip_line("a", "no criu"));
        record(&path, &skip_line("b", "no criu either"));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "SKIPPED (did not run) a: no criu\nSKIPPED (did not run) b: no criu either\n"
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    #[should_panic(expected = "must run, but it cannot: no criu")]
    fn a_required_tool_that_is_missing_fails_the_test() {
        // PATH is set in every environment the tests run in.
        not_run("t", "PATH", "no criu");
    }
}
