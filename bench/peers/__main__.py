"""`make bench-peers`: dagfold side by side with Dask, Celery, Prefect and Temporal, then the physical limits.

    python -m bench.peers [--smoke] [--limit 180] [--systems ...] [--workloads ...]

Every system runs every workload (noop tasks) in its own process, one after the
other, with a time limit: a run that has not finished is recorded as timed out
(with how many tasks it did finish) and its process group is ended. Installs
the peers first (bench/peers/setup.sh, idempotent), starts a Kafka broker on
loopback for dagfold-Kafka and the limits (each Celery run starts its own
redis-server). Writes bench/results/peers.json (peers-smoke.json with
``--smoke``), docs/img/bench-peers.png and the peers section of
docs/benchmarks.md, prints one table with the ratio of dagfold to each peer,
then runs ``bench.limits`` against the same broker.

``--tracing-cost`` measures what tracing costs instead: dagfold-Kafka with tracing off and on
(``dagfold-kafka-traced``: OTEL_EXPORTER_OTLP_ENDPOINT set for every dagfold process, spans exported to a
Jaeger started by deploy/jaeger/jaeger.sh), runs interleaved off, on, off, on, ... so that both see the
same machine; writes bench/results/peers-tracing.json and the tracing-cost section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peers import report
from bench.peers.workloads import WORKLOADS
from dagfold.localkafka import LocalKafka

ROOT = report.ROOT
MAIN_PY = sys.executable
SYSTEMS = ["dagfold-embedded", "dagfold-kafka", "dask", "celery", "prefect", "temporal", "dagfold-kafka-traced"]
PEERS = ["dask", "celery", "prefect", "temporal"]
DAGFOLD = ["dagfold-kafka", "dagfold-embedded", "dagfold-kafka-traced"]
LABEL = {"dagfold-embedded": "dagfold (embedded)", "dagfold-kafka": "dagfold (Kafka, EOS)", "dask": "Dask distributed",
         "celery": "Celery + Redis", "prefect": "Prefect 3", "temporal": "Temporal (dev server)",
         "dagfold-kafka-traced": "dagfold (Kafka, EOS, tracing on)"}
TRACED = "dagfold-kafka-traced"  # dagfold-kafka with OTEL_EXPORTER_OTLP_ENDPOINT set (--tracing-cost)


class Jaeger:
    """deploy/jaeger/jaeger.sh on ports of its own (a test's Jaeger may hold the default ones)."""

    def __init__(self, base_port: int) -> None:
        self.data = Path(tempfile.mkdtemp(prefix="bench-peers-jaeger-"))
        self.http = base_port
        self.env = {**os.environ, "JAEGER_OTLP_HTTP_PORT": str(base_port), "JAEGER_OTLP_GRPC_PORT": str(base_port + 1),
                    "JAEGER_QUERY_PORT": str(base_port + 2), "JAEGER_QUERY_GRPC_PORT": str(base_port + 3),
                    "JAEGER_HEALTH_PORT": str(base_port + 4), "JAEGER_DATA": str(self.data),
                    "JAEGER_START_TIMEOUT": "180"}

    def start(self) -> Jaeger:
        subprocess.run([str(ROOT / "deploy/jaeger/jaeger.sh"), "start"], env=self.env, check=True)
        return self

    @property
    def pid(self) -> int | None:
        p = self.data / "jaeger.pid"
        return int(p.read_text()) if p.exists() else None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def stop(self) -> None:
        subprocess.run([str(ROOT / "deploy/jaeger/jaeger.sh"), "stop"], env=self.env, check=False)
        shutil.rmtree(self.data, ignore_errors=True)


class Broker:
    def __init__(self, port: int, data: Path | None = None, brokers: int = 1) -> None:
        self.port = port
        self.brokers = brokers
        self.owned = data is None  # else a broker already running from that folder (kept running)
        self.data = data if data is not None else Path(tempfile.mkdtemp(prefix="bench-peers-kafka-"))
        self.local = LocalKafka(port, self.data, brokers=brokers)

    def start(self) -> Broker:
        if self.owned:
            self.local.start()
        return self

    @property
    def pids(self) -> list[int]:
        """Every broker's JVM (their CPU counts as dagfold-Kafka's)."""
        return [int((self.data / f"node-{i}" / "kafka.pid").read_text()) for i in range(1, self.brokers + 1)]

    @property
    def url(self) -> str:
        return self.local.url

    def stop(self) -> None:
        if self.owned:
            self.local.stop()
            shutil.rmtree(self.data, ignore_errors=True)


def command(system: str, workload: str, args: argparse.Namespace, broker: Broker | None,
            kafka_data: Path | None) -> list[str]:
    common = ["--workload", workload, "--workers", str(args.workers), "--limit", str(args.limit)]
    if args.smoke:
        common.append("--smoke")
    if system == "dagfold-embedded":
        return [MAIN_PY, "-m", "bench.peers.run_dagfold", *common]
    if system in ("dagfold-kafka", TRACED):
        assert broker is not None and kafka_data is not None
        cmd = [MAIN_PY, "-m", "bench.peers.run_dagfold", *common, "--log", broker.url, "--data", str(kafka_data)]
        for pid in broker.pids:
            cmd += ["--infra-pid", str(pid)]
        if system == TRACED and args.jaeger_pid:  # the backend's CPU counts as the system's
            cmd += ["--infra-pid", str(args.jaeger_pid)]
        return cmd + ([] if args.kafka_one_process else ["--worker-procs", "--scheduler-proc"])
    if system == "temporal":
        common += ["--temporal-db", args.temporal_db]
    return [str(report.PEERS_PY), "-m", f"bench.peers.run_{system}", *common]


def run_one(system: str, workload: str, args: argparse.Namespace, broker: Broker | None, kafka_data: Path | None,
            logdir: Path) -> dict[str, Any]:
    cmd = command(system, workload, args, broker, kafka_data)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # tracing off unless TRACED
    if args.brokers == 3 and system in DAGFOLD:  # topics as production has them (min.insync.replicas 2)
        env["DAGFOLD_REPLICATION"] = "3"
    if system == TRACED:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = args.otlp_endpoint
        env["OTEL_SERVICE_NAME"] = "dagfold-bench"
    load_1m = report.loadavg()
    log = logdir / f"{system}-{workload}.log"
    grace = 240.0  # start-up (Prefect's server, Kafka group joins), warm-up and reading the log back
    t0 = time.monotonic()
    out_path = logdir / f"{system}-{workload}.out"
    # stdout to a file, not a pipe: a child that outlives the run (Prefect's server) must not hold it open
    with open(log, "w") as err, open(out_path, "w") as stdout:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=err, text=True, start_new_session=True, env=env)
        try:
            p.wait(timeout=args.limit + grace)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            return {"system": system, "workload": workload, "status": "timeout", "limit_s": args.limit,
                    "tasks_per_s": None, "done": None, "notes": f"killed after {args.limit + grace:.0f} s"}
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # stragglers: Prefect's server, Celery pool children
    out = out_path.read_text()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if not lines:
        tail = log.read_text()[-1500:]
        return {"system": system, "workload": workload, "status": f"error (exit {p.returncode})",
                "limit_s": args.limit, "tasks_per_s": None, "done": None, "notes": tail}
    res = json.loads(lines[-1])
    res["system"] = system  # run_dagfold names the log only
    res["process_wall_s"] = round(time.monotonic() - t0, 1)
    res["load_before"] = load_1m  # the machine is shared: every figure with its load average
    return res


