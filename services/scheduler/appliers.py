"""Event appliers: the only code that changes scheduler state.

Command handlers decide and emit events; each event is applied here at once (so
later decisions in the batch see it) and again, alone, on replay. Appliers
never look at commands, the clock or anything outside the event and the state,
which is why replaying the events topic rebuilds the same state byte for byte.
Every applier touches O(1) keys, except JobAccepted (once per job, O(tasks +
edges)) and an outcome's notification of its direct dependents (O(out-degree)).
The state each event leaves its task and job in comes from the lifecycle table
(``dagfold.lifecycle.LIFECYCLE``), which the read model's appliers follow too; an event the table
describes alone (a job-only state change, or no change) has no applier here of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from dagfold.codec import Record
from dagfold.lifecycle import TASK_TERMINAL as TERMINAL
from dagfold.lifecycle import TaskState, job_state_after, task_state_after, transition, with_lifecycle_appliers
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.retry import NO_RETRY
from dagfold.state import PartitionTransaction
from dagfold.tenants import stored_settings

Applier = Callable[[PartitionTransaction, Record], None]


def get_job(txn: PartitionTransaction, job_id: str) -> dict[str, Any] | None:
    """The job record as a copy to change and put back (appliers)."""
    j = txn.get(keys.job(job_id))
    return None if j is None else dict(j)


def get_task(txn: PartitionTransaction, job_id: str, task_id: str) -> dict[str, Any] | None:
    """The task record as a copy to change and put back (appliers)."""
    t = txn.get(keys.task(job_id, task_id))
    return None if t is None else dict(t)


def read_job(txn: PartitionTransaction, job_id: str) -> Mapping[str, Any] | None:
    """The job record itself, to decide from (handlers): no copy, so never change it.

    Stored records are replaced on every change, never changed in place, so what
    this returns stays the state as it was when read, exactly like a copy would.
    Handlers read a task about ten times per command; copying each read was a
    fifth of the fold's time.
    """
    j: Mapping[str, Any] | None = txn.get(keys.job(job_id))
    return j


def read_task(txn: PartitionTransaction, job_id: str, task_id: str) -> Mapping[str, Any] | None:
    """The task record itself, to decide from (see ``read_job``)."""
    t: Mapping[str, Any] | None = txn.get(keys.task(job_id, task_id))
    return t


def get_dependents(txn: PartitionTransaction, job_id: str, task_id: str) -> list[str]:
    return txn.get(keys.dependents(job_id, task_id)) or []


def _set_timer(txn: PartitionTransaction, job_id: str, task_id: str, t: dict[str, Any],
               kind: str, due: int | None, attempt: int) -> None:
    """Replace the task's timer of this kind (the index is keyed by due time)."""
    if due is None and kind not in (t.get("timers") or ()):
        return  # no timer to clear: most calls (no timeouts set), and the record stays as it is
    timers = dict(t.get("timers") or {})
    old = timers.pop(kind, None)
    if old is not None:
        _delete_timer(txn, keys.timer(old, job_id, task_id, kind))
    if due is not None:
        timers[kind] = due
        txn.put(keys.timer(due, job_id, task_id, kind), attempt)
    t["timers"] = timers


def _clear_timers(txn: PartitionTransaction, job_id: str, task_id: str, t: dict[str, Any]) -> None:
    for kind, due in (t.get("timers") or {}).items():
        _delete_timer(txn, keys.timer(due, job_id, task_id, kind))
    t["timers"] = {}


def _delete_timer(txn: PartitionTransaction, key: bytes) -> None:
    """A timer's key holds its due time: once deleted it is never read again, so it leaves the cache too."""
    txn.delete(key)
    txn.uncache(key)


_OUTCOME: dict[str, str] = {TaskState.SUCCEEDED: "ok", TaskState.FAILED: "bad", TaskState.SKIPPED: "skip",
            TaskState.CANCELLED: "skip"}
"""The upstream-outcome counter of a dependent that a task's terminal state moves (trigger rules read them)."""


