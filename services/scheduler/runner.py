"""The scheduler: the partition-processor runtime configured with the scheduler fold.

Wiring only (the cycle, its transactions, catch-up and timers live in ``dagfold.processor``):
the commands topic's partitions shared by the group ``dagfold-scheduler``, and the same partitions
of ``scheduler.internal`` (allocation grants: accepted only there, ``wrong_topic``); events to the
command's own partition of ``events``; dispatch and control records by key; dispatch
topics created on first use; TimerFired commands from the due-time index; and the check
that a command's key is its job ID on the job's partition.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from dagfold import metrics
from dagfold.codec import Record
from dagfold.commands import job_id_of
from dagfold.config import COMMANDS, DISPATCH_PREFIX, EVENTS, SCHEDULER_GROUP, SCHEDULER_INTERNAL, Config
from dagfold.log import Log, LogRecord, TopicSpec, partition_for
from dagfold.outputs import Output, dead_letter, forward_misrouted
from dagfold.processor import PartitionProcessor, ProcessorSpec, TimerPolicy
from dagfold.services.scheduler.fold import SchedulerFold
from dagfold.services.scheduler.timers import due_timers
from dagfold.state import Store
from dagfold.tracing import TRACEPARENT, clean_traceparent, traceparent_of


def _same_partition(partition: int) -> int:
    return partition


def _timer_key(command: Record) -> str:
    return str(command["job_id"])


def _record_events(outputs: Sequence[tuple[int, Output]]) -> None:
    metrics.record_scheduler_events(o.record for _, o in outputs if o.topic == EVENTS)
    forwarded = sum(o.topic == COMMANDS for _, o in outputs)
    if forwarded:
        metrics.COMMANDS_FORWARDED.labels("scheduler").inc(forwarded)


SCHEDULER_TIMERS = TimerPolicy(COMMANDS, due_timers, _timer_key)

#: what the scheduler takes only from ``scheduler.internal``, the topic the allocators alone may write
#: (docs/security.md, Boundaries inside a deployment): on ``commands`` anyone who may submit could forge it
INTERNAL_ONLY = frozenset({"dagfold.command.TaskAllocation"})


def wrong_topic(topic: str, command_type: str) -> str | None:
    """Why a command may not arrive on ``topic`` (its writers may not say it); None if it may."""
    internal = command_type in INTERNAL_ONLY
    if topic == COMMANDS and internal:
        return (f"{command_type} is taken only from {SCHEDULER_INTERNAL}, which only allocators may write; "
                f"on {COMMANDS} any producer could forge a grant")
    if topic == SCHEDULER_INTERNAL and not internal:
        return f"{command_type} does not travel on {SCHEDULER_INTERNAL} (only allocation grants do)"
    return None


def scheduler_spec(config: Config, instance_id: str = "0",
                   partition_of: Callable[[bytes], int] | None = None) -> ProcessorSpec:
    """``partition_of(job_id)``: the job's partition of the commands topic; the runner passes the
    log's partitioner over the topic's real partition count (what the log routes a forward by)."""
    fold = SchedulerFold(config.scheduler)
    partitions = config.partitions
    if partition_of is None:
        def partition_of(key: bytes) -> int:
            return partition_for(key, partitions)
    job_partition = partition_of

    def admit(rec: LogRecord, cmd: Record) -> list[Output] | None:
        """A job lives on one partition: its commands are keyed by its ID and go to its partition.

        A SubmitJob without a valid ``traceparent`` field takes its record's ``traceparent`` header
        (an upstream producer's, on Kafka) into the command here, before the fold: the JobAccepted
        event keeps it, so the spans built from the events, and a replay of them, are the same."""
        if rec.headers and cmd["type"] == "dagfold.command.SubmitJob" and not clean_traceparent(cmd.get(TRACEPARENT)):
            cmd[TRACEPARENT] = traceparent_of(rec.headers)
        try:
            job_id = job_id_of(cmd)
        except KeyError:
            return [dead_letter(rec, f"{cmd['type']} is not a scheduler command", "scheduler")]
        if rec.key != job_id.encode():
            return [dead_letter(rec, f"record key {rec.key!r} is not the job ID {job_id!r}", "scheduler")]
        why = wrong_topic(rec.topic, cmd["type"])
        if why is not None:
            return [dead_letter(rec, why, "scheduler")]
        return forward_misrouted(rec, cmd, job_id, job_partition)

    def fold_for(partition: int, store: Store) -> SchedulerFold:
        return fold  # stateless: every partition's state is in its transaction

    def topic_for(topic: str) -> TopicSpec | None:
        if topic.startswith(DISPATCH_PREFIX):
            return config.dispatch_spec(topic[len(DISPATCH_PREFIX):])
        return None

    return ProcessorSpec(
        service="scheduler", commands=COMMANDS, events=EVENTS, group=SCHEDULER_GROUP,
        transactional_id=f"dagfold-scheduler-{instance_id}", fold_for=fold_for, admit=admit,
        events_partition=_same_partition, timers=SCHEDULER_TIMERS,
        store_path=lambda p: config.data_dir / "scheduler" / f"p{p:04d}", topic_for=topic_for,
        # dispatch records go out before the commit, at least once (docs/semantics.md, Dispatch):
        # a share group's client (librdkafka 2.16) can leave a transaction marker unacknowledged
        before_commit=lambda topic: topic.startswith(DISPATCH_PREFIX),
        create_topics=config.core_topics(), batch_max_records=config.scheduler.batch_max_records,
        poll_timeout_s=config.scheduler.poll_timeout_s, commit_interval_s=config.scheduler.commit_interval_s,
        on_committed=_record_events, cache_values=SchedulerFold.CACHE_VALUES, inputs=(SCHEDULER_INTERNAL,))


class SchedulerRunner(PartitionProcessor):
    """One scheduler instance: owns the command partitions the group assigns it."""

    def __init__(self, log_: Log, config: Config, instance_id: str = "0") -> None:
        def partition_of(key: bytes) -> int:
            return log_.partition_for(key, log_.partitions(COMMANDS))

        super().__init__(log_, scheduler_spec(config, instance_id, partition_of), f"scheduler-{instance_id}")
        self.config = config
        self.instance_id = instance_id
