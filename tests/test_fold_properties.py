"""Property-based tests of the scheduler fold in virtual time (``FoldHarness``).

Hypothesis draws jobs (random DAGs up to a few hundred tasks, random trigger
rules, failure policies, retry policies and timeouts) and a seed for a chaotic
world around the fold:

* workers that succeed, fail (retryably or not, with exit codes), crash before
  or after TaskStarted (never report, never heartbeat), hang (heartbeat
  forever), or are slow (heartbeat late, report late);
* a network that reorders, delays, duplicates and drops their reports, and
  dispatch records that never reach any worker (the re-dispatch timer sends
  the same attempt again);
* a timer that fires late, twice, out of order or not at all (a dropped fire
  comes back at the next scan, as in the runner), plus injected stale and
  duplicate ``TimerFired`` commands, stale reports of old attempts, reports
  from intruder workers, duplicate submissions, cancellations, redrives,
  operators' task retries and mark-succeeded (refused ones included), and
  pauses and resumes of the jobs at random (out of turn ones included);
* then the drain: every worker behaves and time moves on until every job is
  terminal.

Invariants checked (see each ``check_*``):

1. no task is dispatched before its trigger rule is satisfied, nor skipped
   while it can still be satisfied (against the upstream outcomes in the
   event stream at that moment); attempts of a task are dispatched 1, 2, 3...;
2. at most one TaskSucceeded per task (succeeded tasks are never redriven);
3. a command the state cannot accept (stale attempt, not the lease holder,
   stale timer, duplicate submission, cancel of a finished job) leaves the
   state digest unchanged and emits only ReportIgnored / LeaseRejected /
   SubmissionDeduplicated;
4. every job reaches a terminal state once workers behave;
5. the job state is a function of its task states and failure policy, and the
   job counters match the task states; no timer survives a finished task;
6. retries honour max_attempts, non-retryable exit codes, and the deterministic
   backoff (``retry_at_ms - ts_ms == backoff_ms(...)``, never dispatched
   early); timeouts never fire before they are due; an attempt is re-dispatched
   only while runnable and unleased, when due, at doubling intervals;
   a paused job dispatches and re-dispatches nothing (its tasks are held), and
   a task is held only while its job is paused;
7. replaying the events gives the same state (``replayed_digest() == digest()``);
8. every record the fold emitted validates against its Avro schema.

Example counts: ``make test`` runs 1,000+ examples in total (see ``EXAMPLES``);
``pytest --slow`` runs ``SLOW_FACTOR`` times more.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dagfold.codec import Record, default_codec
from dagfold.config import SchedulerOptions
from dagfold.jobspec import is_gpu, parse_spec, still_skipped, to_job_spec
from dagfold.lifecycle import JOB_OPEN, JOB_TERMINAL, REDRIVABLE, job_control_refusal, task_action_refusal
from dagfold.lifecycle import TASK_TERMINAL as TERMINAL
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.services.scheduler.retry import NO_RETRY, backoff_ms, jitter_fraction
from dagfold.services.scheduler.timers import due_timers
from dagfold.state.store import META_PREFIX

RULES = ["all_success", "all_done", "one_success", "one_failed", "none_failed", "always"]
POLICIES = ["fail_fast", "skip_downstream", "allow_partial"]
NOOP_EVENTS = {"ReportIgnored", "LeaseRejected", "SubmissionDeduplicated", "TaskActionRejected"}
TIMER_STATE = {"lease": "running", "start_to_close": "running", "schedule_to_start": "runnable",
               "backoff": "retrying", "redispatch": "runnable"}

# Examples per property in the default run (total 1,050); --slow multiplies them.
EXAMPLES = {"chaos_small": 520, "chaos_large": 30, "stale": 150, "rules": 250, "backoff": 100}
SLOW_FACTOR = 10


def run_property(request: pytest.FixtureRequest, prop: Callable[[], None], name: str) -> None:
    """Run a @given property with this file's settings; ``--slow`` selects the long profile."""
    n = EXAMPLES[name] * (SLOW_FACTOR if request.config.getoption("--slow") else 1)
    settings(max_examples=n, deadline=None, print_blob=True,
             suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])(prop)()


def short(rec: Record) -> str:
    return str(rec["type"]).rsplit(".", 1)[-1]


# -- strategies ------------------------------------------------------------------------

retry_policies = st.fixed_dictionaries({
    "max_attempts": st.integers(1, 4),
    "initial_interval_s": st.sampled_from([0.0, 0.05, 0.5, 1.0, 5.0]),
    "backoff_coefficient": st.sampled_from([1.0, 1.5, 2.0, 3.0, 10.0]),
    "max_interval_s": st.sampled_from([0.0, 1.0, 10.0, 60.0]),
    "jitter": st.booleans(),
    "non_retryable_exit_codes": st.lists(st.sampled_from([2, 3, 127]), max_size=2, unique=True),
    "non_retryable_errors": st.lists(st.sampled_from(["ValueError", "KeyError"]), max_size=1),
})

timeout_sets = st.fixed_dictionaries({}, optional={
    "schedule_to_start_s": st.sampled_from([2.0, 30.0, 300.0]),
    "start_to_close_s": st.sampled_from([1.0, 30.0, 300.0]),
    "heartbeat_s": st.sampled_from([0.5, 5.0, 60.0]),
})


@st.composite
def job_docs(draw: st.DrawFn, job_id: str, min_tasks: int, max_tasks: int) -> dict[str, Any]:
    """A job spec document with a random DAG; the graph comes from a drawn seed (fast for big jobs)."""
    n = draw(st.integers(min_tasks, max_tasks))
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    retry_pool = draw(st.lists(retry_policies, min_size=1, max_size=3))
    timeout_pool = draw(st.lists(timeout_sets, min_size=1, max_size=3))
    rule_weights = draw(st.lists(st.integers(0, 5), min_size=len(RULES), max_size=len(RULES)))
    rule_weights[0] += 3  # all_success stays the most common rule
    max_fan_in = draw(st.integers(1, 4))
    doc: dict[str, Any] = {"id": job_id, "failure_policy": draw(st.sampled_from(POLICIES))}
    if draw(st.booleans()):
        doc["retry"] = rnd.choice(retry_pool)
    if draw(st.booleans()):
        doc["timeouts"] = rnd.choice(timeout_pool)
    tasks = []
    for i in range(n):
        t: dict[str, Any] = {"id": f"t{i}", "handler": "noop"}
        if i and rnd.random() < 0.85:
            # mostly near neighbours (deep graphs), sometimes anywhere earlier (wide ones)
            k = rnd.randint(1, min(i, max_fan_in))
            ups = {rnd.randrange(max(0, i - 8), i) if rnd.random() < 0.6 else rnd.randrange(i) for _ in range(k)}
            t["depends_on"] = [f"t{u}" for u in sorted(ups)]
        t["trigger_rule"] = rnd.choices(RULES, weights=rule_weights)[0]
        if rnd.random() < 0.3:
            t["retry"] = rnd.choice(retry_pool)
        if rnd.random() < 0.3:
            t["timeouts"] = rnd.choice(timeout_pool)
        tasks.append(t)
    doc["tasks"] = tasks
    return doc


