"""The jobs read model: job summaries, tasks, attempts and history, folded from events.

``apply(txn, event, partition, offset)`` folds one decoded event (a dict from
``dagfold.codec``) into a ``ReadModelTxn``; it looks the event's type up in ``APPLIERS``,
a table of small functions (Zeebe style); the state each event leaves its job and
task in comes from the lifecycle table (``dagfold.lifecycle.LIFECYCLE``), which the
scheduler's appliers follow too. Every applier does O(1) work, except
``JobAccepted``, which writes one record per task once. Task counts by state
are maintained incrementally on every transition, never recounted.

Key layout (``\\x00`` separates parts; string parts are escaped so that they
never contain ``\\x00``, which keeps every prefix unambiguous)::

    j  job                         -> job summary
    t  job task                    -> task record
    a  job task attempt(>I)        -> attempt record
    r  job                         -> the refused spec's graph of a rejected job (JobRejected.graph, bounded)
    h  job partition(>I) offset(>Q) -> history entry (one key per event: O(1) appends; an entry of a
                                      task event carries ``task_state``, the task's state after it, so
                                      live views recolour from the history stream alone)
    ic created(016d) job           -> 0   (all jobs by creation time)
    it tenant created job          -> 0   (per tenant)
    is state created job           -> 0   (per job state)
    iu tenant state created job    -> 0   (per tenant and job state)
    p  topic partition(>I)         -> next offset to read (the reader's position: dagfold.log.reader.position_key)
    m  name                        -> counters (skipped records, applier errors)

The operator models (tenant usage, queue depths, stuck-task deadlines, failure
reasons; ``dagfold.projections.operator``) are secondary indexes kept by the same
appliers in the same write batch; the GPU cluster model (``dagfold.projections.cluster``)
folds the allocator's events.

``ReadModel`` answers queries from a ``ReadModelStore``; listings are paginated with an
opaque cursor (the last key of the page, base64url).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec

from dagfold.jobspec import is_gpu
from dagfold.lifecycle import (
    JOB_FINAL,
    TASK_STATES,
    TASK_TERMINAL,
    JobState,
    history_line,
    job_state_after,
    task_state_after,
    transition,
    with_lifecycle_appliers,
)
from dagfold.projections import operator as ops
from dagfold.projections.keys import (
    MAX_LIMIT,
    SEP,
    U32,
    U64,
    Page,
    Record,
    clamp_limit,
    decode_cursor,
    encode_cursor,
    job_key,
    ms,
    paginate,
    part,
    public,
    task_key,
    tasks_prefix,
    unpart,
)
from dagfold.projections.store import ReadModelStore, ReadModelTxn, decode_value
from dagfold.tracing import job_trace_id


class _JobTenant(msgspec.Struct):
    tenant: str = ""


_TENANT_OF = msgspec.msgpack.Decoder(_JobTenant).decode

Applier = Callable[[ReadModelTxn, Record, int, int], None]

TERMINAL_JOB_STATES = JOB_FINAL

DETAIL_MAX = 500

# A GPU task's state as the GPU job API, its SSE stream and the dashboard name it (the seed's job states),
# derived from the task's events: TaskDispatched/TaskRequeued/retry -> QUEUED, TaskAllocated -> ASSIGNED,
# LeaseGranted -> RUNNING, TaskCheckpointing -> CHECKPOINTING, TaskSucceeded -> COMPLETED, a final
# TaskFailed -> FAILED, TaskCancelled/TaskSkipped -> CANCELLED. None for a task without GPUs.
GPU_STATES = ("QUEUED", "ASSIGNED", "RUNNING", "CHECKPOINTING", "COMPLETED", "FAILED", "CANCELLED")


def _gpu(task: Record, state: str) -> None:
    if is_gpu(task):
        task["gpu_state"] = state

_SEP = SEP
EXPIRED = "dagfold.event.JobExpired"
_U32 = U32
_U64 = U64
__all__ = ["MAX_LIMIT", "Page", "ReadModel", "apply", "part", "unpart"]


# -- keys -------------------------------------------------------------------
def attempts_prefix(job_id: str, task_id: str) -> bytes:
    return b"a" + _SEP + part(job_id) + _SEP + part(task_id) + _SEP


def attempt_key(job_id: str, task_id: str, attempt: int) -> bytes:
    return attempts_prefix(job_id, task_id) + _U32.pack(max(attempt, 0))


def rejected_graph_key(job_id: str) -> bytes:
    return b"r" + _SEP + part(job_id)


def history_prefix(job_id: str) -> bytes:
    return b"h" + _SEP + part(job_id) + _SEP


def history_key(job_id: str, partition: int, offset: int) -> bytes:
    return history_prefix(job_id) + _U32.pack(partition) + _U64.pack(offset)


def meta_key(name: str) -> bytes:
    return b"m" + _SEP + name.encode()


def index_prefix(tenant: str | None = None, state: str | None = None) -> bytes:
    """Prefix of the job index for a listing with these filters."""
    if tenant is None and state is None:
        return b"ic" + _SEP
    if state is None:
        return b"it" + _SEP + part(tenant or "") + _SEP
    if tenant is None:
        return b"is" + _SEP + part(state) + _SEP
    return b"iu" + _SEP + part(tenant) + _SEP + part(state) + _SEP


def _index_keys(job: Record) -> list[bytes]:
    suffix = b"%016d" % max(int(job["created_ms"]), 0) + _SEP + part(job["job_id"])
    return [index_prefix() + suffix, index_prefix(job["tenant"]) + suffix,
            index_prefix(None, job["state"]) + suffix, index_prefix(job["tenant"], job["state"]) + suffix]


# -- records ----------------------------------------------------------------
def _new_job(job_id: str, tenant: str, ts: int, partition: int) -> Record:
    return {
        "job_id": job_id,
        "name": None,
        "state": JobState.RUNNING,
        "tenant": tenant,
        "tier": "standard",
        "failure_policy": "skip_downstream",
        "idempotency_key": None,
        "labels": {},
        "callback_url": None,
        "total_tasks": 0,
        "counts": dict.fromkeys(TASK_STATES, 0),
        "finished_tasks": 0,
        "progress": 0.0,
        "created_ms": ts,
        "started_ms": None,
        "ended_ms": None,
        "duration_ms": None,
        "updated_ms": ts,
        "code": None,
        "reason": None,
        "partition": partition,
        "last_offset": -1,
        "redrives": 0,
        "retries": 0,
        "spec_hash": None,
    }


def _timeout_ms(spec: Record, job_timeouts: Record | None, name: str) -> int | None:
    """A task's time limit in ms: its own, else the job's, else None (no limit)."""
    for t in (spec.get("timeouts"), job_timeouts):
        if t and t.get(name) is not None:
            return int(float(t[name]) * 1000)
    return None


def _new_task(job_id: str, spec: Record, ts: int, job_timeouts: Record | None, state: str) -> Record:
    return {
        "job_id": job_id,
        "task_id": spec["task_id"],
        "state": state,
        "attempt": 0,
        "queue": spec.get("queue", "default"),
        "handler": spec.get("handler", ""),
        "args_json": spec.get("args_json", "{}"),
        "depends_on": list(spec.get("depends_on") or []),
        "trigger_rule": spec.get("trigger_rule", "all_success"),
        "resources": spec.get("resources"),
        "worker_id": None,
        "retries": 0,
        "reason": None,
        "exit_code": None,
        "error_type": None,
        "result_json": None,
        "progress": None,
        "lease_deadline_ms": None,
        "retry_at_ms": None,
        "last_heartbeat_ms": None,
        "created_ms": ts,
        "dispatched_ms": None,
        "started_ms": None,
        "ended_ms": None,
        "updated_ms": ts,
        "s2s_ms": _timeout_ms(spec, job_timeouts, "schedule_to_start_s"),
        "s2c_ms": _timeout_ms(spec, job_timeouts, "start_to_close_s"),
        "_ix": ops.initial_ix(),
        "gpu_state": "QUEUED" if is_gpu(spec) else None,
    }


def _new_attempt(attempt: int, worker_id: str | None, ts: int | None) -> Record:
    return {
        "attempt": attempt,
        "worker_id": worker_id,
        "outcome": "running",
        "started_ms": ts,
        "ended_ms": None,
        "duration_ms": None,
        "lease_deadline_ms": None,
        "last_heartbeat_ms": None,
        "progress": None,
        "reason": None,
        "exit_code": None,
        "error_type": None,
        "result_json": None,
        "stdout_tail": "",
        "stderr_tail": "",
    }


def _set_progress(job: Record) -> None:
    total = job["total_tasks"]
    job["progress"] = round(100.0 * job["finished_tasks"] / total, 2) if total else 0.0


def _set_job_state(txn: ReadModelTxn, job: Record, state: str) -> None:
    """Change a job's state, moving its state index entries (O(1))."""
    if job["state"] == state:
        return
    for k in _index_keys(job)[2:]:
        txn.delete(k)
    ops.count_job(txn, job["tenant"], job["state"], -1)
    ops.count_job(txn, job["tenant"], state, 1)
    job["state"] = state
    for k in _index_keys(job)[2:]:
        txn.put(k, 0)


