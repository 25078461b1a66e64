"""The chaos workload: generated DAGs and WfCommons workflows, and the outcome each must reach.

Every task runs the ``chaos_effect`` handler (``chaos.handlers``). Generated jobs
are layered DAGs with random fan-in, a mix of trigger rules and failure
policies, flaky tasks (the first attempt fails) and, in some jobs, a task that
fails for good. Every outcome is decided by the spec, not by timing: flaky tasks
have attempts to spare, so ``expected_outcome`` can say, from the spec alone,
which state every task and the job must end in (``fail_fast`` jobs with a
failing task: only the job's state, since what gets cancelled depends on timing).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.handlers import HANDLER
from dagfold.wfcommons import read_workflow

ROOT = Path(__file__).resolve().parent.parent
WFCOMMONS = ROOT.parent / "shared" / "data" / "wfcommons"

# Plenty of attempts: workers are killed mid-task and leases expire; only `fail: always` may fail a task.
RETRY = {"max_attempts": 40, "initial_interval_s": 0.2, "backoff_coefficient": 1.5, "max_interval_s": 2.0}
# A dead worker's lease runs out within seconds; a live worker heartbeats every heartbeat_s / 3.
TIMEOUTS = {"heartbeat_s": 6.0}
RULES = ["all_success", "all_done", "one_success", "one_failed", "none_failed", "always"]


@dataclass
class JobPlan:
    job_id: str
    kind: str  # "generated" or "wfcommons:<name>"
    doc: dict[str, Any]  # the spec document (the API's JSON body)
    expected_job: str = "succeeded"
    expected_tasks: dict[str, str] | None = field(default=None)  # None: not decided by the spec alone

    @property
    def tasks(self) -> int:
        return len(self.doc["tasks"])


def _task(tid: str, deps: list[str], rng: random.Random, *, ms: float, rule: str = "all_success",
          flaky: bool = False, fail: bool = False) -> dict[str, Any]:
    args: dict[str, Any] = {"ms": round(ms, 1)}
    if flaky:
        args["flaky"] = True
    if fail:
        args["fail"] = "always"
    t: dict[str, Any] = {"id": tid, "handler": HANDLER, "args": args, "depends_on": deps}
    if rule != "all_success":
        t["trigger_rule"] = rule
    return t


def generated_job(job_id: str, rng: random.Random, max_width: int = 6, max_layers: int = 6) -> JobPlan:
    layers = rng.randint(2, max_layers)
    fancy = rng.random() < 0.35  # other trigger rules than all_success
    failing = rng.random() < 0.15  # one task fails for good
    policy = rng.choices(["skip_downstream", "allow_partial", "fail_fast"], [6, 2, 1])[0]
    tasks: list[dict[str, Any]] = []
    prev: list[list[str]] = []
    for layer in range(layers):
        ids = [f"L{layer}T{i}" for i in range(rng.randint(1, max_width))]
        for tid in ids:
            deps: list[str] = []
            if prev:
                pool = [u for ls in prev[-2:] for u in ls]
                deps = sorted(rng.sample(pool, min(len(pool), rng.randint(1, 3))))
            rule = rng.choice(RULES) if fancy and deps and rng.random() < 0.5 else "all_success"
            tasks.append(_task(tid, deps, rng, ms=rng.uniform(5, 150), rule=rule, flaky=rng.random() < 0.1))
        prev.append(ids)
    if failing:
        victim = rng.choice(tasks[: max(1, len(tasks) // 2)])
        victim["args"]["fail"] = "always"
        victim["args"].pop("flaky", None)
    doc = {"id": job_id, "failure_policy": policy, "retry": RETRY, "timeouts": TIMEOUTS,
           "labels": {"chaos": "generated"}, "tasks": tasks}
    return with_expectation(JobPlan(job_id, "generated", doc))


def wfcommons_job(job_id: str, path: Path, rng: random.Random, ms_scale: float = 0.5,
                  max_ms: float = 60.0) -> JobPlan:
    """A WfCommons workflow: its tasks and edges, each task sleeping ``runtime * ms_scale`` ms (capped)."""
    wf = read_workflow(path)
    tasks = []
    for t in wf.tasks:
        tasks.append(_task(t.id, list(t.parents), rng, ms=min(max_ms, t.runtime_s * ms_scale),
                           flaky=rng.random() < 0.03))
    name = path.name.split(".json")[0]
    doc = {"id": job_id, "retry": RETRY, "timeouts": TIMEOUTS, "labels": {"chaos": "wfcommons", "workflow": name},
           "tasks": tasks}
    return with_expectation(JobPlan(job_id, f"wfcommons:{name}", doc))


def _rule_decision(rule: str, outcomes: list[str | None]) -> str:
    """'run', 'skip' or 'wait' (Airflow's trigger rules, as dagfold documents them)."""
    done = [o for o in outcomes if o is not None]
    rem = len(outcomes) - len(done)
    ok = sum(o == "succeeded" for o in done)
    bad = sum(o == "failed" for o in done)
    other = len(done) - ok - bad  # skipped or cancelled
    if rule == "always":
        return "run"
    if rule == "all_success":
        return "skip" if bad or other else ("run" if rem == 0 else "wait")
    if rule == "all_done":
        return "run" if rem == 0 else "wait"
    if rule == "one_success":
        return "run" if ok else ("skip" if rem == 0 else "wait")
    if rule == "one_failed":
        return "run" if bad else ("skip" if rem == 0 else "wait")
    if rule == "none_failed":
        return "skip" if bad else ("run" if rem == 0 else "wait")
    raise ValueError(rule)


def rule_decision(rule: str, outcomes: list[str | None]) -> str:
    return _rule_decision(rule, outcomes)


def with_expectation(plan: JobPlan) -> JobPlan:
    """Fill in the final state of every task and of the job, from the spec alone."""
    tasks = {t["id"]: t for t in plan.doc["tasks"]}
    outcome: dict[str, str] = {}
    pending = list(tasks)
    while pending:
        progressed = False
        for tid in list(pending):
            t = tasks[tid]
            d = _rule_decision(t.get("trigger_rule", "all_success"), [outcome.get(u) for u in t.get("depends_on", [])])
            if d == "wait":
                continue
            if d == "skip":
                outcome[tid] = "skipped"
            else:
                outcome[tid] = "failed" if t.get("args", {}).get("fail") == "always" else "succeeded"
            pending.remove(tid)
            progressed = True
        if not progressed:
            raise ValueError(f"{plan.job_id}: cannot decide {pending[:3]}")
    failed = sum(o == "failed" for o in outcome.values())
    policy = plan.doc.get("failure_policy", "skip_downstream")
    downstream = {u for t in tasks.values() for u in t.get("depends_on", [])}
    leaf_ok = sum(1 for tid, o in outcome.items() if o == "succeeded" and tid not in downstream)
    if failed == 0:
        plan.expected_job = "succeeded"
    elif policy == "allow_partial" and leaf_ok > 0:
        plan.expected_job = "succeeded_partial"
    else:
        plan.expected_job = "failed"
    plan.expected_tasks = None if (failed and policy == "fail_fast") else outcome
    return plan


def wfcommons_files(names: list[str]) -> list[Path]:
    out = []
    for n in names:
        p = WFCOMMONS / n
        if p.exists():
            out.append(p)
    return out


def plan_workload(seed: int, generated: int, workflows: list[str]) -> list[JobPlan]:
    """The jobs of a run, in submission order (workflows spread among the generated jobs)."""
    rng = random.Random(seed)
    plans = [generated_job(f"chaos-{seed}-g{i:05d}", rng) for i in range(generated)]
    for i, path in enumerate(wfcommons_files(workflows)):
        plan = wfcommons_job(f"chaos-{seed}-w{i:02d}", path, rng)
        plans.insert(min(len(plans), (i * 7) % max(1, len(plans) // 2 + 1)), plan)
    return plans
