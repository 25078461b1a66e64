"""Reading the log: one partition to its end (``read_to_end``; one key's records: ``read_key``), and
the reader runtime that tails topics into a reader's state (``Reader``, ``GroupReader``).

``read_to_end``: "the end" is the end offset seen at the start; the loop stops when the
consumer's position reaches it, which steps over Kafka's transaction markers
(the last offset of a partition written transactionally is a marker, never a
record). ``max_idle_s`` bounds the wait when the last stable offset lags the end
offset (a zombie's open transaction holds it back until the transaction times out):
then a reader that can do with what was readable (replay, audit, checks) stops, and a
``strict`` one (a fold's catch-up, which must never go on from part of its events) raises.

The reader runtime (Zeebe's exporter director, Kafka Streams' stream task) is the one loop of every
reader of the events topics outside the partition processor: the projector, the callback notifier
and the span exporter only configure it with a handler of a polled batch. It owns joining the
topics, polling, the back-off after a log error, the positions, catch-up, the consumer-lag gauge
(``dagfold_consumer_lag_records``, labelled by the reader's name) and stopping:

* ``Reader``: no consumer group. It assigns every partition of its topics itself, from the
  positions kept in the reader's own store, and hands each polled batch to the handler together
  with one store transaction; the new positions go into that same transaction, so the reader's state
  and its positions are one write batch: a restart (even after kill -9) resumes where the last
  batch stopped, applying no record twice and skipping none.
* ``GroupReader``: a reader with no state of its own (the span exporter) joins a consumer group and
  commits the group's offsets after the handler returned.

``Backoff`` and ``LagGauge`` are shared with the partition processor.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from dagfold import metrics
from dagfold.exceptions import LogError
from dagfold.log.base import Consumer, Log, LogRecord, TopicPartition

log = logging.getLogger("dagfold.log")

LAG_EVERY_S = 5.0
_PARTITION = struct.Struct(">I")


def read_to_end(log_: Log, tp: TopicPartition, start: int = 0, batch: int = 5000,
                max_idle_s: float = 30.0, strict: bool = False) -> Iterator[list[LogRecord]]:
    """Batches of committed records of ``tp`` from ``start`` up to the end offset seen now.

    ``strict``: raise ``LogError`` when nothing more became readable for ``max_idle_s`` before the
    end was reached (else log a warning and stop there)."""
    end = log_.end_offsets([tp])[tp]
    if start >= end:
        return
    consumer = log_.consumer(None, client_id=f"reader-{tp.topic}-{tp.partition}")
    consumer.assign({tp: start})
    idle_since = time.monotonic()
    try:
        while consumer.position(tp) < end:
            recs = consumer.poll(batch, 0.2)
            if recs:
                idle_since = time.monotonic()
                yield recs
            elif time.monotonic() - idle_since > max_idle_s:
                at = consumer.position(tp)
                if strict:
                    raise LogError(f"reading {tp.topic}[{tp.partition}] stopped at {at} of {end}: nothing more "
                                   f"became readable in {max_idle_s:g}s (an open transaction holds the "
                                   "partition's last stable offset back, or its leader is unreachable)")
                log.warning("reading %s stopped at %d of %d: nothing more became readable", tp, at, end)
                return
    finally:
        consumer.close()


def read_key(log_: Log, topic: str, key: bytes, partitions: int) -> Iterator[LogRecord]:
    """The records of ``key`` on its partition of ``topic`` (of ``partitions``), up to the end offset seen
    now: a job's records, keyed by its ID (audits, a job's spans)."""
    for recs in read_to_end(log_, TopicPartition(topic, log_.partition_for(key, partitions))):
        for r in recs:
            if r.key == key:
                yield r


def join_when_present(log_: Log, topic: str, group: str, client_id: str) -> Consumer | None:
    """A consumer of ``group`` subscribed to ``topic`` once the topic exists; None until then (a reader
    that starts before the writer created its topic asks again on its next round)."""
    try:
        log_.partitions(topic)
    except LogError:
        return None
    consumer = log_.consumer(group, client_id=client_id)
    consumer.subscribe([topic])
    return consumer


class Backoff:
    """Waits after consecutive failures: ``first``, doubled each time up to ``most``; a success resets."""

    def __init__(self, first: float = 0.1, most: float = 5.0) -> None:
        self.first = first
        self.most = most
        self._next = first

    def failed(self) -> float:
        """The wait before trying again, after one more failure."""
        delay = self._next
        self._next = min(self._next * 2, self.most)
        return delay

    def succeeded(self) -> None:
        self._next = self.first


class LagGauge:
    """The consumer-lag gauge of one component: records between its positions and the end offsets,
    per topic, measured at most every ``every_s`` seconds (an end-offsets request each time)."""

    def __init__(self, component: str, every_s: float = LAG_EVERY_S) -> None:
        self.component = component
        self.every_s = every_s
        self._at = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._at < self.every_s:
            return False
        self._at = now
        return True

    def report(self, log: Log, positions: Mapping[TopicPartition, int]) -> None:
        """Set the gauge from ``positions`` (next offsets to read); a log error leaves it as it was."""
        if not positions:
            return
        try:
            ends = log.end_offsets(list(positions))
        except LogError:
            return
        by_topic: dict[str, int] = {}
        for tp, end in ends.items():
            by_topic[tp.topic] = by_topic.get(tp.topic, 0) + max(end - positions[tp], 0)
        for topic, lag in by_topic.items():
            metrics.CONSUMER_LAG.labels(self.component, topic).set(lag)


# -- the reader runtime ----------------------------------------------------------------------------
def position_key(topic: str, partition: int) -> bytes:
    """The store key of a reader's next offset to read in ``topic[partition]`` (an int value)."""
    return b"p\x00" + topic.encode() + b"\x00" + _PARTITION.pack(partition)


