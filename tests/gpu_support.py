"""A GPU cluster in one test process: the real scheduler, allocator and node agents over one log.

The scheduler runs its own loop in a thread (as in ``dagfold up``); the test
drives the allocator and the agents round by round (``until``), so it can cut,
crash or throttle a node between two rounds. Agents run real job processes
(``dagfold.services.agent.demo_job``) on simulated GPUs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dagfold.codec import Record, default_codec
from dagfold.commands import CommandSender, submit_job
from dagfold.config import ALLOCATOR_EVENTS, COMMANDS, EVENTS, SCHEDULER_INTERNAL, Config
from dagfold.jobspec import parse_spec, to_job_spec
from dagfold.log import Log, TopicPartition, open_log
from dagfold.services.agent.agent import NodeAgent, simulated
from dagfold.services.agent.devices import SimulatedDevices
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.allocator.runner import AllocatorRunner
from dagfold.services.scheduler.runner import SchedulerRunner
from dagfold.services.stack import Stack, StackOptions
from tests.api_support import free_port

POOL = "gpu"
A = "dagfold.allocator."


def read_all(lg: Log, topic: str) -> list[Record]:
    codec = default_codec()
    out: list[Record] = []
    for p in range(lg.partitions(topic)):
        tp = TopicPartition(topic, p)
        out += [codec.decode(r.value) for r in lg.read(tp, 0, 1_000_000)]
    return out


def of(records: list[Record], name: str, **match: object) -> list[Record]:
    """Records whose type ends with ``.name`` and whose fields equal ``match``."""
    return [e for e in records if e["type"].rsplit(".", 1)[-1] == name
            and all(e.get(k) == v for k, v in match.items())]


def gpu_job(job_id: str, *, gpus: int = 2, hosts: int = 1, tier: str = "standard", tenant: str = "acme",
            checkpoint: bool = True, gpu_type: str | list[str] = "H100", max_runtime_s: float | None = None,
            **task: Any) -> Record:
    """The JobSpec of a one-task GPU job on ``POOL``."""
    resources: dict[str, Any] = {"gpus": gpus, "hosts": hosts, "gpu_type": gpu_type, "checkpoint": checkpoint}
    if max_runtime_s is not None:
        resources["max_runtime_s"] = max_runtime_s
    doc = {"id": job_id, "tenant": tenant, "tier": tier,
           "tasks": [{"id": "train", "handler": "gpu", "queue": POOL,
                      "resources": resources,
                      **task}]}
    return to_job_spec(parse_spec(doc))


class GpuCluster:
    def __init__(self, tmp: Path, nodes: int, *, steps: int = 20, step_s: float = 0.05, gpus: int = 2,
                 alloc_opts: AllocatorOptions | None = None) -> None:
        self.cfg = Config(data_dir=tmp / "data", partitions=2, allocator_partitions=1)
        self.log = open_log("embedded", tmp / "log")
        self.log.create_topics(self.cfg.core_topics())
        self.stop = threading.Event()
        self.scheduler = SchedulerRunner(self.log, self.cfg)
        self.thread = threading.Thread(target=self.scheduler.run, args=(self.stop,), daemon=True)
        self.thread.start()
        self.alloc_opts = alloc_opts or AllocatorOptions(pool=POOL, lease_s=1.5, grace_s=5.0,
                                                         undrain_ok_heartbeats=1000)
        self.allocator = AllocatorRunner(self.log, self.alloc_opts, tmp / "data")
        cmd = [sys.executable, "-m", "dagfold.services.agent.demo_job", str(steps), str(step_s)]
        self.agents: list[NodeAgent] = []
        self.devs: list[SimulatedDevices] = []
        for i in range(nodes):
            a, d = simulated(self.log, POOL, f"n{i}", cmd, tmp / "artifacts", gpus=gpus, hb_interval_s=0.2)
            a.register()
            self.agents.append(a)
            self.devs.append(d)
        self.sender = CommandSender(self.log, "test")

    def submit(self, spec: Record) -> None:
        self.sender.send(submit_job(spec, "test"))

    def events(self) -> list[Record]:
        """Scheduler events and allocator events, each topic in log order."""
        return read_all(self.log, EVENTS) + read_all(self.log, ALLOCATOR_EVENTS)

    def commands(self, job_id: str) -> list[Record]:
        """The job's commands: reports on ``commands``, then the allocator's on ``scheduler.internal``."""
        return [r for t in (COMMANDS, SCHEDULER_INTERNAL) for r in read_all(self.log, t) if r.get("job_id") == job_id]

    def round(self) -> None:
        self.allocator.step(0.0)
        for a in self.agents:
            a.step()

    def until(self, cond: Callable[[list[Record]], bool], timeout_s: float = 30.0) -> list[Record]:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.round()
            ev = self.events()
            if cond(ev):
                return ev
            time.sleep(0.03)
        kinds = [e["type"].rsplit(".", 1)[-1] for e in self.events()]
        raise AssertionError(f"timed out; events: {kinds}")

    def job_state(self, ev: list[Record], job_id: str) -> str | None:
        for name, state in (("JobSucceeded", "succeeded"), ("JobFailed", "failed"), ("JobCancelled", "cancelled")):
            if of(ev, name, job_id=job_id):
                return state
        return None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for a in self.agents:
            a.close()
        self.allocator.close()
        self.sender.close()
        self.log.close()


def gpu_stack(tmp: Path, artifacts_url: str = "", gpus: int = 2) -> Stack:
    """The whole stack (``dagfold up``'s Stack, not yet started) with one simulated GPU node of ``gpus``
    GPUs on pool ``POOL`` and one CPU worker, its API on a free port."""
    cfg = Config(data_dir=tmp / "data", partitions=2, dispatch_partitions=2, api_port=free_port(),
                 artifacts_url=artifacts_url)
    return Stack(cfg, StackOptions(workers=1, gpu_nodes=1, gpus_per_node=gpus, gpu_pool=POOL))
