"""Virtual-time harnesses of the allocator: the production runtime for tests, the bare fold for simulators.

* ``AllocatorHarness``: the allocator as it runs in production, over an in-memory log and a fake
  clock; a facade over ``dagfold.processor.driver.VirtualDriver`` running the real
  ``PartitionProcessor`` configured by ``allocator_spec`` (the fold in its state transaction, the log
  transaction, the state commit, timers written through the log by the runtime's scanner from the
  store's due-time index). ``advance`` fires what falls due on the way, in due order. Tests and
  property checks drive it command by command.
* ``SimAllocator``: the same fold driven directly over a ``MemoryStore``, its timers popped from the
  fold's in-memory heap (``due_timers``; a property test holds the heap equal to the store's index,
  tests/test_allocator_props.py). For the simulators and the allocator CPU benchmarks only: they fold
  100k+ decisions per run and report the fold's own decision latency (p50 0.4 ms on the FGD protocol),
  which the runtime's cost per command through a log (about 0.5-1 ms in Python: encoding, the log
  transaction, the consumer) would swamp and multiply (figures: docs/benchmarks.md, the driver).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dagfold.codec import Record
from dagfold.config import ALLOCATOR_COMMANDS, ALLOCATOR_EVENTS, SCHEDULER_INTERNAL, Config
from dagfold.outputs import Output
from dagfold.processor.driver import DriverFacade, VirtualDriver
from dagfold.services.allocator import commands as cmds
from dagfold.services.allocator.fold import AllocatorFold
from dagfold.services.allocator.keys import request_key
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.runner import allocator_spec
from dagfold.services.allocator.timers import due_timers
from dagfold.state import MemoryStore, PartitionTransaction
from dagfold.state.store import state_digest


class _PoolCommands:
    """Commands and inspection shared by both harnesses (``process``, ``fold`` and the lists are theirs)."""

    opts: AllocatorOptions
    now_ms: int
    events: list[Record]
    controls: list[Record]
    scheduler_commands: list[Record]  # TaskAllocation for the scheduler
    keep_events: bool

    @property
    def fold(self) -> AllocatorFold:
        raise NotImplementedError

    @property
    def pool(self) -> str:
        return self.opts.pool

    def process(self, cmd: Record) -> list[Output]:
        raise NotImplementedError

    def _sort(self, out: Sequence[Output]) -> None:
        if not self.keep_events:
            return
        for o in out:
            if o.topic == ALLOCATOR_EVENTS:
                self.events.append(o.record)
            elif o.topic == SCHEDULER_INTERNAL:
                self.scheduler_commands.append(o.record)
            else:
                self.controls.append(o.record)

    def _replayed(self, events: Sequence[Record]) -> str:
        store = MemoryStore()
        fold = AllocatorFold(store, self.opts)
        txn = PartitionTransaction(store)
        for e in events:
            fold.apply(txn, e)
        txn.commit()
        return state_digest(store)

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
        return self.fold.state.alloc_of_req.get(request_key(job_id, task_id, attempt))


class AllocatorHarness(DriverFacade, _PoolCommands):
    """The allocator of one pool on a ``VirtualDriver`` (module docstring). ``commit_every``: commands
    per transaction (the runner's batch); ``keep_events`` False keeps no lists (the log has them)."""

    def __init__(self, opts: AllocatorOptions | None = None, now_ms: int = 1_000_000, keep_events: bool = True,
                 commit_every: int = 1) -> None:
        self.opts = opts or AllocatorOptions()
        self.keep_events = keep_events
        self.events = []
        self.controls = []
        self.scheduler_commands = []
        config = Config(partitions=1, allocator_partitions=1, dispatch_partitions=1)
        self.driver = VirtualDriver(lambda log: allocator_spec(log, self.opts, None), now_ms=now_ms,
                                    topics=config.core_topics(), client_id=f"allocator-{self.opts.pool}",
                                    commit_every=commit_every)

    @property
    def fold(self) -> AllocatorFold:
        fold = self.driver.fold()
        assert isinstance(fold, AllocatorFold)
        return fold

    def process(self, cmd: Record) -> list[Output]:
        """Write one command to the pool's partition and run the allocator until it is idle."""
        out = self.driver.process(ALLOCATOR_COMMANDS, str(cmd.get("pool", self.pool)), cmd)
        self._sort(out)
        return out

    def commit(self) -> None:
        self.driver.commit()

    def fire_due(self) -> int:
        """Let the runtime fire every timer due now (and those their folding made due); returns how many."""
        before = self.offset
        self._sort(self.driver.fire_timers(repeat=True))
        return self.offset - before

    def advance(self, ms: int) -> int:
        """Move the clock, firing every timer that falls due on the way, in due order."""
        before = self.offset
        self._sort(self.driver.advance(ms, in_due_order=True))
        return self.offset - before

    def digest(self) -> str:
        self.commit()
        return state_digest(self.store)

    def replayed_digest(self) -> str:
        """Digest of a fresh store built by applying the pool's events as the log holds them."""
        self.commit()
        return self._replayed([e for e in self.driver.read(ALLOCATOR_EVENTS) if e.get("pool") == self.pool])


class SimAllocator(_PoolCommands):
    """The allocator fold driven directly, without the runtime (simulators and CPU benchmarks: module
    docstring). ``advance`` fires due timers from the fold's heap, in due order."""

    def __init__(self, opts: AllocatorOptions | None = None, now_ms: int = 1_000_000, keep_events: bool = True,
                 commit_every: int = 1) -> None:
        self.opts = opts or AllocatorOptions()
        self.now_ms = now_ms
        self.keep_events = keep_events
        self.commit_every = commit_every
        self.events = []
        self.controls = []
        self.scheduler_commands = []
        self.offset = 0
        self.store = MemoryStore()
        self._fold = AllocatorFold(self.store, self.opts)
        self.txn = PartitionTransaction(self.store)
        self._pending = 0

    @property
    def fold(self) -> AllocatorFold:
        return self._fold

    def process(self, cmd: Record) -> list[Output]:
        out = self._fold.process(self.txn, cmd, self.now_ms, self.offset)
        self.offset += 1
        self._pending += 1
        if self._pending >= self.commit_every:
            self.commit()
        self._sort(out)
        return out

    def commit(self) -> None:
        if self._pending:
            self.txn.commit(applied_events=self.offset)
            self._fold.state.unbind()  # the committed transaction is freed here, not in the next command
            self.txn = PartitionTransaction(self.store)
            self._pending = 0

    def fire_due(self) -> int:
        n = 0
        while True:
            fired = due_timers(self._fold, self.now_ms)
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
            nxt = self._fold.state.next_timer_ms()
            if nxt is None or nxt > end:
                break
            self.now_ms = max(self.now_ms, nxt)
            n += self.fire_due()
        self.now_ms = end
        return n + self.fire_due()

    def digest(self) -> str:
        self.commit()
        return state_digest(self.store)

    def replayed_digest(self) -> str:
        """Digest of a fresh store built by applying this harness's events only."""
        return self._replayed(self.events)
