"""What a fold hands its I/O shell: records to produce, and dead letters.

Every fold (scheduler, allocator) returns ``Output``s; the runner produces
them in one log transaction. One type for all of them keeps the runners,
harnesses and simulators interchangeable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dagfold.clock import now_ms
from dagfold.codec import Record
from dagfold.config import DEADLETTER
from dagfold.log.base import LogRecord


@dataclass(slots=True)
class Output:
    """A record to produce: topic, key (job ID, pool, node or worker ID, per topic) and the record."""

    topic: str
    key: str
    record: Record


def forward_misrouted(rec: LogRecord, command: Record, job_id: str,
                      job_partition: Callable[[bytes], int]) -> list[Output] | None:
    """The command again, for its job's partition, if ``rec`` arrived on another one (else None).

    A producer with another partitioner (or another partition count in mind) than the
    deployment's still gets its command folded: the runner produces this output in the same
    transaction that commits the misrouted record's offset, so it is folded exactly once,
    on the partition that owns the job. Keyed by job ID, so the log routes it right.
    """
    if job_partition(job_id.encode()) == rec.partition:
        return None
    return [Output(rec.topic, job_id, command)]  # commands, or the partitioned-alike scheduler.internal


def dead_letter(rec: LogRecord, reason: str, service: str) -> Output:
    """The DeadLetter for a record no fold could take, with the reason, for ``deadletter``."""
    return Output(DEADLETTER, f"{rec.topic}/{rec.partition}", {
        "type": "dagfold.deadletter.DeadLetter", "source_topic": rec.topic, "partition": rec.partition,
        "offset": rec.offset, "key": rec.key, "value": rec.value, "reason": reason, "service": service,
        "ts_ms": now_ms()})
