"""The scheduler fold: ``(state, command, now) -> events``, and ``apply`` for replay.

This is the functional core that runs unchanged under Kafka, the embedded log,
the virtual-time simulator and the property tests.
"""

from __future__ import annotations

from dagfold.codec import Record
from dagfold.config import SchedulerOptions
from dagfold.outputs import Output
from dagfold.services.scheduler.appliers import apply_event
from dagfold.services.scheduler.context import Ctx
from dagfold.services.scheduler.exceptions import UnknownCommandError
from dagfold.services.scheduler.handlers import HANDLERS
from dagfold.state import PartitionTransaction


class SchedulerFold:
    """Processes commands of one partition; all state goes through the transaction."""

    #: decoded state values a partition's store keeps between transactions (``ValueCache``): the
    #: appliers copy a record before changing it, so a cached value is never changed in place.
    #: A decoded task record takes about 1.5 kB (tracemalloc): at most about 25 MB per partition,
    #: the working set of a few batches (Montage's 1,738 tasks touch about 9k keys).
    CACHE_VALUES = 16_384

    def __init__(self, opts: SchedulerOptions | None = None) -> None:
        self.opts = opts or SchedulerOptions()

    def process(self, txn: PartitionTransaction, command: Record, now_ms: int, offset: int) -> list[Output]:
        """Fold one command; returns the events (already applied) and side outputs to produce.

        On an exception nothing of this command stays in the transaction.
        """
        handler = HANDLERS.get(command["type"])
        if handler is None:
            raise UnknownCommandError(f"{command['type']} is not a scheduler command")
        ctx = Ctx(txn, now_ms, offset, self.opts)
        txn.atomically(handler, ctx, command)
        return ctx.out

    def reload(self) -> None:
        """Nothing to rebuild: this fold keeps no state outside the transaction."""

    @staticmethod
    def apply(txn: PartitionTransaction, event: Record) -> None:
        """Replay one event (catch-up after restart, audit rebuild)."""
        apply_event(txn, event)