@dataclass(frozen=True)
class World:
    """How the world around the fold misbehaves."""

    p_drop: float
    p_dup: float
    p_delay_timer: float
    behaviour_weights: tuple[int, ...]  # ok, fail, crash_before_start, crash, hang, slow
    cancels: bool
    redrives: bool
    lease_timeout_s: float
    steps_per_task: int
    p_lose_record: float = 0.0  # a dispatch record that never reaches any worker (re-dispatch recovers it)
    redispatch_after_s: float = 60.0
    pauses: bool = False  # an operator pauses and resumes jobs at random


worlds = st.builds(
    World,
    p_drop=st.sampled_from([0.0, 0.05, 0.2]),
    p_dup=st.sampled_from([0.0, 0.1, 0.3]),
    p_delay_timer=st.sampled_from([0.0, 0.2, 0.5]),
    behaviour_weights=st.tuples(st.integers(1, 8), st.integers(0, 4), st.integers(0, 2), st.integers(0, 2),
                                st.integers(0, 2), st.integers(0, 3)),
    cancels=st.booleans(),
    redrives=st.booleans(),
    lease_timeout_s=st.sampled_from([1.0, 10.0, 60.0]),
    steps_per_task=st.integers(3, 10),
    p_lose_record=st.sampled_from([0.0, 0.0, 0.1]),
    redispatch_after_s=st.sampled_from([5.0, 60.0]),
    pauses=st.booleans(),
)


def to_spec(doc: dict[str, Any]) -> Record:
    return to_job_spec(parse_spec(doc))


# -- commands --------------------------------------------------------------------------

REPORT_DEFAULTS: dict[str, dict[str, Any]] = {
    "Started": {},
    "Heartbeat": {"progress": None, "message": None},
    "Succeeded": {"result_json": None, "stdout_tail": "", "stderr_tail": ""},
    "Failed": {"reason": "failed", "exit_code": None, "error_type": None, "retryable": True,
               "stdout_tail": "", "stderr_tail": ""},
}


def report(kind: str, job_id: str, task_id: str, attempt: int, worker: str, now_ms: int,
           **fields: Any) -> Record:
    return {"type": f"dagfold.command.Task{kind}", "job_id": job_id, "task_id": task_id, "attempt": attempt,
            "worker_id": worker, "ts_ms": now_ms, **REPORT_DEFAULTS[kind], **fields}


def task_action(kind: str, job_id: str, task_id: str, now_ms: int) -> Record:
    return {"type": f"dagfold.command.{kind}", "job_id": job_id, "task_id": task_id, "requested_by": "op",
            "reason": "chaos", "requested_at_ms": now_ms}


def timer_cmd(job_id: str, task_id: str, attempt: int, kind: str, due_ms: int, now_ms: int) -> Record:
    return {"type": "dagfold.command.TimerFired", "job_id": job_id, "task_id": task_id, "attempt": attempt,
            "timer": kind, "due_ms": due_ms, "fired_at_ms": now_ms}


# -- reference semantics (independent of the fold) -----------------------------------

def rule_satisfied(rule: str, outs: list[str | None]) -> bool:
    """May a task with these upstream outcomes (None = not finished) run now? Airflow semantics."""
    if not outs or rule == "always":
        return True
    if rule == "all_success":
        return all(o == "succeeded" for o in outs)
    if rule == "all_done":
        return all(o is not None for o in outs)
    if rule == "one_success":
        return "succeeded" in outs
    if rule == "one_failed":
        return "failed" in outs
    if rule == "none_failed":
        return all(o is not None for o in outs) and "failed" not in outs
    raise AssertionError(rule)


def rule_unsatisfiable(rule: str, outs: list[str | None]) -> bool:
    """Can the rule no longer be met, whatever the unfinished upstreams do?"""
    if not outs or rule in ("always", "all_done"):
        return False
    done = all(o is not None for o in outs)
    if rule == "all_success":
        return any(o is not None and o != "succeeded" for o in outs)
    if rule == "one_success":
        return done and "succeeded" not in outs
    if rule == "one_failed":
        return done and "failed" not in outs
    if rule == "none_failed":
        return "failed" in outs
    raise AssertionError(rule)


def expected_job_state(policy: str, states: dict[str, str], leaves: set[str], cancelled: bool) -> str:
    """The job state its finished task states imply."""
    if cancelled:
        return "cancelled"
    n_failed = sum(s == "failed" for s in states.values())
    if n_failed == 0:
        return "succeeded"
    if policy == "allow_partial" and any(states[t] == "succeeded" for t in leaves):
        return "succeeded_partial"
    return "failed"


# -- the world around the fold --------------------------------------------------------

@dataclass
class Actor:
    """A worker holding one dispatch record; ``steps`` are the reports it will still send."""

    d: Record
    worker: str
    steps: list[str]
    forever: bool = False  # hangs: heartbeats for as long as the chaos lasts
    fail_fields: dict[str, Any] = field(default_factory=dict)


