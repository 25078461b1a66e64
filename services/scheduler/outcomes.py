"""What follows a task's outcome inside its job: its dependents run or are skipped (``propagate``), the job
ends when nothing can run (``finish_job_if_done``), a failed attempt retries or fails the task
(``fail_attempt``), a lost worker's attempt runs again (``reclaim_lease``), re-opened tasks decide again
(``rerun``), and a job's open tasks are cancelled (``cancel_open_tasks``). Shared by the handlers; every
task they let run goes through ``runnable.make_runnable``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagfold.jobspec import evaluate_rule
from dagfold.lifecycle import JOB_OPEN, JOB_TERMINAL, TaskState
from dagfold.lifecycle import TASK_TERMINAL as TERMINAL
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.appliers import get_dependents, read_job, read_task
from dagfold.services.scheduler.context import Ctx, stop_attempt
from dagfold.services.scheduler.retry import backoff_ms, should_retry
from dagfold.services.scheduler.runnable import make_runnable


def propagate(ctx: Ctx, job_id: str, task_id: str, outcome: str) -> None:
    """After ``task_id`` reached a terminal outcome, run or skip the dependents it decides."""
    j = read_job(ctx.txn, job_id)
    if j is None or j["state"] not in JOB_OPEN:
        return
    work = [(task_id, outcome)]
    while work:
        up, up_outcome = work.pop()
        for d in get_dependents(ctx.txn, job_id, up):
            dt = read_task(ctx.txn, job_id, d)
            if dt is None or dt["state"] != TaskState.PENDING or dt["rule"] == "always":
                continue
            decision = evaluate_rule(dt)
            if decision == "run":
                make_runnable(ctx, job_id, d, dt, j["tenant"])
            elif decision == "skip":
                ctx.event("TaskSkipped", job_id, task_id=d,
                          reason=f"trigger rule {dt['rule']}: upstream {up} {up_outcome}")
                work.append((d, TaskState.SKIPPED))
    finish_job_if_done(ctx, job_id)


def finish_job_if_done(ctx: Ctx, job_id: str) -> None:
    j = read_job(ctx.txn, job_id)
    if j is None or j["state"] not in JOB_OPEN or j["open"] > 0:
        return
    expires = expires_ms(ctx)
    if j["failed"] == 0:
        ctx.event("JobSucceeded", job_id, partial=False, expires_ms=expires)
    elif j["policy"] == "allow_partial" and j["leaf_ok"] > 0:
        ctx.event("JobSucceeded", job_id, partial=True, expires_ms=expires)
    else:
        first = j.get("first_failure")
        ctx.event("JobFailed", job_id, reason=f"{j['failed']} task(s) failed" + (f"; first: {first}" if first else ""),
                  expires_ms=expires)


def expires_ms(ctx: Ctx) -> int | None:
    """When a job that ends now leaves the state (``finished_job_retention_ms`` after its end); None: never.
    Decided here and carried by the job's end event, so a replay under other settings expires it alike."""
    keep = ctx.opts.finished_job_retention_ms
    return None if keep < 0 else ctx.now_ms + keep


def job_expired(ctx: Ctx, job_id: str, due_ms: int) -> None:
    """A finished job's retention timer: its records go (JobExpired), unless it was redriven meanwhile (its
    timer then went with it) or ended again later (a later timer)."""
    j = read_job(ctx.txn, job_id)
    if j is None or j["state"] not in JOB_TERMINAL or j.get("expires_ms") != due_ms or due_ms > ctx.now_ms:
        return
    ctx.event("JobExpired", job_id)


def cancel_open_tasks(ctx: Ctx, job_id: str, reason: str) -> None:
    """Cancel every task that has not finished (O(tasks) once per job); running ones are told to stop."""
    for tid in ctx.txn.get(keys.task_list(job_id)) or []:
        t = read_task(ctx.txn, job_id, tid)
        if t is None or t["state"] in TERMINAL:
            continue
        stop_attempt(ctx, job_id, tid, t, reason)
        ctx.event("TaskCancelled", job_id, task_id=tid, attempt=t["attempt"], reason=reason)


