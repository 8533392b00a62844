//! Links, addresses and routes of a [`Netns`], through the rtnetlink
//! socket it keeps (see `rtnl`): what `ip link`, `ip addr` and `ip route`
//! did for the harness, typed, and with the kernel's refusal as the panic
//! message.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::AsRawFd,
    sync::PoisonError,
};

use netlink_packet_route::route::RouteProtocol;

use super::{
    rtnl::{Address, Link, NewRoute, Route, Rtnl, RtnlError, Rule},
    Netns,
};

impl Netns {
    pub fn link_up(&self, dev: &str) {
        let index = self.index(dev);
        self.rtnl(&format!("setting {dev} up"), |r| r.set_up(index, true));
    }

    pub fn link_down(&self, dev: &str) {
        let index = self.index(dev);
        self.rtnl(&format!("setting {dev} down"), |r| r.set_up(index, false));
    }

    /// Deletes `dev` (a veth: both ends).
    pub fn link_del(&self, dev: &str) {
        let index = self.index(dev);
        self.rtnl(&format!("deleting {dev}"), |r| r.del_link(index));
    }

    /// Moves `dev` into `to` (where it is down, without addresses).
    pub fn link_set_netns(&self, dev: &str, to: &Netns) {
        let index = self.index(dev);
        let what = format!("moving {dev} to netns {}", to.name);
        self.rtnl(&what, |r| r.set_netns(index, to.fd.as_raw_fd()));
    }

    /// `dev` as the kernel reports it, or None if there is no such link.
    pub fn link(&self, dev: &str) -> Option<Link> {
        self.rtnl(&format!("looking up {dev}"), |r| r.link(dev))
    }

    /// Adds `addr/prefix` to `dev`; IPv6 addresses skip duplicate address
    /// detection (`nodad`), so they are usable at once.
    pub fn add_addr(&self, dev: &str, addr: IpAddr, prefix: u8) {
        let index = self.index(dev);
        let what = format!("adding {addr}/{prefix} to {dev}");
        self.rtnl(&what, |r| r.add_address(index, addr, prefix));
    }

    pub fn del_addr(&self, dev: &str, addr: IpAddr, prefix: u8) {
        let index = self.index(dev);
        let what = format!("removing {addr}/{prefix} from {dev}");
        self.rtnl(&what, |r| r.del_address(index, addr, prefix));
    }

    /// The addresses on `dev`, both families.
    pub fn addresses(&self, dev: &str) -> Vec<Address> {
        let index = self.index(dev);
        self.rtnl(&format!("listing the addresses of {dev}"), |r| {
            r.addresses(index)
        })
    }

    /// `ip route replace DEST via VIA dev DEV`: DEST is `default`, a CIDR
    /// or an address (a host route) of `via`'s family.
    pub fn route_via(&self, dest: &str, via: IpAddr, dev: &str) {
        self.new_route(dest, via, dev, RouteProtocol::Boot, true);
    }

    /// `ip route replace default via VIA dev DEV`.
    pub fn default_route(&self, via: IpAddr, dev: &str) {
        self.route_via("default", via, dev);
    }

    /// `ip route add default via VIA dev DEV metric METRIC`: one more
    /// default route, as a network manager adds one per link (the lowest
    /// metric is used; the others are there for traffic bound to a link).
    pub fn add_default_route_metric(&self, via: IpAddr, dev: &str, metric: u32) {
        self.new_route_metric(
            "default",
            via,
            dev,
            RouteProtocol::Boot,
            false,
            Some(metric),
        );
    }

    /// `ip route add DEST via VIA dev DEV proto PROTOCOL`: fails (panics)
    /// if the main table has a route to DEST already.
    pub fn add_route(&self, dest: &str, via: IpAddr, dev: &str, protocol: RouteProtocol) {
        self.new_route(dest, via, dev, protocol, false);
    }

    /// Every policy rule of both families.
    pub fn rules(&self) -> Vec<Rule> {
        self.rtnl("listing rules", Rtnl::rules)
    }

    /// Every route of both families, in every table (filter on
    /// [`Route::in_main_table`] for what `ip route show` lists).
    pub fn routes(&self) -> Vec<Route> {
        self.rtnl("listing routes", Rtnl::routes)
    }

