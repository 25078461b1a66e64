"""Virtual-time harness: the scheduler as it runs in production, over an in-memory log and a fake clock.

A facade over ``dagfold.processor.driver.VirtualDriver``: the real ``PartitionProcessor`` configured
by ``scheduler_spec`` (admission, the fold in its state transaction, the log transaction, the state
commit, timers written through the log by the runtime's scanner), one command partition, state in
memory. Tests, property checks and the simulator drive it command by command and control time
explicitly (``advance`` moves the clock and lets the runtime fire what fell due).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from dagfold.codec import Record
from dagfold.commands import job_id_of
from dagfold.config import COMMANDS, EVENTS, SCHEDULER_INTERNAL, Config, SchedulerOptions
from dagfold.outputs import Output
from dagfold.processor.driver import DriverFacade, VirtualDriver
from dagfold.services.scheduler.appliers import get_job, get_task
from dagfold.services.scheduler.fold import SchedulerFold
from dagfold.services.scheduler.runner import INTERNAL_ONLY, scheduler_spec
from dagfold.state import MemoryStore, PartitionTransaction, Store
from dagfold.state.store import state_digest


class FoldHarness(DriverFacade):
    """The scheduler of one partition on a ``VirtualDriver``; its outputs sorted into lists."""

    def __init__(self, opts: SchedulerOptions | None = None, now_ms: int = 1_000_000,
                 store: Store | None = None) -> None:
        """``store``: where the partition's state goes (default: a ``MemoryStore`` with the fold's value cache)."""
        self.opts = opts or SchedulerOptions()
        config = Config(partitions=1, allocator_partitions=1, dispatch_partitions=1, scheduler=self.opts)
        self.driver = VirtualDriver(scheduler_spec(config, "harness"), now_ms=now_ms,
                                    topics=config.core_topics(), client_id="scheduler-harness",
                                    store_for=None if store is None else lambda partition: store)
        self.events: list[Record] = []
        self.dispatched: deque[Record] = deque()
        self.controls: list[Record] = []

    @property
    def fold(self) -> SchedulerFold:
        fold = self.driver.fold(0)
        assert isinstance(fold, SchedulerFold)
        return fold

    def _sort(self, out: Sequence[Output]) -> None:
        for o in out:
            if o.topic == EVENTS:
                self.events.append(o.record)
            elif o.record["type"] == "dagfold.dispatch.TaskDispatch":
                self.dispatched.append(o.record)
            else:
                self.controls.append(o.record)

    def process(self, cmd: Record) -> list[Output]:
        """Write one command to the log (allocation grants to ``scheduler.internal``, where only the
        allocators may write) and run the scheduler until it is idle: one transaction per command."""
        topic = SCHEDULER_INTERNAL if cmd["type"] in INTERNAL_ONLY else COMMANDS
        out = self.driver.process(topic, job_id_of(cmd), cmd)
        self._sort(out)
        return out

    def submit(self, spec: Record) -> list[Output]:
        return self.process({"type": "dagfold.command.SubmitJob", "spec": spec,
                             "submitted_at_ms": self.now_ms, "source": "harness"})

    def advance(self, ms: int) -> int:
        """Move the clock and let the runtime fire every timer now due; returns how many fired."""
        before = self.offset
        self._sort(self.driver.advance(ms))
        return self.offset - before

    # -- worker reports -------------------------------------------------------------
    def report(self, kind: str, d: Record, worker: str = "w1", **fields: Any) -> list[Output]:
        base = {"type": f"dagfold.command.Task{kind}", "job_id": d["job_id"], "task_id": d["task_id"],
                "attempt": d["attempt"], "worker_id": worker, "ts_ms": self.now_ms}
        defaults: dict[str, dict[str, Any]] = {
            "Heartbeat": {"progress": None, "message": None},
            "Succeeded": {"result_json": None, "stdout_tail": "", "stderr_tail": ""},
            "Failed": {"reason": "failed", "exit_code": None, "error_type": None, "retryable": True,
                       "stdout_tail": "", "stderr_tail": ""},
        }
        return self.process({**base, **defaults.get(kind, {}), **fields})

    def run_all(self, worker: str = "w1", max_steps: int = 10_000_000) -> int:
        """Start and succeed every dispatched task until the queue is empty; returns tasks run."""
        n = 0
        while self.dispatched and n < max_steps:
            d = self.dispatched.popleft()
            self.report("Started", d, worker)
            self.report("Succeeded", d, worker)
            n += 1
        return n

    # -- inspection -------------------------------------------------------------------
    def job(self, job_id: str) -> dict[str, Any] | None:
        return get_job(PartitionTransaction(self.store), job_id)

    def task(self, job_id: str, task_id: str) -> dict[str, Any] | None:
        return get_task(PartitionTransaction(self.store), job_id, task_id)

    def event_types(self, job_id: str | None = None) -> list[str]:
        return [e["type"].rsplit(".", 1)[-1] for e in self.events if job_id is None or e["job_id"] == job_id]

    def digest(self) -> str:
        return state_digest(self.store)

    def replayed_digest(self) -> str:
        """Digest of a fresh store built by applying the events topic only, as the log holds them."""
        store = MemoryStore()
        for e in self.driver.read(EVENTS):
            txn = PartitionTransaction(store)
            SchedulerFold.apply(txn, e)
            txn.commit()
        return state_digest(store)
