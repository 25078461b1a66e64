"""Virtual-time harness: the allocator fold over a MemoryStore with a fake clock.

The same fold as in production with the log replaced by lists. ``advance``
fires due timers through the fold as the live timer does through the log.
Tests, property checks and the simulator drive it command by command.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dagfold.codec import Record
from dagfold.config import ALLOCATOR_EVENTS, SCHEDULER_INTERNAL
from dagfold.outputs import Output
from dagfold.services.allocator import commands as cmds
from dagfold.services.allocator.fold import AllocatorFold
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.timers import due_timers
from dagfold.state import MemoryStore, PartitionTransaction
from dagfold.state.store import state_digest


@dataclass
class AllocatorHarness:
    opts: AllocatorOptions = field(default_factory=AllocatorOptions)
    now_ms: int = 1_000_000
    store: MemoryStore = field(default_factory=MemoryStore)
    keep_events: bool = True
    commit_every: int = 1  # commands per transaction (the runner's batch)
    events: list[Record] = field(default_factory=list)
    controls: list[Record] = field(default_factory=list)
    scheduler_commands: list[Record] = field(default_factory=list)  # TaskAllocation for the scheduler
    offset: int = 0

    def __post_init__(self) -> None:
        self.fold = AllocatorFold(self.store, self.opts)
        self.txn = PartitionTransaction(self.store)
        self._pending = 0

    @property
    def pool(self) -> str:
        return self.opts.pool

    def process(self, cmd: Record) -> list[Output]:
        out = self.fold.process(self.txn, cmd, self.now_ms, self.offset)
        self.offset += 1
        self._pending += 1
        if self._pending >= self.commit_every:
            self.commit()
        for o in out:
            if o.topic == ALLOCATOR_EVENTS:
                if self.keep_events:
                    self.events.append(o.record)
            elif not self.keep_events:
                continue
            elif o.topic == SCHEDULER_INTERNAL:
                self.scheduler_commands.append(o.record)
            else:
                self.controls.append(o.record)
        return out

    def commit(self) -> None:
        if self._pending:
            self.txn.commit(applied_events=self.offset)
            self.fold.state.unbind()  # the committed transaction is freed here, not in the next command
            self.txn = PartitionTransaction(self.store)
            self._pending = 0

    def fire_due(self) -> int:
        n = 0
        while True:
            fired = due_timers(self.fold, self.now_ms)
            if not fired:
                return n
            for c in fired:
                self.process(c)
                n += 1

    def advance(self, ms: int) -> int:
        """Move the clock, firing every timer that falls due on the way, in due order."""
        end = self.now_ms + ms
        n = 0
        while True:
            nxt = self.fold.state.next_timer_ms()
            if nxt is None or nxt > end:
                break
            self.now_ms = max(self.now_ms, nxt)
            n += self.fire_due()
        self.now_ms = end
        return n + self.fire_due()

    # -- commands ---------------------------------------------------------------------------
    def register(self, node_id: str, gpu_type: str = "H100", gpus: int = 8, **kw: Any) -> list[Output]:
        return self.process(cmds.register_node(self.pool, node_id, gpu_type, gpus, ts_ms=self.now_ms, **kw))

    def heartbeat(self, node_id: str, **kw: Any) -> list[Output]:
        return self.process(cmds.node_heartbeat(self.pool, node_id, ts_ms=self.now_ms, **kw))

    def request(self, job_id: str, **kw: Any) -> list[Output]:
        kw.setdefault("submitted_ms", self.now_ms)
        return self.process(cmds.request_allocation(self.pool, job_id, **kw))

    def release(self, alloc_id: str, reason: str = "completed", **kw: Any) -> list[Output]:
        a = self.fold.state.allocs[alloc_id]
        return self.process(cmds.release_allocation(self.pool, alloc_id, a.epoch, a.parts[0].node, reason,
                                                    ts_ms=self.now_ms, **kw))

    def cancel(self, job_id: str, task_id: str | None = None) -> list[Output]:
        return self.process(cmds.cancel_request(self.pool, job_id, task_id, ts_ms=self.now_ms))

    # -- inspection -------------------------------------------------------------------------
    def of_type(self, name: str) -> list[Record]:
        return [e for e in self.events if e["type"].endswith("." + name)]

    def alloc_of(self, job_id: str, task_id: str = "gpu", attempt: int = 1) -> str | None:
        from dagfold.services.allocator.keys import request_key

        return self.fold.state.alloc_of_req.get(request_key(job_id, task_id, attempt))

    def digest(self) -> str:
        self.commit()
        return state_digest(self.store)

    def replayed_digest(self) -> str:
        """Digest of a fresh store built by applying this harness's events only."""
        store = MemoryStore()
        fold = AllocatorFold(store, self.opts)
        txn = PartitionTransaction(store)
        for e in self.events:
            fold.apply(txn, e)
        txn.commit()
        return state_digest(store)
