//! The kernel ABI of vnat.
//!
//! Every type here is stored in a BPF map and read by both the eBPF programs
//! (`vnat-ebpf`) and userspace (`vnat-daemon`). The rules (see STYLE.md):
//! `#[repr(C)]`, explicit padding, no `bool`/enum/`Option` fields, a
//! compile-time size check beside each type, and byte order in the field name.
//! Changing any of these is an ABI break for pinned maps: bump [`ABI_VERSION`].
#![no_std]

mod hidereach;
mod natguard;
mod owners;
mod peek;
mod stats;
pub use hidereach::*;
pub use natguard::*;
pub use owners::*;
pub use peek::*;
pub use stats::*;

/// Bumped whenever a map layout below changes; pinned maps from an older ABI
/// are refused (and must be removed) rather than misread.
pub const ABI_VERSION: u32 = 13;

pub const AF_INET: u8 = 2;
pub const AF_INET6: u8 = 10;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;

/// Map names. They are also the file names of the pins under the bpffs dir.
pub const MAP_CONNS: &str = "VNAT_CONNS";
pub const MAP_EGRESS_NAT: &str = "VNAT_EGRESS_NAT";
pub const MAP_INGRESS_NAT: &str = "VNAT_INGRESS_NAT";
pub const MAP_STATS: &str = "VNAT_STATS";
pub const MAP_CONFIG: &str = "VNAT_CONFIG";
/// TCP connections of enabled cgroups' sockets in other network namespaces
/// (containers behind this host), keyed by [`GuestKey`].
pub const MAP_GUESTS: &str = "VNAT_GUESTS";

/// Program names (the function names in `vnat-ebpf`).
pub const PROG_SOCKOPS: &str = "vnat_sockops";
pub const PROG_UDP_CONNECT4: &str = "vnat_udp_connect4";
pub const PROG_UDP_CONNECT6: &str = "vnat_udp_connect6";
pub const PROG_UDP_SENDMSG4: &str = "vnat_udp_sendmsg4";
pub const PROG_UDP_SENDMSG6: &str = "vnat_udp_sendmsg6";
pub const PROG_UDP_RECVMSG4: &str = "vnat_udp_recvmsg4";
pub const PROG_UDP_RECVMSG6: &str = "vnat_udp_recvmsg6";
pub const PROG_UDP_RELEASE: &str = "vnat_udp_release";
/// Hide location (`vnatctl enable --hide-location`): the addresses
/// getpeername() and accept(), getsockname() and bind() see.
pub const PROG_HIDE_GETPEERNAME4: &str = "vnat_hide_getpeername4";
pub const PROG_HIDE_GETPEERNAME6: &str = "vnat_hide_getpeername6";
pub const PROG_HIDE_GETSOCKNAME4: &str = "vnat_hide_getsockname4";
pub const PROG_HIDE_GETSOCKNAME6: &str = "vnat_hide_getsockname6";
pub const PROG_HIDE_BIND4: &str = "vnat_hide_bind4";
pub const PROG_HIDE_BIND6: &str = "vnat_hide_bind6";
pub const PROG_TC_EGRESS: &str = "vnat_tc_egress";
pub const PROG_TC_INGRESS: &str = "vnat_tc_ingress";
/// The tc translators of an interface without a link-layer header (tun,
/// wireguard).
pub const PROG_TC_EGRESS_L3: &str = "vnat_tc_egress_l3";
pub const PROG_TC_INGRESS_L3: &str = "vnat_tc_ingress_l3";

/// Capacity of the connection map. Entries are allocated on demand
/// (BPF_F_NO_PREALLOC), so an idle host pays almost nothing for it.
pub const CONNS_MAX_ENTRIES: u32 = 262_144;
/// The share of [`CONNS_MAX_ENTRIES`] UDP records may take, so that
/// datagrams from spoofed sources to a UDP server can never leave TCP
/// connections unrecorded. Counted in [`MAP_UDP_COUNT`].
pub const UDP_MAX_RECORDS: u64 = 65_536;
/// Most UDP flows recorded for one socket (a server's unconnected socket
/// sees one per source); further sources are not recorded.
pub const UDP_PER_SOCKET_MAX: u32 = 4_096;
/// One slot: how many UDP records [`MAP_CONNS`] holds (the eBPF programs
/// add and remove as they record and release; vnatd recounts it at every
/// housekeeping pass).
pub const MAP_UDP_COUNT: &str = "VNAT_UDP_COUNT";
/// UDP records per socket cookie (for [`UDP_PER_SOCKET_MAX`]).
pub const MAP_UDP_PER_SOCK: &str = "VNAT_UDP_PER_SOCK";
/// A UDP record of a source the socket has only received from (never
/// answered), idle for this long, is dropped by vnatd's housekeeping
/// (unless the flow is translated): a spoofed source leaves no trace.
pub const UDP_IDLE_NS: u64 = 180_000_000_000;

