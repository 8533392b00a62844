//! Rewriting a packet's addresses and ports, checksums updated
//! incrementally.

use aya_ebpf::programs::TcContext;
use vnat_common::{
    NatRewrite, AF_INET, PROTO_TCP, STAT_DROP_CSUM_FAILED, STAT_DROP_REWRITE_FAILED,
};

use super::parse::{
    Parsed, IP4_CSUM_OFF, IP4_DADDR_OFF, IP4_SADDR_OFF, IP6_DADDR_OFF, IP6_SADDR_OFF, TCP_CSUM_OFF,
    UDP_CSUM_OFF,
};
use super::Drop;

/// bpf_l4_csum_replace flags (include/uapi/linux/bpf.h).
pub(super) const BPF_F_PSEUDO_HDR: u64 = 1 << 4;
pub(super) const BPF_F_MARK_MANGLED_0: u64 = 1 << 5;

/// bpf_skb_store_bytes: update skb->csum for what is written (an IPv6
/// address has no header checksum to absorb the change, and a receive
/// checksum the NIC computed would otherwise go stale).
pub(super) const BPF_F_RECOMPUTE_CSUM: u64 = 1;

/// Rewrite addresses and ports with incremental checksum updates.
#[inline(always)]
pub(super) fn rewrite(ctx: &TcContext, p: &Parsed, nat: &NatRewrite) -> Result<(), Drop> {
    let (csum_off, mangled) = if p.key.proto == PROTO_TCP {
        (p.l4 + TCP_CSUM_OFF, 0)
    } else {
        // UDPv4 may carry a zero ("no") checksum: MARK_MANGLED_0 leaves it
        // zero, and turns a computed 0 into 0xffff.
        (p.l4 + UDP_CSUM_OFF, BPF_F_MARK_MANGLED_0)
    };
    if p.key.family == AF_INET {
        let (sa, da) = (p.l3 + IP4_SADDR_OFF, p.l3 + IP4_DADDR_OFF);
        addr4(
            ctx,
            p.l3,
            sa,
            csum_off,
            mangled,
            p.key.src_addr_be[0],
            nat.src_addr_be[0],
        )?;
        addr4(
            ctx,
            p.l3,
            da,
            csum_off,
            mangled,
            p.key.dst_addr_be[0],
            nat.dst_addr_be[0],
        )?;
    } else {
        addr6(
            ctx,
            p.l3 + IP6_SADDR_OFF,
            csum_off,
            mangled,
            &p.key.src_addr_be,
            &nat.src_addr_be,
        )?;
        addr6(
            ctx,
            p.l3 + IP6_DADDR_OFF,
            csum_off,
            mangled,
            &p.key.dst_addr_be,
            &nat.dst_addr_be,
        )?;
    }
    port(
        ctx,
        p.l4,
        csum_off,
        mangled,
        p.key.src_port_be,
        nat.src_port_be,
    )?;
    port(
        ctx,
        p.l4 + 2,
        csum_off,
        mangled,
        p.key.dst_port_be,
        nat.dst_port_be,
    )?;
    Ok(())
}

#[inline(always)]
pub(super) fn addr4(
    ctx: &TcContext,
    l3: usize,
    off: usize,
    csum_off: usize,
    mangled: u64,
    old: u32,
    new: u32,
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    ctx.l4_csum_replace(
        csum_off,
        old as u64,
        new as u64,
        BPF_F_PSEUDO_HDR | mangled | 4,
    )
    .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
    ctx.l3_csum_replace(l3 + IP4_CSUM_OFF, old as u64, new as u64, 4)
        .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
    ctx.store(off, &new, 0)
        .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))
}

#[inline(always)]
pub(super) fn addr6(
    ctx: &TcContext,
    off: usize,
    csum_off: usize,
    mangled: u64,
    old: &[u32; 4],
    new: &[u32; 4],
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    // IPv6 has no header checksum; the address is part of the L4
    // pseudo-header. The helper takes 2 or 4 bytes at a time, so update word
    // by word.
    for i in 0..4 {
        if old[i] != new[i] {
            ctx.l4_csum_replace(
                csum_off,
                old[i] as u64,
                new[i] as u64,
                BPF_F_PSEUDO_HDR | mangled | 4,
            )
            .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
        }
    }
    ctx.store(off, new, 0)
        .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))
}

#[inline(always)]
pub(super) fn port(
    ctx: &TcContext,
    off: usize,
    csum_off: usize,
    mangled: u64,
    old: u16,
    new: u16,
) -> Result<(), Drop> {
    if old == new {
        return Ok(());
    }
    ctx.l4_csum_replace(csum_off, old as u64, new as u64, mangled | 2)
        .map_err(|_| Drop(STAT_DROP_CSUM_FAILED))?;
    ctx.store(off, &new, 0)
        .map_err(|_| Drop(STAT_DROP_REWRITE_FAILED))
}