    fn new_route(
        &self,
        dest: &str,
        via: IpAddr,
        dev: &str,
        protocol: RouteProtocol,
        replace: bool,
    ) {
        self.new_route_metric(dest, via, dev, protocol, replace, None);
    }

    fn new_route_metric(
        &self,
        dest: &str,
        via: IpAddr,
        dev: &str,
        protocol: RouteProtocol,
        replace: bool,
        metric: Option<u32>,
    ) {
        let (dst, prefix) = parse_dest(dest, via);
        let route = NewRoute {
            dst,
            prefix,
            gateway: via,
            oif: self.index(dev),
            protocol,
            metric,
        };
        let what = format!("route {dest} via {via} dev {dev} metric {metric:?}");
        self.rtnl(&what, |r| r.add_route(&route, replace));
    }

    /// The index of `dev` in this namespace.
    fn index(&self, dev: &str) -> u32 {
        self.rtnl(&format!("looking up {dev}"), |r| r.index(dev))
    }

    /// Runs `f` with this namespace's netlink socket; panics naming `what`
    /// and the kernel's answer if it fails.
    fn rtnl<T>(&self, what: &str, f: impl FnOnce(&mut Rtnl) -> Result<T, RtnlError>) -> T {
        let result = f(&mut self.rtnl.lock().unwrap_or_else(PoisonError::into_inner));
        result.unwrap_or_else(|e| panic!("in netns {}: {what}: {e}", self.name))
    }
}

/// Creates a veth pair with one end, `a_if`, in `a` and the other, `b_if`,
/// in `b`, both up: one RTM_NEWLINK that creates the ends directly in their
/// namespaces (IFLA_NET_NS_FD on the link and on the peer), so the names
/// only need to be unique there (and at most 15 bytes).
pub fn veth(a: &Netns, a_if: &str, b: &Netns, b_if: &str) {
    assert!(
        a_if.len() <= 15 && b_if.len() <= 15,
        "interface names are at most 15 bytes: {a_if}, {b_if}"
    );
    let what = format!("creating veth {a_if} - {b_if} (peer in netns {})", b.name);
    a.rtnl(&what, |r| {
        r.add_veth((a_if, a.fd.as_raw_fd()), (b_if, b.fd.as_raw_fd()))
    });
    a.link_up(a_if);
    b.link_up(b_if);
}

/// `default` or `ADDR[/PREFIX]` (no prefix: a host route), of `via`'s
/// family, as `ip route` takes a destination.
fn parse_dest(dest: &str, via: IpAddr) -> (IpAddr, u8) {
    let parsed = if dest == "default" {
        let any: IpAddr = match via {
            IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
            IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
        };
        Some((any, 0))
    } else {
        let (addr, prefix) = dest
            .split_once('/')
            .map_or((dest, None), |(a, p)| (a, Some(p)));
        addr.parse::<IpAddr>().ok().and_then(|a| {
            let max = if a.is_ipv4() { 32 } else { 128 };
            let prefix = prefix.map_or(Some(max), |p| p.parse().ok().filter(|p| *p <= max))?;
            Some((a, prefix))
        })
    };
    match parsed {
        Some((dst, prefix)) if dst.is_ipv4() == via.is_ipv4() => (dst, prefix),
        _ => panic!("route destination {dest}: not `default` or ADDR[/PREFIX] of {via}'s family"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn destinations_are_read_as_ip_route_reads_them() {
        let (v4, v6) = (ip("198.18.1.1"), ip("fd00:5e:1::1"));
        assert_eq!(parse_dest("default", v4), (ip("0.0.0.0"), 0));
        assert_eq!(parse_dest("default", v6), (ip("::"), 0));
        assert_eq!(parse_dest("198.18.3.0/24", v4), (ip("198.18.3.0"), 24));
        assert_eq!(parse_dest("198.18.3.2", v4), (ip("198.18.3.2"), 32));
        assert_eq!(parse_dest("fd00:5e:3::2", v6), (ip("fd00:5e:3::2"), 128));
        for (dest, via) in [("198.18.3.0/33", v4), ("fd00::/64", v4), ("eth0", v6)] {
            let parsed = std::panic::catch_unwind(|| parse_dest(dest, via));
            assert!(parsed.is_err(), "{dest} via {via} was taken");
        }
    }
}