/// Capacity of [`MAP_GUESTS`] (allocated on demand, like the others).
pub const GUESTS_MAX_ENTRIES: u32 = 65_536;

/// Capacity of each NAT map (one entry per translated flow and direction).
pub const NAT_MAX_ENTRIES: u32 = 131_072;

/// One transport flow as it appears in a packet: `src` is the sender.
///
/// In [`MAP_CONNS`] the key is written from the local host's point of view,
/// i.e. as an outgoing packet would carry it (`src` = local, `dst` = remote),
/// using the *virtual* endpoints. In the NAT maps the key is the tuple of the
/// packet before rewriting.
///
/// IPv4 addresses live in word 0 and words 1..4 are zero. All address words
/// and ports are in network byte order, exactly as they are in the packet.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FlowKey {
    pub src_addr_be: [u32; 4],
    pub dst_addr_be: [u32; 4],
    pub src_port_be: u16,
    pub dst_port_be: u16,
    /// [`AF_INET`] or [`AF_INET6`].
    pub family: u8,
    /// [`PROTO_TCP`] or [`PROTO_UDP`].
    pub proto: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<FlowKey>() == 40);

impl FlowKey {
    /// The same flow seen from the other side (or the other direction).
    pub const fn reversed(&self) -> FlowKey {
        FlowKey {
            src_addr_be: self.dst_addr_be,
            dst_addr_be: self.src_addr_be,
            src_port_be: self.dst_port_be,
            dst_port_be: self.src_port_be,
            family: self.family,
            proto: self.proto,
            _pad: [0; 2],
        }
    }

    /// The [`MAP_GONE`] key of this flow's source address.
    pub const fn gone_key(&self) -> FlowKey {
        FlowKey {
            src_addr_be: self.src_addr_be,
            dst_addr_be: [0; 4],
            src_port_be: 0,
            dst_port_be: 0,
            family: self.family,
            proto: 0,
            _pad: [0; 2],
        }
    }
}

/// Key of [`MAP_GUESTS`]: a connection of a socket in another network
/// namespace, as that socket sees it (`flow.src` = its own private end).
/// The namespace keeps two containers with the same private address apart.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GuestKey {
    /// `bpf_get_netns_cookie` of the socket's namespace.
    pub netns_cookie: u64,
    pub flow: FlowKey,
}
const _: () = assert!(core::mem::size_of::<GuestKey>() == 48);

/// Word 2 of an IPv4-mapped IPv6 address (`::ffff:a.b.c.d`, RFC 4291
/// section 2.5.5.2) as it sits in memory: bytes `00 00 ff ff`.
pub const V4_MAPPED_WORD2_BE: u32 = 0x0000_ffffu32.to_be();

/// The IPv4 address (network order) inside an IPv4-mapped IPv6 address, or
/// `None` if `addr_be` is not one.
///
/// An AF_INET6 socket that carries IPv4 (a dual-stack `[::]` listener, a
/// client connected to `::ffff:a.b.c.d`) shows its addresses this way, while
/// its packets on the wire, the peer's socket and vnat's translations are
/// IPv4. The recorders key such a connection as the IPv4 flow it is, so that
/// both ends name it the same way.
#[inline(always)]
pub const fn v4_of_mapped(addr_be: &[u32; 4]) -> Option<u32> {
    if addr_be[0] == 0 && addr_be[1] == 0 && addr_be[2] == V4_MAPPED_WORD2_BE {
        Some(addr_be[3])
    } else {
        None
    }
}

/// The local address of a dual-stack socket as IPv4: a v4-mapped address,
/// or the unspecified `::` of a socket bound to the wildcard, which is
/// `0.0.0.0` for its IPv4 flows (userspace resolves the source the kernel
/// routes from, as for an IPv4 socket bound to `0.0.0.0`).
#[inline(always)]
pub const fn v4_of_mapped_or_any(addr_be: &[u32; 4]) -> Option<u32> {
    if addr_be[0] == 0 && addr_be[1] == 0 && addr_be[2] == 0 && addr_be[3] == 0 {
        Some(0)
    } else {
        v4_of_mapped(addr_be)
    }
}

impl FlowKey {
    /// A TCP connection of an AF_INET6 socket whose two ends are IPv4-mapped
    /// becomes the IPv4 flow it is on the wire; any other key is returned
    /// unchanged.
    #[inline(always)]
    pub const fn unmapped(self) -> FlowKey {
        if self.family != AF_INET6 {
            return self;
        }
        match (
            v4_of_mapped(&self.src_addr_be),
            v4_of_mapped(&self.dst_addr_be),
        ) {
            (Some(src), Some(dst)) => FlowKey {
                src_addr_be: [src, 0, 0, 0],
                dst_addr_be: [dst, 0, 0, 0],
                family: AF_INET,
                ..self
            },
            _ => self,
        }
    }
}

