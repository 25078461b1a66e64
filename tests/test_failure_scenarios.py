"""Black-box failure scenarios through the `dagfold` command and the REST API, on both backends.

One stack per backend for the module (started once, shared by the scenarios):

* embedded: ``dagfold up`` (scheduler, projector, API and two worker threads in
  one process, the log a RocksDB folder);
* kafka: ``dagfold up --log kafka://... --workers 0`` (scheduler, projector,
  API) plus two ``dagfold worker --log kafka://...`` processes, with short
  consumer session timeouts (URL settings) so a killed worker's dispatch
  partitions move within seconds.

Both run with a fault-injection handler ``crash_once`` registered (see ``BOOT``):
its first run raises ``dagfold.services.worker.worker.WorkerCrashed``, which makes the
worker thread act like a killed process (no report, no heartbeats, leaves its
consumer group). Job IDs and idempotency keys carry a random suffix: the Kafka
broker is shared by the whole test session.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from dagfold import codec
from dagfold.codec import default_codec
from dagfold.config import Config, dispatch_topic
from dagfold.log.embedded import EmbeddedLog
from dagfold.services.worker import HandlerRegistry, Worker
from tests.cli_support import ROOT, UpProcess, dagfold

# `dagfold` with a fault-injection handler registered first (the CLI has no option for it in `up`).
BOOT = """
import os, sys
from dagfold.services.worker import register_handler
from dagfold.services.worker.worker import WorkerCrashed

