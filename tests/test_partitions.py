"""Real network partitions (issue 25): a GPU host in a network namespace of its own, cut from everything for
3 minutes mid-job, then healed (tests/netns_support.py).

The broker listens on the test network's hub address; `dagfold up` (scheduler, projector, API, a CPU worker),
the allocator and a second agent run in the root namespace. The agent behind the cut must ride it out, stop
its job process itself before the allocator re-grants its GPUs (self-fencing, docs/reliability.md), and
re-register after the heal; the job moves to the other host and completes once, from its checkpoint.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.checks import gpus_held_twice
from dagfold.codec import Record, default_codec
from dagfold.config import ALLOCATOR_EVENTS, COMMANDS
from dagfold.localkafka import LocalKafka, free_base_port
from dagfold.log import Log, TopicPartition, open_log
from dagfold.log.reader import read_to_end
from tests.cli_support import DAGFOLD, ROOT, UpProcess, stop_process_groups
from tests.netns_support import Net
from tests.test_gpu_kafka import _processes_of, final_output, history, submit_gpu, task, wait_running

pytestmark = pytest.mark.kafka

LEASE_S = 10.0  # the allocator's node lease: it declares a silent host lost between 0.75 and 1.0 of it
MARGIN_S = LEASE_S / 6  # the agent's default fencing margin (services/agent/agent.py, FENCE_MARGIN_SHARE)
CUT_S = 180.0  # the 3 minutes


@pytest.fixture(scope="module")
def net_kafka(net: Net, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A broker of this file's own on the network's hub address; its ``kafka://`` URL."""
    port = free_base_port(range(29192, 39192, 100))
    kafka = LocalKafka(port, tmp_path_factory.mktemp("kafka"), host=net.hub).start()
    try:
        yield kafka.url
    finally:
        kafka.stop()


class Procs:
    """Processes of the test, each its own session, killed at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with open(self.tmp / f"{name}.log", "ab") as logf:
            p = subprocess.Popen(argv, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = p
        return p

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")[-3000:]

    def close(self) -> None:
        stop_process_groups(self.procs.values())


def _read(lg: Log, topic: str) -> list[Record]:
    codec = default_codec()
    return [codec.decode(r.value) for p in range(lg.partitions(topic))
            for recs in read_to_end(lg, TopicPartition(topic, p)) for r in recs]


@pytest.mark.timeout(600)  # the 3-minute cut, a broker and a stack: about 4 minutes, more on a loaded machine
def test_an_agent_cut_off_for_3_minutes_fences_itself_rides_it_out_and_the_job_completes_once(
        net: Net, net_kafka: str, tmp_path: Path) -> None:
    host = net.host()
    pool = f"gpu-{uuid.uuid4().hex[:8]}"
    artifacts = tmp_path / "up" / "artifacts"
    procs = Procs(tmp_path)

    def agent(node: str) -> list[str]:
        return [*DAGFOLD, "agent", "--pool", pool, "--log", net_kafka, "--node", node, "--simulate", "--gpus", "2",
                "--heartbeat-s", "0.3", "--artifacts", str(artifacts), "--work-dir", str(tmp_path / "work" / node)]

    up = UpProcess(tmp_path / "up", log=net_kafka, workers=1).start()
    try:
        procs.start("allocator", [*DAGFOLD, "allocator", "--pool", pool, "--log", net_kafka, "--data",
                                  str(tmp_path / "alloc"), "--lease-s", str(LEASE_S), "--grace-s", "4"])
        cut_agent = procs.start("n1", host.command(agent("n1")))  # the host to be cut: in its namespace
        job = submit_gpu(up, pool, 300)  # 30 s of steps, a checkpoint every few
        assert wait_running(up, job)[job] == "n1"
        procs.start("n0", agent("n0"))  # the other host, where the job goes on
        stale = str(task(up, job)["allocation"]["alloc_id"])
        pids = _processes_of(stale)
        assert pids, f"no process of {stale}"

        cut_at = time.time()
        host.cut()
        gone_at: float | None = None
        while time.time() < cut_at + CUT_S:
            if gone_at is None and not any(_alive(p) for p in pids):
                gone_at = time.time()
            assert cut_agent.poll() is None, f"the agent behind the cut exited:\n{procs.output('n1')}"
            time.sleep(0.1)
        host.heal()
        healed_at = time.time()

        assert gone_at is not None, "the stale job process outlived the 3-minute cut"
        print(f"stale process gone {gone_at - cut_at:.1f} s after the cut")  # docs/reliability.md (pytest -rP)
        # The window (docs/reliability.md): stopped by lease - margin/2 after the last acknowledged heartbeat,
        # so before the allocator can declare the host lost and grant its GPUs again
        assert gone_at - cut_at <= LEASE_S - MARGIN_S / 2 + 0.5, f"stopped {gone_at - cut_at:.1f} s after the cut"
        assert up.wait(job, timeout=120)["state"] == "succeeded", history(up, job)
        h = history(up, job)
        assert [e["type"] for e in h].count("TaskSucceeded") == 1, h
        assert not [e for e in h if e["type"] == "TaskFailed"], h
        requeued = [e for e in h if e["type"] == "TaskRequeued"]
        assert requeued and "checkpoint" in requeued[0]["detail"], h
        assert '"resumed_from": 0' not in final_output(up, job)  # it went on from its checkpoint

        lg = open_log(net_kafka, tmp_path / "reader")
        try:
            deadline = time.monotonic() + 60
            while True:  # after the heal the agent learns it was lost and registers anew
                ev = [e for e in _read(lg, ALLOCATOR_EVENTS) if e.get("pool") == pool]
                if [e for e in ev if e["type"].endswith("NodeRegistered") and e["node_id"] == "n1"
                        and e["ts_ms"] > healed_at * 1000]:
                    break
                assert time.monotonic() < deadline, f"n1 did not re-register:\n{procs.output('n1')}"
                time.sleep(0.5)
        finally:
            lg.close()
        assert cut_agent.poll() is None, f"the agent exited after the heal:\n{procs.output('n1')}"
        lost = [e for e in ev if e["type"].endswith("NodeDrained") and e["node_id"] == "n1" and e["lost"]]
        assert lost and lost[0]["ts_ms"] / 1000 > gone_at, "the host was declared lost before its process stopped"
        regrant = [e for e in ev if e["type"].endswith("AllocationGranted") and e["job_id"] == job
                   and e["alloc_id"] != stale]
        assert regrant and regrant[0]["ts_ms"] / 1000 > gone_at  # never ran twice at once
        assert not gpus_held_twice(ev)[0]
        print(f"host declared lost {lost[0]['ts_ms'] / 1000 - cut_at:.1f} s and the job granted again "
              f"{regrant[0]['ts_ms'] / 1000 - cut_at:.1f} s after the cut")
    finally:
        procs.close()
        up.stop()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _attempt_processes(job: str, attempt: int) -> list[int]:
    """PIDs of the shell task processes of ``job``'s attempt (read from their environment)."""
    pids = []
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            env = (d / "environ").read_bytes().split(b"\0") if d.name.isdigit() else []
            if f"DAGFOLD_JOB_ID={job}".encode() in env and f"DAGFOLD_ATTEMPT={attempt}".encode() in env:
                pids.append(int(d.name))
    return pids