/// How a connection came to be recorded ([`ConnRecord::origin`]).
pub const ORIGIN_TCP_ACTIVE: u8 = 1;
pub const ORIGIN_TCP_PASSIVE: u8 = 2;
pub const ORIGIN_UDP_CONNECT: u8 = 3;
pub const ORIGIN_UDP_SENDMSG: u8 = 4;
pub const ORIGIN_UDP_RECVMSG: u8 = 5;
/// Recorded by vnatd, not by sock_ops: a TCP connection that was open
/// before its cgroup was enabled (adopted). It gets no state callbacks, so
/// vnatd drops the record once the socket is gone.
pub const ORIGIN_TCP_ADOPTED: u8 = 6;
/// Recorded by vnatd: a connected UDP socket that was connected before its
/// cgroup was enabled (the recorders see only later connects and sends to
/// an address).
pub const ORIGIN_UDP_ADOPTED: u8 = 7;

/// [`ConnRecord::udp_dirs`]: the socket received from the peer.
pub const UDP_DIR_RECV: u8 = 1;
/// [`ConnRecord::udp_dirs`]: the socket sent to the peer (or connected to it).
pub const UDP_DIR_SEND: u8 = 2;

/// Value of [`MAP_CONNS`]: what the kernel knows about one recorded flow.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnRecord {
    /// `bpf_get_socket_cookie`: stable for the socket's lifetime.
    pub cookie: u64,
    /// cgroup v2 id of the process that created/used the socket, 0 if the
    /// program ran outside process context and could not tell.
    pub cgroup_id: u64,
    /// The network namespace the socket lives in (`bpf_get_netns_cookie`).
    pub netns_cookie: u64,
    /// CLOCK_BOOTTIME (ns) when recorded; suspend-aware.
    pub first_seen_ns: u64,
    /// CLOCK_BOOTTIME (ns) of the last update (UDP refreshes it, at most
    /// once per [`UDP_REFRESH_NS`]).
    pub last_seen_ns: u64,
    /// Thread group id of the process, 0 if unknown.
    pub pid: u32,
    /// TCP only: next sequence number to send / expected, at establishment.
    pub snd_nxt: u32,
    pub rcv_nxt: u32,
    /// One of the `ORIGIN_*` constants.
    pub origin: u8,
    /// UDP only: which ways the socket used the flow, [`UDP_DIR_RECV`] and
    /// [`UDP_DIR_SEND`] bits (0: recorded by an older program, unknown).
    /// A source only received from is no pairing target: anyone can spoof
    /// one.
    pub udp_dirs: u8,
    pub _pad: [u8; 2],
    /// Command name of the process (`bpf_get_current_comm`), NUL padded.
    pub comm: [u8; 16],
    /// TCP only: `snd_una - bytes_acked` at establishment (mod 2^32). The
    /// kernel moves both together (tcp_snd_una_update), so at any later time
    /// `snd_una == snd_una_base + tcpi_bytes_acked` (mod 2^32): userspace
    /// learns the current `snd_una` from sock_diag without a per-packet hook.
    pub snd_una_base: u32,
    /// TCP only: `rcv_nxt - bytes_received` at establishment (mod 2^32);
    /// `rcv_nxt == rcv_nxt_base + tcpi_bytes_received` (tcp_rcv_nxt_update).
    pub rcv_nxt_base: u32,
    /// TCP only: the oldest unacknowledged sequence number (`snd_una`) at
    /// the last retransmission timeout (BPF_SOCK_OPS_RTO_CB, called from
    /// tcp_write_timeout): the sequence number an RFC 6069 ICMP unreachable
    /// must quote to revert a backoff step (tcp_ld_RTO_revert). Meaningful
    /// only when [`ConnRecord::rto_count`] is not 0.
    pub rto_snd_una: u32,
    /// TCP only: retransmission timeouts seen since the connection was
    /// recorded (never reset; 0 means `rto_snd_una` was never set).
    pub rto_count: u32,
    /// CLOCK_BOOTTIME (ns) of the last retransmission timeout, 0 if none.
    pub rto_last_ns: u64,
    /// Whose budget the record counts against ([`MAP_OWNERS`]): the uid
    /// (in the initial user namespace) of the process that made the
    /// connection or used the flow, or [`OWNER_ACCEPTED`] for a TCP
    /// connection accepted from another host (sock_ops cannot tell whose
    /// listener accepted it). 0 (root, and records vnatd wrote) is
    /// charged to no budget.
    pub owner_uid: u32,
    pub _pad2: u32,
}
const _: () = assert!(core::mem::size_of::<ConnRecord>() == 104);

/// UDP records are refreshed at most this often, so a busy UDP sender does
/// not write the map on every datagram.
pub const UDP_REFRESH_NS: u64 = 1_000_000_000;

/// The packet must leave through `redirect_ifindex` with freshly resolved
/// L2 addresses (`bpf_redirect_neigh`), because its destination changed.
pub const NAT_F_REDIRECT: u32 = 1;

/// vnat added the flow's local virtual address to `lo` (it was not there
/// before), so it removes it when the last translation using it goes.
/// Stored in the pinned map, so a restarted vnatd still knows.
pub const NAT_F_LO_ADDR_OURS: u32 = 2;

