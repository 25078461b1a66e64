"""Command processors: one function per command type, deciding which events follow.

A processor reads state, emits events through ``Ctx.event`` (each applied at
once by ``appliers``), and may emit side outputs: dispatch records for workers
and control records (StopTask). It never writes state directly, never reads a
clock (``ctx.now_ms`` is an input) and never does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dagfold.codec import Record
from dagfold.config import (
    ALLOCATOR_COMMANDS,
    CONTROL,
    EVENTS,
    REDISPATCH_MAX_FACTOR,
    SchedulerOptions,
    dispatch_topic,
)
from dagfold.jobspec import (
    Rejection,
    evaluate_rule,
    is_gpu,
    rejected_graph,
    spec_hash,
    still_skipped,
    validate_job_spec,
)
from dagfold.lifecycle import JOB_TERMINAL, REDRIVABLE, task_action_refusal
from dagfold.lifecycle import TASK_TERMINAL as TERMINAL
from dagfold.outputs import Output
from dagfold.processor.fold import FoldContext
from dagfold.rules import MAX_REASON_LEN
from dagfold.services.allocator import commands as alloc_cmds
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.appliers import (
    apply_event,
    get_dependents,
    read_job,
    read_task,
    read_tenant,
)
from dagfold.services.scheduler.exceptions import InvalidSettingsError
from dagfold.services.scheduler.retry import backoff_ms, should_retry
from dagfold.state import PartitionTransaction
from dagfold.tenants import Entitlements, EntitlementsError, settings_unchanged
from dagfold.tracing import attempt_traceparent, clean_traceparent

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
        if t["state"] in ("runnable", "running"):
            ctx.emit(ALLOCATOR_COMMANDS, t["queue"], alloc_cmds.cancel_request(
                t["queue"], job_id, task_id, reason, ts_ms=ctx.now_ms, attempt=t["attempt"]))
    elif t["state"] == "running":
        ctx.stop_task(t["worker"], job_id, task_id, t["attempt"], reason)


def lease_timeout_ms(ctx: Ctx, t: Mapping[str, Any]) -> int:
    hb = (t["timeouts"] or {}).get("heartbeat_s") or ctx.opts.lease_timeout_s
    return int(hb * 1000)


def dispatch(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], attempt: int, tenant: str) -> None:
    """Make an attempt runnable: a TaskDispatched event and a reference on its queue.

    A GPU task's queue names its GPU pool: the attempt is an allocation request
    there, and is dispatched to node agents when the grant comes back
    (``task_allocation``). It resumes from the task's latest known checkpoint.
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
    send_dispatch_record(ctx, job_id, task_id, t, attempt, tenant)


def send_dispatch_record(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], attempt: int,
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


def redispatch(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], tenant: str) -> None:
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
    send_dispatch_record(ctx, job_id, task_id, t, t["attempt"], tenant)


def redispatch_due(ctx: Ctx, job_id: str, task_id: str, t: Mapping[str, Any], tenant: str) -> None:
    """The attempt's re-dispatch time came and no worker has leased it: a lost record, or one still
    queued behind a backlog? The tenant's records on a queue are handed out in order (dispatch records
    are keyed by tenant: one partition). So while the queue keeps handing out this tenant's records
    (one was leased within the interval) and every one it handed out was put there no later than this
    attempt's own, the record is still ahead of the workers: a copy would only join the backlog, be taken
    and fenced, and under a deep backlog (chaos: 15,000 copies queued for 1,600 waiting tasks, workers
    busy fencing them) starve the real work. Then the check is re-armed (TaskRedispatchDeferred) and no
    record is sent. Otherwise (a later record was taken first, or the queue took nothing for a whole
    interval: the record archived or lost with its holder) a new record is sent (``redispatch``)."""
    every = ctx.opts.redispatch_after_ms(t["queue"])
    disp = t.get("disp")
    seen = ctx.txn.get(keys.queue_progress(t["queue"], tenant)) if disp is not None else None
    if seen is not None and seen[0] <= disp and ctx.now_ms - seen[1] < every:
        n = t.get("redefer", 0) + 1
        ctx.event("TaskRedispatchDeferred", job_id, task_id=task_id, attempt=t["attempt"], queue=t["queue"],
                  deferrals=n, queue_dispatched_ms=seen[0], queue_leased_ms=seen[1],
                  next_redispatch_at_ms=ctx.now_ms + every * min(2 ** n, REDISPATCH_MAX_FACTOR))
        return
    redispatch(ctx, job_id, task_id, t, tenant)


