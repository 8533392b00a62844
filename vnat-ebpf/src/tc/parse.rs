//! The tc translators' parser: Ethernet or nothing, IPv4 or IPv6, and the
//! TCP or UDP ports.

use aya_ebpf::programs::TcContext;
use vnat_common::{FlowKey, AF_INET, AF_INET6, PROTO_TCP, PROTO_UDP, STAT_PASS_TRUNCATED};

use crate::maps::count;

const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86DD;
/// Offsets inside the IPv4 header.
const IP4_ID_OFF: usize = 4;
pub(super) const IP4_FRAG_OFF: usize = 6;
pub(super) const IP4_PROTO_OFF: usize = 9;
pub(super) const IP4_CSUM_OFF: usize = 10;
pub(super) const IP4_SADDR_OFF: usize = 12;
pub(super) const IP4_DADDR_OFF: usize = 16;
/// Offsets inside the IPv6 header.
pub(super) const IP6_NEXTHDR_OFF: usize = 6;
pub(super) const IP6_SADDR_OFF: usize = 8;
pub(super) const IP6_DADDR_OFF: usize = 24;
pub(super) const IP6_HLEN: usize = 40;
/// The IPv6 fragment extension header: its number and length.
pub(super) const IP6_NEXTHDR_FRAGMENT: u8 = 44;
pub(super) const IP6_FRAGHDR_LEN: usize = 8;
/// Offsets of the checksum inside the L4 header.
pub(super) const TCP_CSUM_OFF: usize = 16;
pub(super) const UDP_CSUM_OFF: usize = 6;

/// The byte at offset `off` of a header read as words (network order in
/// memory, as on the wire). The offsets are constants: the indexing folds
/// away.
#[inline(always)]
fn byte_at<const N: usize>(h: &[u32; N], off: usize) -> u8 {
    h[off / 4].to_ne_bytes()[off % 4]
}

/// The big-endian 16-bit field at offset `off` of a header read as words.
#[inline(always)]
fn be16_at<const N: usize>(h: &[u32; N], off: usize) -> u16 {
    u16::from_be_bytes([byte_at(h, off), byte_at(h, off + 1)])
}

/// The 16-byte address at offset `off` (a multiple of 4) of a header read
/// as words, as the key holds it.
#[inline(always)]
fn words_at<const N: usize>(h: &[u32; N], off: usize) -> [u32; 4] {
    let w = off / 4;
    [h[w], h[w + 1], h[w + 2], h[w + 3]]
}

/// Where the interesting fields of a parsed packet are.
///
/// `repr(C)` with `frag` first and one `bool` in all (`frag.is_fragment`):
/// `Option<Parsed>` (the parser's result, a function's return type and so
/// in the object's BTF) keeps its tag in that bool's spare values, and
/// BTF describes it as a union with a member at that offset. Linux 6.1
/// refuses a union member at any offset but 0 ("Invalid member
/// bits_offset"), and then the whole object's BTF; at offset 0 it loads.
#[repr(C)]
pub(super) struct Parsed {
    /// A fragment: its IP identification, whether it is the first (the one
    /// with the L4 header), and whether more follow (not the last).
    pub(super) frag: Frag,
    /// IPv6 with more extension headers than the parser walks: what
    /// follows them cannot be told (nothing else here is meaningful).
    /// 0 or 1, not a bool (see above).
    pub(super) unparsed: u8,
    pub(super) key: FlowKey,
    /// Offset of the L3 header and of the L4 header (0 for a fragment
    /// after the first, which has none: its key has no ports).
    pub(super) l3: usize,
    pub(super) l4: usize,
}

/// A fragment's facts, `Frag::NONE` for a whole datagram.
///
/// Not an `Option<Frag>`: a `None` leaves the payload's bytes unwritten,
/// LLVM copies the whole value through the stack, and verifiers before
/// Linux 6.3 refuse a read of stack never written ("invalid read from
/// stack R10 off=-328 size=8" on 6.1). Every field here is always written.
///
/// `is_fragment` first and the only `bool` (see [`Parsed`]); `first` and
/// `more` are 0 or 1.
#[derive(Clone, Copy)]
#[repr(C)]
pub(super) struct Frag {
    pub(super) is_fragment: bool,
    first: u8,
    more: u8,
    pub(super) id: u32,
}