def _set_task_state(job: Record, task: Record, state: str | None) -> None:
    """Move a task to ``state`` and keep the job's counts (O(1)); caller puts both."""
    old = task["state"]
    if state is None or old == state:
        return
    counts = job["counts"]
    counts[old] = counts.get(old, 0) - 1
    counts[state] = counts.get(state, 0) + 1
    job["finished_tasks"] += (state in TASK_TERMINAL) - (old in TASK_TERMINAL)
    task["state"] = state
    _set_progress(job)


def _end_job(txn: ReadModelTxn, job: Record, state: str | None, ts: int, reason: str | None) -> None:
    assert state is not None  # the event ends the job (lifecycle.JOB_ENDING_EVENTS)
    _set_job_state(txn, job, state)
    job["ended_ms"] = ts
    job["duration_ms"] = max(ts - job["created_ms"], 0)
    job["reason"] = reason


def _short(s: str | None, n: int = DETAIL_MAX) -> str:
    if not s:
        return ""
    return s if len(s) <= n else s[: n - 1] + "\u2026"


# -- appliers ---------------------------------------------------------------
class _Ctx:
    """The job (and task) an event touches, loaded once from the txn."""

    __slots__ = ("txn", "job", "jkey", "task", "tkey")

    def __init__(self, txn: ReadModelTxn, job_id: str, task_id: str | None) -> None:
        self.txn = txn
        self.jkey = job_key(job_id)
        self.job: Record | None = txn.get(self.jkey)
        self.task: Record | None = None
        self.tkey = b""
        if task_id is not None and self.job is not None:
            self.tkey = task_key(job_id, task_id)
            self.task = txn.get(self.tkey)

    def save(self, ts: int) -> None:
        if self.task is not None:
            self.task["updated_ms"] = ts
            if self.job is not None:
                ops.sync_task(self.txn, self.job, self.task)
            self.txn.put(self.tkey, self.task)
        if self.job is not None:
            self.job["updated_ms"] = ts
            self.txn.put(self.jkey, self.job)


