"""Re-dispatch of a runnable attempt whose dispatch record never reached a worker (virtual time).

A dispatch record can be lost between the log and a worker (the queue archives it after its last
delivery; a worker killed -9 while it held it). Before the re-dispatch timer nothing dispatched such an
attempt again: its job stayed running for ever (``test_a_lost_dispatch_record_is_dispatched_again``
fails on that code: no second record, the job never ends).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import load_schema

from dagfold.codec import MAGIC, default_codec, schema_fingerprint
from dagfold.config import Config, SchedulerOptions
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.services.scheduler import keys
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.state import PartitionStore

EVERY_MS = 60_000
OPTS = SchedulerOptions(redispatch_after_s=EVERY_MS / 1000)  # the default is 300 s; a minute reads easier
SCHEMAS = Path(__file__).resolve().parents[1] / "schemas"


def spec_of(text: str) -> dict[str, Any]:
    return to_job_spec(load_spec_text(text))


def timers(h: FoldHarness) -> list[tuple[int, str, str, str]]:
    """The scheduler's whole timer table (due, job, task, kind)."""
    end = keys.TIMER_PREFIX[:-1] + bytes([keys.TIMER_PREFIX[-1] + 1])
    return [keys.parse_timer(k) for k, _ in h.store.range(keys.TIMER_PREFIX, end)]


def redispatched(h: FoldHarness) -> list[dict[str, Any]]:
    return [e for e in h.events if e["type"] == "dagfold.event.TaskRedispatched"]


def test_a_lost_dispatch_record_is_dispatched_again_and_the_job_finishes() -> None:
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: J\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))
    lost = h.dispatched.popleft()  # never delivered to any worker
    assert not h.dispatched
    h.advance(EVERY_MS - 1)
    assert not h.dispatched and h.task("J", "a")["state"] == "runnable"
    h.advance(1)
    assert len(h.dispatched) == 1
    again = h.dispatched[0]
    assert {k: again[k] for k in ("job_id", "task_id", "attempt")} == {"job_id": "J", "task_id": "a",
                                                                       "attempt": lost["attempt"]}
    assert [(e["attempt"], e["redispatches"]) for e in redispatched(h)] == [(1, 1)]
    h.run_all()
    assert h.job("J")["state"] == "succeeded"
    assert timers(h) == []
    assert h.replayed_digest() == h.digest()


def deferred(h: FoldHarness) -> list[dict[str, Any]]:
    return [e for e in h.events if e["type"] == "dagfold.event.TaskRedispatchDeferred"]


def test_a_backlog_drained_in_order_gets_no_copies() -> None:
    """One worker takes a record every 20 s from a queue of 8: the waiting records are late, not lost, and
    the queue is still handing out records older than theirs, so no copy is sent. (Before: every task still
    waiting at 60 s got a copy, at 180 s another, ...: in the long chaos run 15,000 copies for 1,600 waiting
    tasks, which the workers spent their time taking and the fold fencing.)"""
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: J\ntasks: [" + ", ".join(f"{{id: t{i}}}" for i in range(8)) + "]"))
    queued = list(h.dispatched)
    h.dispatched.clear()
    for d in queued:
        h.advance(20_000)
        h.report("Succeeded", d)
    assert h.job("J")["state"] == "succeeded"
    assert not redispatched(h) and not h.dispatched
    assert {e["task_id"] for e in deferred(h)} == {f"t{i}" for i in range(2, 8)}  # t0, t1 taken before 60 s
    first = [e for e in deferred(h) if e["task_id"] == "t7"][0]
    assert first["ts_ms"] - h.events[0]["ts_ms"] == EVERY_MS and first["deferrals"] == 1
    assert first["next_redispatch_at_ms"] - first["ts_ms"] == 2 * EVERY_MS
    assert timers(h) == []
    assert h.replayed_digest() == h.digest()


def test_a_record_passed_by_a_later_one_is_sent_again() -> None:
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: A\ntasks: [{id: a}]"))
    h.dispatched.popleft()  # lost
    h.advance(10_000)
    h.submit(spec_of("id: B\ntasks: [{id: b}]"))  # the same tenant: behind a's record on the queue
    h.advance(10_000)
    h.report("Succeeded", h.dispatched.popleft())  # b was taken: a's record is not ahead any more
    h.advance(EVERY_MS - 20_000)
    assert [e["task_id"] for e in redispatched(h)] == ["a"] and not deferred(h)
    h.run_all()
    assert h.job("A")["state"] == "succeeded" and h.replayed_digest() == h.digest()


