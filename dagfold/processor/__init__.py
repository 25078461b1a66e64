"""The partition-processor runtime: the one cycle around every fold (see ``processor``).

* ``fold``: the ``Fold`` protocol and the ``FoldContext`` processors decide in;
* ``transaction``: a log transaction with an explicit status (open, committing, committed,
  aborted, unknown), which decides what a failure means;
* ``catchup``: applying a partition's events to its state (assignment, reconciliation);
* ``timers``: due-timer scans that write timer commands to the log;
* ``processor``: ``PartitionProcessor`` and its configuration, ``ProcessorSpec``.
"""

from dagfold.processor.catchup import catch_up
from dagfold.processor.exceptions import ProcessorError
from dagfold.processor.fold import Fold, FoldContext
from dagfold.processor.processor import PartitionProcessor, ProcessorSpec
from dagfold.processor.timers import TimerPolicy, TimerScanner
from dagfold.processor.transaction import LogTransaction, TxnStatus

__all__ = ["Fold", "FoldContext", "LogTransaction", "PartitionProcessor", "ProcessorError", "ProcessorSpec",
           "TimerPolicy", "TimerScanner", "TxnStatus", "catch_up"]
