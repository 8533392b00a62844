#!/usr/bin/env python3
"""Draw the PNG plots of one benchmark from its JSON result.

    python3 bench/plot.py NAME RESULTS_DIR

reads RESULTS_DIR/NAME.json (written by `cargo xtask bench NAME`) and writes
RESULTS_DIR/NAME*.png. `cargo xtask bench` runs it after every benchmark.
Every number drawn comes from the JSON; the paper's figures are drawn only
where the JSON carries them.
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CASES = [("native", "(a) no vnat"), ("attached", "(b) vnat, not translated"), ("translated", "(c) translated")]


def med(v):
    return v.get("median") if isinstance(v, dict) else v


def rng(v):
    if isinstance(v, dict) and "min" in v and "max" in v:
        return v["median"] - v["min"], v["max"] - v["median"]
    return 0.0, 0.0


def save(fig, out_dir, name):
    path = os.path.join(out_dir, name + ".png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print("wrote", path)


def lines_by_size(ax, result, kind, field, ylabel, cases=CASES):
    for key, label in cases:
        rows = result.get(kind, {}).get(key, {}).get("by_size", [])
        rows = [r for r in rows if r.get(field) is not None]
        if not rows:
            continue
        xs = [r["size"] for r in rows]
        ys = [med(r[field]) for r in rows]
        lo = [rng(r[field])[0] for r in rows]
        hi = [rng(r[field])[1] for r in rows]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()


def overhead(r, out):
    specs = [
        ("overhead-throughput", "throughput_gbps", [("value", "throughput (Gbit/s)")], "Throughput (paper Fig. 6-1)"),
        ("overhead-throughput-cpu", "throughput_gbps",
         [("client_cpu_percent", "sender CPU (% of one CPU)"), ("server_cpu_percent", "receiver CPU (% of one CPU)")],
         "Throughput CPU use (paper Fig. 6-2)"),
        ("overhead-latency", "latency_us", [("value", "mean latency (µs, half RTT)"), ("p99", "99th percentile (µs)")],
         "Request/response latency (paper Fig. 6-3)"),
        ("overhead-latency-cpu", "latency_us",
         [("client_cpu_percent", "client CPU (%)"), ("server_cpu_percent", "server CPU (%)")],
         "Latency CPU use (paper Fig. 6-4)"),
        ("overhead-setup", "setup_per_s", [("value", "connections per second")],
         "Connection setup (paper Fig. 6-5)"),
    ]
    for name, kind, fields, title in specs:
        # A kind left out (`--only`) has no rows: no plot, rather than an
        # empty one over the last full run's.
        if not any(c.get("by_size") for c in r.get(kind, {}).values()):
            print(f"{name}: not measured in this run, not drawn")
            continue
        fig, axes = plt.subplots(1, len(fields), figsize=(6 * len(fields), 4.2), squeeze=False)
        for ax, (field, ylabel) in zip(axes[0], fields):
            lines_by_size(ax, r, kind, field, ylabel)
        fig.suptitle(title)
        save(fig, out, name)


def throughput(r, out):
    cases = r.get("cases", {})
    keys = [k for k, _ in CASES if k in cases]
    fig, ax = plt.subplots(figsize=(6, 4))
    ys = [med(cases[k]["gbit_per_s"]) for k in keys]
    err = [[rng(cases[k]["gbit_per_s"])[0] for k in keys], [rng(cases[k]["gbit_per_s"])[1] for k in keys]]
    ax.bar([cases[k].get("label", k) for k in keys], ys, yerr=err, capsize=4)
    ax.set_ylabel("iperf3 throughput (Gbit/s)")
    ax.set_title("Bulk TCP throughput over veth (median, min-max)")
    plt.setp(ax.get_xticklabels(), rotation=10)
    save(fig, out, "throughput")


def restore(r, out):
    rows = r.get("results", [])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [row["conns"] for row in rows if med(row.get("total_s")) is not None]
    ys = [med(row["total_s"]) for row in rows if med(row.get("total_s")) is not None]
    paper = r.get("paper", [])
    for ax, key, ylabel in ((axes[0], "total_s", "time until every connection carries data (s)"),
                            (axes[1], "per_conn_ms", "per connection (ms)")):
        vals = [(row["conns"], med(row.get(key))) for row in rows if med(row.get(key)) is not None]
        if vals:
            ax.plot([v[0] for v in vals], [v[1] for v in vals], "o-", label="vnat (this repository)")
        if paper:
            ax.plot([p["conns"] for p in paper], [p[key] for p in paper], "s--", label="VNAT paper, Table 1")
        targets = r.get("targets", {})
        if key == "total_s" and targets:
            tx = [500, 10000]
            ty = [targets.get("500_conns_total_s"), targets.get("10000_conns_total_s")]
            if None not in ty:
                ax.plot(tx, ty, "r^", label="targets (issue 5)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("connections")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    del xs, ys
    fig.suptitle("Restoring N connections after the client moves (RTT %s ms)" % r.get("rtt_target_ms"))
    save(fig, out, "restore")


def handover(r, out):
    sweep = r.get("sweep")
    if sweep:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        series = {}
        for row in sweep:
            key = (row.get("movers", "one"), row["outage_s"])
            series.setdefault(key, []).append((row["rtt_ms"], med(row.get("handover_ms"))))
        for (movers, outage), pts in sorted(series.items()):
            pts = sorted(p for p in pts if p[1] is not None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="%s end(s) moving, outage %s s" % (movers, outage))
        rtts = sorted({row["rtt_ms"] for row in sweep})
        if any(row.get("movers", "one") == "one" for row in sweep):
            ax.plot(rtts, [x + 10 for x in rtts], "k:", label="target: RTT + 10 ms (one end)")
        both = {row["rtt_ms"]: row["target_ms"] for row in sweep if row.get("movers") == "both"}
        if both:
            xs = sorted(both)
            ax.plot(xs, [both[x] for x in xs], "k--", label="target: 2 RTT + location-server RTT (both)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("RTT (ms)")
        ax.set_ylabel("handover (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title("Handover against RTT and outage")
        save(fig, out, "handover-sweep")
    scen = r.get("scenarios", {})
    if scen:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        labels, ys, lo, hi = [], [], [], []
        for key, s in scen.items():
            v = s.get("handover_ms")
            if med(v) is None:
                continue
            labels.append(s.get("label", key))
            ys.append(med(v))
            lo.append(rng(v)[0])
            hi.append(rng(v)[1])
        ax.bar(labels, ys, yerr=[lo, hi], capsize=4, label="handover (median, min-max)")
        # Each bar's own target (one end and both ends differ).
        targets = [s.get("target_ms") for s in scen.values() if med(s.get("handover_ms")) is not None]
        for i, t in enumerate(targets):
            if t:
                ax.hlines(t, i - 0.4, i + 0.4, colors="r", linestyles=":", label="target" if i == 0 else None)
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title("Handover at %s ms RTT" % r.get("rtt_target_ms"))
        save(fig, out, "handover")


def vcmp(r, out):
    fig, ax = plt.subplots(figsize=(7, 4))
    names = ["cpu_us_per_record", "local_us_per_record", "verify_full_datagram_us"]
    vals = [r.get(n) for n in names]
    ax.bar(names, [v or 0 for v in vals])
    for n, t in r.get("targets", {}).items():
        if n in names:
            ax.plot([names.index(n)], [t], "r_", markersize=30)
    ax.set_ylabel("µs")
    ax.set_title("VCMP cost for %s connections (red: targets)" % r.get("connections"))
    save(fig, out, "vcmp")


def scale(r, out):
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    times = r.get("times_s", {})
    axes[0].bar(list(times.keys()), [med(v) or 0 for v in times.values()])
    axes[0].set_ylabel("seconds")
    axes[0].set_yscale("log")
    axes[0].set_title("%s connections: times (log scale)" % r.get("conns"))
    plt.setp(axes[0].get_xticklabels(), rotation=30, ha="right")
    mem = r.get("memory_mib", {})
    axes[1].bar(list(mem.keys()), list(mem.values()))
    axes[1].set_ylabel("MiB")
    axes[1].set_title("memory")
    plt.setp(axes[1].get_xticklabels(), rotation=15)
    save(fig, out, "scale")


def tcprog(r, out):
    fig, ax = plt.subplots(figsize=(7, 4))
    fams = r.get("ns_per_packet", {})
    states = ["idle", "miss", "hit"]
    width = 0.8 / max(len(fams), 1)
    for i, (fam, by_state) in enumerate(fams.items()):
        xs = [k + i * width for k in range(len(states))]
        ys = [med(by_state.get(s)) or 0 for s in states]
        errs = [rng(by_state.get(s)) for s in states]
        ax.bar(xs, ys, width, yerr=[[e[0] for e in errs], [e[1] for e in errs]], capsize=3, label=fam)
    ax.set_xticks([k + width * (len(fams) - 1) / 2 for k in range(len(states))])
    ax.set_xticklabels(["idle (nothing translated)", "miss (another flow)", "hit (this flow)"])
    ax.set_ylabel("ns per packet")
    ax.legend()
    ax.set_title("tc egress translator in the kernel (BPF_PROG_TEST_RUN)")
    save(fig, out, "tcprog")


def criu(r, out):
    fig, ax = plt.subplots(figsize=(8, 4))
    cases = r.get("cases") or []
    for i, c in enumerate(cases):
        samples = (c.get("freeze_ms") or {}).get("samples", [])
        ax.scatter([i] * len(samples), samples, alpha=0.5)
        ax.plot([i - 0.2, i + 0.2], [c.get("freeze_p50_ms") or 0] * 2, "k-")
        ax.plot([i - 0.2, i + 0.2], [c.get("freeze_p99_ms") or 0] * 2, "k:")
    ref = r.get("reference", {})
    for key, style in (("podmotion_median_ms", "--"), ("podmotion_p99_ms", ":")):
        if key in ref:
            ax.axhline(ref[key], color="r", linestyle=style, label=key.replace("_ms", "").replace("_", " "))
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.get("case", "?") for c in cases])
    ax.set_ylabel("freeze seen by the client, ms")
    ax.legend()
    where = "images over the network" if r.get("images_over_network") else "local images"
    ax.set_title("CRIU %s migration, %s runs per case, %s (black: p50, dotted: p99)" % (r.get("criu"), r.get("runs"), where))
    save(fig, out, "criu")


PLOTS = {
    "overhead": overhead,
    "throughput": throughput,
    "restore": restore,
    "handover": handover,
    "vcmp": vcmp,
    "scale": scale,
    "tcprog": tcprog,
    "criu": criu,
}


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: plot.py NAME RESULTS_DIR")
    name, out = sys.argv[1], sys.argv[2]
    if name not in PLOTS:
        sys.exit("plot.py: no plots are defined for the benchmark %r (known: %s)" % (name, ", ".join(PLOTS)))
    path = os.path.join(out, name + ".json")
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as e:
        sys.exit("plot.py: cannot read %s: %s" % (path, e))
    PLOTS[name](result, out)


if __name__ == "__main__":
    main()
