"""Virtual-time harness: the scheduler fold with an in-memory store and a fake clock.

The same fold as in production, with the log replaced by lists: tests, property
checks, the simulator and the fold benchmark drive it command by command and
control time explicitly (``advance`` fires due timers through the fold, as the
live timer does through the log).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dagfold.codec import Record
from dagfold.config import EVENTS, SchedulerOptions
from dagfold.outputs import Output
from dagfold.services.scheduler.appliers import get_job, get_task
from dagfold.services.scheduler.fold import SchedulerFold
from dagfold.services.scheduler.timers import due_timers
from dagfold.state import MemoryStore, PartitionTransaction
from dagfold.state.store import state_digest


@dataclass
class FoldHarness:
    opts: SchedulerOptions = field(default_factory=SchedulerOptions)
    now_ms: int = 1_000_000
    store: MemoryStore = field(default_factory=lambda: MemoryStore(SchedulerFold.CACHE_VALUES))
    events: list[Record] = field(default_factory=list)
    dispatched: deque[Record] = field(default_factory=deque)
    controls: list[Record] = field(default_factory=list)
    offset: int = 0

    def __post_init__(self) -> None:
        self.fold = SchedulerFold(self.opts)

    def process(self, cmd: Record) -> list[Output]:
        """Fold one command in its own transaction, as the runner does per batch."""
        txn = PartitionTransaction(self.store)
        out = self.fold.process(txn, cmd, self.now_ms, self.offset)
        txn.commit(applied_events=self.offset)
        self.offset += 1
        for o in out:
            if o.topic == EVENTS:
                self.events.append(o.record)
            elif o.record["type"] == "dagfold.dispatch.TaskDispatch":
                self.dispatched.append(o.record)
            else:
                self.controls.append(o.record)
        return out

    def submit(self, spec: Record) -> list[Output]:
        return self.process({"type": "dagfold.command.SubmitJob", "spec": spec,
                             "submitted_at_ms": self.now_ms, "source": "harness"})

    def advance(self, ms: int) -> int:
        """Move the clock and fold a TimerFired for every timer now due; returns how many fired."""
        self.now_ms += ms
        fired = [cmd for _, cmd in due_timers(self.store, self.now_ms)]
        for cmd in fired:
            self.process(cmd)
        return len(fired)

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
        """Digest of a fresh store built by applying this harness's events only."""
        store = MemoryStore()
        for e in self.events:
            txn = PartitionTransaction(store)
            SchedulerFold.apply(txn, e)
            txn.commit()
        return state_digest(store)
