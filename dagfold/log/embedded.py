"""Embedded durable log: Kafka's contract on one machine, no broker.

All topics live in one RocksDB (rocksdict, raw mode) under ``path``:

* ``r|topic|P(4)|O(8)`` -> ``ts_ms(8) keylen(4) key value`` (the records)
* ``t|topic`` -> partition count and retention (the topic catalogue)
* ``g|group|topic|P(4)`` -> next offset (consumer group offsets)
* ``s|topic|P(4)`` -> the partition's start offset once retention dropped records (Kafka's log start offset)
* ``mpartitioner`` -> the partitioner's name (a log written before this key existed used
  CRC-32, ``consistent_random``, and keeps it; a new log records murmur2 or the one asked for)

A transaction is one RocksDB ``WriteBatch`` holding its records and the
consumer offsets it commits, so both become visible together or not at all,
and survive a kill -9 (RocksDB's write-ahead log). RocksDB's lock file lets only
one process open a data folder, which fences a second ``dagfold up`` on it;
inside the process, transactional ids carry epochs that fence older producers.

Consumers in one group share partitions through an in-process coordinator
(round-robin by member, rebalanced when members join or leave or topics appear).

Queue groups (``queue_consumer``, Kafka's share groups) keep, per group and
partition, which records are done, locked to a member, or available again
(``_Queue``); only the done part is durable:

* ``q|group|topic|P(4)`` -> ``start(8)`` + the done offsets above it (8 bytes each)

so after a restart every record that was not accepted or rejected is available
again (locks and delivery counts live in memory: a kill -9 of the process ends
every member anyway).

Retention (``TopicSpec.retention_ms``, -1 keeps everything): ``enforce_retention`` drops, per partition, the
records older than their topic's retention, oldest first (a binary search on the records' timestamps, then one
range delete), and records the partition's new start; the high watermark stays where it is, so offsets are never
reused. A writer runs it every ``retention_check_s`` (Kafka's ``log.retention.check.interval.ms``, 5 minutes).
Like Kafka's, it works on time, not on what readers have read: a consumer behind the start reads on from the
first record kept, a queue group archives the offsets that are gone.
"""

from __future__ import annotations

import heapq
import itertools
import struct
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import cast

from rocksdict import Rdict, ReadOptions, WriteBatch

from dagfold import rocks
from dagfold.clock import now_ms
from dagfold.exceptions import FencedError, LogError
from dagfold.log.base import (
    DEFAULT_PARTITIONER,
    Ack,
    AssignCallback,
    Consumer,
    LogRecord,
    QueuedRecord,
    TopicPartition,
    TopicSpec,
    partitioner_named,
)

_SEP = b"\x00"
_PO = struct.Struct(">IQ")
_HDR = struct.Struct(">QI")
_TOPIC = struct.Struct(">Iq")
_OFF = struct.Struct(">Q")
_PARTITIONER_KEY = b"mpartitioner"


def _rkey(topic: str, partition: int, offset: int) -> bytes:
    return b"r" + topic.encode() + _SEP + _PO.pack(partition, offset)


def _gkey(group: str, tp: TopicPartition) -> bytes:
    return b"g" + group.encode() + _SEP + tp.topic.encode() + _SEP + struct.pack(">I", tp.partition)


def _skey(tp: TopicPartition) -> bytes:
    return b"s" + tp.topic.encode() + _SEP + struct.pack(">I", tp.partition)


def _qkey(group: str, tp: TopicPartition) -> bytes:
    return b"q" + group.encode() + _SEP + tp.topic.encode() + _SEP + struct.pack(">I", tp.partition)


