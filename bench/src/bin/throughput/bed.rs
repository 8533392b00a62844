//! The three hosts pairs of the overhead measurements (shared by the
//! `throughput` and `overhead` benchmarks): (a) no vnat, (b) vnat attached
//! with the measured flow not translated, (c) the flow translated, each on
//! its own `SameLink`, with the datapath counters that prove each case.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use anyhow::{ensure, Context, Result};
use vnat_bench::{
    host::{translate_both, untranslate_both, Counters, Host},
    iperf::{self, ClientRun, IperfServer},
};
use vnat_common::{PROG_TC_EGRESS, PROG_TC_INGRESS};
use vnat_daemon::datapath::{Proto, VirtualFlow};
use vnat_tests::{Family, SameLink};

/// Counters that must not move in any vnat case: a dropped packet would make
/// the throughput figure meaningless.
pub(crate) const DROPS: [&str; 3] = [
    "drop_rewrite_failed",
    "drop_csum_failed",
    "drop_redirect_failed",
];

/// `--cport` of run `i` is `CPORT_BASE + i`: a fresh 4-tuple per run (the
/// previous one may be in TIME_WAIT), below the ephemeral range (32768 and
/// up) so that no control connection can hold it.
pub(crate) const CPORT_BASE: u16 = 20000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Case {
    Native,
    Attached,
    Translated,
}

impl Case {
    pub(crate) const ALL: [Case; 3] = [Case::Native, Case::Attached, Case::Translated];

    pub(crate) fn key(self) -> &'static str {
        match self {
            Case::Native => "native",
            Case::Attached => "attached",
            Case::Translated => "translated",
        }
    }

    /// Short tag for namespace, cgroup and bpffs names.
    pub(crate) fn tag(self) -> &'static str {
        match self {
            Case::Native => "tpa",
            Case::Attached => "tpb",
            Case::Translated => "tpc",
        }
    }

    pub(crate) fn label(self) -> &'static str {
        match self {
            Case::Native => "(a) no vnat",
            Case::Attached => "(b) vnat attached, not translated",
            Case::Translated => "(c) translated",
        }
    }
}

/// One case's hosts, kept for all its runs.
pub(crate) struct Bed<'a> {
    pub(crate) case: Case,
    pub(crate) topo: &'a SameLink,
    pub(crate) family: Family,
    // Declared first so it is dropped (killed) before its cgroup and pins.
    _iperf: IperfServer,
    pub(crate) laptop: Host<'a>,
    pub(crate) server: Host<'a>,
    /// The largest skb payload either `eth0` may carry (GSO/GRO), which
    /// bounds how few packets a transfer of N bytes can take.
    pub(crate) max_skb: u64,
}

/// One run and, in (b) and (c), how much each host's counters grew during it.
pub(crate) struct Sample {
    pub(crate) run: ClientRun,
    pub(crate) deltas: Option<(Counters, Counters)>,
    /// In (c): the fewest packets that can have carried the received bytes.
    pub(crate) min_packets: Option<u64>,
}