class Sim:
    def __init__(self, h: FoldHarness, rnd: random.Random, world: World, specs: list[Record]) -> None:
        self.h, self.rnd, self.world = h, rnd, world
        self.specs = {s["job_id"]: s for s in specs}
        self.task_ids = [(s["job_id"], t["task_id"]) for s in specs for t in s["tasks"]]
        self.queue: list[Record] = []  # dispatch records not yet taken by a worker
        self.net: list[tuple[Record, Record | None]] = []  # (command, its dispatch record) in flight
        self.actors: list[Actor] = []
        self.history: list[Record] = []  # folded reports and timer fires, for stale replays
        self.dispatch_records: list[Record] = []
        self.n_workers = 0
        self.noop_checks = 0

    # -- plumbing ----------------------------------------------------------------------
    def collect(self) -> None:
        while self.h.dispatched:
            d = self.h.dispatched.popleft()
            self.queue.append(d)
            self.dispatch_records.append(d)

    def snapshot(self) -> dict[bytes, bytes]:
        """The store without its meta keys (the applied offset): equal snapshots, equal digests."""
        return {k: v for k, v in self.h.store.data.items() if not k.startswith(META_PREFIX)}

    def may_change(self, cmd: Record) -> bool:
        """False when the state cannot accept ``cmd``: folding it must then change nothing."""
        h, typ = self.h, short(cmd)
        if typ == "SubmitJob":
            return h.job(cmd["spec"]["job_id"]) is None
        j = h.job(cmd["job_id"])
        if typ == "CancelJob":
            return j is not None and j["state"] in JOB_OPEN
        if typ in ("PauseJob", "ResumeJob"):
            action = "pause" if typ == "PauseJob" else "resume"
            return job_control_refusal(action, cmd["job_id"], j["state"] if j is not None else None) is None
        if typ == "RedriveJob":
            return j is not None and j["state"] in REDRIVABLE
        if typ in ("RetryTask", "MarkTaskSucceeded"):
            t = h.task(cmd["job_id"], cmd["task_id"]) if j is not None else None
            action = "retry" if typ == "RetryTask" else "mark_succeeded"
            if j is None or t is None or task_action_refusal(action, cmd["job_id"], j["state"], cmd["task_id"],
                                                              t["state"]) is not None:
                return False
            return typ == "MarkTaskSucceeded" or still_skipped(cmd["task_id"], t) is None
        t = h.task(cmd["job_id"], cmd["task_id"]) if cmd.get("task_id") is not None else None
        if t is None or j is None:
            return False
        if typ == "TaskStarted":
            return j["state"] in JOB_OPEN and t["state"] == "runnable" and t["attempt"] == cmd["attempt"]
        if typ in ("TaskSucceeded", "TaskFailed") and t["state"] == "runnable":
            # an outcome without a start report (an instant task) starts and ends the current attempt
            return j["state"] in JOB_OPEN and t["attempt"] == cmd["attempt"] and not is_gpu(t)
        if typ in ("TaskHeartbeat", "TaskSucceeded", "TaskFailed"):
            return t["state"] == "running" and t["attempt"] == cmd["attempt"] and t["worker"] == cmd["worker_id"]
        assert typ == "TimerFired"
        due = (t.get("timers") or {}).get(cmd["timer"])
        return j["state"] in JOB_OPEN and t["attempt"] == cmd["attempt"] and due is not None and due <= h.now_ms

    def deliver(self, cmd: Record, *, full_digest: bool = False) -> None:
        accept = self.may_change(cmd)
        before = None if accept else (self.h.digest() if full_digest else self.snapshot())
        n0 = len(self.h.events)
        self.h.process(cmd)
        if before is not None:
            self.noop_checks += 1
            after = self.h.digest() if full_digest else self.snapshot()
            assert after == before, f"{short(cmd)} the state could not accept changed it: {cmd}"
            emitted = {short(e) for e in self.h.events[n0:]}
            assert emitted <= NOOP_EVENTS, f"{cmd} emitted {emitted}"
        if short(cmd) in ("TaskStarted", "TaskHeartbeat", "TaskSucceeded", "TaskFailed", "TimerFired"):
            self.history.append(cmd)
        self.collect()

    def job_states(self) -> dict[str, str]:
        return {jid: (self.h.job(jid) or {}).get("state", "?") for jid in self.specs}

    def all_terminal(self) -> bool:
        return all(s in JOB_TERMINAL for s in self.job_states().values())

    # -- chaos ---------------------------------------------------------------------------
    def chaos(self, steps: int) -> None:
        for i in range(steps):
            r = self.rnd.random()
            if r < 0.22 and self.queue:
                self.take()
            elif r < 0.45 and self.actors:
                self.actor_step()
            elif r < 0.75 and self.net:
                self.deliver_net()
            elif r < 0.87:
                self.advance()
            elif r < 0.98:
                self.inject_stale()
            else:
                self.control()
            if i % 50 == 0:
                check_timer_index(self.h)

    def take(self) -> None:
        rnd = self.rnd
        d = self.queue.pop(rnd.randrange(len(self.queue)) if rnd.random() < 0.3 else 0)
        if rnd.random() < self.world.p_lose_record:
            return  # archived by the queue, or held by a worker killed before it did anything: gone
        kind = rnd.choices(["ok", "fail", "crash_before_start", "crash", "hang", "slow"],
                           weights=self.world.behaviour_weights)[0]
        if kind == "crash_before_start":
            self.queue.append(d)  # died before its offset commit: the record is redelivered
            return
        self.n_workers += 1
        a = Actor(d, f"w{self.n_workers}", ["Started"])
        if kind == "ok":
            a.steps += ["Heartbeat"] * rnd.randint(0, 2) + ["Succeeded"]
        elif kind == "slow":
            a.steps += ["Heartbeat"] * rnd.randint(2, 6) + ["Succeeded"]
        elif kind == "fail":
            a.steps += ["Heartbeat"] * rnd.randint(0, 2) + ["Failed"]
            a.fail_fields = {"reason": "boom", "retryable": rnd.random() < 0.8,
                             "exit_code": rnd.choice([None, 1, 2, 3, 127]),
                             "error_type": rnd.choice([None, "ValueError", "OSError"])}
        elif kind == "crash":
            a.steps += ["Heartbeat"] * rnd.randint(0, 2)
            if rnd.random() < 0.5:
                self.queue.append(d)  # redelivered to another worker, whose start is rejected
        elif kind == "hang":
            a.forever = True
        self.actors.append(a)
        self.actor_step(a)

    def actor_step(self, a: Actor | None = None) -> None:
        if a is None:
            a = self.rnd.choice(self.actors)
        if not a.steps and not a.forever:
            self.actors.remove(a)
            return
        kind = a.steps.pop(0) if a.steps else "Heartbeat"
        d = a.d
        cmd = report(kind, d["job_id"], d["task_id"], d["attempt"], a.worker, self.h.now_ms,
                     **(a.fail_fields if kind == "Failed" else {}))
        if kind == "Heartbeat" and self.rnd.random() < 0.3:
            cmd["progress"] = self.rnd.random()
        self.net.append((cmd, d))

    def deliver_net(self) -> None:
        rnd = self.rnd
        cmd, d = self.net.pop(rnd.randrange(len(self.net)))  # any order: reordered and delayed
        x = rnd.random()
        if x < self.world.p_drop:
            if d is not None and short(cmd) != "TaskHeartbeat":
                self.queue.append(d)  # the worker died before flushing: its record is redelivered
            return
        if x < self.world.p_drop + self.world.p_dup:
            self.net.append((cmd, d))  # delivered again later
        self.deliver(cmd)

    def advance(self) -> None:
        rnd, h = self.rnd, self.h
        lo, hi = rnd.choices([(0, 0), (1, 400), (400, 4000), (4000, 40_000), (40_000, 200_000)],
                             weights=[2, 6, 4, 2, 1])[0]
        ms = rnd.randint(lo, hi)
        if rnd.random() < 0.3:
            h.advance(ms)  # the plain timer: every due timer fires, in due order
            self.collect()
            return
        h.now_ms += ms
        fires = [cmd for _, cmd in due_timers(h.store, h.now_ms)]
        rnd.shuffle(fires)
        for cmd in fires:
            x = rnd.random()
            if x < self.world.p_drop:
                continue  # lost: the index still holds it, the next scan fires it again
            if x < self.world.p_drop + self.world.p_delay_timer:
                self.net.append((cmd, None))  # arrives later, among worker reports
                continue
            self.deliver(cmd)
            if rnd.random() < self.world.p_dup:
                self.deliver(cmd)

    def inject_stale(self) -> None:
        rnd, h = self.rnd, self.h
        x = rnd.random()
        if x < 0.35 and self.history:
            self.deliver(dict(rnd.choice(self.history), ts_ms=h.now_ms))  # a late duplicate
            return
        job_id, task_id = rnd.choice(self.task_ids)
        t = h.task(job_id, task_id)
        if t is None:
            return
        if x < 0.6:  # an attempt that is not the current one
            attempt = rnd.choice([*range(0, t["attempt"]), t["attempt"] + 1])
            kind = rnd.choice(["Started", "Heartbeat", "Succeeded", "Failed"])
            self.deliver(report(kind, job_id, task_id, attempt, rnd.choice(["w1", "intruder"]), h.now_ms))
        elif x < 0.8:  # the current attempt, from a worker that does not hold it
            kind = rnd.choice(["Heartbeat", "Succeeded", "Failed"])
            self.deliver(report(kind, job_id, task_id, t["attempt"], "intruder", h.now_ms))
        else:  # a timer fire for any kind and a nearby attempt
            kind = rnd.choice(list(TIMER_STATE))
            attempt = max(0, t["attempt"] + rnd.choice([-1, 0, 0, 1]))
            self.deliver(timer_cmd(job_id, task_id, attempt, kind, h.now_ms - rnd.randint(0, 10_000), h.now_ms))

    def control(self) -> None:
        rnd = self.rnd
        job_id = rnd.choice(list(self.specs))
        if self.world.pauses and rnd.random() < 0.4:  # mostly in turn, sometimes not (a no-op)
            paused = (self.h.job(job_id) or {}).get("state") == "paused"
            kind = "ResumeJob" if paused != (rnd.random() < 0.1) else "PauseJob"
            self.deliver({"type": f"dagfold.command.{kind}", "job_id": job_id, "reason": "chaos",
                          "requested_by": "op", "requested_at_ms": self.h.now_ms})
            return
        x = rnd.random()
        if x < 0.4:
            self.deliver({"type": "dagfold.command.SubmitJob", "spec": self.specs[job_id],
                          "submitted_at_ms": self.h.now_ms, "source": "retry"})
        elif x < 0.7 and self.world.cancels:
            self.deliver({"type": "dagfold.command.CancelJob", "job_id": job_id, "reason": "chaos",
                          "requested_at_ms": self.h.now_ms})
        elif self.world.redrives and x < 0.85:
            self.deliver({"type": "dagfold.command.RedriveJob", "job_id": job_id, "requested_at_ms": self.h.now_ms})
        elif self.world.redrives:  # an operator's word on any task, in any state (most are refused)
            job_id, task_id = rnd.choice(self.task_ids)
            self.deliver(task_action(rnd.choice(["RetryTask", "MarkTaskSucceeded"]), job_id, task_id, self.h.now_ms))

    # -- drain ---------------------------------------------------------------------------
    def drain(self, max_rounds: int = 100_000) -> None:
        """Late reports arrive, then well-behaved workers run everything until all jobs end."""
        rnd, h = self.rnd, self.h
        rnd.shuffle(self.net)
        for cmd, _ in self.net:
            self.deliver(cmd)
        self.net.clear()
        self.actors.clear()  # hung and slow workers stop (their leases expire)
        for _ in range(max_rounds):
            if self.all_terminal():
                return
            for jid, state in self.job_states().items():
                if state == "paused":  # the operator resumes what is paused
                    self.deliver({"type": "dagfold.command.ResumeJob", "job_id": jid, "reason": "drain",
                                  "requested_by": "op", "requested_at_ms": h.now_ms})
            if self.queue:
                d = self.queue.pop(0)
                self.n_workers += 1
                w = f"good{self.n_workers}"
                self.deliver(report("Started", d["job_id"], d["task_id"], d["attempt"], w, h.now_ms))
                t = h.task(d["job_id"], d["task_id"])
                if t is not None and t["state"] == "running" and t["worker"] == w:
                    self.deliver(report("Succeeded", d["job_id"], d["task_id"], d["attempt"], w, h.now_ms))
                continue
            nxt = next(iter(h.store.range(keys.TIMER_PREFIX, keys.TIMER_PREFIX + b"\xff")), None)
            assert nxt is not None, f"stuck: jobs {self.job_states()} with nothing queued and no timer"
            due = keys.parse_timer(nxt[0])[0]
            h.advance(max(0, due - h.now_ms))
            self.collect()
        raise AssertionError(f"jobs not terminal after {max_rounds} rounds: {self.job_states()}")


