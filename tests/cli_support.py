"""Helpers for black-box tests that run the `dagfold` command as a user would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
DAGFOLD = [sys.executable, "-m", "dagfold"]
TERMINAL = {"succeeded", "succeeded_partial", "failed", "cancelled", "rejected"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dagfold(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DAGFOLD, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


class UpProcess:
    """`dagfold up` in a subprocess, with an HTTP client for its API."""

    def __init__(self, data: Path, log: str = "embedded", workers: int = 2, port: int | None = None,
                 args: tuple[str, ...] = ()) -> None:
        self.data, self.log, self.workers, self.args = data, log, workers, args
        self.port = port or free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> UpProcess:
        logf = open(self.data.parent / f"up-{self.port}.log", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            [*DAGFOLD, "up", "--log", self.log, "--data", str(self.data), "--workers", str(self.workers),
             "--port", str(self.port), *self.args], cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dagfold up exited with {self.proc.returncode}")
            try:
                if httpx.get(self.api + "/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("dagfold up did not answer within 60 s")

    def kill9(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill9()

    def submit(self, body: str, content_type: str = "application/yaml") -> str:
        r = httpx.post(self.api + "/v1/jobs", content=body, headers={"content-type": content_type}, timeout=10)
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
