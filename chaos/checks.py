"""What a chaos run must not have done, found from the log and the stores (never from the harness's own notes).

The only input from the harness is the list of jobs it submitted (with what
their specs say they must end as) and where things live. Everything else is
read back:

* the ``events`` topic, every partition in order, through a small independent
  model of the task state machine (``EventModel``): a task dispatched before its
  trigger rule was satisfied by earlier events of its upstreams (``dispatch
  before dependencies``), and any other step the state machine does not allow,
  such as a second success, a lease on an attempt that is not runnable, a
  re-dispatch of a leased attempt, or a report refused as "unknown job or task"
  after the job's JobAccepted (``illegal transition``);
* the read model (the API): every submitted job is there and terminal (``lost
  job``), in the state its spec implies (``wrong outcome``); a finished job has
  no unfinished task (``task never finished``);
* the external system's records and the side-effect ledger: no idempotency key
  applied twice, and every succeeded task's effect applied (``duplicate side
  effect``);
* the scheduler's RocksDB state after the run: no task of a finished job still
  leased or running, no timer left for it (``lease left dangling``);
* the replay: ``dagfold replay --verify`` and a per-partition comparison of every
  instance's store that holds the final state (``replay differs from live``);
* the ``deadletter`` topic: nothing in it (``dead-lettered record``);
* the GPU pool's allocator events (issue 25): no GPU granted to two allocations that are both live (granted,
  not yet released or expired), in the log's order (``GPU granted twice``); once every job ended, no
  allocation still held (``allocation or lease left dangling``); every GPU job the harness submitted
  ended succeeded (``wrong outcome``, ``lost job``);
* every attempt recorded as succeeded was dispatched, as that attempt, earlier in the committed
  events (``success without a committed dispatch``): a worker may run an attempt whose dispatch
  record left before its transaction committed, and that transaction may abort; its report may
  count only if the re-fold decided the same attempt (docs/semantics.md, Dispatch).
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chaos.workload import JobPlan, rule_decision
from dagfold.codec import default_codec
from dagfold.config import DEADLETTER, EVENTS
from dagfold.exceptions import CodecError
from dagfold.lifecycle import (
    JOB_ENDING_EVENTS,
    JOB_FINAL,
    JOB_STATE_ONLY,
    JOB_TERMINAL,
    TASK_TERMINAL,
    TaskState,
    Transition,
    transition,
)
from dagfold.log import Log, TopicPartition
from dagfold.log.reader import read_to_end
from dagfold.services.scheduler import keys
from dagfold.state import PartitionStore, PartitionTransaction

LOST_JOB = "lost job"
TASK_NEVER_FINISHED = "task never finished"
WRONG_OUTCOME = "wrong outcome"
DUPLICATE_EFFECT = "duplicate side effect"
DISPATCH_BEFORE_DEPS = "dispatch before dependencies"
ILLEGAL_TRANSITION = "illegal transition"
REPLAY_DIFFERS = "replay differs from live"
DANGLING = "allocation or lease left dangling"
DEAD_LETTER = "dead-lettered record"
UNDISPATCHED_SUCCESS = "success without a committed dispatch"
GPU_GRANTED_TWICE = "GPU granted twice"
VIOLATION_KINDS = (LOST_JOB, TASK_NEVER_FINISHED, WRONG_OUTCOME, DUPLICATE_EFFECT, DISPATCH_BEFORE_DEPS,
                   ILLEGAL_TRANSITION, REPLAY_DIFFERS, DANGLING, DEAD_LETTER, UNDISPATCHED_SUCCESS, GPU_GRANTED_TWICE)

UNKNOWN_JOB = "unknown job or task"  # the fold's reason for a report about a job it does not hold
JOB_ENDING = frozenset(kind.rsplit(".", 1)[-1] for kind in JOB_ENDING_EVENTS)


@dataclass
class Violation:
    kind: str
    job_id: str | None
    task_id: str | None
    detail: str

    def line(self) -> str:
        where = "/".join(x for x in (self.job_id, self.task_id) if x) or "-"
        return f"{self.kind}: {where}: {self.detail}"


@dataclass
class Findings:
    violations: list[Violation] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

    def add(self, kind: str, job_id: str | None, task_id: str | None, detail: str) -> None:
        self.violations.append(Violation(kind, job_id, task_id, detail))

    def by_kind(self) -> dict[str, int]:
        c = Counter(v.kind for v in self.violations)
        return {k: c.get(k, 0) for k in VIOLATION_KINDS}


# -- the events topic ----------------------------------------------------------------------------


@dataclass
class _Job:
    deps: dict[str, tuple[list[str], str]]  # task -> (upstreams, trigger rule)
    state: dict[str, str]
    attempt: dict[str, int]
    worker: dict[str, str | None]
    final: str | None = None
    lost_for_good: dict[str, int] = field(default_factory=dict)  # task -> attempt of a final LeaseReclaimed


class EventModel:
    """Folds the events of the log, partition by partition, and flags what the state machine forbids.

    Written apart from the scheduler's appliers on purpose: it checks them (and the handlers that
    decide the events) against the lifecycle table, ``dagfold.lifecycle.LIFECYCLE``.
    """

    def __init__(self, findings: Findings) -> None:
        self.f = findings
        self.jobs: dict[str, _Job] = {}
        self.counts: Counter[str] = Counter()
        self.succeeded_tasks: set[tuple[str, str]] = set()
        self.lease_expiries = 0
        self.dispatched: set[tuple[str, str, int]] = set()  # (job, task, attempt), as committed so far
        # each TaskSucceeded: (job, task, attempt, whether that attempt's dispatch preceded it, where)
        self.successes: list[tuple[str, str, int, bool, str]] = []

    def _bad(self, kind: str, e: dict[str, Any], detail: str) -> None:
        self.f.add(kind, e.get("job_id"), e.get("task_id"), f"{detail} (partition {e['_p']} offset {e['_o']})")

    def apply(self, e: dict[str, Any]) -> None:
        name = e["type"].rsplit(".", 1)[-1]
        self.counts[name] += 1
        job_id = e["job_id"]
        step = transition(e)
        if name == "JobAccepted":
            if job_id in self.jobs:
                self._bad(ILLEGAL_TRANSITION, e, "JobAccepted for a job already accepted")
                return
            spec = e["spec"]
            self.jobs[job_id] = _Job(
                deps={t["task_id"]: (list(dict.fromkeys(t["depends_on"])), t["trigger_rule"]) for t in spec["tasks"]},
                state={t["task_id"]: step.task for t in spec["tasks"]},
                attempt={t["task_id"]: 0 for t in spec["tasks"]}, worker={})
            return
        if name in ("LeaseRejected", "ReportIgnored") and job_id in self.jobs and e.get("reason") == UNKNOWN_JOB:
            # the job's JobAccepted is earlier in this partition: the scheduler folded the report on a
            # state behind its own log (a catch-up taken as complete that was not), and the worker,
            # told to stop, dropped the attempt's dispatch record
            self._bad(ILLEGAL_TRANSITION, e, f"{name}: {UNKNOWN_JOB!r} after the job's JobAccepted (the "
                                             "scheduler's state was behind its log)")
            return
        if name in ("JobRejected", "SubmissionDeduplicated", "ReportIgnored", "LeaseRejected", "TaskActionRejected"):
            return  # recorded for the audit; they change nothing
        j = self.jobs.get(job_id)
        if j is None:
            self._bad(ILLEGAL_TRANSITION, e, f"{name} for a job never accepted")
            return
        if name in JOB_ENDING:
            if j.final is not None:
                self._bad(ILLEGAL_TRANSITION, e, f"{name} after the job already ended {j.final}")
            open_tasks = [t for t, s in j.state.items() if s not in TASK_TERMINAL]
            if name != "JobCancelled" and open_tasks:
                self._bad(ILLEGAL_TRANSITION, e, f"{name} with {len(open_tasks)} unfinished task(s), "
                                                 f"e.g. {open_tasks[0]} {j.state[open_tasks[0]]}")
            j.final = step.job
            return
        if e["type"] in JOB_STATE_ONLY:
            return  # the job's state only (the table says which); its tasks keep theirs
        if name in ("JobRedriven", "TaskReopened"):
            for tid in e["task_ids"]:
                if tid in j.state and j.state[tid] in (step.from_task or ()):
                    j.state[tid] = step.task
            j.final = None
            return
        task = e.get("task_id")
        if task not in j.state:
            self._bad(ILLEGAL_TRANSITION, e, f"{name} for an unknown task")
            return
        s, attempt = j.state[task], int(e.get("attempt") or 0)
        if name in ("TaskDispatched", "TaskRedispatched"):
            self.dispatched.add((job_id, task, attempt))
        elif name == "TaskSucceeded":
            self.successes.append((job_id, task, attempt, (job_id, task, attempt) in self.dispatched,
                                   f"partition {e['_p']} offset {e['_o']}"))
        why = self._refusal(name, e, j, task, step)
        if why is not None:
            self._bad(ILLEGAL_TRANSITION, e, why)
        elif name == "TaskDispatched" and s == TaskState.PENDING:
            ups, rule = j.deps[task]
            outcomes = [j.state[u] if j.state[u] in TASK_TERMINAL else None for u in ups]
            if rule_decision(rule, outcomes) != "run":
                detail = ", ".join(f"{u}={j.state[u]}" for u in ups)
                self._bad(DISPATCH_BEFORE_DEPS, e, f"trigger rule {rule} not satisfied: {detail}")
        if name in ("TaskFailed", "LeaseReclaimed") and str(e.get("reason") or "").startswith("lease_expired"):
            self.lease_expiries += 1
        if name == "LeaseReclaimed" and e.get("final"):
            j.lost_for_good[task] = attempt  # the attempt's final TaskFailed follows, the task retrying
        if name == "TaskDispatched":
            j.attempt[task] = attempt
        if step.task is not None:
            j.state[task] = step.task
            j.worker[task] = e["worker_id"] if name == "LeaseGranted" else None
        if name == "TaskSucceeded":  # run by a worker (a task marked succeeded had no effect applied)
            self.succeeded_tasks.add((job_id, task))

    @staticmethod
    def _refusal(name: str, e: dict[str, Any], j: _Job, task: str, step: Transition) -> str | None:
        """Why the event is a step the lifecycle does not allow for the task as the log left it; None if legal.

        The table (``dagfold.lifecycle.LIFECYCLE``) says which task states each event may follow; the model
        adds what the table does not hold: the attempt an event names is the current one (a dispatch: the
        next one), and only the lease holder's reports count.
        """
        s, cur, holder = j.state[task], j.attempt[task], j.worker.get(task)
        attempt = int(e.get("attempt") or 0)
        allowed = step.from_task is None or s in step.from_task or (
            name == "TaskFailed" and s == TaskState.RETRYING and j.lost_for_good.get(task) == attempt)
        if not allowed:
            if name == "TaskDispatched":
                return f"attempt {attempt} dispatched while the task is {s}"
            return f"{name} of attempt {attempt} while attempt {cur} is {s}"
        if name == "TaskDispatched":
            return f"attempt {attempt} dispatched after attempt {cur}" \
                if s == TaskState.RETRYING and attempt != cur + 1 else None
        if name in _ATTEMPT_CHECKED and attempt != cur:
            return f"{name} of attempt {attempt} while attempt {cur} is {s}"
        if name in ("TaskRedispatched", "TaskRedispatchDeferred") and holder is not None:
            return f"attempt {attempt} re-dispatched while attempt {cur} is leased to {holder}"
        if name in ("LeaseExtended", "TaskSucceeded") and e["worker_id"] != holder:
            return f"{name} of attempt {attempt} by {e['worker_id']} while its lease is {holder}'s"
        return None


_ATTEMPT_CHECKED = frozenset({"TaskRedispatched", "TaskRedispatchDeferred", "LeaseGranted", "LeaseExtended",
                              "TaskSucceeded", "TaskFailed", "LeaseReclaimed"})
"""Reports and decisions that must name the task's current attempt."""


