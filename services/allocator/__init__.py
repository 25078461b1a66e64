"""The GPU allocator: one single-writer deterministic fold per GPU pool.

``(state, command, now_ms) -> events``, in the scheduler's style: processors
decide and emit events, appliers are the only code that changes state, and
replaying the events alone rebuilds the state byte for byte. The same fold runs
under Kafka (one partition of ``allocator.commands`` per pool), under the
virtual-time harness and under the simulator (``dagfold sim ...``).

Modules, in dependency order:

* ``options``      frozen knobs (tiers, tenant weights/quotas, policies, timeouts)
* ``keys``         RocksDB key layout of a pool's state
* ``model``        typed views of nodes, allocations and requests (+ their store records)
* ``capacity``     the capacity index: hosts bucketed by free GPUs per GPU type
* ``profile``      the learned request-shape distribution used by placement scoring
* ``state``        PoolState: the transaction plus the in-memory indexes (a cache of the store)
* ``placement``    feasibility and scoring (frag-aware, best-fit, first-fit)
* ``appliers``     events -> state
* ``reservations`` earliest-start reservations for the head-of-line request (backfill)
* ``preemption``   victim selection
* ``passes``       the scheduling pass: tiers, weighted DRF, backfill, preemption
* ``processors``   commands -> events
* ``fold``         AllocatorFold: process/apply
* ``timers``       due-timer scans (store and in-memory)
* ``harness``      virtual-time driver used by tests and the simulator
* ``sim``/``cli``  the simulator and its Typer sub-app
"""
