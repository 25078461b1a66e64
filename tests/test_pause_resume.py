"""Pause and resume a job (PauseJob, ResumeJob) in the scheduler fold, virtual time, no log, no clock.

A paused job dispatches nothing new: a task that could run (its trigger rule met, its backoff over, its
worker lost, its runnable attempt due for a re-dispatch) is held (TaskHeld, its state unchanged) and no
record reaches a queue or a GPU pool; running tasks finish. Resume dispatches what was held. Every
decision goes through ``runnable.make_runnable``; the rules (what may be paused or resumed) are the
lifecycle's, which the API answers with before it sends the command. Replay equals live throughout.
The same through REST and the CLI on an embedded stack: tests/test_pause_resume_api.py.
"""

from __future__ import annotations

from typing import Any

from dagfold.codec import Record, default_codec
from dagfold.config import ALLOCATOR_COMMANDS
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.lifecycle import JobState, job_control_refusal
from dagfold.services.scheduler.harness import FoldHarness
from tests.gpu_support import POOL


def spec(doc: dict[str, Any]) -> Record:
    return to_job_spec(parse_spec(doc))


def control(h: FoldHarness, kind: str, job: str = "J", **fields: Any) -> list[Record]:
    n = len(h.events)
    h.process({"type": f"dagfold.command.{kind}Job", "job_id": job, "reason": "maintenance",
               "requested_by": "alice", "requested_at_ms": 0, **fields})
    return h.events[n:]


def kinds(events: list[Record]) -> list[str]:
    return [e["type"].rsplit(".", 1)[-1] for e in events]


def start(h: FoldHarness) -> list[Record]:
    """Start every dispatched attempt (leases granted); returns their dispatch records."""
    ds = list(h.dispatched)
    h.dispatched.clear()
    for d in ds:
        h.report("Started", d)
    return ds


def job_state(h: FoldHarness, job: str = "J") -> str:
    return h.job(job)["state"]  # type: ignore[index]


def task_state(h: FoldHarness, task: str, job: str = "J") -> str:
    return h.task(job, task)["state"]  # type: ignore[index]


def check(h: FoldHarness) -> None:
    assert h.replayed_digest() == h.digest()
    codec = default_codec()
    for rec in h.events + list(h.dispatched) + h.controls:
        codec.encode(rec, validate_record=True)


CHAIN = {"id": "J", "tasks": [{"id": "a"}, {"id": "b", "depends_on": ["a"]}, {"id": "c", "depends_on": ["b"]}]}


def test_a_paused_job_dispatches_nothing_new_and_resume_dispatches_what_became_runnable() -> None:
    h = FoldHarness()
    h.submit(spec(CHAIN))
    [a] = start(h)
    assert kinds(control(h, "Pause")) == ["JobPaused"] and job_state(h) == JobState.PAUSED
    h.report("Succeeded", a)  # the running task finishes
    assert task_state(h, "a") == "succeeded" and task_state(h, "b") == "pending"
    assert kinds(h.events[-2:]) == ["TaskSucceeded", "TaskHeld"] and not h.dispatched
    out = control(h, "Resume")
    assert kinds(out) == ["JobResumed", "TaskDispatched"] and out[1]["task_id"] == "b" and out[1]["attempt"] == 1
    assert [d["task_id"] for d in h.dispatched] == ["b"] and job_state(h) == JobState.RUNNING
    h.run_all()
    assert job_state(h) == JobState.SUCCEEDED
    check(h)


def test_running_tasks_finish_while_paused_and_the_job_ends_when_nothing_is_left() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "J", "tasks": [{"id": "x"}, {"id": "y"}]}))
    x, y = start(h)
    control(h, "Pause")
    h.report("Heartbeat", x)
    h.report("Succeeded", x)
    h.report("Succeeded", y)
    assert "ReportIgnored" not in kinds(h.events)
    assert kinds(h.events)[-1] == "JobSucceeded" and job_state(h) == JobState.SUCCEEDED
    check(h)


def test_a_retry_whose_backoff_ends_while_paused_is_held_and_runs_on_resume() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "J", "tasks": [{"id": "a", "retry": {"max_attempts": 3, "initial_interval_s": 1,
                                                                "jitter": False}}]}))
    [a] = start(h)
    h.report("Failed", a)
    control(h, "Pause")
    h.advance(1_000)  # the backoff is over: held, its timer gone
    assert kinds(h.events)[-1] == "TaskHeld" and task_state(h, "a") == "retrying" and not h.dispatched
    assert h.task("J", "a")["timers"] == {}  # type: ignore[index]
    h.advance(60_000)
    assert kinds(h.events)[-1] == "TaskHeld"  # nothing fires again
    out = control(h, "Resume")
    assert kinds(out) == ["JobResumed", "TaskDispatched"] and out[1]["attempt"] == 2
    h.run_all()
    assert job_state(h) == JobState.SUCCEEDED
    check(h)


