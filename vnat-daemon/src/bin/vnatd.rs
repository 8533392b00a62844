//! vnatd: parse flags, read the config, open the kernel datapath, serve the
//! control socket until SIGTERM or SIGINT; on SIGHUP (`systemctl reload`,
//! log rotation) read the config again and apply it without losing state.
//! The logic lives in `vnat_daemon::daemon`; this file is the process edge.

use std::process::ExitCode;

use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};
use vnat_daemon::{
    daemon::{
        self,
        cgroup::cgroup2_root,
        config::{keys, load_file, Args, Generate, Settings},
        DaemonError,
    },
    datapath::{
        kernel::{check, sysctls, KernelDatapath, KernelOptions, TcLoad},
        Datapath,
    },
};

fn main() -> ExitCode {
    // clap prints its own usage errors and exits 2 (0 for --help/--version).
    let args = Args::parse();
    if let Some(what) = args.generate {
        return generate(what);
    }
    if args.check {
        return match check(&args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("vnatd: {e}");
                ExitCode::from(e.exit_code())
            }
        };
    }
    if args.cleanup {
        return match cleanup(&args) {
            Ok(code) => code,
            Err(e) => {
                eprintln!("vnatd: {e}");
                ExitCode::from(e.exit_code())
            }
        };
    }
    match start(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Logging may not be up yet (bad config), and the journal shows
            // stderr anyway: one sentence, prefixed like every other tool
            // (and, for the journal, with its priority).
            eprintln!("{}vnatd: {e}", daemon::systemd::error_prefix());
            ExitCode::from(e.exit_code())
        }
    }
}

/// The settings from `args` and the config file as it is now.
fn settings_of(args: &Args) -> Result<Settings, DaemonError> {
    let (config_file, file) = load_file(args.config.as_deref())?;
    let rust_log = std::env::var("RUST_LOG").ok();
    Ok(Settings::resolve(
        args.clone(),
        config_file,
        file,
        rust_log,
        cgroup2_root,
    )?)
}

/// `vnatd --generate WHAT`: a man page, the example config or a shell
/// completion on stdout, from the same definitions as `--help` and the
/// config parser (`cargo xtask package` writes the package's from these).
fn generate(what: Generate) -> ExitCode {
    use std::io::Write;

    use clap::CommandFactory;
    use clap_complete::Shell;
    let mut cmd = Args::command();
    let mut out = std::io::stdout().lock();
    let written = match what {
        Generate::Man => clap_mangen::Man::new(cmd).section("8").render(&mut out),
        Generate::ManConfig => out.write_all(keys::man_page(env!("CARGO_PKG_VERSION")).as_bytes()),
        Generate::Config => out.write_all(keys::example_file().as_bytes()),
        Generate::Bash | Generate::Zsh | Generate::Fish => {
            let shell = match what {
                Generate::Bash => Shell::Bash,
                Generate::Zsh => Shell::Zsh,
                _ => Shell::Fish,
            };
            clap_complete::generate(shell, &mut cmd, "vnatd", &mut out);
            Ok(())
        }
    };
    match written.and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vnatd: cannot write to stdout: {e}");
            ExitCode::from(1)
        }
    }
}

