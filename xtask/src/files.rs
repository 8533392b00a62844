//! The privileged test files, run one executable at a time and each within a
//! time limit, on the host and in the VMs alike.
//!
//! A test that never returns must fail its own file, name itself, and say
//! what it was waiting on; it must not eat the rest of CI's time and leave
//! nothing behind but a timeout. So each file runs under a watchdog: past
//! its limit, the watchdog prints every process with its state and kernel
//! wait channel, the kernel stack of each thread of the test process and,
//! when gdb is installed, each thread's user-space backtrace; then it ends
//! the test process and everything it started.
use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{mpsc, Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use crate::{panics, run};

/// The outage of tests/tests/unannounced_outage.rs when
/// `VNAT_TEST_OUTAGE_SECS` is unset (the test's own default).
const DEFAULT_OUTAGE_SECS: u64 = 600;

/// How long one test file may run on the host by default: ten minutes
/// beyond the unannounced-outage test's outage, the one test that waits on
/// purpose. The longest of the others takes about three minutes.
pub fn host_file_limit() -> u64 {
    let outage = std::env::var("VNAT_TEST_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(DEFAULT_OUTAGE_SECS);
    600 + outage
}

/// How long one test file may run in a VM by default: TCG is about 18 times
/// slower than the host, and the longest core file takes about eight
/// minutes there.
pub const VM_FILE_LIMIT_SECS: u64 = 1200;

/// Shell functions (bash) shared by the host's watchdog and the VM's:
/// `hang_report PID` prints what the processes wait on; `kill_tree PID`
/// ends PID and its descendants (SIGTERM, then SIGKILL 5 s later), so that
/// a vnatd a test started gets to remove what it attached.
pub const HANG_REPORT_SH: &str = r#"
hang_report() {
    local p=$1 t
    echo "--- every process: pid, parent, state, seconds running, kernel wait channel, command"
    ps -e --forest -o pid=,ppid=,stat=,etimes=,wchan:28=,args= | cut -c1-200
    for t in /proc/"$p"/task/*; do
        [ -d "$t" ] || continue
        echo "--- test thread ${t##*/} ($(cat "$t/comm" 2>/dev/null)): kernel stack"
        head -n 12 "$t/stack" 2>/dev/null | sed 's/^/    /'
    done
    if command -v gdb >/dev/null 2>&1; then
        echo "--- test threads: user-space backtraces (gdb)"
        timeout 300 gdb -q -nx -batch -p "$p" -ex 'set pagination off' \
            -ex 'thread apply all bt 40' 2>&1 \
            | grep -v -e '^\[New LWP' -e '^\[Thread debugging' -e '^Using host libthread' \
            | head -n 800
    else
        echo "--- (gdb is not installed: no user-space backtraces)"
    fi
}
descendants() {
    local all=$1 new=$1 next
    while [ -n "$new" ]; do
        next=$(ps -e -o pid=,ppid= | awk -v s=" $new " 'index(s, " " $2 " ") { print $1 }')
        new=$(echo $next)
        [ -n "$new" ] && all="$all $new"
    done
    echo "$all"
}
kill_tree() {
    local all
    all=$(descendants "$1")
    kill -TERM $all 2>/dev/null
    sleep 5
    kill -KILL $all 2>/dev/null
    return 0
}
"#;

/// The test executables of vnat-tests, built (debug) by `cargo test
/// --no-run`: (name, executable) for each test file (its name in
/// tests/tests) and for the library's own unit tests (`vnat-tests (lib)`).
/// `files` limits the test files to those named (all when empty).
pub fn test_executables(root: &Path, files: &[String]) -> Result<Vec<(String, PathBuf)>> {
    let mut cmd = run::cargo(root);
    cmd.args(["test", "--no-run", "-p", "vnat-tests"]);
    for f in files {
        cmd.args(["--test", f]);
    }
    cmd.arg("--message-format=json-render-diagnostics");
    println!("+ {}", run::describe(&cmd));
    // stdout carries the JSON; diagnostics and progress go to the terminal.
    let out = cmd
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo to build the integration tests")?;
    if !out.status.success() {
        bail!("building the integration tests failed (cargo test --no-run -p vnat-tests)");
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let found: Vec<(String, PathBuf)> = text.lines().filter_map(test_artifact).collect();
    if found.is_empty() {
        bail!("cargo test --no-run -p vnat-tests reported no test executable");
    }
    Ok(found)
}

/// (name, executable) from one line of cargo's JSON output, if it is a
/// compiler-artifact built for testing with an executable: a test file
/// (kind "test", named as its file) or a library's unit tests (kind "lib",
/// named `PACKAGE (lib)`). A string search, not a JSON parser: xtask has no
/// serde, and cargo's message format is stable (neither the target nor the
/// profile object has nested objects).
fn test_artifact(line: &str) -> Option<(String, PathBuf)> {
    if !line.contains("\"reason\":\"compiler-artifact\"") {
        return None;
    }
    let object = |key: &str| -> Option<&str> {
        let pat = format!("\"{key}\":{{");
        let start = line.find(&pat)? + pat.len();
        let rest = &line[start..];
        Some(&rest[..rest.find('}')?])
    };
    let target = object("target")?;
    if !object("profile")?.contains("\"test\":true") {
        return None;
    }
    let exe = PathBuf::from(json_string(line, "executable")?);
    let name = json_string(target, "name")?;
    if target.contains("\"kind\":[\"test\"]") {
        Some((name, exe))
    } else if target.contains("\"kind\":[\"lib\"]") {
        Some((format!("{} (lib)", name.replace('_', "-")), exe))
    } else {
        None
    }
}

/// The string value of `"key":"..."` in `text` (the first one), unescaped.
fn json_string(text: &str, key: &str) -> Option<String> {
    let pat = format!("\"{key}\":\"");
    let start = text.find(&pat)? + pat.len();
    let mut out = String::new();
    let mut chars = text[start..].chars();
    loop {
        match chars.next()? {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                't' => out.push('\t'),
                c => out.push(c),
            },
            c => out.push(c),
        }
    }
}

/// How one test file ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// With how many tests ran (0: the user's filter matched none here).
    Passed { ran: u64 },
    /// With the lines that say why (each panic and its message).
    Failed { panics: Vec<String> },
    /// Still running at its limit: reported and killed.
    TimedOut,
}

