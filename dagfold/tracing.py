"""A job is a trace: W3C trace context for jobs, and spans made from the events.

Identifiers are derived, never drawn: a job's trace ID is the submitter's (its W3C ``traceparent``,
kept in ``JobAccepted``) or, without one, the first 16 bytes of SHA-256 over the job ID; every span
ID is 8 bytes of SHA-256 over the job, the task, the attempt and the span's kind. So the scheduler,
a worker and a GPU agent name the same attempt span without talking to each other (the worker puts
``TRACEPARENT`` in a task process's environment), and the same events replayed give the same spans.

``TraceBuilder`` turns the events of the ``events`` topic, in log order, into finished spans
(``SpanRecord``, plain data; times are the events' own ``ts_ms``). It is a reader beside the
folds, not part of one: the scheduler's fold never sees it. ``services/tracing`` runs it on a
consumer of its own and hands the spans to the OpenTelemetry SDK; ``dagfold audit JOB --trace``
runs it over one job's records.

The spans of a job (names; the attributes carry ``dagfold.*`` ids and outcomes)::

    job                                  JobAccepted .. JobSucceeded / JobFailed / JobCancelled
      task <task_id>   (one per attempt) TaskDispatched .. TaskSucceeded / TaskFailed / TaskCancelled /
                                         LeaseReclaimed (the worker lost: the next attempt follows)
        queued                           dispatched .. a worker's lease (again after a lease loss)
        gpu allocation wait              dispatched (or preempted) .. the allocation's grant
        running                          the lease or grant .. the attempt's end, a lease loss or a
                                         preemption; events: checkpointing, preempted, re-dispatched
      retry backoff                      TaskRetryScheduled .. its retry time

OpenTelemetry is configured by the standard ``OTEL_*`` variables (``otlp_enabled``); when no OTLP
endpoint is set nothing of OpenTelemetry is imported.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dagfold.settings import SettingsError

log = logging.getLogger("dagfold.tracing")

TRACEPARENT = "traceparent"  # the HTTP header and the SubmitJob field
_TRACEPARENT_RE = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
MAX_TRACEPARENT_CHARS = 256
ENDED_JOBS_KEPT = 100_000  # ended jobs whose trace context a builder remembers (for a later redrive)

AttrValue = str | int | float | bool
Attrs = dict[str, AttrValue]


# -- trace context -------------------------------------------------------------------------------

def parse_traceparent(value: str | None) -> tuple[str, str, int] | None:
    """``(trace_id, parent_span_id, flags)`` of a W3C ``traceparent``, or None when it is not one.

    As the W3C rules say: version ``ff`` and all-zero IDs are invalid; version 00 has no more fields;
    a later version may append fields. Invalid values are ignored (the job starts a trace of its own),
    never refused: a tracing header must not fail a submission.
    """
    if not value or len(value) > MAX_TRACEPARENT_CHARS:
        return None
    m = _TRACEPARENT_RE.match(value.strip())
    if m is None:
        return None
    version, trace_id, span_id, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return None
    return trace_id, span_id, int(flags, 16)


def clean_traceparent(value: str | None) -> str:
    """The canonical version-00 form of a valid ``traceparent``, or "" (what a job record keeps)."""
    parsed = parse_traceparent(value)
    if parsed is None:
        return ""
    trace_id, span_id, flags = parsed
    return f"00-{trace_id}-{span_id}-{flags & 0xFF:02x}"


def traceparent_of(headers: Sequence[tuple[str, bytes]]) -> str:
    """The clean ``traceparent`` among a log record's headers (what an upstream producer writing to
    Kafka may say instead of the SubmitJob field), or "": a missing, repeated, over-long, non-ASCII
    or invalid one is ignored, as the REST header's is."""
    values = [v for k, v in headers if k.lower() == TRACEPARENT]
    if len(values) != 1 or len(values[0]) > MAX_TRACEPARENT_CHARS:
        return ""
    try:
        return clean_traceparent(values[0].decode("ascii"))
    except UnicodeDecodeError:
        return ""


