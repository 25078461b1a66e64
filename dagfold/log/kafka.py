"""Kafka backend of the log contract (``dagfold.log.base``), on confluent-kafka.

Choices that keep it equal to the embedded backend:

* Every record gets an explicit partition, ``self.partition_for(key, n)``, so dagfold
  never depends on a client's partitioner; the default (murmur2) is the Java client's
  default and librdkafka's ``murmur2_random``, so other clients route keyed records the
  same way (and dagfold's producers set ``partitioner`` to the same name).
* Topics are never auto-created: every client sets ``allow.auto.create.topics=false``
  and sending to an unknown topic raises ``LogError`` before anything is queued.
* Consumers read committed records only, never auto-commit, and use the
  cooperative-sticky assignor, so ``on_assign``/``on_revoke`` receive just the
  partitions that were added or taken away, as the embedded coordinator does.
* A transactional producer that was fenced (or hit any fatal error, which for a
  transactional producer means it can no longer write) raises ``FencedError``;
  an abortable error aborts the transaction and raises ``TransactionAbortedError``
  (nothing committed); a commit whose outcome librdkafka cannot tell (it timed out,
  ran out of retries, or committed without every delivery report) raises
  ``CommitUnknownError``, and the writer reconciles from the log.
"""

from __future__ import annotations

import logging
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from confluent_kafka import (
    OFFSET_INVALID,
    AcknowledgeType,
    ConsumerGroupState,
    KafkaError,
    KafkaException,
    Message,
    ShareConsumer,
)
from confluent_kafka import Consumer as _CkConsumer
from confluent_kafka import Producer as _CkProducer
from confluent_kafka import TopicPartition as _CkTP
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    OffsetSpec,
    ResourceType,
)

from dagfold.exceptions import CommitUnknownError, FencedError, LogError, TransactionAbortedError
from dagfold.log.base import (
    DEFAULT_PARTITIONER,
    MAX_RECORD_BYTES,
    Ack,
    AssignCallback,
    Consumer,
    LogRecord,
    QueuedRecord,
    TopicPartition,
    TopicSpec,
    partitioner_named,
)

log = logging.getLogger(__name__)
_rdkafka_log = logging.getLogger(__name__ + ".librdkafka")

if TYPE_CHECKING:
    from confluent_kafka._types import HeadersType

_TIMEOUT_S = 30.0
# A writer begins its next transaction as soon as the last commit returned, while the coordinator is
# still writing that one's markers: the next AddPartitionsToTxn / AddOffsetsToTxn is answered
# CONCURRENT_TRANSACTIONS and retried after retry.backoff.ms, librdkafka's 100 ms by default. On a chain
# of tasks (one transaction a hop) that held a tenth of the hops ~100 ms (py-spy of `dagfold scheduler`:
# 84% of its wall time in send_offsets_to_transaction and commit_transaction; docs/benchmarks.md). The
# Java producer retries that answer after 20 ms; 10 ms here, doubled by librdkafka up to
# retry.backoff.max.ms (1 s) while a broker is really away. A URL's producer.retry.backoff.ms wins.
TXN_RETRY_BACKOFF_MS = 10
_END_OFFSETS_ROUND_S = 5.0
# Errors that mean another instance took over the transactional id.
_FENCED_CODES = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH})

# Transient while leaders settle, e.g. just after topic creation (librdkafka does not flag
# them retriable in admin results).
_SETTLING_CODES = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.REPLICA_NOT_AVAILABLE,
        KafkaError.UNKNOWN_LEADER_EPOCH,
        KafkaError.FENCED_LEADER_EPOCH,
        KafkaError.UNKNOWN_TOPIC_OR_PART,  # a broker that has not yet heard of a new topic
        KafkaError._NOENT,  # "No leaders found": a partition between two leaders (a broker died)
    }
)


# An admin request that met a broker going down, or a controller that moved: asked again, it succeeds
# once the client's metadata names a live broker (librdkafka flags few of them retriable).
_UNREACHABLE_CODES = frozenset(
    {
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._ALL_BROKERS_DOWN,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NOT_CONTROLLER,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    }
)


def _settling(err: KafkaError | None) -> bool:
    """Whether ``err`` is retriable or a leader settling (asked again, a read of offsets succeeds)."""
    return err is not None and (err.retriable() or err.code() in _SETTLING_CODES)


def _transient(err: KafkaError | None) -> bool:
    """Whether an admin request that failed with ``err`` may succeed when asked again: settling, or the
    broker it went to is gone."""
    return err is not None and (_settling(err) or err.code() in _UNREACHABLE_CODES)