def cell_status(r: dict[str, Any]) -> str:
    if r["status"] == "ok":
        return "ok"
    if r["status"] == "timeout":
        done = r.get("done")
        return f"timeout {r['limit_s']:.0f}s" + (f" ({done:,} done)" if done is not None else "")
    return r["status"].split(" (")[0][:60]


def ratio(a: dict[str, Any] | None, b: dict[str, Any]) -> str:
    """dagfold ÷ peer on tasks/s; a timed-out peer's rate is an upper bound, so the ratio is a lower bound."""
    if a is None or a.get("status") != "ok" or not a.get("tasks_per_s"):
        return "–"
    if str(b.get("status", "")).startswith("error"):
        return "–"
    rb = b.get("tasks_per_s")
    if not rb:
        return "∞" if b.get("status") == "timeout" else "–"
    x = a["tasks_per_s"] / rb
    return ("≥" if b.get("status") != "ok" else "") + (f"{x:,.1f}×" if x < 100 else f"{x:,.0f}×")


def rows(results: list[dict[str, Any]], workloads: list[str], systems: list[str]) -> list[list[str]]:
    by = {(r["workload"], r["system"]): r for r in results}
    out = []
    for w in workloads:
        for s in systems:
            r = by.get((w, s))
            if r is None:
                continue
            rate = report.fmt(r.get("tasks_per_s"), 0 if (r.get("tasks_per_s") or 0) >= 100 else 1)
            out.append([w, s, cell_status(r), ("≤" if r["status"] == "timeout" and rate != "–" else "") + rate,
                        report.fmt(r.get("sched_cpu_us_per_task")), report.fmt(r.get("total_cpu_us_per_task")),
                        report.fmt(r.get("lat_p50_ms"), 1), report.fmt(r.get("lat_p99_ms"), 1),
                        report.fmt(r.get("peak_rss_mib")),
                        ratio(by.get((w, "dagfold-kafka")), r) if s in PEERS else "",
                        ratio(by.get((w, "dagfold-embedded")), r) if s in PEERS else ""])
    return out


