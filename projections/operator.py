"""Operator read models: tenant usage, queue depths, stuck-task deadlines, failure reasons.

They are secondary indexes of the jobs model, maintained by the jobs appliers
(``dagfold.projections.jobs``) through the hooks below, in the same write batch as the
job and task records, so they are exactly as current as the jobs model and a
replay of the events topic rebuilds them identically. Every hook is O(1) per
event: counts move with each task state transition, never recounted.

Why "stuck" is a deadline index rather than a flag: whether a task is stuck
depends on the current time, which the fold must never read. The projection
stores each open task's next deadline (lease expiry, start-to-close, schedule-
to-start, end of backoff) in a key sorted by due time; a query at time *now*
reads only the keys due before *now* (cost: the stuck tasks, not all tasks).

Each task record carries ``_ix``, the index entries it currently holds, so a
transition removes exactly what was written before (private: the API strips it).

Key spaces (``\\x00``-separated, see ``dagfold.projections.keys``)::

    ut tenant                           -> tenant usage (jobs and tasks by state, retries, failures)
    q  queue                            -> {"runnable", "running", "retrying"} task counts
    qT tenant queue                     -> the same, one tenant's tasks
    qa queue dispatched(ms) job task    -> tenant    (runnable tasks by dispatch time: queue age)
    sd due(ms) job task                 -> kind      (open-task deadlines, all tenants)
    sD tenant due(ms) job task          -> kind      (the same, per tenant)
    fr tenant class                     -> failure-reason aggregate
    fg ts(ms) job task attempt          -> failure entry (all tenants)
    ft tenant ts(ms) job task attempt   -> failure entry (per tenant)
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from dagfold.lifecycle import JOB_OPEN, JOB_STATES, TASK_STATES, TaskState
from dagfold.projections.keys import SEP, U32, Record, clamp_limit, job_key, key, ms, part, public, task_key, unpart
from dagfold.projections.store import ReadModelStore, ReadModelTxn, decode_value

QUEUE_STATES: tuple[str, ...] = (TaskState.RUNNABLE, TaskState.RUNNING, TaskState.RETRYING)
"""The task states a queue's depth counts."""

USAGE = b"ut"
QUEUE = b"q"
QUEUE_TENANT = b"qT"
QUEUE_AGE = b"qa"
DEADLINE = b"sd"
DEADLINE_TENANT = b"sD"
REASONS = b"fr"
FAILURES = b"fg"
FAILURES_TENANT = b"ft"

_TOKEN = re.compile(r"^([a-z][a-z0-9_]{2,40})(?::|$)")
_DIGITS = re.compile(r"\d+")


# -- tenant usage ---------------------------------------------------------------
def _usage(txn: ReadModelTxn, tenant: str) -> tuple[bytes, Record]:
    k = key(USAGE, part(tenant))
    u = txn.get(k)
    if u is None:
        u = {"tenant": tenant, "jobs": dict.fromkeys(JOB_STATES, 0), "tasks": dict.fromkeys(TASK_STATES, 0),
             "retries": 0, "failures": 0, "lease_expiries": 0, "worker_losses": 0, "redispatches": 0}
    return k, u


def count_job(txn: ReadModelTxn, tenant: str, state: str | None, delta: int) -> None:
    """A job of ``tenant`` entered (``delta`` 1) or left (-1) ``state``."""
    if state is None:
        return
    k, u = _usage(txn, tenant)
    u["jobs"][state] = u["jobs"].get(state, 0) + delta
    txn.put(k, u)


def tasks_created(txn: ReadModelTxn, tenant: str, n: int) -> None:
    """A job of ``n`` pending tasks was accepted (tasks start with ``_ix = {"st": "pending"}``)."""
    k, u = _usage(txn, tenant)
    u["tasks"][TaskState.PENDING] = u["tasks"].get(TaskState.PENDING, 0) + n
    txn.put(k, u)


def initial_ix() -> Record:
    return {"st": TaskState.PENDING}


# -- per-task indexes -----------------------------------------------------------
def _deadline(task: Record) -> tuple[int, str] | None:
    """The task's next due time and what it means, or None when nothing is due."""
    state = task["state"]
    if state == TaskState.RUNNING:
        best: tuple[int, str] | None = None
        lease = task.get("lease_deadline_ms")
        if lease is not None:
            best = (int(lease), "lease")
        s2c = task.get("s2c_ms")
        if s2c is not None and task.get("started_ms") is not None:
            due = int(task["started_ms"]) + int(s2c)
            if best is None or due < best[0]:
                best = (due, "start_to_close")
        return best
    if state == TaskState.RUNNABLE:
        s2s = task.get("s2s_ms")
        if s2s is not None and task.get("dispatched_ms") is not None:
            return int(task["dispatched_ms"]) + int(s2s), "schedule_to_start"
        return None
    if state == TaskState.RETRYING and task.get("retry_at_ms") is not None:
        return int(task["retry_at_ms"]), "backoff"
    return None


