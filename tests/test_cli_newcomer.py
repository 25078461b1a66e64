"""A newcomer's first hour, black box: the ``dagfold`` command as a new user runs it (issue 17).

Every test runs the CLI as a process (``python -m dagfold``, stdout and stderr piped, no terminal) against
``dagfold up`` started here, or runs ``dagfold run`` on its own throwaway stack. Each one covers a bullet of
the issue's "Why" and fails on the code before it: failures that hide their stderr, silence during long runs,
truncated and unresolvable job IDs, noisy history, tracebacks for user errors, and help without examples.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api_support import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def dagfold(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would (no terminal: output piped)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DAGFOLD_")}
    full_env.update({"PYTHONPATH": str(ROOT), "COLUMNS": "80", **(env or {})})
    return subprocess.run([sys.executable, "-m", "dagfold", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr


class Up:
    """``dagfold up`` in a process of its own, on a free port."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.data = tmp / "data"
        self.log_path = tmp / "up.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DAGFOLD_")}
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dagfold", "up", "--data", str(self.data), "--port", str(self.port),
                 "--workers", "2"], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                env={**env, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log_path.read_text()
            try:
                if httpx.get(self.api + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"dagfold up did not answer: {self.log_path.read_text()}")

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return dagfold(*args, env={"DAGFOLD_API": self.api}, timeout=timeout)

    def submit(self, spec: dict[str, Any]) -> str:
        r = httpx.post(self.api + "/v1/jobs", json=spec, timeout=30)
        assert r.status_code == 202, r.text
        return str(r.json()["job_id"])

    def wait(self, job_id: str, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = httpx.get(f"{self.api}/v1/jobs/{job_id}", timeout=10).json()
            if job.get("state") in {"succeeded", "succeeded_partial", "failed", "cancelled", "rejected"}:
                return dict(job)
            time.sleep(0.1)
        raise AssertionError(f"{job_id} did not finish")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    stack = Up(tmp_path_factory.mktemp("up"))
    try:
        yield stack
    finally:
        stack.stop()


# -- 1. failures explain themselves ---------------------------------------------------------------------
def test_run_prints_failed_task_reason_and_stderr_and_json_has_them(tmp_path: Path) -> None:
    r = dagfold("run", str(EXAMPLES / "failing.yaml"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "about to fail" in r.stdout  # the task's own stderr, not only "exit code 3"
    assert "bad failed" in r.stdout and "exit code 3" in r.stdout
    assert "--keep" in r.stderr  # says how to keep the data folder
    r = dagfold("run", str(EXAMPLES / "failing.yaml"), "--json")
    failures = json.loads(r.stdout)["failures"]
    assert [(f["task_id"], f["exit_code"]) for f in failures] == [("bad", 3)]
    assert "about to fail" in failures[0]["stderr_tail"]


def test_run_keep_keeps_the_data_folder() -> None:
    r = dagfold("run", str(EXAMPLES / "diamond.yaml"), "--keep")
    assert r.returncode == 0, r.stdout + r.stderr
    kept = Path(r.stderr.split("data kept in ", 1)[1].split(" ", 1)[0])
    try:
        assert kept.is_dir() and (kept / "projections").is_dir()
    finally:
        import shutil

        shutil.rmtree(kept, ignore_errors=True)


def test_submit_wait_prints_failed_task_stderr(up: Up) -> None:
    r = up.cli("submit", str(EXAMPLES / "failing.yaml"), "--wait")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "about to fail" in r.stdout and "exit code 3" in r.stdout
    r = up.cli("submit", str(EXAMPLES / "failing.yaml"), "--wait", "--json")
    assert "about to fail" in json.loads(r.stdout)["failures"][0]["stderr_tail"]


# -- 2. live progress ---------------------------------------------------------------------------------
def test_run_and_submit_wait_show_progress_lines_when_piped(up: Up) -> None:
    r = dagfold("run", str(EXAMPLES / "failing.yaml"))
    # piped: plain progress lines on stderr (state, finished/total, counts), then each failure as it happens
    assert "6/6" in r.stderr and "failed=1" in r.stderr, r.stderr
    assert "✗ bad attempt 1: exit code 3" in r.stderr
    r = up.cli("submit", str(EXAMPLES / "diamond.yaml"), "--wait")
    assert r.returncode == 0 and "succeeded 4/4" in r.stderr, r.stderr


# -- 4. readable history ------------------------------------------------------------------------------
def test_history_says_each_reason_once_with_readable_times_and_filters_by_type(up: Up) -> None:
    job_id = up.submit({"tasks": [{"id": "bad", "handler": "shell", "args": {"cmd": "exit 3"}},
                                  {"id": "ok", "handler": "noop"}]})
    up.wait(job_id)
    r = up.cli("history", job_id, "--type", "TaskFailed")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("exit code 3") == 1, r.stdout  # was "exit code 3, exit code 3"
    assert "LeaseGranted" not in r.stdout and "ago)" in r.stdout
    r = up.cli("history", job_id, "--json")
    events = json.loads(r.stdout)
    lease = next(e for e in events if e["type"] == "LeaseGranted")
    assert "lease until 1" not in lease["detail"] and "lease 30s" in lease["detail"], lease
    r = up.cli("history", job_id, "--type", "NoSuchEvent")
    assert r.returncode == 2 and "TaskFailed" in r.stdout + r.stderr  # the choices are listed


# -- 3. usable IDs and names --------------------------------------------------------------------------
def test_full_ids_at_80_columns_prefixes_and_names(up: Up) -> None:
    named = up.submit({"name": "nightly-etl", "tasks": [{"id": "a"}]})
    other = up.submit({"name": "adhoc report", "tasks": [{"id": "a"}]})
    up.wait(named)
    up.wait(other)
    for cols in ("80", "120"):
        r = dagfold("jobs", env={"DAGFOLD_API": up.api, "COLUMNS": cols})
        assert r.returncode == 0, r.stderr
        assert named in r.stdout and other in r.stdout, r.stdout  # whole, not "3f2a…"
        assert "nightly-etl" in r.stdout
    r = up.cli("jobs", "--name", "NIGHTLY", "--json")
    assert [j["job_id"] for j in json.loads(r.stdout)["jobs"]] == [named]
    r = up.cli("jobs", "--since", "1h", "--state", "succeeded", "--sort", "name", "--json")
    listed = [j["job_id"] for j in json.loads(r.stdout)["jobs"]]
    assert listed.index(other) < listed.index(named)  # "adhoc report" < "nightly-etl"
    r = up.cli("jobs", "--state", "finished")
    assert r.returncode == 2 and "succeeded_partial" in r.stdout + r.stderr  # the choices, listed
    # a unique prefix, or the name, wherever a job ID goes
    prefix = named[:8] if not other.startswith(named[:8]) else named[:13]
    r = up.cli("status", prefix)
    assert r.returncode == 0 and named in r.stdout and "nightly-etl" in r.stdout, r.stdout + r.stderr
    for cmd in (("tasks", prefix), ("history", prefix), ("attempts", prefix, "a"), ("status", "nightly-etl")):
        r = up.cli(*cmd)
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    r = up.cli("status", "zzzz-no-such-job")
    assert r.returncode == 1 and "no job 'zzzz-no-such-job'" in r.stderr
    no_traceback(r)