def _ck(tp: TopicPartition, offset: int | None = None) -> _CkTP:
    return _CkTP(tp.topic, tp.partition) if offset is None else _CkTP(tp.topic, tp.partition, offset)


def _tp(tp: _CkTP) -> TopicPartition:
    return TopicPartition(tp.topic, tp.partition)


def _error_of(exc: KafkaException) -> KafkaError | None:
    err = exc.args[0] if exc.args else None
    return err if isinstance(err, KafkaError) else None


def _serve(p: _CkProducer, timeout_s: float, flush: bool) -> int:
    """``p.flush``/``p.poll``, raising a fatal error as a ``KafkaException``.

    confluent-kafka 2.16 raises a fatal error (e.g. fencing) from flush/poll and then
    still runs delivery callbacks with that exception pending; CPython turns that into
    a ``SystemError`` (chained to the real ``KafkaException``, or with none at all).
    """
    try:
        return p.flush(timeout_s) if flush else p.poll(timeout_s)
    except SystemError as exc:
        if isinstance(exc.__cause__, KafkaException):
            raise exc.__cause__ from None
        err = KafkaError(KafkaError._FATAL, f"client failed while serving callbacks: {exc}", fatal=True)
        raise KafkaException(err) from exc


class KafkaLog:
    """A Kafka cluster seen through the log contract.

    ``consumer_config``/``producer_config`` are merged into every consumer/producer this
    log creates (tests use them for short session timeouts; production for tuning).
    """

    def __init__(
        self,
        bootstrap: str,
        consumer_config: Mapping[str, Any] | None = None,
        producer_config: Mapping[str, Any] | None = None,
        partitioner: str = DEFAULT_PARTITIONER,
        client_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.url = f"kafka://{bootstrap}"
        self.bootstrap = bootstrap
        self.partitioner = partitioner
        self.partition_for = partitioner_named(partitioner)
        # client_config: settings of every client, the admin client included (SASL/TLS: security.protocol,
        # sasl.*, ssl.*), so an authenticated cluster works for topic creation and metadata too
        self._client_config = dict(client_config or {})
        self._base: dict[str, Any] = {
            "bootstrap.servers": bootstrap,
            "allow.auto.create.topics": False,
            "logger": _rdkafka_log,  # librdkafka's own log lines go to Python logging, not stderr
            **self._client_config,
        }
        self._consumer_config = dict(consumer_config or {})
        self._producer_config = dict(producer_config or {})
        admin_conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": _rdkafka_log, **self._client_config}
        self._admin = AdminClient(admin_conf)
        self._partitions: dict[str, int] = {}  # partition counts never change in dagfold

    # -- topics ----------------------------------------------------------
    def create_topics(self, specs: Sequence[TopicSpec]) -> None:
        """Create missing topics, then wait until every partition's leader serves it.

        Waiting matters: a producer or consumer started right after creation would
        otherwise see an unknown topic for a moment.
        """
        existing = self._existing([s.name for s in specs])
        missing = [s for s in specs if s.name not in existing]
        if missing:
            new = []
            for s in missing:
                config = {"retention.ms": str(s.retention_ms)}
                if s.min_insync_replicas is not None:
                    config["min.insync.replicas"] = str(s.min_insync_replicas)
                if s.max_message_bytes is not None:
                    config["max.message.bytes"] = str(s.max_message_bytes)
                new.append(NewTopic(s.name, s.partitions, s.replication, config=config))
            futures = self._admin.create_topics(new, operation_timeout=_TIMEOUT_S, request_timeout=_TIMEOUT_S)
            for name, fut in futures.items():
                try:
                    fut.result()
                except KafkaException as exc:
                    err = _error_of(exc)
                    if err is None or err.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                        raise LogError(f"cannot create topic {name!r}: {exc}") from exc
        deadline = time.monotonic() + _TIMEOUT_S
        for s in missing:
            while self._leaders(s.name) < s.partitions:
                if time.monotonic() > deadline:
                    raise LogError(f"topic {s.name!r} has no leader for every partition after {_TIMEOUT_S}s")
                time.sleep(0.05)
        # ... and until each leader answers for its partitions.
        self.end_offsets([TopicPartition(s.name, p) for s in missing for p in range(s.partitions)])

    def delete_prefixed(self, prefix: str, timeout_s: float = 10.0) -> tuple[int, int]:
        """Delete every topic and consumer group whose name starts with ``prefix`` (a one-shot run's
        namespace, at its end); returns (topics, groups) deleted. Errors are logged, not raised: the
        run is over, and what is left expires with the broker's retention."""
        if not prefix.endswith("."):
            raise LogError(f"refusing to delete by prefix {prefix!r}: it must end with '.' (a namespace)")
        topics = [t for t in self._metadata().topics if t.startswith(prefix)]
        groups: list[str] = []
        try:
            listed = self._admin.list_consumer_groups(request_timeout=timeout_s).result(timeout=timeout_s)
            groups = [g.group_id for g in listed.valid if g.group_id.startswith(prefix)]
        except Exception as exc:  # noqa: BLE001 - listing groups is best effort
            log.warning("cannot list consumer groups under %s: %s", prefix, exc)
        done = [0, 0]
        for i, futures in enumerate((
                self._admin.delete_topics(topics, operation_timeout=timeout_s, request_timeout=timeout_s)
                if topics else {},
                self._admin.delete_consumer_groups(groups, request_timeout=timeout_s) if groups else {})):
            for name, fut in futures.items():
                try:
                    fut.result(timeout=timeout_s)
                    done[i] += 1
                except Exception as exc:  # noqa: BLE001 - best effort, see the docstring
                    log.warning("cannot delete %s: %s", name, exc)
        self._partitions = {t: n for t, n in self._partitions.items() if not t.startswith(prefix)}
        return done[0], done[1]

    def _metadata(self, topic: str | None = None) -> Any:
        try:
            return self._admin.list_topics(topic=topic, timeout=_TIMEOUT_S)
        except KafkaException as exc:
            raise LogError(f"cannot read cluster metadata from {self.bootstrap}: {exc}") from exc

    def _existing(self, names: Sequence[str]) -> set[str]:
        md = self._metadata()
        return {n for n in names if n in md.topics and md.topics[n].error is None}

    def _leaders(self, topic: str) -> int:
        """Number of partitions of ``topic`` that have a leader (0 if it is unknown)."""
        t = self._metadata(topic).topics.get(topic)
        if t is None or t.error is not None:
            return 0
        return sum(1 for p in t.partitions.values() if p.leader >= 0 and p.error is None)

    def partitions(self, topic: str) -> int:
        n = self._partitions.get(topic)
        if n is not None:
            return n
        t = self._metadata(topic).topics.get(topic)
        if t is None or t.error is not None or not t.partitions:
            raise LogError(f"topic {topic!r} does not exist")
        n = len(t.partitions)
        self._partitions[topic] = n
        return n

    def wait_groups_stable(self, groups: Mapping[str, int], timeout_s: float = 120.0) -> bool:
        """Wait until each consumer group is stable with this many members holding partitions.

        For operators and benchmarks: a member that joins later rebalances the group's partitions
        (seconds without progress on them). False if the groups did not settle in ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ok = True
            for group, members in groups.items():
                try:
                    desc = self._admin.describe_consumer_groups([group])[group].result(timeout=10)
                except KafkaException:  # a fresh broker: the group coordinator is still loading
                    ok = False
                    continue
                holding = [m for m in desc.members if m.assignment and m.assignment.topic_partitions]
                ok = ok and desc.state == ConsumerGroupState.STABLE and len(holding) == members
            if ok:
                time.sleep(1.0)  # and stays so: a cooperative rebalance has a second round
                return True
            time.sleep(0.2)
        return False

    def end_offsets(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        """High watermarks (after a transaction that includes its commit marker).

        Retries retriable errors: right after creation the metadata can name a leader
        before that broker serves the partition (NOT_LEADER_FOR_PARTITION). After a
        leader change (a broker died) the admin client's cached metadata names the old
        leader, or an old leader epoch (FENCED_LEADER_EPOCH), until it is refreshed: a
        request sent there times out and comes back as an invalid offset (-1001) with no
        error. So each round has a short timeout, and a retry refreshes the metadata first.
        """
        out: dict[TopicPartition, int] = {}
        todo = list(tps)
        deadline = time.monotonic() + _TIMEOUT_S
        while todo:
            # A short timeout per round: a request stuck on a dead leader is asked again (after a
            # metadata refresh) instead of waiting out the whole deadline.
            futures = self._admin.list_offsets(
                {_ck(tp): OffsetSpec.latest() for tp in todo}, request_timeout=_END_OFFSETS_ROUND_S
            )
            todo = []
            for ck_tp, fut in futures.items():
                try:
                    off = fut.result().offset
                except KafkaException as exc:
                    err = _error_of(exc)
                    if not _settling(err) or time.monotonic() > deadline:
                        raise LogError(f"cannot read end offset of {ck_tp.topic}[{ck_tp.partition}]: {exc}") from exc
                    todo.append(_tp(ck_tp))
                    continue
                if off < 0:
                    # A request that timed out (the leader died) can come back as a result with an
                    # invalid offset and no error; it is no end offset, so ask again.
                    if time.monotonic() > deadline:
                        raise LogError(f"cannot read end offset of {ck_tp.topic}[{ck_tp.partition}]: "
                                       f"the broker answered offset {off}")
                    todo.append(_tp(ck_tp))
                    continue
                out[_tp(ck_tp)] = off
            if todo:
                time.sleep(0.05)
                self._refresh_metadata({tp.topic for tp in todo})
        return out

    def _refresh_metadata(self, topics: set[str] | None = None) -> None:
        """Ask the cluster for these topics' metadata (None: the cluster's, which names its live
        controller), which updates the admin client's cache (leaders and leader epochs); errors are left
        to the caller's retry."""
        for topic in [None] if topics is None else topics:
            try:
                self._admin.list_topics(topic=topic, timeout=5)
            except KafkaException as exc:
                log.debug("metadata refresh of %s failed: %s", topic or "the cluster", exc)

    # -- clients ---------------------------------------------------------
    def _resolve_partition(self, topic: str, key: bytes, partition: int | None) -> int:
        n = self.partitions(topic)
        if partition is None:
            return self.partition_for(key, n)
        if not 0 <= partition < n:
            raise LogError(f"topic {topic!r} has no partition {partition}")
        return partition

    def _producer_conf(self, **extra: Any) -> dict[str, Any]:
        return {
            **self._base,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": 5,
            # a SubmitJob (and its JobAccepted) may be as large as Limits.max_spec_bytes; topics that
            # carry them are created with a matching max.message.bytes (Config.core_topics)
            "message.max.bytes": MAX_RECORD_BYTES,
            "partitioner": self.partitioner,  # unused (dagfold names every partition), kept consistent
            **extra,
            **self._producer_config,
        }

    def producer(self, client_id: str) -> KafkaProducer:
        return KafkaProducer(self, _CkProducer(self._producer_conf(**{"client.id": client_id})))

    def transactional_producer(self, transactional_id: str) -> KafkaTransactionalProducer:
        conf = self._producer_conf(**{"client.id": transactional_id, "transactional.id": transactional_id,
                                      "retry.backoff.ms": TXN_RETRY_BACKOFF_MS})
        return KafkaTransactionalProducer(self, _CkProducer(conf))

    def consumer(
        self, group_id: str | None, client_id: str = "dagfold", config: Mapping[str, Any] | None = None
    ) -> KafkaConsumer:
        """A read_committed consumer; ``config`` overrides settings for this one consumer."""
        conf = {
            **self._base,
            # librdkafka wants a group id even for assign-only use; a random one is never committed to.
            "group.id": group_id if group_id is not None else f"dagfold-assign-{uuid.uuid4().hex}",
            "client.id": client_id,
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "enable.partition.eof": False,
            "partition.assignment.strategy": "cooperative-sticky",
            **self._consumer_config,
            **(config or {}),
        }
        return KafkaConsumer(_CkConsumer(conf), group_id)

    def queue_consumer(self, group_id: str, client_id: str = "dagfold", *, max_records: int = 64,
                       lock_ms: int = 30_000, max_deliveries: int = 5) -> KafkaQueueConsumer:
        """A member of share group ``group_id`` (KIP-932), explicit acknowledgement.

        The group's settings are set first (Kafka keeps them per group, the newest values hold):
        it starts at the beginning of its topics (a share group's default is their end, which
        would lose every record written before the first member joined), reads committed records
        only (dispatch records are written in the scheduler's transactions), and locks each
        acquired record for ``lock_ms``, at most ``max_deliveries`` times. The broker bounds both
        (``group.share.{min,max}.record.lock.duration.ms``, ``group.share.max.delivery.count.limit``).
        """
        settings = {"share.auto.offset.reset": "earliest", "share.isolation.level": "read_committed",
                    "share.record.lock.duration.ms": str(lock_ms), "share.delivery.count.limit": str(max_deliveries)}
        res = ConfigResource(ResourceType.GROUP, group_id, incremental_configs=[
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in settings.items()])
        # A worker (re)started while a broker is down, or while its host or the controller is cut off,
        # must wait that out, however long, not exit (a partition may last minutes: issue 25): the request
        # goes to the controller the client's metadata names, and one that died or is unreachable answers
        # with a transport error or a timeout until the metadata is refreshed. So transient errors are asked
        # again, each round short, with a warning every _TIMEOUT_S that says it still waits; any other error
        # is the broker refusing share groups.
        waiting_since = time.monotonic()
        warn_at = waiting_since + _TIMEOUT_S
        while True:
            try:
                for fut in self._admin.incremental_alter_configs(
                        [res], request_timeout=_END_OFFSETS_ROUND_S).values():
                    fut.result()
                break
            except KafkaException as exc:
                if not _transient(_error_of(exc)):
                    raise LogError(f"cannot configure share group {group_id!r} (a broker with share groups, "
                                   f"Kafka >= 4.2, is needed): {exc}") from exc
                now = time.monotonic()
                if now >= warn_at:
                    log.warning("share group %r not configured: the cluster has not answered for %.0f s (%s); "
                                "still asking", group_id, now - waiting_since, exc)
                    warn_at = now + _TIMEOUT_S
                else:
                    log.info("share group %r not configured yet (%s); asking again", group_id, exc)
                time.sleep(0.5)
                self._refresh_metadata()
        conf = {
            # allow.auto.create.topics is refused by librdkafka's (preview) share consumer; a share
            # consumer only reads, and subscribing to a missing topic creates nothing
            **{k: v for k, v in self._base.items() if k != "allow.auto.create.topics"},
            "group.id": group_id,
            "client.id": client_id,
            "share.acknowledgement.mode": "explicit",
            "max.poll.records": max_records,
            **{k: v for k, v in self._consumer_config.items() if k in _SHARE_CONSUMER_KEYS},
        }
        return KafkaQueueConsumer(ShareConsumer(conf))

    def close(self) -> None:
        """Nothing to release: clients are closed by their owners; the admin client needs no close."""


