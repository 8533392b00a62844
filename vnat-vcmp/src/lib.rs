//! VCMP protocol core (sans-IO), issue 3; paper section 3.3, DESIGN.md section 4.
//!
//! Nothing here touches a socket, a clock, a BPF map or tokio: time
//! ([`Timestamp`]) and randomness (`RngCore + CryptoRng`) are inputs;
//! datagrams to send, timers and datapath events are outputs.
//!
//! The driver's loop, in short:
//!
//! ```text
//! let mut ep = Endpoint::new(Config::default(), HostIdentity::from_bytes(saved_key));
//! ep.connection_added(now, &mut OsRng, flow, local_phys, remote_phys)?;  // sock_ops saw it
//! ep.suspend(now, &mut OsRng, &flows)?;                  // optional, before a planned move
//! ep.resume(now, &mut OsRng, &[(flow, new_local_phys)])?; // after the move
//! ep.handle_datagram(now, &mut OsRng, from, &bytes);     // every datagram on port 2031
//! ep.handle_timeout(now, &mut OsRng);                    // when poll_timeout() is reached
//! while let Some(t) = ep.poll_transmit(now) { socket.send_to(&t.payload, t.dst) }
//! while let Some(e) = ep.poll_event() { /* Event::SetRemote => datapath, ... */ }
//! ```
//!
//! Modules: [`wire`] (codec), [`crypto`] (identities, pairing schedule,
//! HKDF/HMAC), [`replay`], [`roles`], [`location`] (chain and store),
//! [`endpoint`] (state and API), `recv` / `migrate` / `pairing` (the
//! endpoint's receive path, migration and pairing logic), [`tx`] (batching
//! and anti-amplification), [`export`], [`stats`].

mod bind;
pub mod binding;
mod budget;
mod claim;
pub mod config;
mod cookie;
pub mod crypto;
mod ctx;
pub mod endpoint;
pub mod event;
pub mod export;
pub mod extstore;
mod family;
pub mod flow;
pub mod help;
pub mod location;
mod migrate;
mod pairing;
mod probe;
mod proof;
mod recv;
mod remap;
pub mod replay;
pub mod roles;
pub mod room;
pub mod stats;
mod strangers;
mod suspend;
mod switched;
mod timers;
mod trust;
pub mod tx;
mod update;
mod validation;
pub mod wire;

use std::time::Duration;

/// A point in time: nanoseconds of CLOCK_BOOTTIME (suspend-aware, so a laptop
/// that slept does not confuse the retransmission and expiry timers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub u64);

impl Timestamp {
    pub fn from_nanos(n: u64) -> Timestamp {
        Timestamp(n)
    }
    pub fn as_nanos(self) -> u64 {
        self.0
    }
    /// `self + d`, saturating.
    pub fn plus(self, d: Duration) -> Timestamp {
        Timestamp(
            self.0
                .saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        )
    }
    /// Time elapsed since `earlier` (zero if `earlier` is later).
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

pub use binding::Binding;
pub use endpoint::{
    AbortReason, Config, ConnectionView, Endpoint, EndpointError, Event, DEFAULT_PORT,
};
pub use family::Placement;
pub use tx::Transmit;

#[cfg(test)]
mod adversary_tests;
#[cfg(any(test, feature = "sim"))]
pub mod sim;
#[cfg(test)]
mod sim_early_switch_tests;
#[cfg(test)]
mod sim_extstore_tests;
#[cfg(test)]
mod sim_family_tests;
#[cfg(test)]
mod sim_keyx_tests;
#[cfg(test)]
mod sim_location_tests;
#[cfg(test)]
mod sim_nat_tests;
#[cfg(test)]
mod sim_pairing_tests;
#[cfg(test)]
mod sim_remap_tests;
#[cfg(test)]
mod sim_stranger_tests;
#[cfg(test)]
mod sim_suspend_tests;
#[cfg(test)]
mod sim_tests;
#[cfg(test)]
mod sim_trust_tests;
#[cfg(test)]
mod sim_udp_bind_tests;