# -- invariant checks -----------------------------------------------------------------

def check_timer_index(h: FoldHarness) -> None:
    """Timer index and task records agree; timers exist only in states that use them."""
    seen = set()
    for k, _raw in h.store.range(keys.TIMER_PREFIX, keys.TIMER_PREFIX + b"\xff"):
        due, job_id, task_id, kind = keys.parse_timer(k)
        t = h.task(job_id, task_id)
        assert t is not None and (t.get("timers") or {}).get(kind) == due, f"orphan timer {k!r}"
        assert t["state"] == TIMER_STATE[kind], f"{kind} timer on a {t['state']} task {job_id}/{task_id}"
        seen.add((job_id, task_id, kind))
    for k, _ in h.store.range(b"t" + keys.S.encode(), b"t" + keys.S.encode() + b"\xff"):
        _, job_id, task_id = k.decode().split(keys.S)
        t = h.task(job_id, task_id)
        assert t is not None
        for kind in t.get("timers") or {}:
            assert (job_id, task_id, kind) in seen, f"{kind} timer of {job_id}/{task_id} not indexed"


def check_jobs_final(h: FoldHarness, specs: list[Record]) -> None:
    """Terminal jobs: all tasks terminal; the job state and counters follow from the task states."""
    for spec in specs:
        job_id = spec["job_id"]
        j = h.job(job_id)
        assert j is not None and j["state"] in JOB_TERMINAL, (job_id, j)
        states = {t["task_id"]: h.task(job_id, t["task_id"])["state"] for t in spec["tasks"]}  # type: ignore[index]
        assert set(states.values()) <= TERMINAL, Counter(states.values())
        has_downstream = {u for t in spec["tasks"] for u in t["depends_on"]}
        leaves = {t["task_id"] for t in spec["tasks"]} - has_downstream
        last_end = [short(e) for e in h.events if e["job_id"] == job_id
                    and short(e) in ("JobSucceeded", "JobFailed", "JobCancelled")][-1]
        want = expected_job_state(spec["failure_policy"], states, leaves, last_end == "JobCancelled")
        assert j["state"] == want, (j["state"], want, Counter(states.values()))
        counts = Counter(states.values())
        assert j["open"] == 0
        for s in ("succeeded", "failed", "skipped", "cancelled"):
            assert j[s] == counts[s], (s, j[s], counts[s])
        assert j["leaf_ok"] == sum(states[t] == "succeeded" for t in leaves)
    check_timer_index(h)
    assert not any(True for _ in h.store.range(keys.TIMER_PREFIX, keys.TIMER_PREFIX + b"\xff")), "timer leak"


