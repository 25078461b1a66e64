"""The partition-processor runtime's failure handling, on the embedded log with a scripted commit.

Issue 13's reproduction first: a log transaction that committed, then raised (Kafka: "transaction
committed but N delivery report(s) missing", or a commit that timed out after the broker wrote
it). The old runner treated every LogError as "nothing committed": it dropped the state and
rewound to the committed offsets, already past the batch, so the job was gone for good.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dagfold.codec import default_codec
from dagfold.commands import submit_job
from dagfold.config import (
    ALLOCATOR_COMMANDS,
    ALLOCATOR_EVENTS,
    COMMANDS,
    DEADLETTER,
    EVENTS,
    SCHEDULER_INTERNAL,
    Config,
    dispatch_topic,
)
from dagfold.exceptions import CommitUnknownError, FencedError, LogError, TransactionAbortedError
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.log import TopicPartition, partition_for
from dagfold.log.embedded import EmbeddedLog, EmbeddedTransactionalProducer
from dagfold.processor import PartitionProcessor, catch_up
from dagfold.services.allocator import commands as alloc_cmds
from dagfold.services.allocator.fold import AllocatorFold
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.runner import AllocatorRunner
from dagfold.services.scheduler.replay import replay, verify
from dagfold.services.scheduler.runner import SchedulerRunner
from dagfold.state import MemoryStore, PartitionStore
from dagfold.state.store import state_digest
from tests.runner_support import Running, wait_for

codec = default_codec()
PARTS = 2


def events(log: EmbeddedLog) -> list[dict[str, Any]]:
    out = []
    for p in range(PARTS):
        out += [codec.decode(r.value) for r in log.read(TopicPartition(EVENTS, p), 0, 1_000_000)]
    return out


def types(log: EmbeddedLog, job: str) -> list[str]:
    return [e["type"].rsplit(".", 1)[-1] for e in events(log) if e.get("job_id") == job]


class FaultyCommit:
    """Replaces the embedded transactional commit: the next ``times`` commits of a batch that
    holds ``trigger`` fail as scripted ("after": commit, then raise; "before": raise only)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, when: str, exc: type[LogError], times: int = 1) -> None:
        self.when, self.exc, self.left = when, exc, times
        self.real = EmbeddedTransactionalProducer.commit
        fault = self

        def commit(producer: EmbeddedTransactionalProducer, offsets: Any, consumer: Any = None) -> Any:
            if fault.left <= 0 or not producer._buf:
                return fault.real(producer, offsets, consumer)
            fault.left -= 1
            if fault.when == "after":
                fault.real(producer, offsets, consumer)
            else:
                producer._buf = None
            raise fault.exc("scripted commit failure")

        monkeypatch.setattr(EmbeddedTransactionalProducer, "commit", commit)


@pytest.fixture
def env(tmp_path: Path) -> Any:
    cfg = Config(data_dir=tmp_path / "data", partitions=PARTS)
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(cfg.core_topics())
    yield log, cfg
    log.close()


def send(log: EmbeddedLog, job: str, cmd: dict[str, Any]) -> None:
    p = log.producer("test")
    p.send(COMMANDS, job.encode(), codec.encode(cmd))
    p.flush()


def report(kind: str, job: str, task: str, **extra: Any) -> dict[str, Any]:
    return {"type": f"dagfold.command.{kind}", "job_id": job, "task_id": task, "attempt": 1,
            "worker_id": "w", "ts_ms": 0, **extra}


def run_job_to_the_end(log: EmbeddedLog, job: str) -> None:
    send(log, job, report("TaskStarted", job, "a"))
    wait_for(lambda: "LeaseGranted" in types(log, job))
    send(log, job, report("TaskSucceeded", job, "a", output="", duration_ms=1))
    wait_for(lambda: "JobSucceeded" in types(log, job))