class ReaderTxn(Protocol):
    """A write batch of a reader's store with read-your-writes (``ReadModelTxn`` is one)."""

    def get(self, key: bytes) -> Any: ...

    def put(self, key: bytes, value: Any) -> None: ...


TxnT = TypeVar("TxnT", bound=ReaderTxn)


class ReaderStore(Protocol[TxnT]):
    """A reader's store: transactions written atomically (``ReadModelStore`` is one)."""

    def get(self, key: bytes) -> Any: ...

    def txn(self) -> TxnT: ...

    def commit(self, txn: TxnT) -> None: ...


class _Runtime:
    """The loop both readers share: join, poll, hand over, measure the lag, back off, stop.

    ``tick`` runs before each poll and after each polled batch (the notifier's delivery side);
    ``wait_s`` turns the poll timeout into the wait of this round (the notifier wakes for its
    next due delivery)."""

    def __init__(self, log_: Log, name: str, *, batch_max_records: int, poll_timeout_s: float,
                 lag_every_s: float, client_id: str | None, tick: Callable[[], object] | None,
                 wait_s: Callable[[float], float] | None) -> None:
        self.log = log_
        self.name = name
        self.batch_max_records = batch_max_records
        self.poll_timeout_s = poll_timeout_s
        self.client_id = client_id or f"dagfold-{name}"
        self._tick = tick
        self._wait_s = wait_s
        self._consumer: Consumer | None = None
        self._lag = LagGauge(name, lag_every_s)
        self._waiting_logged = False

    # what each reader defines
    def _join(self) -> Consumer | None:
        raise NotImplementedError

    def apply(self, records: list[LogRecord]) -> None:
        raise NotImplementedError

    def lag_positions(self) -> dict[TopicPartition, int]:
        raise NotImplementedError

    # the loop
    def report_lag(self) -> None:
        """Set the consumer-lag gauge now (the loop does it at most every ``lag_every_s``)."""
        self._lag.report(self.log, self.lag_positions())

    def step(self, timeout_s: float | None = None) -> int:
        """One round: poll one batch (waiting at most ``timeout_s``, default ``poll_timeout_s``) and hand
        it over; returns the records polled (0 while the topic does not exist yet)."""
        return self._round(timeout_s, time.sleep)

    def _round(self, timeout_s: float | None, sleep: Callable[[float], object]) -> int:
        if self._tick is not None:
            self._tick()
        wait = self.poll_timeout_s if timeout_s is None else timeout_s
        if self._wait_s is not None:
            wait = self._wait_s(wait)
        consumer = self._join()
        if consumer is None:
            if not self._waiting_logged:
                log.info("%s waits for its topic", self.name)
                self._waiting_logged = True
            sleep(min(wait, 0.5))
            return 0
        records = consumer.poll(self.batch_max_records, wait)
        self.apply(records)
        if self._tick is not None:
            self._tick()
        if self._lag.due():
            self.report_lag()
        return len(records)

    def run(self, stop: threading.Event) -> None:
        """Read until ``stop`` is set; a log error is retried after a back-off (0.1 s doubling up to 5 s)."""
        backoff = Backoff()
        while not stop.is_set():
            try:
                self._round(None, stop.wait)
                backoff.succeeded()
            except LogError as exc:
                delay = backoff.failed()
                log.warning("%s: log error, retrying in %.1fs: %s", self.name, delay, exc)
                stop.wait(delay)

    def close(self) -> None:
        """Release the consumer (after ``run`` returned); the store is the reader's to close."""
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                consumer.close()
            except Exception:
                log.debug("%s: consumer close failed", self.name, exc_info=True)


