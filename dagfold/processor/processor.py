"""The partition processor: the one runtime around every fold (scheduler, allocator).

Per poll of the fold's commands topic (Kafka Streams' ``StreamTask``, Restate's partition
processor):

1. decode each record, check its key and partition (``ProcessorSpec.admit``), or
   dead-letter it with the reason;
2. fold it into its partition's ``PartitionTransaction`` with ``atomically`` (a command
   whose fold raises leaves no write and is dead-lettered);
3. produce the outputs (events to the partition's events partition, everything else by key)
   in ONE log transaction that also commits the consumed command offsets;
4. write each partition's state and its applied-events offset in one RocksDB batch.

With ``ProcessorSpec.commit_interval_s`` the transaction of 3 stays open across polls (Kafka
Streams' ``commit.interval.ms`` under exactly-once): each poll folds on top of the open state
transactions, writes its ``before_commit`` outputs at once and adds the rest to the open log
transaction; 3 and 4 happen when the interval has passed, when an output waits for another
reader (anything but events and ``before_commit`` topics), before a partition is revoked, and at
close. A failure of the commit then redoes every poll since the last one, deterministically
(docs/semantics.md, Dispatch: what a worker may have seen of an aborted transaction).

What a failure in 3 means is decided by the transaction's status (``LogTransaction``):

* ABORTED (nothing committed): drop the state transactions, reload the folds' derived
  indexes, rewind the consumer to the committed offsets; the batch is read again.
* UNKNOWN (it may have committed): drop the state transactions, replace the transactional
  producer (on Kafka its successor's ``init_transactions`` completes or aborts the pending
  transaction), catch the touched partitions' state up to the events topic's end, then
  rewind to the committed offsets. If it committed, catch-up applied its events and the
  committed offsets are past the batch; if not, neither. Either way nothing is lost and
  nothing is decided twice. Until that reconciliation succeeds nothing else is processed.
* fenced (a newer instance took the transactional id): stop.

A rewind that fails (the group coordinator moving during a broker restart) leaves its
partitions to the same reconciliation, retried before the next poll: a consumer standing
past an aborted batch must never poll on.

A crash between 3 and 4 is the UNKNOWN case seen from a restart: on assignment each
partition's store is caught up from its events first, after the group's committed offsets
were read (on Kafka that read waits for a previous owner's pending transaction: see
``_on_assign``). A catch-up that cannot reach the events' end (another instance's open
transaction holds the last stable offset back) leaves its partition to the same
reconciliation: nothing is folded on part of the events. Timers go through the log
(``timers``): due-timer scans write timer commands, folded like any other command.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dagfold import metrics
from dagfold.clock import now_ms
from dagfold.codec import Record, default_codec
from dagfold.config import DEADLETTER
from dagfold.exceptions import CodecError, FencedError, LogError
from dagfold.log.base import Log, LogRecord, Producer, TopicPartition, TopicSpec
from dagfold.log.reader import Backoff, LagGauge
from dagfold.outputs import Output, dead_letter
from dagfold.processor.catchup import catch_up
from dagfold.processor.fold import Fold
from dagfold.processor.timers import TimerPolicy, TimerScanner
from dagfold.processor.transaction import LogTransaction, TxnStatus
from dagfold.state import MemoryStore, PartitionStore, PartitionTransaction, Store
from dagfold.state.store import applied_events_offset

log = logging.getLogger("dagfold.processor")

TIMER_INTERVAL_S = 0.1

Admit = Callable[[LogRecord, Record], "list[Output] | None"]


def _every(event: Record) -> bool:
    return True


def _no_topic(topic: str) -> TopicSpec | None:
    return None


def _never(topic: str) -> bool:
    return False


@dataclass(frozen=True)
class ProcessorSpec:
    """One configuration of the runtime: which fold, which topics, which timers, where outputs go.

    * ``fold_for(partition, store)``: the fold of a partition, bound to its store (a stateless
      fold may return one shared instance);
    * ``admit(record, command)``: None to fold the command; otherwise the outputs to produce
      instead (a dead letter, a forward to the right partition, or nothing to skip it);
    * ``events_partition(partition)``: where this partition's events go (and are caught up from);
    * ``accepts(event)``: whether an event on that partition belongs to this fold (catch-up);
    * ``partitions``: None joins ``group`` and takes what it assigns; a list reads just those;
    * ``store_path(partition)``: None keeps state in memory (tests, simulations);
    * ``topic_for(name)``: the spec of an output topic to create on first use (dispatch queues);
    * ``before_commit(name)``: outputs to this topic are written outside the log transaction, by an
      idempotent producer, and are durable before the transaction commits (at least once: an
      aborted or unknown commit redoes the batch, which writes them again). For records whose
      reader fences duplicates and that must carry no transaction markers (dispatch queues, read
      by Kafka share groups: docs/semantics.md, Dispatch);
    * ``on_committed(outputs)``: metrics after a transaction committed;
    * ``former_group``: a group this configuration committed to before ``group`` (manual
      ``partitions`` only): a partition whose store already holds events but on which ``group``
      committed nothing yet starts where ``former_group`` stood (an upgrade moves on from there);
    * ``cache_values``: how many decoded state values each partition's store keeps between
      transactions (``dagfold.state.store.ValueCache``; 0: none). Only for a fold that never
      mutates a stored value in place;
    * ``inputs``: topics read besides ``commands`` and partitioned as it (the scheduler's
      ``scheduler.internal``, which only dagfold's services may write): partition p of each is
      folded by partition p's fold, read from the group's committed offsets whenever ``commands``'
      partition p is taken here (by a consumer without a group, so that the group's assignor,
      cooperative-sticky on Kafka, cannot give the two to different instances), and its offsets are
      committed in the same transaction as the commands';
    * ``commit_interval_s``: how long one log transaction may stay open across polls (0: one per
      poll). Its round trips are then paid once an interval rather than once a poll, and a
      ``before_commit`` output (a dispatch) leaves right after the fold that decided it, so a chain
      of dependent tasks no longer waits a commit per hop; the other outputs (events) become
      visible up to this much later.
    """

    service: str
    commands: str
    events: str
    group: str
    transactional_id: str
    fold_for: Callable[[int, Store], Fold]
    admit: Admit
    events_partition: Callable[[int], int]
    timers: TimerPolicy | None = None
    accepts: Callable[[Record], bool] = _every
    partitions: Sequence[int] | None = None
    store_path: Callable[[int], Path] | None = None
    topic_for: Callable[[str], TopicSpec | None] = _no_topic
    before_commit: Callable[[str], bool] = _never
    create_topics: Sequence[TopicSpec] = ()
    batch_max_records: int = 500
    poll_timeout_s: float = 0.05
    on_committed: Callable[[Sequence[tuple[int, Output]]], None] | None = None
    clock: Callable[[], int] = now_ms
    former_group: str | None = None
    cache_values: int = 0
    inputs: Sequence[str] = ()
    commit_interval_s: float = 0.0


@dataclass(slots=True)
class _Batch:
    """What is folded since the last commit: one or more polls, one open log transaction."""

    opened: float = field(default_factory=time.monotonic)
    log_txn: LogTransaction | None = None
    txns: dict[int, PartitionTransaction] = field(default_factory=dict)
    offsets: dict[TopicPartition, int] = field(default_factory=dict)
    outputs: list[tuple[int, Output]] = field(default_factory=list)
    records: int = 0
    urgent: bool = False  # an output another reader waits for: commit at the end of this poll


class PartitionProcessor:
    """Owns the partitions of one fold's commands topic assigned to this instance (module docstring)."""

    def __init__(self, log_: Log, spec: ProcessorSpec, client_id: str) -> None:
        self.log = log_
        self.spec = spec
        self.client_id = client_id
        self.codec = default_codec()
        self.stores: dict[int, Store] = {}
        self.folds: dict[int, Fold] = {}
        self.folded = 0  # commands folded and committed
        self.reconciled = 0  # commits of unknown outcome reconciled from the log
        self.ready = threading.Event()
        self._known_topics: set[str] = set()
        self._unreconciled: set[int] = set()
        self._reconcile_backoff = Backoff()
        self._lag = LagGauge(spec.service)
        self._started = False
        self._last_timer = 0.0
        self._batch: _Batch | None = None  # folded, not yet committed (spec.commit_interval_s)
        # the transactional producer first: its initialisation fences an older instance
        self.producer = log_.transactional_producer(spec.transactional_id)
        self.consumer = log_.consumer(spec.group, client_id=client_id)
        # spec.inputs' partitions of the partitions owned here, assigned by hand (ProcessorSpec)
        self.inputs = log_.consumer(None, client_id=f"{client_id}-inputs") if spec.inputs else None
        self.early_producer: Producer | None = None  # outputs of spec.before_commit topics, created on first use
        self.timer_producer = log_.producer(f"{client_id}-timer") if spec.timers is not None else None
        self.timers = TimerScanner(spec.timers, self.timer_producer) \
            if spec.timers is not None and self.timer_producer is not None else None

    # -- partition ownership ----------------------------------------------------
    def _open_store(self, partition: int) -> Store:
        path, n = self.spec.store_path, self.spec.cache_values
        return PartitionStore(path(partition), cache_values=n) if path is not None else MemoryStore(n)

    def _events_tp(self, partition: int) -> TopicPartition:
        return TopicPartition(self.spec.events, self.spec.events_partition(partition))

    def _on_assign(self, tps: list[TopicPartition]) -> None:
        self._take(tps)

    def _take(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        """Take new partitions: their committed offsets first, then each store caught up with its
        events. Returns those offsets (where the commands are read from).

        The order is Kafka Streams' (offsets, then restore). On Kafka the committed-offset fetch is
        stable (read_committed: KIP-447): it waits while a transaction that holds offsets for these
        partitions is pending, so the previous owner's last transaction is committed or aborted
        before the catch-up reads the events to their end. The other way round, an owner that lost
        a partition with its offsets already sent (stopped past its session timeout, then resumed)
        could commit after the catch-up: the commands read from past its batch, its events never
        applied here, and the applied offset moved past them with the next commit.
        """
        new = [tp for tp in tps if tp.topic == self.spec.commands and tp.partition not in self.stores]
        side = [TopicPartition(t, tp.partition) for tp in new for t in self.spec.inputs]
        offsets = self._committed(new + side) if new else {}
        if side and self.inputs is not None:
            self._assign_inputs({tp: offsets.pop(tp) for tp in side})
        for tp in new:
            store = self._open_store(tp.partition)
            try:
                fold = self.spec.fold_for(tp.partition, store)
                try:
                    n = catch_up(self.log, store, fold, self._events_tp(tp.partition), self.spec.accepts)
                except LogError:
                    # Not at the end of its events: nothing of the partition is folded until the
                    # reconciliation (before the next poll) has caught it up and rewound it.
                    log.warning("%s partition %d not caught up with its events; retried before folding",
                                self.spec.service, tp.partition, exc_info=True,
                                extra={"topic": tp.topic, "partition": tp.partition})
                    self._unreconciled.add(tp.partition)
                    n = -1
            except BaseException:
                store.close()
                raise
            if n >= 0:
                log.info("%s partition %d restored (%d events applied)", self.spec.service, tp.partition, n,
                         extra={"topic": tp.topic, "partition": tp.partition})
            self.stores[tp.partition] = store
            self.folds[tp.partition] = fold
            if self.timers is not None:
                self.timers.forget(tp.partition)  # its restored timers may be due long ago
        self.ready.set()
        return self._from_former_group(offsets)

    def _from_former_group(self, offsets: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Offsets of ``spec.former_group`` where ``spec.group`` has none and the store has events."""
        former = self.spec.former_group
        if former is None:
            return offsets
        moved = [tp for tp, off in offsets.items()
                 if off == 0 and tp.partition in self.stores and applied_events_offset(self.stores[tp.partition]) >= 0]
        if not moved:
            return offsets
        c = self.log.consumer(former, client_id=f"{self.client_id}-former-group")
        try:
            before = c.committed(moved)
        finally:
            c.close()
        log.warning("%s: partitions %s start where group %s stood: %s", self.spec.service,
                    [tp.partition for tp in moved], former, {tp.partition: off for tp, off in before.items()})
        return {**offsets, **before}

    def _committed(self, tps: list[TopicPartition], attempts: int = 4) -> dict[TopicPartition, int]:
        """The group's committed offsets of ``tps``, retried while the coordinator moves."""
        backoff = Backoff(0.5, 4.0)
        for _ in range(attempts - 1):
            try:
                return self.consumer.committed(tps)
            except LogError:
                delay = backoff.failed()
                log.warning("%s: reading the committed offsets failed; again in %.1fs", self.spec.service, delay,
                            exc_info=True)
                time.sleep(delay)
        return self.consumer.committed(tps)

    def _assign_inputs(self, add: dict[TopicPartition, int], drop: Iterable[int] = ()) -> None:
        """Read ``add`` from the given offsets besides what the inputs consumer reads now, less
        the partitions ``drop``."""
        assert self.inputs is not None
        gone = set(drop)
        keep = {tp: self.inputs.position(tp) for tp in self.inputs.assignment()
                if tp.partition not in gone and tp not in add}
        self.inputs.assign({**keep, **add})

    def _on_revoke(self, tps: list[TopicPartition]) -> None:
        b = self._batch
        if b is not None and any(tp.partition in b.txns for tp in tps):
            self._commit_open()  # what was folded on them is committed before they move
        if self.inputs is not None:
            self._assign_inputs({}, drop=[tp.partition for tp in tps if tp.topic == self.spec.commands])
        for tp in tps:
            store = self.stores.pop(tp.partition, None)
            self.folds.pop(tp.partition, None)
            self._unreconciled.discard(tp.partition)
            if self.timers is not None:
                self.timers.forget(tp.partition)
            if store is not None:
                store.close()

    def start(self) -> None:
        """Create the topics, then join the group or take the configured partitions (idempotent)."""
        if self._started:
            return
        self._started = True
        if self.spec.create_topics:
            self.log.create_topics(self.spec.create_topics)
        if self.spec.partitions is None:
            self.consumer.subscribe([self.spec.commands], on_assign=self._on_assign, on_revoke=self._on_revoke)
            return
        tps = [TopicPartition(self.spec.commands, p) for p in self.spec.partitions]
        self.consumer.assign(self._take(tps))

    # -- main loop --------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.step()
        except FencedError:
            log.error("%s instance %s was fenced by a newer instance; stopping", self.spec.service, self.client_id)
            raise
        finally:
            self.close()

    def step(self, timeout_s: float | None = None) -> int:
        """One round: reconcile if a commit's outcome is pending, poll and fold a batch, fire due
        timers, report lag. Returns the number of commands polled."""
        self.start()
        if self._unreconciled:
            if self._batch is not None:
                self._commit_open()  # the reconciliation replaces the producer: its open transaction first
            if not self._reconcile():
                return 0
        wait = self.spec.poll_timeout_s if timeout_s is None else timeout_s
        if self._batch is not None:
            wait = min(wait, max(0.0, self._batch.opened + self.spec.commit_interval_s - time.monotonic()))
        recs = self.consumer.poll(self.spec.batch_max_records, wait)
        if self.inputs is not None and self.stores:
            recs = recs + self.inputs.poll(self.spec.batch_max_records, 0.0)
        if recs:
            self.process_batch(recs)
        elif self._batch is not None and self._commit_due(self._batch):
            self._commit_open()
        mono = time.monotonic()
        # timers scan the committed state: not while a transaction holds newer writes
        if self.timers is not None and self._batch is None and mono - self._last_timer >= TIMER_INTERVAL_S:
            self._last_timer = mono
            sent = self.timers.fire(self.stores, self.spec.clock())
            if sent:
                metrics.TIMERS_FIRED.inc(sent)
        if self._lag.due():
            self.report_lag()
        return len(recs)

    def fire_timers(self, now: int) -> int:
        """Scan the owned partitions' due timers now and write their commands (tests, tools)."""
        return self.timers.fire(self.stores, now) if self.timers is not None else 0

    # -- one batch --------------------------------------------------------------
    def _fold_record(self, fold: Fold, txn: PartitionTransaction, rec: LogRecord, now: int) -> list[Output]:
        service = self.spec.service
        try:
            cmd = self.codec.decode(rec.value)
        except CodecError as exc:
            return [dead_letter(rec, str(exc), service)]
        instead = self.spec.admit(rec, cmd)
        if instead is not None:
            return instead
        try:
            return fold.process(txn, cmd, now, rec.offset)
        except Exception as exc:  # a bug must not stop the partition: dead-letter the command
            log.exception("%s fold failed on %s/%d@%d", service, rec.topic, rec.partition, rec.offset,
                          extra={"topic": rec.topic, "partition": rec.partition, "offset": rec.offset,
                                 "job_id": cmd.get("job_id"), "task_id": cmd.get("task_id"),
                                 "attempt": cmd.get("attempt")})
            return [dead_letter(rec, f"fold error: {exc!r}", service)]

    def process_batch(self, recs: Sequence[LogRecord]) -> None:
        """Fold ``recs`` into the open batch (a new one if none), send its outputs, and commit if due."""
        started = time.perf_counter()
        now = self.spec.clock()
        # Not self._batch while folding: a fold that raises past here leaves nothing to commit.
        b, self._batch = (self._batch or _Batch()), None
        events, early = self.spec.events, self.spec.before_commit
        outputs: list[tuple[int, Output]] = []
        folded = 0
        for rec in recs:
            p = rec.partition
            fold = self.folds.get(p)
            if fold is None or p in self._unreconciled:
                continue
            txn = b.txns.get(p)
            if txn is None:
                txn = b.txns[p] = PartitionTransaction(self.stores[p])
            outputs.extend((p, o) for o in self._fold_record(fold, txn, rec, now))
            b.offsets[TopicPartition(rec.topic, p)] = rec.offset + 1
            folded += 1
        if not b.offsets:
            return
        b.records += folded
        b.outputs += outputs
        b.urgent = b.urgent or any(o.topic != events and not early(o.topic) for _, o in outputs)
        self._ensure_topics(o.topic for _, o in outputs)
        if not self._send(b, outputs):
            return
        self._batch = b
        metrics.observe_fold(self.spec.service, folded, time.perf_counter() - started)
        if self._commit_due(b):
            self._commit_open()

    def _commit_due(self, b: _Batch) -> bool:
        interval = self.spec.commit_interval_s
        return interval <= 0 or b.urgent or b.records >= self.spec.batch_max_records \
            or time.monotonic() - b.opened >= interval

    def _send(self, b: _Batch, outputs: list[tuple[int, Output]]) -> bool:
        """Add ``outputs`` to the batch's log transaction (begun on its first poll); the
        ``before_commit`` ones are written (durably) now. False if that failed (handled)."""
        events = self.spec.events
        early = self.spec.before_commit
        try:
            if b.log_txn is None:
                b.log_txn = LogTransaction(self.producer)
            txn = b.log_txn
            before: list[Output] = []
            for p, o in outputs:
                if early(o.topic):
                    before.append(o)
                    continue
                part = self.spec.events_partition(p) if o.topic == events else None
                txn.send(o.topic, o.key.encode(), self.codec.encode(o.record), partition=part)
            if before:
                self._write_before_commit(txn, before)
            return True
        except FencedError:
            raise
        except LogError:
            self._failed(b)
            return False

    def _commit_open(self) -> None:
        """Commit the open batch: its log transaction (records and command offsets), then each
        partition's state and applied-events offset. A failure is handled (``_failed``)."""
        b, self._batch = self._batch, None
        if b is None:
            return
        assert b.log_txn is not None  # begun with the batch's first poll
        try:
            last = b.log_txn.commit(b.offsets, self.consumer)
        except FencedError:
            raise
        except LogError:
            self._failed(b)
            return
        for p, txn in b.txns.items():
            txn.commit(applied_events=last.get(self._events_tp(p)))
        self.folded += b.records
        dead = sum(o.topic == DEADLETTER for _, o in b.outputs)
        if dead:
            metrics.DEAD_LETTERS.labels(self.spec.service).inc(dead)
        if self.spec.on_committed is not None:
            self.spec.on_committed(b.outputs)

    def _failed(self, b: _Batch) -> None:
        """The batch's log transaction failed: what that means was decided by its status."""
        partitions = list(b.txns)
        if b.log_txn is not None and b.log_txn.status is TxnStatus.UNKNOWN:
            log.exception("%s: commit outcome unknown; reconciling partitions %s from the log",
                          self.spec.service, partitions)
            self._unreconciled.update(partitions)
            self._reconcile()
            return
        log.exception("%s: transaction aborted; rewinding to the committed offsets", self.spec.service)
        self._reload(partitions)
        try:
            self._rewind(partitions)
        except LogError:
            # The consumer stands past the batch: it must not poll on before it is rewound.
            log.exception("%s: rewinding failed; retried before the next poll", self.spec.service)
            self._unreconciled.update(partitions)

    def _write_before_commit(self, txn: LogTransaction, outputs: list[Output]) -> None:
        """Write ``outputs`` durably outside ``txn``; if that fails, abort ``txn`` (nothing of the batch
        committed: it is redone, and writes them again) and raise."""
        try:
            if self.early_producer is None:
                self.early_producer = self.log.producer(f"{self.client_id}-early")
            for o in outputs:
                self.early_producer.send(o.topic, o.key.encode(), self.codec.encode(o.record))
            self.early_producer.flush()
        except LogError:
            txn.abort()
            producer, self.early_producer = self.early_producer, None  # a fresh one for the redo
            if producer is not None:
                try:
                    producer.close()
                except Exception:
                    log.debug("closing the failed producer failed", exc_info=True)
            raise

    # -- after a failed transaction -------------------------------------------------
    def _reload(self, partitions: Iterable[int]) -> None:
        for p in partitions:
            fold = self.folds.get(p)
            if fold is not None:
                fold.reload()

    def _rewind(self, partitions: Iterable[int]) -> None:
        """Read the partitions again from the group's committed offsets."""
        partitions = list(partitions)
        owned = set(self.consumer.assignment())
        tps = [tp for tp in (TopicPartition(self.spec.commands, p) for p in partitions) if tp in owned]
        side = [TopicPartition(t, tp.partition) for tp in tps for t in self.spec.inputs]
        for tp, off in self.consumer.committed(tps + side).items():
            (self.consumer if tp.topic == self.spec.commands else self.inputs).seek(tp, off)  # type: ignore[union-attr]

    def _reconcile(self) -> bool:
        """Settle a commit of unknown outcome (module docstring); False if the log is not reachable
        yet (retried at the next step, after a back-off)."""
        partitions = sorted(p for p in self._unreconciled if p in self.stores)
        try:
            self._replace_producer()
            for p in partitions:
                fold = self.folds[p]
                fold.reload()  # drop what the dropped transaction left in memory
                n = catch_up(self.log, self.stores[p], fold, self._events_tp(p), self.spec.accepts)
                log.warning("%s partition %d reconciled: %d events of the uncertain commit applied",
                            self.spec.service, p, n)
            self._rewind(partitions)
        except FencedError:
            raise
        except LogError:
            delay = self._reconcile_backoff.failed()
            log.exception("%s: reconciling failed; again in %.1fs", self.spec.service, delay)
            time.sleep(delay)
            return False
        self._unreconciled.clear()
        self._reconcile_backoff.succeeded()
        self.reconciled += 1
        return True

    def _replace_producer(self) -> None:
        """A new transactional producer with the same id: on Kafka its initialisation completes or
        aborts the transaction the old one left pending, so the log's end is final afterwards."""
        old = self.producer
        try:
            old.close()
        except LogError:
            log.debug("closing the old transactional producer failed", exc_info=True)
        self.producer = self.log.transactional_producer(self.spec.transactional_id)

    def _ensure_topics(self, topics: Iterable[str]) -> None:
        """Create output topics on first use (dispatch queues are named by job specs)."""
        for t in set(topics) - self._known_topics:
            spec = self.spec.topic_for(t)
            if spec is not None:
                self.log.create_topics([spec])
            self._known_topics.add(t)

    # -- lag, close -------------------------------------------------------------
    def report_lag(self) -> None:
        """Commands not yet folded on this instance's partitions (the consumer-lag metric)."""
        try:
            positions = {tp: self.consumer.position(tp)
                         for tp in (TopicPartition(self.spec.commands, p) for p in self.stores)}
            if self.inputs is not None:
                positions.update({tp: self.inputs.position(tp) for tp in self.inputs.assignment()})
        except LogError:
            return
        self._lag.report(self.log, positions)

    def close(self) -> None:
        if self._batch is not None:  # a stop commits what was folded (a crash leaves it to abort)
            try:
                self._commit_open()
            except Exception:
                log.warning("%s: committing the open batch at close failed", self.spec.service, exc_info=True)
        for store in self.stores.values():
            store.close()
        self.stores.clear()
        self.folds.clear()
        closers = [self.consumer.close, self.producer.close]
        if self.inputs is not None:
            closers.append(self.inputs.close)
        if self.timer_producer is not None:
            closers.append(self.timer_producer.close)
        if self.early_producer is not None:
            closers.append(self.early_producer.close)
        for close in closers:
            try:
                close()
            except Exception:
                log.debug("close failed", exc_info=True)
