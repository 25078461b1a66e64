"""The decoded values a partition store keeps between transactions (``ValueCache``): what a later
transaction reads is always the committed state, whatever the transactions before it did."""

from __future__ import annotations

from pathlib import Path

import pytest

from dagfold.config import SchedulerOptions
from dagfold.jobspec import load_spec_text, to_job_spec
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.state import MemoryStore, PartitionStore, PartitionTransaction


def _commit(store: MemoryStore | PartitionStore, **values: object) -> None:
    txn = PartitionTransaction(store)
    for k, v in values.items():
        txn.put(k.encode(), v)
    txn.commit()


def _refuse_reads(store: MemoryStore | PartitionStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_read(key: bytes) -> bytes | None:
        raise AssertionError(f"read {key!r} from the store, not from the cache")

    monkeypatch.setattr(store, "raw_get", no_read)


def test_a_committed_or_read_value_is_served_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = PartitionStore(tmp_path / "p", cache_values=100)
    _commit(store, a={"n": 1}, gone={"n": 0})
    _commit(store, gone=None)
    reopened = PartitionStore(tmp_path / "q", cache_values=100)
    _commit(reopened, b={"n": 2})
    reopened.close()
    reopened = PartitionStore(tmp_path / "q", cache_values=100)
    reader = PartitionTransaction(reopened)
    assert reader.get(b"b") == {"n": 2}  # read from RocksDB by a transaction that writes nothing
    reader.commit()
    _refuse_reads(store, monkeypatch)
    txn = PartitionTransaction(store)
    assert txn.get(b"a") == {"n": 1}
    assert txn.get(b"gone") is None
    _refuse_reads(reopened, monkeypatch)
    assert PartitionTransaction(reopened).get(b"b") == {"n": 2}
    store.close()
    reopened.close()


def test_a_dropped_transaction_or_rolled_back_command_leaves_the_cache_as_committed() -> None:
    store = MemoryStore(cache_values=100)
    _commit(store, k={"v": 1})
    dropped = PartitionTransaction(store)
    dropped.put(b"k", {"v": 2})
    dropped.put(b"new", {"v": 9})  # never committed (a log transaction that aborted)

    def fails(txn: PartitionTransaction) -> None:
        txn.put(b"k", {"v": 3})
        raise ValueError("poison command")

    txn = PartitionTransaction(store)
    with pytest.raises(ValueError):
        txn.atomically(fails, txn)
    txn.commit()
    after = PartitionTransaction(store)
    assert after.get(b"k") == {"v": 1}
    assert after.get(b"new") is None
    assert store.values is not None and store.values.values[b"k"] == {"v": 1}


def test_the_cache_keeps_at_most_its_bound_and_reads_the_rest_from_the_store() -> None:
    store = MemoryStore(cache_values=8)
    for i in range(20):
        _commit(store, **{f"k{i}": {"i": i}})
    assert store.values is not None and len(store.values.values) <= 8
    txn = PartitionTransaction(store)
    assert [txn.get(f"k{i}".encode()) for i in range(20)] == [{"i": i} for i in range(20)]


SPEC = """
id: J
retry: {max_attempts: 2, initial_interval_s: 1}
tasks:
  - {id: a}
  - {id: b, depends_on: [a]}
  - {id: c, depends_on: [a]}
  - {id: d, depends_on: [b, c]}
"""


def test_the_scheduler_fold_decides_the_same_with_and_without_the_cache() -> None:
    """Failures, a retry timer, a lost worker and a redrive, folded with no cache and with one so small
    that it drops values all the time: the same events, the same state, and replay rebuilds it."""
    runs = []
    for store in (MemoryStore(), MemoryStore(cache_values=6)):
        h = FoldHarness(SchedulerOptions(lease_timeout_s=10), store=store)
        h.submit(to_job_spec(load_spec_text(SPEC)))
        d = h.dispatched.popleft()
        h.report("Started", d)
        h.report("Failed", d, reason="boom", exit_code=1)
        h.advance(60_000)  # the retry's backoff timer
        d = h.dispatched.popleft()
        h.report("Started", d)
        h.advance(10_001)  # the worker died: the lease is reclaimed, the attempt runs again
        h.run_all()
        h.process({"type": "dagfold.command.CancelJob", "job_id": "J", "reason": "late", "requested_at_ms": 0})
        runs.append((h.events, h.digest(), h.replayed_digest(), h.job("J")))
    assert runs[0][3] is not None and runs[0][3]["state"] == "succeeded"
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] == runs[1][1] == runs[1][2]


def test_a_finished_jobs_records_and_its_deleted_timers_leave_the_cache() -> None:
    """Issue 25: the cache kept every finished job's records (and a None for each deleted timer, whose key
    holds its due time) until its bound pushed them out, so `dagfold up`'s memory grew with every job up to
    16,384 values per partition. Once the job has ended none of its keys stays; a redrive then reads them
    from the store and runs the job to its end as before."""
    store = MemoryStore(cache_values=100_000)
    h = FoldHarness(SchedulerOptions(lease_timeout_s=10), store=store)
    h.submit(to_job_spec(load_spec_text(SPEC.replace("id: J", "id: J\ntimeouts: {start_to_close_s: 30}"))))
    for _ in range(2):  # both attempts of a fail: the job fails, b, c and d are skipped
        d = h.dispatched.popleft()
        h.report("Started", d)
        h.report("Failed", d, reason="boom", exit_code=1)
        h.advance(60_000)  # the backoff timer
    assert h.job("J") is not None and h.job("J")["state"] == "failed"
    assert store.values is not None
    assert [k for k in store.values.values if b"J" in k] == []
    assert not [k for k in store.data if k.startswith(b"T\x1f")]  # the timers are gone from the store too
    h.process({"type": "dagfold.command.RedriveJob", "job_id": "J", "requested_at_ms": 0})
    h.run_all()
    assert h.job("J") is not None and h.job("J")["state"] == "succeeded"
    assert [k for k in store.values.values if b"J" in k] == []
    assert h.digest() == h.replayed_digest()
