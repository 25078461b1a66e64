"""One log transaction with an explicit status: what a failure means depends on where it happened.

::

    OPEN ──commit()──▶ COMMITTING ──▶ COMMITTED
      │                    │
      │ send/begin fails   ├─ TransactionAbortedError ──▶ ABORTED   (nothing committed)
      ▼                    └─ any other LogError ──────▶ UNKNOWN   (reconcile from the log)
    ABORTED

A failure before ``commit`` was called cannot have committed anything (the runtime aborts);
a failure inside ``commit`` has committed nothing only when the backend says it aborted
(``TransactionAbortedError``). Anything else, including "committed but the delivery reports
are missing", leaves the outcome to be read back from the log (Quix Streams'
``PartitionTransaction`` status, Kafka Streams' ``TaskCorruptedException`` handling).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping

from dagfold.exceptions import FencedError, LogError, TransactionAbortedError
from dagfold.log.base import Consumer, TopicPartition, TransactionalProducer
from dagfold.processor.exceptions import ProcessorError

log = logging.getLogger("dagfold.processor")


class TxnStatus(enum.Enum):
    OPEN = "open"
    COMMITTING = "committing"
    COMMITTED = "committed"
    ABORTED = "aborted"
    UNKNOWN = "unknown"


class LogTransaction:
    """``begin`` → ``send``… → ``commit``; ``status`` says what a raised ``LogError`` means."""

    __slots__ = ("_producer", "status")

    def __init__(self, producer: TransactionalProducer) -> None:
        self._producer = producer
        self.status = TxnStatus.OPEN
        try:
            producer.begin()
        except FencedError:
            raise
        except LogError:
            self._abort()
            raise

    def send(self, topic: str, key: bytes, value: bytes, partition: int | None = None, report: bool = True) -> None:
        """``report=False``: no offset of this record is needed (``TransactionalProducer.send``)."""
        if self.status is not TxnStatus.OPEN:
            raise ProcessorError(f"send in a {self.status.value} transaction")
        try:
            self._producer.send(topic, key, value, partition, report)
        except FencedError:
            raise
        except LogError:
            self._abort()
            raise

    def commit(self, offsets: Mapping[TopicPartition, int], consumer: Consumer | None) -> dict[TopicPartition, int]:
        """Commit the records and the consumed offsets; the last offset written per partition."""
        if self.status is not TxnStatus.OPEN:
            raise ProcessorError(f"commit of a {self.status.value} transaction")
        self.status = TxnStatus.COMMITTING
        try:
            last = self._producer.commit(offsets, consumer)
        except FencedError:
            self.status = TxnStatus.UNKNOWN  # a zombie's fate does not matter: it stops
            raise
        except TransactionAbortedError:
            self.status = TxnStatus.ABORTED
            raise
        except LogError:
            self.status = TxnStatus.UNKNOWN
            raise
        self.status = TxnStatus.COMMITTED
        return last

    def abort(self) -> None:
        """Give up an open transaction (the caller failed before ``commit``): nothing is committed."""
        if self.status is not TxnStatus.OPEN:
            raise ProcessorError(f"abort of a {self.status.value} transaction")
        self._abort()

    def _abort(self) -> None:
        self.status = TxnStatus.ABORTED
        try:
            self._producer.abort()
        except FencedError:
            raise
        except LogError as exc:  # nothing was committed either way; the backend finishes the abort later
            log.warning("abort failed (completed before the next transaction): %s", exc)
