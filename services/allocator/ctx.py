"""The context a processor decides in: state, clock input, and the outputs it collects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dagfold.codec import Record
from dagfold.config import ALLOCATOR_EVENTS, CONTROL, SCHEDULER_INTERNAL
from dagfold.outputs import Output
from dagfold.processor.fold import FoldContext
from dagfold.services.allocator.appliers import A, apply_event
from dagfold.services.allocator.model import AllocView
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.state import PoolState


@dataclass(slots=True)
class Ctx(FoldContext):
    """An allocator command's context: the pool's state (bound to the transaction), options, counters."""

    st: PoolState
    now_ms: int
    offset: int
    opts: AllocatorOptions
    out: list[Output] = field(default_factory=list)
    attempts: int = 0  # placement attempts in this command (the simulator's decision count)
    granted: int = 0
    examine_limit: int = 0

    def event(self, name: str, **fields: Any) -> Record:
        rec: Record = {"type": A + name, "pool": self.opts.pool, "ts_ms": self.now_ms,
                       "cause_offset": self.offset, **fields}
        apply_event(self.st, rec)
        self.out.append(Output(ALLOCATOR_EVENTS, self.opts.pool, rec))
        return rec

    def notify(self, status: str, job_id: str, task_id: str, attempt: int, *, alloc_id: str | None = None,
               epoch: int = 0, hosts: list[Record] | None = None, reason: str = "",
               checkpoint_uri: str | None = None) -> None:
        """Tell the scheduler what happened to a task's request: a TaskAllocation command into the job's
        partition of ``scheduler.internal`` (the allocator is one writer per pool, the scheduler one per
        job partition, so the decision crosses as a command, like Zeebe's inter-partition commands; on a
        topic only allocators may write, since a grant on ``commands`` could come from anyone)."""
        if not self.opts.notify_scheduler:
            return
        self.emit(SCHEDULER_INTERNAL, job_id, {
            "type": "dagfold.command.TaskAllocation", "job_id": job_id, "task_id": task_id, "attempt": attempt,
            "pool": self.opts.pool, "ts_ms": self.now_ms, "status": status, "alloc_id": alloc_id, "epoch": epoch,
            "hosts": hosts or [], "reason": reason, "checkpoint_uri": checkpoint_uri, "cause_offset": self.offset})

    def stop(self, a: AllocView, reason: str, *, checkpoint: bool = False, deadline_ms: int | None = None,
             nodes: list[str] | None = None) -> None:
        """Tell the agents holding ``a`` (or only ``nodes``) to stop it, checkpointing first if asked.

        A checkpointing stop of the whole allocation is also told to the scheduler (TaskAllocation
        ``checkpointing``), which records it as the job's TaskCheckpointing event."""
        if checkpoint and nodes is None:
            self.notify("checkpointing", a.req.job_id, a.req.task_id, a.req.attempt, alloc_id=a.id,
                        epoch=a.epoch, reason=reason)
        for p in a.parts:
            if nodes is not None and p.node not in nodes:
                continue
            self.emit(CONTROL, p.node, {
                "type": A + "StopAllocation", "pool": self.opts.pool, "node_id": p.node, "alloc_id": a.id,
                "epoch": a.epoch, "job_id": a.req.job_id, "task_id": a.req.task_id, "attempt": a.req.attempt,
                "reason": reason, "checkpoint": checkpoint, "deadline_ms": deadline_ms, "ts_ms": self.now_ms})

    def fence(self, node_id: str, alloc_id: str, epoch: int, reason: str) -> None:
        """Stop a process the allocator does not know (stale epoch, lost node): no state involved."""
        self.emit(CONTROL, node_id, {
            "type": A + "StopAllocation", "pool": self.opts.pool, "node_id": node_id, "alloc_id": alloc_id,
            "epoch": epoch, "job_id": "", "task_id": "", "attempt": 0, "reason": reason, "checkpoint": False,
            "deadline_ms": None, "ts_ms": self.now_ms})
