"""A worker's loss is not the task's failure: `dagfold up` (scheduler and workers in one process, the
embedded log) killed with SIGKILL again and again, as an operator or the OOM killer would.

* A job with the default retry policy (one attempt) survives repeated kill -9 of the whole stack: the
  attempts that were running are reclaimed (LeaseReclaimed) and run again without spending the retry
  budget, and the job succeeds. Before worker losses were told apart from failures, the first kill
  failed every running task with ``lease_expired`` and the job with it (issue 14).
* A task that kills every worker it lands on (here: its shell kills the worker process) fails with
  ``worker_lost x 3`` after three losses, instead of taking workers down forever.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx

from tests.cli_support import UpProcess

SHELL = ("--handlers", "noop,sleep,shell")  # these tasks run shell: a capability the stack enables


def _history(up: UpProcess, job_id: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{up.api}/v1/jobs/{job_id}/history", params={"limit": 1000}, timeout=10)
    assert r.status_code == 200, r.text
    return list(r.json()["events"])


def _task(up: UpProcess, job_id: str, task_id: str) -> dict[str, Any]:
    r = httpx.get(f"{up.api}/v1/jobs/{job_id}/tasks/{task_id}", timeout=10)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _job_if_up(up: UpProcess, job_id: str) -> dict[str, Any] | None:
    """The job, or None while the stack is down (the poison task kills it at any moment)."""
    try:
        return up.job(job_id)
    except httpx.HTTPError:
        return None


def _wait(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_job_survives_repeated_kill_9_of_its_workers_and_scheduler(tmp_path: Path) -> None:
    data, effects = tmp_path / "data", tmp_path / "effects"
    effects.mkdir()
    n = 12
    # Each attempt records its effect (job/task/attempt) when it finishes; 0.6 s of work each.
    cmd = f'sleep 0.6; echo "$DAGFOLD_IDEMPOTENCY_KEY/$DAGFOLD_ATTEMPT" >> {effects}/$DAGFOLD_ATTEMPT'
    tasks = "\n".join(f"  - {{id: t{i:02d}, handler: shell, args: {{cmd: '{cmd}'}}}}" for i in range(n))
    spec = f"id: survivor\ntimeouts: {{heartbeat_s: 2}}\ntasks:\n{tasks}\n"
    up = UpProcess(data, workers=2, args=SHELL).start()
    try:
        job = up.submit(spec)
        kills = 0
        while kills < 3:
            # kill while attempts run, once the ones lost by the previous kill have run again
            _wait(lambda u=up: (j := u.job(job)) is not None and j["counts"].get("running", 0) > 0
                  and j["counts"].get("retrying", 0) == 0, 60, "a running attempt")
            if up.job(job)["state"] != "running":  # type: ignore[index]
                break
            up.kill9()
            kills += 1
            up = UpProcess(data, workers=2, args=SHELL).start()
        final = up.wait(job, timeout=180)
        assert kills == 3, "the job ended before it could be killed three times"
        assert final["state"] == "succeeded", final
        hist = _history(up, job)
        kinds = [h["type"] for h in hist]
        assert "TaskFailed" not in kinds  # no loss was charged to a task
        assert kinds.count("LeaseReclaimed") >= 3  # at least one running attempt per kill
        done = {h["task_id"]: h["attempt"] for h in hist if h["type"] == "TaskSucceeded"}
        assert len(done) == n
        lines = [ln for f in effects.iterdir() for ln in f.read_text().split()]
        for tid, attempt in done.items():  # the succeeded attempt's effect is there, once
            assert lines.count(f"{job}/{tid}/{attempt}") == 1, (tid, attempt)
        started = {(h["task_id"], h["attempt"]) for h in hist if h["type"] in ("LeaseGranted", "LeaseRejected")}
        for ln in lines:  # and every effect belongs to an attempt that was started
            _, tid, attempt = ln.rsplit("/", 2)
            assert (tid, int(attempt)) in started, ln
        lost = [t for t in (_task(up, job, f"t{i:02d}") for i in range(n)) if t.get("worker_losses")]
        assert lost and all(t["state"] == "succeeded" for t in lost)
    finally:
        up.stop()


def _launch(data: Path) -> UpProcess:
    """`dagfold up` with one worker, which may die before its API answers (the poison task)."""
    up = UpProcess(data, workers=1, args=SHELL)
    try:
        up.start()
    except RuntimeError:
        assert up.proc is not None and up.proc.poll() is not None  # killed while starting: a death
    return up


def test_a_task_that_kills_every_worker_fails_with_worker_lost_after_the_limit(tmp_path: Path) -> None:
    data = tmp_path / "data"
    spec = ("id: poison\ntimeouts: {heartbeat_s: 2}\nretry: {max_attempts: 5}\ntasks:\n"
            # its parent is its reaper: the worker is the reaper's parent (field 4 of /proc/PID/stat)
            "  - {id: bomb, handler: shell, args: {cmd: 'kill -9 $(cut -d\" \" -f4 /proc/$PPID/stat); sleep 5'}}\n"
            "  - {id: fine, handler: noop}\n")
    up = UpProcess(data, workers=1, args=SHELL).start()
    job = up.submit(spec)
    deaths = 0
    j: dict[str, Any] | None = None
    try:
        while True:
            assert up.proc is not None
            deadline = time.monotonic() + 60
            while up.proc.poll() is None and time.monotonic() < deadline:
                j = _job_if_up(up, job)
                if j is not None and j["state"] != "running":
                    break
                time.sleep(0.1)
            if j is not None and j["state"] != "running" and up.proc.poll() is None:
                break
            assert up.proc.poll() is not None, "the poison task did not kill its worker"
            deaths += 1
            assert deaths <= 4, "the poison task was not stopped"
            up = _launch(data)
        assert j["state"] == "failed", j
        assert deaths == 3
        bomb = _task(up, job, "bomb")
        assert bomb["state"] == "failed" and bomb["error_type"] == "worker_lost"
        assert bomb["reason"].startswith("worker_lost x 3: lease_expired"), bomb
        assert _task(up, job, "fine")["state"] == "succeeded"
        hist = _history(up, job)
        reclaimed = [h for h in hist if h["type"] == "LeaseReclaimed"]
        assert [h["attempt"] for h in reclaimed] == [1, 2, 3]
        failed = [h for h in hist if h["type"] == "TaskFailed"]
        assert len(failed) == 1 and failed[0]["attempt"] == 3  # the retry policy (5 attempts) was never used
    finally:
        up.stop()