def scan_events(log: Log, partitions: int, findings: Findings) -> EventModel:
    codec = default_codec()
    model = EventModel(findings)
    for p in range(partitions):
        for recs in read_to_end(log, TopicPartition(EVENTS, p)):
            for r in recs:
                try:
                    e = codec.decode(r.value)
                except CodecError as exc:
                    findings.add(ILLEGAL_TRANSITION, None, None, f"undecodable event at {p}@{r.offset}: {exc}")
                    continue
                e["_p"], e["_o"] = p, r.offset
                model.apply(e)
    return model


def check_successes_dispatched(model: EventModel, findings: Findings) -> int:
    """No attempt is recorded as succeeded unless its dispatch is in the committed log before it (the
    events, read_committed): a dispatch a worker saw from a transaction that then aborted counts only
    as the attempt the re-fold decided again. Returns the successes checked."""
    for job_id, task, attempt, dispatched, where in model.successes:
        if not dispatched:
            findings.add(UNDISPATCHED_SUCCESS, job_id, task,
                         f"attempt {attempt} succeeded ({where}) with no TaskDispatched of that attempt before it")
    return len(model.successes)


def scan_dead_letters(log: Log, findings: Findings) -> int:
    codec = default_codec()
    n = 0
    for recs in read_to_end(log, TopicPartition(DEADLETTER, 0)):
        for r in recs:
            n += 1
            try:
                d = codec.decode(r.value)
                detail = f"{d['source_topic']}/{d['partition']}@{d['offset']} by {d['service']}: {d['reason']}"
            except CodecError as exc:
                detail = f"undecodable dead letter: {exc}"
            findings.add(DEAD_LETTER, None, None, detail)
    return n


