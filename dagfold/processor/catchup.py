"""Catch a partition's state up with its events: on assignment, and after a commit of unknown outcome."""

from __future__ import annotations

import logging
from collections.abc import Callable

from dagfold.codec import Record, default_codec
from dagfold.exceptions import CodecError
from dagfold.log.base import Log, TopicPartition
from dagfold.log.reader import read_to_end
from dagfold.processor.fold import Fold
from dagfold.state import PartitionTransaction, Store
from dagfold.state.store import applied_events_offset

log = logging.getLogger("dagfold.processor")

# How long a catch-up waits for more events to become readable before it gives up (and is retried).
CATCH_UP_IDLE_S = 30.0


def _every(event: Record) -> bool:
    return True


def catch_up(log_: Log, store: Store, fold: Fold, tp: TopicPartition,
             accepts: Callable[[Record], bool] = _every) -> int:
    """Apply the events of ``tp`` after the store's applied offset, up to the end offset seen now.

    Each polled batch is one state write batch with its last offset, so an interrupted catch-up
    resumes. ``accepts`` skips events of other owners sharing the partition (the allocator's
    pools). Returns how many events were applied. Raises ``LogError`` when the end is not
    reached (an open transaction of a killed or stopped instance holds the last stable offset
    back past ``CATCH_UP_IDLE_S``): a fold that went on from part of its events would take
    decisions on a state without them (a job accepted there is "unknown"), and its next commit
    would move the applied offset past them for good. The caller retries.
    """
    codec = default_codec()
    applied = 0
    for recs in read_to_end(log_, tp, applied_events_offset(store) + 1, max_idle_s=CATCH_UP_IDLE_S, strict=True):
        txn = PartitionTransaction(store)
        for r in recs:
            try:
                event = codec.decode(r.value)
            except CodecError:
                log.error("undecodable event at %s/%d@%d skipped", r.topic, r.partition, r.offset,
                          extra={"topic": r.topic, "partition": r.partition, "offset": r.offset})
                continue
            if accepts(event):
                fold.apply(txn, event)
                applied += 1
        txn.commit(applied_events=recs[-1].offset)
    return applied