/// Runs one test executable on the host (`cmd`, with its arguments and
/// environment set, in the tests' directory), within `limit`; prints
/// `==> NAME` before and `==> NAME: passed in N s` (or failed, or timed
/// out) after.
pub fn run_file(name: &str, mut cmd: Command, limit: Duration) -> Result<Outcome> {
    println!("==> {name}");
    let started = Instant::now();
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start the test executable of {name}"))?;
    // Passed through as it comes; the panics are kept for the summary.
    let collectors = [
        Arc::new(Mutex::new(panics::Collector::default())),
        Arc::new(Mutex::new(panics::Collector::default())),
    ];
    let (done_tx, done) = mpsc::channel();
    if let Some(out) = child.stdout.take() {
        panics::tee(
            out,
            std::io::stdout(),
            collectors[0].clone(),
            done_tx.clone(),
        );
    }
    if let Some(err) = child.stderr.take() {
        panics::tee(err, std::io::stderr(), collectors[1].clone(), done_tx);
    }
    let status = loop {
        if let Some(status) = child.try_wait().context("waiting for a test executable")? {
            break Some(status);
        }
        if started.elapsed() >= limit {
            break None;
        }
        thread::sleep(Duration::from_millis(200));
    };
    let secs = started.elapsed().as_secs();
    let outcome = match status {
        Some(s) if s.success() => {
            // The result line is in by now, as a rule (the exit was
            // polled for); if not, wait for the streams to end.
            let mut ran = panics::ran(&collectors);
            if ran == 0 {
                let _ = panics::finish(&collectors, done);
                ran = panics::ran(&collectors);
            }
            println!("==> {name}: passed in {secs} s");
            Outcome::Passed { ran }
        }
        Some(s) => {
            let panics = panics::finish(&collectors, done);
            println!("==> {name}: FAILED ({s}) after {secs} s");
            Outcome::Failed { panics }
        }
        None => {
            println!(
                "==> {name}: TIMED OUT: still running after {secs} s (the limit per test file; \
                 the test running is the one above without a result). What the processes wait on:"
            );
            let script = format!(
                "{HANG_REPORT_SH}\nhang_report {0}\nkill_tree {0}\n",
                child.id()
            );
            let _ = Command::new("bash")
                .arg("-c")
                .arg(script)
                .stdin(Stdio::null())
                .status();
            let _ = child.kill();
            let _ = child.wait();
            println!("==> {name}: TIMED OUT after {secs} s");
            Outcome::TimedOut
        }
    };
    Ok(outcome)
}

