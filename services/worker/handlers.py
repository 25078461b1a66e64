"""Task handlers: what a worker runs for a dispatched attempt.

A handler is a function ``fn(ctx: TaskContext) -> result``. It returns None or
a JSON-serialisable result (sent as ``result_json``), or raises to fail the
attempt (see ``services.worker.exceptions``: any exception fails it retryably,
``NonRetryableError`` fails it for good). Long handlers call
``ctx.heartbeat(progress, message)`` when they have news (the worker also
heartbeats on its own while a handler runs) and should give up soon after
``ctx.cancelled`` is set (StopTask, start-to-close timeout, worker shutdown).

Custom handlers, the small Python API::

    from services.worker.handlers import register_handler

    def resize(ctx):
        ...  # ctx.args, ctx.idempotency_key, ctx.heartbeat(0.5), ctx.cancelled
        return {"resized": 3}

    register_handler("resize", resize)

or, on a registry of one's own, ``@registry.handler("resize")``.

Built-ins: ``noop``, ``sleep`` (``args.seconds``) and ``shell`` (``args.cmd``
run by ``/bin/sh -c`` in its own process group; optional ``args.env`` (object),
``args.cwd``, ``args.kill_grace_s``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any, TypeVar

from services.worker.exceptions import (
    NonRetryableError,
    ProcessFailed,
    TaskCancelled,
    TaskTimeout,
    UnknownHandlerError,
)

TAIL_BYTES = 4096
"""How much of a process's stdout and stderr (the end) a report carries."""

HeartbeatFn = Callable[[float | None, str | None], None]


@dataclass
class TaskContext:
    """What a handler gets for one attempt."""

    job_id: str
    task_id: str
    attempt: int
    idempotency_key: str
    args: dict[str, Any] = field(default_factory=dict)
    tenant: str = "default"
    handler: str = ""
    worker_id: str = ""
    start_to_close_s: float | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str | None = None
    # Process handlers put the end of the process's output here; it goes into the report.
    stdout_tail: str = ""
    stderr_tail: str = ""
    # An empty folder for the attempt's outputs (when the worker has artifact storage): what the handler
    # or its process leaves there is uploaded when the attempt succeeds and listed in its report.
    output_dir: str | None = None
    on_heartbeat: HeartbeatFn | None = field(default=None, repr=False, compare=False)

    def heartbeat(self, progress: float | None = None, message: str | None = None) -> None:
        """Report liveness now, with optional progress (fraction in [0, 1]) and a short note.

        Heartbeats are rate-limited and sent by the worker; calling this often is cheap.
        """
        if progress is not None:
            progress = float(progress)
            progress = None if progress != progress else min(1.0, max(0.0, progress))  # NaN -> None
        if self.on_heartbeat is not None:
            self.on_heartbeat(progress, message)

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the handler to stop (sets ``cancelled``; the first reason is kept)."""
        if self.cancel_reason is None:
            self.cancel_reason = reason
        self.cancelled.set()

    def env(self) -> dict[str, str]:
        """The ``DAGFOLD_*`` variables a process handler passes to its process."""
        return {
            "DAGFOLD_JOB_ID": self.job_id,
            "DAGFOLD_TASK_ID": self.task_id,
            "DAGFOLD_ATTEMPT": str(self.attempt),
            "DAGFOLD_IDEMPOTENCY_KEY": self.idempotency_key,
            **({"DAGFOLD_OUTPUT_DIR": self.output_dir} if self.output_dir else {}),
        }


HandlerFn = Callable[[TaskContext], Any]
F = TypeVar("F", bound=HandlerFn)


@dataclass(frozen=True)
class Handler:
    """A registered handler.

    ``batched`` handlers are instant (like ``noop``): the worker sends their
    TaskStarted and outcome together with the rest of the polled batch, with
    one flush, and runs no heartbeat thread for them. Every other handler has
    its TaskStarted flushed before it runs (so the lease is taken promptly),
    heartbeats while it runs, and its outcome flushed when it ends.
    """

    name: str
    fn: HandlerFn
    batched: bool = False


class HandlerRegistry:
    """Handlers by name."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._lock = threading.Lock()

    @classmethod
    def with_builtins(cls) -> HandlerRegistry:
        """A new registry holding ``noop``, ``sleep`` and ``shell``."""
        reg = cls()
        reg.register("noop", noop, batched=True)
        reg.register("sleep", sleep)
        reg.register("shell", shell)
        return reg

    def register(self, name: str, fn: HandlerFn, *, batched: bool = False, replace: bool = False) -> None:
        """Register ``fn`` under ``name``; ValueError if taken (unless ``replace``)."""
        if not name or not isinstance(name, str):
            raise ValueError("handler name must be a non-empty string")
        if not callable(fn):
            raise TypeError(f"handler {name!r} is not callable")
        with self._lock:
            if name in self._handlers and not replace:
                raise ValueError(f"handler {name!r} is already registered")
            self._handlers[name] = Handler(name, fn, batched)

    def handler(self, name: str, *, batched: bool = False, replace: bool = False) -> Callable[[F], F]:
        """Decorator form of ``register``: ``@registry.handler("name")``."""

        def deco(fn: F) -> F:
            self.register(name, fn, batched=batched, replace=replace)
            return fn

        return deco

    def find(self, name: str) -> Handler | None:
        return self._handlers.get(name)

    def get(self, name: str) -> Handler:
        """The handler named ``name``, or UnknownHandlerError ("unknown handler 'x'")."""
        h = self._handlers.get(name)
        if h is None:
            raise UnknownHandlerError(name)
        return h

    def names(self) -> list[str]:
        return sorted(self._handlers)

    def __contains__(self, name: object) -> bool:
        return name in self._handlers


