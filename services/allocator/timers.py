"""Due timers of a pool, as AllocatorTimerFired commands.

``due_timers_in_store`` scans the store's due-time index (the live timer of a
runner, like the scheduler's); ``due_timers`` uses the fold's in-memory heap
(the harness and the simulator). Either way the fold re-checks each timer
against the state, so a timer made stale by later events does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

from dagfold.codec import Record
from dagfold.state import Store
from services.allocator import keys
from services.allocator.fold import AllocatorFold


def fired(pool: str, due: int, kind: str, target: str, now_ms: int) -> Record:
    return {"type": "dagfold.allocator.AllocatorTimerFired", "pool": pool, "timer": kind, "target": target,
            "due_ms": due, "fired_at_ms": now_ms}


def due_timers_in_store(store: Store, pool: str, now_ms: int) -> Iterator[tuple[bytes, Record]]:
    """(index key, command) for every timer due at or before ``now_ms``; cost: the due timers."""
    start, end = keys.timers_due_until(now_ms)
    for k, _ in store.range(start, end):
        due, kind, target = keys.parse_timer(k)
        yield k, fired(pool, due, kind, target, now_ms)


def due_timers(fold: AllocatorFold, now_ms: int) -> list[Record]:
    return [fired(fold.opts.pool, due, kind, target, now_ms) for due, kind, target in fold.state.due_timers(now_ms)]
