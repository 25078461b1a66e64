"""Handlers of an operator's decisions on one task: RetryTask, MarkTaskSucceeded (the rules of
``lifecycle.task_action_refusal``, the API's too)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagfold.codec import Record
from dagfold.jobspec import still_skipped
from dagfold.lifecycle import JOB_OPEN, TaskState, task_action_refusal
from dagfold.rules import MAX_REASON_LEN
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.appliers import get_dependents, read_job, read_task
from dagfold.services.scheduler.context import Ctx
from dagfold.services.scheduler.handlers.registry import handles
from dagfold.services.scheduler.outcomes import finish_job_if_done, propagate, rerun


def _refuse(ctx: Ctx, cmd: Record, action: str, code: str, reason: str) -> None:
    ctx.event("TaskActionRejected", cmd["job_id"], task_id=cmd["task_id"], action=action, code=code,
              reason=reason, requested_by=(cmd.get("requested_by") or "")[:MAX_REASON_LEN])


def _action_target(ctx: Ctx, cmd: Record, action: str) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    """The job and task an operator's command acts on, or None after a TaskActionRejected saying why
    (the rules of ``lifecycle.task_action_refusal``, the API's too)."""
    job_id, task_id = cmd["job_id"], cmd["task_id"]
    for name in ("reason", "requested_by"):  # copied into events: bounded as the API bounds them
        if len(cmd.get(name) or "") > MAX_REASON_LEN:
            _refuse(ctx, cmd, action, "invalid_command", f"{name} longer than {MAX_REASON_LEN} characters")
            return None
    j = read_job(ctx.txn, job_id)
    t = read_task(ctx.txn, job_id, task_id) if j is not None else None
    why = task_action_refusal(action, job_id, j["state"] if j is not None else None, task_id,
                              t["state"] if t is not None else None, t["attempt"] if t is not None else 0)
    if why is not None or j is None or t is None:
        code, reason = why or ("unknown_task", "unknown job or task")
        _refuse(ctx, cmd, action, code, reason)
        return None
    return j, t


def reopen_set(ctx: Ctx, job_id: str, task_id: str, j: Mapping[str, Any]) -> list[str]:
    """The task, then every task downstream of it that is skipped or cancelled (through such tasks only:
    what its outcome skipped), in the order found. O(out-degree) of the task and of each task found.

    In a job that fail_fast ended, the other tasks fail_fast cancelled when a task failed run again
    too: one pass over the job's task list, as fail_fast's own cancel was, and only when cancelled tasks
    remain outside the downstream set (the job record counts them).
    """
    found, seen, work = [task_id], {task_id}, [task_id]
    cancelled = 0
    while work:
        for d in get_dependents(ctx.txn, job_id, work.pop()):
            if d in seen:
                continue
            dt = read_task(ctx.txn, job_id, d)
            if dt is not None and dt["state"] in (TaskState.SKIPPED, TaskState.CANCELLED):
                cancelled += dt["state"] == TaskState.CANCELLED
                seen.add(d)
                found.append(d)
                work.append(d)
    t = read_task(ctx.txn, job_id, task_id)
    cancelled += t is not None and t["state"] == TaskState.CANCELLED
    if j["policy"] == "fail_fast" and j["state"] not in JOB_OPEN and j["cancelled"] > cancelled:
        for tid in ctx.txn.get(keys.task_list(job_id)) or []:
            if tid not in seen:
                ot = read_task(ctx.txn, job_id, tid)
                if ot is not None and ot["state"] == TaskState.CANCELLED:
                    found.append(tid)
    return found


@handles("dagfold.command.RetryTask")
def retry_task(ctx: Ctx, cmd: Record) -> None:
    """Run a failed (or skipped, cancelled) task again with a fresh retry budget, re-opening what its
    outcome skipped downstream; the job runs again. Attempt numbers keep counting (fencing)."""
    target = _action_target(ctx, cmd, "retry")
    if target is None:
        return
    j, t = target
    job_id, task_id = cmd["job_id"], cmd["task_id"]
    why = still_skipped(task_id, t)
    if why is not None:
        _refuse(ctx, cmd, "retry", *why)
        return
    reopened = reopen_set(ctx, job_id, task_id, j)
    ctx.event("TaskReopened", job_id, task_id=task_id, task_ids=reopened, action="retry",
              requested_by=cmd.get("requested_by") or "", reason=cmd.get("reason") or "")
    rerun(ctx, job_id, reopened, j["tenant"], f"after the retry of {task_id}")
    finish_job_if_done(ctx, job_id)


@handles("dagfold.command.MarkTaskSucceeded")
def mark_task_succeeded(ctx: Ctx, cmd: Record) -> None:
    """Record a failed, skipped or cancelled task as succeeded without running it (an operator's word,
    said so in the event); what its outcome skipped downstream is re-opened, its dependents decide again."""
    target = _action_target(ctx, cmd, "mark_succeeded")
    if target is None:
        return
    j, t = target
    job_id, task_id = cmd["job_id"], cmd["task_id"]
    by, reason = cmd.get("requested_by") or "", cmd.get("reason") or ""
    reopened = reopen_set(ctx, job_id, task_id, j)
    ctx.event("TaskReopened", job_id, task_id=task_id, task_ids=reopened, action="mark_succeeded",
              requested_by=by, reason=reason)
    ctx.event("TaskMarkedSucceeded", job_id, task_id=task_id, attempt=t["attempt"], requested_by=by,
              reason=reason)
    rerun(ctx, job_id, reopened[1:], j["tenant"], f"after {task_id} was marked succeeded")
    propagate(ctx, job_id, task_id, TaskState.SUCCEEDED)
