"""Load a WfCommons workflow (JSON, optionally gzipped) as a dagfold job spec.

One dagfold task per workflow task, named as in the trace, with the trace's
parent edges; each task sleeps ``runtimeInSeconds * time_scale`` (0 gives noop
tasks, which measure the scheduler rather than the workload).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from dagfold.exceptions import DagfoldError


class WorkflowError(DagfoldError):
    """The file is not a WfCommons workflow."""


def read_workflow(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as fh:
            doc = json.load(fh)
        return dict(doc["workflow"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WorkflowError(f"{path}: not a WfCommons workflow ({exc})") from exc


def workflow_spec(path: Path, time_scale: float = 0.0, job_id: str | None = None,
                  queue: str = "default") -> dict[str, Any]:
    """A job spec document (the YAML/JSON shape) for the workflow at ``path``."""
    wf = read_workflow(path)
    tasks = wf.get("tasks")
    if not isinstance(tasks, list) or not tasks:
        raise WorkflowError(f"{path}: workflow has no tasks")
    out = []
    for t in tasks:
        runtime = float(t.get("runtimeInSeconds") or t.get("runtime") or 0.0)
        seconds = runtime * time_scale
        task: dict[str, Any] = {"id": t["name"], "depends_on": list(t.get("parents") or []), "queue": queue}
        if seconds > 0:
            task.update(handler="sleep", args={"seconds": round(seconds, 3)})
        else:
            task["handler"] = "noop"
        out.append(task)
    name = path.name.split(".json")[0]
    spec: dict[str, Any] = {"tasks": out, "labels": {"workflow": name,
                                                      "makespan_s": str(wf.get("makespanInSeconds", ""))}}
    if job_id:
        spec["id"] = job_id
    return spec
