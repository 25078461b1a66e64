"""Topic namespaces: several dagfold deployments (or dagfold and anything else) on one cluster.

dagfold's code names topics by their *logical* names (``commands``, ``events``,
``dispatch.<queue>``, ... in ``dagfold.config``); the fold emits them, replay digests
and dead letters carry them. A deployment with a prefix (``kafka://host:9092?prefix=prod.dagfold``
or ``DAGFOLD_TOPIC_PREFIX``) reads and writes ``prod.dagfold.commands`` etc. on the
cluster: ``NamespacedLog`` maps every name at the log boundary, in both directions, and
prefixes consumer groups and transactional ids the same way, so two deployments never
share a group's partitions or fence each other's producers. Mapping at the boundary,
not at each of the many call sites, means no code path can forget the prefix, and the
folds stay independent of where they are deployed.

Without a prefix no wrapper is put in place (``namespaced`` returns the log itself).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from dagfold.exceptions import LogError
from dagfold.log.base import (
    Ack,
    AssignCallback,
    Consumer,
    Log,
    LogRecord,
    Producer,
    QueueConsumer,
    QueuedRecord,
    TopicPartition,
    TopicSpec,
    TransactionalProducer,
)

# Kafka's legal topic characters; a prefix must leave room for the longest dagfold name.
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._-]{1,120}$")


@dataclass(frozen=True, slots=True)
class Namespace:
    """The one mapping from logical names to the names on the cluster: ``<prefix>.<name>``."""

    prefix: str = ""

    def __post_init__(self) -> None:
        if self.prefix and (not _PREFIX_RE.match(self.prefix) or self.prefix.endswith(".")):
            raise LogError(f"bad topic prefix {self.prefix!r}: use letters, digits, '.', '_', '-' "
                           "(up to 120, not ending in '.')")

    def topic(self, logical: str) -> str:
        return f"{self.prefix}.{logical}" if self.prefix else logical

    def logical(self, physical: str) -> str:
        head = self.prefix + "."
        if self.prefix and physical.startswith(head):
            return physical[len(head):]
        return physical

    def group(self, group_id: str) -> str:
        return f"{self.prefix}.{group_id}" if self.prefix else group_id

    transactional_id = group  # same rule: one deployment's ids never collide with another's

    def tp(self, tp: TopicPartition) -> TopicPartition:
        return TopicPartition(self.topic(tp.topic), tp.partition)

    def untp(self, tp: TopicPartition) -> TopicPartition:
        return TopicPartition(self.logical(tp.topic), tp.partition)


def namespaced(log: Log, prefix: str) -> Log:
    """``log`` seen through ``prefix`` (the log itself when the prefix is empty)."""
    return NamespacedLog(log, Namespace(prefix)) if prefix else log


class NamespacedLog:
    """A log whose topics, groups and transactional ids live under a prefix (module docstring)."""

    def __init__(self, inner: Log, ns: Namespace) -> None:
        self.inner = inner
        self.ns = ns
        self.url = inner.url
        self.partitioner = inner.partitioner

    def partition_for(self, key: bytes, partitions: int) -> int:
        return self.inner.partition_for(key, partitions)

    def create_topics(self, specs: Sequence[TopicSpec]) -> None:
        self.inner.create_topics([replace(s, name=self.ns.topic(s.name)) for s in specs])

    def partitions(self, topic: str) -> int:
        return self.inner.partitions(self.ns.topic(topic))

    def end_offsets(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        return {self.ns.untp(tp): o for tp, o in self.inner.end_offsets([self.ns.tp(t) for t in tps]).items()}

    def producer(self, client_id: str) -> Producer:
        return _Producer(self.inner.producer(client_id), self.ns)

    def transactional_producer(self, transactional_id: str) -> TransactionalProducer:
        return _TxnProducer(self.inner.transactional_producer(self.ns.transactional_id(transactional_id)), self.ns)

    def consumer(self, group_id: str | None, client_id: str = "dagfold", **kw: Any) -> Consumer:
        group = self.ns.group(group_id) if group_id is not None else None
        return _Consumer(self.inner.consumer(group, client_id, **kw), self.ns)  # type: ignore[call-arg]

    def queue_consumer(self, group_id: str, client_id: str = "dagfold", *, max_records: int = 64,
                       lock_ms: int = 30_000, max_deliveries: int = 5) -> QueueConsumer:
        inner = self.inner.queue_consumer(self.ns.group(group_id), client_id, max_records=max_records,
                                          lock_ms=lock_ms, max_deliveries=max_deliveries)
        return _QueueConsumer(inner, self.ns)

    def delete_namespace(self, timeout_s: float = 10.0) -> tuple[int, int]:
        """Delete this namespace's topics and consumer groups (Kafka only: a one-shot run's cleanup)."""
        delete = getattr(self.inner, "delete_prefixed", None)
        if delete is None:
            raise LogError(f"{type(self.inner).__name__} cannot delete a namespace")
        result: tuple[int, int] = delete(self.ns.prefix + ".", timeout_s)
        return result

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        """Backend extras (``wait_groups_stable``, ``bootstrap``...) pass through unmapped."""
        return getattr(self.inner, name)


class _Producer:
    def __init__(self, inner: Producer, ns: Namespace) -> None:
        self.inner, self.ns = inner, ns

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None:
        self.inner.send(self.ns.topic(topic), key, value, partition)

    def flush(self, timeout_s: float = 30.0) -> None:
        self.inner.flush(timeout_s)

    def close(self) -> None:
        self.inner.close()


class _TxnProducer:
    def __init__(self, inner: TransactionalProducer, ns: Namespace) -> None:
        self.inner, self.ns = inner, ns

    def begin(self) -> None:
        self.inner.begin()

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None, report: bool = True) -> None:
        self.inner.send(self.ns.topic(topic), key, value, partition, report)

    def commit(
        self, offsets: Mapping[TopicPartition, int], consumer: Consumer | None
    ) -> dict[TopicPartition, int]:
        raw = consumer.inner if isinstance(consumer, _Consumer) else consumer
        last = self.inner.commit({self.ns.tp(tp): o for tp, o in offsets.items()}, raw)
        return {self.ns.untp(tp): o for tp, o in last.items()}

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        self.inner.close()


class _Consumer:
    def __init__(self, inner: Consumer, ns: Namespace) -> None:
        self.inner, self.ns = inner, ns

    @property
    def group_id(self) -> str | None:
        return getattr(self.inner, "group_id", None)

    def subscribe(
        self,
        topics: Sequence[str],
        on_assign: AssignCallback | None = None,
        on_revoke: AssignCallback | None = None,
    ) -> None:
        def wrap(cb: AssignCallback | None) -> AssignCallback | None:
            if cb is None:
                return None
            return lambda tps: cb([self.ns.untp(tp) for tp in tps])

        self.inner.subscribe([self.ns.topic(t) for t in topics], wrap(on_assign), wrap(on_revoke))

    def assign(self, positions: Mapping[TopicPartition, int]) -> None:
        self.inner.assign({self.ns.tp(tp): o for tp, o in positions.items()})

    def assignment(self) -> list[TopicPartition]:
        return [self.ns.untp(tp) for tp in self.inner.assignment()]

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.inner.seek(self.ns.tp(tp), offset)

    def position(self, tp: TopicPartition) -> int:
        return self.inner.position(self.ns.tp(tp))

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[LogRecord]:
        logical = self.ns.logical
        return [LogRecord(logical(r.topic), r.partition, r.offset, r.key, r.value, r.timestamp_ms, headers=r.headers)
                for r in self.inner.poll(max_records, timeout_s)]

    def commit(self, offsets: Mapping[TopicPartition, int], wait: bool = True) -> None:
        self.inner.commit({self.ns.tp(tp): o for tp, o in offsets.items()}, wait)

    def committed(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        return {self.ns.untp(tp): o for tp, o in self.inner.committed([self.ns.tp(t) for t in tps]).items()}

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _QueueConsumer:
    """A queue consumer seen through the namespace: topics mapped both ways, records acknowledged
    by their names on the cluster."""

    def __init__(self, inner: QueueConsumer, ns: Namespace) -> None:
        self.inner, self.ns = inner, ns

    def subscribe(self, topics: Sequence[str]) -> None:
        self.inner.subscribe([self.ns.topic(t) for t in topics])

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[QueuedRecord]:
        return [replace(r, topic=self.ns.logical(r.topic)) for r in self.inner.poll(timeout_s, max_records)]

    def acknowledge(self, record: QueuedRecord, ack: Ack = Ack.ACCEPT) -> None:
        self.inner.acknowledge(replace(record, topic=self.ns.topic(record.topic)), ack)

    def commit(self, wait: bool = True) -> None:
        self.inner.commit(wait)

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