@pytest.mark.timeout(420)
def test_a_worker_cut_off_past_its_lease_stops_the_attempt_and_reports_nothing_for_it(
        net: Net, net_kafka: str, tmp_path: Path) -> None:
    """A CPU worker behind a cut stops the attempt whose lease it could not renew (no heartbeat delivered for a
    whole lease) while still cut off: the scheduler has given it to another worker, and the stale attempt's
    outcome never arrives."""
    host = net.host()
    procs = Procs(tmp_path)
    lease_s = 4.0

    def worker(name: str) -> list[str]:
        return [*DAGFOLD, "worker", "--log", net_kafka, "--data", str(tmp_path / name), "--queue", "default",
                "--handlers", "shell"]

    up = UpProcess(tmp_path / "up", log=net_kafka, workers=0).start()
    try:
        cut_worker = procs.start("w1", host.command(worker("w1")))
        job = up.submit({"id": f"cut-{uuid.uuid4().hex[:6]}", "tasks": [
            {"id": "t", "handler": "shell", "args": {"cmd": "sleep 40", "kill_grace_s": 0.5},
             "timeouts": {"heartbeat_s": lease_s}, "retry": {"max_attempts": 3, "initial_interval_s": 0.2}}]})
        deadline = time.monotonic() + 60
        while not (pids := _attempt_processes(job, 1)):
            assert time.monotonic() < deadline, procs.output("w1")
            time.sleep(0.2)
        cut_at = time.time()
        host.cut()
        procs.start("w0", worker("w0"))  # takes the attempt the scheduler reclaims
        gone_at = None
        while time.time() < cut_at + 20:  # five leases
            if gone_at is None and not any(_alive(p) for p in pids):
                gone_at = time.time()
            time.sleep(0.1)
        host.heal()
        assert gone_at is not None, "the stale attempt's process ran through the whole cut"
        print(f"stale attempt stopped {gone_at - cut_at:.1f} s after the cut")  # docs/reliability.md (pytest -rP)
        assert gone_at - cut_at <= lease_s + 3.0, f"stopped {gone_at - cut_at:.1f} s after the cut"
        assert up.wait(job, timeout=120)["state"] == "succeeded"
        assert cut_worker.poll() is None, f"the worker behind the cut exited:\n{procs.output('w1')}"
        lg = open_log(net_kafka, tmp_path / "reader")
        try:
            reports = [c for c in _read(lg, COMMANDS) if c.get("job_id") == job]
        finally:
            lg.close()
        stale = [c for c in reports if c["attempt"] == 1 and c["type"].endswith(("TaskSucceeded", "TaskFailed"))]
        assert not stale, stale
        assert [c["attempt"] for c in reports if c["type"].endswith("TaskSucceeded")] == [2]
    finally:
        procs.close()
        up.stop()
