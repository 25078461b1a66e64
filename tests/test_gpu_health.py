"""Real-GPU health per GPU: NvmlDevices over a fake pynvml with the real module's interface
(tests/fake_nvml.py), and one bad GPU cordoned by the allocator while its host keeps serving."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dagfold.codec import default_codec
from dagfold.services.agent.devices import NvmlDevices
from dagfold.services.agent.exceptions import NvmlUnavailable
from dagfold.services.allocator import commands as cmds
from tests.fake_nvml import FakeGpu, FakeNvml
from tests.gpu_support import GpuCluster, gpu_job, of


def test_nvml_reports_each_gpu_and_a_bad_gpu_leaves_the_host_serving() -> None:
    fake = FakeNvml([FakeGpu(util=87, mem_used=40 * 2**30, temp=61, sm_clock=1800), FakeGpu(), FakeGpu(),
                     FakeGpu(ecc_supported=False)])
    dev = NvmlDevices(fake.module())
    assert (dev.count, dev.gpu_type) == (4, "H200")
    h = dev.health(frozenset({0}))
    assert h.health == "ok" and [g.health for g in h.gpus] == ["ok"] * 4
    g0 = h.gpus[0]
    assert (g0.utilization, g0.memory_used_mib, g0.memory_total_mib, g0.temperature_c) == (0.87, 40 * 1024,
                                                                                          141 * 1024, 61.0)
    assert h.perf is None and h.utilization == pytest.approx(0.87 / 4)  # clocks are not a job's throughput

    fake.gpus[1].reasons = 0x40  # hardware thermal slowdown on GPU 1 only
    fake.gpus[2].reasons = 0x1  # idle: not a fault
    fake.xid(3, 13)  # an application's fault: counted, not cordoned
    h = dev.health()
    assert [g.health for g in h.gpus] == ["ok", "throttled", "ok", "ok"] and h.health == "ok"
    assert (h.gpus[3].xid_errors, h.gpus[3].last_xid) == (1, 13) and h.xid_errors == 1

    fake.xid(2, 79)  # fallen off the bus: cordoned until the agent restarts
    fake.gpus[0].ecc = 2
    h = dev.health()
    assert [g.health for g in h.gpus] == ["ecc_errors", "throttled", "xid", "ok"] and h.health == "ok"
    fake.gpus[0].ecc, fake.gpus[1].reasons = 0, 0
    h = dev.health()
    assert [g.health for g in h.gpus] == ["ecc_errors", "ok", "xid", "ok"]  # ECC and Xid stay; throttling clears

    fake.xid(3, 48)  # the last good GPU goes: the host as a whole is bad
    fake.gpus[1].reasons = 0x8
    h = dev.health()
    assert h.health != "ok" and all(g.health != "ok" for g in h.gpus)

    rec = cmds.node_heartbeat("p", "n", health=h.health, gpus=[g.record() for g in h.gpus])
    codec = default_codec()
    assert codec.decode(codec.encode(rec))["gpus"][2]["last_xid"] == 79  # the schema carries it


def test_nvml_without_gpus_or_library_is_unavailable() -> None:
    with pytest.raises(NvmlUnavailable):
        NvmlDevices(FakeNvml([]).module())


def test_one_bad_gpu_is_cordoned_and_its_job_moves_to_the_hosts_other_gpus(tmp_path: Path) -> None:
    c = GpuCluster(tmp_path, nodes=1, steps=60, step_s=0.05, gpus=4)
    fake = FakeNvml([FakeGpu(name="NVIDIA H100 80GB HBM3") for _ in range(4)])
    agent = c.agents[0]
    agent.devices = NvmlDevices(fake.module())  # the host's GPUs read through the NVML interface
    try:
        c.submit(gpu_job("train", gpus=2))
        ev = c.until(lambda ev: bool(of(ev, "LeaseGranted", job_id="train")))
        first = of(ev, "AllocationGranted", job_id="train")[0]["hosts"][0]["gpu_indices"]
        c.until(lambda ev: any(jp.checkpoint_uri for jp in agent.procs.values()))
        fake.xid(first[0], 79)
        ev = c.until(lambda ev: c.job_state(ev, "train") is not None, timeout_s=60)
        assert c.job_state(ev, "train") == "succeeded"
        beats = [e for e in of(ev, "NodeHeartbeatRecorded", node_id="n0") if e["cordoned_gpus"]]
        assert beats and beats[-1]["cordoned_gpus"] == [first[0]]
        assert not of(ev, "NodeDrained")  # the host was not drained
        moved = of(ev, "PreemptionRequested", job_id="train")
        assert len(moved) == 1 and f"GPU {first[0]}: Xid 79" in moved[0]["reason"]
        second = of(ev, "AllocationGranted", job_id="train")[1]["hosts"][0]
        assert second["node_id"] == "n0" and first[0] not in second["gpu_indices"]  # same host, other GPUs
        assert of(ev, "TaskCheckpointing", job_id="train") and not of(ev, "TaskFailed", job_id="train")
        done = of(c.commands("train"), "TaskSucceeded")
        assert len(done) == 1 and '"resumed_from": 0' not in done[0]["stdout_tail"]
        util = [e["utilization"] for e in of(ev, "NodeHeartbeatRecorded") if e["utilization"] is not None]
        assert util  # the heartbeats carried the GPUs' utilisation
    finally:
        c.close()


def test_a_host_whose_jobs_progress_slowly_is_drained_as_slow(tmp_path: Path) -> None:
    """Throughput comes from the jobs' progress lines, not from clocks: both hosts' GPUs (fake NVML) run at
    full SM clock, but on one host the jobs of two tenants progress at a quarter of the other's pace; the
    allocator drains it as slow (one tenant's jobs alone would not: the next test)."""
    c = GpuCluster(tmp_path, nodes=2, steps=400, step_s=0.05, gpus=2)
    for a in c.agents:
        a.devices = NvmlDevices(FakeNvml([FakeGpu(name="NVIDIA H100 80GB HBM3") for _ in range(2)]).module())
        a.perf_window_s = 2.0
    try:
        c.submit(gpu_job("fast", gpus=2, max_runtime_s=60))  # 400 x 0.05 s = 20 s: 3x the pace it needs
        ev = c.until(lambda ev: any(e["perf"] is not None for e in of(ev, "NodeHeartbeatRecorded")))
        fast = of(ev, "AllocationGranted", job_id="fast")[0]["hosts"][0]["node_id"]
        perf = [e["perf"] for e in of(ev, "NodeHeartbeatRecorded", node_id=fast) if e["perf"] is not None][0]
        assert 1.0 < perf <= 2.0  # progress/s x max_runtime_s (3, capped at 2, on an idle machine)
        slow = "n1" if fast == "n0" else "n0"
        c.agents[int(slow[1:])].launcher.speed = 0.25  # its jobs go at a quarter of the pace, clocks unchanged
        c.submit(gpu_job("slow", gpus=1, max_runtime_s=60, tenant="acme"))
        c.submit(gpu_job("slow-too", gpus=1, max_runtime_s=60, tenant="globex"))
        ev = c.until(lambda ev: bool(of(ev, "NodeDrained", node_id=slow)), timeout_s=60)
        drained = of(ev, "NodeDrained", node_id=slow)[0]
        assert drained["reason"].startswith("slow") and not drained["lost"]
        beats = [e["perf"] for e in of(ev, "NodeHeartbeatRecorded", node_id=slow) if e["perf"] is not None]
        assert beats and beats[-1] < 0.5 * perf  # about 1/80 per s x 60 s = 0.75 on an idle machine
        assert of(ev, "PreemptionRequested", job_id="slow")  # its jobs checkpoint and move
        assert of(ev, "PreemptionRequested", job_id="slow-too")
        assert not of(ev, "NodeDrained", node_id=fast)
    finally:
        c.close()


def test_a_job_slower_than_it_declared_does_not_drain_the_host_it_shares(tmp_path: Path) -> None:
    """Issue 24, recipe 7: a job's pace is held to the runtime it declared. Before, one tenant's jobs
    declaring 0.5 s for 20 s of work made their host's median pace 2.5% of the fleet's: the host was
    drained as slow, and the job of another tenant on it checkpointed and requeued. Now a host is slow
    only when jobs of several tenants there say so; these jobs' runtime limit is theirs to meet."""
    c = GpuCluster(tmp_path, nodes=1, steps=400, step_s=0.05, gpus=3)
    for a in c.agents:
        a.devices = NvmlDevices(FakeNvml([FakeGpu(name="NVIDIA H100 80GB HBM3") for _ in range(3)]).module())
        a.perf_window_s = 2.0
    try:
        c.submit(gpu_job("honest", gpus=1, max_runtime_s=60, tenant="acme"))
        c.until(lambda ev: any(e["perf"] is not None for e in of(ev, "NodeHeartbeatRecorded")))  # the fleet's pace
        for j in ("liar-1", "liar-2"):
            c.submit(gpu_job(j, gpus=1, max_runtime_s=0.5, tenant="mallory"))
        ev = c.until(lambda ev: len(of(ev, "AllocationGranted")) == 3)
        until = time.monotonic() + 3 * a.perf_window_s + 2.0  # their paces known for several heartbeats
        ev = c.until(lambda ev: bool(of(ev, "NodeDrained")) or time.monotonic() > until, timeout_s=60)
        assert not of(ev, "NodeDrained") and not of(ev, "PreemptionRequested")
        assert not of(ev, "AllocationReleased", job_id="honest")
    finally:
        c.close()