class Reader(_Runtime, Generic[TxnT]):
    """Tails ``topics`` into ``store``: ``handler(records, txn)`` folds a polled batch into ``txn``, and the
    reader puts the next positions into the same ``txn`` and commits it (one write batch).

    No consumer group: every partition of ``topics`` is assigned from the stored positions; records
    below them (already in the store) never reach the handler. ``topics[0]`` must exist before the
    reader reads anything; the others are read once they exist. A topic's partitions are looked up
    again every ``partition_check_s`` (a topic that appears or grows is assigned then).
    ``after_commit`` runs once a batch's transaction is written (counters and metrics that must not
    run ahead of the store)."""

    def __init__(self, log_: Log, name: str, topics: Sequence[str], store: ReaderStore[TxnT],
                 handler: Callable[[list[LogRecord], TxnT], object], *,
                 after_commit: Callable[[], object] | None = None, batch_max_records: int = 5000,
                 poll_timeout_s: float = 0.2, partition_check_s: float = 10.0, lag_every_s: float = LAG_EVERY_S,
                 client_id: str | None = None, tick: Callable[[], object] | None = None,
                 wait_s: Callable[[float], float] | None = None) -> None:
        super().__init__(log_, name, batch_max_records=batch_max_records, poll_timeout_s=poll_timeout_s,
                         lag_every_s=lag_every_s, client_id=client_id, tick=tick, wait_s=wait_s)
        self.topics = tuple(topics)
        self.store = store
        self.handler = handler
        self.after_commit = after_commit
        self.partition_check_s = partition_check_s
        self.parts: dict[str, int] = {}  # partitions of each topic found so far
        self._checked_at = 0.0

    def positions(self, topic: str) -> dict[int, int]:
        """Next offset to read per partition of ``topic``, as stored (0 where none)."""
        out = {}
        for p in range(self.parts.get(topic, 0)):
            v = self.store.get(position_key(topic, p))
            out[p] = int(v) if v is not None else 0
        return out

    def lag_positions(self) -> dict[TopicPartition, int]:
        return {TopicPartition(t, p): off for t in self.parts for p, off in self.positions(t).items()}

    def _join(self) -> Consumer | None:
        """(Re)assign every partition when a topic appears or grows; None while ``topics[0]`` does not exist."""
        now = time.monotonic()
        if self._consumer is not None and now - self._checked_at < self.partition_check_s:
            return self._consumer
        self._checked_at = now
        found: dict[str, int] = {}
        for t in self.topics:
            try:
                found[t] = self.log.partitions(t)
            except LogError:
                if t in self.parts:
                    found[t] = self.parts[t]  # a metadata hiccup does not unassign
        if self.topics[0] not in found or (found == self.parts and self._consumer is not None):
            return self._consumer
        self.parts = found
        if self._consumer is None:
            self._consumer = self.log.consumer(None, client_id=self.client_id)
        self._consumer.assign(self.lag_positions())
        log.info("%s assigned %s", self.name, found)
        return self._consumer

    def apply(self, records: list[LogRecord]) -> None:
        """Hand the records past the stored positions to the handler and write its changes and the new
        positions in one transaction (nothing is written if the handler raises)."""
        if not records:
            return
        txn = self.store.txn()
        nexts: dict[tuple[str, int], int] = {}
        new: list[LogRecord] = []
        for rec in records:
            tp = (rec.topic, rec.partition)
            pos = nexts.get(tp)
            if pos is None:
                stored = txn.get(position_key(*tp))
                pos = int(stored) if stored is not None else 0
            if rec.offset < pos:
                continue  # already in the store
            nexts[tp] = rec.offset + 1
            new.append(rec)
        self.handler(new, txn)
        for (t, p), nxt in nexts.items():
            txn.put(position_key(t, p), nxt)
        self.store.commit(txn)
        if self.after_commit is not None:
            self.after_commit()

    def catch_up(self, timeout_s: float = 60.0, idle_s: float = 1.0) -> None:
        """Apply every record written before this call.

        Stops when every partition reached the end offsets seen at the start, or when nothing
        arrived for ``idle_s`` (Kafka's transaction markers leave offsets no record reaches; before
        the first record arrives the wait is five times longer, for the first fetch), or after
        ``timeout_s``."""
        self._checked_at = 0.0
        if self._join() is None:
            return
        tps = [TopicPartition(t, p) for t, n in self.parts.items() for p in range(n)]
        ends = self.log.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        idle_since = time.monotonic()
        got_any = False
        while time.monotonic() < deadline:
            pos = self.lag_positions()
            if all(pos.get(tp, 0) >= end for tp, end in ends.items()):
                break
            if self.step(0.1):
                idle_since = time.monotonic()
                got_any = True
            elif time.monotonic() - idle_since >= (idle_s if got_any else 5 * idle_s):
                break


