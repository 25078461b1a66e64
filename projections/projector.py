"""The projector: tails the events topic (and the allocator's) into the read models.

No consumer group: the projector assigns every partition of its topics itself,
from the positions stored in its own RocksDB store, and writes each polled
batch of events together with the new positions in one write batch. So the
read model is always exactly "the events before these positions", and a
restart (even after kill -9) resumes where the last write batch stopped,
without applying any event twice.

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
from dagfold.exceptions import CodecError, LogError
from dagfold.log.base import Consumer, Log, LogRecord, TopicPartition
from dagfold.processor.polling import Backoff, LagGauge
from dagfold.projections import cluster
from dagfold.projections.jobs import ReadModel, apply, meta_key, position_key
from dagfold.projections.store import ReadModelStore

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
        self.batch_max_records = batch_max_records
        self.poll_timeout_s = poll_timeout_s
        self.partition_check_s = partition_check_s
        self._codec = codec or default_codec()
        self._consumer: Consumer | None = None
        self._parts: dict[str, int] = {}
        self._checked_at = 0.0
        self._lag = LagGauge("projector", LAG_CHECK_S)
        self.applied = 0  # events applied by this instance
        self.commits = 0  # batches committed by this instance (a cheap change signal for readers)

    @property
    def _partitions(self) -> int:
        return self._parts.get(self.topic, 0)

    @property
    def read_model(self) -> ReadModel:
        """Queries over this projector's store (safe from other threads)."""
        return ReadModel(self.store)

    # -- positions -------------------------------------------------------
    def positions(self, topic: str | None = None) -> dict[int, int]:
        """Next offset to read per partition of ``topic`` (default: the events topic), as stored."""
        t = topic or self.topic
        out = {}
        for p in range(self._parts.get(t, 0)):
            v = self.store.get(position_key(t, p))
            out[p] = int(v) if v is not None else 0
        return out

    def _assign(self) -> bool:
        """(Re)assign all partitions when a topic appears or grows; False if the events topic does not exist yet."""
        now = time.monotonic()
        if self._consumer is not None and now - self._checked_at < self.partition_check_s:
            return True
        self._checked_at = now
        found: dict[str, int] = {}
        for t in self.topics:
            try:
                found[t] = self.log.partitions(t)
            except LogError:
                if t in self._parts:
                    found[t] = self._parts[t]  # a metadata hiccup does not unassign
        if self.topic not in found:
            return self._consumer is not None
        if found == self._parts and self._consumer is not None:
            return True
        self._parts = found
        if self._consumer is None:
            self._consumer = self.log.consumer(None, client_id="dagfold-projector")
        assignment = {TopicPartition(t, p): off for t in found for p, off in self.positions(t).items()}
        self._consumer.assign(assignment)
        log.info("projector assigned %s", {t: n for t, n in found.items()})
        return True

    # -- folding ---------------------------------------------------------
    def apply_records(self, records: list[LogRecord]) -> int:
        """Apply records and their positions in one write batch; returns events applied."""
        if not records:
            return 0
        started = time.perf_counter()
        txn = self.store.txn()
        nexts: dict[tuple[str, int], int] = {}
        applied = skipped = errors = 0
        lags: list[float] = []
        now = now_ms()
        for rec in records:
            pkey = position_key(rec.topic, rec.partition)
            pos = nexts.get((rec.topic, rec.partition))
            if pos is None:
                stored = txn.get(pkey)
                pos = int(stored) if stored is not None else 0
            if rec.offset < pos:
                continue  # already in the read model
            nexts[(rec.topic, rec.partition)] = rec.offset + 1
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
        for (t, p), nxt in nexts.items():
            txn.put(position_key(t, p), nxt)
        for name, n in (("skipped", skipped), ("errors", errors)):
            if n:
                key = meta_key(name)
                txn.put(key, int(txn.get(key) or 0) + n)
        self.store.commit(txn)
        self.applied += applied
        self.commits += 1
        metrics.observe_fold("projector", applied, time.perf_counter() - started)
        metrics.PROJECTION_LAST_APPLIED.set(time.time())
        for lag in lags:
            metrics.PROJECTION_LAG.observe(lag)
        return applied

    def _update_lag(self) -> None:
        """Set the consumer-lag gauge: records between the stored positions and the end offsets."""
        if not self._lag.due():
            return
        positions: dict[TopicPartition, int] = {}
        for t, n in self._parts.items():
            pos = self.positions(t)
            positions.update({TopicPartition(t, p): pos.get(p, 0) for p in range(n)})
        self._lag.report(self.log, positions)

    def poll_once(self, timeout_s: float | None = None) -> int:
        """Poll one batch and apply it; returns records polled (0 if the topic does not exist yet)."""
        if not self._assign() or self._consumer is None:
            if timeout_s:
                time.sleep(min(timeout_s, 0.5))
            return 0
        records = self._consumer.poll(self.batch_max_records,
                                      self.poll_timeout_s if timeout_s is None else timeout_s)
        self.apply_records(records)
        self._update_lag()
        return len(records)

    def catch_up(self, timeout_s: float = 60.0, idle_s: float = 1.0) -> int:
        """Apply every event written before this call; returns events applied.

        Stops when every partition reached the end offsets seen at the start,
        or when nothing arrived for ``idle_s`` (Kafka's transaction markers
        leave offsets no record reaches; before the first record arrives the
        wait is five times longer, for the first fetch), or after ``timeout_s``.
        """
        start = self.applied
        self._checked_at = 0.0
        if not self._assign():
            return 0
        tps = [TopicPartition(t, p) for t, n in self._parts.items() for p in range(n)]
        ends = self.log.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        idle_since = time.monotonic()
        got_any = False
        while time.monotonic() < deadline:
            pos = {t: self.positions(t) for t in self._parts}
            if all(pos[tp.topic].get(tp.partition, 0) >= end for tp, end in ends.items()):
                break
            if self.poll_once(0.1):
                idle_since = time.monotonic()
                got_any = True
            elif time.monotonic() - idle_since >= (idle_s if got_any else 5 * idle_s):
                break
        return self.applied - start

    def run(self, stop: threading.Event) -> None:
        """Project until ``stop`` is set; waits for the events topic to exist."""
        backoff = Backoff()
        waiting_logged = False
        while not stop.is_set():
            try:
                if not self._assign():
                    if not waiting_logged:
                        log.info("projector waits for topic %s", self.topic)
                        waiting_logged = True
                    stop.wait(0.5)
                    continue
                self.poll_once()
                backoff.succeeded()
            except LogError as exc:
                delay = backoff.failed()
                log.warning("projector: log error, retrying in %.1fs: %s", delay, exc)
                stop.wait(delay)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._owns_store:
            self.store.close()