/// Drop the flow's packets. On egress the sending socket sees a local
/// transmission failure, keeps the data and tries again later, as with no
/// route. Set while the flow's own end moves, from the moment the move
/// starts until the peer sends to the new address: a packet that left
/// earlier, with the old source or translated, would reach a peer that
/// still answers at the old address, and could make its TCP retransmit
/// into the void and then wait out a full timeout. On ingress, for the
/// replies of a container's connection for the instant its NAT entry is
/// replaced by a pinned copy (one that finds no entry would be answered
/// with a reset); the peer sends them again. An entry that only holds
/// rewrites the flow to itself. Programs that predate the bit ignore it
/// (and translate as before).
pub const NAT_F_HOLD: u32 = 4;

/// The flow's local virtual address is a container's, which this host
/// routes to it (a routed guest): vnat never keeps it on `lo`, where it
/// would take the container's traffic for the host. Userspace only; the
/// programs ignore it.
pub const NAT_F_ROUTED: u32 = 8;

/// The flow's physical endpoints are of the other address family than its
/// virtual ones (an IPv4 connection carried over IPv6 after its host moved
/// to a network where it has only IPv6): the value's addresses are of the
/// other family than the key's (IPv4 in word 0), and the translators change
/// the packet's IP header between IPv4 and IPv6 (`bpf_skb_change_proto`).
/// Programs that predate the bit would misread such an entry (they would
/// write the value's first words into the packet's own family).
pub const NAT_F_FAMILY: u32 = 16;

/// The peer's physical endpoint this flow sends to was announced in an
/// authenticated update and is not validated yet (the reachability
/// challenge is under way): on egress the flow may send there at most
/// what its [`MAP_UNVALIDATED`] entry allows, three times what came from
/// there (RFC 9000 section 8, anti-amplification), and a packet over that
/// is dropped (`drop_unvalidated`; the socket sends it again later); on
/// ingress every packet from there adds three times its length to the
/// allowance. A flow whose entry is missing sends nothing. A packet over
/// the allowance goes to the flow's last validated placement instead when
/// the entry names one ([`UnvalidatedBudget::fallback`]), and is dropped
/// otherwise. vnatd clears the bit when the address is validated, or puts
/// the last validated address back when it is not. Programs that predate
/// the bit ignore it (and send unlimited), which no vnatd that sets it
/// loads.
pub const NAT_F_BUDGET: u32 = 32;

/// In [`UnvalidatedBudget::fallback`]'s flags: the fallback is set. A
/// value without it (zeroed) has none. Userspace and the budget only; a
/// NAT map entry never carries it.
pub const NAT_F_FALLBACK: u32 = 64;

/// What a flow may still send to a peer address that is not validated yet
/// ([`NAT_F_BUDGET`]).
pub const MAP_UNVALIDATED: &str = "VNAT_UNVALIDATED";
/// Capacity of [`MAP_UNVALIDATED`]: one entry per translated flow at most.
pub const UNVALIDATED_MAX_ENTRIES: u32 = NAT_MAX_ENTRIES;
/// The multiple of the bytes received from an address that may be sent to
/// it before it is validated.
pub const AMPLIFICATION_FACTOR: u64 = 3;

/// Value of [`MAP_UNVALIDATED`], keyed by the flow's egress key (its
/// virtual endpoints, as the NAT maps' egress key): bytes (IP packets,
/// headers included) the flow may send to its unvalidated address in
/// all, and bytes it sent there. The ingress program adds
/// [`AMPLIFICATION_FACTOR`] times each packet's length to `allowed`,
/// vnatd writes the first allowance (from the update that announced the
/// address, when it came from there), and the egress program adds to
/// `sent` what it lets out. Updated with plain loads and stores: two CPUs
/// sending the same flow's packets in the same instant may lose one
/// packet's count.
///
/// What is over the allowance goes to `fallback` when it is set
/// ([`NAT_F_FALLBACK`]): the flow's last validated placement, where the
/// peer was proven to be (as QUIC keeps sending on the old path while it
/// validates a new one, RFC 9000 section 9.3). A packet dropped in tc is a
/// local failure to TCP, which gives a socket with nothing in flight up
/// after `tcp_retries2` failed tries 500 ms apart (7.5 s), sooner than
/// tens of thousands of addresses are validated; one that leaves is lost
/// at worst, which TCP retries with its usual back-off. A fallback whose
/// endpoints are the flow's virtual ones means "untranslated"; one
/// carried in the other family is not used (the packet is dropped).
///
/// The fallback's `held_until` (the units of [`hold_until`]; 0: none) is
/// when it starts to be used: before then a packet over the allowance is
/// dropped, a local failure, as in a hold. vnatd sets it for TCP, two
/// seconds on (`FALLBACK_WAIT`): a validation takes a round trip, and what
/// a socket's send failed to send it sends again as soon as it can, where
/// a packet that left to a placement the peer has left is a loss,
/// retransmitted and paid for in its congestion window (a client of a
/// server moved with CRIU resent 36 segments), or draws a reset from a
/// host still reached there. UDP sends are not repeated: its fallback has
/// no wait.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnvalidatedBudget {
    pub allowed: u64,
    pub sent: u64,
    /// Packets that went to `fallback` (plain stores, as above).
    pub diverted: u64,
    pub fallback: NatRewrite,
}
const _: () = assert!(core::mem::size_of::<UnvalidatedBudget>() == 72);

