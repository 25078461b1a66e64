"""Per-task retry and "mark succeeded" in the scheduler fold (virtual time, no log, no clock).

RetryTask and MarkTaskSucceeded are operator decisions folded like every other command: the
events they cause (TaskReopened, TaskMarkedSucceeded, or TaskActionRejected) rebuild the same
state on replay, and each costs the acted-on task plus the downstream tasks it re-opens.
"""

from __future__ import annotations

from typing import Any

from dagfold.codec import Record, default_codec
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.state import PartitionTransaction


def spec(doc: dict[str, Any]) -> Record:
    return to_job_spec(parse_spec(doc))


def retry(h: FoldHarness, job: str, task: str, by: str = "alice") -> list[Record]:
    n = len(h.events)
    h.process({"type": "dagfold.command.RetryTask", "job_id": job, "task_id": task, "requested_by": by,
               "reason": "fixed the input", "requested_at_ms": 0})
    return h.events[n:]


def mark(h: FoldHarness, job: str, task: str, by: str = "alice") -> list[Record]:
    n = len(h.events)
    h.process({"type": "dagfold.command.MarkTaskSucceeded", "job_id": job, "task_id": task, "requested_by": by,
               "reason": "done by hand", "requested_at_ms": 0})
    return h.events[n:]


def run(h: FoldHarness, fail: set[str] | None = None) -> None:
    """Start every dispatched attempt; those of tasks in ``fail`` fail (exit 3), the others succeed."""
    while h.dispatched:
        d = h.dispatched.popleft()
        h.report("Started", d)
        if d["task_id"] in (fail or set()):
            h.report("Failed", d, reason="exit code 3", exit_code=3)
        else:
            h.report("Succeeded", d)


def kinds(events: list[Record]) -> list[str]:
    return [e["type"].rsplit(".", 1)[-1] for e in events]


def states(h: FoldHarness, job: str, *tasks: str) -> dict[str, str]:
    return {t: h.task(job, t)["state"] for t in tasks}  # type: ignore[index]


# a -> bad -> after -> report, a -> good; default policy skip_downstream
CHAIN = {"id": "J", "tasks": [
    {"id": "a"}, {"id": "bad", "depends_on": ["a"], "retry": {"max_attempts": 2, "initial_interval_s": 1,
                                                             "jitter": False}},
    {"id": "after", "depends_on": ["bad"]}, {"id": "report", "depends_on": ["after"]},
    {"id": "good", "depends_on": ["a"]}]}


def failed_chain() -> FoldHarness:
    h = FoldHarness()
    h.submit(spec(CHAIN))
    run(h, {"bad"})
    h.advance(1000)  # bad's retry
    run(h, {"bad"})
    assert h.job("J")["state"] == "failed"  # type: ignore[index]
    assert states(h, "J", "bad", "after", "report") == {"bad": "failed", "after": "skipped", "report": "skipped"}
    return h


def test_retry_reopens_the_task_and_what_it_skipped_and_the_job_runs_to_success() -> None:
    h = failed_chain()
    out = retry(h, "J", "bad")
    assert kinds(out) == ["TaskReopened", "TaskDispatched"]
    assert out[0]["task_ids"] == ["bad", "after", "report"] and out[0]["requested_by"] == "alice"
    assert out[0]["action"] == "retry" and out[0]["reason"] == "fixed the input"
    [d] = list(h.dispatched)
    assert (d["task_id"], d["attempt"]) == ("bad", 3)  # attempt numbers go on: earlier reports stay fenced
    assert h.job("J")["state"] == "running"  # type: ignore[index]
    assert states(h, "J", "after", "report") == {"after": "pending", "report": "pending"}
    run(h)
    assert h.job("J")["state"] == "succeeded"  # type: ignore[index]
    assert kinds(h.events)[-1] == "JobSucceeded"
    assert h.replayed_digest() == h.digest()


