"""A job is a trace, seen in a real Jaeger (deploy/jaeger/jaeger.sh: the all-in-one binary, in-memory
storage, OTLP in) and read back through its query API.

One stack (``dagfold up``'s Stack, one simulated GPU node of 2 GPUs) with the ``OTEL_*`` variables set
runs a DAG job whose first task fails once and is retried, and a GPU job that an enterprise job
preempts; the test asks Jaeger for each trace and checks its spans, their parents and attributes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dagfold.config import Config
from dagfold.services.stack import Stack, StackOptions
from dagfold.services.worker.exceptions import TaskError
from dagfold.services.worker.handlers import HandlerRegistry, TaskContext
from dagfold.tracing import SpanSink, attempt_span_id, attempt_traceparent, job_span_id, job_trace_id
from tests.api_support import free_port
from tests.gpu_support import POOL

ROOT = Path(__file__).resolve().parent.parent
JAEGER = ROOT / "deploy" / "jaeger" / "jaeger.sh"
SUBMITTER_TRACE = "0af7651916cd43dd8448eb211c80319c"
SUBMITTER_SPAN = "b7ad6b7169203331"


class Jaeger:
    def __init__(self, tmp: Path) -> None:
        self.env = {**os.environ, "JAEGER_DATA": str(tmp / "jaeger"), "JAEGER_OTLP_GRPC_PORT": str(free_port()),
                    "JAEGER_OTLP_HTTP_PORT": str(free_port()), "JAEGER_QUERY_PORT": str(free_port()),
                    "JAEGER_QUERY_GRPC_PORT": str(free_port()), "JAEGER_HEALTH_PORT": str(free_port())}
        self.query = f"http://127.0.0.1:{self.env['JAEGER_QUERY_PORT']}"
        self.otlp_http = f"http://127.0.0.1:{self.env['JAEGER_OTLP_HTTP_PORT']}"
        self.otlp_grpc = f"http://127.0.0.1:{self.env['JAEGER_OTLP_GRPC_PORT']}"

    def sh(self, action: str) -> None:
        subprocess.run([str(JAEGER), action], env=self.env, check=True, timeout=120)

    def trace(self, trace_id: str, want: int, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The trace's spans once at least ``want`` arrived (the exporters batch)."""
        spans: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.query}/api/traces/{trace_id}", timeout=10)
            if r.status_code == 200:
                spans = [s for t in r.json()["data"] for s in t["spans"]]
                if len(spans) >= want:
                    return spans
            time.sleep(0.3)
        raise AssertionError(f"trace {trace_id}: {len(spans)} spans after {timeout_s}s, wanted {want}: "
                             f"{sorted(s['operationName'] for s in spans)}")


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    j = Jaeger(tmp_path_factory.mktemp("jaeger"))
    j.sh("start")
    try:
        yield j
    finally:
        j.sh("stop")


def tags(span: dict[str, Any]) -> dict[str, Any]:
    return {t["key"]: t["value"] for t in span["tags"]}


def parent(span: dict[str, Any]) -> str | None:
    refs = [r["spanID"] for r in span.get("references") or [] if r["refType"] == "CHILD_OF"]
    return refs[0] if refs else None