def _bump_queue(txn: ReadModelTxn, tenant: str, queue: str, state: str, delta: int) -> None:
    for k in (key(QUEUE, part(queue)), key(QUEUE_TENANT, part(tenant), part(queue))):
        q = txn.get(k) or dict.fromkeys(QUEUE_STATES, 0)
        q[state] = q.get(state, 0) + delta
        if any(q.values()):
            txn.put(k, q)
        else:
            txn.delete(k)  # an idle queue leaves no key behind (replay gives the same keys)


def _task_suffix(job_id: str, task_id: str) -> bytes:
    return part(job_id) + SEP + part(task_id)


def sync_task(txn: ReadModelTxn, job: Record, task: Record) -> None:
    """Bring the indexes of ``task`` in line with its current fields (call before saving it)."""
    ix: Record = task.get("_ix") or initial_ix()
    tenant = job["tenant"]
    state = task["state"]
    old = ix.get("st")
    if old != state or (state in QUEUE_STATES and ix.get("q") != task["queue"]):
        if old != state:
            k, u = _usage(txn, tenant)
            if old is not None:
                u["tasks"][old] = u["tasks"].get(old, 0) - 1
            u["tasks"][state] = u["tasks"].get(state, 0) + 1
            txn.put(k, u)
        if old in QUEUE_STATES and ix.get("q") is not None:
            _bump_queue(txn, tenant, ix["q"], old, -1)
        if state in QUEUE_STATES:
            _bump_queue(txn, tenant, task["queue"], state, 1)
        ix["st"] = state
        ix["q"] = task["queue"] if state in QUEUE_STATES else None
    suffix = _task_suffix(task["job_id"], task["task_id"])

    want_qa: list[Any] | None = ([task["queue"], int(task["dispatched_ms"])]
                                 if state == TaskState.RUNNABLE and task.get("dispatched_ms") is not None else None)
    if want_qa != ix.get("qa"):
        if ix.get("qa"):
            q, t = ix["qa"]
            txn.delete(key(QUEUE_AGE, part(q), ms(t), suffix))
        if want_qa:
            txn.put(key(QUEUE_AGE, part(str(want_qa[0])), ms(int(want_qa[1])), suffix), tenant)
        ix["qa"] = want_qa

    dl = _deadline(task)
    want_dl: list[Any] | None = [dl[0], dl[1]] if dl else None
    if want_dl != ix.get("dl"):
        if ix.get("dl"):
            due = ix["dl"][0]
            txn.delete(key(DEADLINE, ms(due), suffix))
            txn.delete(key(DEADLINE_TENANT, part(tenant), ms(due), suffix))
        if want_dl:
            due = int(want_dl[0])
            txn.put(key(DEADLINE, ms(due), suffix), want_dl[1])
            txn.put(key(DEADLINE_TENANT, part(tenant), ms(due), suffix), want_dl[1])
        ix["dl"] = want_dl
    task["_ix"] = ix


# -- failures and retries ---------------------------------------------------------
def reason_class(reason: str, exit_code: int | None, error_type: str | None) -> str:
    """A short, low-cardinality class of a failure reason, for grouping.

    ``lease_expired: no heartbeat from w1`` -> ``lease_expired``; a process exit
    -> ``exit code 3``; a Python error -> its type; otherwise the reason with
    numbers replaced by N (first 60 characters).
    """
    m = _TOKEN.match(reason or "")
    if m:
        return m.group(1)
    if exit_code is not None:
        return f"exit code {exit_code}"
    if error_type:
        return error_type
    text = _DIGITS.sub("N", (reason or "unknown").strip())
    return text[:60] or "unknown"


