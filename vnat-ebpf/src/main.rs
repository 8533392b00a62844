//! vnat's eBPF programs.
//!
//! * `sockops`: records TCP connections of enabled cgroups (DESIGN.md §3).
//! * `udp`: cgroup sock_addr hooks that record UDP flows.
//! * `tc`: translates moved flows between virtual and physical endpoints.
//!
//! Shared types live in `vnat-common`; nothing here logs per packet, every
//! interesting verdict is a counter in `VNAT_STATS`.
#![no_std]
#![no_main]

mod maps;
mod sockops;
mod tc;
mod udp;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // eBPF has no unwinding; the verifier rejects any reachable panic path, so
    // this is never executed.
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
