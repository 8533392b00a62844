//! What vnatctl prints. The JSON shapes here are a contract with users'
//! scripts: they are spelled out as their own structs (not the daemon's
//! types serialized as-is) so that a change inside vnatd cannot silently
//! rename a key, and the tests below pin every key.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
};

use serde::Serialize;
use vnat_control::{
    datapath::DatapathStatus, DaemonInfo, ExportDocument, ImportedConnection, MigrateReply,
    PeerInfo, ResumeReply, Skipped, StatusReply, SuspendReply,
};

mod ls;
mod watch;
pub use ls::{ls_table, LsRow};
pub use watch::{event_line, waited_text, WaitedJson};

/// Left-aligned columns two spaces apart; the last column is not padded so
/// lines carry no trailing blanks.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let last = row.len().saturating_sub(1);
        for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                let _ = write!(out, "{cell:<w$}  ");
            }
        }
        out.push('\n');
    }
    out
}

/// `vnatctl --json status`.
#[derive(Debug, Serialize)]
pub struct StatusJson {
    pub daemon: DaemonJson,
    pub datapath: DatapathJson,
    /// Absent when vnatd's VCMP driver is not running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vcmp: Option<VcmpJson>,
    /// The location store and servers (`.location.etcd.state`); absent
    /// when vnatd's VCMP driver is not running.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub location: Option<vnat_control::LocationStatus>,
}

#[derive(Debug, Serialize)]
pub struct DaemonJson {
    pub version: String,
    pub pid: u32,
    pub uptime_secs: u64,
    pub control: PathBuf,
    pub state_dir: PathBuf,
    pub listen: String,
    pub configured_cgroups: Vec<PathBuf>,
}

#[derive(Debug, Serialize)]
pub struct DatapathJson {
    /// `uname -r` of vnatd's host.
    pub kernel: String,
    /// How new tc attachments are made: "tcx" or "clsact".
    pub tc_mode: String,
    /// Capabilities this kernel weakens or turns off.
    pub degraded: Vec<vnat_control::datapath::Degraded>,
    pub bpffs: PathBuf,
    pub netns_cookie: u64,
    pub programs_loaded: Vec<String>,
    pub cgroups: Vec<CgroupJson>,
    pub tc: Vec<TcJson>,
    pub connections: u64,
    pub translations: u64,
    /// Counter name to value, so scripts can write `.datapath.counters.NAME`.
    pub counters: BTreeMap<String, u64>,
}

/// VCMP's counters: `.vcmp.rejected.bad_mac` and so on.
#[derive(Debug, Serialize)]
pub struct VcmpJson {
    /// This host's key: `vnatctl export --to` on another host names it.
    pub host_key: String,
    pub events: BTreeMap<String, u64>,
    pub rejected: BTreeMap<String, u64>,
}

#[derive(Debug, Serialize)]
pub struct CgroupJson {
    pub path: PathBuf,
    pub id: u64,
    /// `enable --hide-location`.
    pub hide_location: bool,
}

#[derive(Debug, Serialize)]
pub struct TcJson {
    pub ifname: String,
    pub ifindex: u32,
    pub mode: String,
    pub users: u32,
}