def test_a_lost_record_behind_a_queue_gone_quiet_is_sent_again() -> None:
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: J\ntasks: [{id: a}, {id: b}]"))
    ra, rb = h.dispatched.popleft(), h.dispatched.popleft()
    assert (ra["task_id"], rb["task_id"]) == ("a", "b")
    h.advance(1_000)
    h.report("Succeeded", rb)  # taken; a's record (as old) lost
    h.advance(EVERY_MS - 1_000)  # the queue took a record 59 s ago, none later than a's: wait
    assert len(deferred(h)) == 1 and not redispatched(h)
    h.advance(2 * EVERY_MS)  # nothing taken for a whole interval since: a's record is lost
    assert [(e["task_id"], e["redispatches"]) for e in redispatched(h)] == [("a", 1)]
    h.run_all()
    assert h.job("J")["state"] == "succeeded" and h.replayed_digest() == h.digest()


def test_another_tenants_progress_does_not_count() -> None:
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: A\ntenant: acme\ntasks: [{id: a}]"))
    h.submit(spec_of("id: B\ntenant: other\ntasks: [{id: b}]"))
    ra = [d for d in h.dispatched if d["job_id"] == "A"][0]
    rb = [d for d in h.dispatched if d["job_id"] == "B"][0]
    h.dispatched.clear()
    h.advance(30_000)
    h.report("Succeeded", rb)  # other's queue moved; acme's took nothing: a's record is lost
    h.advance(EVERY_MS - 30_000)
    assert [e["task_id"] for e in redispatched(h)] == ["a"] and not deferred(h)
    h.report("Succeeded", ra)
    assert h.job("A")["state"] == "succeeded"


def test_a_leased_attempt_is_never_redispatched() -> None:
    h = FoldHarness(SchedulerOptions(lease_timeout_s=30, redispatch_after_s=60))
    h.submit(spec_of("id: J\ntasks: [{id: a}]"))
    d = h.dispatched.popleft()
    h.report("Started", d)
    assert [k for *_, k in timers(h)] == ["lease"]  # LeaseGranted cleared the redispatch timer
    for _ in range(30):  # 10 minutes of a long task, heartbeating
        h.advance(20_000)
        h.report("Heartbeat", d)
    assert not redispatched(h) and not h.dispatched
    h.report("Succeeded", d)
    assert h.job("J")["state"] == "succeeded" and timers(h) == []


