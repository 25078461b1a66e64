"""Workloads with real durations (stdlib only: the peers' venv imports this too).

The noop benchmarks measure the scheduler; these measure what a user waits for
when tasks take time: the makespan against its lower bound
``max(critical path, total work / workers)``, and how long short tasks wait
for a worker while long ones run.

* ``montage-timed``, ``epigenomics-timed``: WfCommons instances with their
  recorded runtimes (``runtimeInSeconds``), scaled so that the lower bound at
  the benchmark's worker count is ``TARGET_S``;
* ``mixed``: three long tasks (tenant ``a``, one job) start at once; every
  second for ``TARGET_S`` seconds another tenant (``b``, ``c``, ``d`` in turn)
  submits a job of 8 short tasks. With one worker free of long tasks, a queue
  that hands work to any free worker starts every short task within a round
  trip; one that ties tasks to the worker owning their partition makes some
  of them wait for a long task to end.

A task's *wait* is its start minus the moment it became ready (its job's
submission for a root, its last parent's end otherwise), on the clocks of the
same machine.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from bench.peers.workloads import WF, topological

TARGET_S = 30.0
SHORT_S = 1.0  # a task shorter than this (scaled) counts as short


@dataclass(frozen=True)
class TimedJob:
    at_s: float  # submitted this long after the run's start
    tenant: str
    name: str
    tasks: list[tuple[str, list[str], float]]  # (task id, parents, seconds), topological


Workload = list[TimedJob]


def _wfcommons(name: str) -> tuple[list[tuple[str, list[str]]], dict[str, float]]:
    with gzip.open(WF / f"{name}.json.gz", "rt") as fh:
        tasks = json.load(fh)["workflow"]["tasks"]
    parents = {t["name"]: list(dict.fromkeys(t.get("parents") or [])) for t in tasks}
    return topological(parents), {t["name"]: float(t["runtimeInSeconds"]) for t in tasks}


def critical_path(tasks: Sequence[tuple[str, list[str], float]]) -> float:
    finish: dict[str, float] = {}
    for t, ps, s in tasks:
        finish[t] = s + max((finish[p] for p in ps), default=0.0)
    return max(finish.values(), default=0.0)


def lower_bound(workload: Workload, workers: int) -> float:
    """max(critical path, total work / workers), each job counted from its submission."""
    total = sum(s for j in workload for _, _, s in j.tasks)
    cp = max(j.at_s + critical_path(j.tasks) for j in workload)
    return max(cp, total / workers)


def wfcommons_timed(name: str, workers: int, target_s: float = TARGET_S) -> Workload:
    dag, runtime = _wfcommons(name)
    raw = [(t, ps, runtime[t]) for t, ps in dag]
    scale = target_s / lower_bound([TimedJob(0.0, "wf", "wf", raw)], workers)
    return [TimedJob(0.0, "wf", name.split("-")[0], [(t, ps, round(s * scale, 4)) for t, ps, s in raw])]


def mixed(workers: int, target_s: float = TARGET_S) -> Workload:
    jobs = [TimedJob(0.0, "a", "long", [(f"long{i}", [], target_s) for i in range(max(workers - 1, 1))])]
    for k in range(int(target_s)):
        tenant = "bcd"[k % 3]
        jobs.append(TimedJob(float(k), tenant, f"short{k:03d}", [(f"s{i}", [], 0.05) for i in range(8)]))
    return jobs


WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "montage-timed": lambda w: wfcommons_timed("montage-chameleon-2mass-01d-001", w),
    "epigenomics-timed": lambda w: wfcommons_timed("epigenomics-chameleon-ilmn-6seq-50k-001", w),
    "mixed": mixed,
}


def percentile(xs: Sequence[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def summarize(workload: Workload, workers: int, t0: float, submitted: Mapping[str, float],
              runs: Mapping[tuple[str, str], tuple[float, float]]) -> dict[str, object]:
    """Figures of one run: ``submitted`` job name -> time; ``runs`` (job, task) -> (start, end), seconds."""
    n = sum(len(j.tasks) for j in workload)
    waits_short: list[float] = []
    waits_all: list[float] = []
    end = t0
    for j in workload:
        for t, ps, s in j.tasks:
            r = runs.get((j.name, t))
            if r is None:
                continue
            ready = max([runs[(j.name, p)][1] for p in ps if (j.name, p) in runs] or [submitted[j.name]])
            w = max(r[0] - ready, 0.0)
            waits_all.append(w)
            if s < SHORT_S:
                waits_short.append(w)
            end = max(end, r[1])
    lb = lower_bound(workload, workers)
    makespan = end - t0
    return {
        "tasks": n, "done": len(runs), "workers": workers, "makespan_s": round(makespan, 2),
        "lower_bound_s": round(lb, 2), "makespan_over_bound": round(makespan / lb, 3) if lb else None,
        "short_tasks": len(waits_short),
        "short_wait_p50_s": _r(percentile(waits_short, 50)), "short_wait_p99_s": _r(percentile(waits_short, 99)),
        "short_wait_max_s": _r(max(waits_short, default=0.0)), "wait_p99_s": _r(percentile(waits_all, 99)),
    }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
