//! The clsact side of tc: what the kernel has on an interface's clsact
//! hooks, read and changed through rtnetlink ([`super::rtnl`]).
//!
//! Where the kernel has no TCX (before Linux 6.6) or `tc_attach = "clsact"`
//! says so, the translators are cls_bpf filters in direct-action mode on a
//! clsact qdisc. Such a filter is no BPF link: it cannot be pinned and it
//! outlives vnatd by itself, so the kernel is the record of what is
//! attached. A filter is vnat's when its program is one of vnat's tc
//! programs (`TCA_BPF_NAME`, the names in [`TC_PROGRAMS`]); vnat never
//! removes another one. vnat attaches at its own priority and handle
//! ([`PRIORITY`], [`HANDLE`]), ahead of filters added without a priority
//! (49152 and up), and its programs hand every packet they pass on to the
//! next filter (`TC_ACT_UNSPEC`), so another program on the same hook
//! (Cilium's, a firewall's) keeps working.
//!
//! A clsact qdisc that vnat added itself is marked by a pin
//! (`links/clsact<ifindex>`), and vnat deletes it when its own filters
//! leave and no other filter is on it; a qdisc someone else added stays.

use std::io;

use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP};
use netlink_packet_route::{
    link::LinkMessage,
    tc::{TcAttribute, TcFilterBpfOption, TcHandle, TcMessage, TcOption},
    RouteNetlinkMessage,
};
use vnat_common::{PROG_TC_EGRESS, PROG_TC_EGRESS_L3, PROG_TC_INGRESS, PROG_TC_INGRESS_L3};

use super::rtnl;

/// vnat's filter priority on both hooks. Lower runs first; filters added
/// without one get 49152 and below, so vnat's translation comes before
/// them (a firewall after it sees the packet as it is on the wire).
pub const PRIORITY: u16 = 0x2031;
/// vnat's filter handle ("vn").
pub const HANDLE: u32 = 0x766e;

/// The names of vnat's tc programs: a filter running one of them is
/// vnat's.
pub const TC_PROGRAMS: [&str; 4] = [
    PROG_TC_INGRESS,
    PROG_TC_EGRESS,
    PROG_TC_INGRESS_L3,
    PROG_TC_EGRESS_L3,
];

/// One filter on a clsact hook.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Filter {
    pub priority: u16,
    pub handle: u32,
    /// The BPF program's name for a cls_bpf filter (`TCA_BPF_NAME`).
    pub program: Option<String>,
}

impl Filter {
    /// Whether this filter runs one of vnat's programs.
    pub fn is_vnats(&self) -> bool {
        self.program
            .as_deref()
            .is_some_and(|p| TC_PROGRAMS.contains(&p))
    }
}

fn hook(egress: bool) -> TcHandle {
    TcHandle {
        major: 0xffff,
        minor: if egress {
            TcHandle::MIN_EGRESS
        } else {
            TcHandle::MIN_INGRESS
        },
    }
}

fn tc_message(ifindex: u32) -> TcMessage {
    let mut m = TcMessage::default();
    m.header.index = ifindex as i32;
    m
}

/// The filters on one hook of `ifindex` (none when it has no clsact).
pub fn filters(ifindex: u32, egress: bool) -> io::Result<Vec<Filter>> {
    let mut m = tc_message(ifindex);
    m.header.parent = hook(egress);
    let answer = match rtnl::call(RouteNetlinkMessage::GetTrafficFilter(m), NLM_F_DUMP) {
        Ok(a) => a,
        // No clsact (or no such interface): nothing is attached there.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::ENOENT | libc::ENODEV)
            ) =>
        {
            return Ok(Vec::new())
        }
        Err(e) => return Err(e),
    };
    Ok(answer
        .into_iter()
        .filter_map(|msg| match msg {
            RouteNetlinkMessage::NewTrafficFilter(f) => Some(f),
            _ => None,
        })
        // A chain's head message has handle 0 and no options: not a filter.
        .filter(|f| u32::from(f.header.handle) != 0)
        .map(|f| Filter {
            // tcm_info holds the priority in its upper 16 bits and the
            // protocol in the lower.
            priority: (f.header.info >> 16) as u16,
            handle: u32::from(f.header.handle),
            program: f.attributes.iter().find_map(|a| match a {
                TcAttribute::Options(opts) => opts.iter().find_map(|o| match o {
                    TcOption::Bpf(TcFilterBpfOption::ProgName(n)) => Some(n.clone()),
                    _ => None,
                }),
                _ => None,
            }),
        })
        .collect())
}