def propagate(ctx: Ctx, job_id: str, task_id: str, outcome: str) -> None:
    """After ``task_id`` reached a terminal outcome, run or skip the dependents it decides."""
    j = read_job(ctx.txn, job_id)
    if j is None or j["state"] != "running":
        return
    work = [(task_id, outcome)]
    while work:
        up, up_outcome = work.pop()
        for d in get_dependents(ctx.txn, job_id, up):
            dt = read_task(ctx.txn, job_id, d)
            if dt is None or dt["state"] != "pending" or dt["rule"] == "always":
                continue
            decision = evaluate_rule(dt)
            if decision == "run":
                # attempt + 1, not 1: a task re-opened by a redrive keeps counting its attempts, so
                # reports and StopTasks of its earlier attempts stay fenced off
                dispatch(ctx, job_id, d, dt, dt["attempt"] + 1, j["tenant"])
            elif decision == "skip":
                ctx.event("TaskSkipped", job_id, task_id=d,
                          reason=f"trigger rule {dt['rule']}: upstream {up} {up_outcome}")
                work.append((d, "skipped"))
    finish_job_if_done(ctx, job_id)


def finish_job_if_done(ctx: Ctx, job_id: str) -> None:
    j = read_job(ctx.txn, job_id)
    if j is None or j["state"] != "running" or j["open"] > 0:
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


# -- processors ------------------------------------------------------------------

def submit_job(ctx: Ctx, cmd: Record) -> None:
    spec = cmd["spec"]
    job_id = spec["job_id"]
    rej = validate_job_spec(spec, ctx.opts.limits) or entitlement_refusal(ctx, spec)
    if rej is not None:
        ctx.event("JobRejected", job_id, tenant=spec["tenant"], code=rej.code, reason=rej.reason,
                  graph=rejected_graph(spec, rej, ctx.opts.limits))
        return
    h = spec_hash(spec)
    key = spec["idempotency_key"]
    first = ctx.txn.get(keys.idempotency(spec["tenant"], key)) if key else None
    existing = read_job(ctx.txn, first or job_id)
    if existing is not None:
        if existing["tenant"] != spec["tenant"]:  # another tenant's job: its ID is taken (the API's 409 too)
            ctx.event("JobRejected", job_id, tenant=spec["tenant"], code="job_id_taken",
                      reason=f"job ID {job_id!r} is already taken; choose another (or omit it)")
        elif existing["hash"] == h:
            ctx.event("SubmissionDeduplicated", job_id, idempotency_key=key or "")
        elif first:
            ctx.event("JobRejected", job_id, tenant=spec["tenant"], code="idempotency_conflict",
                      reason=f"idempotency key {key!r} was used by job {first} with a different spec")
        else:
            ctx.event("JobRejected", job_id, tenant=spec["tenant"], code="job_exists",
                      reason=f"job {job_id} already exists with a different spec")
        return
    ctx.event("JobAccepted", job_id, spec=spec, spec_hash=h, traceparent=clean_traceparent(cmd.get("traceparent")))
    for ts in spec["tasks"]:
        if not ts["depends_on"] or ts["trigger_rule"] == "always":
            t = read_task(ctx.txn, job_id, ts["task_id"])
            assert t is not None
            dispatch(ctx, job_id, ts["task_id"], t, 1, spec["tenant"])


