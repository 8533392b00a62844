//! A benchmark host: a network namespace, a cgroup its measured processes
//! run in, and optionally its own vnat datapath (pins in a private bpffs
//! directory, recorders attached to that cgroup).
//!
//! Hosts without vnat still get a cgroup, so that the only difference between
//! a baseline and a vnat case is vnat itself, not cgroup accounting.

use std::{collections::BTreeMap, process::Command};

use anyhow::{anyhow, Context, Result};
use aya::programs::{tc::TcAttachType, SchedClassifier};
use vnat_daemon::datapath::{
    kernel::{KernelDatapath, KernelOptions},
    Datapath, Translation, VirtualFlow,
};
use vnat_tests::{BpffsDir, Cgroup, Netns};

pub struct Host<'a> {
    pub ns: &'a Netns,
    pub cgroup: Cgroup,
    /// `None`: vnat is not loaded on this host.
    pins: Option<BpffsDir>,
}

impl<'a> Host<'a> {
    /// A host without vnat.
    pub fn plain(ns: &'a Netns, tag: &str) -> Host<'a> {
        Host {
            ns,
            cgroup: Cgroup::new(tag),
            pins: None,
        }
    }

    /// A host whose datapath is loaded, with the recorders attached to its
    /// cgroup.
    pub fn with_vnat(ns: &'a Netns, tag: &str) -> Result<Host<'a>> {
        let h = Host {
            ns,
            cgroup: Cgroup::new(tag),
            pins: Some(BpffsDir::new(tag)),
        };
        h.datapath(|_| Ok(()))?;
        Ok(h)
    }

    /// A command that runs in this host's namespace and cgroup.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = self.ns.cmd(program);
        self.cgroup.join_on_spawn(&mut cmd);
        cmd
    }

    /// Runs `f` on the datapath, opened afresh inside the namespace (route
    /// lookups, addresses and tc attachment by ifindex are per namespace, so
    /// every call must run there; the pins are the datapath's only state).
    pub fn datapath<T: Send>(
        &self,
        f: impl FnOnce(&mut KernelDatapath) -> Result<T> + Send,
    ) -> Result<T> {
        let pins = self
            .pins
            .as_ref()
            .ok_or_else(|| anyhow!("vnat is not loaded in {}", self.ns.name()))?;
        let opts = KernelOptions {
            bpffs: pins.path().to_path_buf(),
            cgroups: vec![self.cgroup.path().to_path_buf()],
            tc_attach: vnat_daemon::datapath::TcAttach::from_env().unwrap_or_default(),
            sysctl_record: None,
            tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
        };
        let name = self.ns.name();
        self.ns.run_in(move || {
            // Beside a running vnatd only observed: opening it would take
            // over (and rewrite) what that vnatd owns.
            let held = vnat_daemon::datapath::kernel::pinlock::PinLock::held(&opts.bpffs);
            let mut dp = if held {
                KernelDatapath::observe(&opts)
            } else {
                KernelDatapath::open(&opts)
            }
            .with_context(|| format!("opening the vnat datapath in {name}"))?;
            f(&mut dp)
        })
    }

    pub fn counters(&self) -> Result<Counters> {
        self.datapath(|dp| Ok(Counters(dp.counters()?.into_iter().collect())))
    }

    /// The programs the kernel runs on `ifname`'s TCX ingress and egress
    /// hooks (BPF_PROG_QUERY, independent of vnat's own record in its pins).
    pub fn tcx_programs(&self, ifname: &str) -> Result<(Vec<String>, Vec<String>)> {
        self.ns.run_in(|| {
            let names = |kind| -> Result<Vec<String>> {
                let (_, progs) = SchedClassifier::query_tcx(ifname, kind)
                    .with_context(|| format!("querying the TCX programs of {ifname}"))?;
                Ok(progs
                    .iter()
                    .map(|p| p.name_as_str().unwrap_or("?").to_string())
                    .collect())
            };
            Ok((names(TcAttachType::Ingress)?, names(TcAttachType::Egress)?))
        })
    }
}

/// The datapath's counters by name (`vnat_common::STAT_NAMES`).
#[derive(Clone, Debug, Default)]
pub struct Counters(pub BTreeMap<String, u64>);

impl Counters {
    pub fn get(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }

    /// How much each counter grew since `before`.
    pub fn since(&self, before: &Counters) -> Counters {
        Counters(
            self.0
                .iter()
                .map(|(k, v)| (k.clone(), v.saturating_sub(before.get(k))))
                .collect(),
        )
    }
}

/// A move of `local`'s end of `flow` to `new_local`, installed on both hosts
/// in the order VCMP uses (the mover becomes receive-ready, the peer
/// switches, then the mover switches its send side), so that no packet of the
/// flow ever reaches either kernel untranslated.
pub fn translate_both(
    local: &Host,
    remote: &Host,
    flow: VirtualFlow,
    new_local: std::net::SocketAddr,
) -> Result<()> {
    let t = Translation {
        flow,
        physical_local: new_local,
        physical_remote: flow.remote,
    };
    let back = Translation {
        flow: VirtualFlow {
            proto: flow.proto,
            local: flow.remote,
            remote: flow.local,
        },
        physical_local: flow.remote,
        physical_remote: new_local,
    };
    local.datapath(|dp| Ok(dp.prepare_translation(&t)?))?;
    remote.datapath(|dp| Ok(dp.install_translation(&back)?))?;
    local.datapath(|dp| Ok(dp.install_translation(&t)?))?;
    Ok(())
}

/// Removes what [`translate_both`] installed for `flow`.
pub fn untranslate_both(local: &Host, remote: &Host, flow: VirtualFlow) -> Result<()> {
    let back = VirtualFlow {
        proto: flow.proto,
        local: flow.remote,
        remote: flow.local,
    };
    local.datapath(|dp| Ok(dp.remove_translation(&flow)?))?;
    remote.datapath(|dp| Ok(dp.remove_translation(&back)?))?;
    Ok(())
}
