"""Timers through the log: one policy for every fold.

A fold keeps a due-time index in its state (appliers maintain it). The runtime scans the
due part of each owned partition's index and writes a timer command (``TimerFired``,
``AllocatorTimerFired``) to the fold's commands topic; the fold checks that the timer is
still current and decides. So a time-based decision is a command on the log like any
other, and replay applies the events it produced. At-least-once: a timer still in the
index is written again after ``REFIRE_MS``; a stale or repeated one changes nothing.

A scan starts ``SCAN_MARGIN_MS`` below the earliest timer the previous scan left (or its
time), not at the index's start: every ended timer is a deletion RocksDB keeps until it
compacts, so a scan from the start walks over all of them. Once a minute, and when a
partition is (re)assigned, a scan starts from the beginning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from dagfold.codec import Record, default_codec
from dagfold.log.base import Producer
from dagfold.state import Store

REFIRE_MS = 5000
# New timers are due at or after the fold's clock, which a wall-clock step back could move earlier.
SCAN_MARGIN_MS = 60_000
FULL_SCAN_MS = 60_000  # and from the index's start once a minute, whatever happened
_FORGET_AFTER = 10_000


@dataclass(frozen=True, slots=True)
class TimerPolicy:
    """How a fold's timers are found and addressed.

    ``scan(store, now_ms, since_ms)`` yields (index key, timer command) for every timer due in
    [since_ms, now_ms]; ``key(command)`` is the command's record key on ``topic``.
    """

    topic: str
    scan: Callable[[Store, int, int], Iterable[tuple[bytes, Record]]]
    key: Callable[[Record], str]


class TimerScanner:
    """Scans the owned partitions' due-time indexes and writes the due timer commands."""

    def __init__(self, policy: TimerPolicy, producer: Producer) -> None:
        self.policy = policy
        self.producer = producer
        self.codec = default_codec()
        self._fired: dict[bytes, int] = {}
        self._floor: dict[int, int] = {}  # per partition: no timer is due before this
        self._full_scan_ms = 0

    def forget(self, partition: int) -> None:
        """The partition was (re)assigned or revoked: its next scan starts from the index's start."""
        self._floor.pop(partition, None)

    def fire(self, stores: Mapping[int, Store], now: int) -> int:
        """Write a timer command for every due timer; returns how many were written."""
        sent = 0
        full = now - self._full_scan_ms >= FULL_SCAN_MS
        if full:
            self._full_scan_ms = now
        for p, store in list(stores.items()):
            earliest = now
            for k, cmd in self.policy.scan(store, now, 0 if full else self._floor.get(p, 0)):
                earliest = min(earliest, cmd["due_ms"])
                fired = self._fired.get(k)
                if fired is not None and now - fired < REFIRE_MS:
                    continue
                self.producer.send(self.policy.topic, self.policy.key(cmd).encode(), self.codec.encode(cmd))
                self._fired[k] = now
                sent += 1
            self._floor[p] = earliest - SCAN_MARGIN_MS
        if sent:
            self.producer.flush()
        if len(self._fired) > _FORGET_AFTER:
            self._fired = {k: t for k, t in self._fired.items() if now - t < REFIRE_MS}
        return sent
