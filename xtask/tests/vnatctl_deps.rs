//! vnatctl builds with stable Rust alone (DESIGN, section 5): nothing in its
//! dependency graph, dev-dependencies included, may be vnat-daemon (whose
//! build script builds the eBPF programs with the pinned nightly and
//! bpf-linker), the eBPF crate or aya. `cargo tree` only resolves the graph,
//! it builds nothing, so this stays fast.

use std::{path::Path, process::Command};

/// Packages vnatctl must never pull in.
fn forbidden(name: &str) -> bool {
    name == "vnat-daemon" || name == "vnat-ebpf" || name.starts_with("aya")
}

/// The package names in vnatctl's graph, for every target and every kind
/// of dependency.
fn vnatctl_graph() -> Vec<String> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(["tree", "--manifest-path"])
        .arg(&manifest)
        .args([
            "--package",
            "vnatctl",
            "--edges",
            "normal,build,dev",
            "--target",
            "all",
            "--prefix",
            "none",
            "--format",
            "{p}",
        ])
        .output()
        .unwrap_or_else(|e| panic!("running cargo tree: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[test]
fn vnatctl_depends_on_neither_the_daemon_nor_the_ebpf_build() {
    let graph = vnatctl_graph();
    assert!(
        graph.iter().any(|p| p == "vnat-control"),
        "vnatctl's graph lacks vnat-control, so this check reads cargo tree wrong: {graph:?}"
    );
    let bad: Vec<&String> = graph.iter().filter(|p| forbidden(p)).collect();
    assert!(
        bad.is_empty(),
        "vnatctl depends on {bad:?}: it must build with stable Rust alone; take the types it needs from vnat-control"
    );
}
