//! `cargo xtask bench tcprog`: what the tc translators cost one packet in
//! the kernel, without the network stack around them.
//!
//! The egress translator is run by BPF_PROG_TEST_RUN on a crafted TCP
//! frame, `--repeat` times per sample in the kernel, which reports its mean
//! time per run. Three states, for IPv4 and IPv6:
//!  - idle: nothing is translated on this host (the NAT maps are empty and
//!    the config says so), which is what an interface kept attached by
//!    `standby_tc` costs every packet until a connection moves;
//!  - miss: another flow is translated, this packet's is not: one parse
//!    and one hash lookup (the "(b)" case of the throughput benchmark);
//!  - hit: this packet's flow is translated: lookup, rewrite, checksums.
//!
//! The figures include the test-run harness's own overhead per run (the
//! same in every state), so differences between states are what matters.
//! Nothing here asserts on timing.

use std::process::ExitCode;

use anyhow::{ensure, Context, Result};
use clap::Parser;
use serde_json::json;
use vnat_bench::{env, stats::Summary};
use vnat_daemon::datapath::{
    kernel::{pair_for, testrun, KernelDatapath, KernelOptions},
    Datapath, Proto, Translation, VirtualFlow,
};
use vnat_tests::{packet::Spec, BpffsDir, Netns};

#[derive(Parser)]
#[command(
    about = "Per-packet cost of the tc translators (BPF_PROG_TEST_RUN), idle, missing and translating.",
    after_help = "Example: cargo xtask bench tcprog -- --samples 9 --repeat 2000000"
)]
struct Args {
    /// Samples per state and family; the median is reported.
    #[arg(long, default_value_t = 7)]
    samples: u32,
    /// Runs of the program in the kernel per sample.
    #[arg(long, default_value_t = 1_000_000)]
    repeat: u32,
    /// Print one JSON object (the table goes to stderr).
    #[arg(long)]
    json: bool,
}

const STATES: [&str; 3] = ["idle", "miss", "hit"];

fn main() -> ExitCode {
    vnat_bench::run_main("tcprog", || {
        let args = Args::parse();
        env::require_root("tcprog")?;
        ensure!(args.samples > 0, "--samples must be at least 1");
        vnat_bench::catch_interrupts();
        let ns = Netns::new("tcprog");
        let rows = ns.run_in(|| measure(&args))?;
        report(&args, &rows)
    })
}

/// One family's samples, per state, in nanoseconds per packet.
struct Row {
    family: &'static str,
    ns: Vec<Summary>,
}

fn translation(local: &str, remote: &str, physical_local: &str) -> Translation {
    Translation {
        flow: VirtualFlow {
            proto: Proto::Tcp,
            local: local.parse().unwrap(),
            remote: remote.parse().unwrap(),
        },
        physical_local: physical_local.parse().unwrap(),
        physical_remote: remote.parse().unwrap(),
    }
}

fn measure(args: &Args) -> Result<Vec<Row>> {
    let pins = BpffsDir::new("tcprog");
    let mut dp = KernelDatapath::open(&KernelOptions {
        bpffs: pins.path().to_path_buf(),
        cgroups: vec![],
        tc_attach: vnat_daemon::datapath::TcAttach::from_env().unwrap_or_default(),
        sysctl_record: None,
        tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
    })
    .context("opening the kernel datapath")?;
    let fd = dp.tc_program_fd(true)?;
    let families = [
        (
            "IPv4",
            translation("198.18.1.2:40000", "198.18.3.2:5001", "198.18.2.2:40000"),
            translation("198.18.1.2:40001", "198.18.3.2:5001", "198.18.2.2:40001"),
        ),
        (
            "IPv6",
            translation(
                "[fd00:5e:1::2]:40000",
                "[fd00:5e:3::2]:5001",
                "[fd00:5e:2::2]:40000",
            ),
            translation(
                "[fd00:5e:1::2]:40001",
                "[fd00:5e:3::2]:5001",
                "[fd00:5e:2::2]:40001",
            ),
        ),
    ];
    let mut rows = Vec::new();
    for (family, measured, other) in families {
        // As the local stack sends it: the virtual endpoints, with data.
        let mut spec = Spec::tcp(
            &measured.flow.local.to_string(),
            &measured.flow.remote.to_string(),
        );
        spec.payload = vec![0x5a; 64];
        let frame = spec.frame();
        let mut per_state = Vec::new();
        for state in STATES {
            match state {
                "idle" => {}
                "miss" => dp.insert_nat_pair(&pair_for(&other, 1, 0))?,
                _ => dp.insert_nat_pair(&pair_for(&measured, 1, 0))?,
            }
            let mut samples = Vec::new();
            for _ in 0..args.samples {
                ensure!(!vnat_bench::interrupted(), "interrupted");
                let (out, ns) =
                    testrun::run_repeated(fd, &frame, args.repeat).context("BPF_PROG_TEST_RUN")?;
                // The state is what it claims: only a hit changes the frame.
                ensure!(
                    (out.packet != frame) == (state == "hit"),
                    "{family} {state}: the frame was {}",
                    if out.packet != frame {
                        "rewritten"
                    } else {
                        "left alone"
                    }
                );
                samples.push(f64::from(ns));
            }
            per_state.push(Summary::of(&samples).expect("at least one sample"));
        }
        dp.remove_translation(&measured.flow)?;
        dp.remove_translation(&other.flow)?;
        ensure!(dp.translations()?.is_empty(), "translations left behind");
        rows.push(Row {
            family,
            ns: per_state,
        });
    }
    Ok(rows)
}

fn report(args: &Args, rows: &[Row]) -> Result<()> {
    let mut table = format!(
        "tc egress translator, ns per packet in the kernel (median of {} samples of {} runs; min-max)\n\n",
        args.samples, args.repeat
    );
    table += &format!("{:<6} {:>20} {:>20} {:>20}\n", "", "idle", "miss", "hit");
    for r in rows {
        table += &format!("{:<6}", r.family);
        for s in &r.ns {
            table += &format!(
                " {:>20}",
                format!("{:.0} ({:.0}-{:.0})", s.median, s.min, s.max)
            );
        }
        table += "\n";
    }
    table += "\nidle: nothing translated on the host (standby_tc's cost); miss: another flow translated; hit: this flow translated.\n";
    let report = json!({
        "benchmark": "tcprog",
        "machine": env::machine(None),
        "samples": args.samples,
        "repeat": args.repeat,
        "ns_per_packet": rows.iter().map(|r| {
            let states: serde_json::Map<String, serde_json::Value> = STATES
                .iter()
                .zip(&r.ns)
                .map(|(k, s)| (k.to_string(), json!(s)))
                .collect();
            (r.family.to_string(), serde_json::Value::Object(states))
        }).collect::<serde_json::Map<_, _>>(),
    });
    vnat_bench::emit("tcprog", args.json, &table, &report)
}
