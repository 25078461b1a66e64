"""Handlers of a worker's (or a GPU grant's) reports on an attempt: TaskStarted, TaskHeartbeat,
TaskSucceeded, TaskFailed, TaskReleased. Only the current attempt's lease holder is heard; anything else is
recorded (ReportIgnored, LeaseRejected) and changes nothing."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dagfold.codec import Record
from dagfold.jobspec import is_gpu
from dagfold.lifecycle import JOB_OPEN, TaskState
from dagfold.services.scheduler.appliers import read_job, read_task
from dagfold.services.scheduler.context import Ctx, lease_timeout_ms
from dagfold.services.scheduler.handlers.registry import handles
from dagfold.services.scheduler.outcomes import fail_attempt, propagate, reclaim_lease


def not_current(t: Mapping[str, Any] | None, j: Mapping[str, Any] | None, attempt: int) -> str | None:
    """Why a record about ``attempt`` concerns no live attempt (unknown, job over, stale); None if it does."""
    if t is None or j is None:
        return "unknown job or task"
    if j["state"] not in JOB_OPEN:
        return f"job is {j['state']}"
    if attempt != t["attempt"]:
        return f"stale attempt {attempt}; current attempt is {t['attempt']}"
    return None


def _report_target(ctx: Ctx, cmd: Record, report: str, t: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``t`` (the command's task, as the caller read it) if ``cmd`` comes from the current lease holder;
    else record why not and return None."""
    job_id, task_id, attempt, worker = cmd["job_id"], cmd["task_id"], cmd["attempt"], cmd["worker_id"]
    if t is None:
        why = "unknown job or task"
    elif attempt != t["attempt"]:
        why = f"stale attempt {attempt}; current attempt is {t['attempt']}"
    elif t["state"] != TaskState.RUNNING:
        why = f"task is {t['state']}"
    elif t["worker"] != worker:
        why = f"attempt is leased to {t['worker']}"
    else:
        return t
    ctx.event("ReportIgnored", job_id, task_id=task_id, attempt=attempt, worker_id=worker,
              report=report, reason=why)
    return None


@handles("dagfold.command.TaskStarted")
def task_started(ctx: Ctx, cmd: Record) -> None:
    job_id, task_id, attempt, worker = cmd["job_id"], cmd["task_id"], cmd["attempt"], cmd["worker_id"]
    t = read_task(ctx.txn, job_id, task_id)
    why = not_current(t, read_job(ctx.txn, job_id), attempt)
    if why is None and t is not None:
        if t["state"] == TaskState.RUNNABLE and (not is_gpu(t) or t.get("alloc") == worker):
            ctx.event("LeaseGranted", job_id, task_id=task_id, attempt=attempt, worker_id=worker,
                      lease_deadline_ms=ctx.now_ms + lease_timeout_ms(ctx, t))
            return
        if t["state"] == TaskState.RUNNING and t["worker"] == worker:
            ctx.event("ReportIgnored", job_id, task_id=task_id, attempt=attempt, worker_id=worker,
                      report="started", reason="duplicate start of the leased attempt")
            return
        if t["state"] == TaskState.RUNNING:
            why = f"attempt {attempt} is already leased to {t['worker']}"
        elif t["state"] == TaskState.RUNNABLE:  # a GPU task: only its current grant may start it
            why = f"allocation {worker} is not the attempt's grant ({t.get('alloc') or 'none yet'})"
        else:
            why = f"task is {t['state']}"
    ctx.event("LeaseRejected", job_id, task_id=task_id, attempt=attempt, worker_id=worker, reason=why or "")
    if t is None or not is_gpu(t):  # a GPU process is stopped by its allocation's fencing, not by worker ID
        ctx.stop_task(worker, job_id, task_id, attempt, f"lease_rejected: {why}")


@handles("dagfold.command.TaskHeartbeat")
def task_heartbeat(ctx: Ctx, cmd: Record) -> None:
    progress = cmd["progress"]
    if progress is not None and not (math.isfinite(progress) and 0.0 <= progress <= 1.0):
        # Avro doubles carry NaN and infinities: a hostile or buggy producer's number changes nothing
        ctx.event("ReportIgnored", cmd["job_id"], task_id=cmd["task_id"], attempt=cmd["attempt"],
                  worker_id=cmd["worker_id"], report="heartbeat",
                  reason=f"progress must be a finite number in [0, 1], got {progress!r}")
        return
    t = _report_target(ctx, cmd, "heartbeat", read_task(ctx.txn, cmd["job_id"], cmd["task_id"]))
    if t is None:
        return
    ctx.event("LeaseExtended", cmd["job_id"], task_id=cmd["task_id"], attempt=cmd["attempt"],
              worker_id=cmd["worker_id"], lease_deadline_ms=ctx.now_ms + lease_timeout_ms(ctx, t),
              progress=cmd["progress"])


def _start_if_unstarted(ctx: Ctx, cmd: Record) -> Mapping[str, Any] | None:
    """An outcome for the current attempt while it is still runnable: a worker that finished the task
    before its start report went out (an instant handler such as ``noop``) reports once, and the
    lease is granted here first. The events are those of a start and an outcome (LeaseGranted, then
    TaskSucceeded or TaskFailed), so projections, history and replay do not tell the two apart; a
    GPU task is started only by its grant's TaskStarted."""
    t = read_task(ctx.txn, cmd["job_id"], cmd["task_id"])
    if t is not None and t["state"] == TaskState.RUNNABLE and t["attempt"] == cmd["attempt"] and not is_gpu(t):
        task_started(ctx, cmd)
        t = read_task(ctx.txn, cmd["job_id"], cmd["task_id"])
    return t  # the task as it stands now


@handles("dagfold.command.TaskSucceeded")
def task_succeeded(ctx: Ctx, cmd: Record) -> None:
    if _report_target(ctx, cmd, "succeeded", _start_if_unstarted(ctx, cmd)) is None:
        return
    job_id, task_id = cmd["job_id"], cmd["task_id"]
    ctx.event("TaskSucceeded", job_id, task_id=task_id, attempt=cmd["attempt"], worker_id=cmd["worker_id"],
              result_json=cmd["result_json"], stdout_tail=cmd["stdout_tail"], stderr_tail=cmd["stderr_tail"],
              outputs=list(cmd.get("outputs") or []))
    propagate(ctx, job_id, task_id, TaskState.SUCCEEDED)


@handles("dagfold.command.TaskReleased")
def task_released(ctx: Ctx, cmd: Record) -> None:
    """The holder gives the attempt back (shutting down, drained): a worker loss, not a failure."""
    t = _report_target(ctx, cmd, "released", read_task(ctx.txn, cmd["job_id"], cmd["task_id"]))
    if t is None:
        return
    reclaim_lease(ctx, cmd["job_id"], cmd["task_id"], t, worker=cmd["worker_id"],
                  reason=f"released: {cmd['reason']}")


@handles("dagfold.command.TaskFailed")
def task_failed(ctx: Ctx, cmd: Record) -> None:
    t = _report_target(ctx, cmd, "failed", _start_if_unstarted(ctx, cmd))
    if t is None:
        return
    fail_attempt(ctx, cmd["job_id"], cmd["task_id"], t, worker=cmd["worker_id"], reason=cmd["reason"],
                 exit_code=cmd["exit_code"], error_type=cmd["error_type"], retryable=cmd["retryable"],
                 stdout_tail=cmd["stdout_tail"], stderr_tail=cmd["stderr_tail"])
