"""Scale: synthetic layered DAGs of 1k to 1M noop tasks through dagfold (issue 7).

    python -m bench.scale [--sizes 1000 10000 100000 1000000] [--smoke] [--no-docs]

Each size runs in a fresh process (`--one N`) on the embedded stack (scheduler,
projector and 2 workers in one process; the embedded log has no record size
limit, while a Kafka record is capped at 1 MB by default, which a spec of more
than about 10k tasks exceeds). The DAG is 100 tasks wide, each task depending on
2 tasks of the level above (O(tasks) edges), 10 to 10,000 levels deep.

Per size: the client's spec build (pydantic) and Avro encode with schema
validation (what `CommandSender.send` does); the scheduler's own validation and
spec hash, timed apart; time from sending to the job being accepted (seen
running in the read model); tasks/s from sending to the job done; bytes per
task of the read model, the scheduler state and the log on disk; peak RSS of
the process (VmHWM) and its RSS before submission. Also the fold alone (in
memory, up to 2,000 commands per transaction) at the same size.

Results: bench/results/scale.json (scale-smoke.json), docs/img/bench-scale.png and
the scale section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peers import probe, report
from bench.peers.workloads import layered_sparse

WIDTH = 100
FAN_IN = 2


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def one(n: int, limit: float, fold_only: bool) -> dict[str, Any]:
    from bench.limits import fold_batched
    from dagfold.codec import default_codec
    from dagfold.commands import submit_job
    from dagfold.config import Config
    from dagfold.jobspec import parse_spec, spec_hash, to_job_spec, validate_job_spec
    from dagfold.services.stack import Stack, StackOptions

    dag = layered_sparse(WIDTH, n // WIDTH, FAN_IN)
    out: dict[str, Any] = {"tasks": len(dag), "edges": sum(len(p) for _, p in dag), "width": WIDTH,
                           "fan_in": FAN_IN}
    job_id = f"scale-{n}"
    t0 = time.perf_counter()
    spec = to_job_spec(parse_spec({"id": job_id, "tasks": [
        {"id": t, "handler": "noop", "depends_on": ps} for t, ps in dag]}))
    out["spec_build_s"] = round(time.perf_counter() - t0, 3)
    del dag
    t0 = time.perf_counter()
    cmd = submit_job(spec, source="bench")
    value = default_codec().encode(cmd, validate_record=True)
    out["encode_validate_s"] = round(time.perf_counter() - t0, 3)
    out["submit_command_bytes"] = len(value)
    del value
    cfg0 = Config()
    t0 = time.perf_counter()
    rej = validate_job_spec(spec, cfg0.scheduler.limits)
    out["scheduler_validation_s"] = round(time.perf_counter() - t0, 3)
    assert rej is None, rej
    t0 = time.perf_counter()
    spec_hash(spec)
    out["spec_hash_s"] = round(time.perf_counter() - t0, 3)

    fold = fold_batched(spec)
    out["fold_tasks_per_s"] = round(fold["tasks_per_s"], 1)
    out["fold_events_per_s"] = round(fold["events_per_s"], 1)
    if fold_only:
        return out

    data = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    cfg = Config.from_env(log_url="embedded", data_dir=data)
    stack = Stack(cfg, StackOptions(workers=2, api=False, callbacks=False)).start()
    try:
        stack.runner.ready.wait(60)
        out["rss_before_mib"] = round(probe.rss_bytes(os.getpid()) / 2**20, 1)
        sched_tid = next(t.native_id for t in __import__("threading").enumerate() if t.name == "scheduler")
        cpu0 = probe.thread_cpu_s(os.getpid(), sched_tid)
        meter = probe.Meter().start()
        t0 = time.perf_counter()
        stack.sender.send(cmd)
        del cmd, spec  # the client's copy: 1M task dicts would slow every garbage collection of this process
        accepted = None
        job = None
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and not stack.failed:
            job = stack.read_model.get_job(job_id)
            if job is not None and accepted is None:
                accepted = time.perf_counter() - t0
            if job is not None and job["state"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(0.02)
        dt = time.perf_counter() - t0
        m = meter.stop()
        sched_cpu = probe.thread_cpu_s(os.getpid(), sched_tid) - cpu0
        ok = job is not None and job["state"] == "succeeded"
        done = int(((job or {}).get("counts") or {}).get("succeeded", 0))
        out.update(status="ok" if ok else ("error" if stack.failed else "timeout"), seconds=round(dt, 2), done=done,
                   accept_s=None if accepted is None else round(accepted, 3),
                   tasks_per_s=round(n / dt, 1) if ok else None,
                   run_tasks_per_s=round(n / (dt - accepted), 1) if ok and accepted else None,
                   sched_cpu_us_per_task=round(sched_cpu / n * 1e6, 1), total_cpu_us_per_task=round(
                       m["own_cpu_s"] / n * 1e6, 1), peak_rss_mib=round(probe.hwm_bytes(os.getpid()) / 2**20, 1),
                   sampled_peak_rss_mib=m["peak_rss_mib"])
    finally:
        stack.stop()
    out["read_model_bytes_per_task"] = round(dir_bytes(data / "projections") / n, 1)
    out["scheduler_state_bytes_per_task"] = round(dir_bytes(data / "scheduler") / n, 1)
    out["log_bytes_per_task"] = round(sum(dir_bytes(p) for p in data.iterdir()
                                          if p.name not in ("projections", "scheduler")) / n, 1)
    shutil.rmtree(data, ignore_errors=True)
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.4))
    xs = [r["tasks"] for r in rows if r.get("tasks_per_s")]
    ax.plot(xs, [r["tasks_per_s"] for r in rows if r.get("tasks_per_s")], "o-", label="end to end (embedded stack)")
    xr = [r["tasks"] for r in rows if r.get("run_tasks_per_s")]
    ax.plot(xr, [r["run_tasks_per_s"] for r in rows if r.get("run_tasks_per_s")], "s--",
            label="end to end, after acceptance")
    xf = [r["tasks"] for r in rows if r.get("fold_tasks_per_s")]
    ax.plot(xf, [r["fold_tasks_per_s"] for r in rows if r.get("fold_tasks_per_s")], "^-",
            label="fold alone (in memory)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tasks in the DAG (100 wide, fan-in 2)")
    ax.set_ylabel("tasks/s")
    ax.set_title("tasks/s by DAG size (flat = no per-event cost growth)", fontsize=10)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    for key, label in (("sched_cpu_us_per_task", "scheduler thread"), ("total_cpu_us_per_task", "whole process")):
        pts = [(r["tasks"], r[key]) for r in rows if r.get(key)]
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    ax2.set_xscale("log")
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("tasks in the DAG")
    ax2.set_ylabel("CPU µs per task")
    ax2.set_title("CPU per task by DAG size (less sensitive to other load)", fontsize=10)
    ax2.grid(which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


HEAD = ["tasks", "status", "spec build s", "encode+validate s", "sched validation s", "spec hash s",
        "accepted after s", "tasks/s", "after accept", "fold tasks/s", "sched CPU µs/task", "peak RSS MiB",
        "read model B/task", "sched state B/task", "log B/task"]


def table_rows(rows: list[dict[str, Any]]) -> list[list[str]]:
    f = report.fmt
    return [[f(r["tasks"]), r.get("status", "fold only"), f(r.get("spec_build_s"), 2), f(r.get("encode_validate_s"), 2),
             f(r.get("scheduler_validation_s"), 2), f(r.get("spec_hash_s"), 2), f(r.get("accept_s"), 2),
             f(r.get("tasks_per_s")), f(r.get("run_tasks_per_s")), f(r.get("fold_tasks_per_s")),
             f(r.get("sched_cpu_us_per_task")), f(r.get("peak_rss_mib")), f(r.get("read_model_bytes_per_task")),
             f(r.get("scheduler_state_bytes_per_task")), f(r.get("log_bytes_per_task"))] for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--fold-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--limit", type=float, default=3600.0, help="seconds per size")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--rerender", action="store_true", help="rebuild table, plot and docs from the results file")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args.one, args.limit, args.fold_only)), flush=True)
        return
    out = report.RESULTS / ("scale-smoke.json" if args.smoke else "scale.json")
    if args.rerender:
        doc = json.loads(out.read_text())
        print(report.text_table(HEAD, table_rows(doc["results"])))
        if not args.no_docs:
            write_docs(doc)
        return
    sizes = [1_000, 10_000] if args.smoke else args.sizes
    load_before = report.loadavg()
    rows = []
    for n in sizes:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "bench.scale", "--one", str(n), "--limit", str(args.limit)],
                           cwd=report.ROOT, capture_output=True, text=True, timeout=args.limit + 1800)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        r = json.loads(lines[-1]) if lines else {"tasks": n, "status": f"error (exit {p.returncode})",
                                                 "stderr": p.stderr[-2000:]}
        r["process_wall_s"] = round(time.monotonic() - t0, 1)
        rows.append(r)
        print(json.dumps(r), flush=True)
    doc = {"when": report.when(), "smoke": args.smoke, "load_before": load_before, "load_after": report.loadavg(),
           "machine": report.machine(), "dag": f"layered, {WIDTH} wide, fan-in {FAN_IN}", "results": rows}
    report.RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(report.text_table(HEAD, table_rows(rows)))
    if not args.no_docs and not args.smoke:
        write_docs(doc)


def write_docs(doc: dict[str, Any]) -> None:
    rows = doc["results"]
    plot(rows, report.IMG / "bench-scale.png")
    report.replace_section("scale", f"""## Scale: 1k to 1M tasks (issue 7)