/// Value of the NAT maps: the tuple a matching packet is rewritten to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NatRewrite {
    pub src_addr_be: [u32; 4],
    pub dst_addr_be: [u32; 4],
    pub src_port_be: u16,
    pub dst_port_be: u16,
    /// Interface for [`NAT_F_REDIRECT`]; 0 otherwise.
    pub redirect_ifindex: u32,
    /// `NAT_F_*` bits.
    pub flags: u32,
    /// With [`NAT_F_HOLD`] on egress: when the hold ends by itself, in
    /// [`HOLD_CLOCK_SHIFT`] units of CLOCK_BOOTTIME (wrapping); 0 (an older
    /// vnatd, an ingress hold): only when vnatd releases it.
    pub held_until: u32,
}
const _: () = assert!(core::mem::size_of::<NatRewrite>() == 48);

/// [`NatRewrite::held_until`] counts CLOCK_BOOTTIME nanoseconds shifted right
/// by this much: units of 1.05 ms, wrapping after 52 days.
pub const HOLD_CLOCK_SHIFT: u32 = 20;

/// The [`NatRewrite::held_until`] of a hold made at `now_ns` (CLOCK_BOOTTIME)
/// for `limit_ns`, never 0. An egress hold ends by itself then: the flow's
/// packets leave as if vnatd had released it, whether or not vnatd got
/// round to it (a vnatd busy with 100,000 moves released them 10 s late,
/// and a socket whose sends fail locally gives up after `tcp_retries2`
/// probes 500 ms apart, 7.5 s).
#[inline(always)]
pub fn hold_until(now_ns: u64, limit_ns: u64) -> u32 {
    ((now_ns.saturating_add(limit_ns) >> HOLD_CLOCK_SHIFT) as u32).max(1)
}

/// Whether a hold that ends at `until` still holds at `now_ns`.
#[inline(always)]
pub fn hold_in_force(until: u32, now_ns: u64) -> bool {
    until == 0 || until.wrapping_sub((now_ns >> HOLD_CLOCK_SHIFT) as u32) as i32 > 0
}

/// Some cgroup hides location ([`MAP_HIDE_CGROUPS`] is not empty): only
/// then do the sock_addr programs look an address up in [`MAP_HIDE_ADDRS`].
pub const CFG_F_HIDE: u32 = 16;
/// Some address is gone ([`MAP_GONE`] is not empty): only then does an
/// outgoing packet without translation look its source address up there.
pub const CFG_F_GONE: u32 = 32;

/// Addresses of mobile connections that this host no longer has on any
/// interface but `lo`, where vnat keeps them (a move left their network),
/// keyed by a [`FlowKey`] whose `family` and `src_addr_be` name the address
/// and whose other fields are zero ([`FlowKey::gone_key`]); the value is the
/// index of the device to redirect to, which vnatd makes 0, no device. On
/// egress, a TCP or UDP packet from such an address that no translation or
/// hold takes is redirected there: the kernel drops it after the program,
/// and its socket sees it sent (tc's redirect verdict is a successful
/// transmit, whatever becomes of the packet): until
/// its connection's move reaches it, its socket behaves as over a link that
/// went dark (data kept, retransmission timer backing off, the restart
/// levers after the move) instead of sending into the new network with
/// the old address, whose answers go to the old network and are lost. At
/// 100,000 connections those packets and their answers filled both cores
/// for seconds while the moves were being started. Not dropped
/// (`TC_ACT_SHOT`): a socket whose sends fail locally probes every 500 ms
/// and is ended after tcp_retries2 probes (about 7.5 s), and a mass move
/// reaches its last connections later than that. Not `TC_ACT_STOLEN`,
/// which TCX takes for "next".
pub const MAP_GONE: &str = "VNAT_GONE";
/// Capacity of [`MAP_GONE`].
pub const GONE_MAX_ENTRIES: u32 = 64;

/// Only record sockets of this network namespace (a program attached to a
/// cgroup sees that cgroup's sockets in every namespace).
pub const CFG_F_NETNS_FILTER: u32 = 1;
/// Both NAT maps are empty: the tc translators pass every packet without
/// parsing it. Userspace clears it before it writes the first NAT entry and
/// sets it after it removes the last, so a set bit is never stale (given one
/// writer per pin directory, which vnatd's copy of the maps assumes too). Programs
/// that predate the bit ignore it, and a config without it (written by an
/// older vnatd) only costs the lookup it always did.
pub const CFG_F_NAT_EMPTY: u32 = 2;
/// Some flow is rebinding (entries in [`MAP_REBIND`]): an incoming packet
/// without a translation is looked up there too. Clear, a miss costs the
/// one NAT lookup it did before rebinding existed.
pub const CFG_F_REBINDING: u32 = 4;
/// Divert in-band BIND datagrams (see [`BIND_LEN`]) arriving at the tc
/// ingress to vnatd's VCMP port. Set only after a paired peer behind NAT has
/// claimed a UDP flow that this host cannot match, and before vnatd asks
/// that peer to send one, so that no application ever receives one.
pub const CFG_F_BIND_DIVERT: u32 = 8;