class GroupReader(_Runtime):
    """Tails ``topic`` in consumer group ``group``: ``handler(records)`` takes each polled batch, then the
    group's offsets are committed (a reader with no state of its own: what the handler did before a
    crash is done again, or not, as the handler's own delivery allows)."""

    def __init__(self, log_: Log, name: str, topic: str, group: str, handler: Callable[[list[LogRecord]], object],
                 *, batch_max_records: int = 5000, poll_timeout_s: float = 0.2, lag_every_s: float = LAG_EVERY_S,
                 client_id: str | None = None, tick: Callable[[], object] | None = None,
                 wait_s: Callable[[float], float] | None = None) -> None:
        super().__init__(log_, name, batch_max_records=batch_max_records, poll_timeout_s=poll_timeout_s,
                         lag_every_s=lag_every_s, client_id=client_id, tick=tick, wait_s=wait_s)
        self.topic = topic
        self.group = group
        self.handler = handler

    def _join(self) -> Consumer | None:
        if self._consumer is None:
            self._consumer = join_when_present(self.log, self.topic, self.group, self.client_id)
            if self._consumer is not None:
                log.info("%s joined group %s on %s", self.name, self.group, self.topic)
        return self._consumer

    def lag_positions(self) -> dict[TopicPartition, int]:
        consumer = self._consumer
        return {} if consumer is None else {tp: consumer.position(tp) for tp in consumer.assignment()}

    def apply(self, records: list[LogRecord]) -> None:
        nexts: dict[TopicPartition, int] = {}
        for rec in records:
            tp = TopicPartition(rec.topic, rec.partition)
            nexts[tp] = max(nexts.get(tp, 0), rec.offset + 1)
        self.handler(records)
        if self._consumer is not None and nexts:
            self._consumer.commit(nexts)
