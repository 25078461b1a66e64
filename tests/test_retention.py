"""Retention of finished jobs (issue 25): ``finished_job_retention_ms`` drops a finished job's records from the
scheduler's state and the read models that long after its end, through the log (a retention timer, then a
``JobExpired`` event), so a replay of the events drops it alike; the embedded log drops records older than their
topic's retention.
"""

from __future__ import annotations

import io
from pathlib import Path

import fastavro
import pytest

from dagfold.codec import default_codec, make, schema_fingerprint
from dagfold.config import Config, SchedulerOptions
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.log import TopicPartition, embedded
from dagfold.log.base import TopicSpec
from dagfold.log.embedded import EmbeddedLog
from dagfold.projections import jobs as jobs_model
from dagfold.projections.keys import job_key
from dagfold.projections.store import ReadModelStore
from dagfold.services.scheduler.fold import SchedulerFold
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.services.scheduler.replay import job_digest, job_ids
from dagfold.state import MemoryStore, PartitionTransaction
from dagfold.state.store import state_digest

HOUR = 3_600_000


def _spec(text: str) -> dict[str, object]:
    return to_job_spec(load_spec_text(text))


def _keys_of(h: FoldHarness, job_id: str) -> list[bytes]:
    """Every scheduler state key that names the job."""
    return sorted(k for k in h.store.data if f"\x1f{job_id}".encode() in k)


def _replayed(events: list[dict[str, object]]) -> MemoryStore:
    store = MemoryStore()
    for e in events:
        txn = PartitionTransaction(store)
        SchedulerFold.apply(txn, e)
        txn.commit()
    return store


