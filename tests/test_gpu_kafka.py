"""GPU jobs end to end on Kafka, every part its own process: `dagfold up` (scheduler, projector, API,
callbacks), `dagfold allocator`, and one `dagfold agent --simulate` per host running real job processes.

Faults are real: kill -9 of an agent, thermal throttling switched on through the agent's faults file,
SIGSTOP of an agent past its node lease and SIGCONT after.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dagfold.services.callbacks.egress import ENV_ALLOW
from dagfold.services.callbacks.signing import verify
from tests.api_support import free_port
from tests.callback_support import LOOPBACK_CIDR, Receiver
from tests.cli_support import DAGFOLD, ROOT, UpProcess, stop_process_groups

pytestmark = pytest.mark.kafka
SECRET = "gpu-e2e-secret"


class GpuPool:
    """An allocator and ``nodes`` simulated 2-GPU agents of a fresh pool, as processes."""

    def __init__(self, tmp: Path, url: str, nodes: int, artifacts: Path) -> None:
        self.tmp, self.url, self.artifacts = tmp, url, artifacts
        self.pool = f"gpu-{uuid.uuid4().hex[:8]}"  # the session broker is shared: a pool of its own
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.faults = {f"n{i}": tmp / f"faults-n{i}" for i in range(nodes)}
        self.metrics = {name: free_port() for name in ["allocator", *self.faults]}  # each serves /metrics
        self.start("allocator", "allocator", "--pool", self.pool, "--log", url, "--data", str(tmp / "alloc"),
                   "--lease-s", "3", "--grace-s", "4", "--metrics-port", str(self.metrics["allocator"]))
        for node in self.faults:
            self.start_agent(node)

    def start(self, name: str, *args: str) -> None:
        logf = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        self.procs[name] = subprocess.Popen([*DAGFOLD, *args], cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
                                            start_new_session=True)

    def start_agent(self, node: str) -> None:
        self.start(node, "agent", "--pool", self.pool, "--log", self.url, "--node", node, "--simulate",
                   "--gpus", "2", "--heartbeat-s", "0.3", "--faults-file", str(self.faults[node]),
                   "--artifacts", str(self.artifacts),  # the API's: where it reads the outputs from
                   "--work-dir", str(self.tmp / "work" / node), "--metrics-port", str(self.metrics[node]))

    def scrape(self, name: str) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics[name]}/metrics", timeout=10).text

    def signal(self, node: str, sig: int) -> None:
        os.kill(self.procs[node].pid, sig)

    def signal_host(self, node: str, sig: int) -> None:
        """``sig`` to the node's agent and the job processes it started (its process group)."""
        os.killpg(self.procs[node].pid, sig)

    def close(self) -> None:
        stop_process_groups(self.procs.values(), resume=True)  # an agent a test stopped (SIGSTOP) too


