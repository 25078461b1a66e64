"""Job processes of a node agent.

A grant becomes one process per host, started with:

* ``CUDA_VISIBLE_DEVICES`` the granted GPU indices;
* ``DAGFOLD_ALLOC_ID``, ``DAGFOLD_EPOCH``, ``DAGFOLD_JOB_ID``, ``DAGFOLD_TASK_ID``, ``DAGFOLD_ATTEMPT``;
* ``DAGFOLD_CHECKPOINT_DIR`` a local folder for this job and task's checkpoints, and
  ``DAGFOLD_RESUME_CHECKPOINT`` the checkpoint to resume from, if any (brought
  back from artifact storage first, into a fresh folder of the agent's);
* ``DAGFOLD_OUTPUT_DIR`` an empty local folder per attempt: what the process
  leaves there is uploaded to artifact storage when it exits 0, and listed in
  the attempt's TaskSucceeded (``outputs``);
* ``DAGFOLD_ARGS_JSON`` the task's arguments (JSON, e.g. model, params and prompt of a GPU job);
* ``DAGFOLD_SPEED`` the simulated device speed (1.0 on real GPUs).

Nothing else of the agent's environment: the process gets the same allow list as
a CPU worker's shell task (``TaskRuntime``: ``PATH``, ``LANG``, ``LC_ALL``, ``TZ``,
``--task-env``; ``HOME`` and ``TMPDIR`` its task folder), runs as the task user
when one is set, and under its own reaper (``dagfold.services.worker.reaper``):
when it exits, is killed, or the agent dies, every process it started ends
too. Its working directory is the agent's (made absolute at start), and a
relative ``{"checkpoint": ...}`` path is read against it. The folders above
are absolute.

Protocol on stdout, one JSON object per line: ``{"progress": 0.4}``,
``{"checkpoint": "<path>"}`` (a file or folder under ``DAGFOLD_CHECKPOINT_DIR``;
the agent uploads it to artifact storage at once, and the stored URI is the
resume point the allocator keeps), ``{"output": <any JSON>}`` (a small result:
the attempt's ``result_json`` is the value, or the list of values when several,
at most 64 KiB); anything else is log output. To checkpoint and
stop, the agent sends SIGTERM (the job writes a checkpoint, prints it, and
exits); after the deadline, SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagfold.artifacts import Artifact, ArtifactError, ArtifactStore, checkpoint_prefix, output_prefix
from dagfold.clock import now_ms
from dagfold.logs import log_context
from dagfold.services.worker.handlers import TaskRuntime
from dagfold.tracing import attempt_traceparent

log = logging.getLogger("dagfold.agent")
MAX_RESULT_BYTES = 64 * 1024
MAX_OUTPUT_LINES = 1000
PROGRESS_SAMPLES = 256  # progress lines kept per process (the throughput window reads them)


@dataclass
class JobProcess:
    alloc_id: str
    epoch: int
    job_id: str
    task_id: str
    attempt: int
    proc: subprocess.Popen[str]
    gpus: list[int]
    tenant: str = "default"
    work: Path = Path(".")
    progress: float | None = None
    last_checkpoint_ms: int | None = None
    checkpoint_uri: str | None = None
    stop_reason: str | None = None
    kill_at: float | None = None
    lines: list[str] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)  # {"output": ...} values
    result_bytes: int = 0
    upload: Future[list[Artifact]] | None = None  # the outputs' upload, once the process exited 0
    # (monotonic time read, progress) of the latest progress lines: the job's throughput
    progress_seen: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=PROGRESS_SAMPLES))
    _reader: threading.Thread | None = None
    traceparent: str = ""  # the attempt's (dagfold.tracing): TRACEPARENT of the process

    def log_fields(self) -> dict[str, Any]:
        """What log lines about this process carry as fields (dagfold.logs)."""
        return {"job_id": self.job_id, "task_id": self.task_id, "attempt": self.attempt, "alloc_id": self.alloc_id,
                "trace_id": self.traceparent[3:35] or None}

    def progress_rate(self, window_s: float, now: float | None = None) -> float | None:
        """Progress per second over the last ``window_s`` seconds of progress lines; None until two
        lines at least a quarter of the window apart (or when progress went back: a restart)."""
        now = time.monotonic() if now is None else now
        seen = [s for s in list(self.progress_seen) if s[0] >= now - window_s]
        if len(seen) < 2:
            return None
        (t0, p0), (t1, p1) = seen[0], seen[-1]
        if t1 - t0 < window_s / 4 or p1 < p0:
            return None
        return (p1 - p0) / (t1 - t0)

    def exited(self) -> int | None:
        return self.proc.poll()

    @property
    def active(self) -> bool:
        """Running, or exited 0 with its outputs still uploading: the attempt's lease is still renewed."""
        return self.exited() is None or (self.upload is not None and not self.upload.done())

    @property
    def checkpoint_dir(self) -> Path:
        return self.work / "checkpoints"

    @property
    def output_dir(self) -> Path:
        return self.work / f"outputs-{self.alloc_id.replace('/', '_')}"

    def result_json(self) -> str | None:
        if not self.results:
            return None
        return json.dumps(self.results[0] if len(self.results) == 1 else self.results, separators=(",", ":"))


