//! vnatctl: the command line for vnatd. See `vnatctl --help`.

mod cli;
mod criu;
mod criu_lock;
mod output;
#[cfg(test)]
mod tests;
mod wait;

use std::{
    io::{self, Read as _, Write as _},
    os::unix::fs::OpenOptionsExt as _,
    path::{Path, PathBuf},
    process::ExitCode,
};

use clap::Parser;
use cli::{Cli, Command, PeersAction, ProtoArg, SelectArgs, StateArg};
use output::LsRow;
use vnat_control::{
    datapath::{ConnState, Proto},
    ClientError, ControlClient, ExportDocument, ListedConnection, MigrateTarget, Selector,
};

/// Why a command failed; each maps to an exit status and a JSON `kind`.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("cannot make the path {} absolute: {source}", path.display())]
    Path {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot start vnatctl's async runtime: {0}")]
    Runtime(#[source] io::Error),
    #[error("cannot create the export file {}: {source}; choose a path that does not exist yet (nothing was exported)", path.display())]
    CreateOutput {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The daemon exported (and forgot) the connections but the file could
    /// not be written: the document went to stdout so that it is not lost.
    #[error("vnatd exported the connections but writing {} failed: {source}; the export was printed to stdout instead, keep it secret", path.display())]
    WriteOutput {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// vnatd answered `enable --hide-location` without hiding (one older
    /// than this vnatctl ignores the flag).
    #[error("vnatd enabled {} but did not turn hide location on; is vnatd older than vnatctl? (vnatd --version)", path.display())]
    NotHiding { path: PathBuf },
    #[error("{failed} connection(s) did not move (see above; vnatd's log says why)")]
    NotMoved { report: String, failed: usize },
    #[error("{failed} suspension(s) were not settled with the peer (see above)")]
    NotSettled { report: String, failed: usize },
    #[error("vnatd closed the monitoring connection (did it stop? journalctl -u vnatd)")]
    MonitorEnded,
    #[error(transparent)]
    Hook(#[from] criu::HookError),
    #[error("cannot read the export {}: {source}", name(path))]
    ReadInput {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "{} is not a vnat export ({source}); give the file `vnatctl export` wrote",
        name(path)
    )]
    ParseInput {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// "-" reads as "stdin" in messages.
fn name(path: &Path) -> String {
    if path == Path::new("-") {
        "from stdin".into()
    } else {
        path.display().to_string()
    }
}

impl Failure {
    /// 1: vnatd reported an error (or broke the protocol), 2: usage,
    /// 3: vnatd cannot be reached.
    fn exit_code(&self) -> u8 {
        match self {
            Failure::Client(e) if e.is_unreachable() => 3,
            Failure::Client(_)
            | Failure::NotMoved { .. }
            | Failure::NotSettled { .. }
            | Failure::MonitorEnded
            | Failure::NotHiding { .. }
            | Failure::Runtime(_)
            | Failure::CreateOutput { .. }
            | Failure::WriteOutput { .. } => 1,
            Failure::Path { .. } | Failure::ReadInput { .. } | Failure::ParseInput { .. } => 2,
            Failure::Hook(e) => e.exit_code(),
        }
    }

    /// The `kind` of the `--json` error object.
    fn kind(&self) -> &'static str {
        match self {
            Failure::Client(ClientError::Unreachable { .. }) => "unreachable",
            Failure::Client(ClientError::Timeout { .. }) => "timeout",
            Failure::Client(ClientError::Io { .. }) => "connection_lost",
            Failure::Client(ClientError::Protocol { .. }) => "protocol",
            Failure::Client(ClientError::Daemon { kind, .. }) => kind.as_str(),
            Failure::Path { .. } | Failure::ReadInput { .. } | Failure::ParseInput { .. } => {
                "usage"
            }
            Failure::CreateOutput { .. } | Failure::WriteOutput { .. } => "output",
            Failure::NotMoved { .. } | Failure::NotSettled { .. } => "mobility",
            Failure::MonitorEnded => "connection_lost",
            Failure::NotHiding { .. } => "protocol",
            Failure::Hook(criu::HookError::NotMobile { .. }) => "mobility",
            Failure::Hook(_) => "usage",
            Failure::Runtime(_) => "internal",
        }
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    match run(&cli) {
        Ok(stdout) => {
            print!("{stdout}");
            ExitCode::SUCCESS
        }
        Err(failure) => {
            // After a failed export write, stdout holds the rescued export
            // document; an error object after it would make it unparsable.
            if let Failure::NotMoved { report, .. } | Failure::NotSettled { report, .. } = &failure
            {
                // The outcomes are the answer, the failed ones included.
                print!("{report}");
            } else if cli.json && !matches!(failure, Failure::WriteOutput { .. }) {
                println!(
                    "{}",
                    output::error_json(failure.kind(), &failure.to_string())
                );
            }
            eprintln!("vnatctl: {failure}");
            ExitCode::from(failure.exit_code())
        }
    }
}

/// clap's own output (help, version, usage errors), plus the JSON error
/// object when `--json` was among the arguments.
fn usage_error(e: clap::Error) -> ExitCode {
    let code = e.exit_code();
    if code != 0 && std::env::args().any(|a| a == "--json") {
        let rendered = e.render().to_string();
        let first = rendered.lines().next().unwrap_or_default();
        println!(
            "{}",
            output::error_json("usage", first.trim_start_matches("error: "))
        );
    }
    let _ = e.print();
    ExitCode::from(u8::try_from(code).unwrap_or(2))
}

/// `vnatctl generate WHAT`: the man page or a completion, from the same
/// clap definitions as `--help` (`cargo xtask package` packages them).
fn generate(what: cli::Generate) -> String {
    use clap::CommandFactory;
    let mut cmd = Cli::command();
    let mut out = Vec::new();
    let shell = match what {
        cli::Generate::Man => {
            // Writing to a Vec cannot fail.
            let _ = clap_mangen::Man::new(cmd).section("8").render(&mut out);
            return String::from_utf8_lossy(&out).into_owned();
        }
        cli::Generate::Bash => clap_complete::Shell::Bash,
        cli::Generate::Zsh => clap_complete::Shell::Zsh,
        cli::Generate::Fish => clap_complete::Shell::Fish,
    };
    clap_complete::generate(shell, &mut cmd, "vnatctl", &mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Run the command and return what to print on stdout.
fn run(cli: &Cli) -> Result<String, Failure> {
    // Resolve paths before connecting: vnatd's working directory is not ours.
    let absolute = |p: &PathBuf| {
        std::path::absolute(p).map_err(|source| Failure::Path {
            path: p.clone(),
            source,
        })
    };
    let selector = |s: &SelectArgs| -> Result<Selector, Failure> {
        Ok(if s.all {
            Selector::All
        } else if let Some(pid) = s.pid {
            Selector::Pid(pid)
        } else if let Some(dir) = &s.cgroup {
            Selector::Cgroup(absolute(dir)?)
        } else {
            // clap's group guarantees exactly one; --conn is what is left.
            Selector::Conns(s.conn.clone())
        })
    };
    let request = match &cli.command {
        Command::Generate { what } => return Ok(generate(*what)),
        Command::Enable {
            cgroup,
            hide_location,
            no_hide_location,
        } => Plan::Enable(
            absolute(cgroup)?,
            match (hide_location, no_hide_location) {
                (true, _) => Some(true),
                (_, true) => Some(false),
                _ => None,
            },
        ),
        Command::Disable { cgroup } => Plan::Disable(absolute(cgroup)?),
        Command::Status => Plan::Status,
        Command::Ls { proto, state } => Plan::Ls(*proto, *state),
        Command::Suspend {
            select,
            helpers,
            wait,
        } => Plan::Suspend(selector(select)?, helpers.clone(), wait.limit()),
        Command::Resume { select, wait } => Plan::Resume(selector(select)?, wait.limit()),
        Command::Monitor => Plan::Monitor,
        Command::Migrate {
            select,
            target,
            wait,
        } => {
            let to = match (&target.to, &target.dev) {
                (Some(a), _) => MigrateTarget::Address(*a),
                // clap's group guarantees exactly one.
                (None, dev) => MigrateTarget::Device(dev.clone().unwrap_or_default()),
            };
            Plan::Migrate(selector(select)?, to, wait.limit())
        }
        Command::Peers { action: None } => Plan::Peers,
        Command::Peers {
            action: Some(PeersAction::Forget { key }),
        } => Plan::ForgetPeer(key.clone()),
        Command::Export { select, output, to } => {
            // Create the file before vnatd forgets anything, so that an
            // unwritable path fails with nothing exported.
            let file = match output {
                Some(path) => Some((absolute(path)?, create_secret(path)?)),
                None => None,
            };
            Plan::Export(selector(select)?, file, to.clone())
        }
        Command::Import { file, from, wait } => {
            Plan::Import(read_export(file)?, from.clone(), wait.limit())
        }
        Command::CriuHook {
            to,
            from,
            unlock_after,
        } => match criu_plan(to, from, *unlock_after)? {
            Some(plan) => plan,
            None => return Ok(String::new()),
        },
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Failure::Runtime)?;
    let json = cli.json;
    let control = cli.control.as_path();
    runtime.block_on(async {
        if matches!(request, Plan::Monitor) {
            return wait::monitor(control, json).await;
        }
        // --wait: subscribe to vnatd's events before the command, so that
        // no outcome can come between the two unseen.
        let waits = matches!(
            request,
            Plan::Suspend(_, _, Some(_))
                | Plan::Resume(_, Some(_))
                | Plan::Migrate(_, _, Some(_))
                | Plan::Import(_, _, Some(_))
        );
        let sub = if waits {
            wait::subscribe(control).await?
        } else {
            None
        };
        let mut client = match ControlClient::connect(&cli.control).await {
            Ok(c) => c,
            // After a restore, nothing may fail it (CRIU would kill the
            // restored process); vnatd finds the sockets by itself.
            Err(e) if matches!(request, Plan::CriuResume) => {
                return Ok(format!("vnat: cannot reach vnatd to hurry it ({e})\n"))
            }
            Err(e) => return Err(e.into()),
        };
        Ok(match request {
            Plan::Status => {
                let status = client.status().await?;
                if json {
                    pretty(&output::StatusJson::from(&status))
                } else {
                    output::status_text(&status)
                }
            }
            Plan::Ls(proto, state) => {
                let rows = select(client.list().await?, proto, state);
                if json {
                    pretty(&rows)
                } else {
                    output::ls_table(&rows)
                }
            }
            Plan::Enable(cgroup, hide) => {
                let (path, hiding) = client.enable_cgroup_hiding(&cgroup, hide).await?;
                if hide == Some(true) && !hiding {
                    return Err(Failure::NotHiding { path });
                }
                cgroup_result(json, &path, Some(hiding))
            }
            Plan::Disable(cgroup) => {
                let path = client.disable_cgroup(&cgroup).await?;
                cgroup_result(json, &path, None)
            }
            Plan::Suspend(selector, helpers, wait) => {
                let reply = client.suspend(selector, helpers).await?;
                let Some(timeout) = wait else {
                    return Ok(if json {
                        pretty(&output::SuspendJson::from(&reply))
                    } else {
                        output::suspend_text(&reply)
                    });
                };
                let ids = reply.suspended.clone();
                let rows = wait::report(control, sub, wait::Awaited::Suspensions, &ids, &[], &Default::default(), &[], timeout).await?;
                let report = if json {
                    let mut v = serde_json::to_value(output::SuspendJson::from(&reply)).unwrap_or_default();
                    v["suspensions"] = serde_json::to_value(&rows).unwrap_or_default();
                    pretty(&v)
                } else {
                    output::suspend_text(&reply) + &output::waited_text(&rows)
                };
                let failed = rows.iter().filter(|r| !r.ok()).count();
                if failed > 0 {
                    return Err(Failure::NotSettled { report, failed });
                }
                report
            }
            Plan::Resume(selector, wait) => {
                let reply = client.resume(selector).await?;
                let Some(timeout) = wait else {
                    return Ok(if json {
                        pretty(&output::ResumeJson::from(&reply))
                    } else {
                        output::resume_text(&reply)
                    });
                };
                let rows = wait::report(control, sub, wait::Awaited::Moves, &reply.moving, &reply.selected, &Default::default(), &[], timeout).await?;
                let report = if json {
                    let mut v = serde_json::to_value(output::ResumeJson::from(&reply)).unwrap_or_default();
                    v["moves"] = serde_json::to_value(&rows).unwrap_or_default();
                    pretty(&v)
                } else if rows.is_empty() {
                    "nothing to wait for: no selected connection is moving (automatic mode may have moved them already)\n".into()
                } else {
                    output::waited_text(&rows)
                };
                let failed = rows.iter().filter(|r| !r.ok()).count();
                if failed > 0 {
                    return Err(Failure::NotMoved { report, failed });
                }
                report
            }
            Plan::Migrate(selector, to, wait) => {
                let reply = client.migrate(selector, to).await?;
                let Some(timeout) = wait else {
                    return Ok(if json {
                        pretty(&output::MigrateJson::from(&reply))
                    } else {
                        output::migrate_text(&reply)
                    });
                };
                let ids: Vec<u64> = reply.started.iter().map(|s| s.id).collect();
                let targets = reply.started.iter().map(|s| (s.id, s.to)).collect();
                let mut rows = wait::report(control, sub, wait::Awaited::Moves, &ids, &[], &targets, &[], timeout).await?;
                // What the command said of each, where the wait knows less.
                for r in &mut rows {
                    if let Some(s) = reply.started.iter().find(|s| s.id == r.id) {
                        r.from.get_or_insert_with(|| s.from.to_string());
                        r.to.get_or_insert_with(|| s.to.to_string());
                    }
                }
                let failed = rows.iter().filter(|r| !r.ok()).count();
                let report = if json {
                    pretty(&output::MigrateWaitJson {
                        moves: rows,
                        skipped: output::skipped_json(&reply.skipped),
                    })
                } else {
                    output::migrate_wait_text(&rows, &reply.skipped)
                };
                if failed > 0 {
                    return Err(Failure::NotMoved { report, failed });
                }
                report
            }
            Plan::Peers => {
                let rows: Vec<output::PeerRow> =
                    client.peers().await?.iter().map(Into::into).collect();
                if json {
                    pretty(&rows)
                } else {
                    output::peers_table(&rows)
                }
            }
            Plan::ForgetPeer(key) => {
                let connections = client.forget_peer(&key).await?;
                if json {
                    pretty(&serde_json::json!({
                        "forgotten": key.trim(),
                        "connections": connections,
                    }))
                } else {
                    format!(
                        "forgot peer host {}; {connections} connection(s) it held can be claimed again\n",
                        key.trim()
                    )
                }
            }
            Plan::Export(selector, file, to) => {
                let document = client.export(selector, to).await?;
                let text = pretty(&document);
                match file {
                    None => text,
                    Some((path, file)) => {
                        if let Err(source) = write_secret(file, &text) {
                            // vnatd has already forgotten the connections'
                            // keys: print the export rather than lose it.
                            print!("{text}");
                            return Err(Failure::WriteOutput { path, source });
                        }
                        output::export_written(json, &path, &document)
                    }
                }
            }
            Plan::CriuExport {
                tree,
                to,
                path,
                unlock_after,
            } => {
                let conns = client.list().await?;
                let ids = criu::select_connections(Path::new("/proc"), &tree, &conns)?;
                if ids.is_empty() {
                    return Ok(format!(
                        "vnat: no connection of process tree {tree:?} is recorded by vnatd; nothing to export\n"
                    ));
                }
                // Create the file before vnatd forgets anything, so that an
                // unwritable images directory fails with nothing exported.
                // A failure here aborts the dump: the process runs on here,
                // so its peers are told to stop holding (pre-dump asked).
                let file = match create_secret_replacing(&path) {
                    Ok(f) => f,
                    Err(e) => {
                        let _ = client.ask_help(Selector::Conns(ids), Vec::new(), 0).await;
                        return Err(e);
                    }
                };
                let document = match client.export(Selector::Conns(ids.clone()), Some(to)).await {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = client.ask_help(Selector::Conns(ids), Vec::new(), 0).await;
                        return Err(e.into());
                    }
                };
                let text = pretty(&document);
                if let Err(source) = write_secret(file, &text) {
                    print!("{text}");
                    return Err(Failure::WriteOutput { path, source });
                }
                let mut said = output::export_written(json, &path, &document);
                if unlock_after > 0 {
                    let tuples: Vec<_> = conns
                        .iter()
                        .filter(|c| ids.contains(&c.info.id) && c.info.proto == Proto::Tcp)
                        .map(|c| (c.info.virtual_local, c.info.virtual_remote))
                        .collect();
                    // The export is written: whatever happens here, the
                    // dump goes on (the lock then stays, as without it).
                    let note = match criu_lock::find(&tuples).and_then(|tables| {
                        criu_lock::remove_later(&tables, std::time::Duration::from_secs(unlock_after))
                            .map(|()| tables)
                    }) {
                        Ok(t) if t.is_empty() => String::new(),
                        Ok(t) => format!(
                            "vnat: CRIU's network lock here ({}) is removed in {unlock_after} s\n",
                            t.join(", ")
                        ),
                        Err(e) => format!("vnat: {e}\n"),
                    };
                    if !json {
                        said.push_str(&note);
                    } else if !note.is_empty() {
                        eprint!("{note}");
                    }
                }
                said
            }
            Plan::CriuHold { tree } => {
                // Before any freeze: a connection that cannot move fails
                // the dump now rather than after it.
                let ids =
                    criu::select_connections(Path::new("/proc"), &tree, &client.list().await?)?;
                if ids.is_empty() {
                    return Ok(String::new());
                }
                let hold = vec![vnat_control::vcmp::help::HOLD.to_string()];
                match client
                    .ask_help(Selector::Conns(ids), hold, criu::HOLD_CONFIRM_MS)
                    .await
                {
                    Ok((asked, confirmed)) => format!(
                        "vnat: the peers of {} of {} connection(s) received the request to hold their packets until the connections have moved\n",
                        confirmed.len(),
                        asked.len()
                    ),
                    // Not holding costs what it did before the hold existed
                    // (the packets sent during the freeze are resent): no
                    // reason to fail the checkpoint.
                    Err(e) => format!("vnat: cannot ask the peers to hold their packets ({e}); those sent during the freeze will be resent\n"),
                }
            }
            Plan::CriuResume => match client.resume(Selector::All).await {
                    Ok(_) => String::new(),
                    Err(e) => format!("vnat: vnatd will find the restored connections by itself within a second ({e})\n"),
                },
            Plan::Import(document, from, wait) => {
                let imported = client.import(document, from).await?;
                let rows: Vec<output::ImportRow> = imported.iter().map(Into::into).collect();
                let Some(timeout) = wait else {
                    return Ok(if json {
                        pretty(&rows)
                    } else {
                        output::import_text(&rows)
                    });
                };
                let ids: Vec<u64> = imported
                    .iter()
                    .filter(|c| c.moving || c.move_pending)
                    .map(|c| c.id)
                    .collect();
                let targets = imported
                    .iter()
                    .filter(|c| c.moving)
                    .map(|c| (c.id, c.physical_local))
                    .collect();
                // Those waiting for their restored socket are not in `ls`
                // until it appears.
                let unlisted: Vec<u64> = imported.iter().filter(|c| c.move_pending).map(|c| c.id).collect();
                let moves = wait::report(control, sub, wait::Awaited::Moves, &ids, &[], &targets, &unlisted, timeout).await?;
                let report = if json {
                    pretty(&serde_json::json!({ "imported": rows, "moves": moves }))
                } else {
                    output::import_text(&rows) + &output::waited_text(&moves)
                };
                let failed = moves.iter().filter(|r| !r.ok()).count();
                if failed > 0 {
                    return Err(Failure::NotMoved { report, failed });
                }
                report
            }
            Plan::Monitor => return Err(Failure::MonitorEnded),
        })
    })
}

/// A command with its arguments checked and resolved, ready to send.
enum Plan {
    Status,
    Ls(Option<ProtoArg>, Option<StateArg>),
    /// With hide location turned on or off, or left as it is.
    Enable(PathBuf, Option<bool>),
    Disable(PathBuf),
    /// With how long `--wait` waits, if it does (also below).
    Suspend(Selector, Vec<String>, Option<std::time::Duration>),
    Resume(Selector, Option<std::time::Duration>),
    Monitor,
    /// With how long `--wait` waits, if it does.
    Migrate(Selector, MigrateTarget, Option<std::time::Duration>),
    Peers,
    ForgetPeer(String),
    Export(Selector, Option<(PathBuf, std::fs::File)>, Option<String>),
    Import(ExportDocument, Option<String>, Option<std::time::Duration>),
    /// criu-hook at post-dump: the dumped tree's connections, sealed for
    /// `to`, into the images directory.
    CriuExport {
        tree: std::collections::BTreeSet<u32>,
        to: String,
        path: PathBuf,
        /// Seconds after which CRIU's lock of the exported connections is
        /// deleted (0: left in place).
        unlock_after: u64,
    },
    /// criu-hook at post-restore: have vnatd look for the restored sockets
    /// now.
    CriuResume,
    /// criu-hook at pre-dump: the tree's peers hold their packets until
    /// its connections have moved.
    CriuHold {
        tree: std::collections::BTreeSet<u32>,
    },
}

/// What `criu-hook` does for the action CRIU names (None: nothing). Reads
/// the tree and the images before connecting, as the other commands check
/// their arguments first.
fn criu_plan(
    to: &Option<String>,
    from: &Option<String>,
    unlock_after: u64,
) -> Result<Option<Plan>, Failure> {
    let env = criu::CriuEnv::from_process();
    Ok(match env.action()? {
        criu::Action::Ignored(_) => None,
        criu::Action::PreDump => Some(Plan::CriuHold {
            tree: criu::process_tree(Path::new("/proc"), env.init_pid()?)?,
        }),
        criu::Action::PostDump => {
            let to = to.clone().ok_or(criu::HookError::NoTarget)?;
            let pid = env.init_pid()?;
            let tree = criu::process_tree(Path::new("/proc"), pid)?;
            Some(Plan::CriuExport {
                tree,
                to,
                path: env.export_path()?,
                unlock_after,
            })
        }
        criu::Action::PreRestore => {
            let path = env.export_path()?;
            if !path.exists() {
                // Dumped without the hook, or a process with no
                // connection of vnat's: nothing to take over.
                println!(
                    "vnat: no {} in the images; nothing to import",
                    criu::EXPORT_FILE
                );
                return Ok(None);
            }
            let document = read_export(&path)?;
            let from = criu::restore_sender(from.as_deref(), &path)?;
            Some(Plan::Import(document, Some(from), None))
        }
        criu::Action::PostRestore => env
            .export_path()
            .is_ok_and(|p| p.exists())
            .then_some(Plan::CriuResume),
    })
}

/// A new file only its owner can read: the export holds keys. `create_new`
/// refuses an existing file (or a symlink planted in its place).
fn create_secret(path: &Path) -> Result<std::fs::File, Failure> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|source| Failure::CreateOutput {
            path: path.to_path_buf(),
            source,
        })
}

/// As [`create_secret`], in a directory only root writes (CRIU's images):
/// an export left by an earlier dump into the same directory is replaced,
/// as CRIU replaces its own images.
fn create_secret_replacing(path: &Path) -> Result<std::fs::File, Failure> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => {
            return Err(Failure::CreateOutput {
                path: path.to_path_buf(),
                source,
            })
        }
    }
    create_secret(path)
}

fn write_secret(mut file: std::fs::File, text: &str) -> io::Result<()> {
    file.write_all(text.as_bytes())?;
    file.sync_all()
}

fn read_export(path: &Path) -> Result<ExportDocument, Failure> {
    let read_err = |source| Failure::ReadInput {
        path: path.to_path_buf(),
        source,
    };
    let mut text = Vec::new();
    if path == Path::new("-") {
        io::stdin().read_to_end(&mut text).map_err(read_err)?;
    } else {
        text = std::fs::read(path).map_err(read_err)?;
    }
    serde_json::from_slice(&text).map_err(|source| Failure::ParseInput {
        path: path.to_path_buf(),
        source,
    })
}

/// Filter by the `ls` flags and sort by virtual endpoints, so that the
/// output order does not depend on the daemon's map iteration order.
fn select(
    conns: Vec<ListedConnection>,
    proto: Option<ProtoArg>,
    state: Option<StateArg>,
) -> Vec<LsRow> {
    let proto: Option<Proto> = proto.map(Into::into);
    let state: Option<ConnState> = state.map(Into::into);
    let mut conns: Vec<ListedConnection> = conns
        .into_iter()
        .filter(|c| {
            proto.is_none_or(|p| c.info.proto == p) && state.is_none_or(|s| c.info.state == s)
        })
        .collect();
    conns.sort_by_key(|c| (c.info.virtual_local, c.info.virtual_remote, c.info.proto));
    conns.iter().map(LsRow::from).collect()
}

/// `enable` (with whether the cgroup now hides location) or `disable`.
fn cgroup_result(json: bool, path: &std::path::Path, enabled: Option<bool>) -> String {
    if json {
        match enabled {
            Some(hide) => pretty(
                &serde_json::json!({ "cgroup": path, "enabled": true, "hide_location": hide }),
            ),
            None => pretty(&serde_json::json!({ "cgroup": path, "enabled": false })),
        }
    } else if let Some(hide) = enabled {
        format!(
            "vnat now manages the connections of cgroup {}{}\n",
            path.display(),
            if hide {
                "; its applications keep seeing moved hosts at their old addresses (hide location)"
            } else {
                ""
            }
        )
    } else {
        format!(
            "vnat no longer records new connections of cgroup {} (translated ones keep working)\n",
            path.display()
        )
    }
}

fn pretty<T: serde::Serialize>(value: &T) -> String {
    // Serializing these plain structs cannot fail; fall back to an error
    // object rather than panicking.
    let mut s = serde_json::to_string_pretty(value)
        .unwrap_or_else(|e| output::error_json("internal", &format!("cannot print JSON: {e}")));
    s.push('\n');
    s
}
