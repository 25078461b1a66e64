"""The log contract (dagfold/log/base.py), run against both backends.

Every test in the first part takes ``log_backend`` (embedded, Kafka, and the in-memory test
backend the virtual-time driver runs over), so the backends are held to the same observable
behaviour. The Kafka-only and embedded-only tests at the end cover what only one of them can show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dagfold.exceptions import FencedError, LogError
from dagfold.log.base import (
    MAX_RECORD_BYTES,
    Ack,
    Consumer,
    Log,
    LogRecord,
    QueueConsumer,
    QueuedRecord,
    TopicPartition,
    TopicSpec,
    partition_for,
)

TopicName = Callable[..., str]


# -- helpers -------------------------------------------------------------------


def _drain(consumer: Consumer, want: int, timeout_s: float = 20.0) -> list[LogRecord]:
    """Poll until ``want`` records arrived (or the deadline passed)."""
    out: list[LogRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        out.extend(consumer.poll(max_records=500, timeout_s=0.2))
    return out


def _quiet(consumer: Consumer, seconds: float = 1.5) -> list[LogRecord]:
    """Everything a consumer gets during ``seconds`` (used to show that nothing arrives)."""
    out: list[LogRecord] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        out.extend(consumer.poll(max_records=500, timeout_s=0.2))
    return out


def _reader(log: Log, topic: str) -> Consumer:
    """Assign-only consumer over every partition of ``topic``, from the start."""
    c = log.consumer(None, client_id="reader")
    c.assign({TopicPartition(topic, p): 0 for p in range(log.partitions(topic))})
    return c


def _reopen(log: Log) -> Log:
    """The same log opened anew (a new process would see this)."""
    if log.url == "memory":
        from dagfold.log.memory import MemoryLog

        assert isinstance(log, MemoryLog)
        return log.reopen()
    if log.url == "embedded":
        from dagfold.log.embedded import EmbeddedLog

        path = log.path  # type: ignore[attr-defined]
        log.close()
        return EmbeddedLog(path)
    from dagfold.log.kafka import KafkaLog

    return KafkaLog(log.bootstrap, consumer_config=log._consumer_config)  # type: ignore[attr-defined]


def _wait_for(cond: Callable[[], bool], consumers: list[Consumer], timeout_s: float = 30.0) -> None:
    """Poll ``consumers`` (callbacks run inside poll) until ``cond()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached while polling")
        for c in consumers:
            c.poll(max_records=1, timeout_s=0.1)


# -- both backends -----------------------------------------------------------------