impl Frag {
    pub(super) const NONE: Frag = Frag {
        is_fragment: false,
        first: 0,
        more: 0,
        id: 0,
    };

    #[inline(always)]
    pub(super) fn new(id: u32, first: bool, more: bool) -> Frag {
        Frag {
            is_fragment: true,
            first: first as u8,
            more: more as u8,
            id,
        }
    }

    /// The fragment with the L4 header.
    #[inline(always)]
    pub(super) fn first(&self) -> bool {
        self.first != 0
    }

    /// Not the last fragment.
    #[inline(always)]
    pub(super) fn more(&self) -> bool {
        self.more != 0
    }
}

/// How many IPv6 extension headers the parser walks to the upper-layer
/// header: more than real traffic carries (RFC 8504 section 5.3 lets a node
/// limit them), few enough for the verifier to follow every path.
const IP6_MAX_EXT: usize = 6;
/// Extension headers walked (RFC 8200 section 4; AH, RFC 4302, counts its
/// length in 4-byte units less 2).
const IP6_HOPOPTS: u8 = 0;
const IP6_ROUTING: u8 = 43;
const IP6_DSTOPTS: u8 = 60;
const IP6_AH: u8 = 51;
/// ICMP and ICMPv6: parsed for their errors (`icmp.rs`), which quote a
/// translated flow's packet.
pub(super) const PROTO_ICMP: u8 = 1;
pub(super) const PROTO_ICMPV6: u8 = 58;

/// Parse Ethernet (`l2` = 14) or nothing (`l2` = 0, an L3 interface, where
/// the skb's protocol says which IP version follows) + IPv4/IPv6 (and its
/// extension headers) + TCP/UDP ports, or ICMP. `None` means "not ours";
/// a packet whose extension headers the parser did not walk to their end
/// comes back `unparsed`.
///
/// One `Option<Parsed>` whose every field is written on every path: a
/// result type with a variant that leaves the payload unwritten (an
/// `Option<Result<Parsed, ()>>`) made LLVM keep undefined registers live
/// and spill them, and the verifier refuses that ("R7 !read_ok" on 6.18).
#[inline(never)]
pub(super) fn parse(ctx: &TcContext, l2: usize) -> Option<Parsed> {
    parse_ip(ctx, l2)
}

