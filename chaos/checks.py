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
* the ``deadletter`` topic: nothing in it (``dead-lettered record``).
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chaos.workload import JobPlan, rule_decision
from dagfold.codec import default_codec
from dagfold.config import DEADLETTER, EVENTS
from dagfold.exceptions import CodecError
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
VIOLATION_KINDS = (LOST_JOB, TASK_NEVER_FINISHED, WRONG_OUTCOME, DUPLICATE_EFFECT, DISPATCH_BEFORE_DEPS,
                   ILLEGAL_TRANSITION, REPLAY_DIFFERS, DANGLING, DEAD_LETTER)

TASK_TERMINAL = frozenset({"succeeded", "failed", "skipped", "cancelled"})
UNKNOWN_JOB = "unknown job or task"  # the fold's reason for a report about a job it does not hold
JOB_TERMINAL = frozenset({"succeeded", "succeeded_partial", "failed", "cancelled", "rejected"})


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


class EventModel:
    """Folds the events of the log, partition by partition, and flags what the state machine forbids.

    Written apart from the scheduler's appliers on purpose: it checks them.
    """

    def __init__(self, findings: Findings) -> None:
        self.f = findings
        self.jobs: dict[str, _Job] = {}
        self.counts: Counter[str] = Counter()
        self.succeeded_tasks: set[tuple[str, str]] = set()
        self.lease_expiries = 0

    def _bad(self, kind: str, e: dict[str, Any], detail: str) -> None:
        self.f.add(kind, e.get("job_id"), e.get("task_id"), f"{detail} (partition {e['_p']} offset {e['_o']})")

    def apply(self, e: dict[str, Any]) -> None:
        name = e["type"].rsplit(".", 1)[-1]
        self.counts[name] += 1
        job_id = e["job_id"]
        if name == "JobAccepted":
            if job_id in self.jobs:
                self._bad(ILLEGAL_TRANSITION, e, "JobAccepted for a job already accepted")
                return
            spec = e["spec"]
            self.jobs[job_id] = _Job(
                deps={t["task_id"]: (list(dict.fromkeys(t["depends_on"])), t["trigger_rule"]) for t in spec["tasks"]},
                state={t["task_id"]: "pending" for t in spec["tasks"]},
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
        if name in ("JobSucceeded", "JobFailed", "JobCancelled"):
            if j.final is not None:
                self._bad(ILLEGAL_TRANSITION, e, f"{name} after the job already ended {j.final}")
            open_tasks = [t for t, s in j.state.items() if s not in TASK_TERMINAL]
            if name != "JobCancelled" and open_tasks:
                self._bad(ILLEGAL_TRANSITION, e, f"{name} with {len(open_tasks)} unfinished task(s), "
                                                 f"e.g. {open_tasks[0]} {j.state[open_tasks[0]]}")
            j.final = ("succeeded_partial" if e.get("partial") else "succeeded") if name == "JobSucceeded" \
                else name.removeprefix("Job").lower()
            return
        if name in ("JobRedriven", "TaskReopened"):
            for tid in e["task_ids"]:
                if tid in j.state and (name == "JobRedriven" or j.state[tid] in ("failed", "skipped", "cancelled")):
                    j.state[tid] = "pending"
            j.final = None
            return
        if name == "TaskMarkedSucceeded":
            if j.state.get(e["task_id"]) != "pending":
                self._bad(ILLEGAL_TRANSITION, e, f"marked succeeded while {j.state.get(e['task_id'])}")
            j.state[e["task_id"]] = "succeeded"
            return
        task = e.get("task_id")
        if task not in j.state:
            self._bad(ILLEGAL_TRANSITION, e, f"{name} for an unknown task")
            return
        s, attempt = j.state[task], int(e.get("attempt") or 0)
        if name == "TaskDispatched":
            if s in TASK_TERMINAL or s in ("runnable", "running"):
                self._bad(ILLEGAL_TRANSITION, e, f"attempt {attempt} dispatched while the task is {s}")
            elif s == "pending":
                ups, rule = j.deps[task]
                outcomes = [j.state[u] if j.state[u] in TASK_TERMINAL else None for u in ups]
                if rule_decision(rule, outcomes) != "run":
                    detail = ", ".join(f"{u}={j.state[u]}" for u in ups)
                    self._bad(DISPATCH_BEFORE_DEPS, e, f"trigger rule {rule} not satisfied: {detail}")
            elif s == "retrying" and attempt != j.attempt[task] + 1:
                self._bad(ILLEGAL_TRANSITION, e, f"attempt {attempt} dispatched after attempt {j.attempt[task]}")
            j.state[task], j.attempt[task], j.worker[task] = "runnable", attempt, None
        elif name in ("TaskRedispatched", "TaskRedispatchDeferred"):  # legal only while runnable and unleased
            if s != "runnable" or attempt != j.attempt[task] or j.worker.get(task) is not None:
                self._bad(ILLEGAL_TRANSITION, e, f"attempt {attempt} re-dispatched while attempt "
                                                 f"{j.attempt[task]} is {s}")
        elif name == "LeaseGranted":
            if s != "runnable" or attempt != j.attempt[task]:
                self._bad(ILLEGAL_TRANSITION, e, f"lease on attempt {attempt} while attempt "
                                                 f"{j.attempt[task]} is {s}")
            j.state[task], j.worker[task] = "running", e["worker_id"]
        elif name == "LeaseExtended":
            if s != "running" or attempt != j.attempt[task] or e["worker_id"] != j.worker.get(task):
                self._bad(ILLEGAL_TRANSITION, e, f"lease of attempt {attempt} extended for {e['worker_id']} "
                                                 f"while attempt {j.attempt[task]} is {s}")
        elif name == "TaskSucceeded":
            if s != "running" or attempt != j.attempt[task] or e["worker_id"] != j.worker.get(task):
                self._bad(ILLEGAL_TRANSITION, e, f"success of attempt {attempt} by {e['worker_id']} while "
                                                 f"attempt {j.attempt[task]} is {s} ({j.worker.get(task)})")
            j.state[task], j.worker[task] = "succeeded", None
            self.succeeded_tasks.add((job_id, task))
        elif name == "TaskFailed":
            if s not in ("running", "runnable") or attempt != j.attempt[task]:
                self._bad(ILLEGAL_TRANSITION, e, f"failure of attempt {attempt} while attempt "
                                                 f"{j.attempt[task]} is {s}")
            if str(e.get("reason") or "").startswith("lease_expired"):
                self.lease_expiries += 1
            j.state[task], j.worker[task] = ("failed" if e["final"] else "retrying"), None
        elif name == "LeaseReclaimed":
            if s != "running" or attempt != j.attempt[task]:
                self._bad(ILLEGAL_TRANSITION, e, f"reclaim of attempt {attempt} while attempt "
                                                 f"{j.attempt[task]} is {s}")
            if str(e.get("reason") or "").startswith("lease_expired"):
                self.lease_expiries += 1
            j.state[task], j.worker[task] = "retrying", None
        elif name == "TaskRetryScheduled":
            if s != "retrying":
                self._bad(ILLEGAL_TRANSITION, e, f"retry scheduled while the task is {s}")
        elif name in ("TaskSkipped", "TaskCancelled"):
            if s in TASK_TERMINAL:
                self._bad(ILLEGAL_TRANSITION, e, f"{name} while the task is already {s}")
            j.state[task], j.worker[task] = ("skipped" if name == "TaskSkipped" else "cancelled"), None


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
            if state not in JOB_TERMINAL:
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
