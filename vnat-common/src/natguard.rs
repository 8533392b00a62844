//! The NAT guard: a standing watch, on the host whose peer sits behind a
//! NAT, for that NAT re-mapping a connection that did not move (a home
//! router that reboots, a carrier-grade NAT that re-maps an idle flow;
//! issue 32, item 2).
//!
//! After a re-map the peer's packets arrive from the NAT's address and a
//! port nobody has seen. Our kernel would answer such a TCP segment with a
//! reset (it has no socket for that 4-tuple), and give such a UDP datagram
//! to the application as a new peer's. So, for each (NAT address, our
//! address and port) where a connection with a peer behind that NAT lives,
//! vnatd keeps one entry here, and the tc ingress program, for a packet
//! from that address to that port that no translation, rebind or record
//! owns:
//!
//! * TCP: drops a segment that opens nothing (not a SYN, not a reset) and
//!   for which the kernel has no socket but a listener (it would reset it);
//!   what the kernel has a socket for (a connection being accepted, or one
//!   of another host behind the same NAT) goes on;
//! * UDP: holds (drops) the datagrams of an unknown source port for at
//!   most [`GUARD_UDP_HOLD_NS`] from the first; then that port is let
//!   through (a new flow of another host behind the NAT, which the
//!   recorders then record), so a stranger's flow waits that long at most.
//!   One port is held at a time; other unknown ports are held too within
//!   the hold's first [`GUARD_UDP_ALL_NS`] (a NAT that forgets its
//!   mappings re-maps every flow at once, and two datagrams of one flow
//!   racing through its conntrack can each get a mapping: the flow goes on
//!   from either), and go on after that;
//! * an ICMP "port unreachable" from the NAT's address about a UDP
//!   datagram we sent to it is dropped: the NAT's own answer to a mapping
//!   it forgot, which would end a connected socket (ECONNREFUSED) before
//!   the peer's BIND rebinds the flow. An error from another host (a
//!   router on the path) or of another kind goes on.
//!
//! And while a TCP guard is suspicious (it dropped a segment within the
//! last [`GUARD_TCP_SUSPECT_NS`], or a rebind waits at its key), a reset
//! without ACK from the NAT's address to a recorded connection there is
//! dropped too: the NAT itself answers our socket's segments to the
//! mapping it forgot with one (a Linux router does: `tcp_v4_send_reset`),
//! and that would kill the connection the peer is about to rebind. Such a
//! reset may come first (our segment reached the NAT before the peer's
//! re-mapped one reached us): one while the guard is not suspicious makes
//! it so (and vnatd asks the peer); the next one after that window goes
//! on, so a peer whose socket is really gone resets the connection a few
//! seconds late. A peer's own abort carries an ACK, and goes on.
//!
//! Each drop counts in `drops`; vnatd watches that count and asks the
//! connections' peers for BINDs, as after a move behind a new NAT: only an
//! authenticated BIND teaches a port (DESIGN.md, "Learning a NAT's new
//! mapping"), never a packet the guard saw.

/// vnatd's guards ([`crate::RebindKey`] with `slot` 0 to [`GuardValue`]).
pub const MAP_GUARD: &str = "VNAT_GUARD";
pub const GUARD_MAX_ENTRIES: u32 = 4096;
/// How long a UDP guard holds the datagrams of one unknown source port,
/// from the first (boot-time nanoseconds): long enough for vnatd to notice
/// (it looks every 250 ms) and start its peer's rebind, which then holds
/// them itself until the BIND.
pub const GUARD_UDP_HOLD_NS: u64 = 3_000_000_000;
/// How long after a UDP hold began other unknown ports are held too: four
/// of vnatd's 250 ms looks at the guard, which then starts the peer's
/// rebind (that holds every unrecorded datagram to the port until the
/// BIND).
pub const GUARD_UDP_ALL_NS: u64 = 1_000_000_000;
/// How long after its last drop a TCP guard drops resets without ACK from
/// the NAT to recorded connections (boot-time nanoseconds).
pub const GUARD_TCP_SUSPECT_NS: u64 = 5_000_000_000;

/// Value of [`MAP_GUARD`], written as zeros by vnatd and kept by the tc
/// program.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GuardValue {
    /// Packets dropped (wraps; vnatd compares with what it saw last).
    pub drops: u32,
    /// UDP: the unknown source port being held, and since when. TCP: 1
    /// if the suspicion was started by a reset.
    pub held_port_be: u16,
    /// UDP: the last port let through after its hold.
    pub released_port_be: u16,
    /// UDP: when the held port's hold began; TCP: the last drop.
    pub since_ns: u64,
}
const _: () = assert!(core::mem::size_of::<GuardValue>() == 16);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: repr(C), integers only, no padding (the size assert above
    // catches any the compiler adds): every bit pattern is a valid value.
    unsafe impl aya::Pod for super::GuardValue {}
}
