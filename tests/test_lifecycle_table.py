"""The lifecycle table (``dagfold.lifecycle.LIFECYCLE``) against the schemas and the two folds.

Every event schema (``schemas/dagfold.event.*``) must be in the table and handled by the scheduler's
appliers and by the jobs read model's appliers, and nothing else may be: a new event type fails here until
the table has its row and each fold an applier for it, its own or the generic one the table implies (a
job-only move between open states, ``JOB_STATE_ONLY``; no state change, ``STATE_UNCHANGED``). Then a run
through the scheduler's fold, replayed one event at a time into both folds, shows that each leaves its
task and its job in the state the table names.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest

from dagfold.codec import Record, make
from dagfold.config import SchedulerOptions
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.lifecycle import (
    JOB_ENDING_EVENTS,
    JOB_STATE_ONLY,
    JOB_TERMINAL,
    LIFECYCLE,
    STATE_UNCHANGED,
    ByFlag,
    JobState,
    TaskState,
    branches,
    history_line,
    job_state_after,
    task_state_after,
    transition,
    with_lifecycle_appliers,
)
from dagfold.projections import jobs as jobs_model
from dagfold.projections.keys import job_key, task_key
from dagfold.projections.store import ReadModelStore
from dagfold.services.scheduler import appliers as scheduler_appliers
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.state import MemoryStore, PartitionTransaction

SCHEMAS = Path(__file__).resolve().parent.parent / "schemas"


def event_schemas() -> dict[str, dict[str, Any]]:
    """Every event record schema by full name (``dagfold.event.X``)."""
    out = {}
    for p in sorted(SCHEMAS.glob("dagfold.event.*.avsc")):
        schema = json.loads(p.read_text())
        out[f"{schema['namespace']}.{schema['name']}"] = schema
    return out


def test_there_are_event_schemas_to_check() -> None:
    assert len(event_schemas()) >= 27 and "dagfold.event.JobAccepted" in event_schemas()


@pytest.mark.parametrize("table", ["lifecycle", "scheduler appliers", "read model appliers"])
def test_every_event_schema_is_handled_and_nothing_else(table: str) -> None:
    handled = {"lifecycle": LIFECYCLE, "scheduler appliers": scheduler_appliers.APPLIERS,
               "read model appliers": jobs_model.APPLIERS}[table]
    schemas = set(event_schemas())
    assert sorted(schemas - set(handled)) == [], f"event schemas without a handler in the {table}"
    assert sorted(set(handled) - schemas) == [], f"handlers in the {table} for events that have no schema"


def test_an_event_the_table_does_not_describe_alone_needs_an_applier_of_its_own() -> None:
    """A fold without its own applier for an event that changes a task's state, or ends a job, has none for it
    (the test above then fails); the generic ones cover only what the table describes alone."""
    generic = with_lifecycle_appliers({}, set_job_state="set", record_only="record")
    assert {k for k, v in generic.items() if v == "set"} == JOB_STATE_ONLY == {
        "dagfold.event.JobPaused", "dagfold.event.JobResumed"}
    assert {k for k, v in generic.items() if v == "record"} == STATE_UNCHANGED
    for kind in ("dagfold.event.TaskDispatched", "dagfold.event.JobAccepted", "dagfold.event.JobRejected",
                 *JOB_ENDING_EVENTS):
        assert kind not in generic, kind
    assert "dagfold.event.TaskHeld" in STATE_UNCHANGED and "dagfold.event.TaskHeld" not in JOB_STATE_ONLY
    own = {"dagfold.event.TaskHeld": "mine"}
    assert with_lifecycle_appliers(own, set_job_state="set", record_only="record")["dagfold.event.TaskHeld"] == "mine"


def test_history_lines_from_the_table() -> None:
    paused = {"type": "dagfold.event.JobPaused", "job_id": "J", "reason": "maintenance", "requested_by": "alice"}
    assert history_line(paused) == "paused by alice: maintenance"
    assert history_line({**paused, "reason": "", "requested_by": ""}) == "paused"
    assert history_line({"type": "dagfold.event.JobResumed", "requested_by": "bob"}) == "resumed by bob"
    assert history_line({"type": "dagfold.event.TaskHeld", "reason": "job paused"}) == (
        "could run, held: job paused (runs when the job is resumed)")
    assert history_line({"type": "dagfold.event.JobRejected", "reason": "bad"}) == "None: bad"  # as Record.get
    assert history_line({"type": "dagfold.event.JobFailed", "reason": "x"}) is None  # worded by the read model
    assert history_line({"type": "dagfold.event.NoSuchEvent"}) is None


def test_the_table_names_fields_and_states_that_exist() -> None:
    schemas = event_schemas()
    for kind, step in LIFECYCLE.items():
        fields = {f["name"]: f["type"] for f in schemas[kind]["fields"]}
        if isinstance(step, ByFlag):
            assert fields.get(step.field) == "boolean", f"{kind}: {step.field} is not a boolean field"
        for t in branches(step):
            assert t.task is None or isinstance(t.task, TaskState)
            assert t.job is None or isinstance(t.job, JobState)
            assert t.from_task is None or (t.from_task and all(isinstance(s, TaskState) for s in t.from_task))
            if t.task is not None or t.from_task is not None:  # about a task: it names one or lists them
                assert {"task_id", "task_ids"} & set(fields) or kind == "dagfold.event.JobAccepted", kind
            names = {n for _, n, _, _ in string.Formatter().parse(t.says) if n} - {"by", "because"}
            assert names <= set(fields), f"{kind}: its history template names fields it lacks: {names - set(fields)}"
    assert {"dagfold.event.JobSucceeded", "dagfold.event.JobFailed",
                                 "dagfold.event.JobCancelled"} == JOB_ENDING_EVENTS


def test_states_are_their_strings() -> None:
    """Stored records, JSON answers and dictionary keys see no difference from the bare strings."""
    import msgspec

    assert TaskState.RUNNING == "running" and hash(TaskState.RUNNING) == hash("running")
    assert f"{JobState.SUCCEEDED_PARTIAL}" == "succeeded_partial" and json.dumps([JobState.FAILED]) == '["failed"]'
    assert msgspec.msgpack.encode({TaskState.PENDING: JobState.RUNNING}) == msgspec.msgpack.encode(
        {"pending": "running"})
    assert {"retrying": 1}[TaskState.RETRYING] == 1


def test_flags_choose_the_state() -> None:
    failed = {"type": "dagfold.event.TaskFailed"}
    assert task_state_after({**failed, "final": True}) == TaskState.FAILED
    assert task_state_after({**failed, "final": False}) == TaskState.RETRYING
    assert task_state_after(failed) == TaskState.FAILED  # a record without the field: final, as the read model had
    ended = {"type": "dagfold.event.JobSucceeded"}
    assert job_state_after({**ended, "partial": True}) == JobState.SUCCEEDED_PARTIAL
    assert job_state_after(ended) == JobState.SUCCEEDED
    with pytest.raises(KeyError):
        transition({"type": "dagfold.event.NoSuchEvent"})


# -- both folds follow the table ---------------------------------------------------------------------------

def _scenario() -> FoldHarness:
    """A run that emits most event types: retries, a lost worker, skips, a cancel, a redrive, an operator's
    retry and mark succeeded, a pause (a task held) and a resume."""
    h = FoldHarness(SchedulerOptions(lease_timeout_s=10))
    h.submit(to_job_spec(load_spec_text(
        "id: J\nretry: {max_attempts: 2, initial_interval_s: 1, jitter: false}\n"
        "tasks: [{id: a}, {id: b, depends_on: [a]}, {id: c, depends_on: [b]}, {id: d}]")))
    d = h.dispatched.popleft()  # a: lost worker, then fails twice (retried once), b and c skipped
    h.report("Started", d, "w1")
    h.advance(10_001)
    d = h.dispatched.popleft()
    h.report("Started", d, "w2")
    h.report("Failed", d, "w2")
    h.advance(2_000)
    d = h.dispatched.popleft()
    h.report("Started", d, "w2")
    h.report("Failed", d, "w2")
    d = h.dispatched.popleft()  # d: started, then the job is cancelled
    h.report("Started", d, "w3")
    h.process(make("dagfold.command.CancelJob", job_id="J", reason="stop", requested_at_ms=0))
    h.process(make("dagfold.command.RedriveJob", job_id="J", requested_at_ms=0))
    h.run_all("w4")  # everything succeeds now
    h.submit(to_job_spec(load_spec_text("id: K\ntasks: [{id: a}, {id: b, depends_on: [a]}]")))
    d = h.dispatched.popleft()
    h.report("Started", d, "w5")
    h.report("Failed", d, "w5", retryable=False)
    h.process(make("dagfold.command.RetryTask", job_id="K", task_id="a", requested_at_ms=0))
    d = h.dispatched.popleft()
    h.report("Started", d, "w5")
    h.report("Failed", d, "w5", retryable=False)
    h.process(make("dagfold.command.MarkTaskSucceeded", job_id="K", task_id="a", requested_at_ms=0))
    h.run_all("w6")
    h.submit(to_job_spec(load_spec_text("id: P\ntasks: [{id: a}, {id: b, depends_on: [a]}]")))  # paused, resumed
    d = h.dispatched.popleft()
    h.process(make("dagfold.command.PauseJob", job_id="P", reason="maintenance", requested_by="ops",
                   requested_at_ms=0))
    h.report("Started", d, "w7")
    h.report("Succeeded", d, "w7")  # b could run: held
    h.process(make("dagfold.command.ResumeJob", job_id="P", requested_at_ms=0))
    h.run_all("w7")
    h.submit(to_job_spec(load_spec_text("id: J\ntasks: [{id: other}]")))  # rejected: job_exists
    return h


def test_both_folds_leave_each_event_s_task_and_job_in_the_state_the_table_names(tmp_path: Path) -> None:
    h = _scenario()
    kinds = {e["type"] for e in h.events}
    assert len(kinds) >= 16 and kinds >= JOB_ENDING_EVENTS and "dagfold.event.TaskMarkedSucceeded" in kinds
    assert h.job("J")["state"] == "succeeded" and h.job("K")["state"] == "succeeded"
    assert h.job("P")["state"] == "succeeded" and kinds >= {"dagfold.event.JobPaused", "dagfold.event.JobResumed",
                                                            "dagfold.event.TaskHeld"}
    sched = MemoryStore()
    rm = ReadModelStore(tmp_path / "rm")
    checked = 0
    try:
        for offset, e in enumerate(h.events):
            txn = PartitionTransaction(sched)
            scheduler_appliers.apply_event(txn, e)
            txn.commit()
            rtxn = rm.txn()
            jobs_model.apply(rtxn, e, 0, offset)
            rm.commit(rtxn)
            step = transition(e)
            tasks = list(e["task_ids"]) if "task_ids" in e else [e["task_id"]] if "task_id" in e else []
            if step.task is not None:
                for tid in tasks:
                    assert _scheduler_task(sched, e["job_id"], tid) == step.task, (offset, e["type"], tid)
                    assert rm.get(task_key(e["job_id"], tid))["state"] == step.task, (offset, e["type"], tid)
                    checked += 1
            if step.job is not None and e["type"] != "dagfold.event.JobRejected":
                assert _scheduler_job(sched, e["job_id"]) == step.job, (offset, e["type"])
                assert rm.get(job_key(e["job_id"]))["state"] == step.job, (offset, e["type"])
                checked += 1
            if step.job in JOB_TERMINAL:
                assert rm.get(job_key(e["job_id"]))["state"] in JOB_TERMINAL
    finally:
        rm.close()
    assert checked > 30


def _scheduler_task(store: MemoryStore, job_id: str, task_id: str) -> Any:
    t: Record | None = scheduler_appliers.get_task(PartitionTransaction(store), job_id, task_id)
    return None if t is None else t["state"]


def _scheduler_job(store: MemoryStore, job_id: str) -> Any:
    j: Record | None = scheduler_appliers.get_job(PartitionTransaction(store), job_id)
    return None if j is None else j["state"]