impl From<&StatusReply> for StatusJson {
    fn from(s: &StatusReply) -> Self {
        let DaemonInfo {
            version,
            pid,
            uptime_secs,
            control,
            state_dir,
            listen,
            configured_cgroups,
        } = &s.daemon;
        let d = &s.datapath;
        StatusJson {
            daemon: DaemonJson {
                version: version.clone(),
                pid: *pid,
                uptime_secs: *uptime_secs,
                control: control.clone(),
                state_dir: state_dir.clone(),
                listen: listen.to_string(),
                configured_cgroups: configured_cgroups.clone(),
            },
            datapath: DatapathJson {
                kernel: d.kernel.clone(),
                tc_mode: d.tc_mode.to_string(),
                degraded: d.degraded.clone(),
                bpffs: d.bpffs.clone(),
                netns_cookie: d.netns_cookie,
                programs_loaded: d.programs_loaded.clone(),
                cgroups: d
                    .cgroups
                    .iter()
                    .map(|c| CgroupJson {
                        path: c.path.clone(),
                        id: c.id,
                        hide_location: c.hide_location,
                    })
                    .collect(),
                tc: d
                    .tc
                    .iter()
                    .map(|t| TcJson {
                        ifname: t.ifname.clone(),
                        ifindex: t.ifindex,
                        mode: t.mode.to_string(),
                        users: t.users,
                    })
                    .collect(),
                connections: d.connections,
                translations: d.translations,
                counters: d.counters.iter().cloned().collect(),
            },
            vcmp: s.vcmp.as_ref().map(|v| VcmpJson {
                host_key: v.host_key.clone(),
                events: v.events.clone(),
                rejected: v.rejected.clone(),
            }),
            location: s.location.clone(),
        }
    }
}

/// `vnatctl status` for people.
pub fn status_text(s: &StatusReply) -> String {
    let DaemonInfo {
        version,
        pid,
        uptime_secs,
        control,
        state_dir,
        listen,
        ..
    } = &s.daemon;
    let d: &DatapathStatus = &s.datapath;
    let mut out = String::new();
    let mut line = |key: &str, values: Vec<String>| {
        for (i, v) in values.iter().enumerate() {
            let key = if i == 0 { key } else { "" };
            let _ = writeln!(out, "  {key:<12} {v}");
        }
    };
    line("control", vec![control.display().to_string()]);
    line("state dir", vec![state_dir.display().to_string()]);
    line("listen", vec![format!("{listen} (VCMP)")]);
    line(
        "bpffs",
        vec![format!(
            "{} (netns cookie {})",
            d.bpffs.display(),
            d.netns_cookie
        )],
    );
    line(
        "programs",
        vec![or_none(d.programs_loaded.join(", "), "none loaded")],
    );
    let cgroups: Vec<String> = d
        .cgroups
        .iter()
        .map(|c| {
            format!(
                "{} (id {}{})",
                c.path.display(),
                c.id,
                if c.hide_location {
                    ", hides location"
                } else {
                    ""
                }
            )
        })
        .collect();
    line(
        "cgroups",
        non_empty(
            cgroups,
            "none (enable one with: vnatctl enable --cgroup DIR)",
        ),
    );
    let tc: Vec<String> =
        d.tc.iter()
            .map(|t| {
                format!(
                    "{} (ifindex {}, {}, {} translated flows)",
                    t.ifname, t.ifindex, t.mode, t.users
                )
            })
            .collect();
    line(
        "tc",
        non_empty(
            tc,
            "none (attached only while a flow on the interface is translated)",
        ),
    );
    line(
        "kernel",
        vec![format!(
            "Linux {} (tc attaches with {})",
            or_none(d.kernel.clone(), "unknown"),
            d.tc_mode
        )],
    );
    let degraded: Vec<String> = d
        .degraded
        .iter()
        .map(|g| format!("{}: needs {}; {}", g.feature, g.needs, g.effect))
        .collect();
    if !degraded.is_empty() {
        line("degraded", degraded);
    }
    line(
        "connections",
        vec![format!("{} ({} translated)", d.connections, d.translations)],
    );
    if let Some(l) = &s.location {
        line("locations", location_lines(l));
    }
    let mut text = format!(
        "vnatd {version}, pid {pid}, up {}\n{out}",
        duration(*uptime_secs)
    );
    if d.counters.is_empty() {
        text.push_str("\nno counters yet\n");
    } else {
        let rows: Vec<Vec<String>> = d
            .counters
            .iter()
            .map(|(k, v)| vec![k.clone(), v.to_string()])
            .collect();
        text.push('\n');
        text.push_str(&table(&["COUNTER", "VALUE"], &rows));
    }
    if let Some(v) = &s.vcmp {
        if !v.host_key.is_empty() {
            text.push_str(&format!("\nhost key: {}\n", v.host_key));
        }
        let mut rows: Vec<Vec<String>> = v
            .events
            .iter()
            .map(|(k, n)| vec![k.clone(), n.to_string()])
            .collect();
        rows.extend(
            v.rejected
                .iter()
                .map(|(k, n)| vec![format!("rejected: {k}"), n.to_string()]),
        );
        text.push('\n');
        if rows.is_empty() {
            text.push_str("no VCMP traffic yet\n");
        } else {
            text.push_str(&table(&["VCMP", "COUNT"], &rows));
        }
    }
    text
}

