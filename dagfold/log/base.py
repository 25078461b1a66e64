"""The log contract both backends implement.

Semantics follow Kafka, so code written against this contract behaves the same
on both backends:

* A topic has a fixed number of partitions; a record's partition is
  ``partition_for(key, n)`` (CRC-32 of the key, the same as librdkafka's default
  ``consistent_random`` partitioner, so upstream producers using plain
  confluent-kafka land on the same partition as dagfold's own writers).
* Offsets are per partition, increasing; consumers see only committed records
  (read_committed). Offsets may have gaps (Kafka's transaction markers).
* A committed consumer offset is the *next* offset to read.
* ``TransactionalProducer.commit`` makes the produced records and the consumed
  offsets visible atomically, or neither. A newer producer with the same
  transactional id fences the older one (``FencedError``).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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


def partition_for(key: bytes, partitions: int) -> int:
    """Partition of a keyed record: CRC-32(key) mod n, as librdkafka's default partitioner."""
    return (zlib.crc32(key) & 0xFFFFFFFF) % partitions


AssignCallback = Callable[[list[TopicPartition]], None]


class Producer(Protocol):
    """Buffered, idempotent, at-least-once producer (workers, API, timers)."""

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None:
        """Queue a record; ``partition`` defaults to ``partition_for(key, n)``."""

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until every queued record is durably written, or raise LogError."""

    def close(self) -> None: ...


class TransactionalProducer(Protocol):
    """Producer whose records and consumed offsets commit atomically (single writers)."""

    def begin(self) -> None: ...

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None: ...

    def commit(
        self, offsets: Mapping[TopicPartition, int], consumer: Consumer | None
    ) -> dict[TopicPartition, int]:
        """Commit records sent since ``begin`` with the consumer group's ``offsets``.

        Returns, for each partition written in this transaction, the offset of
        the last record written there (used as the applied-events offset).
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


class Log(Protocol):
    """A partitioned, durable log."""

    url: str

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

    def close(self) -> None: ...
