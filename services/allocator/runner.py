"""The allocator service: the I/O loop around the allocator fold for one GPU pool.

One writer per pool: the pool's partition of ``allocator.commands`` is read by
one runner, whose transactional ID (``dagfold-allocator-<pool>``) fences an
older instance. Per round:

1. poll the partition; decode each command (undecodable ones, and commands of
   other pools hashed onto the same partition, are dead-lettered or skipped);
2. fold each command, then the timers now due (node leases, preemption grace,
   runtime limits, deferred passes);
3. produce the events (``allocator.events``, keyed by pool), control records
   (``control``, keyed by node) and scheduler commands (``commands``, keyed by
   job) in one log transaction that also commits the consumed offsets;
4. commit the state and the offset of the last event written, in one RocksDB
   batch (Restate's partition processor: state and applied offset together).

If the log transaction fails, the state transaction is dropped and the fold's
indexes are reloaded from the store. On start the store catches up from the
events it has not applied yet, so a crash between steps 3 and 4 loses nothing.

Timers are folded in the round rather than written to the log first: what they
decide is recorded as events, and replay applies events only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dagfold import metrics
from dagfold.codec import default_codec
from dagfold.config import ALLOCATOR_COMMANDS, ALLOCATOR_EVENTS, DEADLETTER
from dagfold.exceptions import CodecError, FencedError, LogError
from dagfold.log import Log, TopicPartition
from dagfold.log.reader import read_to_end
from dagfold.outputs import Output, dead_letter
from dagfold.state import MemoryStore, PartitionStore, PartitionTransaction, Store
from dagfold.state.store import applied_events_offset
from services.allocator.fold import AllocatorFold
from services.allocator.options import AllocatorOptions
from services.allocator.timers import due_timers

log = logging.getLogger("dagfold.allocator")
GROUP = "dagfold-allocator"


def store_path(data_dir: Path, pool: str) -> Path:
    return data_dir / "allocator" / pool


def catch_up(log_: Log, store: Store, opts: AllocatorOptions, tp: TopicPartition) -> int:
    """Apply the pool's events after the store's applied offset; returns how many."""
    codec = default_codec()
    fold = AllocatorFold(store, opts)
    applied = 0
    for recs in read_to_end(log_, tp, applied_events_offset(store) + 1):
        txn = PartitionTransaction(store)
        for r in recs:
            try:
                e = codec.decode(r.value)
            except CodecError:
                log.error("undecodable allocator event at %s/%d@%d skipped", r.topic, r.partition, r.offset)
                continue
            if e.get("pool") == opts.pool:
                fold.apply(txn, e)
                applied += 1
        txn.commit(applied_events=recs[-1].offset)
    return applied


class AllocatorRunner:
    """The allocator of one pool (see module docstring). ``data_dir`` None: in-memory state (tests)."""

    def __init__(self, log_: Log, opts: AllocatorOptions, data_dir: Path | None = None,
                 clock: Callable[[], float] = time.time, batch: int = 500) -> None:
        self.log = log_
        self.opts = opts
        self.clock = clock
        self.batch = batch
        self.codec = default_codec()
        n = log_.partitions(ALLOCATOR_COMMANDS)
        self.tp = TopicPartition(ALLOCATOR_COMMANDS, log_.partition_for(opts.pool.encode(), n))
        self.events_tp = TopicPartition(ALLOCATOR_EVENTS,
                                        log_.partition_for(opts.pool.encode(), log_.partitions(ALLOCATOR_EVENTS)))
        # the producer first: its initialisation fences an older instance of this pool
        self.producer = log_.transactional_producer(f"dagfold-allocator-{opts.pool}")
        self.store: Store = PartitionStore(store_path(data_dir, opts.pool)) if data_dir else MemoryStore()
        restored = catch_up(log_, self.store, opts, self.events_tp)
        if restored:
            log.info("pool %s restored (%d events applied)", opts.pool, restored)
        self.fold = AllocatorFold(self.store, opts)
        self.consumer = log_.consumer(GROUP, client_id=f"allocator-{opts.pool}")
        start = self.consumer.committed([self.tp]).get(self.tp, 0)
        self.consumer.assign({self.tp: start})
        self.folded = 0

    def _fold(self, txn: PartitionTransaction, now: int) -> tuple[list[Output], int | None]:
        recs = self.consumer.poll(self.batch, 0.0 if self.folded else 0.05)
        out: list[Output] = []
        for r in recs:
            try:
                cmd = self.codec.decode(r.value)
            except CodecError as exc:
                out.append(dead_letter(r, f"undecodable: {exc}", "allocator"))
                continue
            if cmd.get("pool") != self.opts.pool:
                continue  # another pool hashed onto this partition: its own allocator folds it
            try:
                out += self.fold.process(txn, cmd, now, r.offset)
            except Exception as exc:  # a poison command: its writes were rolled back
                log.exception("command at offset %s failed", r.offset)
                out.append(dead_letter(r, f"fold error: {exc!r}", "allocator"))
        for c in due_timers(self.fold, now):
            out += self.fold.process(txn, c, now, -1)
        return out, (recs[-1].offset + 1 if recs else None)

    def step(self, timeout_s: float = 0.05) -> int:
        """One round; returns the number of records produced."""
        now = int(self.clock() * 1000)
        txn = PartitionTransaction(self.store)
        out, next_offset = self._fold(txn, now)
        if next_offset is None and not out:
            time.sleep(timeout_s)
            return 0
        try:
            self.producer.begin()
            for o in out:
                part = self.events_tp.partition if o.topic == ALLOCATOR_EVENTS else None
                self.producer.send(o.topic, o.key.encode(), self.codec.encode(o.record), partition=part)
            offsets = {self.tp: next_offset} if next_offset is not None else {}
            last = self.producer.commit(offsets, self.consumer)
        except FencedError:
            raise
        except LogError:
            log.exception("allocator transaction failed; rewinding to the committed offset")
            self.producer.abort()
            self.fold.reload()
            self.consumer.assign({self.tp: self.consumer.committed([self.tp]).get(self.tp, 0)})
            return 0
        txn.commit(applied_events=last.get(self.events_tp))
        self.folded += 1
        dead = sum(o.topic == DEADLETTER for o in out)
        if dead:
            metrics.DEAD_LETTERS.labels("allocator").inc(dead)
        return len(out)

    def run(self, stop: threading.Event, idle_s: float = 0.05) -> None:
        try:
            while not stop.is_set():
                self.step(idle_s)
        except FencedError:
            log.error("allocator of pool %s was fenced by a newer instance; stopping", self.opts.pool)
            raise
        finally:
            self.close()

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
        self.store.close()
