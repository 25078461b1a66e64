"""NodeAgent: the loop of one GPU host against the log contract.

Reads: the pool's partition of ``allocator.events`` (preemption requests,
releases and expiries of its allocations; its own loss) and its partition of
``control`` (keyed by node): the scheduler's GpuTaskDispatch, which starts a
process on the granted GPUs, and the allocator's StopAllocation. Writes, to
``allocator.commands`` keyed by pool: RegisterNode, NodeHeartbeat (health and
the processes it runs, with their latest checkpoints), ReleaseAllocation when
a process exits. The gang's first host (``leader``) also reports the attempt
to the scheduler's ``commands`` topic with ``worker_id`` = the allocation ID:
TaskStarted, a TaskHeartbeat every heartbeat interval (the attempt's lease,
with progress and the latest checkpoint), TaskSucceeded/TaskFailed. A
checkpointed stop is not a failure: the allocator requeues the request and
tells the scheduler.

Throughput (the heartbeat's ``perf``) comes from the jobs themselves: for each running process
whose allocation declares ``max_runtime_s`` (read from its AllocationGranted event), its progress
per second over the last ``perf_window_s`` (the ``{"progress": f}`` lines it prints) times that
runtime: how fast the job goes against the pace its declared runtime allows (1.0: it would end
exactly at its limit), capped at ``PERF_CAP``: each process's ``pace`` in the heartbeat. The
allocator takes their median as the host's throughput and compares it with its GPU type's
average, but finds the host ``slow`` from paces only when jobs of several tenants go below it: a
job's pace is that job's claim (a job slower than it declared is stopped by its runtime limit,
which counts across its grants), never a verdict on the host its neighbours share. Because a job
that keeps within its declared runtime scores at least 1.0 and the cap bounds the average at 2.0,
such a job's host is never found slow at the default ratio (0.5). The heartbeat's ``perf`` is the
device model's own figure, taken when no job tells its pace (``SimulatedDevices``: its speed; NVML:
none, since clocks say nothing about a job's progress).

Grants: a GpuTaskDispatch (from the scheduler) starts a process only if the allocator's own
AllocationGranted on ``allocator.events`` names the same allocation, epoch, job, task, attempt and
tenant, and this host with the same GPUs (``grant_refusal``). A dispatch whose grant is not read yet
waits for it up to ``GRANT_WAIT_S``; one that differs from it, or whose grant never comes, is refused
(logged as a warning): an agent runs what the allocator granted to its host, not whatever reaches
its control partition.

Fencing: every process carries its allocation's epoch, and its reports carry
its allocation ID, which the scheduler accepts only from the attempt's current
grant. A process whose allocation was released, expired or is unknown to the
allocator (a heartbeat answered by a fence) is stopped; after a partition or
an expired lease the agent re-registers with a new incarnation, so heartbeats
of the old one are ignored by the allocator.

Outages (docs/reliability.md, "Partitions"): the agent never exits because the log is unreachable. A flush
that cannot deliver leaves the records in the producer's bounded buffer (librdkafka's
``message.timeout.ms`` drops what waits longer) and the agent holds its heartbeats until the buffer is
delivered, so a healed partition delivers one stale heartbeat, not one per interval of the cut. Self-fencing:
the agent knows the node lease the allocator holds for it (``lease_deadline_ms`` of the allocator's
NodeRegistered and NodeHeartbeatRecorded events for its incarnation). Once less than the fencing margin
(``fence_margin_s``, default a sixth of that lease) is left of it, heard from the allocator or not, it
stops its job processes itself, SIGTERM (they checkpoint) and SIGKILL by half the margin, so none runs
when the allocator declares the host lost and grants its GPUs again. It releases those allocations as
preempted (the allocator requeues them from their checkpoints) and launches nothing until the allocator
renews the lease or the agent re-registers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from dagfold import metrics
from dagfold.artifacts import LocalArtifactStore
from dagfold.codec import Record, default_codec, make
from dagfold.config import ALLOCATOR_COMMANDS, ALLOCATOR_EVENTS, COMMANDS, CONTROL
from dagfold.exceptions import CodecError, LogError
from dagfold.log import Log, TopicPartition
from dagfold.logs import log_context
from dagfold.services.agent.devices import Devices, Health, SimulatedDevices
from dagfold.services.agent.launcher import MAX_RESULT_BYTES, JobProcess, Launcher
from dagfold.services.allocator import commands as cmds

log = logging.getLogger("dagfold.agent")
A = "dagfold.allocator."
PERF_CAP = 2.0  # the most a job's throughput counts (module docstring): loose runtimes cannot lift the average
GRANT_WAIT_S = 30.0  # how long a dispatch waits for its AllocationGranted to be read (module docstring)
FENCE_MARGIN_SHARE = 6  # default fencing margin: the node lease / this (module docstring)
SELF_FENCED = "self-fenced: node lease lapsing"


class NodeAgent:
    """One host's agent (see module docstring). Drive it with ``step()`` or ``run()``."""

    def __init__(self, log_: Log, pool: str, node_id: str, devices: Devices, launcher: Launcher, *,
                 hb_interval_s: float = 1.0, grace_s: float = 30.0, report_to_scheduler: bool = True,
                 keep_checkpoints: bool = False, clock: Callable[[], float] = time.time,
                 perf_window_s: float = 60.0, fence_margin_s: float | None = None, flush_s: float = 1.0) -> None:
        self.log = log_
        self.pool = pool
        self.node_id = node_id
        self.devices = devices
        self.launcher = launcher
        self.hb_interval_s = hb_interval_s
        self.grace_s = grace_s
        self.report_to_scheduler = report_to_scheduler
        # checkpoint retention: a task's checkpoints are deleted from artifact storage when it succeeds,
        # unless kept (a failed or cancelled task keeps them: a redrive resumes from them)
        self.keep_checkpoints = keep_checkpoints
        self.clock = clock
        self.perf_window_s = perf_window_s
        self.runtime_s: dict[str, float] = {}  # allocation on this host -> its declared max_runtime_s
        self.grants: dict[str, Record] = {}  # AllocationGranted naming this host, by allocation, until it ends
        self.waiting: dict[str, tuple[Record, float]] = {}  # dispatches waiting for their grant: (dispatch, since)
        self.refused = 0  # dispatches refused (grant_refusal)
        self.codec = default_codec()
        self.incarnation = int(clock() * 1000)
        self.procs: dict[str, JobProcess] = {}
        self.leader_of: set[str] = set()  # allocations whose scheduler reports this host makes
        self.ended: dict[str, None] = {}  # allocations known to be over (insertion-ordered, bounded)
        self.report_every_s: dict[str, float] = {}  # per led allocation: a quarter of its scheduler lease
        self._next_report: dict[str, float] = {}
        self.partitioned = False
        # Self-fencing (module docstring): the node lease as the allocator last acknowledged it (its clock, ms;
        # None until it acknowledged this incarnation) and its length; flush_s bounds one step's wait for
        # deliveries; backlog: records are waiting for the log, heartbeats are held
        self.fence_margin_s = fence_margin_s
        self.flush_s = flush_s
        self.lease_deadline_ms: int | None = None
        self.lease_s: float | None = None
        self.backlog = False
        self.outages = 0  # times the log stopped taking or giving records (metrics, tests)
        self.last_health: Health | None = None  # the last heartbeat's snapshot (metrics)
        self.crashed = False
        self._next_hb = 0.0
        # what needs the log to answer first (a LogError here leaves no client behind: `dagfold agent` retries)
        ev = TopicPartition(ALLOCATOR_EVENTS, log_.partition_for(pool.encode(), log_.partitions(ALLOCATOR_EVENTS)))
        ct = TopicPartition(CONTROL, log_.partition_for(node_id.encode(), log_.partitions(CONTROL)))
        ends = log_.end_offsets([ev, ct])
        self.producer = log_.producer(f"agent-{node_id}")
        self.events = log_.consumer(None, client_id=f"agent-{node_id}-events")
        self.control = log_.consumer(None, client_id=f"agent-{node_id}-control")
        self.events.assign({ev: ends[ev]})
        self.control.assign({ct: ends[ct]})

    # -- output -------------------------------------------------------------------------------
    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _send(self, topic: str, key: str, rec: Record) -> None:
        self.producer.send(topic, key.encode(), self.codec.encode(rec))

    def _alloc_cmd(self, rec: Record) -> None:
        self._send(ALLOCATOR_COMMANDS, self.pool, rec)

    def _sched(self, kind: str, jp: JobProcess, **fields: Any) -> None:
        if not self.report_to_scheduler or jp.alloc_id not in self.leader_of:
            return
        rec = make(f"dagfold.command.Task{kind}", job_id=jp.job_id, task_id=jp.task_id, attempt=jp.attempt,
                   worker_id=jp.alloc_id, ts_ms=self._now_ms(), **fields)
        self._send(COMMANDS, jp.job_id, rec)

    def register(self) -> None:
        self.incarnation = max(self.incarnation + 1, self._now_ms())
        self.lease_deadline_ms = None  # the new incarnation's lease is unknown until the allocator answers
        self._alloc_cmd(cmds.register_node(self.pool, self.node_id, self.devices.gpu_type, self.devices.count,
                                           incarnation=self.incarnation, ts_ms=self._now_ms()))
        self._flush()
        self._next_hb = self.clock() + self.hb_interval_s

    def _flush(self) -> None:
        """Deliver what was sent, waiting at most ``flush_s`` (nothing while a backlog waits): an unreachable
        log is an outage to ride out, never an error that ends the agent."""
        try:
            self.producer.flush(0.0 if self.backlog else self.flush_s)
        except LogError as exc:
            if not self.backlog:
                self._outage(f"records wait for the log ({exc}); heartbeats held until they are delivered")
            self.backlog = True
            return
        if self.backlog:
            log.warning("%s: the log takes records again", self.node_id)
        self.backlog = False

    def _outage(self, what: str) -> None:
        self.outages += 1
        log.warning("%s: %s", self.node_id, what)

    # -- self-fencing ---------------------------------------------------------------------------
    def _acknowledged(self, e: Record) -> None:
        """The allocator recorded this incarnation's registration or a heartbeat: its lease deadline."""
        self.lease_s = max(0.0, (e["lease_deadline_ms"] - e["ts_ms"]) / 1000)
        self.lease_deadline_ms = max(self.lease_deadline_ms or 0, int(e["lease_deadline_ms"]))

    def fence_margin(self) -> float:
        """Seconds before the acknowledged lease deadline at which the agent stops its processes."""
        if self.fence_margin_s is not None:
            return self.fence_margin_s
        return (self.lease_s or 0.0) / FENCE_MARGIN_SHARE

    def lease_left_s(self) -> float | None:
        """Seconds of the acknowledged node lease left before the fencing margin (None: not acknowledged)."""
        if self.lease_deadline_ms is None:
            return None
        return self.lease_deadline_ms / 1000 - self.clock() - self.fence_margin()

    def _self_fence(self) -> None:
        """Stop every job process whose node lease is about to lapse (module docstring)."""
        left = self.lease_left_s()
        if left is None or left > 0:
            return
        margin = self.fence_margin()
        kill_at = time.monotonic() + max(0.0, left + margin / 2)  # SIGKILL by half the margin before the deadline
        for jp in self.procs.values():
            if jp.exited() is None and jp.stop_reason is None:
                log.warning("%s: node lease acknowledged until %d ms lapses in %.1f s and the allocator is not "
                            "heard: stopping allocation %s", self.node_id, self.lease_deadline_ms, left + margin,
                            jp.alloc_id)
                self.launcher.stop(jp, SELF_FENCED, kill_at)

    def heartbeat(self) -> None:
        busy = frozenset(g for jp in self.procs.values() if jp.exited() is None for g in jp.gpus)
        h = self.last_health = self.devices.health(busy)
        paces = self.paces()
        statuses = [cmds.alloc_status(jp.alloc_id, jp.epoch, progress=jp.progress, pace=paces.get(jp.alloc_id),
                                      last_checkpoint_ms=jp.last_checkpoint_ms, checkpoint_uri=jp.checkpoint_uri)
                    for jp in self.procs.values() if jp.active]
        self._alloc_cmd(cmds.node_heartbeat(
            self.pool, self.node_id, incarnation=self.incarnation, ts_ms=self._now_ms(), health=h.health,
            detail=h.detail, perf=h.perf, temperature_c=h.temperature_c, ecc_errors=h.ecc_errors,
            xid_errors=h.xid_errors, throttle_events=h.throttle_events, allocations=statuses,
            gpus=[g.record() for g in h.gpus]))
        metrics.observe_agent(self.node_id, h.gpus, len(statuses))
        now = self.clock()
        for aid, jp in self.procs.items():  # the attempt's lease: renewed 4 times per lease, progress or not
            if jp.active and jp.stop_reason is None and now >= self._next_report.get(aid, 0.0):
                self._next_report[aid] = now + self.report_every_s.get(aid, self.hb_interval_s)
                self._sched("Heartbeat", jp, progress=jp.progress, message=jp.checkpoint_uri)

    def paces(self) -> dict[str, float]:
        """Each running job's pace against its declared runtime (module docstring), by allocation."""
        now = time.monotonic()
        out = {}
        for aid, jp in self.procs.items():
            runtime = self.runtime_s.get(aid)
            if runtime is None or jp.exited() is not None or jp.stop_reason is not None:
                continue
            rate = jp.progress_rate(self.perf_window_s, now)
            if rate is not None:
                out[aid] = round(min(PERF_CAP, rate * runtime), 4)
        return out

    # -- faults (tests and demos) ----------------------------------------------------------------
    def crash(self) -> None:
        """The host dies: its processes with it, and it goes silent."""
        self.crashed = True
        for jp in self.procs.values():
            if jp.exited() is None:
                jp.proc.kill()
        self.procs.clear()

    def set_partitioned(self, cut: bool) -> None:
        """A network partition: processes keep running, nothing is sent or received."""
        self.partitioned = cut

    # -- input ------------------------------------------------------------------------------------
    def _ended(self, alloc_id: str) -> None:
        self.ended[alloc_id] = None
        self.runtime_s.pop(alloc_id, None)
        self.grants.pop(alloc_id, None)
        self.waiting.pop(alloc_id, None)
        if len(self.ended) > 10_000:
            del self.ended[next(iter(self.ended))]

    def grant_refusal(self, d: Record) -> str | None:
        """Why the allocator's grant does not cover dispatch ``d`` on this host ("" while it is not read
        yet); None if it does (module docstring)."""
        g = self.grants.get(d["alloc_id"])
        if g is None:
            return ""
        for f in ("epoch", "job_id", "task_id", "attempt", "tenant"):
            if g[f] != d[f]:
                return f"{f} {d[f]!r} is not the grant's ({g[f]!r})"
        mine = [list(h["gpu_indices"]) for h in g["hosts"] if h["node_id"] == self.node_id]
        if mine != [list(d["gpu_indices"])]:
            return f"GPUs {list(d['gpu_indices'])[:16]} are not the ones granted on {self.node_id} ({mine[:1]})"
        return None

    def _refuse(self, d: Record, why: str) -> None:
        self.waiting.pop(d["alloc_id"], None)
        self.refused += 1
        log.warning("%s: dispatch of %s/%s attempt %s as allocation %s refused: %s", self.node_id, d["job_id"],
                    d["task_id"], d["attempt"], d["alloc_id"], why)

    def _launch_waiting(self) -> None:
        """Dispatches whose grant was read since: launched or refused; those waiting too long refused."""
        now = self.clock()
        for aid, (d, since) in list(self.waiting.items()):
            if aid in self.grants:
                del self.waiting[aid]
                self.launch(d)
            elif now - since > GRANT_WAIT_S:
                self._refuse(d, f"no AllocationGranted for it on allocator.events within {GRANT_WAIT_S:g} s")

    def launch(self, d: Record) -> None:
        """Start this host's part of a dispatched GPU attempt (once per allocation), as granted."""
        aid = d["alloc_id"]
        if aid in self.procs or aid in self.ended:
            return  # a redelivered dispatch, or one for an allocation already over
        left = self.lease_left_s()
        if left is not None and left <= 0:
            log.warning("%s: not starting allocation %s: the node lease lapses", self.node_id, aid)
            return  # a dispatch from before a partition; the allocator expires or requeues it
        why = self.grant_refusal(d)
        if why == "":
            self.waiting.setdefault(aid, (d, self.clock()))
            return
        if why is not None:
            self._refuse(d, why)
            return
        jp = self.launcher.start(aid, d["epoch"], d["job_id"], d["task_id"], d["attempt"],
                                 list(d["gpu_indices"]), d["resume_checkpoint"], args_json=d["args_json"],
                                 tenant=d["tenant"], traceparent=d.get("traceparent") or "")
        self.procs[aid] = jp
        if d["leader"]:
            self.leader_of.add(aid)
            self.report_every_s[aid] = max(self.hb_interval_s, d["lease_timeout_s"] / 4)
            self._sched("Started", jp)

    def on_event(self, e: Record) -> None:
        t = e["type"][len(A):] if e["type"].startswith(A) else ""
        if t == "AllocationGranted" and e.get("max_runtime_s") and e["alloc_id"] not in self.ended \
                and any(h.get("node_id") == self.node_id for h in e.get("hosts") or ()):
            self.runtime_s[e["alloc_id"]] = float(e["max_runtime_s"])  # the pace its throughput is held to
        if t == "AllocationGranted" and e["pool"] == self.pool and e["alloc_id"] not in self.ended \
                and any(h["node_id"] == self.node_id for h in e["hosts"]):
            self.grants[e["alloc_id"]] = e
        if t in ("AllocationReleased", "AllocationExpired"):
            self._ended(e["alloc_id"])
        if t == "NodeRegistered" and e["node_id"] == self.node_id and e["incarnation"] == self.incarnation:
            self._acknowledged(e)
        elif t == "NodeHeartbeatRecorded" and e["node_id"] == self.node_id and self.lease_deadline_ms is not None:
            self._acknowledged(e)  # recorded after this incarnation's registration: this incarnation's
        if t == "PreemptionRequested" and e["alloc_id"] in self.procs:
            self._stop(self.procs[e["alloc_id"]], "preempted", e["grace_deadline_ms"])
        elif t in ("AllocationReleased", "AllocationExpired") and e["alloc_id"] in self.procs:
            jp = self.procs[e["alloc_id"]]
            if jp.exited() is None:
                self._stop(jp, f"fenced: {e['reason']}", None)
        elif t == "NodeDrained" and e["node_id"] == self.node_id and e["lost"]:
            log.warning("%s: the allocator lost this node (%s); re-registering", self.node_id, e["reason"])
            self._fence_all("fenced: node lease expired")
            self.register()

    def on_control(self, c: Record) -> None:
        if c.get("node_id") != self.node_id:
            return  # another node's (the control topic is shared), or a CPU worker's StopTask
        if c["type"] == "dagfold.control.GpuTaskDispatch":
            self.launch(c)
            return
        if c["type"] != A + "StopAllocation":
            return
        aid = c["alloc_id"]
        if not aid:
            self._fence_all(c["reason"])
            self.register()
            return
        jp = self.procs.get(aid)
        if jp is not None and jp.epoch <= c["epoch"]:
            self._stop(jp, "preempted" if c["checkpoint"] else f"fenced: {c['reason']}", c["deadline_ms"])

    def _stop(self, jp: JobProcess, reason: str, deadline_ms: int | None) -> None:
        grace = self.grace_s if deadline_ms is None else max(0.0, deadline_ms / 1000 - self.clock())
        self.launcher.stop(jp, reason, time.monotonic() + (grace if reason == "preempted" else min(grace, 5.0)))

    def _fence_all(self, reason: str) -> None:
        for jp in self.procs.values():
            if jp.exited() is None:
                self._stop(jp, reason, None)

    def _reap(self) -> None:
        for aid, jp in list(self.procs.items()):
            self.launcher.enforce(jp)
            code = jp.exited()
            if code is None:
                continue
            if code == 0 and jp.stop_reason is None and aid in self.leader_of and self.report_to_scheduler:
                if jp.upload is None:
                    self.launcher.finish(jp)  # every stdout line read: outputs and checkpoints known
                    self.launcher.collect(jp)
                if not jp.upload.done():  # type: ignore[union-attr]
                    continue  # still uploading; heartbeats keep the attempt's lease and allocation
            self.launcher.finish(jp)
            del self.procs[aid]
            self.report_every_s.pop(aid, None)
            self._next_report.pop(aid, None)
            tail = "\n".join(jp.lines[-20:])
            if jp.stop_reason in ("preempted", SELF_FENCED):  # checkpointed: the allocator requeues it
                self._alloc_cmd(cmds.release_allocation(self.pool, aid, jp.epoch, self.node_id, "preempted",
                                                        exit_code=code, checkpoint_uri=jp.checkpoint_uri,
                                                        ts_ms=self._now_ms()))
            elif jp.stop_reason is None:
                self._report_exit(jp, code, tail)
            self.leader_of.discard(aid)  # fenced processes report nothing: their allocation is gone

    def _report_exit(self, jp: JobProcess, code: int, tail: str) -> None:
        """A process ended by itself: release its GPUs, and (gang leader) report the attempt with its outputs."""
        failure: str | None = None if code == 0 else f"exit code {code}"
        outputs: list[Record] = []
        if code == 0 and jp.upload is not None:
            try:
                outputs = [a.to_record() for a in jp.upload.result()]
            except Exception as exc:  # storage refused or unreachable, or outputs over the limits
                failure = f"output upload failed: {exc}"[:500]
        result = jp.result_json()
        if failure is None and result is not None and len(result.encode()) > MAX_RESULT_BYTES:
            failure = f"output lines are {len(result.encode())} bytes, over the {MAX_RESULT_BYTES}-byte limit"
        self._alloc_cmd(cmds.release_allocation(self.pool, jp.alloc_id, jp.epoch, self.node_id,
                                                "completed" if code == 0 else "failed", exit_code=code,
                                                checkpoint_uri=jp.checkpoint_uri, ts_ms=self._now_ms()))
        if failure is None:
            self._sched("Succeeded", jp, stdout_tail=tail, result_json=result, outputs=outputs)
            if not self.keep_checkpoints and jp.alloc_id in self.leader_of:
                self.launcher.drop_checkpoints(jp)
        else:
            self._sched("Failed", jp, reason=failure, exit_code=code, stdout_tail=tail,
                        error_type=None if code else "output_upload")

    def step(self) -> None:
        """One round: read events and control, fence what the lease no longer covers, reap processes,
        heartbeat when due (not while records wait for the log). Never raises for an unreachable log."""
        if self.crashed or getattr(self.devices, "crashed", False):
            return
        if not self.partitioned:
            for consumer, handler in ((self.events, self.on_event), (self.control, self.on_control)):
                try:
                    records = consumer.poll(500, 0.0)
                except LogError as exc:
                    self._outage(f"cannot read the log: {exc}")
                    continue
                for r in records:
                    try:
                        rec = self.codec.decode(r.value)
                    except CodecError:
                        continue
                    handler(rec)
        self._self_fence()
        try:
            if not self.partitioned:
                self._launch_waiting()
            self._reap()
            if self.partitioned:
                return
            if self.clock() >= self._next_hb and not self.backlog:
                self.heartbeat()
                self._next_hb = self.clock() + self.hb_interval_s
        except LogError as exc:  # the producer refused a record (it failed): what was sent stays buffered
            self._outage(f"cannot send: {exc}")
        self._flush()

    def run(self, should_stop: Callable[[], bool], tick_s: float = 0.05) -> None:
        with log_context(node=self.node_id):  # every line this agent's loop logs names its node
            self.register()
            while not should_stop():
                self.step()
                time.sleep(tick_s)

    def close(self) -> None:
        for jp in self.procs.values():
            if jp.exited() is None:
                jp.proc.kill()
        self.launcher.close()
        self.events.close()
        self.control.close()
        try:
            self.producer.close()
        except LogError as exc:  # shutting down during an outage: what is still buffered is lost
            log.warning("%s: closing with undelivered records: %s", self.node_id, exc)


def simulated(log_: Log, pool: str, node_id: str, command: list[str], artifact_dir: Any, *, gpus: int = 8,
              gpu_type: str = "H100", **kw: Any) -> tuple[NodeAgent, SimulatedDevices]:
    """An agent over the simulated device model (tests, demos)."""
    dev = SimulatedDevices(gpus, gpu_type)
    store = kw.pop("store", None) or LocalArtifactStore(artifact_dir)
    work = kw.pop("work_dir", None) or artifact_dir.parent / "agent-work" / node_id
    launcher = Launcher(command, store, work, speed=1.0, runtime=kw.pop("runtime", None))
    agent = NodeAgent(log_, pool, node_id, dev, launcher, **kw)
    return agent, dev