def entitlement_refusal(ctx: Ctx, spec: Record) -> Rejection | None:
    """The tenant's entitlements as folded from the log: tier and handlers (none set: no restriction).

    Upstream producers write SubmitJob without the API: the scheduler refuses what the API would
    (403 there, ``tier_not_allowed`` / ``handler_not_allowed`` here). One key read per submission;
    the handler check is one set lookup per distinct handler.
    """
    stored = read_tenant(ctx.txn, spec["tenant"])
    if stored is None:
        return None
    ent = Entitlements.from_record(stored["ent"])
    why = ent.tier_refusal(spec["tier"])
    if why:
        return Rejection("tier_not_allowed", why)
    for handler in {t["handler"] for t in spec["tasks"]}:
        why = ent.handler_refusal(handler)
        if why:
            return Rejection("handler_not_allowed", why)
    return None


def set_tenant_entitlements(ctx: Ctx, cmd: Record) -> None:
    """Store a tenant's settings on this partition (each partition gets its own copy of the command).

    Settings that do not parse are dropped with an exception (the runner dead-letters the command);
    the auth file's settings, re-sent at every API start, are a no-op when the file did not change.
    """
    try:
        ent = Entitlements.parse(cmd["entitlements"], f"tenant {cmd['tenant'][:60]!r}")
    except EntitlementsError as exc:
        raise InvalidSettingsError(str(exc)) from None
    rec = ent.to_record()
    if settings_unchanged(read_tenant(ctx.txn, cmd["tenant"]), rec, cmd["source"]):
        return  # e.g. the file's settings were applied before; later admin changes stand
    ctx.event("TenantEntitlementsSet", cmd["job_id"], tenant=cmd["tenant"], entitlements=rec, source=cmd["source"])


def cancel_job(ctx: Ctx, cmd: Record) -> None:
    job_id = cmd["job_id"]
    j = read_job(ctx.txn, job_id)
    if j is None or j["state"] in JOB_TERMINAL:
        return  # unknown or finished: a no-op, the command stays in the log for the audit
    cancel_open_tasks(ctx, job_id, f"job cancelled: {cmd['reason']}")
    ctx.event("JobCancelled", job_id, reason=cmd["reason"], expires_ms=expires_ms(ctx))




def redrive_job(ctx: Ctx, cmd: Record) -> None:
    """Re-run a finished job from its failed, skipped and cancelled tasks; history stays in the log."""
    job_id = cmd["job_id"]
    j = read_job(ctx.txn, job_id)
    if j is None or j["state"] not in REDRIVABLE:
        return  # nothing to redrive; the API answers 409 before sending
    reopen = []
    for tid in ctx.txn.get(keys.task_list(job_id)) or []:
        t = read_task(ctx.txn, job_id, tid)
        if t is not None and t["state"] in ("failed", "skipped", "cancelled"):
            reopen.append(tid)
    if not reopen:
        return
    ctx.event("JobRedriven", job_id, task_ids=reopen)
    rerun(ctx, job_id, reopen, j["tenant"], "after redrive")
    finish_job_if_done(ctx, job_id)


def rerun(ctx: Ctx, job_id: str, task_ids: list[str], tenant: str, after: str) -> None:
    """Decide again for re-opened tasks: each still pending runs or is skipped by its trigger rule, on
    the upstream outcomes that stay (a re-opened upstream is open again, so its dependents wait)."""
    for tid in task_ids:
        t = read_task(ctx.txn, job_id, tid)
        if t is None or t["state"] != "pending":
            continue  # decided meanwhile, downstream of a task skipped again here
        decision = "run" if t["n_up"] == 0 or t["rule"] == "always" else evaluate_rule(t)
        if decision == "run":
            dispatch(ctx, job_id, tid, t, t["attempt"] + 1, tenant)
        elif decision == "skip":
            ctx.event("TaskSkipped", job_id, task_id=tid,
                      reason=f"trigger rule {t['rule']}: cannot be met {after} "
                             f"({t['ok']} upstream succeeded, {t['bad']} failed, {t['skip']} skipped)")
            propagate(ctx, job_id, tid, "skipped")