/// An in-band BIND: a VCMP datagram that a host behind NAT sends on one of
/// its UDP flows' own 5-tuple, so that it crosses the NAT with that flow's
/// mapping and tells the peer which public port is that flow's. Exactly
/// this long, starting with [`BIND_HEAD`], with [`BIND_MAGIC`] at offset 4.
/// The diverting tc program writes the original destination port (big
/// endian) into bytes 2..4, which the sender leaves zero, and sends the
/// datagram to [`DatapathConfig::vcmp_port_be`] instead.
pub const BIND_LEN: usize = 134;
/// VCMP version and kind of a BIND.
pub const BIND_HEAD: [u8; 2] = [1, 19];
/// Bytes 4..8 of a BIND (its request id field).
pub const BIND_MAGIC: [u8; 4] = *b"vnat";

/// Value of the single-slot [`MAP_CONFIG`] array.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DatapathConfig {
    pub netns_cookie: u64,
    pub flags: u32,
    pub abi_version: u32,
    /// vnatd's VCMP port, where [`CFG_F_BIND_DIVERT`] sends BINDs.
    pub vcmp_port_be: u16,
    pub _pad: [u16; 3],
}
const _: () = assert!(core::mem::size_of::<DatapathConfig>() == 24);

#[cfg(feature = "user")]
mod pod {
    // SAFETY: aya copies Pod values to and from raw map bytes, so every bit
    // pattern must be a valid value and no byte may be uninitialized. All
    // of these are repr(C), made only of integers and arrays of integers,
    // with every padding byte spelled out as a field (the size asserts
    // beside each type would catch padding the compiler added).
    unsafe impl aya::Pod for super::FlowKey {}
    unsafe impl aya::Pod for super::ConnRecord {}
    unsafe impl aya::Pod for super::NatRewrite {}
    unsafe impl aya::Pod for super::DatapathConfig {}
    unsafe impl aya::Pod for super::GuestKey {}
    unsafe impl aya::Pod for super::UnvalidatedBudget {}
}

/// Cgroups whose applications do not see moves (`vnatctl enable
/// --hide-location`, paper section 3.4.1): cgroup id to 1. A process is
/// covered if its cgroup or one of its ancestors (up to
/// [`HIDE_MAX_LEVEL`]) is listed.
pub const MAP_HIDE_CGROUPS: &str = "VNAT_HIDE_CGROUPS";
pub const HIDE_CGROUPS_MAX_ENTRIES: u32 = 1024;
/// Deepest cgroup level whose ancestors are looked up.
pub const HIDE_MAX_LEVEL: u32 = 16;
/// What the applications of those cgroups are shown for, and where they
/// reach through, an address ([`HideKey`] to [`HideValue`]); vnatd writes
/// it from the moved connections.
pub const MAP_HIDE_ADDRS: &str = "VNAT_HIDE_ADDRS";
pub const HIDE_ADDRS_MAX_ENTRIES: u32 = 4096;
/// Translated flows whose remote virtual endpoint a connect() or sendmsg()
/// names: left to the tc translation, never redirected. A [`FlowKey`] with
/// the local address zero (the local port is the socket's), to 1.
pub const MAP_HIDE_FLOWS: &str = "VNAT_HIDE_FLOWS";
pub const HIDE_FLOWS_MAX_ENTRIES: u32 = 65_536;

/// [`HideKey::side`]: an address of this host.
pub const HIDE_SIDE_LOCAL: u8 = 0;
/// [`HideKey::side`]: an address of a peer host.
pub const HIDE_SIDE_REMOTE: u8 = 1;
/// [`HideValue::flags`]: `show_be` is what getpeername(), accept() and
/// recvmsg() (remote side) or getsockname() (local side) report instead.
pub const HIDE_F_SHOW: u32 = 1;
/// [`HideValue::flags`]: `reach_be` is where a connect() or sendmsg() to
/// the address (remote side) or a bind() to it (local side) goes instead.
pub const HIDE_F_REACH: u32 = 2;

/// Key of [`MAP_HIDE_ADDRS`]: an address as the kernel shows it (an IPv4
/// address in word 0, also when a dual-stack socket shows it mapped).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HideKey {
    pub addr_be: [u32; 4],
    /// [`AF_INET`] or [`AF_INET6`].
    pub family: u8,
    /// [`HIDE_SIDE_LOCAL`] or [`HIDE_SIDE_REMOTE`].
    pub side: u8,
    pub _pad: [u8; 2],
}
const _: () = assert!(core::mem::size_of::<HideKey>() == 20);