def _finish_task(txn: PartitionTransaction, e: Record) -> None:
    """Move a task to the terminal state the event says, update job counters and its dependents' counts."""
    job_id, task_id = e["job_id"], e["task_id"]
    state = task_state_after(e)
    assert state is not None
    outcome = _OUTCOME[state]
    t = get_task(txn, job_id, task_id)
    if t is None or t["state"] in TERMINAL:
        return
    _clear_timers(txn, job_id, task_id, t)
    t["state"] = state
    t["worker"] = None
    t["alloc"] = None
    t["ended_ms"] = e["ts_ms"]
    t.pop("held", None)
    txn.put(keys.task(job_id, task_id), t)
    j = get_job(txn, job_id)
    if j is not None:
        j["open"] -= 1
        j[state] += 1
        if state == TaskState.SUCCEEDED and t["leaf"]:
            j["leaf_ok"] += 1
        if state == TaskState.FAILED and not j.get("first_failure"):
            j["first_failure"] = f"{task_id}: {e['reason']}"
        txn.put(keys.job(job_id), j)
    for d in get_dependents(txn, job_id, task_id):
        dt = get_task(txn, job_id, d)
        if dt is None:
            continue
        dt["rem"] -= 1
        dt[outcome] += 1
        txn.put(keys.task(job_id, d), dt)


def _job_accepted(txn: PartitionTransaction, e: Record) -> None:
    spec = e["spec"]
    job_id = spec["job_id"]
    tasks = spec["tasks"]
    step = transition(e)
    downs: dict[str, list[str]] = {}
    for t in tasks:
        for u in dict.fromkeys(t["depends_on"]):
            downs.setdefault(u, []).append(t["task_id"])
    for t in tasks:
        ups = list(dict.fromkeys(t["depends_on"]))
        txn.put(keys.task(job_id, t["task_id"]), {
            "state": step.task, "attempt": 0, "n_up": len(ups), "rem": len(ups), "ok": 0, "bad": 0, "skip": 0,
            "queue": t["queue"], "handler": t["handler"], "args": t["args_json"], "rule": t["trigger_rule"],
            "retry": t["retry"] or spec["retry"] or NO_RETRY,
            "timeouts": t["timeouts"] or spec["timeouts"], "resources": t["resources"],
            "leaf": t["task_id"] not in downs, "worker": None, "lease_ms": None, "timers": {},
            "ended_ms": None, **({"tp": e["traceparent"]} if e.get("traceparent") else {}),
        })
    for u, ds in downs.items():
        txn.put(keys.dependents(job_id, u), ds)
    txn.put(keys.task_list(job_id), [t["task_id"] for t in tasks])
    txn.put(keys.job(job_id), {
        "state": step.job, "tenant": spec["tenant"], "tier": spec["tier"],
        "policy": spec["failure_policy"], "n": len(tasks), "open": len(tasks),
        "succeeded": 0, "failed": 0, "skipped": 0, "cancelled": 0, "leaf_ok": 0,
        "hash": e["spec_hash"], "accepted_ms": e["ts_ms"],
        "idempotency_key": spec["idempotency_key"], "cancel_requested": False,
    })
    if spec["idempotency_key"]:
        txn.put(keys.idempotency(spec["tenant"], spec["idempotency_key"]), job_id)


TaskApplier = Callable[[PartitionTransaction, Record, dict[str, Any]], None]


def _on_task(change: TaskApplier) -> Applier:
    """An applier that changes one task record: load it (events of unknown tasks change nothing),
    let ``change`` update it and its timers, save it."""

    def apply(txn: PartitionTransaction, e: Record) -> None:
        t = get_task(txn, e["job_id"], e["task_id"])
        if t is not None:
            change(txn, e, t)
            txn.put(keys.task(e["job_id"], e["task_id"]), t)

    return apply


def _timeout_due(e: Record, t: dict[str, Any], name: str) -> int | None:
    """When the task's ``name`` timeout, counted from this event, runs out; None if it has none."""
    seconds = (t["timeouts"] or {}).get(name)
    return e["ts_ms"] + int(seconds * 1000) if seconds else None