def test_a_lost_workers_attempt_is_held_while_paused() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "J", "tasks": [{"id": "a", "timeouts": {"heartbeat_s": 5}}]}))
    start(h)
    control(h, "Pause")
    h.advance(5_000)
    assert kinds(h.events)[-2:] == ["LeaseReclaimed", "TaskHeld"] and not h.dispatched
    out = control(h, "Resume")
    assert kinds(out) == ["JobResumed", "TaskDispatched"] and out[1]["attempt"] == 2
    check(h)


def test_a_re_dispatch_due_while_paused_is_held_and_the_same_attempt_is_sent_again_on_resume() -> None:
    h = FoldHarness()
    h.submit(spec(CHAIN))
    h.dispatched.clear()  # the record is lost
    control(h, "Pause")
    h.advance(h.opts.redispatch_after_ms("default"))
    assert kinds(h.events)[-1] == "TaskHeld" and task_state(h, "a") == "runnable" and not h.dispatched
    out = control(h, "Resume")
    assert kinds(out) == ["JobResumed", "TaskRedispatched"] and out[1]["attempt"] == 1
    assert [d["attempt"] for d in h.dispatched] == [1]
    h.run_all()
    assert job_state(h) == JobState.SUCCEEDED
    check(h)


def test_gpu_requests_are_held_while_paused_and_sent_on_resume() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "J", "tasks": [
        {"id": "prep"},
        {"id": "train", "handler": "gpu", "queue": POOL, "depends_on": ["prep"],
         "resources": {"gpus": 2, "hosts": 1, "gpu_type": "H100"}}]}))
    [prep] = start(h)
    control(h, "Pause")
    out = h.report("Succeeded", prep)
    assert not [o for o in out if o.topic == ALLOCATOR_COMMANDS]
    assert kinds(h.events)[-1] == "TaskHeld" and task_state(h, "train") == "pending"
    n = len(h.events)
    h.process({"type": "dagfold.command.ResumeJob", "job_id": "J", "reason": "", "requested_by": "",
               "requested_at_ms": 0})
    assert kinds(h.events[n:]) == ["JobResumed", "TaskDispatched"] and task_state(h, "train") == "runnable"
    requests = [c for c in h.controls if c["job_id"] == "J" and c.get("pool") == POOL]
    assert len(requests) == 1 and requests[0]["attempt"] == 1
    check(h)


def test_pause_and_resume_out_of_turn_change_nothing() -> None:
    h = FoldHarness()
    h.submit(spec(CHAIN))
    before = h.digest()
    assert control(h, "Resume") == [] and h.digest() == before  # running: nothing to resume
    assert control(h, "Pause", job="nope") == []
    control(h, "Pause")
    before = h.digest()
    assert control(h, "Pause") == [] and h.digest() == before  # paused already
    control(h, "Cancel")
    assert job_state(h) == JobState.CANCELLED
    before = h.digest()
    assert control(h, "Pause") == [] and control(h, "Resume") == [] and h.digest() == before
    check(h)


def test_cancelling_a_paused_job_cancels_its_held_tasks() -> None:
    h = FoldHarness()
    h.submit(spec(CHAIN))
    [a] = start(h)
    control(h, "Pause")
    h.report("Succeeded", a)
    out = control(h, "Cancel")
    assert kinds(out) == ["TaskCancelled", "TaskCancelled", "JobCancelled"]
    assert task_state(h, "b") == "cancelled" and not h.dispatched
    check(h)


def test_an_operator_retry_in_a_paused_job_is_refused_until_resume() -> None:
    h = FoldHarness()
    h.submit(spec({"id": "J", "failure_policy": "allow_partial", "tasks": [{"id": "bad"}, {"id": "slow"}]}))
    bad, slow = start(h)
    h.report("Failed", bad, retryable=False)
    control(h, "Pause")
    retry = {"type": "dagfold.command.RetryTask", "job_id": "J", "task_id": "bad", "requested_by": "op",
             "reason": "", "requested_at_ms": 0}
    h.process(retry)
    assert kinds(h.events)[-1] == "TaskActionRejected" and h.events[-1]["code"] == "job_paused"
    control(h, "Resume")
    h.process(retry)
    assert kinds(h.events)[-2:] == ["TaskReopened", "TaskDispatched"]
    h.run_all()
    h.report("Succeeded", slow)
    assert job_state(h) == JobState.SUCCEEDED
    check(h)


def test_the_api_and_the_fold_share_one_rule_for_what_may_be_paused_or_resumed() -> None:
    assert job_control_refusal("pause", "J", JobState.RUNNING) is None
    assert job_control_refusal("resume", "J", JobState.PAUSED) is None
    assert job_control_refusal("pause", "J", JobState.PAUSED)[0] == "job_paused"  # type: ignore[index]
    assert job_control_refusal("resume", "J", JobState.RUNNING)[0] == "job_not_paused"  # type: ignore[index]
    assert job_control_refusal("pause", "J", JobState.FAILED)[0] == "job_finished"  # type: ignore[index]
    assert job_control_refusal("resume", "J", None)[0] == "unknown_job"  # type: ignore[index]