# -- operator decisions on one task --------------------------------------------------

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
            if dt is not None and dt["state"] in ("skipped", "cancelled"):
                cancelled += dt["state"] == "cancelled"
                seen.add(d)
                found.append(d)
                work.append(d)
    t = read_task(ctx.txn, job_id, task_id)
    cancelled += t is not None and t["state"] == "cancelled"
    if j["policy"] == "fail_fast" and j["state"] != "running" and j["cancelled"] > cancelled:
        for tid in ctx.txn.get(keys.task_list(job_id)) or []:
            if tid not in seen:
                ot = read_task(ctx.txn, job_id, tid)
                if ot is not None and ot["state"] == "cancelled":
                    found.append(tid)
    return found


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
    propagate(ctx, job_id, task_id, "succeeded")


def not_current(t: Mapping[str, Any] | None, j: Mapping[str, Any] | None, attempt: int) -> str | None:
    """Why a record about ``attempt`` concerns no live attempt (unknown, job over, stale); None if it does."""
    if t is None or j is None:
        return "unknown job or task"
    if j["state"] != "running":
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
    elif t["state"] != "running":
        why = f"task is {t['state']}"
    elif t["worker"] != worker:
        why = f"attempt is leased to {t['worker']}"
    else:
        return t
    ctx.event("ReportIgnored", job_id, task_id=task_id, attempt=attempt, worker_id=worker,
              report=report, reason=why)
    return None


def task_started(ctx: Ctx, cmd: Record) -> None:
    job_id, task_id, attempt, worker = cmd["job_id"], cmd["task_id"], cmd["attempt"], cmd["worker_id"]
    t = read_task(ctx.txn, job_id, task_id)
    why = not_current(t, read_job(ctx.txn, job_id), attempt)
    if why is None and t is not None:
        if t["state"] == "runnable" and (not is_gpu(t) or t.get("alloc") == worker):
            ctx.event("LeaseGranted", job_id, task_id=task_id, attempt=attempt, worker_id=worker,
                      lease_deadline_ms=ctx.now_ms + lease_timeout_ms(ctx, t))
            return
        if t["state"] == "running" and t["worker"] == worker:
            ctx.event("ReportIgnored", job_id, task_id=task_id, attempt=attempt, worker_id=worker,
                      report="started", reason="duplicate start of the leased attempt")
            return
        if t["state"] == "running":
            why = f"attempt {attempt} is already leased to {t['worker']}"
        elif t["state"] == "runnable":  # a GPU task: only its current grant may start it
            why = f"allocation {worker} is not the attempt's grant ({t.get('alloc') or 'none yet'})"
        else:
            why = f"task is {t['state']}"
    ctx.event("LeaseRejected", job_id, task_id=task_id, attempt=attempt, worker_id=worker, reason=why or "")
    if t is None or not is_gpu(t):  # a GPU process is stopped by its allocation's fencing, not by worker ID
        ctx.stop_task(worker, job_id, task_id, attempt, f"lease_rejected: {why}")


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
    if t is not None and t["state"] == "runnable" and t["attempt"] == cmd["attempt"] and not is_gpu(t):
        task_started(ctx, cmd)
        t = read_task(ctx.txn, cmd["job_id"], cmd["task_id"])
    return t  # the task as it stands now


def task_succeeded(ctx: Ctx, cmd: Record) -> None:
    if _report_target(ctx, cmd, "succeeded", _start_if_unstarted(ctx, cmd)) is None:
        return
    job_id, task_id = cmd["job_id"], cmd["task_id"]
    ctx.event("TaskSucceeded", job_id, task_id=task_id, attempt=cmd["attempt"], worker_id=cmd["worker_id"],
              result_json=cmd["result_json"], stdout_tail=cmd["stdout_tail"], stderr_tail=cmd["stderr_tail"],
              outputs=list(cmd.get("outputs") or []))
    propagate(ctx, job_id, task_id, "succeeded")


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
    if j is not None and j["policy"] == "fail_fast" and j["state"] == "running":
        cancel_open_tasks(ctx, job_id, f"fail_fast: task {task_id} failed")
        finish_job_if_done(ctx, job_id)
        return
    propagate(ctx, job_id, task_id, "failed")


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
        dispatch(ctx, job_id, task_id, now, now["attempt"] + 1, j["tenant"])


