"""The context a scheduler command is decided in (``Ctx``), and the two small helpers every family of
handlers shares: stopping an attempt wherever it runs, and its lease timeout.

A handler reads state, emits events through ``Ctx.event`` (each applied at once by ``appliers``), and may
emit side outputs: dispatch records for workers, control records (StopTask), allocator commands. It never
writes state directly, never reads a clock (``ctx.now_ms`` is an input) and never does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dagfold.codec import Record
from dagfold.config import ALLOCATOR_COMMANDS, CONTROL, EVENTS, SchedulerOptions
from dagfold.jobspec import is_gpu
from dagfold.lifecycle import TaskState
from dagfold.outputs import Output
from dagfold.processor.fold import FoldContext
from dagfold.services.allocator import commands as alloc_cmds
from dagfold.services.scheduler.appliers import apply_event
from dagfold.state import PartitionTransaction

E = "dagfold.event."


@dataclass
class Ctx(FoldContext):
    """A scheduler command's context: the partition's transaction, and its events applied at once."""

    txn: PartitionTransaction
    now_ms: int
    offset: int
    opts: SchedulerOptions
    out: list[Output] = field(default_factory=list)

    def event(self, name: str, job_id: str, **fields: Any) -> Record:
        rec: Record = {"type": E + name, "job_id": job_id, "ts_ms": self.now_ms,
                       "cause_offset": self.offset, **fields}
        apply_event(self.txn, rec)
        self.out.append(Output(EVENTS, job_id, rec))
        return rec

    def stop_task(self, worker_id: str | None, job_id: str, task_id: str, attempt: int, reason: str) -> None:
        if not worker_id:
            return
        self.emit(CONTROL, worker_id, {
            "type": "dagfold.control.StopTask", "worker_id": worker_id, "job_id": job_id,
            "task_id": task_id, "attempt": attempt, "reason": reason, "ts_ms": self.now_ms})


def stop_attempt(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], reason: str) -> None:
    """Stop the task's current attempt wherever it is: a worker's (StopTask to the lease holder), or a
    GPU attempt's (CancelRequest to its pool: drops the queued request or releases the allocation,
    whose agents the allocator stops)."""
    if is_gpu(t):
        if t["state"] in (TaskState.RUNNABLE, TaskState.RUNNING):
            ctx.emit(ALLOCATOR_COMMANDS, t["queue"], alloc_cmds.cancel_request(
                t["queue"], job_id, task_id, reason, ts_ms=ctx.now_ms, attempt=t["attempt"]))
    elif t["state"] == TaskState.RUNNING:
        ctx.stop_task(t["worker"], job_id, task_id, t["attempt"], reason)


def lease_timeout_ms(ctx: Ctx, t: Mapping[str, Any]) -> int:
    hb = (t["timeouts"] or {}).get("heartbeat_s") or ctx.opts.lease_timeout_s
    return int(hb * 1000)
