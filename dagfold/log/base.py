"""The log contract both backends implement.

Semantics follow Kafka, so code written against this contract behaves the same
on both backends:

* A topic has a fixed number of partitions; a record's partition is
  ``log.partition_for(key, n)``: by default ``murmur2_partition`` (the Java
  client's default partitioner, and librdkafka's ``murmur2_random``), so Java,
  Kafka Streams, Connect and Python producers with default settings land on the
  same partition as dagfold's own writers. Deployments whose data was written
  before dagfold 0.x used CRC-32 (librdkafka's ``consistent_random``) and keep it
  with ``?partitioner=consistent_random`` in the log URL (docs/architecture.md).
* Offsets are per partition, increasing; consumers see only committed records
  (read_committed). Offsets may have gaps (Kafka's transaction markers).
* A committed consumer offset is the *next* offset to read.
* ``TransactionalProducer.commit`` makes the produced records and the consumed
  offsets visible atomically, or neither. A newer producer with the same
  transactional id fences the older one (``FencedError``).

Queues (``Log.queue_consumer``; Kafka's share groups, KIP-932) are the second way to
read a topic, for work that any free member may take:

* A member *acquires* records: each is locked to it for the group's ``lock_ms``
  and handed to no other member meanwhile. Every member may acquire from every
  partition (the embedded log always; Kafka when the share group's assignor shares
  the partition with the member, which it does for every member of a one-partition
  topic, and for about members/partitions members of each partition otherwise).
* The member then acknowledges each record: ``ACCEPT`` (done, never delivered again),
  ``RELEASE`` (available again at once, to any member) or ``REJECT`` (unprocessable,
  never delivered again). A lock that runs out, or a member that leaves or dies
  holding records, makes them available again too.
* ``QueuedRecord.delivery_count`` counts the acquisitions of a record, this one
  included; a record acquired ``max_deliveries`` times without being accepted or
  rejected is archived (never delivered again).
* A new queue group starts at the beginning of the topic and reads committed
  records only; records are handed out lowest offset first within a partition
  (a released or expired record before newer ones), with no order across partitions.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

# The largest record dagfold writes: a SubmitJob of Limits.max_spec_bytes (64 MiB) with its framing.
# Kafka's default is 1 MiB; topics that carry job specs are created with this limit.
MAX_RECORD_BYTES = 72 * 1024 * 1024


@dataclass(frozen=True, slots=True, order=True)
class TopicPartition:
    topic: str
    partition: int


@dataclass(frozen=True, slots=True)
class TopicSpec:
    """How dagfold creates a topic."""

    name: str
    partitions: int
    retention_ms: int = -1  # -1 keeps everything (the events topic is the audit log)
    replication: int = 1
    min_insync_replicas: int | None = None
    max_message_bytes: int | None = None  # None: the broker's default (1 MiB on Kafka)


@dataclass(frozen=True, slots=True)
class LogRecord:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int
    # the record's headers as its producer wrote them (Kafka only: dagfold's own writers and the
    # embedded log carry none); read-only, for what an upstream producer may say only there (its
    # W3C ``traceparent``: ``dagfold.tracing.traceparent_of``)
    headers: tuple[tuple[str, bytes], ...] = field(default=(), kw_only=True)


@dataclass(frozen=True, slots=True)
class QueuedRecord(LogRecord):
    """A record acquired from a queue; ``delivery_count`` counts its acquisitions, this one included."""

    delivery_count: int


class Ack(Enum):
    """How a member acknowledges a record it acquired from a queue (KIP-932's AcknowledgeType)."""

    ACCEPT = "accept"  # processed: never delivered again
    RELEASE = "release"  # given back: available again at once, to any member
    REJECT = "reject"  # unprocessable: never delivered again


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (``org.apache.kafka.common.utils.Utils.murmur2``) as a signed 32-bit int.

    Written by hand: it is twenty lines, every Kafka client carries its own copy, and the one
    Python package with it (kafka-python) is a whole client. Checked against the Java client's
    published test vectors and against librdkafka's ``murmur2_random`` on a real broker
    (tests/test_partitioning.py).
    """
    m = 0x5BD1E995
    n = len(data)
    h = (0x9747B28C ^ n) & 0xFFFFFFFF
    end = n & ~3
    for k in struct.unpack_from(f"<{end >> 2}I", data):  # the 4-byte little-endian words
        k = (k * m) & 0xFFFFFFFF
        k = ((k ^ (k >> 24)) * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    rest = n & 3
    if rest == 3:
        h ^= data[end + 2] << 16
    if rest >= 2:
        h ^= data[end + 1] << 8
    if rest >= 1:
        h ^= data[end]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - 0x1_0000_0000 if h & 0x8000_0000 else h


# Job IDs repeat (every command of a job): hash each once. The hot keys are the jobs in flight; at 65,536 the cache
# (about 190 B a job) grew with every job of a process for its first 65,536 (issue 25, tests/test_soak.py).
@functools.lru_cache(maxsize=1 << 12)
def murmur2_partition(key: bytes, partitions: int) -> int:
    """The Java client's default: ``toPositive(murmur2(key)) % n``, where toPositive clears the
    sign bit (``& 0x7fffffff``, not ``abs``); librdkafka's ``murmur2_random`` does the same."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def crc32_partition(key: bytes, partitions: int) -> int:
    """librdkafka's ``consistent_random``: CRC-32(key) mod n (dagfold's partitioner before murmur2)."""
    return (zlib.crc32(key) & 0xFFFFFFFF) % partitions


Partitioner = Callable[[bytes, int], int]

# Names as librdkafka's ``partitioner`` setting spells them; the value of ``?partitioner=`` in a log URL.
PARTITIONERS: dict[str, Partitioner] = {
    "murmur2_random": murmur2_partition,
    "consistent_random": crc32_partition,
}
DEFAULT_PARTITIONER = "murmur2_random"


def partition_for(key: bytes, partitions: int) -> int:
    """Partition of a keyed record under the default partitioner (murmur2, as the Java client).

    Code holding a ``Log`` asks ``log.partition_for``, which honours the deployment's choice.
    """
    return murmur2_partition(key, partitions)


def partitioner_named(name: str) -> Partitioner:
    try:
        return PARTITIONERS[name]
    except KeyError:
        raise ValueError(f"unknown partitioner {name!r}: use one of {sorted(PARTITIONERS)}") from None


AssignCallback = Callable[[list[TopicPartition]], None]


class Producer(Protocol):
    """Buffered, idempotent, at-least-once producer (workers, API, timers)."""

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None:
        """Queue a record; ``partition`` defaults to ``log.partition_for(key, n)``."""

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until every queued record is durably written, or raise LogError."""

    def close(self) -> None: ...


class TransactionalProducer(Protocol):
    """Producer whose records and consumed offsets commit atomically (single writers)."""

    def begin(self) -> None: ...

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None, report: bool = True) -> None:
        """Add a record to the open transaction. ``report=False``: the caller needs no offset of this
        record (a backend may then skip its delivery report: on Kafka one Python callback per record)."""

    def commit(
        self, offsets: Mapping[TopicPartition, int], consumer: Consumer | None
    ) -> dict[TopicPartition, int]:
        """Commit records sent since ``begin`` with the consumer group's ``offsets``.

        Returns, for each partition written in this transaction with a reported record
        (``send(report=True)``), the offset of the last record written there (used as the
        applied-events offset): a caller that needs a partition's offset reports at least the last
        record it sends there (a backend may return more partitions than that).
        Raises FencedError if a newer instance took over the transactional id.
        """

    def abort(self) -> None: ...

    def close(self) -> None: ...


class Consumer(Protocol):
    """A consumer, in a group (``subscribe``) or with manual assignment (``assign``)."""

    def subscribe(
        self,
        topics: Sequence[str],
        on_assign: AssignCallback | None = None,
        on_revoke: AssignCallback | None = None,
    ) -> None:
        """Join the group; partitions are shared among the group's members.

        ``on_assign``/``on_revoke`` are called from inside ``poll``.
        """

    def assign(self, positions: Mapping[TopicPartition, int]) -> None:
        """Read exactly these partitions from these offsets (no group rebalancing)."""

    def assignment(self) -> list[TopicPartition]: ...

    def seek(self, tp: TopicPartition, offset: int) -> None: ...

    def position(self, tp: TopicPartition) -> int:
        """Next offset this consumer will read from ``tp``; past transaction markers on Kafka,
        so ``position >= end_offsets`` means the partition was read to its end."""

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[LogRecord]:
        """Up to ``max_records`` committed records, waiting at most ``timeout_s``."""

    def commit(self, offsets: Mapping[TopicPartition, int], wait: bool = True) -> None:
        """Store the group's next offsets (non-transactional consumers).

        ``wait=False`` returns before the log confirms: for consumers whose effects are
        durable already and fenced on redelivery (workers), so the next poll is not
        held up by a round trip. A failed commit then only means a redelivery.
        """

    def committed(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        """The group's committed next offsets; 0 where none."""

    def close(self) -> None: ...


class QueueConsumer(Protocol):
    """A member of a queue group: records of its topics go to whichever member acquires them first.

    Not thread-safe (as Kafka's share consumer): one thread polls and acknowledges.
    """

    def subscribe(self, topics: Sequence[str]) -> None:
        """Join the queue group for these topics."""

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[QueuedRecord]:
        """Acquire available records (up to ``max_records``, default the consumer's), waiting at
        most ``timeout_s``. Kafka takes the consumer's ``max_records`` as a hint (the broker
        acquires whole producer batches) and cannot lower it per poll. Every record of the
        previous poll must have been acknowledged first (``LogError`` otherwise)."""

    def acknowledge(self, record: QueuedRecord, ack: Ack = Ack.ACCEPT) -> None:
        """Mark one acquired record; sent to the log by ``commit`` (or the next ``poll``)."""

    def commit(self, wait: bool = True) -> None:
        """Send the acknowledgements marked so far; ``wait`` until the log has them. A record
        whose lock ran out before its acknowledgement arrived may have gone to another member."""

    def close(self) -> None:
        """Send pending acknowledgements and leave; records still acquired become available."""


class Log(Protocol):
    """A partitioned, durable log."""

    url: str
    partitioner: str  # a PARTITIONERS name

    def partition_for(self, key: bytes, partitions: int) -> int:
        """Partition of a keyed record in this deployment (its partitioner)."""

    def create_topics(self, specs: Sequence[TopicSpec]) -> None:
        """Create missing topics; existing ones are left as they are."""

    def partitions(self, topic: str) -> int:
        """Partition count of a topic (LogError if it does not exist)."""

    def end_offsets(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        """Next offset that will be written to each partition (high watermark)."""

    def producer(self, client_id: str) -> Producer: ...

    def transactional_producer(self, transactional_id: str) -> TransactionalProducer: ...

    def consumer(self, group_id: str | None, client_id: str = "dagfold") -> Consumer:
        """A read_committed consumer; ``group_id`` None means assign-only, no commits."""

    def queue_consumer(self, group_id: str, client_id: str = "dagfold", *, max_records: int = 64,
                       lock_ms: int = 30_000, max_deliveries: int = 5) -> QueueConsumer:
        """A member of queue group ``group_id`` (Kafka: a share group). ``lock_ms`` and
        ``max_deliveries`` are settings of the group (the newest member's values hold)."""

    def close(self) -> None: ...