_default: HandlerRegistry | None = None
_default_lock = threading.Lock()


def default_registry() -> HandlerRegistry:
    """The process-wide registry (built-ins plus whatever ``register_handler`` added)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = HandlerRegistry.with_builtins()
        return _default


def register_handler(name: str, fn: HandlerFn, *, batched: bool = False, replace: bool = False) -> None:
    """Register a custom handler in the default registry (used by ``dagfold up`` / ``dagfold worker``).

    ``fn(ctx: TaskContext)`` returns None or a JSON-serialisable result, or
    raises (``NonRetryableError`` for failures that must not be retried). Use
    ``ctx.idempotency_key`` (stable across attempts) to deduplicate external
    side effects, e.g. with ``services.worker.sideeffects.SideEffectLedger``.
    Set ``batched=True`` only for instant handlers (see ``Handler``).
    """
    default_registry().register(name, fn, batched=batched, replace=replace)


# -- built-ins -----------------------------------------------------------------


def noop(ctx: TaskContext) -> None:
    """Does nothing and succeeds (benchmarks, DAG plumbing)."""
    return None


def sleep(ctx: TaskContext) -> None:
    """Sleeps ``args.seconds`` (default 0); stops early, failing, when cancelled."""
    seconds = ctx.args.get("seconds", 0)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds >= 0:
        raise NonRetryableError(f"sleep: args.seconds must be a number >= 0, got {seconds!r}")
    if ctx.cancelled.wait(float(seconds)):
        raise TaskCancelled(f"cancelled: {ctx.cancel_reason or 'cancelled'}")


class _Tail:
    """Keeps the last ``limit`` bytes of a stream."""

    def __init__(self, limit: int = TAIL_BYTES) -> None:
        self.limit = limit
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        if len(self.buf) > 4 * self.limit:
            del self.buf[: -self.limit]

    def text(self) -> str:
        return bytes(self.buf[-self.limit :]).decode("utf-8", "replace")


def _drain(stream: IO[bytes], tail: _Tail) -> None:
    fd = stream.fileno()
    try:
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            tail.feed(chunk)
    except OSError:
        pass
    finally:
        stream.close()


def _killpg(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``, reap the leader."""
    _killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    _killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def shell(ctx: TaskContext) -> None:
    """Runs ``args.cmd`` with ``/bin/sh -c`` in its own process group.

    The environment is the worker's, plus ``args.env``, plus ``DAGFOLD_JOB_ID``,
    ``DAGFOLD_TASK_ID``, ``DAGFOLD_ATTEMPT`` and ``DAGFOLD_IDEMPOTENCY_KEY``.
    Exit 0 succeeds; another status raises ProcessFailed ("exit code N"). Both
    output streams are drained by threads (no pipe deadlock on big outputs) and
    their last ``TAIL_BYTES`` bytes are left in ``ctx.stdout_tail``/``stderr_tail``.
    On cancellation or after ``ctx.start_to_close_s`` the whole group gets
    SIGTERM, then SIGKILL after ``args.kill_grace_s`` (default 2 s). Processes
    the command leaves behind holding its output open are killed too.
    """
    cmd = ctx.args.get("cmd")
    if not isinstance(cmd, str) or not cmd.strip():
        raise NonRetryableError("shell: args.cmd must be a non-empty string")
    extra_env = ctx.args.get("env") or {}
    if not isinstance(extra_env, dict):
        raise NonRetryableError("shell: args.env must be an object")
    cwd = ctx.args.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise NonRetryableError("shell: args.cwd must be a string")
    grace = ctx.args.get("kill_grace_s", 2.0)
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace >= 0:
        raise NonRetryableError("shell: args.kill_grace_s must be a number >= 0")
    env = dict(os.environ)
    env.update({str(k): str(v) for k, v in extra_env.items()})
    env.update(ctx.env())

    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", cmd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError as exc:
        raise NonRetryableError(f"shell: cannot start /bin/sh: {exc}") from exc
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Tail(), _Tail()
    readers = [
        threading.Thread(target=_drain, args=(proc.stdout, out), daemon=True, name="shell-stdout"),
        threading.Thread(target=_drain, args=(proc.stderr, err), daemon=True, name="shell-stderr"),
    ]
    for t in readers:
        t.start()
    deadline = started + ctx.start_to_close_s if ctx.start_to_close_s else None
    stopped_by: str | None = None
    try:
        while True:
            try:
                proc.wait(timeout=0.05)
                break
            except subprocess.TimeoutExpired:
                pass
            if ctx.cancelled.is_set():
                stopped_by = "cancelled"
                break
            if deadline is not None and time.monotonic() >= deadline:
                stopped_by = "timeout"
                break
    finally:
        if proc.returncode is None:  # cancelled, timed out, or interrupted
            _kill_group(proc, float(grace))
    # Leftover processes of the group may still hold the pipes open.
    end = time.monotonic() + 0.5
    for t in readers:
        t.join(timeout=max(0.0, end - time.monotonic()))
    if any(t.is_alive() for t in readers):
        _killpg(proc.pid, signal.SIGKILL)
        for t in readers:
            t.join(timeout=2.0)
    ctx.stdout_tail, ctx.stderr_tail = out.text(), err.text()
    if stopped_by == "timeout":
        raise TaskTimeout()
    if stopped_by == "cancelled":
        raise TaskCancelled(f"cancelled: {ctx.cancel_reason or 'cancelled'}")
    if proc.returncode != 0:
        raise ProcessFailed(proc.returncode)
