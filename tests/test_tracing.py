"""A job is a trace: trace context kept by the fold, and spans built from the events alone.

The fold runs in the virtual-time harness (no log, no clock); the spans come from its events through
``TraceBuilder``, the same code the span exporter runs on a consumer. The real backend is in
tests/test_tracing_jaeger.py.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import fastavro
import pytest
from fastavro.schema import load_schema
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from dagfold.codec import MAGIC, default_codec, schema_fingerprint
from dagfold.codec import SCHEMA_DIR as SCHEMAS
from dagfold.config import COMMANDS, Config, SchedulerOptions
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.log import LogRecord, partition_for
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.services.scheduler.runner import scheduler_spec
from dagfold.services.worker.handlers import TaskContext
from dagfold.tracing import (
    SpanEvent,
    SpanRecord,
    SpanSink,
    TraceBuilder,
    attempt_span_id,
    attempt_traceparent,
    clean_traceparent,
    job_span_id,
    job_trace_id,
    otlp_enabled,
    otlp_protocol,
    parse_traceparent,
    span_id,
)

ROOT = Path(__file__).resolve().parents[1]
SUBMITTER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
RETRIED = "id: J\ntasks: [{id: a, retry: {max_attempts: 2, initial_interval_s: 1, jitter: false}}, " \
          "{id: b, depends_on: [a]}]"


def spec_of(text: str) -> dict[str, Any]:
    return to_job_spec(load_spec_text(text))


def spans_of(events: list[dict[str, Any]]) -> list[SpanRecord]:
    b = TraceBuilder()
    return [s for e in events for s in b.apply(e)]


def run_retried(h: FoldHarness, traceparent: str = "") -> None:
    h.process({"type": "dagfold.command.SubmitJob", "spec": spec_of(RETRIED), "submitted_at_ms": h.now_ms,
               "source": "test", "traceparent": traceparent})
    d1 = h.dispatched.popleft()
    h.now_ms += 5
    h.report("Started", d1, "w1")
    h.now_ms += 20
    h.report("Failed", d1, "w1", reason="exit code 3", exit_code=3)
    h.advance(1000)  # the retry timer
    h.now_ms += 7
    h.run_all("w2")


def test_a_retried_task_gives_one_span_per_attempt_nested_under_the_job() -> None:
    h = FoldHarness()
    run_retried(h)
    spans = spans_of(h.events)
    by_name: dict[str, list[SpanRecord]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    trace = job_trace_id("J")
    assert {s.trace_id for s in spans} == {trace}
    (job,) = by_name["job"]
    assert job.parent_id is None and job.span_id == job_span_id("J") and job.error is None
    assert job.attributes["dagfold.outcome"] == "succeeded"
    a1, a2 = sorted(by_name["task a"], key=lambda s: s.attributes["dagfold.attempt"])
    assert a1.parent_id == a2.parent_id == job.span_id
    assert a1.span_id == attempt_span_id("J", "a", 1) and a2.span_id == attempt_span_id("J", "a", 2)
    assert a1.error == "exit code 3" and a1.attributes["dagfold.outcome"] == "failed"
    assert a1.attributes["dagfold.exit_code"] == 3 and a1.attributes["dagfold.worker_id"] == "w1"
    assert a2.error is None and a2.attributes["dagfold.retry_of"] == 1 and a2.attributes["dagfold.worker_id"] == "w2"
    # the attempt's phases: queued until a worker's lease, then running until its outcome
    phases = [s for s in spans if s.parent_id == a1.span_id]
    assert [(s.name, s.end_ms - s.start_ms) for s in phases] == [("queued", 5), ("running", 20)]
    assert phases[1].error == "exit code 3" and phases[1].attributes["dagfold.worker_id"] == "w1"
    (backoff,) = by_name["retry backoff"]
    assert backoff.parent_id == job.span_id and backoff.end_ms - backoff.start_ms == 1000
    assert by_name["task b"][0].parent_id == job.span_id
    # times are the events' own: the job spans its first dispatch to its end
    assert job.start_ms == a1.start_ms and job.end_ms == max(s.end_ms for s in spans)


def test_the_same_events_replayed_give_the_same_spans() -> None:
    h = FoldHarness()
    run_retried(h)
    assert spans_of(h.events) == spans_of(list(h.events))
    # a builder that starts mid-log (a consumer's committed position) names the later spans identically
    first = spans_of(h.events)
    cut = next(i for i, e in enumerate(h.events) if e["type"].endswith("TaskRetryScheduled")) + 1
    later = spans_of(h.events[cut:])
    assert later and all(s in first for s in later if s.name != "job") and \
        {s.span_id for s in later} <= {s.span_id for s in first}


def test_the_dispatch_carries_the_attempt_traceparent_a_worker_gives_its_process() -> None:
    h = FoldHarness()
    h.submit(spec_of(RETRIED))
    d = h.dispatched[0]
    assert d["traceparent"] == attempt_traceparent("J", "a", 1) == \
        f"00-{job_trace_id('J')}-{attempt_span_id('J', 'a', 1)}-01"
    ctx = TaskContext(job_id="J", task_id="a", attempt=1, idempotency_key="J/a", traceparent=d["traceparent"])
    assert ctx.env()["TRACEPARENT"] == d["traceparent"]


def test_a_submitters_traceparent_is_kept_and_the_job_continues_its_trace() -> None:
    h = FoldHarness()
    run_retried(h, traceparent=SUBMITTER.upper())
    accepted = next(e for e in h.events if e["type"].endswith("JobAccepted"))
    assert accepted["traceparent"] == ""  # upper-case hex is not valid W3C: ignored, not repaired
    h = FoldHarness()
    run_retried(h, traceparent=SUBMITTER)
    accepted = next(e for e in h.events if e["type"].endswith("JobAccepted"))
    assert accepted["traceparent"] == SUBMITTER
    spans = spans_of(h.events)
    assert {s.trace_id for s in spans} == {"4bf92f3577b34da6a3ce929d0e0e4736"}
    (job,) = [s for s in spans if s.name == "job"]
    assert job.parent_id == "00f067aa0ba902b7"
    # the dispatched attempts name the submitter's trace too (b's dispatch was the last one)
    assert h.task("J", "a")["tp"] == SUBMITTER


@pytest.mark.parametrize("value", [
    "", "garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01",
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", SUBMITTER + "-extra", "x" * 10_000,
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
    "\u00e9" * 55,
])
def test_an_invalid_traceparent_is_ignored_and_the_job_starts_a_trace_of_its_own(value: str) -> None:
    assert parse_traceparent(value) is None and clean_traceparent(value) == ""
    h = FoldHarness()
    h.process({"type": "dagfold.command.SubmitJob", "spec": spec_of("id: J\ntasks: [{id: a}]"),
               "submitted_at_ms": 0, "source": "test", "traceparent": value})
    assert h.events[0]["type"].endswith("JobAccepted") and h.events[0]["traceparent"] == ""
    assert h.dispatched[0]["traceparent"] == attempt_traceparent("J", "a", 1)


def test_a_later_version_traceparent_keeps_its_ids() -> None:
    later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more"
    assert clean_traceparent(later) == SUBMITTER


def test_a_submit_job_written_before_traceparent_existed_is_still_read() -> None:
    """Producers with the old schema (kept in schemas/history) still submit: the field defaults to ""."""
    old = load_schema(str(SCHEMAS / "history" / "v1-no-traceparent" / "dagfold.command.SubmitJob.avsc"))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, old, {"spec": spec_of("id: J\ntasks: [{id: a}]"), "submitted_at_ms": 1,
                                          "source": "old"})
    rec = default_codec().decode(MAGIC + schema_fingerprint(old) + buf.getvalue())
    assert rec["type"] == "dagfold.command.SubmitJob" and rec["traceparent"] == ""
    assert schema_fingerprint(old) != default_codec().schema("dagfold.command.SubmitJob").fingerprint


def gpu_preempted_events() -> list[dict[str, Any]]:
    """The events of a GPU job preempted once (checkpointed, requeued, granted again, succeeded)."""
    h = FoldHarness()
    h.submit(spec_of("id: G\ntasks: [{id: train, queue: gpu, resources: {gpus: 1}}]"))
    req = h.controls[-1]
    assert req["type"] == "dagfold.allocator.RequestAllocation"

    def status(kind: str, alloc: str, **kw: Any) -> None:
        h.process({"type": "dagfold.command.TaskAllocation", "job_id": "G", "task_id": "train", "attempt": 1,
                   "pool": "gpu", "status": kind, "alloc_id": alloc, "epoch": kw.get("epoch", 1), "ts_ms": h.now_ms,
                   "hosts": [{"node_id": "n1", "gpu_indices": [0], "gpu_milli": 1000}], "reason": kw.get("reason", ""),
                   "checkpoint_uri": kw.get("checkpoint_uri")})

    h.now_ms += 10
    status("granted", "a1")
    h.report("Started", {"job_id": "G", "task_id": "train", "attempt": 1}, "a1")  # GPU attempts: by allocation
    dispatch = next(c for c in h.controls if c["type"] == "dagfold.control.GpuTaskDispatch")
    assert dispatch["traceparent"] == attempt_traceparent("G", "train", 1)
    h.now_ms += 100
    status("checkpointing", "a1", reason="preempted by a higher tier", checkpoint_uri="s3://b/ck1")
    h.now_ms += 50
    status("requeued", "a1", reason="preempted by a higher tier", checkpoint_uri="s3://b/ck1")
    h.now_ms += 30
    status("granted", "a2", checkpoint_uri="s3://b/ck1", epoch=2)  # the pool's grants are numbered
    h.report("Started", {"job_id": "G", "task_id": "train", "attempt": 1}, "a2")
    h.now_ms += 200
    h.report("Succeeded", {"job_id": "G", "task_id": "train", "attempt": 1}, "a2")
    return h.events


def test_a_gpu_job_preempted_once_waits_for_gpus_again_in_the_same_attempt() -> None:
    spans = spans_of(gpu_preempted_events())
    names = [s.name for s in spans]
    assert names.count("task train") == 1 and names[-1] == "job"
    (att,) = [s for s in spans if s.name == "task train"]
    assert att.attributes["dagfold.preemptions"] == 1 and att.error is None
    assert [e.name for e in att.events] == ["preempted", "resumed from checkpoint"]
    phases = [(s.name, s.end_ms - s.start_ms, s.attributes.get("dagfold.alloc_id")) for s in spans
              if s.parent_id == att.span_id]
    assert phases == [("gpu allocation wait", 10, None), ("running", 150, "a1"), ("gpu allocation wait", 30, None),
                      ("running", 200, "a2")]
    preempted_run = [s for s in spans if s.parent_id == att.span_id][1]
    assert [e.name for e in preempted_run.events] == ["checkpointing", "preempted"]
    assert preempted_run.error is not None and preempted_run.error.startswith("preempted")


def test_tracing_is_on_only_with_an_otlp_endpoint_and_a_known_protocol() -> None:
    assert not otlp_enabled({})
    assert otlp_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert otlp_enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"})
    assert not otlp_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_SDK_DISABLED": "true"})
    assert not otlp_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x", "OTEL_TRACES_EXPORTER": "none"})
    assert otlp_protocol({}) == "http/protobuf"
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    assert otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                          "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}) == "http/protobuf"
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        otlp_protocol({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


class Backend:
    """An OTLP receiver in place of the transport: the requests the sink sends, decoded."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []

    def __call__(self, n: int, body: bytes) -> bool:
        req = ExportTraceServiceRequest.FromString(body)
        assert n == sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)
        self.requests.append(req)
        return True

    def spans(self) -> list[Any]:
        return [s for r in self.requests for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]


