"""The scheduler fold, driven command by command in virtual time (no log, no clock)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dagfold.codec import default_codec
from dagfold.config import Limits, SchedulerOptions
from dagfold.jobspec import load_spec_text, parse_spec, to_job_spec
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.wfcommons import workflow_spec

WF = Path(__file__).resolve().parents[2] / "shared" / "data" / "wfcommons"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def spec_of(text: str) -> dict[str, Any]:
    return to_job_spec(load_spec_text(text))


DIAMOND = """
id: J
tasks:
  - {id: a}
  - {id: b, depends_on: [a]}
  - {id: c, depends_on: [a]}
  - {id: d, depends_on: [b, c]}
"""


def test_diamond_runs_in_dependency_order_and_succeeds() -> None:
    h = FoldHarness()
    h.submit(spec_of(DIAMOND))
    assert [d["task_id"] for d in h.dispatched] == ["a"]
    order = []
    while h.dispatched:
        d = h.dispatched.popleft()
        order.append(d["task_id"])
        h.report("Started", d)
        h.report("Succeeded", d)
    assert order[0] == "a" and order[-1] == "d" and set(order) == {"a", "b", "c", "d"}
    assert h.job("J")["state"] == "succeeded"
    assert h.event_types()[-1] == "JobSucceeded"


def test_dispatch_records_are_references_not_the_graph() -> None:
    h = FoldHarness()
    h.submit(spec_of(DIAMOND))
    d = h.dispatched[0]
    assert set(d) >= {"job_id", "task_id", "attempt", "handler", "args_json", "idempotency_key"}
    assert "depends_on" not in d and "tasks" not in d
    assert d["idempotency_key"] == "J/a"


def test_every_output_is_valid_against_its_avro_schema() -> None:
    codec = default_codec()
    h = FoldHarness()
    outs = h.submit(spec_of(DIAMOND))
    while h.dispatched:
        d = h.dispatched.popleft()
        outs += h.report("Started", d) + h.report("Started", d, "w2") + h.report("Succeeded", d)
    for o in outs:
        assert codec.decode(codec.encode(o.record, validate_record=True))["type"] == o.record["type"]


@pytest.mark.parametrize(("text", "code", "fragment"), [
    ("tasks: [{id: a, depends_on: [c]}, {id: b, depends_on: [a]}, {id: c, depends_on: [b]}]",
     "cycle", "dependency cycle: b -> c -> a -> b"),
    ("tasks: [{id: a, depends_on: [zz]}]", "unknown_dependency", "unknown task 'zz'"),
    ("tasks: [{id: a}, {id: a}]", "duplicate_task", "duplicate task id 'a'"),
    ("tasks: [{id: a, depends_on: [a]}]", "cycle", "a -> a"),
    ("tasks: [{id: a, queue: 'bad queue'}]", "invalid_field", "queue"),
])
def test_invalid_jobs_are_rejected_with_a_reason(text: str, code: str, fragment: str) -> None:
    h = FoldHarness()
    if "bad queue" in text:  # the spec model refuses it too; an upstream producer writes it as is
        spec = spec_of("tasks: [{id: a}]")
        spec["tasks"][0]["queue"] = "bad queue"
    else:
        spec = spec_of(text)
    h.submit(spec)
    [ev] = h.events
    assert ev["type"] == "dagfold.event.JobRejected"
    assert ev["code"] == code and fragment in ev["reason"]
    assert h.job(spec["job_id"]) is None and not h.dispatched


def test_limits_reject_large_jobs_and_payloads() -> None:
    h = FoldHarness(SchedulerOptions(limits=Limits(max_tasks_per_job=3, max_args_bytes=20)))
    h.submit(spec_of("tasks: [{id: a}, {id: b}, {id: c}, {id: d}]"))
    h.submit(spec_of("tasks: [{id: a, args: {x: 'aaaaaaaaaaaaaaaaaaaaaaaaaaaa'}}]"))
    assert [e["code"] for e in h.events] == ["too_many_tasks", "payload_too_large"]


def test_failure_skips_downstream_and_independent_branch_finishes() -> None:
    h = FoldHarness()
    spec = to_job_spec(load_spec_text((EXAMPLES / "failing.yaml").read_text()))
    job = spec["job_id"]
    h.submit(spec)
    while h.dispatched:
        d = h.dispatched.popleft()
        h.report("Started", d)
        if d["task_id"] == "bad":
            h.report("Failed", d, reason="exit code 3", exit_code=3)
        else:
            h.report("Succeeded", d)
    states = {t: h.task(job, t)["state"] for t in ("start", "good", "bad", "after_bad", "report", "after_good")}
    assert states == {"start": "succeeded", "good": "succeeded", "bad": "failed", "after_bad": "skipped",
                      "report": "skipped", "after_good": "succeeded"}
    j = h.job(job)
    assert j["state"] == "failed" and "bad: exit code 3" in j["first_failure"]
    skipped = [e for e in h.events if e["type"].endswith("TaskSkipped")]
    assert {e["task_id"]: e["reason"] for e in skipped}["after_bad"] == "trigger rule all_success: upstream bad failed"


def test_first_start_wins_the_lease_and_later_starts_are_rejected() -> None:
    h = FoldHarness()
    h.submit(spec_of("id: J\ntasks: [{id: a}]"))
    d = h.dispatched.popleft()
    h.report("Started", d, "w1")
    h.report("Started", d, "w2")
    h.report("Started", d, "w1")
    assert h.event_types()[-3:] == ["LeaseGranted", "LeaseRejected", "ReportIgnored"]
    assert h.controls[-1]["worker_id"] == "w2" and "already leased to w1" in h.controls[-1]["reason"]
    # a report from the loser changes nothing
    h.report("Succeeded", d, "w2")
    assert h.task("J", "a")["state"] == "running"
    h.report("Succeeded", d, "w1")
    assert h.job("J")["state"] == "succeeded"


def test_an_outcome_without_a_start_report_starts_and_ends_the_attempt() -> None:
    """A worker that finishes a task before its start report went out (noop) reports once: the events
    are those of a start and an outcome, so the two ways of reporting cannot be told apart after it."""
    two, one = FoldHarness(), FoldHarness()
    for h in (two, one):
        h.submit(spec_of(DIAMOND))
    while two.dispatched:
        d = two.dispatched.popleft()
        two.report("Started", d)
        two.report("Succeeded", d)
    while one.dispatched:
        one.report("Succeeded", one.dispatched.popleft())
    assert one.job("J")["state"] == "succeeded"
    assert one.event_types() == two.event_types()
    assert one.event_types().count("LeaseGranted") == 4 and "ReportIgnored" not in one.event_types()
    assert one.replayed_digest() == one.digest()
    # a failure report alone too; a stale or repeated one changes nothing
    h = FoldHarness()
    h.submit(spec_of("id: J\ntasks: [{id: a, retry: {max_attempts: 2, initial_interval_s: 1, jitter: false}}]"))
    d1 = h.dispatched.popleft()
    h.report("Failed", d1, reason="boom")
    assert h.event_types()[-3:] == ["LeaseGranted", "TaskFailed", "TaskRetryScheduled"]
    h.advance(1000)
    before = h.digest()
    h.report("Succeeded", d1)
    assert h.digest() == before and h.event_types()[-1] == "ReportIgnored"


def test_reports_for_stale_attempts_and_duplicates_change_nothing() -> None:
    h = FoldHarness()
    h.submit(spec_of("id: J\ntasks: [{id: a, retry: {max_attempts: 2, initial_interval_s: 1, jitter: false}}]"))
    d1 = h.dispatched.popleft()
    h.report("Started", d1)
    h.report("Failed", d1, reason="boom")
    assert h.task("J", "a")["state"] == "retrying"
    assert h.advance(999) == 0
    assert h.advance(1) == 1  # the backoff timer fires through the fold
    d2 = h.dispatched.popleft()
    assert d2["attempt"] == 2
    before = h.digest()
    h.report("Succeeded", d1)  # stale attempt 1
    h.report("Heartbeat", d1)
    assert h.digest() == before
    assert h.event_types()[-2:] == ["ReportIgnored", "ReportIgnored"]
    h.report("Started", d2)
    h.report("Succeeded", d2)
    h.report("Succeeded", d2)  # duplicate delivery
    assert h.job("J")["state"] == "succeeded"
    assert h.event_types().count("TaskSucceeded") == 1


def test_lease_expires_without_heartbeats_and_heartbeats_keep_it() -> None:
    h = FoldHarness(SchedulerOptions(lease_timeout_s=10))
    h.submit(spec_of("id: J\ntasks: [{id: a, retry: {max_attempts: 2, initial_interval_s: 1, jitter: false}},"
                     " {id: b}]"))
    da, db = h.dispatched.popleft(), h.dispatched.popleft()
    h.report("Started", da)
    h.report("Started", db, "w2")
    for _ in range(3):
        h.advance(8000)
        h.report("Heartbeat", da)
    assert h.task("J", "a")["state"] == "running"
    h.advance(2001)  # b never heartbeated: 24 s > 10 s; a heartbeated 2 s ago
    # b's worker is lost, which is not b's failure: attempt 2 is dispatched at once
    assert h.task("J", "b")["state"] == "runnable" and h.task("J", "b")["attempt"] == 2
    lost = [e for e in h.events if e["type"].endswith("LeaseReclaimed")]
    assert len(lost) == 1 and lost[0]["reason"].startswith("lease_expired") and lost[0]["worker_id"] == "w2"
    assert (lost[0]["losses"], lost[0]["final"]) == (1, False)
    assert "TaskFailed" not in h.event_types()
    assert any(c["worker_id"] == "w2" and c["reason"] == "lease_expired" for c in h.controls)
    assert h.task("J", "a")["state"] == "running"
    assert h.replayed_digest() == h.digest()


def test_a_lost_worker_spends_no_retry_budget() -> None:
    """Default policy (max_attempts 1): a task whose workers die twice still runs and succeeds; before
    worker losses were told apart from failures, the first lease expiry failed the task and its job."""
    h = FoldHarness(SchedulerOptions(lease_timeout_s=10))
    h.submit(spec_of("id: J\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))
    for worker in ("w1", "w2"):
        d = h.dispatched.popleft()
        h.report("Started", d, worker)
        h.advance(10_001)  # the worker died: no heartbeat
    d = h.dispatched.popleft()
    assert d["attempt"] == 3
    h.report("Started", d, "w3")
    h.report("Failed", d, "w3")  # the task's own failure: the retry policy (1 attempt) decides
    assert h.task("J", "a")["state"] == "failed"
    assert h.event_types().count("LeaseReclaimed") == 2
    h.process({"type": "dagfold.command.RedriveJob", "job_id": "J", "reason": "again", "requested_at_ms": 0})
    h.run_all("w4")
    assert h.job("J")["state"] == "succeeded"
    assert h.replayed_digest() == h.digest()


def test_a_task_that_loses_every_worker_fails_with_worker_lost_after_the_limit() -> None:
    h = FoldHarness(SchedulerOptions(lease_timeout_s=10, max_worker_losses=3))
    h.submit(spec_of("id: J\ntasks: [{id: poison, retry: {max_attempts: 5, initial_interval_s: 1}}, {id: ok}]"))
    ok = [d for d in h.dispatched if d["task_id"] == "ok"][0]
    h.dispatched.remove(ok)
    h.report("Started", ok, "w0")
    h.report("Succeeded", ok, "w0")
    for i in range(3):
        d = h.dispatched.popleft()
        assert d["task_id"] == "poison" and d["attempt"] == i + 1
        h.report("Started", d, f"w{i + 1}")
        h.advance(10_001)
    assert not h.dispatched
    t = h.task("J", "poison")
    assert t["state"] == "failed"
    failed = [e for e in h.events if e["type"].endswith("TaskFailed")]
    assert len(failed) == 1 and failed[0]["final"] and failed[0]["error_type"] == "worker_lost"
    assert failed[0]["reason"].startswith("worker_lost x 3: lease_expired")
    assert [e["final"] for e in h.events if e["type"].endswith("LeaseReclaimed")] == [False, False, True]
    assert h.job("J")["state"] == "failed"
    assert h.replayed_digest() == h.digest()


def test_a_released_attempt_runs_again_and_stale_reports_stay_fenced() -> None:
    h = FoldHarness()
    h.submit(spec_of("id: J\ntasks: [{id: a}]"))
    d = h.dispatched.popleft()
    h.report("Started", d, "w1")
    h.report("Released", d, "w2", reason="worker_shutdown")  # not the holder: ignored
    assert h.event_types()[-1] == "ReportIgnored"
    h.report("Released", d, "w1", reason="worker_shutdown")
    assert h.event_types()[-2:] == ["LeaseReclaimed", "TaskDispatched"]
    assert h.events[-2]["reason"] == "released: worker_shutdown"
    h.report("Succeeded", d, "w1")  # the given-back attempt's late outcome does not count
    assert h.event_types()[-1] == "ReportIgnored"
    h.run_all("w3")
    assert h.job("J")["state"] == "succeeded"
    assert h.replayed_digest() == h.digest()


def test_dispatch_records_are_keyed_by_tenant() -> None:
    h = FoldHarness()
    spec = spec_of("id: J\ntenant: acme\ntasks: [{id: a}, {id: b}]")
    outs = h.submit(spec)
    keys = {o.key for o in outs if o.record["type"] == "dagfold.dispatch.TaskDispatch"}
    assert keys == {"acme"}


def test_cancel_cancels_open_tasks_stops_running_ones_and_ignores_late_reports() -> None:
    h = FoldHarness()
    h.submit(spec_of(DIAMOND))
    d = h.dispatched.popleft()
    h.report("Started", d)
    h.process({"type": "dagfold.command.CancelJob", "job_id": "J", "reason": "user", "requested_at_ms": 0})
    assert h.job("J")["state"] == "cancelled"
    assert {h.task("J", t)["state"] for t in "abcd"} == {"cancelled"}
    assert h.controls[-1]["worker_id"] == "w1"
    n = len(h.events)
    h.report("Succeeded", d)
    h.process({"type": "dagfold.command.CancelJob", "job_id": "J", "reason": "again", "requested_at_ms": 0})
    assert h.event_types()[n:] == ["ReportIgnored"]  # the second cancel is a no-op


def test_duplicate_submission_is_deduplicated_and_conflicting_key_rejected() -> None:
    h = FoldHarness()
    spec = spec_of("idempotency_key: k1\ntasks: [{id: a}]")
    h.submit(spec)
    h.submit(spec)
    other = spec_of("idempotency_key: k1\ntasks: [{id: a}, {id: b}]")
    assert other["job_id"] == spec["job_id"]  # the key derives the job ID
    h.submit(other)
    assert h.event_types() == ["JobAccepted", "TaskDispatched", "SubmissionDeduplicated", "JobRejected"]
    assert h.events[-1]["code"] == "idempotency_conflict"
    assert h.job(spec["job_id"])["n"] == 1


@pytest.mark.parametrize(("rule", "upstream", "expected"), [
    ("all_success", "fail", "skipped"),
    ("all_done", "fail", "succeeded"),
    ("one_success", "mixed", "succeeded"),
    ("one_failed", "mixed", "succeeded"),
    ("one_failed", "ok", "skipped"),
    ("none_failed", "fail", "skipped"),
    ("none_failed", "ok", "succeeded"),
])
def test_trigger_rules(rule: str, upstream: str, expected: str) -> None:
    h = FoldHarness()
    h.submit(spec_of(f"id: J\ntasks: [{{id: u1}}, {{id: u2}}, {{id: x, depends_on: [u1, u2], trigger_rule: {rule}}}]"))
    outcome = {"fail": ("Failed", "Failed"), "ok": ("Succeeded", "Succeeded"), "mixed": ("Succeeded", "Failed")}
    for d, kind in zip(list(h.dispatched), outcome[upstream], strict=True):
        h.dispatched.popleft()
        h.report("Started", d)
        h.report(kind, d)
    h.run_all()
    assert h.task("J", "x")["state"] == expected


def test_fail_fast_cancels_the_rest() -> None:
    h = FoldHarness()
    h.submit(spec_of("id: J\nfailure_policy: fail_fast\ntasks: [{id: a}, {id: b}, {id: c, depends_on: [b]}]"))
    da, db = h.dispatched.popleft(), h.dispatched.popleft()
    h.report("Started", da)
    h.report("Started", db, "w2")
    h.report("Failed", da, reason="boom")
    assert h.job("J")["state"] == "failed"
    assert h.task("J", "b")["state"] == "cancelled" and h.task("J", "c")["state"] == "cancelled"
    assert h.controls[-1]["worker_id"] == "w2"


def test_allow_partial_succeeds_partially_when_a_leaf_succeeded() -> None:
    h = FoldHarness()
    h.submit(spec_of("id: J\nfailure_policy: allow_partial\ntasks: [{id: a}, {id: b}]"))
    da, db = h.dispatched.popleft(), h.dispatched.popleft()
    h.report("Started", da)
    h.report("Failed", da)
    h.report("Started", db)
    h.report("Succeeded", db)
    assert h.job("J")["state"] == "succeeded_partial"


def test_replaying_events_rebuilds_identical_state() -> None:
    h = FoldHarness()
    h.submit(spec_of(DIAMOND))
    h.submit(spec_of("id: K\ntasks: [{id: a, retry: {max_attempts: 3}}, {id: b, depends_on: [a]}]"))
    d = [x for x in h.dispatched if x["job_id"] == "K"][0]
    h.dispatched.remove(d)
    h.report("Started", d)
    h.report("Failed", d)
    h.advance(5000)
    h.run_all()
    assert h.job("J")["state"] == "succeeded" and h.job("K")["state"] == "succeeded"
    assert h.replayed_digest() == h.digest()


@pytest.mark.parametrize("name", ["montage-chameleon-2mass-05d-001", "epigenomics-chameleon-ilmn-6seq-50k-001",
                                  "1000genome-chameleon-22ch-250k-001"])
def test_real_workflows_run_to_completion_respecting_every_edge(name: str) -> None:
    path = WF / f"{name}.json.gz"
    doc = workflow_spec(path, job_id=name)
    spec = to_job_spec(parse_spec(doc))
    parents = {t["id"]: set(t["depends_on"]) for t in doc["tasks"]}
    h = FoldHarness()
    h.submit(spec)
    done: set[str] = set()
    while h.dispatched:
        d = h.dispatched.popleft()
        assert parents[d["task_id"]] <= done, f"{d['task_id']} dispatched before its parents"
        h.report("Started", d)
        h.report("Succeeded", d)
        done.add(d["task_id"])
    assert done == set(parents)
    assert h.job(name)["state"] == "succeeded"
    assert h.replayed_digest() == h.digest()


def test_redrive_reruns_failed_and_skipped_tasks_keeping_history() -> None:
    h = FoldHarness()
    spec = to_job_spec(load_spec_text((EXAMPLES / "failing.yaml").read_text()))
    job = spec["job_id"]
    h.submit(spec)
    while h.dispatched:
        d = h.dispatched.popleft()
        h.report("Started", d)
        h.report("Failed", d, reason="exit code 3", exit_code=3) if d["task_id"] == "bad" else h.report("Succeeded", d)
    assert h.job(job)["state"] == "failed"
    h.process({"type": "dagfold.command.RedriveJob", "job_id": job, "requested_at_ms": 0})
    assert h.events[-2]["type"] == "dagfold.event.JobRedriven"
    assert sorted(h.events[-2]["task_ids"]) == ["after_bad", "bad", "report"]
    [d] = list(h.dispatched)
    assert (d["task_id"], d["attempt"]) == ("bad", 2)  # attempts keep counting
    assert h.job(job)["state"] == "running"
    h.run_all()
    assert h.job(job)["state"] == "succeeded"
    assert {h.task(job, t)["state"] for t in ("bad", "after_bad", "report")} == {"succeeded"}
    assert h.replayed_digest() == h.digest()
    n = len(h.events)
    h.process({"type": "dagfold.command.RedriveJob", "job_id": job, "requested_at_ms": 0})
    assert len(h.events) == n  # a succeeded job has nothing to redrive
