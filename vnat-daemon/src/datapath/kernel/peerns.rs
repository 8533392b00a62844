//! Which network namespace an address of this host's routes leads into:
//! the check that ties a container's socket to the namespace the host
//! really sends that container's address to (docs/containers.md).
//!
//! A process in an enabled cgroup can make a namespace of its own and give
//! a socket any address there. What it cannot change is the host's routing:
//! the host's route for the address leaves by a veth whose other end is in
//! some namespace, or by a bridge with such veths as ports. A guest's
//! socket counts only if its namespace is behind that route.

use std::{
    collections::HashMap,
    fs::File,
    io,
    net::IpAddr,
    os::fd::{AsFd, AsRawFd},
};

use netlink_packet_core::NLM_F_DUMP;
use netlink_packet_route::{
    link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage},
    nsid::{NsidAttribute, NsidMessage},
    RouteNetlinkMessage,
};

use super::rtnl::{self, RouteType};

/// What the host's routing table says of one interface.
#[derive(Debug, Default)]
pub(super) struct Link {
    pub(super) kind: Option<InfoKind>,
    /// `IFLA_LINK`: the link it is stacked on, or a veth's other end.
    pub(super) lower: Option<u32>,
    /// `IFLA_LINK_NETNSID`: the namespace the other end is in (a veth's),
    /// as this namespace numbers it.
    peer_nsid: Option<i32>,
    /// `IFLA_MASTER`: the bridge it is a port of.
    controller: Option<u32>,
}

impl Link {
    fn from_message(m: &LinkMessage) -> Link {
        let mut l = Link::default();
        for a in &m.attributes {
            match a {
                LinkAttribute::LinkNetNsId(n) => l.peer_nsid = Some(*n),
                LinkAttribute::Link(i) => l.lower = Some(*i),
                LinkAttribute::Controller(c) => l.controller = Some(*c),
                LinkAttribute::LinkInfo(infos) => {
                    for i in infos {
                        if let LinkInfo::Kind(k) = i {
                            l.kind = Some(k.clone());
                        }
                    }
                }
                _ => {}
            }
        }
        l
    }
}

pub(super) fn link(ifindex: u32) -> io::Result<Link> {
    let mut m = LinkMessage::default();
    m.header.index = ifindex;
    rtnl::call(RouteNetlinkMessage::GetLink(m), 0)?
        .iter()
        .find_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => Some(Link::from_message(l)),
            _ => None,
        })
        .ok_or_else(|| io::Error::other("the kernel answered a link query with no link"))
}

fn links() -> io::Result<Vec<Link>> {
    Ok(rtnl::call(
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        NLM_F_DUMP,
    )?
    .iter()
    .filter_map(|m| match m {
        RouteNetlinkMessage::NewLink(l) => Some(Link::from_message(l)),
        _ => None,
    })
    .collect())
}

/// This namespace's number for the namespace `ns` (RTM_GETNSID), None if
/// it has none (then no link of ours leads there: a link whose other end
/// is there gets a number when it is listed).
fn nsid_of(ns: &File) -> io::Result<Option<i32>> {
    let mut m = NsidMessage::default();
    m.attributes
        .push(NsidAttribute::Fd(ns.as_fd().as_raw_fd() as u32));
    let id = rtnl::call(RouteNetlinkMessage::GetNsId(m), 0)?
        .iter()
        .find_map(|m| match m {
            RouteNetlinkMessage::NewNsId(n) => n.attributes.iter().find_map(|a| match a {
                NsidAttribute::Id(i) => Some(*i),
                _ => None,
            }),
            _ => None,
        });
    Ok(id.filter(|i| *i >= 0))
}

/// Where this host routes an address: into a namespace through a link it
/// can follow, or out of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Leads {
    /// A local address of this host's.
    Local,
    /// Out of a veth whose other end is in another namespace, or a bridge
    /// with such veths as ports.
    Namespaces,
    /// Out of any other link (a physical one, a tunnel; or a kind of link
    /// whose other end this cannot follow: Open vSwitch, ipvlan).
    Elsewhere,
}

/// Where this host routes `ip`, and the numbers (this namespace's
/// `IFLA_LINK_NETNSID`) of the namespaces the route leads into.
fn follow(ip: IpAddr) -> io::Result<(Leads, Vec<i32>)> {
    let route = rtnl::route_get(ip, None)?;
    if route.kind == RouteType::Local {
        return Ok((Leads::Local, Vec::new()));
    }
    let Some(oif) = route.oif.filter(|_| route.kind == RouteType::Unicast) else {
        return Ok((Leads::Elsewhere, Vec::new()));
    };
    // The links first: listing a veth gives its peer's namespace a number.
    let out = link(oif)?;
    let ports = match out.kind {
        Some(InfoKind::Veth) => vec![out],
        Some(InfoKind::Bridge) => links()?
            .into_iter()
            .filter(|l| l.controller == Some(oif) && l.kind == Some(InfoKind::Veth))
            .collect(),
        _ => Vec::new(),
    };
    let peers: Vec<i32> = ports.iter().filter_map(|l| l.peer_nsid).collect();
    if peers.is_empty() {
        Ok((Leads::Elsewhere, peers))
    } else {
        Ok((Leads::Namespaces, peers))
    }
}