def sdk_request(spans: list[SpanRecord], component: str) -> ExportTraceServiceRequest:
    """What the SDK's own encoder (``encode_spans``, as the OTLP exporters call it) makes of our spans,
    built the SDK's way: a ReadableSpan each, with its SpanContext, Status and Events."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    from dagfold.tracing import _resource

    resource, scope, flags = _resource(component), InstrumentationScope("dagfold.tracing"), TraceFlags(1)
    sdk = []
    for s in spans:
        tid = int(s.trace_id, 16)
        remote = s.name == "job" and s.submitter_sampled is not None  # the submitter's span
        parent = SpanContext(tid, int(s.parent_id, 16), is_remote=remote, trace_flags=flags) if s.parent_id else None
        sdk.append(ReadableSpan(
            name=s.name, context=SpanContext(tid, int(s.span_id, 16), is_remote=False, trace_flags=flags),
            parent=parent, resource=resource, attributes=s.attributes,
            events=[Event(e.name, e.attributes, e.ts_ms * 1_000_000) for e in s.events],
            kind=SpanKind.INTERNAL, instrumentation_scope=scope,
            status=Status(StatusCode.ERROR, s.error) if s.error is not None else Status(StatusCode.OK),
            start_time=s.start_ms * 1_000_000, end_time=s.end_ms * 1_000_000))
    return encode_spans(sdk)


def test_the_sinks_otlp_is_the_sdks_encoding_of_our_ids_times_parents_and_attributes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sink writes OTLP itself (the SDK's objects cost most of tracing's CPU, issue 28): its request
    must be the one the SDK's encoder makes, message for message, for spans of every kind: a submitter's
    parent, failed and retried attempts (status ERROR, events), a GPU job's preemption, odd values."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", "dagfold-test")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=jobs")
    h = FoldHarness()
    run_retried(h, traceparent=SUBMITTER)
    spans = spans_of(h.events) + spans_of(gpu_preempted_events())
    spans.append(SpanRecord(job_trace_id("odd"), span_id("odd"), None, "odd ünïcode", 0, 2**40, {
        "s": "", "t": True, "f": False, "i": -5, "big": 2**62, "x": 0.25, "nan-free": -1e300},
        (SpanEvent("e", 7, {"k": "v"}), SpanEvent("bare", 8)), ""))
    assert {s.name for s in spans} >= {"job", "task a", "queued", "running", "retry backoff",
                                       "gpu allocation wait"}
    backend = Backend()
    sink = SpanSink("scheduler", send=backend)
    sink.export(spans)
    assert sink.flush() and sink.exported == len(spans)
    (got,) = backend.requests
    assert got == sdk_request(spans, "scheduler")
    attrs = {kv.key: kv.value.string_value for kv in got.resource_spans[0].resource.attributes}
    assert attrs["service.name"] == "dagfold-test" and attrs["team"] == "jobs"
    sink.close()


def test_a_burst_of_spans_is_exported_whole_in_batches_of_the_configured_size(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The exporter hands a poll's spans over at once (a Montage job's 1,738 tasks: 5,215 spans): every
    one is sent, in requests of at most OTEL_BSP_MAX_EXPORT_BATCH_SIZE spans (full ones at once, the
    rest on flush); the SDK's default queue of 2,048 once dropped the rest of such a burst."""
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1000")
    h = FoldHarness()
    tasks = ", ".join(f"{{id: t{i}}}" for i in range(1100))
    h.process({"type": "dagfold.command.SubmitJob", "spec": spec_of(f"id: J\ntasks: [{tasks}]"),
               "submitted_at_ms": 0, "source": "test", "traceparent": ""})
    h.run_all("w1")
    spans = spans_of(h.events)
    assert len(spans) > 3000
    backend = Backend()
    sink = SpanSink("scheduler", send=backend)
    sink.export(spans)
    assert [len(r.resource_spans[0].scope_spans[0].spans) for r in backend.requests] == [1000] * 3
    assert sink.flush()
    assert [len(r.resource_spans[0].scope_spans[0].spans) for r in backend.requests][-1] == len(spans) - 3000
    assert [s.span_id.hex() for s in backend.spans()] == [s.span_id for s in spans]
    sink.close()


