"""GPU tasks end to end on the embedded log: the scheduler asks the allocator, grants dispatch to node
agents (simulated GPUs, real job processes), faults move jobs from their checkpoints, stale processes
are fenced."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from dagfold.commands import cancel_job
from dagfold.config import ALLOCATOR_COMMANDS
from dagfold.services.agent.agent import SELF_FENCED
from dagfold.services.agent.devices import SimulatedDevices, detect
from dagfold.services.allocator.options import AllocatorOptions
from tests.gpu_support import POOL, GpuCluster, gpu_job, of, read_all


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


def test_gpu_task_runs_on_its_granted_gpus_and_reports_once(tmp_path: Path) -> None:
    c = GpuCluster(tmp_path, nodes=1, steps=6)
    try:
        c.submit(gpu_job("job1", gpus=2))
        ev = c.until(lambda ev: c.job_state(ev, "job1") is not None)
        assert c.job_state(ev, "job1") == "succeeded"
        alloc = of(ev, "TaskAllocated", job_id="job1")
        assert len(alloc) == 1 and alloc[0]["node_ids"] == ["n0"]
        assert of(ev, "AllocationReleased", job_id="job1")[0]["reason"] == "completed"
        cmds = c.commands("job1")
        assert [r["status"] for r in of(cmds, "TaskAllocation")] == ["granted"]
        started, done = of(cmds, "TaskStarted"), of(cmds, "TaskSucceeded")
        assert len(started) == 1 and len(done) == 1
        assert started[0]["worker_id"] == done[0]["worker_id"] == alloc[0]["alloc_id"]  # fenced by allocation
        assert '"cuda": "0,1"' in done[0]["stdout_tail"]
        release = of(read_all(c.log, ALLOCATOR_COMMANDS), "ReleaseAllocation", alloc_id=alloc[0]["alloc_id"])
        assert release[0]["checkpoint_uri"].startswith((tmp_path / "artifacts").as_uri())  # checkpoints stored
        assert not list((tmp_path / "artifacts" / "acme" / "job1" / "train").glob("checkpoints/*"))  # and dropped
        out = done[0]["outputs"]
        assert [o["name"] for o in out] == ["sample.json"] and json.loads(done[0]["result_json"])["steps"] == 6
        stored = Path(out[0]["uri"].removeprefix("file://")).read_bytes()
        assert hashlib.sha256(stored).hexdigest() == out[0]["sha256"] and len(stored) == out[0]["size"]
        assert json.loads(stored)["steps"] == 6 and out[0]["content_type"] == "application/json"
        assert not of(ev, "TaskDispatch")  # never on a CPU queue
    finally:
        c.close()


def test_throttled_node_is_drained_and_the_job_resumes_elsewhere_from_its_checkpoint(tmp_path: Path) -> None:
    c = GpuCluster(tmp_path, nodes=2, steps=60, step_s=0.05)
    try:
        c.submit(gpu_job("job2", gpus=2))
        ev = c.until(lambda ev: bool(of(ev, "LeaseGranted", job_id="job2")))
        first = of(ev, "TaskAllocated", job_id="job2")[0]["node_ids"][0]
        time.sleep(0.6)  # progress and a checkpoint
        c.round()
        c.devs[int(first[1:])].inject("throttle")
        ev = c.until(lambda ev: c.job_state(ev, "job2") is not None, timeout_s=40)
        assert c.job_state(ev, "job2") == "succeeded"
        assert of(ev, "NodeDrained", node_id=first)[0]["reason"].startswith("throttled")
        requeued = of(ev, "TaskRequeued", job_id="job2")
        assert len(requeued) == 1 and requeued[0]["checkpoint_uri"]
        second = of(ev, "TaskAllocated", job_id="job2")[1]
        assert second["node_ids"][0] != first and second["resume_checkpoint"] and second["attempt"] == 1
        assert not of(ev, "TaskFailed", job_id="job2")  # a move is not a failure: no retry spent
        done = of(c.commands("job2"), "TaskSucceeded")
        assert len(done) == 1 and '"resumed_from": 0' not in done[0]["stdout_tail"]
    finally:
        c.close()


def test_crashed_node_loses_its_allocation_and_the_job_finishes_on_another(tmp_path: Path) -> None:
    c = GpuCluster(tmp_path, nodes=2, steps=40, step_s=0.05)
    try:
        c.submit(gpu_job("job4", gpus=2))
        ev = c.until(lambda ev: bool(of(ev, "LeaseGranted", job_id="job4")))
        node = of(ev, "TaskAllocated", job_id="job4")[0]["node_ids"][0]
        time.sleep(0.5)
        c.round()
        c.agents[int(node[1:])].crash()
        ev = c.until(lambda ev: c.job_state(ev, "job4") is not None, timeout_s=40)
        assert c.job_state(ev, "job4") == "succeeded"
        assert of(ev, "AllocationExpired", job_id="job4")[0]["reason"] == f"node {node} lease expired"
        assert of(ev, "TaskRequeued", job_id="job4")
        assert of(ev, "TaskAllocated", job_id="job4")[-1]["node_ids"][0] != node
    finally:
        c.close()


def test_partitioned_node_loses_its_allocation_and_its_stale_process_is_fenced(tmp_path: Path) -> None:
    c = GpuCluster(tmp_path, nodes=2, steps=200, step_s=0.05)
    try:
        c.submit(gpu_job("job3", gpus=2))
        ev = c.until(lambda ev: bool(of(ev, "LeaseGranted", job_id="job3")))
        node = of(ev, "TaskAllocated", job_id="job3")[0]["node_ids"][0]
        agent = c.agents[int(node[1:])]
        [stale] = agent.procs.values()
        agent.set_partitioned(True)
        ev = c.until(lambda ev: bool(of(ev, "AllocationExpired", job_id="job3")))
        # Self-fencing: behind the partition the agent stopped the process before its node lease lapsed and
        # the allocator could grant those GPUs again (docs/reliability.md, Partitions)
        assert stale.exited() is not None and stale.stop_reason == SELF_FENCED
        assert not agent.procs
        ev = c.until(lambda ev: len(of(ev, "TaskAllocated", job_id="job3")) == 2)
        assert of(ev, "NodeDrained", node_id=node, lost=True)
        agent.set_partitioned(False)
        c.until(lambda ev: not agent.procs and len(of(ev, "NodeRegistered", node_id=node)) >= 2, timeout_s=20)
        live = [a for a in c.agents if a.procs]
        assert len(live) == 1 and live[0].node_id != node  # only the current grant runs
    finally:
        c.close()


def test_a_task_no_host_can_hold_fails_with_the_allocators_reason(tmp_path: Path) -> None:
    c = GpuCluster(tmp_path, nodes=1)
    try:
        c.submit(gpu_job("big", gpus=16))
        ev = c.until(lambda ev: c.job_state(ev, "big") is not None)
        assert c.job_state(ev, "big") == "failed"
        failed = of(ev, "TaskFailed", job_id="big")[0]
        assert failed["final"] and failed["reason"].startswith("allocation rejected:")
    finally:
        c.close()


def test_cancelling_a_running_gpu_job_releases_its_gpus_and_stops_the_process(tmp_path: Path) -> None:
    c = GpuCluster(tmp_path, nodes=1, steps=400)
    try:
        c.submit(gpu_job("long", gpus=2))
        c.until(lambda ev: bool(of(ev, "LeaseGranted", job_id="long")))
        c.sender.send(cancel_job("long", "test"))
        ev = c.until(lambda ev: bool(of(ev, "AllocationReleased", job_id="long")) and not c.agents[0].procs)
        assert c.job_state(ev, "long") == "cancelled"
        assert of(ev, "AllocationReleased", job_id="long")[0]["reason"].startswith("cancelled")
        assert not of(c.commands("long"), "TaskSucceeded") and not of(c.commands("long"), "TaskFailed")
    finally:
        c.close()


def test_enterprise_job_preempts_a_standard_one_which_resumes_after(tmp_path: Path) -> None:
    opts = AllocatorOptions(pool=POOL, lease_s=1.5, grace_s=5.0, undrain_ok_heartbeats=1000)
    c = GpuCluster(tmp_path, nodes=1, steps=40, step_s=0.05, alloc_opts=opts)
    try:
        c.submit(gpu_job("std", gpus=2, tier="standard", tenant="free-rider"))
        c.until(lambda ev: bool(of(ev, "LeaseGranted", job_id="std")))
        # running, its SIGTERM handler set (it prints progress after): preempted, it checkpoints
        c.until(lambda ev: any(jp.progress for a in c.agents for jp in a.procs.values()))
        c.submit(gpu_job("ent", gpus=2, tier="enterprise", tenant="bank"))
        ev = c.until(lambda ev: c.job_state(ev, "ent") == "succeeded" and c.job_state(ev, "std") is not None,
                     timeout_s=40)
        assert c.job_state(ev, "std") == "succeeded"
        assert of(ev, "PreemptionRequested", job_id="std")
        assert of(ev, "TaskRequeued", job_id="std")[0]["checkpoint_uri"]
        ent_done = of(ev, "TaskSucceeded", job_id="ent")[0]["ts_ms"]
        std_started_again = of(ev, "TaskAllocated", job_id="std")[1]["ts_ms"]
        assert std_started_again >= ent_done - 1000  # the standard job waited for the enterprise one
        assert not of(ev, "TaskFailed")
    finally:
        c.close()
