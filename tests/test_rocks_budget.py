"""One RocksDB memory budget per process (dagfold/rocks.py): the memtables of every store together stay
near it however much is written. Before it each store kept up to two 64 MiB memtables of its own, freed only
when full: the bulk of issue 25's growth of `dagfold up` (tests/test_soak.py runs the whole stack)."""

from __future__ import annotations

import os
from pathlib import Path

from dagfold import rocks
from dagfold.projections.store import ReadModelStore
from dagfold.state import PartitionStore


def memtables(*stores: PartitionStore | ReadModelStore) -> int:
    return sum(int(s._db.property_int_value("rocksdb.cur-size-all-mem-tables") or 0) for s in stores)


def test_the_memtables_of_every_store_share_one_budget(tmp_path: Path) -> None:
    stores = [PartitionStore(tmp_path / f"p{i}") for i in range(3)]
    model = ReadModelStore(tmp_path / "model")
    value = os.urandom(4096)
    try:
        for i in range(10_000):  # 40 MB into each of the three, 120 MB in all
            for s in stores:
                s.write({f"k{i:08d}".encode(): value})
        assert memtables(*stores, model) <= rocks.MEMTABLE_BUDGET + rocks.WRITE_BUFFER
        for s in stores:  # what was flushed is still there
            assert s.raw_get(b"k00000000") == value and s.raw_get(b"k00009999") == value
    finally:
        for s in stores:
            s.close()
        model.close()
