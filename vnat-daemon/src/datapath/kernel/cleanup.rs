//! `vnatd --cleanup`: remove what vnat changed on this host once no vnatd
//! runs (the package's purge runs it). Each step stands alone: one that
//! fails is reported and the others still run. Only what carries vnat's
//! mark goes: rules and routes by their protocol number, priority and
//! table, addresses on `lo` by their `IFA_PROTO` tag (or a pinned
//! translation's record of having added them), tc filters by their
//! program's name, pins by their names. The state directory (keys, peers)
//! and the conntrack entries stay: the first is no host setting, the
//! second are the connections' own NAT entries.

use std::{collections::BTreeSet, fs, io, net::IpAddr, os::unix::fs::MetadataExt, path::Path};

use vnat_common::{FlowKey, NatRewrite, MAP_EGRESS_NAT, NAT_F_LO_ADDR_OURS};

use super::{attach, clsact, net, policy, rtnl, sysctls, translation_of};

mod sockets;
use crate::datapath::{DatapathError, Proto, SysctlRestore};

/// What a step of the cleanup is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    ControlSocket,
    Rule,
    Route,
    Interface,
    Address,
    Sysctl,
    Tc,
    Cgroup,
    Pins,
    /// Settings vnatd changed on applications' sockets and processes
    /// (`cleanup/sockets.rs`).
    Socket,
}

/// Why one step failed.
#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    #[error(transparent)]
    Datapath(#[from] DatapathError),
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("vnat's addresses are still on lo ({addrs}), and without the ARP settings the host would answer for them on its other links")]
    AddressesOnLo { addrs: String },
    #[error("it holds pins that are not vnat's ({names}), which stay")]
    ForeignPins { names: String },
    #[error("it is not on a bpf filesystem")]
    NotBpffs,
}

/// A step that did something, as one line for the user.
#[derive(Debug, serde::Serialize)]
pub struct Done {
    pub kind: Kind,
    pub what: String,
}

/// A step that failed: what it tried ("remove rule ...") and why not.
#[derive(Debug, serde::Serialize)]
pub struct Failed {
    pub kind: Kind,
    pub what: String,
    #[serde(serialize_with = "as_text")]
    pub error: CleanupError,
}

fn as_text<S: serde::Serializer>(e: &CleanupError, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(e)
}

/// Everything `vnatd --cleanup` did and could not do.
#[derive(Debug, Default, serde::Serialize)]
pub struct Report {
    pub done: Vec<Done>,
    pub failed: Vec<Failed>,
}

impl Report {
    fn done(&mut self, kind: Kind, what: String) {
        self.done.push(Done { kind, what });
    }

    fn failed(&mut self, kind: Kind, what: String, error: impl Into<CleanupError>) {
        self.failed.push(Failed {
            kind,
            what,
            error: error.into(),
        });
    }

    /// One line for each thing done, or one saying there was nothing.
    pub fn render(&self) -> String {
        if self.done.is_empty() && self.failed.is_empty() {
            return "nothing of vnat's is left on this host\n".into();
        }
        self.done.iter().map(|d| format!("{}\n", d.what)).collect()
    }
}

/// Remove what vnat changed on this host: its pins under `bpffs`, and the
/// sysctls recorded in `state_dir` put back. The caller makes sure no
/// vnatd runs.
pub fn cleanup(bpffs: &Path, state_dir: &Path) -> Report {
    let mut r = Report::default();
    // Read before the pins go: on a kernel without IFA_PROTO (before
    // Linux 6.1) a translation's record is the only mark of an address
    // vnat added to lo.
    let recorded_lo = lo_addrs_in_pins(bpffs);
    rules(&mut r);
    sink(&mut r);
    routes(&mut r);
    addresses(&mut r, &recorded_lo);
    restore_sysctls(&mut r, state_dir, &recorded_lo);
    sockets::give_back(&mut r, state_dir);
    tc(&mut r, bpffs);
    cgroups(&mut r, bpffs);
    pins(&mut r, bpffs);
    r
}

/// The local addresses of the pinned translations that added theirs to
/// `lo` (`NAT_F_LO_ADDR_OURS`).
fn lo_addrs_in_pins(bpffs: &Path) -> BTreeSet<IpAddr> {
    let Ok(data) = aya::maps::MapData::from_pin(bpffs.join(MAP_EGRESS_NAT)) else {
        return BTreeSet::new();
    };
    let Ok(map) =
        aya::maps::HashMap::<_, FlowKey, NatRewrite>::try_from(aya::maps::Map::HashMap(data))
    else {
        return BTreeSet::new();
    };
    map.iter()
        .filter_map(Result::ok)
        .filter(|(_, v)| v.flags & NAT_F_LO_ADDR_OURS != 0)
        .filter_map(|(k, v)| translation_of(&k, &v))
        .map(|t| t.flow.local.ip())
        .collect()
}

