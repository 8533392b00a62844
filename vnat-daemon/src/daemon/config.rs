//! vnatd's settings: flags (clap) over the TOML config file over defaults.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use serde::Deserialize;

use crate::{control::DEFAULT_CONTROL_PATH, datapath::TcAttach};

pub const DEFAULT_CONFIG_PATH: &str = "/etc/vnat/vnatd.toml";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/vnat";
pub const DEFAULT_BPFFS: &str = "/sys/fs/bpf/vnat";
/// The VCMP port of the paper (section 3.3).
pub const DEFAULT_LISTEN: &str = "0.0.0.0:2031";
pub const DEFAULT_LOG_LEVEL: &str = "info";
pub const DEFAULT_HELPERS_DIR: &str = "/etc/vnat/helpers";

mod about;
mod args;
pub mod keys;
pub mod store;
use args::usable_location_server;
pub use args::{Args, Generate, LogFormat};

/// The config file. Unknown keys are refused so that a typo is not silently
/// ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub control: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub bpffs: Option<PathBuf>,
    pub listen: Option<SocketAddr>,
    pub cgroups: Option<Vec<PathBuf>>,
    pub preempt_cgroups: Option<Vec<PathBuf>>,
    pub hide_location_cgroups: Option<Vec<PathBuf>>,
    pub peer_helpers: Option<Vec<String>>,
    pub helpers_dir: Option<PathBuf>,
    pub log_level: Option<String>,
    pub log_format: Option<LogFormat>,
    pub location_servers: Option<Vec<SocketAddr>>,
    pub standby_tc: Option<bool>,
    pub tc_attach: Option<TcAttach>,
    pub keepalive_secs: Option<u32>,
    pub sleep_inhibit: Option<bool>,
    pub location_store: Option<store::StoreKind>,
    pub etcd_endpoints: Option<Vec<String>>,
    pub etcd_ca: Option<PathBuf>,
    pub etcd_cert: Option<PathBuf>,
    pub etcd_key: Option<PathBuf>,
    pub etcd_user: Option<String>,
    pub etcd_password_file: Option<PathBuf>,
}

/// The effective settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The file that was read, if any.
    pub config_file: Option<PathBuf>,
    pub control: PathBuf,
    pub state_dir: PathBuf,
    pub bpffs: PathBuf,
    pub listen: SocketAddr,
    pub cgroups: Vec<PathBuf>,
    /// `preempt_cgroups`: connections under these preempt in a conflict
    /// (default: none, every conflict aborts).
    pub preempt_cgroups: Vec<PathBuf>,
    /// `hide_location_cgroups`: these hide location (default: none). Each
    /// is in `cgroups` too unless a cgroup there is it or above it.
    pub hide_location_cgroups: Vec<PathBuf>,
    /// `peer_helpers`: the keep-alive helpers peers may ask of this host.
    pub peer_helpers: Vec<String>,
    /// `helpers_dir`: where the installed ones are.
    pub helpers_dir: PathBuf,
    pub log_level: String,
    pub log_format: LogFormat,
    /// Location servers for step P(3)/S(3) of the location chain, in the
    /// order they are asked (default: none).
    pub location_servers: Vec<SocketAddr>,
    /// `standby_tc`: tc stays attached to every interface while
    /// connections are paired (default: on; off attaches only where used).
    pub standby_tc: bool,
    /// `tc_attach`: TCX, clsact, or whichever the kernel has (default).
    pub tc_attach: TcAttach,
    /// NAT keepalive interval in seconds (default 25; 0: off).
    pub keepalive_secs: u32,
    /// `sleep_inhibit`: hold logind's delay inhibitor and settle the
    /// connections before sleep (`daemon::sleep`; default on).
    pub sleep_inhibit: bool,
    /// `location_store` and the `etcd_*` keys: etcd besides the embedded
    /// store, or the embedded store alone (`None`, the default).
    pub location_store: store::StoreSetting,
}