def test_retry_gives_a_fresh_retry_budget() -> None:
    h = failed_chain()
    retry(h, "J", "bad")
    run(h, {"bad"})  # attempt 3, the first of the new run: retried per the policy
    assert h.task("J", "bad")["state"] == "retrying"  # type: ignore[index]
    h.advance(1000)
    run(h, {"bad"})  # attempt 4: the budget of 2 is spent again
    assert h.task("J", "bad")["state"] == "failed" and h.job("J")["state"] == "failed"  # type: ignore[index]
    assert h.job("J")["failed"] == 1 and h.job("J")["skipped"] == 2  # type: ignore[index]
    assert h.replayed_digest() == h.digest()


def test_mark_succeeded_records_who_and_runs_the_downstream() -> None:
    h = failed_chain()
    out = mark(h, "J", "bad", by="bob")
    assert kinds(out)[:3] == ["TaskReopened", "TaskMarkedSucceeded", "TaskDispatched"]
    marked = out[1]
    assert (marked["task_id"], marked["attempt"], marked["requested_by"]) == ("bad", 2, "bob")
    assert out[2]["task_id"] == "after" and not [d for d in h.dispatched if d["task_id"] == "bad"]
    assert h.task("J", "bad")["state"] == "succeeded"  # type: ignore[index]
    run(h)
    assert states(h, "J", "after", "report") == {"after": "succeeded", "report": "succeeded"}
    assert h.job("J")["state"] == "succeeded"  # type: ignore[index]
    assert h.replayed_digest() == h.digest()


def test_mark_succeeded_of_a_leaf_ends_the_job_at_once() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "L", "tasks": [{"id": "a"}, {"id": "leaf", "depends_on": ["a"]}]}))
    run(h, {"leaf"})
    assert h.job("L")["state"] == "failed"  # type: ignore[index]
    assert kinds(mark(h, "L", "leaf")) == ["TaskReopened", "TaskMarkedSucceeded", "JobSucceeded"]
    assert h.replayed_digest() == h.digest()


def test_refusals_are_rejection_events_that_change_nothing() -> None:
    h = failed_chain()
    digest = h.digest()
    cases = [("good", "task_succeeded"), ("nope", "unknown_task")]
    for task, code in cases:
        [e] = retry(h, "J", task)
        assert (kinds([e]), e["code"], e["action"]) == (["TaskActionRejected"], code, "retry")
    [e] = retry(h, "J", "after")  # skipped because bad failed: retrying it alone would skip it again
    assert e["code"] == "still_skipped" and "retry the failed upstream" in e["reason"]
    [e] = mark(h, "NOJOB", "x")
    assert e["code"] == "unknown_job"
    assert h.digest() == digest
    retry(h, "J", "bad")
    [e] = retry(h, "J", "bad")  # now runnable
    assert e["code"] == "task_not_finished" and "queued" in e["reason"]
    run(h)
    [e] = mark(h, "J", "bad")
    assert e["code"] == "job_succeeded"
    codec = default_codec()
    for ev in h.events:
        codec.encode(ev, validate_record=True)


def test_an_oversized_reason_from_the_log_is_refused_and_changes_nothing() -> None:
    """A producer on ``commands`` is not bound by the API's 2,000-character limit: the fold applies it."""
    h = failed_chain()
    digest = h.digest()
    for field in ("reason", "requested_by"):
        cmd = {"type": "dagfold.command.RetryTask", "job_id": "J", "task_id": "bad", "requested_by": "alice",
               "reason": "fixed", "requested_at_ms": 0, field: "x" * 100_000}
        n = len(h.events)
        h.process(cmd)
        [e] = h.events[n:]
        assert (kinds([e]), e["code"]) == (["TaskActionRejected"], "invalid_command")
        assert len(e["requested_by"]) <= 2000 and len(e["reason"]) < 200
    assert h.digest() == digest


def test_cancelled_job_is_refused_with_a_pointer_to_redrive() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "C", "tasks": [{"id": "a"}]}))
    h.process({"type": "dagfold.command.CancelJob", "job_id": "C", "reason": "stop", "requested_at_ms": 0})
    [e] = retry(h, "C", "a")
    assert e["code"] == "job_cancelled" and "dagfold redrive C" in e["reason"]


