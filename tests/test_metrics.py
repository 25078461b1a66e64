"""Metrics: the helpers the components call, the projector's lag metrics, and that the Grafana dashboard
only uses metric names that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

from dagfold import metrics
from dagfold.codec import make
from tests.api_support import ApiHarness, accepted, ev, now_ms

ROOT = Path(__file__).resolve().parents[1]


def value(name: str, labels: dict[str, str] | None = None) -> float:
    v = REGISTRY.get_sample_value(name, labels or {})
    return 0.0 if v is None else v


def test_record_scheduler_events() -> None:
    before = {n: value(n) for n in ("dagfold_task_retries_total", "dagfold_lease_expiries_total")}
    failed_final = value("dagfold_task_failures_total", {"final": "true"})
    failed_retried = value("dagfold_task_failures_total", {"final": "false"})
    lost = value("dagfold_worker_losses_total", {"final": "false"})
    dispatched = value("dagfold_scheduler_events_emitted_total", {"type": "TaskDispatched"})
    redispatched = value("dagfold_task_redispatches_total")
    metrics.record_scheduler_events([
        make("dagfold.event.TaskDispatched", job_id="j", task_id="a", attempt=1, ts_ms=1, queue="q"),
        make("dagfold.event.TaskRedispatched", job_id="j", task_id="a", attempt=1, ts_ms=2, queue="q",
             redispatches=1, next_redispatch_at_ms=3),
        make("dagfold.event.LeaseReclaimed", job_id="j", task_id="a", attempt=1, worker_id="w", ts_ms=2,
             reason="lease_expired: no heartbeat", losses=1, final=False),
        make("dagfold.event.TaskFailed", job_id="j", task_id="a", attempt=2, worker_id="w", ts_ms=2,
             reason="exit code 2", final=False),
        make("dagfold.event.TaskRetryScheduled", job_id="j", task_id="a", attempt=2, ts_ms=2, next_attempt=3,
             retry_at_ms=3, reason="exit code 2"),
        make("dagfold.event.TaskFailed", job_id="j", task_id="b", attempt=1, worker_id="w", ts_ms=2,
             reason="exit code 1", final=True),
        {"type": "dagfold.dispatch.TaskDispatch", "job_id": "j"},  # not an event: ignored
    ])
    assert value("dagfold_task_retries_total") == before["dagfold_task_retries_total"] + 1
    assert value("dagfold_lease_expiries_total") == before["dagfold_lease_expiries_total"] + 1
    assert value("dagfold_task_failures_total", {"final": "true"}) == failed_final + 1
    assert value("dagfold_task_failures_total", {"final": "false"}) == failed_retried + 1  # the task's own
    assert value("dagfold_worker_losses_total", {"final": "false"}) == lost + 1  # the worker's, apart
    assert value("dagfold_scheduler_events_emitted_total", {"type": "TaskDispatched"}) == dispatched + 1
    assert value("dagfold_task_redispatches_total") == redispatched + 1  # apart from dispatches and retries


def test_worker_and_fold_helpers() -> None:
    n = value("dagfold_dispatch_latency_seconds_count", {"queue": "mq"})
    metrics.observe_dispatch("mq", 1000, 1250)
    assert value("dagfold_dispatch_latency_seconds_count", {"queue": "mq"}) == n + 1
    assert value("dagfold_dispatch_latency_seconds_sum", {"queue": "mq"}) >= 0.25
    metrics.observe_worker_task("mq", None, 0.1)
    metrics.observe_worker_task("mq", {"type": "dagfold.command.TaskSucceeded"}, 0.1)
    metrics.observe_worker_task("mq", {"type": "dagfold.command.TaskFailed"}, 0.1)
    for outcome in ("stopped", "succeeded", "failed"):
        assert value("dagfold_worker_tasks_total", {"queue": "mq", "outcome": outcome}) >= 1
    folded = value("dagfold_events_folded_total", {"component": "scheduler"})
    metrics.observe_fold("scheduler", 7, 0.01)
    assert value("dagfold_events_folded_total", {"component": "scheduler"}) == folded + 7


def test_projector_observes_lag(tmp_path: Path) -> None:
    api = ApiHarness(tmp_path)
    try:
        applied = value("dagfold_events_folded_total", {"component": "projector"})
        lags = value("dagfold_projection_lag_seconds_count")
        api.project(accepted("j", ["a"], ts=now_ms() - 2000),
                    ev("TaskDispatched", job_id="j", task_id="a", attempt=1, ts_ms=now_ms(), queue="q"))
        assert value("dagfold_events_folded_total", {"component": "projector"}) == applied + 2
        assert value("dagfold_projection_lag_seconds_count") == lags + 2
        assert value("dagfold_projection_lag_seconds_sum") >= 2.0
        api.projector.reader.report_lag()
        assert value("dagfold_consumer_lag_records", {"consumer": "projector", "topic": "events"}) == 0
        assert value("dagfold_projection_last_applied_timestamp_seconds") > 0
    finally:
        api.close()


def test_grafana_dashboard_uses_existing_metrics(tmp_path: Path) -> None:
    dash = json.loads((ROOT / "deploy" / "grafana" / "dagfold.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {re.sub(r"_(bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"dagfold_[a-z_]+", e)}
    api = ApiHarness(tmp_path)
    try:  # everything the API can expose: the process registry and the read-model gauges (cluster included)
        api.allocator({"type": "dagfold.allocator.NodeRegistered", "node_id": "h", "gpus": 8, "health": "healthy",
                       "gpu_util": [0.5]})
        text = api.client.get("/metrics").text
    finally:
        api.close()
    exposed = set(re.findall(r"^# TYPE (dagfold_[a-z_]+)", text, re.M))
    exposed = {re.sub(r"_total$", "", m) + ("_total" if m.endswith("_total") else "") for m in exposed}
    missing = {m for m in used if m not in exposed and m.removesuffix("_total") not in exposed}
    assert not missing, f"dashboard uses metrics nobody exposes: {sorted(missing)}"
    assert len(used) >= 25
    assert dash["uid"] == "dagfold" and all(p["type"] in ("row", "stat", "timeseries") for p in dash["panels"])
