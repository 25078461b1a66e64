"""The local stack: scheduler, projector, workers and API in one process.

``dagfold up`` and ``dagfold run`` use it. On the embedded log everything must
share one process (the log is a RocksDB folder that one process opens); on
Kafka the same pieces also run as separate processes (``dagfold worker``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dagfold.artifacts import open_store
from dagfold.commands import CommandSender
from dagfold.config import Config
from dagfold.exceptions import disk_full
from dagfold.log import Log, open_log
from dagfold.projections.jobs import TERMINAL_JOB_STATES
from dagfold.projections.projector import Projector
from dagfold.services.callbacks import CallbackNotifier
from dagfold.services.callbacks.egress import log_ports
from dagfold.services.scheduler.runner import SchedulerRunner
from dagfold.services.tracing import SpanExporter
from dagfold.services.worker.handlers import HandlerRegistry, TaskRuntime, default_registry
from dagfold.services.worker.worker import Worker
from dagfold.tracing import otlp_enabled

log = logging.getLogger("dagfold.stack")
CLOSE_TIMEOUT_S = 15.0  # each group of clients closing at stop, in parallel



@dataclass(frozen=True)
class StackOptions:
    workers: int = 2
    queues: tuple[str, ...] = ("default",)
    api: bool = True
    scheduler: bool = True  # False: API/projector/workers only, schedulers run as `dagfold scheduler`
    scheduler_instance: str = "0"
    registry: HandlerRegistry = field(default_factory=default_registry)  # the workers' capabilities (no shell)
    runtime: TaskRuntime = field(default_factory=TaskRuntime)  # environment, folder and user of task processes
    callbacks: bool = True  # the job-end callback notifier (one per deployment: its ledger is local)
    traces: bool = True  # the span exporter when tracing is on (False: `dagfold traces` processes run it)
    # GPU pool in this process: its allocator and gpu_nodes simulated node agents running the demo job
    # (on Kafka, real hosts run `dagfold agent` and the pool's `dagfold allocator` runs once, elsewhere)
    gpu_nodes: int = 0
    gpus_per_node: int = 8
    gpu_pool: str = "default"
    # a one-shot run on Kafka lives in its own topic namespace, deleted at stop (topics and groups)
    delete_namespace_at_stop: bool = False


class Stack:
    """Starts the pieces as threads; ``failed`` tells when one of them died."""

    def __init__(self, config: Config, options: StackOptions | None = None) -> None:
        self.config = config
        self.options = options or StackOptions()
        self.stop_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.log: Log | None = None
        self.api_server: Any = None
        self.close_timeout_s = CLOSE_TIMEOUT_S
        self.close_timeouts: list[str] = []  # parts whose close did not return in time

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        def guarded() -> None:
            try:
                target()
            except BaseException as exc:  # surfaced through .failed; the CLI exits non-zero
                if disk_full(exc):  # one line: the cause is the disk, not the code
                    log.error("%s stopped: no space left on device under %s", name, self.config.data_dir)
                else:
                    log.exception("%s stopped with an error", name)
                self.errors.append(exc)
                self.stop_event.set()

        t = threading.Thread(target=guarded, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def start(self) -> Stack:
        cfg = self.config
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):  # the service's state and secrets: not for task users to read
            cfg.data_dir.chmod(0o700)
        self.log = open_log(cfg.log_url, cfg.data_dir, prefix=cfg.topic_prefix)
        self.log.create_topics(cfg.core_topics() + [cfg.dispatch_spec(q) for q in self.options.queues])
        if self.options.scheduler:
            self.runner = SchedulerRunner(self.log, cfg, self.options.scheduler_instance)
            self._spawn("scheduler", lambda: self.runner.run(self.stop_event))
        self.projector = Projector(self.log, cfg.data_dir / "projections")
        self.read_model = self.projector.read_model
        self._spawn("projector", lambda: self.projector.run(self.stop_event))
        self.notifier: CallbackNotifier | None = None
        if self.options.callbacks:
            notifier = self.notifier = CallbackNotifier(  # DAGFOLD_CALLBACK_* settings; never to its own API
                self.log, cfg.data_dir, own_ports=(cfg.api_port, *log_ports(cfg.log_url)))
            self._spawn("callbacks", lambda: notifier.run(self.stop_event))
        self.span_exporter: SpanExporter | None = None
        if self.options.traces and otlp_enabled():  # OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT set: spans from events
            exporter = self.span_exporter = SpanExporter(self.log)
            self._spawn("traces", lambda: exporter.run(self.stop_event))
        self.artifacts = open_store(cfg.artifacts_url, cfg.data_dir)  # task outputs, GPU checkpoints
        host = f"{socket.gethostname()}-{os.getpid()}"  # unique per process: a restart is a new worker
        self.workers: list[Worker] = []
        for q in self.options.queues:
            for i in range(self.options.workers):
                w = Worker(self.log, q, f"{host}-{q}-{i}", self.options.registry, config=cfg,
                           artifacts=self.artifacts, runtime=self.options.runtime)
                self.workers.append(w)
                self._spawn(f"worker-{q}-{i}", lambda w=w: w.run(self.stop_event))  # type: ignore[misc]
        if self.options.gpu_nodes:
            self._start_gpu_pool()
        self.sender = CommandSender(self.log, "dagfold-stack")
        if self.options.api:
            self._start_api()
        return self

    def _start_gpu_pool(self) -> None:
        """The pool's allocator and its simulated hosts (demo job processes on simulated GPUs)."""
        from dagfold.services.agent.agent import simulated
        from dagfold.services.allocator.options import options_for_pool
        from dagfold.services.allocator.runner import AllocatorRunner
        from dagfold.services.api.auth import AuthConfig

        assert self.log is not None
        o = self.options
        tenants = AuthConfig.from_env().limits  # the auth file's weights and quotas (DAGFOLD_AUTH_FILE)
        allocator = AllocatorRunner(self.log, options_for_pool(o.gpu_pool, tenants), self.config.data_dir)
        self._spawn("allocator", lambda: allocator.run(self.stop_event))
        command = [sys.executable, "-m", "dagfold.services.agent.demo_job"]
        store = self.artifacts
        work: Path | None = None
        if o.runtime.owner() is not None:  # a task user cannot reach into the data folder (0700): work elsewhere
            work = Path(tempfile.mkdtemp(prefix="dagfold-agent-work-", dir=o.runtime.work_root))
            work.chmod(0o711)  # the task user passes through to its own task folders, lists nothing
        self.agent_work = work
        self.agents = []
        for i in range(o.gpu_nodes):
            node = f"{o.gpu_pool}-node-{i}"
            agent, _ = simulated(self.log, o.gpu_pool, node, command, self.config.data_dir / "artifacts",
                                 gpus=o.gpus_per_node, store=store, work_dir=work / node if work else None,
                                 runtime=o.runtime)  # job processes: the shell tasks' environment and user
            self.agents.append(agent)
            self._spawn(f"agent-{i}", lambda a=agent: a.run(self.stop_event.is_set))  # type: ignore[misc]

    def _start_api(self) -> None:
        import uvicorn

        from dagfold.services.api.app import create_app

        assert self.log is not None
        app = create_app(self.log, self.read_model, self.config,
                         callbacks=self.notifier.ledger if self.notifier is not None else None,
                         handlers=self.options.registry if self.options.workers else None)
        server = uvicorn.Server(uvicorn.Config(app, host=self.config.api_host, port=self.config.api_port,
                                               log_level="warning", lifespan="on"))
        server.install_signal_handlers = lambda: None  # type: ignore[attr-defined]  # the CLI owns signals
        self.api_server = server
        # Bind here, in start(): a port in use is an OSError the caller reports in one line (in the server's
        # thread it was a logged traceback and a SystemExit, after `up` had said the API was up).
        host, port = self.config.api_host, self.config.api_port
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None
        self._spawn("api", lambda: server.run(sockets=[sock]))
        deadline = time.monotonic() + 15
        while not server.started and time.monotonic() < deadline and not self.errors:
            time.sleep(0.05)

    @property
    def failed(self) -> bool:
        return bool(self.errors)

    def wait_job(self, job_id: str, timeout_s: float = 600.0, poll_s: float = 0.05) -> dict[str, Any] | None:
        """Block until the job is terminal in the read model (or timeout/failure); returns the summary."""
        deadline = time.monotonic() + timeout_s
        job = None
        while time.monotonic() < deadline and not self.failed:
            job = self.read_model.get_job(job_id)
            if job is not None and job["state"] in TERMINAL_JOB_STATES:
                return job
            time.sleep(poll_s)
        return job

    def stop(self) -> None:
        self.stop_event.set()
        if self.api_server is not None:
            self.api_server.should_exit = True
        for t in self.threads:
            t.join(timeout=10)
        # the clients close in parallel, each bounded: a consumer's close can hang inside librdkafka
        # (seen once in 21 one-shot runs; cf. librdkafka #4041), and a stop must still end
        self._close_all([(f"worker {w.worker_id}", w.close) for w in getattr(self, "workers", [])]
                        + [(f"agent {i}", a.close) for i, a in enumerate(getattr(self, "agents", []))])
        parts: list[tuple[str, Callable[[], None]]] = []
        if hasattr(self, "projector"):
            parts.append(("projector", self.projector.close))
        if (notifier := getattr(self, "notifier", None)) is not None:
            parts.append(("callback notifier", notifier.close))
        if (span_exporter := getattr(self, "span_exporter", None)) is not None:
            parts.append(("span exporter", span_exporter.close))
        if hasattr(self, "sender"):
            parts.append(("command sender", self.sender.close))
        self._close_all(parts)
        if self.log is not None:
            if self.options.delete_namespace_at_stop:
                self._close_all([("namespace deletion", self._delete_namespace)])
            self._close_all([("log", self.log.close)])
        if (work := getattr(self, "agent_work", None)) is not None:
            shutil.rmtree(work, ignore_errors=True)

    def _delete_namespace(self) -> None:
        delete = getattr(self.log, "delete_namespace", None)
        if delete is not None:
            topics, groups = delete()
            log.info("deleted the run's namespace %s: %d topics, %d consumer groups",
                     self.config.topic_prefix, topics, groups)

    def _close(self, name: str, close: Callable[[], None]) -> None:
        """Close one part; a failure (a store whose disk filled up cannot flush) is logged, the rest still close."""
        try:
            close()
        except Exception as exc:
            log.warning("closing the %s failed: %s", name, exc)

    def _close_all(self, parts: list[tuple[str, Callable[[], None]]], timeout_s: float | None = None) -> None:
        """Close parts in parallel threads, waiting at most ``timeout_s`` in all; a part that fails is
        logged, one that does not return in time is logged and left behind (a daemon thread)."""
        deadline = time.monotonic() + (self.close_timeout_s if timeout_s is None else timeout_s)
        threads = []
        for name, close in parts:
            t = threading.Thread(target=self._close, args=(name, close), name=f"close-{name}", daemon=True)
            t.start()
            threads.append((name, t))
        for name, t in threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.0))
            if t.is_alive():
                self.close_timeouts.append(name)
                log.warning("closing the %s did not finish within %.0f s; left behind", name,
                            self.close_timeout_s if timeout_s is None else timeout_s)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