# Settings of the log's consumer_config that a share consumer takes too (it has no session or
# assignment settings of its own: the share group's are broker and group configs).
_SHARE_CONSUMER_KEYS = frozenset({"max.poll.interval.ms", "fetch.wait.max.ms", "socket.timeout.ms",
                                  "reconnect.backoff.ms", "reconnect.backoff.max.ms"})

_ACK_TYPES = {Ack.ACCEPT: AcknowledgeType.ACCEPT, Ack.RELEASE: AcknowledgeType.RELEASE,
              Ack.REJECT: AcknowledgeType.REJECT}


class KafkaQueueConsumer:
    """A share consumer (KIP-932) seen through the ``QueueConsumer`` contract."""

    def __init__(self, consumer: ShareConsumer) -> None:
        self.raw = consumer
        self._held: set[tuple[str, int, int]] = set()
        self._closed = False

    def subscribe(self, topics: Sequence[str]) -> None:
        try:
            self.raw.subscribe(list(topics))
        except KafkaException as exc:
            raise LogError(f"cannot join the share group: {exc}") from exc

    def poll(self, timeout_s: float = 1.0, max_records: int | None = None) -> list[QueuedRecord]:
        """``max_records`` is not Kafka's to honour per poll (max.poll.records is set at creation)."""
        if self._held:
            raise LogError(f"{len(self._held)} record(s) of the previous poll are not acknowledged")
        try:
            msgs = self.raw.poll(timeout_s)
        except KafkaException as exc:
            raise LogError(f"share consumer poll failed: {exc}") from exc
        except Exception as exc:  # IllegalStateException and friends are not KafkaExceptions
            raise LogError(f"share consumer poll failed: {exc}") from exc
        out: list[QueuedRecord] = []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.fatal():
                    raise LogError(f"share consumer failed: {err}")
                log.warning("share consumer: %s", err)
                continue
            topic, partition, offset = m.topic(), m.partition(), m.offset()
            assert topic is not None and partition is not None and offset is not None
            count = m.delivery_count()
            out.append(QueuedRecord(topic, partition, offset, m.key(), m.value(), m.timestamp()[1],
                                    int(count) if count is not None else 1))
            self._held.add((topic, partition, offset))
        return out

    def acknowledge(self, record: QueuedRecord, ack: Ack = Ack.ACCEPT) -> None:
        key = (record.topic, record.partition, record.offset)
        if key not in self._held:
            raise LogError(f"{record.topic}[{record.partition}]@{record.offset} is not held by this consumer")
        try:
            self.raw.acknowledge_offset(record.topic, record.partition, record.offset, _ACK_TYPES[ack])
        except Exception as exc:
            raise LogError(f"cannot acknowledge {record.topic}[{record.partition}]@{record.offset}: {exc}") from exc
        self._held.discard(key)

    def commit(self, wait: bool = True) -> None:
        try:
            if not wait:
                self.raw.commit_async()
                return
            results = self.raw.commit_sync(_TIMEOUT_S)
        except Exception as exc:
            raise LogError(f"acknowledgement commit failed: {exc}") from exc
        failed = [(tp, e) for tp, e in (results or {}).items() if e is not None]
        if failed:
            # e.g. INVALID_RECORD_STATE: a lock ran out first and the record went to another member
            log.warning("acknowledgements not applied for %s[%s]: %s", failed[0][0].topic, failed[0][0].partition,
                        failed[0][1])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.raw.close()
        except Exception as exc:
            log.debug("closing share consumer: %s", exc)


