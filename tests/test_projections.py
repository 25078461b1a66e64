"""The jobs read model: hand-built event sequences through the projector on an embedded log."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dagfold.codec import default_codec, make
from dagfold.config import EVENTS, Config
from dagfold.log.base import Log, TopicPartition, TopicSpec
from dagfold.log.embedded import EmbeddedLog
from dagfold.projections import Projector, ReadModel, ReadModelStore
from dagfold.projections.jobs import TASK_STATES

T0 = 1_700_000_000_000


def task(tid: str, *deps: str, queue: str = "default") -> dict[str, Any]:
    return make("dagfold.common.TaskSpec", task_id=tid, handler="noop", depends_on=list(deps), queue=queue)


def accepted(job_id: str, tasks: list[dict[str, Any]], ts: int = T0, tenant: str = "acme",
             policy: str = "skip_downstream") -> dict[str, Any]:
    spec = make("dagfold.common.JobSpec", job_id=job_id, tenant=tenant, failure_policy=policy, tasks=tasks)
    return make("dagfold.event.JobAccepted", job_id=job_id, ts_ms=ts, cause_offset=0, spec=spec)


def ev(name: str, **fields: Any) -> dict[str, Any]:
    return make("dagfold.event." + name, **fields)


def run_attempt(job: str, tid: str, attempt: int, worker: str, ts: int, *, ok: bool = True,
                final: bool = True, reason: str = "boom") -> list[dict[str, Any]]:
    out = [
        ev("TaskDispatched", job_id=job, task_id=tid, attempt=attempt, ts_ms=ts, queue="default"),
        ev("LeaseGranted", job_id=job, task_id=tid, attempt=attempt, worker_id=worker, ts_ms=ts + 10,
           lease_deadline_ms=ts + 30_010),
    ]
    if ok:
        out.append(ev("TaskSucceeded", job_id=job, task_id=tid, attempt=attempt, worker_id=worker, ts_ms=ts + 100,
                      result_json='{"n": 1}', stdout_tail="done\n"))
    else:
        out.append(ev("TaskFailed", job_id=job, task_id=tid, attempt=attempt, worker_id=worker, ts_ms=ts + 100,
                      reason=reason, exit_code=3, error_type="RuntimeError", final=final, stderr_tail="trace"))
    return out


class Harness:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.log = EmbeddedLog(tmp / "log")
        self.log.create_topics(Config(partitions=4).core_topics())
        self.producer = self.log.producer("test")
        self.open()

    def open(self) -> None:
        self.projector = Projector(self.log, self.tmp / "read")
        self.rm = self.projector.read_model

    def reopen(self) -> None:
        self.projector.close()
        self.open()

    def emit(self, *events: dict[str, Any]) -> None:
        codec = default_codec()
        for e in events:
            self.producer.send(EVENTS, e["job_id"].encode(), codec.encode(e))
        self.producer.flush()

    def project(self, *events: dict[str, Any]) -> int:
        self.emit(*events)
        return self.projector.catch_up(timeout_s=10)

    def close(self) -> None:
        self.projector.close()
        self.log.close()


@pytest.fixture
def h(tmp_path: Path) -> Iterator[Harness]:
    harness = Harness(tmp_path)
    yield harness
    harness.close()


def test_lifecycle_counts_progress_attempts(h: Harness) -> None:
    job = "job-1"
    h.project(accepted(job, [task("a"), task("b", "a"), task("c", "a")]))
    s = h.rm.get_job(job)
    assert s is not None
    assert s["state"] == "running" and s["tenant"] == "acme" and s["total_tasks"] == 3
    assert s["counts"]["pending"] == 3 and s["progress"] == 0.0 and s["created_ms"] == T0
    assert set(s["counts"]) == set(TASK_STATES)

    # a: attempt 1 fails (retryable), retried, attempt 2 succeeds
    h.project(
        *run_attempt(job, "a", 1, "w1", T0 + 1000, ok=False, final=False, reason="flaky"),
        ev("TaskRetryScheduled", job_id=job, task_id="a", attempt=1, ts_ms=T0 + 1100, next_attempt=2,
           retry_at_ms=T0 + 3000, reason="flaky"),
    )
    a = h.rm.get_task(job, "a")
    assert a is not None and a["state"] == "retrying" and a["retries"] == 1 and a["reason"] == "flaky"
    assert h.rm.get_job(job)["counts"]["retrying"] == 1  # type: ignore[index]

    h.project(*run_attempt(job, "a", 2, "w2", T0 + 3000))
    s = h.rm.get_job(job)
    assert s is not None
    assert s["counts"]["succeeded"] == 1 and s["counts"]["pending"] == 2
    assert s["progress"] == pytest.approx(33.33) and s["started_ms"] == T0 + 1010

    # b running with a heartbeat, c fails for good
    h.project(
        ev("TaskDispatched", job_id=job, task_id="b", attempt=1, ts_ms=T0 + 4000, queue="default"),
        ev("LeaseGranted", job_id=job, task_id="b", attempt=1, worker_id="w1", ts_ms=T0 + 4010,
           lease_deadline_ms=T0 + 34_010),
        ev("LeaseExtended", job_id=job, task_id="b", attempt=1, worker_id="w1", ts_ms=T0 + 5000,
           lease_deadline_ms=T0 + 35_000, progress=0.5),
        *run_attempt(job, "c", 1, "w3", T0 + 4000, ok=False, final=True, reason="exit 3"),
    )
    b = h.rm.get_task(job, "b")
    assert b is not None and b["state"] == "running" and b["worker_id"] == "w1"
    assert b["progress"] == 0.5 and b["last_heartbeat_ms"] == T0 + 5000 and b["lease_deadline_ms"] == T0 + 35_000
    s = h.rm.get_job(job)
    assert s is not None
    assert s["counts"] == {**dict.fromkeys(TASK_STATES, 0), "succeeded": 1, "running": 1, "failed": 1}
    assert s["progress"] == pytest.approx(66.67)

    h.project(
        ev("TaskSucceeded", job_id=job, task_id="b", attempt=1, worker_id="w1", ts_ms=T0 + 6000),
        ev("JobFailed", job_id=job, ts_ms=T0 + 6000, reason="task c failed: exit 3"),
    )
    s = h.rm.get_job(job)
    assert s is not None
    assert s["state"] == "failed" and s["reason"] == "task c failed: exit 3"
    assert s["progress"] == 100.0 and s["ended_ms"] == T0 + 6000 and s["duration_ms"] == 6000

    attempts = h.rm.get_attempts(job, "a")
    assert [(x["attempt"], x["worker_id"], x["outcome"]) for x in attempts] == [
        (1, "w1", "failed"), (2, "w2", "succeeded")]
    assert attempts[0]["reason"] == "flaky" and attempts[0]["exit_code"] == 3
    assert attempts[0]["stderr_tail"] == "trace" and attempts[0]["error_type"] == "RuntimeError"
    assert attempts[1]["started_ms"] == T0 + 3010 and attempts[1]["ended_ms"] == T0 + 3100
    assert attempts[1]["duration_ms"] == 90 and attempts[1]["stdout_tail"] == "done\n"
    assert attempts[1]["result_json"] == '{"n": 1}'
    c = h.rm.get_task(job, "c")
    assert c is not None and c["state"] == "failed" and c["exit_code"] == 3


def test_history_in_order_and_paginated(h: Harness) -> None:
    job = "job-h"
    events = [accepted(job, [task("a"), task("b", "a")]), *run_attempt(job, "a", 1, "w", T0 + 10),
              *run_attempt(job, "b", 1, "w", T0 + 20), ev("JobSucceeded", job_id=job, ts_ms=T0 + 200)]
    h.project(*events)
    page = h.rm.get_history(job, limit=1000)
    types = [e["type"] for e in page.items]
    assert types == ["JobAccepted", "TaskDispatched", "LeaseGranted", "TaskSucceeded",
                     "TaskDispatched", "LeaseGranted", "TaskSucceeded", "JobSucceeded"]
    assert page.next_cursor is None
    offsets = [e["offset"] for e in page.items]
    assert offsets == sorted(offsets) and len({e["partition"] for e in page.items}) == 1
    assert page.items[2]["task_id"] == "a" and page.items[2]["attempt"] == 1
    assert "worker w" in page.items[2]["detail"]

    got: list[dict[str, Any]] = []
    cursor = None
    while True:
        p = h.rm.get_history(job, limit=3, cursor=cursor)
        got += p.items
        if p.next_cursor is None:
            break
        cursor = p.next_cursor
    assert got == page.items
    assert h.rm.get_job(job)["state"] == "succeeded"  # type: ignore[index]


def test_restart_resumes_without_double_apply(h: Harness) -> None:
    job = "job-r"
    n = h.project(accepted(job, [task("a"), task("b")]), *run_attempt(job, "a", 1, "w", T0 + 10))
    assert n == 4
    before = h.rm.get_job(job)
    history = h.rm.get_history(job).items

    h.reopen()
    assert h.projector.catch_up(timeout_s=5) == 0
    assert h.rm.get_job(job) == before
    assert h.rm.get_history(job).items == history

    # replaying already-applied records changes nothing (positions fence them)
    parts = h.log.partitions(EVENTS)
    recs = [r for p in range(parts) for r in h.log.read(TopicPartition(EVENTS, p), 0, 100)]
    assert h.projector.apply_records(recs) == 0
    assert h.rm.get_job(job) == before

    # new events after the restart are applied once
    assert h.project(*run_attempt(job, "b", 1, "w", T0 + 20)) == 3
    s = h.rm.get_job(job)
    assert s is not None and s["counts"]["succeeded"] == 2 and s["counts"]["pending"] == 0
    assert len(h.rm.get_history(job).items) == 7
    assert sum(h.rm.positions(EVENTS).values()) == 7


def test_rejected_job_visible_with_reason(h: Harness) -> None:
    h.project(ev("JobRejected", job_id="bad", ts_ms=T0, tenant="acme", code="cycle",
                 reason="dependency cycle: a -> b -> a"))
    s = h.rm.get_job("bad")
    assert s is not None
    assert s["state"] == "rejected" and s["code"] == "cycle" and s["reason"] == "dependency cycle: a -> b -> a"
    assert s["total_tasks"] == 0 and h.rm.get_tasks("bad").items == []
    assert [j["job_id"] for j in h.rm.list_jobs(state="rejected").items] == ["bad"]
    assert [j["job_id"] for j in h.rm.list_jobs(tenant="acme", state="rejected").items] == ["bad"]
    hist = h.rm.get_history("bad").items
    assert hist[0]["type"] == "JobRejected" and "cycle" in hist[0]["detail"]

    # a duplicate submission of a live job is rejected without touching the job
    h.project(accepted("live", [task("a")], ts=T0 + 1),
              ev("JobRejected", job_id="live", ts_ms=T0 + 2, tenant="acme", code="job_exists", reason="job exists"))
    live = h.rm.get_job("live")
    assert live is not None and live["state"] == "running" and live["reason"] is None
    assert [e["type"] for e in h.rm.get_history("live").items] == ["JobAccepted", "JobRejected"]
    # another tenant's submission under the same ID never enters the job's history
    h.project(ev("JobRejected", job_id="live", ts_ms=T0 + 3, tenant="beta", code="job_exists", reason="job exists"))
    assert [e["type"] for e in h.rm.get_history("live").items] == ["JobAccepted", "JobRejected"]


def test_list_jobs_filters_and_cursor(h: Harness) -> None:
    for i in range(7):
        h.emit(accepted(f"j{i}", [task("a")], ts=T0 + i, tenant="acme" if i % 2 == 0 else "beta"))
    h.projector.catch_up(timeout_s=5)
    assert [j["job_id"] for j in h.rm.list_jobs().items] == [f"j{i}" for i in range(6, -1, -1)]
    assert [j["job_id"] for j in h.rm.list_jobs(tenant="beta").items] == ["j5", "j3", "j1"]

    ids: list[str] = []
    cursor = None
    while True:
        page = h.rm.list_jobs(limit=2, cursor=cursor)
        ids += [j["job_id"] for j in page.items]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert ids == [f"j{i}" for i in range(6, -1, -1)]

    h.project(ev("JobCancelled", job_id="j4", ts_ms=T0 + 100, reason="user"),
              ev("JobSucceeded", job_id="j1", ts_ms=T0 + 100))
    assert [j["job_id"] for j in h.rm.list_jobs(state="cancelled").items] == ["j4"]
    assert [j["job_id"] for j in h.rm.list_jobs(tenant="beta", state="succeeded").items] == ["j1"]
    assert [j["job_id"] for j in h.rm.list_jobs(state="running").items] == ["j6", "j5", "j3", "j2", "j0"]
    assert [j["job_id"] for j in h.rm.list_jobs(tenant="acme", state="running").items] == ["j6", "j2", "j0"]


def test_skip_cancel_partial_and_redrive(h: Harness) -> None:
    job = "job-p"
    h.project(
        accepted(job, [task("a"), task("b", "a"), task("c"), task("d")], policy="allow_partial"),
        *run_attempt(job, "a", 1, "w", T0 + 10, ok=False, final=True),
        ev("TaskSkipped", job_id=job, task_id="b", ts_ms=T0 + 200, reason="upstream a failed"),
        ev("TaskDispatched", job_id=job, task_id="c", attempt=1, ts_ms=T0 + 10, queue="default"),
        ev("LeaseGranted", job_id=job, task_id="c", attempt=1, worker_id="w9", ts_ms=T0 + 20,
           lease_deadline_ms=T0 + 999),
        ev("TaskCancelled", job_id=job, task_id="c", attempt=1, ts_ms=T0 + 300, reason="stop"),
        *run_attempt(job, "d", 1, "w", T0 + 10),
        ev("JobSucceeded", job_id=job, ts_ms=T0 + 400, partial=True),
    )
    s = h.rm.get_job(job)
    assert s is not None and s["state"] == "succeeded_partial" and s["failure_policy"] == "allow_partial"
    assert s["counts"]["failed"] == 1 and s["counts"]["skipped"] == 1 and s["counts"]["cancelled"] == 1
    assert s["counts"]["succeeded"] == 1 and s["progress"] == 100.0
    assert h.rm.get_task(job, "b")["reason"] == "upstream a failed"  # type: ignore[index]
    att = h.rm.get_attempts(job, "c")
    assert len(att) == 1 and att[0]["outcome"] == "cancelled" and att[0]["reason"] == "stop"
    assert [t["task_id"] for t in h.rm.get_tasks(job, state="skipped").items] == ["b"]

    h.project(ev("JobRedriven", job_id=job, ts_ms=T0 + 500, task_ids=["a", "b", "c"]))
    s = h.rm.get_job(job)
    assert s is not None and s["state"] == "running" and s["ended_ms"] is None and s["redrives"] == 1
    assert s["counts"]["pending"] == 3 and s["counts"]["succeeded"] == 1 and s["progress"] == 25.0
    assert [j["job_id"] for j in h.rm.list_jobs(state="running").items] == [job]
    assert h.rm.list_jobs(state="succeeded_partial").items == []
    assert len(h.rm.get_attempts(job, "a")) == 1  # history and attempts are kept


def test_tasks_pagination_and_odd_ids(h: Harness) -> None:
    ids = ["a|b", "x/y", "nul\x00in", "esc\x01ape", "z"] + [f"t{i:03d}" for i in range(20)]
    h.project(accepted("odd|job", [task(t) for t in ids]))
    got: list[str] = []
    cursor = None
    while True:
        page = h.rm.get_tasks("odd|job", limit=4, cursor=cursor)
        got += [t["task_id"] for t in page.items]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert sorted(got) == sorted(ids) and len(got) == len(ids)
    assert h.rm.get_task("odd|job", "nul\x00in") is not None
    assert h.rm.get_tasks("odd", limit=10).items == []  # prefix of another job ID


def test_undecodable_record_skipped(h: Harness) -> None:
    h.producer.send(EVENTS, b"junk", b"not avro")
    h.producer.flush()
    h.project(accepted("ok", [task("a")]))
    assert h.rm.get_job("ok") is not None
    assert h.rm.counters().get("skipped") == 1
    h.reopen()
    assert h.projector.catch_up(timeout_s=5) == 0


def test_large_job_counts_incremental(h: Harness) -> None:
    n = 20_000
    h.project(accepted("big", [task(f"t{i:06d}") for i in range(n)]))
    s = h.rm.get_job("big")
    assert s is not None and s["total_tasks"] == n and s["counts"]["pending"] == n
    started = time.perf_counter()
    h.project(*run_attempt("big", "t000007", 1, "w", T0 + 10))
    assert time.perf_counter() - started < 2.0
    s = h.rm.get_job("big")
    assert s is not None and s["counts"]["succeeded"] == 1 and s["counts"]["pending"] == n - 1
    assert s["progress"] == pytest.approx(100 / n, abs=0.01)


def test_run_waits_for_topic(tmp_path: Path) -> None:
    log = EmbeddedLog(tmp_path / "log")
    projector = Projector(log, tmp_path / "read", poll_timeout_s=0.05)
    rm = ReadModel(projector.store)
    stop = threading.Event()
    thread = threading.Thread(target=projector.run, args=(stop,), daemon=True)
    thread.start()
    try:
        time.sleep(0.2)
        log.create_topics(Config(partitions=2).core_topics())
        producer = log.producer("t")
        e = accepted("late", [task("a")])
        producer.send(EVENTS, b"late", default_codec().encode(e))
        producer.flush()
        deadline = time.monotonic() + 10
        while rm.get_job("late") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rm.get_job("late") is not None
    finally:
        stop.set()
        thread.join(5)
        projector.close()
        log.close()
    assert not thread.is_alive()


def test_store_shared_with_reader(tmp_path: Path) -> None:
    """A projector given an open ReadModelStore leaves it open for its readers."""
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics(Config(partitions=1).core_topics())
    store = ReadModelStore(tmp_path / "read")
    projector = Projector(log, store)
    projector.close()
    assert ReadModel(store).get_job("none") is None
    store.close()
    log.close()


def test_projector_on_both_backends(log_backend: Log, unique_topic: Callable[..., str], tmp_path: Path) -> None:
    """Transactional writes (Kafka leaves commit markers between records) project exactly once."""
    topic = unique_topic("events")
    log_backend.create_topics([TopicSpec(topic, 2)])
    tx = log_backend.transactional_producer(unique_topic("tx"))
    codec = default_codec()

    def write(*events: dict[str, Any]) -> None:
        tx.begin()
        for e in events:
            tx.send(topic, e["job_id"].encode(), codec.encode(e))
        tx.commit({}, None)

    write(accepted("k1", [task("a"), task("b")]), accepted("k2", [task("x")]))
    write(*run_attempt("k1", "a", 1, "w", T0 + 10))
    projector = Projector(log_backend, tmp_path / "read", topic=topic)
    try:
        assert projector.catch_up(timeout_s=60) == 5
        rm = ReadModel(projector.store)
        before = rm.get_job("k1")
        assert before is not None and before["counts"]["succeeded"] == 1
    finally:
        projector.close()

    projector = Projector(log_backend, tmp_path / "read", topic=topic)
    try:
        rm = ReadModel(projector.store)
        assert projector.catch_up(timeout_s=60, idle_s=0.5) == 0
        assert rm.get_job("k1") == before
        write(*run_attempt("k1", "b", 1, "w", T0 + 20), ev("JobSucceeded", job_id="k1", ts_ms=T0 + 200))
        assert projector.catch_up(timeout_s=60) == 4
        job = rm.get_job("k1")
        assert job is not None and job["state"] == "succeeded" and job["counts"]["succeeded"] == 2
        assert len(rm.get_history("k1").items) == 8
    finally:
        projector.close()
        tx.close()
