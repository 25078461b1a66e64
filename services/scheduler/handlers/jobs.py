"""Handlers of a job's commands: SubmitJob, CancelJob, RedriveJob, PauseJob, ResumeJob."""

from __future__ import annotations

from dagfold.codec import Record
from dagfold.jobspec import Rejection, rejected_graph, spec_hash, validate_job_spec
from dagfold.lifecycle import JOB_TERMINAL, REDRIVABLE, REOPENABLE, TaskState, job_control_refusal
from dagfold.rules import MAX_REASON_LEN
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.appliers import read_job, read_task, read_tenant
from dagfold.services.scheduler.context import Ctx
from dagfold.services.scheduler.handlers.registry import handles
from dagfold.services.scheduler.outcomes import cancel_open_tasks, expires_ms, finish_job_if_done, rerun
from dagfold.services.scheduler.runnable import make_runnable
from dagfold.tenants import Entitlements
from dagfold.tracing import clean_traceparent


@handles("dagfold.command.SubmitJob")
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
            make_runnable(ctx, job_id, ts["task_id"], t, spec["tenant"])


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


@handles("dagfold.command.CancelJob")
def cancel_job(ctx: Ctx, cmd: Record) -> None:
    job_id = cmd["job_id"]
    j = read_job(ctx.txn, job_id)
    if j is None or j["state"] in JOB_TERMINAL:
        return  # unknown or finished: a no-op, the command stays in the log for the audit
    cancel_open_tasks(ctx, job_id, f"job cancelled: {cmd['reason']}")
    ctx.event("JobCancelled", job_id, reason=cmd["reason"], expires_ms=expires_ms(ctx))


@handles("dagfold.command.RedriveJob")
def redrive_job(ctx: Ctx, cmd: Record) -> None:
    """Re-run a finished job from its failed, skipped and cancelled tasks; history stays in the log."""
    job_id = cmd["job_id"]
    j = read_job(ctx.txn, job_id)
    if j is None or j["state"] not in REDRIVABLE:
        return  # nothing to redrive; the API answers 409 before sending
    reopen = []
    for tid in ctx.txn.get(keys.task_list(job_id)) or []:
        t = read_task(ctx.txn, job_id, tid)
        if t is not None and t["state"] in REOPENABLE:
            reopen.append(tid)
    if not reopen:
        return
    ctx.event("JobRedriven", job_id, task_ids=reopen)
    rerun(ctx, job_id, reopen, j["tenant"], "after redrive")
    finish_job_if_done(ctx, job_id)


@handles("dagfold.command.PauseJob")
def pause_job(ctx: Ctx, cmd: Record) -> None:
    """Pause a running job: from now on ``make_runnable`` holds its tasks instead of dispatching them.
    Attempts already dispatched are left as they are (running ones finish, a record already queued may
    still be taken); the job ends as usual if nothing is left to run."""
    job_id = cmd["job_id"]
    j = read_job(ctx.txn, job_id)
    if job_control_refusal("pause", job_id, j["state"] if j is not None else None) is not None:
        return  # not running: a no-op, the command stays in the log for the audit; the API answers 409
    ctx.event("JobPaused", job_id, reason=cmd["reason"][:MAX_REASON_LEN],
              requested_by=cmd["requested_by"][:MAX_REASON_LEN])


@handles("dagfold.command.ResumeJob")
def resume_job(ctx: Ctx, cmd: Record) -> None:
    """Resume a paused job and let its held tasks run: one pass over the job's task list (as a cancel's).
    A held pending task decides again by its trigger rule (an operator's retry may have re-opened an
    upstream meanwhile); a held retrying or runnable one goes back to ``make_runnable``."""
    job_id = cmd["job_id"]
    j = read_job(ctx.txn, job_id)
    if job_control_refusal("resume", job_id, j["state"] if j is not None else None) is not None or j is None:
        return
    ctx.event("JobResumed", job_id, reason=cmd["reason"][:MAX_REASON_LEN],
              requested_by=cmd["requested_by"][:MAX_REASON_LEN])
    pending = []
    for tid in ctx.txn.get(keys.task_list(job_id)) or []:
        t = read_task(ctx.txn, job_id, tid)
        if t is None or not t.get("held"):
            continue
        if t["state"] == TaskState.PENDING:
            pending.append(tid)
        elif t["state"] in (TaskState.RETRYING, TaskState.RUNNABLE):
            make_runnable(ctx, job_id, tid, t, j["tenant"])
    rerun(ctx, job_id, pending, j["tenant"], "on resume")
    finish_job_if_done(ctx, job_id)
