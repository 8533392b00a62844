//! vnat's eBPF programs.
//!
//! * `sockops`: records TCP connections of enabled cgroups (DESIGN.md §3).
//! * `udp`: cgroup sock_addr hooks that record UDP flows.
//! * `hide`: what the applications of a hiding cgroup see of moves.
//! * `tc`: translates moved flows between virtual and physical endpoints.
//! * `peek`: reads a TCP socket's sequence numbers for adoption (run, never
//!   attached).
//!
//! Shared types live in `vnat-common`; nothing here logs per packet, every
//! interesting verdict is a counter in `VNAT_STATS`.
// Built for bpfel-unknown-none by vnat-daemon/build.rs. On the host target
// (`cargo build --workspace`, clippy) the crate is an empty program, so that
// workspace-wide commands work.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]

#[cfg(target_arch = "bpf")]
mod hide;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod owners;
#[cfg(target_arch = "bpf")]
mod peek;
#[cfg(target_arch = "bpf")]
mod sockops;
#[cfg(target_arch = "bpf")]
mod tc;
#[cfg(target_arch = "bpf")]
mod udp;

#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!("vnat-ebpf holds eBPF programs; vnat-daemon's build script builds them for bpfel-unknown-none");
}

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // eBPF has no unwinding; the verifier rejects any reachable panic path, so
    // this is never executed.
    loop {}
}

#[cfg(target_arch = "bpf")]
// SAFETY: `no_mangle` exports this static as the symbol `LICENSE`, which
// nothing else in the object defines, and `link_section` places it in the
// "license" section, where the loader reads the program's license from. The
// value is a NUL-terminated byte string, which is what the loader expects.
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
