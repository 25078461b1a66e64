"""Operator endpoints of the API: idempotent submit, time filters, stuck, queues, tenants, failures,
cluster, graph, timeline, server-sent events, metrics and the dashboard's static files."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api_support import T0, ApiHarness, LiveServer, accepted, ev, now_ms


@pytest.fixture
def api(tmp_path: Path) -> Iterator[ApiHarness]:
    a = ApiHarness(tmp_path)
    yield a
    a.close()


def error(resp: httpx.Response, status: int, code: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and body["error"]["code"] == code, body
    return str(body["error"]["reason"])


SPEC = {"tenant": "acme", "idempotency_key": "nightly-1", "tasks": [{"id": "a"}, {"id": "b", "depends_on": ["a"]}]}


def test_idempotent_submit(api: ApiHarness) -> None:
    first = api.client.post("/v1/jobs", json=SPEC)
    assert first.status_code == 202, first.text
    job_id = first.json()["job_id"]
    # before the scheduler accepted it, a repeat is sent again (the scheduler deduplicates)
    assert api.client.post("/v1/jobs", json=SPEC).status_code == 202
    assert api.accept_submitted() == [job_id]

    again = api.client.post("/v1/jobs", json=SPEC)
    assert again.status_code == 200, again.text
    assert again.json()["job_id"] == job_id and again.json()["state"] == "running"
    assert again.headers["location"] == f"/v1/jobs/{job_id}"
    assert len(api.commands()) == 2  # the 200 sent nothing

    changed = {**SPEC, "tasks": [{"id": "a"}]}
    reason = error(api.client.post("/v1/jobs", json=changed), 409, "idempotency_conflict")
    assert "nightly-1" in reason and job_id in reason and "different spec" in reason

    api.client.post("/v1/jobs", json={"id": "fixed", "tasks": [{"id": "x"}]})
    api.accept_submitted()
    assert api.client.post("/v1/jobs", json={"id": "fixed", "tasks": [{"id": "x"}]}).status_code == 200
    error(api.client.post("/v1/jobs", json={"id": "fixed", "tasks": [{"id": "y"}]}), 409, "job_exists")

    # a rejected job may be submitted again (fixed)
    api.project(ev("JobRejected", job_id="bad", ts_ms=T0, tenant="default", code="cycle", reason="a -> a"))
    assert api.client.post("/v1/jobs", json={"id": "bad", "tasks": [{"id": "a"}]}).status_code == 202


def test_list_time_filters(api: ApiHarness) -> None:
    api.project(*[accepted(f"j{i}", ["a"], ts=T0 + i * 60_000) for i in range(4)])
    ids = lambda r: [j["job_id"] for j in r.json()["jobs"]]  # noqa: E731
    assert ids(api.client.get("/v1/jobs", params={"created_after": T0 + 60_000})) == ["j3", "j2", "j1"]
    assert ids(api.client.get("/v1/jobs", params={"created_before": str(T0 + 60_000)})) == ["j0"]
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime((T0 + 120_000) / 1000))
    assert ids(api.client.get("/v1/jobs", params={"created_after": iso})) == ["j3", "j2"]
    assert "created_after" in error(api.client.get("/v1/jobs", params={"created_after": "yesterday"}), 400,
                                    "invalid_request")
    error(api.client.get("/v1/jobs", params={"created_before": "2024-01-01T00:00:00"}), 400, "invalid_request")
    error(api.client.get("/v1/jobs", params={"limit": 1001}), 400, "invalid_request")


def test_stuck_queues_tenants_failures(api: ApiHarness) -> None:
    now = now_ms()
    api.project(
        accepted("j", ["a", "b", "c"], ts=now - 120_000),
        accepted("k", ["x"], ts=now - 100_000, tenant="beta"),
        ev("TaskDispatched", job_id="j", task_id="a", attempt=1, ts_ms=now - 90_000, queue="default"),
        ev("LeaseGranted", job_id="j", task_id="a", attempt=1, worker_id="w-lost", ts_ms=now - 89_000,
           lease_deadline_ms=now - 59_000),
        ev("TaskDispatched", job_id="j", task_id="b", attempt=1, ts_ms=now - 80_000, queue="io"),
        ev("TaskDispatched", job_id="k", task_id="x", attempt=1, ts_ms=now - 70_000, queue="default"),
        ev("LeaseGranted", job_id="k", task_id="x", attempt=1, worker_id="w1", ts_ms=now - 69_000,
           lease_deadline_ms=now + 60_000),
        ev("TaskDispatched", job_id="j", task_id="c", attempt=1, ts_ms=now - 60_000, queue="default"),
        ev("LeaseGranted", job_id="j", task_id="c", attempt=1, worker_id="w2", ts_ms=now - 59_000,
           lease_deadline_ms=now - 29_000),
        ev("TaskFailed", job_id="j", task_id="c", attempt=1, worker_id="w2", ts_ms=now - 1000, reason="exit code 7",
           exit_code=7, final=True),
    )
    stuck = api.client.get("/v1/stuck").json()
    assert [(t["job_id"], t["task_id"], t["kind"], t["worker_id"]) for t in stuck["tasks"]] == [
        ("j", "a", "lease", "w-lost")]
    assert stuck["tasks"][0]["overdue_s"] == pytest.approx(59, abs=2)
    queued = api.client.get("/v1/stuck", params={"queued_longer_than_s": 60}).json()["tasks"]
    assert [(t["task_id"], t["kind"]) for t in queued] == [("b", "queued"), ("a", "lease")]
    assert api.client.get("/v1/stuck", params={"grace_s": 120}).json()["tasks"] == []
    error(api.client.get("/v1/stuck", params={"grace_s": -1}), 400, "invalid_request")

    queues = {q["queue"]: q for q in api.client.get("/v1/queues").json()["queues"]}
    assert (queues["default"]["running"], queues["default"]["runnable"]) == (2, 0)
    assert queues["io"]["depth"] == 1 and queues["io"]["oldest_runnable_age_s"] == pytest.approx(80, abs=2)

    tenants = {t["tenant"]: t for t in api.client.get("/v1/tenants").json()["tenants"]}
    assert tenants["acme"]["running_tasks"] == 1 and tenants["acme"]["open_jobs"] == 1
    assert tenants["acme"]["tasks"]["failed"] == 1 and tenants["acme"]["failures"] == 1
    assert tenants["acme"]["share"]["running_tasks"] == 0.5 and tenants["acme"]["gpus"] is None
    assert tenants["beta"]["limits"]["max_open_jobs"] > 0

    failures = api.client.get("/v1/failures").json()
    assert [(r["class"], r["count"]) for r in failures["reasons"]] == [("exit code 7", 1)]
    assert failures["recent"][0]["task_id"] == "c"


def test_cluster_empty_then_from_allocator_events(api: ApiHarness) -> None:
    empty = api.client.get("/v1/cluster").json()
    assert empty["available"] is False and empty["totals"] is None and empty["pools"] == []
    assert api.client.get("/v1/cluster/nodes").json() == {"nodes": [], "next_cursor": None}
    a = "dagfold.allocator."
    api.allocator(
        *[{"type": a + "NodeRegistered", "node_id": f"h{i}", "pool": "p1", "gpus": 8, "gpu_type": "H100",
           "health": "healthy"} for i in range(3)],
        {"type": a + "NodeHealthChanged", "node_id": "h2", "health": "degraded"},
        {"type": a + "AllocationGranted", "allocation_id": "al1", "job_id": "j", "tenant": "acme",
         "placements": [{"node_id": "h0", "gpus": 8}, {"node_id": "h1", "gpus": 4}]},
    )
    c = api.client.get("/v1/cluster").json()
    assert c["available"] is True
    assert {k: c["totals"][k] for k in ("gpus", "healthy_gpus", "allocated", "free")} == {
        "gpus": 24, "healthy_gpus": 16, "allocated": 12, "free": 4}
    assert c["totals"]["allocation_ratio"] == 0.75
    assert c["pools"] == [{"pool": "p1", "nodes": 3, "gpus": 24, "allocated": 12, "unhealthy_nodes": 1}]
    assert c["tenants"][0]["tenant"] == "acme" and c["tenants"][0]["gpus"] == 12
    nodes = api.client.get("/v1/cluster/nodes", params={"limit": 2}).json()
    assert [n["node_id"] for n in nodes["nodes"]] == ["h0", "h1"] and nodes["next_cursor"]
    tenants = {t["tenant"]: t for t in api.client.get("/v1/tenants").json()["tenants"]}
    assert tenants["acme"]["gpus"] == 12 and tenants["acme"]["share"]["gpus"] == 1.0
    metrics = api.client.get("/metrics").text
    assert 'dagfold_gpus{state="allocated"} 12.0' in metrics and "dagfold_gpu_allocation_ratio 0.75" in metrics


def test_graph_and_timeline(api: ApiHarness) -> None:
    deps = {"b": ["a"], "c": ["a"], "d": ["b", "c"], "e": []}
    api.project(accepted("g", ["a", "b", "c", "d", "e"], deps=deps),
                ev("TaskDispatched", job_id="g", task_id="a", attempt=1, ts_ms=T0 + 1, queue="default"),
                ev("LeaseGranted", job_id="g", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 2,
                   lease_deadline_ms=T0 + 30_000),
                ev("TaskFailed", job_id="g", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 3, reason="x",
                   final=False),
                ev("TaskRetryScheduled", job_id="g", task_id="a", attempt=1, ts_ms=T0 + 3, next_attempt=2,
                   retry_at_ms=T0 + 4, reason="x"),
                ev("TaskDispatched", job_id="g", task_id="a", attempt=2, ts_ms=T0 + 4, queue="default"),
                ev("LeaseGranted", job_id="g", task_id="a", attempt=2, worker_id="w", ts_ms=T0 + 5,
                   lease_deadline_ms=T0 + 30_000),
                ev("TaskSucceeded", job_id="g", task_id="a", attempt=2, worker_id="w", ts_ms=T0 + 9))
    g = api.client.get("/v1/jobs/g/graph").json()
    idx = {t: i for i, t in enumerate(g["ids"])}
    layer = {t: g["layer"][i] for t, i in idx.items()}
    assert layer == {"a": 0, "e": 0, "b": 1, "c": 1, "d": 2}
    assert g["layers"] == [2, 2, 1]
    edges = {(g["ids"][g["edges"][k]], g["ids"][g["edges"][k + 1]]) for k in range(0, len(g["edges"]), 2)}
    assert edges == {("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")}
    assert g["states"][idx["a"]] == "succeeded" and g["states"][idx["d"]] == "pending"
    assert sorted(g["pos"][idx[t]] for t in ("b", "c")) == [0, 1]
    attempts = api.client.get("/v1/jobs/g/attempts").json()
    assert [(a["task_id"], a["attempt"], a["outcome"]) for a in attempts["attempts"]] == [
        ("a", 1, "failed"), ("a", 2, "succeeded")]
    assert api.client.get("/v1/jobs/g").json()["retries"] == 1
    hist = api.client.get("/v1/jobs/g/history").json()["events"]
    assert [(e["type"], e.get("task_state")) for e in hist[-2:]] == [("LeaseGranted", "running"),
                                                                     ("TaskSucceeded", "succeeded")]


def test_graph_layout_of_a_large_job(api: ApiHarness) -> None:
    n = 5000
    ids = [f"t{i:05d}" for i in range(n)]
    deps = {t: [ids[(i - 1) // 2]] for i, t in enumerate(ids) if i}  # a binary tree
    api.project(accepted("tree", ids, deps=deps))
    started = time.perf_counter()
    g = api.client.get("/v1/jobs/tree/graph").json()
    assert time.perf_counter() - started < 5
    assert len(g["ids"]) == n and max(g["layer"]) == 12 and len(g["edges"]) == 2 * (n - 1)


def parse_sse(text: str) -> list[tuple[str, Any, str | None]]:
    frames = []
    for block in text.split("\n\n"):
        event, data, eid = None, None, None
        for line in block.splitlines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif line.startswith("id: "):
                eid = line[4:]
        if event:
            frames.append((event, data, eid))
    return frames


def test_sse_of_a_finished_job(api: ApiHarness) -> None:
    api.project(accepted("s", ["a"]),
                ev("TaskDispatched", job_id="s", task_id="a", attempt=1, ts_ms=T0 + 1, queue="default"),
                ev("LeaseGranted", job_id="s", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 2,
                   lease_deadline_ms=T0 + 30_000),
                ev("TaskSucceeded", job_id="s", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 3),
                ev("JobSucceeded", job_id="s", ts_ms=T0 + 3))
    r = api.client.get("/v1/jobs/s/events")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = parse_sse(r.text)
    assert [f[0] for f in frames] == ["history"] * 5 + ["job", "end"]
    assert [f[1]["type"] for f in frames[:5]] == ["JobAccepted", "TaskDispatched", "LeaseGranted",
                                                  "TaskSucceeded", "JobSucceeded"]
    assert frames[5][1]["state"] == "succeeded" and frames[6][1] == {"job_id": "s", "state": "succeeded"}
    # resuming after the third entry sends the rest only
    r = api.client.get("/v1/jobs/s/events", headers={"Last-Event-ID": str(frames[2][2])})
    assert [f[1]["type"] for f in parse_sse(r.text) if f[0] == "history"] == ["TaskSucceeded", "JobSucceeded"]
    error(api.client.get("/v1/jobs/s/events", params={"after": "bogus!"}), 400, "invalid_cursor")
    error(api.client.get("/v1/jobs/nope/events"), 404, "not_found")


def test_sse_streams_a_running_job_live(api: ApiHarness) -> None:
    api.project(accepted("live", ["a", "b"], deps={"b": ["a"]}))
    got: list[tuple[str, Any, str | None]] = []
    done = threading.Event()

    with LiveServer(api.app) as srv:
        def follow() -> None:
            with httpx.stream("GET", f"{srv.url}/v1/jobs/live/events", timeout=30) as r:
                buf = ""
                for chunk in r.iter_text():
                    buf += chunk
                    while "\n\n" in buf:
                        block, buf = buf.split("\n\n", 1)
                        got.extend(parse_sse(block + "\n\n"))
            done.set()

        t = threading.Thread(target=follow, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while not any(f[0] == "job" for f in got) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [f[0] for f in got] == ["history", "job"]
        api.project(ev("TaskDispatched", job_id="live", task_id="a", attempt=1, ts_ms=T0 + 1, queue="default"),
                    ev("LeaseGranted", job_id="live", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 2,
                       lease_deadline_ms=T0 + 30_000))
        while sum(f[0] == "history" for f in got) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [f[1].get("task_state") for f in got if f[0] == "history"][1:] == ["runnable", "running"]
        assert not done.is_set()
        api.project(ev("TaskSucceeded", job_id="live", task_id="a", attempt=1, worker_id="w", ts_ms=T0 + 3),
                    ev("TaskSkipped", job_id="live", task_id="b", ts_ms=T0 + 3, reason="x"),
                    ev("JobSucceeded", job_id="live", ts_ms=T0 + 3, partial=True))
        assert done.wait(10)
        t.join(5)
    assert got[-1] == ("end", {"job_id": "live", "state": "succeeded_partial"}, None)
    assert [f[1]["type"] for f in got if f[0] == "history"][-3:] == ["TaskSucceeded", "TaskSkipped", "JobSucceeded"]


def test_metrics_endpoint(api: ApiHarness) -> None:
    api.project(accepted("m", ["a", "b"]),
                ev("TaskDispatched", job_id="m", task_id="a", attempt=1, ts_ms=now_ms(), queue="q1"))
    api.client.get("/v1/jobs")
    text = api.client.get("/metrics").text
    for line in ('dagfold_tasks{state="pending"} 1.0', 'dagfold_tasks{state="runnable"} 1.0',
                 'dagfold_tenant_jobs{state="running",tenant="acme"} 1.0', 'dagfold_queue_depth{queue="q1"} 1.0',
                 'dagfold_stuck_tasks{kind="lease"} 0.0'):
        assert line in text, line
    for name in ("dagfold_events_folded_total", "dagfold_fold_latency_seconds", "dagfold_projection_lag_seconds",
                 "dagfold_dispatch_latency_seconds", "dagfold_task_retries_total", "dagfold_lease_expiries_total",
                 "dagfold_consumer_lag_records", "dagfold_allocator_decision_latency_seconds",
                 "dagfold_api_requests_total"):
        assert f"# TYPE {name}" in text, name
    assert 'dagfold_api_requests_total{method="GET",route="/v1/jobs",status="200"}' in text
    assert "dagfold_gpus" not in text  # no allocator events: no GPU gauges that look like an empty cluster


def test_dashboard_files(api: ApiHarness) -> None:
    r = api.client.get("/", follow_redirects=False)
    assert r.status_code in (302, 307) and r.headers["location"] == "/ui/"
    page = api.client.get("/ui/")
    assert page.status_code == 200 and "/ui/static/app.js" in page.text
    assert api.client.get("/ui/jobs/anything").status_code == 200
    js = api.client.get("/ui/static/app.js")
    assert js.status_code == 200 and "followJob" in js.text
    for asset in ("app.js", "style.css", "index.html"):  # no network at runtime: nothing loaded from elsewhere
        text = api.client.get(f"/ui/static/{asset}").text
        assert "https://" not in text and "http://" not in text and "@import" not in text
    assert "/ui/" not in json.dumps(api.client.get("/openapi.json").json()["paths"])
