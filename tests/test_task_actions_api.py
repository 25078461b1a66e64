"""Per-task retry and "mark succeeded" black-box: `dagfold up` with API keys, the REST API and the `dagfold`
command, then a replay of the log that must equal the live state.

One stack for the module. A tenant acts on its own jobs only (another tenant's job answers as a missing
one); an admin acts on any; refusals are 409 with the scheduler's own rule codes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cli_support import UpProcess, dagfold

ACME, BETA, ADMIN = "k-acme-0123456789", "k-beta-0123456789", "k-admin-0123456789"
H = {t: {"Authorization": f"Bearer {k}"} for t, k in (("acme", ACME), ("beta", BETA), ("admin", ADMIN))}
TERMINAL = {"succeeded", "succeeded_partial", "failed", "cancelled", "rejected"}


class Stack:
    def __init__(self, root: Path) -> None:
        self.root = root
        auth = root / "auth.yaml"
        auth.write_text(f"keys:\n  {ACME}: acme\n  {BETA}: beta\n  {ADMIN}: admin\n"
                        "tenants:\n  acme: {handlers: [noop, shell]}\n")  # shell is a granted capability
        self.up = UpProcess(root / "data", workers=2,
                            args=("--handlers", "noop,shell", "--auth-file", str(auth))).start()
        self.api = self.up.api

    def call(self, method: str, path: str, who: str = "acme", **kw: Any) -> httpx.Response:
        headers = {**H[who], **kw.pop("headers", {})}
        return httpx.request(method, self.api + path, headers=headers, timeout=10, **kw)

    def submit(self, marker: Path, who: str = "acme") -> str:
        """prepare -> load (fails until ``marker`` exists) -> report; and an independent ``side``."""
        job = f"ta-{uuid.uuid4().hex[:10]}"
        spec = {"id": job, "tasks": [
            {"id": "prepare", "handler": "noop"},
            {"id": "load", "handler": "shell", "depends_on": ["prepare"],
             "args": {"cmd": f"test -e {marker} || {{ echo 'input missing' >&2; exit 3; }}"}},
            {"id": "report", "handler": "noop", "depends_on": ["load"]},
            {"id": "side", "handler": "noop"}]}
        r = self.call("POST", "/v1/jobs", who, content=json.dumps(spec), headers={"content-type": "application/json"})
        assert r.status_code == 202, r.text
        return job

    def wait(self, job: str, states: set[str] = TERMINAL, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        rec: dict[str, Any] = {}
        while time.monotonic() < deadline:
            rec = self.call("GET", f"/v1/jobs/{job}", "admin").json()
            if rec.get("state") in states:
                return rec
            time.sleep(0.1)
        raise AssertionError(f"{job} not in {states}: {rec}")

    def tasks(self, job: str) -> dict[str, dict[str, Any]]:
        return {t["task_id"]: t for t in self.call("GET", f"/v1/jobs/{job}/tasks", "admin").json()["tasks"]}

    def history(self, job: str) -> list[dict[str, Any]]:
        return list(self.call("GET", f"/v1/jobs/{job}/history", "admin", params={"limit": 1000}).json()["events"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("task-actions"))
    yield s
    s.up.stop()


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text
    return str(r.json()["error"]["reason"])


def test_api_retry_is_tenant_scoped_checked_and_reruns_the_task_and_its_skipped_downstream(stack: Stack) -> None:
    marker = stack.root / f"fixed-{uuid.uuid4().hex[:6]}"
    job = stack.submit(marker)
    assert stack.wait(job)["state"] == "failed"
    assert {k: t["state"] for k, t in stack.tasks(job).items()} == {
        "prepare": "succeeded", "load": "failed", "report": "skipped", "side": "succeeded"}

    # another tenant: exactly the answer for a job that does not exist; nothing sent
    theirs = stack.call("POST", f"/v1/jobs/{job}/tasks/load/retry", "beta")
    missing = stack.call("POST", "/v1/jobs/ta-nope/tasks/load/retry", "beta")
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json()["error"]["reason"] == missing.json()["error"]["reason"].replace("ta-nope", job)
    _error(stack.call("POST", f"/v1/jobs/{job}/tasks/nope/retry"), 404, "not_found")
    # the scheduler's rules, answered at once
    _error(stack.call("POST", f"/v1/jobs/{job}/tasks/prepare/retry"), 409, "task_succeeded")
    why = _error(stack.call("POST", f"/v1/jobs/{job}/tasks/report/retry"), 409, "still_skipped")
    assert "retry the failed upstream task" in why
    _error(stack.call("POST", f"/v1/jobs/{job}/tasks/load/retry", json={"reason": "x" * 2001}), 400,
           "invalid_request")

    marker.touch()
    r = stack.call("POST", f"/v1/jobs/{job}/tasks/load/retry", json={"reason": "input restored"})
    assert r.status_code == 202 and r.json()["state"] == "retry_requested", r.text
    assert stack.wait(job, states={"succeeded", "cancelled"})["state"] == "succeeded"
    tasks = stack.tasks(job)
    assert {k: (t["state"], t["attempt"]) for k, t in tasks.items()} == {
        "prepare": ("succeeded", 1), "load": ("succeeded", 2), "report": ("succeeded", 1), "side": ("succeeded", 1)}
    assert tasks["load"]["retried_by"] == "acme"
    hist = stack.history(job)
    kinds = [h["type"] for h in hist]
    assert kinds.index("JobFailed") < kinds.index("TaskReopened") < kinds.index("JobSucceeded")
    reopened = next(h for h in hist if h["type"] == "TaskReopened")
    assert reopened["task_id"] == "load" and "retry by acme" in reopened["detail"]
    assert "load, report" in reopened["detail"] and "input restored" in reopened["detail"]
    attempts = stack.call("GET", f"/v1/jobs/{job}/tasks/load/attempts").json()["attempts"]
    assert [(a["attempt"], a["outcome"]) for a in attempts] == [(1, "failed"), (2, "succeeded")]
    _error(stack.call("POST", f"/v1/jobs/{job}/tasks/load/retry"), 409, "job_succeeded")


def test_cli_mark_succeeded_by_prefix_then_one_line_errors_and_replay_equals_live(stack: Stack) -> None:
    job = stack.submit(stack.root / "never-there")
    assert stack.wait(job)["state"] == "failed"
    cli = ("--api", stack.api, "--api-key", ACME)
    r = dagfold("mark-succeeded", job[:9], "load", "--reason", "loaded by hand", *cli)
    assert r.returncode == 0 and f"mark succeeded requested for {job} load" in r.stdout, r.stdout + r.stderr
    assert stack.wait(job, states={"succeeded", "cancelled"})["state"] == "succeeded"
    tasks = stack.tasks(job)
    assert tasks["load"]["state"] == "succeeded" and tasks["load"]["marked_by"] == "acme"
    assert tasks["report"]["state"] == "succeeded" and tasks["report"]["attempt"] == 1
    graph = stack.call("GET", f"/v1/jobs/{job}/graph", "acme").json()  # the drawing badges the marked task
    assert [graph["ids"][i] for i in graph["marked"]] == ["load"]
    marked = next(h for h in stack.history(job) if h["type"] == "TaskMarkedSucceeded")
    assert marked["detail"] == "marked succeeded by acme, not run: loaded by hand"
    shown = dagfold("tasks", job, *cli)
    assert "succeeded (marked)" in shown.stdout and "marked succeeded by acme" in shown.stdout, shown.stdout
    shown = dagfold("status", job, *cli)
    assert "marked succeeded by an operator, not run: 1 task(s)" in shown.stdout, shown.stdout

    r = dagfold("retry", job, "load", *cli)  # the job succeeded: refused, one line
    assert r.returncode == 1 and "409" in r.stderr and "job_succeeded" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr

    # an admin acts on any tenant's job
    other = stack.submit(stack.root / "never-there")
    assert stack.wait(other)["state"] == "failed"
    r2 = stack.call("POST", f"/v1/jobs/{other}/tasks/load/mark-succeeded", "admin")
    assert r2.status_code == 202 and r2.json()["state"] == "mark_succeeded_requested", r2.text
    assert stack.wait(other, states={"succeeded", "cancelled"})["state"] == "succeeded"
    assert stack.tasks(other)["load"]["marked_by"] == "admin"

    # the log rebuilds the live state: scheduler state and read model alike
    r = dagfold("replay", "--data", str(stack.root / "data"), "--out", str(stack.root / "replayed"), "--verify",
                "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["differences"] == []
