"""Due-timer scan shared by the live runner and the virtual-time harness.

Cost per scan is the number of due timers: the index is ordered by due time,
so the scan stops at the first timer in the future.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec

from dagfold.codec import Record
from dagfold.services.scheduler import keys
from dagfold.state import Store


def due_timers(store: Store, now_ms: int, since_ms: int = 0) -> Iterator[tuple[bytes, Record]]:
    """(index key, TimerFired command) for every timer due at or before ``now_ms``.

    ``since_ms`` skips timers due earlier: the live runner passes a floor below
    which it knows no timer is left, because a scan from the index's start walks
    over the deletions of every timer that ended early (each finished task's lease
    timer), and those pile up with the job's size until RocksDB compacts them.
    """
    start, end = keys.timers_due_until(now_ms, since_ms)
    for k, raw in store.range(start, end):
        due, job_id, task_id, kind = keys.parse_timer(k)
        yield k, {"type": "dagfold.command.TimerFired", "job_id": job_id, "task_id": task_id,
                  "attempt": int(msgspec.msgpack.decode(raw)), "timer": kind, "due_ms": due,
                  "fired_at_ms": now_ms}
