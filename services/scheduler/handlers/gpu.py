"""Handler of the allocator's word on a GPU attempt: TaskAllocation (granted, checkpointing, requeued,
rejected, ended). The request itself is sent by ``runnable.make_runnable``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagfold.codec import Record
from dagfold.config import ALLOCATOR_COMMANDS, CONTROL
from dagfold.jobspec import is_gpu
from dagfold.lifecycle import JOB_OPEN, TaskState
from dagfold.lifecycle import TASK_TERMINAL as TERMINAL
from dagfold.services.allocator import commands as alloc_cmds
from dagfold.services.scheduler.appliers import read_job, read_task
from dagfold.services.scheduler.context import Ctx, lease_timeout_ms
from dagfold.services.scheduler.handlers.registry import handles
from dagfold.services.scheduler.handlers.reports import not_current
from dagfold.services.scheduler.outcomes import fail_attempt
from dagfold.tracing import attempt_traceparent


def _gpu_dispatch(ctx: Ctx, cmd: Record, t: Mapping[str, Any], tenant: str) -> None:
    """The grant's hosts get the attempt on control, keyed by node; the first host reports it.

    It resumes from the checkpoint the scheduler knows for this task (``t["ckpt"]``: the one it asked
    the pool to resume from, or its own requeue's), never from a URI the grant carries."""
    lease_s = lease_timeout_ms(ctx, t) / 1000
    for i, h in enumerate(cmd["hosts"]):
        ctx.emit(CONTROL, h["node_id"], {
            "type": "dagfold.control.GpuTaskDispatch", "node_id": h["node_id"], "pool": cmd["pool"],
            "alloc_id": cmd["alloc_id"], "epoch": cmd["epoch"], "job_id": cmd["job_id"], "task_id": cmd["task_id"],
            "attempt": cmd["attempt"], "tenant": tenant, "handler": t["handler"], "args_json": t["args"],
            "gpu_indices": list(h["gpu_indices"]), "leader": i == 0, "resume_checkpoint": t.get("ckpt"),
            "lease_timeout_s": lease_s, "ts_ms": ctx.now_ms,
            "traceparent": attempt_traceparent(cmd["job_id"], cmd["task_id"], cmd["attempt"], t.get("tp", ""))})


def _grant_mismatch(t: Mapping[str, Any], cmd: Record) -> str | None:
    """Why a grant does not answer the request the scheduler made for the attempt (its pool, its shape:
    ``hosts`` distinct hosts of ``gpus`` distinct GPUs each); None if it does."""
    res = t["resources"]
    if cmd["pool"] != t["queue"]:
        return f"granted by pool {cmd['pool']!r}; the request went to {t['queue']!r}"
    hosts = cmd["hosts"]
    nodes = {h["node_id"] for h in hosts}
    if len(hosts) != res["hosts"] or len(nodes) != len(hosts):
        return f"grant names {len(hosts)} host(s) ({len(nodes)} distinct); the request asked for {res['hosts']}"
    for h in hosts:
        if len(set(h["gpu_indices"])) != len(h["gpu_indices"]) or len(h["gpu_indices"]) != res["gpus"]:
            return (f"grant names GPUs {list(h['gpu_indices'])[:16]} on {h['node_id']}; the request asked for "
                    f"{res['gpus']} per host")
    return None


def _allocation_mismatch(t: Mapping[str, Any], status: str, alloc: str | None, epoch: int) -> str | None:
    """Why an allocation decision does not apply to the task's current attempt; None if it does.

    A grant no newer than the task's last one is stale: a redelivered grant of an allocation the pool
    has since requeued would otherwise wait for a start that never comes, and turn away every later grant."""
    if not is_gpu(t):
        return "task asks for no GPUs"
    if status in ("granted", "rejected") and (t["state"] != TaskState.RUNNABLE or t.get("alloc")):
        return f"task is {t['state']} with allocation {t.get('alloc')}"
    if status == "granted" and epoch <= (t.get("epoch") or 0):
        return f"grant epoch {epoch} is not newer than the task's last grant's ({t.get('epoch')})"
    if status in ("requeued", "ended", "checkpointing") and t.get("alloc") != alloc:
        return f"allocation {alloc} is not the attempt's ({t.get('alloc')})"
    if status not in ("granted", "rejected", "requeued", "ended", "checkpointing"):
        return f"unknown allocation status {status!r}"
    return None


@handles("dagfold.command.TaskAllocation")
def task_allocation(ctx: Ctx, cmd: Record) -> None:
    """The allocator's word on a GPU attempt's request: granted, requeued, rejected or ended.

    Only the current attempt's current allocation counts. An attempt that ended
    by a timeout, a failure or a cancel already sent its pool a CancelRequest,
    which the allocator folds after this decision; a task that ended otherwise
    (its success crossed a preemption) gets one now.
    """
    job_id, task_id, attempt, status = cmd["job_id"], cmd["task_id"], cmd["attempt"], cmd["status"]
    t = read_task(ctx.txn, job_id, task_id)
    j = read_job(ctx.txn, job_id)
    alloc = cmd["alloc_id"]
    why = not_current(t, j, attempt)
    if why is None and t is not None:
        why = _allocation_mismatch(t, status, alloc, cmd["epoch"])
    if why is None and t is not None and status == "granted":
        why = _grant_mismatch(t, cmd)
    if why is not None or t is None or j is None:
        ctx.event("ReportIgnored", job_id, task_id=task_id, attempt=attempt, worker_id=alloc or "",
                  report=f"allocation {status}", reason=why or "")
        over = t is None or j is None or j["state"] not in JOB_OPEN or t["state"] in TERMINAL
        if over and status in ("granted", "requeued"):
            # the task ended without its pool hearing (it succeeded while its allocation was being
            # preempted): free the GPUs or the queue slot; no later attempt of it can be hurt
            ctx.emit(ALLOCATOR_COMMANDS, cmd["pool"], alloc_cmds.cancel_request(
                cmd["pool"], job_id, task_id, f"task ended: {why}", ts_ms=ctx.now_ms))
        return
    if status == "granted":
        ctx.event("TaskAllocated", job_id, task_id=task_id, attempt=attempt, pool=cmd["pool"], alloc_id=alloc,
                  epoch=cmd["epoch"], node_ids=[h["node_id"] for h in cmd["hosts"]],
                  resume_checkpoint=t.get("ckpt"))
        _gpu_dispatch(ctx, cmd, t, j["tenant"])
    elif status == "checkpointing":
        ctx.event("TaskCheckpointing", job_id, task_id=task_id, attempt=attempt, alloc_id=alloc,
                  reason=cmd["reason"], checkpoint_uri=cmd["checkpoint_uri"])
    elif status == "requeued":
        ctx.event("TaskRequeued", job_id, task_id=task_id, attempt=attempt, alloc_id=alloc,
                  reason=cmd["reason"], checkpoint_uri=cmd["checkpoint_uri"])
    elif status == "rejected":
        fail_attempt(ctx, job_id, task_id, t, worker="", reason=f"allocation rejected: {cmd['reason']}",
                     error_type="allocation_rejected", retryable=False)
    else:
        fail_attempt(ctx, job_id, task_id, t, worker=alloc or "", reason=f"allocation ended: {cmd['reason']}",
                     error_type="allocation_ended")