HEADER = ["workload", "system", "status", "tasks/s", "sched CPU µs/task", "total CPU µs/task",
          "dep→start p50 ms", "p99 ms", "peak RSS MiB", "Kafka ÷ peer", "embedded ÷ peer"]


def plot(results: list[dict[str, Any]], workloads: list[str], systems: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["workload"], r["system"]): r for r in results}
    colors = {"dagfold-embedded": "#1f77b4", "dagfold-kafka": "#0b3d91", "dask": "#ff7f0e", "celery": "#2ca02c",
              "prefect": "#9467bd", "temporal": "#8c564b"}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / len(systems)
    for ax, key, title in ((axes[0], "tasks_per_s", "tasks/s (higher is better)"),
                           (axes[1], "lat_p99_ms", "upstream success → downstream start, p99 ms (lower is better)")):
        for i, s in enumerate(systems):
            xs, ys, hatch = [], [], []
            for j, w in enumerate(workloads):
                r = by.get((w, s))
                v = None if r is None else r.get(key)
                if r is not None and v:
                    xs.append(j + (i - (len(systems) - 1) / 2) * width)
                    ys.append(v)
                    hatch.append(r["status"] != "ok")
            bars = ax.bar(xs, ys, width, label=LABEL.get(s, s), color=colors.get(s))
            for b, h in zip(bars, hatch, strict=True):
                if h:
                    b.set_hatch("//")
                    b.set_alpha(0.5)
            for j, w in enumerate(workloads):
                r = by.get((w, s))
                if r is not None and str(r.get("status", "")).startswith("error") and key == "tasks_per_s":
                    ax.text(j + (i - (len(systems) - 1) / 2) * width, 0.01, "×", ha="center", va="bottom",
                            color=colors.get(s), fontsize=12, fontweight="bold", transform=ax.get_xaxis_transform())
        ax.set_yscale("log")
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, rotation=15)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(systems), fontsize=8, frameon=False)
    fig.suptitle("noop DAGs, 2 workers; hatched = timed out (rate of the tasks done within the limit); "
                 "× = could not run", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def target_rows(res: list[dict[str, Any]]) -> list[list[str]]:
    by = {(r["workload"], r["system"]): r for r in res}
    k = by.get(("montage", "dagfold-kafka"))
    out = []
    ratios = [("", "dagfold-kafka", "dask", "montage", 2.0), ("", "dagfold-kafka", "celery", "montage", 10.0),
              ("", "dagfold-kafka", "prefect", "montage", 10.0), ("", "dagfold-kafka", "dask", "epigenomics", 2.0),
              ("", "dagfold-kafka", "dask", "chain-1k", 1.0), ("", "dagfold-embedded", "dask", "montage", 3.0),
              # issue 27's
              ("issue 27: ", "dagfold-kafka", "dask", "chain-1k", 1.0),
              ("issue 27: ", "dagfold-kafka", "temporal", "chain-1k", 10.0),
              ("issue 27: ", "dagfold-embedded", "dask", "chain-1k", 3.0),
              ("issue 27: ", "dagfold-kafka", "dask", "montage", 2.5),
              ("issue 27: ", "dagfold-kafka", "temporal", "montage", 10.0),
              ("issue 27: ", "dagfold-kafka", "dask", "epigenomics", 2.5),
              ("issue 27: ", "dagfold-kafka", "temporal", "epigenomics", 10.0)]
    for tag, ours, peer, w, want in ratios:  # issue 7's and issue 14's, then issue 27's
        o, p = by.get((w, ours)), by.get((w, peer))
        if o is None or p is None or not o.get("tasks_per_s") or not p.get("tasks_per_s"):
            continue
        x = o["tasks_per_s"] / p["tasks_per_s"]
        name = "dagfold-Kafka" if ours == "dagfold-kafka" else "dagfold-embedded"
        out.append([f"{tag}{name} ≥ {want:g}× {peer} tasks/s on {w}", f"{x:.2f}×", "yes" if x >= want else "no"])
    if k is not None and k.get("total_cpu_us_per_task"):
        v = k["total_cpu_us_per_task"]
        out.append(["Kafka total CPU per noop task ≤ 450 µs (Montage)", f"{v:.0f} µs", "yes" if v <= 450 else "no"])
    for w, want_ms in (("chain-1k", 10.0), ("montage", 50.0)):
        r = by.get((w, "dagfold-kafka"))
        v = None if r is None else r.get("median_dep_to_dispatch_p99_ms", r.get("dep_to_dispatch_p99_ms"))
        if v is not None:
            out.append([f"issue 27: Kafka dependency→dispatch p99 ≤ {want_ms:g} ms ({w}, median of runs)",
                        f"{v:.0f} ms", "yes" if v <= want_ms else "no"])
    if k is not None and k.get("sched_cpu_us_per_task"):
        v = k.get("median_sched_cpu_us_per_task", k["sched_cpu_us_per_task"])
        out.append(["issue 27: Kafka scheduler CPU per noop task ≤ 170 µs (Montage, median of runs)", f"{v:.0f} µs",
                    "yes" if v <= 170 else "no"])
    for w in WORKLOADS:
        r = by.get((w, "dagfold-kafka"))
        if r is not None and r.get("dep_to_dispatch_p99_ms") is not None:
            v = r["dep_to_dispatch_p99_ms"]
            out.append([f"Kafka p99 dependency→dispatch ≤ 20 ms ({w})", f"{v:.0f} ms"
                        + (" (timed out)" if r["status"] != "ok" else ""), "yes" if v <= 20 else "no"])
    return out


def docs(doc: dict[str, Any], workloads: list[str], systems: list[str]) -> None:
    res = doc["results"]
    table = report.md_table(HEADER, rows(res, workloads, systems), "lllrrrrrrrr")
    first: dict[str, str] = {}
    for r in res:
        if r.get("notes") and r["status"] == "ok":
            first.setdefault(r["system"], r["notes"].replace(", level barriers added", ""))
    if "celery" in first:
        first["celery"] += " (on the WfCommons DAGs the levels add barriers: a task waits for its whole level above)"
    notes = [f"* **{s}**: {n}" for s, n in sorted(first.items())]
    targets = report.md_table(["target (issue 7)", "measured", "met"], target_rows(res), "llc")
    body = f"""## dagfold side by side with Dask, Celery, Prefect and Temporal (issues 7, 27)

Measured {doc['when']} by `make bench-peers` ({'smoke sizes' if doc['smoke'] else 'full sizes'}, time limit
{doc['limit_s']:.0f} s per run, {doc['workers']} worker processes each). Machine: {report.machine_line(
        doc['machine'], doc['load_before'])}.

Every task is a noop; each system runs each workload in a fresh process after a 16-task warm-up.
*tasks/s* = tasks ÷ time from submission to the client seeing the DAG done. *sched CPU* =
CPU of the scheduler alone (dagfold: the scheduler thread; Dask: the scheduler process without its client
thread); Celery and Prefect have no separable scheduler, so theirs is all CPU of the system. *total CPU* = all
processes of the system (bench client, scheduler, workers, projector) plus the broker (Kafka's JVM, redis-server).
*dep→start* = from an upstream task's success (its worker's clock) to the start of a downstream task whose
last upstream it was (queueing included). *peak RSS* = the system's own processes, summed (the Kafka broker
and redis-server not included; they are in the JSON as `infra_rss_mib`). *÷ peer* = dagfold's tasks/s over
the peer's; against a timed-out peer it is a lower bound (≥).

![tasks/s and p99 latency per system](img/bench-peers.png)

{table}

{targets}

How each system ran:

{chr(10).join(notes)}

Reproduce: `bench/peers/setup.sh && .venv/bin/python -m bench.peers` (peers go to `.cache/peers-venv` from
the pinned `bench/peers/requirements.txt`, never into dagfold's dependencies); one cell:
`.venv/bin/python -m bench.peers --systems dask --workloads montage`. Raw figures:
`bench/results/peers.json`.
"""
    report.replace_section("peers", body)


TRACING_HEADER = ["workload", "tracing", "tasks/s (median of runs)", "runs' tasks/s", "total CPU µs/task",
                  "on ÷ off"]


def tracing_rows(res: list[dict[str, Any]]) -> list[list[str]]:
    by = {(r["workload"], r["system"]): r for r in res}
    out = []
    for (w, s), r in by.items():
        off = by.get((w, "dagfold-kafka"))
        x = ("–" if s != TRACED or off is None or not off.get("tasks_per_s") or not r.get("tasks_per_s")
             else f"{r['tasks_per_s'] / off['tasks_per_s']:.2f}")
        out.append([w, "on" if s == TRACED else "off", report.fmt(r.get("tasks_per_s")),
                    ", ".join(report.fmt(v) for v in r.get("runs_tasks_per_s", [r.get("tasks_per_s")])),
                    report.fmt(r.get("median_total_cpu_us_per_task", r.get("total_cpu_us_per_task"))), x])
    return out


def tracing_docs(doc: dict[str, Any]) -> None:
    table = report.md_table(TRACING_HEADER, tracing_rows(doc["results"]), "llrrrr")
    loads = [v for r in doc["results"] for v in (r.get("runs_load_before") or [r.get("load_before")]) if v]
    by = {r["system"]: r for r in doc["results"]}
    off, on = (by.get(k, {}).get("tasks_per_s") for k in ("dagfold-kafka", TRACED))
    verdict = "not measured" if not off or not on else (
        f"{'met' if on / off >= 0.9 else 'not met'} ({on / off:.2f})")
    runs_off, runs_on = (by.get(k, {}).get("runs_tasks_per_s") or [] for k in ("dagfold-kafka", TRACED))
    paired = sorted(b / a for a, b in zip(runs_off, runs_on, strict=False) if a and b)
    paired_line = ("" if not paired else f"Run by run (each traced run ÷ the untraced run just before it): "
                   f"{', '.join(f'{x:.2f}' for x in paired)}; median {paired[(len(paired) - 1) // 2]:.2f}.")
    on_run = by.get(TRACED, {})
    exporter_line = "" if on_run.get("median_traces_cpu_us_per_task") is None else (
        f"The span exporter's CPU for the job, until it had sent the job's last span (median of the traced runs): "
        f"{on_run['median_traces_cpu_us_per_task']:.0f} µs a task; it had sent them "
        f"{on_run['median_trace_lag_s']:.1f} s after the job's end (schedule delay: 1 s).")
    cpu = "; ".join(f"{'on' if r['system'] == TRACED else 'off'}: " + ", ".join(
        f"{k} {v:.2f}" for k, v in sorted((r.get("cpu_by_process_s") or {}).items())) for r in doc["results"])
    body = f"""## What tracing costs (issue 28)

Measured {doc['when']} by `.venv/bin/python -m bench.peers --tracing-cost` (time limit {doc['limit_s']:.0f} s per
run, {doc['workers']} `dagfold worker` processes and a `dagfold scheduler` process, as the dagfold-Kafka row above).
Machine: {report.machine_line(doc['machine'], doc['load_before'])}; 1-min load average before each run
{min(v[0] for v in loads):.1f}–{max(v[0] for v in loads):.1f}.

*off*: no OpenTelemetry variable (no OpenTelemetry SDK or exporter is imported). *on*: `OTEL_EXPORTER_OTLP_ENDPOINT` set
for every dagfold process, and a `dagfold traces` process (the span exporter, `dagfold.services.tracing`: spans
built from the events, encoded as OTLP by `dagfold.tracing.SpanSink`, sent in batches by the OTLP exporter's
HTTP client) exporting to a Jaeger v2 with in-memory
storage on the same machine (deploy/jaeger/jaeger.sh; its CPU counts in the total). Before each traced run's
clock starts, the exporter has caught up with the events of the runs before it. The runs alternate off, on,
off, on, ... so that a load that comes and goes falls on both alike; each row is the median run by tasks/s.
Raw figures: `bench/results/peers-tracing.json`.

{table}

CPU seconds by process in the median runs: {cpu}.

{paired_line} {exporter_line}

Target (issue 28): tracing on costs less than 10% of tasks/s (on ÷ off ≥ 0.90): {verdict}.
"""
    report.replace_section("tracing-cost", body)


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median tasks/s (failed runs count as 0), with every run's tasks/s beside it."""
    if len(runs) == 1:
        return runs[0]
    ranked = sorted(runs, key=lambda r: r.get("tasks_per_s") or 0.0)
    out = {**ranked[(len(ranked) - 1) // 2], "runs_tasks_per_s": [r.get("tasks_per_s") for r in runs],
           "runs_load_before": [r.get("load_before") for r in runs]}
    for key in ("total_cpu_us_per_task", "sched_cpu_us_per_task", "dep_to_dispatch_p99_ms", "lat_p99_ms",
                "traces_cpu_us_per_task", "trace_lag_s"):
        vals = [r.get(key) for r in runs]
        out[f"runs_{key}"] = vals
        known = sorted(v for v in vals if v is not None)
        if known:  # each figure's own median over the runs (the median run's is kept under its name)
            out[f"median_{key}"] = known[(len(known) - 1) // 2]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="small sizes of the same shapes (build and debug)")
    ap.add_argument("--limit", type=float, default=180.0, help="seconds per run before it counts as timed out")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--kafka-port", type=int, default=19492)
    ap.add_argument("--brokers", type=int, choices=(1, 3), default=1,
                    help="Kafka brokers of the bench's cluster; 3: a 3-voter KRaft cluster, dagfold's topics with "
                         "replication 3 and min.insync.replicas 2 (as production runs); every broker's CPU counts")
    ap.add_argument("--temporal-db", choices=("wal", "file", "memory"), default="wal",
                    help="Temporal dev server's store (bench/peers/run_temporal.py): wal = SQLite file with a WAL "
                         "journal (the fastest durable configuration found here), file = the CLI's defaults, "
                         "memory = not durable")
    ap.add_argument("--kafka-one-process", action="store_true",
                    help="dagfold-kafka as one process (scheduler, projector and workers as threads of the "
                         "stack, like dagfold-embedded); default: a deployment's shape, a `dagfold scheduler` "
                         "process and `dagfold worker` processes, the read model in the measuring process")
    ap.add_argument("--kafka-data", type=Path,
                    help="use the broker already running (deploy/kafka/kafka.sh) from this data folder on "
                         "--kafka-port instead of starting one (a loaded machine may not start one in 90 s)")
    ap.add_argument("--no-setup", action="store_true")
    ap.add_argument("--no-limits", action="store_true")
    ap.add_argument("--no-docs", action="store_true")
    ap.add_argument("--repeat", type=int, default=None,
                    help="runs per cell; the cell reports its median run by tasks/s, all runs' tasks/s in "
                         "runs_tasks_per_s (short cells such as Montage vary by 2-3x run to run); default 3 "
                         "for the dagfold and Dask rows, 1 for Celery and Prefect (their runs take minutes)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rerender", action="store_true",
                    help="rebuild the table, plot and docs section from the results file; measure nothing")
    ap.add_argument("--tracing-cost", action="store_true",
                    help="dagfold-Kafka with tracing off and on (a Jaeger of its own), runs interleaved; only "
                         "the tracing-cost section of docs/benchmarks.md (default workload: montage)")
    ap.add_argument("--jaeger-port", type=int, default=24318, help="the Jaeger's OTLP/HTTP port (and the 4 above)")
    args = ap.parse_args()
    if args.tracing_cost:
        args.systems = ["dagfold-kafka", TRACED]
        if "--workloads" not in sys.argv:
            args.workloads = ["montage"]
        args.no_limits = args.no_setup = True

    if args.rerender:
        path = args.out or report.RESULTS / ("peers-smoke.json" if args.smoke else "peers.json")
        if args.tracing_cost:
            path = args.out or report.RESULTS / "peers-tracing.json"
            doc = json.loads(path.read_text())
            print(report.text_table(TRACING_HEADER, tracing_rows(doc["results"])))
            if not args.no_docs:
                tracing_docs(doc)
            return
        doc = json.loads(path.read_text())
        wls = [w for w in WORKLOADS if any(r["workload"] == w for r in doc["results"])]
        syss = [s for s in SYSTEMS if any(r["system"] == s for r in doc["results"])]
        print(report.text_table(HEADER, rows(doc["results"], wls, syss)))
        print(report.text_table(["target (issue 7)", "measured", "met"], target_rows(doc["results"])))
        if not args.no_docs:
            plot(doc["results"], wls, syss, report.IMG / "bench-peers.png")
            docs(doc, wls, syss)
        return
    if not args.no_setup:
        subprocess.run([str(ROOT / "bench/peers/setup.sh")], check=True)
    out = args.out or report.RESULTS / ("peers-tracing.json" if args.tracing_cost else
                                        "peers-smoke.json" if args.smoke else "peers.json")
    load_before = report.loadavg()
    broker = None
    kafka_data = None
    jaeger = None
    args.jaeger_pid = None
    needs_kafka = "dagfold-kafka" in args.systems or not args.no_limits
    logdir = Path(tempfile.mkdtemp(prefix="bench-peers-logs-"))
    results: list[dict[str, Any]] = []
    try:
        if TRACED in args.systems:
            jaeger = Jaeger(args.jaeger_port).start()
            args.otlp_endpoint, args.jaeger_pid = jaeger.endpoint, jaeger.pid
        if needs_kafka:
            broker = Broker(args.kafka_port, args.kafka_data, args.brokers).start()
            kafka_data = Path(tempfile.mkdtemp(prefix="bench-peers-dagfold-kafka-"))
        if "dagfold-kafka" in args.systems and not args.smoke:
            # A broker that just started runs its request paths interpreted until the JVM has compiled
            # them: on a fresh broker, the first Montage runs reached 1,200-2,000 tasks/s
            # and later ones 2,800-3,400. A production broker is warm; so is this one when measured.
            r = run_one("dagfold-kafka", args.workloads[0], args, broker, kafka_data, logdir)
            print(f"broker warm-up (not counted): {args.workloads[0]} tasks/s={r.get('tasks_per_s')}", flush=True)
        for w in args.workloads:
            # the systems' runs interleaved (a, b, c, a, b, c, ...): a load that comes and goes on a shared
            # machine falls on every system alike, which makes their ratios meaningful
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
            wanted = {s: args.repeat or (3 if s in (*DAGFOLD, "dask") else 1) for s in args.systems}
            for i in range(max(wanted.values())):
                for s in args.systems:
                    if i < wanted[s]:
                        runs[s].append(run_one(s, w, args, broker, kafka_data, logdir))
            for s in args.systems:
                r = median_run(runs[s])
                results.append(r)
                print(f"{w:16} {s:17} {cell_status(r):28} tasks/s={r.get('tasks_per_s')} "
                      f"p99={r.get('lat_p99_ms')} ms  (log {logdir})", flush=True)
        doc = {"when": report.when(), "smoke": args.smoke, "limit_s": args.limit, "workers": args.workers,
               "brokers": args.brokers, "temporal_db": args.temporal_db,
               "load_before": load_before, "load_after": report.loadavg(), "machine": report.machine(),
               "results": results}
        report.RESULTS.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        if args.tracing_cost:
            print(report.text_table(TRACING_HEADER, tracing_rows(results)))
            print(f"\nload average before/after: {load_before} / {doc['load_after']}; results in {out}")
            if not args.no_docs:
                tracing_docs(doc)
            return
        systems = [s for s in SYSTEMS if s in args.systems]
        print()
        print(report.text_table(HEADER, rows(results, args.workloads, systems)))
        print()
        print(report.text_table(["target (issue 7)", "measured", "met"], target_rows(results)))
        print(f"\nload average before/after: {load_before} / {doc['load_after']}; results in {out}")
        if not args.no_docs and not args.smoke:
            plot(results, args.workloads, systems, report.IMG / "bench-peers.png")
            docs(doc, args.workloads, systems)
        if not args.no_limits:
            assert broker is not None
            cmd = [MAIN_PY, "-m", "bench.limits", "--bootstrap", f"127.0.0.1:{args.kafka_port}", "--peers", str(out)]
            if args.smoke:
                cmd.append("--smoke")
            if args.no_docs:
                cmd.append("--no-docs")
            subprocess.run(cmd, cwd=ROOT, check=True)
    finally:
        if jaeger is not None:
            jaeger.stop()
        if broker is not None:
            broker.stop()
        if kafka_data is not None:
            shutil.rmtree(kafka_data, ignore_errors=True)


if __name__ == "__main__":
    main()
