"""The one place that lets a task run: ``make_runnable``.

Every path to a worker or a GPU pool goes through it: a job's first tasks (SubmitJob), a dependent whose
trigger rule is met (``outcomes.propagate``), a task re-opened by a redrive or an operator
(``outcomes.rerun``), the next attempt after a lost worker (``outcomes.reclaim_lease``) or a backoff
(TimerFired backoff), and a runnable attempt whose record may be lost (TimerFired redispatch). It decides
what the task gets now:

* **dispatch**: a new attempt, a TaskDispatched event and a record on the task's queue;
* **GPU request**: the same for a GPU task, whose queue names its pool: the attempt is an allocation
  request there, dispatched to node agents when the grant comes back (``handlers.gpu``);
* **re-dispatch**: the current, still runnable attempt gets a new record on its queue (or, while the
  queue is still draining older records, the check is deferred);
* **hold**: its job is paused (``lifecycle.HOLDING``): a TaskHeld event, its state unchanged, nothing sent;
  resuming the job (``handlers.jobs.resume_job``) brings it back here.

A rule about whether a task may start now (a quota, a maintenance window) belongs here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dagfold.config import ALLOCATOR_COMMANDS, REDISPATCH_MAX_FACTOR, dispatch_topic
from dagfold.jobspec import is_gpu
from dagfold.lifecycle import HOLDING, TaskState
from dagfold.services.allocator import commands as alloc_cmds
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.appliers import read_job
from dagfold.services.scheduler.context import Ctx, lease_timeout_ms
from dagfold.tracing import attempt_traceparent


def make_runnable(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], tenant: str) -> None:
    """Let the task run now: a runnable attempt is re-dispatched (a new record for the same attempt, or a
    deferred check); any other task (pending with its trigger rule met, retrying with its backoff over,
    or its worker lost) gets its next attempt dispatched. ``t`` is the task as it stands now. While its job
    is paused nothing is sent: the task is held (TaskHeld, once) until ResumeJob brings it back here.

    Attempt numbers count on across runs (``t["attempt"] + 1``, not 1): a task re-opened by a redrive keeps
    counting its attempts, so reports and StopTasks of its earlier attempts stay fenced off.
    """
    j = read_job(ctx.txn, job_id)
    if j is not None and j["state"] in HOLDING:
        if not t.get("held"):  # held already: a second upstream outcome of a pending task changes nothing
            ctx.event("TaskHeld", job_id, task_id=task_id, attempt=t["attempt"], reason=f"job {j['state']}")
        return
    if t["state"] == TaskState.RUNNABLE:
        if not is_gpu(t):  # a GPU attempt's request waits at its pool: nothing to send again
            _redispatch_due(ctx, job_id, task_id, t, tenant)
        return
    _dispatch(ctx, job_id, task_id, t, t["attempt"] + 1, tenant)


def _dispatch(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], attempt: int, tenant: str) -> None:
    """A new attempt: a TaskDispatched event and a reference on its queue.

    A GPU task's queue names its GPU pool: the attempt is an allocation request
    there, and is dispatched to node agents when the grant comes back
    (``handlers.gpu.task_allocation``). It resumes from the task's latest known checkpoint.
    """
    gpu = is_gpu(t)
    every = 0 if gpu else ctx.opts.redispatch_after_ms(t["queue"])
    ctx.event("TaskDispatched", job_id, task_id=task_id, attempt=attempt, queue=t["queue"],
              redispatch_at_ms=ctx.now_ms + every if every else None)
    if gpu:
        j = read_job(ctx.txn, job_id)
        tier = j["tier"] if j is not None else "standard"
        req = alloc_cmds.from_resources(t["queue"], job_id, task_id, attempt, tenant, tier, t["resources"],
                                        ctx.now_ms)
        req["resume_checkpoint"] = t.get("ckpt")
        ctx.emit(ALLOCATOR_COMMANDS, t["queue"], req)
        return
    _send_dispatch_record(ctx, job_id, task_id, t, attempt, tenant)


def _send_dispatch_record(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], attempt: int,
                         tenant: str) -> None:
    """Put a reference to the attempt on its queue (a dispatch, or a re-dispatch of the same attempt)."""
    # keyed by tenant: the queue hands records out round-robin across partitions, so a tenant's backlog
    # on its partition delays another tenant's records by one record per round, not by its length
    # (any free worker takes any record: the dispatch topic is a queue, dagfold.log.base)
    ctx.emit(dispatch_topic(t["queue"]), tenant, {
        "type": "dagfold.dispatch.TaskDispatch", "job_id": job_id, "task_id": task_id, "attempt": attempt,
        "tenant": tenant, "handler": t["handler"], "args_json": t["args"],
        "idempotency_key": f"{job_id}/{task_id}", "lease_timeout_s": lease_timeout_ms(ctx, t) / 1000,
        "start_to_close_s": (t["timeouts"] or {}).get("start_to_close_s"), "dispatched_at_ms": ctx.now_ms,
        "traceparent": attempt_traceparent(job_id, task_id, attempt, t.get("tp", ""))})


def _redispatch(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], tenant: str) -> None:
    """The attempt is runnable and unleased at its re-dispatch time: its record may never reach a worker
    (archived by the queue after its last delivery, lost with a worker killed while it held it), and
    nothing else would dispatch it again. Send a new record for the same attempt and re-arm the timer at
    twice the last interval (up to REDISPATCH_MAX_FACTOR times the queue's setting), so a deep backlog
    costs a waiting task a few duplicate records, not one per interval. A duplicate is harmless: the
    attempt is leased once (a second TaskStarted gets LeaseRejected and a StopTask, an instant task's
    second outcome ReportIgnored)."""
    n = t.get("redisp", 0) + 1
    every = ctx.opts.redispatch_after_ms(t["queue"])
    nxt = ctx.now_ms + every * min(2 ** n, REDISPATCH_MAX_FACTOR) if every else None
    ctx.event("TaskRedispatched", job_id, task_id=task_id, attempt=t["attempt"], queue=t["queue"],
              redispatches=n, next_redispatch_at_ms=nxt)
    _send_dispatch_record(ctx, job_id, task_id, t, t["attempt"], tenant)


def _redispatch_due(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], tenant: str) -> None:
    """The attempt's re-dispatch time came and no worker has leased it: a lost record, or one still
    queued behind a backlog? The tenant's records on a queue are handed out in order (dispatch records
    are keyed by tenant: one partition). So while the queue keeps handing out this tenant's records
    (one was leased within the interval) and every one it handed out was put there no later than this
    attempt's own, the record is still ahead of the workers: a copy would only join the backlog, be taken
    and fenced, and under a deep backlog (chaos: 15,000 copies queued for 1,600 waiting tasks, workers
    busy fencing them) starve the real work. Then the check is re-armed (TaskRedispatchDeferred) and no
    record is sent. Otherwise (a later record was taken first, or the queue took nothing for a whole
    interval: the record archived or lost with its holder) a new record is sent (``_redispatch``)."""
    every = ctx.opts.redispatch_after_ms(t["queue"])
    disp = t.get("disp")
    seen = ctx.txn.get(keys.queue_progress(t["queue"], tenant)) if disp is not None else None
    if seen is not None and seen[0] <= disp and ctx.now_ms - seen[1] < every:
        n = t.get("redefer", 0) + 1
        ctx.event("TaskRedispatchDeferred", job_id, task_id=task_id, attempt=t["attempt"], queue=t["queue"],
                  deferrals=n, queue_dispatched_ms=seen[0], queue_leased_ms=seen[1],
                  next_redispatch_at_ms=ctx.now_ms + every * min(2 ** n, REDISPATCH_MAX_FACTOR))
        return
    _redispatch(ctx, job_id, task_id, t, tenant)