# An idempotent producer serves its delivery reports every this many sends (a flush serves them all)
SERVE_EVERY = 32


class KafkaProducer:
    """Idempotent producer; ``flush`` raises the first delivery failure since the last flush."""

    def __init__(self, log: KafkaLog, producer: _CkProducer) -> None:
        self._log = log
        self._p = producer
        self._errors: list[KafkaError] = []
        self._unserved = 0  # sends since delivery reports were last served

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            self._errors.append(err)

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None) -> None:
        p = self._log._resolve_partition(topic, key, partition)
        try:
            while True:
                try:
                    self._p.produce(topic, value=value, key=key, partition=p, on_delivery=self._on_delivery)
                    break
                except BufferError:  # local queue full: wait for deliveries to make room
                    _serve(self._p, 0.05, flush=False)
            # Reports are served every SERVE_EVERY sends (and by flush), not after each: a poll per
            # record was a sizeable part of the scheduler's CPU per dispatch.
            self._unserved += 1
            if self._unserved >= SERVE_EVERY:
                self._unserved = 0
                _serve(self._p, 0, flush=False)
        except KafkaException as exc:
            raise LogError(f"cannot send to {topic!r}: {exc}") from exc

    def flush(self, timeout_s: float = 30.0) -> None:
        self._unserved = 0
        try:
            left = _serve(self._p, timeout_s, flush=True)
        except KafkaException as exc:
            raise LogError(f"producer failed: {exc}") from exc
        errors, self._errors = self._errors, []
        if errors:
            raise LogError(f"{len(errors)} record(s) not delivered: {errors[0]}")
        if left:
            raise LogError(f"{left} record(s) still undelivered after {timeout_s}s")

    def close(self) -> None:
        self.flush()
        self._p.close()


