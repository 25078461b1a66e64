"""Shared machinery of the time-driven simulations (``openb`` and ``day``).

A virtual clock, a heap of simulated world events (arrivals, process exits,
checkpoints, heartbeats, faults) and the allocator fold driven directly
(``SimAllocator``: why not through the runtime, see its module); the fold's
own timers are interleaved in due order. The world reacts to the fold's events
the way node agents would: it starts a job on a grant, checkpoints and releases
on a preemption request, loses the work since the last checkpoint when its node
is lost, and resumes from the checkpoint when the job is granted again.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dagfold.codec import Record
from dagfold.config import ALLOCATOR_EVENTS
from dagfold.outputs import Output
from dagfold.services.allocator import commands as cmds
from dagfold.services.allocator.harness import SimAllocator
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.timers import fired

A = "dagfold.allocator."
INF = float("inf")


@dataclass(slots=True)
class Job:
    """One simulated task attempt and what happened to it."""

    id: str
    tenant: str
    tier: str
    gpus: int
    hosts: int
    work_ms: int  # GPU time it needs at nominal speed
    max_runtime_s: float | None
    checkpoint: bool
    submit_ms: int
    milli: int = 1000
    cpu: int = 0
    mem: int = 0
    gpu_types: tuple[str, ...] = ()
    done_ms: float = 0.0  # work saved at the last checkpoint (resume point)
    run_from: float = 0.0  # work done when the current grant started
    start_ms: int = -1  # current grant
    speed: float = 1.0
    alloc: str | None = None
    epoch: int = 0
    first_grant_ms: int = -1
    end_ms: int = -1
    grants: int = 0
    preempted: int = 0
    lost_work_ms: float = 0.0
    releasing: bool = False
    queued_ms: int = 0
    queue_ms: float = 0.0  # total time waiting, all (re)queues
    measured: bool = True
    token: int = 0  # the pending exit event that is current

    def progress(self, now: int) -> float:
        return self.run_from + (now - self.start_ms) * self.speed if self.start_ms >= 0 else self.done_ms


@dataclass
class World:
    """The simulated cluster around one allocator fold."""

    opts: AllocatorOptions
    hb_ms: int = 300_000
    ckpt_every_ms: int = 300_000
    ckpt_cost_ms: int = 10_000  # time a job takes to write a checkpoint when asked
    start_ms: int = 0
    harness: SimAllocator = field(init=False)
    jobs: dict[str, Job] = field(default_factory=dict)
    heap: list[tuple[int, int, str, Any]] = field(default_factory=list)
    seq: int = 0
    alloc_job: dict[str, Job] = field(default_factory=dict)
    node_speed: dict[str, float] = field(default_factory=dict)
    node_health: dict[str, str] = field(default_factory=dict)
    node_perf: dict[str, float] = field(default_factory=dict)
    node_allocs: dict[str, set[str]] = field(default_factory=dict)
    node_up: dict[str, bool] = field(default_factory=dict)
    node_inc: dict[str, int] = field(default_factory=dict)
    busy_gpu_milli: int = 0
    busy_integral: float = 0.0
    last_t: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    fold_s: float = 0.0
    fold_cpu_s: float = 0.0
    pass_lat: list[float] = field(default_factory=list)  # wall time per decision-making command
    pass_cpu: list[float] = field(default_factory=list)  # CPU time of the same (immune to other processes)
    attempts: int = 0
    res_first: dict[str, int] = field(default_factory=dict)
    res_wait: list[float] = field(default_factory=list)
    samples: list[tuple[int, float]] = field(default_factory=list)
    jain: list[float] = field(default_factory=list)
    on_tick: Callable[[World], None] | None = None

    def __post_init__(self) -> None:
        self.harness = SimAllocator(opts=self.opts, now_ms=self.start_ms, keep_events=False, commit_every=2048)
        self.last_t = self.start_ms

    # -- world events ------------------------------------------------------------------------
    def at(self, t: int, kind: str, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (int(t), self.seq, kind, payload))

    def now(self) -> int:
        return self.harness.now_ms

    def _advance_clock(self, t: int) -> None:
        if t > self.last_t:
            self.busy_integral += self.busy_gpu_milli * (t - self.last_t)
            self.last_t = t
        self.harness.now_ms = max(self.harness.now_ms, t)

    def process(self, cmd: Record, pass_cmd: bool = True) -> list[Output]:
        s = time.perf_counter()
        c = time.thread_time()
        out = self.harness.process(cmd)
        dc = time.thread_time() - c
        dt = time.perf_counter() - s
        self.fold_s += dt
        self.fold_cpu_s += dc
        self.attempts += self.harness.fold.last_attempts
        if pass_cmd:
            self.pass_lat.append(dt)
            self.pass_cpu.append(dc)
        for o in out:
            if o.topic == ALLOCATOR_EVENTS:
                self.on_event(o.record)
        return out

    def run(self, end_ms: int, handlers: dict[str, Callable[[Any], None]], sample_ms: int = 300_000) -> None:
        next_sample = self.start_ms
        h = self.harness
        while True:
            t_world: float = self.heap[0][0] if self.heap else INF
            nt = h.fold.state.next_timer_ms()
            t_timer: float = INF if nt is None else nt
            t = min(t_world, t_timer, float(next_sample))
            if t > end_ms or t == INF:
                break
            self._advance_clock(int(t))
            if t == next_sample:
                self.sample()
                next_sample += sample_ms
                continue
            if t_timer <= t_world:
                for c in list(h.fold.state.due_timers(int(t))):
                    self.process(fired(self.opts.pool, c[0], c[1], c[2], int(t)))
                continue
            _, _, kind, payload = heapq.heappop(self.heap)
            handlers[kind](payload)
        self._advance_clock(end_ms)
        h.commit()

    # -- reactions to the fold's events ---------------------------------------------------------
    def on_event(self, e: Record) -> None:
        name = e["type"][len(A):]
        self.counts[name] = self.counts.get(name, 0) + 1
        now = e["ts_ms"]
        if name == "AllocationGranted":
            j = self.jobs[e["job_id"]]
            j.alloc, j.epoch = e["alloc_id"], e["epoch"]
            j.grants += 1
            j.queue_ms += now - j.queued_ms
            if j.first_grant_ms < 0:
                j.first_grant_ms = now
            j.start_ms = now
            j.run_from = j.done_ms
            nodes = [h["node_id"] for h in e["hosts"]]
            j.speed = min(self.node_speed.get(n, 1.0) for n in nodes)
            j.releasing = False
            self.alloc_job[j.alloc] = j
            for n in nodes:
                self.node_allocs.setdefault(n, set()).add(j.alloc)
            self.busy_gpu_milli += j.hosts * j.gpus * (j.milli if j.gpus == 1 else 1000)
            self.schedule_finish(j)
            key = f"{j.id}\x1fgpu\x1f1"
            if key in self.res_first:
                self.res_wait.append((now - self.res_first.pop(key)) / 1000)
        elif name in ("AllocationReleased", "AllocationExpired"):
            ended = self.alloc_job.pop(e["alloc_id"], None)
            if ended is None:
                return
            j = ended
            for n in e["node_ids"]:
                self.node_allocs.get(n, set()).discard(e["alloc_id"])
            self.busy_gpu_milli -= j.hosts * j.gpus * (j.milli if j.gpus == 1 else 1000)
            if e["requeued"]:
                prog = j.progress(now)
                if not j.releasing:  # lost without a checkpoint request: back to the last periodic one
                    saved = self.periodic_ckpt(j, prog)
                    j.lost_work_ms += prog - saved
                    j.done_ms = saved
                j.alloc = None
                j.start_ms = -1
                j.queued_ms = now
            elif j.end_ms < 0 and e["reason"] != "completed":
                j.end_ms = now  # failed / cancelled / runtime exceeded
                j.alloc = None
        elif name == "PreemptionRequested":
            victim = self.alloc_job.get(e["alloc_id"])
            if victim is None or victim.releasing:
                return
            j = victim
            if e["preemptor_job_id"] is not None:
                j.preempted += 1
            j.releasing = True
            prog = j.progress(now)
            if j.checkpoint:
                j.done_ms = prog
                self.at(now + self.ckpt_cost_ms, "ckpt_release", (j.id, j.alloc, j.epoch))
            else:
                j.lost_work_ms += prog
                j.done_ms = 0
                self.at(now, "ckpt_release", (j.id, j.alloc, j.epoch))
        elif name == "ReservationMade" and e["kind"] == "backfill":
            self.res_first.setdefault(f"{e['job_id']}\x1f{e['task_id']}\x1f{e['attempt']}", now)
        elif name == "RequestRejected":
            rj = self.jobs.get(e["job_id"])
            if rj is not None:
                rj.end_ms = now

    def periodic_ckpt(self, j: Job, prog: float) -> float:
        if not j.checkpoint:
            return 0.0
        return max(j.done_ms, math.floor(prog / self.ckpt_every_ms) * self.ckpt_every_ms)

    def schedule_finish(self, j: Job) -> None:
        left = max(0.0, j.work_ms - j.run_from)
        j.token += 1
        self.at(j.start_ms + math.ceil(left / j.speed), "finish", (j.id, j.alloc, j.token))

    # -- world handlers ---------------------------------------------------------------------------
    def submit(self, j: Job) -> None:
        self.jobs[j.id] = j
        j.queued_ms = self.now()
        self.process(cmds.request_allocation(
            self.opts.pool, j.id, "gpu", 1, tenant=j.tenant, tier=j.tier, gpus=j.gpus, gpu_type=list(j.gpu_types),
            hosts=j.hosts, gpu_milli=j.milli, cpu_milli=j.cpu, memory_mib=j.mem, max_runtime_s=j.max_runtime_s,
            checkpoint=j.checkpoint, submitted_ms=j.submit_ms))

    def finish(self, payload: tuple[str, str, int]) -> None:
        jid, aid, token = payload
        j = self.jobs[jid]
        if j.alloc != aid or j.token != token or j.releasing:
            return
        j.end_ms = self.now()
        node = self.harness.fold.state.allocs[aid].parts[0].node
        self.process(cmds.release_allocation(self.opts.pool, aid, j.epoch, node, "completed", ts_ms=self.now()))

    def ckpt_release(self, payload: tuple[str, str, int]) -> None:
        jid, aid, epoch = payload
        j = self.jobs[jid]
        a = self.harness.fold.state.allocs.get(aid)
        if a is None or j.alloc != aid:
            return
        # a job that does not checkpoint stops with none (as an agent's process does): its work is lost
        uri = f"ckpt://{jid}/{int(j.done_ms)}" if j.checkpoint else None
        self.process(cmds.release_allocation(self.opts.pool, aid, epoch, a.parts[0].node, "preempted",
                                             checkpoint_uri=uri, ts_ms=self.now()))

    def register(self, node: str, gpu_type: str, gpus: int, cpu: int = 0, mem: int = 0) -> None:
        inc = self.node_inc.get(node, 0) + 1
        self.node_inc[node] = inc
        self.node_up[node] = True
        self.node_speed[node] = 1.0
        self.node_health[node] = "ok"
        self.node_perf[node] = 1.0
        self.process(cmds.register_node(self.opts.pool, node, gpu_type, gpus, cpu_milli=cpu, memory_mib=mem,
                                        incarnation=inc, ts_ms=self.now()), pass_cmd=True)

    def heartbeat(self, node: str) -> None:
        if not self.node_up.get(node):
            return
        now = self.now()
        allocs = []
        on_node = self.node_allocs.get(node)
        for aid in sorted(on_node) if on_node else ():
            j = self.alloc_job.get(aid)
            if j is None:
                continue
            prog = j.progress(now)
            ck = self.periodic_ckpt(j, prog)
            ck_ms = None if not j.checkpoint or ck <= 0 else now - int((prog - ck) / j.speed)
            allocs.append(cmds.alloc_status(aid, j.epoch, progress=min(1.0, prog / j.work_ms),
                                            last_checkpoint_ms=ck_ms,
                                            checkpoint_uri=None if ck_ms is None else f"ckpt://{j.id}/{int(ck)}"))
        self.process(cmds.node_heartbeat(self.opts.pool, node, incarnation=self.node_inc[node], ts_ms=now,
                                         health=self.node_health[node], perf=self.node_perf[node],
                                         allocations=allocs), pass_cmd=False)
        self.at(now + self.hb_ms, "hb", node)

    def set_speed(self, node: str, speed: float) -> None:
        """Jobs on ``node`` now progress at ``speed`` (throttling): their exit moves."""
        now = self.now()
        self.node_speed[node] = speed
        for aid in list(self.node_allocs.get(node, ())):
            j = self.alloc_job.get(aid)
            if j is None or j.releasing:
                continue
            j.run_from = j.progress(now)
            j.start_ms = now
            j.speed = speed
            self.schedule_finish(j)

    def sample(self) -> None:
        now = self.now()
        cap = sum(len(n.free) for n in self.harness.fold.state.nodes.values()) * 1000 or 1
        self.samples.append((now, self.busy_gpu_milli / cap))
        st = self.harness.fold.state
        for rank, q in st.queues.items():
            backlogged = [t for t, lst in q.items() if lst]
            if len(backlogged) < 2 or rank >= len(self.opts.tiers):
                continue
            tier = self.opts.tiers[rank]
            if self.opts.strict_tiers:
                xs = [st.usage.get((tier, t), 0) / self.opts.weight(t) for t in backlogged]
            else:  # one queue for all tiers: all-tier usage
                xs = [st.tenant_usage.get(t, 0) / self.opts.weight(t) for t in backlogged]
            s2 = sum(x * x for x in xs)
            if s2 > 0:
                self.jain.append(sum(xs) ** 2 / (len(xs) * s2))
        if self.on_tick:
            self.on_tick(self)


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(math.ceil(p / 100 * len(s))) - 1)], 3)


def with_policy(base: AllocatorOptions, policy: str) -> AllocatorOptions:
    """The compared policies as options of the same core. ours: frag placement, weighted DRF,
    backfill, preemption; bestfit: the same with best-fit placement; fifo: one FIFO queue for
    all tiers, no backfill, no preemption, first-fit."""
    if policy == "ours":
        return base
    if policy == "bestfit":
        return replace(base, placement="bestfit")
    if policy == "fifo":
        return replace(base, placement="firstfit", backfill=False, preemption=False, fair_share=False,
                       strict_tiers=False)
    raise ValueError(f"unknown policy {policy!r}")
