//! Rebinding flows (a peer moved behind a NAT whose new port only its own
//! packets can tell) and the divert of in-band BINDs to vnatd.

use aya_ebpf::programs::TcContext;
use vnat_common::{
    FlowKey, NatRewrite, RebindKey, RebindValue, BIND_HEAD, BIND_LEN, BIND_MAGIC, PROTO_UDP,
    REBIND_MAX_REFUSALS, REBIND_SLOTS, STAT_BIND_DIVERTED, STAT_DROP_BIND_DIRECT,
    STAT_DROP_REBINDING, STAT_REBIND_LEARNED, STAT_REBIND_REFUSED, STAT_REBIND_STOPPED,
    STAT_REBIND_UNCHANGED, STAT_TCP_BIND_CONSUMED, TCP_BIND_HDR_LEN, TCP_BIND_OPT,
};

use super::parse::{Parsed, UDP_CSUM_OFF};
use super::rewrite::{port, BPF_F_MARK_MANGLED_0};
use super::{opaque_zero, Drop};
use crate::maps::{count, VNAT_CONNS, VNAT_EGRESS_NAT, VNAT_INGRESS_NAT, VNAT_REBIND};

/// A packet with no translation, coming in, for a rebinding flow (its
/// peer moved behind a NAT whose port we cannot know until the peer's
/// packets cross it): the key is the NAT's public address from the peer's
/// authenticated update and our end.
///
/// Neither a UDP datagram nor a TCP segment proves by itself that it is
/// the peer's: anyone behind the same NAT can send one to the port, and a
/// TCP segment's numbers can be guessed or known. So a flow learns its
/// port only from its peer's authenticated BIND: a UDP flow's through
/// vnatd, a TCP flow's here ([`learn_tcp`]). Meanwhile a packet from that
/// address to that port that belongs to no recorded flow is dropped, so
/// that no application takes it for a new peer's and our kernel does not
/// reset the moved connection's first segments.
///
/// `Ok(true)`: the flow's translations are installed (the caller then
/// translates the packet by them). A call of its own, for the stack (see
/// `translate_flow`).
#[inline(never)]
pub(super) fn learn(ctx: &TcContext, p: &Parsed) -> Result<bool, Drop> {
    if p.key.proto == PROTO_UDP {
        udp_rebinding(p)?;
        return Ok(false);
    }
    learn_tcp(ctx, p)
}

/// See [`learn`]: a UDP datagram for a rebinding flow's port is dropped
/// unless a recorded flow owns it.
#[inline(always)]
pub(super) fn udp_rebinding(p: &Parsed) -> Result<(), Drop> {
    if !rebinding(p) || recorded(p) {
        return Ok(());
    }
    Err(Drop(STAT_DROP_REBINDING))
}

/// Whether some flow is rebinding toward the packet's source address and
/// destination port.
#[inline(always)]
pub(super) fn rebinding(p: &Parsed) -> bool {
    let mut rk = rebind_key(p);
    for slot in 0..REBIND_SLOTS {
        rk.slot = slot;
        if VNAT_REBIND.get_ptr(&rk).is_some() {
            return true;
        }
    }
    false
}

/// Whether the packet belongs to a recorded connection or flow (another
/// host behind the same NAT, say): then it is that one's, never a rebinding
/// flow's. Recorded flows are keyed as the local stack names them: our end
/// first.
#[inline(always)]
pub(super) fn recorded(p: &Parsed) -> bool {
    let own = FlowKey {
        src_addr_be: p.key.dst_addr_be,
        dst_addr_be: p.key.src_addr_be,
        src_port_be: p.key.dst_port_be,
        dst_port_be: p.key.src_port_be,
        family: p.key.family,
        proto: p.key.proto,
        _pad: [0; 2],
    };
    if VNAT_CONNS.get_ptr(&own).is_some() {
        return true;
    }
    // A socket bound to the wildcard address is recorded under it.
    let wildcard = FlowKey {
        src_addr_be: [opaque_zero(), opaque_zero(), opaque_zero(), opaque_zero()],
        ..own
    };
    VNAT_CONNS.get_ptr(&wildcard).is_some()
}

/// TCP flags (RFC 9293 section 3.1), at byte 13 of the header; the data
/// offset in the high nibble of byte 12.
const TCP_DOFF_OFF: usize = 12;
pub(super) const TCP_FLAGS_OFF: usize = 13;
pub(super) const TCP_SYN: u8 = 0x02;
pub(super) const TCP_RST: u8 = 0x04;
pub(super) const TCP_ACK: u8 = 0x10;

/// The token of a TCP BIND (`vnat_common::TCP_BIND_OPT`): a segment whose
/// header is exactly the option's length and whose options start with it;
/// `None` for any other segment.
#[inline(always)]
fn tcp_bind_token(ctx: &TcContext, p: &Parsed) -> Option<[u32; 2]> {
    let doff = ctx.load::<u8>(p.l4 + TCP_DOFF_OFF).ok()?;
    if usize::from(doff >> 4) * 4 != TCP_BIND_HDR_LEN {
        return None;
    }
    let head = ctx.load::<u32>(p.l4 + 20).ok()?;
    if head != u32::from_ne_bytes(TCP_BIND_OPT) {
        return None;
    }
    let token = ctx.load::<[u32; 2]>(p.l4 + 24).ok()?;
    Some(token)
}