def test_a_refused_export_is_counted_and_reported_by_flush() -> None:
    h = FoldHarness()
    run_retried(h)
    sink = SpanSink("scheduler", send=lambda n, body: False)
    sink.export(spans_of(h.events))
    assert not sink.flush() and sink.exported == 0 and sink.failed == len(spans_of(h.events))


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_batch_setting_is_refused_with_its_name(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", value)
    with pytest.raises(ValueError, match="OTEL_BSP_SCHEDULE_DELAY"):
        SpanSink("scheduler", send=Backend())


def test_the_exporter_sends_a_bursts_spans_within_the_schedule_delay_and_the_rest_on_close(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One request per schedule delay, not one per poll (a poll during a Montage job holds a few events):
    spans wait in the sink until the delay has passed, then go on the next poll, an empty one too."""
    from dagfold.services.tracing import SpanExporter

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    h = FoldHarness()
    run_retried(h)
    codec = default_codec()
    records = [LogRecord("events", 0, i, b"J", codec.encode(e), 0) for i, e in enumerate(h.events)]
    backend = Backend()
    exporter = SpanExporter(None, sink=SpanSink("scheduler", send=backend))  # type: ignore[arg-type]
    for i in range(0, len(records), 2):  # polls of two events
        exporter.ingest(records[i:i + 2])
    assert backend.requests == [] and exporter.spans == len(spans_of(h.events))
    exporter.sink.delay_s = 0  # the delay has passed: the next poll, with no record, sends them
    exporter.ingest([])
    assert len(backend.requests) == 1 and len(backend.spans()) == exporter.spans
    exporter.sink.delay_s = 60
    run_retried(h2 := FoldHarness(), traceparent=SUBMITTER)
    exporter.ingest([LogRecord("events", 0, i, b"J2", codec.encode(e), 0) for i, e in enumerate(h2.events)])
    assert len(backend.requests) == 1
    exporter.close()
    assert len(backend.requests) == 2 and len(backend.spans()) == exporter.spans


def test_a_ratio_sampler_keeps_or_drops_whole_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.5")
    spans: list[SpanRecord] = []
    for i in range(40):
        h = FoldHarness()
        h.submit(spec_of(f"id: J{i}\ntasks: [{{id: a}}, {{id: b, depends_on: [a]}}]"))
        h.run_all()
        spans += spans_of(h.events)
    backend = Backend()
    sink = SpanSink("scheduler", send=backend)
    sink.export(spans)
    sink.flush()
    per_trace: dict[bytes, int] = {}
    for s in backend.spans():
        per_trace[s.trace_id] = per_trace.get(s.trace_id, 0) + 1
    assert 0 < len(per_trace) < 40 and set(per_trace.values()) == {len(spans) // 40}
    sink.close()


def test_span_records_are_json_for_the_audit_export() -> None:
    h = FoldHarness(SchedulerOptions())
    run_retried(h)
    doc = json.loads(json.dumps([s.to_dict() for s in spans_of(h.events)]))
    assert {d["name"] for d in doc} >= {"job", "task a", "task b", "queued", "running", "retry backoff"}


def test_dagfold_config_is_readable_at_80_columns_and_shows_tracing() -> None:
    """Each setting's variable whole on its line with its value, its meaning wrapped in words, grouped;
    before, a five-column table split names (``DAGFOLD_TOPIC_`` / ``PREFIX``) over 233 lines."""
    import os
    import subprocess
    import sys

    from dagfold.settings import Settings, env_name

    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("DAGFOLD_", "OTEL_"))}, "COLUMNS": "80",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    r = subprocess.run([sys.executable, "-m", "dagfold", "config"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    for name in Settings.model_fields:
        assert any(line.startswith(f"  {env_name(name)} = ") for line in lines), name
    text = " ".join(line.strip() for line in lines)
    assert all(Settings.model_fields[n].description in text for n in Settings.model_fields)
    assert {"log and storage", "API and dashboard", "job-end callbacks"} <= set(lines)
    assert "  enabled = yes" in lines and "  protocol = grpc" in lines and "  endpoint = http://127.0.0.1:4318" in lines
    assert len(lines) < 150


def test_a_gpu_process_has_its_attempts_traceparent_and_the_agents_json_lines_name_it(tmp_path: Any) -> None:
    """The launcher's lines about a process (here: a checkpoint outside its folder, logged by the
    process's reader thread) carry job, task, attempt, alloc_id and trace_id as JSON fields."""
    import logging
    import sys

    from dagfold.logs import JsonFormatter
    from dagfold.services.agent.launcher import Launcher

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("dagfold")
    logger.addHandler(handler)
    script = ("import json, os; print(json.dumps({'checkpoint': '/etc/hostname'}), flush=True); "
              "print(json.dumps({'output': os.environ['TRACEPARENT']}), flush=True)")
    launcher = Launcher([sys.executable, "-c", script], tmp_path / "store", work_dir=tmp_path / "work")
    try:
        jp = launcher.start("alloc-7", 1, "G", "train", 2, [0], None, traceparent=SUBMITTER)
        assert jp.proc.wait(30) == 0
        assert jp._reader is not None
        jp._reader.join(10)
    finally:
        logger.removeHandler(handler)
        launcher.close()
    assert jp.results == [SUBMITTER]  # the process saw the dispatch's TRACEPARENT
    lines = [json.loads(x) for x in buf.getvalue().splitlines()]
    (warned,) = [x for x in lines if "ignored: not inside" in x["message"]]
    assert {k: warned.get(k) for k in ("job_id", "task_id", "attempt", "alloc_id", "trace_id")} == {
        "job_id": "G", "task_id": "train", "attempt": 2, "alloc_id": "alloc-7", "trace_id": SUBMITTER[3:35]}
    # without one from the scheduler (an older one), the agent derives the attempt's own
    launcher = Launcher([sys.executable, "-c", "import os; print(os.environ['TRACEPARENT'])"], tmp_path / "store",
                        work_dir=tmp_path / "work2")
    try:
        jp = launcher.start("alloc-8", 1, "G", "train", 3, [0], None)
        jp.proc.wait(30)
        assert jp._reader is not None
        jp._reader.join(10)
    finally:
        launcher.close()
    assert jp.lines == [attempt_traceparent("G", "train", 3)]


def test_a_submission_with_a_traceparent_header_keeps_it_and_metrics_carry_trace_exemplars(tmp_path: Any) -> None:
    """REST: the W3C header goes into SubmitJob and the answer names the trace; an invalid header is
    dropped, not refused. /metrics in OpenMetrics shows the task-duration exemplar's trace ID."""
    from dagfold import metrics
    from tests.api_support import ApiHarness

    api = ApiHarness(tmp_path)
    r = api.client.post("/v1/jobs", json={"id": "tp-job", "tasks": [{"id": "a"}]}, headers={"traceparent": SUBMITTER})
    assert r.status_code == 202 and r.json()["trace_id"] == SUBMITTER.split("-")[1]
    r = api.client.post("/v1/jobs", json={"id": "bad-tp", "tasks": [{"id": "a"}]}, headers={"traceparent": "zz"})
    assert r.status_code == 202 and r.json()["trace_id"] == job_trace_id("bad-tp")
    sent = {c["spec"]["job_id"]: c["traceparent"] for c in api.commands() if c["type"].endswith("SubmitJob")}
    assert sent == {"tp-job": SUBMITTER, "bad-tp": ""}
    trace = job_trace_id("ex-job")
    metrics.observe_worker_task("exemplars", {"type": "dagfold.command.TaskSucceeded"}, 0.2, trace)
    om = api.client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n") and om.text.count("# EOF") == 1
    assert f'queue="exemplars"}} 1.0 # {{trace_id="{trace}"}} 0.2' in om.text
    plain = api.client.get("/metrics").text
    assert "dagfold_worker_task_duration_seconds_bucket" in plain and "# {trace_id" not in plain


def test_the_sdk_sends_the_callers_current_span_as_the_jobs_parent(tmp_path: Any) -> None:
    from opentelemetry.sdk.trace import TracerProvider

    from dagfold.client import Job, RestClient
    from dagfold.tracing import current_traceparent
    from tests.api_support import ApiHarness

    api = ApiHarness(tmp_path)
    client = RestClient("http://127.0.0.1", transport=api.client._transport)
    assert current_traceparent() == ""  # no span: the job starts a trace of its own
    tracer = TracerProvider().get_tracer("submitter")
    with tracer.start_as_current_span("nightly batch") as span:
        ctx = span.get_span_context()
        job = Job("sdk-traced")
        job.task("a")
        sub = client.submit(job)
    assert sub.trace_id == f"{ctx.trace_id:032x}"
    plain = Job("sdk-plain")
    plain.task("a")
    untraced = client.submit(plain)
    assert untraced.trace_id == job_trace_id("sdk-plain")
    sent = {c["spec"]["job_id"]: c["traceparent"] for c in api.commands() if c["type"].endswith("SubmitJob")}
    flags = int(ctx.trace_flags)  # sampled, and (W3C level 2) random
    assert sent == {"sdk-traced": f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{flags:02x}", "sdk-plain": ""}


def test_a_parent_based_sampler_decides_for_the_whole_trace_as_for_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """parentbased_traceidratio at 0: a job of its own trace (a root) is dropped whole; a job whose submitter
    sampled its span is kept whole; one whose submitter did not is dropped whole."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    unsampled = "00-1bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    spans: list[SpanRecord] = []
    for tp in ("", SUBMITTER, unsampled):
        h = FoldHarness()
        run_retried(h, traceparent=tp)
        spans += spans_of(h.events)
    backend = Backend()
    sink = SpanSink("scheduler", send=backend)
    sink.export(spans)
    sink.flush()
    sink.close()
    kept = {s.trace_id.hex() for s in backend.spans()}
    assert kept == {SUBMITTER.split("-")[1]}
    assert len(backend.spans()) == len(spans) // 3


def test_a_traceparent_header_fills_an_empty_submit_job_field_before_the_fold(tmp_path: Any) -> None:
    """The scheduler's admit step copies a record's ``traceparent`` header (an upstream producer's, on
    Kafka: tests/test_kafka_e2e.py) into a SubmitJob whose field is empty or invalid, so the fold and
    its JobAccepted event see it; the field wins; a bad, repeated or non-ASCII header is ignored."""
    cfg = Config.from_env(data_dir=tmp_path)
    admit = scheduler_spec(cfg).admit

    def admitted(field: str, headers: tuple[tuple[str, bytes], ...]) -> str:
        cmd = {"type": "dagfold.command.SubmitJob", "spec": spec_of("id: J\ntasks: [{id: a}]"),
               "submitted_at_ms": 0, "source": "test", "traceparent": field}
        rec = LogRecord(COMMANDS, partition_for(b"J", cfg.partitions), 0, b"J", b"", 0, headers=headers)
        assert admit(rec, cmd) is None
        h = FoldHarness()
        h.process(cmd)
        (accepted,) = [e for e in h.events if e["type"].endswith("JobAccepted")]
        return str(accepted["traceparent"])

    other = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert admitted("", (("traceparent", SUBMITTER.encode()),)) == SUBMITTER
    assert admitted("garbage", (("other", b"x"), ("Traceparent", SUBMITTER.encode()))) == SUBMITTER
    assert admitted(other, (("traceparent", SUBMITTER.encode()),)) == other
    for bad in ((("traceparent", b"garbage"),), (("traceparent", SUBMITTER.encode()),) * 2,
                (("traceparent", SUBMITTER.encode() + b"\xff"),), (("traceparent", b"0" * 10_000),), ()):
        assert admitted("", bad) == ""


def test_the_span_exporter_lowers_only_its_own_threads_cpu_priority(tmp_path: Any) -> None:
    """DAGFOLD_TRACES_NICE: the exporter's thread (and the threads it starts, a Kafka client's) run at a
    lower priority than the rest of the process, so on a busy host the scheduler goes first."""
    from dagfold.log import open_log
    from dagfold.services.tracing import SpanExporter

    def nice_of(tid: int) -> int:
        with open(f"/proc/self/task/{tid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[16])

    main_before = nice_of(threading.get_native_id())
    lg = open_log("embedded", tmp_path)
    exporter = SpanExporter(lg, sink=SpanSink("scheduler", send=Backend()), nice=3)
    stop = threading.Event()
    seen: list[int] = []

    def run() -> None:
        exporter.run(stop)
        seen.append(nice_of(threading.get_native_id()))

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    stop.set()
    t.join(10)
    exporter.close()
    lg.close()
    assert seen == [min(19, main_before + 3)] and nice_of(threading.get_native_id()) == main_before


def test_the_trace_id_cache_holds_the_jobs_in_flight_only() -> None:
    """At 65,536 entries ``job_trace_id``'s cache grew with every job of a process for its first 65,536 (about
    220 B a job: issue 25, tests/test_soak.py); the fold asks for the jobs it is dispatching."""
    from dagfold.tracing import job_trace_id

    assert job_trace_id.cache_info().maxsize is not None
    assert job_trace_id.cache_info().maxsize <= 1 << 12


def test_with_tracing_off_no_process_loads_the_opentelemetry_sdk(tmp_path: Any) -> None:
    """Issue 28: tracing off costs nothing. In a process with no OTEL_* variable, the scheduler's, the workers'
    and the read model's modules import no ``opentelemetry`` module at all; then the whole embedded stack
    (scheduler, worker, projector, API, callbacks) runs a job through its API, and neither the SDK, nor an
    exporter, nor the protocol's messages were ever imported. (FastAPI itself imports the OpenTelemetry *API*
    for its native telemetry, which with no provider configured only checks, per request, that none is.)"""
    import subprocess
    import sys

    script = f"""
import socket, sys
from pathlib import Path
import dagfold.services.scheduler.runner, dagfold.services.worker.worker, dagfold.projections.jobs
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
import httpx
from dagfold.config import Config
from dagfold.services.stack import Stack, StackOptions
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cfg = Config(data_dir=Path({str(tmp_path / 'data')!r}), partitions=2, dispatch_partitions=2, api_port=port)
with Stack(cfg, StackOptions(workers=1)) as stack:
    r = httpx.post(f"http://127.0.0.1:{{port}}/v1/jobs", json={{"id": "off", "tasks": [{{"id": "a"}}]}},
                   timeout=30)
    assert r.status_code == 202, r.text
    job = stack.wait_job("off", timeout_s=120)
    assert job is not None and job["state"] == "succeeded", job
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                                      "opentelemetry.proto"))))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DAGFOLD_"))}
    r = subprocess.run([sys.executable, "-c", script], env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[0] == "[]", lines[0]  # the scheduler, worker and read model: no OpenTelemetry module
    assert lines[-1] == "[]", lines[-1]  # the whole stack: no SDK, exporter or OTLP message