impl<'a> Bed<'a> {
    /// `idle`: in (b), leave out the unrelated translation, so that
    /// nothing is translated on either host (a host none of whose
    /// connections has moved).
    pub(crate) fn new(
        case: Case,
        topo: &'a SameLink,
        family: Family,
        idle: bool,
    ) -> Result<Bed<'a>> {
        let tag = case.tag();
        let (laptop, server) = match case {
            Case::Native => (
                Host::plain(&topo.laptop, &format!("{tag}l")),
                Host::plain(&topo.server, &format!("{tag}s")),
            ),
            _ => (
                Host::with_vnat(&topo.laptop, &format!("{tag}l"))?,
                Host::with_vnat(&topo.server, &format!("{tag}s"))?,
            ),
        };
        match case {
            Case::Native => {}
            // Nothing translated on either host: tc stays attached but
            // passes every packet unparsed (standby_tc).
            Case::Attached if idle => {}
            Case::Attached => {
                // A made-up flow whose laptop end moved from an address
                // nobody uses to the laptop's real one, on ports nobody uses:
                // it attaches tc on both eth0 and puts one entry in the NAT
                // maps, which iperf3's packets are looked up in and miss.
                let unrelated = match family {
                    Family::V4 => IpAddr::from([198, 18, 1, 50]),
                    Family::V6 => IpAddr::from([0xfd00, 0x5e, 1, 0, 0, 0, 0, 0x50]),
                };
                let flow = VirtualFlow {
                    proto: Proto::Tcp,
                    local: SocketAddr::new(unrelated, 7000),
                    remote: SocketAddr::new(topo.server_addr.get(family), 7001),
                };
                let physical = SocketAddr::new(topo.laptop_addr.get(family), 7000);
                translate_both(&laptop, &server, flow, physical)
                    .context("installing the unrelated translation of case (b)")?;
            }
            // The old address stays usable: each run's translation puts it
            // on the laptop's lo and a host route to it on the server.
            Case::Translated => topo.move_laptop(),
        }
        if case == Case::Native {
            for (who, h) in [("laptop", &laptop), ("server", &server)] {
                let (ingress, egress) = h.tcx_programs("eth0")?;
                ensure!(
                    ingress.is_empty() && egress.is_empty(),
                    "case (a) must run without tc programs, but the {who}'s eth0 has {ingress:?} / {egress:?}"
                );
            }
        }
        let iperf = IperfServer::start(
            server.command("iperf3"),
            &topo.server,
            topo.server_addr.get(family),
        )?;
        let max_skb = max_skb(topo)?;
        Ok(Bed {
            case,
            topo,
            family,
            _iperf: iperf,
            laptop,
            server,
            max_skb,
        })
    }

    pub(crate) fn vnat(&self) -> bool {
        self.case != Case::Native
    }

    /// Run `index`: in (c) the data connection's translation is installed
    /// before iperf3 starts and removed after it ends, so every run of (b)
    /// and (c) has exactly one translation installed.
    pub(crate) fn measure(&self, index: u16, seconds: u64) -> Result<Sample> {
        self.measure_sized(index, seconds, None)
    }

    /// [`Bed::measure`] with iperf3 writing `len` bytes at a time (`-l`).
    pub(crate) fn measure_sized(
        &self,
        index: u16,
        seconds: u64,
        len: Option<u32>,
    ) -> Result<Sample> {
        let port = CPORT_BASE + index;
        let flow = VirtualFlow {
            proto: Proto::Tcp,
            local: SocketAddr::new(self.topo.laptop_addr.get(self.family), port),
            remote: SocketAddr::new(self.topo.server_addr.get(self.family), iperf::PORT),
        };
        if self.case == Case::Translated {
            let physical = SocketAddr::new(self.topo.laptop_new_addr.get(self.family), port);
            translate_both(&self.laptop, &self.server, flow, physical)
                .context("installing the translation of iperf3's data connection")?;
        }
        let before = if self.vnat() {
            Some(self.check_attached()?)
        } else {
            None
        };

        let mut cmd = self.laptop.command("iperf3");
        cmd.args([
            "-c",
            &flow.remote.ip().to_string(),
            "-p",
            &iperf::PORT.to_string(),
        ])
        .args([
            "-B",
            &flow.local.ip().to_string(),
            "--cport",
            &port.to_string(),
        ])
        .args([
            "-t",
            &seconds.to_string(),
            "-J",
            "--connect-timeout",
            "5000",
        ]);
        if let Some(len) = len {
            // The overhead benchmark: sender on CPU 0, receiver on CPU 1.
            // Left to the scheduler, small writes on this 2-CPU machine
            // ran at 0.7 or 3 Gbit/s depending on where the two landed.
            cmd.args(["-l", &len.to_string(), "-A", "0,1"]);
        }
        let run = iperf::run_client(cmd, Duration::from_secs(seconds + 60))
            .with_context(|| format!("case {}, run {}", self.case.label(), index + 1))?;
        ensure!(
            run.local == flow.local && run.remote == flow.remote,
            "iperf3's data connection was {} -> {}, not {} -> {} as the benchmark expects",
            run.local,
            run.remote,
            flow.local,
            flow.remote
        );

        let min_packets =
            (self.case == Case::Translated).then(|| run.bytes_received.div_ceil(self.max_skb));
        let mut sample = Sample {
            run,
            deltas: None,
            min_packets,
        };
        if let Some((lap0, srv0)) = before {
            let lap = self.laptop.counters()?.since(&lap0);
            let srv = self.server.counters()?.since(&srv0);
            self.check_counters(&lap, &srv, min_packets.unwrap_or(0))?;
            sample.deltas = Some((lap, srv));
        }
        if self.case == Case::Translated {
            untranslate_both(&self.laptop, &self.server, flow)?;
        }
        Ok(sample)
    }

    /// Run `f` on the flow from the laptop's `port` to the server's
    /// `server_port`; in (c) that flow's translation is installed first and
    /// removed after, as for iperf3's data connection.
    pub(crate) fn with_flow<T>(
        &self,
        port: u16,
        server_port: u16,
        f: impl FnOnce(VirtualFlow) -> Result<T>,
    ) -> Result<T> {
        let flow = VirtualFlow {
            proto: Proto::Tcp,
            local: SocketAddr::new(self.topo.laptop_addr.get(self.family), port),
            remote: SocketAddr::new(self.topo.server_addr.get(self.family), server_port),
        };
        if self.case == Case::Translated {
            let physical = SocketAddr::new(self.topo.laptop_new_addr.get(self.family), port);
            translate_both(&self.laptop, &self.server, flow, physical)
                .context("installing the measured flow's translation")?;
        }
        let r = f(flow);
        if self.case == Case::Translated {
            untranslate_both(&self.laptop, &self.server, flow)?;
        }
        r
    }

    /// Both ends run vnat's tc programs on eth0, as the kernel reports
    /// them; returns their counters.
    pub(crate) fn check_attached(&self) -> Result<(Counters, Counters)> {
        for (who, h) in [("laptop", &self.laptop), ("server", &self.server)] {
            let (ingress, egress) = h.tcx_programs("eth0")?;
            ensure!(
                ingress.iter().any(|p| p == PROG_TC_INGRESS)
                    && egress.iter().any(|p| p == PROG_TC_EGRESS),
                "in case {} vnat's tc programs are not attached to the {who}'s eth0 \
                 (ingress: {ingress:?}, egress: {egress:?})",
                self.case.label()
            );
        }
        Ok((self.laptop.counters()?, self.server.counters()?))
    }

    /// The counters must show the case it claims to be.
    pub(crate) fn check_counters(
        &self,
        lap: &Counters,
        srv: &Counters,
        min_packets: u64,
    ) -> Result<()> {
        let label = self.case.label();
        for (who, c) in [("laptop", lap), ("server", srv)] {
            for d in DROPS {
                ensure!(
                    c.get(d) == 0,
                    "in case {label} the {who} dropped {} packets ({d})",
                    c.get(d)
                );
            }
        }
        match self.case {
            Case::Native => {}
            Case::Attached => {
                for (who, c) in [("laptop", lap), ("server", srv)] {
                    let n = c.get("egress_translated") + c.get("ingress_translated");
                    ensure!(
                        n == 0,
                        "in case {label} the {who} translated {n} packets of an untranslated flow"
                    );
                    // Control and data connection: the recorders ran for iperf3.
                    let rec = c.get("sockops_recorded");
                    ensure!(rec >= 2, "in case {label} sock_ops recorded {rec} of iperf3's 2 connections on the {who}");
                }
            }
            Case::Translated => {
                // Every data byte crossed laptop egress and server ingress in
                // skbs of at most max_skb bytes; fewer translated packets
                // than that would mean some went through untranslated.
                for (who, n) in [
                    ("laptop's egress", lap.get("egress_translated")),
                    ("server's ingress", srv.get("ingress_translated")),
                ] {
                    ensure!(
                        n >= min_packets,
                        "in case {label} the {who} translated {n} packets, fewer than the {min_packets} \
                         that carried the data: the flow was not translated"
                    );
                }
                for (who, n) in [
                    ("laptop's ingress", lap.get("ingress_translated")),
                    ("server's egress", srv.get("egress_translated")),
                ] {
                    ensure!(
                        n > 0,
                        "in case {label} the {who} translated no ACKs: the flow was not translated"
                    );
                }
            }
        }
        Ok(())
    }
}

/// Largest IFLA_GSO_MAX_SIZE / IFLA_GRO_MAX_SIZE of the two eth0.
pub(crate) fn max_skb(topo: &SameLink) -> Result<u64> {
    let mut max = 0;
    for ns in [&topo.laptop, &topo.server] {
        let eth0 = ns
            .link("eth0")
            .with_context(|| format!("no eth0 in netns {}", ns.name()))?;
        for size in [eth0.gso_max_size, eth0.gro_max_size] {
            max = max.max(u64::from(size.unwrap_or(0)));
        }
    }
    ensure!(max > 0, "the kernel reports no gso_max_size for eth0");
    Ok(max)
}
