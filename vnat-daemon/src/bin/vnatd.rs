//! vnatd: parse flags, read the config, open the kernel datapath, serve the
//! control socket until SIGTERM or SIGINT. The logic lives in
//! `vnat_daemon::daemon`; this file is the process edge.

use std::process::ExitCode;

use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};
use vnat_daemon::{
    daemon::{
        self,
        cgroup::cgroup2_root,
        config::{load_file, Args, Settings},
        DaemonError,
    },
    datapath::{
        kernel::{KernelDatapath, KernelOptions},
        Datapath,
    },
};

fn main() -> ExitCode {
    // clap prints its own usage errors and exits 2 (0 for --help/--version).
    let args = Args::parse();
    match start(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Logging may not be up yet (bad config), and the journal shows
            // stderr anyway: one sentence, prefixed like every other tool.
            eprintln!("vnatd: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

fn start(args: Args) -> Result<(), DaemonError> {
    let (config_file, file) = load_file(args.config.as_deref())?;
    let rust_log = std::env::var("RUST_LOG").ok();
    let settings = Settings::resolve(args, config_file, file, rust_log, cgroup2_root)?;
    daemon::init_logging(&settings)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|source| DaemonError::Runtime {
            what: "start the async runtime",
            source,
        })?;
    runtime.block_on(async {
        // Installed before anything is created, so a signal during start-up
        // still leads to a clean stop instead of the default kill.
        let mut term = signal(SignalKind::terminate()).map_err(|source| DaemonError::Runtime {
            what: "install the SIGTERM handler",
            source,
        })?;
        let mut int = signal(SignalKind::interrupt()).map_err(|source| DaemonError::Runtime {
            what: "install the SIGINT handler",
            source,
        })?;
        let shutdown = async move {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            tracing::info!("{name} received; stopping");
        };
        daemon::run(&settings, open_datapath, shutdown).await
    })
}

/// Open (or adopt the pinned) kernel datapath and attach it to the
/// configured cgroups. The only place vnatd names the real datapath; the run
/// loop and the control API see the `Datapath` trait.
fn open_datapath(settings: &Settings) -> Result<Box<dyn Datapath + Send>, DaemonError> {
    tracing::debug!(bpffs = %settings.bpffs.display(), cgroups = ?settings.cgroups, "opening the kernel datapath");
    let opts = KernelOptions {
        bpffs: settings.bpffs.clone(),
        cgroups: settings.cgroups.clone(),
    };
    Ok(Box::new(KernelDatapath::open(&opts)?))
}