fn rules(r: &mut Report) {
    match net::via_routes() {
        Ok(all) => {
            for (flow, ifindex) in all {
                let proto = match flow.proto {
                    Proto::Tcp => "tcp",
                    Proto::Udp => "udp",
                };
                let what = format!(
                    "rule {proto} from {} to {} lookup {} priority {}",
                    flow.local,
                    flow.remote,
                    net::VIA_TABLE_BASE + ifindex,
                    net::VIA_RULE_PRIORITY
                );
                // The table's routes go with the other routes below.
                match net::del_via_route(&flow, ifindex, true) {
                    Ok(()) => r.done(Kind::Rule, format!("removed {what}")),
                    Err(e) => r.failed(Kind::Rule, format!("remove {what}"), e),
                }
            }
        }
        Err(e) => r.failed(Kind::Rule, "list vnat's per-connection rules".into(), e),
    }
    match net::fallback_rules() {
        Ok(all) => {
            for src in all {
                let what = format!(
                    "rule from {src} ipproto udp lookup {} priority {}",
                    net::FALLBACK_TABLE,
                    net::FALLBACK_PRIORITY
                );
                match net::del_fallback_rule(src) {
                    Ok(()) => r.done(Kind::Rule, format!("removed {what}")),
                    Err(e) => r.failed(Kind::Rule, format!("remove {what}"), e),
                }
            }
        }
        Err(e) => r.failed(Kind::Rule, "list vnat's last-resort rules".into(), e),
    }
    match super::intercept::intercepted() {
        Ok(all) => {
            for (addr, port) in all {
                let what = format!(
                    "rule to {addr} ipproto udp dport {port} lookup {} priority {}",
                    super::intercept::INTERCEPT_TABLE,
                    super::intercept::INTERCEPT_PRIORITY
                );
                match super::intercept::remove(addr, port) {
                    Ok(()) => r.done(Kind::Rule, format!("removed {what}")),
                    Err(e) => r.failed(Kind::Rule, format!("remove {what}"), e),
                }
            }
        }
        Err(e) => r.failed(
            Kind::Rule,
            "list vnat's rules for routed containers' VCMP".into(),
            e,
        ),
    }
}

fn sink(r: &mut Report) {
    let what = format!(
        "interface {} (and its peer {})",
        net::SINK_DEV,
        net::SINK_PEER
    );
    match net::remove_sink() {
        Ok(net::SinkRemoval::Removed) => r.done(Kind::Interface, format!("removed {what}")),
        Ok(net::SinkRemoval::Absent) => {}
        Ok(net::SinkRemoval::Foreign) => tracing::warn!("{}", net::foreign_sink_warning()),
        Err(e) => r.failed(Kind::Interface, format!("remove {what}"), e),
    }
}

/// Whether a route tagged with vnat's protocol number is one vnat makes:
/// a host route in the main table, any route in vnat's own tables.
fn vnats_route(route: &rtnl::Route) -> bool {
    if route.protocol != net::ROUTE_PROTO {
        return false;
    }
    if route.table == u32::from(rtnl::RT_TABLE_MAIN) {
        return route
            .dst
            .is_some_and(|d| route.dst_len == if d.is_ipv4() { 32 } else { 128 });
    }
    route.table > net::VIA_TABLE_BASE && route.table <= net::FALLBACK_TABLE
}

fn routes(r: &mut Report) {
    for (fam, v6) in [
        (rtnl::AddressFamily::Inet, false),
        (rtnl::AddressFamily::Inet6, true),
    ] {
        let all = match rtnl::routes_of_every_table(fam) {
            Ok(all) => all,
            // A kernel without IPv6 has no IPv6 routes.
            Err(e) if v6 && e.raw_os_error() == Some(libc::EAFNOSUPPORT) => continue,
            Err(e) => {
                r.failed(Kind::Route, "list the routes".into(), e);
                continue;
            }
        };
        for route in all.iter().filter(|x| vnats_route(x)) {
            let dst = route.dst.map_or_else(
                || "default".to_string(),
                |d| format!("{d}/{}", route.dst_len),
            );
            let table = if route.table == u32::from(rtnl::RT_TABLE_MAIN) {
                "main".to_string()
            } else {
                route.table.to_string()
            };
            let what = format!("route {dst} table {table}");
            match policy::del_route(v6, route.dst, route.dst_len, route.table, net::ROUTE_PROTO) {
                Ok(()) => r.done(Kind::Route, format!("removed {what}")),
                // Gone meanwhile (with its interface).
                Err(e) if matches!(e.raw_os_error(), Some(libc::ESRCH | libc::ENOENT)) => {}
                Err(e) => r.failed(Kind::Route, format!("remove {what}"), e),
            }
        }
    }
}