def _real_dir(path: Path, *, empty: bool) -> None:
    """A folder of its own at ``path`` (a symlink or file there is removed, never followed), emptied if asked."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif empty:
        shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)


class Launcher:
    """Starts and stops job processes; ``command`` is the job's argv.

    ``store`` is the artifact storage (outputs, checkpoints); ``work_dir`` the
    host-local folder of the processes' checkpoint and output folders; ``runtime``
    the environment allow list and user of the processes (``TaskRuntime``).
    Relative folders are made absolute once, here: the processes' working
    directory is this process's at start.
    """

    def __init__(self, command: list[str], store: ArtifactStore | Path, work_dir: Path | None = None,
                 speed: float = 1.0, runtime: TaskRuntime | None = None) -> None:
        from dagfold.artifacts import LocalArtifactStore

        self.command = command
        if isinstance(store, Path):
            work_dir = work_dir or store.parent / (store.name + "-work")
            store = LocalArtifactStore(store)
        self.store = store
        self.cwd = Path.cwd()  # the processes' working directory
        self.work_dir = (work_dir or Path(".dagfold") / "agent-work").absolute()
        self.speed = speed
        self.runtime = runtime if runtime is not None else TaskRuntime()
        self._uploads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="agent-upload")

    def task_dir(self, job_id: str, task_id: str) -> Path:
        from urllib.parse import quote

        d = self.work_dir / quote(job_id, safe="") / quote(task_id, safe="")
        d.mkdir(parents=True, exist_ok=True)
        self.runtime.hand_over(d)  # the process writes its checkpoints and outputs there (task user)
        return d

    def start(self, alloc_id: str, epoch: int, job_id: str, task_id: str, attempt: int, gpus: list[int],
              resume: str | None, args_json: str = "{}", tenant: str = "default", traceparent: str = "") -> JobProcess:
        jp = JobProcess(alloc_id, epoch, job_id, task_id, attempt, None, gpus,  # type: ignore[arg-type]
                        tenant=tenant, work=self.task_dir(job_id, task_id),
                        traceparent=traceparent or attempt_traceparent(job_id, task_id, attempt))
        # both live in the task's folder, where an earlier attempt may have left a symlink or a file
        _real_dir(jp.checkpoint_dir, empty=False)
        self.runtime.hand_over(jp.checkpoint_dir)
        _real_dir(jp.output_dir, empty=True)
        self.runtime.hand_over(jp.output_dir)
        task_vars = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus), "DAGFOLD_ALLOC_ID": alloc_id,
                     "DAGFOLD_EPOCH": str(epoch), "DAGFOLD_JOB_ID": job_id, "DAGFOLD_TASK_ID": task_id,
                     "DAGFOLD_ATTEMPT": str(attempt),
                     "DAGFOLD_CHECKPOINT_DIR": str(jp.checkpoint_dir), "DAGFOLD_OUTPUT_DIR": str(jp.output_dir),
                     "DAGFOLD_ARGS_JSON": args_json, "DAGFOLD_SPEED": str(self.speed),
                     "TRACEPARENT": jp.traceparent}
        if resume:
            jp.checkpoint_uri = resume
            # into a folder of the agent's that no task process can write (an earlier attempt's could
            # have left symlinks in its checkpoint folder for this agent to write through)
            fresh = self._resume_dir(jp)
            shutil.rmtree(fresh, ignore_errors=True)
            with log_context(**jp.log_fields()):
                local = self._fetch(resume, fresh)
            if local is not None:
                task_vars["DAGFOLD_RESUME_CHECKPOINT"] = str(local)
        # the same allow list as a shell task's, never the agent's own environment (its credentials)
        env = self.runtime.process_env({}, task_vars, str(jp.work))
        env["PWD"] = str(self.cwd)
        jp.proc = self.runtime.spawn(self.command, env, str(self.cwd), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        jp._reader = threading.Thread(target=_with_log_fields, args=(jp, self._read), daemon=True)
        jp._reader.start()
        return jp

    def _resume_dir(self, jp: JobProcess) -> Path:
        return self.work_dir / ".resume" / jp.alloc_id.replace("/", "_")

    def _fetch(self, uri: str, dest: Path) -> Path | None:
        """The stored checkpoint, brought into the local checkpoint folder (None: not found; start over)."""
        try:
            return self.store.fetch_checkpoint(uri, dest)
        except (ArtifactError, OSError) as exc:
            log.warning("checkpoint %s cannot be read (%s); the attempt starts without it", uri, exc)
            return None
        except Exception as exc:  # storage unreachable (boto3/botocore errors)
            log.warning("checkpoint %s cannot be read (%r); the attempt starts without it", uri, exc)
            return None

    def _store_checkpoint(self, jp: JobProcess, reported: str) -> None:
        """Upload a checkpoint the process reported; only paths inside its checkpoint folder are taken."""
        base = Path(os.path.normpath(jp.checkpoint_dir))
        # a relative path is the process's own: relative to its working directory, as it wrote it
        path = Path(os.path.normpath(self.cwd / reported))
        if path == base or base not in path.parents or not os.path.lexists(path):
            log.warning("%s: checkpoint %r ignored: not inside DAGFOLD_CHECKPOINT_DIR", jp.alloc_id, reported)
            return
        try:  # read without following a symlink (the process may still be running): upload_checkpoint
            jp.checkpoint_uri = self.store.upload_checkpoint(
                path, checkpoint_prefix(jp.tenant, jp.job_id, jp.task_id), owner=self.runtime.owner(), base=base)
        except Exception as exc:  # storage errors: the previous checkpoint stays the resume point
            log.warning("%s: checkpoint upload failed: %r", jp.alloc_id, exc)
            return
        jp.last_checkpoint_ms = now_ms()

    def collect(self, jp: JobProcess) -> Future[list[Artifact]]:
        """Upload the outputs of a process that exited 0 (in the background: big outputs do not stall
        the agent's heartbeats)."""
        jp.upload = self._uploads.submit(self.store.upload_outputs, jp.output_dir,
                                         output_prefix(jp.tenant, jp.job_id, jp.task_id, jp.attempt),
                                         owner=self.runtime.owner())
        return jp.upload

    def drop_checkpoints(self, jp: JobProcess) -> int:
        """Delete the task's stored and local checkpoints (retention: after success)."""
        shutil.rmtree(jp.checkpoint_dir, ignore_errors=True)
        try:
            return self.store.delete_prefix(checkpoint_prefix(jp.tenant, jp.job_id, jp.task_id))
        except Exception as exc:
            log.warning("%s: checkpoints not deleted: %r", jp.alloc_id, exc)
            return 0

    def close(self) -> None:
        self._uploads.shutdown(wait=False, cancel_futures=True)

    def _read(self, jp: JobProcess) -> None:
        assert jp.proc.stdout is not None
        for line in jp.proc.stdout:
            line = line.strip()
            try:
                msg = json.loads(line) if line.startswith("{") and len(line) <= MAX_RESULT_BYTES else None
            except ValueError:
                msg = None
            if isinstance(msg, dict) and "progress" in msg:
                with contextlib.suppress(TypeError, ValueError):
                    p = float(msg["progress"])
                    if p == p:
                        jp.progress = min(1.0, max(0.0, p))
                        jp.progress_seen.append((time.monotonic(), jp.progress))
            elif isinstance(msg, dict) and "checkpoint" in msg:
                self._store_checkpoint(jp, str(msg["checkpoint"]))
            elif isinstance(msg, dict) and "output" in msg and len(jp.results) < MAX_OUTPUT_LINES:
                jp.results.append(msg["output"])
                jp.result_bytes += len(line)
            else:
                jp.lines = (jp.lines + [line[:2000]])[-50:]

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
            jp._reader.join(timeout=10)  # the last checkpoint's upload, after a SIGTERM
        if jp.exited() is not None:
            shutil.rmtree(self._resume_dir(jp), ignore_errors=True)


def _with_log_fields(jp: JobProcess, fn: Callable[[JobProcess], None]) -> None:
    """``fn(jp)`` with ``jp``'s log fields on every line it logs (a reader thread of its own)."""
    with log_context(**jp.log_fields()):
        fn(jp)
