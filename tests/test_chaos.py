"""Chaos: dagfold on a 3-broker Kafka cluster while schedulers, workers and brokers are kill -9'd.

``test_short_chaos_run`` is the short run of ``make test`` (the long one is ``make
chaos``): its own 3-broker cluster (each broker on a host of its own, a network
namespace, as is the GPU host: the partition faults cut the host off, cut it
from the brokers, and isolate one broker from the other two), GPU jobs, three
scheduler instances, worker processes with a side-effecting handler, a report
duplicator, at least 50 injected faults including scheduler and broker kills and
both partition kinds, then every check of
``chaos.checks`` and ``dagfold replay --verify``; zero violations.

The tests before it are fast: the checker itself (it must see what it is meant
to see), the workload's expectations against the real fold, and regression tests
for the bugs the chaos runs found.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from chaos import checks
from chaos.faults import ALLOCATOR_SIGSTOP, BROKER_RESTART_IN_COMMIT, COMMIT_KINDS, PARTITION_KINDS, SCHEDULER_SIGSTOP
from chaos.harness import PROFILES, ChaosRun
from chaos.report import format_report
from chaos.workload import JobPlan, generated_job, plan_workload, with_expectation
from dagfold.exceptions import LogError
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.log import TopicPartition, open_log
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.services.worker.sideeffects import SideEffectLedger

SEED = int(os.environ.get("DAGFOLD_CHAOS_SEED", "20251130"))


# -- the workload's expectations, against the real fold ------------------------------------------


def run_in_fold(plan: JobPlan) -> FoldHarness:
    """Run a plan's job through the fold as chaos.handlers would: fail, flaky, or succeed."""
    h = FoldHarness()
    h.submit(to_job_spec(parse_spec(plan.doc)))
    for _ in range(10_000):
        if not h.dispatched:
            if h.advance(5_000) == 0 and not h.dispatched:
                break
            continue
        d = h.dispatched.popleft()
        args = json.loads(d["args_json"])
        h.report("Started", d)
        if args.get("fail") == "always":
            h.report("Failed", d, reason="on purpose", retryable=False)
        elif args.get("flaky") and d["attempt"] == 1:
            h.report("Failed", d, reason="transient")
        else:
            h.report("Succeeded", d)
    return h


def model_of(events: list[dict[str, Any]]) -> tuple[checks.Findings, checks.EventModel]:
    f = checks.Findings()
    m = checks.EventModel(f)
    for i, e in enumerate(events):
        m.apply({**e, "_p": 0, "_o": i})
    return f, m


@pytest.mark.parametrize("seed", range(40))
def test_generated_jobs_end_as_their_specs_say_and_pass_the_event_checks(seed: int) -> None:
    plan = generated_job(f"J{seed}", random.Random(seed))
    h = run_in_fold(plan)
    job = h.job(plan.job_id)
    assert job is not None and job["state"] == plan.expected_job
    if plan.expected_tasks is not None:
        assert {t: (h.task(plan.job_id, t) or {}).get("state") for t in plan.expected_tasks} == plan.expected_tasks
    findings, model = model_of(h.events)
    assert findings.violations == []
    assert model.jobs[plan.job_id].final == plan.expected_job


def test_workload_mixes_generated_and_wfcommons_jobs() -> None:
    plans = plan_workload(1, 20, ["montage-chameleon-2mass-01d-001.json.gz"])
    kinds = {p.kind for p in plans}
    assert "generated" in kinds and "wfcommons:montage-chameleon-2mass-01d-001" in kinds
    montage = next(p for p in plans if p.kind.startswith("wfcommons"))
    assert montage.tasks == 103 and montage.expected_job == "succeeded"


# -- the checker sees what it must see ----------------------------------------------------------------


DIAMOND = {"id": "D", "tasks": [{"id": "a", "handler": "chaos_effect"},
                                {"id": "b", "handler": "chaos_effect", "depends_on": ["a"]},
                                {"id": "c", "handler": "chaos_effect", "depends_on": ["a"]},
                                {"id": "d", "handler": "chaos_effect", "depends_on": ["b", "c"]}]}


def diamond_events() -> list[dict[str, Any]]:
    return run_in_fold(with_expectation(JobPlan("D", "generated", DIAMOND))).events


