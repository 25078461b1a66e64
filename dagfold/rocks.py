"""One memory budget for every RocksDB store a process opens.

`dagfold up` opens about a dozen RocksDB databases in one process: the embedded log, one state store per
scheduler partition (8 by default), the read models, the callback ledger, the allocator's state. With
RocksDB's defaults each of them keeps up to two 64 MiB memtables and its own 32 MiB block cache, and a
memtable is only freed when it is flushed, which happens when it is full, never on idle. So the process's
memory grew with every job it ran until each memtable had filled once (issue 25: 257 MB to 796 MB over
about 8,600 jobs, not given back after a minute idle; tests/test_soak.py). Every store now opens with
``options()``: the memtables of all of them share one ``WriteBufferManager`` (when their sum passes
``MEMTABLE_BUDGET`` the store being written flushes its memtable), none grows past ``WRITE_BUFFER``, and
their blocks share one LRU cache of ``BLOCK_CACHE``. A flush writes a small level-0 file where a full
64 MiB memtable wrote a large one; compaction merges them as before.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rocksdict import AccessType, BlockBasedOptions, Cache, Options, Rdict, WriteBufferManager

MEMTABLE_BUDGET = 64 << 20  # every memtable of the process together
WRITE_BUFFER = 16 << 20  # one store's memtable (RocksDB's default: 64 MiB)
BLOCK_CACHE = 64 << 20  # uncompressed blocks read from SST files, shared by every store

_lock = threading.Lock()
_shared: tuple[WriteBufferManager, Cache] | None = None


def _budget() -> tuple[WriteBufferManager, Cache]:
    global _shared
    with _lock:
        if _shared is None:
            _shared = (WriteBufferManager(MEMTABLE_BUDGET, False), Cache(BLOCK_CACHE))
        return _shared


def options(create: bool = False) -> Options:
    """Raw-mode options of a store of this process, within the process's memory budget (module docstring)."""
    manager, cache = _budget()
    opts = Options(raw_mode=True)
    if create:
        opts.create_if_missing(True)
    table = BlockBasedOptions()
    table.set_block_cache(cache)
    opts.set_block_based_table_factory(table)
    opts.set_write_buffer_manager(manager)
    opts.set_write_buffer_size(WRITE_BUFFER)
    return opts


def open_db(path: Path, read_only: bool = False) -> Rdict:
    """A store of this process (raw mode, within the memory budget) at ``path``: opened read-only, or else
    created with its folder if missing. rocksdict's own exception when it cannot be opened (a caller says
    what it is: the log, a state store, a read model)."""
    if read_only:
        return Rdict(str(path), options=options(), access_type=AccessType.read_only())
    path.mkdir(parents=True, exist_ok=True)
    return Rdict(str(path), options=options(create=True))
