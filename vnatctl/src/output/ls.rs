//! `vnatctl ls`: its JSON rows (a contract with users' scripts, pinned by
//! the tests) and its table.

use serde::Serialize;
use vnat_control::ListedConnection;

use super::table;

/// One element of `vnatctl --json ls`.
#[derive(Debug, Serialize)]
pub struct LsRow {
    pub id: u64,
    /// "tcp" or "udp".
    pub proto: String,
    /// "ip:port", IPv6 as "[ip]:port".
    pub virtual_local: String,
    pub virtual_remote: String,
    pub physical_local: String,
    pub physical_remote: String,
    /// "native" or "translated".
    pub state: String,
    pub pid: Option<u32>,
    pub command: Option<String>,
    pub cgroup: Option<String>,
    pub cgroup_id: u64,
    pub cookie: u64,
    pub age_secs: u64,
    /// VCMP has keys for it, so it can move (its peer runs vnatd).
    pub mobile: bool,
    /// A NAT between the ends: the peer sees our end at `seen_by_peer_as`.
    pub behind_nat: bool,
    /// "ip:port" the peer sees for our end, when it differs from
    /// `virtual_local`; null otherwise.
    pub seen_by_peer_as: Option<String>,
    /// Why it cannot move, in a few words; null when it can.
    pub why_not_mobile: Option<String>,
    /// The role a suspension settled for this end: "primary" (this end
    /// moves) or "secondary" (the peer does); null before any suspension.
    pub role: Option<String>,
    /// A move is under way: the peer is validating the new address.
    pub moving: bool,
    /// Suspended: vnatd turned its TCP keepalive off until resume.
    pub keepalive_held: bool,
    /// The local address an operator placed it at (`vnatctl migrate`),
    /// where automatic mode leaves it, also across restarts of vnatd;
    /// null while automatic mode decides where it is.
    pub placed: Option<String>,
    /// Keep-alive helpers this host asked the peer for (`suspend
    /// --helper`), until the connection works again.
    pub helpers_asked: Vec<String>,
    /// Keep-alive helpers this host runs for the absent peer.
    pub helping: Vec<String>,
    /// Recorded after the fact: the connection was open before vnatd
    /// started or before its cgroup was enabled (it moves like any other).
    pub adopted: bool,
    /// Its application's cgroup hides location (`enable --hide-location`):
    /// it keeps seeing moved hosts at their old addresses.
    pub hide_location: bool,
    /// A container's connection (a socket in another network namespace
    /// behind this host's NAT): where it lives. The endpoints above are
    /// then the public ones, after the host's NAT. Null for the host's own.
    pub guest: Option<GuestRow>,
    /// Its last move since vnatd started (this host's end or the peer's);
    /// null if none.
    pub last_move: Option<LastMoveRow>,
}

/// `last_move` of an `ls` row.
#[derive(Debug, Serialize)]
pub struct LastMoveRow {
    /// "local" (this host's end moved) or "peer".
    pub side: String,
    pub from: String,
    pub to: String,
    /// "moving" (under way), "moved" or "failed".
    pub outcome: String,
    /// For "moved": from its start until both ends translated.
    pub handover_ms: Option<u64>,
    /// For "failed": why.
    pub reason: Option<String>,
    /// Milliseconds since the Unix epoch.
    pub started_ms: u64,
    pub ended_ms: Option<u64>,
}

/// `guest` of an `ls` row.
#[derive(Debug, Serialize)]
pub struct GuestRow {
    /// "net:[INODE]" as lsns and /proc/PID/ns/net name it; null if no
    /// process of it is known.
    pub netns: Option<String>,
    /// The kernel's cookie for the namespace (`bpf_get_netns_cookie`).
    pub netns_cookie: u64,
    /// The socket's own ends, "ip:port", before the host's NAT.
    pub private_local: String,
    pub private_remote: String,
    /// Not NATed: the container's own address, routed to it by this host;
    /// this host's address on the network that routes it (the connection
    /// moves when that address goes). Null when NATed.
    pub routed_via: Option<String>,
}

impl From<&ListedConnection> for LsRow {
    fn from(listed: &ListedConnection) -> Self {
        let c = &listed.info;
        LsRow {
            id: c.id,
            proto: c.proto.to_string(),
            virtual_local: c.virtual_local.to_string(),
            virtual_remote: c.virtual_remote.to_string(),
            physical_local: c.physical_local.to_string(),
            physical_remote: c.physical_remote.to_string(),
            state: c.state.to_string(),
            pid: c.pid,
            command: c.command.clone(),
            cgroup: c.cgroup.clone(),
            cgroup_id: c.cgroup_id,
            cookie: c.cookie,
            age_secs: c.age_secs,
            mobile: listed.mobile,
            behind_nat: listed.seen_by_peer_as.is_some(),
            seen_by_peer_as: listed.seen_by_peer_as.map(|a| a.to_string()),
            why_not_mobile: listed.why_not_mobile.clone(),
            role: listed.role.clone(),
            moving: listed.moving,
            keepalive_held: listed.keepalive_held,
            placed: listed.placed.map(|a| a.to_string()),
            adopted: c.adopted,
            hide_location: c.hide_location,
            helpers_asked: listed.helpers_asked.clone(),
            helping: listed.helping.clone(),
            guest: c.guest.as_ref().map(|g| GuestRow {
                netns: g.netns.clone(),
                netns_cookie: g.netns_cookie,
                private_local: g.private_local.to_string(),
                private_remote: g.private_remote.to_string(),
                routed_via: g.routed_via.map(|a| a.to_string()),
            }),
            last_move: listed.last_move.as_ref().map(|m| LastMoveRow {
                side: match m.side {
                    vnat_control::Side::Local => "local".into(),
                    vnat_control::Side::Peer => "peer".into(),
                },
                from: m.from.to_string(),
                to: m.to.to_string(),
                outcome: m.outcome.map_or("moving", |o| o.as_str()).to_string(),
                handover_ms: m.handover_ms,
                reason: m.reason.clone(),
                started_ms: m.started_ms,
                ended_ms: m.ended_ms,
            }),
        }
    }
}

