//! Placeholder for the roaming demo (`cargo xtask demo`); the real demo is
//! written in this file by the demo's owner.
fn main() {
    eprintln!("vnat-demo: the demo is not written yet");
    std::process::exit(2)
}
