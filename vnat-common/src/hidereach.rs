//! Hide location, where a hiding application's connect() or sendmsg() to a
//! moved peer's old address goes: only to the endpoints (address and port)
//! the peer really held there, never to the whole address. Another host
//! may answer at that address (it passed on by DHCP, or it is a NAT's or a
//! CGNAT's that other hosts share, which a peer can even name as its own);
//! what the peer held there is only what this host saw it use.
//!
//! Two maps, of the same key and value:
//! - [`MAP_HIDE_REACH`], which vnatd writes: the remote virtual endpoint of
//!   each of a moved peer's connections, to its physical endpoint now.
//! - [`MAP_HIDE_SEEN`], which the getpeername and recvmsg programs write:
//!   an endpoint they showed a hiding application in place of the one the
//!   packets came from (a moved peer's new socket), to that one, so that
//!   the answer goes back where the packets came from.

/// vnatd's endpoints to reach ([`HideReachKey`] to [`HideReachValue`]).
pub const MAP_HIDE_REACH: &str = "VNAT_HIDE_REACH";
pub const HIDE_REACH_MAX_ENTRIES: u32 = 65_536;
/// The endpoints shown (an LRU map: the oldest go first).
pub const MAP_HIDE_SEEN: &str = "VNAT_HIDE_SEEN";
pub const HIDE_SEEN_MAX_ENTRIES: u32 = 16_384;

/// An endpoint a hiding application names (an IPv4 address in word 0,
/// also when a dual-stack socket shows it mapped).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HideReachKey {
    pub addr_be: [u32; 4],
    pub port_be: u16,
    /// [`crate::AF_INET`] or [`crate::AF_INET6`].
    pub family: u8,
    /// [`crate::PROTO_TCP`] or [`crate::PROTO_UDP`].
    pub proto: u8,
}
const _: () = assert!(core::mem::size_of::<HideReachKey>() == 20);

/// Where it goes instead (same family).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HideReachValue {
    pub addr_be: [u32; 4],
    pub port_be: u16,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<HideReachValue>() == 20);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), integers and arrays of integers only, every padding
    // byte a field (the size asserts above catch any the compiler adds):
    // every bit pattern is a valid value and no byte is uninitialized.
    unsafe impl aya::Pod for super::HideReachKey {}
    unsafe impl aya::Pod for super::HideReachValue {}
}
