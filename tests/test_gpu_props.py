"""Property test of the scheduler and the allocator folded together, in virtual time.

Both folds run as in production (``FoldHarness``, ``AllocatorHarness``); the
world between them is simulated: a message bus with one FIFO queue per producer
(Kafka keeps a producer's order per partition, not the order between
producers), at-least-once delivery (duplicates), node agents that run GPU
attempts for a virtual duration, heartbeat, checkpoint, obey stops, and CPU
workers. Hypothesis draws the jobs (small DAGs mixing CPU and GPU tasks, gangs,
tiers), the cluster, and a fault schedule: node crashes, network partitions
(healed later), re-registrations, duplicated deliveries and cancellations.

Invariants:

1. every job ends once the faults stop;
2. a GPU task succeeds at most once, reported by the allocation the scheduler
   last granted it (``worker_id`` = allocation ID);
3. a GpuTaskDispatch names an allocation the allocator granted, on its hosts
   and GPU indices;
4. nothing is left behind: no allocation, no queued request, and no process
   on an agent once every job has ended;
5. the allocator's GPU accounting returns to whole GPUs everywhere;
6. replaying each fold's events gives its live state.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dagfold.codec import Record
from dagfold.config import ALLOCATOR_COMMANDS, COMMANDS, CONTROL, EVENTS, SCHEDULER_INTERNAL
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.outputs import Output
from dagfold.services.allocator import commands as acmds
from dagfold.services.allocator.harness import AllocatorHarness
from dagfold.services.allocator.model import FULL
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.timers import due_timers as alloc_due
from dagfold.services.scheduler.harness import FoldHarness
from dagfold.services.scheduler.timers import due_timers as sched_due

POOL = "p"
TICK_MS = 250


@dataclass
class Proc:
    alloc_id: str
    epoch: int
    job_id: str
    task_id: str
    attempt: int
    leader: bool
    left_ms: int
    ckpt: str | None = None


@dataclass
class Node:
    name: str
    gpus: int
    up: bool = True
    cut: bool = False  # partitioned: runs its processes, sends and receives nothing
    incarnation: int = 1
    procs: dict[str, Proc] = field(default_factory=dict)
    ended: set[str] = field(default_factory=set)
    lost: bool = False  # the allocator declared it lost: it re-registers once it hears of it


class World:
    def __init__(self, nodes: list[int], rnd: random.Random, dup_p: float) -> None:
        self.rnd = rnd
        self.dup_p = dup_p
        self.sched = FoldHarness()
        self.alloc = AllocatorHarness(AllocatorOptions(pool=POOL, lease_s=3.0, grace_s=2.0, runtime_grace_s=5.0))
        self.alloc.now_ms = self.sched.now_ms
        self.queues: dict[str, deque[tuple[str, Record]]] = {}
        self.nodes = {f"n{i}": Node(f"n{i}", g) for i, g in enumerate(nodes)}
        self.sched_events: list[Record] = []
        self.grants: dict[str, Record] = {}
        self.dispatches: list[Record] = []
        self.successes: list[Record] = []
        self.cpu_running: list[Record] = []
        for n in self.nodes.values():
            self.alloc.register(n.name, "H100", n.gpus, incarnation=n.incarnation)

    # -- bus ---------------------------------------------------------------------------------
    def send(self, source: str, dest: str, rec: Record) -> None:
        self.queues.setdefault(source, deque()).append((dest, rec))

    def route(self, source: str, outs: list[Output]) -> None:
        for o in outs:
            if o.topic == EVENTS:
                self.sched_events.append(o.record)
            elif o.topic in (COMMANDS, SCHEDULER_INTERNAL):
                self.send(source, "sched", o.record)
            elif o.topic == ALLOCATOR_COMMANDS:
                self.send(source, "alloc", o.record)
            elif o.topic == CONTROL and o.key in self.nodes:
                self.send(source, f"node:{o.key}", o.record)
            elif o.topic == CONTROL:
                pass  # a StopTask for a CPU worker: the simulated workers finish at once
            elif o.record["type"] == "dagfold.dispatch.TaskDispatch":
                self.cpu_running.append(o.record)
            elif o.record["type"].startswith("dagfold.allocator."):
                self.on_alloc_event(o.record)

    def on_alloc_event(self, e: Record) -> None:
        if e["type"].endswith("AllocationGranted"):
            self.grants[e["alloc_id"]] = e
        elif e["type"].endswith(("AllocationReleased", "AllocationExpired")):
            for n in e["node_ids"]:
                self.nodes[n].ended.add(e["alloc_id"])  # what the agent reads on allocator.events
        elif e["type"].endswith("NodeDrained") and e["lost"]:
            node = self.nodes[e["node_id"]]
            node.lost = True
            if node.up and not node.cut:
                self.rejoin(node)

    def rejoin(self, n: Node) -> None:
        """What an agent does on hearing it was lost: stop every process, register a new incarnation."""
        n.procs.clear()
        n.lost = False
        n.incarnation += 1
        self.send(n.name, "alloc", acmds.register_node(POOL, n.name, "H100", n.gpus, incarnation=n.incarnation,
                                                       ts_ms=self.now))

    def deliver(self, dest: str, rec: Record) -> None:
        if dest == "sched":
            self.route("sched", self.sched.process(rec))
        elif dest == "alloc":
            self.route("alloc", self.alloc.process(rec))
        else:
            self.on_control(self.nodes[dest[5:]], rec)

    def pump(self, limit: int = 10_000) -> None:
        """Deliver queued messages, producers interleaved at random, some twice."""
        for _ in range(limit):
            live = [s for s, q in self.queues.items() if q]
            if not live:
                return
            src = self.rnd.choice(live)
            dest, rec = self.queues[src].popleft()
            if dest.startswith("node:") and (not self.nodes[dest[5:]].up or self.nodes[dest[5:]].cut):
                continue  # lost with the node (a cut node reads its control partition later: modelled lost)
            self.deliver(dest, rec)
            if self.rnd.random() < self.dup_p:
                self.queues[src].append((dest, rec))
        raise AssertionError("the bus did not drain")

    # -- agents and workers ----------------------------------------------------------------------
    def on_control(self, n: Node, c: Record) -> None:
        if c["type"] == "dagfold.control.GpuTaskDispatch":
            self.dispatches.append(c)
            aid = c["alloc_id"]
            if aid in n.procs or aid in n.ended:
                return
            n.procs[aid] = Proc(aid, c["epoch"], c["job_id"], c["task_id"], c["attempt"], c["leader"],
                                self.rnd.randint(1, 12) * TICK_MS, c["resume_checkpoint"])
            if c["leader"]:
                self.report(n, n.procs[aid], "Started")
        elif c["type"] == "dagfold.allocator.StopAllocation":
            p = n.procs.get(c["alloc_id"])
            if p is None and not c["alloc_id"]:
                n.procs.clear()
                return
            if p is None:
                return
            del n.procs[p.alloc_id]
            if c["checkpoint"]:
                self.send(n.name, "alloc", acmds.release_allocation(
                    POOL, p.alloc_id, p.epoch, n.name, "preempted", checkpoint_uri=p.ckpt, ts_ms=self.now))

    def report(self, n: Node, p: Proc, kind: str) -> None:
        base = {"type": f"dagfold.command.Task{kind}", "job_id": p.job_id, "task_id": p.task_id,
                "attempt": p.attempt, "worker_id": p.alloc_id, "ts_ms": self.now}
        extra = {"Heartbeat": {"progress": None, "message": p.ckpt},
                 "Succeeded": {"result_json": None, "stdout_tail": "", "stderr_tail": ""}}.get(kind, {})
        self.send(n.name, "sched", {**base, **extra})

    @property
    def now(self) -> int:
        return self.sched.now_ms

    def tick(self) -> None:
        self.sched.now_ms += TICK_MS
        self.alloc.now_ms = self.sched.now_ms
        for _, cmd in list(sched_due(self.sched.store, self.now)):
            self.route("sched", self.sched.process(cmd))
        for cmd in alloc_due(self.alloc.fold, self.now):
            self.route("alloc", self.alloc.process(cmd))
        for n in self.nodes.values():
            if not n.up:
                continue
            for p in list(n.procs.values()):
                p.left_ms -= TICK_MS
                p.ckpt = f"ckpt/{p.job_id}/{p.task_id}/{self.now}"
                if p.left_ms <= 0:
                    del n.procs[p.alloc_id]
                    if n.cut:
                        continue  # finished behind the partition: nobody hears of it
                    self.send(n.name, "alloc", acmds.release_allocation(POOL, p.alloc_id, p.epoch, n.name,
                                                                        ts_ms=self.now))
                    if p.leader:
                        self.report(n, p, "Succeeded")
            if n.cut:
                continue
            statuses = [acmds.alloc_status(p.alloc_id, p.epoch, checkpoint_uri=p.ckpt) for p in n.procs.values()]
            self.send(n.name, "alloc", acmds.node_heartbeat(POOL, n.name, incarnation=n.incarnation,
                                                            ts_ms=self.now, allocations=statuses))
            for p in n.procs.values():
                if p.leader:
                    self.report(n, p, "Heartbeat")
        for d in self.cpu_running:
            w = {"job_id": d["job_id"], "task_id": d["task_id"], "attempt": d["attempt"]}
            self.route("sched", self.sched.report("Started", w))
            self.route("sched", self.sched.report("Succeeded", w))
        self.cpu_running.clear()
        self.pump()

    # -- faults --------------------------------------------------------------------------------------
    def fault(self, kind: str, which: int) -> None:
        n = list(self.nodes.values())[which % len(self.nodes)]
        if kind == "crash" and n.up:
            n.up = False
            n.procs.clear()
        elif kind == "restart" and not n.up:
            n.up, n.cut = True, False
            self.rejoin(n)
        elif kind == "cut" and n.up:
            n.cut = True
        elif kind == "heal" and n.cut:
            n.cut = False
            # back from a partition: it reads what it missed on allocator.events and stops what ended
            for aid in [a for a in n.procs if a in n.ended]:
                del n.procs[aid]
            if n.lost:
                self.rejoin(n)

    def heal_all(self) -> None:
        for i, n in enumerate(self.nodes.values()):
            if not n.up:
                self.fault("restart", i)
            elif n.cut:
                self.fault("heal", i)


def job_docs(i: int) -> Any:
    gpu_res = st.fixed_dictionaries({"gpus": st.integers(1, 4), "hosts": st.integers(1, 2),
                                     "checkpoint": st.booleans()})

    @st.composite
    def build(draw: Any) -> Record:
        n = draw(st.integers(1, 4))
        tasks = []
        for t in range(n):
            deps = draw(st.lists(st.integers(0, t - 1), max_size=2, unique=True)) if t else []
            task: dict[str, Any] = {"id": f"t{t}", "depends_on": [f"t{d}" for d in deps]}
            if draw(st.booleans()):
                task.update(handler="gpu", queue=POOL, resources=draw(gpu_res))
            tasks.append(task)
        doc = {"id": f"J{i}", "tier": draw(st.sampled_from(["enterprise", "standard", "free"])),
               "tenant": draw(st.sampled_from(["a", "b"])), "tasks": tasks,
               "retry": {"max_attempts": 3, "initial_interval_s": 0.5, "jitter": False}}
        return to_job_spec(parse_spec(doc))

    return build()


FAULTS = st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["crash", "restart", "cut", "heal", "cancel"]),
                            st.integers(0, 7)), max_size=8)


@pytest.mark.filterwarnings("ignore")
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.lists(st.sampled_from([2, 4, 8]), min_size=2, max_size=4),
       specs=st.integers(1, 4).flatmap(lambda n: st.tuples(*[job_docs(i) for i in range(n)])),
       faults=FAULTS, dup_p=st.sampled_from([0.0, 0.05, 0.2]), seed=st.integers(0, 2**32 - 1))
def test_gpu_jobs_end_and_leave_nothing_behind(nodes: list[int], specs: tuple[Record, ...],
                                                faults: list[tuple[int, str, int]], dup_p: float, seed: int) -> None:
    w = World(nodes, random.Random(seed), dup_p)
    w.pump()
    for spec in specs:
        w.route("api", w.sched.submit(spec))
    w.pump()
    by_tick: dict[int, list[tuple[str, int]]] = {}
    for at, kind, which in faults:
        by_tick.setdefault(at, []).append((kind, which))
    for t in range(41):
        for kind, which in by_tick.get(t, []):
            if kind == "cancel":
                job = specs[which % len(specs)]["job_id"]
                w.route("api", w.sched.process({"type": "dagfold.command.CancelJob", "job_id": job,
                                                "reason": "test", "requested_at_ms": w.now}))
            else:
                w.fault(kind, which)
        w.tick()
    w.heal_all()
    for _ in range(2000):  # the drain: no more faults
        if all(w.sched.job(s["job_id"])["state"] != "running" for s in specs):  # type: ignore[index]
            break
        w.tick()
    for _ in range(20):  # let releases and stops settle
        w.tick()

    for name in ("TaskRequeued", "TaskAllocated", "ReportIgnored", "JobCancelled"):
        if any(e["type"].endswith(name) for e in w.sched_events):
            event(name)  # --hypothesis-show-statistics: how often each path was taken
    # 1. every job ended
    states = {s["job_id"]: w.sched.job(s["job_id"])["state"] for s in specs}  # type: ignore[index]
    assert "running" not in states.values(), states
    # 2. one success per task, from the allocation last granted to it
    ok = [e for e in w.sched_events if e["type"] == "dagfold.event.TaskSucceeded"]
    assert len({(e["job_id"], e["task_id"]) for e in ok}) == len(ok)
    allocated: dict[tuple[str, str], str] = {}
    for e in w.sched_events:
        if e["type"] == "dagfold.event.TaskAllocated":
            allocated[(e["job_id"], e["task_id"])] = e["alloc_id"]
        elif e["type"] == "dagfold.event.TaskSucceeded" and (e["job_id"], e["task_id"]) in allocated:
            assert e["worker_id"] == allocated[(e["job_id"], e["task_id"])]
    # 3. dispatches name real grants, on their hosts and GPUs
    for d in w.dispatches:
        g = w.grants[d["alloc_id"]]
        host = next(h for h in g["hosts"] if h["node_id"] == d["node_id"])
        assert list(host["gpu_indices"]) == list(d["gpu_indices"])
        assert (g["job_id"], g["task_id"], g["attempt"]) == (d["job_id"], d["task_id"], d["attempt"])
    # 4. nothing left behind
    st_ = w.alloc.fold.state
    assert not st_.allocs, list(st_.allocs)
    assert not st_.requests, list(st_.requests)
    assert not any(n.procs for n in w.nodes.values())
    # 5. accounting: with nothing allocated, every GPU of every node is whole again
    for n in st_.nodes.values():
        assert all(f == FULL for f in n.free), (n.id, n.free)
    # 6. replay equals live
    assert w.sched.replayed_digest() == w.sched.digest()
    assert w.alloc.replayed_digest() == w.alloc.digest()