def check_event_stream(events: list[Record], specs: list[Record], opts: SchedulerOptions) -> None:
    """Walk the events in order with a model built from them alone and check every decision."""
    tspec = {(s["job_id"], t["task_id"]): (s, t) for s in specs for t in s["tasks"]}
    ups = {k: list(dict.fromkeys(t["depends_on"])) for k, (_, t) in tspec.items()}
    outcome: dict[tuple[str, str], str] = {}
    attempt: dict[tuple[str, str], int] = {}
    run_dispatches: Counter[tuple[str, str]] = Counter()  # attempts dispatched in this run
    base: dict[tuple[str, str], int] = {}  # attempts before this run (set by JobRedriven)
    in_run: set[tuple[str, str]] = set()  # dispatched since last (re)opened
    retry_due: dict[tuple[str, str], tuple[int, int]] = {}
    lease: dict[tuple[str, str], int] = {}
    granted_ts: dict[tuple[str, str], int] = {}
    dispatched_ts: dict[tuple[str, str], int] = {}
    successes: Counter[tuple[str, str]] = Counter()
    lost: Counter[tuple[str, str]] = Counter()  # attempts of this run whose worker was lost
    reclaimed: set[tuple[str, str]] = set()  # a LeaseReclaimed (not final) awaits its TaskDispatched
    leased: set[tuple[str, str]] = set()  # attempts leased and not ended
    redispatch_due: dict[tuple[str, str], int | None] = {}  # when the runnable attempt may be re-dispatched
    job_state: dict[str, str] = {}
    fail_fast_until_end: dict[str, int] = {}  # job -> cause offset of the final failure

    def policy_of(k: tuple[str, str]) -> dict[str, Any]:
        s, t = tspec[k]
        return t["retry"] or s["retry"] or NO_RETRY

    def timeouts_of(k: tuple[str, str]) -> dict[str, Any]:
        s, t = tspec[k]
        return t["timeouts"] or s["timeouts"] or {}

    for i, e in enumerate(events):
        typ, job_id = short(e), e["job_id"]
        k = (job_id, str(e.get("task_id")))
        if job_id in fail_fast_until_end and typ not in ("TaskCancelled", "JobFailed"):
            raise AssertionError(f"fail_fast: {typ} after the failure, before JobFailed")
        if typ == "JobAccepted":
            job_state[job_id] = "running"
        elif typ == "JobRejected":
            raise AssertionError(f"valid job rejected: {e}")
        elif typ == "TaskDispatched":
            assert job_state[job_id] == "running"
            assert k not in outcome, f"{k} dispatched though {outcome[k]}"
            assert e["attempt"] == attempt.get(k, 0) + 1, f"{k}: attempt {e['attempt']} after {attempt.get(k)}"
            attempt[k] = e["attempt"]
            dispatched_ts[k] = e["ts_ms"]
            leased.discard(k)
            every = opts.redispatch_after_ms(tspec[k][1]["queue"])
            gpu = bool((tspec[k][1]["resources"] or {}).get("gpus"))
            assert e["redispatch_at_ms"] == (None if gpu or not every else e["ts_ms"] + every)
            redispatch_due[k] = e["redispatch_at_ms"]
            if k in reclaimed:
                reclaimed.discard(k)  # a lost worker's attempt runs again at once
            elif k in retry_due:
                next_attempt, at = retry_due.pop(k)
                assert e["attempt"] == next_attempt and e["ts_ms"] >= at, f"{k} retried early: {e['ts_ms']} < {at}"
            else:
                outs = [outcome.get((job_id, u)) for u in ups[k]]
                rule = tspec[k][1]["trigger_rule"]
                assert rule_satisfied(rule, outs), f"{k} dispatched with rule {rule} and upstream {outs}"
                assert k not in in_run
            in_run.add(k)
            run_dispatches[k] += 1
            assert run_dispatches[k] - lost[k] <= policy_of(k)["max_attempts"], f"{k}: more attempts than max_attempts"
        elif typ == "LeaseReclaimed":
            assert e["attempt"] == attempt[k] and k not in outcome
            leased.discard(k)
            if e["reason"].startswith("lease_expired"):
                assert e["ts_ms"] >= lease[k], f"{k}: lease expired early"
            lost[k] += 1
            assert e["losses"] == lost[k] and e["final"] == (lost[k] >= opts.max_worker_losses)
            nxt = events[i + 1]  # the next attempt at once, or held while the job is paused
            assert nxt["task_id"] == k[1] and short(nxt) in (("TaskFailed",) if e["final"]
                                                             else ("TaskDispatched", "TaskHeld"))
            if not e["final"]:
                reclaimed.add(k)
        elif typ == "TaskRedispatched":  # the same attempt again: only runnable, unleased, and when due
            assert job_state[job_id] == "running", f"{k} re-dispatched while the job is {job_state[job_id]}"
            assert e["attempt"] == attempt[k] and k not in outcome and k not in leased, f"{k} re-dispatched"
            due = redispatch_due.get(k)
            assert due is not None and e["ts_ms"] >= due, f"{k} re-dispatched at {e['ts_ms']}, due {due}"
            every = opts.redispatch_after_ms(tspec[k][1]["queue"])
            assert e["next_redispatch_at_ms"] == e["ts_ms"] + every * min(2 ** e["redispatches"], 8)
            redispatch_due[k] = e["next_redispatch_at_ms"]
        elif typ == "TaskRedispatchDeferred":  # the check re-armed, no record: the same conditions, when due
            assert e["attempt"] == attempt[k] and k not in outcome and k not in leased, f"{k} deferred"
            due = redispatch_due.get(k)
            assert due is not None and e["ts_ms"] >= due, f"{k} checked at {e['ts_ms']}, due {due}"
            every = opts.redispatch_after_ms(tspec[k][1]["queue"])
            assert e["queue_leased_ms"] > e["ts_ms"] - every  # the queue was still handing out records
            assert e["next_redispatch_at_ms"] == e["ts_ms"] + every * min(2 ** e["deferrals"], 8)
            redispatch_due[k] = e["next_redispatch_at_ms"]
        elif typ == "LeaseGranted":
            assert e["attempt"] == attempt[k] and k not in leased
            leased.add(k)
            redispatch_due[k] = None
            lease[k] = e["lease_deadline_ms"]
            granted_ts[k] = e["ts_ms"]
        elif typ == "LeaseExtended":
            assert e["attempt"] == attempt[k] and e["lease_deadline_ms"] >= lease[k]
            lease[k] = e["lease_deadline_ms"]
        elif typ == "TaskFailed":
            assert e["attempt"] == attempt[k]
            leased.discard(k)
            redispatch_due[k] = None
            reason, pol, to = e["reason"], policy_of(k), timeouts_of(k)
            if reason.startswith("lease_expired"):
                assert e["ts_ms"] >= lease[k], f"{k}: lease expired early"
            elif reason == "start_to_close_timeout":
                assert e["ts_ms"] >= granted_ts[k] + int(to["start_to_close_s"] * 1000)
            elif reason == "schedule_to_start_timeout":
                assert e["ts_ms"] >= dispatched_ts[k] + int(to["schedule_to_start_s"] * 1000) and e["final"]
            if e["exit_code"] is not None and e["exit_code"] in pol["non_retryable_exit_codes"]:
                assert e["final"], f"{k}: non-retryable exit code {e['exit_code']} retried"
            if e["error_type"] is not None and e["error_type"] in pol["non_retryable_errors"]:
                assert e["final"]
            run_attempt = e["attempt"] - base.get(k, 0) - lost[k]  # lost workers spend no retry budget
            assert run_attempt == run_dispatches[k] - lost[k]
            if reason.startswith("worker_lost"):
                assert e["final"] and e["error_type"] == "worker_lost" and lost[k] == opts.max_worker_losses
            elif reason.startswith("lease_expired"):
                raise AssertionError(f"{k}: a lease expiry is a worker loss, never the task's failure")
            if reason == "start_to_close_timeout":
                # retryable by nature: final exactly when this run's attempts are used up
                assert e["final"] == (run_attempt >= pol["max_attempts"]), f"{k}: retry budget"
            if not e["final"]:
                assert run_attempt < pol["max_attempts"]
                nxt = events[i + 1]
                assert short(nxt) == "TaskRetryScheduled" and nxt["task_id"] == k[1]
                want = e["ts_ms"] + backoff_ms(pol, job_id, k[1], run_attempt)
                assert nxt["retry_at_ms"] == want and nxt["next_attempt"] == e["attempt"] + 1
                retry_due[k] = (e["attempt"] + 1, nxt["retry_at_ms"])
            else:
                outcome[k] = "failed"
                if tspec[k][0]["failure_policy"] == "fail_fast":
                    fail_fast_until_end[job_id] = e["cause_offset"]
        elif typ == "TaskSucceeded":
            assert e["attempt"] == attempt[k] and k not in outcome
            successes[k] += 1
            leased.discard(k)
            assert successes[k] == 1, f"{k} succeeded twice"
            outcome[k] = "succeeded"
        elif typ == "TaskSkipped":
            assert k not in outcome and k not in in_run, f"{k} skipped after being dispatched"
            outs = [outcome.get((job_id, u)) for u in ups[k]]
            rule = tspec[k][1]["trigger_rule"]
            assert rule_unsatisfiable(rule, outs), f"{k} skipped with rule {rule} and upstream {outs}"
            outcome[k] = "skipped"
        elif typ == "TaskCancelled":
            assert k not in outcome
            leased.discard(k)
            redispatch_due[k] = None
            outcome[k] = "cancelled"
            retry_due.pop(k, None)
        elif typ == "TaskHeld":  # could run, but its job is paused: nothing dispatched
            assert job_state[job_id] == "paused", f"{k} held while the job is {job_state[job_id]}"
            assert e["attempt"] == attempt.get(k, 0) and k not in outcome and k not in leased, f"{k} held"
        elif typ == "JobPaused":
            assert job_state[job_id] == "running", job_state[job_id]
            job_state[job_id] = "paused"
        elif typ == "JobResumed":
            assert job_state[job_id] == "paused", job_state[job_id]
            job_state[job_id] = "running"
        elif typ in ("JobSucceeded", "JobFailed", "JobCancelled"):
            assert job_state[job_id] in ("running", "paused")
            job_state[job_id] = typ
            open_tasks = [tk for tk in tspec if tk[0] == job_id and tk not in outcome]
            assert not open_tasks, f"{typ} with open tasks {open_tasks[:5]}"
            if typ == "JobFailed" and job_id in fail_fast_until_end:
                assert e["cause_offset"] == fail_fast_until_end.pop(job_id)
        elif typ == "JobRedriven":
            assert job_state[job_id] in ("JobFailed", "JobCancelled", "JobSucceeded")
            job_state[job_id] = "running"
            for tid in e["task_ids"]:
                tk = (job_id, tid)
                assert outcome.pop(tk) in ("failed", "skipped", "cancelled")
                in_run.discard(tk)
                run_dispatches[tk] = 0
                lost[tk] = 0
                base[tk] = attempt.get(tk, 0)  # a redrive gives a fresh retry budget
                retry_due.pop(tk, None)
        elif typ == "TaskReopened":  # an operator's retry or mark succeeded: a new run of each listed task
            assert job_state[job_id] in ("running", "JobFailed", "JobSucceeded"), job_state[job_id]
            assert e["task_ids"][0] == e["task_id"] and len(set(e["task_ids"])) == len(e["task_ids"])
            job_state[job_id] = "running"
            for tid in e["task_ids"]:
                tk = (job_id, tid)
                assert outcome.pop(tk) in ("failed", "skipped", "cancelled"), tk
                in_run.discard(tk)
                run_dispatches[tk] = 0
                lost[tk] = 0
                base[tk] = attempt.get(tk, 0)  # a fresh retry budget
                retry_due.pop(tk, None)
            if e["action"] == "mark_succeeded":
                nxt = events[i + 1]
                assert short(nxt) == "TaskMarkedSucceeded" and nxt["task_id"] == e["task_id"]
        elif typ == "TaskMarkedSucceeded":
            assert short(events[i - 1]) == "TaskReopened" and k not in outcome and k not in in_run
            outcome[k] = "succeeded"
        elif typ == "TaskRetryScheduled":
            assert short(events[i - 1]) == "TaskFailed" and not events[i - 1]["final"]
        else:
            assert typ in NOOP_EVENTS, typ
    assert not fail_fast_until_end, "fail_fast failure without JobFailed"


