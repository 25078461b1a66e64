"""Job processes of a node agent.

A grant becomes one process per host, started with:

* ``CUDA_VISIBLE_DEVICES`` the granted GPU indices;
* ``DAGFOLD_ALLOC_ID``, ``DAGFOLD_EPOCH``, ``DAGFOLD_JOB_ID``, ``DAGFOLD_TASK_ID``, ``DAGFOLD_ATTEMPT``;
* ``DAGFOLD_CHECKPOINT_DIR`` a folder in the artifact store for this job and task
  (kept across attempts and hosts: the resume point), and
  ``DAGFOLD_RESUME_CHECKPOINT`` the checkpoint to resume from, if any;
* ``DAGFOLD_ARGS_JSON`` the task's arguments (JSON, e.g. model, params and prompt of a GPU job);
* ``DAGFOLD_SPEED`` the simulated device speed (1.0 on real GPUs).

Protocol on stdout, one JSON object per line: ``{"progress": 0.4}``,
``{"checkpoint": "<path>"}``; anything else is log output. To checkpoint and
stop, the agent sends SIGTERM (the job writes a checkpoint, prints it, and
exits); after the deadline, SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class JobProcess:
    alloc_id: str
    epoch: int
    job_id: str
    task_id: str
    attempt: int
    proc: subprocess.Popen[str]
    gpus: list[int]
    progress: float | None = None
    last_checkpoint_ms: int | None = None
    checkpoint_uri: str | None = None
    stop_reason: str | None = None
    kill_at: float | None = None
    lines: list[str] = field(default_factory=list)
    _reader: threading.Thread | None = None

    def exited(self) -> int | None:
        return self.proc.poll()


class Launcher:
    """Starts and stops job processes; ``command`` is the job's argv."""

    def __init__(self, command: list[str], artifact_dir: Path, speed: float = 1.0) -> None:
        self.command = command
        self.artifact_dir = artifact_dir
        self.speed = speed

    def checkpoint_dir(self, job_id: str, task_id: str) -> Path:
        d = self.artifact_dir / job_id / task_id
        d.mkdir(parents=True, exist_ok=True)
        return d

    def start(self, alloc_id: str, epoch: int, job_id: str, task_id: str, attempt: int, gpus: list[int],
              resume: str | None, args_json: str = "{}") -> JobProcess:
        env = dict(os.environ)
        env.update({"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus), "DAGFOLD_ALLOC_ID": alloc_id,
                    "DAGFOLD_EPOCH": str(epoch), "DAGFOLD_JOB_ID": job_id, "DAGFOLD_TASK_ID": task_id,
                    "DAGFOLD_ATTEMPT": str(attempt),
                    "DAGFOLD_CHECKPOINT_DIR": str(self.checkpoint_dir(job_id, task_id)),
                    "DAGFOLD_ARGS_JSON": args_json, "DAGFOLD_SPEED": str(self.speed)})
        if resume:
            env["DAGFOLD_RESUME_CHECKPOINT"] = resume
        proc = subprocess.Popen(self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        jp = JobProcess(alloc_id, epoch, job_id, task_id, attempt, proc, gpus)
        jp._reader = threading.Thread(target=self._read, args=(jp,), daemon=True)
        jp._reader.start()
        return jp

    @staticmethod
    def _read(jp: JobProcess) -> None:
        assert jp.proc.stdout is not None
        for line in jp.proc.stdout:
            line = line.strip()
            try:
                msg = json.loads(line) if line.startswith("{") else None
            except ValueError:
                msg = None
            if isinstance(msg, dict) and "progress" in msg:
                jp.progress = float(msg["progress"])
            elif isinstance(msg, dict) and "checkpoint" in msg:
                jp.checkpoint_uri = str(msg["checkpoint"])
                jp.last_checkpoint_ms = int(time.time() * 1000)
            else:
                jp.lines = (jp.lines + [line])[-50:]

    def stop(self, jp: JobProcess, reason: str, deadline_s: float) -> None:
        """Ask the process to checkpoint and exit (SIGTERM); it is killed at ``deadline_s`` (monotonic)."""
        if jp.stop_reason is None:
            jp.stop_reason = reason
        if jp.exited() is None:
            with contextlib.suppress(ProcessLookupError):
                jp.proc.send_signal(signal.SIGTERM)
        jp.kill_at = deadline_s if jp.kill_at is None else min(jp.kill_at, deadline_s)

    def enforce(self, jp: JobProcess) -> None:
        if jp.kill_at is not None and jp.exited() is None and time.monotonic() >= jp.kill_at:
            jp.proc.kill()

    def finish(self, jp: JobProcess) -> None:
        if jp._reader is not None:
            jp._reader.join(timeout=2)