@pytest.mark.parametrize("exc", [LogError, CommitUnknownError])
def test_a_commit_that_raises_after_committing_keeps_the_job(
        env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: type[LogError]) -> None:
    log, cfg = env
    fault = FaultyCommit(monkeypatch, "after", exc)
    s = Running(log, cfg)
    try:
        send(log, "J", submit_job(to_job_spec(load_spec_text("id: J\ntasks: [{id: a}]"))))
        wait_for(lambda: fault.left == 0 and types(log, "J") == ["JobAccepted", "TaskDispatched"])
        run_job_to_the_end(log, "J")  # the worker's reports are accepted: the job is in the state
        assert "LeaseRejected" not in types(log, "J")
        assert types(log, "J").count("JobAccepted") == 1  # on the log once, not redone
        assert s.error is None and s.runner.reconciled == 1
    finally:
        s.close()
    diffs = verify(cfg.data_dir, _replayed(log, tmp_path), PARTS)
    assert diffs == []


@pytest.mark.parametrize(("exc", "reconciled"), [(CommitUnknownError, 1), (TransactionAbortedError, 0)])
def test_a_commit_that_failed_without_committing_is_redone_once(
        env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: type[LogError], reconciled: int) -> None:
    """Unknown: reconciled from the log (nothing there), then redone; aborted: rewound and redone."""
    log, cfg = env
    fault = FaultyCommit(monkeypatch, "before", exc)
    s = Running(log, cfg)
    try:
        send(log, "K", submit_job(to_job_spec(load_spec_text("id: K\ntasks: [{id: a}]"))))
        wait_for(lambda: types(log, "K") == ["JobAccepted", "TaskDispatched"])
        assert fault.left == 0 and s.runner.reconciled == reconciled
        run_job_to_the_end(log, "K")
    finally:
        s.close()
    assert verify(cfg.data_dir, _replayed(log, tmp_path), PARTS) == []


def dispatch_records(log: EmbeddedLog, job: str) -> list[dict[str, Any]]:
    topic = dispatch_topic("default")
    out = []
    for p in range(log.partitions(topic)):
        out += [codec.decode(r.value) for r in log.read(TopicPartition(topic, p), 0, 1_000_000)]
    return [d for d in out if d["job_id"] == job]