def _items(db: Rdict, start: bytes, end: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
    """Raw-mode iteration over [start, end); keys and values are bytes in raw mode.

    The bound goes to RocksDB: without it, finding where a range stops reads the first record
    past it, value included, and the record after a partition's last one may be a job spec of
    tens of MiB (a JobAccepted on ``events``), copied on every poll of a caught-up consumer.
    """
    if end is None:
        yield from cast(Iterator[tuple[bytes, bytes]], iter(db.items(from_key=start)))
        return
    opts = ReadOptions()  # must outlive the iterator (RocksDB keeps a pointer to the bound): a generator
    opts.set_iterate_upper_bound(end)
    yield from cast(Iterator[tuple[bytes, bytes]], iter(db.items(from_key=start, read_opt=opts)))


TAIL_RECORDS = 4096  # per partition, the newest records kept in memory for caught-up consumers
TAIL_BYTES = 4 << 20  # and at most this many value bytes of them
TAIL_RECORD_MAX = 256 << 10  # a record larger than this is read from RocksDB (a job spec)
# Records dropped from a tail's front are let go in bulk, once they pass 1/TAIL_SLACK of TAIL_RECORDS (a list's
# prefix deleted: about 4,096 pointers moved per 256 appends). At 1 (the bound itself) a busy partition's tail swung
# between 4,096 and 8,192 records (about 1.3-2.6 MB), and the 20 or so busy ones together rose and fell by tens of
# MB over thousands of jobs: the residual growth of tests/test_soak.py (issue 25).
TAIL_SLACK = 16


class _Tail:
    """The newest records of one partition, in memory: what consumers that keep up ask for.

    Reading them from RocksDB meant a new iterator and a seek per partition and poll, whose
    cost grows with the memtables and level-0 files a write-heavy run piles up (at 1M tasks a
    worker spent most of its time there). Records are appended in offset order after their
    batch is written, so the tail is always a contiguous run ending at the high watermark.
    """

    __slots__ = ("base", "records", "nbytes", "head")

    def __init__(self, base: int) -> None:
        self.base = base  # offset of records[head]
        self.records: list[LogRecord] = []
        self.head = 0  # records before it are dropped (compacted away in bulk, not one by one)
        self.nbytes = 0

    def append(self, rec: LogRecord) -> None:
        if len(rec.value or b"") > TAIL_RECORD_MAX:
            self.records, self.head, self.nbytes, self.base = [], 0, 0, rec.offset + 1
            return
        if not self.records or self.head == len(self.records):
            self.records, self.head, self.base = [], 0, rec.offset
        self.records.append(rec)
        self.nbytes += len(rec.value or b"")
        while len(self.records) - self.head > TAIL_RECORDS or self.nbytes > TAIL_BYTES:
            self.nbytes -= len(self.records[self.head].value or b"")
            self.head += 1
            self.base += 1
        if self.head * TAIL_SLACK > TAIL_RECORDS:
            del self.records[: self.head]
            self.head = 0

    def read(self, offset: int, max_records: int) -> list[LogRecord] | None:
        """Records from ``offset`` on, or None if the tail does not reach back that far."""
        if offset < self.base or self.head == len(self.records):
            return None
        i = self.head + offset - self.base
        return self.records[i : i + max_records]


class EmbeddedLog:
    """The embedded backend (see module docstring)."""

    def __init__(self, path: Path, read_only: bool = False, partitioner: str | None = None,
                 retention_check_s: float = 300.0) -> None:
        """``read_only`` opens a snapshot next to a running writer (audits, replay); it cannot append.

        ``retention_check_s``: how often a writer drops the records its topics' retention no longer keeps
        (``enforce_retention``); 0 never (tests call it).

        ``partitioner`` (a PARTITIONERS name) is fixed when the log is created; None takes the
        recorded one, and asking an existing log for another is an error (it would move jobs).
        """
        self.url = "embedded"
        self.path = path
        self.read_only = read_only
        try:
            if read_only and not path.exists():
                raise LogError(f"no embedded log at {path}")
            self._db = rocks.open_db(path, read_only)  # the process's RocksDB memory budget
        except Exception as exc:
            raise LogError(f"cannot open embedded log at {path} (is another dagfold using it?): {exc}") from exc
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._topics: dict[str, TopicSpec] = {}
        self._hwm: dict[TopicPartition, int] = {}
        self._tails: dict[TopicPartition, _Tail] = {}
        self._epochs: dict[str, int] = {}
        self._groups: dict[str, _Group] = {}
        self._queues: dict[str, _QueueGroup] = {}
        self._closed = False
        self._load_catalogue()
        self.partitioner = self._load_partitioner(partitioner)
        self.partition_for = partitioner_named(self.partitioner)
        self._stop_retention = threading.Event()
        if not read_only and retention_check_s > 0:
            threading.Thread(target=self._retention_loop, args=(retention_check_s,), daemon=True,
                             name="embedded-log-retention").start()

    def _load_partitioner(self, wanted: str | None) -> str:
        if wanted is not None:
            partitioner_named(wanted)  # unknown names fail before anything is written
        raw = self._db.get(_PARTITIONER_KEY)
        recorded = raw.decode() if raw is not None else ("consistent_random" if self._topics else None)
        if recorded is None:  # a new log
            recorded = wanted or DEFAULT_PARTITIONER
        elif wanted is not None and wanted != recorded:
            raise LogError(f"the embedded log at {self.path} partitions with {recorded}, not {wanted}: "
                           "its jobs live on the partitions that partitioner chose")
        if raw is None and not self.read_only:
            self._db.put(_PARTITIONER_KEY, recorded.encode())
        return recorded

    # -- catalogue -------------------------------------------------------
    def _load_catalogue(self) -> None:
        for k, v in _items(self._db, b"t"):
            if not k.startswith(b"t"):
                break
            name = k[1:].decode()
            n, retention = _TOPIC.unpack(v)
            self._topics[name] = TopicSpec(name, n, retention)
            for p in range(n):
                self._hwm[TopicPartition(name, p)] = self._scan_hwm(name, p)

    def _scan_hwm(self, topic: str, partition: int) -> int:
        it = self._db.iter()
        it.seek_for_prev(_rkey(topic, partition, 2**64 - 1))
        prefix = b"r" + topic.encode() + _SEP + struct.pack(">I", partition)
        if it.valid() and it.key().startswith(prefix):
            return int(_OFF.unpack(it.key()[-8:])[0]) + 1
        return self.start_offset(TopicPartition(topic, partition))  # every record dropped by retention

    def start_offset(self, tp: TopicPartition) -> int:
        """The partition's first offset still kept (0 until retention dropped records)."""
        raw = self._db.get(_skey(tp))
        return int(_OFF.unpack(raw)[0]) if raw is not None else 0

    # -- retention -------------------------------------------------------
    def _retention_loop(self, every_s: float) -> None:
        while not self._stop_retention.wait(every_s):
            try:
                self.enforce_retention()
            except LogError:
                return  # closed meanwhile

    def _ts(self, tp: TopicPartition, offset: int) -> int:
        v = self._db.get(_rkey(tp.topic, tp.partition, offset))
        if v is None:
            raise LogError(f"{tp} has no record at {offset}")
        return int(_HDR.unpack_from(v)[0])

    def enforce_retention(self, now: int | None = None) -> dict[TopicPartition, int]:
        """Drop the records older than their topic's retention; the new start of every partition that moved.

        O(log n) reads and one range delete per partition: the records of a partition are appended in
        timestamp order, so those to drop are a prefix of it."""
        now = now_ms() if now is None else now
        moved: dict[TopicPartition, int] = {}
        with self._lock:
            if self._closed or self.read_only:
                return moved
            for spec in list(self._topics.values()):
                if spec.retention_ms < 0:
                    continue
                cutoff = now - spec.retention_ms
                for p in range(spec.partitions):
                    tp = TopicPartition(spec.name, p)
                    lo, hi = self.start_offset(tp), self._hwm.get(tp, 0)
                    if lo >= hi or self._ts(tp, lo) >= cutoff:
                        continue
                    a, b = lo, hi  # the first offset in [lo, hi) kept: ts >= cutoff (hi: none is)
                    while a < b:
                        mid = (a + b) // 2
                        if self._ts(tp, mid) >= cutoff:
                            b = mid
                        else:
                            a = mid + 1
                    wb = WriteBatch(raw_mode=True)
                    wb.delete_range(_rkey(tp.topic, p, lo), _rkey(tp.topic, p, a))
                    wb.put(_skey(tp), _OFF.pack(a))
                    try:
                        self._db.write(wb)
                    except Exception as exc:
                        raise LogError(f"cannot apply retention to the embedded log: {exc}") from exc
                    tail = self._tails.get(tp)
                    if tail is not None and tail.base < a:
                        del self._tails[tp]  # it held dropped records: read from RocksDB until the next append
                    moved[tp] = a
        return moved

    def create_topics(self, specs: Sequence[TopicSpec]) -> None:
        with self._lock:
            if self.read_only:
                if missing := [s.name for s in specs if s.name not in self._topics]:
                    raise LogError(f"read-only log has no topics {missing}")
                return
            created = False
            for s in specs:
                if s.name in self._topics:
                    continue
                if s.partitions < 1:
                    raise LogError(f"topic {s.name}: partitions must be >= 1")
                self._store_topic(s)
                self._topics[s.name] = s
                for p in range(s.partitions):
                    self._hwm[TopicPartition(s.name, p)] = 0
                created = True
            if created:
                for g in self._groups.values():
                    g.bump()
                self._cond.notify_all()

    def _store_topic(self, spec: TopicSpec) -> None:
        """Keep a new topic where this backend keeps its records (the memory log overrides it)."""
        self._db.put(b"t" + spec.name.encode(), _TOPIC.pack(spec.partitions, spec.retention_ms))

    def topics(self) -> list[str]:
        with self._lock:
            return sorted(self._topics)

    def partitions(self, topic: str) -> int:
        spec = self._topics.get(topic)
        if spec is None:
            raise LogError(f"topic {topic!r} does not exist")
        return spec.partitions

    def end_offsets(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        with self._lock:
            return {tp: self._hwm.get(tp, 0) for tp in tps}

    # -- writing ---------------------------------------------------------
    def _resolve_partition(self, topic: str, key: bytes, partition: int | None) -> int:
        n = self.partitions(topic)
        if partition is None:
            return self.partition_for(key, n)
        if not 0 <= partition < n:
            raise LogError(f"topic {topic!r} has no partition {partition}")
        return partition

    def _append_batch(
        self,
        records: Sequence[tuple[str, int, bytes, bytes]],
        offsets: Mapping[TopicPartition, int] | None = None,
        group: str | None = None,
        fence: tuple[str, int] | None = None,
    ) -> dict[TopicPartition, int]:
        """Write records (+ group offsets) in one atomic batch; returns last offsets written."""
        with self._lock:
            if self._closed:
                raise LogError("log is closed")
            if self.read_only:
                raise LogError("the log is open read-only")
            if fence is not None and self._epochs.get(fence[0]) != fence[1]:
                raise FencedError(f"transactional id {fence[0]!r} was taken over by a newer instance")
            if offsets and group is None:
                raise LogError("offsets committed without a consumer group")
            ts = self._now_ms()
            last: dict[TopicPartition, int] = {}
            next_off: dict[TopicPartition, int] = {}
            written: list[LogRecord] = []
            for topic, partition, key, value in records:
                tp = TopicPartition(topic, partition)
                off = next_off.get(tp, self._hwm[tp])
                written.append(LogRecord(topic, partition, off, key, value, ts))
                next_off[tp] = off + 1
                last[tp] = off
            self._store(written, offsets or {}, group)
            self._hwm.update(next_off)
            if next_off:
                self._cond.notify_all()
            return last

    def _now_ms(self) -> int:
        """The records' timestamp (the memory log's is injectable)."""
        return now_ms()

    def _store(self, written: Sequence[LogRecord], offsets: Mapping[TopicPartition, int], group: str | None) -> None:
        """Store one batch atomically: its records (offsets assigned) and the group's offsets."""
        wb = WriteBatch(raw_mode=True)
        for rec in written:
            key = rec.key or b""
            wb.put(_rkey(rec.topic, rec.partition, rec.offset),
                   _HDR.pack(rec.timestamp_ms, len(key)) + key + (rec.value or b""))
        for tp, off in offsets.items():
            wb.put(_gkey(group or "", tp), _OFF.pack(off))
        if not wb.is_empty():
            try:
                self._db.write(wb)
            except Exception as exc:  # RocksDB reports I/O failures (ENOSPC among them) as plain Exception
                raise LogError(f"cannot write the embedded log: {exc}") from exc
        for rec in written:
            tp = TopicPartition(rec.topic, rec.partition)
            tail = self._tails.get(tp)
            if tail is None:
                tail = self._tails[tp] = _Tail(rec.offset)
            tail.append(rec)

    def producer(self, client_id: str) -> EmbeddedProducer:
        return EmbeddedProducer(self)

    def transactional_producer(self, transactional_id: str) -> EmbeddedTransactionalProducer:
        with self._lock:
            epoch = self._epochs.get(transactional_id, 0) + 1
            self._epochs[transactional_id] = epoch
        return EmbeddedTransactionalProducer(self, transactional_id, epoch)

    # -- reading ---------------------------------------------------------
    def read(self, tp: TopicPartition, offset: int, max_records: int) -> list[LogRecord]:
        """Records of one partition from ``offset`` (committed ones only)."""
        end = self._hwm.get(tp, 0)
        if offset >= end:
            return []
        tail = self._tails.get(tp)
        if tail is not None:
            with self._lock:  # appends move the tail's window: read it whole
                cached = tail.read(offset, max_records)
            if cached is not None:
                return cached
        out: list[LogRecord] = []
        prefix = b"r" + tp.topic.encode() + _SEP + struct.pack(">I", tp.partition)
        for k, v in _items(self._db, _rkey(tp.topic, tp.partition, offset), _rkey(tp.topic, tp.partition, end)):
            if not k.startswith(prefix):
                break
            off = int(_OFF.unpack(k[-8:])[0])
            if off >= end:
                break
            ts, klen = _HDR.unpack_from(v)
            key = v[12 : 12 + klen]
            out.append(LogRecord(tp.topic, tp.partition, off, key, v[12 + klen :], ts))
            if len(out) >= max_records:
                break
        return out

    def wait(self, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait(timeout_s)

    def consumer(self, group_id: str | None, client_id: str = "dagfold") -> EmbeddedConsumer:
        group = None
        if group_id is not None:
            with self._lock:
                group = self._groups.setdefault(group_id, _Group(self, group_id))
        return EmbeddedConsumer(self, group, client_id)

    def queue_consumer(self, group_id: str, client_id: str = "dagfold", *, max_records: int = 64,
                       lock_ms: int = 30_000, max_deliveries: int = 5) -> EmbeddedQueueConsumer:
        if max_records < 1 or lock_ms < 1 or max_deliveries < 1:
            raise LogError("max_records, lock_ms and max_deliveries must be >= 1")
        with self._lock:
            group = self._queues.get(group_id)
            if group is None:
                group = self._queues[group_id] = _QueueGroup(self, group_id)
            group.lock_ms, group.max_deliveries = lock_ms, max_deliveries
        return EmbeddedQueueConsumer(self, group, max_records)

    def committed(self, group: str, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        out = {}
        for tp in tps:
            v = self._db.get(_gkey(group, tp))
            out[tp] = int(_OFF.unpack(v)[0]) if v is not None else 0
        return out

    def commit_offsets(self, group: str, offsets: Mapping[TopicPartition, int]) -> None:
        self._append_batch([], offsets, group)

    def _load_queue(self, group: str, tp: TopicPartition) -> bytes | None:
        """The stored done state of a queue group's partition (``_Queue.encode``), or None."""
        v = self._db.get(_qkey(group, tp))
        return None if v is None else bytes(v)

    def _save_queues(self, group: str, states: Mapping[TopicPartition, bytes]) -> None:
        wb = WriteBatch(raw_mode=True)
        for tp, state in states.items():
            wb.put(_qkey(group, tp), state)
        self._db.write(wb)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop_retention.set()
            self._cond.notify_all()
            self._db.close()


class _Group:
    """In-process group coordinator: round-robin assignment over members."""

    _ids = itertools.count()

    def __init__(self, log: EmbeddedLog, name: str) -> None:
        self.log = log
        self.name = name
        self.members: dict[int, tuple[str, ...]] = {}
        self.generation = 0

    def bump(self) -> None:
        self.generation += 1

    def join(self, topics: Sequence[str]) -> int:
        member = next(self._ids)
        self.members[member] = tuple(topics)
        self.bump()
        return member

    def leave(self, member: int) -> None:
        if self.members.pop(member, None) is not None:
            self.bump()

    def assignment(self, member: int) -> list[TopicPartition]:
        topics = sorted({t for ts in self.members.values() for t in ts})
        members = sorted(self.members)
        out = []
        for topic in topics:
            spec = self.log._topics.get(topic)
            if spec is None:
                continue
            subscribers = [m for m in members if topic in self.members[m]]
            for p in range(spec.partitions):
                if subscribers[p % len(subscribers)] == member:
                    out.append(TopicPartition(topic, p))
        return out


class EmbeddedConsumer:
    def __init__(self, log: EmbeddedLog, group: _Group | None, client_id: str) -> None:
        self._log = log
        self._group = group
        self._member: int | None = None
        self._generation = -1
        self._positions: dict[TopicPartition, int] = {}
        self._on_assign: AssignCallback | None = None
        self._on_revoke: AssignCallback | None = None
        self._rr = 0

    def subscribe(
        self,
        topics: Sequence[str],
        on_assign: AssignCallback | None = None,
        on_revoke: AssignCallback | None = None,
    ) -> None:
        if self._group is None:
            raise LogError("subscribe needs a consumer group")
        self._on_assign, self._on_revoke = on_assign, on_revoke
        with self._log._lock:
            if self._member is not None:
                self._group.leave(self._member)
            self._member = self._group.join(topics)

    def assign(self, positions: Mapping[TopicPartition, int]) -> None:
        self._positions = dict(positions)

    def assignment(self) -> list[TopicPartition]:
        return sorted(self._positions)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._positions[tp] = offset

    def position(self, tp: TopicPartition) -> int:
        return self._positions.get(tp, 0)

    def _rebalance(self) -> None:
        group, member = self._group, self._member
        if group is None or member is None or group.generation == self._generation:
            return
        with self._log._lock:
            self._generation = group.generation
            new = group.assignment(member)
        old = set(self._positions)
        revoked = sorted(old - set(new))
        added = [tp for tp in new if tp not in old]
        if revoked and self._on_revoke:
            self._on_revoke(revoked)
        for tp in revoked:
            del self._positions[tp]
        if added:
            self._positions.update(self._log.committed(group.name, added))
            if self._on_assign:
                self._on_assign(added)

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[LogRecord]:
        deadline = time.monotonic() + timeout_s
        while True:
            self._rebalance()
            out = self._read(max_records)
            if out:
                return out
            left = deadline - time.monotonic()
            if left <= 0 or self._log._closed:
                return []
            self._log.wait(min(left, 0.05))

    def _read(self, max_records: int) -> list[LogRecord]:
        tps = sorted(self._positions)
        if not tps:
            return []
        out: list[LogRecord] = []
        self._rr = (self._rr + 1) % len(tps)
        for tp in tps[self._rr :] + tps[: self._rr]:
            recs = self._log.read(tp, self._positions[tp], max_records - len(out))
            if recs:
                self._positions[tp] = recs[-1].offset + 1
                out.extend(recs)
            if len(out) >= max_records:
                break
        return out

    def commit(self, offsets: Mapping[TopicPartition, int], wait: bool = True) -> None:
        """A local write: done at once either way, ``wait`` has nothing to wait for."""
        if self._group is None:
            raise LogError("commit needs a consumer group")
        self._log.commit_offsets(self._group.name, offsets)

    def committed(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        if self._group is None:
            raise LogError("committed needs a consumer group")
        return self._log.committed(self._group.name, tps)

    @property
    def group_id(self) -> str | None:
        return self._group.name if self._group else None

    def close(self) -> None:
        if self._group is not None and self._member is not None:
            with self._log._lock:
                self._group.leave(self._member)
            self._member = None


class _Queue:
    """Queue state of one partition in one queue group (the embedded share partition).

    ``start``: every offset below it is done; ``done``: done offsets above it (accepted,
    rejected or archived); ``fresh``: the lowest offset never acquired; ``locks``: offset ->
    (member, deadline); ``available``: a heap of offsets released or expired, to hand out
    before fresh ones; ``deliveries``: acquisitions of offsets not done; ``expiry``: a heap of
    (deadline, offset) to find the locks that ran out without scanning them all.
    """

    __slots__ = ("start", "fresh", "done", "locks", "available", "deliveries", "expiry")

    def __init__(self, start: int, done: set[int]) -> None:
        self.start = start
        self.fresh = start
        self.done = done
        self.locks: dict[int, tuple[int, float]] = {}
        self.available: list[int] = []
        self.deliveries: dict[int, int] = {}
        self.expiry: list[tuple[float, int]] = []

    def encode(self) -> bytes:
        return _OFF.pack(self.start) + b"".join(_OFF.pack(o) for o in sorted(self.done))

    @classmethod
    def decode(cls, v: bytes | None) -> _Queue:
        if v is None:
            return cls(0, set())
        offs = [int(_OFF.unpack_from(v, i)[0]) for i in range(0, len(v), 8)]
        return cls(offs[0], set(offs[1:]))

    def finish(self, off: int) -> None:
        """Accepted, rejected or archived: never handed out again."""
        self.locks.pop(off, None)
        self.deliveries.pop(off, None)
        self.done.add(off)
        while self.start in self.done:
            self.done.discard(self.start)
            self.start += 1

    def give_back(self, off: int, max_deliveries: int) -> None:
        """Released, expired or left behind by a member: available again, or archived at the limit."""
        self.locks.pop(off, None)
        if self.deliveries.get(off, 0) >= max_deliveries:
            self.finish(off)
        else:
            heapq.heappush(self.available, off)

    def expire(self, now: float, max_deliveries: int) -> None:
        while self.expiry and self.expiry[0][0] <= now:
            deadline, off = heapq.heappop(self.expiry)
            lock = self.locks.get(off)
            if lock is not None and lock[1] == deadline:
                self.give_back(off, max_deliveries)

    def take(self, end: int) -> int | None:
        """The lowest offset that may be acquired now, or None."""
        while self.available:
            off = heapq.heappop(self.available)
            if off >= self.start and off not in self.done and off not in self.locks:
                return off
        while self.fresh < end:
            off = self.fresh
            self.fresh += 1
            if off >= self.start and off not in self.done:
                return off
        return None


class _QueueGroup:
    """A queue group of the embedded log: members acquire records of any partition, round-robin."""

    _ids = itertools.count()

    def __init__(self, log: EmbeddedLog, name: str) -> None:
        self.log = log
        self.name = name
        self.lock_ms = 30_000
        self.max_deliveries = 5
        self.members: dict[int, tuple[str, ...]] = {}
        self.queues: dict[TopicPartition, _Queue] = {}
        self.turn = 0  # partition to start the next acquisition at (fairness across partitions)

    def queue(self, tp: TopicPartition) -> _Queue:
        q = self.queues.get(tp)
        if q is None:
            q = self.queues[tp] = _Queue.decode(self.log._load_queue(self.name, tp))
        return q

    def acquire(self, member: int, max_records: int) -> list[QueuedRecord]:
        """Up to ``max_records`` records for ``member``, one partition after another in turn.

        Round-robin across partitions, a record at a time, is the queue's fairness: records
        keyed by tenant land on the tenant's partition, so one tenant's backlog delays another
        tenant's records by at most one record per turn, not by the backlog's length.
        """
        log = self.log
        tps = sorted(TopicPartition(t, p) for t in self.members.get(member, ())
                     for p in range(log._topics[t].partitions if t in log._topics else 0))
        if not tps:
            return []
        now = time.monotonic()
        deadline = now + self.lock_ms / 1000
        self.turn = (self.turn + 1) % len(tps)
        order = tps[self.turn:] + tps[: self.turn]
        out: list[QueuedRecord] = []
        while len(out) < max_records and order:
            still = []
            for tp in order:
                q = self.queue(tp)
                q.expire(now, self.max_deliveries)
                off = q.take(log._hwm.get(tp, 0))
                if off is None:
                    continue
                recs = log.read(tp, off, 1)
                if not recs:  # cannot happen below the high watermark; hand it out later
                    heapq.heappush(q.available, off)
                    continue
                if recs[0].offset != off:  # dropped by retention: archived, as Kafka's share groups do
                    for gone in range(off, recs[0].offset):
                        q.finish(gone)
                    q.fresh = max(q.fresh, recs[0].offset)
                    still.append(tp)
                    continue
                n = q.deliveries[off] = q.deliveries.get(off, 0) + 1
                q.locks[off] = (member, deadline)
                heapq.heappush(q.expiry, (deadline, off))
                r = recs[0]
                out.append(QueuedRecord(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp_ms, n))
                still.append(tp)
                if len(out) >= max_records:
                    break
            order = still
        return out

    def settle(self, member: int, acks: Sequence[tuple[TopicPartition, int, Ack]]) -> None:
        """Apply acknowledgements of ``member`` (those of records it no longer holds are void),
        then store the done state of the partitions they touched in one write."""
        touched: set[TopicPartition] = set()
        for tp, off, ack in acks:
            q = self.queue(tp)
            lock = q.locks.get(off)
            if lock is None or lock[0] != member:
                continue  # the lock ran out and the record is another member's (or available) now
            if ack is Ack.RELEASE:
                q.give_back(off, self.max_deliveries)
            else:
                q.finish(off)
            touched.add(tp)
        self.store(touched)

    def store(self, tps: set[TopicPartition]) -> None:
        if not tps:
            return
        self.log._save_queues(self.name, {tp: self.queues[tp].encode() for tp in tps})
        self.log._cond.notify_all()

    def leave(self, member: int) -> None:
        """A member leaves (or dies): the records it holds are available again."""
        self.members.pop(member, None)
        touched: set[TopicPartition] = set()
        for tp, q in self.queues.items():
            mine = [off for off, (m, _) in q.locks.items() if m == member]
            for off in mine:
                q.give_back(off, self.max_deliveries)
                touched.add(tp)
        self.store(touched)


class EmbeddedQueueConsumer:
    """A member of an embedded queue group (see ``QueueConsumer`` in ``dagfold.log.base``)."""

    def __init__(self, log: EmbeddedLog, group: _QueueGroup, max_records: int) -> None:
        self._log = log
        self._group = group
        self._max = max_records
        self._member: int | None = None
        self._held: set[tuple[TopicPartition, int]] = set()  # acquired by the last poll, not yet acknowledged
        self._acks: list[tuple[TopicPartition, int, Ack]] = []

    def subscribe(self, topics: Sequence[str]) -> None:
        with self._log._lock:
            if self._member is None:
                self._member = next(_QueueGroup._ids)
            self._group.members[self._member] = tuple(topics)

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[QueuedRecord]:
        if self._member is None:
            raise LogError("poll before subscribe")
        if self._held:
            raise LogError(f"{len(self._held)} record(s) of the previous poll are not acknowledged")
        if self._acks:
            self.commit()
        deadline = time.monotonic() + timeout_s
        while True:
            with self._log._lock:
                if self._log._closed:
                    return []
                out = self._group.acquire(self._member, min(max_records or self._max, self._max))
            if out:
                self._held = {(TopicPartition(r.topic, r.partition), r.offset) for r in out}
                return out
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            self._log.wait(min(left, 0.05))

    def acknowledge(self, record: QueuedRecord, ack: Ack = Ack.ACCEPT) -> None:
        key = (TopicPartition(record.topic, record.partition), record.offset)
        if key not in self._held:
            raise LogError(f"{record.topic}[{record.partition}]@{record.offset} is not held by this consumer")
        self._held.discard(key)
        self._acks.append((key[0], key[1], ack))

    def commit(self, wait: bool = True) -> None:
        """A local write: done at once either way."""
        acks, self._acks = self._acks, []
        if acks and self._member is not None:
            with self._log._lock:
                if not self._log._closed:
                    self._group.settle(self._member, acks)

    def close(self) -> None:
        if self._member is None:
            return
        with self._log._lock:
            if not self._log._closed:
                if self._acks:
                    self._group.settle(self._member, self._acks)
                self._group.leave(self._member)
        self._acks = []
        self._held = set()
        self._member = None


class EmbeddedProducer:
    """Writes each flush as one batch; ``send`` only buffers."""

    def __init__(self, log: EmbeddedLog) -> None:
        self._log = log
        self._buf: list[tuple[str, int, bytes, bytes]] = []
        self._lock = threading.Lock()

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None:
        p = self._log._resolve_partition(topic, key, partition)
        with self._lock:
            self._buf.append((topic, p, key, value))

    def flush(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            buf, self._buf = self._buf, []
        if buf:
            self._log._append_batch(buf)

    def close(self) -> None:
        self.flush()


class EmbeddedTransactionalProducer:
    def __init__(self, log: EmbeddedLog, transactional_id: str, epoch: int) -> None:
        self._log = log
        self._tid = transactional_id
        self._epoch = epoch
        self._buf: list[tuple[str, int, bytes, bytes]] | None = None

    def begin(self) -> None:
        if self._buf is not None:
            raise LogError("transaction already open")
        self._buf = []

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None, report: bool = True) -> None:
        if self._buf is None:
            raise LogError("send outside a transaction")
        self._buf.append((topic, self._log._resolve_partition(topic, key, partition), key, value))

    def commit(
        self, offsets: Mapping[TopicPartition, int], consumer: Consumer | None = None
    ) -> dict[TopicPartition, int]:
        if self._buf is None:
            raise LogError("commit without begin")
        buf, self._buf = self._buf, None
        if consumer is not None and not isinstance(consumer, EmbeddedConsumer):
            raise LogError("an embedded transaction needs an embedded consumer")
        group = consumer.group_id if consumer is not None else None
        return self._log._append_batch(buf, offsets, group, fence=(self._tid, self._epoch))

    def abort(self) -> None:
        self._buf = None

    def close(self) -> None:
        self._buf = None