def test_retry_in_a_running_job_keeps_other_branches_going() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "R", "tasks": [{"id": "x"}, {"id": "y"}, {"id": "z", "depends_on": ["x"]}]}))
    dx, dy = h.dispatched.popleft(), h.dispatched.popleft()
    h.report("Started", dx)
    h.report("Failed", dx, reason="boom")
    assert h.job("R")["state"] == "running" and states(h, "R", "z") == {"z": "skipped"}  # type: ignore[index]
    assert kinds(retry(h, "R", "x")) == ["TaskReopened", "TaskDispatched"]
    h.report("Started", dy)
    h.report("Succeeded", dy)
    run(h)
    assert h.job("R")["state"] == "succeeded"  # type: ignore[index]
    assert h.replayed_digest() == h.digest()


def test_fail_fast_retry_runs_what_fail_fast_cancelled() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "F", "failure_policy": "fail_fast", "tasks": [
        {"id": "x"}, {"id": "y"}, {"id": "z", "depends_on": ["x"]}, {"id": "w", "depends_on": ["y"]}]}))
    dx = h.dispatched.popleft()
    h.report("Started", dx)
    h.report("Failed", dx, reason="boom")
    assert h.job("F")["state"] == "failed"  # type: ignore[index]
    assert states(h, "F", "y", "z", "w") == {"y": "cancelled", "z": "cancelled", "w": "cancelled"}
    out = retry(h, "F", "x")
    assert sorted(out[0]["task_ids"]) == ["w", "x", "y", "z"] and out[0]["task_ids"][0] == "x"
    h.dispatched.popleft()  # y's first attempt, stopped by fail_fast: its report is stale now
    run(h)
    assert h.job("F")["state"] == "succeeded"  # type: ignore[index]
    assert h.replayed_digest() == h.digest()


def test_other_failures_stay_and_the_job_fails_again_naming_them() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "T", "tasks": [{"id": "p"}, {"id": "q"}]}))
    run(h, {"p", "q"})
    assert h.job("T")["state"] == "failed"  # type: ignore[index]
    retry(h, "T", "p")
    run(h)
    assert h.job("T")["state"] == "failed"  # type: ignore[index]
    assert h.events[-1]["reason"].startswith("1 task(s) failed")
    assert h.replayed_digest() == h.digest()


def test_cost_is_the_reopened_tasks_not_the_graph() -> None:
    """A retry reads and writes the task, its re-opened downstream and their dependents' records only."""
    def touched(width: int) -> int:
        h = FoldHarness()
        h.submit(spec({"id": "W", "tasks": [{"id": "bad"}, {"id": "after", "depends_on": ["bad"]}]
                       + [{"id": f"t{i}"} for i in range(width)]}))
        run(h, {"bad"})
        txn = PartitionTransaction(h.store)
        h.fold.process(txn, {"type": "dagfold.command.RetryTask", "job_id": "W", "task_id": "bad",
                             "requested_by": "", "reason": "", "requested_at_ms": 0}, h.now_ms, h.offset)
        return len(txn.written_keys())
    assert touched(10) == touched(1000)


def test_the_chaos_event_model_accepts_reopened_and_marked_tasks() -> None:
    """chaos.checks.EventModel, written apart from the appliers, finds no illegal transition in a retry, a
    fail_fast retry and a mark; and flags a mark that no TaskReopened preceded."""
    from chaos import checks

    h = failed_chain()
    retry(h, "J", "bad")
    run(h)
    h.submit(spec({"id": "F", "failure_policy": "fail_fast", "tasks": [{"id": "x"}, {"id": "y"}]}))
    dx = next(d for d in h.dispatched if d["task_id"] == "x")
    h.report("Started", dx)
    h.report("Failed", dx, reason="boom")
    h.dispatched.clear()
    mark(h, "F", "x")
    run(h)
    assert h.job("J")["state"] == h.job("F")["state"] == "succeeded"  # type: ignore[index]

    def violations(events: list[Record]) -> list[str]:
        f = checks.Findings()
        m = checks.EventModel(f)
        for i, e in enumerate(events):
            m.apply({**e, "_p": 0, "_o": i})
        return [v.kind for v in f.violations]

    assert violations(h.events) == []
    bogus = [e for e in h.events if not e["type"].endswith("TaskReopened")]
    assert checks.ILLEGAL_TRANSITION in violations(bogus)
