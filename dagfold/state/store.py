"""Stores and transactions (see package docstring).

Values are Python data (dicts, lists, str, int, float, bool, None) encoded with
msgpack; encoding is deterministic for the same sequence of writes, which is
what makes a replayed store byte-for-byte equal to the live one.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import msgspec
from rocksdict import ReadOptions, WriteBatch

from dagfold import rocks
from dagfold.state.exceptions import StateError

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()
_MISSING = object()

META_PREFIX = b"\x00meta|"
APPLIED_EVENTS = b"applied_events"


class ValueCache:
    """The decoded values of a store's recently read or committed keys, kept between transactions.

    Without it every transaction decodes (and on RocksDB first reads) each key it touches again,
    although the previous transaction had the value in hand: a task is dispatched in one batch and
    reported on in the next. Only for a fold whose stored values are replaced, never mutated (the
    scheduler's appliers copy before they change a record), since a cached object is handed to every
    later transaction. Filled only with committed values: a value read from the store, or written
    by a transaction that committed; a dropped transaction leaves it as it was. At most
    ``max_entries`` keys: past that the oldest quarter (by first insertion) is dropped, so the
    bookkeeping per get is one dict lookup (an LRU would reorder on every hit).
    """

    __slots__ = ("max_entries", "values")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.values: dict[bytes, Any] = {}

    def remember(self, values: dict[bytes, Any]) -> None:
        v = self.values
        v.update(values)
        if len(v) > self.max_entries:
            for k in list(itertools.islice(v, len(v) - self.max_entries * 3 // 4)):
                del v[k]

    def forget(self, keys: Iterable[bytes]) -> None:
        """Drop these keys (values no later transaction is expected to read)."""
        v = self.values
        for k in keys:
            v.pop(k, None)


class Store(Protocol):
    """Backing storage of one partition's fold state (a read model has its own,
    ``dagfold.projections.store.ReadModelStore``). Values are replaced, never mutated.
    ``values``: decoded values kept between transactions, or None (``ValueCache``)."""

    values: ValueCache | None

    def raw_get(self, key: bytes) -> bytes | None: ...

    def write(self, puts: dict[bytes, bytes | None]) -> None: ...

    def range(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]: ...

    def close(self) -> None: ...


class MemoryStore:
    """A dict-backed store for the simulator, tests and property checks."""

    def __init__(self, cache_values: int = 0) -> None:
        self.data: dict[bytes, bytes] = {}
        self.values = ValueCache(cache_values) if cache_values > 0 else None

    def raw_get(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def write(self, puts: dict[bytes, bytes | None]) -> None:
        for k, v in puts.items():
            if v is None:
                self.data.pop(k, None)
            else:
                self.data[k] = v

    def range(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        for k in sorted(k for k in self.data if start <= k < end):
            yield k, self.data[k]

    def close(self) -> None:
        pass


class PartitionStore:
    """RocksDB (rocksdict, raw mode) holding one partition's state."""

    def __init__(self, path: Path, read_only: bool = False, cache_values: int = 0) -> None:
        self.values = ValueCache(cache_values) if cache_values > 0 else None
        try:
            self._db = rocks.open_db(path, read_only)  # the process's RocksDB memory budget
        except Exception as exc:
            raise StateError(f"cannot open state store {path}: {exc}") from exc
        self.path = path

    def raw_get(self, key: bytes) -> bytes | None:
        v = self._db.get(key)
        return None if v is None else bytes(v)

    def write(self, puts: dict[bytes, bytes | None]) -> None:
        wb = WriteBatch(raw_mode=True)
        for k, v in puts.items():
            if v is None:
                wb.delete(k)
            else:
                wb.put(k, v)
        self._db.write(wb)

    def range(self, start: bytes, end: bytes) -> Iterator[tuple[bytes, bytes]]:
        """Keys in [start, end). The bound goes to RocksDB itself: without it the iterator
        steps over every deleted key past ``end`` (the timer index deletes a key per fired
        timer, so an unbounded scan grows with the partition's age)."""
        opts = ReadOptions()
        opts.set_iterate_upper_bound(end)
        for k, v in self._db.items(from_key=start, read_opt=opts):
            assert isinstance(k, bytes) and isinstance(v, bytes)  # raw mode
            yield k, v

    def close(self) -> None:
        self._db.close()