def test_event_model_flags_a_dispatch_before_its_dependencies() -> None:
    events = diamond_events()
    names = [(e["type"].rsplit(".", 1)[-1], e.get("task_id")) for e in events]
    # move d's dispatch before c's success
    i_d = names.index(("TaskDispatched", "d"))
    i_c = names.index(("TaskSucceeded", "c"))
    assert i_c < i_d
    tampered = events[:i_c] + [events[i_d]] + events[i_c:i_d] + events[i_d + 1:]
    findings, _ = model_of(tampered)
    assert [v.kind for v in findings.violations][:1] == [checks.DISPATCH_BEFORE_DEPS]


def test_event_model_flags_a_second_success_and_a_lease_on_a_finished_task() -> None:
    events = diamond_events()
    succ = next(e for e in events if e["type"].endswith("TaskSucceeded"))
    lease = next(e for e in events if e["type"].endswith("LeaseGranted"))
    findings, _ = model_of([*events, succ, lease])
    kinds = [v.kind for v in findings.violations]
    assert kinds.count(checks.ILLEGAL_TRANSITION) >= 2


def test_event_model_flags_a_redispatch_of_a_leased_attempt_and_a_report_refused_as_unknown() -> None:
    h = run_in_fold(with_expectation(JobPlan("R", "generated", {"id": "R", "tasks": [
        {"id": "a", "handler": "chaos_effect"}]})))
    events = h.events
    lease = next(i for i, e in enumerate(events) if e["type"].endswith("LeaseGranted"))
    redispatch = {**events[lease], "type": "dagfold.event.TaskRedispatched", "queue": "default",
                  "redispatches": 1, "next_redispatch_at_ms": None}
    findings, _ = model_of([*events[:lease], redispatch, *events[lease:]])
    assert findings.violations == []  # runnable and unleased: legal
    findings, _ = model_of([*events[:lease + 1], redispatch, *events[lease + 1:]])
    assert [v.kind for v in findings.violations] == [checks.ILLEGAL_TRANSITION]
    refused = {**events[lease], "type": "dagfold.event.LeaseRejected", "reason": checks.UNKNOWN_JOB}
    findings, _ = model_of([*events[:lease], refused, *events[lease:]])
    assert [v.kind for v in findings.violations] == [checks.ILLEGAL_TRANSITION]
    assert "behind its log" in findings.violations[0].detail


def test_a_success_of_an_attempt_whose_dispatch_is_not_in_the_committed_log_is_flagged() -> None:
    """A worker may run an attempt seen before its transaction committed; if that transaction aborted
    and the re-fold decided another attempt, a success of the first would be one no committed event
    dispatched (issue 27). Here: a's TaskDispatched dropped from the log, as an aborted one would be."""
    events = diamond_events()
    findings, model = model_of(events)
    assert checks.check_successes_dispatched(model, findings) == 4 and findings.violations == []
    first = next(i for i, e in enumerate(events) if e["type"].endswith("TaskDispatched"))
    dropped = [{**e, "attempt": 2} if e.get("task_id") == "a" else e for e in events[first + 1:]]
    findings, model = model_of([*events[:first], *dropped])
    checks.check_successes_dispatched(model, findings)
    assert checks.UNDISPATCHED_SUCCESS in [v.kind for v in findings.violations]


def test_side_effect_check_flags_duplicates_and_missing_effects(tmp_path: Path) -> None:
    from chaos.handlers import ExternalSystem
    from dagfold.services.worker import TaskContext

    ext = ExternalSystem(tmp_path / "effects.sqlite")
    ledger = SideEffectLedger(tmp_path / "ledger.sqlite")
    ctx = TaskContext(job_id="D", task_id="a", attempt=1, idempotency_key="D/a")
    ledger.once("D/a", lambda: ext.apply("D/a", ctx))
    ledger.once("D/a", lambda: ext.apply("D/a", ctx))  # a second attempt: nothing more applied
    with sqlite3.connect(tmp_path / "effects.sqlite") as db:  # an effect applied behind the ledger's back
        db.execute("INSERT INTO effects (key, job_id, task_id, attempt, worker_id, pid, ts) "
                   "VALUES ('D/b', 'D', 'b', 1, 'w', 1, 0), ('D/b', 'D', 'b', 2, 'w', 1, 0)")
    ext.close()
    ledger.close()
    plan = with_expectation(JobPlan("D", "generated", DIAMOND))
    findings, model = model_of(diamond_events())
    stats = checks.check_side_effects(tmp_path / "effects.sqlite", tmp_path / "ledger.sqlite", model, [plan],
                                      findings)
    details = [v.detail for v in findings.violations if v.kind == checks.DUPLICATE_EFFECT]
    assert any("D/b applied 2 times" in d for d in details)
    assert sum("never applied" in d for d in details) == 2  # c and d
    assert stats["distinct keys"] == 2


