"""The log contract (dagfold/log/base.py), run against both backends.

Every test in the first part takes ``log_backend`` (embedded and Kafka), so the two
backends are held to the same observable behaviour. The Kafka-only and embedded-only
tests at the end cover what only one of them can show.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dagfold.exceptions import FencedError, LogError
from dagfold.log.base import MAX_RECORD_BYTES, Consumer, Log, LogRecord, TopicPartition, TopicSpec, partition_for

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
