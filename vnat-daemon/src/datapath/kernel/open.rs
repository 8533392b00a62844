//! Opening the datapath: as its owner (`open`: the pins' lock, the
//! config, the cgroups, reconciliation) or only to look (`observe`, beside
//! a running vnatd), and the process state both start from.

use std::{collections::HashMap as StdHashMap, path::PathBuf};

use super::{attach, features, mirror::Mirror, object, KernelDatapath, KernelOptions};
use crate::datapath::{DatapathError, TcAttach, TcMode};

impl KernelDatapath {
    /// Load the programs (reusing pinned maps), attach the recorders to the
    /// requested and the previously enabled cgroups, take over pinned tc
    /// links, and check that what the pinned translations need is in place.
    ///
    /// The opener owns the pins from then on: it holds their directory's
    /// lock until dropped, and another process's open is refused
    /// ([`DatapathError::PinsInUse`]) meanwhile.
    pub fn open(opts: &KernelOptions) -> Result<KernelDatapath, DatapathError> {
        let loaded = object::load(&opts.bpffs, true, opts.tc_load)?;
        let mut dp = Self::new(opts, loaded)?;
        dp.forget_left_guards();
        dp.lift_left_budgets();
        dp.set_rebinding(!dp.rebinds.is_empty())?;
        if dp.mirror.is_empty() && dp.rebinds.is_empty() {
            dp.set_nat_empty(true)?;
        }
        let mut cgroups: Vec<PathBuf> = opts.cgroups.clone();
        for id in attach::pinned_cgroups(&dp.bpffs) {
            match attach::cgroup_path(id) {
                Some(p) if !cgroups.contains(&p) => cgroups.push(p),
                Some(_) => {}
                // The cgroup is gone: its links are defunct, drop the pins.
                None => {
                    let _ = attach::detach_cgroup(&dp.bpffs, id);
                }
            }
        }
        for cg in &cgroups {
            attach::attach_cgroup(&mut dp.loaded.ebpf, &dp.bpffs, cg)?;
        }
        dp.reconcile()?;
        // Connections opened while no vnatd recorded them are adopted by
        // the first housekeeping (`maintain`, at once when vnatd starts),
        // not here: every opening of the datapath (tools, the tests'
        // harness) would walk and probe the host's sockets.
        Ok(dp)
    }

    /// Look at a datapath another process (a running vnatd) owns: its
    /// pinned maps and counters, read; levers on its sockets. Nothing the
    /// owner keeps a copy of is written at open: no config, no guard
    /// forgotten, no cgroup or tc attached, nothing reconciled. For tools
    /// and tests beside a running vnatd. What an observer installs or
    /// removes later (a translation, a guard) is not in the owner's copy,
    /// so it should change none of that; `sync_udp` completes pending UDP
    /// records as the owner would.
    pub fn observe(opts: &KernelOptions) -> Result<KernelDatapath, DatapathError> {
        let loaded = object::load(&opts.bpffs, false, opts.tc_load)?;
        let mut dp = Self::new(opts, loaded)?;
        (dp.nat_empty, dp.rebinding, dp.bind_divert_port) = object::read_config(&dp.loaded)?;
        Ok(dp)
    }

    /// Read a datapath's pinned maps without loading its programs: as
    /// [`KernelDatapath::observe`], minus the verifier's work, which is
    /// nearly all an opening costs. For reading connections and counters
    /// (and `sync_udp`, which completes UDP records in the maps); anything
    /// that attaches a program or probes what the kernel offers fails or
    /// answers as if all were there.
    pub fn inspect(opts: &KernelOptions) -> Result<KernelDatapath, DatapathError> {
        let loaded = object::load_maps(&opts.bpffs)?;
        let tc_mode = match opts.tc_attach {
            TcAttach::Clsact => TcMode::Clsact,
            _ => TcMode::Tcx,
        };
        let mut dp = Self::with_mode(opts, loaded, tc_mode, Vec::new())?;
        (dp.nat_empty, dp.rebinding, dp.bind_divert_port) = object::read_config(&dp.loaded)?;
        Ok(dp)
    }

    /// The process's state of a datapath just loaded: the NAT maps' copy
    /// and the rebinds waiting, read from the pins.
    fn new(
        opts: &KernelOptions,
        mut loaded: object::Loaded,
    ) -> Result<KernelDatapath, DatapathError> {
        let tc_mode = features::resolve_tc_attach(&mut loaded, opts.tc_attach)?;
        let degraded = features::degraded(&loaded, opts.tc_attach, tc_mode);
        for d in &degraded {
            tracing::warn!(feature = %d.feature, "this kernel lacks {}: {}", d.needs, d.effect);
        }
        Self::with_mode(opts, loaded, tc_mode, degraded)
    }

    fn with_mode(
        opts: &KernelOptions,
        loaded: object::Loaded,
        tc_mode: TcMode,
        degraded: Vec<crate::datapath::Degraded>,
    ) -> Result<KernelDatapath, DatapathError> {
        let mut dp = KernelDatapath {
            bpffs: opts.bpffs.clone(),
            loaded,
            tc_mode,
            degraded,
            tc_current: Default::default(),
            standby: Default::default(),
            bind_ifaces: Default::default(),
            lo_ours: Default::default(),
            memo: Default::default(),
            egress_via: StdHashMap::new(),
            kept: Default::default(),
            guests: Default::default(),
            listing: Default::default(),
            mirror: Default::default(),
            nat_empty: false,
            rebinding: true,
            bind_divert_port: 0,
            rebinds: std::collections::HashSet::new(),
            rebinds_since: StdHashMap::new(),
            budget_next: StdHashMap::new(),
            guards: Default::default(),
            last_adoption: None,
            adopt_backoff: StdHashMap::new(),
            hide_mirror: None,
            sysctl_record: opts.sysctl_record.clone(),
        };
        dp.mirror = Mirror::from(dp.read_map(true)?, dp.read_map(false)?);
        // Rebinds a previous vnatd left waiting are ours to finish.
        dp.rebinds = dp
            .loaded
            .maps
            .rebind
            .keys()
            .filter_map(Result::ok)
            .collect();
        Ok(dp)
    }
}
