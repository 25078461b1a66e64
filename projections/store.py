"""A small RocksDB key-value store for read models, written in explicit batches.

Keys are raw bytes; values are msgpack (``msgspec``), so a value is any plain
Python structure (dicts, lists, str, int, float, bool, None).

Writes go through a ``ReadModelTxn``: an in-memory overlay that answers its own reads
(read-your-writes) and coalesces repeated writes of one key, then becomes one
RocksDB ``WriteBatch`` on ``ReadModelStore.commit``. The projector puts one polled batch
of events plus the consumed offsets into one ``ReadModelTxn``, so the read model and its
position are written atomically (RocksDB's write-ahead log makes the batch
survive a kill -9 as a whole or not at all).

Reads (``get``, ``scan``) may run on other threads while the projector commits:
RocksDB point reads and iterators are thread-safe, and every iterator reads an
implicit snapshot taken when it is created.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
from rocksdict import ReadOptions, WriteBatch

from dagfold import rocks
from dagfold.projections.exceptions import StoreError

_DELETED: Any = object()
_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


def encode_value(value: Any) -> bytes:
    return _encode(value)


def decode_value(data: bytes) -> Any:
    return _decode(data)


def prefix_end(prefix: bytes) -> bytes | None:
    """Smallest key greater than every key starting with ``prefix`` (None: no bound)."""
    p = prefix.rstrip(b"\xff")
    if not p:
        return None
    return p[:-1] + bytes([p[-1] + 1])


class ReadModelTxn:
    """A write batch with read-your-writes; values are the decoded Python objects.

    A value returned by ``get`` is the txn's own copy: mutate it, then ``put``
    it back (only ``put`` marks a key for writing).
    """

    __slots__ = ("_store", "_cache", "_dirty")

    def __init__(self, store: ReadModelStore) -> None:
        self._store = store
        self._cache: dict[bytes, Any] = {}
        self._dirty: set[bytes] = set()

    def get(self, key: bytes) -> Any | None:
        try:
            v = self._cache[key]
        except KeyError:
            v = self._store.get(key)
            self._cache[key] = _DELETED if v is None else v
            return v
        return None if v is _DELETED else v

    def put(self, key: bytes, value: Any) -> None:
        self._cache[key] = value
        self._dirty.add(key)

    def delete(self, key: bytes) -> None:
        self._cache[key] = _DELETED
        self._dirty.add(key)

    def keys_with_prefix(self, prefix: bytes) -> list[bytes]:
        """The keys under ``prefix`` as this transaction sees them: the store's and this transaction's puts,
        less its deletes (for dropping a whole job, whose records a replay may have written in this batch)."""
        found = {k for k, _ in self._store.scan(prefix)}
        found.update(k for k in self._dirty if k.startswith(prefix))
        return sorted(k for k in found if self._cache.get(k) is not _DELETED)

    def __len__(self) -> int:
        """Keys to be written (or deleted) on commit."""
        return len(self._dirty)

    def write_batch(self) -> WriteBatch:
        wb = WriteBatch(raw_mode=True)
        for key in self._dirty:
            v = self._cache[key]
            if v is _DELETED:
                wb.delete(key)
            else:
                wb.put(key, _encode(v))
        return wb


class ReadModelStore:
    """RocksDB (rocksdict, raw mode) under ``path``; one process may open it at a time.

    A read model's store, not a fold's (``dagfold.state.Store``): its transactions hand out
    copies to mutate and put back, where a fold's state values are replaced, never mutated
    (which is what lets ``PartitionTransaction`` roll a command back without copying).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._db = rocks.open_db(path)  # the process's RocksDB memory budget
        except Exception as exc:
            raise StoreError(f"cannot open read-model store at {path} (in use by another process?): "
                             f"{exc}") from exc
        self._write_lock = threading.Lock()
        self._closed = False

    # -- reading ---------------------------------------------------------
    def get(self, key: bytes) -> Any | None:
        """Decoded value of ``key``, or None."""
        raw = self._db.get(key)
        return None if raw is None else _decode(raw)

    def get_raw(self, key: bytes) -> bytes | None:
        """The encoded value of ``key`` (msgpack), or None: for reading one field without decoding the rest."""
        raw: bytes | None = self._db.get(key)
        return raw

    def scan(
        self, prefix: bytes, *, after: bytes | None = None, reverse: bool = False
    ) -> Iterator[tuple[bytes, bytes]]:
        """Raw ``(key, value)`` pairs whose key starts with ``prefix``, in key order.

        ``after`` (a full key) starts strictly after it in the direction of the
        scan (strictly before it when ``reverse``): the cursor of a listing.
        """
        # Bounded to the prefix inside RocksDB, so deleted index keys outside it are never stepped over.
        opts = ReadOptions()
        opts.set_iterate_lower_bound(prefix)
        end_key = prefix_end(prefix)
        if end_key is not None:
            opts.set_iterate_upper_bound(end_key)
        it = self._db.iter(opts)
        if not reverse:
            if after is None or after < prefix:
                it.seek(prefix)
            else:
                it.seek(after)
                if it.valid() and it.key() == after:
                    it.next()
            while it.valid():
                k = it.key()
                if not k.startswith(prefix):
                    return
                yield k, it.value()
                it.next()
        else:
            end = prefix_end(prefix)
            if after is not None and (end is None or after < end):
                it.seek_for_prev(after)
                if it.valid() and it.key() == after:
                    it.prev()
            elif end is None:
                it.seek_to_last()
            else:
                it.seek_for_prev(end)
                if it.valid() and it.key() == end:
                    it.prev()
            while it.valid():
                k = it.key()
                if not k.startswith(prefix):
                    return
                yield k, it.value()
                it.prev()

    # -- writing ---------------------------------------------------------
    def txn(self) -> ReadModelTxn:
        return ReadModelTxn(self)

    def commit(self, txn: ReadModelTxn) -> None:
        """Write every change of ``txn`` atomically."""
        if not len(txn):
            return
        wb = txn.write_batch()
        with self._write_lock:
            if self._closed:
                raise StoreError("store is closed")
            try:
                self._db.write(wb)
            except Exception as exc:
                raise StoreError(f"read-model write failed: {exc}") from exc

    def close(self) -> None:
        with self._write_lock:
            if self._closed:
                return
            self._closed = True
            self._db.close()