/// See [`learn`]. A segment for a rebinding flow's port from its NAT's
/// address that belongs to no recorded connection (another host behind
/// the NAT) is one of three things:
///
/// * a SYN (a new connection from behind the NAT): passed;
/// * a TCP BIND: if its token is one vnatd wrote into a rebinding flow's
///   entry, that flow's translations are installed for the port it came
///   from; the BIND itself is dropped either way. A wrong token counts
///   against every flow waiting there; after `REBIND_MAX_REFUSALS` a flow
///   learns nothing more, so a guesser gets a few 2^-64 tries, not one per
///   packet it can send;
/// * a segment our kernel has a socket for other than a listener (another
///   host's connection behind the NAT, its handshake's last ACK before
///   sock_ops records it): passed, it is that connection's;
/// * anything else (the moved peer's segments before its BIND, or a
///   stranger's): dropped. The peer's TCP sends them again.
#[inline(always)]
pub(super) fn learn_tcp(ctx: &TcContext, p: &Parsed) -> Result<bool, Drop> {
    if !rebinding(p) {
        return Ok(false);
    }
    if recorded(p) {
        return unchanged(ctx, p);
    }
    let Ok(flags) = ctx.load::<u8>(p.l4 + TCP_FLAGS_OFF) else {
        return Ok(false);
    };
    let Some(token) = tcp_bind_token(ctx, p) else {
        if flags & TCP_SYN != 0 && flags & TCP_ACK == 0 {
            return Ok(false);
        }
        // Another host's connection behind the same NAT that the kernel
        // has a socket for (its handshake's last ACK, before sock_ops
        // records it; or one not recorded): its own, never the moved
        // peer's. Dropping it would keep every new connection from that
        // NAT to this port from completing while the rebind waits.
        if super::natguard::kernel_has_socket(ctx, p) {
            return Ok(false);
        }
        return Err(Drop(STAT_DROP_REBINDING));
    };
    let mut rk = rebind_key(p);
    if token != [0, 0] {
        for slot in 0..REBIND_SLOTS {
            rk.slot = slot;
            let Some(vp) = VNAT_REBIND.get_ptr(&rk) else {
                continue;
            };
            // SAFETY: a pointer a lookup just returned, into the map's
            // memory (BPF_F_NO_PREALLOC: an element deleted meanwhile is
            // freed after an RCU grace period, which this program's run is
            // inside). Only the numbers: the whole value copied out would
            // cost 64 bytes of a frame that has few to spare.
            let (refusals, ours) = unsafe {
                let v = &*vp;
                (v.refusals, v.token == token || v.token_prev == token)
            };
            if !ours {
                continue;
            }
            if refusals >= REBIND_MAX_REFUSALS {
                count(STAT_REBIND_STOPPED);
                return Err(Drop(STAT_TCP_BIND_CONSUMED));
            }
            if install(p, vp) {
                let _ = VNAT_REBIND.remove(&rk);
                count(STAT_REBIND_LEARNED);
            }
            return Err(Drop(STAT_TCP_BIND_CONSUMED));
        }
    }
    // No flow's token: a refusal for each flow waiting there whose token
    // is set (before it is, the peer's own BIND may simply have come
    // early).
    count(STAT_REBIND_REFUSED);
    for slot in 0..REBIND_SLOTS {
        rk.slot = slot;
        let Some(vp) = VNAT_REBIND.get_ptr_mut(&rk) else {
            continue;
        };
        // SAFETY: as above. Two packets at once on two CPUs may both add
        // to `refusals` and lose one count: a few more tries for a
        // guesser, not a way around the limit.
        unsafe {
            if (*vp).token != [0, 0] {
                (*vp).refusals = (*vp).refusals.saturating_add(1);
            }
        }
    }
    Err(Drop(STAT_TCP_BIND_CONSUMED))
}

/// A segment of a recorded connection, from an address some flow is
/// rebinding toward, to that flow's port. If it is a TCP BIND whose token
/// is a rebinding flow's, and that flow is this very connection (its
/// virtual remote end is where the segment comes from: asked after a
/// suspected re-map, its NAT had kept the mapping), the rebind ends with
/// nothing to learn and the BIND is dropped. Anything else belongs to the
/// recorded connection and goes on.
#[inline(always)]
fn unchanged(ctx: &TcContext, p: &Parsed) -> Result<bool, Drop> {
    let Some(token) = tcp_bind_token(ctx, p) else {
        return Ok(false);
    };
    if token == [0, 0] {
        return Ok(false);
    }
    let mut rk = rebind_key(p);
    for slot in 0..REBIND_SLOTS {
        rk.slot = slot;
        let Some(vp) = VNAT_REBIND.get_ptr(&rk) else {
            continue;
        };
        // SAFETY: as in `learn_tcp`; only the numbers are read.
        let same = unsafe {
            let v = &*vp;
            (v.token == token || v.token_prev == token)
                && v.virt_remote_port_be == p.key.src_port_be
                && v.virt_local_port_be == p.key.dst_port_be
                && v.virt_remote_addr_be == p.key.src_addr_be
        };
        if same {
            let _ = VNAT_REBIND.remove(&rk);
            count(STAT_REBIND_UNCHANGED);
            return Err(Drop(STAT_TCP_BIND_CONSUMED));
        }
    }
    Ok(false)
}

