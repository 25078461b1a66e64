"""The GPU job API: POST /v1/gpu-jobs builds a one-task GPU job; status, events and cancel.

The first tests use the API over an embedded log with the test playing the
scheduler (``ApiHarness.accept_submitted``); the last one runs the real stack
(scheduler, projector, notifier, API on a port) and cancels the job, so it
does not depend on GPU tasks running.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dagfold.codec import default_codec
from dagfold.config import Config
from dagfold.jobspec import job_id_for
from dagfold.services.api.auth import AuthConfig
from dagfold.services.callbacks import DELIVERED, verify
from dagfold.services.stack import Stack, StackOptions
from tests.api_support import ApiHarness, LiveServer, accepted, ev, free_port, now_ms, wait_until
from tests.callback_support import Receiver, allow_loopback

VALID: dict[str, Any] = {
    "model": "llama-3-70b",
    "params": {"temperature": 0.2, "max_tokens": 256},
    "prompt": "Summarise the attached report.",
    "tier": "enterprise",
    "pool": "h100",
    "idempotency_key": "req-1",
    "callback_url": "https://hooks.example.com/dagfold?x=1",
    "resources": {"gpus": 2, "gpu_type": "H100", "hosts": 2, "max_runtime_s": 3600, "checkpoint": True},
}


@pytest.fixture
def api(tmp_path: Path) -> Iterator[ApiHarness]:
    a = ApiHarness(tmp_path)
    yield a
    a.close()



def submits(api: ApiHarness) -> list[dict[str, Any]]:
    return [c for c in api.commands() if c["type"] == "dagfold.command.SubmitJob"]


@pytest.mark.parametrize(("change", "field"), [
    ({"resources": {"gpus": 0}}, "resources.gpus"),
    ({"resources": {"gpus": 9}}, "resources.gpus"),
    ({"resources": {"hosts": 0}}, "resources.hosts"),
    ({"resources": {"gpus": 2, "gpu_milli": 500}}, "gpu_milli below 1000"),
    ({"tier": "gold"}, "tier"),
    ({"callback_url": "ftp://hooks.example.com/x"}, "callback_url"),
    ({"callback_url": "not a url"}, "callback_url"),
    ({"model": ""}, "model"),
    ({"model": None}, "model"),
    ({"pool": "bad pool"}, "pool"),
    ({"surprise": 1}, "surprise"),
    ({"retry": {"max_attempts": 0}}, "retry.max_attempts"),
])
def test_invalid_requests_are_422_with_the_field(api: ApiHarness, change: dict[str, Any], field: str) -> None:
    body = {**VALID, **change}
    if body.get("model") is None:
        body.pop("model")
    r = api.client.post("/v1/gpu-jobs", json=body)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_gpu_job" and field in err["reason"], err
    assert submits(api) == []


@pytest.mark.parametrize("body", [b"", b"[1, 2]", b"{not json"])
def test_a_body_that_is_not_a_json_object_is_400(api: ApiHarness, body: bytes) -> None:
    r = api.client.post("/v1/gpu-jobs", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text


def test_a_submission_is_a_one_task_gpu_job(api: ApiHarness) -> None:
    r = api.client.post("/v1/gpu-jobs", json=VALID)
    assert r.status_code == 202, r.text
    out = r.json()
    job_id = out["job_id"]
    assert job_id == job_id_for("default", "req-1")  # derived from the idempotency key, as for /v1/jobs
    assert out["state"] == "submitted" and out["tenant"] == "default"
    assert out["links"]["self"] == f"/v1/gpu-jobs/{job_id}" and r.headers["location"] == f"/v1/gpu-jobs/{job_id}"

    [cmd] = submits(api)
    spec = cmd["spec"]
    assert (spec["job_id"], spec["tier"], spec["callback_url"]) == (job_id, "enterprise", VALID["callback_url"])
    [task] = spec["tasks"]
    assert (task["task_id"], task["handler"], task["queue"], task["depends_on"]) == ("run", "gpu", "h100", [])
    assert json.loads(task["args_json"]) == {"model": VALID["model"], "params": VALID["params"],
                                             "prompt": VALID["prompt"]}
    assert task["resources"] == {"gpus": 2, "gpu_type": ["H100"], "hosts": 2, "gpu_milli": 1000,
                                 "max_runtime_s": 3600.0, "checkpoint": True}

    # the scheduler accepts it: the task reads back through the jobs API
    assert api.accept_submitted() == [job_id]
    [t] = api.client.get(f"/v1/jobs/{job_id}/tasks").json()["tasks"]
    assert (t["task_id"], t["handler"], t["queue"], t["state"]) == ("run", "gpu", "h100", "pending")
    assert t["resources"]["gpus"] == 2 and t["resources"]["hosts"] == 2 and t["resources"]["gpu_type"] == ["H100"]

    # the same request again: the first job (200), nothing new sent; another request with the key: 409
    again = api.client.post("/v1/gpu-jobs", json=VALID)
    assert again.status_code == 200 and again.json()["job_id"] == job_id and again.json()["state"] == "running"
    conflict = api.client.post("/v1/gpu-jobs", json={**VALID, "prompt": "something else"})
    assert conflict.status_code == 409 and conflict.json()["error"]["code"] == "idempotency_conflict"
    assert len(submits(api)) == 1


def test_defaults_and_the_tenant_of_the_key(tmp_path: Path) -> None:
    api = ApiHarness(tmp_path, auth=AuthConfig.from_env(env={"DAGFOLD_API_KEYS": "k-acme-0001:acme"}))
    try:
        h = {"Authorization": "Bearer k-acme-0001"}
        r = api.client.post("/v1/gpu-jobs", json={"model": "m"}, headers=h)
        assert r.status_code == 202, r.text
        assert r.json()["tenant"] == "acme"
        [cmd] = submits(api)
        spec = cmd["spec"]
        assert (spec["tenant"], spec["tier"], spec["callback_url"]) == ("acme", "standard", None)
        [task] = spec["tasks"]
        assert task["queue"] == "default" and task["resources"]["gpus"] == 1 and task["resources"]["hosts"] == 1
        other = api.client.post("/v1/gpu-jobs", json={"model": "m", "tenant": "globex"}, headers=h)
        assert other.status_code == 403 and other.json()["error"]["code"] == "tenant_mismatch"
    finally:
        api.close()


def test_status_progress_stream_and_cancel(api: ApiHarness) -> None:
    job_id = api.client.post("/v1/gpu-jobs", json={**VALID, "idempotency_key": None, "job_id": "g1"}).json()["job_id"]
    assert job_id == "g1"
    api.accept_submitted()
    st = api.client.get("/v1/gpu-jobs/g1").json()
    assert (st["state"], st["tenant"], st["tier"], st["pool"], st["model"]) == (
        "running", "default", "enterprise", "h100", VALID["model"])
    assert st["params"] == VALID["params"] and st["resources"]["gpus"] == 2
    assert st["task"]["task_id"] == "run" and st["task"]["state"] == "pending" and st["task"]["attempt"] == 0
    assert st["allocation"] is None and st["callback_url"] == VALID["callback_url"]
    assert "callback" not in st  # no notifier in this process
    assert st["created_ms"] and st["ended_ms"] is None

    t = now_ms()
    events = [ev("LeaseGranted", job_id="g1", task_id="run", attempt=1, worker_id="h100-a", ts_ms=t,
                 lease_deadline_ms=t + 30_000),
              ev("LeaseExtended", job_id="g1", task_id="run", attempt=1, worker_id="h100-a", ts_ms=t + 1,
                 lease_deadline_ms=t + 30_000, progress=0.4)]
    if "dagfold.event.TaskAllocated" in default_codec().names():  # the scheduler's GPU events (issue #5)
        events.insert(0, ev("TaskAllocated", job_id="g1", task_id="run", attempt=1, ts_ms=t, pool="h100",
                            alloc_id="h100:7", epoch=7, node_ids=["h100-a", "h100-b"]))
    api.project(*events)
    st = api.client.get("/v1/gpu-jobs/g1").json()
    assert (st["task"]["state"], st["task"]["attempt"], st["task"]["progress"]) == ("running", 1, 0.4)
    assert st["task"]["worker_id"] == "h100-a"
    if len(events) == 3:
        assert st["allocation"]["node_ids"] == ["h100-a", "h100-b"]

    with LiveServer(api.app) as srv, httpx.stream("GET", f"{srv.url}/v1/gpu-jobs/g1/events",
                                                  params={"timeout_s": 1}, timeout=10) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    frames = [f for f in text.split("\n\n") if "event: " in f]
    progress = [json.loads(f.split("data: ", 1)[1]) for f in frames if "event: progress" in f]
    assert progress and progress[-1]["progress"] == 0.4 and progress[-1]["state"] == "running"
    assert any("event: history" in f for f in frames) and any("event: job" in f for f in frames)

    r = api.client.post("/v1/gpu-jobs/g1/cancel", json={"reason": "not needed"})
    assert r.status_code == 202 and r.json() == {"job_id": "g1", "state": "cancel_requested"}
    cancels = [c for c in api.commands() if c["type"] == "dagfold.command.CancelJob"]
    assert [(c["job_id"], c["reason"]) for c in cancels] == [("g1", "not needed")]

    api.project(ev("JobCancelled", job_id="g1", ts_ms=now_ms(), reason="not needed"))
    assert api.client.get("/v1/gpu-jobs/g1").json()["state"] == "cancelled"
    again = api.client.post("/v1/gpu-jobs/g1/cancel")
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_finished"


def test_other_jobs_are_not_gpu_jobs(api: ApiHarness) -> None:
    api.project(accepted("dag-1", ["a", "b"]))
    for path in ("/v1/gpu-jobs/dag-1", "/v1/gpu-jobs/nope", "/v1/gpu-jobs/dag-1/events"):
        r = api.client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
    assert api.client.post("/v1/gpu-jobs/dag-1/cancel").status_code == 404


def test_on_the_stack_accepted_status_with_callback_and_cancel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real scheduler accepts the GPU job; cancelling it ends it and the notifier calls back."""
    secret = "gpu-test-secret"
    monkeypatch.setenv("DAGFOLD_CALLBACK_SECRET", secret)
    allow_loopback(monkeypatch)  # the receiver is on 127.0.0.1
    cfg = Config(data_dir=tmp_path / "data", partitions=2, dispatch_partitions=2, api_port=free_port())
    with Receiver() as receiver, Stack(cfg, StackOptions(workers=1)) as stack:
        base = f"http://127.0.0.1:{cfg.api_port}"
        body = {"job_id": "gpu-live", "model": "m", "pool": "gpu-test", "callback_url": receiver.url("/hook"),
                "resources": {"gpus": 1, "gpu_milli": 500}}
        r = httpx.post(f"{base}/v1/gpu-jobs", json=body, timeout=10)
        assert r.status_code == 202, r.text
        job = wait_until(lambda: stack.read_model.get_job("gpu-live"), "the scheduler accepts the job")
        assert job["state"] == "running", job
        [t] = httpx.get(f"{base}/v1/jobs/gpu-live/tasks", timeout=10).json()["tasks"]
        assert (t["handler"], t["queue"], t["resources"]["gpus"], t["resources"]["gpu_milli"]) == (
            "gpu", "gpu-test", 1, 500)
        st = httpx.get(f"{base}/v1/gpu-jobs/gpu-live", timeout=10).json()
        assert st["state"] == "running" and st["callback"]["state"] == "awaiting_end"

        assert httpx.post(f"{base}/v1/gpu-jobs/gpu-live/cancel", timeout=10).status_code == 202
        ended = stack.wait_job("gpu-live", timeout_s=60)
        assert ended is not None and ended["state"] == "cancelled", ended
        [req] = receiver.wait_for("gpu-live")
        assert verify(secret, req.body, req.headers["x-dagfold-signature"])
        assert req.json["state"] == "cancelled" and req.json["reason"] == "cancelled by user"
        st = wait_until(lambda: (lambda s: s if s["callback"]["state"] == DELIVERED else None)(
            httpx.get(f"{base}/v1/gpu-jobs/gpu-live", timeout=10).json()), "the status shows the delivery")
        assert st["callback"]["attempts"] == 1 and st["callback"]["delivery_id"] == "gpu-live"
        assert st["state"] == "cancelled" and st["ended_ms"] is not None
        assert not stack.failed, stack.errors