def test_a_dispatch_record_is_durable_before_its_transaction_commits_and_written_again_when_it_aborts(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch records carry no transaction (Kafka: no commit marker for a share group to acquire):
    written at least once, before the commit. An aborted commit redoes the batch, which dispatches
    the same attempt again; the lease decides which report counts."""
    log, cfg = env
    fault = FaultyCommit(monkeypatch, "before", TransactionAbortedError)
    seen_at_commit: list[int] = []
    faulty = EmbeddedTransactionalProducer.commit

    def commit(producer: EmbeddedTransactionalProducer, offsets: Any, consumer: Any = None) -> Any:
        if producer._buf:
            seen_at_commit.append(len(dispatch_records(log, "D")))
        return faulty(producer, offsets, consumer)

    monkeypatch.setattr(EmbeddedTransactionalProducer, "commit", commit)
    s = Running(log, cfg)
    try:
        send(log, "D", submit_job(to_job_spec(load_spec_text("id: D\ntasks: [{id: a}]"))))
        wait_for(lambda: types(log, "D") == ["JobAccepted", "TaskDispatched"])
        assert fault.left == 0
        assert seen_at_commit[:2] == [1, 2]  # durable before each of the two commits (aborted, redone)
        assert [(d["task_id"], d["attempt"]) for d in dispatch_records(log, "D")] == [("a", 1), ("a", 1)]
        run_job_to_the_end(log, "D")
        assert types(log, "D").count("LeaseGranted") == 1 and "LeaseRejected" not in types(log, "D")
    finally:
        s.close()


def _interval(cfg: Config, seconds: float) -> Config:
    return replace(cfg, scheduler=replace(cfg.scheduler, commit_interval_s=seconds))


@pytest.mark.parametrize("exc", [TransactionAbortedError, CommitUnknownError])
def test_a_dispatch_seen_before_its_open_transaction_failed_is_decided_again_as_the_same_attempt(
        env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: type[LogError]) -> None:
    """The transaction stays open across polls (commit_interval_s): a worker sees a's dispatch, runs
    it and reports, and b's dispatch follows, all before anything commits. That commit fails without
    committing (at the stop here), and the restarted scheduler folds the commands again from the
    committed offsets: it decides the same attempts (a's report still counts; b's attempt 1 is the
    one the worker already holds). A report for an attempt the state never dispatched changes nothing."""
    log, cfg = env
    fault = FaultyCommit(monkeypatch, "before", exc)
    s = SchedulerRunner(log, _interval(cfg, 60), "t")
    try:
        send(log, "C", submit_job(to_job_spec(load_spec_text("id: C\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))))
        step_until(s, lambda: len(dispatch_records(log, "C")) == 1)
        send(log, "C", report("TaskStarted", "C", "a"))
        send(log, "C", report("TaskSucceeded", "C", "a", output="", duration_ms=1))
        step_until(s, lambda: len(dispatch_records(log, "C")) == 2)
        assert fault.left == 1 and events(log) == []  # both dispatches out, nothing committed yet
    finally:
        s.close()  # its commit fails
    assert fault.left == 0 and events(log) == []
    s = SchedulerRunner(log, _interval(cfg, 0.1), "t")
    try:
        step_until(s, lambda: types(log, "C").count("TaskDispatched") == 2)
        assert types(log, "C") == ["JobAccepted", "TaskDispatched", "LeaseGranted", "TaskSucceeded",
                                   "TaskDispatched"]
        assert [(d["task_id"], d["attempt"]) for d in dispatch_records(log, "C")] == \
            [("a", 1), ("b", 1), ("a", 1), ("b", 1)]  # the same attempts, written again
        send(log, "C", report("TaskStarted", "C", "b", attempt=2))  # an attempt the state does not know
        send(log, "C", report("TaskStarted", "C", "b"))
        send(log, "C", report("TaskSucceeded", "C", "b", output="", duration_ms=1))
        step_until(s, lambda: "JobSucceeded" in types(log, "C"))
        assert types(log, "C")[5:] == ["LeaseRejected", "LeaseGranted", "TaskSucceeded", "JobSucceeded"]
    finally:
        s.close()
    assert verify(cfg.data_dir, _replayed(log, tmp_path), PARTS) == []


def test_polls_fold_into_one_open_transaction_that_a_stop_commits(env: Any) -> None:
    """Within the interval each poll's dispatch leaves at once, its events wait in the open
    transaction; a stop commits them, all in one transaction."""
    log, cfg = env
    s = SchedulerRunner(log, _interval(cfg, 60), "t")
    try:
        send(log, "I", submit_job(to_job_spec(load_spec_text("id: I\ntasks: [{id: a}]"))))
        step_until(s, lambda: len(dispatch_records(log, "I")) == 1)
        send(log, "I", report("TaskStarted", "I", "a"))
        step_until(s, lambda: s._batch is not None and s._batch.records == 2)
        assert events(log) == [] and s.folded == 0
    finally:
        s.close()
    assert types(log, "I") == ["JobAccepted", "TaskDispatched", "LeaseGranted"] and s.folded == 2


def test_an_output_another_reader_waits_for_commits_at_the_end_of_its_poll(env: Any) -> None:
    """Only events wait for the interval: a dead letter (or a forward, a control record) commits
    the open transaction at once, with what was folded before it."""
    log, cfg = env
    s = SchedulerRunner(log, _interval(cfg, 60), "t")
    try:
        send(log, "U", submit_job(to_job_spec(load_spec_text("id: U\ntasks: [{id: a}]"))))
        step_until(s, lambda: len(dispatch_records(log, "U")) == 1)
        assert events(log) == []
        p = log.producer("test")
        p.send(COMMANDS, b"not-U", codec.encode(report("TaskStarted", "U", "a")))  # keyed wrong: dead-lettered
        p.flush()
        step_until(s, lambda: s.folded == 2)
        assert types(log, "U") == ["JobAccepted", "TaskDispatched"]
        dead = [r for q in range(log.partitions(DEADLETTER)) for r in log.read(TopicPartition(DEADLETTER, q), 0, 100)]
        assert len(dead) == 1
    finally:
        s.close()


def _replayed(log: EmbeddedLog, tmp_path: Path) -> Path:
    out = tmp_path / "replayed"
    replay(log, out, PARTS, with_read_model=False)
    return out


def test_the_applied_offset_never_passes_events_the_state_lacks(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the uncertain commit the store's applied offset is the last event of the partition."""
    from dagfold.state.store import applied_events_offset

    log, cfg = env
    FaultyCommit(monkeypatch, "after", LogError)
    s = Running(log, cfg)
    try:
        send(log, "M", submit_job(to_job_spec(load_spec_text("id: M\ntasks: [{id: a}]"))))
        wait_for(lambda: s.runner.reconciled == 1)
    finally:
        s.close()
    p = partition_for(b"M", PARTS)
    store = PartitionStore(cfg.data_dir / "scheduler" / f"p{p:04d}")
    try:
        assert applied_events_offset(store) == log.end_offsets([TopicPartition(EVENTS, p)])[
            TopicPartition(EVENTS, p)] - 1
    finally:
        store.close()


# -- the allocator on the same runtime -----------------------------------------------------------------


def alloc_events(log: EmbeddedLog) -> list[dict[str, Any]]:
    return [codec.decode(r.value) for r in log.read(TopicPartition(ALLOCATOR_EVENTS, 0), 0, 1_000_000)]


def alloc_send(log: EmbeddedLog, cmd: dict[str, Any]) -> None:
    p = log.producer("test")
    p.send(ALLOCATOR_COMMANDS, cmd["pool"].encode(), codec.encode(cmd))
    p.flush()


def step_until(runner: AllocatorRunner, pred: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runner.step(0.02)
        if pred():
            return
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize("when", ["after", "before"])
def test_an_allocator_grant_whose_commit_outcome_is_unknown_is_neither_lost_nor_doubled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    cfg = Config(data_dir=tmp_path / "data", partitions=PARTS, allocator_partitions=1)
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(cfg.core_topics())
    runner = AllocatorRunner(log, AllocatorOptions(pool="p"), cfg.data_dir)
    try:
        alloc_send(log, alloc_cmds.register_node("p", "n0", "H100", 8))
        step_until(runner, lambda: any(e["type"].endswith("NodeRegistered") for e in alloc_events(log)))
        fault = FaultyCommit(monkeypatch, when, CommitUnknownError)
        alloc_send(log, alloc_cmds.request_allocation("p", "job1", gpus=2))
        step_until(runner, lambda: any(e["type"].endswith("AllocationGranted") for e in alloc_events(log)))
        runner.step(0.05)
        assert fault.left == 0 and runner.reconciled == 1
        grants = [e for e in alloc_events(log) if e["type"].endswith("AllocationGranted")]
        assert len(grants) == 1  # not doubled on the log
        told = [r for p in range(PARTS) for r in log.read(TopicPartition(SCHEDULER_INTERNAL, p), 0, 1000)]
        assert sum(codec.decode(r.value)["type"].endswith("TaskAllocation") for r in told) == 1
        state = runner.folds[0].state  # type: ignore[attr-defined]
        assert [a.req.job_id for a in state.allocs.values()] == ["job1"]  # not lost from the state
        g = grants[0]
        alloc_send(log, alloc_cmds.release_allocation("p", g["alloc_id"], g["epoch"], "n0"))
        step_until(runner, lambda: any(e["type"].endswith("AllocationReleased") for e in alloc_events(log)))
        assert not state.allocs
        live = state_digest(runner.stores[0])
    finally:
        runner.close()
    # the live state equals the state rebuilt from the pool's events
    rebuilt = MemoryStore()
    catch_up(log, rebuilt, AllocatorFold(rebuilt, AllocatorOptions(pool="p")), TopicPartition(ALLOCATOR_EVENTS, 0))
    assert state_digest(rebuilt) == live
    log.close()


# -- zombies: an instance stopped (SIGSTOP) while a newer one took over, then resumed --------------------


def test_a_resumed_zombie_allocator_is_fenced_and_its_late_writes_change_nothing(tmp_path: Path) -> None:
    cfg = Config(data_dir=tmp_path / "data", partitions=PARTS, allocator_partitions=1)
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(cfg.core_topics())
    opts = AllocatorOptions(pool="p")
    zombie = AllocatorRunner(log, opts, tmp_path / "zombie")
    alloc_send(log, alloc_cmds.register_node("p", "n0", "H100", 8))
    step_until(zombie, lambda: any(e["type"].endswith("NodeRegistered") for e in alloc_events(log)))
    # the zombie polls a request, then stops (SIGSTOP) before its transaction; a new instance takes over
    alloc_send(log, alloc_cmds.request_allocation("p", "job1", gpus=2))
    recs = zombie.consumer.poll(100, 1.0)
    assert recs
    successor = AllocatorRunner(log, opts, tmp_path / "successor")
    step_until(successor, lambda: any(e["type"].endswith("AllocationGranted") for e in alloc_events(log)))
    with pytest.raises(FencedError):  # SIGCONT: the zombie's late transaction is refused
        zombie.process_batch(recs)
    zombie.close()
    grants = [e for e in alloc_events(log) if e["type"].endswith("AllocationGranted")]
    assert len(grants) == 1
    state = successor.folds[0].state  # type: ignore[attr-defined]
    assert [a.req.job_id for a in state.allocs.values()] == ["job1"]
    successor.close()
    log.close()


def test_a_resumed_zombie_scheduler_is_fenced_and_its_late_writes_change_nothing(env: Any) -> None:
    log, cfg = env
    # one transaction per poll: the zombie's late batch commits (and is refused) within process_batch
    zombie = SchedulerRunner(log, replace(cfg, scheduler=replace(cfg.scheduler, commit_interval_s=0)), "t")
    zombie.step(0.5)
    assert zombie.stores
    send(log, "Z", submit_job(to_job_spec(load_spec_text("id: Z\ntasks: [{id: a}]"))))
    recs = zombie.consumer.poll(100, 1.0)
    assert recs
    # SIGSTOP past the session timeout: the group drops the zombie; its replacement (same instance ID,
    # started elsewhere, e.g. rescheduled by an orchestrator) takes its work
    zombie.consumer.close()
    successor = Running(log, Config(data_dir=cfg.data_dir.parent / "elsewhere", partitions=PARTS))
    try:
        wait_for(lambda: types(log, "Z") == ["JobAccepted", "TaskDispatched"])
        with pytest.raises(FencedError):  # SIGCONT: the zombie's late transaction is refused
            zombie.process_batch(recs)
        time.sleep(0.2)
        assert types(log, "Z") == ["JobAccepted", "TaskDispatched"]
        run_job_to_the_end(log, "Z")
    finally:
        successor.close()
        zombie.close()


def test_a_rewind_that_fails_after_an_abort_is_retried_before_the_next_poll(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chaos run caught it: the group coordinator moved (broker restart) while an aborted batch was
    rewound; the scheduler died on the error (had it polled on instead, the batch would be lost)."""
    from dagfold.log.embedded import EmbeddedConsumer

    log, cfg = env
    FaultyCommit(monkeypatch, "before", TransactionAbortedError)
    real_committed = EmbeddedConsumer.committed
    failures = [1]

    def committed(self: EmbeddedConsumer, tps: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise LogError("cannot read committed offsets: Broker: Not coordinator")
        return real_committed(self, tps)

    monkeypatch.setattr(EmbeddedConsumer, "committed", committed)
    s = Running(log, cfg)
    try:
        send(log, "R", submit_job(to_job_spec(load_spec_text("id: R\ntasks: [{id: a}]"))))
        wait_for(lambda: types(log, "R") == ["JobAccepted", "TaskDispatched"])
        assert failures[0] == 0 and s.error is None
        run_job_to_the_end(log, "R")
    finally:
        s.close()


# -- a partition taken over while its previous owner's transaction is pending ---------------------------


class StableOffsetFetch:
    """The new owner's consumer as librdkafka and Kafka behave: a group member's committed offsets
    are fetched when the assignment is applied, after ``on_assign`` returned; and a fetch of
    committed offsets waits while a transaction holding offsets for them is pending (read_committed,
    KIP-447), which ``pending()`` plays by letting that transaction commit first."""

    def __init__(self, inner: Any, pending: Any) -> None:
        self.inner = inner
        self.pending = pending

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def committed(self, tps: Any) -> Any:
        self.pending()
        return self.inner.committed(tps)

    def subscribe(self, topics: Any, on_assign: Any = None, on_revoke: Any = None) -> None:
        def assigned(tps: list[TopicPartition]) -> None:
            if on_assign is not None:
                on_assign(tps)
            for tp, off in self.committed(tps).items():  # librdkafka: after the callback
                self.inner.seek(tp, off)

        self.inner.subscribe(topics, on_assign=assigned, on_revoke=on_revoke)


@pytest.mark.parametrize("assignment", ["group", "manual"])
def test_a_partition_taken_over_during_its_previous_owners_commit_misses_none_of_its_events(
        env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, assignment: str) -> None:
    """Seen as s1 behind the events at a chaos run's end (28 replay differences): the old owner lost
    its partitions with its offsets sent and its events not yet on the log (stopped past its session
    timeout, then resumed), and committed after the new owner had caught its state up but before
    the new owner's (stable) offset fetch returned. The new owner read the commands from past that
    batch and never applied its events: the job was missing from its state for good."""
    import dataclasses
    import threading

    from dagfold.services.scheduler.replay import job_ids
    from dagfold.services.scheduler.runner import scheduler_spec

    log, cfg = env
    # commit_interval_s=0: the old owner's batch commits within process_batch (on a thread below)
    old_owner = PartitionProcessor(log, dataclasses.replace(scheduler_spec(cfg, "old"), partitions=list(range(PARTS)),
                                                            commit_interval_s=0), "old")
    old_owner.start()
    send(log, "T", submit_job(to_job_spec(load_spec_text("id: T\ntasks: [{id: a}]"))))
    recs = old_owner.consumer.poll(100, 1.0)
    assert recs
    released, committed = threading.Event(), threading.Event()
    real_commit = EmbeddedTransactionalProducer.commit

    def commit(producer: EmbeddedTransactionalProducer, offsets: Any, consumer: Any = None) -> Any:
        if producer is old_owner.producer:
            assert released.wait(10)  # its offsets are sent, its events not yet on the log
        return real_commit(producer, offsets, consumer)

    monkeypatch.setattr(EmbeddedTransactionalProducer, "commit", commit)

    def old_owner_commits() -> None:
        old_owner.process_batch(recs)
        committed.set()

    def pending() -> None:  # the stable fetch: the pending transaction completes first
        released.set()
        assert committed.wait(10)

    thread = threading.Thread(target=old_owner_commits, daemon=True)
    thread.start()
    new_cfg = Config(data_dir=tmp_path / "new", partitions=PARTS)
    spec = scheduler_spec(new_cfg, "new")
    new_owner = PartitionProcessor(log, spec if assignment == "group" else
                                   dataclasses.replace(spec, partitions=list(range(PARTS))), "new")
    new_owner.consumer = StableOffsetFetch(new_owner.consumer, pending)  # type: ignore[assignment]
    p = partition_for(b"T", PARTS)
    try:
        deadline = time.monotonic() + 10
        while p not in new_owner.stores and time.monotonic() < deadline:
            new_owner.step(0.05)
        thread.join(10)
        assert types(log, "T") == ["JobAccepted", "TaskDispatched"]  # the old owner's batch committed
        assert "T" in job_ids(new_owner.stores[p])  # ... and its events are in the new owner's state
        new_owner.consumer = new_owner.consumer.inner  # taken over (the embedded commit wants its own)
        send(log, "T", report("TaskStarted", "T", "a"))
        deadline = time.monotonic() + 10
        while "LeaseGranted" not in types(log, "T") and time.monotonic() < deadline:
            new_owner.step(0.05)
        assert types(log, "T") == ["JobAccepted", "TaskDispatched", "LeaseGranted"], types(log, "T")
    finally:
        new_owner.close()
        old_owner.close()
    assert verify(new_cfg.data_dir, _replayed(log, tmp_path), PARTS) == []


class _StalledReader:
    """A reader of the events topic that gets nothing while ``stalled`` is set: what a Kafka reader
    (read_committed) gets while another instance's open transaction holds the last stable offset
    back, until the coordinator aborts it."""

    def __init__(self, inner: Any, stalled: Any) -> None:
        self.inner, self.stalled = inner, stalled

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> Any:
        if self.stalled.is_set():
            time.sleep(min(timeout_s, 0.05))
            return []
        return self.inner.poll(max_records, timeout_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_catch_up_that_cannot_reach_the_end_is_retried_before_anything_is_folded(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted scheduler whose catch-up found the events partition unreadable for a while (an
    open transaction of a killed instance, a leader moving) went on from part of its events: the job
    was unknown to it, the worker's TaskStarted got LeaseRejected (unknown job or task) and a
    StopTask, the worker accepted its dispatch record, and the task was never run (the chaos run's
    g00019). Now the catch-up raises, and the partition is caught up before any command is folded."""
    import shutil
    import threading

    from dagfold.log import reader
    from dagfold.processor import catchup

    log, cfg = env
    s = Running(log, cfg)
    try:
        send(log, "J", submit_job(to_job_spec(load_spec_text("id: J\ntasks: [{id: a}]"))))
        wait_for(lambda: types(log, "J") == ["JobAccepted", "TaskDispatched"])
    finally:
        s.close()
    shutil.rmtree(cfg.data_dir / "scheduler")  # restarted on an empty state: rebuilt from the events

    stalled = threading.Event()
    stalled.set()
    real_consumer, real_read = log.consumer, reader.read_to_end

    def consumer(group_id: str | None, client_id: str = "dagfold") -> Any:
        c = real_consumer(group_id, client_id)
        return _StalledReader(c, stalled) if client_id.startswith(f"reader-{EVENTS}-") else c

    monkeypatch.setattr(log, "consumer", consumer)
    monkeypatch.setattr(catchup, "read_to_end", lambda *a, **kw: real_read(*a, **{**kw, "max_idle_s": 0.3}))
    s = Running(log, cfg)
    try:
        send(log, "J", report("TaskStarted", "J", "a"))
        time.sleep(1.5)  # catch-up gave up (at least) once meanwhile
        assert types(log, "J") == ["JobAccepted", "TaskDispatched"]  # nothing folded on a partial state
        stalled.clear()
        wait_for(lambda: "LeaseGranted" in types(log, "J"))
        assert "LeaseRejected" not in types(log, "J")
        assert s.error is None
    finally:
        s.close()
