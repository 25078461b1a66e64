"""The span exporter: tails the ``events`` topic and exports each job's spans over OTLP.

Data flow (one ``SpanExporter``: its own consumer, an in-memory ``TraceBuilder``, a ``SpanSink``)::

    events (group dagfold-traces) --> TraceBuilder.apply (event types it reads, by fingerprint)
        --> finished SpanRecords --> SpanSink: encoded as OTLP, sent in batches by the OTLP exporter's
            transport once per OTEL_BSP_SCHEDULE_DELAY (or when a batch is full)
    offsets committed after each batch is handed to the sink

It runs beside the scheduler, never inside its fold: tracing on costs the fold nothing, and the
spans depend only on the events (``dagfold audit JOB --trace`` rebuilds a job's trace from its
partition with ``job_spans``). It starts only when ``dagfold.tracing.otlp_enabled()``.

Delivery is at most once: a span handed to the sink is lost if the process dies before the sink
sends it (within a schedule delay), and spans begun before a restart's committed position are not rebuilt
(a trace backend is a diagnostic, not a ledger; the audit export fills a gap).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from dagfold.codec import Codec, default_codec
from dagfold.config import EVENTS
from dagfold.exceptions import CodecError, LogError
from dagfold.log import Log, TopicPartition
from dagfold.log.base import Consumer, LogRecord
from dagfold.log.reader import join_when_present, read_to_end
from dagfold.processor.polling import Backoff, LagGauge
from dagfold.settings import load_settings
from dagfold.tracing import EVENT_TYPES, SpanRecord, SpanSink, TraceBuilder, lower_cpu_priority

log = logging.getLogger("dagfold.tracing")

GROUP = "dagfold-traces"


class SpanExporter:
    """Tails ``events`` and exports spans; ``run`` until stopped, then ``close`` (flushes)."""

    def __init__(self, log_: Log, *, sink: SpanSink | None = None, codec: Codec | None = None,
                 batch_max_records: int = 5000, poll_timeout_s: float = 0.2, nice: int | None = None) -> None:
        self.log = log_
        self.nice = load_settings().traces_nice if nice is None else nice  # DAGFOLD_TRACES_NICE
        self.sink = sink if sink is not None else SpanSink("scheduler")
        self.builder = TraceBuilder()
        self.batch_max_records = batch_max_records
        self.poll_timeout_s = poll_timeout_s
        self._codec = codec or default_codec()
        self._relevant_fp: dict[bytes, bool] = {}
        self._consumer: Consumer | None = None
        self._lag = LagGauge("traces")
        self.spans = 0

    def _ensure_consumer(self) -> bool:
        if self._consumer is not None:
            return True
        consumer = join_when_present(self.log, EVENTS, GROUP, "dagfold-traces")
        if consumer is None:
            return False
        self._consumer = consumer
        return True

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
        """Build and export the spans these events end, then commit their offsets; returns spans."""
        spans: list[SpanRecord] = []
        nexts: dict[TopicPartition, int] = {}
        for rec in records:
            tp = TopicPartition(rec.topic, rec.partition)
            nexts[tp] = max(nexts.get(tp, 0), rec.offset + 1)
            ev = self._event(rec)
            if ev is not None:
                spans.extend(self.builder.apply(ev))
        if spans:
            self.sink.export(spans)
            self.spans += len(spans)
        if self.sink.due():  # also on an empty poll: what a burst left is sent within the delay
            self.sink.flush()
        if self._consumer is not None and nexts:
            self._consumer.commit(nexts)
        return len(spans)

    def step(self, timeout_s: float | None = None) -> int:
        if not self._ensure_consumer() or self._consumer is None:
            threading.Event().wait(min(self.poll_timeout_s, 0.5))
            return 0
        records = self._consumer.poll(self.batch_max_records, self.poll_timeout_s if timeout_s is None else timeout_s)
        self.ingest(records)
        if self._lag.due():
            consumer = self._consumer
            self._lag.report(self.log, {tp: consumer.position(tp) for tp in consumer.assignment()})
        return len(records)

    def run(self, stop: threading.Event) -> None:
        lower_cpu_priority(self.nice)  # before its consumer starts its threads, which inherit it
        backoff = Backoff()
        log.info("span exporter started (group %s, nice +%d)", GROUP, self.nice)
        while not stop.is_set():
            try:
                self.step()
                backoff.succeeded()
            except LogError as exc:
                delay = backoff.failed()
                log.warning("span exporter: log error, retrying in %.1fs: %s", delay, exc)
                stop.wait(delay)
        log.info("span exporter stopped: %d spans", self.spans)

    def close(self) -> None:
        """Export what the sink holds, then release the consumer."""
        try:
            self.sink.close()
        finally:
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None


def job_spans(log_: Log, job_id: str) -> list[SpanRecord]:
    """Every span of ``job_id``, rebuilt from its partition of ``events`` (the same IDs and times as the
    live exporter's): what ``dagfold audit JOB --trace`` prints and re-exports."""
    codec = default_codec()
    p = log_.partition_for(job_id.encode(), log_.partitions(EVENTS))  # the topic's own count, not a setting
    key = job_id.encode()
    builder = TraceBuilder()
    out: list[SpanRecord] = []
    for recs in read_to_end(log_, TopicPartition(EVENTS, p)):
        for r in recs:
            if r.key != key:
                continue
            try:
                ev = codec.decode(r.value)
            except CodecError:
                continue
            if ev["type"] in EVENT_TYPES:
                out.extend(builder.apply(ev))
    return out
