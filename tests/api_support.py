"""Helpers for the API tests: an app over an embedded log and a projector, and a live uvicorn server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from dagfold.codec import default_codec, make
from dagfold.config import COMMANDS, EVENTS, Config
from dagfold.jobspec import spec_hash
from dagfold.log.base import TopicPartition
from dagfold.log.embedded import EmbeddedLog
from dagfold.projections import Projector, ReadModel
from dagfold.projections import cluster as cluster_model
from dagfold.services.api import create_app
from dagfold.services.api.admission import AdmissionConfig
from dagfold.services.api.auth import AuthConfig
from dagfold.services.api.guard import GuardConfig
from dagfold.services.worker.handlers import HandlerRegistry

T0 = 1_700_000_000_000


def now_ms() -> int:
    return int(time.time() * 1000)


def ev(name: str, **fields: Any) -> dict[str, Any]:
    return make("dagfold.event." + name, **fields)


def accepted(job_id: str, task_ids: list[str] | None = None, ts: int = T0, tenant: str = "acme",
             deps: dict[str, list[str]] | None = None, spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JobAccepted event: for ``spec`` (as submitted, hash included) or for noop tasks ``task_ids``."""
    if spec is None:
        deps = deps or {}
        tasks = [make("dagfold.common.TaskSpec", task_id=t, handler="noop", depends_on=deps.get(t, []))
                 for t in task_ids or []]
        spec = make("dagfold.common.JobSpec", job_id=job_id, tenant=tenant, tasks=tasks)
    return make("dagfold.event.JobAccepted", job_id=job_id, ts_ms=ts, spec=spec, spec_hash=spec_hash(spec))


class ApiHarness:
    def __init__(self, tmp: Path, *, auth: AuthConfig | None = None, admission: AdmissionConfig | None = None,
                 max_body_bytes: int | None = None, guard: GuardConfig | None = None,
                 handlers: HandlerRegistry | None = None) -> None:
        self.config = Config(partitions=4)
        self.log = EmbeddedLog(tmp / "log")
        self.log.create_topics(self.config.core_topics())
        self.projector = Projector(self.log, tmp / "read")
        self.rm = ReadModel(self.projector.store)
        self.app: FastAPI = create_app(self.log, self.rm, self.config, max_body_bytes=max_body_bytes,
                                       auth=auth or AuthConfig(), admission=admission, sse_poll_s=0.05,
                                       guard=guard, handlers=handlers)
        self.client = TestClient(self.app, base_url="http://127.0.0.1")
        self._producer = self.log.producer("test")

    def commands(self) -> list[dict[str, Any]]:
        out = []
        for p in range(self.log.partitions(COMMANDS)):
            out += [default_codec().decode(r.value) for r in self.log.read(TopicPartition(COMMANDS, p), 0, 10_000)]
        return out

    def emit(self, *events: dict[str, Any]) -> None:
        for e in events:
            self._producer.send(EVENTS, e["job_id"].encode(), default_codec().encode(e))
        self._producer.flush()

    def project(self, *events: dict[str, Any]) -> None:
        self.emit(*events)
        self.projector.catch_up(timeout_s=10, idle_s=0.2)

    def allocator(self, *events: dict[str, Any]) -> None:
        """Allocator events, folded straight into the store (their schemas come with the allocator)."""
        txn = self.projector.store.txn()
        for e in events:
            cluster_model.apply(txn, e)
        self.projector.store.commit(txn)

    def accept_submitted(self, ts: int | None = None) -> list[str]:
        """Play the scheduler: accept every SubmitJob sent so far (once per job); returns their IDs."""
        seen = set()
        events = []
        for c in self.commands():
            if c["type"] != "dagfold.command.SubmitJob":
                continue
            spec = c["spec"]
            if spec["job_id"] in seen or self.rm.get_job(spec["job_id"]) is not None:
                continue
            seen.add(spec["job_id"])
            events.append(accepted(spec["job_id"], spec=spec, ts=ts or now_ms()))
        self.project(*events)
        return [e["job_id"] for e in events]

    def close(self) -> None:
        self.client.close()
        self.projector.close()
        self.log.close()


def wait_until(get: Callable[[], Any], what: str = "condition", timeout_s: float = 30.0,
               interval_s: float = 0.05) -> Any:
    """``get()``'s first truthy value, polled every ``interval_s``; fails naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = get()
        if v:
            return v
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s}s")


def wait_js(page: Any, expr: str, timeout: float = 30) -> Any:
    """The first truthy value of the JavaScript ``expr`` in a Playwright ``page``."""
    return wait_until(lambda: page.evaluate(expr), f"{expr} stayed falsy", timeout, 0.1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """The app on a real uvicorn server in a thread (streaming and concurrency as in production)."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="off"))
        self.server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "uvicorn did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)
