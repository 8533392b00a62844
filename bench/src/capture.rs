//! tcpdump of the router's view, for `--capture`: to see where the time of
//! a move goes when a figure looks wrong.

use std::{
    path::Path,
    process::{Child, Stdio},
    time::Duration,
};

use anyhow::{Context, Result};

/// tcpdump writing a pcap of the router's view (all its interfaces).
pub struct Tcpdump(Child);

impl Tcpdump {
    /// With `on` (`--capture`), [`Tcpdump::start`] into
    /// `bench/results/DIAG.pcap`.
    pub fn for_run(
        on: bool,
        ns: &vnat_tests::Netns,
        diag: &str,
        port: u16,
    ) -> Result<Option<Tcpdump>> {
        on.then(|| Tcpdump::start(ns, &crate::results_path(diag).with_extension("pcap"), port))
            .transpose()
    }

    /// Capture the TCP of `port`, VCMP, ICMP and ARP into `path`.
    pub fn start(ns: &vnat_tests::Netns, path: &Path, port: u16) -> Result<Tcpdump> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let child = ns
            .cmd("tcpdump")
            .args([
                "-i",
                "any",
                "-nn",
                "-U",
                "--immediate-mode",
                "-s",
                "200",
                "-w",
            ])
            .arg(path)
            .args([
                "tcp",
                "port",
                &port.to_string(),
                "or",
                "udp",
                "port",
                "2031",
                "or",
                "icmp",
                "or",
                "arp",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting tcpdump")?;
        // tcpdump needs a moment to open its socket.
        std::thread::sleep(Duration::from_millis(500));
        Ok(Tcpdump(child))
    }
}

impl Drop for Tcpdump {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        );
        let _ = self.0.wait();
    }
}
