"""The running allocator's metrics, measured around the pure fold (which reads no clock).

* ``dagfold_allocator_decision_latency_seconds{decision}``: for every decision record a command
  produced (``grant``: AllocationGranted, ``reject``: RequestRejected, ``preempt``:
  PreemptionRequested), the compute time of folding that command (the pass that decided it
  included): from the allocator starting on the command to the record being produced. A pass
  that places several requests counts its whole time for each of them (an upper bound).
* ``dagfold_allocator_queue_wait_seconds{tier}``: at every committed grant, how long the request
  waited for it (``AllocationGranted.waited_ms``, allocator time).

``ObservedAllocatorFold`` is what the runner runs; the simulator and the tests run the plain fold.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from dagfold import metrics
from dagfold.codec import Record
from dagfold.outputs import Output
from dagfold.services.allocator.fold import AllocatorFold
from dagfold.state import PartitionTransaction

A = "dagfold.allocator."
DECISIONS = {A + "AllocationGranted": "grant", A + "RequestRejected": "reject",
             A + "PreemptionRequested": "preempt"}


class ObservedAllocatorFold(AllocatorFold):
    """The allocator fold, timed per command; each decision it produced is observed."""

    def process(self, txn: PartitionTransaction, command: Record, now_ms: int, offset: int) -> list[Output]:
        started = time.perf_counter()
        out = super().process(txn, command, now_ms, offset)
        elapsed = time.perf_counter() - started
        for o in out:
            decision = DECISIONS.get(o.record.get("type", ""))
            if decision is not None:
                metrics.ALLOCATOR_DECISION_LATENCY.labels(decision).observe(elapsed)
        return out


def on_committed(outputs: Sequence[tuple[int, Output]]) -> None:
    """After the allocator's transaction committed: the queue wait of every grant, by tier."""
    for _, o in outputs:
        r = o.record
        if r.get("type") == A + "AllocationGranted":
            metrics.ALLOCATOR_QUEUE_WAIT.labels(r.get("tier") or "").observe(max(int(r.get("waited_ms") or 0), 0)
                                                                            / 1000.0)