/// Delete one filter (by priority and handle) from a hook.
pub fn del_filter(ifindex: u32, egress: bool, f: &Filter) -> io::Result<()> {
    let mut m = tc_message(ifindex);
    m.header.parent = hook(egress);
    m.header.handle = TcHandle::from(f.handle);
    // tcm_info: priority in the upper half, protocol (ETH_P_ALL, which
    // aya attaches with, big-endian) in the lower.
    m.header.info = (u32::from(f.priority) << 16) | u32::from(0x0003u16.to_be());
    rtnl::call(RouteNetlinkMessage::DelTrafficFilter(m), NLM_F_ACK).map(|_| ())
}

/// Remove vnat's filters from both hooks of `ifindex`; another's stay.
/// Returns whether any filter (another's) is left on either hook.
pub fn remove_ours(ifindex: u32) -> io::Result<bool> {
    let mut others = false;
    for egress in [false, true] {
        for f in filters(ifindex, egress)? {
            if f.is_vnats() {
                match del_filter(ifindex, egress, &f) {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(e) => return Err(e),
                }
            } else {
                others = true;
            }
        }
    }
    Ok(others)
}

/// Delete the clsact qdisc of `ifindex` (with whatever is on it: callers
/// check first that nothing is).
pub fn del_qdisc(ifindex: u32) -> io::Result<()> {
    let mut m = tc_message(ifindex);
    m.header.parent = TcHandle::CLSACT;
    m.header.handle = TcHandle {
        major: 0xffff,
        minor: 0,
    };
    m.attributes.push(TcAttribute::Kind("clsact".into()));
    match rtnl::call(RouteNetlinkMessage::DelQueueDiscipline(m), NLM_F_ACK) {
        Ok(_) => Ok(()),
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENOENT | libc::EINVAL | libc::ENODEV)
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// The indexes of this namespace's interfaces.
pub fn interfaces() -> io::Result<Vec<u32>> {
    Ok(rtnl::call(
        RouteNetlinkMessage::GetLink(LinkMessage::default()),
        NLM_F_DUMP,
    )?
    .into_iter()
    .filter_map(|m| match m {
        RouteNetlinkMessage::NewLink(l) => Some(l.header.index),
        _ => None,
    })
    .collect())
}

/// The interfaces with one of vnat's filters on a clsact hook.
pub fn attached() -> io::Result<Vec<u32>> {
    let mut out = Vec::new();
    for ifindex in interfaces()? {
        let ours = [false, true].iter().any(|&egress| {
            filters(ifindex, egress).is_ok_and(|fs| fs.iter().any(Filter::is_vnats))
        });
        if ours {
            out.push(ifindex);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_vnats_programs_make_a_filter_vnats() {
        let f = |p: Option<&str>| Filter {
            priority: PRIORITY,
            handle: HANDLE,
            program: p.map(str::to_string),
        };
        assert!(f(Some(PROG_TC_INGRESS)).is_vnats());
        assert!(f(Some(PROG_TC_EGRESS_L3)).is_vnats());
        // Same priority and handle, someone else's program: not ours.
        assert!(!f(Some("cil_from_netdev")).is_vnats());
        assert!(!f(None).is_vnats());
    }
}
