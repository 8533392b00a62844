//! vnatctl: the command line for vnatd. See `vnatctl --help`.

mod cli;
mod output;
#[cfg(test)]
mod tests;

use std::{io, path::PathBuf, process::ExitCode};

use clap::Parser;
use cli::{Cli, Command, ProtoArg, StateArg};
use output::LsRow;
use vnat_daemon::{
    control::{ClientError, ControlClient},
    datapath::{ConnState, ConnectionInfo, Proto},
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
}

impl Failure {
    /// 1: vnatd reported an error (or broke the protocol), 2: usage,
    /// 3: vnatd cannot be reached.
    fn exit_code(&self) -> u8 {
        match self {
            Failure::Client(e) if e.is_unreachable() => 3,
            Failure::Client(_) | Failure::Runtime(_) => 1,
            Failure::Path { .. } => 2,
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
            Failure::Path { .. } => "usage",
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
            if cli.json {
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

/// Run the command and return what to print on stdout.
fn run(cli: &Cli) -> Result<String, Failure> {
    // Resolve paths before connecting: vnatd's working directory is not ours.
    let absolute = |p: &PathBuf| {
        std::path::absolute(p).map_err(|source| Failure::Path {
            path: p.clone(),
            source,
        })
    };
    let command = match &cli.command {
        Command::Enable { cgroup } => Command::Enable {
            cgroup: absolute(cgroup)?,
        },
        Command::Disable { cgroup } => Command::Disable {
            cgroup: absolute(cgroup)?,
        },
        Command::Status => Command::Status,
        Command::Ls { proto, state } => Command::Ls {
            proto: *proto,
            state: *state,
        },
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Failure::Runtime)?;
    runtime.block_on(async {
        let mut client = ControlClient::connect(&cli.control).await?;
        let json = cli.json;
        Ok(match command {
            Command::Status => {
                let status = client.status().await?;
                if json {
                    pretty(&output::StatusJson::from(&status))
                } else {
                    output::status_text(&status)
                }
            }
            Command::Ls { proto, state } => {
                let rows = select(client.list().await?, proto, state);
                if json {
                    pretty(&rows)
                } else {
                    output::ls_table(&rows)
                }
            }
            Command::Enable { cgroup } => {
                let path = client.enable_cgroup(&cgroup).await?;
                cgroup_result(json, &path, true)
            }
            Command::Disable { cgroup } => {
                let path = client.disable_cgroup(&cgroup).await?;
                cgroup_result(json, &path, false)
            }
        })
    })
}

/// Filter by the `ls` flags and sort by virtual endpoints, so that the
/// output order does not depend on the daemon's map iteration order.
fn select(
    conns: Vec<ConnectionInfo>,
    proto: Option<ProtoArg>,
    state: Option<StateArg>,
) -> Vec<LsRow> {
    let proto: Option<Proto> = proto.map(Into::into);
    let state: Option<ConnState> = state.map(Into::into);
    let mut conns: Vec<ConnectionInfo> = conns
        .into_iter()
        .filter(|c| proto.is_none_or(|p| c.proto == p) && state.is_none_or(|s| c.state == s))
        .collect();
    conns.sort_by_key(|c| (c.virtual_local, c.virtual_remote, c.proto));
    conns.iter().map(LsRow::from).collect()
}

fn cgroup_result(json: bool, path: &std::path::Path, enabled: bool) -> String {
    if json {
        pretty(&serde_json::json!({ "cgroup": path, "enabled": enabled }))
    } else if enabled {
        format!(
            "vnat now manages the connections of cgroup {}\n",
            path.display()
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
