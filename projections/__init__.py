"""Read models folded from the events topic (projector + query API).

The projector (``Projector``) tails every partition of the events topic (and
the GPU allocator's events topic once it exists) and applies each polled batch,
together with the consumed offsets, in one RocksDB write batch (``ReadModelStore``), so
the read models and their position never disagree and a restart resumes
exactly where it stopped. Deleting the store rebuilds every model by replay.

Queries, safe from other threads: ``ReadModel`` (jobs, tasks, attempts,
history), ``OperatorModel`` (tenant usage, queue depths, stuck tasks, failure
reasons) and ``ClusterModel`` (GPU nodes, allocations, tenant GPU shares).
"""

from dagfold.lifecycle import JOB_STATES, TASK_STATES
from dagfold.projections.cluster import ClusterModel
from dagfold.projections.exceptions import InvalidCursor, ProjectionError, StoreError
from dagfold.projections.jobs import TERMINAL_JOB_STATES, Page, ReadModel, apply
from dagfold.projections.operator import OperatorModel
from dagfold.projections.projector import Projector
from dagfold.projections.store import ReadModelStore, ReadModelTxn

__all__ = [
    "JOB_STATES",
    "TASK_STATES",
    "TERMINAL_JOB_STATES",
    "ClusterModel",
    "InvalidCursor",
    "OperatorModel",
    "Page",
    "ProjectionError",
    "Projector",
    "ReadModel",
    "ReadModelStore",
    "StoreError",
    "ReadModelTxn",
    "apply",
]
