//! BPF_PROG_TEST_RUN: run a loaded program on a crafted packet and get the
//! verdict and the packet as the program left it. Used by the tests of the
//! tc translators; needs root (CAP_BPF/CAP_NET_ADMIN), no attachment.

use std::os::fd::RawFd;

/// `union bpf_attr`, the `test` member (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct TestRunAttr {
    prog_fd: u32,
    retval: u32,
    data_size_in: u32,
    data_size_out: u32,
    data_in: u64,
    data_out: u64,
    repeat: u32,
    duration: u32,
    ctx_size_in: u32,
    ctx_size_out: u32,
    ctx_in: u64,
    ctx_out: u64,
    flags: u32,
    cpu: u32,
    batch_size: u32,
    _pad: u32,
}

const BPF_PROG_TEST_RUN: libc::c_long = 10;

/// What a test run returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestRun {
    /// The program's return value (TC_ACT_*).
    pub verdict: u32,
    /// The packet after the program ran.
    pub packet: Vec<u8>,
}

/// Run program `prog_fd` once on `packet` (an Ethernet frame).
pub fn run(prog_fd: RawFd, packet: &[u8]) -> std::io::Result<TestRun> {
    run_repeated(prog_fd, packet, 1).map(|(r, _)| r)
}

/// Run program `prog_fd` `repeat` times on `packet` in the kernel, and
/// return the last run and the kernel's mean time per run in nanoseconds
/// (what the program costs a packet, without the stack around it).
pub fn run_repeated(prog_fd: RawFd, packet: &[u8], repeat: u32) -> std::io::Result<(TestRun, u32)> {
    let mut out = vec![0u8; packet.len() + 256];
    let mut attr = TestRunAttr {
        prog_fd: prog_fd as u32,
        data_size_in: packet.len() as u32,
        data_size_out: out.len() as u32,
        data_in: packet.as_ptr() as u64,
        data_out: out.as_mut_ptr() as u64,
        repeat: repeat.max(1),
        ..Default::default()
    };
    // SAFETY: `attr` is a live, zero-padded copy of the kernel's test-run
    // attributes (the bpf syscall refuses unknown non-zero bytes). Its
    // pointers are to `packet`, which the kernel only reads, data_size_in
    // bytes of it, and to `out`, into which it writes at most
    // data_size_out bytes (since Linux 5.0 it fails with ENOSPC rather than
    // write more; vnat needs 6.6); both outlive the call. ctx_in and ctx_out
    // are null, so nothing else is read or written but `attr` itself. A
    // `prog_fd` that is not a program makes the call fail, nothing worse.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_TEST_RUN,
            &mut attr as *mut TestRunAttr,
            std::mem::size_of::<TestRunAttr>(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    out.truncate(attr.data_size_out as usize);
    let run = TestRun {
        verdict: attr.retval,
        packet: out,
    };
    Ok((run, attr.duration))
}
