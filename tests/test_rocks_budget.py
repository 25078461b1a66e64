"""One RocksDB memory budget per process (dagfold/rocks.py): the memtables of every store together stay
near it however much is written. Before it each store kept up to two 64 MiB memtables of its own, freed only
when full: the bulk of issue 25's growth of `dagfold up` (tests/test_soak.py runs the whole stack)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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


def test_a_freed_large_block_goes_back_to_the_os_after_a_store_opens(tmp_path: Path) -> None:
    """RocksDB's memtables are 2 MiB blocks: mapped, and unmapped when their memtable is flushed. glibc raised its
    mmap threshold to the size of each mapped block freed, so every later block came from its heaps, whose freed
    space the process kept (issue 25). A store fixes the threshold (``rocks.tune_malloc``): a block freed and asked
    for again is mapped again."""
    import ctypes

    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallinfo2") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        pytest.skip("glibc >= 2.33 without an operator's threshold")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    store = PartitionStore(tmp_path / "p")
    try:
        size = 2 << 20
        libc.free(libc.malloc(size))  # a mapped block freed: glibc's threshold rose past it
        mapped = libc.mallinfo2().hblkhd
        block = libc.malloc(size)
        try:
            assert libc.mallinfo2().hblkhd - mapped >= size  # mapped again, not carved out of a heap
        finally:
            libc.free(block)
    finally:
        store.close()