# -- the read model ------------------------------------------------------------------------------------


def check_read_model(api: str, plans: list[JobPlan], model: EventModel, findings: Findings) -> Counter[str]:
    states: Counter[str] = Counter()
    with httpx.Client(base_url=api, timeout=30) as http:
        for plan in plans:
            jid = plan.job_id
            if jid not in model.jobs:
                findings.add(LOST_JOB, jid, None, "submitted (the API answered 202) but no JobAccepted in the log")
            r = http.get(f"/v1/jobs/{jid}")
            if r.status_code != 200:
                findings.add(LOST_JOB, jid, None, f"not in the read model (HTTP {r.status_code})")
                states["missing"] += 1
                continue
            job = r.json()
            state = job["state"]
            states[state] += 1
            if state not in JOB_FINAL:
                findings.add(LOST_JOB, jid, None, f"still {state} in the read model "
                                                  f"({json.dumps(job.get('counts'))})")
                continue
            logged = model.jobs[jid].final if jid in model.jobs else None
            if logged != state:
                findings.add(WRONG_OUTCOME, jid, None, f"read model says {state}, the log says {logged}")
            if state != plan.expected_job:
                findings.add(WRONG_OUTCOME, jid, None, f"ended {state}; its spec says {plan.expected_job}")
            # A succeeded job's tasks all succeeded, except those its trigger rules skip by design.
            expected = plan.expected_tasks or {}
            should_succeed = sum(1 for s in expected.values() if s == "succeeded")
            counts = job.get("counts") or {}
            open_ = {k: v for k, v in counts.items() if k not in TASK_TERMINAL and v}
            if open_:
                findings.add(TASK_NEVER_FINISHED, jid, None, f"{state} in the read model with unfinished "
                                                             f"tasks: {open_}")
            elif state == "succeeded" and counts.get("succeeded") != should_succeed:
                findings.add(TASK_NEVER_FINISHED, jid, None, f"succeeded with {counts.get('succeeded')} tasks "
                                                             f"succeeded of {should_succeed}: {counts}")
            if jid not in model.jobs:
                continue
            j = model.jobs[jid]
            for tid, s in j.state.items():
                if s not in TASK_TERMINAL:
                    findings.add(TASK_NEVER_FINISHED, jid, tid, f"job {state} but the task is {s}")
                elif state == "succeeded" and s != "succeeded" and expected.get(tid) != s:
                    findings.add(TASK_NEVER_FINISHED, jid, tid, f"job succeeded but the task is {s}")
                elif plan.expected_tasks is not None and expected.get(tid) != s:
                    findings.add(WRONG_OUTCOME, jid, tid, f"task ended {s}; the spec says {expected.get(tid)}")
    return states