def current_traceparent() -> str:
    """The ``traceparent`` of the caller's current OpenTelemetry span, or "" (also when the caller has
    not imported OpenTelemetry: this never imports it)."""
    if "opentelemetry.trace" not in sys.modules:
        return ""
    from opentelemetry import trace

    sc = trace.get_current_span().get_span_context()
    if not sc.is_valid:
        return ""
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()


def span_id(*parts: object) -> str:
    """16 hex digits derived from ``parts`` (never all zero)."""
    d = _digest("dagfold-span", *parts)[:8]
    return (d if any(d) else b"\x01" * 8).hex()


# The fold asks once per dispatch; a job's tasks ask alike: the hot keys are the jobs in flight (at 65,536 the cache,
# about 220 B a job, grew with every job of a process for its first 65,536: issue 25, tests/test_soak.py).
@functools.lru_cache(maxsize=1 << 12)
def job_trace_id(job_id: str, traceparent: str = "") -> str:
    """The job's trace: the submitter's, or 32 hex digits derived from the job ID."""
    parsed = parse_traceparent(traceparent)
    if parsed is not None:
        return parsed[0]
    d = _digest("dagfold-trace", job_id)[:16]
    return (d if any(d) else b"\x01" * 16).hex()


def job_span_id(job_id: str, round_: int = 0) -> str:
    """The job's span (a new one for each redrive or reopen: ``round_`` counts them)."""
    return span_id("job", job_id, round_)


def attempt_span_id(job_id: str, task_id: str, attempt: int) -> str:
    return span_id("attempt", job_id, task_id, attempt)


def attempt_traceparent(job_id: str, task_id: str, attempt: int, job_traceparent: str = "") -> str:
    """The ``TRACEPARENT`` of an attempt's process: its spans nest under the attempt's span."""
    return f"00-{job_trace_id(job_id, job_traceparent)}-{attempt_span_id(job_id, task_id, attempt)}-01"


# -- spans from events ---------------------------------------------------------------------------

@dataclass(frozen=True)
class SpanEvent:
    name: str
    ts_ms: int
    attributes: Attrs = field(default_factory=dict)


