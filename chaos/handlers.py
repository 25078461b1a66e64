"""The chaos workload's handler: a short task with an external side effect.

``dagfold worker --handler-module chaos.handlers`` imports this module, which
registers ``chaos_effect``. Each attempt sleeps ``args.ms`` milliseconds
(heartbeating as any handler does), may fail on purpose, and then applies its
side effect to an "external system" through the worker's
``SideEffectLedger``, keyed by the task's idempotency key:

* ``args.fail == "always"``: fails for good (``NonRetryableError``), no effect;
* ``args.flaky``: the first attempt fails retryably (before the effect);
* otherwise ``ledger.once(key, apply)`` applies the effect once per key.

The external system (``ExternalSystem``, a SQLite file) accepts the
idempotency key the way a payment API does (it looks the key up before it
applies anything), which closes the window the ledger cannot close on its own
(a worker killed after the effect but before the ledger recorded it). It keeps
one row per *application*, without a unique constraint, so two attempts that
both applied the effect (two workers running one task at once, racing
processes) show up as a duplicate key for ``chaos.checks``.

Paths come from ``DAGFOLD_CHAOS_LEDGER`` and ``DAGFOLD_CHAOS_EFFECTS`` (set by
the harness for every worker process).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from dagfold.services.worker import NonRetryableError, SideEffectLedger, TaskCancelled, TaskContext, TaskError
from dagfold.services.worker.handlers import register_handler

LEDGER_ENV = "DAGFOLD_CHAOS_LEDGER"
EFFECTS_ENV = "DAGFOLD_CHAOS_EFFECTS"
HANDLER = "chaos_effect"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL,
    job_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    worker_id TEXT NOT NULL,
    pid INTEGER NOT NULL,
    ts REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS effects_key ON effects (key);
"""


class ExternalSystem:
    """A stand-in for an external API with idempotency-key lookup; one row per application."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._db = sqlite3.connect(str(self.path), timeout=60.0, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def lookup(self, key: str) -> int | None:
        with self._lock:
            row = self._db.execute("SELECT id FROM effects WHERE key = ? ORDER BY id LIMIT 1", (key,)).fetchone()
        return None if row is None else int(row[0])

    def apply(self, key: str, ctx: TaskContext) -> int:
        """Apply the effect for ``key`` unless the system already has it; returns its receipt."""
        found = self.lookup(key)
        if found is not None:
            return found
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO effects (key, job_id, task_id, attempt, worker_id, pid, ts) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (key, ctx.job_id, ctx.task_id, ctx.attempt, ctx.worker_id, os.getpid(), time.time()))
            return int(cur.lastrowid or 0)

    def close(self) -> None:
        self._db.close()


_ledger: SideEffectLedger | None = None
_external: ExternalSystem | None = None
_init_lock = threading.Lock()


def _stores() -> tuple[SideEffectLedger, ExternalSystem]:
    global _ledger, _external
    with _init_lock:
        if _ledger is None or _external is None:
            try:
                _ledger = SideEffectLedger(os.environ[LEDGER_ENV])
                _external = ExternalSystem(os.environ[EFFECTS_ENV])
            except KeyError as exc:
                raise NonRetryableError(f"chaos_effect: {exc.args[0]} is not set") from None
        return _ledger, _external


def chaos_effect(ctx: TaskContext) -> dict[str, Any]:
    args = ctx.args
    if args.get("fail") == "always":
        raise NonRetryableError("chaos: this task fails on purpose")
    if args.get("flaky") and ctx.attempt == 1:
        raise TaskError("chaos: transient failure of the first attempt")
    ms = args.get("ms", 20)
    if ctx.cancelled.wait(max(0.0, float(ms)) / 1000.0):
        raise TaskCancelled(f"cancelled: {ctx.cancel_reason or 'cancelled'}")
    ledger, external = _stores()
    key = ctx.idempotency_key
    receipt = ledger.once(key, lambda: external.apply(key, ctx))
    return {"receipt": receipt}


register_handler(HANDLER, chaos_effect, replace=True)