/// Value of [`MAP_HIDE_ADDRS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HideValue {
    /// The virtual address the applications see (with [`HIDE_F_SHOW`]).
    pub show_be: [u32; 4],
    /// The physical address sent to or bound (with [`HIDE_F_REACH`]).
    pub reach_be: [u32; 4],
    pub flags: u32,
}
const _: () = assert!(core::mem::size_of::<HideValue>() == 36);

// SAFETY: both are repr(C), made only of integers and arrays of integers,
// with every padding byte spelled out as a field (sizes asserted above).
#[cfg(feature = "user")]
unsafe impl aya::Pod for HideKey {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for HideValue {}

/// Map of flows whose peer moved behind a NAT and whose new port is not
/// known yet (a "rebinding" flow, DESIGN.md section 3): keyed by the NAT's
/// public address (from the peer's authenticated update) and our end.
pub const MAP_REBIND: &str = "VNAT_REBIND";
pub const REBIND_MAX_ENTRIES: u32 = 4096;
/// Flows from one public address to one of our ports that may rebind at
/// once (the key's `slot`).
pub const REBIND_SLOTS: u8 = 4;

/// Key of [`MAP_REBIND`]: a packet from `src_addr_be` (any port) to
/// `dst_addr_be:dst_port_be`, the `slot`-th such flow.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RebindKey {
    pub src_addr_be: [u32; 4],
    pub dst_addr_be: [u32; 4],
    pub dst_port_be: u16,
    pub family: u8,
    pub proto: u8,
    pub slot: u8,
    pub _pad: [u8; 3],
}
const _: () = assert!(core::mem::size_of::<RebindKey>() == 40);

/// Value of [`MAP_REBIND`]: what the flow is named by our socket, and the
/// token its peer's TCP BIND must carry.
///
/// A UDP flow learns its port from its authenticated BIND through vnatd;
/// meanwhile the tc program drops datagrams from the key's address to the
/// key's port that no recorded flow owns. A TCP flow learns it in tc from
/// its TCP BIND: a segment from the key's address to the key's port that
/// carries the option described at [`TCP_BIND_OPT`] with `token` or
/// `token_prev` (vnatd writes them as the BIND requests it sends the peer
/// go out; all zero: none yet, nothing matches). That segment installs the
/// flow's ingress and egress translations (egress with `redirect_ifindex`
/// and `flags`), removes this entry and is dropped (it carries nothing for
/// the socket). Meanwhile segments from the address to the port that
/// belong to no recorded connection and open none (a SYN) are dropped, so
/// that our kernel never answers the moved peer's first segments with a
/// reset. Nothing else teaches the port: the sequence numbers an earlier
/// version checked can be guessed, or known by a host sharing the NAT.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RebindValue {
    pub virt_remote_addr_be: [u32; 4],
    pub virt_local_addr_be: [u32; 4],
    pub virt_remote_port_be: u16,
    pub virt_local_port_be: u16,
    /// The token of the newest BIND request sent for the flow: the 8 bytes
    /// the option carries, as two words in memory order.
    pub token: [u32; 2],
    /// The one before it (a BIND answering the previous request may still
    /// be on its way).
    pub token_prev: [u32; 2],
    pub redirect_ifindex: u32,
    pub flags: u32,
    /// TCP: BINDs from the key's address to its port with another token
    /// (written by the tc program, 0 when vnatd writes the entry). At
    /// [`REBIND_MAX_REFUSALS`] the flow learns nothing more.
    pub refusals: u32,
}
const _: () = assert!(core::mem::size_of::<RebindValue>() == 64);

/// How many TCP BINDs with a wrong token the tc program takes before it
/// stops learning that flow's port: a guesser's tries, each a 2^-64 chance.
pub const REBIND_MAX_REFUSALS: u32 = 8;

/// A TCP BIND: how a peer that moved behind a NAT tells us which of that
/// NAT's ports is its TCP connection's. Its vnatd sends, on the
/// connection's own 5-tuple (so that it crosses the NAT with the
/// connection's mapping), a pure ACK whose header is exactly
/// [`TCP_BIND_HDR_LEN`] bytes and whose options start with this
/// experimental option (RFC 6994, kind 253): kind, length 12, the
/// experiment id "vn", then the 8-byte token both vnatds derive from the
/// connection's keys and the nonce of our BIND request
/// (`vcmp::crypto::tcp_bind_token`). These are its first four bytes.
pub const TCP_BIND_OPT: [u8; 4] = [253, 12, b'v', b'n'];
/// The TCP header length of a TCP BIND: 20 bytes and the 12-byte option.
pub const TCP_BIND_HDR_LEN: usize = 32;
/// Length of a TCP BIND's token.
pub const TCP_BIND_TOKEN_LEN: usize = 8;

