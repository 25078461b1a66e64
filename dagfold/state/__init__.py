"""Partition state: a RocksDB store per partition, changed only through transactions.

A transaction gathers the fold's reads and writes in memory; ``commit`` turns
them, together with the partition's applied-events offset, into one RocksDB
write batch (Restate's "one atomic batch of state + applied offset"). The
in-memory store has the same interface for the simulator and property tests.
"""

from dagfold.state.exceptions import StateError
from dagfold.state.store import MemoryStore, PartitionStore, PartitionTransaction, Store

__all__ = ["MemoryStore", "PartitionStore", "PartitionTransaction", "StateError", "Store"]
