"""One Dask distributed run of a workload with real durations (peers venv):
``python -m bench.peers.run_timed_dask``.

A ``LocalCluster`` of ``--workers`` worker processes x 1 thread; each job is one
low-level graph submitted at its ``at_s`` (``client.get(..., sync=False)``); a
task sleeps its scaled runtime and returns its own (start, end) times. See
``bench.peers.timed`` for the figures.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dask.distributed import Client, LocalCluster, wait

from bench.peers import probe, timed


def sleep_task(seconds: float, *upstream: object) -> tuple[float, float]:
    start = time.time()
    time.sleep(seconds)
    return start, time.time()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True, choices=sorted(timed.WORKLOADS))
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--limit", type=float, default=300.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=40)
    client = Client(cluster)
    try:
        warm = {f"warm-{i}": (sleep_task, 0.2) for i in range(4 * args.workers)}
        wait(client.get(warm, list(warm), sync=False), timeout=120)
        workload = timed.WORKLOADS[args.workload](args.workers)
        meter = probe.Meter().start()
        t0 = time.time()
        submitted: dict[str, float] = {}
        futures = {}
        for j in sorted(workload, key=lambda j: j.at_s):
            delay = t0 + j.at_s - time.time()
            if delay > 0:
                time.sleep(delay)
            p = f"{j.name}/"
            dsk = {p + t: (sleep_task, s, *(p + q for q in ps)) for t, ps, s in j.tasks}
            submitted[j.name] = time.time()
            keys = list(dsk)
            for k, f in zip(keys, client.get(dsk, keys, sync=False), strict=True):
                futures[(j.name, k[len(p):])] = f
        res = wait(list(futures.values()), timeout=max(t0 + args.limit - time.time(), 1.0))
        m = meter.stop()
        runs = {k: tuple(f.result()) for k, f in futures.items() if f.status == "finished"}
        out = timed.summarize(workload, args.workers, t0, submitted, runs)  # type: ignore[arg-type]
        probe.emit({"system": "dask", "workload": args.workload, "status": "ok" if not res.not_done else "timeout",
                    **out, "total_cpu_s": round(m["own_cpu_s"], 2),
                    "notes": f"LocalCluster, {args.workers} worker processes x 1 thread; a graph per job"}, args.out)
    finally:
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