class KafkaTransactionalProducer:
    """One transaction at a time: ``begin`` → ``send``… → ``commit(offsets, consumer)``.

    Delivery reports are served only after ``commit_transaction`` succeeded (which flushes
    and fails the whole transaction if any record failed), never while a fatal error
    may be pending (see ``_serve``); they give the last offset per partition.
    """

    def __init__(self, log: KafkaLog, producer: _CkProducer) -> None:
        self._log = log
        self._p = producer
        self._open = False
        self._fenced = False
        # An abort that failed (e.g. timed out flushing while a broker was down) stays in progress in
        # librdkafka until abort_transaction is called again; until then every begin fails with
        # _CONFLICT. A chaos run caught a scheduler looping on that for 4 minutes, its partitions held.
        self._abort_pending = False
        self._txn = 0  # numbers transactions, so late reports of an aborted one are ignored
        self._sent = 0  # records sent in the open transaction
        self._reported = 0  # of which with a delivery report (send(report=True))
        self._delivered = 0
        self._last: dict[TopicPartition, int] = {}
        # Fences any older instance with this transactional id (and aborts its open transaction).
        self._call(lambda: self._p.init_transactions(_TIMEOUT_S), "init")

    def _on_delivery(self, txn: int, err: KafkaError | None, msg: Message) -> None:
        if txn != self._txn:
            return
        self._delivered += 1
        if err is not None:
            return  # the transaction failed as a whole; commit_transaction reported it
        topic, partition, off = msg.topic(), msg.partition(), msg.offset()
        assert topic is not None and partition is not None and off is not None  # set on delivered records
        tp = TopicPartition(topic, partition)
        if off > self._last.get(tp, -1):
            self._last[tp] = off

    def _call(self, fn: Any, what: str) -> Any:
        """Run a transactional API call, retrying retriable errors, mapping the others."""
        for _ in range(5):
            try:
                return fn()
            except KafkaException as exc:
                err = _error_of(exc)
                if err is None or not err.retriable() or err.fatal() or err.txn_requires_abort():
                    self._fail(exc, what)
                log.warning("transaction %s: retrying after %s", what, err)
        raise LogError(f"transaction {what} still failing after retries")

    def _fail(self, exc: KafkaException | KafkaError, what: str) -> NoReturn:
        """Raise the contract's error: fenced/fatal → FencedError; abortable → abort + LogError."""
        err = _error_of(exc) if isinstance(exc, KafkaException) else exc
        cause = exc if isinstance(exc, KafkaException) else None
        if err is not None and (err.code() in _FENCED_CODES or err.fatal()):
            self._open = False
            self._fenced = True
            raise FencedError(f"transaction {what} failed, producer fenced: {err}") from cause
        if err is not None and err.txn_requires_abort() and self._open:
            self._abort_quietly()
            raise TransactionAbortedError(f"transaction {what} failed and was aborted: {err}") from cause
        raise LogError(f"transaction {what} failed: {exc}") from cause

    def _abort_quietly(self) -> None:
        self._open = False
        self._abort_pending = True
        try:
            self._p.abort_transaction(_TIMEOUT_S)
        except KafkaException as exc:
            log.warning("abort after a failed transaction also failed (completed before the next begin): %s", exc)
            return
        self._abort_pending = False

    def begin(self) -> None:
        if self._open:
            raise LogError("transaction already open")
        if self._abort_pending:  # complete the failed abort first (librdkafka: call it again)
            self._call(lambda: self._p.abort_transaction(_TIMEOUT_S), "abort")
            self._abort_pending = False
        self._call(self._p.begin_transaction, "begin")
        self._open = True
        self._txn += 1
        self._sent = self._reported = self._delivered = 0
        self._last = {}

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None, report: bool = True) -> None:
        if not self._open:
            raise LogError("send outside a transaction")
        p = self._log._resolve_partition(topic, key, partition)
        # Only a reported record gets a delivery report (one Python callback each, served after the
        # commit): a committed transaction delivered every record, so the others' reports say nothing.
        if report:
            txn = self._txn

            def delivered(err: KafkaError | None, msg: Message) -> None:
                self._on_delivery(txn, err, msg)
        while True:
            try:
                if report:
                    self._p.produce(topic, value=value, key=key, partition=p, on_delivery=delivered)
                else:
                    self._p.produce(topic, value=value, key=key, partition=p)
                break
            except BufferError:  # queue full: serving reports frees it (records stay uncommitted)
                try:
                    _serve(self._p, 0.05, flush=False)
                except KafkaException as exc:
                    self._fail(exc, "send")
            except KafkaException as exc:
                self._fail(exc, "send")
        self._sent += 1
        if report:
            self._reported += 1

    def commit(
        self, offsets: Mapping[TopicPartition, int], consumer: Consumer | None = None
    ) -> dict[TopicPartition, int]:
        if not self._open:
            raise LogError("commit without begin")
        if offsets:
            if not isinstance(consumer, KafkaConsumer) or consumer.group_id is None:
                raise LogError("offsets committed without a Kafka consumer in a group")
            meta = consumer.raw.consumer_group_metadata()
            ck_offsets = [_ck(tp, off) for tp, off in offsets.items()]
        try:
            if offsets:
                self._call(lambda: self._p.send_offsets_to_transaction(ck_offsets, meta, _TIMEOUT_S), "offsets")
            self._call(lambda: self._p.commit_transaction(_TIMEOUT_S), "commit")
        except (FencedError, TransactionAbortedError):
            raise
        except LogError as exc:
            # Neither fenced nor aborted: librdkafka may still complete this commit (a retriable
            # timeout leaves it in progress). The writer replaces this producer, whose successor's
            # init_transactions finishes or aborts it, and reads the outcome from the log.
            self._open = False
            raise CommitUnknownError(f"transaction commit outcome unknown: {exc}") from exc
        self._open = False
        # Committed, so every record was delivered: collect the remaining delivery reports.
        deadline = time.monotonic() + _TIMEOUT_S
        try:
            while self._delivered < self._reported and time.monotonic() < deadline:
                _serve(self._p, 0.01, flush=False)
        except KafkaException as exc:
            raise CommitUnknownError(f"transaction committed, then serving its delivery reports failed: {exc}",
                                     committed=True) from exc
        if self._delivered < self._reported:
            raise CommitUnknownError(f"transaction committed but {self._reported - self._delivered} delivery "
                                     "report(s) missing", committed=True)
        return dict(self._last)

    def abort(self) -> None:
        if not self._open:
            return
        self._open = False
        self._abort_pending = True
        self._call(lambda: self._p.abort_transaction(_TIMEOUT_S), "abort")
        self._abort_pending = False

    def close(self) -> None:
        """Abort any open transaction and release the client; never raises (a fenced
        producer's close reports the fencing again, which the caller already knows)."""
        if self._open:
            self._abort_quietly()
        with warnings.catch_warnings():
            if self._fenced:  # confluent-kafka warns that close could not abort; we know
                warnings.simplefilter("ignore", RuntimeWarning)
            try:
                self._p.close()
            except KafkaException as exc:
                log.debug("closing transactional producer: %s", exc)


