"""Graph and limit checks at submission, run inside the fold.

Pure functions over the Avro ``JobSpec`` dict: the scheduler cannot trust that
a record came through the API (upstream systems produce SubmitJob directly), so
every rule that decides acceptance lives here and nowhere else. The API calls
the same function to answer 4xx at once.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from dagfold import rules
from dagfold.config import Limits
from dagfold.jobspec.args import check_builtin_args
from dagfold.jobspec.triggers import TRIGGER_RULES

FailurePolicy = Literal["fail_fast", "skip_downstream", "allow_partial"]
FAILURE_POLICIES = frozenset(get_args(FailurePolicy))


@dataclass(frozen=True)
class Rejection:
    """Why a submission is refused: a machine code and a sentence for people.

    ``tasks`` and ``edges`` name what is at fault in the graph (the tasks of a cycle and its edges as
    ``(upstream, downstream)``, the dependency on an unknown task, a duplicated or invalid task), so
    the JobRejected event can carry a drawing of the refused graph with them marked (``rejected_graph``).
    """

    code: str
    reason: str
    tasks: tuple[str, ...] = ()
    edges: tuple[tuple[str, str], ...] = ()


def find_cycle(tasks: list[dict[str, Any]]) -> list[str] | None:
    """Return one dependency cycle as a list of task IDs (first repeated at the end), or None.

    Kahn's algorithm finds whether a cycle exists in O(V+E); a walk along
    remaining upstream edges then names one, so the rejection is actionable.
    """
    indeg = {t["task_id"]: len(set(t["depends_on"])) for t in tasks}
    down: dict[str, list[str]] = {t["task_id"]: [] for t in tasks}
    ups: dict[str, list[str]] = {}
    for t in tasks:
        ups[t["task_id"]] = sorted(set(t["depends_on"]))
        for u in ups[t["task_id"]]:
            down[u].append(t["task_id"])
    ready = [tid for tid, d in indeg.items() if d == 0]
    while ready:
        tid = ready.pop()
        for d in down[tid]:
            indeg[d] -= 1
            if indeg[d] == 0:
                ready.append(d)
    left = {tid for tid, d in indeg.items() if d > 0}
    if not left:
        return None
    # Every task left has an upstream that is also left: walk upstream until a repeat.
    start = min(left)
    seen: dict[str, int] = {}
    path: list[str] = []
    node = start
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(u for u in ups[node] if u in left)
    cycle = path[seen[node] :]
    cycle.reverse()  # upstream walk reversed reads in dependency order: a -> b means b depends on a
    return cycle + [cycle[0]]


MAX_ATTEMPTS = 1000
MAX_GPU_TYPES = 16
MAX_SECONDS = 10 * 365 * 24 * 3600.0  # longest interval or timeout: times stay in Avro longs (ms)


def _check_policies(where: str, retry: dict[str, Any] | None, timeouts: dict[str, Any] | None) -> Rejection | None:
    """Retry policy and timeouts: finite, in range (the API's spec model says the same; upstream
    producers bypass it, and a NaN or infinite time would make the fold fail on every command)."""
    if retry is not None:
        n = retry["max_attempts"]
        if not 1 <= n <= MAX_ATTEMPTS:
            return Rejection("invalid_field", f"{where}retry.max_attempts must be 1..{MAX_ATTEMPTS}, got {n}")
        for name, low, high in (("initial_interval_s", 0.0, MAX_SECONDS), ("max_interval_s", 0.0, MAX_SECONDS),
                                ("backoff_coefficient", 1.0, math.inf)):
            v = retry[name]
            if not (math.isfinite(v) and low <= v <= high):
                return Rejection("invalid_field", f"{where}retry.{name} must be a finite number >= {low:g}"
                                 + (f" and <= {high:g}" if high < math.inf else "") + f", got {v}")
    for name, v in (timeouts or {}).items():
        if v is not None and not (math.isfinite(v) and 0 < v <= MAX_SECONDS):
            return Rejection("invalid_field",
                             f"{where}timeouts.{name} must be a finite number > 0 and <= {MAX_SECONDS:g}, got {v}")
    return None


def _check_resources(tid: str, r: dict[str, Any] | None) -> Rejection | None:
    if r is None:
        return None
    for name in ("gpus", "hosts", "gpu_milli"):
        if not rules.finite_number(r.get(name, 0)):
            return Rejection("invalid_field", f"task {tid!r}: resources.{name} must be a number")
    rt = r.get("max_runtime_s")
    if rt is not None and not (rules.finite_number(rt) and 0 < rt <= MAX_SECONDS):
        return Rejection("invalid_field",
                         f"task {tid!r}: resources.max_runtime_s must be a finite number > 0 and <= {MAX_SECONDS:g}")
    types = r.get("gpu_type") or []
    if len(types) > MAX_GPU_TYPES:
        return Rejection("invalid_field", f"task {tid!r}: at most {MAX_GPU_TYPES} GPU types")
    for g in types:
        bad = rules.check_id("gpu_type", g)
        if bad:
            return Rejection("invalid_field", f"task {tid!r}: {bad}")
    return None


def _check_task(t: dict[str, Any], limits: Limits, names: set[tuple[str, str]]) -> Rejection | None:
    """One task's rules. ``names``: (kind, name) pairs already found valid in this job: a job of a million
    tasks names a handful of handlers and queues, so each is matched once, not once per task."""
    tid = t["task_id"]
    if len(tid) > limits.max_task_id_len:
        return Rejection("invalid_field", f"task id {tid[:40]!r} must be 1..{limits.max_task_id_len} characters")
    bad = rules.check_id("task_id", tid)
    if bad:
        return Rejection("invalid_field", bad)
    for kind in ("handler", "queue"):
        v = t[kind]
        if (kind, v) not in names:
            bad = rules.check_id(kind, v)
            if bad is None and kind == "queue" and len(v) > limits.max_queue_name_len:
                bad = f"queue is over {limits.max_queue_name_len} characters"
            if bad:
                return Rejection("invalid_field", f"task {tid!r}: {bad}")
            names.add((kind, v))
    if len(t["args_json"]) > limits.max_args_bytes:
        return Rejection("payload_too_large",
                         f"task {tid!r}: args are {len(t['args_json'])} bytes, limit {limits.max_args_bytes}")
    try:
        args = json.loads(t["args_json"])
    except ValueError:
        return Rejection("invalid_field", f"task {tid!r}: args_json is not valid JSON")
    if not isinstance(args, dict):
        return Rejection("invalid_field", f"task {tid!r}: args must be a JSON object")
    bad_args = check_builtin_args(t["handler"], args)  # the handler's own rules (built-ins; see jobspec.args)
    if bad_args:
        return Rejection("invalid_args", f"task {tid!r}: {bad_args}")
    if t["trigger_rule"] not in TRIGGER_RULES:
        return Rejection("invalid_field", f"task {tid!r}: unknown trigger_rule {t['trigger_rule']!r}")
    if tid in t["depends_on"]:
        return Rejection("cycle", f"dependency cycle: {tid} -> {tid}", (tid,), ((tid, tid),))
    return _check_policies(f"task {tid!r}: ", t["retry"], t["timeouts"]) or _check_resources(tid, t.get("resources"))


def validate_job_spec(spec: dict[str, Any], limits: Limits) -> Rejection | None:
    """All acceptance rules; None means the job is valid."""
    tasks = spec["tasks"]
    if len(spec["job_id"]) > limits.max_task_id_len:
        return Rejection("invalid_field", f"job_id must be 1..{limits.max_task_id_len} characters")
    for kind in ("job_id", "tenant", "tier"):
        bad = rules.check_id(kind, spec[kind])
        if bad:
            return Rejection("invalid_field", bad)
    key, name = spec.get("idempotency_key"), spec.get("name")
    bad = (rules.check_id("idempotency_key", key) if key is not None else None) or (
        rules.check_id("job_name", name) if name is not None else None) or rules.check_labels(
        spec.get("labels") or {})
    if bad:
        return Rejection("invalid_field", bad)
    url = spec.get("callback_url")
    if url is not None and (len(url) > rules.MAX_URL_LEN or rules.has_control(url)):
        return Rejection("invalid_field", f"callback_url must be at most {rules.MAX_URL_LEN} printable characters")
    if not tasks:
        return Rejection("invalid_field", "a job needs at least one task")
    if len(tasks) > limits.max_tasks_per_job:
        return Rejection("too_many_tasks", f"{len(tasks)} tasks, limit {limits.max_tasks_per_job} per job")
    if spec["failure_policy"] not in FAILURE_POLICIES:
        return Rejection("invalid_field", f"unknown failure_policy {spec['failure_policy']!r}")
    bad_policy = _check_policies("", spec["retry"], spec["timeouts"])
    if bad_policy:
        return bad_policy
    ids: set[str] = set()
    for t in tasks:
        if t["task_id"] in ids:
            return Rejection("duplicate_task", f"duplicate task id {t['task_id']!r}", (t["task_id"],))
        ids.add(t["task_id"])
    names: set[tuple[str, str]] = set()
    for t in tasks:
        task_bad = _check_task(t, limits, names)
        if task_bad:
            return task_bad if task_bad.tasks else replace(task_bad, tasks=(t["task_id"],))
        for dep in t["depends_on"]:
            if dep not in ids:
                return Rejection("unknown_dependency",
                                 f"task {t['task_id']!r} depends on unknown task {dep!r}",
                                 (t["task_id"],), ((dep, t["task_id"]),))
    cycle = find_cycle(tasks)
    if cycle:
        return Rejection("cycle", "dependency cycle: " + _path(cycle), tuple(cycle[:-1][:REJECTED_GRAPH_TASKS]),
                         tuple(zip(cycle, cycle[1:], strict=False))[:REJECTED_GRAPH_TASKS])
    return None


CYCLE_NAMED = 50  # tasks of a cycle the reason names: a cycle through a million tasks is one line


def _path(cycle: list[str]) -> str:
    if len(cycle) <= CYCLE_NAMED + 1:
        return " -> ".join(cycle)
    return (" -> ".join(cycle[:CYCLE_NAMED]) + f" -> \u2026 ({len(cycle) - 1 - CYCLE_NAMED} more tasks) -> "
            + cycle[-1])


# What a JobRejected may carry of the refused graph: a 1M-task spec must not make a 1M-task event.
REJECTED_GRAPH_TASKS = 2000
REJECTED_GRAPH_BYTES = 64 * 1024  # of task IDs (UTF-8); edges are 2 ints each, at most 4 per task drawn
REJECTED_GRAPH_EDGES = 4 * REJECTED_GRAPH_TASKS


def rejected_graph(spec: dict[str, Any], rej: Rejection, limits: Limits) -> dict[str, Any]:
    """A bounded drawing of a refused spec for the ``JobRejected.graph`` field (schema: RejectedGraph).

    The tasks the rejection names come first (so a cycle among a million tasks is always drawn), then
    their neighbours breadth first (the context a reader needs), then the rest in spec order, until
    ``REJECTED_GRAPH_TASKS`` tasks or ``REJECTED_GRAPH_BYTES`` of IDs. Edges among the drawn tasks
    follow, the offending ones first, up to ``REJECTED_GRAPH_EDGES``. Task IDs are cut to the length
    limit of an ID (an over-long one is itself a reason for refusal; a cut that repeats a drawn ID is
    left out). Cost: O(tasks + edges) of the spec, as validation already is, once per refused
    submission (the downstream index only when the rejection names tasks); the event is O(limits).
    """
    tasks = spec["tasks"]
    cut = limits.max_task_id_len
    order: list[str] = []  # full IDs drawn, in drawing order
    index: dict[str, int] = {}
    shorts: set[str] = set()
    budget = REJECTED_GRAPH_BYTES

    def take(tid: str) -> bool:
        """Draw ``tid`` if it fits; False once the graph is full."""
        nonlocal budget
        short = tid[:cut]
        if tid in index or short in shorts:
            return True
        size = len(short.encode("utf-8", "surrogatepass"))
        if len(order) >= REJECTED_GRAPH_TASKS or size > budget:
            return False
        budget -= size
        shorts.add(short)
        index[tid] = len(order)
        order.append(tid)
        return True

    deps_of: dict[str, list[str]] = {}
    total_edges = 0
    for t in tasks:
        deps_of.setdefault(t["task_id"], t["depends_on"])  # a duplicate's first definition
        total_edges += len(t["depends_on"])
    named = [*rej.tasks, *(x for e in rej.edges for x in e)]
    full = False
    if named:
        downs: dict[str, list[str]] = {}
        for tid, deps in deps_of.items():
            for d in deps:
                downs.setdefault(d, []).append(tid)
        queue: deque[str] = deque()
        for tid in named:
            if tid not in index:
                full = not take(tid)
                if full:
                    break
                if tid in index:
                    queue.append(tid)
        while queue and not full:  # neighbours of what the rejection names, breadth first
            tid = queue.popleft()
            for n in (*deps_of.get(tid, ()), *downs.get(tid, ())):
                if n in index:
                    continue
                full = not take(n)
                if full:
                    break
                if n in index:
                    queue.append(n)
    for t in tasks:
        if full or not take(t["task_id"]):
            break

    marked = list(dict.fromkeys((index[a], index[b]) for a, b in rej.edges if a in index and b in index))
    seen = set(marked)
    edges = [i for pair in marked for i in pair]
    for tid in order:
        c = index[tid]
        for d in deps_of.get(tid, ()):
            p = index.get(d)
            if p is not None and (p, c) not in seen:
                if len(seen) >= REJECTED_GRAPH_EDGES:
                    break
                seen.add((p, c))
                edges += (p, c)
    return {
        "task_ids": [tid[:cut] for tid in order],
        "edges": edges,
        "marked_edges": [i for pair in marked for i in pair],
        "marked_tasks": sorted({index[tid] for tid in rej.tasks if tid in index}),
        "missing_tasks": [i for i, tid in enumerate(order) if tid not in deps_of],
        "total_tasks": len(tasks),
        "total_edges": total_edges,
    }