def task_released(ctx: Ctx, cmd: Record) -> None:
    """The holder gives the attempt back (shutting down, drained): a worker loss, not a failure."""
    t = _report_target(ctx, cmd, "released", read_task(ctx.txn, cmd["job_id"], cmd["task_id"]))
    if t is None:
        return
    reclaim_lease(ctx, cmd["job_id"], cmd["task_id"], t, worker=cmd["worker_id"],
                  reason=f"released: {cmd['reason']}")


def task_failed(ctx: Ctx, cmd: Record) -> None:
    t = _report_target(ctx, cmd, "failed", _start_if_unstarted(ctx, cmd))
    if t is None:
        return
    fail_attempt(ctx, cmd["job_id"], cmd["task_id"], t, worker=cmd["worker_id"], reason=cmd["reason"],
                 exit_code=cmd["exit_code"], error_type=cmd["error_type"], retryable=cmd["retryable"],
                 stdout_tail=cmd["stdout_tail"], stderr_tail=cmd["stderr_tail"])


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
    if t is None or j is None or j["state"] != "running" or t["attempt"] != attempt:
        return
    due = (t.get("timers") or {}).get(kind)
    if due is None or due > ctx.now_ms:
        return
    if kind == "backoff" and t["state"] == "retrying":
        dispatch(ctx, job_id, task_id, t, attempt + 1, j["tenant"])
    elif kind == "lease" and t["state"] == "running":
        stop_attempt(ctx, job_id, task_id, t, "lease_expired")
        reclaim_lease(ctx, job_id, task_id, t, worker=t["worker"] or "",
                      reason=f"lease_expired: no heartbeat from {t['worker']} within the lease")
    elif kind == "start_to_close" and t["state"] == "running":
        stop_attempt(ctx, job_id, task_id, t, "start_to_close_timeout")
        fail_attempt(ctx, job_id, task_id, t, worker=t["worker"] or "", reason="start_to_close_timeout")
    elif kind == "redispatch" and t["state"] == "runnable" and not is_gpu(t):
        redispatch_due(ctx, job_id, task_id, t, j["tenant"])
    elif kind == "schedule_to_start" and t["state"] == "runnable":
        stop_attempt(ctx, job_id, task_id, t, "schedule_to_start_timeout")
        fail_attempt(ctx, job_id, task_id, t, worker="", reason="schedule_to_start_timeout", retryable=False)


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
    if status in ("granted", "rejected") and (t["state"] != "runnable" or t.get("alloc")):
        return f"task is {t['state']} with allocation {t.get('alloc')}"
    if status == "granted" and epoch <= (t.get("epoch") or 0):
        return f"grant epoch {epoch} is not newer than the task's last grant's ({t.get('epoch')})"
    if status in ("requeued", "ended", "checkpointing") and t.get("alloc") != alloc:
        return f"allocation {alloc} is not the attempt's ({t.get('alloc')})"
    if status not in ("granted", "rejected", "requeued", "ended", "checkpointing"):
        return f"unknown allocation status {status!r}"
    return None


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
        over = t is None or j is None or j["state"] != "running" or t["state"] in TERMINAL
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


PROCESSORS: dict[str, Callable[[Ctx, Record], None]] = {
    "dagfold.command.SubmitJob": submit_job,
    "dagfold.command.CancelJob": cancel_job,
    "dagfold.command.RedriveJob": redrive_job,
    "dagfold.command.RetryTask": retry_task,
    "dagfold.command.MarkTaskSucceeded": mark_task_succeeded,
    "dagfold.command.TaskStarted": task_started,
    "dagfold.command.TaskHeartbeat": task_heartbeat,
    "dagfold.command.TaskSucceeded": task_succeeded,
    "dagfold.command.TaskFailed": task_failed,
    "dagfold.command.TaskReleased": task_released,
    "dagfold.command.TimerFired": timer_fired,
    "dagfold.command.TaskAllocation": task_allocation,
    "dagfold.command.SetTenantEntitlements": set_tenant_entitlements,
}
