//! The eBPF object's BTF as the oldest kernel we support checks it.
//!
//! A kernel that refuses the object's BTF does not refuse the programs:
//! aya loads them without it and logs a warning with the kernel's whole
//! BTF dump at every start. Linux 6.1 refuses a union with a member at any
//! offset but 0 ("Invalid member bits_offset"), which is how the object
//! describes an `Option` (or any Rust enum) that keeps its tag in a spare
//! value of a field further in (it did for the tc parser's
//! `Option<Parsed>`). The VMs of `cargo xtask test --kernel 6.1` would only
//! log it; this fails.

use super::EBPF_OBJECT;

/// The `.BTF` section of an ELF64 little-endian object.
fn btf_section(elf: &[u8]) -> Option<&[u8]> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(elf.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(elf.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(elf.get(o..o + 8)?.try_into().ok()?));
    let shoff = u64_at(0x28)? as usize;
    let (entsize, count, strndx) = (
        usize::from(u16_at(0x3a)?),
        usize::from(u16_at(0x3c)?),
        usize::from(u16_at(0x3e)?),
    );
    let section = |i: usize| {
        let h = shoff + i * entsize;
        Some((
            u32_at(h)? as usize,
            u64_at(h + 0x18)? as usize,
            u64_at(h + 0x20)? as usize,
        ))
    };
    let (_, names_at, _) = section(strndx)?;
    (0..count).find_map(|i| {
        let (name, off, size) = section(i)?;
        let name_bytes = elf.get(names_at + name..)?;
        let end = name_bytes.iter().position(|&b| b == 0)?;
        (&name_bytes[..end] == b".BTF").then(|| elf.get(off..off + size))?
    })
}

/// Every union's members with a non-zero bit offset, as (union's type id,
/// member's bit offset).
fn unions_with_offset_members(btf: &[u8]) -> Vec<(usize, u32)> {
    let u32_at = |o: usize| u32::from_le_bytes(btf[o..o + 4].try_into().expect("4 bytes"));
    let hdr_len = u32_at(4) as usize;
    let (type_off, type_len) = (u32_at(8) as usize, u32_at(12) as usize);
    let (mut p, end) = (hdr_len + type_off, hdr_len + type_off + type_len);
    let mut bad = Vec::new();
    let mut id = 1;
    while p < end {
        let info = u32_at(p + 4);
        let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
        p += 12;
        p += match kind {
            // INT, ARRAY
            1 => 4,
            3 => 12,
            // STRUCT, UNION: members of 12 bytes (name, type, offset)
            4 | 5 => {
                if kind == 5 {
                    for m in 0..vlen {
                        let offset = u32_at(p + m * 12 + 8);
                        if offset != 0 {
                            bad.push((id, offset));
                        }
                    }
                }
                12 * vlen
            }
            // ENUM, FUNC_PROTO: 8 bytes each; VAR 4; DATASEC 12 each;
            // DECL_TAG 4; ENUM64 12 each
            6 | 13 => 8 * vlen,
            14 | 17 => 4,
            15 | 19 => 12 * vlen,
            _ => 0,
        };
        id += 1;
    }
    bad
}

#[test]
fn the_objects_btf_has_no_union_member_past_offset_0() {
    if EBPF_OBJECT.is_empty() {
        // Built with AYA_BUILD_SKIP: there is no object to check.
        return;
    }
    let btf = btf_section(EBPF_OBJECT).expect("the eBPF object has a .BTF section");
    assert_eq!(
        u16::from_le_bytes([btf[0], btf[1]]),
        0xeb9f,
        "not BTF (magic)"
    );
    let bad = unions_with_offset_members(btf);
    assert!(
        bad.is_empty(),
        "unions with a member past offset 0 (type id, bit offset): {bad:?}; Linux 6.1 refuses the object's BTF for them: give the Option or enum's type no spare values past its first byte (see the tc parser's Parsed)"
    );
}
