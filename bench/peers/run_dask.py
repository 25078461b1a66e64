"""One Dask distributed run (peers venv): ``python -m bench.peers.run_dask``.

A ``LocalCluster`` with ``--workers`` worker processes of one thread each; the
whole DAG is one low-level graph ``{task: (noop, task, *upstream)}`` submitted in
one call (``client.get(..., sync=False)``, Dask's cheapest path), and the clock
stops when every sink's future is done.

* scheduler CPU: the client+scheduler process minus its main (client) thread,
  i.e. the event-loop thread (scheduler and client comms share it) and the
  offload thread that unpacks graphs;
* total CPU: the client+scheduler process, the nannies and the workers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from dask.distributed import Client, LocalCluster, wait

from bench.peers import probe
from bench.peers.tasks import noop
from bench.peers.workloads import Dag, load


def graph(dag: Dag, prefix: str) -> tuple[dict[str, tuple], list[str]]:
    has_down = {p for _, ps in dag for p in ps}
    # the task id argument must not equal a key (Dask would read it as a dependency)
    dsk = {prefix + t: (noop, prefix.replace("-", ":") + t, *(prefix + p for p in ps)) for t, ps in dag}
    return dsk, [prefix + t for t, _ in dag if t not in has_down]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit", type=float, default=180.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    probe_dir = Path(tempfile.mkdtemp(prefix="bench-dask-probe-"))
    os.environ["BENCH_PROBE_DIR"] = str(probe_dir)
    cluster = LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True,
                           dashboard_address=None, silence_logs=40)
    client = Client(cluster)
    try:
        dsk, sinks = graph(load("warmup"), "warm-")
        wait(client.get(dsk, sinks, sync=False), timeout=120)

        dag = load(args.workload, args.smoke)
        dsk, sinks = graph(dag, "run-")
        main_tid = threading.main_thread().native_id
        assert main_tid is not None
        pid = os.getpid()
        sched0 = probe.proc_cpu_s(pid) - probe.thread_cpu_s(pid, main_tid)
        meter = probe.Meter().start()
        t0 = time.perf_counter()
        futs = client.get(dsk, sinks, sync=False)
        res = wait(futs, timeout=args.limit, return_when="ALL_COMPLETED")
        dt = time.perf_counter() - t0
        m = meter.stop()
        sched = probe.proc_cpu_s(pid) - probe.thread_cpu_s(pid, main_tid) - sched0
        status = "ok" if not res.not_done and all(f.status == "finished" for f in futs) else "timeout"
    except TimeoutError:
        dt, status = args.limit, "timeout"
        m = meter.stop()
        sched = probe.proc_cpu_s(pid) - probe.thread_cpu_s(pid, main_tid) - sched0
    finally:
        client.close()
        cluster.close()
    runs = {t[4:]: v for t, v in probe.read_probes(probe_dir).items() if t.startswith("run:")}
    lat = probe.dependency_latencies_ms(dag, {t: v[0] for t, v in runs.items()}, {t: v[1] for t, v in runs.items()})
    done = len(dag) if status == "ok" else len(runs)
    probe.emit(probe.result("dask", args.workload, dag, status=status, seconds=dt if status == "ok" else args.limit,
                            done=done, meter=m, sched_cpu_s=sched, lat_ms=lat, limit_s=args.limit,
                            workers=args.workers,
                            notes=f"LocalCluster, {args.workers} worker processes x 1 thread; one low-level graph; "
                                  "scheduler CPU = client+scheduler process minus its main thread"),
               args.out)


if __name__ == "__main__":
    main()