/// `vnatd --check [--json]`: print the report; exit 0 when vnatd can run
/// here, 1 when it cannot.
fn check(args: &Args) -> Result<ExitCode, DaemonError> {
    let settings = settings_of(args)?;
    let unknown = vnat_daemon::datapath::kernel::features::unknown_simulated();
    if !unknown.is_empty() {
        eprintln!(
            "vnatd: {} names no kernel feature: {} (known: {})",
            vnat_daemon::datapath::kernel::features::LACKS_ENV,
            unknown.join(", "),
            vnat_daemon::datapath::kernel::features::Feature::ALL
                .map(|f| f.name())
                .join(", ")
        );
        return Ok(ExitCode::from(2));
    }
    let report = check::check(&settings.bpffs, settings.tc_attach);
    let mut store = vnat_daemon::daemon::config::store::describe(&settings.location_store);
    if let Some(etcd) = &settings.location_store {
        // What the first move would meet: the files, the login, the role.
        match vnat_daemon::daemon::etcd::check(etcd) {
            Ok(()) => store.push_str(": answers"),
            Err(e) => store = format!("{store}: {e}"),
        }
    }
    if args.json {
        let mut v = serde_json::to_value(&report).unwrap_or_default();
        if let Some(o) = v.as_object_mut() {
            o.insert("location_store".into(), store.into());
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
        );
    } else {
        // The verdict stays the last line (scripts and the tests read it
        // there): the store goes just before it.
        let text = check::render(&report);
        let body = text.trim_end_matches('\n');
        let (lines, verdict) = body.rsplit_once('\n').unwrap_or(("", body));
        if !lines.is_empty() {
            println!("{lines}");
        }
        println!("location store: {store}");
        println!("{verdict}");
    }
    Ok(if report.can_run {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `vnatd --cleanup [--json]`: refuse while a vnatd answers on the control
/// socket, else remove what vnat changed on this host and print each thing
/// done; exit 1 if anything could not be removed (each said on stderr).
fn cleanup(args: &Args) -> Result<ExitCode, DaemonError> {
    use vnat_daemon::{
        control::{server::remove_if_stale, ServerError},
        datapath::kernel::cleanup::{self, Done, Kind},
    };
    // The cgroups vnatd would enable play no part here: a host without a
    // cgroup2 mount (a container, a rescue shell) can be cleaned too.
    let (config_file, file) = load_file(args.config.as_deref())?;
    let settings = Settings::resolve(args.clone(), config_file, file, None, || {
        Ok(std::path::PathBuf::from("/"))
    })?;
    let control = &settings.control;
    let stale = control.exists();
    match remove_if_stale(control) {
        Ok(()) => {}
        Err(ServerError::AlreadyRunning { .. }) => {
            eprintln!(
                "vnatd: a vnatd is running (it answers on {}); stop it first (systemctl stop vnatd), then run vnatd --cleanup again",
                control.display()
            );
            return Ok(ExitCode::from(1));
        }
        Err(e) => return Err(e.into()),
    }
    // A vnatd with its own control socket but these pins: the lock says so.
    if vnat_daemon::datapath::kernel::pinlock::PinLock::held(&settings.bpffs) {
        eprintln!(
            "vnatd: a running vnatd holds the pins in {}; stop it first, then run vnatd --cleanup again",
            settings.bpffs.display()
        );
        return Ok(ExitCode::from(1));
    }
    let mut report = cleanup::cleanup(&settings.bpffs, &settings.state_dir);
    if stale {
        report.done.insert(
            0,
            Done {
                kind: Kind::ControlSocket,
                what: format!("removed the stale control socket {}", control.display()),
            },
        );
    }
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report)
                .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
        );
    } else {
        print!("{}", report.render());
        for f in &report.failed {
            eprintln!("vnatd: cannot {}: {}", f.what, f.error);
        }
    }
    Ok(if report.failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Blocks of 256 KiB and more are mapped apart and unmapped when freed.
///
/// glibc's default does that too, but raises the threshold to the size of
/// the largest such block freed, up to 32 MiB. vnatd's big blocks are
/// transient: a resync's listing of every record and `vnatctl ls`'s
/// answer, tens of megabytes at 100,000 connections. After the first one
/// is freed the next ones come from the heap, and glibc keeps what they
/// leave resident: at 100,000 connections about a third of the daemon's
/// memory (issue 33, item 1; see docs/RESULTS.md, Scale). A fixed
/// threshold turns that adjustment off.
fn large_allocations_go_back() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets a parameter of glibc's malloc; it is called
    // before this process starts any thread.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
    }
}

fn start(args: Args) -> Result<(), DaemonError> {
    large_allocations_go_back();
    let settings = settings_of(&args)?;
    let log = daemon::init_logging(&settings)?;
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
        // SIGHUP's default action ends the process, and systemd's
        // Restart=on-failure does not restart a process a signal ended
        // cleanly: reload instead. A bad file changes nothing.
        let mut hup = signal(SignalKind::hangup()).map_err(|source| DaemonError::Runtime {
            what: "install the SIGHUP handler",
            source,
        })?;
        let (reload_tx, reload_rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                tracing::info!("SIGHUP received; reading the configuration again");
                // `systemctl status` shows "reloading" until READY=1.
                daemon::systemd::reloading();
                match settings_of(&args) {
                    Ok(new) => {
                        if let Err(e) = log.set_level(&new.log_level) {
                            tracing::error!(error = %e, "reload: log level unchanged");
                        }
                        if reload_tx.send(new).await.is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::error!(
                            error = %e,
                            "reload refused: the running configuration is unchanged; fix the file and send SIGHUP again"
                        );
                        daemon::systemd::reload_refused();
                    }
                }
            }
        });
        let shutdown = async move {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            tracing::info!("{name} received; stopping");
        };
        daemon::run(&settings, open_datapath, shutdown, reload_rx).await
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
        tc_attach: settings.tc_attach,
        sysctl_record: Some(sysctls::record_path(&settings.state_dir)),
        tc_load: TcLoad::AtOpen,
    };
    let mut dp = KernelDatapath::open(&opts)?;
    // The configured hiding cgroups (one enabled with vnatctl stays so:
    // it is pinned).
    for c in &settings.hide_location_cgroups {
        dp.set_hide_location(c, true)?;
    }
    Ok(Box::new(dp))
}
