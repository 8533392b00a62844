//! Fault injection for the crash-safety tests (DESIGN.md §8): with
//! `VNAT_TEST_CRASH_AT=<step>` in its environment, vnatd kills itself with
//! SIGKILL right after that step of installing or removing a translation
//! has changed the kernel, leaving exactly what a crash there would. Only
//! whoever starts vnatd sets its environment, so this opens nothing to
//! other users.

use std::sync::OnceLock;

/// The environment variable naming the step to die after.
pub const CRASH_AT_ENV: &str = "VNAT_TEST_CRASH_AT";

/// Every step [`after`] is called with, in the order a move meets them.
pub const STEPS: &[&str] = &[
    "install:lo-address",
    "install:host-route",
    "install:tc",
    "install:receive-side",
    "install:send-side",
    "remove:send-side",
    "remove:receive-side",
    "remove:lo-address",
    "remove:host-route",
    "remove:tc",
    "pin:replies-held",
];

/// The kernel change named `step` is done: die here if asked to.
pub(super) fn after(step: &'static str) {
    static CRASH_AT: OnceLock<Option<String>> = OnceLock::new();
    debug_assert!(STEPS.contains(&step), "unlisted fault step {step}");
    let at = CRASH_AT.get_or_init(|| std::env::var(CRASH_AT_ENV).ok());
    if at.as_deref() == Some(step) {
        tracing::error!(step, "{CRASH_AT_ENV}: vnatd kills itself here");
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}