def test_the_interval_doubles_up_to_eight_times() -> None:
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: J\ntasks: [{id: a}]"))
    start = h.now_ms
    h.dispatched.clear()
    for _ in range(6 * 8):  # 48 minutes in steps of 1 minute; every record is lost
        h.advance(EVERY_MS)
        h.dispatched.clear()
    at = [(e["ts_ms"] - start) // EVERY_MS for e in redispatched(h)]
    assert at == [1, 3, 7, 15, 23, 31, 39, 47]  # +1, +2, +4, +8, then +8 (the cap)
    assert [e["redispatches"] for e in redispatched(h)] == list(range(1, 9))
    assert all(e["attempt"] == 1 for e in redispatched(h))
    assert [e["next_redispatch_at_ms"] - e["ts_ms"] for e in redispatched(h)][:4] == [
        2 * EVERY_MS, 4 * EVERY_MS, 8 * EVERY_MS, 8 * EVERY_MS]
    assert h.replayed_digest() == h.digest()


def test_a_duplicate_record_is_harmless_one_lease_per_attempt() -> None:
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: J\ntasks: [{id: slow, handler: sleep}, {id: instant}]"))
    originals = list(h.dispatched)
    h.dispatched.clear()
    h.advance(EVERY_MS)  # both records were only late, not lost: now each attempt has two
    copies = list(h.dispatched)
    h.dispatched.clear()
    assert len(copies) == 2
    slow = [d for d in originals if d["task_id"] == "slow"][0]
    slow2 = [d for d in copies if d["task_id"] == "slow"][0]
    h.report("Started", slow, "w1")
    h.report("Started", slow2, "w2")
    assert h.event_types()[-1] == "LeaseRejected"
    assert [(c["worker_id"], c["task_id"]) for c in h.controls] == [("w2", "slow")]  # w2 is told to stop
    assert h.task("J", "slow")["worker"] == "w1"
    inst = [d for d in originals if d["task_id"] == "instant"][0]
    inst2 = [d for d in copies if d["task_id"] == "instant"][0]
    h.report("Succeeded", inst, "w3")  # an instant task reports once, without a start
    h.report("Succeeded", inst2, "w4")
    assert h.event_types()[-1] == "ReportIgnored"
    assert h.event_types().count("TaskSucceeded") == 1
    assert h.event_types().count("LeaseGranted") == 2  # slow by w1, instant by w3
    h.report("Succeeded", slow, "w1")
    assert h.job("J")["state"] == "succeeded" and timers(h) == []
    assert h.replayed_digest() == h.digest()


def test_timers_are_cleared_when_the_job_is_cancelled_or_fails() -> None:
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: C\ntasks: [{id: a}, {id: b}]"))
    assert sorted(k for *_, k in timers(h)) == ["redispatch", "redispatch"]
    h.dispatched.clear()
    h.advance(EVERY_MS)  # re-dispatched once each, re-armed
    h.process({"type": "dagfold.command.CancelJob", "job_id": "C", "reason": "test", "requested_at_ms": h.now_ms})
    assert h.job("C")["state"] == "cancelled" and timers(h) == []
    h.dispatched.clear()

    h.submit(spec_of("id: F\nfailure_policy: fail_fast\ntasks: [{id: a}, {id: b}]"))
    a = [d for d in h.dispatched if d["task_id"] == "a"][0]
    h.dispatched.clear()
    h.report("Failed", a)  # b's record was lost; the job ends (fail_fast cancels b)
    assert h.job("F")["state"] == "failed" and timers(h) == []
    assert h.advance(10 * EVERY_MS) == 0 and len(redispatched(h)) == 2  # C's, before its cancel
    assert h.replayed_digest() == h.digest()


def test_a_retry_arms_a_fresh_timer_for_the_next_attempt() -> None:
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: J\ntasks: [{id: a, retry: {max_attempts: 2, initial_interval_s: 1, jitter: false}}]"))
    h.dispatched.clear()
    h.advance(EVERY_MS)
    d = h.dispatched.popleft()
    h.report("Started", d)
    h.report("Failed", d)
    h.advance(1000)  # backoff: attempt 2 dispatched, its timer starts at the first interval again
    d2 = h.dispatched.popleft()
    assert d2["attempt"] == 2 and [k for *_, k in timers(h)] == ["redispatch"]
    assert timers(h)[0][0] == h.now_ms + EVERY_MS
    h.advance(EVERY_MS)
    assert [(e["attempt"], e["redispatches"]) for e in redispatched(h)] == [(1, 1), (2, 1)]
    assert h.replayed_digest() == h.digest()


def test_the_interval_is_a_setting_per_queue_and_zero_turns_it_off() -> None:
    h = FoldHarness(SchedulerOptions(redispatch_after_s=0, redispatch_after_s_by_queue={"fast": 5}))
    h.submit(spec_of("id: J\ntasks: [{id: a}, {id: b, queue: fast}]"))
    h.dispatched.clear()
    h.advance(5000)
    assert [e["task_id"] for e in redispatched(h)] == ["b"]
    for _ in range(3600):  # an hour in steps of a second
        h.advance(1000)
    at = [(e["ts_ms"] - h.now_ms) // 1000 + 3605 for e in redispatched(h)]
    assert at[:5] == [5, 15, 35, 75, 115] and len(at) == 4 + (3605 - 75) // 40  # b: every 40 s; a: never
    assert {e["task_id"] for e in redispatched(h)} == {"b"}

    cfg = Config.from_env()
    assert cfg.scheduler.redispatch_after_s == 300.0  # the default


def test_the_settings_reach_the_scheduler(monkeypatch: Any) -> None:
    monkeypatch.setenv("DAGFOLD_REDISPATCH_AFTER_S", "2.5")
    monkeypatch.setenv("DAGFOLD_REDISPATCH_AFTER_S_BY_QUEUE", "slow=600, fast=1")
    opts = Config.from_env().scheduler
    assert opts.redispatch_after_ms("default") == 2500
    assert (opts.redispatch_after_ms("slow"), opts.redispatch_after_ms("fast")) == (600_000, 1000)


def test_a_gpu_task_is_not_redispatched() -> None:
    h = FoldHarness(OPTS)
    h.submit(spec_of("id: G\ntasks: [{id: train, resources: {gpus: 1}}]"))
    assert timers(h) == []
    h.advance(10 * EVERY_MS)
    assert not redispatched(h)


def test_the_events_are_valid_avro_and_old_dispatched_events_decode() -> None:
    codec = default_codec()
    h = FoldHarness(OPTS)
    outs = h.submit(spec_of("id: J\ntasks: [{id: a}]"))
    h.advance(EVERY_MS)
    for o in outs + [o for o in h.events]:
        rec = o.record if hasattr(o, "record") else o
        assert codec.decode(codec.encode(rec, validate_record=True))["type"] == rec["type"]
    # a TaskDispatched written before the field existed (its schema kept in history) reads as "never"
    old = load_schema(str(SCHEMAS / "history" / "v1-dispatched-no-redispatch" / "dagfold.event.TaskDispatched.avsc"))
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, old, {"job_id": "J", "task_id": "a", "attempt": 1, "ts_ms": 1,
                                          "cause_offset": 0, "queue": "default"})
    rec = codec.decode(MAGIC + schema_fingerprint(old) + buf.getvalue())
    assert rec["queue"] == "default" and rec["redispatch_at_ms"] is None


def test_the_read_model_shows_and_counts_redispatches_apart(tmp_path: Path) -> None:
    from dagfold.projections import OperatorModel, ReadModel, ReadModelStore
    from dagfold.projections.jobs import apply

    h = FoldHarness(OPTS)
    h.submit(spec_of("id: J\ntenant: acme\ntasks: [{id: a}]"))
    h.dispatched.clear()
    h.advance(EVERY_MS)
    h.advance(2 * EVERY_MS)
    h.run_all()
    store = ReadModelStore(tmp_path / "read")
    try:
        txn = store.txn()
        for i, e in enumerate(h.events):
            apply(txn, e, 0, i)
        store.commit(txn)
        rm, ops = ReadModel(store), OperatorModel(store)
        job = rm.get_job("J")
        assert job is not None and job["state"] == "succeeded" and job["redispatches"] == 2
        assert job["retries"] == 0 and (rm.get_task("J", "a") or {}).get("redispatches") == 2
        usage = ops.tenant("acme")
        assert usage is not None and usage["redispatches"] == 2 and usage["worker_losses"] == 0
        details = [x["detail"] for x in rm.get_history("J").items if x["type"] == "TaskRedispatched"]
        assert details == ["queue default: not leased in time, dispatched again (1x); next in 2min",
                           "queue default: not leased in time, dispatched again (2x); next in 4min"]
    finally:
        store.close()


def test_the_live_scheduler_redispatches_through_the_log(tmp_path: Path) -> None:
    """On the embedded log: the runtime's due-timer scan writes TimerFired(redispatch) to the commands
    topic, the fold answers with TaskRedispatched and a second record on dispatch.default; a report
    for the attempt then runs the job to its end and leaves no timer behind."""
    from dagfold.commands import submit_job
    from dagfold.config import COMMANDS, EVENTS, dispatch_topic
    from dagfold.exceptions import LogError
    from dagfold.log import TopicPartition
    from dagfold.log.embedded import EmbeddedLog
    from tests.runner_support import Running, wait_for

    def decoded(log: EmbeddedLog, topic: str) -> list[dict[str, Any]]:
        try:
            return [codec.decode(r.value) for p in range(log.partitions(topic))
                    for r in log.read(TopicPartition(topic, p), 0, 1_000_000)]
        except LogError:  # dispatch.<queue> is created at its first record
            return []

    codec = default_codec()
    cfg = Config(data_dir=tmp_path / "data", partitions=2, scheduler=SchedulerOptions(redispatch_after_s=0.3))
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(cfg.core_topics())
    r = Running(log, cfg)
    try:
        p = log.producer("test")
        p.send(COMMANDS, b"J", codec.encode(submit_job(spec_of("id: J\ntasks: [{id: a}]"))))
        p.flush()
        wait_for(lambda: len(decoded(log, dispatch_topic("default"))) >= 2)  # the first one "lost"
        records = decoded(log, dispatch_topic("default"))
        assert {(d["task_id"], d["attempt"]) for d in records} == {("a", 1)}
        fired = [c for c in decoded(log, COMMANDS) if c["type"] == "dagfold.command.TimerFired"]
        assert fired and {c["timer"] for c in fired} == {"redispatch"}
        report = {"type": "dagfold.command.TaskSucceeded", "job_id": "J", "task_id": "a", "attempt": 1,
                  "worker_id": "w1", "ts_ms": 0, "result_json": None, "stdout_tail": "", "stderr_tail": ""}
        p.send(COMMANDS, b"J", codec.encode(report))
        p.flush()
        wait_for(lambda: any(e["type"] == "dagfold.event.JobSucceeded" for e in decoded(log, EVENTS)))
        types = [e["type"].rsplit(".", 1)[-1] for e in decoded(log, EVENTS)]
        assert types[:3] == ["JobAccepted", "TaskDispatched", "TaskRedispatched"]
        assert r.error is None
    finally:
        r.close()
        log.close()
    for p in range(cfg.partitions):  # no timer left in the scheduler's state
        store = PartitionStore(cfg.data_dir / "scheduler" / f"p{p:04d}")
        try:
            assert list(store.range(keys.TIMER_PREFIX, keys.TIMER_PREFIX + b"\xff")) == []
        finally:
            store.close()