def rerun(ctx: Ctx, job_id: str, task_ids: list[str], tenant: str, after: str) -> None:
    """Decide again for re-opened tasks: each still pending runs or is skipped by its trigger rule, on
    the upstream outcomes that stay (a re-opened upstream is open again, so its dependents wait)."""
    for tid in task_ids:
        t = read_task(ctx.txn, job_id, tid)
        if t is None or t["state"] != TaskState.PENDING:
            continue  # decided meanwhile, downstream of a task skipped again here
        decision = "run" if t["n_up"] == 0 or t["rule"] == "always" else evaluate_rule(t)
        if decision == "run":
            make_runnable(ctx, job_id, tid, t, tenant)
        elif decision == "skip":
            ctx.event("TaskSkipped", job_id, task_id=tid,
                      reason=f"trigger rule {t['rule']}: cannot be met {after} "
                             f"({t['ok']} upstream succeeded, {t['bad']} failed, {t['skip']} skipped)")
            propagate(ctx, job_id, tid, TaskState.SKIPPED)


def fail_attempt(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], *, worker: str, reason: str,
                 exit_code: int | None = None, error_type: str | None = None, retryable: bool = True,
                 stdout_tail: str = "", stderr_tail: str = "") -> None:
    """The current attempt failed: schedule a retry per policy, or fail the task for good."""
    attempt = t["attempt"]
    # the retry budget and backoff count the attempts of this run (a redrive starts a new run) that
    # failed or are failing: attempts whose worker was lost (LeaseReclaimed) spent none of it
    run_attempt = attempt - t.get("base", 0) - t.get("lost", 0)
    retry = should_retry(t["retry"], run_attempt, exit_code, error_type, retryable)
    ctx.event("TaskFailed", job_id, task_id=task_id, attempt=attempt, worker_id=worker, reason=reason,
              exit_code=exit_code, error_type=error_type, final=not retry,
              stdout_tail=stdout_tail, stderr_tail=stderr_tail)
    if retry:
        ctx.event("TaskRetryScheduled", job_id, task_id=task_id, attempt=attempt, next_attempt=attempt + 1,
                  retry_at_ms=ctx.now_ms + backoff_ms(t["retry"], job_id, task_id, run_attempt), reason=reason)
        return
    j = read_job(ctx.txn, job_id)
    if j is not None and j["policy"] == "fail_fast" and j["state"] in JOB_OPEN:
        cancel_open_tasks(ctx, job_id, f"fail_fast: task {task_id} failed")
        finish_job_if_done(ctx, job_id)
        return
    propagate(ctx, job_id, task_id, TaskState.FAILED)


def reclaim_lease(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], *, worker: str, reason: str) -> None:
    """The attempt's worker is lost (died, froze, cut off, drained): not the task's failure.

    The task runs again at once as the next attempt, its retry budget untouched; after
    ``max_worker_losses`` losses in this run it fails for good with ``worker_lost``, so a
    task that kills every worker it lands on stops.
    """
    losses = t.get("lost", 0) + 1
    final = losses >= ctx.opts.max_worker_losses
    ctx.event("LeaseReclaimed", job_id, task_id=task_id, attempt=t["attempt"], worker_id=worker, reason=reason,
              losses=losses, final=final)
    now = read_task(ctx.txn, job_id, task_id)
    j = read_job(ctx.txn, job_id)
    assert now is not None and j is not None
    if final:
        fail_attempt(ctx, job_id, task_id, now, worker=worker, reason=f"worker_lost x {losses}: {reason}",
                     error_type="worker_lost", retryable=False)
    else:
        make_runnable(ctx, job_id, task_id, now, j["tenant"])