pub const LS_HEADER: [&str; 14] = [
    "ID",
    "PROTO",
    "VIRTUAL-LOCAL",
    "VIRTUAL-REMOTE",
    "PHYSICAL-LOCAL",
    "PHYSICAL-REMOTE",
    "STATE",
    "MOBILE",
    "ROLE",
    "PID",
    "COMMAND",
    "CGROUP",
    "LAST-MOVE",
    "NOTE",
];

/// The `ls` table; unknown values are shown as "-".
pub fn ls_table(rows: &[LsRow]) -> String {
    let dash = |v: Option<String>| v.unwrap_or_else(|| "-".into());
    let now_ms = vnat_control::monitor::unix_ms(std::time::SystemTime::now());
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.id.to_string(),
                r.proto.clone(),
                r.virtual_local.clone(),
                r.virtual_remote.clone(),
                r.physical_local.clone(),
                r.physical_remote.clone(),
                if r.moving {
                    "moving".into()
                } else {
                    r.state.clone()
                },
                yes_no(r.mobile),
                dash(r.role.clone()),
                dash(r.pid.map(|p| p.to_string())),
                dash(r.command.clone()),
                dash(r.cgroup.clone()),
                last_move(r, now_ms),
                note(r),
            ]
        })
        .collect();
    table(&LS_HEADER, &cells)
}

/// The `ls` LAST-MOVE: "moved in 12ms 3m05s ago" (the peer's end: "peer
/// moved ..."), "failed 10s ago" (the reason is in --json), "moving".
fn last_move(r: &LsRow, now_ms: u64) -> String {
    let Some(m) = &r.last_move else {
        return "-".into();
    };
    let who = if m.side == "peer" { "peer " } else { "" };
    let ago = m.ended_ms.map_or_else(String::new, |t| {
        format!(" {} ago", super::duration(now_ms.saturating_sub(t) / 1000))
    });
    match (m.outcome.as_str(), m.handover_ms) {
        ("moved", Some(ms)) => format!("{who}moved in {ms}ms{ago}"),
        (o, _) => format!("{who}{o}{ago}"),
    }
}

/// The `ls` NOTE: where a NAT put our end, or why it cannot move; for a
/// container's connection, first its namespace and private end.
fn note(r: &LsRow) -> String {
    let mut rest = match (&r.seen_by_peer_as, &r.why_not_mobile) {
        (_, Some(why)) => Some(why.clone()),
        (Some(seen), None) => Some(format!("NAT: the peer sees {seen}")),
        (None, None) => None,
    };
    let asked = format!(
        "peer asked to keep it alive ({})",
        r.helpers_asked.join(", ")
    );
    let helping = format!(
        "keeping it alive for the absent peer ({})",
        r.helping.join(", ")
    );
    let placed = format!(
        "placed at {} by migrate",
        r.placed.as_deref().unwrap_or_default()
    );
    for (on, what) in [
        (r.placed.is_some(), placed.as_str()),
        (r.keepalive_held, "keepalive held until resume"),
        (!r.helpers_asked.is_empty(), asked.as_str()),
        (!r.helping.is_empty(), helping.as_str()),
        (r.adopted, "adopted (open before vnat recorded its cgroup)"),
        (r.hide_location, "hide location"),
    ] {
        if on {
            rest = Some(match rest {
                Some(r) => format!("{r}; {what}"),
                None => what.to_string(),
            });
        }
    }
    let guest = r.guest.as_ref().map(|g| {
        let ns = g
            .netns
            .clone()
            .unwrap_or_else(|| format!("netns cookie {}", g.netns_cookie));
        match &g.routed_via {
            Some(via) => format!("container {ns}, its address routed here via {via}"),
            None => format!("container {ns} at {}", g.private_local),
        }
    });
    match (guest, rest) {
        (Some(g), Some(r)) => format!("{g}; {r}"),
        (Some(g), None) => g,
        (None, Some(r)) => r,
        (None, None) => "-".into(),
    }
}

fn yes_no(b: bool) -> String {
    if b { "yes" } else { "no" }.to_string()
}