# -- side effects ------------------------------------------------------------------------------------


def check_side_effects(effects_db: Path, ledger_db: Path, model: EventModel, plans: list[JobPlan],
                       findings: Findings) -> dict[str, int]:
    submitted = {p.job_id for p in plans}
    eff = sqlite3.connect(f"file:{effects_db}?mode=ro", uri=True)
    led = sqlite3.connect(f"file:{ledger_db}?mode=ro", uri=True)
    try:
        applied = Counter(k for (k,) in eff.execute("SELECT key FROM effects"))
        recorded = {k for (k,) in led.execute("SELECT key FROM side_effects")}
    finally:
        eff.close()
        led.close()
    for key, n in sorted(applied.items()):
        if n > 1:
            job_id, _, task_id = key.partition("/")
            findings.add(DUPLICATE_EFFECT, job_id, task_id, f"idempotency key {key} applied {n} times")
    missing = 0
    for job_id, task_id in sorted(model.succeeded_tasks):
        if job_id not in submitted:
            continue
        key = f"{job_id}/{task_id}"
        if key not in applied:
            missing += 1
            findings.add(DUPLICATE_EFFECT, job_id, task_id, "task succeeded but its side effect was never applied")
        elif key not in recorded:
            findings.add(DUPLICATE_EFFECT, job_id, task_id, "task succeeded but the ledger has no record of it")
    return {"effects applied": sum(applied.values()), "distinct keys": len(applied), "ledger records": len(recorded),
            "missing": missing}


