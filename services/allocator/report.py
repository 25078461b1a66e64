"""Tables and matplotlib plots of simulator results (for docs/gpu-scheduling.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

OURS_LABEL = {"frag": "dagfold frag (ours)", "bestfit": "dagfold best-fit", "firstfit": "dagfold first-fit (FIFO)",
              "ours": "dagfold (ours)", "fifo": "FIFO, no backfill"}


def fgd_table(result: dict[str, Any]) -> str:
    """Markdown: mean unallocated GPU % at 100% arrival, per trace, ours and the paper's six policies."""
    lines = []
    for trace, tr in result["traces"].items():
        lines.append(f"**{trace}** (mean over seeds {result['seeds'][0]}-{result['seeds'][-1]}; lower is better)\n")
        lines.append("| policy | source | unallocated GPU % at 100% arrival | stdev |")
        lines.append("|---|---|---:|---:|")
        rows = [(v["unallocated_pct_at_100"], OURS_LABEL.get(k, k), "dagfold sim", v["unallocated_pct_at_100_stdev"])
                for k, v in tr["policies"].items()]
        rows += [(v["unallocated_pct_at_100"], k, "FGD paper", v["unallocated_pct_at_100_stdev"])
                 for k, v in tr["paper"].items()]
        for un, name, src, sd in sorted(rows):
            lines.append(f"| {name} | {src} | {un:.2f} | {sd:.2f} |")
        lines.append("")
    return "\n".join(lines)


def plot_fgd(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for trace, tr in result["traces"].items():
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
        xs = list(range(131))
        for k, v in tr["paper"].items():
            ax1.plot(xs, v["alloc_ratio"], "--", lw=1, label=f"paper {k}")
        for k, v in tr["policies"].items():
            ax1.plot(xs, v["alloc_ratio_mean"], lw=2, label=OURS_LABEL.get(k, k))
        ax1.plot(xs, xs, ":", color="grey", lw=0.8)
        ax1.set_xlim(70, 130)
        ax1.set_ylim(70, 100)
        ax1.set_xlabel("arrived GPU request (% of capacity)")
        ax1.set_ylabel("allocated GPU (% of capacity)")
        ax1.set_title(f"openb {trace}: allocation ratio (mean of seeds)")
        ax1.legend(fontsize=7, loc="lower right")
        names = [OURS_LABEL.get(k, k) for k in tr["policies"]] + [f"paper {k}" for k in tr["paper"]]
        vals = [v["unallocated_pct_at_100"] for v in tr["policies"].values()] + \
               [v["unallocated_pct_at_100"] for v in tr["paper"].values()]
        colors = ["tab:green"] * len(tr["policies"]) + ["tab:grey"] * len(tr["paper"])
        ax2.barh(names, vals, color=colors)
        for i, v in enumerate(vals):
            ax2.text(v, i, f" {v:.2f}", va="center", fontsize=8)
        ax2.invert_yaxis()
        ax2.set_xlabel("unallocated GPU % at 100% arrival (lower is better)")
        ax2.set_title("fragmentation at 100% arrival")
        fig.tight_layout()
        p = out_dir / f"gpu-fgd-{trace}.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def plot_openb(result: dict[str, Any], out_dir: Path, suffix: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    for k, v in result["policies"].items():
        pts = v["utilization_over_time"]
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], label=OURS_LABEL.get(k, k))
    ax.set_xlabel("trace day")
    ax.set_ylabel("allocated GPU (% of capacity)")
    scale = result.get("time_scale", 1.0)
    ax.set_title("openb replay: GPU allocation over time" + (f" (arrivals {scale:g}x faster)" if scale != 1 else ""))
    ax.legend()
    fig.tight_layout()
    p = out_dir / f"gpu-openb-utilization{suffix}.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def plot_day(result: dict[str, Any], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    runs = {"ours": result, **result.get("baselines", {})}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for k, v in runs.items():
        pts = v.get("utilization_over_time", [])
        ax1.plot([p[0] for p in pts], [100 * p[1] for p in pts], label=OURS_LABEL.get(k, k))
    ax1.set_xlabel("hour")
    ax1.set_ylabel("allocated GPU (%)")
    ax1.set_title("synthetic day: GPU allocation")
    ax1.legend()
    tiers = ["enterprise", "standard", "free"]
    width = 0.8 / len(runs)
    for i, (k, v) in enumerate(runs.items()):
        vals = [(v["wait_p99_s"].get(t) or 0) / 60 for t in tiers]
        ax2.bar([x + i * width for x in range(len(tiers))], vals, width, label=OURS_LABEL.get(k, k))
    ax2.set_xticks([x + width * (len(runs) - 1) / 2 for x in range(len(tiers))], tiers)
    ax2.set_yscale("symlog")
    ax2.set_ylabel("p99 wait (min)")
    ax2.set_title("p99 wait to first start, per tier")
    ax2.legend()
    fig.tight_layout()
    p = out_dir / "gpu-day.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def day_table(result: dict[str, Any]) -> str:
    """Markdown: the synthetic day, ours and the baselines side by side."""
    runs = {"ours": result, **result.get("baselines", {})}
    rows = [("utilization (GPU allocated, after warm-up)", lambda r: f"{100 * r['utilization']:.1f}%"),
            ("wait p50 / p99, enterprise (s)",
             lambda r: f"{r['wait_p50_s']['enterprise']:.0f} / {r['wait_p99_s']['enterprise']:.0f}"),
            ("wait p50 / p99, standard (s)",
             lambda r: f"{r['wait_p50_s']['standard']:.0f} / {r['wait_p99_s']['standard']:.0f}"),
            ("wait p50 / p99, free (s)", lambda r: f"{r['wait_p50_s']['free']:.0f} / {r['wait_p99_s']['free']:.0f}"),
            ("small tenant wait p99 (s)", lambda r: f"{r['small_tenant_wait_p99_s']:.0f}"),
            ("flood tenant wait p50 (s)", lambda r: f"{r['flood_tenant_wait_p50_s']:.0f}"),
            ("Jain fairness (backlogged tenants, per tier)", lambda r: f"{r['jain_fairness']:.3f}"),
            ("preemptions (by a higher tier)", lambda r: str(r["preemptions"])),
            ("jobs moved off drained/lost hosts", lambda r: str(r["drain_moves"] + r["allocation_expired"])),
            ("work lost (GPU-hours)", lambda r: f"{r['lost_work_gpu_h']}"),
            ("reservation wait p50 / p99 (s)",
             lambda r: "-" if r["reservation_wait_p99_s"] is None else
             f"{r['reservation_wait_p50_s']:.0f} / {r['reservation_wait_p99_s']:.0f}"),
            ("jobs completed / never started", lambda r: f"{r['jobs_completed']} / {r['jobs_never_started']}"),
            ("decisions/s (fold CPU)", lambda r: f"{r['decisions_per_s']:.0f}"),
            ("decision p50 / p99, CPU (ms)", lambda r: f"{r['decision_p50_ms']:.3f} / {r['decision_p99_ms']:.3f}"),
            ("decision p99, wall (ms)", lambda r: f"{r['decision_wall_p99_ms']:.3f}"),
            ("simulated day: CPU / wall (s)", lambda r: f"{r['cpu_s']:.0f} / {r['wall_s']:.0f}")]
    lines = ["| metric | " + " | ".join(OURS_LABEL.get(k, k) for k in runs) + " |",
             "|---|" + "---:|" * len(runs)]
    for name, f in rows:
        lines.append(f"| {name} | " + " | ".join(f(r) for r in runs.values()) + " |")
    return "\n".join(lines)