def record_failure(txn: ReadModelTxn, job: Record, ev: Record) -> None:
    """A TaskFailed event: count its reason class, keep the entry for the recent-failures listing."""
    tenant = job["tenant"]
    final = bool(ev.get("final", True))
    cls = reason_class(ev.get("reason", ""), ev.get("exit_code"), ev.get("error_type"))
    k = key(REASONS, part(tenant), part(cls))
    agg = txn.get(k) or {"class": cls, "tenant": tenant, "count": 0, "final": 0, "retried": 0}
    agg["count"] += 1
    agg["final" if final else "retried"] += 1
    agg.update(last_ms=ev["ts_ms"], last_job_id=ev["job_id"], last_task_id=ev["task_id"],
               sample_reason=str(ev.get("reason", ""))[:300])
    txn.put(k, agg)
    entry = {"ts_ms": ev["ts_ms"], "tenant": tenant, "job_id": ev["job_id"], "task_id": ev["task_id"],
             "attempt": ev["attempt"], "worker_id": ev.get("worker_id") or None, "class": cls, "final": final,
             "reason": str(ev.get("reason", ""))[:500], "exit_code": ev.get("exit_code"),
             "error_type": ev.get("error_type")}
    suffix = ms(ev["ts_ms"]) + SEP + _task_suffix(ev["job_id"], ev["task_id"]) + SEP + U32.pack(
        max(int(ev["attempt"]), 0))
    txn.put(FAILURES + SEP + suffix, entry)
    txn.put(FAILURES_TENANT + SEP + part(tenant) + SEP + suffix, entry)
    uk, u = _usage(txn, tenant)
    u["failures"] += 1
    if cls == "lease_expired":  # logs written before LeaseReclaimed failed tasks on lease expiry
        u["lease_expiries"] += 1
    txn.put(uk, u)


def record_worker_loss(txn: ReadModelTxn, tenant: str, reason: str) -> None:
    """A LeaseReclaimed event: a worker lost, counted apart from the task's own failures."""
    k, u = _usage(txn, tenant)
    u["worker_losses"] = u.get("worker_losses", 0) + 1
    if reason.startswith("lease_expired"):
        u["lease_expiries"] += 1
    txn.put(k, u)


def record_redispatch(txn: ReadModelTxn, tenant: str) -> None:
    """A TaskRedispatched event: a dispatch record sent again, counted apart from retries and losses."""
    k, u = _usage(txn, tenant)
    u["redispatches"] = u.get("redispatches", 0) + 1
    txn.put(k, u)


def record_retry(txn: ReadModelTxn, tenant: str) -> None:
    k, u = _usage(txn, tenant)
    u["retries"] += 1
    txn.put(k, u)


# -- queries ------------------------------------------------------------------------
def _parse_due_key(k: bytes, prefix_len: int) -> tuple[int, str, str]:
    """(due, job, task) of a ``... due \\0 job \\0 task`` key after a prefix of ``prefix_len`` bytes."""
    rest = k[prefix_len:]
    due, job, task = rest.split(SEP, 2)
    return int(due), unpart(job), unpart(task)



def open_job_count(jobs_by_state: Mapping[str, int]) -> int:
    """Jobs not finished (``lifecycle.JOB_OPEN``) among a tenant's jobs by state."""
    return sum(int(n) for state, n in jobs_by_state.items() if state in JOB_OPEN)

