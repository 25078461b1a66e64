"""A minimal I/O loop around the allocator fold for one pool (tests, demos, the lead's integration).

Per round: poll the pool's partition of ``allocator.commands``, fold each
command (undecodable ones are skipped and logged here; the production runner
dead-letters them), fold the timers now due, then produce the events (to
``allocator.events``, keyed by pool) and control records (to ``control``, keyed
by node) in one log transaction that also commits the consumed offsets, and
commit the state. If the log transaction fails, the state transaction is
dropped and the fold's indexes are reloaded from the store.

Timers are folded directly in the round rather than written to the log first:
what they decide is recorded as events, and replay applies events only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dagfold.codec import default_codec
from dagfold.exceptions import CodecError, LogError
from dagfold.log import Log, TopicPartition, partition_for
from dagfold.state import MemoryStore, PartitionTransaction, Store
from services.allocator.ctx import ALLOCATOR_COMMANDS, Output
from services.allocator.fold import AllocatorFold
from services.allocator.options import AllocatorOptions
from services.allocator.timers import due_timers

log = logging.getLogger("dagfold.allocator")
GROUP = "dagfold-allocator"


class AllocatorRunner:
    def __init__(self, log_: Log, opts: AllocatorOptions, store: Store | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.log = log_
        self.opts = opts
        self.store = store or MemoryStore()
        self.fold = AllocatorFold(self.store, opts)
        self.codec = default_codec()
        self.clock = clock
        self.tp = TopicPartition(ALLOCATOR_COMMANDS,
                                 partition_for(opts.pool.encode(), log_.partitions(ALLOCATOR_COMMANDS)))
        self.consumer = log_.consumer(GROUP, client_id=f"allocator-{opts.pool}")
        start = self.consumer.committed([self.tp]).get(self.tp, 0)
        self.consumer.assign({self.tp: start})
        self.producer = log_.transactional_producer(f"dagfold-allocator-{opts.pool}")
        self.folded = 0

    def step(self, timeout_s: float = 0.05) -> int:
        now = int(self.clock() * 1000)
        recs = self.consumer.poll(500, timeout_s)
        txn = PartitionTransaction(self.store)
        out: list[Output] = []
        for r in recs:
            try:
                cmd = self.codec.decode(r.value)
            except CodecError as exc:
                log.error("skipping undecodable record at %s: %s", r.offset, exc)
                continue
            try:
                out += self.fold.process(txn, cmd, now, r.offset)
            except Exception:  # a poison command: its writes were rolled back
                log.exception("command at offset %s failed", r.offset)
        for c in due_timers(self.fold, now):
            out += self.fold.process(txn, c, now, -1)
        if not recs and not out:
            return 0
        try:
            self.producer.begin()
            for o in out:
                self.producer.send(o.topic, o.key.encode(), self.codec.encode(o.record))
            offsets = {self.tp: recs[-1].offset + 1} if recs else {}
            self.producer.commit(offsets, self.consumer)
        except LogError:
            self.producer.abort()
            self.fold.reload()
            raise
        txn.commit()
        self.folded += len(recs)
        return len(out)

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