/// The arguments every test executable gets: the thread count, then the
/// user's (after `--`).
pub fn test_args(test_threads: u32, args: &[OsString]) -> Vec<OsString> {
    let mut all = vec![OsString::from(format!("--test-threads={test_threads}"))];
    all.extend(args.iter().cloned());
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECORDERS: &str = r#"{"reason":"compiler-artifact","package_id":"path+file:///w/tests#vnat-tests@0.1.0","manifest_path":"/w/tests/Cargo.toml","target":{"kind":["test"],"crate_types":["bin"],"name":"recorders","src_path":"/w/tests/tests/recorders.rs","edition":"2021","doctest":false,"test":true},"profile":{"opt_level":"0","debuginfo":2,"debug_assertions":true,"overflow_checks":true,"test":true},"features":[],"filenames":["/w/target/debug/deps/recorders-0123"],"executable":"/w/target/debug/deps/recorders-0123","fresh":true}"#;

    #[test]
    fn test_artifacts_are_found_in_cargo_json() {
        assert_eq!(
            test_artifact(RECORDERS),
            Some((
                "recorders".to_string(),
                PathBuf::from("/w/target/debug/deps/recorders-0123")
            ))
        );
        // The library's unit tests run too, under a name of their own.
        let lib = RECORDERS
            .replace(r#""kind":["test"]"#, r#""kind":["lib"]"#)
            .replace(r#""name":"recorders""#, r#""name":"vnat_tests""#);
        assert_eq!(
            test_artifact(&lib).map(|(n, _)| n),
            Some("vnat-tests (lib)".to_string())
        );
        // A library built for linking (profile test false) is no test, nor
        // is a binary's unit-test build.
        let linked = lib.replace(
            r#""overflow_checks":true,"test":true"#,
            r#""overflow_checks":true,"test":false"#,
        );
        assert_eq!(test_artifact(&linked), None);
        let bin = RECORDERS.replace(r#""kind":["test"]"#, r#""kind":["bin"]"#);
        assert_eq!(test_artifact(&bin), None);
    }

    #[test]
    fn the_hang_report_script_is_valid_bash() {
        let out = Command::new("bash")
            .arg("-n")
            .arg("-c")
            .arg(HANG_REPORT_SH)
            .output()
            .expect("running bash -n");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A file that never ends is reported and killed at its limit, with the
    /// processes it started.
    #[test]
    fn a_hanging_file_is_killed_at_its_limit_with_its_children() {
        let marker = format!("vnat-xtask-hang-{}", std::process::id());
        let mut cmd = Command::new("bash");
        // A child that outlives its parent's kill unless the tree is ended.
        cmd.arg("-c").arg(format!(
            "(exec -a {marker}-child sleep 1000) & exec -a {marker} sleep 1000"
        ));
        let t = Instant::now();
        let outcome = run_file("hang", cmd, Duration::from_secs(1)).unwrap();
        assert_eq!(outcome, Outcome::TimedOut);
        assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
        let left = Command::new("pgrep")
            .arg("-f")
            .arg(&marker)
            .output()
            .unwrap();
        assert!(
            left.stdout.is_empty(),
            "left running: {}",
            String::from_utf8_lossy(&left.stdout)
        );
    }

    #[test]
    fn passing_and_failing_files_are_told_apart() {
        let mut ok = Command::new("true");
        ok.arg("x");
        assert_eq!(
            run_file("ok", ok, Duration::from_secs(10)).unwrap(),
            Outcome::Passed { ran: 0 }
        );
        // How many ran is libtest's result line's (what a filter left).
        let mut two = Command::new("bash");
        two.arg("-c").arg(
            "echo 'test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 5 filtered out'",
        );
        assert_eq!(
            run_file("two", two, Duration::from_secs(10)).unwrap(),
            Outcome::Passed { ran: 2 }
        );
        let bad = Command::new("false");
        assert_eq!(
            run_file("bad", bad, Duration::from_secs(10)).unwrap(),
            Outcome::Failed { panics: vec![] }
        );
    }

    #[test]
    fn a_failing_files_panic_is_kept_for_the_summary() {
        let mut bad = Command::new("bash");
        bad.arg("-c").arg(
            // A line of stdout between the panic and its message on
            // stderr is no part of the message.
            "echo 'log line'; echo \"thread 't' panicked at x.rs:1:2:\" >&2; \
             echo 'failures:'; echo 'the stream failed' >&2; echo >&2; exit 101",
        );
        assert_eq!(
            run_file("bad", bad, Duration::from_secs(10)).unwrap(),
            Outcome::Failed {
                panics: vec![
                    "thread 't' panicked at x.rs:1:2:".to_string(),
                    "the stream failed".to_string()
                ]
            }
        );
    }
}
