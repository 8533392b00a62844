//! Routes, addresses and sysctls, through iproute2's JSON interface.
//!
//! Kept behind this small module so that it can be replaced by direct
//! rtnetlink calls without touching the manager. Every route vnat adds
//! carries [`ROUTE_PROTO`], so cleanup removes exactly what vnat added.

use std::{net::IpAddr, process::Command};

use serde::Deserialize;

use crate::datapath::DatapathError;

/// Route protocol number of vnat's host routes (`ip route show proto 157`).
pub const ROUTE_PROTO: u8 = 157;

/// Where the kernel would send a packet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteInfo {
    pub dev: String,
    pub ifindex: u32,
    pub gateway: Option<IpAddr>,
    /// The source address the kernel picks for this route.
    pub prefsrc: Option<IpAddr>,
}

#[derive(Deserialize)]
struct JsonRoute {
    dev: Option<String>,
    prefsrc: Option<IpAddr>,
    gateway: Option<IpAddr>,
    #[serde(rename = "type")]
    kind: Option<String>,
}

fn ip(args: &[&str]) -> Result<String, DatapathError> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| DatapathError::Kernel {
            what: format!("running `ip {}` (is iproute2 installed?)", args.join(" ")),
            source: e,
        })?;
    if !out.status.success() {
        return Err(DatapathError::Kernel {
            what: format!("`ip {}`", args.join(" ")),
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn family_flag(a: IpAddr) -> &'static str {
    if a.is_ipv4() {
        "-4"
    } else {
        "-6"
    }
}

fn host_prefix(a: IpAddr) -> String {
    match a {
        IpAddr::V4(v4) => format!("{v4}/32"),
        IpAddr::V6(v6) => format!("{v6}/128"),
    }
}

pub fn ifindex(name: &str) -> Result<u32, DatapathError> {
    nix::net::if_::if_nametoindex(name).map_err(|e| DatapathError::Kernel {
        what: format!("looking up interface {name}"),
        source: std::io::Error::from(e),
    })
}

pub fn ifname(index: u32) -> Result<String, DatapathError> {
    let mut buf = [0u8; libc::IF_NAMESIZE];
    let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr().cast()) };
    if p.is_null() {
        return Err(DatapathError::Kernel {
            what: format!("looking up interface index {index}"),
            source: std::io::Error::last_os_error(),
        });
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// `ip route get DST [from SRC]`: the interface and gateway the kernel uses.
pub fn route_get(dst: IpAddr, from: Option<IpAddr>) -> Result<RouteInfo, DatapathError> {
    let d = dst.to_string();
    let f = from.map(|a| a.to_string());
    let mut args = vec!["-j", family_flag(dst), "route", "get", d.as_str()];
    if let Some(f) = f.as_deref() {
        args.extend(["from", f]);
    }
    let out = ip(&args).map_err(|_| DatapathError::NoRoute { addr: dst })?;
    let routes: Vec<JsonRoute> = serde_json::from_str(&out).map_err(|e| DatapathError::Kernel {
        what: "parsing `ip -j route get`".into(),
        source: std::io::Error::other(e),
    })?;
    let r = routes
        .into_iter()
        .next()
        .ok_or(DatapathError::NoRoute { addr: dst })?;
    if r.kind.as_deref().is_some_and(|k| k != "unicast") {
        return Err(DatapathError::NoRoute { addr: dst });
    }
    let dev = r.dev.ok_or(DatapathError::NoRoute { addr: dst })?;
    Ok(RouteInfo {
        ifindex: ifindex(&dev)?,
        dev,
        gateway: r.gateway,
        prefsrc: r.prefsrc,
    })
}

#[derive(Deserialize)]
struct JsonLink {
    #[serde(default)]
    ifindex: u32,
    #[serde(default)]
    ifname: String,
    addr_info: Vec<JsonAddr>,
}
/// `ip -j addr show scope X` prints `{}` for the addresses the filter hid,
/// so `local` is optional.
#[derive(Deserialize)]
struct JsonAddr {
    local: Option<IpAddr>,
}

/// Every address currently assigned to `lo`.
pub fn lo_addrs() -> Result<Vec<IpAddr>, DatapathError> {
    let out = ip(&["-j", "addr", "show", "dev", "lo"])?;
    let links: Vec<JsonLink> = serde_json::from_str(&out).map_err(|e| DatapathError::Kernel {
        what: "parsing `ip -j addr show dev lo`".into(),
        source: std::io::Error::other(e),
    })?;
    Ok(links
        .into_iter()
        .flat_map(|l| l.addr_info)
        .filter_map(|a| a.local)
        .collect())
}

/// Global-scope addresses of every interface but `lo`, with the ifindex.
pub fn interface_addrs() -> Result<Vec<(IpAddr, u32)>, DatapathError> {
    let out = ip(&["-j", "addr", "show", "scope", "global"])?;
    let links: Vec<JsonLink> = serde_json::from_str(&out).map_err(|e| DatapathError::Kernel {
        what: "parsing `ip -j addr show`".into(),
        source: std::io::Error::other(e),
    })?;
    Ok(links
        .into_iter()
        .filter(|l| l.ifname != "lo")
        .flat_map(|l| {
            let idx = l.ifindex;
            l.addr_info
                .into_iter()
                .filter_map(move |a| Some((a.local?, idx)))
        })
        .collect())
}

/// Keep a moved-away address local (DESIGN.md §3): as a host address on `lo`,
/// never answered for or announced on other links.
pub fn add_lo_addr(a: IpAddr) -> Result<(), DatapathError> {
    if a.is_ipv4() {
        // arp_ignore=1: answer ARP only for addresses of the receiving
        // interface; arp_announce=2: never use a non-local-subnet source
        // address in ARP. The kernel uses max(all, iface), so "all" is enough.
        sysctl("net/ipv4/conf/all/arp_ignore", "1")?;
        sysctl("net/ipv4/conf/all/arp_announce", "2")?;
        ip(&["addr", "add", &host_prefix(a), "dev", "lo"])?;
    } else {
        ip(&["-6", "addr", "add", &host_prefix(a), "dev", "lo", "nodad"])?;
    }
    Ok(())
}

pub fn del_lo_addr(a: IpAddr) -> Result<(), DatapathError> {
    ip(&[family_flag(a), "addr", "del", &host_prefix(a), "dev", "lo"]).map(|_| ())
}

/// Route a moved peer's old (virtual) address the way its new physical
/// address is routed, so the socket's packets leave through the interface
/// where tc rewrites them instead of dying in an unresolved neighbour entry.
pub fn add_host_route(virt: IpAddr, phys: IpAddr, via: &RouteInfo) -> Result<(), DatapathError> {
    let prefix = host_prefix(virt);
    let gw = via.gateway.unwrap_or(phys).to_string();
    let proto = ROUTE_PROTO.to_string();
    ip(&[
        family_flag(virt),
        "route",
        "replace",
        &prefix,
        "via",
        &gw,
        "dev",
        &via.dev,
        "proto",
        &proto,
    ])
    .map(|_| ())
}

pub fn del_host_route(virt: IpAddr) -> Result<(), DatapathError> {
    let proto = ROUTE_PROTO.to_string();
    ip(&[
        family_flag(virt),
        "route",
        "del",
        &host_prefix(virt),
        "proto",
        &proto,
    ])
    .map(|_| ())
}

#[derive(Deserialize)]
struct JsonDst {
    dst: String,
}

/// Host routes carrying vnat's protocol number.
pub fn host_routes() -> Result<Vec<IpAddr>, DatapathError> {
    let proto = ROUTE_PROTO.to_string();
    let mut all = Vec::new();
    for fam in ["-4", "-6"] {
        let out = ip(&["-j", fam, "route", "show", "proto", &proto])?;
        let routes: Vec<JsonDst> = serde_json::from_str(&out).unwrap_or_default();
        all.extend(
            routes
                .iter()
                .filter_map(|r| r.dst.split('/').next()?.parse::<IpAddr>().ok()),
        );
    }
    Ok(all)
}

fn sysctl(key: &str, value: &str) -> Result<(), DatapathError> {
    std::fs::write(format!("/proc/sys/{key}"), value).map_err(|e| DatapathError::Kernel {
        what: format!("setting sysctl {}", key.replace('/', ".")),
        source: e,
    })
}
