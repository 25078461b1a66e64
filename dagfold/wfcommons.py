"""Load a WfCommons workflow (JSON, optionally gzipped) as a dagfold job spec.

Every layout of the WfCommons schema (github.com/wfcommons/wfformat) is read:

- 1.0-1.2: tasks in ``workflow.jobs``; identity ``name``; parents are names; runtime ``runtime``.
- 1.3-1.4: ``workflow.tasks``; identity ``name`` (``id`` if names repeat); parents are names (or ids);
  runtime ``runtimeInSeconds`` (or ``runtime``).
- 1.5+: ``workflow.specification.tasks``; identity ``id`` (``name`` repeats, e.g. Nextflow); parents
  are ids; runtime ``runtimeInSeconds`` of ``workflow.execution.tasks``, matched by ``id`` (0 without
  an execution section).

The layout is found from the keys present (``schemaVersion`` only names it in
errors), so a file whose version string is off but whose layout is known still
loads. Every error names the schema version and the missing or bad field.

One dagfold task per workflow task, with the trace's parent edges; each task
sleeps ``runtime * time_scale`` (0 gives noop tasks, which measure the scheduler
rather than the workload). The file is hostile input: its decompressed size is
bounded before parsing, and the job spec still goes through the scheduler's
validation (task count, ID rules, cycles) before it is submitted.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dagfold.exceptions import DagfoldError

MAX_WORKFLOW_BYTES = 512 * 1024 * 1024  # decompressed; the largest WfInstances files are ~100 MB


class WorkflowError(DagfoldError):
    """The file is not a WfCommons workflow, or a field it needs is missing or malformed."""


@dataclass(frozen=True)
class WorkflowTask:
    id: str
    parents: tuple[str, ...]
    runtime_s: float


@dataclass(frozen=True)
class Workflow:
    name: str
    schema_version: str
    tasks: list[WorkflowTask]
    makespan_s: float | None


def read_document(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as fh:
            raw = fh.read(MAX_WORKFLOW_BYTES + 1)
    except (OSError, EOFError) as exc:
        raise WorkflowError(f"{path}: cannot read ({exc})") from exc
    if len(raw) > MAX_WORKFLOW_BYTES:
        raise WorkflowError(f"{path}: larger than {MAX_WORKFLOW_BYTES >> 20} MiB decompressed")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise WorkflowError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("workflow"), dict):
        raise WorkflowError(f"{path}: not a WfCommons workflow (no 'workflow' object)")
    return doc


def read_workflow(path: Path) -> Workflow:
    """The workflow's tasks, whatever the schema version; raises WorkflowError naming version and field."""
    doc = read_document(path)
    version = str(doc.get("schemaVersion") or "?")
    wf: dict[str, Any] = doc["workflow"]
    where = f"{path.name} (schema {version})"
    spec = wf.get("specification")
    if isinstance(spec, dict):  # 1.5+
        raw = _task_list(spec.get("tasks"), where, "workflow.specification.tasks")
        runtimes = _execution_runtimes(wf.get("execution"), where)
        tasks = _resolve(raw, where, "workflow.specification.tasks", by_id=True, runtimes=runtimes)
        execution = wf.get("execution")
        makespan = execution.get("makespanInSeconds") if isinstance(execution, dict) else None
    elif "tasks" in wf:  # 1.3-1.4
        raw = _task_list(wf["tasks"], where, "workflow.tasks")
        tasks = _resolve(raw, where, "workflow.tasks", by_id=False, runtimes=None)
        makespan = wf.get("makespanInSeconds", wf.get("makespan"))
    elif "jobs" in wf:  # 1.0-1.2
        raw = _task_list(wf["jobs"], where, "workflow.jobs")
        tasks = _resolve(raw, where, "workflow.jobs", by_id=False, runtimes=None)
        makespan = wf.get("makespan", wf.get("makespanInSeconds"))
    else:
        raise WorkflowError(f"{where}: no tasks: expected workflow.specification.tasks (1.5+), "
                            "workflow.tasks (1.3-1.4) or workflow.jobs (1.0-1.2)")
    name = path.name.split(".json")[0]
    return Workflow(name, version, tasks, float(makespan) if isinstance(makespan, (int, float)) else None)


