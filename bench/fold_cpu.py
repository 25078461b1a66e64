"""The scheduler fold's rate in two source trees, on process CPU time: before/after comparisons.

    python -m bench.fold_cpu BEFORE_TREE AFTER_TREE [--runs 5] [--out bench/results/runtime-fold.json]

Each run is a fresh ``python`` in one tree that runs that tree's own
``bench.limits.fold_limits(smoke=True)`` (the scheduler fold in memory, best of two rounds per
figure) with ``time.perf_counter`` replaced by ``time.process_time``: on a shared machine the
wall clock measures the neighbours, the process's CPU time much less so. Runs alternate between
the trees (before, after, before, ...); the result holds every run, the medians and the load
average (1 minute) before each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUN = (
    "import json, time\n"
    "time.perf_counter = time.process_time  # CPU time of this process, not the wall clock\n"
    "from bench.limits import fold_limits\n"
    "print(json.dumps({k: v['events_per_s'] for k, v in fold_limits(smoke=True).items()}))\n"
)


def run_once(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, "-c", RUN], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=1800, check=True)
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def git_head(tree: Path) -> str:
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    trees = {"before": a.before.resolve(), "after": a.after.resolve()}
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
    loads: list[float] = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for i in range(a.runs):
        for name, tree in trees.items():
            loads.append(os.getloadavg()[0])
            runs[name].append(run_once(tree))
            print(f"run {i + 1} {name}: " + ", ".join(f"{k} {v:,.0f}" for k, v in runs[name][-1].items()),
                  flush=True)
    figures = list(runs["before"][0])
    doc: dict[str, Any] = {
        "what": "bench.limits.fold_limits(smoke=True) per tree: the scheduler fold in memory, events/s, "
                "each figure the best of 2 rounds; runs alternate before/after (bench/fold_cpu.py)",
        "clock": "process CPU time (time.perf_counter replaced by time.process_time)",
        "started": started,
        "trees": {k: f"{v.name} at {git_head(v)}" for k, v in trees.items()},
        "load average (1 min) before each run": [round(x, 1) for x in loads],
        "medians": {f: {k: round(statistics.median(r[f] for r in runs[k])) for k in trees} for f in figures},
        "runs": {k: {f: [round(r[f]) for r in v] for f in figures} for k, v in runs.items()},
    }
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    print(text)
    if a.out is not None:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