@_on_task
def _task_dispatched(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    t["state"] = task_state_after(e)
    t["attempt"] = e["attempt"]
    t["worker"] = None
    t["alloc"] = None
    t.pop("redisp", None)
    t.pop("redefer", None)
    t.pop("held", None)
    _set_timer(txn, e["job_id"], e["task_id"], t, "backoff", None, e["attempt"])
    _set_timer(txn, e["job_id"], e["task_id"], t, "schedule_to_start",
               _timeout_due(e, t, "schedule_to_start_s"), e["attempt"])
    # logs written before re-dispatch existed decode with null here: no timer
    _set_timer(txn, e["job_id"], e["task_id"], t, "redispatch", e.get("redispatch_at_ms"), e["attempt"])
    if e.get("redispatch_at_ms") is not None:
        t["disp"] = e["ts_ms"]  # when its record went on the queue (queue progress, at its lease)
    else:
        t.pop("disp", None)


@_on_task
def _task_redispatched(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    """A new record for the same runnable attempt: counted (the next interval doubles), timer re-armed."""
    t["redisp"] = e["redispatches"]
    t["disp"] = e["ts_ms"]
    t.pop("held", None)
    _set_timer(txn, e["job_id"], e["task_id"], t, "redispatch", e["next_redispatch_at_ms"], e["attempt"])


@_on_task
def _task_redispatch_deferred(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    """No new record (the queue is still draining records older than this one's): the check re-armed."""
    t["redefer"] = e["deferrals"]
    t.pop("held", None)
    _set_timer(txn, e["job_id"], e["task_id"], t, "redispatch", e["next_redispatch_at_ms"], e["attempt"])


def _queue_taken(txn: PartitionTransaction, e: Record, queue: str, dispatched_ms: int) -> None:
    """A worker took a record of ``queue`` put there at ``dispatched_ms``: the queue's progress for the
    job's tenant (latest dispatch time taken, and when). Cost: one job read (cached) and one small write
    per lease, so that a re-dispatch check reads one key instead of guessing from time alone."""
    j = txn.get(keys.job(e["job_id"]))
    if j is None:
        return
    k = keys.queue_progress(queue, j["tenant"])
    prev = txn.get(k)
    if prev is None or dispatched_ms > prev[0] or e["ts_ms"] != prev[1]:
        # a batch's commands share one time: after its first lease most leave the value as it is
        txn.put(k, [max(dispatched_ms, prev[0]) if prev else dispatched_ms, e["ts_ms"]])


@_on_task
def _lease_granted(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    t["state"] = task_state_after(e)
    t["worker"] = e["worker_id"]
    t["lease_ms"] = e["lease_deadline_ms"]
    t.pop("held", None)
    _set_timer(txn, e["job_id"], e["task_id"], t, "schedule_to_start", None, e["attempt"])
    _set_timer(txn, e["job_id"], e["task_id"], t, "redispatch", None, e["attempt"])
    _set_timer(txn, e["job_id"], e["task_id"], t, "lease", e["lease_deadline_ms"], e["attempt"])
    disp = t.pop("disp", None)
    if disp is not None:
        _queue_taken(txn, e, t["queue"], disp)
    _set_timer(txn, e["job_id"], e["task_id"], t, "start_to_close",
               _timeout_due(e, t, "start_to_close_s"), e["attempt"])


@_on_task
def _lease_extended(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    t["lease_ms"] = e["lease_deadline_ms"]
    _set_timer(txn, e["job_id"], e["task_id"], t, "lease", e["lease_deadline_ms"], e["attempt"])


@_on_task
def _task_allocated(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    """GPUs granted: the attempt waits for its first host's TaskStarted from this allocation only.

    ``epoch`` keeps the newest grant's epoch (the pool numbers its grants in order) through requeues
    and retries, so that a redelivered grant of an allocation already requeued is known as stale."""
    t["alloc"] = e["alloc_id"]
    t["epoch"] = max(t.get("epoch") or 0, e["epoch"])
    if e["resume_checkpoint"]:
        t["ckpt"] = e["resume_checkpoint"]


@_on_task
def _task_requeued(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    """The allocation ended without a result: the same attempt waits for GPUs again (no lease, no
    run-time clock); its checkpoint is where the next grant resumes."""
    _set_timer(txn, e["job_id"], e["task_id"], t, "lease", None, e["attempt"])
    _set_timer(txn, e["job_id"], e["task_id"], t, "start_to_close", None, e["attempt"])
    t.update(state=task_state_after(e), worker=None, alloc=None, lease_ms=None)
    if e["checkpoint_uri"]:
        t["ckpt"] = e["checkpoint_uri"]


@_on_task
def _attempt_will_retry(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    _clear_timers(txn, e["job_id"], e["task_id"], t)
    t["state"] = task_state_after(e)
    t["worker"] = None
    t["alloc"] = None


@_on_task
def _lease_reclaimed(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    """The worker is lost: the lease ends; TaskDispatched (next attempt) or TaskFailed (final) follows.
    ``lost`` counts the losses of this run, which the retry budget does not count."""
    _clear_timers(txn, e["job_id"], e["task_id"], t)
    t.update(state=task_state_after(e), worker=None, alloc=None, lease_ms=None, lost=e["losses"])


def _task_failed(txn: PartitionTransaction, e: Record) -> None:
    if task_state_after(e) in TERMINAL:  # final: failed; else retrying
        _finish_task(txn, e)
    else:
        _attempt_will_retry(txn, e)


@_on_task
def _retry_scheduled(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    _set_timer(txn, e["job_id"], e["task_id"], t, "backoff", e["retry_at_ms"], e["attempt"])


def _job_ended(txn: PartitionTransaction, e: Record) -> None:
    j = get_job(txn, e["job_id"])
    if j is None:
        return
    j["state"] = job_state_after(e)
    j["ended_ms"] = e["ts_ms"]
    _set_expiry(txn, e["job_id"], j, e.get("expires_ms"))
    txn.put(keys.job(e["job_id"]), j)
    _uncache_job(txn, e["job_id"])


def _set_expiry(txn: PartitionTransaction, job_id: str, j: dict[str, Any], due: int | None) -> None:
    """The finished job's retention timer (a job's timer: task ID ""), replacing any earlier one; None clears."""
    old = j.pop("expires_ms", None)
    if old is not None:
        _delete_timer(txn, keys.timer(old, job_id, "", keys.EXPIRE_TIMER))
    if due is not None:
        j["expires_ms"] = due
        txn.put(keys.timer(due, job_id, "", keys.EXPIRE_TIMER), 0)


def _job_expired(txn: PartitionTransaction, e: Record) -> None:
    """The finished job's retention ended: every record of it goes (job, task list, tasks, dependents, its
    retention timer, its idempotency key if it still names this job). O(tasks of the job)."""
    job_id = e["job_id"]
    j = get_job(txn, job_id)
    if j is None:
        return
    _set_expiry(txn, job_id, j, None)
    task_ids = txn.get(keys.task_list(job_id)) or []
    for tid in task_ids:
        t = get_task(txn, job_id, tid)
        if t is not None:
            _clear_timers(txn, job_id, tid, dict(t))  # none is left on a finished job's tasks; cheap to be sure
        for key in (keys.task(job_id, tid), keys.dependents(job_id, tid)):
            txn.delete(key)
            txn.uncache(key)
    if j.get("idempotency_key"):
        ikey = keys.idempotency(j["tenant"], j["idempotency_key"])
        if txn.get(ikey) == job_id:
            txn.delete(ikey)
            txn.uncache(ikey)
    for key in (keys.job(job_id), keys.task_list(job_id)):
        txn.delete(key)
        txn.uncache(key)


def _uncache_job(txn: PartitionTransaction, job_id: str) -> None:
    """A finished job's records leave the shared cache (``PartitionTransaction.uncache``); a redrive, a
    retry or a late report reads them from the store again."""
    task_ids = txn.get(keys.task_list(job_id)) or []
    for key in (keys.job(job_id), keys.task_list(job_id)):
        txn.uncache(key)
    for task_id in task_ids:
        txn.uncache(keys.task(job_id, task_id))
        txn.uncache(keys.dependents(job_id, task_id))


def _job_redriven(txn: PartitionTransaction, e: Record) -> None:
    """Re-open the listed tasks (all terminal but succeeded); upstream counts are rebuilt from the set.

    Every task of a finished job is terminal, so an upstream outside the set has
    succeeded: a re-opened task waits only for re-opened upstreams.
    """
    job_id = e["job_id"]
    reopened = set(e["task_ids"])
    step = transition(e)
    j = get_job(txn, job_id)
    if j is None:
        return
    waiting: dict[str, int] = dict.fromkeys(reopened, 0)
    for tid in reopened:
        for d in get_dependents(txn, job_id, tid):
            if d in waiting:
                waiting[d] += 1
    for tid in e["task_ids"]:
        t = get_task(txn, job_id, tid)
        if t is None:
            continue
        j[t["state"]] -= 1
        # base: attempts before this run; the retry budget counts from it, attempt numbers go on
        t.update(state=step.task, rem=waiting[tid], ok=t["n_up"] - waiting[tid], bad=0, skip=0,
                 worker=None, lease_ms=None, ended_ms=None, base=t["attempt"], lost=0)
        txn.put(keys.task(job_id, tid), t)
    j.update(state=step.job, open=j["open"] + len(reopened), first_failure=None, ended_ms=None)
    _set_expiry(txn, job_id, j, None)  # running again: kept until its next end
    txn.put(keys.job(job_id), j)


def _task_reopened(txn: PartitionTransaction, e: Record) -> None:
    """An operator re-opened tasks (RetryTask, MarkTaskSucceeded): each listed task that ended without
    succeeding is pending again as a new run (fresh retry budget, attempt numbers go on), its
    dependents count it open again, and the job runs again.

    O(listed tasks + their out-degree): the dependents' counts change by the listed tasks' old
    outcomes only (unlike a redrive, upstreams outside the list need not have succeeded).
    """
    job_id = e["job_id"]
    step = transition(e)
    assert step.from_task is not None
    j = get_job(txn, job_id)
    if j is None:
        return
    old: dict[str, str] = {}
    for tid in e["task_ids"]:
        t = get_task(txn, job_id, tid)
        if t is None or t["state"] not in step.from_task or tid in old:
            continue
        old[tid] = t["state"]
        j[t["state"]] -= 1
        if t["state"] == TaskState.FAILED and str(j.get("first_failure") or "").startswith(f"{tid}: "):
            j["first_failure"] = None
        t.update(state=step.task, worker=None, alloc=None, lease_ms=None, ended_ms=None, base=t["attempt"], lost=0)
        txn.put(keys.task(job_id, tid), t)
    for tid, state in old.items():
        outcome = _OUTCOME[state]
        for d in get_dependents(txn, job_id, tid):
            dt = get_task(txn, job_id, d)
            if dt is not None:
                dt["rem"] += 1
                dt[outcome] -= 1
                txn.put(keys.task(job_id, d), dt)
    j.update(state=step.job, open=j["open"] + len(old), ended_ms=None)
    _set_expiry(txn, job_id, j, None)  # running again: kept until its next end
    txn.put(keys.job(job_id), j)


@_on_task
def _task_held(txn: PartitionTransaction, e: Record, t: dict[str, Any]) -> None:
    """Its job is paused: marked held (what ResumeJob lets run), its backoff and re-dispatch timers gone
    (the one that fired is spent; a re-dispatch is decided again on resume)."""
    t["held"] = True
    _set_timer(txn, e["job_id"], e["task_id"], t, "backoff", None, e["attempt"])
    _set_timer(txn, e["job_id"], e["task_id"], t, "redispatch", None, e["attempt"])


def _job_state_set(txn: PartitionTransaction, e: Record) -> None:
    """A job's state changes, nothing else (``lifecycle.JOB_STATE_ONLY``: no applier of their own)."""
    j = get_job(txn, e["job_id"])
    if j is not None:
        j["state"] = job_state_after(e)
        txn.put(keys.job(e["job_id"]), j)


def _no_state(txn: PartitionTransaction, e: Record) -> None:
    """Recorded for the audit only."""


def _tenant_entitlements_set(txn: PartitionTransaction, e: Record) -> None:
    """One key per tenant; ``file`` remembers the auth file's last settings, so an API restart with an
    unchanged file does not undo what the admin API set since."""
    old = txn.get(keys.tenant(e["tenant"]))
    txn.put(keys.tenant(e["tenant"]), stored_settings(old, e["entitlements"], e.get("source") or "admin_api"))


def read_tenant(txn: PartitionTransaction, tenant: str) -> Record | None:
    """The tenant's stored settings ({ent, file}), or None when none were ever set."""
    return txn.get(keys.tenant(tenant))  # type: ignore[no-any-return]


APPLIERS: dict[str, Applier] = with_lifecycle_appliers({
    "dagfold.event.JobAccepted": _job_accepted,
    "dagfold.event.TenantEntitlementsSet": _tenant_entitlements_set,
    "dagfold.event.JobRejected": _no_state,
    "dagfold.event.TaskDispatched": _task_dispatched,
    "dagfold.event.TaskRedispatched": _task_redispatched,
    "dagfold.event.TaskRedispatchDeferred": _task_redispatch_deferred,
    "dagfold.event.TaskAllocated": _task_allocated,
    "dagfold.event.TaskRequeued": _task_requeued,
    "dagfold.event.LeaseGranted": _lease_granted,
    "dagfold.event.LeaseExtended": _lease_extended,
    "dagfold.event.TaskSucceeded": _finish_task,
    "dagfold.event.LeaseReclaimed": _lease_reclaimed,
    "dagfold.event.TaskFailed": _task_failed,
    "dagfold.event.TaskRetryScheduled": _retry_scheduled,
    "dagfold.event.TaskSkipped": _finish_task,
    "dagfold.event.TaskCancelled": _finish_task,
    "dagfold.event.JobSucceeded": _job_ended,
    "dagfold.event.JobFailed": _job_ended,
    "dagfold.event.JobCancelled": _job_ended,
    "dagfold.event.JobRedriven": _job_redriven,
    "dagfold.event.TaskReopened": _task_reopened,
    "dagfold.event.TaskMarkedSucceeded": _finish_task,
    "dagfold.event.TaskHeld": _task_held,
    "dagfold.event.JobExpired": _job_expired,
}, set_job_state=_job_state_set, record_only=_no_state)
"""Every event type and its applier: these, and the lifecycle's generic ones (``with_lifecycle_appliers``);
JobRejected changes nothing here (the scheduler keeps nothing of a rejected submission)."""


def apply_event(txn: PartitionTransaction, event: Record) -> None:
    """Apply one event; unknown event types are an error (a newer writer wrote them)."""
    APPLIERS[event["type"]](txn, event)
