"""One dagfold run of a workload with real durations (main venv): ``python -m bench.peers.run_timed_dagfold``.

The stack (scheduler, projector, ``--workers`` worker threads; no API) on the
embedded log or on Kafka; every task is the built-in ``sleep`` handler for its
scaled runtime, so it takes the real path (TaskStarted flushed, heartbeats,
outcome). Jobs are submitted at their ``at_s``; starts and ends are the
workers' TaskStarted and TaskSucceeded times read back from the commands topic.
See ``bench.peers.timed`` for the figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.peers import probe, timed
from bench.peers.run_dagfold import read_reports
from dagfold.commands import submit_job
from dagfold.config import Config
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.services.stack import Stack, StackOptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True, choices=sorted(timed.WORKLOADS))
    ap.add_argument("--log", default="embedded", help="embedded or kafka://HOST:PORT")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--limit", type=float, default=300.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    kafka = args.log.startswith("kafka://")
    system = "dagfold-kafka" if kafka else "dagfold-embedded"
    data = Path(tempfile.mkdtemp(prefix="bench-timed-"))
    cfg = Config.from_env(log_url=args.log, data_dir=data)
    stack = Stack(cfg, StackOptions(workers=args.workers, api=False, callbacks=False)).start()
    try:
        if not stack.runner.ready.wait(120):
            raise RuntimeError("scheduler got no partitions")
        run_id = f"{os.getpid()}-{int(time.time() * 1000)}"
        # warm-up: every worker has joined the queue group and run a task
        warm = to_job_spec(parse_spec({"id": f"warmup-{run_id}", "tasks": [
            {"id": f"w{i}", "handler": "sleep", "args": {"seconds": 0.2}} for i in range(4 * args.workers)]}))
        stack.sender.send(submit_job(warm, source="bench"))
        w = stack.wait_job(warm["job_id"], timeout_s=120, poll_s=0.01)
        if w is None or w["state"] != "succeeded":
            raise RuntimeError(f"warm-up job did not succeed: {w}")

        workload = timed.WORKLOADS[args.workload](args.workers)
        ids = {j.name: f"{j.name}-{run_id}" for j in workload}
        specs = {j.name: to_job_spec(parse_spec({"id": ids[j.name], "tenant": j.tenant, "tasks": [
            {"id": t, "handler": "sleep", "args": {"seconds": s}, "depends_on": ps} for t, ps, s in j.tasks]}))
            for j in workload}
        meter = probe.Meter().start()
        t0 = time.time()
        submitted: dict[str, float] = {}
        for j in sorted(workload, key=lambda j: j.at_s):
            delay = t0 + j.at_s - time.time()
            if delay > 0:
                time.sleep(delay)
            submitted[j.name] = time.time()
            stack.sender.send(submit_job(specs[j.name], source="bench"))
        deadline = t0 + args.limit
        states = {}
        for j in workload:
            job = stack.wait_job(ids[j.name], timeout_s=max(deadline - time.time(), 1.0), poll_s=0.02)
            states[j.name] = (job or {}).get("state")
        m = meter.stop()
        runs: dict[tuple[str, str], tuple[float, float]] = {}
        for j in workload:
            started, done, _ = read_reports(stack, cfg, ids[j.name])
            for t in done:
                if t in started:
                    runs[(j.name, t)] = (started[t], done[t])
        res = timed.summarize(workload, args.workers, t0, submitted, runs)
        ok = all(s == "succeeded" for s in states.values())
        probe.emit({"system": system, "workload": args.workload, "status": "ok" if ok else "timeout",
                    **res, "total_cpu_s": round(m["own_cpu_s"], 2),
                    "notes": f"{args.workers} worker threads; tasks = the sleep handler"}, args.out)
    finally:
        stack.stop()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