Measured {doc['when']} by `make bench-scale` (`.venv/bin/python -m bench.scale`) on the machine of the peers table
(load average when it began: {'/'.join(str(x) for x in doc['load_before'])}). Synthetic layered DAGs,
{WIDTH} tasks wide, each task
depending on {FAN_IN} tasks of the level above, noop tasks, through the embedded stack (scheduler, projector and
2 workers in one process). Each size runs in a fresh process.

![tasks/s and CPU per task by DAG size](img/bench-scale.png)

{report.md_table(HEAD, table_rows(rows))}

*spec build* = pydantic parse of the user spec and translation to the Avro JobSpec (client side);
*encode+validate* = Avro encoding of the SubmitJob with schema validation (`CommandSender.send`);
*sched validation* and *spec hash* = the scheduler's checks at submission (unknown references, duplicates,
cycles, limits) and the spec's SHA-256, timed apart; *accepted after* = from sending the SubmitJob until the
read model shows the job; *tasks/s* = tasks ÷ time from sending to the job done, *after accept* excludes
submission; *fold tasks/s* = the fold alone in memory (≤2,000 commands per transaction); *peak RSS* = the
whole process (VmHWM); bytes per task on disk after the run, RocksDB with its WAL.
Raw figures: `bench/results/scale.json`.
""")


if __name__ == "__main__":
    main()