def test_keyed_records_land_on_partition_for(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("keyed")
    log_backend.create_topics([TopicSpec(topic, 5)])
    p = log_backend.producer("test")
    keys = [f"job-{i}".encode() for i in range(40)]
    for k in keys:
        p.send(topic, k, b"v:" + k)
    p.send(topic, b"pinned", b"explicit", partition=3)
    p.flush()

    recs = _drain(_reader(log_backend, topic), len(keys) + 1)
    assert len(recs) == len(keys) + 1
    by_key = {r.key: r for r in recs}
    for k in keys:
        assert by_key[k].partition == partition_for(k, 5)
        assert by_key[k].value == b"v:" + k
    assert by_key[b"pinned"].partition == 3
    assert len({r.partition for r in recs}) > 1  # the keys really spread


def test_records_read_back_in_order(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("order")
    log_backend.create_topics([TopicSpec(topic, 2)])
    p = log_backend.producer("test")
    for i in range(100):
        p.send(topic, b"same-key", str(i).encode())
    p.flush()

    recs = _drain(_reader(log_backend, topic), 100)
    assert [r.value for r in recs] == [str(i).encode() for i in range(100)]
    assert {r.partition for r in recs} == {partition_for(b"same-key", 2)}
    offsets = [r.offset for r in recs]
    assert offsets == sorted(offsets) and len(set(offsets)) == 100
    assert all(r.timestamp_ms > 1_600_000_000_000 for r in recs)


def test_a_job_spec_sized_record_goes_through_a_transaction(log_backend: Log, unique_topic: TopicName) -> None:
    """Big DAGs make big SubmitJob records (a 100 x 100 layered DAG is about 7 MiB): topics that carry
    specs take records far above Kafka's 1 MiB default, through the exactly-once path."""
    topic = unique_topic("big")
    log_backend.create_topics([TopicSpec(topic, 1, max_message_bytes=MAX_RECORD_BYTES)])
    big = bytes(range(256)) * (12 * 1024 * 1024 // 256)  # 12 MiB
    p = log_backend.transactional_producer(f"big-{topic}")
    p.begin()
    p.send(topic, b"k", big)
    p.commit({}, None)
    recs = _drain(_reader(log_backend, topic), 1, timeout_s=60)
    assert len(recs) == 1 and recs[0].value == big
    p.close()


def test_end_offsets(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("ends")
    log_backend.create_topics([TopicSpec(topic, 3)])
    tps = [TopicPartition(topic, i) for i in range(3)]
    assert log_backend.end_offsets(tps) == {tp: 0 for tp in tps}
    p = log_backend.producer("test")
    for i in range(7):
        p.send(topic, b"k", str(i).encode(), partition=1)
    p.send(topic, b"k", b"x", partition=2)
    p.flush()
    assert log_backend.end_offsets(tps) == {tps[0]: 0, tps[1]: 7, tps[2]: 1}


def test_create_topics_is_idempotent(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("idem")
    log_backend.create_topics([TopicSpec(topic, 3)])
    log_backend.create_topics([TopicSpec(topic, 3), TopicSpec(topic + "-b", 2)])
    log_backend.create_topics([TopicSpec(topic, 6)])  # existing topics are left as they are
    assert log_backend.partitions(topic) == 3
    assert log_backend.partitions(topic + "-b") == 2


def test_missing_topic_is_an_error_and_never_created(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("missing")
    with pytest.raises(LogError):
        log_backend.partitions(topic)
    with pytest.raises(LogError):
        log_backend.producer("test").send(topic, b"k", b"v")
    with pytest.raises(LogError):
        log_backend.partitions(topic)


def test_assign_and_seek(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("seek")
    log_backend.create_topics([TopicSpec(topic, 2)])
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    p = log_backend.producer("test")
    for i in range(5):
        p.send(topic, b"k", f"a{i}".encode(), partition=0)
        p.send(topic, b"k", f"b{i}".encode(), partition=1)
    p.flush()

    c = log_backend.consumer(None)
    c.assign({tp0: 2, tp1: 4})
    assert c.assignment() == [tp0, tp1]
    recs = _drain(c, 4)
    assert sorted((r.partition, r.value or b"") for r in recs) == [(0, b"a2"), (0, b"a3"), (0, b"a4"), (1, b"b4")]
    c.seek(tp0, 1)
    again = _drain(c, 4, timeout_s=2)
    assert [(r.partition, r.value) for r in again] == [(0, b"a1"), (0, b"a2"), (0, b"a3"), (0, b"a4")]
    with pytest.raises(LogError):
        c.commit({tp0: 1})  # assign-only consumers have no group
    c.close()


def test_group_shares_partitions_and_rebalances(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("group")
    log_backend.create_topics([TopicSpec(topic, 4)])
    everything = {TopicPartition(topic, i) for i in range(4)}
    events: dict[str, list[tuple[str, list[TopicPartition]]]] = {"a": [], "b": []}

    def member(name: str) -> Consumer:
        c = log_backend.consumer("g-" + topic, client_id=name)
        c.subscribe(
            [topic],
            on_assign=lambda tps: events[name].append(("assign", tps)),
            on_revoke=lambda tps: events[name].append(("revoke", tps)),
        )
        return c

    a = member("a")
    _wait_for(lambda: set(a.assignment()) == everything, [a])
    assert events["a"] == [("assign", sorted(everything))]

    b = member("b")
    _wait_for(
        lambda: (
            bool(a.assignment()) and bool(b.assignment()) and set(a.assignment()) | set(b.assignment()) == everything
        ),
        [a, b],
    )
    assert not set(a.assignment()) & set(b.assignment())
    assert any(kind == "revoke" for kind, _ in events["a"])
    assert any(kind == "assign" for kind, _ in events["b"])

    # Each member reads exactly the records of its own partitions.
    p = log_backend.producer("test")
    for i in range(4):
        p.send(topic, b"k", f"r{i}".encode(), partition=i)
    p.flush()
    got: dict[str, list[LogRecord]] = {"a": [], "b": []}
    deadline = time.monotonic() + 20
    while len(got["a"]) + len(got["b"]) < 4 and time.monotonic() < deadline:
        got["a"] += a.poll(timeout_s=0.1)
        got["b"] += b.poll(timeout_s=0.1)
    assert {TopicPartition(topic, r.partition) for r in got["a"]} == set(a.assignment())
    assert {TopicPartition(topic, r.partition) for r in got["b"]} == set(b.assignment())

    # When b leaves, a gets every partition back.
    b_had = set(b.assignment())
    b.close()
    n_assigns = sum(1 for kind, _ in events["a"] if kind == "assign")
    _wait_for(lambda: set(a.assignment()) == everything, [a])
    later = [tps for kind, tps in events["a"] if kind == "assign"][n_assigns:]
    assert b_had <= {tp for tps in later for tp in tps}
    a.close()


def test_committed_offsets_survive_a_new_consumer(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("commit")
    group = "g-" + topic
    log_backend.create_topics([TopicSpec(topic, 2)])
    tp0, tp1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
    p = log_backend.producer("test")
    for i in range(5):
        p.send(topic, b"k", str(i).encode(), partition=0)
    p.flush()

    c = log_backend.consumer(group)
    c.subscribe([topic])
    assert len(_drain(c, 5)) == 5
    c.commit({tp0: 3})
    assert c.committed([tp0, tp1]) == {tp0: 3, tp1: 0}
    c.close()

    log2 = _reopen(log_backend)
    try:
        c2 = log2.consumer(group)
        assert c2.committed([tp0, tp1]) == {tp0: 3, tp1: 0}
        c2.subscribe([topic])
        recs = _drain(c2, 2)
        assert [(r.offset, r.value) for r in recs] == [(3, b"3"), (4, b"4")]
        c2.close()
    finally:
        log2.close()


def test_transaction_commits_records_and_offsets_atomically(log_backend: Log, unique_topic: TopicName) -> None:
    src, dst = unique_topic("src"), unique_topic("dst")
    group = "g-" + src
    log_backend.create_topics([TopicSpec(src, 1), TopicSpec(dst, 2)])
    src_tp = TopicPartition(src, 0)
    p = log_backend.producer("test")
    for i in range(3):
        p.send(src, b"cmd", f"c{i}".encode())
    p.flush()

    c = log_backend.consumer(group)
    c.subscribe([src])
    assert len(_drain(c, 3)) == 3
    reader = _reader(log_backend, dst)
    txp = log_backend.transactional_producer("tx-" + src)
    txp.begin()
    txp.send(dst, b"a", b"e1", partition=0)
    txp.send(dst, b"a", b"e2", partition=0)
    txp.send(dst, b"b", b"e3", partition=1)
    # Until commit: neither the records nor the offsets are visible.
    assert _quiet(reader, 1.0) == []
    assert c.committed([src_tp]) == {src_tp: 0}

    last = txp.commit({src_tp: 3}, c)
    recs = _drain(reader, 3)
    assert sorted(r.value or b"" for r in recs) == [b"e1", b"e2", b"e3"]
    assert c.committed([src_tp]) == {src_tp: 3}
    for part in (0, 1):
        mine = [r.offset for r in recs if r.partition == part]
        assert last[TopicPartition(dst, part)] == max(mine)
    ends = log_backend.end_offsets([TopicPartition(dst, 0)])
    assert ends[TopicPartition(dst, 0)] > last[TopicPartition(dst, 0)]
    txp.close()
    c.close()
    reader.close()


def test_transaction_reports_the_offsets_of_reported_records(log_backend: Log, unique_topic: TopicName) -> None:
    """Records sent with ``report=False`` are committed like the others; the offset returned for a
    partition is that of its last record when that one was reported (the runtime reports only the
    last event of each partition it writes: one delivery report, not one per record, on Kafka)."""
    topic = unique_topic("report")
    log_backend.create_topics([TopicSpec(topic, 2)])
    reader = _reader(log_backend, topic)
    txp = log_backend.transactional_producer("tx-" + topic)
    for rnd in range(2):  # the second transaction: no report of the first is taken for its own
        txp.begin()
        for i in range(5):
            txp.send(topic, b"k", f"r{rnd}-{i}".encode(), partition=0, report=i == 4)
        txp.send(topic, b"k", f"r{rnd}-p1".encode(), partition=1, report=False)
        last = txp.commit({}, None)
        recs = _drain(reader, 6)
        assert sorted(r.value or b"" for r in recs) == sorted(
            [f"r{rnd}-{i}".encode() for i in range(5)] + [f"r{rnd}-p1".encode()])
        assert last[TopicPartition(topic, 0)] == max(r.offset for r in recs if r.partition == 0)
    txp.close()
    reader.close()


def test_aborted_transaction_is_never_visible(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("abort")
    log_backend.create_topics([TopicSpec(topic, 1)])
    reader = _reader(log_backend, topic)
    txp = log_backend.transactional_producer("tx-" + topic)
    txp.begin()
    txp.send(topic, b"k", b"aborted-1")
    txp.send(topic, b"k", b"aborted-2")
    txp.abort()
    txp.begin()
    txp.send(topic, b"k", b"kept")
    last = txp.commit({}, None)

    recs = _drain(reader, 1) + _quiet(reader, 1.0)
    assert [r.value for r in recs] == [b"kept"]
    assert last == {TopicPartition(topic, 0): recs[0].offset}
    txp.close()
    reader.close()


def test_newer_transactional_producer_fences_the_older(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("fence")
    log_backend.create_topics([TopicSpec(topic, 1)])
    old = log_backend.transactional_producer("tx-" + topic)
    old.begin()
    old.send(topic, b"k", b"zombie")

    new = log_backend.transactional_producer("tx-" + topic)
    with pytest.raises(FencedError):
        old.commit({}, None)
    new.begin()
    new.send(topic, b"k", b"successor")
    new.commit({}, None)

    # Fenced while idle: the next transaction fails (at the latest on commit).
    newest = log_backend.transactional_producer("tx-" + topic)
    new.begin()
    with pytest.raises(FencedError):
        new.send(topic, b"k", b"zombie-2")
        new.commit({}, None)
    newest.begin()
    newest.send(topic, b"k", b"newest")
    newest.commit({}, None)

    reader = _reader(log_backend, topic)
    recs = _drain(reader, 2) + _quiet(reader, 1.0)
    assert [r.value for r in recs] == [b"successor", b"newest"]
    for p in (old, new, newest):
        p.close()
    reader.close()


# -- queues (share groups) -----------------------------------------------------------


def _member(log: Log, group: str, topic: str, name: str, *, max_records: int = 1, lock_ms: int = 30_000,
            max_deliveries: int = 5) -> QueueConsumer:
    q = log.queue_consumer(group, client_id=name, max_records=max_records, lock_ms=lock_ms,
                           max_deliveries=max_deliveries)
    q.subscribe([topic])
    return q


def _acquire(q: QueueConsumer, want: int = 1, timeout_s: float = 30.0) -> list[QueuedRecord]:
    """Poll until at least ``want`` records were acquired (or the deadline passed)."""
    out: list[QueuedRecord] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < want and time.monotonic() < deadline:
        out.extend(q.poll(timeout_s=0.2))
    return out


def _ack_all(q: QueueConsumer, recs: list[QueuedRecord], ack: Ack = Ack.ACCEPT) -> None:
    for r in recs:
        q.acknowledge(r, ack)
    q.commit()


def _send(log: Log, topic: str, values: list[bytes], partition: int = 0) -> None:
    p = log.producer("test")
    for v in values:
        p.send(topic, b"k", v, partition=partition)
    p.flush()


def test_queue_a_busy_member_holds_nothing_back(log_backend: Log, unique_topic: TopicName) -> None:
    """Records go to whichever member polls: one member holding a record (busy) does not keep the
    next records from an idle member (the head-of-line case of consumer groups)."""
    topic = unique_topic("queue")
    log_backend.create_topics([TopicSpec(topic, 1)])
    group = "q-" + topic
    busy, idle = _member(log_backend, group, topic, "busy"), _member(log_backend, group, topic, "idle")
    _send(log_backend, topic, [b"long"])
    held = _acquire(busy)
    assert [r.value for r in held] == [b"long"] and held[0].delivery_count == 1
    _send(log_backend, topic, [b"a", b"b", b"c"])
    got: list[QueuedRecord] = []
    while len(got) < 3:
        recs = _acquire(idle)
        assert recs, f"idle member got {[r.value for r in got]} while the busy one held its record"
        got += recs
        _ack_all(idle, recs)
    assert [r.value for r in got] == [b"a", b"b", b"c"]  # lowest offset first, and never the held one
    _ack_all(busy, held)
    assert _acquire(idle, timeout_s=1.5) == []  # accepted records are never delivered again
    busy.close()
    idle.close()


def test_queue_release_and_lock_expiry_redeliver(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("queue")
    log_backend.create_topics([TopicSpec(topic, 1)])
    group = "q-" + topic
    a = _member(log_backend, group, topic, "a", lock_ms=1000)
    b = _member(log_backend, group, topic, "b", lock_ms=1000)
    _send(log_backend, topic, [b"r"])
    first = _acquire(a)
    assert [(r.value, r.delivery_count) for r in first] == [(b"r", 1)]
    _ack_all(a, first, Ack.RELEASE)  # given back: available at once, to any member
    holder, again = _acquire_any([b, a])
    assert [(r.value, r.delivery_count) for r in again] == [(b"r", 2)]
    # The holder neither accepts nor releases: after the lock (1 s) the record is available again.
    other = a if holder is b else b
    third = _acquire(other, timeout_s=30)
    assert [(r.value, r.delivery_count) for r in third] == [(b"r", 3)]
    _ack_all(other, third)
    _ack_all(holder, again)  # the late acknowledgement of a lost lock changes nothing
    assert _acquire(a, timeout_s=1.0) + _acquire(b, timeout_s=0.5) == []
    a.close()
    b.close()


def _acquire_any(members: list[QueueConsumer], timeout_s: float = 30.0) -> tuple[QueueConsumer, list[QueuedRecord]]:
    """The first member to acquire something, and what it acquired."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for m in members:
            recs = m.poll(0.1)
            if recs:
                return m, recs
    raise AssertionError("no member acquired anything")


def test_queue_reject_and_delivery_limit(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("queue")
    log_backend.create_topics([TopicSpec(topic, 1)])
    q = _member(log_backend, "q-" + topic, topic, "m", max_deliveries=2)
    _send(log_backend, topic, [b"bad", b"poison", b"ok"])
    seen: list[tuple[bytes | None, int]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        recs = q.poll(0.2)
        for r in recs:
            seen.append((r.value, r.delivery_count))
            q.acknowledge(r, Ack.REJECT if r.value == b"bad" else Ack.RELEASE if r.value == b"poison" else Ack.ACCEPT)
        q.commit()
        if (b"ok", 1) in seen and seen.count((b"poison", 2)) == 1 and not recs:
            break
    # rejected once, never again; released up to the limit (2 deliveries), then archived
    assert seen.count((b"bad", 1)) == 1 and [v for v, _ in seen].count(b"bad") == 1
    assert [n for v, n in seen if v == b"poison"] == [1, 2]
    assert (b"ok", 1) in seen
    q.close()


def test_queue_records_of_a_member_that_leaves_go_to_the_others(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("queue")
    log_backend.create_topics([TopicSpec(topic, 1)])
    group = "q-" + topic
    gone = _member(log_backend, group, topic, "gone", max_records=10)
    _send(log_backend, topic, [b"x", b"y"])
    held = _acquire(gone, 2)
    assert sorted(r.value or b"" for r in held) == [b"x", b"y"]
    gone.close()  # a member that leaves (or dies) without acknowledging gives its records back
    stays = _member(log_backend, group, topic, "stays", max_records=10)
    got = _acquire(stays, 2)
    assert sorted((r.value or b"", r.delivery_count) for r in got) == [(b"x", 2), (b"y", 2)]
    _ack_all(stays, got)
    stays.close()


def test_queue_reads_committed_records_only(log_backend: Log, unique_topic: TopicName) -> None:
    topic = unique_topic("queue")
    log_backend.create_topics([TopicSpec(topic, 1)])
    q = _member(log_backend, "q-" + topic, topic, "m", max_records=10)
    txp = log_backend.transactional_producer("tx-" + topic)
    txp.begin()
    txp.send(topic, b"k", b"aborted", partition=0)
    txp.abort()
    txp.begin()
    txp.send(topic, b"k", b"open", partition=0)
    assert _acquire(q, timeout_s=1.5) == []
    txp.commit({}, None)
    got = _acquire(q)
    assert [r.value for r in got] == [b"open"]
    _ack_all(q, got)
    txp.close()
    q.close()


def test_embedded_queue_is_fair_across_partitions(tmp_path: Path, unique_topic: TopicName) -> None:
    """Dispatch records are keyed by tenant: one tenant's backlog on its partition delays another
    tenant's records by one record per round, not by the backlog's length."""
    from dagfold.log.embedded import EmbeddedLog

    log = EmbeddedLog(tmp_path / "log")
    topic = unique_topic("fair")
    log.create_topics([TopicSpec(topic, 4)])
    _send(log, topic, [b"A%d" % i for i in range(1000)], partition=1)
    _send(log, topic, [b"B%d" % i for i in range(10)], partition=3)
    q = _member(log, "q-" + topic, topic, "m", max_records=4)
    order: list[bytes] = []
    while len(order) < 40:
        recs = _acquire(q, timeout_s=2)
        order += [r.value or b"" for r in recs]
        _ack_all(q, recs)
    assert [v for v in order[:20] if v.startswith(b"B")] == [b"B%d" % i for i in range(10)]
    q.close()
    log.close()


def test_embedded_queue_done_state_survives_reopen(tmp_path: Path, unique_topic: TopicName) -> None:
    from dagfold.log.embedded import EmbeddedLog

    log = EmbeddedLog(tmp_path / "log")
    topic = unique_topic("qdurable")
    log.create_topics([TopicSpec(topic, 1)])
    _send(log, topic, [b"0", b"1", b"2", b"3"])
    q = _member(log, "g", topic, "m", max_records=4)
    recs = _acquire(q, 4)
    q.acknowledge(recs[0], Ack.ACCEPT)
    q.acknowledge(recs[1], Ack.RELEASE)
    q.acknowledge(recs[2], Ack.REJECT)
    q.acknowledge(recs[3], Ack.ACCEPT)
    q.commit()
    log.close()  # like a kill -9 after the commit: locks and delivery counts are gone, done stays

    log = EmbeddedLog(tmp_path / "log")
    try:
        q = _member(log, "g", topic, "m", max_records=4)
        assert [r.value for r in _acquire(q, 1)] == [b"1"]
    finally:
        log.close()


# -- one backend only ------------------------------------------------------------


@pytest.mark.kafka
@pytest.mark.parametrize("partitioner", ["murmur2_random", "consistent_random"])
def test_plain_confluent_producer_routes_like_the_logs_partitioner(
        kafka_bootstrap: str, unique_topic: TopicName, partitioner: str) -> None:
    """A librdkafka producer set to the deployment's partitioner routes as dagfold does: murmur2
    (the default, as the Java client's) or CRC-32 (kept for data written before murmur2)."""
    from confluent_kafka import Producer

    from dagfold.log.kafka import KafkaLog

    topic = unique_topic("upstream")
    lg = KafkaLog(kafka_bootstrap, partitioner=partitioner)
    lg.create_topics([TopicSpec(topic, 7)])
    landed: dict[bytes, int] = {}

    def delivered(err: object, msg: object) -> None:
        assert err is None, err
        landed[msg.key()] = msg.partition()  # type: ignore[attr-defined]

    producer = Producer({"bootstrap.servers": kafka_bootstrap, "partitioner": partitioner})
    keys = [f"job-{i:04d}".encode() for i in range(60)] + [b"a", b"ab", b"abc", "jöb-ü".encode()]
    if partitioner == "murmur2_random":  # consistent_random partitions an empty key at random
        keys.append(b"")
    for k in keys:
        producer.produce(topic, key=k, value=b"x", on_delivery=delivered)
    assert producer.flush(30) == 0
    assert landed == {k: lg.partition_for(k, 7) for k in keys}
    if partitioner == "murmur2_random":
        assert landed == {k: partition_for(k, 7) for k in keys}


def test_embedded_data_survives_close_and_reopen(tmp_path: Path, unique_topic: TopicName) -> None:
    from dagfold.log.embedded import EmbeddedLog

    topic = unique_topic("durable")
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics([TopicSpec(topic, 2, retention_ms=1234)])
    p = log.producer("test")
    for i in range(10):
        p.send(topic, f"k{i}".encode(), str(i).encode())
    p.flush()
    c = log.consumer("g")
    c.commit({TopicPartition(topic, 0): 1})
    log.close()

    log = EmbeddedLog(tmp_path / "log")
    try:
        assert log.partitions(topic) == 2
        recs = _drain(_reader(log, topic), 10, timeout_s=2)
        assert sorted(r.value or b"" for r in recs) == sorted(str(i).encode() for i in range(10))
        assert log.consumer("g").committed([TopicPartition(topic, 0)]) == {TopicPartition(topic, 0): 1}
        tps = [TopicPartition(topic, i) for i in range(2)]
        assert sum(log.end_offsets(tps).values()) == 10
    finally:
        log.close()


def test_position_reaches_the_end_offset_past_transaction_markers(log_backend: Log, unique_topic: TopicName) -> None:
    """Catch-up relies on this: reading to the end means position >= end offset, on both backends."""
    topic = unique_topic("pos")
    log_backend.create_topics([TopicSpec(topic, 1)])
    tp = TopicPartition(topic, 0)
    txp = log_backend.transactional_producer("tx-" + topic)
    for i in range(3):
        txp.begin()
        txp.send(topic, b"k", f"v{i}".encode(), partition=0)
        txp.commit({}, None)
    end = log_backend.end_offsets([tp])[tp]
    reader = log_backend.consumer(None)
    reader.assign({tp: 0})
    seen: list[bytes] = []
    deadline = time.monotonic() + 15
    while reader.position(tp) < end and time.monotonic() < deadline:
        seen.extend(r.value or b"" for r in reader.poll(100, 0.2))
    assert reader.position(tp) >= end
    assert seen == [b"v0", b"v1", b"v2"]
    txp.close()
    reader.close()


def test_embedded_reads_from_the_in_memory_tail_equal_reads_from_disk(
    tmp_path: Path, unique_topic: TopicName, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Caught-up consumers read the newest records from memory; they must get exactly what a
    reader of the data on disk (a reopened log, whose tail is empty) gets, across the tail's
    trims, a record too large to keep in memory, and reads that start before the tail."""
    from dagfold.log import embedded
    from dagfold.log.embedded import EmbeddedLog

    monkeypatch.setattr(embedded, "TAIL_RECORDS", 7)
    monkeypatch.setattr(embedded, "TAIL_BYTES", 200)
    monkeypatch.setattr(embedded, "TAIL_RECORD_MAX", 64)
    topic = unique_topic("tail")
    log = EmbeddedLog(tmp_path / "log")
    log.create_topics([TopicSpec(topic, 2)])
    tps = [TopicPartition(topic, p) for p in range(2)]
    txp = log.transactional_producer("tx")
    sizes = [3, 10, 40, 100, 5, 5, 30, 2, 70, 1, 1, 1, 50, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 60]
    live: list[list[LogRecord]] = []
    for i, n in enumerate(sizes):
        txp.begin()
        txp.send(topic, f"k{i}".encode(), bytes([65 + i % 26]) * n, partition=i % 2)
        if i % 3 == 0:
            txp.send(topic, b"x", f"second {i}".encode(), partition=(i + 1) % 2)
        txp.commit({}, None)
        # every start offset, every batch size, as the log stands after each transaction
        live.append([r for tp in tps for off in range(log.end_offsets([tp])[tp] + 1)
                     for size in (1, 3, 50) for r in log.read(tp, off, size)])
    ends = log.end_offsets(tps)
    log.close()

    disk = EmbeddedLog(tmp_path / "log")
    try:
        assert disk.end_offsets(tps) == ends
        assert not disk._tails  # a reopened log reads from RocksDB only
        full = [r for tp in tps for off in range(ends[tp] + 1) for size in (1, 3, 50) for r in disk.read(tp, off, size)]
        assert live[-1] == full
        for upto in live:  # earlier views are prefixes of the final one, record for record
            for r in upto:
                assert disk.read(TopicPartition(r.topic, r.partition), r.offset, 1) == [r]
    finally:
        disk.close()


def test_embedded_tail_holds_at_most_a_sixteenth_more_than_its_bound() -> None:
    """A tail lets go of the records dropped from its front in bulk. It did so once they were TAIL_RECORDS: each
    busy partition's tail swung between 4,096 and 8,192 records, and the 20 or so busy ones rose and fell by tens of
    MB over thousands of jobs (issue 25, tests/test_soak.py). Now once they pass a sixteenth of it."""
    from dagfold.log import embedded

    tail = embedded._Tail(0)
    most = 0
    for off in range(3 * embedded.TAIL_RECORDS):
        tail.append(LogRecord("t", 0, off, b"k", b"v", 0))
        most = max(most, len(tail.records))
        assert tail.read(off, 1) == [LogRecord("t", 0, off, b"k", b"v", 0)]
    assert most <= embedded.TAIL_RECORDS * 17 // 16
    assert len(tail.records) - tail.head == embedded.TAIL_RECORDS
    assert tail.read(3 * embedded.TAIL_RECORDS - embedded.TAIL_RECORDS, 1) is not None
    assert tail.read(3 * embedded.TAIL_RECORDS - embedded.TAIL_RECORDS - 1, 1) is None


def test_the_partitioner_caches_the_keys_of_the_jobs_in_flight_only() -> None:
    """murmur2 in Python is slow, so each key's partition is cached; its keys are job IDs, and at 65,536 the cache
    grew with every job of a process for its first 65,536 (about 190 B a job: issue 25)."""
    from dagfold.log.base import murmur2_partition

    assert murmur2_partition.cache_info().maxsize is not None
    assert murmur2_partition.cache_info().maxsize <= 1 << 12