def _task_list(value: Any, where: str, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise WorkflowError(f"{where}: {field} is missing or empty")
    for i, t in enumerate(value):
        if not isinstance(t, dict):
            raise WorkflowError(f"{where}: {field}[{i}] is not an object")
    return value


def _execution_runtimes(execution: Any, where: str) -> dict[str, float]:
    """Runtimes by task id from workflow.execution.tasks (absent: a specification without a run, all 0)."""
    if execution is None:
        return {}
    if not isinstance(execution, dict):
        raise WorkflowError(f"{where}: workflow.execution is not an object")
    tasks = execution.get("tasks") or []
    if not isinstance(tasks, list):
        raise WorkflowError(f"{where}: workflow.execution.tasks is not a list")
    out: dict[str, float] = {}
    for i, t in enumerate(tasks):
        if not isinstance(t, dict) or not isinstance(t.get("id"), str):
            raise WorkflowError(f"{where}: workflow.execution.tasks[{i}] has no 'id'")
        out[t["id"]] = _runtime(t, ("runtimeInSeconds",), where, f"workflow.execution.tasks[{i}]")
    return out


def _runtime(t: dict[str, Any], fields: tuple[str, ...], where: str, at: str) -> float:
    for f in fields:
        v = t.get(f)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
            raise WorkflowError(f"{where}: {at}.{f} must be a number of seconds >= 0, not {v!r}")
        return float(v)
    return 0.0


def _resolve(raw: list[dict[str, Any]], where: str, field: str, *, by_id: bool,
             runtimes: dict[str, float] | None) -> list[WorkflowTask]:
    """Task identities and parent edges.

    1.5+ (``by_id``): identity is ``id``, required. Before: ``name``, required; if names repeat and
    every task has a unique ``id``, identity is ``id``. A parent reference is looked up among the
    identities first, then (for the few files that mix them) among the other key.
    """
    key = "id" if by_id else "name"
    for i, t in enumerate(raw):
        if not isinstance(t.get(key), str) or not t[key]:
            raise WorkflowError(f"{where}: {field}[{i}] has no '{key}'")
    idents = [t[key] for t in raw]
    if not by_id and len(set(idents)) != len(idents):
        ids = [t.get("id") for t in raw]
        if all(isinstance(x, str) and x for x in ids) and len(set(ids)) == len(ids):
            key, idents = "id", [str(x) for x in ids]
    seen: set[str] = set()
    for ident in idents:
        if ident in seen:
            raise WorkflowError(f"{where}: task {key} {ident!r} repeats in {field}")
        seen.add(ident)
    other = "name" if key == "id" else "id"
    alias: dict[str, str] = {}
    for t, ident in zip(raw, idents, strict=True):
        o = t.get(other)
        if isinstance(o, str) and o not in alias:
            alias[o] = ident
    known = set(idents)
    out = []
    for i, (t, ident) in enumerate(zip(raw, idents, strict=True)):
        parents = t.get("parents") or []
        if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
            raise WorkflowError(f"{where}: {field}[{i}].parents must be a list of task {key}s")
        resolved = []
        for p in parents:
            if p in known:
                resolved.append(p)
            elif p in alias:
                resolved.append(alias[p])
            else:
                raise WorkflowError(f"{where}: {field}[{i}] ({ident!r}): parent {p!r} is not a task {key}")
        if runtimes is not None:
            runtime = runtimes.get(ident, 0.0)
        else:
            runtime = _runtime(t, ("runtimeInSeconds", "runtime"), where, f"{field}[{i}]")
        out.append(WorkflowTask(ident, tuple(dict.fromkeys(resolved)), runtime))
    return out


def workflow_spec(path: Path, time_scale: float = 0.0, job_id: str | None = None,
                  queue: str = "default") -> dict[str, Any]:
    """A job spec document (the YAML/JSON shape) for the workflow at ``path``."""
    wf = read_workflow(path)
    out = []
    for t in wf.tasks:
        seconds = t.runtime_s * time_scale
        task: dict[str, Any] = {"id": t.id, "depends_on": list(t.parents), "queue": queue}
        if seconds > 0:
            task.update(handler="sleep", args={"seconds": round(seconds, 3)})
        else:
            task["handler"] = "noop"
        out.append(task)
    labels = {"workflow": wf.name, "wfcommons_schema": wf.schema_version,
              "makespan_s": "" if wf.makespan_s is None else str(wf.makespan_s)}
    spec: dict[str, Any] = {"tasks": out, "labels": labels}
    if job_id:
        spec["id"] = job_id
    return spec
