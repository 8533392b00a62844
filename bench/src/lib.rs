//! Shared pieces of vnat's benchmarks (`bench/src/bin/*`): checks of the
//! environment, namespace hosts with their own datapath, an iperf3 driver,
//! a userspace delay line and summary statistics.
//!
//! Benchmarks build their hosts with the integration tests' harness
//! (`vnat-tests`), so they need root. Their numbers always come from the run
//! that prints them.
pub mod delayline;
pub mod env;
pub mod host;
pub mod iperf;
pub mod stats;

use std::path::PathBuf;

/// `bench/results/<name>.json`: where a benchmark writes its last result
/// (the directory is gitignored).
pub fn results_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("results")
        .join(format!("{name}.json"))
}

/// Writes `value` as pretty JSON to `path`, creating its directory.
pub fn write_json(path: &std::path::Path, value: &serde_json::Value) -> anyhow::Result<()> {
    use anyhow::Context;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = serde_json::to_string_pretty(value)? + "\n";
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}
