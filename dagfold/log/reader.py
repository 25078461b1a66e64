"""Read one partition from an offset to its end: catch-up, replay, audit and checks all do this.

"The end" is the end offset seen at the start; the loop stops when the
consumer's position reaches it, which steps over Kafka's transaction markers
(the last offset of a partition written transactionally is a marker, never a
record). ``max_idle_s`` bounds the wait when the last stable offset lags the end
offset (a zombie's open transaction holds it back until the transaction times out):
then a reader that can do with what was readable (replay, audit, checks) stops, and a
``strict`` one (a fold's catch-up, which must never go on from part of its events) raises.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from dagfold.exceptions import LogError
from dagfold.log.base import Consumer, Log, LogRecord, TopicPartition

log = logging.getLogger("dagfold.log")


def read_to_end(log_: Log, tp: TopicPartition, start: int = 0, batch: int = 5000,
                max_idle_s: float = 30.0, strict: bool = False) -> Iterator[list[LogRecord]]:
    """Batches of committed records of ``tp`` from ``start`` up to the end offset seen now.

    ``strict``: raise ``LogError`` when nothing more became readable for ``max_idle_s`` before the
    end was reached (else log a warning and stop there)."""
    end = log_.end_offsets([tp])[tp]
    if start >= end:
        return
    consumer = log_.consumer(None, client_id=f"reader-{tp.topic}-{tp.partition}")
    consumer.assign({tp: start})
    idle_since = time.monotonic()
    try:
        while consumer.position(tp) < end:
            recs = consumer.poll(batch, 0.2)
            if recs:
                idle_since = time.monotonic()
                yield recs
            elif time.monotonic() - idle_since > max_idle_s:
                at = consumer.position(tp)
                if strict:
                    raise LogError(f"reading {tp.topic}[{tp.partition}] stopped at {at} of {end}: nothing more "
                                   f"became readable in {max_idle_s:g}s (an open transaction holds the "
                                   "partition's last stable offset back, or its leader is unreachable)")
                log.warning("reading %s stopped at %d of %d: nothing more became readable", tp, at, end)
                return
    finally:
        consumer.close()


def join_when_present(log_: Log, topic: str, group: str, client_id: str) -> Consumer | None:
    """A consumer of ``group`` subscribed to ``topic`` once the topic exists; None until then (a reader
    that starts before the writer created its topic asks again on its next round)."""
    try:
        log_.partitions(topic)
    except LogError:
        return None
    consumer = log_.consumer(group, client_id=client_id)
    consumer.subscribe([topic])
    return consumer
