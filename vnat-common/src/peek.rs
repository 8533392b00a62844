//! The sequence-number reader (`vnat_peek`): not a map type but the bytes
//! vnatd hands a program through BPF_PROG_TEST_RUN and reads back, so the
//! same layout rules hold.
//!
//! The test-run packet is an Ethernet header ([`PEEK_ETH_LEN`] bytes, any
//! contents: the kernel only wants one), then a [`PeekRequest`] at
//! [`PEEK_REQUEST_OFF`], then room for a [`PeekAnswer`] at
//! [`PEEK_ANSWER_OFF`], which the program fills in.

/// Program name (the function name in `vnat-ebpf`).
pub const PROG_PEEK: &str = "vnat_peek";

pub const PEEK_ETH_LEN: usize = 14;
pub const PEEK_REQUEST_OFF: usize = PEEK_ETH_LEN;
pub const PEEK_ANSWER_OFF: usize = PEEK_REQUEST_OFF + core::mem::size_of::<PeekRequest>();
/// The whole test-run packet.
pub const PEEK_PACKET_LEN: usize = PEEK_ANSWER_OFF + core::mem::size_of::<PeekAnswer>();

/// A TCP socket to find, named as an arriving segment would name it (the
/// layout of `struct bpf_sock_tuple`): source the peer's end, destination
/// this host's.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeekRequest {
    /// [`crate::AF_INET`] or [`crate::AF_INET6`].
    pub family: u32,
    /// IPv4: the first word of each address only.
    pub remote_addr_be: [u32; 4],
    pub local_addr_be: [u32; 4],
    pub remote_port_be: u16,
    pub local_port_be: u16,
}
const _: () = assert!(core::mem::size_of::<PeekRequest>() == 40);

/// `found`: the lookup found an established socket (not a listener).
pub const PEEK_FOUND: u32 = 1;
/// `found`: ... and its fields read the same twice in a row, so they were
/// not torn by a segment processed meanwhile on another CPU.
pub const PEEK_STEADY: u32 = 2;

/// What the program read of the socket (`struct bpf_tcp_sock`), host byte
/// order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeekAnswer {
    /// `PEEK_FOUND | PEEK_STEADY` when the reading can be used.
    pub found: u32,
    /// The socket's TCP state (TCP_ESTABLISHED = 1, ...); 0 if not found.
    pub state: u32,
    pub snd_una: u32,
    pub snd_nxt: u32,
    pub rcv_nxt: u32,
    pub _pad: u32,
    pub bytes_acked: u64,
    pub bytes_received: u64,
}
const _: () = assert!(core::mem::size_of::<PeekAnswer>() == 40);
