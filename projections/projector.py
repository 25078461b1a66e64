"""The projector: tails the events topic (and the allocator's) into the read models.

The loop is the reader runtime (``dagfold.log.reader.Reader``): no consumer
group, every partition of its topics assigned from the positions stored in its
own RocksDB store, each polled batch of events written together with the new
positions in one write batch. So the read model is always exactly "the events
before these positions", and a restart (even after kill -9) resumes where the
last write batch stopped, without applying any event twice.

Topics: ``events`` (the scheduler's decisions: jobs, tasks, attempts, history
and the operator models) and, once it exists, ``allocator.events`` (GPU node
inventory and allocations: the cluster model). A topic that does not exist yet
is looked for again every ``partition_check_s``.

A record that cannot be decoded is skipped (and counted): the projector is a
reader, the scheduler owns the dead-letter topic.

Metrics (``dagfold.metrics``): events folded, fold latency, projection lag
(event time to applied) and consumer lag (records behind the end offsets).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from dagfold import metrics
from dagfold.clock import now_ms
from dagfold.codec import Codec, default_codec
from dagfold.config import ALLOCATOR_EVENTS, EVENTS
from dagfold.exceptions import CodecError
from dagfold.log.base import Log, LogRecord
from dagfold.log.reader import Reader
from dagfold.projections import cluster
from dagfold.projections.jobs import ReadModel, apply, meta_key
from dagfold.projections.store import ReadModelStore, ReadModelTxn

log = logging.getLogger(__name__)

LAG_CHECK_S = 5.0


class Projector:
    """Folds the events topic into ``store`` (a path opens one, owned by the projector)."""

    def __init__(
        self,
        log: Log,
        path: Path | ReadModelStore,
        *,
        topic: str = EVENTS,
        extra_topics: Sequence[str] | None = None,
        batch_max_records: int = 5000,
        poll_timeout_s: float = 0.2,
        partition_check_s: float = 10.0,
        codec: Codec | None = None,
    ) -> None:
        self.log = log
        self._owns_store = not isinstance(path, ReadModelStore)
        self.store = path if isinstance(path, ReadModelStore) else ReadModelStore(path)
        self.topic = topic
        default_extra = (ALLOCATOR_EVENTS,) if topic == EVENTS else ()
        self.topics = (topic, *(default_extra if extra_topics is None else extra_topics))
        self._codec = codec or default_codec()
        self.reader: Reader[ReadModelTxn] = Reader(
            log, "projector", self.topics, self.store, self._fold, after_commit=self._committed,
            batch_max_records=batch_max_records, poll_timeout_s=poll_timeout_s,
            partition_check_s=partition_check_s, lag_every_s=LAG_CHECK_S, client_id="dagfold-projector")
        self._batch: tuple[int, float, list[float]] = (0, 0.0, [])  # the batch being written: applied, started, lags
        self.applied = 0  # events applied by this instance
        self.commits = 0  # batches committed by this instance (a cheap change signal for readers)

    @property
    def read_model(self) -> ReadModel:
        """Queries over this projector's store (safe from other threads)."""
        return ReadModel(self.store)

    def positions(self, topic: str | None = None) -> dict[int, int]:
        """Next offset to read per partition of ``topic`` (default: the events topic), as stored."""
        return self.reader.positions(topic or self.topic)

    # -- folding ---------------------------------------------------------
    def _fold(self, records: list[LogRecord], txn: ReadModelTxn) -> None:
        """The reader's handler: fold a batch of new events into ``txn`` (the reader adds the positions)."""
        started = time.perf_counter()
        applied = skipped = errors = 0
        lags: list[float] = []
        now = now_ms()
        for rec in records:
            try:
                event = self._codec.decode(rec.value)
            except CodecError as exc:
                skipped += 1
                log.warning("projector skips %s[%d]@%d: %s", rec.topic, rec.partition, rec.offset, exc,
                            extra={"topic": rec.topic, "partition": rec.partition, "offset": rec.offset})
                continue
            try:
                cluster.apply(txn, event)
                if rec.topic == self.topic:
                    apply(txn, event, rec.partition, rec.offset)
                applied += 1
                ts = event.get("ts_ms")
                if isinstance(ts, int):
                    lags.append(max(now - ts, 0.0) / 1000.0)
            except Exception:  # one bad event must not stop the read model
                errors += 1
                log.exception("projector failed to apply %s at %s[%d]@%d", event.get("type"), rec.topic,
                              rec.partition, rec.offset,
                              extra={"topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
                                     "job": event.get("job_id"), "task": event.get("task_id"),
                                     "attempt": event.get("attempt")})
        for name, n in (("skipped", skipped), ("errors", errors)):
            if n:
                key = meta_key(name)
                txn.put(key, int(txn.get(key) or 0) + n)
        self._batch = (applied, started, lags)

    def _committed(self) -> None:
        """The reader wrote the batch: count it (never ahead of the store)."""
        applied, started, lags = self._batch
        self._batch = (0, 0.0, [])
        self.applied += applied
        self.commits += 1
        metrics.observe_fold("projector", applied, time.perf_counter() - started)
        metrics.PROJECTION_LAST_APPLIED.set(time.time())
        for lag in lags:
            metrics.PROJECTION_LAG.observe(lag)

    def apply_records(self, records: list[LogRecord]) -> int:
        """Apply records and their positions in one write batch; returns events applied."""
        before = self.applied
        self.reader.apply(records)
        return self.applied - before

    def poll_once(self, timeout_s: float | None = None) -> int:
        """Poll one batch and apply it; returns records polled (0 if the topic does not exist yet)."""
        return self.reader.step(timeout_s)

    def catch_up(self, timeout_s: float = 60.0, idle_s: float = 1.0) -> int:
        """Apply every event written before this call; returns events applied (``Reader.catch_up``)."""
        start = self.applied
        self.reader.catch_up(timeout_s, idle_s)
        return self.applied - start

    def run(self, stop: threading.Event) -> None:
        """Project until ``stop`` is set; waits for the events topic to exist."""
        self.reader.run(stop)

    def close(self) -> None:
        self.reader.close()
        if self._owns_store:
            self.store.close()
