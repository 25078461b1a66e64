"""Baseline benchmark (`make bench`): numbers reported, never asserted.

(a) events/s of the scheduler fold alone (virtual-time harness, in memory and
    on RocksDB), on the Montage workflow and a 100x100 layered DAG;
(b) the Montage workflow (montage-chameleon-2mass-05d: 1,738 tasks) with noop
    tasks end to end on each backend: tasks/s, and p50/p99 latency from an
    upstream task's success report to its dependent's dispatch record.

Results go to bench/results/baseline.json and the table in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from dagfold.codec import default_codec
from dagfold.config import COMMANDS, SCHEDULER_GROUP, Config, dispatch_topic
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.localkafka import LocalKafka
from dagfold.log import TopicPartition
from dagfold.log.reader import read_to_end
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.state import PartitionStore
from dagfold.wfcommons import workflow_spec

ROOT = Path(__file__).resolve().parents[1]
WF = ROOT.parent / "shared" / "data" / "wfcommons"
MONTAGE = WF / "montage-chameleon-2mass-05d-001.json.gz"
RESULTS = ROOT / "bench" / "results"


def layered(width: int, depth: int, job_id: str) -> dict[str, Any]:
    tasks = []
    for level in range(depth):
        for i in range(width):
            deps = [f"l{level - 1}-{j}" for j in range(width)] if level else []
            tasks.append({"id": f"l{level}-{i}", "handler": "noop", "depends_on": deps})
    return to_job_spec(parse_spec({"id": job_id, "tasks": tasks}))


def fold_rate(spec: dict[str, Any], store_dir: Path | None = None) -> dict[str, Any]:
    h = FoldHarness(store=PartitionStore(store_dir) if store_dir is not None else None)
    t0 = time.perf_counter()
    h.submit(spec)
    h.run_all()
    dt = time.perf_counter() - t0
    commands = h.offset
    n_events = len(h.events)
    assert h.job(spec["job_id"])["state"] == "succeeded"
    if store_dir is not None:
        h.store.close()
    return {"tasks": len(spec["tasks"]), "commands": commands, "events": n_events, "seconds": round(dt, 3),
            "commands_per_s": round(commands / dt), "events_per_s": round(n_events / dt)}


def fold_rate_batched(spec: dict[str, Any], batch: int = 2000) -> dict[str, Any]:
    """The fold as the runner drives it: one state transaction per batch of commands (in memory)."""
    from collections import deque

    from dagfold.services.scheduler.fold import SchedulerFold
    from dagfold.state import MemoryStore, PartitionTransaction

    fold, store, queue = SchedulerFold(), MemoryStore(), deque()
    txn = PartitionTransaction(store)
    n_cmd = n_ev = 0
    job = spec["job_id"]

    def run(cmd: dict[str, Any]) -> None:
        nonlocal txn, n_cmd, n_ev
        for o in fold.process(txn, cmd, 0, n_cmd):
            if o.topic == "events":
                n_ev += 1
            elif o.record["type"] == "dagfold.dispatch.TaskDispatch":
                queue.append(o.record)
        n_cmd += 1
        if n_cmd % batch == 0:
            txn.commit(applied_events=n_cmd)
            txn = PartitionTransaction(store)

    t0 = time.perf_counter()
    run({"type": "dagfold.command.SubmitJob", "spec": spec, "submitted_at_ms": 0, "source": "bench"})
    while queue:
        d = queue.popleft()
        base = {"job_id": job, "task_id": d["task_id"], "attempt": d["attempt"], "worker_id": "w", "ts_ms": 0}
        run({"type": "dagfold.command.TaskStarted", **base})
        run({"type": "dagfold.command.TaskSucceeded", **base, "result_json": None, "stdout_tail": "",
             "stderr_tail": ""})
    txn.commit()
    dt = time.perf_counter() - t0
    return {"tasks": len(spec["tasks"]), "commands": n_cmd, "events": n_ev, "seconds": round(dt, 3),
            "commands_per_s": round(n_cmd / dt), "events_per_s": round(n_ev / dt)}


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def dependency_latencies(log: Any, spec: dict[str, Any], config: Config) -> list[float]:
    """ms from the last upstream's success report to the dependent's dispatch record."""
    codec = default_codec()
    parents = {t["task_id"]: t["depends_on"] for t in spec["tasks"]}
    done_at: dict[str, int] = {}
    dispatched_at: dict[str, int] = {}
    for topic, n in ((COMMANDS, config.partitions), (dispatch_topic("default"), config.dispatch_partition_count())):
        for p in range(n):
            for recs in read_to_end(log, TopicPartition(topic, p)):
                for r in recs:
                    rec = codec.decode(r.value)
                    if rec.get("job_id") != spec["job_id"]:
                        continue
                    if rec["type"] == "dagfold.command.TaskSucceeded":
                        done_at[rec["task_id"]] = rec["ts_ms"]
                    elif rec["type"] == "dagfold.dispatch.TaskDispatch":
                        dispatched_at[rec["task_id"]] = r.timestamp_ms
    out = []
    for tid, ups in parents.items():
        if ups and tid in dispatched_at and all(u in done_at for u in ups):
            out.append(float(dispatched_at[tid] - max(done_at[u] for u in ups)))
    return out


def end_to_end(log_url: str, workers: int) -> dict[str, Any]:
    from dagfold.services.stack import Stack, StackOptions

    doc = workflow_spec(MONTAGE, 0.0, job_id=f"montage-bench-{int(time.time())}")
    spec = to_job_spec(parse_spec(doc))
    data = Path(tempfile.mkdtemp(prefix="dagfold-bench-"))
    cfg = Config.from_env(log_url=log_url, data_dir=data)
    stack = Stack(cfg, StackOptions(workers=workers, api=False, callbacks=False)).start()
    try:
        from dagfold.commands import submit_job
        from dagfold.log.kafka import KafkaLog

        # measure a settled system: groups joined (a late join rebalances mid-run), one small job done
        if isinstance(stack.log, KafkaLog):
            # workers are members of a share group (a queue): no rebalance to wait for
            stack.log.wait_groups_stable({SCHEDULER_GROUP: 1})
        warm = to_job_spec(parse_spec({"id": f"warmup-{int(time.time() * 1000)}",
                                       "tasks": [{"id": f"w{i}"} for i in range(16)]}))
        stack.sender.send(submit_job(warm, source="bench"))
        stack.wait_job(warm["job_id"], timeout_s=120, poll_s=0.02)
        t0 = time.perf_counter()
        stack.sender.send(submit_job(spec, source="bench"))
        job = stack.wait_job(spec["job_id"], timeout_s=1800, poll_s=0.02)
        dt = time.perf_counter() - t0
        assert job is not None and job["state"] == "succeeded", job
        lat = dependency_latencies(stack.log, spec, cfg)
    finally:
        stack.stop()
        shutil.rmtree(data, ignore_errors=True)
    return {"backend": log_url.split(":")[0], "workers": workers, "tasks": len(spec["tasks"]),
            "seconds": round(dt, 2), "tasks_per_s": round(len(spec["tasks"]) / dt, 1),
            "dep_to_dispatch_p50_ms": percentile(lat, 50), "dep_to_dispatch_p99_ms": percentile(lat, 99),
            "latency_samples": len(lat)}


def kafka_broker(port: int) -> tuple[str, Any]:
    broker = LocalKafka(port, Path(tempfile.mkdtemp(prefix="dagfold-bench-kafka-"))).start()
    return broker.url, broker.stop


def write_docs(results: dict[str, Any]) -> None:
    doc = ROOT / "docs" / "benchmarks.md"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    start, end = "<!-- baseline:start -->", "<!-- baseline:end -->"
    rows = ["| workload | tasks | commands/s | events/s |", "|---|---:|---:|---:|"]
    for name, r in results["fold"].items():
        rows.append(f"| {name} | {r['tasks']} | {r['commands_per_s']:,} | {r['events_per_s']:,} |")
    rows += ["", "| backend | workers | tasks | wall s | tasks/s | dep→dispatch p50 ms | p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results["end_to_end"]:
        rows.append(f"| {r['backend']} | {r['workers']} | {r['tasks']} | {r['seconds']} | {r['tasks_per_s']} | "
                    f"{r['dep_to_dispatch_p50_ms']:.0f} | {r['dep_to_dispatch_p99_ms']:.0f} |")
    m = results["machine"]
    block = "\n".join([start, f"Measured {results['when']} on {m['cpus']} CPUs, Python {m['python']}.", "",
                       *rows, end])
    if start in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text += "\n" + block + "\n"
    doc.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-kafka", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kafka-port", type=int, default=19392)
    args = ap.parse_args()
    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": {
        "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}}
    montage = to_job_spec(parse_spec(workflow_spec(MONTAGE, 0.0, job_id="montage")))
    tmp = Path(tempfile.mkdtemp(prefix="dagfold-fold-"))
    results["fold"] = {
        "montage (memory, batched like the runner)": fold_rate_batched(montage),
        "montage (memory)": fold_rate(montage),
        "montage (rocksdb)": fold_rate(montage, tmp / "m"),
        "layered 100x100 (memory)": fold_rate(layered(100, 100, "layered")),
    }
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results["fold"], indent=1))
    results["end_to_end"] = [end_to_end("embedded", args.workers)]
    print(json.dumps(results["end_to_end"][-1]))
    if not args.no_kafka:
        url, stop = kafka_broker(args.kafka_port)
        try:
            results["end_to_end"].append(end_to_end(url, args.workers))
            print(json.dumps(results["end_to_end"][-1]))
        finally:
            stop()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "baseline.json").write_text(json.dumps(results, indent=2) + "\n")
    write_docs(results)


if __name__ == "__main__":
    main()