# -- regression tests for what the chaos runs found ---------------------------------------------------


def _ledger_race(path: str, out: str, i: int) -> None:
    ledger = SideEffectLedger(path)

    def effect() -> int:
        with sqlite3.connect(out, timeout=30) as db:
            db.execute("INSERT INTO calls VALUES (?)", (i,))
        time.sleep(0.3)
        return i

    ledger.once("same-key", effect)
    ledger.close()


def test_ledger_runs_a_key_once_across_processes(tmp_path: Path) -> None:
    """SideEffectLedger.once serialised a key across threads only: two processes both ran it."""
    out = tmp_path / "calls.sqlite"
    with sqlite3.connect(out) as db:
        db.execute("CREATE TABLE calls (i INTEGER)")
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_ledger_race, args=(str(tmp_path / "l.sqlite"), str(out), i)) for i in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    with sqlite3.connect(out) as db:
        assert db.execute("SELECT COUNT(*) FROM calls").fetchone() == (1,)


def test_ledger_keys_in_one_process_still_run_in_parallel(tmp_path: Path) -> None:
    ledger = SideEffectLedger(tmp_path / "l.sqlite")
    started = threading.Barrier(2, timeout=5)
    threads = [threading.Thread(target=ledger.once, args=(f"k{i}", lambda: started.wait())) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert ledger.get("k0")[0] and ledger.get("k1")[0]
    ledger.close()


def test_kafka_url_carries_client_settings(tmp_path: Path) -> None:
    log = open_log("kafka://127.0.0.1:1,127.0.0.1:2?consumer.session.timeout.ms=6000"
                   "&producer.transaction.timeout.ms=10000", tmp_path)
    assert log.bootstrap == "127.0.0.1:1,127.0.0.1:2"  # type: ignore[attr-defined]
    assert log._consumer_config == {"session.timeout.ms": "6000"}  # type: ignore[attr-defined]
    assert log._producer_config == {"transaction.timeout.ms": "10000"}  # type: ignore[attr-defined]
    with pytest.raises(LogError, match="unknown Kafka URL setting 'session.timeout.ms'"):
        open_log("kafka://127.0.0.1:1?session.timeout.ms=6000", tmp_path)


class _Offsets:
    def __init__(self, offset: int) -> None:
        self.offset = offset


class _FakeAdmin:
    """list_offsets answers from a script of rounds; list_topics counts metadata refreshes."""

    def __init__(self, rounds: list[Callable[[], Any]]) -> None:
        self.rounds = rounds
        self.refreshes = 0
        self.timeouts: list[float] = []

    def list_offsets(self, req: dict[Any, Any], request_timeout: float) -> dict[Any, Future[Any]]:
        self.timeouts.append(request_timeout)
        answer = self.rounds.pop(0) if len(self.rounds) > 1 else self.rounds[0]
        out = {}
        for tp in req:
            f: Future[Any] = Future()
            try:
                f.set_result(_Offsets(answer()))
            except KafkaException as exc:
                f.set_exception(exc)
            out[tp] = f
        return out

    def list_topics(self, topic: str | None = None, timeout: float = 0) -> None:
        self.refreshes += 1


def _kafka_log_with(admin: _FakeAdmin) -> Any:
    from dagfold.log.kafka import KafkaLog

    log = KafkaLog("127.0.0.1:1")
    log._admin = admin  # type: ignore[assignment]
    return log


def test_end_offsets_never_returns_an_invalid_offset() -> None:
    """A ListOffsets request stuck on a dead leader came back as offset -1001 with no error, and
    end_offsets returned it: a scheduler taking a partition over then skipped its catch-up."""
    admin = _FakeAdmin([lambda: -1001, lambda: -1001, lambda: 42])
    ends = _kafka_log_with(admin).end_offsets([TopicPartition("events", 0)])
    assert ends == {TopicPartition("events", 0): 42}
    assert admin.refreshes >= 2  # the metadata (leaders, epochs) is refreshed before each retry
    assert max(admin.timeouts) <= 5.0  # short rounds: a dead leader does not eat the whole deadline


@pytest.mark.parametrize("code", [KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.FENCED_LEADER_EPOCH,
                                  KafkaError._NOENT])
def test_end_offsets_retries_errors_of_a_leader_change_or_a_new_topic(code: int) -> None:
    def err() -> int:
        raise KafkaException(KafkaError(code))

    admin = _FakeAdmin([err, err, lambda: 7])
    assert _kafka_log_with(admin).end_offsets([TopicPartition("t", 0)]) == {TopicPartition("t", 0): 7}


def test_worker_waits_for_the_control_offsets_instead_of_dying(tmp_path: Path) -> None:
    """A worker starting during a broker outage died (and `dagfold worker` exited 0)."""
    from dagfold.config import Config
    from dagfold.log.embedded import EmbeddedLog
    from dagfold.services.worker.worker import Worker

    log = EmbeddedLog(tmp_path / "log")
    cfg = Config(data_dir=tmp_path)
    log.create_topics(cfg.core_topics())
    real = log.end_offsets
    failures = [LogError("leader not available"), LogError("leader not available")]

    def flaky(tps: Any) -> Any:
        if failures:
            raise failures.pop()
        return real(tps)

    log.end_offsets = flaky  # type: ignore[method-assign]
    w = Worker(log, "default", "w-1", config=cfg)
    stop = threading.Event()
    try:
        assert w._prepare(stop) is True
        assert not failures
    finally:
        stop.set()
        w.close()
        log.close()


# -- the short chaos run (make test) -----------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.timeout(600)
def test_short_chaos_run(tmp_path: Path) -> None:
    report = ChaosRun(PROFILES["short"], SEED, tmp_path / "run").run()
    text = format_report(report)
    print(text)
    faults = report["faults"]
    assert report["faults total"] >= 50, text
    assert faults["scheduler kill -9"] + faults["scheduler kill -9, empty state"] >= 5, text
    # a broker killed at a random time, or inside a commit (the first broker fault when commit faults run)
    assert faults["broker kill -9"] + faults[BROKER_RESTART_IN_COMMIT] >= 1 and faults["worker kill -9"] >= 5, text
    # issue 13: each commit-fault kind and each zombie kind at least once (each armed until a commit takes it,
    # the next as soon as one is taken; broker kills wait for the one inside a commit; the run
    # injects past 90 s, up to 150 s, until each kind happened: the partitions take the GPU host for 8-25 s)
    assert all(faults[kind] >= 1 for kind in (*COMMIT_KINDS.values(), SCHEDULER_SIGSTOP, ALLOCATOR_SIGSTOP)), text
    # issue 25: the GPU host (a network namespace of its own) cut off, and cut from the brokers only, each once
    # at least, each healed after 8-25 s; its agent rides them out (an exit would be an unexpected exit); one
    # broker isolated from the other two (each broker on a host of its own) for 8-15 s
    assert all(faults[kind] >= 1 for kind in PARTITION_KINDS), text
    assert report["allocator"]["stores compared"] >= 1, text
    # GPU jobs ran on the pool, and the checks of the pool held: no GPU granted to two live allocations, no
    # allocation left once every job ended, every GPU job succeeded (violations otherwise)
    assert report["allocator"]["GPU jobs"] >= 1 and report["allocator"]["grants"] >= 1, text
    assert report["violations total"] == 0, text
    assert report["replay"]["exit code"] == 0 and report["replay"]["differences"] == 0, text
    assert report["consolidation"]["s1 caught up"], text
    assert report["jobs"]["submitted"] == PROFILES["short"].generated_jobs + 1, text
    # A writer fenced by a newer instance of itself exits 75 by design (the harness restarts it, or keeps
    # an allocator as the standby); nothing may exit otherwise.
    assert not report["unexpected exits"], text


@pytest.mark.kafka
@pytest.mark.timeout(900)
def test_three_schedulers_survive_losing_one_instance_and_one_broker(tmp_path: Path) -> None:
    report = ChaosRun(PROFILES["failover"], SEED, tmp_path / "run").run()
    text = format_report(report)
    print(text)
    assert report["faults"]["scheduler kill -9"] == 1 and report["faults"]["broker kill -9"] == 1, text
    assert report["violations total"] == 0, text
    assert report["jobs"]["submitted"] == PROFILES["failover"].generated_jobs + 1, text
