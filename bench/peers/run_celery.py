"""One Celery run (peers venv): ``python -m bench.peers.run_celery``.

A fresh redis-server on loopback (no persistence) is broker and result backend;
``celery worker --pool prefork --concurrency N`` gives N worker processes. The
DAG runs level by level (tasks grouped by longest path from a root): each level
is a chord (a ``group`` of its tasks; consecutive single-task levels are one
``chain``) whose callback sends the next level's chord, so every message stays small (``--canvas
dynamic``, the default). ``--canvas static`` builds the one-shot canvas
``chain(group(level0), group(level1), ...)`` instead, which Celery also turns
into chords but which carries every later level inside each message: on
Montage it ran at 17 tasks/s with 1.1 GB of RSS. Levels are exact for the
chain, the independent tasks and the fully connected layered DAG; for the
WfCommons DAGs they add barriers (a task waits for its whole level above, not
only its parents), since one Celery task cannot be the header of two chords.
The latency figure still measures from a task's real parents.

Celery has no scheduler process: routing is done by the workers' consumers,
chords by the workers against the backend, and Redis holds queues and counters.
So "scheduler CPU" is everything: redis-server, the worker processes and this
client (the tasks are noops).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.peers import probe
from bench.peers.workloads import Dag, levels, load

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def canvas(dag: Dag, prefix: str):  # type: ignore[no-untyped-def]
    from celery import chain, group

    from bench.peers.celery_app import noop

    steps = []
    for lv in levels(dag):
        sigs = [noop.si(prefix + t) for t in lv]
        steps.append(sigs[0] if len(sigs) == 1 else group(sigs))
    return steps[0] if len(steps) == 1 else chain(*steps)


def start(dag: Dag, workload: str, smoke: bool, prefix: str, how: str):  # type: ignore[no-untyped-def]
    """Send the DAG; returns the result to wait on."""
    import uuid

    from celery.result import AsyncResult

    from bench.peers.celery_app import advance

    if how == "static":
        return canvas(dag, prefix).apply_async()
    final = f"{prefix}final-{uuid.uuid4()}"
    advance.si(workload, smoke, 0, prefix, final).apply_async()
    return AsyncResult(final)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit", type=float, default=180.0)
    ap.add_argument("--canvas", choices=["dynamic", "static"], default="dynamic",
                    help="dynamic: one chord per level whose callback sends the next level (default); "
                         "static: one chain(group, group, ...) canvas")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="bench-celery-"))
    probe_dir = tmp / "probe"
    probe_dir.mkdir()
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(tmp), "--loglevel", "warning"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    env = dict(os.environ, BENCH_REDIS_URL=url, BENCH_PROBE_DIR=str(probe_dir))
    os.environ.update(BENCH_REDIS_URL=url)
    worker = None
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "bench.peers.celery_app", "worker", "--pool", "prefork",
             "--concurrency", str(args.workers), "--loglevel", "WARNING", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "-n", f"bench{port}@%h"],
            cwd=ROOT, env=env, stdout=open(tmp / "worker.log", "w"), stderr=subprocess.STDOUT,  # noqa: SIM115
            start_new_session=True)
        start(load("warmup"), "warmup", False, "warm:", args.canvas).get(timeout=120)

        dag = load(args.workload, args.smoke)
        meter = probe.Meter(infra=[redis.pid]).start()
        t0 = time.perf_counter()
        status = "ok"
        try:
            start(dag, args.workload, args.smoke, "run:", args.canvas).get(timeout=args.limit, interval=0.005)
        except Exception as exc:  # celery.exceptions.TimeoutError
            status = "timeout" if "time" in type(exc).__name__.lower() else f"error: {exc!r}"[:300]
        dt = time.perf_counter() - t0
        m = meter.stop()
    finally:
        if worker is not None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        redis.terminate()
        redis.wait(10)
    runs = {t[4:]: v for t, v in probe.read_probes(probe_dir).items() if t.startswith("run:")}
    shutil.rmtree(tmp, ignore_errors=True)
    lat = probe.dependency_latencies_ms(dag, {t: v[0] for t, v in runs.items()}, {t: v[1] for t, v in runs.items()})
    done = len(dag) if status == "ok" else len(runs)
    total = m["own_cpu_s"] + m["infra_cpu_s"]
    exact = len({len(ps) for _, ps in dag}) <= 2 and args.workload != "montage" and args.workload != "epigenomics"
    probe.emit(probe.result(
        "celery", args.workload, dag, status=status, seconds=dt if status == "ok" else args.limit, done=done,
        meter=m, sched_cpu_s=total, lat_ms=lat, limit_s=args.limit, workers=args.workers,
        notes=f"prefork pool, {args.workers} processes; Redis broker+backend; "
              + ("one chain of per-level groups (chords)" if args.canvas == "static"
                 else "one chord per level, its callback sends the next level")
              + ("" if exact else ", level barriers added") + "; scheduler CPU = all processes incl. redis"),
        args.out)


if __name__ == "__main__":
    main()