/// A bad flag or config file (vnatd exit status 2).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the config file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid config file {}{}: {message}", path.display(), line.map(|l| format!(" line {l}")).unwrap_or_default())]
    Parse {
        path: PathBuf,
        line: Option<usize>,
        message: String,
    },
    #[error("{key} = {} in the config file {} is relative; use an absolute path", value.display(), file.display())]
    RelativePath {
        file: PathBuf,
        key: &'static str,
        value: PathBuf,
    },
    #[error("location_servers entry {value} in the config file {} cannot be asked; give the address and port another vnatd listens on, such as 192.0.2.7:2031", file.display())]
    LocationServer { file: PathBuf, value: SocketAddr },
    #[error("keepalive_secs = {value} in the config file {} is out of range; use 0 (off) to 3600 seconds (default 25)", file.display())]
    Keepalive { file: PathBuf, value: u32 },
    #[error("{name:?} {} is no keep-alive helper: peer_helpers (--peer-helper) takes zero-window, stop, hold, the name of an executable in helpers_dir (1 to 14 of a-z, 0-9, '-', '_'), or none", file.as_ref().map(|f| format!("in peer_helpers in the config file {}", f.display())).unwrap_or_else(|| "given to --peer-helper".into()))]
    PeerHelper { file: Option<PathBuf>, name: String },
    #[error("cannot make {} absolute: {source}", path.display())]
    Absolute {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid log level {value:?}: {source}; use error, warn, info, debug, trace or a filter such as info,vnat_daemon=debug")]
    LogLevel {
        value: String,
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("etcd_endpoints entry {value:?} is no etcd client URL; give http://HOST:PORT or https://HOST:PORT, such as https://192.0.2.10:2379")]
    EtcdEndpoint { value: String },
    #[error("{key} is set but location_store is not \"etcd\"; add location_store = \"etcd\" or remove {key}")]
    EtcdKeyWithoutEtcd { key: &'static str },
    #[error("location_store = \"etcd\" needs etcd_endpoints (or --etcd-endpoint), such as [\"https://192.0.2.10:2379\"]")]
    EtcdNoEndpoints,
    #[error("etcd_cert and etcd_key go together: give both (a client certificate and its key) or neither")]
    EtcdCertKeyPair,
    #[error("etcd_user needs etcd_password_file (a file holding the password; never the password in the config) and the other way round")]
    EtcdUserPassword,
    #[error("etcd_ca and etcd_cert are for TLS, but an etcd endpoint is http://; give https:// endpoints")]
    EtcdTlsOverHttp,
    #[error("no cgroup2 filesystem is mounted, so there is no root cgroup to enable; mount one (mount -t cgroup2 none /sys/fs/cgroup) or pass --cgroup")]
    NoCgroup2Mount,
    #[error("cannot read {}: {source}", path.display())]
    Mounts {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl ConfigError {
    /// Whether this is the user's input being wrong (exit status 2) rather
    /// than the machine (exit status 1).
    pub fn is_usage(&self) -> bool {
        !matches!(
            self,
            ConfigError::NoCgroup2Mount | ConfigError::Mounts { .. }
        )
    }
}

/// Read the config file: `explicit` (from `--config`) must exist; the
/// default one may be missing.
pub fn load_file(explicit: Option<&Path>) -> Result<(Option<PathBuf>, FileConfig), ConfigError> {
    load_file_or(explicit, Path::new(DEFAULT_CONFIG_PATH))
}

/// [`load_file`] with another default path (for tests).
pub fn load_file_or(
    explicit: Option<&Path>,
    default: &Path,
) -> Result<(Option<PathBuf>, FileConfig), ConfigError> {
    let path = explicit.unwrap_or(default).to_path_buf();
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && explicit.is_none() => {
            return Ok((None, FileConfig::default()))
        }
        Err(source) => return Err(ConfigError::Read { path, source }),
    };
    let config = parse_file(&path, &text)?;
    Ok((Some(path), config))
}

/// Parse config text; `path` is for messages.
pub fn parse_file(path: &Path, text: &str) -> Result<FileConfig, ConfigError> {
    let config: FileConfig = toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        line: e.span().map(|s| {
            text.as_bytes()[..s.start.min(text.len())]
                .iter()
                .filter(|b| **b == b'\n')
                .count()
                + 1
        }),
        // toml's Display is a multi-line snippet; keep its one-line message.
        message: e.message().trim().to_string(),
    })?;
    let relative = |key, value: &Option<PathBuf>| match value {
        Some(v) if !v.is_absolute() => Err(ConfigError::RelativePath {
            file: path.to_path_buf(),
            key,
            value: v.clone(),
        }),
        _ => Ok(()),
    };
    relative("control", &config.control)?;
    relative("state_dir", &config.state_dir)?;
    relative("bpffs", &config.bpffs)?;
    relative("helpers_dir", &config.helpers_dir)?;
    for c in config.cgroups.iter().flatten() {
        relative("cgroups", &Some(c.clone()))?;
    }
    for c in config.preempt_cgroups.iter().flatten() {
        relative("preempt_cgroups", &Some(c.clone()))?;
    }
    for c in config.hide_location_cgroups.iter().flatten() {
        relative("hide_location_cgroups", &Some(c.clone()))?;
    }
    if let Some(value) = config.keepalive_secs.filter(|s| *s > 3600) {
        return Err(ConfigError::Keepalive {
            file: path.to_path_buf(),
            value,
        });
    }
    store::check_file(path, &config)?;
    if let Some(bad) = config
        .location_servers
        .iter()
        .flatten()
        .find(|a| !usable_location_server(a))
    {
        return Err(ConfigError::LocationServer {
            file: path.to_path_buf(),
            value: *bad,
        });
    }
    Ok(config)
}

