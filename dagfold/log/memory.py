"""In-memory log: the test backend (never a deployment's).

The embedded log's semantics (``dagfold.log.embedded``: its group coordinator, consumers,
queue groups and producers are reused as they are) with its storage in Python lists and
dicts instead of RocksDB: nothing touches the disk, a record costs a list append, and the
record timestamps come from an injectable clock. It is what the virtual-time driver
(``dagfold.processor.driver``) runs the real partition processor over, and it passes the
log contract (tests/test_log_contract.py) like the two production backends.

A transaction is one append under the log's lock, records and group offsets together, so
both become visible at once or not at all (read_committed); transactional ids carry epochs
that fence older producers, as in the embedded log.

The data lives in a ``MemoryBroker``; ``reopen`` gives a new client of the same broker (what a
restarted process sees of a broker that kept running).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from dagfold.clock import now_ms
from dagfold.exceptions import LogError
from dagfold.log.base import DEFAULT_PARTITIONER, LogRecord, TopicPartition, TopicSpec, partitioner_named
from dagfold.log.embedded import EmbeddedLog, _Group, _QueueGroup


@dataclass
class MemoryBroker:
    """What a memory log holds, shared by every client (``MemoryLog.reopen``)."""

    partitioner: str = DEFAULT_PARTITIONER
    topics: dict[str, TopicSpec] = field(default_factory=dict)
    records: dict[TopicPartition, list[LogRecord]] = field(default_factory=dict)
    hwm: dict[TopicPartition, int] = field(default_factory=dict)
    offsets: dict[tuple[str, TopicPartition], int] = field(default_factory=dict)  # group offsets
    queues: dict[tuple[str, TopicPartition], bytes] = field(default_factory=dict)  # queue groups' done state
    epochs: dict[str, int] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)


class MemoryLog(EmbeddedLog):
    """The in-memory backend (module docstring). ``clock`` stamps the records (ms since the epoch)."""

    def __init__(self, partitioner: str | None = None, clock: Callable[[], int] = now_ms,
                 broker: MemoryBroker | None = None) -> None:
        if broker is None:
            broker = MemoryBroker(partitioner or DEFAULT_PARTITIONER)
        elif partitioner is not None and partitioner != broker.partitioner:
            raise LogError(f"the memory log partitions with {broker.partitioner}, not {partitioner}")
        self.url = "memory"
        self.read_only = False
        self.broker = broker
        self.clock = clock
        self._lock = broker.lock
        self._cond = threading.Condition(self._lock)
        self._topics = broker.topics
        self._hwm = broker.hwm
        self._epochs = broker.epochs
        self._groups: dict[str, _Group] = {}
        self._queues: dict[str, _QueueGroup] = {}
        self._closed = False
        self.partitioner = broker.partitioner
        self.partition_for = partitioner_named(self.partitioner)

    def reopen(self) -> MemoryLog:
        """A new client of the same broker (this one is closed)."""
        self.close()
        return MemoryLog(clock=self.clock, broker=self.broker)

    def _store_topic(self, spec: TopicSpec) -> None:
        for p in range(spec.partitions):
            self.broker.records[TopicPartition(spec.name, p)] = []

    def _now_ms(self) -> int:
        return self.clock()

    def _store(self, written: Sequence[LogRecord], offsets: Mapping[TopicPartition, int], group: str | None) -> None:
        stored = self.broker.records
        for rec in written:
            stored[TopicPartition(rec.topic, rec.partition)].append(rec)
        for tp, off in offsets.items():
            self.broker.offsets[(group or "", tp)] = off

    def read(self, tp: TopicPartition, offset: int, max_records: int) -> list[LogRecord]:
        log = self.broker.records.get(tp)
        if log is None or offset >= len(log):
            return []
        return log[offset : offset + max_records]

    def committed(self, group: str, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        with self._lock:
            return {tp: self.broker.offsets.get((group, tp), 0) for tp in tps}

    def _load_queue(self, group: str, tp: TopicPartition) -> bytes | None:
        return self.broker.queues.get((group, tp))

    def _save_queues(self, group: str, states: Mapping[TopicPartition, bytes]) -> None:
        for tp, state in states.items():
            self.broker.queues[(group, tp)] = state

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
