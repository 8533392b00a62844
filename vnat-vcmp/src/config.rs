//! Tunables of the protocol core, with their defaults.

use std::net::SocketAddr;
use std::time::Duration;

use super::location::StoreLimits;

/// Default VCMP port (the paper's).
pub const DEFAULT_PORT: u16 = 2031;

/// Tunables of the protocol core. Defaults are in [`Config::default`].
#[derive(Clone, Debug)]
pub struct Config {
    /// UDP port every vnatd listens on (default 2031).
    pub port: u16,
    /// Path MTU used to size batched datagrams (default 1500).
    pub mtu: usize,
    /// Location servers asked in step P(3)/S(3), in order.
    pub location_servers: Vec<SocketAddr>,
    /// Also store our new location at the location servers and look the
    /// peer up there from the first step of the chain, not only at
    /// P(3)/S(3) after the other steps' retries (default true; see
    /// `migrate::Early`). Costs one STORE and one LOOKUP per server for
    /// every batch of moved connections, even when the peer stayed put.
    pub ask_location_servers_at_once: bool,
    /// Also keep and look up locations in a store outside VCMP that the
    /// daemon reaches (etcd; `vcmp::extstore`), after the location servers
    /// and early like them (default false).
    pub external_store: bool,
    /// First retransmission timeout (default 200 ms); doubled per retry.
    pub initial_rto: Duration,
    /// Largest retransmission timeout (default 3 s).
    pub max_rto: Duration,
    /// Transmissions of a request before its step counts as failed (8).
    pub max_tries: u32,
    /// How long a host that stored its location waits for the peer before
    /// running the chain again (default 30 s, paper 3.3.2.1 P(1)).
    pub park_timeout: Duration,
    /// Rounds of the chain before the migration is aborted (default 3).
    pub max_rounds: u32,
    /// Claim roles with SUSP_PRIMARY at suspend (default true).
    pub negotiate_roles: bool,
    /// Run the suspend-time Diffie-Hellman (default true).
    pub suspend_dh: bool,
    /// How often a host behind a NAT probes each peer it holds mobile
    /// connections with, so the NAT keeps the mapping that lets the peer
    /// reach it (default 25 s, below the 30 s some NATs keep an idle UDP
    /// mapping; zero: never). See `vcmp::probe`.
    pub keepalive_interval: Duration,
    pub max_connections: usize,
    pub max_connections_per_peer: usize,
    /// Handshakes held at once (default 256). From half of it, a
    /// PAIR_INIT gets a cookie to echo instead of any state or DH.
    pub max_pending_pairings: usize,
    /// Diffie-Hellman computations per second for PAIR_INITs without a
    /// valid cookie from one source (an IPv4 address or an IPv6 /64), and
    /// their burst (defaults 2 and 5); beyond, the source gets a cookie.
    pub pair_dh_per_sec: u32,
    pub pair_dh_burst: u32,
    /// A pairing that failed (no answer, table full) is tried again after
    /// this, doubled per failure up to `pair_retry_max` (defaults 5 s and
    /// 5 min), while connections with that host still wait for it.
    pub pair_retry_initial: Duration,
    pub pair_retry_max: Duration,
    /// New pairings this host starts per second, and their burst (defaults
    /// 20 and 64); beyond, they wait (never refused): a host is never a
    /// reflector of PAIR_INITs, whatever set of peers it is shown.
    pub pair_starts_per_sec: u32,
    pub pair_starts_burst: u32,
    pub max_queued_datagrams: usize,
    pub max_events: usize,
    pub store: StoreLimits,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            port: DEFAULT_PORT,
            mtu: 1500,
            location_servers: Vec::new(),
            ask_location_servers_at_once: true,
            external_store: false,
            initial_rto: Duration::from_millis(200),
            max_rto: Duration::from_secs(3),
            max_tries: 8,
            park_timeout: Duration::from_secs(30),
            max_rounds: 3,
            negotiate_roles: true,
            suspend_dh: true,
            keepalive_interval: Duration::from_secs(25),
            max_connections: 1 << 20,
            max_connections_per_peer: 1 << 17,
            max_pending_pairings: 256,
            pair_dh_per_sec: 2,
            pair_dh_burst: 5,
            pair_retry_initial: Duration::from_secs(5),
            pair_retry_max: Duration::from_secs(300),
            pair_starts_per_sec: 20,
            pair_starts_burst: 64,
            max_queued_datagrams: 16_384,
            max_events: 1 << 20,
            store: StoreLimits::default(),
        }
    }
}
