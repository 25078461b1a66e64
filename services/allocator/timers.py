"""Due timers of a pool, as AllocatorTimerFired commands.

``due_timers_in_store`` scans the store's due-time index: the runtime's timer policy
(``dagfold.processor.timers``) writes its commands to ``allocator.commands``, as the
scheduler's does. ``due_timers`` pops the fold's in-memory heap, for the virtual-time
harness and the simulator, which fold timers in due order without a log. Either way the
fold re-checks each timer against the state, so a timer made stale by later events does
nothing.
"""

from __future__ import annotations

from collections.abc import Iterator

from dagfold.codec import Record
from dagfold.services.allocator import keys
from dagfold.services.allocator.fold import AllocatorFold
from dagfold.state import Store


def fired(pool: str, due: int, kind: str, target: str, now_ms: int) -> Record:
    return {"type": "dagfold.allocator.AllocatorTimerFired", "pool": pool, "timer": kind, "target": target,
            "due_ms": due, "fired_at_ms": now_ms}


def due_timers_in_store(store: Store, pool: str, now_ms: int, since_ms: int = 0) -> Iterator[tuple[bytes, Record]]:
    """(index key, command) for every timer due in [since_ms, now_ms]; cost: the due timers."""
    start, end = keys.timers_due_until(now_ms, since_ms)
    for k, _ in store.range(start, end):
        due, kind, target = keys.parse_timer(k)
        yield k, fired(pool, due, kind, target, now_ms)


def due_timers(fold: AllocatorFold, now_ms: int) -> list[Record]:
    return [fired(fold.opts.pool, due, kind, target, now_ms) for due, kind, target in fold.state.due_timers(now_ms)]
