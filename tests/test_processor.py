"""The partition-processor runtime's failure handling, on the embedded log with a scripted commit.

Issue 13's reproduction first: a log transaction that committed, then raised (Kafka: "transaction
committed but N delivery report(s) missing", or a commit that timed out after the broker wrote
it). The old runner treated every LogError as "nothing committed": it dropped the state and
rewound to the committed offsets, already past the batch, so the job was gone for good.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dagfold.codec import default_codec
from dagfold.commands import submit_job
from dagfold.config import COMMANDS, EVENTS, Config
from dagfold.exceptions import CommitUnknownError, LogError, TransactionAbortedError
from dagfold.log import TopicPartition, partition_for
from dagfold.log.embedded import EmbeddedLog, EmbeddedTransactionalProducer
from dagfold.state import PartitionStore
from services.scheduler.replay import replay, verify
from services.scheduler.runner import SchedulerRunner
from services.scheduler.spec import load_spec_text, to_job_spec

codec = default_codec()
PARTS = 2


def events(log: EmbeddedLog) -> list[dict[str, Any]]:
    out = []
    for p in range(PARTS):
        out += [codec.decode(r.value) for r in log.read(TopicPartition(EVENTS, p), 0, 1_000_000)]
    return out


def types(log: EmbeddedLog, job: str) -> list[str]:
    return [e["type"].rsplit(".", 1)[-1] for e in events(log) if e.get("job_id") == job]


def wait_for(pred: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


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


class Scheduler:
    def __init__(self, log: EmbeddedLog, cfg: Config) -> None:
        self.runner = SchedulerRunner(log, cfg, "t")
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.runner.run(self.stop)
        except BaseException as exc:
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


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
    s = Scheduler(log, cfg)
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


def test_a_commit_that_raises_without_committing_is_redone_once(
        env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log, cfg = env
    fault = FaultyCommit(monkeypatch, "before", CommitUnknownError)
    s = Scheduler(log, cfg)
    try:
        send(log, "K", submit_job(to_job_spec(load_spec_text("id: K\ntasks: [{id: a}]"))))
        wait_for(lambda: types(log, "K") == ["JobAccepted", "TaskDispatched"])
        assert fault.left == 0 and s.runner.reconciled == 1
        run_job_to_the_end(log, "K")
    finally:
        s.close()
    assert verify(cfg.data_dir, _replayed(log, tmp_path), PARTS) == []


def test_an_aborted_commit_is_rewound_and_redone_without_reconciling(
        env: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log, cfg = env
    fault = FaultyCommit(monkeypatch, "before", TransactionAbortedError)
    s = Scheduler(log, cfg)
    try:
        send(log, "L", submit_job(to_job_spec(load_spec_text("id: L\ntasks: [{id: a}]"))))
        wait_for(lambda: types(log, "L") == ["JobAccepted", "TaskDispatched"])
        assert fault.left == 0 and s.runner.reconciled == 0
        run_job_to_the_end(log, "L")
    finally:
        s.close()
    assert verify(cfg.data_dir, _replayed(log, tmp_path), PARTS) == []


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
    s = Scheduler(log, cfg)
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