def crash_once(ctx):
    try:
        fd = os.open(ctx.args["marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return {"worker_id": ctx.worker_id}
    os.write(fd, ctx.worker_id.encode())
    os.close(fd)
    raise WorkerCrashed("fault injection: worker killed mid-task")

register_handler("crash_once", crash_once)
from dagfold.cli import app
sys.argv[0] = "dagfold"
app()
"""
DAGFOLD_BOOT = [sys.executable, "-c", BOOT]
SCENARIO_HANDLERS = "noop,sleep,shell,crash_once"  # shell is a capability the stack must enable
# librdkafka settings for the worker processes: a killed worker leaves its group after 6 s, not 45 s.
KAFKA_WORKER_SETTINGS = "consumer.session.timeout.ms=6000&consumer.heartbeat.interval.ms=500"


@dataclass
class Env:
    backend: str
    root: Path
    up: UpProcess
    log_url: str
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def api(self) -> str:
        return self.up.api

    def start_worker(self) -> subprocess.Popen[bytes]:
        """A `dagfold worker` process (Kafka only)."""
        n = len(self.workers)
        logf = open(self.root / f"worker-{n}.log", "ab")  # noqa: SIM115 - lives as long as the process
        url = f"{self.log_url}?{KAFKA_WORKER_SETTINGS}"
        p = subprocess.Popen([*DAGFOLD_BOOT, "worker", "--log", url, "--data", str(self.root / f"w{n}"),
                              "--queue", "default", "--handlers", SCENARIO_HANDLERS], cwd=ROOT, stdout=logf,
                             stderr=subprocess.STDOUT, start_new_session=True)
        self.workers.append(p)
        return p

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return dagfold(*args, "--api", self.api, timeout=timeout)

    def spec_file(self, text: str) -> Path:
        path = self.root / f"spec-{uuid.uuid4().hex[:8]}.yaml"
        path.write_text(text)
        return path

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(self.api + path, params=params, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def task(self, job_id: str, task_id: str) -> dict[str, Any]:
        return dict(self.get(f"/v1/jobs/{job_id}/tasks/{task_id}"))

    def attempts(self, job_id: str, task_id: str) -> list[dict[str, Any]]:
        return list(self.get(f"/v1/jobs/{job_id}/tasks/{task_id}/attempts")["attempts"])

    def history(self, job_id: str) -> list[dict[str, Any]]:
        return list(self.get(f"/v1/jobs/{job_id}/history", limit=1000)["events"])

    def wait_task(self, job_id: str, task_id: str, state: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        t: dict[str, Any] = {}
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.api}/v1/jobs/{job_id}/tasks/{task_id}", timeout=10)
            if r.status_code == 200:
                t = r.json()
                if t["state"] == state:
                    return t
            time.sleep(0.1)
        raise AssertionError(f"{job_id}/{task_id} not {state} after {timeout}s: {t}")


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def _start_up(data: Path, log: str, workers: int) -> UpProcess:
    return UpProcess(data, log=log, workers=workers, args=("--handlers", SCENARIO_HANDLERS),
                     command=DAGFOLD_BOOT).start()


@pytest.fixture(scope="module", params=["embedded", pytest.param("kafka", marks=pytest.mark.kafka)])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp(f"scenarios-{request.param}")
    if request.param == "embedded":
        e = Env("embedded", root, _start_up(root / "data", "embedded", 2), "embedded")
    else:
        url = f"kafka://{request.getfixturevalue('kafka_bootstrap')}"
        e = Env("kafka", root, _start_up(root / "data", url, 0), url)
        e.start_worker()
        e.start_worker()
    try:
        yield e
    finally:
        for p in e.workers:
            _stop(p)
        e.up.stop()


def uid() -> str:
    return uuid.uuid4().hex[:10]


# -- scenarios -------------------------------------------------------------------------

def test_transient_failure_is_retried_and_succeeds(env: Env) -> None:
    marker = env.root / f"attempts-{uid()}"
    job = f"transient-{uid()}"
    spec = env.spec_file(f"""
id: {job}
retry: {{max_attempts: 3, initial_interval_s: 0.2, backoff_coefficient: 2.0, max_interval_s: 1}}
tasks:
  - id: flaky
    handler: shell
    args:
      cmd: 'echo "$DAGFOLD_ATTEMPT" >> {marker}; [ "$DAGFOLD_ATTEMPT" -ge 2 ] || {{ echo not yet >&2; exit 1; }}'
  - {{id: after, depends_on: [flaky]}}
""")
    r = env.cli("submit", str(spec), "--wait", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["job"]["state"] == "succeeded"
    assert marker.read_text().split() == ["1", "2"]  # ran twice, and only twice
    attempts = env.attempts(job, "flaky")
    assert [(a["attempt"], a["outcome"]) for a in attempts] == [(1, "failed"), (2, "succeeded")]
    assert attempts[0]["exit_code"] == 1 and "not yet" in attempts[0]["stderr_tail"]
    kinds = [h["type"] for h in env.history(job)]
    assert kinds.count("TaskRetryScheduled") == 1 and kinds[-1] == "JobSucceeded"


def test_non_retryable_exit_code_fails_after_one_attempt(env: Env) -> None:
    marker = env.root / f"attempts-{uid()}"
    job = f"nonretryable-{uid()}"
    spec = env.spec_file(f"""
id: {job}
retry: {{max_attempts: 3, initial_interval_s: 0.2, non_retryable_exit_codes: [2]}}
tasks:
  - {{id: bad, handler: shell, args: {{cmd: 'echo "$DAGFOLD_ATTEMPT" >> {marker}; exit 2'}}}}
  - {{id: after, depends_on: [bad]}}
""")
    r = env.cli("submit", str(spec), "--wait", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    out = json.loads(r.stdout)
    assert out["job"]["state"] == "failed"
    assert {t["task_id"]: t["state"] for t in out["tasks"]} == {"bad": "failed", "after": "skipped"}
    assert marker.read_text().split() == ["1"]
    [attempt] = env.attempts(job, "bad")
    assert attempt["outcome"] == "failed" and attempt["exit_code"] == 2
    kinds = [h["type"] for h in env.history(job)]
    assert "TaskRetryScheduled" not in kinds and kinds[-1] == "JobFailed"


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with contextlib.suppress(OSError):  # a zombie not yet reaped counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z"
    return False


def test_cancel_stops_the_running_task_and_cancelling_again_is_a_409(env: Env) -> None:
    pidfile = env.root / f"pid-{uid()}"
    job = f"cancel-{uid()}"
    spec = env.spec_file(f"""
id: {job}
tasks:
  - {{id: long, handler: shell, args: {{cmd: 'echo $$ > {pidfile}; exec sleep 120'}}}}
  - {{id: after, depends_on: [long]}}
""")
    r = env.cli("submit", str(spec))
    assert r.returncode == 0 and r.stdout.strip() == job, r.stdout + r.stderr
    env.wait_task(job, "long", "running")
    deadline = time.monotonic() + 30
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    assert not _gone(pid)

    r = env.cli("cancel", job)
    assert r.returncode == 0, r.stderr
    cancelled = env.up.wait(job, timeout=60)
    assert cancelled["state"] == "cancelled"
    deadline = time.monotonic() + 20  # StopTask -> the shell handler kills the process group
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pid), "the cancelled task's process is still running"
    assert {t["task_id"]: t["state"] for t in env.get(f"/v1/jobs/{job}/tasks")["tasks"]} == {
        "long": "cancelled", "after": "cancelled"}
    kinds = [h["type"] for h in env.history(job)]
    assert kinds.count("TaskCancelled") == 2 and kinds[-1] == "JobCancelled"

    r = env.cli("cancel", job)
    assert r.returncode == 1
    assert "HTTP 409" in r.stderr and "job_finished" in r.stderr and "cancelled" in r.stderr
    done = env.spec_file(f"id: done-{uid()}\ntasks: [{{id: a}}]\n")
    r = env.cli("submit", str(done), "--wait", "--json")
    done_id = json.loads(r.stdout)["job"]["job_id"]
    r = env.cli("cancel", done_id)
    assert r.returncode == 1 and "HTTP 409" in r.stderr and "already succeeded" in r.stderr


def test_duplicate_submission_returns_the_same_job(env: Env) -> None:
    key = f"order-{uid()}"
    body = f"idempotency_key: {key}\ntasks: [{{id: a}}, {{id: b, depends_on: [a]}}]\n"
    spec = env.spec_file(body)
    first = env.cli("submit", str(spec), "--json")
    second = env.cli("submit", str(spec), "--json")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    job_id = json.loads(first.stdout)["job_id"]
    assert json.loads(second.stdout)["job_id"] == job_id
    assert env.up.wait(job_id, timeout=60)["state"] == "succeeded"
    # a different body under the same key: refused, by the API at once (409) or by the scheduler
    other = env.spec_file(f"idempotency_key: {key}\ntasks: [{{id: a}}, {{id: c}}]\n")
    third = env.cli("submit", str(other), "--json")
    if third.returncode != 0:
        assert "HTTP 409" in third.stderr and "idempotency_conflict" in third.stderr, third.stderr
    else:  # accepted for the log: the fold rejects it (JobRejected, code idempotency_conflict)
        assert json.loads(third.stdout)["job_id"] == job_id
        deadline = time.monotonic() + 30
        while "JobRejected" not in [h["type"] for h in env.history(job_id)] and time.monotonic() < deadline:
            time.sleep(0.1)
        [rejected] = [h for h in env.history(job_id) if h["type"] == "JobRejected"]
        assert "idempotency_conflict" in rejected["detail"]
    kinds = [h["type"] for h in env.history(job_id)]
    # the API answers a repeat it already knows from the read model; a repeat that reaches the
    # scheduler first is recorded as SubmissionDeduplicated: either way, one job
    assert kinds.count("JobAccepted") == 1 and kinds.count("SubmissionDeduplicated") <= 1
    assert env.get(f"/v1/jobs/{job_id}")["state"] == "succeeded"  # the first job is unchanged
    assert len(env.get(f"/v1/jobs/{job_id}/tasks")["tasks"]) == 2
    listed = [j for j in env.get("/v1/jobs", limit=1000)["jobs"] if j["job_id"] == job_id]
    assert len(listed) == 1


def test_redrive_after_a_fix_succeeds_and_keeps_the_first_failure(env: Env) -> None:
    fixed = env.root / f"fixed-{uid()}"
    job = f"redrive-{uid()}"
    spec = env.spec_file(f"""
id: {job}
tasks:
  - {{id: prepare}}
  - id: load
    depends_on: [prepare]
    handler: shell
    args: {{cmd: 'test -e {fixed} || {{ echo "input missing" >&2; exit 3; }}'}}
  - {{id: report, depends_on: [load]}}
""")
    r = env.cli("submit", str(spec), "--wait")
    assert r.returncode == 1, r.stdout + r.stderr
    fixed.touch()
    r = env.cli("redrive", job)
    assert r.returncode == 0, r.stderr
    job_rec = env.up.wait(job, timeout=60, states={"succeeded", "succeeded_partial", "cancelled"})
    assert job_rec["state"] == "succeeded"
    states = {t["task_id"]: (t["state"], t["attempt"]) for t in env.get(f"/v1/jobs/{job}/tasks")["tasks"]}
    assert states == {"prepare": ("succeeded", 1), "load": ("succeeded", 2), "report": ("succeeded", 1)}
    attempts = env.attempts(job, "load")
    assert [(a["attempt"], a["outcome"]) for a in attempts] == [(1, "failed"), (2, "succeeded")]
    hist = env.history(job)
    kinds = [h["type"] for h in hist]
    assert kinds.index("JobFailed") < kinds.index("JobRedriven") < kinds.index("JobSucceeded")
    first_failure = next(h for h in hist if h["type"] == "TaskFailed")
    assert first_failure["task_id"] == "load" and first_failure["attempt"] == 1
    assert "exit code 3" in first_failure["detail"]
    r = env.cli("redrive", job)  # nothing left to redrive
    assert r.returncode == 1 and "HTTP 409" in r.stderr and "not_redrivable" in r.stderr


def test_a_new_job_starts_on_an_idle_worker_while_another_runs_a_long_task(env: Env) -> None:
    """The head-of-line case: with one worker busy on a long task and the other idle, a new job's tasks
    start on the idle worker at once. Dispatch records used to ride consumer-group partitions: a new
    task on the busy worker's partition waited for the long task (120 s on Kafka in issue 14)."""
    long_job, job = f"long-{uid()}", f"short-{uid()}"
    r = env.cli("submit", str(env.spec_file(f"""
id: {long_job}
tasks:
  - {{id: long, handler: sleep, args: {{seconds: 300}}}}
""")))
    assert r.returncode == 0, r.stderr
    try:
        busy = env.wait_task(long_job, "long", "running", timeout=90)["worker_id"]
        tasks = "\n".join(f"  - {{id: t{i}, handler: sleep, args: {{seconds: 0.05}}}}" for i in range(8))
        r = env.cli("submit", str(env.spec_file(f"id: {job}\ntasks:\n{tasks}\n")))
        assert r.returncode == 0, r.stderr
        final = env.up.wait(job, timeout=120)
        assert final["state"] == "succeeded", final
        assert env.task(long_job, "long")["state"] == "running"  # still busy all along
        waits = []
        for i in range(8):
            [att] = env.attempts(job, f"t{i}")
            assert att["worker_id"] != busy  # never queued behind the long task
            t = env.task(job, f"t{i}")
            waits.append(att["started_ms"] - t["dispatched_ms"])
        # within 1 s for the first; the idle worker then runs the 8 one after another (0.05 s each),
        # so the last waits for 7 of them: a generous bound
        assert min(waits) < 1_000 and max(waits) < 5_000, waits
    finally:
        env.cli("cancel", long_job)


def test_killed_worker_loses_its_lease_and_another_worker_finishes(env: Env) -> None:
    """heartbeat_s 2: the lease of a worker killed mid-task expires, attempt 2 runs on another worker. The
    default retry policy (one attempt): a lost worker is not the task's failure, so it spends no budget."""
    job = f"heartbeat-{uid()}"
    marker = env.root / f"crashed-{uid()}"
    worker_pid, shell_pid = env.root / f"worker-pid-{uid()}", env.root / f"shell-pid-{uid()}"
    if env.backend == "embedded":
        # worker threads share one process: the crash_once handler makes its worker thread "die"
        task = f"{{id: work, handler: crash_once, args: {{marker: '{marker}'}}}}"
    else:
        # the shell's parent is its reaper; the worker is the reaper's parent (field 4 of /proc/PID/stat)
        cmd = (f'if [ "$DAGFOLD_ATTEMPT" = 1 ]; then [ -e {worker_pid} ] || '
               f'cut -d" " -f4 /proc/$PPID/stat > {worker_pid}; '
               f'[ -e {shell_pid} ] || echo $$ > {shell_pid}; exec sleep 120; fi; echo finished')
        task = f"{{id: work, handler: shell, args: {{cmd: '{cmd}'}}}}"
    spec = env.spec_file(f"""
id: {job}
timeouts: {{heartbeat_s: 2}}
tasks:
  - {task}
""")
    r = env.cli("submit", str(spec))
    assert r.returncode == 0, r.stderr
    try:
        if env.backend == "kafka":
            assert sum(p.poll() is None for p in env.workers) == 2
            running = env.wait_task(job, "work", "running", timeout=90)
            deadline = time.monotonic() + 30
            while not (worker_pid.exists() and worker_pid.read_text().strip()) and time.monotonic() < deadline:
                time.sleep(0.05)
            pid = int(worker_pid.read_text())
            [victim] = [p for p in env.workers if p.pid == pid]  # the task's worker, a `dagfold worker`
            holder = running["worker_id"]
            os.kill(pid, signal.SIGKILL)
            victim.wait(10)
        final = env.up.wait(job, timeout=120)
        assert final["state"] == "succeeded", final
        attempts = env.attempts(job, "work")
        assert [a["attempt"] for a in attempts] == [1, 2]
        first, second = attempts
        if env.backend == "embedded":
            holder = marker.read_text()
        assert first["worker_id"] == holder and first["outcome"] == "lost"
        assert first["reason"].startswith("lease_expired"), first
        assert second["outcome"] == "succeeded" and second["worker_id"] not in (None, holder)
        hist = env.history(job)
        reclaimed = [h for h in hist if h["type"] == "LeaseReclaimed"]
        assert len(reclaimed) == 1 and reclaimed[0]["attempt"] == 1 and "lease_expired" in reclaimed[0]["detail"]
        assert not [h for h in hist if h["type"] == "TaskFailed"]
    finally:
        if shell_pid.exists():  # the killed worker's `sleep` (its reaper kills it too; in case it did not)
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.killpg(int(shell_pid.read_text()), signal.SIGKILL)
        if env.backend == "kafka":
            for p in [p for p in env.workers if p.poll() is not None]:
                env.workers.remove(p)
            while len(env.workers) < 2:
                env.start_worker()


# -- regressions (in-process) ---------------------------------------------------------

def test_regression_stop_arriving_as_the_start_is_flushed_prevents_the_run(tmp_path: Path) -> None:
    """A StopTask that comes after the worker checked its stop list but before it registered the
    attempt as running (e.g. lease_rejected for a redelivered record) must still stop the attempt."""
    cfg = Config(partitions=2, dispatch_partitions=2)
    log = EmbeddedLog(tmp_path / "log")
    try:
        log.create_topics(cfg.core_topics() + [cfg.dispatch_spec("default")])
        ran = []
        reg = HandlerRegistry.with_builtins()
        reg.register("probe", lambda ctx: ran.append(ctx.attempt))
        w = Worker(log, "default", "w1", reg, config=cfg, poll_timeout_s=0.05)
        real_flush = w._producer.flush

        def flush_then_stop(*args: Any, **kwargs: Any) -> None:  # the StopTask lands right after the flush
            real_flush(*args, **kwargs)
            w.stop_task("J", "t", 1, "lease_rejected: attempt 1 is already leased to w0")

        w._producer.flush = flush_then_stop  # type: ignore[method-assign]
        rec = codec.make("dagfold.dispatch.TaskDispatch", job_id="J", task_id="t", attempt=1, handler="probe",
                         args_json="{}", idempotency_key="J/t", lease_timeout_s=30.0, start_to_close_s=None,
                         dispatched_at_ms=0)
        p = log.producer("test")
        p.send(dispatch_topic("default"), b"J", default_codec().encode(rec))
        p.flush()
        stop = threading.Event()
        t = w.start_thread(stop)
        deadline = time.monotonic() + 10
        while w.tasks_run == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        stop.set()
        t.join(10)
        w.close()
        assert w.tasks_run == 1 and ran == [], "the stopped attempt ran"
        assert w.tasks_skipped == 1 and w.tasks_succeeded == 0
    finally:
        log.close()
