"""The allocator fold: ``(state, command, now) -> events``, and ``apply`` for replay.

One instance per pool, bound to that pool's store: it keeps the in-memory
indexes of ``PoolState`` (a cache of the store). Contract with the loop that
drives it (runner, harness, simulator):

* ``process(txn, ...)`` with the transaction of the current batch; a new
  transaction object means the previous one was committed;
* after dropping a transaction without committing it (a failed log
  transaction), call ``reload()`` before the next command;
* ``apply`` replays one event (catch-up after restart, audit rebuild).
"""

from __future__ import annotations

from dagfold.codec import Record
from dagfold.outputs import Output
from dagfold.services.allocator.appliers import apply_event
from dagfold.services.allocator.ctx import Ctx
from dagfold.services.allocator.exceptions import UnknownCommandError
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.processors import PROCESSORS
from dagfold.services.allocator.state import PoolState
from dagfold.state import PartitionTransaction, Store


class AllocatorFold:
    """Processes the commands of one pool; all state goes through the transaction."""

    def __init__(self, store: Store, opts: AllocatorOptions | None = None) -> None:
        self.opts = opts or AllocatorOptions()
        self.store = store
        self.state = PoolState(self.opts)
        self.state.load(store)
        self.last_attempts = 0

    def reload(self) -> None:
        """Rebuild the in-memory indexes from the committed store."""
        self.state.unbind()
        self.state.load(self.store)

    def process(self, txn: PartitionTransaction, command: Record, now_ms: int, offset: int) -> list[Output]:
        """Fold one command; returns the events (already applied) and control records to produce.

        On an exception nothing of this command stays in the transaction, and
        the indexes are rebuilt from the store plus the batch's earlier writes.
        """
        proc = PROCESSORS.get(command["type"])
        if proc is None:
            raise UnknownCommandError(f"{command['type']} is not an allocator command")
        st = self.state
        st.bind(txn)
        ctx = Ctx(st, now_ms, offset, self.opts)
        try:
            txn.atomically(proc, ctx, command)
        except BaseException:
            st.load(self.store, txn)  # the in-memory indexes follow the rolled-back store
            raise
        self.last_attempts = ctx.attempts
        return ctx.out

    def apply(self, txn: PartitionTransaction, event: Record) -> None:
        """Replay one event into this fold's state."""
        self.state.bind(txn)
        apply_event(self.state, event)
