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

The same first store also fixes two of glibc's malloc settings for the process (``tune_malloc``): memtables
are built of 2 MiB blocks, mapped from the OS and unmapped when their memtable is flushed; but glibc raises its
mmap threshold to the size of each mapped block freed, after which every later block came from malloc's heaps,
one per thread up to 8 per core, and their freed space stayed in the process (issue 25: after the fixes above
the 20,000-job soak of tests/test_soak.py still grew 10 MB over its second half, malloc's heaps 92 -> 108 MB,
its mapped blocks 8 -> 5 MB). A fixed threshold (128 KiB, glibc's initial one) keeps them mapped, and at most
``MALLOC_ARENAS`` heaps bound the rest. An operator's MALLOC_MMAP_THRESHOLD_ or MALLOC_ARENA_MAX stands.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from rocksdict import AccessType, BlockBasedOptions, Cache, Options, Rdict, WriteBufferManager

MEMTABLE_BUDGET = 64 << 20  # every memtable of the process together
WRITE_BUFFER = 16 << 20  # one store's memtable (RocksDB's default: 64 MiB)
BLOCK_CACHE = 64 << 20  # uncompressed blocks read from SST files, shared by every store
MMAP_THRESHOLD = 128 << 10  # malloc requests from here up are mapped, and unmapped when freed (tune_malloc)
MALLOC_ARENAS = 2  # malloc's heaps (glibc's default: 8 per core)
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8  # mallopt's parameter numbers (malloc.h)

_lock = threading.Lock()
_shared: tuple[WriteBufferManager, Cache] | None = None


def tune_malloc() -> list[str]:
    """Fix glibc's mmap threshold and bound its heaps (module docstring); the settings made, none where the C
    library is not glibc or the operator's environment sets them."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt, macOS neither)
        return []
    done = []
    for env, param, value in (("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                              ("MALLOC_ARENA_MAX", _M_ARENA_MAX, MALLOC_ARENAS)):
        if env not in os.environ and mallopt(param, value) == 1:
            done.append(env)
    return done


def _budget() -> tuple[WriteBufferManager, Cache]:
    global _shared
    with _lock:
        if _shared is None:
            tune_malloc()  # before the first store's threads and memtables
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
