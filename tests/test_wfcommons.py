"""WfCommons 1.0-1.6: every layout (files written for these tests in tests/data/wfcommons), clear
errors naming the schema version and the field, and every schema-1.5 WfInstances file of
../shared/data/wfinstances imported and run through `dagfold submit --wfcommons` on a live stack."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from dagfold.cli import app
from dagfold.config import Config
from dagfold.services.stack import Stack, StackOptions
from dagfold.wfcommons import WorkflowError, read_workflow, workflow_spec
from tests.cli_support import free_port

DATA = Path(__file__).resolve().parent / "data" / "wfcommons"
WFINSTANCES = Path(__file__).resolve().parents[2] / "shared" / "data" / "wfinstances"
# the task counts of ../shared/data/wfinstances/README.md
INSTANCE_TASKS = {
    "1000genome-chameleon-2ch-250k-001": 82, "cycles-chameleon-1l-2c-9p-001": 134,
    "epigenomics-chameleon-hep-1seq-100k-001": 41, "montage-chameleon-2mass-02d-001": 619,
    "montage-chameleon-dss-075d-001": 178, "seismology-chameleon-300p-001": 301,
}


def _edges(path: Path) -> dict[str, tuple[tuple[str, ...], float]]:
    return {t.id: (t.parents, t.runtime_s) for t in read_workflow(path).tasks}


def test_every_layout_reads_tasks_edges_and_runtimes() -> None:
    assert _edges(DATA / "schema-1.0-jobs.json") == {
        "split": ((), 2.5), "left": (("split",), 4.0), "right": (("split",), 3.0), "join": (("left", "right"), 1.0)}
    assert _edges(DATA / "schema-1.2-jobs.json") == {
        "fetch": ((), 5.0), "parse": (("fetch",), 2.0), "report": (("parse", "fetch"), 0.0)}
    assert _edges(DATA / "schema-1.3-tasks.json") == {
        "stage_ID0000001": ((), 1.5), "work_ID0000002": (("stage_ID0000001",), 6.0),
        "work_ID0000003": (("stage_ID0000001",), 7.0),
        "merge_ID0000004": (("work_ID0000002", "work_ID0000003"), 2.0)}
    # 1.4 with a repeated name: identity falls back to the unique ids
    assert _edges(DATA / "schema-1.4-repeated-names.json") == {
        "t1": ((), 3.0), "t2": ((), 4.0), "t3": (("t1", "t2"), 2.0)}
    # 1.5: identity from id (names repeat), runtimes from the execution section
    assert _edges(DATA / "schema-1.5-nextflow.json") == {
        "FASTQC_0001": ((), 11.0), "FASTQC_0002": ((), 12.5), "TRIM_0003": ((), 8.0),
        "MULTIQC_0004": (("FASTQC_0001", "FASTQC_0002", "TRIM_0003"), 6.25)}
    # 1.6 specification without an execution section: runtimes 0
    assert _edges(DATA / "schema-1.6-spec-only.json") == {"gen_00000001": ((), 0.0),
                                                         "sum_00000002": (("gen_00000001",), 0.0)}
    spec = workflow_spec(DATA / "schema-1.5-nextflow.json", time_scale=0.1)
    assert spec["labels"]["wfcommons_schema"] == "1.5" and spec["labels"]["makespan_s"] == "30.0"
    assert spec["tasks"][1] == {"id": "FASTQC_0002", "depends_on": [], "queue": "default", "handler": "sleep",
                                "args": {"seconds": 1.25}}
    assert workflow_spec(DATA / "schema-1.0-jobs.json")["tasks"][0]["handler"] == "noop"


def _write(tmp: Path, doc: dict[str, Any], gz: bool = False) -> Path:
    p = tmp / ("wf.json.gz" if gz else "wf.json")
    raw = json.dumps(doc).encode()
    p.write_bytes(gzip.compress(raw) if gz else raw)
    return p


@pytest.mark.parametrize(("doc", "message"), [
    ({"schemaVersion": "1.5", "workflow": {"specification": {"tasks": [{"name": "a", "parents": []}]}}},
     "(schema 1.5): workflow.specification.tasks[0] has no 'id'"),
    ({"schemaVersion": "1.5", "workflow": {"specification": {"tasks": [{"id": "a", "parents": ["zz"]}]}}},
     "(schema 1.5): workflow.specification.tasks[0] ('a'): parent 'zz' is not a task id"),
    ({"schemaVersion": "1.5", "workflow": {"specification": {"tasks": []}}},
     "(schema 1.5): workflow.specification.tasks is missing or empty"),
    ({"schemaVersion": "1.5", "workflow": {"specification": {"tasks": [{"id": "a"}]},
                                           "execution": {"tasks": [{"runtimeInSeconds": 1}]}}},
     "(schema 1.5): workflow.execution.tasks[0] has no 'id'"),
    ({"schemaVersion": "1.5", "workflow": {"specification": {"tasks": [{"id": "a"}]},
                                           "execution": {"tasks": [{"id": "a", "runtimeInSeconds": -1}]}}},
     "(schema 1.5): workflow.execution.tasks[0].runtimeInSeconds must be a number of seconds >= 0"),
    ({"schemaVersion": "1.4", "workflow": {"tasks": [{"id": "x", "runtimeInSeconds": 1}]}},
     "(schema 1.4): workflow.tasks[0] has no 'name'"),
    ({"schemaVersion": "1.4", "workflow": {"tasks": [{"name": "a"}, {"name": "a"}]}},
     "(schema 1.4): task name 'a' repeats in workflow.tasks"),
    ({"schemaVersion": "1.3", "workflow": {"tasks": [{"name": "a", "runtimeInSeconds": "slow"}]}},
     "(schema 1.3): workflow.tasks[0].runtimeInSeconds must be a number of seconds >= 0, not 'slow'"),
    ({"schemaVersion": "1.1", "workflow": {"jobs": [{"name": "a", "parents": "b"}]}},
     "(schema 1.1): workflow.jobs[0].parents must be a list of task names"),
    ({"schemaVersion": "1.0", "workflow": {"machines": []}},
     "(schema 1.0): no tasks: expected workflow.specification.tasks (1.5+)"),
    ({"tasks": []}, "not a WfCommons workflow (no 'workflow' object)"),
])
def test_errors_name_the_schema_version_and_field(tmp_path: Path, doc: dict[str, Any], message: str) -> None:
    with pytest.raises(WorkflowError) as exc:
        read_workflow(_write(tmp_path, doc, gz=True))
    assert message in str(exc.value)


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    bad = _write(tmp_path, {"schemaVersion": "1.5", "workflow": {"specification": {"tasks": [{"name": "a"}]}}})
    for cmd in ("run", "submit"):
        r = CliRunner().invoke(app, [cmd, "--wfcommons", str(bad)], env={"COLUMNS": "300"})
        assert r.exit_code == 2 and "workflow.specification.tasks[0] has no 'id'" in r.output
        assert "Traceback" not in r.output
    (tmp_path / "junk.json").write_text("{not json")
    r = CliRunner().invoke(app, ["run", "--wfcommons", str(tmp_path / "junk.json")])
    assert r.exit_code == 2 and "not JSON" in r.output


def test_every_wfinstances_file_and_each_layout_runs_through_submit(tmp_path: Path) -> None:
    files = sorted(WFINSTANCES.glob("*.json.gz"))
    assert {f.name.split(".json")[0] for f in files} == set(INSTANCE_TASKS), "../shared/data/wfinstances changed"
    port = free_port()
    cfg = Config.from_env(log_url="embedded", data_dir=tmp_path / "data", api_port=port)
    with Stack(cfg, StackOptions(workers=2, callbacks=False)):
        for f in [*files, *sorted(DATA.glob("schema-*.json"))]:
            r = CliRunner().invoke(app, ["submit", "--wfcommons", str(f), "--wait", "--json", "--timeout", "120",
                                         "--api", f"http://127.0.0.1:{port}"])
            assert r.exit_code == 0, (f.name, r.output)
            res = json.loads(r.stdout)
            name = f.name.split(".json")[0]
            want = INSTANCE_TASKS.get(name) or len(read_workflow(f).tasks)
            assert res["job"]["state"] == "succeeded" and res["job"]["total_tasks"] == want, f.name
            assert len(res["tasks"]) == want and {t["state"] for t in res["tasks"]} == {"succeeded"}