# -- scheduler state ---------------------------------------------------------------------------------------


def check_dangling(store_dirs: list[Path], findings: Findings) -> int:
    """Tasks of finished jobs still leased, running or holding a timer, in the given partition stores."""
    checked = 0
    jprefix = b"j" + keys.S.encode()
    for path in store_dirs:
        store = PartitionStore(path, read_only=True)
        try:
            txn = PartitionTransaction(store)
            ended: dict[str, str] = {}
            for k, _ in store.range(jprefix, jprefix + b"\xff"):
                job_id = k[len(jprefix):].decode()
                j = txn.get(k)
                if j["state"] in JOB_TERMINAL:
                    ended[job_id] = j["state"]
            for job_id, jstate in ended.items():
                for tid in txn.get(keys.task_list(job_id)) or []:
                    t = txn.get(keys.task(job_id, tid)) or {}
                    checked += 1
                    if t.get("state") not in TASK_TERMINAL or t.get("worker") or t.get("timers"):
                        findings.add(DANGLING, job_id, tid, f"job {jstate} but the task is {t.get('state')} "
                                                            f"(worker {t.get('worker')}, timers {t.get('timers')}) "
                                                            f"in {path}")
            for k, _v in store.range(keys.TIMER_PREFIX, keys.TIMER_PREFIX + b"\xff"):
                _, job_id, task_id, kind = keys.parse_timer(k)
                if job_id in ended:
                    findings.add(DANGLING, job_id, task_id, f"{kind} timer left for a {ended[job_id]} job in {path}")
        finally:
            store.close()
    return checked


# -- the GPU pool ------------------------------------------------------------------------------------------


def gpus_held_twice(events: Iterable[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """Fold the allocator's events in log order: the GPUs granted to a second allocation while the first still
    held them (``node/gpu: first and second``), and the allocations still held at the end (alloc ID -> job)."""
    held: dict[tuple[str, int], str] = {}
    live: dict[str, str] = {}
    clashes: list[str] = []
    for e in events:
        t = str(e["type"]).rsplit(".", 1)[-1]
        if t == "AllocationGranted":
            alloc = str(e["alloc_id"])
            live[alloc] = str(e.get("job_id"))
            for h in e["hosts"]:
                for g in h["gpu_indices"]:
                    key = (str(h["node_id"]), int(g))
                    if key in held and held[key] in live:
                        clashes.append(f"{key[0]}/{key[1]}: {held[key]} and {alloc}")
                    held[key] = alloc
        elif t in ("AllocationReleased", "AllocationExpired"):
            live.pop(str(e["alloc_id"]), None)
    return clashes, live


def check_gpu_pool(events: list[dict[str, Any]], job_states: dict[str, str], findings: Findings) -> dict[str, int]:
    """The pool's events (one pool's, in order) and the final state of every GPU job submitted."""
    clashes, live = gpus_held_twice(events)
    for c in clashes:
        findings.add(GPU_GRANTED_TWICE, None, None, c)
    for alloc, job in sorted(live.items()):
        findings.add(DANGLING, job, None, f"allocation {alloc} still held after every job ended")
    for job, state in sorted(job_states.items()):
        if state == "missing":
            findings.add(LOST_JOB, job, None, "GPU job not in the read model")
        elif state != "succeeded":
            findings.add(WRONG_OUTCOME, job, None, f"GPU job ended {state}, not succeeded")
    grants = sum(1 for e in events if str(e["type"]).endswith("AllocationGranted"))
    return {"GPU jobs": len(job_states), "GPU jobs succeeded": sum(s == "succeeded" for s in job_states.values()),
            "grants": grants, "GPUs granted twice": len(clashes), "allocations held at the end": len(live)}
