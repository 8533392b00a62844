//! Reading a whole BPF hash map with `BPF_MAP_LOOKUP_BATCH` (Linux 5.6):
//! thousands of entries per system call, where aya's iterator makes two
//! per entry (next key, then lookup). At 100,000 connections a pass over
//! the connection map was 200,000 system calls, and vnatd makes several
//! such passes (listing, housekeeping, UDP completion) on the thread that
//! also starts moves. aya 0.14 has no batch API, so this calls bpf(2)
//! itself.

use std::os::fd::{AsFd, AsRawFd};

use aya::maps::{HashMap, IterableMap, MapData, MapError};
use aya::Pod;

/// `BPF_MAP_LOOKUP_BATCH` in `enum bpf_cmd`.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Entries asked for per call. A hash map's batch ends at a bucket's end,
/// and a bucket larger than this fails with ENOSPC (then the call is
/// retried with room for twice as many).
const BATCH: usize = 4096;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Every entry of `map` (a hash map of plain values: not per-CPU), read in
/// batches. Entries changed during the read may be missed or seen in
/// either state, as with aya's iterator. Where the kernel refuses batches
/// (EINVAL: before 5.6, or a map type without them) it falls back to that
/// iterator.
pub fn read_all<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>) -> Result<Vec<(K, V)>, MapError> {
    match lookup_batches(map) {
        Ok(all) => Ok(all),
        // The per-entry way.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => map.iter().collect(),
        Err(io_error) => Err(MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_lookup_batch",
            io_error,
        })),
    }
}

fn lookup_batches<K: Pod, V: Pod>(map: &HashMap<MapData, K, V>) -> std::io::Result<Vec<(K, V)>> {
    let fd = map.map().fd().as_fd().as_raw_fd();
    let mut room = BATCH;
    // SAFETY: `Pod` types are plain data, valid for any bit pattern,
    // zeroes included.
    let zero_k: K = unsafe { std::mem::zeroed() };
    let zero_v: V = unsafe { std::mem::zeroed() };
    let mut keys = vec![zero_k; room];
    let mut values = vec![zero_v; room];
    let mut out = Vec::new();
    // A hash map's batch token is a bucket index (u32); 8 bytes leave room
    // for any map type's.
    let mut token_in = [0u8; 8];
    let mut token_out = [0u8; 8];
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first {
                0
            } else {
                token_in.as_mut_ptr() as u64
            },
            out_batch: token_out.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: room as u32,
            map_fd: fd as u32,
            ..Default::default()
        };
        // SAFETY: `attr` is a valid `bpf_attr` batch member of the size
        // passed; the buffers it points to hold `count` keys and values of
        // the map's sizes (aya checked K and V against the map's sizes when
        // the typed map was made) and live until the call returns.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                &mut attr as *mut BatchAttr,
                std::mem::size_of::<BatchAttr>() as libc::c_uint,
            )
        };
        let err = (rc < 0).then(std::io::Error::last_os_error);
        match err.as_ref().and_then(std::io::Error::raw_os_error) {
            // One bucket holds more than `room`: ask again with more.
            Some(libc::ENOSPC) if room < (1 << 20) => {
                room *= 2;
                keys.resize(room, zero_k);
                values.resize(room, zero_v);
                continue;
            }
            None | Some(libc::ENOENT) => {}
            Some(_) => return Err(err.unwrap_or_else(std::io::Error::last_os_error)),
        }
        let n = (attr.count as usize).min(room);
        out.extend(keys[..n].iter().copied().zip(values[..n].iter().copied()));
        // ENOENT: the last batch (its entries, if any, are above).
        if err.is_some() {
            return Ok(out);
        }
        token_in = token_out;
        first = false;
    }
}