def check_avro(records: list[Record]) -> None:
    codec = default_codec()
    for rec in records:
        codec.encode(rec, validate_record=True)


def check_replay(h: FoldHarness) -> None:
    assert h.replayed_digest() == h.digest()


# -- properties -----------------------------------------------------------------------

def run_scenario(docs: list[dict[str, Any]], world: World, seed: int) -> Sim:
    specs = [to_spec(d) for d in docs]
    opts = SchedulerOptions(lease_timeout_s=world.lease_timeout_s, redispatch_after_s=world.redispatch_after_s)
    h = FoldHarness(opts)
    sim = Sim(h, random.Random(seed), world, specs)
    for spec in specs:
        sim.deliver({"type": "dagfold.command.SubmitJob", "spec": spec, "submitted_at_ms": h.now_ms,
                     "source": "test"})
    n_tasks = sum(len(s["tasks"]) for s in specs)
    sim.chaos(min(world.steps_per_task * n_tasks + 30, 3000))
    if sim.rnd.random() < 0.2:
        check_replay(h)  # also mid-way, with jobs still running
    sim.drain()
    check_jobs_final(h, specs)
    check_event_stream(h.events, specs, opts)
    check_replay(h)

    # An operator retries (or marks succeeded) every failed task of a failed job, upstream first; the
    # invariants hold through the re-opened runs.
    failed_jobs = [jid for jid, s in sim.job_states().items() if s == "failed"]
    if failed_jobs and sim.rnd.random() < 0.5:
        for jid in failed_jobs:
            for t in sim.specs[jid]["tasks"]:
                if (h.task(jid, t["task_id"]) or {}).get("state") == "failed":
                    kind = "MarkTaskSucceeded" if sim.rnd.random() < 0.3 else "RetryTask"
                    sim.deliver(task_action(kind, jid, t["task_id"], h.now_ms))
        sim.drain()
        check_jobs_final(h, specs)
        check_event_stream(h.events, specs, opts)
        check_replay(h)

    # Redrive what did not succeed; with behaving workers the rerun succeeds.
    redriven = [jid for jid, s in sim.job_states().items() if s in REDRIVABLE]
    if redriven and sim.rnd.random() < 0.6:
        for jid in redriven:
            sim.deliver({"type": "dagfold.command.RedriveJob", "job_id": jid, "requested_at_ms": h.now_ms})
        sim.drain()
        assert {sim.job_states()[j] for j in redriven} == {"succeeded"}, sim.job_states()
        check_jobs_final(h, specs)
        check_event_stream(h.events, specs, opts)
        check_replay(h)
    check_avro(h.events + h.controls + sim.dispatch_records)
    return sim