class OperatorModel:
    """Queries over the operator read models; safe from any thread."""

    def __init__(self, store: ReadModelStore) -> None:
        self.store = store

    # -- tenants -----------------------------------------------------------------
    def tenants(self) -> list[Record]:
        """Usage of every tenant seen in the events, by tenant name."""
        return [decode_value(v) for _, v in self.store.scan(USAGE + SEP)]

    def tenant(self, tenant: str) -> Record | None:
        rec: Record | None = self.store.get(key(USAGE, part(tenant)))
        return rec

    def open_jobs(self, tenant: str) -> int:
        """Jobs of ``tenant`` that are not finished (the queued-jobs cap counts these)."""
        u = self.tenant(tenant)
        return open_job_count(u["jobs"]) if u else 0

    # -- queues --------------------------------------------------------------------
    def queues(self, tenant: str | None = None) -> list[Record]:
        """Task counts per queue (runnable = the queue depth); all tenants, or one."""
        prefix = QUEUE + SEP if tenant is None else key(QUEUE_TENANT, part(tenant)) + SEP
        out = []
        for k, v in self.store.scan(prefix):
            counts = decode_value(v)
            out.append({"queue": unpart(k[len(prefix):]), **{s: counts.get(s, 0) for s in QUEUE_STATES}})
        return out

    def oldest_runnable_ms(self, queue: str) -> int | None:
        """Dispatch time of the longest-waiting runnable task of ``queue`` (first key of its age index)."""
        prefix = key(QUEUE_AGE, part(queue)) + SEP
        for k, _ in self.store.scan(prefix):
            return int(k[len(prefix):].split(SEP, 1)[0])
        return None

    # -- stuck tasks -----------------------------------------------------------------
    def _task(self, job_id: str, task_id: str) -> Record | None:
        rec: Record | None = self.store.get(task_key(job_id, task_id))
        return rec

    def _job_tenant(self, job_id: str) -> str | None:
        job = self.store.get(job_key(job_id))
        return None if job is None else str(job["tenant"])

    def _item(self, job_id: str, task_id: str, kind: str, due: int, now_ms: int, tenant: str | None) -> Record | None:
        task = self._task(job_id, task_id)
        if task is None:
            return None
        return {"job_id": job_id, "task_id": task_id, "tenant": tenant or self._job_tenant(job_id),
                "kind": kind, "due_ms": due, "overdue_s": round((now_ms - due) / 1000, 3),
                "state": task["state"], "attempt": task["attempt"], "queue": task["queue"],
                "worker_id": task.get("worker_id"), "last_heartbeat_ms": task.get("last_heartbeat_ms"),
                "dispatched_ms": task.get("dispatched_ms"), "started_ms": task.get("started_ms")}

    def _deadline_rows(self, now_ms: int, tenant: str | None) -> Iterator[tuple[int, str, str, str]]:
        prefix = DEADLINE + SEP if tenant is None else key(DEADLINE_TENANT, part(tenant)) + SEP
        for k, v in self.store.scan(prefix):
            due, job, task = _parse_due_key(k, len(prefix))
            if due > now_ms:
                return
            yield due, job, task, decode_value(v)

    def stuck(self, now_ms: int, *, grace_ms: int = 5000, tenant: str | None = None, limit: int = 100,
              queued_longer_than_ms: int | None = None) -> list[Record]:
        """Open tasks past a deadline by more than ``grace_ms`` at ``now_ms``, most overdue first.

        With ``queued_longer_than_ms``, runnable tasks waiting longer than that
        are added (kind ``queued``), even without a schedule-to-start limit.
        """
        limit = clamp_limit(limit)
        out: list[Record] = []
        seen: set[tuple[str, str]] = set()
        for due, job, task, kind in self._deadline_rows(now_ms - grace_ms, tenant):
            item = self._item(job, task, kind, due, now_ms, tenant)
            if item is not None:
                out.append(item)
                seen.add((job, task))
            if len(out) >= limit:
                return out
        if queued_longer_than_ms is not None:
            cutoff = now_ms - queued_longer_than_ms
            for q in self.queues(tenant):
                prefix = key(QUEUE_AGE, part(q["queue"])) + SEP
                for k, v in self.store.scan(prefix):
                    t, job, task = _parse_due_key(k, len(prefix))
                    if t > cutoff:
                        break
                    owner = decode_value(v)
                    if (tenant is not None and owner != tenant) or (job, task) in seen:
                        continue
                    item = self._item(job, task, "queued", t, now_ms, owner)
                    if item is not None:
                        out.append(item)
                        seen.add((job, task))
                    if len(out) >= limit:
                        break
            out.sort(key=lambda x: x["due_ms"])
        return out[:limit]

    # -- failures --------------------------------------------------------------------
    def failure_reasons(self, tenant: str | None = None) -> list[Record]:
        """Failure counts by reason class (summed over tenants unless one is given), most frequent first."""
        prefix = REASONS + SEP if tenant is None else key(REASONS, part(tenant)) + SEP
        merged: dict[str, Record] = {}
        for _, v in self.store.scan(prefix):
            agg = decode_value(v)
            m = merged.get(agg["class"])
            if m is None:
                merged[agg["class"]] = {k: v for k, v in agg.items() if k != "tenant"}
                continue
            for f in ("count", "final", "retried"):
                m[f] += agg[f]
            if agg["last_ms"] >= m["last_ms"]:
                m.update(last_ms=agg["last_ms"], last_job_id=agg["last_job_id"],
                         last_task_id=agg["last_task_id"], sample_reason=agg["sample_reason"])
        return sorted(merged.values(), key=lambda r: (-r["count"], r["class"]))

    def recent_failures(self, tenant: str | None = None, limit: int = 50, since_ms: int | None = None) -> list[Record]:
        """The newest failed attempts (retried or final), newest first."""
        prefix = FAILURES + SEP if tenant is None else key(FAILURES_TENANT, part(tenant)) + SEP
        out = []
        for k, v in self.store.scan(prefix, reverse=True):
            if since_ms is not None and int(k[len(prefix):len(prefix) + 16]) < since_ms:
                break
            out.append(public(decode_value(v)))
            if len(out) >= clamp_limit(limit):
                break
        return out

    def totals(self) -> dict[str, Any]:
        """Tasks and jobs by state summed over tenants (for metrics)."""
        tasks = dict.fromkeys(TASK_STATES, 0)
        jobs = dict.fromkeys(JOB_STATES, 0)
        for u in self.tenants():
            for s, n in u["tasks"].items():
                tasks[s] = tasks.get(s, 0) + n
            for s, n in u["jobs"].items():
                jobs[s] = jobs.get(s, 0) + n
        return {"tasks": tasks, "jobs": jobs}