#[inline(always)]
fn parse_ip(ctx: &TcContext, l2: usize) -> Option<Parsed> {
    let proto = if l2 == 0 {
        // skb->protocol holds the ethertype in network byte order.
        u16::from_be(ctx.skb.protocol() as u16)
    } else {
        u16::from_be(ctx.load::<u16>(12).ok()?)
    };
    let l3 = l2;
    let mut key = FlowKey::default();
    let mut frag = Frag::NONE;
    let l4 = match proto {
        ETH_P_IP => {
            // The fixed header in one helper call, not one per field: on a
            // host whose tc translators parse every packet, the calls cost
            // a packet that matches nothing about 20 of its 100 ns. Words,
            // so that every read below is an aligned one (the verifier
            // refuses a misaligned stack access).
            let h: [u32; 5] = ctx.load(l3).ok()?;
            let vihl = byte_at(&h, 0);
            // Honour IHL: options move the L4 header.
            let ihl = (vihl & 0x0f) as usize;
            if vihl >> 4 != 4 || ihl < 5 {
                count(STAT_PASS_TRUNCATED);
                return None;
            }
            key.proto = byte_at(&h, IP4_PROTO_OFF);
            if key.proto != PROTO_TCP && key.proto != PROTO_UDP && key.proto != PROTO_ICMP {
                return None;
            }
            let frag_field = be16_at(&h, IP4_FRAG_OFF);
            key.family = AF_INET;
            key.src_addr_be[0] = h[IP4_SADDR_OFF / 4];
            key.dst_addr_be[0] = h[IP4_DADDR_OFF / 4];
            // Offset and "more fragments": either makes it a fragment.
            if frag_field & 0x3fff != 0 {
                let id = u32::from(be16_at(&h, IP4_ID_OFF));
                let more = frag_field & 0x2000 != 0;
                if frag_field & 0x1fff != 0 {
                    // Not the first: no ports, matched by its datagram.
                    if key.proto == PROTO_ICMP {
                        return None;
                    }
                    return Some(later_fragment(key, l3, id, more));
                }
                frag = Frag::new(id, true, more);
            }
            l3 + ihl * 4
        }
        ETH_P_IPV6 => {
            key.family = AF_INET6;
            // The fixed header in one call, as for IPv4.
            let h: [u32; 10] = ctx.load(l3).ok()?;
            key.src_addr_be = words_at(&h, IP6_SADDR_OFF);
            key.dst_addr_be = words_at(&h, IP6_DADDR_OFF);
            let mut nh: u8 = byte_at(&h, IP6_NEXTHDR_OFF);
            let mut off = l3 + IP6_HLEN;
            // The chain, one header a turn: its next header and length
            // (RFC 8200 section 4). A bounded loop (Linux 5.3).
            for _ in 0..IP6_MAX_EXT {
                if !walked(nh) {
                    break;
                }
                let Ok(h) = ctx.load::<[u8; 2]>(off) else {
                    count(STAT_PASS_TRUNCATED);
                    return None;
                };
                let len = match nh {
                    IP6_NEXTHDR_FRAGMENT => {
                        // Next header, offset and M flag, identification.
                        let offset_m = u16::from_be(ctx.load::<u16>(off + 2).ok()?);
                        let id = u32::from_be(ctx.load::<u32>(off + 4).ok()?);
                        let more = offset_m & 1 != 0;
                        if offset_m >> 3 != 0 {
                            // Not the first: what follows is payload.
                            key.proto = h[0];
                            if key.proto != PROTO_TCP && key.proto != PROTO_UDP {
                                return None;
                            }
                            return Some(later_fragment(key, l3, id, more));
                        }
                        frag = Frag::new(id, true, more);
                        IP6_FRAGHDR_LEN
                    }
                    IP6_AH => (usize::from(h[1]) + 2) * 4,
                    _ => (usize::from(h[1]) + 1) * 8,
                };
                nh = h[0];
                off += len;
            }
            if walked(nh) {
                return Some(Parsed {
                    key,
                    l3,
                    l4: 0,
                    frag,
                    unparsed: 1,
                });
            }
            key.proto = nh;
            if key.proto != PROTO_TCP && key.proto != PROTO_UDP && key.proto != PROTO_ICMPV6 {
                // ESP, a mobility header, no next header: nothing we
                // translate.
                return None;
            }
            off
        }
        _ => return None,
    };
    if key.proto == PROTO_ICMP || key.proto == PROTO_ICMPV6 {
        // Its "ports" stay 0: no NAT entry is keyed by ICMP.
        return Some(Parsed {
            key,
            l3,
            l4,
            frag,
            unparsed: 0,
        });
    }
    let Ok(ports) = ctx.load::<[u16; 2]>(l4) else {
        count(STAT_PASS_TRUNCATED);
        return None;
    };
    key.src_port_be = ports[0];
    key.dst_port_be = ports[1];
    Some(Parsed {
        key,
        l3,
        l4,
        frag,
        unparsed: 0,
    })
}

/// An extension header the parser walks past.
#[inline(always)]
fn walked(nh: u8) -> bool {
    matches!(
        nh,
        IP6_HOPOPTS | IP6_ROUTING | IP6_NEXTHDR_FRAGMENT | IP6_DSTOPTS | IP6_AH
    )
}

/// A fragment after the first of its datagram: no L4 header, so no ports;
/// it is matched by its datagram (`translate_fragment`).
#[inline(always)]
pub(super) fn later_fragment(key: FlowKey, l3: usize, id: u32, more: bool) -> Parsed {
    Parsed {
        key,
        l3,
        l4: 0,
        frag: Frag::new(id, false, more),
        unparsed: 0,
    }
}