@dataclass(frozen=True)
class SpanRecord:
    """A finished span, as plain data (``to_otel`` makes the SDK's span of it)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ms: int
    end_ms: int
    attributes: Attrs
    events: tuple[SpanEvent, ...] = ()
    error: str | None = None  # the status description of a failed span; None: ok
    submitter_sampled: bool | None = None  # the submitter's sampled flag; None: the job's own trace

    def to_dict(self) -> dict[str, Any]:
        return {"trace_id": self.trace_id, "span_id": self.span_id, "parent_id": self.parent_id,
                "name": self.name, "start_ms": self.start_ms, "end_ms": self.end_ms,
                "attributes": dict(self.attributes), "error": self.error,
                "events": [{"name": e.name, "ts_ms": e.ts_ms, "attributes": dict(e.attributes)}
                           for e in self.events]}


@dataclass
class _Open:
    """A span begun and not yet ended."""

    span_id: str
    parent_id: str | None
    name: str
    start_ms: int
    attributes: Attrs
    events: list[SpanEvent] = field(default_factory=list)


@dataclass
class _Job:
    trace_id: str
    parent_id: str | None  # the submitter's span
    submitter_sampled: bool | None
    round: int = 0
    span: _Open | None = None
    attempts: dict[tuple[str, int], _Open] = field(default_factory=dict)
    phases: dict[tuple[str, int], tuple[_Open, int]] = field(default_factory=dict)  # (phase, number)


def _span_attrs(ev: Mapping[str, Any], *names: str) -> Attrs:
    out: Attrs = {}
    for n in names:
        v = ev.get(n)
        if v is None or v == "":
            continue
        out[f"dagfold.{n}"] = v if isinstance(v, (str, int, float, bool)) else ",".join(str(x) for x in v)
    return out


class TraceBuilder:
    """Finished spans from events read in log order (``apply`` one event at a time).

    State is the open spans of running jobs, plus the trace context of up to ``ENDED_JOBS_KEPT``
    ended jobs (so a redriven job continues its trace). A builder that starts mid-log (a consumer
    group's committed position) names spans exactly as one that read from the start; it only misses
    the spans begun before its first event, and ``dagfold audit JOB --trace`` rebuilds those.
    """

    def __init__(self, ended_kept: int = ENDED_JOBS_KEPT) -> None:
        self._jobs: dict[str, _Job] = {}
        self._ended: OrderedDict[str, _Job] = OrderedDict()
        self._ended_kept = ended_kept

    def trace_of(self, job_id: str) -> str | None:
        j = self._jobs.get(job_id) or self._ended.get(job_id)
        return j.trace_id if j is not None else None

    def _job(self, job_id: str) -> _Job:
        j = self._jobs.get(job_id)
        if j is None:
            j = self._ended.pop(job_id, None) or _Job(job_trace_id(job_id), None, None)
            self._jobs[job_id] = j
        return j

    def _finish(self, j: _Job, s: _Open, end_ms: int, error: str | None = None, **attrs: AttrValue) -> SpanRecord:
        s.attributes.update(attrs)
        return SpanRecord(j.trace_id, s.span_id, s.parent_id, s.name, s.start_ms, max(end_ms, s.start_ms),
                          dict(s.attributes), tuple(s.events), error, j.submitter_sampled)

    def _job_span_id(self, job_id: str, j: _Job) -> str:
        return j.span.span_id if j.span is not None else job_span_id(job_id, j.round)

    def _open_phase(self, job_id: str, j: _Job, key: tuple[str, int], name: str, ts: int, **attrs: AttrValue) -> None:
        parent = j.attempts.get(key)
        previous = j.phases.get(key)
        number = previous[1] + 1 if previous is not None else 0
        sid = span_id("phase", job_id, key[0], key[1], number)
        j.phases[key] = (_Open(sid, parent.span_id if parent is not None else attempt_span_id(job_id, *key),
                               name, ts, dict(attrs)), number)

    def _close_phase(self, j: _Job, key: tuple[str, int], ts: int, out: list[SpanRecord], *,
                     name: str | None = None, error: str | None = None, **attrs: AttrValue) -> None:
        cur = j.phases.get(key)
        if cur is None or cur[0].start_ms < 0:
            return
        s, number = cur
        if name is not None:
            s.name = name
        out.append(self._finish(j, s, ts, error, **attrs))
        j.phases[key] = (_Open(s.span_id, s.parent_id, s.name, -1, {}), number)  # ended; numbering goes on

    def _end_attempt(self, job_id: str, j: _Job, key: tuple[str, int], ts: int, out: list[SpanRecord],
                     outcome: str, error: str | None, ev: Mapping[str, Any], *names: str) -> None:
        self._close_phase(j, key, ts, out, error=error)
        j.phases.pop(key, None)
        s = j.attempts.pop(key, None)
        if s is None:
            return
        s.attributes.update(_span_attrs(ev, *names))
        out.append(self._finish(j, s, ts, error, **{"dagfold.outcome": outcome}))

    def apply(self, ev: Mapping[str, Any]) -> list[SpanRecord]:
        """The spans ``ev`` ends (most events end none)."""
        kind = str(ev.get("type", "")).rsplit(".", 1)[-1]
        job_id = ev.get("job_id")
        if not isinstance(job_id, str) or kind not in _HANDLED:
            return []
        ts = int(ev.get("ts_ms") or 0)
        out: list[SpanRecord] = []
        if kind == "JobAccepted":
            spec = ev.get("spec") or {}
            tp = clean_traceparent(ev.get("traceparent"))
            parsed = parse_traceparent(tp)
            j = self._jobs.get(job_id)
            if j is None:  # a new job (or one re-read: its context is derived again, identically)
                self._ended.pop(job_id, None)
                j = self._jobs[job_id] = _Job(job_trace_id(job_id, tp), parsed[1] if parsed else None,
                                              bool(parsed[2] & 1) if parsed else None)
            j.span = _Open(job_span_id(job_id, j.round), j.parent_id, "job", ts, {
                "dagfold.job_id": job_id, "dagfold.tenant": spec.get("tenant", ""),
                "dagfold.tasks": len(spec.get("tasks") or []),
                **({"dagfold.name": spec["name"]} if spec.get("name") else {})})
            return out
        j = self._job(job_id)
        if kind in ("JobRedriven", "TaskReopened"):
            if j.span is None:  # the job had ended: it runs again under a new job span
                j.round += 1
                j.span = _Open(job_span_id(job_id, j.round), j.parent_id, "job", ts,
                               {"dagfold.job_id": job_id, "dagfold.round": j.round})
            return out
        if kind in ("JobSucceeded", "JobFailed", "JobCancelled"):
            outcome = {"JobSucceeded": "succeeded", "JobFailed": "failed", "JobCancelled": "cancelled"}[kind]
            if j.span is not None:
                err = None if kind == "JobSucceeded" else (ev.get("reason") or outcome)
                attrs: Attrs = {"dagfold.outcome": outcome}
                if ev.get("partial"):
                    attrs["dagfold.partial"] = True
                out.append(self._finish(j, j.span, ts, err, **attrs))
                j.span = None
            if not j.attempts:
                self._retire(job_id, j)
            return out
        task_id = ev.get("task_id")
        attempt = ev.get("attempt")
        if not isinstance(task_id, str) or not isinstance(attempt, int):
            return out
        key = (task_id, attempt)
        if kind == "TaskDispatched":
            if key in j.attempts:
                return out
            attrs = {"dagfold.job_id": job_id, "dagfold.task_id": task_id, "dagfold.attempt": attempt,
                     "dagfold.queue": ev.get("queue", "")}
            if attempt > 1:
                attrs["dagfold.retry_of"] = attempt - 1
            j.attempts[key] = _Open(attempt_span_id(job_id, task_id, attempt), self._job_span_id(job_id, j),
                                    f"task {task_id}", ts, attrs)
            self._open_phase(job_id, j, key, "queued", ts)
        elif kind == "LeaseGranted":
            worker = {"dagfold.worker_id": ev.get("worker_id", "")}
            cur = j.phases.get(key)
            if cur is not None and cur[0].start_ms >= 0 and cur[0].name == "running":
                cur[0].attributes.update(worker)  # a GPU attempt: running since its grant; its host started it
            else:
                self._close_phase(j, key, ts, out, name="queued")
                self._open_phase(job_id, j, key, "running", ts, **worker)
            if key in j.attempts:
                j.attempts[key].attributes.update(worker)
        elif kind == "TaskAllocated":
            self._close_phase(j, key, ts, out, name="gpu allocation wait")
            attrs = _span_attrs(ev, "pool", "alloc_id", "epoch", "node_ids")
            self._open_phase(job_id, j, key, "running", ts, **attrs)
            if key in j.attempts:
                j.attempts[key].attributes.update(attrs)
                if ev.get("resume_checkpoint"):
                    j.attempts[key].events.append(SpanEvent("resumed from checkpoint", ts, _span_attrs(
                        ev, "resume_checkpoint")))
        elif kind in ("TaskCheckpointing", "TaskRequeued", "TaskRedispatched"):
            name = {"TaskCheckpointing": "checkpointing", "TaskRequeued": "preempted",
                    "TaskRedispatched": "re-dispatched"}[kind]
            se = SpanEvent(name, ts, _span_attrs(ev, "alloc_id", "reason", "checkpoint_uri", "redispatches"))
            cur = j.phases.get(key)
            target = cur[0] if cur is not None and cur[0].start_ms >= 0 else j.attempts.get(key)
            if target is not None:
                target.events.append(se)
            if kind == "TaskRequeued":  # the attempt waits for GPUs again (it keeps its number)
                self._close_phase(j, key, ts, out, error=f"preempted: {ev.get('reason', '')}")
                if key in j.attempts:
                    j.attempts[key].events.append(se)
                    j.attempts[key].attributes["dagfold.preemptions"] = int(
                        j.attempts[key].attributes.get("dagfold.preemptions", 0)) + 1
                    self._open_phase(job_id, j, key, "gpu allocation wait", ts)
        elif kind == "LeaseReclaimed":
            reason = f"lease lost: {ev.get('reason', '')}"
            if key in j.attempts:
                j.attempts[key].events.append(SpanEvent("lease lost", ts, _span_attrs(
                    ev, "worker_id", "reason", "losses", "final")))
            self._end_attempt(job_id, j, key, ts, out, "lease_lost", reason, ev, "worker_id", "losses")
        elif kind == "TaskSucceeded":
            self._end_attempt(job_id, j, key, ts, out, "succeeded", None, ev, "worker_id")
        elif kind == "TaskFailed":
            self._end_attempt(job_id, j, key, ts, out, "failed", str(ev.get("reason") or "failed"), ev,
                              "worker_id", "exit_code", "error_type", "final")
        elif kind == "TaskCancelled":
            self._end_attempt(job_id, j, key, ts, out, "cancelled", str(ev.get("reason") or "cancelled"), ev)
        elif kind == "TaskRetryScheduled":
            retry_at = int(ev.get("retry_at_ms") or ts)
            out.append(SpanRecord(j.trace_id, span_id("retry", job_id, task_id, attempt),
                                  self._job_span_id(job_id, j), "retry backoff", ts, max(ts, retry_at), {
                                      "dagfold.task_id": task_id, "dagfold.attempt": attempt,
                                      "dagfold.next_attempt": int(ev.get("next_attempt") or attempt + 1),
                                      "dagfold.reason": str(ev.get("reason", ""))}, (), None, j.submitter_sampled))
        if j.span is None and not j.attempts:
            self._retire(job_id, j)
        return out

    def _retire(self, job_id: str, j: _Job) -> None:
        self._jobs.pop(job_id, None)
        j.phases.clear()
        self._ended[job_id] = j
        while len(self._ended) > self._ended_kept:
            self._ended.popitem(last=False)


_HANDLED = frozenset({
    "JobAccepted", "JobRedriven", "TaskReopened", "JobSucceeded", "JobFailed", "JobCancelled", "TaskDispatched",
    "LeaseGranted", "TaskAllocated", "TaskCheckpointing", "TaskRequeued", "TaskRedispatched", "LeaseReclaimed",
    "TaskSucceeded", "TaskFailed", "TaskCancelled", "TaskRetryScheduled"})
EVENT_TYPES = frozenset(f"dagfold.event.{k}" for k in _HANDLED)


# -- OpenTelemetry, from the OTEL_* variables ----------------------------------------------------

def otlp_enabled(env: Mapping[str, str] | None = None) -> bool:
    """Tracing is on when an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` or its traces
    variant), unless ``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none``."""
    env = os.environ if env is None else env
    if not (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return False  # first: the check a worker makes for each task when tracing is off
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() != "none"


def otlp_protocol(env: Mapping[str, str] | None = None) -> str:
    """``grpc`` or ``http/protobuf`` (the specification's default); ``http/json`` has no Python exporter."""
    env = os.environ if env is None else env
    proto = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
             or "http/protobuf").strip().lower()
    if proto not in ("grpc", "http/protobuf"):
        raise SettingsError(f"OTEL_EXPORTER_OTLP_PROTOCOL={proto!r}: use grpc or http/protobuf")
    return proto


def settings_summary(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What ``dagfold config`` shows of tracing."""
    env = os.environ if env is None else env
    if not otlp_enabled(env):
        return {"enabled": "no (set OTEL_EXPORTER_OTLP_ENDPOINT)"}
    try:
        proto = otlp_protocol(env)
    except SettingsError as exc:
        proto = f"invalid: {exc}"
    return {"enabled": "yes", "endpoint": env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", ""), "protocol": proto,
            "service_name": env.get("OTEL_SERVICE_NAME") or "dagfold",
            "sampler": env.get("OTEL_TRACES_SAMPLER") or "parentbased_always_on"}


def _resource(component: str) -> Any:
    from opentelemetry.sdk.resources import Resource

    return Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "dagfold",
                            "dagfold.component": component})


def _span_exporter() -> Any:
    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]
    return OTLPSpanExporter()


# -- OTLP encoding of SpanRecords ----------------------------------------------------------------
#
# Why this is written by hand: the SDK's way is a ReadableSpan per span (SpanContext, Status, Event
# objects) and then the exporter's ``encode_spans``, which builds a protobuf message per span,
# attribute and value. For dagfold's spans, which are finished, plain data before OpenTelemetry sees
# them, that cost 110-130 µs of CPU a task (3 spans a task), the largest part of what tracing cost the
# scheduler's 2 cores (issue 28). The bytes below are the same ExportTraceServiceRequest
# (opentelemetry-proto's trace.proto; tests/test_tracing.py checks them against the SDK's encoder,
# message for message), written in 10-15 µs a task. What stays the library's: the resource
# (``Resource.create``: OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) and the scope, encoded once by
# the exporter's own encoder; the sampler (OTEL_TRACES_SAMPLER); and the transport, the
# opentelemetry-exporter-otlp exporter of the protocol (endpoint, headers, timeout, compression,
# certificates from OTEL_EXPORTER_OTLP_*, its retries and backoff): ``_otlp_transport``.

_I64 = struct.Struct("<Q").pack
_F64 = struct.Struct("<d").pack
_FLAGS = {False: b"\x85\x01" + struct.pack("<I", 0x100),  # SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE
          True: b"\x85\x01" + struct.pack("<I", 0x300)}  # ... and IS_REMOTE: the submitter's span
_STATUS_OK = b"\x7a\x02\x18\x01"  # Status{code: STATUS_CODE_OK}
_KEYS: dict[str, bytes] = {}  # KeyValue.key, encoded (dagfold's attribute names: a few dozen)


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _any_value(v: AttrValue) -> bytes:
    if isinstance(v, str):
        return _field(b"\x0a", v.encode())  # string_value
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"  # bool_value (before int: a bool is an int)
    if isinstance(v, int):
        return b"\x18" + _varint(v & 0xFFFF_FFFF_FFFF_FFFF)  # int_value (int64, two's complement)
    if isinstance(v, float):
        return b"\x21" + _F64(v)  # double_value
    return _field(b"\x0a", str(v).encode())


def _attributes(tag: bytes, attrs: Mapping[str, AttrValue]) -> bytes:
    """Repeated KeyValue under ``tag`` (Span.attributes or Event.attributes)."""
    out = []
    for k, v in attrs.items():
        key = _KEYS.get(k)
        if key is None:
            key = _field(b"\x0a", k.encode())
            if len(_KEYS) < 4096:
                _KEYS[k] = key
        out.append(_field(tag, key + _field(b"\x12", _any_value(v))))
    return b"".join(out)


def otlp_span(s: SpanRecord) -> bytes:
    """The OTLP ``Span`` message of ``s`` (kind INTERNAL; status OK, or ERROR with the reason)."""
    parts = [b"\x0a\x10", bytes.fromhex(s.trace_id), b"\x12\x08", bytes.fromhex(s.span_id)]
    if s.parent_id:
        parts += (b"\x22\x08", bytes.fromhex(s.parent_id))
    parts += (_field(b"\x2a", s.name.encode()), b"\x30\x01", b"\x39", _I64(s.start_ms * 1_000_000),
              b"\x41", _I64(s.end_ms * 1_000_000), _attributes(b"\x4a", s.attributes))
    for e in s.events:
        parts.append(_field(b"\x5a", b"\x09" + _I64(e.ts_ms * 1_000_000) + _field(b"\x12", e.name.encode())
                            + _attributes(b"\x1a", e.attributes)))
    if s.error is None:
        parts.append(_STATUS_OK)
    else:
        parts.append(_field(b"\x7a", (_field(b"\x12", s.error.encode()) if s.error else b"") + b"\x18\x02"))
    # the job's span is the child of the submitter's (a remote parent); every other parent is ours
    parts.append(_FLAGS[s.parent_id is not None and s.name == "job" and s.submitter_sampled is not None])
    return b"".join(parts)


OtlpSend = Callable[[int, bytes], bool]  # (spans, an encoded ExportTraceServiceRequest) -> delivered


def _otlp_transport() -> tuple[OtlpSend, Callable[[], None]]:
    """Send and shut down through opentelemetry-exporter-otlp's exporter of ``otlp_protocol()``.

    The exporters take SDK spans and encode them (``encode_spans``); the encoded request goes to the
    client underneath instead: for http/protobuf the exporter's HTTP client (it sends serialized
    payloads, with retries), for gRPC the exporter's ``_export`` (channel, retries, backoff) with its
    one encoding step (``_translate_data``) reading our bytes. Both are the exporters' internals,
    pinned with them (pyproject.toml); tests/test_tracing_jaeger.py sends over both to a real Jaeger.
    """
    from opentelemetry.sdk.trace.export import SpanExportResult

    if otlp_protocol() == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        class Encoded(GrpcExporter):
            def _translate_data(self, data: Any) -> ExportTraceServiceRequest:
                return ExportTraceServiceRequest.FromString(data[1])

            def _count_data(self, data: Any) -> int:
                return int(data[0])

        grpc_exporter = Encoded()
        return (lambda n, body: grpc_exporter._export((n, body)) == SpanExportResult.SUCCESS), grpc_exporter.shutdown
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    http_exporter = HttpExporter()
    return (lambda n, body: bool(http_exporter._client.export(body).success)), http_exporter.shutdown


def _positive_env(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise SettingsError(f"{name}={raw!r}: expected a positive whole number")
    return value


class SpanSink:
    """Encodes ``SpanRecord``s as OTLP and exports them in batches (``OTEL_*``).

    ``export`` encodes the sampled spans and sends every full batch (``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``
    spans, default 2,048: one request); ``flush`` sends the rest; ``due`` says when the delay since the
    last flush (``OTEL_BSP_SCHEDULE_DELAY`` ms, default 1,000) has passed or a batch is full, and the
    span exporter flushes then: a few large requests, not one a poll (the variables mean what they mean
    for the SDK's batch span processor). Sending happens on the caller's thread: a slow backend slows
    the exporter, never the scheduler. The sampler is ``OTEL_TRACES_SAMPLER``'s, asked once per trace
    with the trace ID and the submitter's flags as parent:
    ``traceidratio`` keeps or drops whole traces. ``send`` replaces the OTLP transport (tests).
    """

    def __init__(self, component: str = "scheduler", send: OtlpSend | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.common._internal import (
            _encode_instrumentation_scope,
            _encode_resource,
        )
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        resource = _resource(component)
        self._sampler = TracerProvider(resource=resource).sampler  # OTEL_TRACES_SAMPLER(_ARG)
        self.batch = _positive_env("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 2048)
        self.delay_s = _positive_env("OTEL_BSP_SCHEDULE_DELAY", 1000) / 1000
        # ResourceSpans.resource (+ schema_url) and ScopeSpans.scope, encoded once by the library
        self._resource_field = _field(b"\x0a", _encode_resource(resource).SerializeToString()) + (
            _field(b"\x1a", resource.schema_url.encode()) if resource.schema_url else b"")
        scope = _encode_instrumentation_scope(InstrumentationScope("dagfold.tracing"))
        self._scope_field = _field(b"\x0a", scope.SerializeToString())
        if send is None:
            self._send, self._shutdown = _otlp_transport()
        else:
            self._send, self._shutdown = send, lambda: None
        self._pending: list[bytes] = []  # ScopeSpans.spans fields
        self._last_flush = time.monotonic()
        self._decisions: OrderedDict[str, bool] = OrderedDict()  # trace ID -> sampled
        self.exported = 0  # spans the backend took
        self.failed = 0  # spans of requests that failed (logged; not retried beyond the exporter's retries)

    def export(self, spans: Sequence[SpanRecord]) -> None:
        pending = self._pending
        for s in spans:
            if self._sampled(s):
                pending.append(_field(b"\x12", otlp_span(s)))
        while len(self._pending) >= self.batch:
            self._send_batch(self.batch)

    def due(self) -> bool:
        """Time to flush: the schedule delay has passed since the last flush, or a batch is full."""
        return len(self._pending) >= self.batch or time.monotonic() - self._last_flush >= self.delay_s

    def flush(self) -> bool:
        """Send every pending span; False when a request failed."""
        ok = True
        while self._pending:
            ok = self._send_batch(self.batch) and ok
        self._last_flush = time.monotonic()
        return ok

    def request(self, spans: Sequence[bytes]) -> bytes:
        """An ExportTraceServiceRequest of encoded spans (``ScopeSpans.spans`` fields)."""
        return _field(b"\x0a", self._resource_field + _field(b"\x12", self._scope_field + b"".join(spans)))

    def _send_batch(self, n: int) -> bool:
        batch, self._pending = self._pending[:n], self._pending[n:]
        try:
            ok = self._send(len(batch), self.request(batch))
        except Exception as exc:  # the transport's own errors are logged by it; anything else here
            log.warning("OTLP export of %d spans failed: %s", len(batch), exc)
            ok = False
        if ok:
            self.exported += len(batch)
        else:
            self.failed += len(batch)
        return ok

    def _sampled(self, s: SpanRecord) -> bool:
        """The sampler's decision for the span's trace, asked once per trace as for the job's span: a root
        (the job's own trace) or the child of the submitter's span, with its flags. The ratio samplers
        read the trace ID, the parent-based ones the submitter's flags: every span of a trace goes alike."""
        kept = self._decisions.get(s.trace_id)
        if kept is None:
            from opentelemetry import trace
            from opentelemetry.trace import SpanContext, TraceFlags

            tid = int(s.trace_id, 16)
            ctx = None
            if s.submitter_sampled is not None:
                ctx = trace.set_span_in_context(trace.NonRecordingSpan(SpanContext(
                    tid, 1, is_remote=True, trace_flags=TraceFlags(1 if s.submitter_sampled else 0))))
            kept = self._sampler.should_sample(ctx, tid, "job").decision.is_sampled()
            self._decisions[s.trace_id] = kept
            if len(self._decisions) > 10_000:
                self._decisions.popitem(last=False)
        return kept

    def close(self) -> None:
        """Send what is pending, then shut the transport down."""
        try:
            self.flush()
        finally:
            self._shutdown()


def lower_cpu_priority(by: int) -> None:
    """Lower the calling thread's CPU priority by ``by`` nice steps (at most to 19). On Linux the nice value
    is a thread's, and the threads it starts later (a Kafka client's) inherit it: the span exporter calls
    this first thing on its own thread, so the rest of a ``dagfold up`` process keeps its priority."""
    if by <= 0:
        return
    try:
        os.nice(by)
    except OSError as exc:
        log.warning("could not lower the span exporter's CPU priority: %s", exc)


# -- spans of a task's own code ------------------------------------------------------------------

_provider_lock = threading.Lock()
_provider_installed = False


def install_process_provider(component: str) -> bool:
    """Make this process's global tracer provider export over OTLP (once; False when tracing is off),
    so a Python handler's ``opentelemetry.trace.get_tracer(...)`` spans reach the backend."""
    global _provider_installed
    if not otlp_enabled():
        return False
    with _provider_lock:
        if not _provider_installed:
            from opentelemetry import trace
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider = TracerProvider(resource=_resource(component))
            provider.add_span_processor(BatchSpanProcessor(_span_exporter()))
            trace.set_tracer_provider(provider)
            _provider_installed = True
    return True


class _Attached:
    """The attempt's span as the current context while a handler runs (a remote parent)."""

    __slots__ = ("parsed", "token")

    def __init__(self, parsed: tuple[str, str, int]) -> None:
        self.parsed = parsed
        self.token: Any = None

    def __enter__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace import SpanContext, TraceFlags

        # what TraceContextTextMapPropagator().extract gives for the header, without its carrier dict
        # and second parse (with the checks below: 30 -> 12 µs a task in a worker, tracing on)
        trace_id, parent_id, flags = self.parsed
        self.token = context.attach(trace.set_span_in_context(trace.NonRecordingSpan(SpanContext(
            int(trace_id, 16), int(parent_id, 16), is_remote=True, trace_flags=TraceFlags(flags & 0xFF)))))

    def __exit__(self, *exc: object) -> None:
        from opentelemetry import context

        context.detach(self.token)


_UNTRACED = contextlib.nullcontext()


def attempt_context(traceparent: str, component: str = "worker") -> contextlib.AbstractContextManager[None]:
    """Run a Python handler under its attempt's span (``with attempt_context(tp): ...``): spans it starts
    are children of the attempt.

    Nothing of OpenTelemetry is imported when tracing is off, and nothing is made: the check is two
    environment lookups (``otlp_enabled``), then the same do-nothing context for every task.
    """
    if not traceparent or not (_provider_installed or install_process_provider(component)):
        return _UNTRACED
    parsed = parse_traceparent(traceparent)
    return _UNTRACED if parsed is None else _Attached(parsed)
