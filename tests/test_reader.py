"""The reader runtime (``dagfold.log.reader``): positions and state in one write batch, so a reader
that dies anywhere (a failed write batch, a handler that raises, kill -9 between batches or inside
one) resumes applying every record exactly once; a group reader commits only what its handler took."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dagfold import metrics
from dagfold.log.base import LogRecord, TopicPartition, TopicSpec
from dagfold.log.embedded import EmbeddedLog
from dagfold.log.reader import GroupReader, Reader, position_key
from dagfold.projections.exceptions import StoreError
from dagfold.projections.store import ReadModelStore, ReadModelTxn

ROOT = Path(__file__).resolve().parent.parent
TOPIC = "t"
PARTITIONS = 2


def fill(log: EmbeddedLog, n: int, start: int = 0) -> None:
    p = log.producer("test")
    for i in range(start, start + n):
        p.send(TOPIC, str(i).encode(), str(i).encode(), partition=i % PARTITIONS)
    p.flush()


def count(records: list[LogRecord], txn: ReadModelTxn) -> None:
    """The handler of these tests: how often each record was applied (``c|<value>``)."""
    for rec in records:
        key = b"c|" + rec.value
        txn.put(key, int(txn.get(key) or 0) + 1)


def applied(store: ReadModelStore) -> dict[int, int]:
    return {int(k[2:]): int(v) for k, v in ((k, store.get(k)) for k, _ in store.scan(b"c|"))}


@pytest.fixture
def log(tmp_path: Path) -> Any:
    lg = EmbeddedLog(tmp_path / "log")
    lg.create_topics([TopicSpec(TOPIC, PARTITIONS)])
    yield lg
    lg.close()


class Recording(ReadModelStore):
    """A store that remembers the keys of each write batch, and fails the ``fail_at``-th one (1-based)."""

    def __init__(self, path: Path, fail_at: int = 0) -> None:
        super().__init__(path)
        self.batches: list[set[bytes]] = []
        self.fail_at = fail_at

    def commit(self, txn: ReadModelTxn) -> None:
        if self.fail_at and len(self.batches) + 1 == self.fail_at:
            self.fail_at = 0
            raise StoreError("injected: the disk is full")
        self.batches.append(set(txn._dirty))  # noqa: SLF001 - the keys of this batch
        super().commit(txn)


def test_positions_go_into_the_handler_s_write_batch(tmp_path: Path, log: EmbeddedLog) -> None:
    fill(log, 10)
    store = Recording(tmp_path / "store")
    reader = Reader(log, "test", (TOPIC,), store, count, batch_max_records=3)
    try:
        reader.catch_up(timeout_s=10, idle_s=0.3)
        assert store.batches, "nothing written"
        for keys in store.batches:
            state = {k for k in keys if k.startswith(b"c|")}
            positions = keys & {position_key(TOPIC, p) for p in range(PARTITIONS)}
            assert state and positions, keys
        assert reader.positions(TOPIC) == {0: 5, 1: 5}
        assert applied(store) == dict.fromkeys(range(10), 1)
    finally:
        reader.close()
        store.close()


@pytest.mark.parametrize("fault", ["write batch 2", "write batch 3", "handler"])
def test_a_failed_batch_writes_nothing_and_a_restart_applies_each_record_once(
        tmp_path: Path, log: EmbeddedLog, fault: str) -> None:
    fill(log, 20)
    store = Recording(tmp_path / "store", fail_at=int(fault[-1]) if fault.startswith("write batch") else 0)
    calls = 0

    def handler(records: list[LogRecord], txn: ReadModelTxn) -> None:
        nonlocal calls
        calls += 1
        count(records, txn)
        if fault == "handler" and calls == 3:
            raise RuntimeError("injected: the handler failed after writing into the batch")

    reader = Reader(log, "test", (TOPIC,), store, handler, batch_max_records=4)
    with pytest.raises((StoreError, RuntimeError), match="injected"):
        reader.catch_up(timeout_s=10, idle_s=0.3)
    reader.close()
    before = applied(store)
    assert 0 < sum(before.values()) < 20 and set(before.values()) == {1}
    assert sum(reader.positions(TOPIC).values()) == sum(before.values()), "positions are what was applied"

    again = Reader(log, "test", (TOPIC,), store, count, batch_max_records=4)  # the restart
    try:
        again.catch_up(timeout_s=10, idle_s=0.3)
        assert applied(store) == dict.fromkeys(range(20), 1), "each record once: none twice, none skipped"
        fill(log, 5, start=20)
        again.catch_up(timeout_s=10, idle_s=0.3)
        assert applied(store) == dict.fromkeys(range(25), 1)
    finally:
        again.close()
        store.close()


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from dagfold.log.embedded import EmbeddedLog
    from dagfold.log.reader import Reader
    from dagfold.projections.store import ReadModelStore

    def count(records, txn):
        for rec in records:
            key = b"c|" + rec.value
            txn.put(key, int(txn.get(key) or 0) + 1)
        time.sleep(0.002)  # a slow fold: the kill lands between batches or inside one

    done = 0
    def committed():
        global done
        done += 1
        print(done, flush=True)

    tmp = Path(sys.argv[1])
    log = EmbeddedLog(tmp / "log")
    store = ReadModelStore(tmp / "store")
    Reader(log, "child", ("t",), store, count, after_commit=committed, batch_max_records=7).catch_up(60, 5)
    print("finished", flush=True)
""")


