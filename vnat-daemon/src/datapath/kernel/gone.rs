//! The addresses this host has only on `lo` now (`vnat_common::MAP_GONE`):
//! an address vnat keeps there (for a moved connection's socket, or for a
//! mobile UDP connection's, `kept.rs`) after it left every other interface.
//!
//! Once the host has a route into its new network, a socket of that
//! address whose move has not been started yet (a mass move starts them in
//! shares, over seconds at 100,000), or whose hold ended before its move
//! did, would send there with the old address: its peer answers to the old
//! network, where the answer is lost, and the retransmissions of both ends
//! fill the new network and the hosts' CPUs for nothing. With the address
//! in the map, the tc egress program redirects such a packet to no device
//! instead, where it is lost; the socket sees a transmission that was
//! lost, as over a link that went dark, and its move's restart levers
//! resume it.
//!
//! An address that comes back to an interface (the host returns to the
//! network) leaves the map at the next check, so that new connections made
//! from it there are not discarded. Checked at every resync (each address
//! notification brings one), and as soon as a translation adds an address
//! to `lo` or removes the last one.
//!
//! The entries name no device ([`GONE_NO_DEVICE`]): the kernel drops a
//! packet redirected to no device after the program, and its socket sees
//! it sent all the same (tc's redirect verdict is a successful transmit).
//! They used to name `vnat-sink`, created for the first gone address: a
//! veth pair made on the way to a move's first message to the peer, 0.8 to
//! 1 ms of it (the sink stays for the UDP flows' last-resort route,
//! `kept.rs`, which needs a device).

use std::{
    collections::{BTreeSet, HashSet},
    net::IpAddr,
};

use vnat_common::{FlowKey, CFG_F_GONE, MAP_GONE};

use super::{map_err, net, object, KernelDatapath};
use crate::datapath::{DatapathError, Proto};

/// What a [`MAP_GONE`] entry redirects to: no device (interface indexes
/// start at 1).
const GONE_NO_DEVICE: u32 = 0;

/// The [`MAP_GONE`] key of `ip`.
fn gone_key(ip: IpAddr) -> FlowKey {
    let sa = std::net::SocketAddr::new(ip, 0);
    crate::datapath::flow_key(Proto::Tcp, sa, sa).gone_key()
}

/// Which of the addresses on `lo` are gone: those vnat put there (by
/// their tag, or by a translation's own record, `lo_ours`) that no other
/// interface has.
fn gone_of(
    lo: &[(IpAddr, bool)],
    lo_ours: &HashSet<IpAddr>,
    elsewhere: &[(IpAddr, u32)],
) -> BTreeSet<IpAddr> {
    lo.iter()
        .filter(|(a, tagged)| *tagged || lo_ours.contains(a))
        .filter(|(a, _)| !elsewhere.iter().any(|(b, _)| b == a))
        .map(|(a, _)| *a)
        .collect()
}

impl KernelDatapath {
    /// Bring [`MAP_GONE`] and the config's `CFG_F_GONE` in line with the
    /// interfaces (see the module's documentation).
    pub(super) fn sync_gone(&mut self) -> Result<(), DatapathError> {
        let wanted = gone_of(&net::lo_addrs()?, &self.lo_ours, &net::interface_addrs()?);
        let wanted_keys: BTreeSet<FlowKey> = wanted.iter().map(|a| gone_key(*a)).collect();
        let have: BTreeSet<FlowKey> = self
            .loaded
            .maps
            .gone
            .keys()
            .collect::<Result<_, _>>()
            .map_err(map_err(MAP_GONE))?;
        if wanted_keys == have && self.loaded.gone != have.is_empty() {
            return Ok(());
        }
        for k in &wanted_keys {
            self.loaded
                .maps
                .gone
                .insert(k, GONE_NO_DEVICE, 0)
                .map_err(map_err(MAP_GONE))?;
        }
        for k in have.difference(&wanted_keys) {
            match self.loaded.maps.gone.remove(k) {
                Ok(()) => {}
                Err(e) if super::is_not_found(&e) => {}
                Err(e) => return Err(map_err(MAP_GONE)(e)),
            }
        }
        let on = !wanted.is_empty();
        if on != self.loaded.gone {
            self.loaded.gone = on;
            if let Err(e) = object::set_config_flag(&mut self.loaded, CFG_F_GONE, on) {
                self.loaded.gone = !on;
                return Err(e);
            }
        }
        tracing::debug!(addresses = ?wanted, "addresses only on lo: untranslated packets from them are lost as sent");
        Ok(())
    }

    /// [`Self::sync_gone`] where a failure must not fail the caller: said,
    /// and tried again at the next resync.
    pub(super) fn sync_gone_or_warn(&mut self) {
        if let Err(e) = self.sync_gone() {
            tracing::warn!(error = %e, "cannot update which addresses this host has only on lo: packets from them may leave untranslated until the next resync");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn an_address_is_gone_when_vnat_keeps_it_on_lo_and_no_other_interface_has_it() {
        let lo = [
            (ip("198.18.1.2"), true),
            (ip("198.18.4.2"), true),
            (ip("10.9.9.9"), false),
            (ip("2001:db8::2"), false),
        ];
        let ours: HashSet<IpAddr> = [ip("2001:db8::2")].into_iter().collect();
        // 198.18.4.2 is back on an interface (the host returned to that
        // network, or `vnatctl migrate` moved a connection off a link that
        // is still up); 10.9.9.9 is someone else's.
        let elsewhere = [(ip("198.18.2.2"), 3), (ip("198.18.4.2"), 4)];
        let gone = gone_of(&lo, &ours, &elsewhere);
        assert_eq!(
            gone,
            [ip("198.18.1.2"), ip("2001:db8::2")].into_iter().collect()
        );
    }

    #[test]
    fn a_gone_key_names_only_the_address() {
        let k = gone_key(ip("198.18.1.2"));
        let sa = |s: &str| s.parse::<std::net::SocketAddr>().unwrap();
        let flow =
            crate::datapath::flow_key(Proto::Udp, sa("198.18.1.2:5000"), sa("198.18.3.2:53"));
        assert_eq!(flow.gone_key(), k);
        let other =
            crate::datapath::flow_key(Proto::Tcp, sa("198.18.1.3:5000"), sa("198.18.3.2:53"));
        assert_ne!(other.gone_key(), k);
        let v6 = gone_key(ip("2001:db8::2"));
        assert_ne!(v6, k);
        assert_eq!(v6.family, vnat_common::AF_INET6);
    }
}
