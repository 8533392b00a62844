//! Which network namespace an address of this host's routes leads into:
//! the check that ties a container's socket to the namespace the host
//! really sends that container's address to (README, "Containers").
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
struct Link {
    kind: Option<InfoKind>,
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

fn link(ifindex: u32) -> io::Result<Link> {
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

/// Whether this host routes `ip` into the namespace `ns`: its route leaves
/// by a veth whose other end is in `ns`, or by a bridge that has such a
/// veth as a port. A local address, a route out of a physical link, or a
/// bridge without a port into `ns` is not.
pub(super) fn routes_into(ip: IpAddr, ns: &File) -> io::Result<bool> {
    let route = rtnl::route_get(ip, None)?;
    let Some(oif) = route.oif.filter(|_| route.kind == RouteType::Unicast) else {
        return Ok(false);
    };
    // The links first: listing a veth gives its peer's namespace a number.
    let out = link(oif)?;
    let ports = match out.kind {
        Some(InfoKind::Veth) => vec![out],
        Some(InfoKind::Bridge) => links()?
            .into_iter()
            .filter(|l| l.controller == Some(oif) && l.kind == Some(InfoKind::Veth))
            .collect(),
        _ => return Ok(false),
    };
    let Some(id) = nsid_of(ns)? else {
        return Ok(false);
    };
    Ok(ports.iter().any(|l| l.peer_nsid == Some(id)))
}

/// The cookie (`SO_NETNS_COOKIE`, what `bpf_get_netns_cookie` gives the
/// recorder) of the namespace `ns`, asked from a thread that enters it.
pub(super) fn cookie_of(ns: &File) -> io::Result<u64> {
    std::thread::scope(|s| {
        s.spawn(|| {
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            let sock = std::net::UdpSocket::bind("127.0.0.1:0")
                .or_else(|_| std::net::UdpSocket::bind("[::1]:0"))?;
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
#[derive(Default)]
pub(super) struct NetnsFinder {
    cookies: HashMap<u64, u64>,
}

impl NetnsFinder {
    pub fn find(&mut self, cookie: u64, pid: u32) -> Option<File> {
        if pid != 0 {
            if let Some(f) = self.check(&format!("/proc/{pid}/ns/net"), cookie) {
                return Some(f);
            }
        }
        let entries = std::fs::read_dir("/proc").ok()?;
        let mut tried = std::collections::HashSet::new();
        for e in entries.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let path = format!("/proc/{}/ns/net", name.to_string_lossy());
            let Some(ino) = inode(&path) else {
                continue;
            };
            if !tried.insert(ino) || self.cookies.get(&ino).is_some_and(|c| *c != cookie) {
                continue;
            }
            if let Some(f) = self.check(&path, cookie) {
                return Some(f);
            }
        }
        // Not found: an inode of a namespace that is gone may have been
        // reused by a new one, whose cookie is then asked again next time.
        self.cookies.clear();
        None
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