def test_killed_with_sigkill_mid_run_the_reader_resumes_without_double_applying_or_skipping(
        tmp_path: Path, log: EmbeddedLog) -> None:
    n = 3000
    fill(log, n)
    log.close()  # the child opens it
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        assert child.stdout is not None
        for line in child.stdout:
            if line.strip() == "finished" or int(line) >= 40:
                break
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)

    relog = EmbeddedLog(tmp_path / "log")
    store = ReadModelStore(tmp_path / "store")
    try:
        before = applied(store)
        assert 0 < len(before) < n, "killed mid-run"
        assert set(before.values()) == {1}
        reader = Reader(relog, "test", (TOPIC,), store, count)
        reader.catch_up(timeout_s=30, idle_s=0.5)
        reader.close()
        assert applied(store) == dict.fromkeys(range(n), 1)
    finally:
        store.close()
        relog.close()


def test_the_lag_gauge_is_labelled_by_the_reader(tmp_path: Path, log: EmbeddedLog) -> None:
    fill(log, 6)
    store = ReadModelStore(tmp_path / "store")
    reader = Reader(log, "lag-test", (TOPIC,), store, count)
    try:
        reader.step(0.1)  # assigns; reads what it can
        reader.report_lag()
        gauge = metrics.CONSUMER_LAG.labels("lag-test", TOPIC)
        assert gauge._value.get() == 6 - sum(reader.positions(TOPIC).values())  # noqa: SLF001
        reader.catch_up(timeout_s=5, idle_s=0.3)
        reader.report_lag()
        assert gauge._value.get() == 0  # noqa: SLF001
    finally:
        reader.close()
        store.close()


def test_a_reader_waits_for_its_topic_and_stops(tmp_path: Path) -> None:
    lg = EmbeddedLog(tmp_path / "log")
    store = ReadModelStore(tmp_path / "store")
    stop = threading.Event()
    reader = Reader(lg, "late", (TOPIC,), store, count)
    th = threading.Thread(target=reader.run, args=(stop,))
    th.start()
    try:
        time.sleep(0.3)
        lg.create_topics([TopicSpec(TOPIC, PARTITIONS)])
        fill(lg, 4)
        reader._checked_at = 0.0  # noqa: SLF001 - look for the topic now, not in partition_check_s
        deadline = time.monotonic() + 10
        while applied(store) != dict.fromkeys(range(4), 1):
            assert time.monotonic() < deadline, applied(store)
            time.sleep(0.05)
    finally:
        stop.set()
        th.join(10)
        assert not th.is_alive()
        reader.close()
        store.close()
        lg.close()


def test_a_group_reader_commits_only_what_its_handler_took(log: EmbeddedLog) -> None:
    fill(log, 8)
    seen: list[int] = []
    fail = True

    def handler(records: list[LogRecord]) -> None:
        if fail and records:
            raise RuntimeError("injected")
        seen.extend(int(r.value) for r in records)

    reader = GroupReader(log, "group-test", TOPIC, "g", handler)
    deadline = time.monotonic() + 10
    with pytest.raises(RuntimeError):
        while time.monotonic() < deadline:
            reader.step(0.1)
    reader.close()
    probe = log.consumer("g")
    assert probe.committed([TopicPartition(TOPIC, p) for p in range(PARTITIONS)]) == \
        {TopicPartition(TOPIC, p): 0 for p in range(PARTITIONS)}
    probe.close()

    fail = False
    reader = GroupReader(log, "group-test", TOPIC, "g", handler)
    try:
        while len(seen) < 8:
            assert time.monotonic() < deadline + 10
            reader.step(0.1)
        assert sorted(seen) == list(range(8))
    finally:
        reader.close()
