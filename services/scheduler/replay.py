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

from dagfold.codec import default_codec
from dagfold.config import EVENTS
from dagfold.exceptions import CodecError
from dagfold.log import Log, LogRecord, TopicPartition, partition_for
from dagfold.log.reader import read_to_end
from dagfold.state import PartitionStore, PartitionTransaction, Store
from dagfold.state.store import state_digest
from services.scheduler import keys
from services.scheduler.fold import SchedulerFold

Progress = Callable[[int], None]


@dataclass(frozen=True)
class ReplayFilter:
    """Which events to apply: a log-time window (ms) and/or one job."""

    from_ms: int | None = None
    to_ms: int | None = None
    job_id: str | None = None

    def accepts(self, rec: LogRecord) -> bool:
        if self.from_ms is not None and rec.timestamp_ms < self.from_ms:
            return False
        if self.to_ms is not None and rec.timestamp_ms > self.to_ms:
            return False
        return self.job_id is None or rec.key == self.job_id.encode()


@dataclass
class ReplayResult:
    applied: dict[int, int] = field(default_factory=dict)
    skipped_undecodable: int = 0

    @property
    def total(self) -> int:
        return sum(self.applied.values())


def replay(log: Log, out_dir: Path, partitions: int, filt: ReplayFilter = ReplayFilter(),
           progress: Progress | None = None, with_read_model: bool = True) -> ReplayResult:
    """Apply the events topic into fresh stores under ``out_dir`` (scheduler/pNNNN, projections)."""
    codec = default_codec()
    result = ReplayResult()
    projector = None
    if with_read_model:
        from projections.projector import Projector

        projector = Projector(log, out_dir / "projections")
    try:
        for p in range(partitions):
            if filt.job_id is not None and p != partition_for(filt.job_id.encode(), partitions):
                continue
            store = PartitionStore(out_dir / "scheduler" / f"p{p:04d}")
            n = 0
            for recs in read_to_end(log, TopicPartition(EVENTS, p)):
                chosen = [r for r in recs if filt.accepts(r)]
                txn = PartitionTransaction(store)
                for r in chosen:
                    try:
                        SchedulerFold.apply(txn, codec.decode(r.value))
                    except CodecError:
                        result.skipped_undecodable += 1
                txn.commit(applied_events=recs[-1].offset)
                if projector is not None and chosen:
                    projector.apply_records(chosen)
                n += len(chosen)
                if progress:
                    progress(len(recs))
            result.applied[p] = n
            store.close()
    finally:
        if projector is not None:
            projector.close()
    return result


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


def verify(live_dir: Path, replay_dir: Path, partitions: int, job_id: str | None = None) -> list[Difference]:
    """Compare live scheduler state with a replay: digests per partition, then per job."""
    diffs: list[Difference] = []
    for p in range(partitions):
        if job_id is not None and p != partition_for(job_id.encode(), partitions):
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
