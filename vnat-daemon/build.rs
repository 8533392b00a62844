//! Builds `vnat-ebpf` for bpfel-unknown-none with the pinned nightly and
//! places the object in OUT_DIR, where `datapath::kernel::object` embeds it
//! (`EBPF_OBJECT`).
//!
//! `AYA_BUILD_SKIP=1` skips the eBPF build (for work on the protocol core on a
//! machine without bpf-linker); the daemon then reports at run time that it was
//! built without its eBPF programs instead of failing to compile.
use std::{env, fs, path::PathBuf};

use anyhow::{anyhow, Context as _};
use aya_build::{Package, Toolchain};

/// Keep in sync with `xtask/src/prereq.rs` (EBPF_TOOLCHAIN).
const EBPF_TOOLCHAIN: &str = "nightly-2026-05-20";

fn main() -> anyhow::Result<()> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let object = out_dir.join("vnat");
    let skip = env::var("AYA_BUILD_SKIP").map(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    if skip.unwrap_or(false) {
        println!("cargo:rerun-if-env-changed=AYA_BUILD_SKIP");
        fs::write(&object, b"").context("writing the empty eBPF placeholder")?;
        return Ok(());
    }
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR not set")?);
    let root_dir = manifest_dir.join("..").join("vnat-ebpf");
    let root_dir = root_dir
        .to_str()
        .ok_or_else(|| anyhow!("the vnat-ebpf path is not UTF-8"))?;
    aya_build::build_ebpf(
        [Package {
            name: "vnat-ebpf",
            root_dir,
            ..Default::default()
        }],
        Toolchain::Custom(EBPF_TOOLCHAIN),
    )
    .context(
        "building vnat-ebpf: run `cargo xtask prereq` to install bpf-linker and the pinned nightly",
    )
}
