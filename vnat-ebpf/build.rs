//! Rebuild when bpf-linker changes (a new linker can change the object).
use which::which;

fn main() {
    match which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(_) => println!("cargo:warning=bpf-linker not found; run `cargo xtask prereq`"),
    }
}
