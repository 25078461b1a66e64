"""The chaos run: start the cluster and the processes, run the workload under faults, check, report.

Layout of a run folder (``--workdir``, default a temporary folder removed after a passing run)::

    kafka/            the 3-broker cluster (kafka.sh's KAFKA_DATA)
    api/              dagfold up --no-scheduler --workers 0 (API + projector)
    s1/ s2/ s3/       dagfold scheduler --instance sI --data sI
    effects.sqlite    the external system (chaos.handlers), ledger.sqlite the SideEffectLedger
    logs/             one log per process; faults.jsonl, duplicates.jsonl; report.json
    replay/           dagfold replay --verify output

The end of a run, step by step: stop injecting and bring every process and
broker back; stop the duplicator; wait until every submitted job is terminal in
the read model; wait until the schedulers consumed every command; stop all
schedulers but s1 and wait until s1 owns every partition and its stores hold
the last event of each; stop s1; ``dagfold replay --verify --data s1``; compare
every instance's store that holds a partition's final state with the replay;
run ``chaos.checks``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from chaos import checks, commitfaults
from chaos.cluster import BrokerCluster
from chaos.faults import (
    BROKER_KILL,
    KILL_KINDS,
    NEW_KINDS,
    PARTITION_KINDS,
    SCHEDULER_KILL,
    SCHEDULER_KILL_EMPTY,
    FaultPlan,
    Injector,
)
from chaos.handlers import EFFECTS_ENV, LEDGER_ENV
from chaos.procs import ROOT, Proc, terminate_all
from chaos.workload import JobPlan, plan_workload
from dagfold.codec import default_codec
from dagfold.config import ALLOCATOR_EVENTS, COMMANDS, EVENTS, SCHEDULER_GROUP
from dagfold.lifecycle import JOB_FINAL
from dagfold.log import Log, TopicPartition, open_log
from dagfold.log.reader import read_to_end
from dagfold.processor import catch_up
from dagfold.services.allocator.fold import AllocatorFold
from dagfold.services.allocator.options import AllocatorOptions
from dagfold.services.scheduler.replay import job_digest, job_ids
from dagfold.state import MemoryStore, PartitionStore
from dagfold.state.store import applied_events_offset, state_digest

PY = sys.executable
PARTITIONS = 8
STUCK_S = 60.0  # consolidation: s1's stores unchanged this long while behind the events = stuck, not late
POOL = "chaos"
# Short session timeouts so a killed process's partitions move within seconds. A transaction
# timeout of 30 s (librdkafka's default is 60 s) bounds how long a killed scheduler's open
# transaction holds its partitions back when that instance does not come back; shorter ones
# (10 s) make the coordinator abort live transactions that straddle a broker failover, which
# fences the producer (a fatal error: the scheduler exits and is restarted).
CLIENT_SETTINGS = ("consumer.session.timeout.ms=6000&consumer.heartbeat.interval.ms=500"
                   "&producer.transaction.timeout.ms=30000")


@dataclass(frozen=True)
class Profile:
    name: str
    generated_jobs: int
    workflows: tuple[str, ...]
    inject_s: float  # at most this long
    min_faults: int = 0  # keep injecting past inject_s until this many faults (kills + copied reports)
    max_inject_s: float = 0.0  # ... but never longer than this (0: inject_s)
    submit_share: float = 0.6  # jobs are submitted over this share of inject_s
    max_open_jobs: int = 0  # >0: submit only while fewer jobs than this are unfinished (long runs)
    schedulers: int = 3
    workers: int = 3
    worker_concurrency: int = 2
    dup_rate: float = 0.05
    dup_max_per_s: float = 1.0
    drain_s: float = 180.0
    plan: FaultPlan = field(default_factory=FaultPlan)
    scenario: str = "random"  # "random" faults, or "failover": one scheduler and one broker killed once
    # keep injecting past inject_s (up to max_inject_s) until each of these kinds happened require_count times
    require_kinds: tuple[str, ...] = ()
    require_count: int = 1
    # issue 25: hosts of their own (network namespaces) when the plan has partitions: the GPU hosts (one agent
    # each), the workers (worker_hosts), the brokers (when the plan isolates brokers); GPU jobs submitted to
    # the pool, one at a time while fewer than max_open_gpu_jobs are unfinished
    gpu_hosts: int = 1
    worker_hosts: bool = False
    gpu_jobs: int = 0
    gpu_job_s: float = 6.0  # the demo job's run time (steps of 0.1 s, a checkpoint every few)
    max_open_gpu_jobs: int = 2


PROFILES: dict[str, Profile] = {
    # tests/test_chaos.py (make test): about 3 minutes on a 2-core box; every kind of issue 13 at least once.
    "short": Profile("short", generated_jobs=36, workflows=("montage-chameleon-2mass-01d-001.json.gz",),
                     inject_s=90, min_faults=60, max_inject_s=150, drain_s=150,
                     require_kinds=(*NEW_KINDS, *PARTITION_KINDS), gpu_jobs=4,
                     plan=FaultPlan(scheduler_every_s=5.0, worker_every_s=4.0, broker_every_s=20.0,
                                    commit_every_s=5.0, sigstop_every_s=45.0, allocator_sigstop_every_s=50.0,
                                    partition_every_s=30.0, partition_s=(8.0, 25.0),
                                    isolate_every_s=30.0, isolate_s=(8.0, 15.0))),
    # python -m chaos --profile commit-faults: issue 13's kinds alone, under 5 minutes.
    "commit-faults": Profile("commit-faults", generated_jobs=24,
                             workflows=("montage-chameleon-2mass-01d-001.json.gz",), inject_s=70, min_faults=16,
                             max_inject_s=90, submit_share=0.9, drain_s=120, dup_rate=0.0, workers=2,
                             plan=FaultPlan(scheduler_every_s=0, worker_every_s=0, broker_every_s=0,
                                            commit_every_s=3.0, sigstop_every_s=25.0,
                                            allocator_sigstop_every_s=25.0)),
    # make chaos: at least 3,000 faults (about 1.3 a second on a quiet machine: 40-55 minutes of faults; at load
    # 30-40 on 2 cores about 0.7 a second, hence up to 75 minutes), about an hour in all; and at least 300 of
    # each partition kind (issue 25). Host partitions: up to 4 of the 6 hosts (3 GPU hosts, 3 workers) cut at
    # once, one every 3 s on average while fewer are cut, 85% of them 5-12 s long and 15% 15-180 s (log-uniform):
    # about 17 s on average, so about 600 in 50 minutes. A broker isolation holds the one broker slot until the
    # cluster is whole again, and a broker kill (plain, or inside a commit) holds it for a minute or more on a
    # loaded machine, so most isolations are short: 97% of 5-6 s (the followers of the isolated broker's
    # partitions stop fetching, acks=all produces to its leaders wait, the controller quorum goes on without it),
    # 3% of 15-180 s (past the 9 s broker session timeout: the controller fences it, leaders move, its clients
    # time out): about 7.5 s on average, 8-9 s with the recovery, 300 in 45-55 minutes; plain broker kills every
    # 900 s and broker kills inside a commit at least 600 s apart, for that.
    "long": Profile("long", generated_jobs=1200,
                    workflows=("montage-chameleon-2mass-01d-001.json.gz", "seismology-chameleon-1100p-001.json.gz",
                               "1000genome-chameleon-22ch-250k-001.json.gz", "cycles-chameleon-10l-1c-9p-001.json.gz",
                               "montage-chameleon-2mass-05d-001.json.gz",
                               "epigenomics-chameleon-ilmn-6seq-50k-001.json.gz"),
                    inject_s=2400, min_faults=3000, max_inject_s=5400, submit_share=0.85, drain_s=900,
                    max_open_jobs=30, dup_rate=0.15, dup_max_per_s=0.7,
                    require_kinds=PARTITION_KINDS, require_count=300, gpu_hosts=3, worker_hosts=True,
                    gpu_jobs=400, max_open_gpu_jobs=3,
                    plan=FaultPlan(scheduler_every_s=3.5, worker_every_s=2.0, broker_every_s=900.0,
                                   commit_every_s=6.0, sigstop_every_s=60.0, allocator_sigstop_every_s=60.0,
                                   partition_every_s=3.0, partition_s=(5.0, 12.0), partition_long_s=(15.0, 180.0),
                                   partition_long_share=0.15, max_hosts_cut=4,
                                   isolate_every_s=0.5, isolate_s=(5.0, 6.0), isolate_long_share=0.03,
                                   commit_broker_gap_s=600.0)),
    # 3 schedulers on 3 brokers: kill -9 one instance and one broker mid-run, bring neither back until the end.
    "failover": Profile("failover", generated_jobs=40, workflows=("montage-chameleon-2mass-01d-001.json.gz",),
                        inject_s=0, drain_s=240, dup_rate=0.0, scenario="failover"),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ChaosRun:
    def __init__(self, profile: Profile, seed: int, workdir: Path | None = None, keep: bool = False,
                 say: Any = None) -> None:
        self.profile = profile
        self.seed = seed
        self.keep = keep or workdir is not None
        self.dir = workdir if workdir is not None else Path(tempfile.mkdtemp(prefix="dagfold-chaos-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.logs = self.dir / "logs"
        self.logs.mkdir(exist_ok=True)
        self.rng = random.Random(seed)
        self._say = say or (lambda m: print(m, flush=True))
        self.t0 = time.monotonic()
        self.timings: dict[str, float] = {}
        self.submitted: list[JobPlan] = []
        self.gpu_submitted: list[str] = []
        self.procs: list[Proc] = []
        self.submit_stop = threading.Event()

    def say(self, msg: str) -> None:
        self._say(f"[chaos {time.monotonic() - self.t0:7.1f}s] {msg}")

    def mark(self, name: str) -> None:
        self.timings[name] = round(time.monotonic() - self.t0, 1)

    # -- processes ---------------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"DAGFOLD_REPLICATION": "3", "DAGFOLD_PARTITIONS": str(PARTITIONS),
                    LEDGER_ENV: str(self.dir / "ledger.sqlite"), EFFECTS_ENV: str(self.dir / "effects.sqlite"),
                    "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), "COLUMNS": "200",
                    # a worker killed every 2-4 s loses dispatch records far more often than production does,
                    # and the short run's drain (150 s) is shorter than the default interval (300 s): re-dispatch
                    # after 60 s, as both long runs of 1 December evening did
                    "DAGFOLD_REDISPATCH_AFTER_S": "60"})
        return env

    def _proc(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        p = Proc(name, [PY, *args], {**self._env(), **(env or {})}, self.logs / f"{name}.log")
        self.procs.append(p)
        return p

    def start_processes(self) -> None:
        url = self.url
        self.api_port = free_port()
        self.api = f"http://127.0.0.1:{self.api_port}"
        self.api_proc = self._proc("api", "-m", "dagfold", "up", "--log", url, "--data", str(self.dir / "api"),
                                   "--no-scheduler", "--workers", "0", "--port", str(self.api_port)).start()
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.api + "/healthz", timeout=2).status_code == 200:
                    break
            if not self.api_proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start:\n{self.api_proc.tail()}")
            time.sleep(0.3)
        self.scheduler_dirs = {f"s{i}": self.dir / f"s{i}" for i in range(1, self.profile.schedulers + 1)}
        # Each scheduler runs under chaos.commitfaults: the first commit of any of them takes an armed fault.
        self.fault_dir = self.dir / "commit-faults"
        self.fault_dir.mkdir(exist_ok=True)
        self.schedulers = [self._proc(name, "-m", "chaos.commitfaults", "scheduler", "--log", url, "--data", str(d),
                                      "--instance", name, env={commitfaults.ENV: str(self.fault_dir)}).start()
                           for name, d in self.scheduler_dirs.items()]
        # The GPU pool: its allocator (a second instance is the standby the zombie fault starts) and one
        # simulated host whose heartbeats keep allocator commands flowing.
        self.allocators: list[Proc] = []
        self.agents: list[Proc] = []
        if self.profile.plan.allocator_sigstop_every_s > 0:
            self.allocator_dirs = {f"a{i}": self.dir / f"a{i}" for i in (1, 2)}
            self.allocators = [self._proc(name, "-m", "dagfold", "allocator", "--pool", POOL, "--log", url,
                                          "--data", str(d), "--lease-s", "20")
                               for name, d in self.allocator_dirs.items()]
            self.allocators[0].start()
            self.agents = []
            for i in range(1, max(1, self.profile.gpu_hosts) + 1):
                agent = self._proc("agent" if i == 1 else f"agent{i}", "-m", "dagfold", "agent", "--pool", POOL,
                                   "--log", url, "--node", f"chaos-node-{i}", "--simulate", "--gpus", "2",
                                   "--heartbeat-s", "0.5", "--artifacts", str(self.dir / "artifacts"),
                                   "--work-dir", str(self.dir / f"agent-work-{i}"),
                                   "--allow-root-tasks")  # its jobs are the demo job: as root, say so
                if i <= len(self.gpu_hosts):  # on a host of its own, which the partition faults cut off
                    agent.argv = self.gpu_hosts[i - 1].command(agent.argv)
                self.agents.append(agent.start())
            self.agent = self.agents[0]
        self.workers = []
        for i in range(1, self.profile.workers + 1):
            worker = self._proc(f"w{i}", "-m", "dagfold", "worker", "--log", url, "--data", str(self.dir / f"w{i}"),
                                "--queue", "default", "--concurrency", str(self.profile.worker_concurrency),
                                "--handler-module", "chaos.handlers")
            if i <= len(self.worker_hosts):
                worker.argv = self.worker_hosts[i - 1].command(worker.argv)
            self.workers.append(worker.start())
        self.dup_stats = self.dir / "duplicates.json"
        self.duplicator = self._proc("duplicator", "-m", "chaos.duplicator", "--log", url, "--seed",
                                     str(self.seed + 1), "--rate", str(self.profile.dup_rate), "--max-per-s",
                                     str(self.profile.dup_max_per_s), "--stats", str(self.dup_stats),
                                     "--journal", str(self.logs / "duplicates.jsonl"))
        if self.profile.dup_rate > 0:
            self.duplicator.start()

    def duplicates(self) -> dict[str, int]:
        try:
            return dict(json.loads(self.dup_stats.read_text())["counts"])
        except (OSError, ValueError, KeyError):
            return {}

    # -- workload -------------------------------------------------------------------------------------
    def submit_all(self, plans: list[JobPlan], over_s: float, stop: threading.Event) -> None:
        """Submit the plans evenly over ``over_s`` seconds; with ``max_open_jobs``, as fast as jobs
        finish instead, until ``stop`` (the plans left are not submitted)."""
        start = time.monotonic()
        open_jobs: list[str] = []
        with httpx.Client(base_url=self.api, timeout=30) as http:
            for i, plan in enumerate(plans):
                if self.profile.max_open_jobs:
                    open_jobs = self._room(http, open_jobs, self.profile.max_open_jobs, stop)
                    if stop.is_set():
                        return
                    open_jobs.append(plan.job_id)
                at = start + over_s * i / max(1, len(plans))
                while time.monotonic() < at and not stop.is_set():
                    time.sleep(0.05)
                body = json.dumps(plan.doc)
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline:
                    try:
                        r = http.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
                        if r.status_code == 202:
                            self.submitted.append(plan)
                            break
                        self.say(f"submit {plan.job_id}: HTTP {r.status_code} {r.text[:200]}; retrying")
                    except httpx.HTTPError as exc:
                        self.say(f"submit {plan.job_id}: {exc!r}; retrying")
                    time.sleep(1.0)  # the same job ID again: a duplicate submission is deduplicated
                else:
                    self.say(f"giving up on submitting {plan.job_id}")

    def submit_gpu_jobs(self, stop: threading.Event) -> None:
        """GPU jobs (the simulated agents' demo job, checkpointing) to the pool, one as soon as fewer than
        ``max_open_gpu_jobs`` are unfinished, until ``stop``: what the host partitions move between hosts."""
        steps = max(1, round(self.profile.gpu_job_s / 0.1))
        open_jobs: list[str] = []
        with httpx.Client(base_url=self.api, timeout=30) as http:
            for i in range(self.profile.gpu_jobs):
                open_jobs = self._room(http, open_jobs, self.profile.max_open_gpu_jobs, stop)
                if stop.is_set():
                    return
                job_id = f"chaos-{self.seed}-gpu{i:04d}"
                body = {"job_id": job_id, "model": "demo", "params": {"steps": steps, "step_s": 0.1},
                        "prompt": "chaos", "pool": POOL, "resources": {"gpus": 1, "checkpoint": True}}
                deadline = time.monotonic() + 300
                while time.monotonic() < deadline and not stop.is_set():
                    try:
                        r = http.post("/v1/gpu-jobs", json=body)
                        if r.status_code in (200, 202):
                            self.gpu_submitted.append(job_id)
                            open_jobs.append(job_id)
                            break
                        self.say(f"submit {job_id}: HTTP {r.status_code} {r.text[:200]}; retrying")
                    except httpx.HTTPError as exc:
                        self.say(f"submit {job_id}: {exc!r}; retrying")
                    stop.wait(1.0)

    def _room(self, http: httpx.Client, open_jobs: list[str], limit: int, stop: threading.Event) -> list[str]:
        """Wait until fewer than ``limit`` of ``open_jobs`` are unfinished (or ``stop``); the unfinished ones."""
        while not stop.is_set():
            open_jobs = [j for j in open_jobs if not self._terminal(http, j)]
            if len(open_jobs) < limit:
                break
            stop.wait(1.0)
        return open_jobs

    @staticmethod
    def _terminal(http: httpx.Client, job_id: str) -> bool:
        try:
            r = http.get(f"/v1/jobs/{job_id}")
            return r.status_code == 200 and r.json()["state"] in JOB_FINAL
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    def job_states(self) -> Counter[str]:
        c: Counter[str] = Counter()
        with httpx.Client(base_url=self.api, timeout=30) as http:
            for job_id in [p.job_id for p in self.submitted] + list(self.gpu_submitted):
                try:
                    r = http.get(f"/v1/jobs/{job_id}")
                    c[r.json()["state"] if r.status_code == 200 else "missing"] += 1
                except (httpx.HTTPError, ValueError, KeyError):
                    c["unknown"] += 1
        return c

    def wait_jobs(self, timeout_s: float, injector: Injector | None) -> bool:
        deadline = time.monotonic() + timeout_s
        last = 0.0
        while time.monotonic() < deadline:
            if injector is not None:
                injector.supervise()
            c = self.job_states()
            open_ = sum(n for s, n in c.items() if s not in JOB_FINAL)
            if time.monotonic() - last > 15:
                self.say(f"jobs: {dict(c)}")
                last = time.monotonic()
            if open_ == 0:
                return True
            time.sleep(1)
        return False

    # -- the end: quiesce, consolidate, replay -------------------------------------------------------------
    def command_lag(self, log: Log) -> int | None:
        tps = [TopicPartition(COMMANDS, p) for p in range(PARTITIONS)]
        try:
            c = log.consumer(SCHEDULER_GROUP, client_id="chaos-lag")
            try:
                committed = c.committed(tps)
            finally:
                c.close()
            ends = log.end_offsets(tps)
        except Exception:
            return None
        return sum(max(0, ends[tp] - committed.get(tp, 0)) for tp in tps)

    def last_event_offsets(self, log: Log) -> dict[int, int]:
        """Offset of the last committed record of each events partition (-1 if none)."""
        out = {}
        for p in range(PARTITIONS):
            tp = TopicPartition(EVENTS, p)
            end = log.end_offsets([tp])[tp]
            window, found = 64, -1
            while end > 0:
                start = max(0, end - window)
                c = log.consumer(None, client_id="chaos-tail")
                c.assign({tp: start})
                deadline = time.monotonic() + 20
                while c.position(tp) < end and time.monotonic() < deadline:
                    for r in c.poll(5000, 0.2):
                        found = max(found, r.offset)
                c.close()
                if found >= 0 or start == 0:
                    break
                window *= 8
            out[p] = found
        return out

    def store_offsets(self, instance_dir: Path) -> dict[int, int]:
        out = {}
        for p in range(PARTITIONS):
            path = instance_dir / "scheduler" / f"p{p:04d}"
            if not path.exists():
                continue
            try:
                s = PartitionStore(path, read_only=True)
            except Exception:
                continue
            try:
                out[p] = applied_events_offset(s)
            finally:
                s.close()
        return out

    def consolidate(self, log: Log, injector: Injector | None) -> dict[str, Any]:
        """Stop every scheduler but s1; wait until s1 holds the final state of every partition; stop it."""
        info: dict[str, Any] = {}
        deadline = time.monotonic() + 120
        lag = None
        while time.monotonic() < deadline:
            if injector is not None:
                injector.supervise()
            lag = self.command_lag(log)
            if lag == 0:
                break
            time.sleep(1)
        info["command lag before consolidation"] = lag
        keep, others = self.schedulers[0], self.schedulers[1:]
        terminate_all(others)
        if not keep.alive():
            keep.start()
        # Late or stuck? s1 gets 180 s, and longer (up to 600 s) while its stores still move: taking
        # over partitions on a loaded machine can be slow; a store that stopped moving behind the
        # events for STUCK_S is stuck, which no waiting mends.
        start = time.monotonic()
        moved = start
        final: dict[int, int] = {}
        behind: dict[int, tuple[int | None, int]] = {}
        while True:
            now = time.monotonic()
            if now - start >= 600 or (now - start >= 180 and now - moved >= STUCK_S):
                break
            if not keep.alive():
                self.say(f"s1 exited during consolidation (code {keep.exit_code()}); restarting it")
                keep.start()
            final = self.last_event_offsets(log)
            have = self.store_offsets(self.scheduler_dirs[keep.name])
            now_behind = {p: (have.get(p), off) for p, off in final.items() if off >= 0 and have.get(p) != off}
            if now_behind != behind:
                moved = time.monotonic()
            behind = now_behind
            if not behind and self.command_lag(log) == 0:
                break
            time.sleep(1)
        info["s1 caught up"] = not behind
        info["s1 waited s"] = round(time.monotonic() - start, 1)
        if behind:
            info["s1 behind"] = {str(p): v for p, v in behind.items()}
            info["s1 stuck s"] = round(time.monotonic() - moved, 1)  # how long nothing moved
        keep.terminate()
        self.final_offsets = final
        return info

    def replay_and_compare(self, findings: checks.Findings) -> dict[str, Any]:
        out_dir = self.dir / "replay"
        shutil.rmtree(out_dir, ignore_errors=True)
        t = time.monotonic()
        p = subprocess.run([PY, "-m", "dagfold", "replay", "--log", self.url, "--data", str(self.scheduler_dirs["s1"]),
                            "--out", str(out_dir), "--verify", "--json"], cwd=ROOT, env=self._env(),
                           capture_output=True, text=True, timeout=900)
        info: dict[str, Any] = {"exit code": p.returncode, "seconds": round(time.monotonic() - t, 1)}
        try:
            rep = json.loads(p.stdout)
            info.update(applied=rep["applied"], events_per_s=rep["events_per_s"],
                        differences=len(rep.get("differences", [])))
            for d in rep.get("differences", []):
                findings.add(checks.REPLAY_DIFFERS, d.get("job_id"), None,
                             f"dagfold replay --verify: partition {d['partition']}: {d['what']}")
        except (ValueError, KeyError):
            info["output"] = (p.stdout + p.stderr)[-2000:]
        if p.returncode != 0 and not info.get("differences"):
            findings.add(checks.REPLAY_DIFFERS, None, None, f"dagfold replay --verify exited {p.returncode}: "
                                                            f"{(p.stdout + p.stderr)[-500:]}")
        # Every instance's store that holds a partition's final state must equal the replay.
        compared = 0
        for name, d in self.scheduler_dirs.items():
            for part, off in self.store_offsets(d).items():
                if off != self.final_offsets.get(part) or off < 0:
                    continue
                live = PartitionStore(d / "scheduler" / f"p{part:04d}", read_only=True)
                rep_store = PartitionStore(out_dir / "scheduler" / f"p{part:04d}", read_only=True)
                try:
                    compared += 1
                    if state_digest(live) != state_digest(rep_store):
                        lj, rj = job_ids(live), job_ids(rep_store)
                        bad = sorted(j for j in lj | rj if j not in lj or j not in rj
                                     or job_digest(live, j) != job_digest(rep_store, j))
                        findings.add(checks.REPLAY_DIFFERS, bad[0] if bad else None, None,
                                     f"{name} partition {part}: live state differs from the replay "
                                     f"({len(bad)} job(s))")
                finally:
                    live.close()
                    rep_store.close()
        info["stores compared"] = compared
        return info

    # -- the run -----------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        prof = self.profile
        self.say(f"profile {prof.name}, seed {self.seed}, folder {self.dir}")
        plans = plan_workload(self.seed, prof.generated_jobs, list(prof.workflows))
        self.say(f"workload: {len(plans)} jobs, {sum(p.tasks for p in plans)} tasks")
        # Partition faults: the GPU hosts (and the workers, with worker_hosts) get network namespaces of their
        # own; the brokers too when the plan isolates brokers, else they listen on the network's hub address
        self.net: Any = None
        self.gpu_hosts: list[Any] = []
        self.worker_hosts: list[Any] = []
        broker_hosts: list[Any] = []
        if prof.plan.partition_every_s > 0 or prof.plan.isolate_every_s > 0:
            from tests.netns_support import Net

            self.net = Net()
            if prof.plan.isolate_every_s > 0:
                broker_hosts = [self.net.host() for _ in range(3)]
            if prof.plan.partition_every_s > 0 and prof.plan.allocator_sigstop_every_s > 0:
                self.gpu_hosts = [self.net.host() for _ in range(max(1, prof.gpu_hosts))]
            if prof.plan.partition_every_s > 0 and prof.worker_hosts:
                self.worker_hosts = [self.net.host() for _ in range(prof.workers)]
            for i, h in enumerate(self.gpu_hosts, 1):
                h.label = f"gpu-host-{i} ({h.ns})"
            for i, h in enumerate(self.worker_hosts, 1):
                h.label = f"w{i}'s host ({h.ns})"
        self.cluster = BrokerCluster(self.dir / "kafka", host=self.net.hub if self.net is not None else "127.0.0.1",
                                     hosts=broker_hosts)
        self.url = f"kafka://{self.cluster.bootstrap}?{CLIENT_SETTINGS}"
        report: dict[str, Any] = {"profile": prof.name, "seed": self.seed, "folder": str(self.dir),
                                  "settings": {k: v for k, v in asdict(prof).items() if k != "plan"},
                                  "fault plan": asdict(prof.plan)}
        findings = checks.Findings()
        injector: Injector | None = None
        stop = threading.Event()
        try:
            self.cluster.start()
            self.mark("cluster up")
            self.say(f"cluster up on {self.cluster.bootstrap}")
            self.start_processes()
            self.mark("processes up")
            submit_over = prof.inject_s * prof.submit_share if prof.scenario == "random" else 5.0
            if prof.max_open_jobs:
                submit_over = 0.0
            submitter = threading.Thread(target=self.submit_all, args=(plans, submit_over, self.submit_stop),
                                         daemon=True)
            submitter.start()
            gpu_submitter = threading.Thread(target=self.submit_gpu_jobs, args=(self.submit_stop,), daemon=True)
            if self.allocators and prof.gpu_jobs:
                gpu_submitter.start()
            others = [self.api_proc] + ([self.duplicator] if prof.dup_rate else []) + \
                (list(self.agents) if self.allocators else [])
            injector = Injector(self.rng, prof.plan, self.cluster, self.schedulers, self.scheduler_dirs,
                                self.workers, others, self.logs / "faults.jsonl", self.say,
                                fault_dir=self.fault_dir, allocators=self.allocators,
                                require_kinds=prof.require_kinds, require_count=prof.require_count,
                                hosts=[*self.gpu_hosts, *self.worker_hosts], broker_addrs=self.cluster.addresses)
            if prof.scenario == "failover":
                self.failover(injector, submitter)
            else:
                self.inject(injector)
            self.mark("faults stopped")
            submitter.join(timeout=600)
            if gpu_submitter.is_alive():
                gpu_submitter.join(timeout=60)
            if self.duplicator.alive():
                self.duplicator.terminate(60)
            self.say(f"faults: {self.fault_counts(injector)}")
            done = self.wait_jobs(prof.drain_s, injector)
            self.mark("jobs drained")
            self.say("every job is terminal" if done else "some jobs are not terminal")
            log = open_log(self.url, self.dir)
            try:
                report["consolidation"] = self.consolidate(log, injector)
                self.mark("consolidated")
                self.say(f"consolidated on s1: {report['consolidation']}")
                report["replay"] = self.replay_and_compare(findings)
                self.mark("replayed")
                self.say(f"replay: {report['replay']}")
                report.update(self.check(log, findings))
                self.mark("checked")
            finally:
                log.close()
        finally:
            stop.set()
            self.submit_stop.set()
            terminate_all(self.procs, 20)
            for p in self.procs:
                p.close()
            with contextlib.suppress(Exception):
                self.cluster.stop()
            if self.net is not None:
                self.net.close()
        report["faults"] = self.fault_counts(injector)
        report["faults total"] = sum(report["faults"].values())
        report["unexpected exits"] = injector.unexpected if injector else []
        report["violations by kind"] = findings.by_kind()
        report["violations total"] = len(findings.violations)
        report["violations"] = [v.line() for v in findings.violations[:200]]
        report["timings s"] = self.timings
        (self.dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
        if not findings.violations and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        return report

    def inject(self, injector: Injector) -> None:
        """Random faults for ``inject_s``, longer if needed to reach ``min_faults`` (up to ``max_inject_s``)."""
        prof = self.profile
        start = time.monotonic()
        hard = start + (prof.max_inject_s or prof.inject_s)
        last = start
        while True:
            now = time.monotonic()
            total = injector.kills + sum(self.duplicates().values())
            kinds_done = all(injector.counts.get(k, 0) >= prof.require_count for k in prof.require_kinds)
            # jobs keep coming while the run still needs faults of a kind (a long run's partitions), but not
            # in its last minutes, so that the drain ends them
            if now >= start + prof.inject_s * prof.submit_share and (
                    prof.require_count <= 1 or kinds_done or now >= hard - 300):
                self.submit_stop.set()
            if now >= hard or (now >= start + prof.inject_s and total >= prof.min_faults and kinds_done):
                break
            injector.step_until(min(hard, now + 2.0))
            if time.monotonic() - last > 15:
                self.say(f"faults so far: {self.fault_counts(injector)}")
                last = time.monotonic()
        self.submit_stop.set()
        injector.recover()

    def failover(self, injector: Injector, submitter: threading.Thread) -> None:
        """Kill -9 one scheduler instance and one broker mid-run; bring both back only after every job ended."""
        submitter.join(timeout=300)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            c = self.job_states()
            if c.get("succeeded", 0) + c.get("failed", 0) + c.get("succeeded_partial", 0) >= len(self.submitted) // 4:
                break
            time.sleep(1)
        victim, node = self.schedulers[1], self.rng.randint(1, 3)
        victim.kill9()
        injector.record(SCHEDULER_KILL, victim.name)
        self.cluster.kill9(node)
        injector.record(BROKER_KILL, f"broker-{node}")
        self.say(f"killed {victim.name} and broker-{node}; neither comes back until every job ended")
        self.mark("failover kill")
        self.wait_jobs(self.profile.drain_s, injector)
        self.mark("jobs ended without them")
        self.cluster.restart_missing()
        self.cluster.wait_healthy(180)
        victim.start()

    def fault_counts(self, injector: Injector | None) -> dict[str, int]:
        c = dict(injector.counts) if injector else dict.fromkeys(KILL_KINDS, 0)
        c.update(self.duplicates())
        return c

    def check(self, log: Log, findings: checks.Findings) -> dict[str, Any]:
        model = checks.scan_events(log, PARTITIONS, findings)
        dead = checks.scan_dead_letters(log, findings)
        states = checks.check_read_model(self.api_read(), self.submitted, model, findings)
        effects = checks.check_side_effects(self.dir / "effects.sqlite", self.dir / "ledger.sqlite", model,
                                            self.submitted, findings)
        allocator = self.check_allocator(log, findings) if self.allocators else None
        stores = [self.scheduler_dirs["s1"] / "scheduler" / f"p{p:04d}" for p in range(PARTITIONS)
                  if (self.scheduler_dirs["s1"] / "scheduler" / f"p{p:04d}").exists()]
        dangling_checked = checks.check_dangling(stores, findings)
        successes_checked = checks.check_successes_dispatched(model, findings)
        c = model.counts
        return {
            "jobs": {"submitted": len(self.submitted), **{f"ended {k}": v for k, v in sorted(states.items())}},
            "tasks": {"in submitted jobs": sum(p.tasks for p in self.submitted),
                      "succeeded": c["TaskSucceeded"], "failed for good": sum(
                          1 for j in model.jobs.values() for s in j.state.values() if s == "failed"),
                      "skipped": c["TaskSkipped"], "cancelled": c["TaskCancelled"],
                      "attempts leased": c["LeaseGranted"], "retries": c["TaskRetryScheduled"],
                      "lease expiries": model.lease_expiries, "reports ignored": c["ReportIgnored"],
                      "leases rejected": c["LeaseRejected"],
                      "re-dispatches (record not taken in time)": c["TaskRedispatched"],
                      "re-dispatches deferred (queue still draining older records)": c["TaskRedispatchDeferred"],
                      "events": sum(c.values()),
                      "tasks checked for dangling leases": dangling_checked,
                      "successes checked for a committed dispatch": successes_checked},
            "side effects": effects,
            "dead letters": dead,
            **({"allocator": allocator} if allocator is not None else {}),
        }

    def pool_events(self, log: Log, tp: TopicPartition) -> list[dict[str, Any]]:
        codec = default_codec()
        out = []
        for recs in read_to_end(log, tp):
            for r in recs:
                e = codec.decode(r.value)
                if e.get("pool") == POOL:
                    out.append(e)
        return out

    def check_allocator(self, log: Log, findings: checks.Findings) -> dict[str, Any]:
        """The pool's state in the store of its last allocator equals the state rebuilt from its events,
        no request was granted twice (zombies' late writes changed nothing), no GPU was granted to two live
        allocations, no allocation is left once every job ended, every GPU job succeeded."""
        tp = TopicPartition(ALLOCATOR_EVENTS, log.partition_for(POOL.encode(), log.partitions(ALLOCATOR_EVENTS)))
        # Every job ended: the releases of their allocations may still be on their way (an agent that was cut
        # off reports its exits when it is back; a lost host's allocations expire with its lease): wait for
        # them while the agents and the allocator still run, up to a few leases.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not checks.gpus_held_twice(self.pool_events(log, tp))[1]:
                break
            time.sleep(2)
        terminate_all([*self.agents, *self.allocators], 20)
        with httpx.Client(base_url=self.api_read(), timeout=30) as http:
            gpu_states = {}
            for job_id in self.gpu_submitted:
                try:
                    r = http.get(f"/v1/jobs/{job_id}")
                    gpu_states[job_id] = r.json()["state"] if r.status_code == 200 else "missing"
                except (httpx.HTTPError, ValueError, KeyError):
                    gpu_states[job_id] = "missing"
        pool = checks.check_gpu_pool(self.pool_events(log, tp), gpu_states, findings)
        opts = AllocatorOptions(pool=POOL)
        rebuilt = MemoryStore()
        events = catch_up(log, rebuilt, AllocatorFold(rebuilt, opts), tp, lambda e: e.get("pool") == POOL)
        # A request attempt granted again while an earlier grant of it is still live: a zombie's late write (a
        # grant again after the first expired, its host lost, is the requeue doing its work)
        live: dict[tuple[str, str, int], str] = {}
        owner: dict[str, tuple[str, str, int]] = {}
        for e in self.pool_events(log, tp):
            if e["type"].endswith("AllocationGranted"):
                key = (e["job_id"], e["task_id"], e["attempt"])
                if key in live:
                    findings.add(checks.REPLAY_DIFFERS, key[0], key[1],
                                 f"allocator granted attempt {key[2]} again ({e['alloc_id']}), "
                                 f"while {live[key]} held it")
                live[key] = str(e["alloc_id"])
                owner[str(e["alloc_id"])] = key
            elif e["type"].endswith(("AllocationReleased", "AllocationExpired")):
                k = owner.pop(str(e["alloc_id"]), None)
                if k is not None and live.get(k) == str(e["alloc_id"]):
                    del live[k]
        last = applied_events_offset(rebuilt)
        compared = 0
        for name, d in self.allocator_dirs.items():
            path = d / "allocator" / POOL
            if not path.exists():
                continue
            store = PartitionStore(path, read_only=True)
            try:
                if applied_events_offset(store) != last:
                    continue
                compared += 1
                if state_digest(store) != state_digest(rebuilt):
                    findings.add(checks.REPLAY_DIFFERS, None, None,
                                 f"allocator {name}: live pool state differs from its events rebuilt")
            finally:
                store.close()
        if not compared and events:
            findings.add(checks.REPLAY_DIFFERS, None, None, "no allocator store holds the pool's final state")
        return {"events": events, "stores compared": compared, **pool}

    def api_read(self) -> str:
        """The API for the read-model checks (restarted if it died during the end phase)."""
        if not self.api_proc.alive():
            self.api_proc.start()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.api + "/healthz", timeout=2).status_code == 200:
                        break
                time.sleep(0.3)
        return self.api


__all__ = ["ChaosRun", "PROFILES", "Profile", "SCHEDULER_KILL_EMPTY", "replace"]
