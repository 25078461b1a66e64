"""`make bench-peers`, part 2: workloads with real durations on dagfold-embedded, dagfold-Kafka and Dask.

    python -m bench.peers.durations [--repeat 1] [--workers 4] [--workloads ...] [--systems ...]

Each run is its own process (``run_timed_dagfold`` in dagfold's venv, ``run_timed_dask`` in the
peers' venv), one after the other, with the same worker count; a Kafka broker is started on
loopback for dagfold-Kafka. Prints one table (makespan / lower bound, short tasks' p99 wait;
medians over the repeats) with the load average, and writes bench/results/peers-durations.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peers.timed import WORKLOADS
from dagfold.localkafka import LocalKafka, free_base_port

ROOT = Path(__file__).resolve().parents[2]
PEERS_PY = ROOT / ".cache" / "peers-venv" / "bin" / "python"
SYSTEMS = ["dagfold-embedded", "dagfold-kafka", "dask"]


def run_one(system: str, workload: str, workers: int, kafka_url: str | None, limit: float) -> dict[str, Any]:
    if system == "dask":
        cmd = [str(PEERS_PY), "-m", "bench.peers.run_timed_dask"]
    else:
        cmd = [sys.executable, "-m", "bench.peers.run_timed_dagfold", "--log",
               kafka_url if system == "dagfold-kafka" and kafka_url else "embedded"]
    cmd += ["--workload", workload, "--workers", str(workers), "--limit", str(limit)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit + 180)
    except subprocess.TimeoutExpired:
        return {"system": system, "workload": workload, "status": "timeout"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"system": system, "workload": workload, "status": f"error: {p.stderr.strip()[-300:]}"}
    return dict(json.loads(lines[-1]))


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in runs if r.get("status") == "ok" and r.get(key) is not None]
    return round(statistics.median(xs), 3) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--limit", type=float, default=300.0)
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument("--systems", nargs="*", default=SYSTEMS)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peers-durations.json")
    args = ap.parse_args()

    broker: LocalKafka | None = None
    data = Path(tempfile.mkdtemp(prefix="bench-durations-kafka-"))
    if "dagfold-kafka" in args.systems:
        broker = LocalKafka(free_base_port(range(29192, 30000, 100)), data).start()
    load_before = os.getloadavg()
    runs: list[dict[str, Any]] = []
    try:
        for rep in range(args.repeat):
            for wl in args.workloads:
                for system in args.systems:
                    r = run_one(system, wl, args.workers, broker.url if broker else None, args.limit)
                    r["repeat"] = rep
                    runs.append(r)
                    print(json.dumps(r), flush=True)
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(data, ignore_errors=True)
    load_after = os.getloadavg()
    table = []
    for wl in args.workloads:
        for system in args.systems:
            mine = [r for r in runs if r["system"] == system and r["workload"] == wl]
            table.append({"workload": wl, "system": system, "runs": len(mine),
                          "ok": sum(r.get("status") == "ok" for r in mine),
                          **{k: median_of(mine, k) for k in ("makespan_s", "lower_bound_s", "makespan_over_bound",
                                                             "short_wait_p50_s", "short_wait_p99_s", "total_cpu_s")}})
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "workers": args.workers,
              "repeat": args.repeat, "loadavg_before": load_before, "loadavg_after": load_after,
              "cpus": os.cpu_count(), "table": table, "runs": runs}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nworkloads with real durations, {args.workers} workers, medians of {args.repeat}; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs)")
    print(f"{'workload':<18} {'system':<17} {'makespan s':>10} {'bound s':>8} {'ratio':>6} {'short p50 s':>11} "
          f"{'short p99 s':>11}")
    for t in table:
        print(f"{t['workload']:<18} {t['system']:<17} {t['makespan_s']!s:>10} {t['lower_bound_s']!s:>8} "
              f"{t['makespan_over_bound']!s:>6} {t['short_wait_p50_s']!s:>11} {t['short_wait_p99_s']!s:>11}")


if __name__ == "__main__":
    main()
