"""Deduplicating a handler's external side effects.

Workers run tasks *at least once*: a worker that dies after doing the work but
before its TaskSucceeded is durable (or before its dispatch offset is committed)
has the attempt run again, by itself after a restart or by another worker after
the lease expires and the task is retried. Every attempt of a task gets the
same ``ctx.idempotency_key``, so a handler can make its side effects happen
once by keying them on it::

    ledger = SideEffectLedger(Path("/var/lib/dagfold/side-effects.sqlite"))

    def charge(ctx):
        receipt = ledger.once(f"{ctx.idempotency_key}:charge",
                              lambda: payments.charge(ctx.args["order"]))
        return {"receipt": receipt}

``once`` runs the function only if the key was never recorded, records its
result durably, and returns the stored result on every later call, across
restarts. A function that raises records nothing, so a retry runs it again.

What it cannot do: if the process dies *after* the side effect but *before* the
result is recorded, the next attempt runs it again. Where the external system
accepts an idempotency key of its own, pass it ``ctx.idempotency_key`` too; the
ledger then only saves the round trip. The ledger is a file on one host (SQLite,
shared safely by the worker threads and processes of that host: ``once`` calls
for one key are serialised across threads by a lock and across processes by a
POSIX record lock on ``<file>.lock``, which the OS releases when a process
dies); it does not deduplicate across hosts.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# Byte offsets of the lock file that stand for keys (crc32 of the key); the file stays
# empty: POSIX record locks may lie past its end. Two keys sharing a slot only wait for
# each other.
_LOCK_SLOTS = 1 << 32

_SCHEMA = """
CREATE TABLE IF NOT EXISTS side_effects (
    key TEXT PRIMARY KEY,
    result TEXT NOT NULL,
    recorded_at REAL NOT NULL DEFAULT (julianday('now'))
)
"""


class SideEffectLedger:
    """Durable record of side effects already done, by key (see module docstring).

    Results are stored as JSON, so ``fn`` must return something JSON-serialisable
    (tuples come back as lists after a reopen).
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(self.path), timeout=30.0, check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)
        self._db_lock = threading.Lock()
        self._keys_lock = threading.Lock()
        self._key_locks: dict[int, tuple[threading.Lock, int]] = {}
        self._lock_fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o644)

    def get(self, key: str) -> tuple[bool, Any]:
        """``(True, result)`` if ``key`` is recorded, else ``(False, None)``."""
        with self._db_lock:
            row = self._db.execute("SELECT result FROM side_effects WHERE key = ?", (key,)).fetchone()
        return (True, json.loads(row[0])) if row is not None else (False, None)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key)[0]

    def once(self, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` unless ``key`` was recorded; record and return its result, or the stored one."""
        slot = zlib.crc32(key.encode()) % _LOCK_SLOTS
        lock = self._acquire(slot)
        try:
            found, stored = self.get(key)
            if found:
                return stored  # type: ignore[no-any-return]
            result = fn()
            data = json.dumps(result)
            with self._db_lock:
                # INSERT OR IGNORE: another process may have recorded it meanwhile; its result wins.
                self._db.execute("INSERT OR IGNORE INTO side_effects (key, result) VALUES (?, ?)", (key, data))
            found, stored = self.get(key)
            return stored if found else result  # type: ignore[no-any-return]
        finally:
            self._release(slot, lock)

    def _acquire(self, slot: int) -> threading.Lock:
        """Serialise ``once`` calls of one key: in this process (a lock per key slot, other
        slots run in parallel), then across processes (the slot's byte in the lock file).

        POSIX record locks belong to the process, not the thread, which is why the
        thread lock comes first: one thread of a process holds a slot's record lock at a time.
        """
        with self._keys_lock:
            lock, users = self._key_locks.get(slot, (None, 0))
            if lock is None:
                lock = threading.Lock()
            self._key_locks[slot] = (lock, users + 1)
        lock.acquire()
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_EX, 1, slot)
        except BaseException:
            self._release_thread_lock(slot, lock)
            raise
        return lock

    def _release(self, slot: int, lock: threading.Lock) -> None:
        try:
            fcntl.lockf(self._lock_fd, fcntl.LOCK_UN, 1, slot)
        finally:
            self._release_thread_lock(slot, lock)

    def _release_thread_lock(self, slot: int, lock: threading.Lock) -> None:
        lock.release()
        with self._keys_lock:
            _, users = self._key_locks[slot]
            if users <= 1:
                del self._key_locks[slot]
            else:
                self._key_locks[slot] = (lock, users - 1)

    def close(self) -> None:
        with self._db_lock:
            self._db.close()
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    def __enter__(self) -> SideEffectLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
