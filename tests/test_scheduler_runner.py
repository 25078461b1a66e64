"""The scheduler's I/O shell on the embedded log: dead letters, restart, and the crash window."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from dagfold import metrics
from dagfold.codec import default_codec
from dagfold.commands import submit_job
from dagfold.config import COMMANDS, DEADLETTER, EVENTS, Config
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.log import LogRecord, TopicPartition, partition_for
from dagfold.log.embedded import EmbeddedLog
from dagfold.services.scheduler.replay import replay
from dagfold.services.scheduler.runner import SchedulerRunner
from dagfold.state import PartitionStore, PartitionTransaction
from dagfold.state.store import applied_events_offset, state_digest
from tests.runner_support import Running, wait_for

codec = default_codec()


def read_all(log: EmbeddedLog, topic: str) -> list[LogRecord]:
    out: list[LogRecord] = []
    for p in range(log.partitions(topic)):
        out += log.read(TopicPartition(topic, p), 0, 1_000_000)
    return out


def decoded(log: EmbeddedLog, topic: str) -> list[dict[str, Any]]:
    return [codec.decode(r.value) for r in read_all(log, topic)]


@pytest.fixture
def env(tmp_path: Path) -> Any:
    cfg = Config(data_dir=tmp_path / "data", partitions=4)
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(cfg.core_topics())
    yield log, cfg
    log.close()


def send(log: EmbeddedLog, key: bytes, value: bytes, partition: int | None = None) -> None:
    p = log.producer("test")
    p.send(COMMANDS, key, value, partition=partition)
    p.flush()


def test_bad_records_are_dead_lettered_with_reasons_and_the_scheduler_goes_on(env: Any) -> None:
    log, cfg = env
    r = Running(log, cfg)
    try:
        spec = to_job_spec(load_spec_text("id: good\ntasks: [{id: a}]"))
        send(log, b"junk", b"not avro at all")
        send(log, b"wrong-key", codec.encode(submit_job(spec)))
        send(log, b"good", codec.encode(submit_job(spec)))
        wait_for(lambda: any(e["type"] == "dagfold.event.JobAccepted" for e in decoded(log, EVENTS)))
        wait_for(lambda: len(read_all(log, DEADLETTER)) == 2)
        reasons = sorted(d["reason"] for d in decoded(log, DEADLETTER))
        assert any("bad magic bytes" in x for x in reasons)
        assert any("is not the job ID 'good'" in x for x in reasons)
        dl = decoded(log, DEADLETTER)[0]
        assert dl["source_topic"] == COMMANDS and dl["value"] and dl["service"] == "scheduler"
        assert r.error is None and r.thread.is_alive()
    finally:
        r.close()


def test_a_command_on_the_wrong_partition_is_forwarded_to_its_job_and_folded_there(env: Any) -> None:
    """A producer with another partitioner (CRC-32, or its own) still gets its job run: the record
    is forwarded to the job's partition in the scheduler's transaction, never dead-lettered."""
    log, cfg = env
    forwarded = metrics.COMMANDS_FORWARDED.labels("scheduler")
    before = forwarded._value.get()
    r = Running(log, cfg)
    try:
        spec = to_job_spec(load_spec_text("id: moved\ntasks: [{id: a}]"))
        right = partition_for(b"moved", 4)
        wrong = (right + 1) % 4
        send(log, b"moved", codec.encode(submit_job(spec)), partition=wrong)
        wait_for(lambda: any(e["type"] == "dagfold.event.JobAccepted" for e in decoded(log, EVENTS)))
        accepted = [rec for rec in read_all(log, EVENTS)
                    if codec.decode(rec.value)["type"] == "dagfold.event.JobAccepted"]
        assert [a.partition for a in accepted] == [right]
        on_right = log.read(TopicPartition(COMMANDS, right), 0, 100)
        assert [(c.key, codec.decode(c.value)["spec"]["job_id"]) for c in on_right] == [(b"moved", "moved")]
        assert read_all(log, DEADLETTER) == []
        assert forwarded._value.get() == before + 1
        assert log.read(TopicPartition(COMMANDS, wrong), 0, 100)[0].key == b"moved"  # the original stays
    finally:
        r.close()


def test_crash_between_log_commit_and_state_commit_is_recovered_by_catch_up(
        env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    log, cfg = env
    spec = to_job_spec(load_spec_text("id: J\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))
    p = partition_for(b"J", 4)
    real_commit = PartitionTransaction.commit

    def crash(self: PartitionTransaction, applied_events: int | None = None) -> None:
        raise RuntimeError("power cut after the log transaction")

    monkeypatch.setattr(PartitionTransaction, "commit", crash)
    r = Running(log, cfg)
    send(log, b"J", codec.encode(submit_job(spec)))
    wait_for(lambda: r.error is not None)
    r.close()
    # the events and the consumed offset are in the log; the state store never saw them
    assert [e["type"] for e in decoded(log, EVENTS)] == ["dagfold.event.JobAccepted", "dagfold.event.TaskDispatched"]
    store = PartitionStore(cfg.data_dir / "scheduler" / f"p{p:04d}")
    assert applied_events_offset(store) == -1
    store.close()

    monkeypatch.setattr(PartitionTransaction, "commit", real_commit)
    r2 = Running(log, cfg)
    try:
        wait_for(lambda: p in r2.runner.stores)
        # nothing was processed twice: the SubmitJob is not re-folded, events are not duplicated
        time.sleep(0.3)
        assert [e["type"] for e in decoded(log, EVENTS)] == ["dagfold.event.JobAccepted",
                                                              "dagfold.event.TaskDispatched"]
        start = {"type": "dagfold.command.TaskStarted", "job_id": "J", "task_id": "a", "attempt": 1,
                 "worker_id": "w", "ts_ms": 0}
        send(log, b"J", codec.encode(start))
        wait_for(lambda: decoded(log, EVENTS)[-1]["type"] == "dagfold.event.LeaseGranted")
    finally:
        r2.close()
    # and the recovered state equals a replay of the log
    out = cfg.data_dir.parent / "replayed"
    replay(log, out, 4, with_read_model=False)
    live = PartitionStore(cfg.data_dir / "scheduler" / f"p{p:04d}")
    rep = PartitionStore(out / "scheduler" / f"p{p:04d}")
    assert state_digest(live) == state_digest(rep)
    live.close()
    rep.close()


def test_a_fenced_instance_stops(env: Any) -> None:
    log, cfg = env
    r1 = Running(log, cfg)
    wait_for(lambda: r1.runner.ready.is_set())
    log.transactional_producer("dagfold-scheduler-t")  # a newer instance takes the transactional id
    spec = to_job_spec(load_spec_text("id: F\ntasks: [{id: a}]"))
    send(log, b"F", codec.encode(submit_job(spec)))
    wait_for(lambda: r1.error is not None)
    assert type(r1.error).__name__ == "FencedError"
    assert not any(e["type"] == "dagfold.event.JobAccepted" for e in decoded(log, EVENTS))
    r1.close()


class _RecordingStore:
    """A scheduler store that remembers where each range scan started."""

    def __init__(self, store: PartitionStore) -> None:
        self.store = store
        self.starts: list[bytes] = []

    def range(self, start: bytes, end: bytes) -> Any:
        self.starts.append(start)
        return self.store.range(start, end)

    def close(self) -> None:
        self.store.close()


def test_timer_scans_start_at_a_floor_and_still_fire_every_due_timer(env: Any, tmp_path: Path) -> None:
    """The due-timer scan starts a margin below the earliest timer the last scan left, not at the
    index's start (which walks over every deleted lease timer of the job); new timers are always
    found, and a full scan each minute finds anything below the floor."""
    from dagfold.processor.timers import SCAN_MARGIN_MS as TIMER_SCAN_MARGIN_MS
    from dagfold.services.scheduler import keys

    log, cfg = env
    runner = SchedulerRunner(log, cfg, "floor")
    rec = _RecordingStore(PartitionStore(tmp_path / "p0"))
    runner.stores[0] = rec  # type: ignore[assignment]

    def put_timer(due: int, task: str, attempt: int | None = 1) -> None:
        txn = PartitionTransaction(rec.store)
        txn.put(keys.timer(due, "job-f", task, "lease"), attempt)
        txn.commit()

    def fired() -> list[tuple[str, int]]:
        return sorted((c["task_id"], c["due_ms"]) for c in decoded(log, COMMANDS)
                      if c["type"] == "dagfold.command.TimerFired")

    put_timer(1_000_000, "later")
    assert runner.fire_timers(900_000) == 0
    assert rec.starts[-1] == keys.TIMER_PREFIX  # the first scan is a full one

    put_timer(850_000, "new")  # due after the floor: a timer the fold set since
    put_timer(100_000, "below")  # due long before the floor (cannot happen live; the full scan's case)
    assert runner.fire_timers(905_000) == 1
    assert rec.starts[-1] == keys.timers_due_until(0, 900_000 - TIMER_SCAN_MARGIN_MS)[0]
    assert fired() == [("new", 850_000)]
    put_timer(850_000, "new", None)  # the fold handled it: its index entry is deleted

    assert runner.fire_timers(961_000) == 1  # a minute after the last full scan: from the start again
    assert rec.starts[-1] == keys.TIMER_PREFIX
    assert fired() == [("below", 100_000), ("new", 850_000)]
    put_timer(100_000, "below", None)

    assert runner.fire_timers(1_000_000) == 1
    assert rec.starts[-1] == keys.timers_due_until(0, 100_000 - TIMER_SCAN_MARGIN_MS)[0]  # "below" was there
    assert fired() == [("below", 100_000), ("later", 1_000_000), ("new", 850_000)]
    runner.close()
