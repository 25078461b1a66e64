"""The dispatch queue on a real Kafka broker (share groups, KIP-932): what the broker's batching and
retention do to a queue of tasks, beyond the log contract (tests/test_log_contract.py)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dagfold import codec
from dagfold.codec import Record, default_codec
from dagfold.config import COMMANDS, Config, dispatch_topic
from dagfold.exceptions import LogError
from dagfold.log.base import Log, TopicPartition
from dagfold.log.factory import open_log
from dagfold.services.worker.handlers import HandlerRegistry
from dagfold.services.worker.worker import Worker

pytestmark = pytest.mark.kafka

STARTED = "dagfold.command.TaskStarted"
SUCCEEDED = "dagfold.command.TaskSucceeded"


@pytest.fixture
def klog(kafka_bootstrap: str, tmp_path: Any) -> Iterator[Log]:
    """A Kafka log in a topic namespace of its own (nothing of other tests is seen)."""
    lg = open_log(f"kafka://{kafka_bootstrap}?prefix=dq-{uuid.uuid4().hex[:8]}", tmp_path)
    lg.create_topics(Config(log_url=lg.url, partitions=1).core_topics())
    yield lg
    lg.close()


def _dispatch_all(log: Log, queue: str, jobs: list[str], seconds: float) -> None:
    """One transaction, as the scheduler writes a burst: the broker keeps it as one batch."""
    log.create_topics([Config(log_url=log.url, partitions=1).dispatch_spec(queue)])
    txp = log.transactional_producer(f"dispatcher-{uuid.uuid4().hex[:6]}")
    txp.begin()
    for job in jobs:
        rec = codec.make("dagfold.dispatch.TaskDispatch", job_id=job, task_id="t", attempt=1, handler="sleep",
                         args_json=json.dumps({"seconds": seconds}), idempotency_key=f"{job}/t",
                         lease_timeout_s=30.0, dispatched_at_ms=int(time.time() * 1000))
        txp.send(dispatch_topic(queue), b"tenant", default_codec().encode(rec))
    txp.commit({}, None)
    txp.close()


def _commands(log: Log, type_: str) -> list[Record]:
    c = log.consumer(None)
    tp = TopicPartition(COMMANDS, 0)
    end = log.end_offsets([tp])[tp]
    c.assign({tp: 0})
    out: list[Record] = []
    deadline = time.monotonic() + 10
    n = 0
    while n < end and time.monotonic() < deadline:
        recs = c.poll(timeout_s=0.2)
        n += len(recs)
        out += [r for r in (default_codec().decode(x.value) for x in recs) if r["type"] == type_]
    c.close()
    return out


def _wait(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _workers(log: Log, queue: str, n: int, **kw: Any) -> list[tuple[Worker, threading.Event, threading.Thread]]:
    out = []
    for i in range(n):
        w = Worker(log, queue, f"w{i}-{uuid.uuid4().hex[:4]}", HandlerRegistry.with_builtins(),
                   config=Config(log_url=log.url, partitions=1), poll_timeout_s=0.1, shutdown_grace_s=0.1, **kw)
        stop = threading.Event()
        out.append((w, stop, w.start_thread(stop)))
    return out


def _stop(workers: list[tuple[Worker, threading.Event, threading.Thread]]) -> None:
    for _, stop, _ in workers:
        stop.set()
    for w, _, t in workers:
        t.join(20)
        w.close()


def test_a_deep_backlog_of_slow_tasks_loses_none_to_the_delivery_limit(klog: Log) -> None:
    """A burst of slow tasks is one producer batch; a worker acquires the whole batch, runs one task
    and gives the rest back, and each give-back counts as a delivery. With a delivery limit of 3,
    records passed around 3 times were archived by the broker and their tasks never ran."""
    queue = f"q{uuid.uuid4().hex[:6]}"
    jobs = [f"job-{i}" for i in range(24)]
    _dispatch_all(klog, queue, jobs, 0.02)
    workers = _workers(klog, queue, 4, max_deliveries=3)
    try:
        _wait(lambda: len({r["job_id"] for r in _commands(klog, SUCCEEDED)}) == len(jobs), 90, "every task")
    finally:
        _stop(workers)
    assert sorted({r["job_id"] for r in _commands(klog, STARTED)}) == sorted(jobs)


def test_committed_dispatch_records_between_aborted_transactions_all_reach_the_queue(klog: Log) -> None:
    """Several schedulers write one dispatch partition in their own transactions; a killed or fenced one
    leaves an open transaction that is aborted later (by its successor's init, or by the coordinator),
    with other schedulers' committed transactions in between. The queue (a read_committed share group)
    must hand out every committed record and none of the aborted ones."""
    from dagfold.log.base import Ack

    queue = f"q{uuid.uuid4().hex[:6]}"
    topic = dispatch_topic(queue)
    klog.create_topics([Config(log_url=klog.url, partitions=1).dispatch_spec(queue)])
    enc = default_codec().encode

    def rec(name: str) -> bytes:
        return enc(codec.make("dagfold.dispatch.TaskDispatch", job_id=name, task_id="t", attempt=1,
                              handler="noop", args_json="{}", idempotency_key=f"{name}/t", lease_timeout_s=30.0,
                              dispatched_at_ms=0))

    committed: list[str] = []
    ida, idb = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
    for round_ in range(3):
        a = klog.transactional_producer(ida)  # fences (and aborts) the previous round's open transaction
        b = klog.transactional_producer(idb)
        a.begin()
        for i in range(3):
            a.send(topic, b"tenant", rec(f"aborted-{round_}-{i}"))
        a.inner._p.flush(10)  # type: ignore[attr-defined]  # noqa: SLF001 - on the log, not committed: a producer killed mid-transaction
        b.begin()
        for i in range(2):
            b.send(topic, b"tenant", rec(f"b-{round_}-{i}"))
            committed.append(f"b-{round_}-{i}")
        b.commit({}, None)
        a.send(topic, b"tenant", rec(f"aborted-{round_}-late"))
        a.inner._p.flush(10)  # type: ignore[attr-defined]  # noqa: SLF001
        b.begin()
        b.send(topic, b"tenant", rec(f"b-{round_}-after"))
        committed.append(f"b-{round_}-after")
        b.commit({}, None)
        b.close()
        if round_ == 2:
            a.abort()
        a.inner._open = False  # type: ignore[attr-defined]  # noqa: SLF001 - left open: the next round's producer with this id aborts it
    klog.transactional_producer(ida).close()

    qc = klog.queue_consumer(f"dagfold-queue.{queue}", "probe", max_records=64, lock_ms=15_000, max_deliveries=10)
    qc.subscribe([topic])
    seen: list[str] = []
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and sorted(set(seen)) != sorted(committed):
            for r in qc.poll(0.5):
                seen.append(default_codec().decode(r.value)["job_id"])
                qc.acknowledge(r, Ack.ACCEPT)
            qc.commit()
    finally:
        qc.close()
    assert sorted(set(seen)) == sorted(committed), f"seen {seen}"


def test_the_scheduler_writes_dispatch_records_without_transaction_markers(klog: Log, tmp_path: Any) -> None:
    """A commit marker in a dispatch topic is a record a share group acquires: librdkafka 2.16 never
    acknowledged one fetched without a record beside it, so it stayed acquired until the delivery
    limit archived it (10 x 15 s), holding the share partition's start offset; 2,000 offsets behind
    it the broker acquired nothing more and every worker waited (docs/benchmarks.md, the Kafka
    stall). Dispatch records now go out before the scheduler's transaction: no markers, offsets
    without gaps."""
    from dagfold.commands import submit_job
    from dagfold.jobspec import load_spec_text, to_job_spec
    from tests.runner_support import Running

    cfg = Config(log_url=klog.url, data_dir=tmp_path / "data", partitions=1)
    s = Running(klog, cfg)
    topic = dispatch_topic("default")
    tp = TopicPartition(topic, 0)
    try:
        p = klog.producer("test")
        for n in (1, 2, 3):  # one SubmitJob at a time, so one scheduler transaction each
            spec = to_job_spec(load_spec_text(f"id: m{n}\ntasks: [{{id: a}}, {{id: b}}, {{id: c}}]"))
            p.send(COMMANDS, f"m{n}".encode(), default_codec().encode(submit_job(spec)))
            p.flush()
            _wait(lambda n=n: _dispatched(klog) >= 3 * n, 60, f"job m{n}'s dispatch records")
        p.close()
    finally:
        s.close()
    assert s.error is None
    c = klog.consumer(None)
    c.assign({tp: 0})
    offsets: list[int] = []
    deadline = time.monotonic() + 10
    while len(offsets) < 9 and time.monotonic() < deadline:
        offsets += [r.offset for r in c.poll(timeout_s=0.2)]
    c.close()
    assert offsets == list(range(9))  # a marker after each job's three records would leave gaps
    assert klog.end_offsets([tp])[tp] == 9


def _dispatched(log: Log) -> int:
    """Records and markers in dispatch.default (0 before the scheduler created it)."""
    tp = TopicPartition(dispatch_topic("default"), 0)
    try:
        return log.end_offsets([tp])[tp]
    except LogError:
        return 0


def _read_committed(log: Log, topic: str) -> list[Record]:
    """What a read_committed reader (a worker's share group, the read model) can read of partition 0 now."""
    tp = TopicPartition(topic, 0)
    c = log.consumer(None)
    c.assign({tp: 0})
    out: list[Record] = []
    try:
        for _ in range(5):
            out += [default_codec().decode(r.value) for r in c.poll(timeout_s=0.2)]
    finally:
        c.close()
    return out


def test_a_chains_next_dispatch_is_readable_while_the_transaction_of_its_dependency_is_open(
        klog: Log, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27, on the broker: with the scheduler's transaction open across polls, a's dispatch and,
    after a's success, b's are readable (read_committed) while none of their events is. That
    transaction aborts; the restarted scheduler folds the same commands again and decides the same
    attempts, whose dispatch records it writes again (docs/semantics.md, Dispatch)."""
    from dataclasses import replace

    from dagfold.commands import submit_job
    from dagfold.config import EVENTS
    from dagfold.exceptions import TransactionAbortedError
    from dagfold.jobspec import load_spec_text, to_job_spec
    from dagfold.log.kafka import KafkaTransactionalProducer
    from dagfold.services.scheduler.runner import SchedulerRunner

    real_commit = KafkaTransactionalProducer.commit
    aborts = [1]

    def commit(producer: KafkaTransactionalProducer, offsets: Any, consumer: Any = None) -> Any:
        if aborts[0] and producer._sent:
            aborts[0] -= 1
            producer.abort()
            raise TransactionAbortedError("scripted abort")
        return real_commit(producer, offsets, consumer)

    monkeypatch.setattr(KafkaTransactionalProducer, "commit", commit)
    cfg = Config(log_url=klog.url, data_dir=tmp_path / "data", partitions=1)
    p = klog.producer("test")

    def send(cmd: Record) -> None:
        p.send(COMMANDS, b"C", default_codec().encode(cmd))
        p.flush()

    def dispatched() -> list[tuple[str, int]]:
        return [(d["task_id"], d["attempt"]) for d in _read_committed(klog, dispatch_topic("default"))]

    def step_until(runner: SchedulerRunner, pred: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 60
        while not pred():
            assert time.monotonic() < deadline, what
            runner.step(0.05)

    def report(kind: str, task: str) -> Record:
        return {"type": f"dagfold.command.{kind}", "job_id": "C", "task_id": task, "attempt": 1,
                "worker_id": "w", "ts_ms": 0, **({"output": "", "duration_ms": 1} if kind == "TaskSucceeded" else {})}

    s = SchedulerRunner(klog, replace(cfg, scheduler=replace(cfg.scheduler, commit_interval_s=600)), "t")
    try:
        send(submit_job(to_job_spec(load_spec_text("id: C\ntasks: [{id: a}, {id: b, depends_on: [a]}]"))))
        step_until(s, lambda: dispatched() == [("a", 1)], "a's dispatch")
        send(report("TaskSucceeded", "a"))
        step_until(s, lambda: dispatched() == [("a", 1), ("b", 1)], "b's dispatch")
        assert _read_committed(klog, EVENTS) == [] and aborts == [1]
    finally:
        s.close()  # its commit aborts
    assert aborts == [0] and _read_committed(klog, EVENTS) == []
    s = SchedulerRunner(klog, cfg, "t")
    try:
        step_until(s, lambda: [e["type"].rsplit(".", 1)[-1] for e in _read_committed(klog, EVENTS)] ==
                   ["JobAccepted", "TaskDispatched", "LeaseGranted", "TaskSucceeded", "TaskDispatched"],
                   "the same decisions, committed")
        assert dispatched() == [("a", 1), ("b", 1), ("a", 1), ("b", 1)]
    finally:
        s.close()
        p.close()
