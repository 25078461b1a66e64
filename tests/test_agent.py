"""Node agents on the embedded log: simulated GPUs, real job processes, faults, checkpoints, fencing."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dagfold.codec import Record, default_codec
from dagfold.config import COMMANDS, CONTROL
from dagfold.log.base import TopicPartition, TopicSpec
from dagfold.log.embedded import EmbeddedLog
from services.agent.agent import NodeAgent, simulated
from services.agent.devices import SimulatedDevices, detect
from services.allocator import commands as cmds
from services.allocator.ctx import ALLOCATOR_COMMANDS, ALLOCATOR_EVENTS
from services.allocator.options import AllocatorOptions
from services.allocator.runner import AllocatorRunner

A = "dagfold.allocator."
POOL = "gpu"


@pytest.fixture
def elog(tmp_path: Path) -> Iterator[EmbeddedLog]:
    lg = EmbeddedLog(tmp_path / "log")
    lg.create_topics([TopicSpec(ALLOCATOR_COMMANDS, 1), TopicSpec(ALLOCATOR_EVENTS, 1), TopicSpec(CONTROL, 2),
                      TopicSpec(COMMANDS, 2)])
    yield lg
    lg.close()


def read_all(lg: EmbeddedLog, topic: str) -> list[Record]:
    codec = default_codec()
    out = []
    for p in range(lg.partitions(topic)):
        out += [codec.decode(r.value) for r in lg.read(TopicPartition(topic, p), 0, 100_000)]
    return out


class Cluster:
    def __init__(self, lg: EmbeddedLog, tmp: Path, nodes: int, steps: int = 20, step_s: float = 0.05) -> None:
        self.lg = lg
        opts = AllocatorOptions(pool=POOL, lease_s=1.5, grace_s=5.0, undrain_ok_heartbeats=1000)
        self.runner = AllocatorRunner(lg, opts)
        cmd = [sys.executable, "-m", "services.agent.demo_job", str(steps), str(step_s)]
        self.agents: list[NodeAgent] = []
        self.devs: list[SimulatedDevices] = []
        for i in range(nodes):
            a, d = simulated(lg, POOL, f"n{i}", cmd, tmp / "artifacts", gpus=2, hb_interval_s=0.2)
            a.register()
            self.agents.append(a)
            self.devs.append(d)
        self.producer = lg.producer("test")

    def send(self, rec: Record) -> None:
        self.producer.send(ALLOCATOR_COMMANDS, POOL.encode(), default_codec().encode(rec, validate_record=True))
        self.producer.flush()

    def until(self, cond: Callable[[list[Record]], bool], timeout_s: float = 20.0) -> list[Record]:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            self.runner.step(0.01)
            for a in self.agents:
                a.step()
            ev = read_all(self.lg, ALLOCATOR_EVENTS)
            if cond(ev):
                return ev
            time.sleep(0.02)
        raise AssertionError(f"timed out; events: {[e['type'][len(A):] for e in read_all(self.lg, ALLOCATOR_EVENTS)]}")

    def close(self) -> None:
        for a in self.agents:
            a.close()
        self.runner.close()
        self.producer.close()


def of(ev: list[Record], name: str, **match: object) -> list[Record]:
    return [e for e in ev if e["type"] == A + name and all(e.get(k) == v for k, v in match.items())]


def test_devices_fall_back_to_the_simulated_model() -> None:
    d = detect(SimulatedDevices(4, "A100"))
    assert d.count == 4 and d.health().health == "ok"
    sim = SimulatedDevices()
    sim.inject("throttle")
    assert sim.health().health == "throttled" and sim.speed() == 0.5
    sim.inject("ecc")
    assert sim.health().health == "ecc_errors"
    with pytest.raises(ValueError):
        sim.inject("meteor")


def test_grant_launches_with_cuda_visible_devices_and_reports_exit(elog: EmbeddedLog, tmp_path: Path) -> None:
    c = Cluster(elog, tmp_path, nodes=1, steps=6)
    try:
        c.until(lambda ev: len(of(ev, "NodeRegistered")) == 1)
        c.send(cmds.request_allocation(POOL, "job1", "t", 1, gpus=2, checkpoint=True, max_runtime_s=60))
        ev = c.until(lambda ev: bool(of(ev, "AllocationReleased", job_id="job1")))
        assert of(ev, "AllocationReleased", job_id="job1")[0]["reason"] == "completed"
        sched = [r for r in read_all(elog, COMMANDS) if r["job_id"] == "job1"]
        kinds = [r["type"].rsplit(".", 1)[-1] for r in sched]
        assert kinds[0] == "TaskStarted" and kinds[-1] == "TaskSucceeded" and kinds.count("TaskSucceeded") == 1
        assert '"cuda": "0,1"' in sched[-1]["stdout_tail"]
        ckpts = list((tmp_path / "artifacts" / "job1" / "t").glob("step-*.json"))
        assert ckpts  # checkpoints go to the artifact folder
    finally:
        c.close()


def test_throttled_node_is_drained_and_job_resumes_elsewhere(elog: EmbeddedLog, tmp_path: Path) -> None:
    c = Cluster(elog, tmp_path, nodes=2, steps=60, step_s=0.05)
    try:
        c.until(lambda ev: len(of(ev, "NodeRegistered")) == 2)
        c.send(cmds.request_allocation(POOL, "job2", "t", 1, gpus=2, checkpoint=True))
        ev = c.until(lambda ev: bool(of(ev, "AllocationGranted", job_id="job2")))
        first = of(ev, "AllocationGranted", job_id="job2")[0]["hosts"][0]["node_id"]
        time.sleep(0.6)  # let it make progress and checkpoint
        c.devs[int(first[1:])].inject("throttle")
        ev = c.until(lambda ev: len(of(ev, "AllocationGranted", job_id="job2")) == 2)
        assert of(ev, "NodeDrained", node_id=first)[0]["reason"].startswith("throttled")
        rel = of(ev, "AllocationReleased", job_id="job2")[0]
        assert rel["requeued"]
        g2 = of(ev, "AllocationGranted", job_id="job2")[1]
        assert g2["hosts"][0]["node_id"] != first and g2["resume_checkpoint"]
        ev = c.until(lambda ev: any(e["reason"] == "completed" for e in of(ev, "AllocationReleased", job_id="job2")),
                     timeout_s=30)
        sched = [r for r in read_all(elog, COMMANDS) if r["job_id"] == "job2"]
        done = [r for r in sched if r["type"].endswith("TaskSucceeded")]
        assert len(done) == 1 and not [r for r in sched if r["type"].endswith("TaskFailed")]
        assert '"resumed_from": 0' not in done[0]["stdout_tail"]  # resumed from its checkpoint
    finally:
        c.close()


def test_partitioned_node_loses_allocation_and_stale_process_is_fenced(elog: EmbeddedLog, tmp_path: Path) -> None:
    c = Cluster(elog, tmp_path, nodes=2, steps=200, step_s=0.05)
    try:
        c.until(lambda ev: len(of(ev, "NodeRegistered")) == 2)
        c.send(cmds.request_allocation(POOL, "job3", "t", 1, gpus=2, checkpoint=True))
        ev = c.until(lambda ev: bool(of(ev, "AllocationGranted", job_id="job3")))
        node = of(ev, "AllocationGranted", job_id="job3")[0]["hosts"][0]["node_id"]
        agent = c.agents[int(node[1:])]
        agent.set_partitioned(True)
        ev = c.until(lambda ev: bool(of(ev, "AllocationExpired", job_id="job3")))
        assert of(ev, "NodeDrained", node_id=node, lost=True)
        assert len(agent.procs) == 1  # still running behind the partition
        ev = c.until(lambda ev: len(of(ev, "AllocationGranted", job_id="job3")) == 2)
        agent.set_partitioned(False)
        c.until(lambda ev: not agent.procs and len(of(ev, "NodeRegistered", node_id=node)) >= 2, timeout_s=20)
        live = [a for a in c.agents if a.procs]
        assert len(live) == 1 and live[0].node_id != node  # only the current grant runs
    finally:
        c.close()