/// vnat's addresses on `lo`: tagged, or recorded by a pinned translation.
fn vnats_lo_addrs(recorded: &BTreeSet<IpAddr>) -> Result<Vec<IpAddr>, DatapathError> {
    Ok(net::lo_addrs()?
        .into_iter()
        .filter(|(a, ours)| *ours || recorded.contains(a))
        .map(|(a, _)| a)
        .collect())
}

fn addresses(r: &mut Report, recorded: &BTreeSet<IpAddr>) {
    let (lo, addrs) = match net::ifindex("lo").and_then(|lo| Ok((lo, vnats_lo_addrs(recorded)?))) {
        Ok(x) => x,
        Err(e) => {
            r.failed(Kind::Address, "list the addresses on lo".into(), e);
            return;
        }
    };
    for a in addrs {
        let what = format!("address {a}/{} from lo", if a.is_ipv4() { 32 } else { 128 });
        match rtnl::del_address(a, lo) {
            Ok(()) => r.done(Kind::Address, format!("removed {what}")),
            Err(e) => r.failed(Kind::Address, format!("remove {what}"), e),
        }
    }
}

/// Put back the sysctls recorded in `state_dir`, once none of vnat's IPv4
/// addresses is left on `lo`.
fn restore_sysctls(r: &mut Report, state_dir: &Path, recorded: &BTreeSet<IpAddr>) {
    let path = sysctls::record_path(state_dir);
    if !path.exists() {
        return;
    }
    let what = "put back the ARP sysctls".to_string();
    match vnats_lo_addrs(recorded) {
        Ok(left) => {
            let left: Vec<String> = left
                .iter()
                .filter(|a| a.is_ipv4())
                .map(ToString::to_string)
                .collect();
            if !left.is_empty() {
                let addrs = left.join(", ");
                r.failed(Kind::Sysctl, what, CleanupError::AddressesOnLo { addrs });
                return;
            }
        }
        Err(e) => {
            r.failed(Kind::Sysctl, what, e);
            return;
        }
    }
    match sysctls::restore(&path) {
        Ok(all) => {
            for s in all.unwrap_or_default() {
                let line = match s {
                    SysctlRestore::PutBack { key, value } => {
                        format!("restored sysctl {key} = {value}")
                    }
                    SysctlRestore::LeftChanged { key, value } => {
                        format!("left sysctl {key} = {value}: it changed since vnat set it")
                    }
                };
                r.done(Kind::Sysctl, line);
            }
        }
        Err(e) => r.failed(Kind::Sysctl, what, e),
    }
}

/// Detach the translators from every interface: the pinned TCX links
/// (their pin is their last reference once no vnatd runs), vnat's clsact
/// filters, and the clsact qdisc vnat added if nothing else is on it.
fn tc(r: &mut Report, bpffs: &Path) {
    let interfaces = match clsact::interfaces() {
        Ok(all) => all,
        Err(e) => {
            r.failed(Kind::Tc, "list the interfaces".into(), e);
            return;
        }
    };
    for ifindex in interfaces {
        let name = net::ifname(ifindex).unwrap_or_else(|_| format!("interface {ifindex}"));
        let mut how = Vec::new();
        let mut tcx = false;
        for egress in [false, true] {
            let pin = attach::tc_pin(bpffs, ifindex, egress);
            match fs::remove_file(&pin) {
                Ok(()) => tcx = true,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => r.failed(Kind::Tc, format!("remove {}", pin.display()), e),
            }
        }
        if tcx {
            how.push("TCX links");
        }
        let mut others = false;
        let mut filters = false;
        for egress in [false, true] {
            let hook = if egress { "egress" } else { "ingress" };
            match clsact::filters(ifindex, egress) {
                Ok(all) => {
                    for f in all {
                        if !f.is_vnats() {
                            others = true;
                            continue;
                        }
                        match clsact::del_filter(ifindex, egress, &f) {
                            Ok(()) => filters = true,
                            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                            Err(e) => {
                                others = true;
                                let what = format!("remove vnat's tc filter on {name} {hook}");
                                r.failed(Kind::Tc, what, e);
                            }
                        }
                    }
                }
                Err(e) => {
                    others = true;
                    r.failed(Kind::Tc, format!("list the tc filters on {name} {hook}"), e);
                }
            }
        }
        if filters {
            how.push("clsact filters");
        }
        // The mark itself goes with the pins.
        if attach::qdisc_pin(bpffs, ifindex).exists() && !others {
            match clsact::del_qdisc(ifindex) {
                Ok(()) => how.push("the clsact qdisc vnat added"),
                Err(e) => r.failed(Kind::Tc, format!("remove the clsact qdisc of {name}"), e),
            }
        }
        if !how.is_empty() {
            r.done(
                Kind::Tc,
                format!("detached tc from {name} ({})", how.join(", ")),
            );
        }
    }
}

