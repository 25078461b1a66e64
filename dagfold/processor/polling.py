"""Pieces every consumer loop of dagfold shares: the partition processor, the projector and the
callback notifier (consumer lag, and the back-off after a log error)."""

from __future__ import annotations

import time
from collections.abc import Mapping

from dagfold import metrics
from dagfold.exceptions import LogError
from dagfold.log.base import Log, TopicPartition

LAG_EVERY_S = 5.0


class Backoff:
    """Waits after consecutive failures: ``first``, doubled each time up to ``most``; a success resets."""

    def __init__(self, first: float = 0.1, most: float = 5.0) -> None:
        self.first = first
        self.most = most
        self._next = first

    def failed(self) -> float:
        """The wait before trying again, after one more failure."""
        delay = self._next
        self._next = min(self._next * 2, self.most)
        return delay

    def succeeded(self) -> None:
        self._next = self.first


class LagGauge:
    """The consumer-lag gauge of one component: records between its positions and the end offsets,
    per topic, measured at most every ``every_s`` seconds (an end-offsets request each time)."""

    def __init__(self, component: str, every_s: float = LAG_EVERY_S) -> None:
        self.component = component
        self.every_s = every_s
        self._at = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._at < self.every_s:
            return False
        self._at = now
        return True

    def report(self, log: Log, positions: Mapping[TopicPartition, int]) -> None:
        """Set the gauge from ``positions`` (next offsets to read); a log error leaves it as it was."""
        if not positions:
            return
        try:
            ends = log.end_offsets(list(positions))
        except LogError:
            return
        by_topic: dict[str, int] = {}
        for tp, end in ends.items():
            by_topic[tp.topic] = by_topic.get(tp.topic, 0) + max(end - positions[tp], 0)
        for topic, lag in by_topic.items():
            metrics.CONSUMER_LAG.labels(self.component, topic).set(lag)
