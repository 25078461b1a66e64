"""Prometheus metrics of every dagfold component, defined in one place.

Why one module: ``dagfold up`` runs the scheduler, projector, workers and API
as threads of one process, and the API's ``/metrics`` serves the process-wide
default registry, so every component's metrics appear on one endpoint without
any wiring. Separate processes (``dagfold worker --metrics-port``) serve the
same registry on their own port. The dashboard in ``deploy/grafana/dagfold.json``
uses exactly these names.

Gauges that describe the read model (tasks by state, queue depths, GPU
occupancy) are not kept here: they are computed from the projections at scrape
time (``dagfold.services.api.metrics_collector``), so they are right after a restart
and never drift from what the API shows.

Naming: ``dagfold_<component>_<what>_<unit>``; counters end in ``_total``;
durations are histograms in seconds. Label values are bounded sets (component,
queue, decision, reason class), never job or task IDs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

# Latency buckets from 1 ms to 2 min: folds are ms, dispatch is ms to minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Task runtimes: 10 ms to 2 h.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0, 7200.0)

# -- folding (scheduler and projector) ------------------------------------------
EVENTS_FOLDED = Counter(
    "dagfold_events_folded_total",
    "Records folded: commands by the scheduler, events by the projector. rate() gives events per second.",
    ["component"],
)
FOLD_LATENCY = Histogram(
    "dagfold_fold_latency_seconds",
    "Wall time to fold one polled batch, including its log transaction (scheduler) or RocksDB write (projector).",
    ["component"],
    buckets=LATENCY_BUCKETS,
)
FOLD_BATCH_SIZE = Histogram(
    "dagfold_fold_batch_records",
    "Records per folded batch.",
    ["component"],
    buckets=(1, 10, 50, 100, 500, 1000, 2000, 5000),
)
EVENTS_EMITTED = Counter(
    "dagfold_scheduler_events_emitted_total",
    "Events the scheduler wrote to the events topic, by event type (short name).",
    ["type"],
)
TASK_RETRIES = Counter(
    "dagfold_task_retries_total",
    "Retries scheduled (TaskRetryScheduled events emitted by the scheduler).",
)
LEASE_EXPIRIES = Counter(
    "dagfold_lease_expiries_total",
    "Attempts whose lease expired (no heartbeat in time): their worker was lost.",
)
WORKER_LOSSES = Counter(
    "dagfold_worker_losses_total",
    "Attempts reclaimed because their worker was lost (LeaseReclaimed): lease expired or given back; "
    "final=true means the task reached its limit of worker losses and failed with worker_lost.",
    ["final"],
)
TASK_REDISPATCHES = Counter(
    "dagfold_task_redispatches_total",
    "Runnable attempts no worker had leased at their re-dispatch time, sent again (TaskRedispatched): "
    "a dispatch record lost on the way to a worker, or a queue waiting longer than the re-dispatch interval.",
)
TASK_FAILURES = Counter(
    "dagfold_task_failures_total",
    "TaskFailed events emitted by the scheduler; final=true means the task failed for good.",
    ["final"],
)
TIMERS_FIRED = Counter(
    "dagfold_scheduler_timers_fired_total",
    "TimerFired commands written by the scheduler's timer.",
)
COMMANDS_FORWARDED = Counter(
    "dagfold_commands_forwarded_total",
    "Commands that arrived on another partition than their job's (a producer with another partitioner) "
    "and were forwarded to the job's partition in the same transaction.",
    ["service"],
)
DEAD_LETTERS = Counter(
    "dagfold_dead_letters_total",
    "Records sent to the dead-letter topic, by the service that rejected them.",
    ["service"],
)

# -- lag ---------------------------------------------------------------------------
CONSUMER_LAG = Gauge(
    "dagfold_consumer_lag_records",
    "Records not yet consumed: end offset minus position, summed over the partitions a consumer reads.",
    ["consumer", "topic"],
)
PROJECTION_LAG = Histogram(
    "dagfold_projection_lag_seconds",
    "Time from an event's scheduler timestamp to its application in the read model.",
    buckets=LATENCY_BUCKETS,
)
PROJECTION_LAST_APPLIED = Gauge(
    "dagfold_projection_last_applied_timestamp_seconds",
    "Unix time at which the projector last committed a batch; time() minus this shows a stalled projector.",
)

# -- workers -----------------------------------------------------------------------
DISPATCH_LATENCY = Histogram(
    "dagfold_dispatch_latency_seconds",
    "Time from TaskDispatched (scheduler clock, in the dispatch record) to the worker starting the attempt.",
    ["queue"],
    buckets=LATENCY_BUCKETS,
)
WORKER_TASKS = Counter(
    "dagfold_worker_tasks_total",
    "Attempts a worker finished, by queue and outcome (succeeded, failed, stopped).",
    ["queue", "outcome"],
)
WORKER_TASK_DURATION = Histogram(
    "dagfold_worker_task_duration_seconds",
    "Handler run time of an attempt, by queue.",
    ["queue"],
    buckets=DURATION_BUCKETS,
)

# -- API ---------------------------------------------------------------------------
API_REQUESTS = Counter(
    "dagfold_api_requests_total",
    "HTTP requests, by route template, method and status code.",
    ["route", "method", "status"],
)
API_LATENCY = Histogram(
    "dagfold_api_request_duration_seconds",
    "HTTP request duration, by route template.",
    ["route"],
    buckets=LATENCY_BUCKETS,
)
API_ADMISSION_REJECTIONS = Counter(
    "dagfold_api_admission_rejections_total",
    "Submissions refused with 429, by reason (rate_limited, too_many_queued_jobs).",
    ["reason"],
)
SSE_STREAMS = Gauge(
    "dagfold_api_sse_streams",
    "Open server-sent-event streams (job progress).",
)

# -- job-end callbacks (services/callbacks) ---------------------------------------
CALLBACKS_DELIVERED = Counter(
    "dagfold_callbacks_delivered_total",
    "Job-end callbacks answered with a 2xx (each delivery counts once, whatever its attempts).",
)
CALLBACKS_RETRIED = Counter(
    "dagfold_callbacks_retried_total",
    "Callback attempts that failed retryably (connection error, timeout, 408, 429, 5xx) and were rescheduled.",
)
CALLBACKS_FAILED = Counter(
    "dagfold_callbacks_failed_total",
    "Callbacks given up, by reason: rejected (a final 4xx), invalid_url, max_attempts.",
    ["reason"],
)

# -- GPU allocator (observed by services/allocator) ------------------------------
ALLOCATOR_DECISION_LATENCY = Histogram(
    "dagfold_allocator_decision_latency_seconds",
    "Allocator compute time per decision: from the allocator starting to place a request (it was read, or "
    "capacity it waited for appeared) to the decision record (grant, preemption, rejection) being produced. "
    "Excludes time spent waiting for capacity; see dagfold_allocator_queue_wait_seconds.",
    ["decision"],
    buckets=LATENCY_BUCKETS,
)
ALLOCATOR_QUEUE_WAIT = Histogram(
    "dagfold_allocator_queue_wait_seconds",
    "Time a GPU request waited from its arrival at the allocator to its grant, by tier.",
    ["tier"],
    buckets=LATENCY_BUCKETS + (300.0, 900.0, 1800.0, 3600.0),
)

# -- node agents (set by services/agent at every heartbeat; `dagfold agent --metrics-port`) ----------
AGENT_GPU_UTILIZATION = Gauge("dagfold_agent_gpu_utilization_ratio",
                              "Utilisation of each GPU of the host (0..1), as NVML (or the simulated model) reads it.",
                              ["node", "gpu"])
AGENT_GPU_MEMORY_USED = Gauge("dagfold_agent_gpu_memory_used_bytes", "Device memory in use per GPU.",
                              ["node", "gpu"])
AGENT_GPU_TEMPERATURE = Gauge("dagfold_agent_gpu_temperature_celsius", "GPU temperature.", ["node", "gpu"])
AGENT_GPU_HEALTHY = Gauge("dagfold_agent_gpu_healthy", "1 when the GPU is ok, 0 when it is cordoned "
                          "(throttled, ECC errors, Xid).", ["node", "gpu"])
AGENT_GPU_ECC_ERRORS = Gauge("dagfold_agent_gpu_ecc_errors", "Uncorrectable ECC errors (volatile) per GPU.",
                             ["node", "gpu"])
AGENT_GPU_XID_ERRORS = Gauge("dagfold_agent_gpu_xid_errors", "Critical Xid events seen per GPU since the agent "
                             "started.", ["node", "gpu"])
AGENT_JOBS = Gauge("dagfold_agent_job_processes", "Job processes the agent runs now.", ["node"])


# -- helpers the components call -----------------------------------------------------
def _short(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def record_scheduler_events(events: Iterable[Mapping[str, Any]]) -> None:
    """Count the events of one scheduler batch: by type, retries, lease expiries, failures.

    Called by the scheduler runner after its transaction committed, with the
    records it wrote to the events topic (other outputs are ignored by type).
    """
    by_type: dict[str, int] = {}
    for ev in events:
        t = str(ev.get("type", ""))
        if not t.startswith("dagfold.event."):
            continue
        short = _short(t)
        by_type[short] = by_type.get(short, 0) + 1
        if short == "TaskRetryScheduled":
            TASK_RETRIES.inc()
        elif short == "TaskFailed":
            TASK_FAILURES.labels("true" if ev.get("final", True) else "false").inc()
        elif short == "TaskRedispatched":
            TASK_REDISPATCHES.inc()
        elif short == "LeaseReclaimed":
            WORKER_LOSSES.labels("true" if ev.get("final") else "false").inc()
            if str(ev.get("reason", "")).startswith("lease_expired"):
                LEASE_EXPIRIES.inc()
    for short, n in by_type.items():
        EVENTS_EMITTED.labels(short).inc(n)


def observe_agent(node: str, gpus: Iterable[Any], jobs: int) -> None:
    """A node agent's heartbeat: its GPUs' snapshot (``dagfold.services.agent.devices.GpuHealth``) and job count."""
    for g in gpus:
        i = str(g.index)
        if g.utilization is not None:
            AGENT_GPU_UTILIZATION.labels(node, i).set(g.utilization)
        if g.memory_used_mib is not None:
            AGENT_GPU_MEMORY_USED.labels(node, i).set(g.memory_used_mib * 2**20)
        if g.temperature_c is not None:
            AGENT_GPU_TEMPERATURE.labels(node, i).set(g.temperature_c)
        AGENT_GPU_HEALTHY.labels(node, i).set(1 if g.health == "ok" else 0)
        AGENT_GPU_ECC_ERRORS.labels(node, i).set(g.ecc_errors)
        AGENT_GPU_XID_ERRORS.labels(node, i).set(g.xid_errors)
    AGENT_JOBS.labels(node).set(jobs)


def observe_fold(component: str, records: int, seconds: float) -> None:
    """One folded batch of ``records`` that took ``seconds`` (scheduler or projector)."""
    EVENTS_FOLDED.labels(component).inc(records)
    FOLD_LATENCY.labels(component).observe(seconds)
    FOLD_BATCH_SIZE.labels(component).observe(records)


def observe_dispatch(queue: str, dispatched_at_ms: int, started_at_ms: int) -> None:
    """A worker starts an attempt the scheduler dispatched at ``dispatched_at_ms`` (scheduler clock)."""
    DISPATCH_LATENCY.labels(queue).observe(max(started_at_ms - dispatched_at_ms, 0) / 1000.0)


def observe_worker_task(queue: str, report: Mapping[str, Any] | None, seconds: float, trace_id: str = "") -> None:
    """A worker finished an attempt: ``report`` is the TaskSucceeded/TaskFailed it sends (None: stopped).

    ``trace_id`` (the attempt's, ``dagfold.tracing``) becomes the observation's exemplar: the OpenMetrics
    exposition (``Accept: application/openmetrics-text``) links a latency bucket to a trace.
    """
    if report is None:
        outcome = "stopped"
    else:
        outcome = "succeeded" if str(report.get("type", "")).endswith("TaskSucceeded") else "failed"
    WORKER_TASKS.labels(queue, outcome).inc()
    WORKER_TASK_DURATION.labels(queue).observe(seconds, {"trace_id": trace_id} if trace_id else None)


_servers: dict[int, Any] = {}
_servers_lock = threading.Lock()


def serve(port: int, addr: str = "127.0.0.1") -> None:
    """Serve the default registry on ``addr:port`` (``/metrics``) from a daemon thread; idempotent per port."""
    with _servers_lock:
        if port in _servers:
            return
        _servers[port] = start_http_server(port, addr=addr)