/// Detach the recorders and hooks from each cgroup, by their pins.
fn cgroups(r: &mut Report, bpffs: &Path) {
    for id in attach::pinned_cgroups(bpffs) {
        let path = attach::cgroup_path(id).map_or_else(
            || format!("cgroup id {id} (gone)"),
            |p| p.display().to_string(),
        );
        match attach::detach_cgroup(bpffs, id) {
            Ok(()) => r.done(
                Kind::Cgroup,
                format!("detached vnat's programs from cgroup {path}"),
            ),
            Err(e) => r.failed(
                Kind::Cgroup,
                format!("detach vnat's programs from cgroup {path}"),
                e,
            ),
        }
    }
}

/// Remove the pin directory: `links/` and the maps (`VNAT_*`), then the
/// directory itself, unless it holds something else or is a mount point.
fn pins(r: &mut Report, bpffs: &Path) {
    let what = format!("remove {}", bpffs.display());
    let entries = match fs::read_dir(bpffs) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return,
        Err(e) => return r.failed(Kind::Pins, what, e),
    };
    match nix::sys::statfs::statfs(bpffs) {
        Ok(st) => {
            if st.filesystem_type() != nix::sys::statfs::BPF_FS_MAGIC {
                return r.failed(Kind::Pins, what, CleanupError::NotBpffs);
            }
        }
        Err(e) => return r.failed(Kind::Pins, what, io::Error::from(e)),
    }
    let mut foreign = Vec::new();
    let mut clean = true;
    for entry in entries {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                clean = false;
                r.failed(Kind::Pins, what.clone(), e);
                continue;
            }
        };
        let name = entry.file_name().to_string_lossy().into_owned();
        let removed = if name == "links" {
            fs::remove_dir_all(entry.path())
        } else if name.starts_with("VNAT_") {
            fs::remove_file(entry.path())
        } else {
            foreign.push(name);
            continue;
        };
        if let Err(e) = removed {
            clean = false;
            r.failed(Kind::Pins, format!("remove {}", entry.path().display()), e);
        }
    }
    if !foreign.is_empty() {
        let names = foreign.join(", ");
        return r.failed(Kind::Pins, what, CleanupError::ForeignPins { names });
    }
    if !clean {
        return;
    }
    // A directory that is bpffs's mount point itself stays (only its
    // entries were vnat's).
    let mount_point =
        bpffs
            .parent()
            .is_none_or(|parent| match (fs::metadata(bpffs), fs::metadata(parent)) {
                (Ok(a), Ok(b)) => a.dev() != b.dev(),
                _ => true,
            });
    if mount_point {
        return r.done(
            Kind::Pins,
            format!("removed vnat's pins from {}", bpffs.display()),
        );
    }
    match fs::remove_dir(bpffs) {
        Ok(()) => r.done(
            Kind::Pins,
            format!(
                "removed {} (vnat's pinned programs, maps and links)",
                bpffs.display()
            ),
        ),
        Err(e) => r.failed(Kind::Pins, what, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(table: u32, protocol: u8, dst: Option<&str>, dst_len: u8) -> rtnl::Route {
        rtnl::Route {
            kind: rtnl::RouteType::Unicast,
            table,
            protocol,
            dst: dst.map(|d| d.parse().expect("address")),
            dst_len,
            oif: None,
            gateway: None,
            prefsrc: None,
        }
    }

    #[test]
    fn only_routes_of_vnats_shapes_and_tag_are_vnats() {
        let main = u32::from(rtnl::RT_TABLE_MAIN);
        let tag = net::ROUTE_PROTO;
        assert!(vnats_route(&route(main, tag, Some("10.0.0.1"), 32)));
        assert!(vnats_route(&route(main, tag, Some("2001:db8::1"), 128)));
        assert!(vnats_route(&route(
            net::VIA_TABLE_BASE + 3,
            tag,
            Some("10.0.0.1"),
            32
        )));
        assert!(vnats_route(&route(net::FALLBACK_TABLE, tag, None, 0)));
        // Someone else's protocol, anywhere.
        assert!(!vnats_route(&route(main, 4, Some("10.0.0.1"), 32)));
        assert!(!vnats_route(&route(net::FALLBACK_TABLE, 3, None, 0)));
        // vnat's tag on what vnat never makes: a prefix in main, a route
        // in another table.
        assert!(!vnats_route(&route(main, tag, Some("10.0.0.0"), 24)));
        assert!(!vnats_route(&route(100, tag, Some("10.0.0.1"), 32)));
    }

    #[test]
    fn a_report_with_nothing_done_says_so() {
        assert_eq!(
            Report::default().render(),
            "nothing of vnat's is left on this host\n"
        );
        let mut r = Report::default();
        r.done(Kind::Interface, "removed interface vnat-sink".into());
        assert_eq!(r.render(), "removed interface vnat-sink\n");
    }
}
