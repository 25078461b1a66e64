"""One dagfold run of one workload (main venv): ``python -m bench.peers.run_dagfold``.

The stack is ``dagfold.services.stack.Stack`` (scheduler, projector, workers; no API), on
the embedded log or on Kafka (the exactly-once path: one Kafka transaction per
batch of commands). The clock runs from sending the SubmitJob (its Avro encoding
and schema validation included) to the job being terminal in the read model
(what the API would answer), polled every 10 ms.

* scheduler CPU: the scheduler thread only (``/proc/self/task/TID/schedstat``);
* total CPU: this process and its children (workers when ``--worker-procs``),
  plus the Kafka broker (``--infra-pid``);
* latency: from an upstream's TaskSucceeded report (worker clock, ms) to the
  downstream's TaskStarted report, read back from the commands topic; also
  dependency→dispatch (the success report to the dispatch record's log
  timestamp), the baseline bench's figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.peers import probe
from bench.peers.workloads import Dag, load
from dagfold.codec import default_codec
from dagfold.commands import submit_job
from dagfold.config import COMMANDS, EVENTS, SCHEDULER_GROUP, Config, dispatch_topic
from dagfold.exceptions import LogError
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.log import TopicPartition
from dagfold.services.stack import Stack, StackOptions
from dagfold.services.tracing import GROUP as TRACES_GROUP
from dagfold.tracing import otlp_enabled

ROOT = Path(__file__).resolve().parents[2]


def job_spec(dag: Dag, job_id: str) -> dict[str, Any]:
    return to_job_spec(parse_spec({"id": job_id, "tasks": [
        {"id": t, "handler": "noop", "depends_on": ps} for t, ps in dag]}))


def read_reports(stack: Stack, cfg: Config, job_id: str) -> tuple[dict[str, float], dict[str, float],
                                                                      dict[str, float]]:
    """(started, succeeded, dispatched) times in seconds for the tasks of ``job_id``, from the log."""
    codec = default_codec()
    assert stack.log is not None
    started: dict[str, float] = {}
    done: dict[str, float] = {}
    dispatched: dict[str, float] = {}
    for topic, n in ((COMMANDS, cfg.partitions), (dispatch_topic("default"), cfg.dispatch_partition_count())):
        c = stack.log.consumer(None, client_id="bench-reader")
        tps = [TopicPartition(topic, p) for p in range(n)]
        ends = stack.log.end_offsets(tps)
        c.assign(dict.fromkeys(tps, 0))
        deadline = time.monotonic() + 120
        while any(c.position(tp) < ends[tp] for tp in tps) and time.monotonic() < deadline:
            for r in c.poll(5000, 0.25):
                rec = codec.decode(r.value)
                if rec.get("job_id") != job_id:
                    continue
                t = rec["type"]
                if t == "dagfold.command.TaskStarted":
                    started.setdefault(rec["task_id"], rec["ts_ms"] / 1000)
                elif t == "dagfold.command.TaskSucceeded":
                    done.setdefault(rec["task_id"], rec["ts_ms"] / 1000)
                elif t == "dagfold.dispatch.TaskDispatch":
                    dispatched.setdefault(rec["task_id"], r.timestamp_ms / 1000)
        c.close()
    for task, t in done.items():  # an instant task (noop) reports once: its outcome is its start too
        started.setdefault(task, t)
    return started, done, dispatched


def wait_traces_caught_up(stack: Stack, cfg: Config, timeout_s: float = 120.0) -> None:
    """Until the span exporters' group has committed the events topic's end: the measured job's spans
    are then all the exporters build while it runs (not a backlog of earlier runs on the same broker)."""
    assert stack.log is not None
    tps = [TopicPartition(EVENTS, p) for p in range(cfg.partitions)]
    c = stack.log.consumer(TRACES_GROUP, client_id="bench-traces-lag")  # never subscribes: no member
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ends, done = stack.log.end_offsets(tps), c.committed(tps)
            # a consumer commits past its last record, and a transaction's marker takes one offset after it
            if all(done.get(tp, 0) >= end - 1 for tp, end in ends.items()):
                return
            time.sleep(0.1)
        raise RuntimeError("the span exporters did not catch up with the events")
    finally:
        c.close()


def scheduler_tid() -> int:
    for t in threading.enumerate():
        if t.name == "scheduler" and t.native_id is not None:
            return t.native_id
    raise RuntimeError("no scheduler thread")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--log", default="embedded", help="embedded or kafka://HOST:PORT")
    ap.add_argument("--data", type=Path, help="data folder (default: a fresh temporary one)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--worker-procs", action="store_true",
                    help="Kafka only: run the workers as `dagfold worker` processes, not threads of the stack")
    ap.add_argument("--scheduler-proc", action="store_true",
                    help="Kafka only: run the scheduler as a `dagfold scheduler` process (a deployment's shape); "
                         "this process keeps the projector and measures")
    ap.add_argument("--limit", type=float, default=180.0)
    ap.add_argument("--infra-pid", type=int, action="append", default=[])
    ap.add_argument("--pyspy", type=Path,
                    help="profile the measured window with py-spy (raw, per thread) into this file")
    ap.add_argument("--pyspy-all", type=Path,
                    help="folder: py-spy (raw) of every dagfold process of the run, for bench.peers.cpu_split")
    ap.add_argument("--sched-cprofile", type=Path,
                    help="with --scheduler-proc: run the `dagfold scheduler` process under cProfile timed by CPU "
                         "(bench.peers.cpu_profile; its whole life, warm-up included) into this file")
    ap.add_argument("--traces-cprofile", type=Path,
                    help="with tracing on and --scheduler-proc: the `dagfold traces` process under cProfile timed by "
                         "CPU, as --sched-cprofile")
    ap.add_argument("--pyspy-bin", default=os.environ.get("PYSPY", "py-spy"))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    kafka = args.log.startswith("kafka://")
    system = "dagfold-kafka" if kafka else "dagfold-embedded"
    data = args.data or Path(tempfile.mkdtemp(prefix="bench-dagfold-"))
    cfg = Config.from_env(log_url=args.log, data_dir=data)
    procs: list[subprocess.Popen[bytes]] = []
    thread_workers = 0 if (kafka and args.worker_procs) else args.workers
    split = kafka and args.scheduler_proc
    tracing = otlp_enabled()  # bench.peers --tracing-cost sets OTEL_EXPORTER_OTLP_ENDPOINT for the traced runs
    stack = Stack(cfg, StackOptions(workers=thread_workers, api=False, callbacks=False,
                                    scheduler=not split, traces=not split)).start()
    sched_proc: subprocess.Popen[bytes] | None = None
    traces_proc: subprocess.Popen[bytes] | None = None
    try:
        if split:
            prof = ["-m", "bench.peers.cpu_profile", str(args.sched_cprofile)] if args.sched_cprofile else []
            sched_proc = subprocess.Popen(
                [sys.executable, *prof, "-m", "dagfold", "scheduler", "--log", args.log, "--data", str(data / "sched")],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(sched_proc)
            if tracing:  # a deployment's shape: the span exporter is a `dagfold traces` process
                tprof = ["-m", "bench.peers.cpu_profile", str(args.traces_cprofile)] if args.traces_cprofile else []
                traces_proc = subprocess.Popen(
                    [sys.executable, *tprof, "-m", "dagfold", "traces", "--log", args.log,
                     "--data", str(data / "traces")],
                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                procs.append(traces_proc)
        if thread_workers == 0:
            for _ in range(args.workers):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "dagfold", "worker", "--log", args.log, "--data", str(data)],
                    cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if not split and not stack.runner.ready.wait(120):
            raise RuntimeError("scheduler got no partitions")
        if kafka:
            # workers are members of a share group (a queue), which has no rebalance to wait for
            groups: dict[str, int] = {}
            if split:
                groups[SCHEDULER_GROUP] = 1
            lg: Any = stack.log  # a KafkaLog, or a NamespacedLog over one (a log URL with ?prefix=)
            ns = getattr(lg, "ns", None)
            groups = {ns.group(g) if ns is not None else g: n for g, n in groups.items()}
            if groups and not lg.wait_groups_stable(groups):
                raise RuntimeError(f"consumer groups not stable: {groups}")
        run_id = f"{os.getpid()}-{int(time.time() * 1000)}"
        warm = job_spec(load("warmup"), f"warmup-{run_id}")
        stack.sender.send(submit_job(warm, source="bench"))
        w = stack.wait_job(warm["job_id"], timeout_s=120, poll_s=0.01)
        if w is None or w["state"] != "succeeded":
            raise RuntimeError(f"warm-up job did not succeed: {w}")
        if tracing and kafka:
            wait_traces_caught_up(stack, cfg)

        dag = load(args.workload, args.smoke)
        job_id = f"{args.workload}-{run_id}"
        spec = job_spec(dag, job_id)
        def sched_cpu() -> float:
            if sched_proc is not None:
                return probe.proc_cpu_s(sched_proc.pid)
            return probe.thread_cpu_s(os.getpid(), scheduler_tid())

        sched0 = sched_cpu()
        threads0 = probe.threads_cpu_s(sched_proc.pid) if sched_proc is not None else {}
        traces0 = probe.proc_cpu_s(traces_proc.pid) if traces_proc is not None else 0.0
        spy = None
        if args.pyspy is not None:
            spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(os.getpid()),
                                    "--rate", "250", "--threads", "--nonblocking", "--format", "raw",
                                    "--output", str(args.pyspy)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        spies: list[subprocess.Popen[bytes]] = []
        if args.pyspy_all is not None:
            args.pyspy_all.mkdir(parents=True, exist_ok=True)
            for pid in [os.getpid()] + [p.pid for p in procs]:
                label = probe.process_label(pid, os.getpid()).replace(" ", "-")
                spies.append(subprocess.Popen(
                    [args.pyspy_bin, "record", "--pid", str(pid), "--rate", "200", "--nonblocking", "--format",
                     "raw", "--output", str(args.pyspy_all / f"{label}-{pid}.txt")],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.5)
        meter = probe.Meter(infra=args.infra_pid).start()
        t0 = time.perf_counter()
        try:
            stack.sender.send(submit_job(spec, source="bench"))
        except LogError as exc:  # e.g. a spec over Kafka's record size limit
            meter.stop()
            if spy is not None:
                spy.send_signal(2)
            size = len(default_codec().encode(submit_job(spec, source="bench")))
            probe.emit({"system": system, "workload": args.workload, "tasks": len(dag), "status":
                        f"error: SubmitJob of {size / 2**20:.1f} MiB not accepted by the log ({exc})"[:300],
                        "limit_s": args.limit, "done": 0, "tasks_per_s": None, "workers": args.workers,
                        "notes": "the job spec travels in one record (SubmitJob, then JobAccepted)"}, args.out)
            return
        job = stack.wait_job(job_id, timeout_s=args.limit, poll_s=0.01)
        dt = time.perf_counter() - t0
        m = meter.stop()
        sched = sched_cpu() - sched0
        # where the scheduler process's CPU went: its Python thread(s) and librdkafka's threads
        threads = {k: round(v - threads0.get(k, 0.0), 3)
                   for k, v in (probe.threads_cpu_s(sched_proc.pid) if sched_proc is not None else {}).items()}
        for sp in spies:
            sp.send_signal(2)
        for sp in spies:
            sp.wait(60)
        if spy is not None:
            spy.send_signal(2)
            spy.wait(60)
        status = "ok" if job is not None and job["state"] == "succeeded" else "timeout"
        traced: dict[str, Any] = {}
        if traces_proc is not None and status == "ok":
            # after the measured window: how long the exporter took to send the job's last spans, and all
            # the CPU it spent on the job (the window's figures miss what it does after the job's end)
            t_end = time.perf_counter()
            wait_traces_caught_up(stack, cfg)
            traced = {"trace_lag_s": round(time.perf_counter() - t_end, 2),
                      "traces_cpu_us_per_task": round(
                          (probe.proc_cpu_s(traces_proc.pid) - traces0) * 1e6 / len(dag), 1)}
        if stack.failed:
            status = "error"
        done = len(dag) if status == "ok" else int(((job or {}).get("counts") or {}).get("succeeded", 0))
        started, succeeded, dispatched = read_reports(stack, cfg, job_id)
        if status != "ok":
            done = len(succeeded)
        lat = probe.dependency_latencies_ms(dag, started, succeeded)
        lat_d = probe.dependency_latencies_ms(dag, dispatched, succeeded)
        kind = "processes (dagfold worker)" if thread_workers == 0 else "threads of the stack"
        where = "the `dagfold scheduler` process" if split else "the scheduler thread"
        notes = f"workers: {args.workers} {kind}; scheduler CPU = {where}"
        res = probe.result(system, args.workload, dag, status=status, seconds=dt if status == "ok" else args.limit,
                           done=done, meter=m, sched_cpu_s=sched, lat_ms=lat, limit_s=args.limit,
                           workers=args.workers, notes=notes,
                           dep_to_dispatch_p50_ms=probe._r(probe.percentile(lat_d, 50)),
                           dep_to_dispatch_p99_ms=probe._r(probe.percentile(lat_d, 99)),
                           error=repr(stack.errors[0]) if stack.errors else None,
                           sched_cpu_by_thread_s={k: v for k, v in sorted(threads.items()) if v > 0}, **traced)
        probe.emit(res, args.out)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        stack.stop()
        if args.data is None:
            shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