impl Settings {
    /// Merge flags over the file over defaults. `cgroup_root` is only called
    /// when neither gives a cgroup; `rust_log` is the RUST_LOG value.
    pub fn resolve(
        args: Args,
        config_file: Option<PathBuf>,
        file: FileConfig,
        rust_log: Option<String>,
        cgroup_root: impl FnOnce() -> Result<PathBuf, ConfigError>,
    ) -> Result<Settings, ConfigError> {
        let abs = |p: PathBuf| {
            std::path::absolute(&p).map_err(|source| ConfigError::Absolute { path: p, source })
        };
        let pick = |flag: Option<PathBuf>,
                    file: Option<PathBuf>,
                    default: &str|
         -> Result<PathBuf, ConfigError> {
            match flag {
                Some(p) => abs(p),
                None => Ok(file.unwrap_or_else(|| PathBuf::from(default))),
            }
        };
        let location_store = store::resolve(args.location_store, args.etcd_endpoints, &file)?;
        let control = pick(args.control, file.control, DEFAULT_CONTROL_PATH)?;
        let state_dir = pick(args.state_dir, file.state_dir, DEFAULT_STATE_DIR)?;
        let bpffs = pick(args.bpffs, file.bpffs, DEFAULT_BPFFS)?;
        let listen = match args.listen.or(file.listen) {
            Some(l) => l,
            None => DEFAULT_LISTEN
                .parse()
                .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 2031))),
        };
        let log_level = args
            .log_level
            .or(file.log_level)
            .or(rust_log.filter(|s| !s.trim().is_empty()))
            .unwrap_or_else(|| DEFAULT_LOG_LEVEL.to_string());
        // Validate now, so a typo is a config error and not a silent default.
        tracing_subscriber::EnvFilter::builder()
            .parse(&log_level)
            .map_err(|source| ConfigError::LogLevel {
                value: log_level.clone(),
                source,
            })?;
        let log_format = args
            .log_format
            .or(file.log_format)
            .unwrap_or(LogFormat::Text);
        let hide_location_cgroups = if !args.hide_location_cgroups.is_empty() {
            args.hide_location_cgroups
                .into_iter()
                .map(abs)
                .collect::<Result<Vec<_>, _>>()?
        } else {
            file.hide_location_cgroups.unwrap_or_default()
        };
        let mut cgroups = if !args.cgroups.is_empty() {
            args.cgroups
                .into_iter()
                .map(abs)
                .collect::<Result<Vec<_>, _>>()?
        } else if let Some(c) = file.cgroups.filter(|c| !c.is_empty()) {
            c
        } else {
            vec![cgroup_root()?]
        };
        // A hiding cgroup that no enabled one covers is enabled too (the
        // programs that hide run where the recorders are attached).
        let uncovered: Vec<PathBuf> = hide_location_cgroups
            .iter()
            .filter(|h| !cgroups.iter().any(|c| h.starts_with(c)))
            .cloned()
            .collect();
        cgroups.extend(uncovered);
        let peer_helpers = if args.peer_helpers.is_empty() {
            peer_helpers(file.peer_helpers, config_file.as_deref())?
        } else {
            peer_helpers(Some(args.peer_helpers), None)?
        };
        let preempt_cgroups = if !args.preempt_cgroups.is_empty() {
            args.preempt_cgroups
                .into_iter()
                .map(abs)
                .collect::<Result<Vec<_>, _>>()?
        } else {
            file.preempt_cgroups.unwrap_or_default()
        };
        // Like --cgroup, the flags replace the file's list rather than add
        // to it, so one command line says the whole truth.
        let location_servers = if !args.location_servers.is_empty() {
            args.location_servers
        } else {
            file.location_servers.unwrap_or_default()
        };
        Ok(Settings {
            config_file,
            control,
            state_dir,
            bpffs,
            listen,
            cgroups,
            preempt_cgroups,
            hide_location_cgroups,
            peer_helpers,
            helpers_dir: pick(args.helpers_dir, file.helpers_dir, DEFAULT_HELPERS_DIR)?,
            log_level,
            log_format,
            location_servers,
            standby_tc: if args.standby_tc {
                true
            } else if args.no_standby_tc {
                false
            } else {
                file.standby_tc.unwrap_or(true)
            },
            tc_attach: args.tc_attach.or(file.tc_attach).unwrap_or_default(),
            keepalive_secs: args.keepalive_secs.or(file.keepalive_secs).unwrap_or(25),
            // The two flags conflict: at most one is given.
            sleep_inhibit: !args.no_sleep_inhibit
                && (args.sleep_inhibit || file.sleep_inhibit.unwrap_or(true)),
            location_store,
        })
    }
}

