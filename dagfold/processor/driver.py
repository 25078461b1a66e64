"""The virtual-time driver: the real partition processor over the in-memory log, stepped by hand.

Kafka Streams' ``TopologyTestDriver`` for dagfold: tests, property checks and the harnesses
(``services/scheduler/harness.py``, ``services/allocator/harness.py``) run the very runtime a
deployment runs (``PartitionProcessor``: admission, the fold in a state transaction, the log
transaction with the consumed offsets, the state commit, timers written through the log by the
runtime's ``TimerScanner``), with three things replaced:

* the log is a ``MemoryLog`` (``dagfold.log.memory``) whose record timestamps follow the driver;
* the clock is ``VirtualDriver.now_ms``, moved only by the caller (``advance`` or assignment);
* nothing happens on its own: ``step`` is one poll, fold and commit cycle with no wait, timers are
  scanned only when the driver is told to (``fire_timers``, ``advance``), at the virtual now.

So a run is a function of the commands sent and the clock moves: deterministic, replayable, and
what it exercises is the production cycle, not a copy of it. A command whose fold raises is
dead-lettered by the runtime as in production; the driver then re-raises the fold's exception to
its caller (``strict``, the default), so a bug does not hide in a dead letter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from dagfold.codec import Record, default_codec
from dagfold.config import DEADLETTER
from dagfold.exceptions import DagfoldError
from dagfold.log.base import Log, TopicPartition, TopicSpec
from dagfold.log.memory import MemoryLog
from dagfold.log.reader import read_to_end
from dagfold.outputs import Output
from dagfold.processor.fold import Fold
from dagfold.processor.processor import PartitionProcessor, ProcessorSpec
from dagfold.state import PartitionTransaction, Store


class DriverError(DagfoldError):
    """A command the driver sent was dead-lettered without its fold raising (strict drivers)."""


class _Watched:
    """A fold whose exceptions and outputs the driver sees (the runtime dead-letters the command)."""

    __slots__ = ("fold", "driver")

    def __init__(self, fold: Fold, driver: VirtualDriver) -> None:
        self.fold = fold
        self.driver = driver

    def process(self, txn: PartitionTransaction, command: Record, now_ms: int, offset: int) -> list[Output]:
        self.driver.commands += 1
        try:
            out = self.fold.process(txn, command, now_ms, offset)
        except Exception as exc:
            self.driver._errors.append(exc)
            raise
        self.driver._folded.extend(out)
        return out

    def apply(self, txn: PartitionTransaction, event: Record) -> None:
        self.fold.apply(txn, event)

    def reload(self) -> None:
        self.fold.reload()


class _Processor(PartitionProcessor):
    """The runtime with the driver's stores (``VirtualDriver``'s ``store_for``)."""

    def __init__(self, log_: Log, spec: ProcessorSpec, client_id: str,
                 store_for: Callable[[int], Store] | None) -> None:
        self._store_for = store_for
        super().__init__(log_, spec, client_id)

    def _open_store(self, partition: int) -> Store:
        return self._store_for(partition) if self._store_for is not None else super()._open_store(partition)


class VirtualDriver:
    """Runs one ``PartitionProcessor`` over a ``MemoryLog`` on a virtual clock (module docstring).

    ``spec``: the service's own configuration (``scheduler_spec``, ``allocator_spec``), or a function
    of the log that builds it (a spec that asks the log for partition counts); the driver keeps its
    fold, admission, topics, timers and output routing, and replaces its clock, its store paths
    (state in memory unless ``keep_store_path``), its poll wait (none) and its commit cadence:
    every poll commits, or with ``commit_every`` > 1 one transaction spans that many commands (the
    runner's batch), committed also before timers are scanned and on ``commit``. ``topics`` are
    created first. ``store_for(partition)``: the store a partition's state goes to (a store the caller
    inspects or sizes; default as the spec says).
    """

    def __init__(self, spec: ProcessorSpec | Callable[[Log], ProcessorSpec], *, now_ms: int = 1_000_000,
                 topics: Sequence[TopicSpec] = (), log: MemoryLog | None = None, client_id: str = "driver",
                 commit_every: int = 1, strict: bool = True, keep_store_path: bool = False,
                 store_for: Callable[[int], Store] | None = None) -> None:
        self.now_ms = now_ms
        self.strict = strict
        self.codec = default_codec()
        self.log = log if log is not None else MemoryLog(clock=self.clock)
        self.log.create_topics(topics)
        base = spec if isinstance(spec, ProcessorSpec) else spec(self.log)
        self.commands = 0  # commands the folds were given
        self._errors: list[Exception] = []
        self._folded: list[Output] = []  # what the folds produced since the last take
        self._dead: list[Output] = []
        self.dead_letters: list[Output] = []
        on_committed = base.on_committed

        def committed(outputs: Sequence[tuple[int, Output]]) -> None:
            self._dead.extend(o for _, o in outputs if o.topic == DEADLETTER)
            if on_committed is not None:
                on_committed(outputs)

        fold_for = base.fold_for

        def watched(partition: int, store: Store) -> Fold:
            return _Watched(fold_for(partition, store), self)

        self.spec = replace(
            base, clock=self.clock, fold_for=watched, on_committed=committed, poll_timeout_s=0.0,
            store_path=base.store_path if keep_store_path else None,
            batch_max_records=max(commit_every, 1), commit_interval_s=0.0 if commit_every <= 1 else math.inf)
        self.processor = _Processor(self.log, self.spec, client_id, store_for)
        self.processor.timer_interval_s = math.inf  # timers fire when the driver says, on its clock
        self.producer = self.log.producer(f"{client_id}-input")
        self.step()  # joins the group (or takes its partitions) and restores the stores

    def clock(self) -> int:
        return self.now_ms

    # -- input --------------------------------------------------------------------------
    def send(self, topic: str, key: str, record: Record, partition: int | None = None) -> None:
        """Write a record to the log, as an upstream producer would (folded by the next steps)."""
        self.producer.send(topic, key.encode(), self.codec.encode(record), partition)
        self.producer.flush()

    def process(self, topic: str, key: str, record: Record) -> list[Output]:
        """Send one record and run until the processor is idle; returns what the folds produced."""
        self.send(topic, key, record)
        return self.run()

    # -- stepping -----------------------------------------------------------------------
    def step(self) -> int:
        """One poll, fold and commit cycle, without waiting; returns the records polled."""
        n = self.processor.step(0.0)
        self._check()
        return n

    def run(self, max_steps: int = 1_000_000) -> list[Output]:
        """Step until a poll finds nothing; returns the folds' outputs since the last ``run``, in order."""
        for _ in range(max_steps):
            if not self.step() or not self._readable():
                break
        out, self._folded = self._folded, []
        return out

    def _readable(self) -> bool:
        """Whether a poll would find records (the end offsets past the consumers' positions): spares
        the empty poll that would otherwise end every ``run``."""
        p = self.processor
        positions = {tp: c.position(tp) for c in (p.consumer, p.inputs) if c is not None for tp in c.assignment()}
        return any(positions[tp] < end for tp, end in self.log.end_offsets(list(positions)).items())

    def commit(self) -> None:
        """Commit the open transaction (``commit_every`` > 1)."""
        self.processor.commit_now()
        self._check()

    def _check(self) -> None:
        if self._errors:
            errors, self._errors = self._errors, []
            self._dead.clear()
            raise errors[0]
        if self._dead:
            dead, self._dead = self._dead, []
            self.dead_letters.extend(dead)
            if self.strict:
                raise DriverError(f"dead-lettered: {[o.record.get('reason') for o in dead]}")

    # -- time ---------------------------------------------------------------------------
    def fire_timers(self, repeat: bool = False) -> list[Output]:
        """The runtime's timer scan at the virtual now (committed state: an open transaction is
        committed first); the timer commands it writes are folded. ``repeat``: scan again while
        folding them made more timers due. Returns the outputs."""
        out: list[Output] = []
        while True:
            self.commit()
            if not self.processor.fire_timers(self.now_ms):
                return out
            out += self.run()
            if not repeat:
                return out

    def next_timer_ms(self, until_ms: int) -> int | None:
        """Due time of the earliest timer in the owned partitions' indexes, if one is due by ``until_ms``."""
        policy = self.spec.timers
        if policy is None:
            return None
        self.commit()
        dues = [next(iter(policy.scan(store, until_ms, 0)), None) for store in self.processor.stores.values()]
        return min((int(cmd["due_ms"]) for d in dues if d is not None for cmd in (d[1],)), default=None)

    def advance(self, ms: int, in_due_order: bool = False) -> list[Output]:
        """Move the clock ``ms`` forward and fire what fell due. ``in_due_order``: stop at each
        timer's due time on the way, in order, so each is folded at its own time (else all are
        folded at the end time, with one scan). Returns the outputs."""
        end = self.now_ms + ms
        out: list[Output] = []
        if in_due_order:
            while (due := self.next_timer_ms(end)) is not None:
                self.now_ms = max(self.now_ms, due)
                fired = self.fire_timers(repeat=True)
                if not fired and self.next_timer_ms(end) == due:
                    break  # a timer its fold leaves in the index (refired after REFIRE_MS): on to the end
                out += fired
        self.now_ms = max(self.now_ms, end)
        return out + self.fire_timers(repeat=in_due_order)

    # -- inspection ---------------------------------------------------------------------
    def store(self, partition: int = 0) -> Store:
        return self.processor.stores[partition]

    def fold(self, partition: int = 0) -> Fold:
        """The service's fold of a partition (as its spec built it)."""
        f = self.processor.folds[partition]
        return f.fold if isinstance(f, _Watched) else f

    def read(self, topic: str, partitions: Iterable[int] | None = None) -> list[Record]:
        """The committed records of ``topic`` (every partition, or these), decoded, in offset order per partition."""
        ps = range(self.log.partitions(topic)) if partitions is None else partitions
        return [self.codec.decode(r.value) for p in ps
                for recs in read_to_end(self.log, TopicPartition(topic, p), strict=True) for r in recs]

    def close(self) -> None:
        self.processor.close()
        self.producer.close()


class DriverFacade:
    """What a harness over a ``VirtualDriver`` shares: the clock, partition 0's store, the command count."""

    driver: VirtualDriver

    @property
    def now_ms(self) -> int:
        return self.driver.now_ms

    @now_ms.setter
    def now_ms(self, value: int) -> None:
        self.driver.now_ms = value

    @property
    def store(self) -> Store:
        return self.driver.store(0)

    @property
    def offset(self) -> int:
        """Commands folded so far."""
        return self.driver.commands