/// The `locations` lines of `vnatctl status`: the store, how etcd's calls
/// went, and the location servers.
fn location_lines(l: &vnat_control::LocationStatus) -> Vec<String> {
    let mut out = vec![l.description.clone()];
    if let Some(h) = &l.etcd {
        let ago = |secs: Option<u64>| {
            secs.map(|s| format!(" {} ago", duration(s)))
                .unwrap_or_default()
        };
        out.push(match h.state.as_str() {
            "untried" => "etcd: not called yet (the first move calls it)".to_string(),
            "failing" => format!(
                "etcd: FAILING, moves go on without it ({} of {} calls failed, the last{}): {}",
                h.failed,
                h.answered + h.failed,
                ago(h.last_error_secs_ago),
                h.last_error.as_deref().unwrap_or("no reason given")
            ),
            _ => format!(
                "etcd: answering ({} of {} calls, the last{})",
                h.answered,
                h.answered + h.failed,
                ago(h.last_answer_secs_ago)
            ),
        });
    }
    if !l.servers.is_empty() {
        let servers: Vec<String> = l.servers.iter().map(|s| s.to_string()).collect();
        out.push(format!("location servers: {}", servers.join(", ")));
    }
    out
}

fn or_none(s: String, none: &str) -> String {
    if s.is_empty() {
        none.to_string()
    } else {
        s
    }
}

fn non_empty(v: Vec<String>, none: &str) -> Vec<String> {
    if v.is_empty() {
        vec![none.to_string()]
    } else {
        v
    }
}

/// 3725 -> "1h02m05s".
pub fn duration(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m{s:02}s"),
        (0, _, _) => format!("{h}h{m:02}m{s:02}s"),
        _ => format!("{d}d{h:02}h{m:02}m"),
    }
}

/// `{"error":{"kind":...,"message":...}}`, what `--json` prints on failure.
pub fn error_json(kind: &str, message: &str) -> String {
    serde_json::json!({ "error": { "kind": kind, "message": message } }).to_string()
}

/// `vnatctl --json suspend`.
#[derive(Debug, Serialize)]
pub struct SuspendJson {
    /// Ids of the connections whose peers were asked to prepare.
    pub suspended: Vec<u64>,
    /// Ids of those whose peers were also asked for the helpers.
    pub helped: Vec<u64>,
    pub skipped: Vec<SkippedJson>,
}

#[derive(Debug, Serialize)]
pub struct SkippedJson {
    pub id: u64,
    pub reason: String,
}

impl From<&SuspendReply> for SuspendJson {
    fn from(r: &SuspendReply) -> Self {
        SuspendJson {
            suspended: r.suspended.clone(),
            helped: r.helped.clone(),
            skipped: r
                .skipped
                .iter()
                .map(|s| SkippedJson {
                    id: s.id,
                    reason: s.reason.clone(),
                })
                .collect(),
        }
    }
}

pub fn suspend_text(r: &SuspendReply) -> String {
    let mut out = format!(
        "suspended {} connection(s): their peers are agreeing roles and fresh keys; after the move run: vnatctl resume\n",
        r.suspended.len()
    );
    if !r.helped.is_empty() {
        let _ = writeln!(
            out,
            "asked the peers of {} of them to keep them alive until they work again",
            r.helped.len()
        );
    }
    for s in &r.skipped {
        let _ = writeln!(out, "skipped connection {}: {}", s.id, s.reason);
    }
    out
}

