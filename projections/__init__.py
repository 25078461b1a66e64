"""Read models folded from the events topic (projector + query API).

The projector (``Projector``) tails every partition of the events topic and
applies each polled batch, together with the consumed offsets, in one RocksDB
write batch (``Store``), so the read model and its position never disagree and
a restart resumes exactly where it stopped. ``ReadModel`` answers the API's
queries from the same store, safe to use from other threads.
"""

from projections.exceptions import InvalidCursor, ProjectionError, StoreError
from projections.jobs import JOB_STATES, TASK_STATES, TERMINAL_JOB_STATES, Page, ReadModel, apply
from projections.projector import Projector
from projections.store import Store, Txn

__all__ = [
    "JOB_STATES",
    "TASK_STATES",
    "TERMINAL_JOB_STATES",
    "InvalidCursor",
    "Page",
    "ProjectionError",
    "Projector",
    "ReadModel",
    "Store",
    "StoreError",
    "Txn",
    "apply",
]