def _task_ctx(txn: ReadModelTxn, ev: Record) -> _Ctx | None:
    ctx = _Ctx(txn, ev["job_id"], ev["task_id"])
    return ctx if ctx.task is not None else None


def _load_attempt(txn: ReadModelTxn, ev: Record, worker_id: str | None) -> tuple[bytes, Record]:
    key = attempt_key(ev["job_id"], ev["task_id"], ev["attempt"])
    att = txn.get(key)
    if att is None:
        att = _new_attempt(ev["attempt"], worker_id, None)
    return key, att


def _end_attempt(att: Record, outcome: str, ts: int) -> None:
    att["outcome"] = outcome
    att["ended_ms"] = ts
    if att["started_ms"] is not None:
        att["duration_ms"] = max(ts - att["started_ms"], 0)


def _job_accepted(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    spec = ev["spec"]
    job_id = ev["job_id"]
    jkey = job_key(job_id)
    old = txn.get(jkey)
    if old is not None:
        if old["state"] != JobState.REJECTED:
            return  # a job is accepted once; a repeat changes nothing (history keeps it)
        for k in _index_keys(old):
            txn.delete(k)
        txn.delete(rejected_graph_key(job_id))
        ops.count_job(txn, old["tenant"], JobState.REJECTED, -1)
    ts = ev["ts_ms"]
    job = _new_job(job_id, spec.get("tenant", "default"), ts, partition)
    job.update(tier=spec.get("tier", "standard"), failure_policy=spec.get("failure_policy", "skip_downstream"),
               idempotency_key=spec.get("idempotency_key"), labels=dict(spec.get("labels") or {}),
               callback_url=spec.get("callback_url"), spec_hash=ev.get("spec_hash"), name=spec.get("name"),
               trace_id=job_trace_id(job_id, ev.get("traceparent") or ""))
    seen: set[str] = set()
    job_timeouts = spec.get("timeouts")
    step = transition(ev)
    assert step.job is not None and step.task is not None
    for t in spec["tasks"]:
        if t["task_id"] in seen:
            continue  # validation rejects duplicates; never count one twice
        seen.add(t["task_id"])
        txn.put(task_key(job_id, t["task_id"]), _new_task(job_id, t, ts, job_timeouts, step.task))
    n = len(seen)
    job["state"] = step.job
    ops.count_job(txn, job["tenant"], step.job, 1)
    ops.tasks_created(txn, job["tenant"], n)
    job["total_tasks"] = n
    job["counts"][step.task] = n
    _set_progress(job)
    txn.put(jkey, job)
    for k in _index_keys(job):
        txn.put(k, 0)


def _job_rejected(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    jkey = job_key(ev["job_id"])
    job = txn.get(jkey)
    ts = ev["ts_ms"]
    if job is None:
        job = _new_job(ev["job_id"], ev.get("tenant", "default"), ts, partition)
        job["state"] = job_state_after(ev)
        for k in _index_keys(job):
            txn.put(k, 0)
        ops.count_job(txn, job["tenant"], job["state"], 1)
    elif job["state"] != JobState.REJECTED:
        return  # e.g. job_exists: a resubmission of a live job; the job itself is unchanged
    job.update(code=ev["code"], reason=ev["reason"], ended_ms=ts, duration_ms=0, updated_ms=ts)
    txn.put(jkey, job)
    graph = ev.get("graph")  # bounded by the scheduler (validation.rejected_graph); None before the field
    if graph is not None:
        txn.put(rejected_graph_key(ev["job_id"]), graph)
    else:
        txn.delete(rejected_graph_key(ev["job_id"]))


def claim_key(tenant: str, job_id: str) -> bytes:
    """A tenant's rejected submission of a job ID that another tenant's job holds (one per tenant and ID)."""
    return b"jr" + _SEP + part(tenant) + _SEP + part(job_id)


def _claim_rejected(txn: ReadModelTxn, ev: Record, partition: int) -> None:
    """The loser of a race for a job ID (two submissions before either was projected) sees its own
    submission rejected, in its tenant's view alone: nothing of the job that holds the ID is read or kept."""
    ts = ev["ts_ms"]
    job = _new_job(ev["job_id"], ev["tenant"], ts, partition)
    job.update(state=job_state_after(ev), code=ev["code"], reason=ev["reason"], ended_ms=ts, duration_ms=0)
    txn.put(claim_key(ev["tenant"], ev["job_id"]), job)


def _task_dispatched(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    task = ctx.task
    _set_task_state(ctx.job, task, task_state_after(ev))
    task.update(attempt=ev["attempt"], queue=ev["queue"], dispatched_ms=ev["ts_ms"], worker_id=None,
                lease_deadline_ms=None, retry_at_ms=None, ended_ms=None)
    _gpu(task, "QUEUED")
    ctx.save(ev["ts_ms"])


def _task_redispatched(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """The same attempt sent again (its dispatch record may have been lost): counted apart, per task, job
    and tenant; the task stays runnable. O(1): the task, its job and the tenant's usage."""
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    ctx.task["redispatches"] = ctx.task.get("redispatches", 0) + 1
    ctx.job["redispatches"] = ctx.job.get("redispatches", 0) + 1
    ops.record_redispatch(txn, ctx.job["tenant"])
    ctx.save(ev["ts_ms"])


def _task_allocated(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.task is None:
        return
    ctx.task.update(allocation={"pool": ev["pool"], "alloc_id": ev["alloc_id"], "epoch": ev["epoch"],
                                "node_ids": list(ev["node_ids"]), "granted_ms": ev["ts_ms"]},
                    checkpoint_uri=ev.get("resume_checkpoint") or ctx.task.get("checkpoint_uri"))
    _gpu(ctx.task, "ASSIGNED")
    ctx.txn.put(ctx.tkey, ctx.task)


def _task_checkpointing(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """The allocator asked the attempt to checkpoint and give its GPUs back (preemption, drain)."""
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.task is None or ctx.task["state"] in TASK_TERMINAL:
        return
    _gpu(ctx.task, "CHECKPOINTING")
    ctx.txn.put(ctx.tkey, ctx.task)


def _task_requeued(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """A GPU attempt lost its allocation (preempted, node lost): it waits for GPUs again."""
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    task = ctx.task
    _set_task_state(ctx.job, task, task_state_after(ev))
    task.update(worker_id=None, lease_deadline_ms=None, allocation=None, requeues=task.get("requeues", 0) + 1,
                checkpoint_uri=ev.get("checkpoint_uri") or task.get("checkpoint_uri"))
    _gpu(task, "QUEUED")
    ctx.save(ev["ts_ms"])


def _lease_granted(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    ts = ev["ts_ms"]
    task = ctx.task
    _set_task_state(ctx.job, task, task_state_after(ev))
    task.update(attempt=ev["attempt"], worker_id=ev["worker_id"], started_ms=ts, ended_ms=None,
                lease_deadline_ms=ev["lease_deadline_ms"], last_heartbeat_ms=ts, progress=None)
    _gpu(task, "RUNNING")
    if ctx.job["started_ms"] is None:
        ctx.job["started_ms"] = ts
    att = _new_attempt(ev["attempt"], ev["worker_id"], ts)
    att["lease_deadline_ms"] = ev["lease_deadline_ms"]
    att["last_heartbeat_ms"] = ts
    txn.put(attempt_key(ev["job_id"], ev["task_id"], ev["attempt"]), att)
    ctx.save(ts)


def _lease_extended(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.task is None:
        return
    ts = ev["ts_ms"]
    task = ctx.task
    if task["attempt"] == ev["attempt"]:
        task.update(lease_deadline_ms=ev["lease_deadline_ms"], last_heartbeat_ms=ts)
        if ev.get("progress") is not None:
            task["progress"] = ev["progress"]
        if ctx.job is not None:
            ops.sync_task(txn, ctx.job, task)  # the lease deadline moved
        ctx.txn.put(ctx.tkey, task)  # no count changes: the job summary is left alone
    key, att = _load_attempt(txn, ev, ev["worker_id"])
    att.update(lease_deadline_ms=ev["lease_deadline_ms"], last_heartbeat_ms=ts)
    if ev.get("progress") is not None:
        att["progress"] = ev["progress"]
    txn.put(key, att)


def _task_succeeded(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    ts = ev["ts_ms"]
    task = ctx.task
    _set_task_state(ctx.job, task, task_state_after(ev))
    outputs = list(ev.get("outputs") or [])
    task.update(attempt=ev["attempt"], worker_id=ev["worker_id"], ended_ms=ts, result_json=ev.get("result_json"),
                reason=None, exit_code=None, error_type=None, lease_deadline_ms=None, outputs=outputs)
    if is_gpu(task):
        task["progress"] = 1.0  # a GPU task's progress ends at 100% (its last report may say less)
    _gpu(task, "COMPLETED")
    key, att = _load_attempt(txn, ev, ev["worker_id"])
    _end_attempt(att, "succeeded", ts)
    att.update(result_json=ev.get("result_json"), stdout_tail=ev.get("stdout_tail", ""),
               stderr_tail=ev.get("stderr_tail", ""), outputs=outputs)
    txn.put(key, att)
    ctx.save(ts)


def _task_failed(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    ts = ev["ts_ms"]
    task = ctx.task
    state = task_state_after(ev)
    final = state in TASK_TERMINAL  # else the attempt is retried
    _set_task_state(ctx.job, task, state)
    task.update(attempt=ev["attempt"], reason=ev["reason"], exit_code=ev.get("exit_code"),
                error_type=ev.get("error_type"), lease_deadline_ms=None, ended_ms=ts if final else None)
    _gpu(task, "FAILED" if final else "QUEUED")
    key, att = _load_attempt(txn, ev, ev["worker_id"] or None)
    _end_attempt(att, "failed", ts)
    att.update(reason=ev["reason"], exit_code=ev.get("exit_code"), error_type=ev.get("error_type"),
               stdout_tail=ev.get("stdout_tail", ""), stderr_tail=ev.get("stderr_tail", ""))
    txn.put(key, att)
    ops.record_failure(txn, ctx.job, ev)
    ctx.save(ts)


def _task_retry_scheduled(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    task = ctx.task
    _set_task_state(ctx.job, task, task_state_after(ev))
    task.update(retries=task["retries"] + 1, retry_at_ms=ev["retry_at_ms"], reason=ev["reason"],
                worker_id=None, lease_deadline_ms=None)
    ctx.job["retries"] = ctx.job.get("retries", 0) + 1
    ops.record_retry(txn, ctx.job["tenant"])
    ctx.save(ev["ts_ms"])


def _lease_reclaimed(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """The attempt's worker was lost: the attempt ends ``lost``, counted apart from failures and retries."""
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    ts = ev["ts_ms"]
    task = ctx.task
    _set_task_state(ctx.job, task, task_state_after(ev))
    task.update(worker_losses=task.get("worker_losses", 0) + 1, reason=ev["reason"], worker_id=None,
                lease_deadline_ms=None)
    ctx.job["worker_losses"] = ctx.job.get("worker_losses", 0) + 1
    key, att = _load_attempt(txn, ev, ev["worker_id"] or None)
    _end_attempt(att, "lost", ts)
    att["reason"] = ev["reason"]
    txn.put(key, att)
    ops.record_worker_loss(txn, ctx.job["tenant"], ev["reason"])
    ctx.save(ts)


def _task_skipped(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    _set_task_state(ctx.job, ctx.task, task_state_after(ev))
    _gpu(ctx.task, "CANCELLED")
    ctx.task.update(reason=ev["reason"], ended_ms=ev["ts_ms"])
    ctx.save(ev["ts_ms"])


def _task_cancelled(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    ts = ev["ts_ms"]
    _set_task_state(ctx.job, ctx.task, task_state_after(ev))
    _gpu(ctx.task, "CANCELLED")
    ctx.task.update(reason=ev["reason"], ended_ms=ts, lease_deadline_ms=None)
    akey = attempt_key(ev["job_id"], ev["task_id"], ev["attempt"])
    att = txn.get(akey)
    if att is not None and att["outcome"] == "running":  # a running attempt ends cancelled
        _end_attempt(att, "cancelled", ts)
        att["reason"] = ev["reason"]
        txn.put(akey, att)
    ctx.save(ts)


def _job_succeeded(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    ctx = _Ctx(txn, ev["job_id"], None)
    if ctx.job is None:
        return
    state = job_state_after(ev)
    partial = state == JobState.SUCCEEDED_PARTIAL
    _end_job(txn, ctx.job, state, ev["ts_ms"], "some tasks did not succeed (allow_partial)" if partial else None)
    ctx.save(ev["ts_ms"])


def _job_ended_for_a_reason(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """JobFailed, JobCancelled: the job ends in the table's state, with the event's reason."""
    ctx = _Ctx(txn, ev["job_id"], None)
    if ctx.job is None:
        return
    _end_job(txn, ctx.job, job_state_after(ev), ev["ts_ms"], ev["reason"])
    ctx.save(ev["ts_ms"])


def _job_state_set(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """The job's state changes, nothing else (``lifecycle.JOB_STATE_ONLY``: no applier of their own)."""
    ctx = _Ctx(txn, ev["job_id"], None)
    state = job_state_after(ev)
    if ctx.job is None or state is None:
        return
    _set_job_state(txn, ctx.job, state)
    ctx.save(ev["ts_ms"])


def _job_expired(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """The finished job's retention ended (the scheduler's ``finished_job_retention_ms``): its summary, index
    entries, tasks, attempts and history go; the API answers 404 for it. O(its records). The tenant's usage
    counters keep counting it (accounting), and its events stay in the log for the audit."""
    job_id = ev["job_id"]
    job = txn.get(job_key(job_id))
    if job is None:
        return
    for k in _index_keys(job):
        txn.delete(k)
    for prefix in (tasks_prefix(job_id), b"a" + _SEP + part(job_id) + _SEP, history_prefix(job_id)):
        for k in txn.keys_with_prefix(prefix):
            txn.delete(k)
    txn.delete(job_key(job_id))


def _reopen_tasks(txn: ReadModelTxn, ev: Record, counter: str, extra: dict[str, Record] | None = None) -> None:
    """Tasks the scheduler re-opened (a redrive, an operator's retry or mark succeeded): each listed task that
    ended without succeeding is pending again (``extra`` adds fields per task), the job is running again and
    counts it in ``counter``. O(listed tasks), like the scheduler's appliers."""
    ctx = _Ctx(txn, ev["job_id"], None)
    job = ctx.job
    if job is None:
        return
    step = transition(ev)
    assert step.from_task is not None and step.job is not None
    ts = ev["ts_ms"]
    for tid in ev["task_ids"]:
        tkey = task_key(ev["job_id"], tid)
        task = txn.get(tkey)
        if task is None or task["state"] not in step.from_task:
            continue
        _set_task_state(job, task, step.task)
        task.update(reason=None, exit_code=None, error_type=None, ended_ms=None, worker_id=None,
                    lease_deadline_ms=None, retry_at_ms=None, progress=None, updated_ms=ts)
        task.update((extra or {}).get(tid, {}))
        _gpu(task, "QUEUED")
        ops.sync_task(txn, job, task)
        txn.put(tkey, task)
    _set_job_state(txn, job, step.job)
    job.update(ended_ms=None, duration_ms=None, reason=None)
    job[counter] = job.get(counter, 0) + 1
    ctx.save(ts)


def _job_redriven(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    _reopen_tasks(txn, ev, "redrives")


def _task_reopened(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """An operator's retry (the task says who) or mark succeeded (TaskMarkedSucceeded follows)."""
    who = {ev["task_id"]: {"retried_by": ev.get("requested_by") or ""}} if ev["action"] == "retry" else None
    _reopen_tasks(txn, ev, "operator_actions", who)


def _task_marked_succeeded(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """Succeeded by an operator's word, not by a run: the task says who marked it (no attempt record)."""
    ctx = _task_ctx(txn, ev)
    if ctx is None or ctx.job is None or ctx.task is None:
        return
    ts = ev["ts_ms"]
    _set_task_state(ctx.job, ctx.task, task_state_after(ev))
    ctx.task.update(ended_ms=ts, reason=None, exit_code=None, error_type=None, lease_deadline_ms=None,
                    marked_by=ev.get("requested_by") or "", marked_reason=ev.get("reason") or "", marked_ms=ts)
    ctx.job["marked_tasks"] = ctx.job.get("marked_tasks", 0) + 1  # succeeded by an operator's word, not run
    _gpu(ctx.task, "COMPLETED")
    ctx.save(ts)


def _history_only(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    return None


def tenant_settings_key(tenant: str) -> bytes:
    return b"E" + _SEP + part(tenant)


def _tenant_entitlements_set(txn: ReadModelTxn, ev: Record, partition: int, offset: int) -> None:
    """Every partition folds its own copy of the same settings: the last one written stands (equal)."""
    txn.put(tenant_settings_key(ev["tenant"]), {"entitlements": ev["entitlements"], "source": ev["source"],
                                                "ts_ms": ev["ts_ms"]})


APPLIERS: dict[str, Applier] = with_lifecycle_appliers({
    "dagfold.event.JobAccepted": _job_accepted,
    "dagfold.event.JobRejected": _job_rejected,
    "dagfold.event.TaskDispatched": _task_dispatched,
    "dagfold.event.TaskRedispatched": _task_redispatched,
    "dagfold.event.TaskAllocated": _task_allocated,
    "dagfold.event.TaskRequeued": _task_requeued,
    "dagfold.event.TaskCheckpointing": _task_checkpointing,
    "dagfold.event.LeaseGranted": _lease_granted,
    "dagfold.event.LeaseExtended": _lease_extended,
    "dagfold.event.TaskSucceeded": _task_succeeded,
    "dagfold.event.LeaseReclaimed": _lease_reclaimed,
    "dagfold.event.TaskFailed": _task_failed,
    "dagfold.event.TaskRetryScheduled": _task_retry_scheduled,
    "dagfold.event.TaskSkipped": _task_skipped,
    "dagfold.event.TaskCancelled": _task_cancelled,
    "dagfold.event.JobSucceeded": _job_succeeded,
    "dagfold.event.JobFailed": _job_ended_for_a_reason,
    "dagfold.event.JobCancelled": _job_ended_for_a_reason,
    "dagfold.event.JobRedriven": _job_redriven,
    "dagfold.event.TaskReopened": _task_reopened,
    "dagfold.event.TaskMarkedSucceeded": _task_marked_succeeded,
    "dagfold.event.JobExpired": _job_expired,
    "dagfold.event.TenantEntitlementsSet": _tenant_entitlements_set,
}, set_job_state=_job_state_set, record_only=_history_only)
"""Every event type and its applier: these, and the lifecycle's generic ones (``with_lifecycle_appliers``)."""


# -- history ----------------------------------------------------------------
def _within(prefix: str, at_ms: object, ts_ms: object) -> str:
    """``prefix 30s``: how long after the event a deadline falls (readable, unlike raw epoch ms)."""
    if not isinstance(at_ms, int) or not isinstance(ts_ms, int):
        return ""
    s = max(at_ms - ts_ms, 0) / 1000
    return prefix + (f"{s:.3g}s" if s < 60 else f"{s / 60:.3g}min" if s < 3600 else f"{s / 3600:.3g}h")


def _detail(kind: str, ev: Record) -> str:
    """The event's history line: the lifecycle table's template for it (``Transition.says``), else worded here
    (a line that needs more than the event's fields), else its reason."""
    told = history_line(ev)
    if told is not None:
        return told
    g = ev.get
    if kind == "JobAccepted":
        spec = ev["spec"]
        return f"{len(spec['tasks'])} tasks, tenant {spec.get('tenant')}, tier {spec.get('tier')}"
    if kind == "TaskRedispatched":
        return (f"queue {g('queue')}: not leased in time, dispatched again ({g('redispatches')}x)"
                + _within("; next in ", g("next_redispatch_at_ms"), g("ts_ms")))
    if kind == "TaskRedispatchDeferred":
        return (f"queue {g('queue')}: not leased yet, still queued behind older records; not sent again "
                f"({g('deferrals')}x)" + _within("; checks again in ", g("next_redispatch_at_ms"), g("ts_ms")))
    if kind == "TaskAllocated":
        resume = g("resume_checkpoint")
        return f"{g('alloc_id')} on {', '.join(g('node_ids') or [])}" + (f", resumes from {resume}" if resume else "")
    if kind == "TaskRequeued":
        ck = g("checkpoint_uri")
        return f"{g('alloc_id')} ended: {g('reason')}; waits for GPUs again" + (f" (checkpoint {ck})" if ck else "")
    if kind == "LeaseGranted":  # a duration, not the deadline's raw epoch ms
        return f"worker {g('worker_id')}" + _within(", lease ", g("lease_deadline_ms"), g("ts_ms"))
    if kind == "LeaseExtended":
        p = g("progress")
        return f"worker {g('worker_id')}" + (f", progress {p:g}" if isinstance(p, float | int) else "")
    if kind == "TaskFailed":
        code = g("exit_code")
        etype = g("error_type")
        why = str(g("reason") or "")
        # each fact once: the worker's reason often already says "exit code 3"
        extra = "".join([f", exit code {code}" if code is not None and f"exit code {code}" not in why else "",
                         f", {etype}" if etype and etype not in why else ""])
        return f"{why}{extra}" + ("" if g("final", True) else " (will retry)")
    if kind == "TaskRetryScheduled":
        return f"attempt {g('next_attempt')}" + _within(" in ", g("retry_at_ms"), g("ts_ms")) + f": {g('reason')}"
    if kind == "LeaseReclaimed":
        then = "fails (worker_lost)" if g("final") else "runs again, retry budget untouched"
        return f"worker {g('worker_id')} lost ({g('losses')} in this run): {g('reason')}; {then}"
    if kind == "JobSucceeded":
        return "partial success" if g("partial") else "all tasks succeeded"
    if kind == "JobRedriven":
        ids = g("task_ids") or []
        return f"{len(ids)} tasks re-opened: " + ", ".join(ids[:20]) + (", \u2026" if len(ids) > 20 else "")
    if kind == "TaskReopened":
        ids = g("task_ids") or []
        what = "retry" if g("action") == "retry" else "mark succeeded"
        why = f" ({g('reason')})" if g("reason") else ""
        return (f"{what} by {g('requested_by') or 'an operator'}: {len(ids)} task(s) re-opened: "
                + ", ".join(ids[:20]) + (", \u2026" if len(ids) > 20 else "") + why)
    if kind == "TaskMarkedSucceeded":
        return (f"marked succeeded by {g('requested_by') or 'an operator'}, not run"
                + (f": {g('reason')}" if g("reason") else ""))
    if kind == "TaskActionRejected":
        what = "retry" if g("action") == "retry" else "mark succeeded"
        return f"{what} refused ({g('code')}): {g('reason')}"
    reason = g("reason")
    return reason if isinstance(reason, str) else ""


def history_entry(ev: Record, partition: int, offset: int) -> Record:
    kind = str(ev.get("type", "")).rsplit(".", 1)[-1]
    return {
        "partition": partition,
        "offset": offset,
        "ts_ms": ev.get("ts_ms"),
        "type": kind,
        "task_id": ev.get("task_id"),
        "attempt": ev.get("attempt"),
        "cause_offset": ev.get("cause_offset", -1),
        "detail": _short(_detail(kind, ev)),
    }


def apply(txn: ReadModelTxn, event: Record, partition: int, offset: int) -> None:
    """Fold one event (from ``partition`` at ``offset`` of the events topic) into ``txn``."""
    job_id = event.get("job_id")
    if not isinstance(job_id, str):
        return  # not a job event: nothing of the jobs read model
    if event.get("type") == "dagfold.event.JobRejected":
        job = txn.get(job_key(job_id))
        if job is not None and job["tenant"] != event.get("tenant", job["tenant"]):
            # another tenant's submission under a taken job ID: never part of this job, nor its history; the
            # submitter's own view of it (its GET answers 'rejected, job_id_taken' instead of 404 forever)
            _claim_rejected(txn, event, partition)
            return
    applier = APPLIERS.get(event.get("type", ""))
    if applier is not None:
        applier(txn, event, partition, offset)
    if event.get("type") == EXPIRED:
        return  # the job's records are gone, its history with them
    entry = history_entry(event, partition, offset)
    task_id = event.get("task_id")
    if isinstance(task_id, str):  # the task's state after the event: live views recolour from history alone
        task = txn.get(task_key(job_id, task_id))
        entry["task_state"] = task["state"] if task is not None else None
        if task is not None and task.get("gpu_state"):
            entry["gpu_state"] = task["gpu_state"]
    txn.put(history_key(job_id, partition, offset), entry)
    job = txn.get(job_key(job_id))
    if job is not None and job["last_offset"] < offset:
        job["last_offset"] = offset
        txn.put(job_key(job_id), job)


# -- queries ----------------------------------------------------------------
def _attempt_task_id(k: bytes, prefix: bytes) -> str:
    """Task ID of an attempt key ``prefix task \0 attempt(>I)`` (the attempt is the last 4 bytes)."""
    return unpart(k[len(prefix):-5])


class ReadModel:
    """Queries over the jobs read model; safe to call from any thread."""

    def __init__(self, store: ReadModelStore) -> None:
        self.store = store

    def job_tenant(self, job_id: str) -> str | None:
        """The tenant of a job, or None if there is no such job; decodes only that field.

        The check before a job is read for a caller: a job of another tenant answers as fast as a missing
        one, however large its record (msgspec skips the other fields without building them).
        """
        raw = self.store.get_raw(job_key(job_id))
        return None if raw is None else _TENANT_OF(raw).tenant

    def get_job(self, job_id: str) -> Record | None:
        """The job summary, or None if no event of it was projected."""
        job: Record | None = self.store.get(job_key(job_id))
        return job

    def rejected_claim(self, tenant: str, job_id: str) -> Record | None:
        """``tenant``'s own submission of ``job_id`` that was rejected because another tenant's job holds the ID
        (``job_id_taken``), as a rejected job summary; None if there was none."""
        job: Record | None = self.store.get(claim_key(tenant, job_id))
        return job

    def tenant_settings(self, tenant: str) -> Record | None:
        """The tenant's entitlements as last set through the log ({entitlements, source, ts_ms}), or None."""
        rec: Record | None = self.store.get(tenant_settings_key(tenant))
        return rec

    def list_jobs(self, tenant: str | None = None, state: str | None = None, limit: int = 100,
                  cursor: str | None = None, created_after: int | None = None,
                  created_before: int | None = None, name: str | None = None,
                  id_prefix: str | None = None) -> Page:
        """Job summaries, newest first, optionally of one tenant and/or job state.

        ``created_after`` / ``created_before`` (ms, inclusive / exclusive) bound
        the creation time: a range of the index, not a filter over all jobs.
        ``name`` keeps jobs whose name contains it (any case): a filter, so a rare
        name reads the index range until ``limit`` jobs match. ``id_prefix`` lists
        the jobs whose ID starts with it, in ID order (a range of the job keys:
        how the CLI resolves a short ID).
        """
        needle = name.casefold() if name else None

        def keep(job: Record | None) -> Record | None:
            if job is None or (state is not None and job["state"] != state):
                return None  # (state: moved on between the index read and now)
            if tenant is not None and job["tenant"] != tenant:
                return None
            if needle is not None and needle not in (job.get("name") or "").casefold():
                return None
            if created_after is not None and job["created_ms"] < created_after:
                return None
            if created_before is not None and job["created_ms"] >= created_before:
                return None
            return job

        if id_prefix is not None:
            scan_prefix = job_key(id_prefix)
            start = decode_cursor(cursor, scan_prefix) if cursor else None
            return paginate(((k, keep(decode_value(v))) for k, v in self.store.scan(scan_prefix, after=start)),
                            clamp_limit(limit))
        prefix = index_prefix(tenant, state)
        after = decode_cursor(cursor, prefix) if cursor else None
        if created_before is not None:
            bound = prefix + ms(created_before)
            if after is None or bound < after:
                after = bound  # a reverse scan starts strictly before this key
        low = ms(created_after) if created_after is not None else None

        def rows() -> Iterator[tuple[bytes, Record | None]]:
            for k, _ in self.store.scan(prefix, after=after, reverse=True):
                if low is not None and k[len(prefix):len(prefix) + 16] < low:
                    return
                yield k, keep(self.get_job(unpart(k.rsplit(_SEP, 1)[1])))

        return paginate(rows(), clamp_limit(limit))

    def get_rejected_graph(self, job_id: str) -> Record | None:
        """The refused spec's graph of a rejected job (task IDs, edges, the offending ones marked), or None."""
        graph: Record | None = self.store.get(rejected_graph_key(job_id))
        return graph

    def get_tasks(self, job_id: str, limit: int = 100, cursor: str | None = None,
                  state: str | None = None) -> Page:
        """Task records of a job in task-ID order; ``state`` filters (a scan of the job's tasks)."""
        prefix = tasks_prefix(job_id)
        after = decode_cursor(cursor, prefix) if cursor else None

        def rows() -> Iterator[tuple[bytes, Record | None]]:
            for k, v in self.store.scan(prefix, after=after):
                task = decode_value(v)
                yield k, (public(task) if state is None or task["state"] == state else None)

        return paginate(rows(), clamp_limit(limit))

    def iter_tasks(self, job_id: str) -> Iterator[Record]:
        """Every task record of a job, in task-ID order (for the graph layout)."""
        for _, v in self.store.scan(tasks_prefix(job_id)):
            yield decode_value(v)

    def get_task(self, job_id: str, task_id: str) -> Record | None:
        task: Record | None = self.store.get(task_key(job_id, task_id))
        return None if task is None else public(task)

    def get_attempts(self, job_id: str, task_id: str) -> list[Record]:
        """Attempts of a task, first attempt first."""
        return [decode_value(v) for _, v in self.store.scan(attempts_prefix(job_id, task_id))]

    def get_job_attempts(self, job_id: str, limit: int = 1000, cursor: str | None = None) -> Page:
        """Every attempt of a job (each with its ``task_id``), by task then attempt: the timeline."""
        prefix = b"a" + _SEP + part(job_id) + _SEP
        after = decode_cursor(cursor, prefix) if cursor else None
        rows = ((k, {"task_id": _attempt_task_id(k, prefix), **decode_value(v)})
                for k, v in self.store.scan(prefix, after=after))
        return paginate(rows, clamp_limit(limit))

    def get_history(self, job_id: str, limit: int = 100, cursor: str | None = None) -> Page:
        """Every event of a job in log order (oldest first)."""
        prefix = history_prefix(job_id)
        after = decode_cursor(cursor, prefix) if cursor else None
        rows = ((k, decode_value(v)) for k, v in self.store.scan(prefix, after=after))
        return paginate(rows, clamp_limit(limit))

    def history_cursor(self, job_id: str, partition: int, offset: int) -> str:
        """The cursor that resumes a job's history after the entry at ``partition``/``offset``."""
        return encode_cursor(history_key(job_id, partition, offset))

    def positions(self, topic: str) -> dict[int, int]:
        """Next offset the projector will read, per partition of ``topic``."""
        prefix = b"p" + _SEP + part(topic) + _SEP
        return {_U32.unpack(k[len(prefix):])[0]: decode_value(v) for k, v in self.store.scan(prefix)}

    def counters(self) -> dict[str, int]:
        """Projector counters (undecodable records skipped, applier errors)."""
        prefix = meta_key("")
        return {k[len(prefix):].decode(): decode_value(v) for k, v in self.store.scan(prefix)}