def get_meta(store: Store, name: bytes) -> bytes | None:
    return store.raw_get(META_PREFIX + name)


def applied_events_offset(store: Store) -> int:
    """Offset of the last event applied to this store, -1 if none."""
    v = get_meta(store, APPLIED_EVENTS)
    return -1 if v is None else int(v)


def state_digest(store: Store) -> str:
    """SHA-256 over every non-meta key and value: equal digests mean equal state."""
    h = hashlib.sha256()
    for k, v in store.range(b"\x01", b"\xff\xff\xff\xff"):
        h.update(len(k).to_bytes(4, "big"))
        h.update(k)
        h.update(len(v).to_bytes(4, "big"))
        h.update(v)
    return h.hexdigest()


class PartitionTransaction:
    """Read-your-writes view of a store; ``commit`` writes one atomic batch.

    ``atomically`` (``savepoint``/``rollback`` underneath) undoes the writes of a single command whose
    processing raised, so one poison record cannot corrupt the batch.
    """

    def __init__(self, store: Store) -> None:
        self._store = store
        self._shared = store.values
        self._read: dict[bytes, Any] = {}  # decoded from the store here: for the shared cache on commit
        self._cache: dict[bytes, Any] = {}
        self._dirty: set[bytes] = set()
        self._undo: list[tuple[bytes, Any, bool]] | None = None
        self._uncache: list[bytes] = []
        self._open = True

    def get(self, key: bytes) -> Any:
        v = self._cache.get(key, _MISSING)
        if v is _MISSING:
            shared = self._shared
            if shared is not None:
                v = shared.values.get(key, _MISSING)
            if v is _MISSING:
                raw = self._store.raw_get(key)
                v = None if raw is None else _dec.decode(raw)
                if shared is not None:
                    self._read[key] = v
            self._cache[key] = v
        return v

    def put(self, key: bytes, value: Any) -> None:
        if self._undo is not None:
            self._undo.append((key, self._cache.get(key, _MISSING), key in self._dirty))
        self._cache[key] = value
        self._dirty.add(key)

    def delete(self, key: bytes) -> None:
        self.put(key, None)

    def uncache(self, key: bytes) -> None:
        """Keep ``key`` out of the store's shared cache once this transaction commits: a value no later
        transaction is expected to read (a deleted timer, whose key holds its due time; a finished job's
        records). Without this the cache filled with finished jobs' records until its bound (16,384 values
        per scheduler partition, about 25 MB each), evicting live ones first-in first-out. Only the cache:
        a later read of the key reads the store."""
        if self._shared is not None:
            self._uncache.append(key)

    def written_keys(self) -> set[bytes]:
        """The keys this transaction has written (put or deleted) and not rolled back: a copy."""
        return set(self._dirty)

    def savepoint(self) -> None:
        self._undo = []

    def rollback(self) -> None:
        """Undo every put since ``savepoint`` (values were replaced, never mutated, before put)."""
        if self._undo is None:
            raise StateError("rollback without savepoint")
        for key, old, was_dirty in reversed(self._undo):
            if old is _MISSING:
                self._cache.pop(key, None)
            else:
                self._cache[key] = old
            if not was_dirty:
                self._dirty.discard(key)
        self._undo = None

    def release(self) -> None:
        self._undo = None

    def atomically(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)``: all its writes stay, or (if it raises) none of them: one command's fold.

        A plain call, not a context manager: a generator-based one per command cost 5% of the
        scheduler's fold."""
        self.savepoint()
        try:
            fn(*args)
        except BaseException:
            self.rollback()
            raise
        self.release()

    def commit(self, applied_events: int | None = None) -> None:
        if not self._open:
            raise StateError("transaction already committed")
        puts: dict[bytes, bytes | None] = {}
        for k in self._dirty:
            v = self._cache[k]
            puts[k] = None if v is None else _enc.encode(v)
        if applied_events is not None:
            puts[META_PREFIX + APPLIED_EVENTS] = str(applied_events).encode()
        if puts:
            self._store.write(puts)
        self._open = False
        if self._shared is not None:
            # what was read stands where this transaction did not overwrite it
            self._read.update((k, self._cache[k]) for k in self._dirty)
            self._shared.remember(self._read)
            self._shared.forget(self._uncache)
