"""The span exporter: tails the ``events`` topic and exports each job's spans over OTLP.

Data flow (one ``SpanExporter``: its reader, a ``dagfold.log.reader.GroupReader``, an in-memory
``TraceBuilder``, the SDK's batch span processor)::

    events (group dagfold-traces) --> TraceBuilder.apply (event types it reads, by fingerprint)
        --> finished SpanRecords --> SpanSink: BatchSpanProcessor --> OTLP exporter (its own thread)
    offsets committed after each batch is handed to the processor

It runs beside the scheduler, never inside its fold: tracing on costs the fold nothing, and the
spans depend only on the events (``dagfold audit JOB --trace`` rebuilds a job's trace from its
partition with ``job_spans``). It starts only when ``dagfold.tracing.otlp_enabled()``.

Delivery is at most once: a span handed to the batch processor is lost if the process dies before
the processor exports it, and spans begun before a restart's committed position are not rebuilt
(a trace backend is a diagnostic, not a ledger; the audit export fills a gap).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from dagfold.codec import Codec, default_codec
from dagfold.config import EVENTS
from dagfold.exceptions import CodecError
from dagfold.log import Log
from dagfold.log.base import LogRecord
from dagfold.log.reader import GroupReader, read_key
from dagfold.tracing import EVENT_TYPES, SpanRecord, SpanSink, TraceBuilder

log = logging.getLogger("dagfold.tracing")

GROUP = "dagfold-traces"


class SpanExporter:
    """Tails ``events`` and exports spans; ``run`` until stopped, then ``close`` (flushes)."""

    def __init__(self, log_: Log, *, sink: SpanSink | None = None, codec: Codec | None = None,
                 batch_max_records: int = 5000, poll_timeout_s: float = 0.2) -> None:
        self.log = log_
        self.sink = sink if sink is not None else SpanSink("scheduler")
        self.builder = TraceBuilder()
        self._codec = codec or default_codec()
        self._relevant_fp: dict[bytes, bool] = {}
        self.reader = GroupReader(log_, "traces", EVENTS, GROUP, self.ingest, batch_max_records=batch_max_records,
                                  poll_timeout_s=poll_timeout_s, client_id="dagfold-traces")
        self.spans = 0

    def _event(self, rec: LogRecord) -> dict[str, Any] | None:
        """The decoded event if the builder reads its type (others are skipped by fingerprint, undecoded)."""
        fp = bytes(rec.value[2:10]) if rec.value is not None else b""
        if self._relevant_fp.get(fp) is False:
            return None
        try:
            ev = self._codec.decode(rec.value)
        except CodecError:
            return None
        relevant = ev["type"] in EVENT_TYPES
        self._relevant_fp[fp] = relevant
        return ev if relevant else None

    def ingest(self, records: list[LogRecord]) -> int:
        """The reader's handler: build and export the spans these events end (the reader then commits
        their offsets); returns spans."""
        spans: list[SpanRecord] = []
        for rec in records:
            ev = self._event(rec)
            if ev is not None:
                spans.extend(self.builder.apply(ev))
        if spans:
            self.sink.export(spans)
            self.spans += len(spans)
        return len(spans)

    def step(self, timeout_s: float | None = None) -> int:
        return self.reader.step(timeout_s)

    def run(self, stop: threading.Event) -> None:
        log.info("span exporter started (group %s)", GROUP)
        self.reader.run(stop)
        log.info("span exporter stopped: %d spans", self.spans)

    def close(self) -> None:
        """Export what the batch processor holds, then release the consumer."""
        try:
            self.sink.flush(10.0)
            self.sink.close()
        finally:
            self.reader.close()


def job_spans(log_: Log, job_id: str) -> list[SpanRecord]:
    """Every span of ``job_id``, rebuilt from its partition of ``events`` (the same IDs and times as the
    live exporter's): what ``dagfold audit JOB --trace`` prints and re-exports."""
    codec = default_codec()
    builder = TraceBuilder()
    out: list[SpanRecord] = []
    for r in read_key(log_, EVENTS, job_id.encode(), log_.partitions(EVENTS)):  # the topic's own count
        try:
            ev = codec.decode(r.value)
        except CodecError:
            continue
        if ev["type"] in EVENT_TYPES:
            out.extend(builder.apply(ev))
    return out