def test_a_finished_job_leaves_the_state_its_retention_after_its_end_and_the_replay_drops_it_alike() -> None:
    h = FoldHarness(SchedulerOptions(finished_job_retention_ms=HOUR))
    h.submit(_spec("id: J\nidempotency_key: k1\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))
    h.run_all()
    ended = h.job("J")
    assert ended is not None and ended["state"] == "succeeded"
    end = next(e for e in h.events if e["type"] == "dagfold.event.JobSucceeded")
    assert end["expires_ms"] == end["ts_ms"] + HOUR  # decided by the fold, carried by the event
    h.advance(HOUR - 1)
    assert h.job("J") is not None and "JobExpired" not in h.event_types("J")
    replay_before = state_digest(_replayed(h.events))
    assert replay_before == h.digest()
    h.advance(1)
    assert h.event_types("J")[-1] == "JobExpired"
    assert h.job("J") is None and h.task("J", "a") is None
    assert _keys_of(h, "J") == []  # job, task list, tasks, dependents, its timer, its idempotency key
    assert h.digest() == h.replayed_digest()  # replay equals live: the expiry is an event
    # the ID and the key are free again: a new submission is a new job (not a duplicate of a forgotten one)
    h.submit(_spec("id: J\nidempotency_key: k1\ntasks: [{id: other}]"))
    types = h.event_types("J")
    assert types[types.index("JobExpired") + 1] == "JobAccepted" and h.task("J", "other") is not None


def test_a_replay_of_a_log_whose_oldest_events_are_gone_holds_every_job_the_live_state_holds_alike() -> None:
    """The audit trade-off (docs/operations.md, Retention): with the events kept longer than the finished-job
    retention plus a job's run time, the events a retention drops belong to jobs that expired; a replay from
    the first kept event then holds the same jobs as the live state, each equal, job by job."""
    h = FoldHarness(SchedulerOptions(finished_job_retention_ms=HOUR))
    h.submit(_spec("id: OLD\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))
    h.run_all()
    h.advance(HOUR // 2)
    h.submit(_spec("id: NEW\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))
    h.run_all()
    h.submit(_spec("id: RUNNING\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))
    h.advance(HOUR // 2)  # OLD expires; NEW finished within its retention; RUNNING runs
    assert h.job("OLD") is None and h.job("NEW") is not None and h.job("RUNNING") is not None
    # the log's retention dropped OLD's first events (its JobAccepted among them), not NEW's
    first_kept = next(i for i, e in enumerate(h.events) if e["type"] == "dagfold.event.JobSucceeded")
    replayed = _replayed(h.events[first_kept:])
    assert job_ids(replayed) == job_ids(h.store) == {"NEW", "RUNNING"}
    assert all(job_digest(replayed, j) == job_digest(h.store, j) for j in ("NEW", "RUNNING"))


def test_a_redriven_job_is_kept_until_its_next_end() -> None:
    h = FoldHarness(SchedulerOptions(finished_job_retention_ms=HOUR))
    h.submit(_spec("id: J\ntasks: [{id: a}]"))
    d = h.dispatched.popleft()
    h.report("Started", d)
    h.report("Failed", d, retryable=False)
    assert h.job("J")["state"] == "failed"  # type: ignore[index]
    h.advance(HOUR // 2)
    h.process(make("dagfold.command.RedriveJob", job_id="J", requested_at_ms=h.now_ms))
    assert h.job("J")["state"] == "running" and "expires_ms" not in h.job("J")  # type: ignore[index,operator]
    h.advance(HOUR)  # past the first end's expiry: nothing happens to a running job
    assert h.job("J") is not None and "JobExpired" not in h.event_types("J")
    h.run_all()
    assert h.job("J")["state"] == "succeeded"  # type: ignore[index]
    h.advance(HOUR - 1)
    assert h.job("J") is not None
    h.advance(1)
    assert h.job("J") is None and h.event_types("J").count("JobExpired") == 1
    assert h.digest() == h.replayed_digest()


def test_a_cancelled_job_expires_and_without_the_setting_nothing_does() -> None:
    h = FoldHarness(SchedulerOptions(finished_job_retention_ms=0))
    h.submit(_spec("id: C\ntasks: [{id: a}]"))
    h.process(make("dagfold.command.CancelJob", job_id="C", reason="stop", requested_at_ms=h.now_ms))
    assert h.job("C")["state"] == "cancelled"  # type: ignore[index]
    h.advance(0)
    assert h.job("C") is None and h.event_types("C")[-1] == "JobExpired"
    keep = FoldHarness()  # the default: -1, kept forever
    keep.submit(_spec("id: K\ntasks: [{id: a}]"))
    keep.run_all()
    assert next(e for e in keep.events if e["type"] == "dagfold.event.JobSucceeded")["expires_ms"] is None
    keep.advance(100 * 24 * HOUR)
    assert keep.job("K") is not None and "JobExpired" not in keep.event_types()


def test_the_setting_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DAGFOLD_FINISHED_JOB_RETENTION_MS", "86400000")
    assert Config.from_env().scheduler.finished_job_retention_ms == 86_400_000
    monkeypatch.setenv("DAGFOLD_FINISHED_JOB_RETENTION_MS", "-2")
    with pytest.raises(Exception, match="DAGFOLD_FINISHED_JOB_RETENTION_MS"):
        Config.from_env()


def test_an_end_event_written_before_the_field_existed_still_decodes() -> None:
    """The job-end events gained ``expires_ms``; their earlier schemas (schemas/history/v1-no-expiry) decode
    with it null: a log written before keeps its jobs."""


    codec = default_codec()
    old = fastavro.schema.load_schema(
        str(Path(__file__).resolve().parent.parent / "schemas" / "history" / "v1-no-expiry"
            / "dagfold.event.JobSucceeded.avsc"))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, old, {"job_id": "J", "ts_ms": 5, "cause_offset": 1, "partial": False})
    raw = b"\xc3\x01" + schema_fingerprint(old) + buf.getvalue()
    rec = codec.decode(raw)
    assert rec["type"] == "dagfold.event.JobSucceeded" and rec.get("expires_ms") is None


def test_the_read_model_drops_an_expired_job_whether_its_events_come_one_by_one_or_in_one_batch(
        tmp_path: Path) -> None:
    h = FoldHarness(SchedulerOptions(finished_job_retention_ms=HOUR))
    h.submit(_spec("id: J\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))
    h.submit(_spec("id: L\ntasks: [{id: a}]"))
    h.run_all()
    h.advance(HOUR)
    assert "JobExpired" in h.event_types("J") and "JobExpired" in h.event_types("L")
    h.submit(_spec("id: M\ntasks: [{id: a}]"))  # a job still held
    one_by_one = ReadModelStore(tmp_path / "a")
    batched = ReadModelStore(tmp_path / "b")
    try:
        for offset, e in enumerate(h.events):
            txn = one_by_one.txn()
            jobs_model.apply(txn, e, 0, offset)
            one_by_one.commit(txn)
        txn = batched.txn()  # a replay: the job's records are written and dropped in one transaction
        for offset, e in enumerate(h.events):
            jobs_model.apply(txn, e, 0, offset)
        batched.commit(txn)
        for store in (one_by_one, batched):
            assert store.get(job_key("J")) is None and store.get(job_key("L")) is None
            assert store.get(job_key("M")) is not None
            rm = jobs_model.ReadModel(store)
            assert [j["job_id"] for j in rm.list_jobs().items] == ["M"]
            assert rm.get_history("J").items == [] and rm.get_tasks("J").items == []
        assert list(one_by_one.scan(b"")) == list(batched.scan(b""))
    finally:
        one_by_one.close()
        batched.close()


# -- the embedded log's retention ----------------------------------------------------------------------------


def _append_at(log: EmbeddedLog, monkeypatch: pytest.MonkeyPatch, topic: str, times_ms: list[int]) -> None:
    p = log.producer("t")
    for i, t in enumerate(times_ms):
        monkeypatch.setattr(embedded, "now_ms", lambda t=t: t)
        p.send(topic, b"k", f"v{i}".encode(), partition=0)
        p.flush()  # one batch each: its records take the batch's time


def test_the_embedded_log_drops_records_older_than_their_topic_s_retention_and_never_reuses_an_offset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = EmbeddedLog(tmp_path / "log", retention_check_s=0)
    try:
        log.create_topics([TopicSpec("cmds", 1, 1000), TopicSpec("events", 1, -1)])
        _append_at(log, monkeypatch, "cmds", [1000 * i for i in range(10)])
        _append_at(log, monkeypatch, "events", [1000 * i for i in range(10)])
        tp = TopicPartition("cmds", 0)
        assert log.enforce_retention(now=9_500) == {tp: 9}  # older than 8,500 ms: offsets 0-8
        assert log.start_offset(tp) == 9 and log.end_offsets([tp]) == {tp: 10}
        assert [r.offset for r in log.read(tp, 0, 100)] == [9]  # a reader behind the start reads on from it
        assert len(log.read(TopicPartition("events", 0), 0, 100)) == 10  # -1: kept
        c = log.consumer(None)
        c.assign({tp: 3})
        assert [r.offset for r in c.poll(100, 0.1)] == [9]
        c.close()
        assert log.enforce_retention(now=9_500) == {}  # nothing more to drop
        assert log.enforce_retention(now=100_000) == {tp: 10}  # everything
    finally:
        log.close()
    log = EmbeddedLog(tmp_path / "log", retention_check_s=0)  # reopened: the high watermark stays
    try:
        tp = TopicPartition("cmds", 0)
        assert log.end_offsets([tp]) == {tp: 10} and log.start_offset(tp) == 10
        _append_at(log, monkeypatch, "cmds", [200_000])
        assert [r.offset for r in log.read(tp, 0, 100)] == [10]
    finally:
        log.close()


def test_a_queue_group_archives_the_records_retention_dropped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = EmbeddedLog(tmp_path / "log", retention_check_s=0)
    try:
        log.create_topics([TopicSpec("dispatch.q", 1, 1000)])
        _append_at(log, monkeypatch, "dispatch.q", [0, 0, 0, 5_000, 5_000])
        q = log.queue_consumer("workers")
        q.subscribe(["dispatch.q"])
        first = q.poll(0.1, max_records=1)
        assert [r.offset for r in first] == [0]
        q.acknowledge(first[0])
        q.commit()
        log.enforce_retention(now=5_500)  # offsets 1 and 2 (ts 0) are gone, unread
        got = []
        for _ in range(5):
            recs = q.poll(0.1, max_records=10)
            for r in recs:
                q.acknowledge(r)
            got += recs
        assert [r.offset for r in got] == [3, 4]
        q.close()
    finally:
        log.close()