/// What a reload (SIGHUP) changes in a running vnatd, and what it cannot.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ReloadPlan {
    /// cgroups to start and to stop recording.
    pub enable: Vec<PathBuf>,
    pub disable: Vec<PathBuf>,
    /// cgroups to hide location for (all the new file's, applied after
    /// the disables: disabling a cgroup that a newly enabled one covers
    /// also stopped its hiding) and to stop hiding for.
    pub hide: Vec<PathBuf>,
    pub unhide: Vec<PathBuf>,
    /// Settings the new file changes that only a restart applies
    /// (sockets, directories, pins, the log format).
    pub restart_only: Vec<&'static str>,
}

/// The `peer_helpers` setting: the built-in helpers by name, checked; the
/// default is zero-window and hold (neither can harm this host: the
/// first answers for the peer, the second holds only that connection's
/// own packets, for seconds), and "none" alone means none.
fn peer_helpers(
    names: Option<Vec<String>>,
    file: Option<&Path>,
) -> Result<Vec<String>, ConfigError> {
    let Some(names) = names else {
        return Ok(vec![
            crate::vcmp::help::ZERO_WINDOW.to_string(),
            crate::vcmp::help::HOLD.to_string(),
        ]);
    };
    if names == ["none"] {
        return Ok(Vec::new());
    }
    for n in &names {
        if !crate::vcmp::help::Help::valid_name(n) {
            return Err(ConfigError::PeerHelper {
                file: file.map(Path::to_path_buf),
                name: n.clone(),
            });
        }
    }
    Ok(names)
}

