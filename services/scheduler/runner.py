"""The scheduler's I/O shell: the loop around the fold.

Per poll of the commands topic:

1. decode each record (or dead-letter it with the reason) and fold it into the
   partition's state transaction;
2. produce the events (to the *same* partition of the events topic), dispatch
   and control records in ONE log transaction that also commits the consumed
   command offsets (exactly-once: a crash before this point redoes the batch,
   after it never does);
3. commit each partition's state and its applied-events offset in one RocksDB
   write batch.

A crash between 2 and 3 loses nothing: when a partition is (re)assigned, its
store catches up by applying the events after its recorded offset (replay
applies events only), then commands resume from the committed offset.
A timer scans each store's due-time index and writes TimerFired commands, so
time-based decisions go through the log and replay deterministically.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from dagfold import metrics
from dagfold.codec import default_codec
from dagfold.commands import job_id_of
from dagfold.config import COMMANDS, DEADLETTER, DISPATCH_PREFIX, EVENTS, SCHEDULER_GROUP, Config
from dagfold.exceptions import CodecError, FencedError, LogError
from dagfold.log import Log, LogRecord, TopicPartition, partition_for
from dagfold.log.reader import read_to_end
from dagfold.outputs import Output, dead_letter
from dagfold.state import PartitionStore, PartitionTransaction
from dagfold.state.store import applied_events_offset
from services.scheduler.fold import SchedulerFold
from services.scheduler.timers import due_timers

log = logging.getLogger("dagfold.scheduler")

TIMER_REFIRE_MS = 5000
# Timer scans start this far below the earliest timer the last scan left (or its time): new
# timers are due at or after the fold's clock, which a wall-clock step back could move earlier.
TIMER_SCAN_MARGIN_MS = 60_000
TIMER_FULL_SCAN_MS = 60_000  # and from the index's start once a minute, whatever happened


def now_ms() -> int:
    return int(time.time() * 1000)


class SchedulerRunner:
    """One scheduler instance: owns the command partitions the group assigns it."""

    def __init__(self, log_: Log, config: Config, instance_id: str = "0") -> None:
        self.log = log_
        self.config = config
        self.instance_id = instance_id
        self.fold = SchedulerFold(config.scheduler)
        self.codec = default_codec()
        self.stores: dict[int, PartitionStore] = {}
        self._known_topics: set[str] = set()
        self._fired: dict[bytes, int] = {}
        self._timer_floor: dict[int, int] = {}  # per partition: no timer is due before this
        self._full_scan_ms = 0
        self.folded = 0
        self.ready = threading.Event()
        self.consumer = log_.consumer(SCHEDULER_GROUP, client_id=f"scheduler-{instance_id}")
        self.producer = log_.transactional_producer(f"dagfold-scheduler-{instance_id}")
        self.timer_producer = log_.producer(f"scheduler-timer-{instance_id}")

    # -- partition ownership ----------------------------------------------------
    def store_path(self, partition: int) -> Path:
        return self.config.data_dir / "scheduler" / f"p{partition:04d}"

    def _on_assign(self, tps: list[TopicPartition]) -> None:
        for tp in tps:
            if tp.topic == COMMANDS and tp.partition not in self.stores:
                store = PartitionStore(self.store_path(tp.partition))
                n = catch_up(self.log, store, self.fold, tp.partition)
                log.info("partition %d restored (%d events applied)", tp.partition, n)
                self.stores[tp.partition] = store
                self._timer_floor.pop(tp.partition, None)  # its restored timers may be due long ago
        self.ready.set()

    def _on_revoke(self, tps: list[TopicPartition]) -> None:
        for tp in tps:
            store = self.stores.pop(tp.partition, None)
            self._timer_floor.pop(tp.partition, None)
            if store is not None:
                store.close()

    # -- main loop --------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.log.create_topics(self.config.core_topics())
        self.consumer.subscribe([COMMANDS], on_assign=self._on_assign, on_revoke=self._on_revoke)
        last_timer = last_lag = 0.0
        try:
            while not stop.is_set():
                recs = self.consumer.poll(self.config.scheduler.batch_max_records,
                                          self.config.scheduler.poll_timeout_s)
                if recs:
                    self.process_batch(recs)
                if time.monotonic() - last_timer >= 0.1:
                    self.fire_timers(now_ms())
                    last_timer = time.monotonic()
                if time.monotonic() - last_lag >= 5.0:
                    self.report_lag()
                    last_lag = time.monotonic()
        except FencedError:
            log.error("scheduler instance %s was fenced by a newer instance; stopping", self.instance_id)
            raise
        finally:
            self.close()

    def _fold_record(self, txn: PartitionTransaction, rec: LogRecord, now: int) -> list[Output]:
        try:
            cmd = self.codec.decode(rec.value)
        except CodecError as exc:
            return [dead_letter(rec, str(exc), "scheduler")]
        try:
            job_id = job_id_of(cmd)
        except KeyError:
            return [dead_letter(rec, f"{cmd['type']} is not a scheduler command", "scheduler")]
        if rec.key != job_id.encode():
            return [dead_letter(rec, f"record key {rec.key!r} is not the job ID {job_id!r}", "scheduler")]
        expected = partition_for(rec.key, self.config.partitions)
        if expected != rec.partition:
            return [dead_letter(rec, f"job {job_id} belongs to partition {expected}, not {rec.partition}",
                                "scheduler")]
        try:
            return self.fold.process(txn, cmd, now, rec.offset)
        except Exception as exc:  # a bug must not stop the partition: dead-letter the command
            log.exception("fold failed on %s/%d@%d", rec.topic, rec.partition, rec.offset)
            return [dead_letter(rec, f"fold error: {exc!r}", "scheduler")]

    def process_batch(self, recs: Sequence[LogRecord]) -> None:
        started = time.perf_counter()
        now = now_ms()
        txns: dict[int, PartitionTransaction] = {}
        offsets: dict[TopicPartition, int] = {}
        outputs: list[tuple[int, Output]] = []
        for rec in recs:
            store = self.stores.get(rec.partition)
            if store is None:
                continue
            txn = txns.get(rec.partition)
            if txn is None:
                txn = txns[rec.partition] = PartitionTransaction(store)
            outputs.extend((rec.partition, o) for o in self._fold_record(txn, rec, now))
            offsets[TopicPartition(COMMANDS, rec.partition)] = rec.offset + 1
        self._ensure_topics(o.topic for _, o in outputs)
        try:
            self.producer.begin()
            for p, o in outputs:
                self.producer.send(o.topic, o.key.encode(), self.codec.encode(o.record),
                                   partition=p if o.topic == EVENTS else None)
            last = self.producer.commit(offsets, self.consumer)
        except FencedError:
            raise
        except LogError:
            log.exception("transaction failed; rewinding to the committed offsets")
            self.producer.abort()
            self._rewind(list(txns))
            return
        for p, txn in txns.items():
            txn.commit(applied_events=last.get(TopicPartition(EVENTS, p)))
        self.folded += len(recs)
        metrics.observe_fold("scheduler", len(recs), time.perf_counter() - started)
        metrics.record_scheduler_events(o.record for _, o in outputs if o.topic == EVENTS)
        dead = sum(o.topic == DEADLETTER for _, o in outputs)
        if dead:
            metrics.DEAD_LETTERS.labels("scheduler").inc(dead)

    def report_lag(self) -> None:
        """Commands not yet folded on this instance's partitions (the consumer-lag metric)."""
        tps = [TopicPartition(COMMANDS, p) for p in self.stores]
        if not tps:
            return
        try:
            ends = self.log.end_offsets(tps)
            lag = sum(max(ends[tp] - self.consumer.position(tp), 0) for tp in tps)
        except LogError:
            return
        metrics.CONSUMER_LAG.labels("scheduler", COMMANDS).set(lag)

    def _rewind(self, partitions: list[int]) -> None:
        """After an aborted transaction, read the batch again from the committed offsets."""
        owned = set(self.consumer.assignment())
        tps = [tp for tp in (TopicPartition(COMMANDS, p) for p in partitions) if tp in owned]
        for tp, off in self.consumer.committed(tps).items():
            self.consumer.seek(tp, off)

    def _ensure_topics(self, topics: Iterable[str]) -> None:
        """Create dispatch topics on first use (queues are named by job specs)."""
        missing = set(topics) - self._known_topics
        for t in missing:
            if t.startswith(DISPATCH_PREFIX):
                self.log.create_topics([self.config.dispatch_spec(t[len(DISPATCH_PREFIX):])])
            self._known_topics.add(t)

    # -- timers -----------------------------------------------------------------
    def fire_timers(self, now: int) -> int:
        """Write a TimerFired command for every due timer (at-least-once; the fold drops stale ones)."""
        sent = 0
        full = now - self._full_scan_ms >= TIMER_FULL_SCAN_MS
        if full:
            self._full_scan_ms = now
        for p, store in list(self.stores.items()):
            earliest = now
            for k, cmd in due_timers(store, now, 0 if full else self._timer_floor.get(p, 0)):
                earliest = min(earliest, cmd["due_ms"])
                fired = self._fired.get(k)
                if fired is not None and now - fired < TIMER_REFIRE_MS:
                    continue
                self.timer_producer.send(COMMANDS, cmd["job_id"].encode(), self.codec.encode(cmd))
                self._fired[k] = now
                sent += 1
            self._timer_floor[p] = earliest - TIMER_SCAN_MARGIN_MS
        if sent:
            self.timer_producer.flush()
            metrics.TIMERS_FIRED.inc(sent)
        if len(self._fired) > 10_000:
            self._fired = {k: t for k, t in self._fired.items() if now - t < TIMER_REFIRE_MS}
        return sent

    def close(self) -> None:
        for store in self.stores.values():
            store.close()
        self.stores.clear()
        for c in (self.consumer, self.producer, self.timer_producer):
            try:
                c.close()
            except Exception:
                log.debug("close failed", exc_info=True)



def catch_up(log_: Log, store: PartitionStore, fold: SchedulerFold, partition: int) -> int:
    """Apply the events of ``partition`` after the store's applied offset; returns how many."""
    codec = default_codec()
    applied = 0
    tp = TopicPartition(EVENTS, partition)
    for recs in read_to_end(log_, tp, applied_events_offset(store) + 1):
        txn = PartitionTransaction(store)
        for r in recs:
            try:
                fold.apply(txn, codec.decode(r.value))
            except CodecError:
                log.error("undecodable event at %s/%d@%d skipped", r.topic, r.partition, r.offset)
        txn.commit(applied_events=recs[-1].offset)
        applied += len(recs)
    return applied
