//! `cargo xtask bench scale`: 100,000 live TCP connections (issue 5, item
//! 5): the memory of vnatd and of its BPF maps with all of them recorded,
//! the time `vnatctl ls` takes, and the time to resume all of them after the
//! laptop moves.
//!
//! It is the restore benchmark at that size (`restore --scale`), which has
//! the hosts, the epoll client and echo server and the daemons: this binary
//! runs it with `--conns 100000 --runs 1 --interval-ms 1000` (each
//! connection writes once a second: every 10 ms would be ten million writes a
//! second) and any arguments given, which override those. The result is
//! bench/results/scale.json (and restore.json beside it).

use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    let given: Vec<String> = std::env::args().skip(1).collect();
    if given.iter().any(|a| a == "-h" || a == "--help") {
        println!(
            "Usage: scale [RESTORE OPTIONS]\n\n\
             Runs `restore --scale --conns 100000 --runs 1 --interval-ms 1000` and writes \
             bench/results/scale.json: vnatctl ls time, vnatd and BPF map memory, time to resume all.\n\
             Options given here are passed to restore after those (a later --conns or --interval-ms wins).\n\
             See `restore --help`."
        );
        return ExitCode::SUCCESS;
    }
    let Ok(me) = std::env::current_exe() else {
        eprintln!("scale: cannot find this executable to find the restore benchmark beside it");
        return ExitCode::FAILURE;
    };
    let restore = me.with_file_name("restore");
    if !restore.is_file() {
        eprintln!(
            "scale: {} does not exist: build the benchmarks first (cargo build --release -p vnat-bench --bins; \
             cargo xtask bench does)",
            restore.display()
        );
        return ExitCode::FAILURE;
    }
    let mut args = vec![
        "--scale".to_string(),
        "--conns".into(),
        "100000".into(),
        "--runs".into(),
        "1".into(),
        "--interval-ms".into(),
        "1000".into(),
    ];
    // clap keeps the last of a repeated single-value option; --conns is a
    // list, so a given --conns replaces ours instead of adding to it.
    if given
        .iter()
        .any(|a| a == "--conns" || a.starts_with("--conns="))
    {
        args.drain(1..3);
    }
    args.extend(given);
    match Command::new(&restore).args(&args).status() {
        Ok(s) if s.success() => ExitCode::SUCCESS,
        Ok(s) => {
            eprintln!("scale: the restore benchmark failed ({s})");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("scale: cannot run {}: {e}", restore.display());
            ExitCode::FAILURE
        }
    }
}