def named(spans: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return sorted((s for s in spans if s["operationName"] == name), key=lambda s: s["startTime"])


def flaky(ctx: TaskContext) -> dict[str, Any]:
    """Fails its first attempt; the second starts a span of its own (the handler's OpenTelemetry)."""
    if ctx.attempt == 1:
        raise TaskError("first attempt fails", exit_code=3)
    from opentelemetry import trace

    with trace.get_tracer("tests.flaky").start_as_current_span("handler work") as span:
        span.set_attribute("flaky.attempt", ctx.attempt)
    return {"ok": True}


def test_a_dag_job_and_a_preempted_gpu_job_are_traces_in_jaeger(jaeger: Jaeger, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", jaeger.otlp_http)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "dagfold-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    registry = HandlerRegistry.with_builtins(shell=True)
    registry.register("flaky", flaky)
    cfg = Config(data_dir=tmp_path / "data", partitions=2, dispatch_partitions=2, api_port=free_port())
    opts = StackOptions(workers=2, registry=registry, gpu_nodes=1, gpus_per_node=2, gpu_pool=POOL)
    with Stack(cfg, opts) as stack:
        base = f"http://127.0.0.1:{cfg.api_port}"
        dag = {"id": "traced-dag", "tasks": [
            {"id": "flaky", "handler": "flaky", "retry": {"max_attempts": 2, "initial_interval_s": 0.2,
                                                          "jitter": False}},
            {"id": "echo", "handler": "shell", "args": {"cmd": 'echo "tp=$TRACEPARENT"'}, "depends_on": ["flaky"]}]}
        r = httpx.post(f"{base}/v1/jobs", json=dag, timeout=10)
        assert r.status_code == 202, r.text
        trace_id = r.json()["trace_id"]
        assert trace_id == job_trace_id("traced-dag")  # no traceparent given: derived from the job ID

        # the GPU job continues the submitter's trace (the W3C header)
        std = {"job_id": "traced-gpu", "model": "m", "pool": POOL, "tier": "standard",
               "params": {"steps": 60, "step_s": 0.05}, "resources": {"gpus": 2}}
        r = httpx.post(f"{base}/v1/gpu-jobs", json=std, timeout=10,
                       headers={"traceparent": f"00-{SUBMITTER_TRACE}-{SUBMITTER_SPAN}-01"})
        assert r.status_code == 202, r.text
        assert r.json()["trace_id"] == SUBMITTER_TRACE
        # while it runs, its process has the attempt's TRACEPARENT (the submitter's trace, the attempt's span)
        agent = stack.agents[0]
        deadline = time.monotonic() + 60
        while not agent.procs and time.monotonic() < deadline:
            time.sleep(0.05)
        (jp,) = agent.procs.values()
        environ = Path(f"/proc/{jp.proc.pid}/environ").read_bytes().split(b"\0")
        assert f"TRACEPARENT=00-{SUBMITTER_TRACE}-{attempt_span_id('traced-gpu', 'run', 1)}-01".encode() in environ
        time.sleep(0.5)
        ent = {**std, "job_id": "urgent-gpu", "tier": "enterprise", "params": {"steps": 3, "step_s": 0.01}}
        assert httpx.post(f"{base}/v1/gpu-jobs", json=ent, timeout=10).status_code == 202
        for job in ("traced-dag", "urgent-gpu", "traced-gpu"):
            assert (stack.wait_job(job, timeout_s=90) or {}).get("state") == "succeeded", job
        assert httpx.get(f"{base}/v1/jobs/traced-dag", timeout=10).json()["trace_id"] == trace_id
        (echo,) = httpx.get(f"{base}/v1/jobs/traced-dag/tasks/echo/attempts", timeout=10).json()["attempts"]
        assert echo["stdout_tail"].strip() == f"tp={attempt_traceparent('traced-dag', 'echo', 1)}", echo
        assert not stack.failed, stack.errors

    # -- the DAG job: job > attempts > phases; the retry's backoff; the handler's own span
    spans = jaeger.trace(trace_id, want=11)
    (job,) = named(spans, "job")
    assert parent(job) is None and job["spanID"] == job_span_id("traced-dag")
    assert tags(job)["dagfold.outcome"] == "succeeded"
    a1, a2 = named(spans, "task flaky")
    assert parent(a1) == parent(a2) == job["spanID"]
    assert (a1["spanID"], a2["spanID"]) == (attempt_span_id("traced-dag", "flaky", 1),
                                            attempt_span_id("traced-dag", "flaky", 2))
    assert tags(a1)["dagfold.outcome"] == "failed" and tags(a1)["otel.status_code"] == "ERROR"
    assert tags(a1)["dagfold.exit_code"] == 3 and tags(a1)["dagfold.worker_id"]
    assert tags(a2)["dagfold.outcome"] == "succeeded" and tags(a2)["dagfold.retry_of"] == 1
    assert [s["operationName"] for s in sorted((s for s in spans if parent(s) == a1["spanID"]),
                                               key=lambda s: s["startTime"])] == ["queued", "running"]
    (backoff,) = named(spans, "retry backoff")
    assert parent(backoff) == job["spanID"] and tags(backoff)["dagfold.next_attempt"] == 2
    (work,) = named(spans, "handler work")
    assert parent(work) == a2["spanID"] and tags(work)["flaky.attempt"] == 2
    (echo_span,) = named(spans, "task echo")
    assert parent(echo_span) == job["spanID"]
    processes = {p["serviceName"] for p in jaeger_processes(jaeger, trace_id)}
    assert processes == {"dagfold-test"}

    # the audit rebuilds the job's spans from the log: the IDs the live exporter gave them, exported again
    audit_env = {**os.environ, "OTEL_SERVICE_NAME": "dagfold-audit"}
    r = subprocess.run([sys.executable, "-m", "dagfold", "audit", "traced-dag", "--trace", "--data",
                        str(cfg.data_dir)], capture_output=True, text=True, timeout=120, env=audit_env)
    assert r.returncode == 0, r.stderr
    rebuilt = json.loads(r.stdout)
    assert {s["span_id"] for s in rebuilt} == {s["spanID"] for s in spans if s["operationName"] != "handler work"}
    assert f"exported {len(rebuilt)} spans of trace {trace_id}" in r.stderr
    deadline = time.monotonic() + 30
    while "dagfold-audit" not in {p["serviceName"] for p in jaeger_processes(jaeger, trace_id)}:
        assert time.monotonic() < deadline, "the audit's spans did not reach Jaeger"
        time.sleep(0.3)

    # -- the GPU job: one attempt, waiting for GPUs twice around its preemption
    spans = jaeger.trace(SUBMITTER_TRACE, want=6)
    (job,) = named(spans, "job")
    assert parent(job) == SUBMITTER_SPAN
    (att,) = named(spans, "task run")
    assert parent(att) == job["spanID"] and tags(att)["dagfold.preemptions"] == 1
    assert {f["value"] for log in att["logs"] for f in log["fields"] if f["key"] == "event"} >= {"preempted"}
    phases = sorted((s for s in spans if parent(s) == att["spanID"]), key=lambda s: s["startTime"])
    assert [s["operationName"] for s in phases] == ["gpu allocation wait", "running", "gpu allocation wait",
                                                    "running"]
    preempted = phases[1]
    assert tags(preempted)["otel.status_code"] == "ERROR" and tags(preempted)["dagfold.alloc_id"]
    assert {f["value"] for log in preempted["logs"] for f in log["fields"] if f["key"] == "event"} \
        == {"checkpointing", "preempted"}
    assert tags(phases[3])["dagfold.alloc_id"] != tags(preempted)["dagfold.alloc_id"]


def jaeger_processes(jaeger: Jaeger, trace_id: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{jaeger.query}/api/traces/{trace_id}", timeout=10)
    return [p for t in r.json()["data"] for p in t["processes"].values()]


def test_otlp_over_grpc_reaches_jaeger_too(jaeger: Jaeger, monkeypatch: pytest.MonkeyPatch) -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc: the same spans through the gRPC exporter."""
    from dagfold.jobspec import load_spec_text, to_job_spec
    from dagfold.services.scheduler.harness import FoldHarness
    from dagfold.tracing import TraceBuilder

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", jaeger.otlp_grpc)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    h = FoldHarness()
    h.submit(to_job_spec(load_spec_text("id: grpc-job\ntasks: [{id: a}, {id: b, depends_on: [a]}]")))
    h.run_all()
    b = TraceBuilder()
    records = [s for e in h.events for s in b.apply(e)]
    sink = SpanSink("test")
    sink.export(records)
    assert sink.flush() and sink.exported == len(records)
    sink.close()
    spans = jaeger.trace(job_trace_id("grpc-job"), want=len(records))
    assert sorted(s["spanID"] for s in spans) == sorted(r.span_id for r in records)