def _headers(hs: HeadersType) -> tuple[tuple[str, bytes], ...]:
    items = hs.items() if isinstance(hs, dict) else hs
    return tuple((k, v.encode() if isinstance(v, str) else v or b"") for k, v in items)


class KafkaConsumer:
    """Wraps a confluent-kafka consumer; ``raw`` is the underlying one (group metadata etc.)."""

    def __init__(self, consumer: _CkConsumer, group_id: str | None) -> None:
        self.raw = consumer
        self.group_id = group_id
        self._manual: dict[TopicPartition, int] = {}
        self._closed = False

    def subscribe(
        self,
        topics: Sequence[str],
        on_assign: AssignCallback | None = None,
        on_revoke: AssignCallback | None = None,
    ) -> None:
        if self.group_id is None:
            raise LogError("subscribe needs a consumer group")

        # With the cooperative assignor the client itself applies the incremental
        # (un)assignment after these return; they only report it.
        def assigned(_c: _CkConsumer, parts: list[_CkTP]) -> None:
            if on_assign is not None and parts:
                on_assign(sorted(_tp(p) for p in parts))

        def revoked(_c: _CkConsumer, parts: list[_CkTP]) -> None:
            if on_revoke is not None and parts:
                on_revoke(sorted(_tp(p) for p in parts))

        self.raw.subscribe(list(topics), on_assign=assigned, on_revoke=revoked, on_lost=revoked)

    def assign(self, positions: Mapping[TopicPartition, int]) -> None:
        self._manual = dict(positions)
        self.raw.assign([_ck(tp, off) for tp, off in self._manual.items()])

    def assignment(self) -> list[TopicPartition]:
        return sorted(_tp(p) for p in self.raw.assignment())

    def seek(self, tp: TopicPartition, offset: int) -> None:
        if tp in self._manual:
            # Re-assigning is the reliable way for manual assignments: librdkafka's seek
            # fails with _STATE until the partition's fetcher has started.
            self._manual[tp] = offset
            self.raw.assign([_ck(t, o) for t, o in self._manual.items()])
            return
        try:
            self.raw.seek(_ck(tp, offset))
        except KafkaException as exc:
            raise LogError(f"cannot seek {tp} to {offset}: {exc}") from exc

    def position(self, tp: TopicPartition) -> int:
        try:
            off = self.raw.position([_ck(tp, OFFSET_INVALID)])[0].offset
        except KafkaException as exc:
            raise LogError(f"cannot read the position of {tp}: {exc}") from exc
        if off >= 0:
            return int(off)
        return self._manual.get(tp, 0)

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[LogRecord]:
        """Return as soon as records are there: ``consume(n, timeout)`` alone waits the whole
        timeout unless n records arrive, which put a full poll timeout on every hop of a chain.
        So: take what is fetched already; if nothing, block for one record, then take the rest."""
        try:
            msgs = self.raw.consume(num_messages=max_records, timeout=0)
            if not msgs:
                first = self.raw.poll(timeout_s)
                if first is not None:
                    msgs = [first, *self.raw.consume(num_messages=max_records - 1, timeout=0)]
        except KafkaException as exc:
            raise LogError(f"consume failed: {exc}") from exc
        out: list[LogRecord] = []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.fatal():
                    raise LogError(f"consumer failed: {err}")
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer: %s", err)
                continue
            topic, partition, offset = m.topic(), m.partition(), m.offset()
            assert topic is not None and partition is not None and offset is not None
            hs = m.headers()  # a list of (str, bytes or None) as consumed; the stubs allow a dict and str too
            out.append(LogRecord(topic, partition, offset, m.key(), m.value(), m.timestamp()[1],
                                 headers=_headers(hs) if hs else ()))
            if self._manual:
                self._manual[TopicPartition(topic, partition)] = offset + 1
        return out

    def commit(self, offsets: Mapping[TopicPartition, int], wait: bool = True) -> None:
        if self.group_id is None:
            raise LogError("commit needs a consumer group")
        if not offsets:
            return
        try:
            if not wait:  # failures surface through the client's log (offset_commit_cb is not set)
                self.raw.commit(offsets=[_ck(tp, o) for tp, o in offsets.items()], asynchronous=True)
                return
            result = self.raw.commit(offsets=[_ck(tp, o) for tp, o in offsets.items()], asynchronous=False)
        except KafkaException as exc:
            raise LogError(f"offset commit failed: {exc}") from exc
        failed = [p for p in result or [] if p.error is not None]
        if failed:
            raise LogError(f"offset commit failed for {failed[0].topic}[{failed[0].partition}]: {failed[0].error}")

    def committed(self, tps: Sequence[TopicPartition]) -> dict[TopicPartition, int]:
        if self.group_id is None:
            raise LogError("committed needs a consumer group")
        if not tps:
            return {}
        try:
            parts = self.raw.committed([_ck(tp) for tp in tps], timeout=_TIMEOUT_S)
        except KafkaException as exc:
            raise LogError(f"cannot read committed offsets: {exc}") from exc
        return {_tp(p): max(p.offset, 0) for p in parts}

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.raw.close()
