"""The soak: a steady mix of jobs against `dagfold up` (the embedded stack, as `make run` starts it) for a long
time, with the process's memory, the data folder's disk use and the API's p99 sampled as it goes.

The mix, per submitted job (``--max-tasks`` caps the DAG sizes; the short form in `make test` uses 4):

* 70% small DAGs: 1-10 ``noop`` tasks (at most ``--max-tasks``), a chain or a fan-out with a join;
* 10% retries: a chain of 1-4 ``noop`` tasks (at most ``--max-tasks``), then ``soak_flaky``, failing its first
  attempt and succeeding at its second (task retry policy: 3 attempts, no backoff), then one more ``noop``;
* 8% cancels: a ``sleep`` task of 2 s and a ``noop`` after it, cancelled through the API 0.2-0.5 s after its
  submission;
* 7% large DAGs: layered, 100 to ``--max-tasks`` (default 2,000) ``noop`` tasks (small DAGs instead where
  ``--max-tasks`` is at most 10);
* 5% GPU jobs (``POST /v1/gpu-jobs``, 1-4 GPUs on the 2 simulated 8-GPU hosts of ``--gpu-nodes 2``; the demo job
  runs 3 steps of 0.05 s in a subprocess; small DAGs instead without GPU hosts).

Every job names a callback URL: a receiver in this process counts the deliveries, which is how the driver knows
a job ended. The driver keeps at most ``--in-flight`` jobs unfinished (a closed loop: the rate is what the stack
sustains; ``--rate`` caps it). Every ``--sample-s`` seconds it records the RSS of `dagfold up` and of each of its
child processes (the demo GPU jobs), the data folder's size on disk, the p99 of the API calls of the interval
(submits, cancels and a status probe), and the counts so far.

    python -m bench.soak --minutes 60                      # make soak: bench/results/soak.json, docs/img/soak.png
    python -m bench.soak --jobs 2000 --tracemalloc DIR    # snapshots of the stack's allocations, for diffs
    python -m bench.soak --direct --jobs 20000 --max-tasks 4 --plot ''   # tests/test_soak.py's run

The handler ``soak_flaky`` lives in bench/soak_handlers.py (`dagfold up --handler-module bench.soak_handlers`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "soak.json"
PLOT = ROOT / "docs" / "img" / "soak.png"


# -- the driver ----------------------------------------------------------------------------------------------

@dataclass
class Counts:
    submitted: int = 0
    refused: int = 0  # 429 and other non-2xx answers to a submission
    cancels: int = 0
    # requests sent again because a kept-alive connection was closed under them (the server's keep-alive
    # timeout racing the next request: no answer was read, and every soak request is idempotent)
    resent: int = 0
    callbacks: int = 0
    tasks_submitted: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_state: dict[str, int] = field(default_factory=dict)


class Receiver:
    """A local callback receiver: counts POSTs by job state, remembers which jobs were called back."""

    def __init__(self) -> None:
        self.done: set[str] = set()
        self.states: dict[str, int] = {}
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                try:
                    doc = json.loads(body)
                    job, state = str(doc.get("job_id")), str(doc.get("state"))
                except ValueError:
                    job, state = "", "unreadable"
                with receiver.lock:
                    if job not in receiver.done:
                        receiver.done.add(job)
                        receiver.states[state] = receiver.states.get(state, 0) + 1
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/cb"
        threading.Thread(target=self.server.serve_forever, name="receiver", daemon=True).start()

    def finished(self) -> int:
        with self.lock:
            return len(self.done)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def small_dag(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """``n`` noop tasks: a chain, or a fan-out from the first task joined by the last."""
    if n <= 2 or rng.random() < 0.5:
        return [{"id": f"t{i}", "depends_on": [f"t{i - 1}"] if i else []} for i in range(n)]
    mid = [{"id": f"t{i}", "depends_on": ["t0"]} for i in range(1, n - 1)]
    return [{"id": "t0"}, *mid, {"id": f"t{n - 1}", "depends_on": [t["id"] for t in mid]}]


def layered_dag(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """``n`` noop tasks in layers of up to 200; each task depends on 1-3 tasks of the layer before."""
    tasks: list[dict[str, Any]] = []
    prev: list[str] = []
    while len(tasks) < n:
        layer = [f"l{len(tasks) + i}" for i in range(min(rng.randint(20, 200), n - len(tasks)))]
        for tid in layer:
            deps = rng.sample(prev, min(len(prev), rng.randint(1, 3))) if prev else []
            tasks.append({"id": tid, "depends_on": deps})
        prev = layer
    return tasks


def next_job(rng: random.Random, seq: int, max_tasks: int, callback: str, gpu: bool) -> tuple[str, str, dict[str, Any]]:
    """(kind, route, body) of the next submission of the mix (module docstring)."""
    tenant = f"soak-{seq % 4}"
    base = {"id": f"soak-{seq:08d}", "tenant": tenant, "callback_url": callback}
    r = rng.random()
    if (r < 0.05 and not gpu) or (0.05 <= r < 0.12 and max_tasks <= 10):
        r = 1.0  # a small DAG in place of a kind this run leaves out
    if r < 0.05:
        return "gpu", "/v1/gpu-jobs", {
            "job_id": base["id"], "tenant": tenant, "callback_url": callback, "model": "soak",
            "params": {"steps": 3, "step_s": 0.05}, "resources": {"gpus": rng.choice((1, 2, 4)), "max_runtime_s": 120}}
    if r < 0.12:
        return "large", "/v1/jobs", {**base, "tasks": layered_dag(rng, rng.randint(100, max_tasks))}
    if r < 0.20:
        return "cancel", "/v1/jobs", {**base, "tasks": [
            {"id": "slow", "handler": "sleep", "args": {"seconds": 2}}, {"id": "after", "depends_on": ["slow"]}]}
    if r < 0.30:
        n = rng.randint(1, min(4, max_tasks))
        tasks = [{"id": f"a{i}", "depends_on": [f"a{i - 1}"] if i else []} for i in range(n)]
        flaky = {"id": "flaky", "handler": "soak_flaky", "depends_on": [tasks[-1]["id"]],
                 "retry": {"max_attempts": 3, "initial_interval_s": 0, "jitter": False}}
        return "retry", "/v1/jobs", {**base, "tasks": [*tasks, flaky, {"id": "z", "depends_on": ["flaky"]}]}
    return "small", "/v1/jobs", {**base, "tasks": small_dag(rng, rng.randint(1, min(10, max_tasks)))}


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc/*/stat)."""
    parents: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` in MB (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def disk_mb(path: Path) -> float:
    """Space the folder's files take on disk, MB."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file compaction removed meanwhile
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
    return total / 1e6


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_stack(data: Path, port: int, env: dict[str, str], gpu_nodes: int, log_path: Path) -> subprocess.Popen[bytes]:
    """`dagfold up` as `make run` starts it (handlers noop, sleep, shell; two simulated GPU hosts), plus the
    soak's handler module; waits until the API answers."""
    import httpx

    cmd = [sys.executable, "-m", "dagfold", "up", "--handlers", "noop,sleep,shell,soak_flaky",
           "--handler-module", "bench.soak_handlers", "--gpu-nodes", str(gpu_nodes), "--data", str(data),
           "--port", str(port)]
    if os.geteuid() == 0:  # as `make run` does (its TASK_FLAGS): shell tasks and GPU jobs as root, said explicitly
        cmd.append("--allow-root-tasks")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dagfold up ended with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code < 500:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("dagfold up did not answer within 120 s")


def stack_env(snapshots: Path | None) -> dict[str, str]:
    """The environment of the soak's `dagfold up`: the operator settings of a busy deployment (admission
    sized for the soak's rate, commands retained for an hour, finished jobs for 15 minutes, callbacks allowed
    to the driver's loopback receiver) and, when profiling, tracemalloc."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAGFOLD_")}
    env.update({"PYTHONPATH": str(ROOT), "DAGFOLD_SUBMIT_RATE": "100000", "DAGFOLD_SUBMIT_BURST": "100000",
                "DAGFOLD_MAX_OPEN_JOBS": "100000", "DAGFOLD_COMMANDS_RETENTION_MS": str(3600 * 1000),
                # finished jobs leave the scheduler's state and the read models 15 minutes after they end (the
                # events stay: the audit log)
                "DAGFOLD_FINISHED_JOB_RETENTION_MS": str(15 * 60 * 1000),
                "DAGFOLD_CALLBACK_BASE_BACKOFF_S": "0.2", "DAGFOLD_CALLBACK_CONCURRENCY": "16",
                # the soak's receiver runs in the driver, on loopback: callbacks there are denied unless allowed
                "DAGFOLD_CALLBACK_ALLOW": "127.0.0.1/32"})
    if snapshots is not None:
        env.update({"PYTHONTRACEMALLOC": "1", "DAGFOLD_SOAK_SNAPSHOTS": str(snapshots)})
    return env


@dataclass
class Plan:
    seconds: float
    jobs: int  # 0: no limit
    max_tasks: int
    in_flight: int
    rate: float  # jobs/s at most; 0: as fast as the stack takes them
    sample_s: float
    gpu_nodes: int
    seed: int
    snapshots: Path | None = None
    snapshot_every: int = 0  # jobs between tracemalloc snapshots


def run(plan: Plan, data: Path) -> dict[str, Any]:
    import httpx

    port = free_port()
    receiver = Receiver()
    proc = start_stack(data, port, stack_env(plan.snapshots), plan.gpu_nodes, data.parent / "up.log")
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
    rng = random.Random(plan.seed)
    counts = Counts()
    latencies: list[float] = []
    lat_lock = threading.Lock()
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    t0 = time.monotonic()
    cancels: list[tuple[float, str]] = []
    phase = ["load"]

    def timed(method: str, path: str, **kw: Any) -> httpx.Response:
        start = time.perf_counter()
        try:
            r = api.request(method, path, **kw)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # a kept-alive connection the server closed as this request went out (its keep-alive timeout):
            # nothing was answered; submissions carry their job ID and cancels are idempotent, so send again
            counts.resent += 1
            r = api.request(method, path, **kw)
        with lat_lock:
            latencies.append((time.perf_counter() - start) * 1000)
        return r

    def sample() -> None:
        pids = _children(proc.pid)
        with lat_lock:
            window, latencies[:] = list(latencies), []
        finished = receiver.finished()
        samples.append({
            "t_s": round(time.monotonic() - t0, 1), "rss_mb": round(rss_mb(proc.pid), 1),
            "children_rss_mb": round(sum(rss_mb(p) for p in pids), 1), "children": len(pids),
            "disk_mb": round(disk_mb(data), 1), "api_p99_ms": None if not window else round(p99(window) or 0, 1),
            "api_calls": len(window), "submitted": counts.submitted, "finished": finished,
            "tasks_submitted": counts.tasks_submitted, "phase": phase[0]})

    def sampler() -> None:
        while not stop.wait(plan.sample_s):
            sample()

    def prober() -> None:  # what an operator's dashboard asks: the newest jobs and one job's status
        while not stop.wait(1.0):
            try:
                timed("GET", "/v1/jobs", params={"limit": 20})
                if counts.submitted:
                    timed("GET", f"/v1/jobs/soak-{rng.randrange(counts.submitted):08d}")
            except httpx.HTTPError:
                pass

    threads = [threading.Thread(target=f, daemon=True) for f in (sampler, prober)]
    sample()
    for t in threads:
        t.start()
    snaps = 0
    try:
        seq = 0
        while time.monotonic() - t0 < plan.seconds and (not plan.jobs or seq < plan.jobs):
            if proc.poll() is not None:
                raise RuntimeError(f"dagfold up ended with {proc.returncode}")
            now = time.monotonic()
            while cancels and cancels[0][0] <= now:
                _, job_id = cancels.pop(0)
                timed("POST", f"/v1/jobs/{job_id}/cancel")
                counts.cancels += 1
            if seq - receiver.finished() >= plan.in_flight or (plan.rate and seq >= plan.rate * (now - t0)):
                time.sleep(0.005)
                continue
            kind, route, body = next_job(rng, seq, plan.max_tasks, receiver.url, plan.gpu_nodes > 0)
            r = timed("POST", route, json=body)
            seq += 1
            if r.status_code >= 300:
                counts.refused += 1
                receiver.done.add(f"refused-{seq}")  # never called back: out of the in-flight count
                continue
            counts.submitted = seq
            counts.tasks_submitted += len(body.get("tasks", [1]))
            counts.by_kind[kind] = counts.by_kind.get(kind, 0) + 1
            if kind == "cancel":
                cancels.append((now + rng.uniform(0.2, 0.5), str(body["id"])))
            if plan.snapshots is not None and plan.snapshot_every and seq % plan.snapshot_every == 0:
                proc.send_signal(signal.SIGUSR2)
                snaps += 1
        drain_until = time.monotonic() + 120
        while receiver.finished() < seq and time.monotonic() < drain_until:
            time.sleep(0.5)
        ran_s = time.monotonic() - t0
        phase[0] = "idle"
        idle_until = time.monotonic() + plan.sample_s * 6  # a minute idle at the default 10 s
        while time.monotonic() < idle_until:
            time.sleep(0.5)
        if plan.snapshots is not None:
            proc.send_signal(signal.SIGUSR2)
            time.sleep(5)
        sample()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        api.close()
        receiver.close()
    counts.callbacks = receiver.finished() - counts.refused
    counts.by_state = dict(receiver.states)
    return {"plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in plan.__dict__.items()},
            "counts": counts.__dict__, "run_s": round(ran_s, 1), "jobs_per_s": round(counts.submitted / ran_s, 1),
            "tasks_per_s": round(counts.tasks_submitted / ran_s, 1), "samples": samples,
            "load_average": os.getloadavg(), "cpus": os.cpu_count()}


def snapshot(folder: Path) -> None:
    """A tracemalloc snapshot of this process into ``folder``, numbered."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.take_snapshot().dump(str(folder / f"{len(list(folder.glob('*.snap'))):03d}.snap"))


def run_direct(plan: Plan, data: Path) -> dict[str, Any]:
    """The mix without HTTP, for the short form in `make test`: the stack runs in this process (what `dagfold up`
    runs, less the API; no GPU hosts) and jobs and cancels go straight onto its commands topic. RSS is this
    process's."""
    os.environ.update({k: v for k, v in stack_env(None).items() if k.startswith("DAGFOLD_CALLBACK")})
    import bench.soak_handlers  # noqa: F401  (registers soak_flaky)
    from dagfold.commands import cancel_job, submit_job
    from dagfold.config import Config
    from dagfold.jobspec import parse_spec, to_job_spec
    from dagfold.services.stack import Stack, StackOptions
    if plan.snapshots is not None:
        import tracemalloc

        tracemalloc.start(int(os.environ.get("SOAK_FRAMES", "1")))
    receiver = Receiver()
    stack = Stack(Config.from_env(data_dir=data), StackOptions(api=False)).start()
    rng = random.Random(plan.seed)
    samples: list[dict[str, Any]] = []
    cancels: list[tuple[float, str]] = []
    t0 = time.monotonic()
    tasks = seq = 0

    def sample(phase: str) -> None:
        samples.append({"t_s": round(time.monotonic() - t0, 1), "rss_mb": round(rss_mb(os.getpid()), 1),
                        "children_rss_mb": 0.0, "children": 0, "disk_mb": round(disk_mb(data), 1),
                        "api_p99_ms": None, "api_calls": 0, "submitted": seq, "finished": receiver.finished(),
                        "tasks_submitted": tasks, "phase": phase})

    try:
        sample("load")
        next_sample = time.monotonic() + plan.sample_s
        while time.monotonic() - t0 < plan.seconds and (not plan.jobs or seq < plan.jobs):
            if stack.failed:
                raise RuntimeError(f"the stack failed: {stack.errors[0]!r}")
            now = time.monotonic()
            if now >= next_sample:
                sample("load")
                next_sample = now + plan.sample_s
            while cancels and cancels[0][0] <= now:
                stack.sender.send(cancel_job(cancels.pop(0)[1]))
            if seq - receiver.finished() >= plan.in_flight:
                time.sleep(0.005)
                continue
            kind, _, body = next_job(rng, seq, plan.max_tasks, receiver.url, gpu=False)
            stack.sender.send(submit_job(to_job_spec(parse_spec(body)), source="soak"))
            seq += 1
            tasks += len(body["tasks"])
            if kind == "cancel":
                cancels.append((now + rng.uniform(0.2, 0.5), str(body["id"])))
            if plan.snapshots is not None and plan.snapshot_every and seq % plan.snapshot_every == 0:
                snapshot(plan.snapshots)
        drain_until = time.monotonic() + 120
        while receiver.finished() < seq and time.monotonic() < drain_until:
            time.sleep(0.5)
        ran_s = time.monotonic() - t0
        sample("idle")
        if plan.snapshots is not None:
            snapshot(plan.snapshots)
    finally:
        stack.stop()
        receiver.close()
    return {"mode": "direct", "plan": {k: (str(v) if isinstance(v, Path) else v) for k, v in plan.__dict__.items()},
            "counts": {"submitted": seq, "tasks_submitted": tasks, "callbacks": receiver.finished(),
                       "by_state": dict(receiver.states)},
            "run_s": round(ran_s, 1), "jobs_per_s": round(seq / ran_s, 1), "tasks_per_s": round(tasks / ran_s, 1),
            "samples": samples, "load_average": os.getloadavg(), "cpus": os.cpu_count()}


def second_half_growth(samples: list[dict[str, Any]], key: str = "rss_mb") -> float:
    """MB of growth over the second half of the samples: a least-squares slope times the half's span."""
    half = samples[len(samples) // 2:]
    if len(half) < 2:
        return 0.0
    xs, ys = [s["t_s"] for s in half], [s[key] for s in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return slope * (xs[-1] - xs[0])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["samples"]
    t = [x["t_s"] / 60 for x in s]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(t, [x["rss_mb"] for x in s], label="dagfold up")
    axes[0].plot(t, [x["children_rss_mb"] for x in s], label="its child processes (GPU demo jobs)")
    axes[0].set_ylabel("RSS, MB")
    axes[0].legend(loc="upper left")
    axes[1].plot(t, [x["disk_mb"] for x in s], color="tab:green")
    axes[1].set_ylabel("data folder, MB")
    axes[2].plot(t, [x["api_p99_ms"] for x in s], color="tab:red", marker=".", linestyle="")
    axes[2].set_ylabel("API p99, ms")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("minutes")
    idle = next((x["t_s"] / 60 for x in s if x.get("phase") == "idle"), None)
    for ax in axes if idle is not None else ():
        ax.axvline(idle, color="grey", linestyle=":", linewidth=1)  # the mix ends: idle from here
    c = result["counts"]
    fig.suptitle(f"soak: {c['submitted']:,} jobs ({c['tasks_submitted']:,} tasks), {result['jobs_per_s']} jobs/s; "
                 f"load {result['load_average'][0]:.1f} on {result['cpus']} CPUs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def top_growth(snapshots: list[Path], limit: int = 25) -> Iterator[str]:
    """The allocation sites that grew most between the second snapshot and the last (after warm-up)."""
    import tracemalloc

    if len(snapshots) < 2:
        return
    first = tracemalloc.Snapshot.load(str(snapshots[min(1, len(snapshots) - 2)]))
    last = tracemalloc.Snapshot.load(str(snapshots[-1]))
    for stat in last.compare_to(first, "lineno")[:limit]:
        yield str(stat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0, help="wall time of the mix (default 60)")
    ap.add_argument("--jobs", type=int, default=0, help="stop after this many jobs (0: no limit)")
    ap.add_argument("--max-tasks", type=int, default=2000, help="largest DAG of the mix")
    ap.add_argument("--in-flight", type=int, default=200, help="unfinished jobs at most")
    ap.add_argument("--rate", type=float, default=0.0, help="jobs/s at most (0: what the stack takes)")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--gpu-nodes", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tracemalloc", type=Path, help="write tracemalloc snapshots here and print the growth")
    ap.add_argument("--snapshot-every", type=int, default=1000, help="jobs between snapshots (--tracemalloc)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--plot", default=str(PLOT), help="the figure ('': none)")
    ap.add_argument("--keep", action="store_true", help="keep the data folder")
    ap.add_argument("--direct", action="store_true", help="the stack in this process, jobs straight onto its log "
                    "(no API, no GPU hosts): the short form of tests/test_soak.py")
    a = ap.parse_args()
    if a.tracemalloc is not None:
        a.tracemalloc.mkdir(parents=True, exist_ok=True)
    plan = Plan(seconds=a.minutes * 60, jobs=a.jobs, max_tasks=a.max_tasks, in_flight=a.in_flight, rate=a.rate,
                sample_s=a.sample_s, gpu_nodes=a.gpu_nodes, seed=a.seed, snapshots=a.tracemalloc,
                snapshot_every=a.snapshot_every)
    tmp = Path(tempfile.mkdtemp(prefix="dagfold-soak-"))
    try:
        result = (run_direct if a.direct else run)(plan, tmp / "data")
    finally:
        if not a.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"data kept in {tmp}")
    s = result["samples"]
    result["rss_first_mb"], result["rss_peak_mb"], result["rss_last_mb"] = (
        s[0]["rss_mb"], max(x["rss_mb"] for x in s), s[-1]["rss_mb"])
    result["rss_second_half_growth_mb"] = round(second_half_growth([x for x in s if x["phase"] == "load"]), 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    if a.plot:
        plot(result, Path(a.plot))
    c = result["counts"]
    print(f"{c['submitted']} jobs ({c['tasks_submitted']} tasks) in {result['run_s']} s: {result['jobs_per_s']} "
          f"jobs/s; RSS {result['rss_first_mb']} -> peak {result['rss_peak_mb']} -> {result['rss_last_mb']} MB after "
          f"idle; second-half growth {result['rss_second_half_growth_mb']} MB; disk {s[-1]['disk_mb']} MB; "
          f"states {c['by_state']}; wrote {a.out}{' and ' + a.plot if a.plot else ''}")
    if a.tracemalloc is not None:
        for line in top_growth(sorted(a.tracemalloc.glob("*.snap"))):
            print(line)


if __name__ == "__main__":
    main()