/// `vnatctl --json resume`.
#[derive(Debug, Serialize)]
pub struct ResumeJson {
    pub selected: Vec<u64>,
    pub moves_started: usize,
}

impl From<&ResumeReply> for ResumeJson {
    fn from(r: &ResumeReply) -> Self {
        ResumeJson {
            selected: r.selected.clone(),
            moves_started: r.moves_started,
        }
    }
}

pub fn resume_text(r: &ResumeReply) -> String {
    if r.moves_started == 0 {
        "nothing to move: every connection is at an address this host has (automatic mode may have moved them already)\n".into()
    } else {
        format!(
            "started {} move(s); `vnatctl ls` shows the new physical endpoints once the peers confirm\n",
            r.moves_started
        )
    }
}

/// `vnatctl --json migrate` (without --wait).
#[derive(Debug, Serialize)]
pub struct MigrateJson {
    /// The moves started: the peers are validating the new addresses.
    pub started: Vec<MigrateStartedJson>,
    pub skipped: Vec<SkippedJson>,
}

#[derive(Debug, Serialize)]
pub struct MigrateStartedJson {
    pub id: u64,
    pub from: String,
    pub to: String,
}

pub fn skipped_json(skipped: &[Skipped]) -> Vec<SkippedJson> {
    skipped
        .iter()
        .map(|s| SkippedJson {
            id: s.id,
            reason: s.reason.clone(),
        })
        .collect()
}

impl From<&MigrateReply> for MigrateJson {
    fn from(r: &MigrateReply) -> Self {
        MigrateJson {
            started: r
                .started
                .iter()
                .map(|s| MigrateStartedJson {
                    id: s.id,
                    from: s.from.to_string(),
                    to: s.to.to_string(),
                })
                .collect(),
            skipped: skipped_json(&r.skipped),
        }
    }
}

pub fn migrate_text(r: &MigrateReply) -> String {
    let mut out = String::new();
    for s in &r.started {
        let _ = writeln!(
            out,
            "connection {}: moving from {} to {}",
            s.id, s.from, s.to
        );
    }
    let _ = writeln!(
        out,
        "started {} move(s); `vnatctl ls` shows them as moving until their peers have validated the new addresses",
        r.started.len()
    );
    for s in &r.skipped {
        let _ = writeln!(out, "skipped connection {}: {}", s.id, s.reason);
    }
    out
}

/// `vnatctl --json migrate --wait`.
#[derive(Debug, Serialize)]
pub struct MigrateWaitJson {
    pub moves: Vec<WaitedJson>,
    pub skipped: Vec<SkippedJson>,
}

pub fn migrate_wait_text(moves: &[WaitedJson], skipped: &[Skipped]) -> String {
    let mut out = waited_text(moves);
    for s in skipped {
        let _ = writeln!(out, "skipped connection {}: {}", s.id, s.reason);
    }
    out
}

/// One element of `vnatctl --json peers`.
#[derive(Debug, Serialize)]
pub struct PeerRow {
    pub address: String,
    /// The host's x25519 key, hex; null for connections at that address
    /// that no paired host has claimed yet.
    pub key: Option<String>,
    pub connections: usize,
    pub mobile: usize,
    /// This host is behind a NAT as that peer sees it.
    pub behind_nat: bool,
    /// "ip:port" the peer last saw this host's VCMP come from; null until
    /// a keepalive was answered.
    pub reflexive: Option<String>,
    /// When vnatd last heard from it (an authentic, fresh message:
    /// keepalive, probe or a connection's record), in milliseconds since
    /// the Unix epoch, and how many seconds ago; null if not since vnatd
    /// started.
    pub last_heard_ms: Option<u64>,
    pub last_heard_secs: Option<u64>,
    /// The addresses the host told us it has (its keepalives): where its
    /// IPv4 connections continue over IPv6 when IPv4 is gone here.
    pub addresses: Vec<String>,
}