impl ReloadPlan {
    /// Compare the running settings with the new ones.
    pub fn between(running: &Settings, new: &Settings) -> ReloadPlan {
        let enable = new
            .cgroups
            .iter()
            .filter(|c| !running.cgroups.contains(c))
            .cloned()
            .collect();
        let disable = running
            .cgroups
            .iter()
            .filter(|c| !new.cgroups.contains(c))
            .cloned()
            .collect();
        let hide = new.hide_location_cgroups.clone();
        let unhide = running
            .hide_location_cgroups
            .iter()
            .filter(|c| !new.hide_location_cgroups.contains(c))
            .cloned()
            .collect();
        let mut restart_only = Vec::new();
        if running.control != new.control {
            restart_only.push("control");
        }
        if running.state_dir != new.state_dir {
            restart_only.push("state_dir");
        }
        if running.bpffs != new.bpffs {
            restart_only.push("bpffs");
        }
        if running.listen != new.listen {
            restart_only.push("listen");
        }
        if running.log_format != new.log_format {
            restart_only.push("log_format");
        }
        if running.peer_helpers != new.peer_helpers {
            restart_only.push("peer_helpers");
        }
        if running.helpers_dir != new.helpers_dir {
            restart_only.push("helpers_dir");
        }
        if running.sleep_inhibit != new.sleep_inhibit {
            restart_only.push("sleep_inhibit");
        }
        if running.location_store != new.location_store {
            restart_only.push("location_store");
        }
        ReloadPlan {
            enable,
            disable,
            hide,
            unhide,
            restart_only,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use clap::Parser;

    use super::*;

    fn resolve(flags: &[&str], file: FileConfig) -> Settings {
        let args = Args::try_parse_from(std::iter::once("vnatd").chain(flags.iter().copied()))
            .unwrap_or_else(|e| panic!("flags {flags:?} refused: {e}"));
        Settings::resolve(args, None, file, None, || Ok(PathBuf::from("/cg2")))
            .unwrap_or_else(|e| panic!("settings refused: {e}"))
    }

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap_or_else(|e| panic!("bad address {s}: {e}"))
    }

    #[test]
    fn tc_attach_is_auto_by_default_and_the_flag_overrides_the_file() {
        assert_eq!(
            resolve(&[], FileConfig::default()).tc_attach,
            TcAttach::Auto
        );
        let file =
            || parse_file(Path::new("t.toml"), "tc_attach = \"clsact\"").expect("valid file");
        assert_eq!(resolve(&[], file()).tc_attach, TcAttach::Clsact);
        assert_eq!(
            resolve(&["--tc-attach", "tcx"], file()).tc_attach,
            TcAttach::Tcx
        );
        let err = parse_file(Path::new("t.toml"), "tc_attach = \"xdp\"").unwrap_err();
        let err = err.to_string();
        assert!(
            err.contains("line 1") && err.contains("expected one of `auto`, `tcx`, `clsact`"),
            "{err}"
        );
    }

    #[test]
    fn standby_tc_is_on_by_default_and_flags_override_the_file() {
        assert!(resolve(&[], FileConfig::default()).standby_tc);
        assert!(!resolve(&["--no-standby-tc"], FileConfig::default()).standby_tc);
        let off = || parse_file(Path::new("t.toml"), "standby_tc = false").expect("valid file");
        assert!(!resolve(&[], off()).standby_tc);
        assert!(resolve(&["--standby-tc"], off()).standby_tc);
        let on = parse_file(Path::new("t.toml"), "standby_tc = true").expect("valid file");
        assert!(!resolve(&["--no-standby-tc"], on).standby_tc);
        assert!(
            Args::try_parse_from(["vnatd", "--standby-tc", "--no-standby-tc"]).is_err(),
            "contradicting flags must be refused"
        );
        assert!(
            parse_file(Path::new("t.toml"), "standby_tc = \"yes\"").is_err(),
            "a non-boolean must be refused"
        );
    }

    #[test]
    fn keepalive_defaults_to_25_s_flags_override_and_nonsense_is_refused() {
        assert_eq!(resolve(&[], FileConfig::default()).keepalive_secs, 25);
        let file = parse_file(Path::new("t.toml"), "keepalive_secs = 10").expect("valid file");
        assert_eq!(resolve(&[], file).keepalive_secs, 10);
        let file = parse_file(Path::new("t.toml"), "keepalive_secs = 10").expect("valid file");
        assert_eq!(resolve(&["--keepalive-secs", "0"], file).keepalive_secs, 0);
        let e = parse_file(Path::new("t.toml"), "keepalive_secs = 99999")
            .expect_err("out of range")
            .to_string();
        assert!(e.contains("0 (off) to 3600"), "{e}");
        assert!(parse_file(Path::new("t.toml"), "keepalive_secs = -1").is_err());
        assert!(Args::try_parse_from(["vnatd", "--keepalive-secs", "4000"]).is_err());
        assert!(Args::try_parse_from(["vnatd", "--keepalive-secs", "soon"]).is_err());
    }

    #[test]
    fn hiding_cgroups_are_enabled_unless_covered_and_reload_turns_them_on_and_off() {
        let file: FileConfig = toml::from_str(
            "cgroups = [\"/cg/apps\"]\nhide_location_cgroups = [\"/cg/apps/ftp\", \"/cg/other\"]",
        )
        .expect("parses");
        let s = resolve(&[], file);
        assert_eq!(
            s.hide_location_cgroups,
            vec![PathBuf::from("/cg/apps/ftp"), PathBuf::from("/cg/other")]
        );
        // /cg/apps covers the first; the second is enabled itself.
        assert_eq!(
            s.cgroups,
            vec![PathBuf::from("/cg/apps"), PathBuf::from("/cg/other")]
        );
        let flags = resolve(
            &["--cgroup", "/cg", "--hide-location-cgroup", "/cg/ftp"],
            FileConfig::default(),
        );
        assert_eq!(flags.cgroups, vec![PathBuf::from("/cg")]);
        assert_eq!(flags.hide_location_cgroups, vec![PathBuf::from("/cg/ftp")]);
        let e = parse_file(Path::new("t.toml"), "hide_location_cgroups = [\"ftp\"]")
            .expect_err("relative")
            .to_string();
        assert!(e.contains("hide_location_cgroups"), "{e}");
        let plan = ReloadPlan::between(&s, &flags);
        assert_eq!(plan.hide, vec![PathBuf::from("/cg/ftp")]);
        assert_eq!(
            plan.unhide,
            vec![PathBuf::from("/cg/apps/ftp"), PathBuf::from("/cg/other")]
        );
        assert_eq!(plan.enable, vec![PathBuf::from("/cg")]);
    }

    #[test]
    fn preempt_cgroups_come_from_the_flags_over_the_file_and_must_be_absolute() {
        let file: FileConfig =
            toml::from_str("preempt_cgroups = [\"/sys/fs/cgroup/app\"]").expect("parses");
        assert_eq!(
            resolve(&["--cgroup", "/cg"], file).preempt_cgroups,
            vec![PathBuf::from("/sys/fs/cgroup/app")]
        );
        let file: FileConfig =
            toml::from_str("preempt_cgroups = [\"/sys/fs/cgroup/app\"]").expect("parses");
        assert_eq!(
            resolve(
                &["--cgroup", "/cg", "--preempt-cgroup", "/sys/fs/cgroup/b"],
                file
            )
            .preempt_cgroups,
            vec![PathBuf::from("/sys/fs/cgroup/b")]
        );
        assert!(resolve(&["--cgroup", "/cg"], FileConfig::default())
            .preempt_cgroups
            .is_empty());
        let dir = std::env::temp_dir().join(format!("vnat-preempt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vnatd.toml");
        std::fs::write(&path, "preempt_cgroups = [\"relative/app\"]\n").unwrap();
        let err = load_file_or(Some(&path), &path).expect_err("relative path refused");
        assert!(err.to_string().contains("preempt_cgroups"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_reload_applies_cgroups_and_names_what_needs_a_restart() {
        let running = resolve(
            &[
                "--cgroup",
                "/sys/fs/cgroup/a",
                "--cgroup",
                "/sys/fs/cgroup/b",
            ],
            FileConfig::default(),
        );
        let mut new = resolve(
            &[
                "--cgroup",
                "/sys/fs/cgroup/b",
                "--cgroup",
                "/sys/fs/cgroup/c",
            ],
            FileConfig::default(),
        );
        let plan = ReloadPlan::between(&running, &new);
        assert_eq!(plan.enable, vec![PathBuf::from("/sys/fs/cgroup/c")]);
        assert_eq!(plan.disable, vec![PathBuf::from("/sys/fs/cgroup/a")]);
        assert!(plan.restart_only.is_empty());
        new.listen = "0.0.0.0:2032".parse().unwrap();
        new.state_dir = "/var/lib/other".into();
        assert_eq!(
            ReloadPlan::between(&running, &new).restart_only,
            vec!["state_dir", "listen"]
        );
        assert_eq!(
            ReloadPlan::between(&running, &running),
            ReloadPlan::default()
        );
    }

    #[test]
    fn location_servers_default_to_none() {
        let s = resolve(&[], FileConfig::default());
        assert!(s.location_servers.is_empty(), "{:?}", s.location_servers);
    }

    #[test]
    fn location_servers_from_the_file_and_flags_replace_them() {
        let text = r#"location_servers = ["198.18.6.2:2031", "[fd00:5e:6::2]:2031"]"#;
        let file = parse_file(Path::new("t.toml"), text)
            .unwrap_or_else(|e| panic!("valid file refused: {e}"));
        let s = resolve(&[], file);
        assert_eq!(
            s.location_servers,
            vec![sa("198.18.6.2:2031"), sa("[fd00:5e:6::2]:2031")],
            "the file's list, in order"
        );
        let file = parse_file(Path::new("t.toml"), text)
            .unwrap_or_else(|e| panic!("valid file refused: {e}"));
        let s = resolve(
            &[
                "--location-server",
                "192.0.2.7:2031",
                "--location-server",
                "192.0.2.8:4000",
            ],
            file,
        );
        assert_eq!(
            s.location_servers,
            vec![sa("192.0.2.7:2031"), sa("192.0.2.8:4000")],
            "flags replace the file's list, in the order given"
        );
    }

    #[test]
    fn bad_location_servers_are_refused() {
        for bad in ["192.0.2.7", "host:2031", "0.0.0.0:2031", "192.0.2.7:0"] {
            let e = Args::try_parse_from(["vnatd", "--location-server", bad])
                .err()
                .unwrap_or_else(|| panic!("--location-server {bad} was accepted"));
            assert_eq!(e.exit_code(), 2, "{bad}: {e}");
            assert!(e.to_string().contains("192.0.2.7:2031"), "{bad}: {e}");
        }
        match parse_file(Path::new("t.toml"), r#"location_servers = ["192.0.2.7"]"#) {
            Err(e @ ConfigError::Parse { .. }) => assert!(e.is_usage(), "{e}"),
            other => panic!("a port-less location server must be refused, got {other:?}"),
        }
        match parse_file(Path::new("t.toml"), r#"location_servers = ["[::]:2031"]"#) {
            Err(e @ ConfigError::LocationServer { .. }) => {
                assert!(e.is_usage(), "{e}");
                assert!(e.to_string().contains("[::]:2031"), "{e}");
            }
            other => panic!("an unspecified location server must be refused, got {other:?}"),
        }
        match parse_file(
            Path::new("t.toml"),
            r#"location_server = ["192.0.2.7:2031"]"#,
        ) {
            Err(e @ ConfigError::Parse { .. }) => {
                assert!(e.to_string().contains("location_server"), "{e}")
            }
            other => panic!("a misspelt key must be refused, got {other:?}"),
        }
    }

    #[test]
    fn help_documents_the_flag_and_the_key() {
        let help = <Args as clap::CommandFactory>::command()
            .render_long_help()
            .to_string();
        assert!(help.contains("--location-server <ADDR:PORT>"), "{help}");
        assert!(help.contains("location_servers = []"), "{help}");
    }
}
