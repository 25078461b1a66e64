"""Fold CPU per allocator command type in the synthetic GPU day (issue 14 part 6: where the allocator's CPU goes).

Runs ``run_day`` (policy ours, with the flood) and adds up the thread CPU time of every command the fold
processes, per command type (RequestAllocation = submit, NodeHeartbeat, ReleaseAllocation = a job's report
of its end, AllocatorTimerFired, RegisterNode). Prints one JSON line: per type the count, total CPU and
mean µs, plus the day's CPU and decision p99, and the load average before and after.

    .venv/bin/python -m bench.alloc_cmd_cpu [--gpus 2000] [--jobs 20000] [--digest]

``--digest`` adds a hash of every record the fold emits (topic and JSON with sorted keys): equal
digests mean equal decisions, for CPU work on the fold. (Builds from before the package move, such as
0ad76f7, import the same modules as ``services.allocator``: measure them with a copy of ``run`` that does.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from typing import Any


def run(gpus: int, jobs: int, seed: int = 42, digest: bool = False) -> dict[str, Any]:
    from dagfold.services.allocator import sim_core
    from dagfold.services.allocator.sim_day import run_day

    per: dict[str, list[float]] = {}
    orig = sim_core.SimAllocator.process
    h = hashlib.sha256()

    def timed(self: Any, cmd: Any) -> Any:
        c = time.thread_time()
        out = orig(self, cmd)
        acc = per.setdefault(cmd["type"].rsplit(".", 1)[-1], [0, 0.0])
        acc[0] += 1
        acc[1] += time.thread_time() - c
        if digest:
            for o in out:
                h.update(o.topic.encode())
                h.update(json.dumps(o.record, sort_keys=True).encode())
        return out

    sim_core.SimAllocator.process = timed  # type: ignore[method-assign]
    try:
        before = os.getloadavg()
        r = run_day(gpus, jobs, seed, "ours", True)
        after = os.getloadavg()
    finally:
        sim_core.SimAllocator.process = orig  # type: ignore[method-assign]
    res = {"gpus": gpus, "jobs": jobs, "cpu_s": r["cpu_s"], "fold_cpu_s": r["fold_cpu_s"],
           "decision_p50_ms": r["decision_p50_ms"], "decision_p99_ms": r["decision_p99_ms"],
           "utilization": r["utilization"],
           "commands": {k: {"n": n, "cpu_s": round(s, 3), "us": round(s / n * 1e6, 1)}
                        for k, (n, s) in sorted(per.items())},
           "load_before": [round(x, 1) for x in before], "load_after": [round(x, 1) for x in after]}
    if digest:
        res["events_digest"] = h.hexdigest()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--digest", action="store_true", help="also hash every record the fold emits")
    a = ap.parse_args()
    print(json.dumps(run(a.gpus, a.jobs, a.seed, a.digest)))


if __name__ == "__main__":
    main()
