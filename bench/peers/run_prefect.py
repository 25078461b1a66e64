"""One Prefect 3 run (peers venv): ``python -m bench.peers.run_prefect``.

Prefect as it comes: no server configured, so it starts its ephemeral API
server (a subprocess) on its default database, SQLite under ``PREFECT_HOME``
(a fresh temporary folder per run), and the flow's default task runner
(``ThreadPoolTaskRunner``). One flow submits every task with
``task.submit(..., wait_for=[upstream futures])`` in topological order and
waits for all of them.

Prefect has no separate scheduler: the flow process (its task-run engine in
threads) and the API server do the orchestration, and the tasks are noops, so
"scheduler CPU" is all CPU: this process and the server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

_home = Path(tempfile.mkdtemp(prefix="bench-prefect-"))
os.environ.setdefault("PREFECT_HOME", str(_home))
os.environ.setdefault("BENCH_PROBE_DIR", str(_home / "probe"))
# the server's start-up wait (default 20 s) is too short on a loaded 2-core machine; no effect on speed
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
(_home / "probe").mkdir(exist_ok=True)

from prefect import flow, task  # noqa: E402
from prefect.futures import wait  # noqa: E402

from bench.peers import probe  # noqa: E402
from bench.peers.tasks import noop  # noqa: E402
from bench.peers.workloads import Dag, load  # noqa: E402


@task(name="noop")
def p_noop(task_id: str) -> None:
    noop(task_id)


@flow(name="bench-dag")
def dag_flow(workload: str, smoke: bool, prefix: str) -> int:
    # the DAG is built inside the flow: as a parameter, the layered one is over the API's size limit
    dag: Dag = load(workload, smoke)
    futs: dict[str, Any] = {}
    for t, ps in dag:
        futs[t] = p_noop.submit(prefix + t, wait_for=[futs[p] for p in ps])
    wait(list(futs.values()))
    return len(futs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--workers", type=int, default=2, help="recorded only: Prefect runs tasks in its thread pool")
    ap.add_argument("--limit", type=float, default=180.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    probe_dir = Path(os.environ["BENCH_PROBE_DIR"])

    dag_flow("warmup", False, "warm:")
    dag = load(args.workload, args.smoke)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["n"] = dag_flow(args.workload, args.smoke, "run:")
        except BaseException as exc:  # noqa: BLE001
            box["error"] = exc

    meter = probe.Meter().start()
    t0 = time.perf_counter()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(args.limit)
    dt = time.perf_counter() - t0
    m = meter.stop()
    if th.is_alive():
        status = "timeout"
    elif "error" in box:
        status = f"error: {box['error']!r}"[:300]
    else:
        status = "ok"
    runs = {t[4:]: v for t, v in probe.read_probes(probe_dir).items() if t.startswith("run:")}
    lat = probe.dependency_latencies_ms(dag, {t: v[0] for t, v in runs.items()}, {t: v[1] for t, v in runs.items()})
    done = len(dag) if status == "ok" else len(runs)
    total = m["own_cpu_s"] + m["infra_cpu_s"]
    probe.emit(probe.result(
        "prefect", args.workload, dag, status=status, seconds=dt if status == "ok" else args.limit, done=done,
        meter=m, sched_cpu_s=total, lat_ms=lat, limit_s=args.limit, workers=args.workers,
        notes="ephemeral API server on SQLite (defaults), ThreadPoolTaskRunner; scheduler CPU = all processes"),
        args.out)
    sys.stdout.flush()
    # A timed-out flow keeps threads busy, so leave with os._exit, and end the ephemeral API
    # server first (it would outlive this process and keep its stdout open).
    for pid in probe.descendants(os.getpid())[1:]:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    shutil.rmtree(_home, ignore_errors=True)
    os._exit(0)


if __name__ == "__main__":
    main()
