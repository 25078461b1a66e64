"""Helpers for black-box tests that run the `dagfold` command as a user would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
DAGFOLD = [sys.executable, "-m", "dagfold"]
TERMINAL = {"succeeded", "succeeded_partial", "failed", "cancelled", "rejected"}
# Kafka consumers of the tests: a member that died (kill -9) leaves its group within seconds instead of
# librdkafka's default 45 s session timeout, so that its partitions move (and a restart's rebalance ends) soon.
TEST_CONSUMER_CONFIG = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
# A killed instance's open transaction holds back every read_committed reader of its partitions until the
# broker aborts it: librdkafka's default transaction timeout is 60 s; the tests' processes use 15 s.
TEST_PRODUCER_CONFIG = {"transaction.timeout.ms": 15000}


def kafka_url(bootstrap: str) -> str:
    """The log URL of the broker ``bootstrap`` for every process a test starts, with the test client settings."""
    return f"kafka://{bootstrap}?" + "&".join([*(f"consumer.{k}={v}" for k, v in TEST_CONSUMER_CONFIG.items()),
                                               *(f"producer.{k}={v}" for k, v in TEST_PRODUCER_CONFIG.items())])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the test process dies, even killed (a timeout's SIGTERM or
    SIGKILL runs no fixture teardown), so that no `dagfold up` outlives its test session. Linux only."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stop_process_groups(procs: Iterable[subprocess.Popen[Any]], grace_s: float = 15.0, *,
                        resume: bool = False) -> None:
    """Stop processes started each in its own session: SIGTERM to each one's process group (``resume``: SIGCONT
    first, for a group a test stopped), then wait up to ``grace_s`` for each; a group still running then is
    killed (SIGKILL)."""
    procs = list(procs)
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            if resume:
                os.killpg(p.pid, signal.SIGCONT)
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def dagfold(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DAGFOLD, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


class UpProcess:
    """`dagfold up` in a process of its own (its own session, so that kill9 takes its children too), on a free
    port unless ``port`` is given, with an HTTP client for its API.

    The one helper for every test that starts `dagfold up` as a user would. ``start()`` waits until
    ``/healthz`` answers (60 s) and raises ``RuntimeError`` with the end of the process's output if it exits
    first or does not answer; the output goes to ``<data's parent>/up-<port>.log`` (``output()``).
    ``stop()`` sends SIGTERM and waits 30 s, then kills the process group. ``clean_env`` drops the caller's
    ``DAGFOLD_*`` variables (a newcomer's shell), so that only the flags given here configure it.
    """

    def __init__(self, data: Path, log: str = "embedded", workers: int = 2, port: int | None = None,
                 args: tuple[str, ...] = (), *, clean_env: bool = False, command: Sequence[str] | None = None) -> None:
        self.data, self.log, self.workers, self.args = data, log, workers, args
        self.clean_env = clean_env
        self.command = list(command) if command is not None else None
        self.port = port or free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.log_path = data.parent / f"up-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.api

    def output(self, tail: int = 4000) -> str:
        """The end of what the process printed (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def start(self) -> UpProcess:
        self.data.parent.mkdir(parents=True, exist_ok=True)
        # DAGFOLD_ALLOW_ROOT_TASKS is the suite's own opt-in (tests/conftest.py), not a caller's setting
        env = {k: v for k, v in os.environ.items()
               if not (self.clean_env and k.startswith("DAGFOLD_") and k != "DAGFOLD_ALLOW_ROOT_TASKS")}
        with open(self.log_path, "ab") as logf:  # the child holds its own copy of the descriptor
            self.proc = subprocess.Popen(
                [*(self.command or DAGFOLD), "up", "--log", self.log, "--data", str(self.data),
                 "--workers", str(self.workers), "--port", str(self.port), *self.args],
                cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                env=env, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dagfold up exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.api + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"dagfold up did not answer within 60 s:\n{self.output()}")

    def __enter__(self) -> UpProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kill9(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill9()

    def submit(self, body: str | dict[str, Any], content_type: str = "application/yaml") -> str:
        """POST /v1/jobs: a YAML (or ``content_type``) document as text, or a spec as JSON."""
        if isinstance(body, dict):
            body, content_type = json.dumps(body), "application/json"
        r = httpx.post(self.api + "/v1/jobs", content=body, headers={"content-type": content_type}, timeout=30)
        assert r.status_code == 202, r.text
        return str(r.json()["job_id"])

    def job(self, job_id: str) -> dict[str, Any] | None:
        r = httpx.get(f"{self.api}/v1/jobs/{job_id}", timeout=10)
        return r.json() if r.status_code == 200 else None

    def wait(self, job_id: str, timeout: float = 120, states: set[str] = TERMINAL) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        job = None
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job and job["state"] in states:
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id} not in {states} after {timeout}s: {job}")