@given(docs=st.integers(1, 2).flatmap(lambda n: st.tuples(*[job_docs(f"J{i}", 1, 40) for i in range(n)])),
       world=worlds, seed=st.integers(0, 2**32 - 1))
def prop_chaos_small(docs: tuple[dict[str, Any], ...], world: World, seed: int) -> None:
    run_scenario(list(docs), world, seed)


@given(doc=job_docs("BIG", 100, 300), world=worlds, seed=st.integers(0, 2**32 - 1))
def prop_chaos_large(doc: dict[str, Any], world: World, seed: int) -> None:
    run_scenario([doc], world, seed)


def test_chaos_invariants_small_jobs(request: pytest.FixtureRequest) -> None:
    """1-2 jobs of up to 40 tasks per example, every invariant of the module docstring."""
    run_property(request, prop_chaos_small, "chaos_small")


def test_chaos_invariants_large_jobs(request: pytest.FixtureRequest) -> None:
    """One job of 100-300 tasks per example."""
    run_property(request, prop_chaos_large, "chaos_large")


@given(doc=job_docs("S", 1, 15), world=worlds, seed=st.integers(0, 2**32 - 1), data=st.data())
def prop_stale_reports(doc: dict[str, Any], world: World, seed: int, data: st.DataObject) -> None:
    """After some chaos, every report of an old attempt, of a non-holder, and every duplicate or stale
    timer fire leaves ``h.digest()`` unchanged."""
    spec = to_spec(doc)
    h = FoldHarness(SchedulerOptions(lease_timeout_s=world.lease_timeout_s,
                                     redispatch_after_s=world.redispatch_after_s))
    sim = Sim(h, random.Random(seed), world, [spec])
    sim.deliver({"type": "dagfold.command.SubmitJob", "spec": spec, "submitted_at_ms": h.now_ms, "source": "t"})
    sim.chaos(data.draw(st.integers(0, 150), label="chaos steps"))
    for job_id, task_id in sim.task_ids:
        t = h.task(job_id, task_id)
        assert t is not None
        for attempt in range(0, t["attempt"]):
            for kind in ("Started", "Heartbeat", "Succeeded", "Failed"):
                sim.deliver(report(kind, job_id, task_id, attempt, "w1", h.now_ms), full_digest=True)
        for kind in ("Heartbeat", "Succeeded", "Failed"):
            sim.deliver(report(kind, job_id, task_id, t["attempt"], "not-the-holder", h.now_ms), full_digest=True)
        for kind in TIMER_STATE:
            for attempt in (t["attempt"] - 1, t["attempt"] + 1):
                sim.deliver(timer_cmd(job_id, task_id, attempt, kind, h.now_ms, h.now_ms), full_digest=True)
    for cmd in list(sim.history):  # every earlier report and timer fire, once more
        sim.deliver(dict(cmd), full_digest=True)
    sim.deliver({"type": "dagfold.command.SubmitJob", "spec": spec, "submitted_at_ms": h.now_ms, "source": "t"},
                full_digest=True)
    sim.drain()
    before = h.digest()
    for cmd in list(sim.history):  # the job is over: nothing changes it any more
        sim.deliver(dict(cmd), full_digest=True)
    sim.deliver({"type": "dagfold.command.CancelJob", "job_id": "S", "reason": "late", "requested_at_ms": 0})
    assert h.digest() == before
    check_replay(h)


def test_stale_and_duplicate_reports_change_nothing(request: pytest.FixtureRequest) -> None:
    run_property(request, prop_stale_reports, "stale")


@st.composite
def small_dags(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, bool]]:
    """A small DAG drawn structurally (shrinks well) and each task's outcome (True = succeeds)."""
    n = draw(st.integers(1, 9))
    tasks, outcome = [], {}
    for i in range(n):
        deps = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        tasks.append({"id": f"t{i}", "depends_on": [f"t{d}" for d in deps],
                      "trigger_rule": draw(st.sampled_from(RULES))})
        outcome[f"t{i}"] = draw(st.booleans())
    return {"id": "R", "failure_policy": draw(st.sampled_from(POLICIES)), "tasks": tasks}, outcome


def reference_states(doc: dict[str, Any], ok: dict[str, bool]) -> dict[str, str]:
    """Final task states by the Airflow rules over final upstream states (no fail_fast)."""
    state: dict[str, str] = {}
    for t in doc["tasks"]:  # tasks only depend on earlier ones
        outs: list[str | None] = [state[u] for u in dict.fromkeys(t["depends_on"])]
        runs = rule_satisfied(t["trigger_rule"], outs)
        state[t["id"]] = ("succeeded" if ok[t["id"]] else "failed") if runs else "skipped"
    return state


@given(dag=small_dags(), rnd=st.randoms(use_true_random=False))
def prop_trigger_rules(dag: tuple[dict[str, Any], dict[str, bool]], rnd: random.Random) -> None:
    doc, ok = dag
    spec = to_spec(doc)
    h = FoldHarness()
    h.submit(spec)
    pending = list(h.dispatched)
    h.dispatched.clear()
    while pending:  # workers finish runnable tasks in any order
        d = pending.pop(rnd.randrange(len(pending)))
        h.report("Started", d)
        h.report("Succeeded" if ok[d["task_id"]] else "Failed", d, reason="boom")
        pending += list(h.dispatched)
        h.dispatched.clear()
    states = {t["id"]: h.task("R", t["id"])["state"] for t in doc["tasks"]}  # type: ignore[index]
    if doc["failure_policy"] != "fail_fast":
        assert states == reference_states(doc, ok)
    leaves = {t["id"] for t in doc["tasks"]} - {u for t in doc["tasks"] for u in t["depends_on"]}
    assert h.job("R")["state"] == expected_job_state(doc["failure_policy"], states, leaves, False)  # type: ignore[index]
    check_jobs_final(h, [spec])
    check_event_stream(h.events, [spec], h.opts)
    check_replay(h)


def test_trigger_rules_and_failure_policies_match_the_reference(request: pytest.FixtureRequest) -> None:
    run_property(request, prop_trigger_rules, "rules")


@given(policy=retry_policies, job=st.text(min_size=1, max_size=8), task=st.text(min_size=1, max_size=8),
       attempt=st.integers(1, 1000))