@pytest.fixture(scope="module")
def up(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """One `dagfold up` for this file's tests: each runs its own pool of agents and its own jobs, and only
    reads through the API (the faults are the agents', never the stack's)."""
    os.environ["DAGFOLD_CALLBACK_SECRET"] = SECRET  # inherited by `dagfold up`: it signs callbacks
    os.environ[ENV_ALLOW] = LOOPBACK_CIDR  # and may call the receiver on 127.0.0.1
    try:
        u = UpProcess(tmp_path_factory.mktemp("gpu-up") / "data", log=f"kafka://{kafka_bootstrap}").start()
    finally:
        os.environ.pop("DAGFOLD_CALLBACK_SECRET", None)
        os.environ.pop(ENV_ALLOW, None)
    try:
        yield u
    finally:
        u.stop()


def submit_gpu(up: UpProcess, pool: str, steps: int, callback: str | None = None, **kw: Any) -> str:
    body = {"model": "demo", "params": {"steps": steps, "step_s": 0.1}, "prompt": "hello", "pool": pool,
            "resources": {"gpus": 2, "checkpoint": True}, "callback_url": callback, **kw}
    r = httpx.post(up.api + "/v1/gpu-jobs", json=body, timeout=10)
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


def task(up: UpProcess, job_id: str) -> dict[str, Any]:
    """The job's task as the read model has it ({} until the projector has seen the job)."""
    r = httpx.get(f"{up.api}/v1/jobs/{job_id}/tasks/run", timeout=10)
    assert r.status_code in (200, 404), r.text
    return dict(r.json()) if r.status_code == 200 else {}


def wait_running(up: UpProcess, *job_ids: str, timeout: float = 90) -> dict[str, str]:
    """The node each job's task runs on, once all run at once and have checkpointed (progress >= 10%)."""
    deadline = time.monotonic() + timeout
    tasks: dict[str, dict[str, Any]] = {}
    while time.monotonic() < deadline:
        tasks = {j: task(up, j) for j in job_ids}
        if all(t.get("state") == "running" and (t.get("progress") or 0) >= 0.1 and t.get("allocation")
               for t in tasks.values()):
            return {j: str(t["allocation"]["node_ids"][0]) for j, t in tasks.items()}
        time.sleep(0.2)
    raise AssertionError(f"not all of {job_ids} ran: {tasks}")


def history(up: UpProcess, job_id: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{up.api}/v1/jobs/{job_id}/history", params={"limit": 1000}, timeout=10)
    return list(r.json()["events"])


def final_output(up: UpProcess, job_id: str) -> str:
    r = httpx.get(f"{up.api}/v1/jobs/{job_id}/tasks/run/attempts", timeout=10)
    att = [a for a in r.json()["attempts"] if a.get("outcome") == "succeeded"]
    assert len(att) == 1, r.json()
    return str(att[0].get("stdout_tail") or "")


def test_gpu_jobs_survive_a_killed_and_a_throttled_agent_and_call_back_once(
        up: UpProcess, kafka_bootstrap: str, tmp_path: Path) -> None:
    pool = GpuPool(tmp_path, f"kafka://{kafka_bootstrap}", nodes=4, artifacts=up.data / "artifacts")
    with Receiver() as rx:
        try:
            # 45 s jobs: the faults must come while they run, after the first progress report (one per quarter
            # lease) that wait_running waits for. 15 s jobs were at step 130 of 150 by then at load 30-45, and a
            # throttled one ended on its node before the allocator moved it (no TaskRequeued).
            jobs = [submit_gpu(up, pool.pool, 450, rx.url(f"/hook/{i}")) for i in range(3)]
            nodes = wait_running(up, *jobs)
            assert len(set(nodes.values())) == 3  # 2 GPUs a job, 2 a host: one job per host
            killed, throttled, calm = jobs
            pool.signal(nodes[killed], signal.SIGKILL)
            pool.faults[nodes[throttled]].write_text("throttle\n")
            for j in jobs:
                assert up.wait(j, timeout=180)["state"] == "succeeded", history(up, j)
            for j in (killed, throttled):
                h = history(up, j)
                requeued = [e for e in h if e["type"] == "TaskRequeued"]
                assert requeued and "checkpoint" in requeued[0]["detail"], h
                allocated = [e for e in h if e["type"] == "TaskAllocated"]
                assert len(allocated) >= 2 and nodes[j] not in allocated[-1]["detail"]
                assert "resumes from" in allocated[-1]["detail"]
                assert not [e for e in h if e["type"] == "TaskFailed"]  # moved, never failed
                assert '"resumed_from": 0' not in final_output(up, j)  # it went on from its checkpoint
            h = history(up, calm)
            assert len([e for e in h if e["type"] == "TaskAllocated"]) == 1
            # the job's file, through the API; the processes' own /metrics were fed
            [out] = httpx.get(f"{up.api}/v1/gpu-jobs/{calm}", timeout=10).json()["outputs"]
            body = httpx.get(up.api + out["download"], timeout=10).content
            assert hashlib.sha256(body).hexdigest() == out["sha256"]
            alloc_metrics = pool.scrape("allocator")
            assert re.search(r'dagfold_allocator_decision_latency_seconds_count\{decision="grant"\} [1-9]',
                             alloc_metrics)
            assert re.search(r'dagfold_allocator_queue_wait_seconds_count\{tier="standard"\} [1-9]', alloc_metrics)
            assert f'dagfold_agent_gpu_utilization_ratio{{gpu="0",node="{nodes[calm]}"}}' in pool.scrape(nodes[calm])
            for j in jobs:
                got = rx.wait_for(j, 1, timeout_s=60)
            time.sleep(2.0)  # a duplicate would come now
            for j in jobs:
                got = rx.of(j)
                assert len(got) == 1, [g.path for g in got]
                assert got[0].json["state"] == "succeeded"
                assert verify(SECRET, got[0].body, got[0].headers.get("x-dagfold-signature"))
        finally:
            pool.close()


def _processes_of(alloc_id: str) -> list[int]:
    """PIDs of job processes started for ``alloc_id`` (read from their environment)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            env = (d / "environ").read_bytes().split(b"\0")
            if f"DAGFOLD_ALLOC_ID={alloc_id}".encode() in env:
                pids.append(int(d.name))
    return pids


def _stopped_by_its_agent(pid: int) -> bool:
    """True once ``pid`` got its agent's SIGTERM (pending while the process is stopped) or is gone (SIGKILL)."""
    try:
        status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return True
    if status["State"].strip()[:1] in ("Z", "X"):
        return True
    pending = int(status["ShdPnd"], 16) | int(status["SigPnd"], 16)
    return bool(pending >> (signal.SIGTERM - 1) & 1)


def test_an_agent_stopped_past_its_lease_is_fenced_when_it_comes_back(
        up: UpProcess, kafka_bootstrap: str, tmp_path: Path) -> None:
    pool = GpuPool(tmp_path, f"kafka://{kafka_bootstrap}", nodes=2, artifacts=up.data / "artifacts")
    try:
        job = submit_gpu(up, pool.pool, 150)
        deadline = time.monotonic() + 90
        while not ((t := task(up, job)).get("state") == "running" and t.get("allocation")):
            assert time.monotonic() < deadline, f"the job did not start: {t}"
            time.sleep(0.1)
        node, stale = str(t["allocation"]["node_ids"][0]), t["allocation"]["alloc_id"]
        # As soon as its agent reported the job running, the host freezes, agent and job process (a paused VM),
        # so that the job is still there when the agent comes back. Before, the test waited for a progress
        # report (step 98 of 150 by then at load 45) and froze only the agent: whenever the allocator's move
        # took longer than the rest of the 15 s job, the job had ended by itself and there was nothing to fence.
        pool.signal_host(node, signal.SIGSTOP)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            t = task(up, job)
            if t["state"] == "running" and t.get("allocation") and t["allocation"]["alloc_id"] != stale:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"the job did not move off the stopped node: {history(up, job)}")
        pids = _processes_of(stale)
        assert pids  # the stale process is still there behind the partition
        pool.signal(node, signal.SIGCONT)  # the agent comes back; its job process stays stopped until the
        deadline = time.monotonic() + 60  # agent has stopped it, so that it cannot end by itself meanwhile
        while not all(_stopped_by_its_agent(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_stopped_by_its_agent(p) for p in pids)  # fenced: its allocation is over, the agent stops it
        pool.signal_host(node, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while _processes_of(stale) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _processes_of(stale)
        assert up.wait(job, timeout=120)["state"] == "succeeded"
        h = history(up, job)
        assert [e["type"] for e in h].count("TaskSucceeded") == 1
        assert not [e for e in h if e["type"] == "TaskFailed"]
    finally:
        pool.close()
