"""What the runtime asks of a fold, and the context every fold's processors decide in."""

from __future__ import annotations

from typing import Protocol

from dagfold.codec import Record
from dagfold.outputs import Output
from dagfold.state import PartitionTransaction


class Fold(Protocol):
    """A deterministic fold over one partition's state: no I/O, no clock, no randomness inside.

    * ``process`` folds one command inside the partition's open transaction and returns the
      records to produce (events, already applied, and side outputs); if it raises, none of
      the command's writes stay (``PartitionTransaction.atomically``);
    * ``apply`` applies one event (catch-up, replay);
    * ``reload`` rebuilds whatever the fold derives in memory from the committed store, after
      the runtime dropped a transaction without committing it.
    """

    def process(self, txn: PartitionTransaction, command: Record, now_ms: int, offset: int) -> list[Output]: ...

    def apply(self, txn: PartitionTransaction, event: Record) -> None: ...

    def reload(self) -> None: ...


class FoldContext:
    """Base of the contexts processors decide in: the command's time and offset, and the outputs.

    Subclasses (the scheduler's and the allocator's ``Ctx``) add their state and options and
    an ``event`` that applies and emits an event; every other record goes out through ``emit``.
    """

    __slots__ = ()
    now_ms: int
    offset: int
    out: list[Output]

    def emit(self, topic: str, key: str, record: Record) -> None:
        """Queue a record for the log transaction of this command's batch."""
        self.out.append(Output(topic, key, record))
