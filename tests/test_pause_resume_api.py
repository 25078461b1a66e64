"""Pause and resume black-box: `dagfold up` with API keys, the REST API, the SDK and the `dagfold` command, then
a replay of the log that must equal the live state.

A tenant pauses and resumes its own jobs only (another tenant's job answers as a missing one); pausing a
paused or finished job, or resuming a running one, is a 409 with the lifecycle's code.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from dagfold.client import ClientError, Job, RestClient
from tests.cli_support import dagfold
from tests.test_task_actions_api import ACME, Stack, _error


def until(what: str, ok: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def states(stack: Stack, job: str) -> dict[str, str]:
    """Task states by ID; none while the job is accepted but not yet in the read model (404)."""
    r = stack.call("GET", f"/v1/jobs/{job}/tasks", "admin")
    if r.status_code == 404:
        return {}
    assert r.status_code == 200, r.text
    return {t["task_id"]: t["state"] for t in r.json()["tasks"]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("pause-resume"))
    yield s
    s.up.stop()


def test_pause_over_rest_holds_the_next_task_and_the_cli_resumes_it_then_replay_equals_live(stack: Stack) -> None:
    marker = stack.root / f"go-{uuid.uuid4().hex[:6]}"
    job = f"pr-{uuid.uuid4().hex[:10]}"
    spec = {"id": job, "tasks": [
        {"id": "first", "handler": "shell", "args": {"cmd": f"while [ ! -e {marker} ]; do sleep 0.1; done"}},
        {"id": "second", "handler": "noop", "depends_on": ["first"]}]}
    r = stack.call("POST", "/v1/jobs", content=json.dumps(spec), headers={"content-type": "application/json"})
    assert r.status_code == 202, r.text
    until("first running", lambda: states(stack, job).get("first") == "running")

    # another tenant: exactly the answer for a job that does not exist
    theirs, missing = (stack.call("POST", f"/v1/jobs/{j}/pause", "beta") for j in (job, "pr-nope"))
    assert theirs.status_code == missing.status_code == 404
    _error(stack.call("POST", f"/v1/jobs/{job}/resume"), 409, "job_not_paused")

    r = stack.call("POST", f"/v1/jobs/{job}/pause", json={"reason": "maintenance"})
    assert r.status_code == 202 and r.json()["state"] == "pause_requested", r.text
    stack.wait(job, {"paused"})
    _error(stack.call("POST", f"/v1/jobs/{job}/pause"), 409, "job_paused")

    marker.touch()  # the running task finishes; the next one is held
    until("first succeeded", lambda: states(stack, job)["first"] == "succeeded")
    until("second held", lambda: "TaskHeld" in [h["type"] for h in stack.history(job)])
    time.sleep(0.5)
    assert states(stack, job)["second"] == "pending" and stack.wait(job, {"paused"})

    cli = ("--api", stack.api, "--api-key", ACME)
    r2 = dagfold("resume", job, *cli)
    assert r2.returncode == 0 and f"resume requested for {job}" in r2.stdout, r2.stdout + r2.stderr
    assert stack.wait(job)["state"] == "succeeded"
    kinds = [h["type"] for h in stack.history(job)]
    assert kinds.index("JobPaused") < kinds.index("TaskHeld") < kinds.index("JobResumed") < kinds.index("JobSucceeded")

    r3 = dagfold("pause", job, *cli)  # finished: refused, one line
    assert r3.returncode == 1 and "409" in r3.stderr and "job_finished" in r3.stderr, r3.stderr
    assert len(r3.stderr.strip().splitlines()) == 1 and "Traceback" not in r3.stderr

    r4 = dagfold("replay", "--data", str(stack.root / "data"), "--out", str(stack.root / "replayed"), "--verify",
                 "--json")
    assert r4.returncode == 0, r4.stdout + r4.stderr
    assert json.loads(r4.stdout)["differences"] == []


def test_the_sdk_pauses_and_resumes(stack: Stack) -> None:
    marker = stack.root / f"go-{uuid.uuid4().hex[:6]}"
    job = Job(id=f"pr-{uuid.uuid4().hex[:10]}", tenant="acme")
    first = job.task("first", "shell", args={"cmd": f"while [ ! -e {marker} ]; do sleep 0.1; done"})
    job.task("second", "noop", after=[first])
    with RestClient(stack.api, api_key=ACME) as client:
        client.submit(job)
        until("first running", lambda: states(stack, job.id).get("first") == "running")
        client.pause(job.id, reason="look first")
        until("paused", lambda: client.status(job.id).state == "paused")
        with pytest.raises(ClientError) as refused:
            client.pause(job.id)
        assert refused.value.code == "job_paused"
        marker.touch()
        until("first succeeded", lambda: states(stack, job.id)["first"] == "succeeded")
        client.resume(job.id)
        assert client.wait(job.id, timeout_s=60).state == "succeeded"