/// Install a rebinding flow's translations (from the entry at `vp`) for
/// the packet's source port; false if either insert failed (nothing is
/// left half done).
#[inline(always)]
fn install(p: &Parsed, vp: *const RebindValue) -> bool {
    // SAFETY: see `learn_tcp`; copied out field by field, each entry built
    // and written in a block of its own so that their stack is shared.
    let installed = unsafe {
        let ingress = NatRewrite {
            src_addr_be: (*vp).virt_remote_addr_be,
            dst_addr_be: (*vp).virt_local_addr_be,
            src_port_be: (*vp).virt_remote_port_be,
            dst_port_be: (*vp).virt_local_port_be,
            redirect_ifindex: 0,
            flags: 0,
            held_until: 0,
        };
        VNAT_INGRESS_NAT.insert(&p.key, &ingress, 0).is_ok()
    } && unsafe {
        let egress_key = FlowKey {
            src_addr_be: (*vp).virt_local_addr_be,
            dst_addr_be: (*vp).virt_remote_addr_be,
            src_port_be: (*vp).virt_local_port_be,
            dst_port_be: (*vp).virt_remote_port_be,
            family: p.key.family,
            proto: p.key.proto,
            _pad: [0; 2],
        };
        let egress = NatRewrite {
            src_addr_be: p.key.dst_addr_be,
            dst_addr_be: p.key.src_addr_be,
            src_port_be: p.key.dst_port_be,
            dst_port_be: p.key.src_port_be,
            redirect_ifindex: (*vp).redirect_ifindex,
            flags: (*vp).flags,
            held_until: 0,
        };
        VNAT_EGRESS_NAT.insert(&egress_key, &egress, 0).is_ok()
    };
    if !installed {
        let _ = VNAT_INGRESS_NAT.remove(&p.key);
    }
    installed
}

/// An in-band BIND (see `vnat_common::BIND_LEN`) coming in on a UDP flow:
/// send it to vnatd's VCMP port instead of the flow's, with the flow's port
/// written into the datagram (bytes 2..4, zero as sent) so that vnatd knows
/// which of its flows the BIND names. Only the exact length, head and magic
/// qualify, so an application datagram is never taken by mistake; a forged
/// BIND reaches vnatd, which checks its tag like any VCMP datagram.
#[inline(always)]
pub(super) fn divert_bind(ctx: &TcContext, p: &Parsed, vcmp_port_be: u16) -> Result<bool, Drop> {
    if p.key.proto != PROTO_UDP {
        return Ok(false);
    }
    let Ok(udp_len) = ctx.load::<u16>(p.l4 + 4) else {
        return Ok(false);
    };
    if usize::from(u16::from_be(udp_len)) != 8 + BIND_LEN {
        return Ok(false);
    }
    let Ok(head) = ctx.load::<[u8; 8]>(p.l4 + 8) else {
        return Ok(false);
    };
    if head[0] != BIND_HEAD[0] || head[1] != BIND_HEAD[1] || head[4..8] != BIND_MAGIC {
        return Ok(false);
    }
    if p.key.dst_port_be == vcmp_port_be {
        // Sent to the VCMP port directly, whatever its bytes 2..4 say:
        // the flow port in a BIND that reaches vnatd is the divert's, never
        // the sender's word.
        return Err(Drop(STAT_DROP_BIND_DIRECT));
    }
    if head[2] != 0 || head[3] != 0 {
        return Ok(false);
    }
    let (csum_off, mangled) = (p.l4 + UDP_CSUM_OFF, BPF_F_MARK_MANGLED_0);
    // Payload byte 2 is at an even offset from the UDP header, so the
    // 16-bit checksum update lines up with the words it sums.
    port(ctx, p.l4 + 8 + 2, csum_off, mangled, 0, p.key.dst_port_be)?;
    port(
        ctx,
        p.l4 + 2,
        csum_off,
        mangled,
        p.key.dst_port_be,
        vcmp_port_be,
    )?;
    count(STAT_BIND_DIVERTED);
    Ok(true)
}

/// The rebind map's key for an incoming packet (slot 0): who it comes
/// from and where it goes, not the port it comes from (the unknown).
#[inline(always)]
pub(super) fn rebind_key(p: &Parsed) -> RebindKey {
    RebindKey {
        src_addr_be: p.key.src_addr_be,
        dst_addr_be: p.key.dst_addr_be,
        dst_port_be: p.key.dst_port_be,
        family: p.key.family,
        proto: p.key.proto,
        slot: 0,
        _pad: [opaque_zero(), opaque_zero(), opaque_zero()],
    }
}