/// Whether this host routes `ip` into the namespace `ns`: `Some(true)` if
/// its route leaves by a veth whose other end is in `ns` (or a bridge with
/// such a port), `Some(false)` if it is local or leads into other
/// namespaces only, `None` if it leaves by a link this cannot follow.
pub(super) fn routes_into(ip: IpAddr, ns: &File) -> io::Result<Option<bool>> {
    let (leads, peers) = follow(ip)?;
    match leads {
        Leads::Local => Ok(Some(false)),
        Leads::Elsewhere => Ok(None),
        Leads::Namespaces => {
            let id = nsid_of(ns)?;
            Ok(Some(id.is_some_and(|id| peers.contains(&id))))
        }
    }
}

/// Whether a flow from `from` (a container's address) to `to` stays on
/// this host: `to` is a local address, or the host reaches it by the same
/// link as `from` (another container on the same bridge).
pub(super) fn stays_on_host(from: IpAddr, to: IpAddr) -> io::Result<bool> {
    let there = rtnl::route_get(to, None)?;
    if there.kind == RouteType::Local {
        return Ok(true);
    }
    Ok(there.oif.is_some() && there.oif == rtnl::route_get(from, None)?.oif)
}

/// The cookie (`SO_NETNS_COOKIE`, what `bpf_get_netns_cookie` gives the
/// recorder) of the namespace `ns`, asked from a thread that enters it
/// with a socket made there (unbound: `lo` may be down).
pub(super) fn cookie_of(ns: &File) -> io::Result<u64> {
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            let sock = nix::sys::socket::socket(
                nix::sys::socket::AddressFamily::Inet,
                nix::sys::socket::SockType::Datagram,
                nix::sys::socket::SockFlag::SOCK_CLOEXEC,
                None,
            )
            .map_err(io::Error::from)?;
            let mut cookie: u64 = 0;
            let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
            // SAFETY: getsockopt writes at most `len` bytes into `cookie`, a
            // live u64 whose size `len` gives; the socket is open for the
            // whole call.
            let r = unsafe {
                libc::getsockopt(
                    sock.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_NETNS_COOKIE,
                    (&mut cookie as *mut u64).cast(),
                    &mut len,
                )
            };
            if r != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(cookie)
        })
        .join()
        .map_err(|_| io::Error::other("the thread that entered a namespace panicked"))?
    })
}

/// Finds a namespace by its cookie: through the recorded process first,
/// else among every process's namespace (a connection accepted in a
/// container is recorded with no process). What each namespace's cookie
/// is stays known, by inode, for the next search.
///
/// The search of every process is bounded: at most one every
/// [`SCAN_EVERY`] (a cookie it did not find waits for the next one, however
/// many records ask), and at most [`NEW_PER_SCAN`] namespaces not seen
/// before are entered per scan (each costs a thread): a user who makes
/// thousands of namespaces slows the finding of new ones, not vnatd.
#[derive(Default)]
pub(super) struct NetnsFinder {
    cookies: HashMap<u64, u64>,
    /// Where each cookie the last scan found is, by a process's path.
    found: HashMap<u64, String>,
    last_scan: Option<std::time::Instant>,
}

/// How often /proc is searched at most.
const SCAN_EVERY: std::time::Duration = std::time::Duration::from_secs(5);
/// New namespaces entered per scan at most.
const NEW_PER_SCAN: usize = 64;

impl NetnsFinder {
    pub fn find(&mut self, cookie: u64, pid: u32) -> Option<File> {
        if pid != 0 {
            if let Some(f) = self.check(&format!("/proc/{pid}/ns/net"), cookie) {
                return Some(f);
            }
        }
        if let Some(path) = self.found.get(&cookie).cloned() {
            if let Some(f) = self.check(&path, cookie) {
                return Some(f);
            }
        }
        if self.last_scan.is_some_and(|t| t.elapsed() < SCAN_EVERY) {
            return None;
        }
        self.scan();
        let path = self.found.get(&cookie).cloned()?;
        self.check(&path, cookie)
    }

    /// One search of every process's namespace.
    fn scan(&mut self) {
        self.last_scan = Some(std::time::Instant::now());
        self.found.clear();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        let mut seen = std::collections::HashSet::new();
        let mut entered = 0;
        for e in entries.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let path = format!("/proc/{}/ns/net", name.to_string_lossy());
            let Some(ino) = inode(&path) else {
                continue;
            };
            if !seen.insert(ino) {
                continue;
            }
            let cookie = match self.cookies.get(&ino) {
                Some(c) => *c,
                None if entered < NEW_PER_SCAN => {
                    entered += 1;
                    let Some(c) = File::open(&path).ok().and_then(|f| cookie_of(&f).ok()) else {
                        continue;
                    };
                    self.cookies.insert(ino, c);
                    c
                }
                None => continue,
            };
            self.found.entry(cookie).or_insert(path);
        }
        // Namespaces gone: an inode may be reused by a new one, whose
        // cookie is then asked again.
        self.cookies.retain(|ino, _| seen.contains(ino));
    }

    /// The namespace at `path` if its cookie is `cookie`.
    fn check(&mut self, path: &str, cookie: u64) -> Option<File> {
        let f = File::open(path).ok()?;
        let ino = std::os::unix::fs::MetadataExt::ino(&f.metadata().ok()?);
        let c = match self.cookies.get(&ino) {
            Some(c) => *c,
            None => {
                let c = cookie_of(&f).ok()?;
                self.cookies.insert(ino, c);
                c
            }
        };
        (c == cookie).then_some(f)
    }
}

fn inode(path: &str) -> Option<u64> {
    std::fs::metadata(path)
        .ok()
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
}
