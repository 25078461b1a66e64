"""Handler of a due timer: TimerFired (backoff over, lease expired, a timeout, a re-dispatch check)."""

from __future__ import annotations

from dagfold.codec import Record
from dagfold.jobspec import is_gpu
from dagfold.lifecycle import JOB_OPEN, TaskState
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.appliers import read_job, read_task
from dagfold.services.scheduler.context import Ctx, stop_attempt
from dagfold.services.scheduler.handlers.registry import handles
from dagfold.services.scheduler.outcomes import fail_attempt, job_expired, reclaim_lease
from dagfold.services.scheduler.runnable import make_runnable


@handles("dagfold.command.TimerFired")
def timer_fired(ctx: Ctx, cmd: Record) -> None:
    """Decide what a due timer means now; a timer made stale by later events does nothing."""
    job_id, task_id, attempt, kind = cmd["job_id"], cmd["task_id"], cmd["attempt"], cmd["timer"]
    if kind == keys.EXPIRE_TIMER:
        job_expired(ctx, job_id, cmd["due_ms"])
        return
    if task_id is None:
        return
    t = read_task(ctx.txn, job_id, task_id)
    j = read_job(ctx.txn, job_id)
    if t is None or j is None or j["state"] not in JOB_OPEN or t["attempt"] != attempt:
        return
    due = (t.get("timers") or {}).get(kind)
    if due is None or due > ctx.now_ms:
        return
    if kind == "backoff" and t["state"] == TaskState.RETRYING:
        make_runnable(ctx, job_id, task_id, t, j["tenant"])
    elif kind == "lease" and t["state"] == TaskState.RUNNING:
        stop_attempt(ctx, job_id, task_id, t, "lease_expired")
        reclaim_lease(ctx, job_id, task_id, t, worker=t["worker"] or "",
                      reason=f"lease_expired: no heartbeat from {t['worker']} within the lease")
    elif kind == "start_to_close" and t["state"] == TaskState.RUNNING:
        stop_attempt(ctx, job_id, task_id, t, "start_to_close_timeout")
        fail_attempt(ctx, job_id, task_id, t, worker=t["worker"] or "", reason="start_to_close_timeout")
    elif kind == "redispatch" and t["state"] == TaskState.RUNNABLE and not is_gpu(t):
        make_runnable(ctx, job_id, task_id, t, j["tenant"])
    elif kind == "schedule_to_start" and t["state"] == TaskState.RUNNABLE:
        stop_attempt(ctx, job_id, task_id, t, "schedule_to_start_timeout")
        fail_attempt(ctx, job_id, task_id, t, worker="", reason="schedule_to_start_timeout", retryable=False)