def openb_table(result: dict[str, Any]) -> str:
    lines = ["| policy | pods | GPU allocated, mean / max (busy window) | queue delay p50 / p99 (s) | "
             "pods that queued | JCT p50 / p99 (s) | decision p99 CPU (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for k, r in result["policies"].items():
        lines.append(f"| {OURS_LABEL.get(k, k)} | {r['pods']} | {100 * r['utilization_mean']:.2f}% / "
                     f"{100 * r['utilization_max']:.2f}% | {r['queue_delay_p50_s']} / {r['queue_delay_p99_s']} | "
                     f"{r['queued_at_all']} | {r['jct_p50_s']:.0f} / {r['jct_p99_s']:.0f} | {r['decision_p99_ms']} |")
    return "\n".join(lines)


def sweep_table(result: dict[str, Any]) -> str:
    """Markdown: the synthetic day at each offered load, every policy a row."""
    lines = ["| offered | policy | utilization | wait p50 / p99 enterprise (s) | wait p50 / p99 standard (s) | "
             "wait p50 / p99 free (s) | JCT p50 / p99 (s) | preemptions | lost GPU-h | Jain | never started | "
             "decision p99 CPU (ms) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def w(r: dict[str, Any], tier: str) -> str:
        a, b = r["wait_p50_s"].get(tier), r["wait_p99_s"].get(tier)
        return "-" if a is None or b is None else f"{a:.0f} / {b:.0f}"

    for entry in result["loads"].values():
        for pol, r in entry["policies"].items():
            jain = "-" if r["jain_fairness"] is None else f"{r['jain_fairness']:.3f}"
            lines.append(f"| {100 * r['offered_load']:.0f}% | {OURS_LABEL.get(pol, pol)} | "
                         f"{100 * r['utilization']:.1f}% | {w(r, 'enterprise')} | {w(r, 'standard')} | "
                         f"{w(r, 'free')} | {r['jct_p50_s']:.0f} / {r['jct_p99_s']:.0f} | {r['preemptions']} | "
                         f"{r['lost_work_gpu_h']} | {jain} | {r['jobs_never_started']} | {r['decision_p99_ms']:.3f} |")
    return "\n".join(lines)