impl From<&PeerInfo> for PeerRow {
    fn from(p: &PeerInfo) -> Self {
        PeerRow {
            address: p.address.to_string(),
            key: p.key.clone(),
            connections: p.connections,
            mobile: p.mobile,
            behind_nat: p.behind_nat,
            reflexive: p.reflexive.map(|a| a.to_string()),
            last_heard_ms: p.last_heard_ms,
            last_heard_secs: p.last_heard_ms.map(|t| {
                vnat_control::monitor::unix_ms(std::time::SystemTime::now()).saturating_sub(t)
                    / 1000
            }),
            addresses: p.addresses.iter().map(|a| a.to_string()).collect(),
        }
    }
}

pub const PEERS_HEADER: [&str; 6] = ["ADDRESS", "KEY", "CONNECTIONS", "MOBILE", "NAT", "HEARD"];

pub fn peers_table(rows: &[PeerRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|p| {
            vec![
                p.address.clone(),
                p.key.clone().unwrap_or_else(|| "-".into()),
                p.connections.to_string(),
                p.mobile.to_string(),
                match (&p.reflexive, p.behind_nat) {
                    (Some(r), true) => format!("yes:{r}"),
                    (_, true) => "yes".into(),
                    _ => "no".into(),
                },
                p.last_heard_secs
                    .map_or_else(|| "-".into(), |s| format!("{} ago", duration(s))),
            ]
        })
        .collect();
    table(&PEERS_HEADER, &cells)
}

/// What `export --output FILE` prints (the document itself went to FILE).
pub fn export_written(json: bool, path: &Path, document: &ExportDocument) -> String {
    let ids: Vec<u64> = document.connections.iter().map(|c| c.id).collect();
    if json {
        let mut s = serde_json::json!({ "output": path, "exported": ids }).to_string();
        s.push('\n');
        s
    } else {
        format!(
            "exported {} connection(s) to {} (mode 0600); it holds their secret keys: keep it safe, import it on the host it is sealed for with `vnatctl import --from KEY FILE` (KEY: this host's, `vnatctl status`), then delete it\n",
            ids.len(),
            path.display()
        )
    }
}

/// One element of `vnatctl --json import`.
#[derive(Debug, Serialize)]
pub struct ImportRow {
    pub id: u64,
    pub proto: String,
    pub virtual_local: String,
    pub virtual_remote: String,
    pub physical_local: String,
    pub physical_remote: String,
    /// A move to `physical_local` was started.
    pub moving: bool,
}

impl From<&ImportedConnection> for ImportRow {
    fn from(c: &ImportedConnection) -> Self {
        ImportRow {
            id: c.id,
            proto: c.proto.to_string(),
            virtual_local: c.virtual_local.to_string(),
            virtual_remote: c.virtual_remote.to_string(),
            physical_local: c.physical_local.to_string(),
            physical_remote: c.physical_remote.to_string(),
            moving: c.moving,
        }
    }
}

pub fn import_text(rows: &[ImportRow]) -> String {
    let mut out = format!("imported {} connection(s)\n", rows.len());
    for r in rows {
        let _ = if r.moving {
            writeln!(
                out,
                "  {} {} {} -> {}: moving to {}, the peer is being updated",
                r.id, r.proto, r.virtual_local, r.virtual_remote, r.physical_local
            )
        } else {
            // vnatd starts the move once the restored socket shows up in
            // its records (until then a peer's packet would meet no socket).
            writeln!(
                out,
                "  {} {} {} -> {}: at {} for now; it moves to this host's address once the restored socket appears",
                r.id, r.proto, r.virtual_local, r.virtual_remote, r.physical_local
            )
        };
    }
    out
}