// SAFETY: both are repr(C), made only of integers and arrays of integers,
// with every padding byte spelled out as a field (sizes asserted above).
#[cfg(feature = "user")]
unsafe impl aya::Pod for RebindKey {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for RebindValue {}

/// Map of UDP sockets that called connect() before they had a local port
/// (the cgroup connect hook runs before the kernel autobinds). Userspace
/// completes these from sock_diag (by socket cookie) into [`MAP_CONNS`].
/// Each entry is charged to its owner as a socket connecting
/// ([`OwnerCounts::connecting`], shared with [`MAP_CONNECTING`]).
pub const MAP_UDP_PENDING: &str = "VNAT_UDP_PENDING";
pub const UDP_PENDING_MAX_ENTRIES: u32 = 16_384;

/// Value of [`MAP_UDP_PENDING`] (keyed by socket cookie, u64).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UdpPending {
    /// The flow as far as it is known: `dst` is the peer; `src` is the bound
    /// address (zero if wildcard) and port zero.
    pub key: FlowKey,
    pub record: ConnRecord,
}
const _: () = assert!(core::mem::size_of::<UdpPending>() == 144);

// SAFETY: as for the types in `pod` above: repr(C), a FlowKey (40 bytes,
// 4-aligned) followed by a ConnRecord (8-aligned, at offset 40), so there
// is no padding between or after them (the size assert above checks 144),
// and both are valid for any bit pattern.
#[cfg(feature = "user")]
unsafe impl aya::Pod for UdpPending {}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;

    #[test]
    fn a_hold_lasts_its_limit_across_the_clock_wrapping_and_one_without_an_end_lasts() {
        let unit = 1u64 << HOLD_CLOCK_SHIFT;
        for limit_ns in [2_000_000_000u64, 3_750_000_000] {
            for start_ns in [5 * unit, (u32::MAX as u64 - 3) * unit, 0] {
                let until = hold_until(start_ns, limit_ns);
                assert_ne!(until, 0, "an end is never 0");
                assert!(hold_in_force(until, start_ns));
                let end = start_ns + limit_ns;
                assert!(
                    hold_in_force(until, end - 2 * unit),
                    "{start_ns} {limit_ns}"
                );
                assert!(!hold_in_force(until, end + unit), "{start_ns} {limit_ns}");
            }
        }
        // No end (an ingress hold, an older vnatd): held until released.
        assert!(hold_in_force(0, u64::MAX));
    }

    fn v6(s: &str) -> [u32; 4] {
        let b: [u8; 16] = s.parse::<std::net::Ipv6Addr>().unwrap().octets();
        core::array::from_fn(|i| u32::from_ne_bytes(b[i * 4..i * 4 + 4].try_into().unwrap()))
    }

    fn v4(s: &str) -> u32 {
        u32::from_ne_bytes(s.parse::<std::net::Ipv4Addr>().unwrap().octets())
    }

    #[test]
    fn a_v4_mapped_tcp_key_becomes_the_ipv4_flow() {
        let key = FlowKey {
            src_addr_be: v6("::ffff:198.18.3.2"),
            dst_addr_be: v6("::ffff:198.18.1.2"),
            src_port_be: 5001u16.to_be(),
            dst_port_be: 40000u16.to_be(),
            family: AF_INET6,
            proto: PROTO_TCP,
            _pad: [0; 2],
        };
        let want = FlowKey {
            src_addr_be: [v4("198.18.3.2"), 0, 0, 0],
            dst_addr_be: [v4("198.18.1.2"), 0, 0, 0],
            family: AF_INET,
            ..key
        };
        assert_eq!(key.unmapped(), want);
        // Already IPv4: unchanged.
        assert_eq!(want.unmapped(), want);
    }

    #[test]
    fn real_ipv6_keys_stay_ipv6() {
        for (src, dst) in [
            ("2001:db8::2", "2001:db8:1::2"),
            // One end mapped, the other not: not a v4 flow.
            ("::ffff:198.18.3.2", "2001:db8::1"),
            // IPv4-compatible (deprecated, ::a.b.c.d) is not v4-mapped.
            ("::198.18.3.2", "::198.18.1.2"),
            ("::", "::ffff:198.18.1.2"),
        ] {
            let key = FlowKey {
                src_addr_be: v6(src),
                dst_addr_be: v6(dst),
                family: AF_INET6,
                proto: PROTO_TCP,
                ..FlowKey::default()
            };
            assert_eq!(key.unmapped(), key, "{src} -> {dst}");
        }
    }

    #[test]
    fn a_dual_stack_wildcard_is_the_ipv4_wildcard() {
        assert_eq!(v4_of_mapped_or_any(&v6("::")), Some(0));
        assert_eq!(
            v4_of_mapped_or_any(&v6("::ffff:10.0.0.1")),
            Some(v4("10.0.0.1"))
        );
        assert_eq!(v4_of_mapped_or_any(&v6("2001:db8::1")), None);
        assert_eq!(v4_of_mapped(&v6("::")), None);
    }
}
