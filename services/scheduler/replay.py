"""Audit replay: rebuild scheduler state (and the read model) from the events log alone.

Replay applies events only, through the same appliers as the live fold, so a
full replay must equal the live state byte for byte; ``verify`` proves it with
a digest per partition and, where a partition differs, per job.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagfold.codec import default_codec
from dagfold.config import EVENTS
from dagfold.exceptions import CodecError
from dagfold.log import Log, LogRecord, TopicPartition, partition_for
from dagfold.log.base import Partitioner
from dagfold.log.reader import read_to_end
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.fold import SchedulerFold
from dagfold.state import PartitionStore, PartitionTransaction, Store
from dagfold.state.store import state_digest

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ReplayFilter:
    """What to rebuild and what to report: one job (or all), and a log-time window [from_ms, to_ms].

    State is always rebuilt from the start of the log: every event of the chosen job(s) up to
    ``to_ms`` is applied, so a job accepted before ``from_ms`` is in the rebuilt state and read
    model. ``from_ms`` only selects which of the applied events are *reported* (the audit window).
    ``to_ms`` ends each partition at its first event later than ``to_ms`` (a prefix of the log by
    offset, so the state is exactly "the partition as of then", even if a failover left a
    timestamp out of order).
    """

    from_ms: int | None = None
    to_ms: int | None = None
    job_id: str | None = None

    def __post_init__(self) -> None:
        if self.from_ms is not None and self.to_ms is not None and self.from_ms > self.to_ms:
            raise ValueError(f"the window is empty: --from ({self.from_ms}) is after --to ({self.to_ms})")

    def of_job(self, rec: LogRecord) -> bool:
        return self.job_id is None or rec.key == self.job_id.encode()

    def past_end(self, rec: LogRecord) -> bool:
        return self.to_ms is not None and rec.timestamp_ms > self.to_ms

    def in_window(self, rec: LogRecord) -> bool:
        return self.from_ms is None or rec.timestamp_ms >= self.from_ms


@dataclass
class ReplayResult:
    """``applied``: events folded per partition (from the start); ``window``: those in [from, to]."""

    applied: dict[int, int] = field(default_factory=dict)
    skipped_undecodable: int = 0
    window: int = 0
    window_by_type: dict[str, int] = field(default_factory=dict)
    window_jobs: set[str] = field(default_factory=set)
    window_offsets: dict[int, tuple[int, int]] = field(default_factory=dict)  # partition -> (first, last)

    @property
    def total(self) -> int:
        return sum(self.applied.values())


WindowSink = Callable[[LogRecord, dict[str, Any]], None]


def replay(log: Log, out_dir: Path, partitions: int, filt: ReplayFilter = ReplayFilter(),
           progress: Progress | None = None, with_read_model: bool = True,
           on_window_event: WindowSink | None = None) -> ReplayResult:
    """Apply the events topic into fresh stores under ``out_dir`` (scheduler/pNNNN, projections).

    ``on_window_event`` is called with each applied event inside the window (record and decoded event).
    """
    codec = default_codec()
    result = ReplayResult()
    projector = None
    if with_read_model:
        from dagfold.projections.projector import Projector

        projector = Projector(log, out_dir / "projections")
    try:
        for p in range(partitions):
            if filt.job_id is not None and p != log.partition_for(filt.job_id.encode(), partitions):
                continue
            store = PartitionStore(out_dir / "scheduler" / f"p{p:04d}")
            n = 0
            for recs in read_to_end(log, TopicPartition(EVENTS, p)):
                end = next((i for i, r in enumerate(recs) if filt.past_end(r)), None)
                batch = recs if end is None else recs[:end]
                chosen = [r for r in batch if filt.of_job(r)]
                txn = PartitionTransaction(store)
                for r in chosen:
                    try:
                        ev = codec.decode(r.value)
                    except CodecError:
                        result.skipped_undecodable += 1
                        continue
                    SchedulerFold.apply(txn, ev)
                    if filt.in_window(r):
                        _count_window(result, p, r, ev)
                        if on_window_event is not None:
                            on_window_event(r, ev)
                if batch:
                    txn.commit(applied_events=batch[-1].offset)
                if projector is not None and chosen:
                    projector.apply_records(chosen)
                n += len(chosen)
                if progress:
                    progress(len(recs))
                if end is not None:
                    break  # the rest of this partition is after --to
            result.applied[p] = n
            store.close()
    finally:
        if projector is not None:
            projector.close()
    return result


def _count_window(result: ReplayResult, p: int, r: LogRecord, ev: dict[str, Any]) -> None:
    result.window += 1
    t = str(ev["type"]).rsplit(".", 1)[-1]
    result.window_by_type[t] = result.window_by_type.get(t, 0) + 1
    if r.key:
        result.window_jobs.add(r.key.decode(errors="replace"))
    first = result.window_offsets.get(p, (r.offset, r.offset))[0]
    result.window_offsets[p] = (first, r.offset)


def job_digest(store: Store, job_id: str) -> str:
    """Digest of every key that belongs to one job (job, task list, tasks, dependents, timers)."""
    h = hashlib.sha256()
    s = keys.S
    for start in (keys.job(job_id), keys.task_list(job_id)):
        v = store.raw_get(start)
        h.update(start + b"=" + (v or b"-"))
    for prefix in (f"t{s}{job_id}{s}".encode(), f"d{s}{job_id}{s}".encode()):
        for k, v in store.range(prefix, prefix + b"\xff"):
            h.update(k + b"=" + v)
    for k, v in store.range(keys.TIMER_PREFIX, keys.TIMER_PREFIX + b"\xff"):
        if keys.parse_timer(k)[1] == job_id:
            h.update(k + b"=" + v)
    return h.hexdigest()


def job_ids(store: Store) -> set[str]:
    prefix = f"j{keys.S}".encode()
    return {k[len(prefix):].decode() for k, _ in store.range(prefix, prefix + b"\xff")}


@dataclass(frozen=True)
class Difference:
    partition: int
    job_id: str | None
    what: str


def verify(live_dir: Path, replay_dir: Path, partitions: int, job_id: str | None = None,
           partitioner: Partitioner = partition_for) -> list[Difference]:
    """Compare live scheduler state with a replay: digests per partition, then per job
    (``partitioner``: the log's, ``log.partition_for``, which finds ``job_id``'s partition)."""
    diffs: list[Difference] = []
    for p in range(partitions):
        if job_id is not None and p != partitioner(job_id.encode(), partitions):
            continue
        live_path = live_dir / "scheduler" / f"p{p:04d}"
        rep_path = replay_dir / "scheduler" / f"p{p:04d}"
        if not live_path.exists():
            if rep_path.exists() and job_ids(PartitionStore(rep_path, read_only=True)):
                diffs.append(Difference(p, None, "no live state for this partition"))
            continue
        live, rep = PartitionStore(live_path, read_only=True), PartitionStore(rep_path, read_only=True)
        try:
            if job_id is not None:
                if job_digest(live, job_id) != job_digest(rep, job_id):
                    diffs.append(Difference(p, job_id, "job state differs"))
                continue
            if state_digest(live) == state_digest(rep):
                continue
            lj, rj = job_ids(live), job_ids(rep)
            diffs += [Difference(p, j, "job only in live state") for j in sorted(lj - rj)]
            diffs += [Difference(p, j, "job only in replay") for j in sorted(rj - lj)]
            diffs += [Difference(p, j, "job state differs") for j in sorted(lj & rj)
                      if job_digest(live, j) != job_digest(rep, j)]
            if not diffs or diffs[-1].partition != p:
                diffs.append(Difference(p, None, "partition state differs outside job keys"))
        finally:
            live.close()
            rep.close()
    return diffs
