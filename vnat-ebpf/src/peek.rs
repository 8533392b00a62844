//! `vnat_peek`: read an established TCP socket's sequence numbers and byte
//! counters for adoption (vnat-daemon's `restart/peek.rs`).
//!
//! It is never attached: vnatd runs it with BPF_PROG_TEST_RUN on a packet
//! that carries a [`PeekRequest`], in its own network namespace, and reads
//! the [`PeekAnswer`] the program wrote into the packet. `bpf_tcp_sock`
//! (Linux 5.1) gives `snd_una`, `rcv_nxt`, `bytes_acked` and
//! `bytes_received` in one go, nanoseconds apart, where reading them from
//! userspace took a probe, an answer and two sock_diag dumps, milliseconds
//! that a busy connection rarely holds still for (and, under a VM without
//! KVM, never).

use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_tuple, bpf_tcp_sock, TC_ACT_OK, TC_ACT_SHOT},
    helpers::{bpf_sk_lookup_tcp, bpf_sk_release, bpf_tcp_sock},
    macros::classifier,
    programs::TcContext,
};
use vnat_common::{
    PeekAnswer, PeekRequest, AF_INET, PEEK_ANSWER_OFF, PEEK_FOUND, PEEK_REQUEST_OFF, PEEK_STEADY,
};

/// `BPF_F_CURRENT_NETNS`: look in the namespace of the packet's device,
/// which for a test run is the caller's.
const CURRENT_NETNS: u64 = u64::MAX;
/// The size of `bpf_sock_tuple`'s IPv4 and IPv6 forms.
const TUPLE4_LEN: u32 = 12;
const TUPLE6_LEN: u32 = 36;
const TCP_LISTEN: u32 = 10;

#[classifier]
pub fn vnat_peek(ctx: TcContext) -> i32 {
    match try_peek(&ctx) {
        Some(()) => TC_ACT_OK,
        None => TC_ACT_SHOT,
    }
}

fn try_peek(ctx: &TcContext) -> Option<()> {
    let req: PeekRequest = ctx.load(PEEK_REQUEST_OFF).ok()?;
    let mut tuple = tuple_of(&req);
    let v4 = req.family == u32::from(AF_INET);
    // SAFETY: `tuple` is a live bpf_sock_tuple on the stack, and the size
    // passed is that of the form `tuple_of` filled in; the helper returns a
    // referenced socket or null, and every non-null one is released below.
    let sk = unsafe {
        if v4 {
            bpf_sk_lookup_tcp(ctx.skb.skb.cast(), &mut tuple, TUPLE4_LEN, CURRENT_NETNS, 0)
        } else {
            bpf_sk_lookup_tcp(ctx.skb.skb.cast(), &mut tuple, TUPLE6_LEN, CURRENT_NETNS, 0)
        }
    };
    let mut answer = PeekAnswer::default();
    if !sk.is_null() {
        answer = read(sk);
        // SAFETY: `sk` is the non-null reference the lookup returned, and it
        // is released exactly once.
        unsafe { bpf_sk_release(sk.cast()) };
    }
    ctx.store(PEEK_ANSWER_OFF, &answer, 0).ok()?;
    Some(())
}

/// The tuple of a segment from the peer's end to this host's.
fn tuple_of(req: &PeekRequest) -> bpf_sock_tuple {
    // SAFETY: bpf_sock_tuple is a union of plain integers: all zeroes is a
    // valid value of either form.
    let mut t: bpf_sock_tuple = unsafe { core::mem::zeroed() };
    // SAFETY: writing the fields of one union member; both members are
    // plain integers, so no invalid value can be made.
    unsafe {
        if req.family == u32::from(AF_INET) {
            let v4 = &mut t.__bindgen_anon_1.ipv4;
            v4.saddr = req.remote_addr_be[0];
            v4.daddr = req.local_addr_be[0];
            v4.sport = req.remote_port_be;
            v4.dport = req.local_port_be;
        } else {
            let v6 = &mut t.__bindgen_anon_1.ipv6;
            v6.saddr = req.remote_addr_be;
            v6.daddr = req.local_addr_be;
            v6.sport = req.remote_port_be;
            v6.dport = req.local_port_be;
        }
    }
    t
}

/// The socket's numbers, read twice: a segment processed on another CPU
/// between the two readings (the lookup takes no socket lock) makes them
/// differ, and the answer is then not `PEEK_STEADY`.
fn read(sk: *mut bpf_sock) -> PeekAnswer {
    // SAFETY: `sk` is a referenced socket from the lookup; the verifier
    // allows reading its `state` field.
    let state = unsafe { (*sk).state };
    let mut a = PeekAnswer {
        state,
        ..PeekAnswer::default()
    };
    if state == TCP_LISTEN {
        return a;
    }
    // SAFETY: bpf_tcp_sock takes any socket pointer and returns null for
    // one that is not a full TCP socket.
    let tp: *mut bpf_tcp_sock = unsafe { bpf_tcp_sock(sk) };
    if tp.is_null() {
        return a;
    }
    let once = numbers(tp);
    let again = numbers(tp);
    a.found = PEEK_FOUND;
    if once == again {
        a.found |= PEEK_STEADY;
    }
    (
        a.snd_una,
        a.snd_nxt,
        a.rcv_nxt,
        a.bytes_acked,
        a.bytes_received,
    ) = once;
    a
}

/// `snd_una`, `snd_nxt`, `rcv_nxt`, `bytes_acked`, `bytes_received`.
#[inline(always)]
fn numbers(tp: *mut bpf_tcp_sock) -> (u32, u32, u32, u64, u64) {
    // SAFETY: `tp` is non-null, from bpf_tcp_sock on a socket still held;
    // the verifier rewrites these loads into reads of the kernel's tcp_sock.
    unsafe {
        (
            (*tp).snd_una,
            (*tp).snd_nxt,
            (*tp).rcv_nxt,
            (*tp).bytes_acked,
            (*tp).bytes_received,
        )
    }
}