def prop_backoff(policy: dict[str, Any], job: str, task: str, attempt: int) -> None:
    try:
        grown = policy["initial_interval_s"] * policy["backoff_coefficient"] ** (attempt - 1)
    except OverflowError:
        grown = float("inf") if policy["initial_interval_s"] > 0 else 0.0
    base = min(grown, policy["max_interval_s"])
    ms = backoff_ms(policy, job, task, attempt)
    assert ms == backoff_ms(dict(policy), job, task, attempt)  # a function of its inputs only
    if policy["jitter"]:
        f = jitter_fraction(job, task, attempt)
        assert 0 <= f < 1
        assert ms == int(base * (0.8 + 0.4 * f) * 1000)
        assert int(base * 800) - 1 <= ms <= int(base * 1200) + 1
    else:
        assert ms == int(base * 1000)
        assert ms <= backoff_ms(policy, job, task, attempt + 1)  # never shrinks without jitter
    assert ms <= int(policy["max_interval_s"] * 1200) + 1


def test_backoff_is_deterministic_capped_and_jittered_by_20_percent(request: pytest.FixtureRequest) -> None:
    run_property(request, prop_backoff, "backoff")


# -- regressions found by the properties above ---------------------------------------

def _finish(h: FoldHarness, outcomes: dict[str, str]) -> None:
    """Run every dispatched task with the named outcome (default: succeed) until nothing is queued."""
    while h.dispatched:
        d = h.dispatched.popleft()
        h.report("Started", d)
        h.report(outcomes.get(d["task_id"], "Succeeded"), d, reason="boom")


def test_regression_redrive_dispatches_downstream_with_a_new_attempt_number() -> None:
    """A re-opened task dispatched after its upstream succeeds gets attempt N+1, not 1 again."""
    h = FoldHarness()
    h.submit(to_spec({"id": "J", "tasks": [{"id": "u"}, {"id": "d", "depends_on": ["u"], "trigger_rule": "all_done"}]}))
    _finish(h, {"u": "Failed", "d": "Failed"})
    assert h.job("J")["state"] == "failed" and h.task("J", "d")["attempt"] == 1  # type: ignore[index]
    h.process({"type": "dagfold.command.RedriveJob", "job_id": "J", "requested_at_ms": 0})
    _finish(h, {})
    attempts = [(e["task_id"], e["attempt"]) for e in h.events if short(e) == "TaskDispatched"]
    assert attempts == [("u", 1), ("d", 1), ("u", 2), ("d", 2)]
    assert h.job("J")["state"] == "succeeded"  # type: ignore[index]
    # a late duplicate of the first run's report is fenced off
    before = h.digest()
    h.report("Succeeded", {"job_id": "J", "task_id": "d", "attempt": 1})
    assert h.digest() == before


def test_regression_redrive_evaluates_trigger_rules_again() -> None:
    """A re-opened one_failed task whose upstream all succeeded is skipped again, not dispatched."""
    h = FoldHarness()
    h.submit(to_spec({"id": "J", "tasks": [
        {"id": "bad"}, {"id": "ok"}, {"id": "on_fail", "depends_on": ["ok"], "trigger_rule": "one_failed"},
        {"id": "after", "depends_on": ["on_fail"], "trigger_rule": "all_done"}]}))
    _finish(h, {"bad": "Failed"})
    assert h.task("J", "on_fail")["state"] == "skipped"  # type: ignore[index]
    h.process({"type": "dagfold.command.RedriveJob", "job_id": "J", "requested_at_ms": 0})
    assert [d["task_id"] for d in h.dispatched] == ["bad"]
    assert h.task("J", "on_fail")["state"] == "skipped"  # type: ignore[index]
    _finish(h, {})
    assert h.job("J")["state"] == "succeeded"  # type: ignore[index]
    check_event_stream(h.events, [_spec_of(h, "J")], h.opts)
    check_replay(h)


def test_regression_redrive_gives_a_fresh_retry_budget() -> None:
    """After a redrive, a task retries per its policy again; attempt numbers keep counting."""
    h = FoldHarness()
    h.submit(to_spec({"id": "J", "tasks": [{"id": "a", "retry": {"max_attempts": 2, "initial_interval_s": 1,
                                                                  "jitter": False}}]}))
    for _ in range(2):
        _finish(h, {"a": "Failed"})
        h.advance(1000)
    _finish(h, {"a": "Failed"})
    assert h.job("J")["state"] == "failed" and h.task("J", "a")["attempt"] == 2  # type: ignore[index]
    h.process({"type": "dagfold.command.RedriveJob", "job_id": "J", "requested_at_ms": 0})
    _finish(h, {"a": "Failed"})  # attempt 3, the first of the new run: retried
    assert h.task("J", "a")["state"] == "retrying"  # type: ignore[index]
    retry = [e for e in h.events if short(e) == "TaskRetryScheduled"][-1]
    assert (retry["attempt"], retry["retry_at_ms"] - retry["ts_ms"]) == (3, 1000)  # backoff restarts too
    h.advance(1000)
    _finish(h, {})
    assert h.job("J")["state"] == "succeeded" and h.task("J", "a")["attempt"] == 4  # type: ignore[index]
    check_replay(h)


def _spec_of(h: FoldHarness, job_id: str) -> Record:
    return next(e["spec"] for e in h.events if short(e) == "JobAccepted" and e["job_id"] == job_id)


@pytest.mark.parametrize(("where", "field", "value"), [
    ("job", "timeouts.heartbeat_s", float("nan")),
    ("job", "timeouts.start_to_close_s", float("inf")),
    ("task", "timeouts.schedule_to_start_s", -1.0),
    ("task", "retry.max_attempts", 0),
    ("job", "retry.initial_interval_s", float("nan")),
    ("task", "retry.backoff_coefficient", 0.5),
    ("job", "retry.max_interval_s", 1e300),
])
def test_regression_non_finite_or_out_of_range_policies_are_rejected(where: str, field: str, value: float) -> None:
    """Upstream producers bypass the API's spec model: the fold's validation must refuse what would
    make every later command of the job fail (a NaN lease, an infinite timeout, a retry time past
    Avro's long), instead of accepting a job that can never run."""
    spec = to_spec({"id": "J", "retry": {"max_attempts": 2}, "timeouts": {"heartbeat_s": 5},
                    "tasks": [{"id": "a", "retry": {"max_attempts": 2}, "timeouts": {"heartbeat_s": 5}}]})
    group, name = field.split(".")
    target = spec if where == "job" else spec["tasks"][0]
    target[group] = dict(target[group], **{name: value})
    h = FoldHarness()
    h.submit(spec)
    [ev] = h.events
    assert short(ev) == "JobRejected" and ev["code"] == "invalid_field" and name in ev["reason"], ev
    assert h.job("J") is None


def test_regression_backoff_does_not_overflow_on_late_attempts() -> None:
    policy = dict(NO_RETRY, max_attempts=1000, initial_interval_s=1.0, backoff_coefficient=10.0,
                  max_interval_s=60.0, jitter=False)
    assert backoff_ms(policy, "J", "a", 400) == 60_000  # 10.0 ** 399 overflows a float
    assert backoff_ms(dict(policy, initial_interval_s=0.0), "J", "a", 400) == 0
