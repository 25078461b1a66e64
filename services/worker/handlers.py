"""Task handlers: what a worker runs for a dispatched attempt.

A handler is a function ``fn(ctx: TaskContext) -> result``. It returns None or
a JSON-serialisable result (sent as ``result_json``), or raises to fail the
attempt (see ``dagfold.services.worker.exceptions``: any exception fails it retryably,
``NonRetryableError`` fails it for good). Long handlers call
``ctx.heartbeat(progress, message)`` when they have news (the worker also
heartbeats on its own while a handler runs) and should give up soon after
``ctx.cancelled`` is set (StopTask, start-to-close timeout, worker shutdown).

Custom handlers, the small Python API::

    from dagfold.services.worker.handlers import register_handler

    def resize(ctx):
        ...  # ctx.args, ctx.idempotency_key, ctx.heartbeat(0.5), ctx.cancelled
        return {"resized": 3}

    register_handler("resize", resize)

or, on a registry of one's own, ``@registry.handler("resize")``.

Built-ins: ``noop``, ``sleep`` (``args.seconds``) and ``shell`` (``args.cmd``
run by ``/bin/sh -c`` under its own reaper, ``dagfold.services.worker.reaper``; optional ``args.env`` (object),
``args.cwd``, ``args.kill_grace_s``). ``shell`` is a capability a worker must
enable (``HandlerRegistry.with_builtins(shell=True)``, ``--handlers ...,shell``);
see ``dagfold.services.worker.capabilities`` and docs/security.md. A handler may carry
an argument check (``args_check``), run at submission where the API knows the
registry, and by the worker before every attempt.

Process handlers run without the service's secrets (``TaskRuntime``): a
minimal environment, a fresh per-attempt work folder, and another user where
one is configured and the worker runs as root. Every process a task starts
ends with it (``TaskRuntime.spawn``: the reaper), even when the worker is
killed.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

from dagfold.services.worker import reaper
from dagfold.services.worker.capabilities import ArgsCheck, check_noop, check_shell, check_sleep
from dagfold.services.worker.exceptions import (
    NonRetryableError,
    ProcessFailed,
    TaskCancelled,
    TaskTimeout,
    UnknownHandlerError,
)

TAIL_BYTES = 4096
"""How much of a process's stdout and stderr (the end) a report carries."""

HeartbeatFn = Callable[[float | None, str | None], None]

PASS_ENV_DEFAULT = ("PATH", "LANG", "LC_ALL", "TZ")
"""Variables of the worker's environment a task process inherits by default: none of them secret."""


@dataclass(frozen=True)
class TaskRuntime:
    """Where and as whom process handlers run: the task side of the trust boundary.

    A task process never inherits the worker's environment (which may hold
    ``DAGFOLD_AUTH_FILE``, ``DAGFOLD_API_KEYS``, ``DAGFOLD_CALLBACK_SECRET``,
    Kafka credentials, the data folder's path): it gets ``pass_env`` copied
    from the worker, ``set_env`` (operator-fixed values), the spec's
    ``args.env``, and its ``DAGFOLD_*`` task variables. Its working directory
    is a fresh folder per attempt (``HOME`` and ``TMPDIR`` too), under
    ``work_root`` (default: the system's temp folder), removed after the
    attempt. With ``user`` set and the worker running as root, the process runs
    as that user (its primary group, no supplementary groups). GPU job
    processes of a node agent get the same environment and user (one allow
    list for every task process).

    Running task processes as root with no ``user`` is refused by ``check``
    (root reads every secret of the host) unless ``allow_root`` says the
    operator wants it (``--allow-root-tasks``).
    """

    pass_env: tuple[str, ...] = PASS_ENV_DEFAULT
    set_env: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    work_root: Path | None = None
    allow_root: bool = False

    def __post_init__(self) -> None:
        if self.work_root is not None:  # made absolute once: HOME, TMPDIR and the working directory hold it
            object.__setattr__(self, "work_root", self.work_root.absolute())

    def check(self, *, runs_processes: bool = True) -> None:
        """Raise ValueError for a setting that cannot work (unknown user, user without root), or for task
        processes that would run as root (``runs_processes``) without a task user or ``allow_root``."""
        if runs_processes and self.user is None and os.geteuid() == 0 and not self.allow_root:
            raise ValueError("task processes would run as root and could read every secret of this host: "
                             "give --task-user USER (e.g. nobody), or --allow-root-tasks to run them as root anyway")
        if self.user is not None:
            try:
                pwd.getpwnam(self.user)
            except KeyError:
                raise ValueError(f"task user {self.user!r} does not exist") from None
            if os.geteuid() != 0:
                raise ValueError(f"running tasks as {self.user!r} needs a worker running as root")
        if self.work_root is not None and not self.work_root.is_dir():
            raise ValueError(f"task work folder root {self.work_root} is not a directory")

    @staticmethod
    def protect_process() -> bool:
        """Make this process's /proc files (environ, memory, fds, cwd) unreadable to same-user processes.

        Linux ``prctl(PR_SET_DUMPABLE, 0)`` (no core dumps either): a task running as the worker's user
        cannot read the service's environment from ``/proc/<worker>/environ``. Root (and a task user
        that is root) still can; for that, run tasks as another user (``user``). False where unavailable.
        """
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        if name is None:
            return False
        try:
            libc = ctypes.CDLL(name, use_errno=True)
            return int(libc.prctl(4, 0, 0, 0, 0)) == 0  # PR_SET_DUMPABLE = 4
        except (OSError, AttributeError):
            return False

    def _account(self) -> pwd.struct_passwd | None:
        if self.user is None or os.geteuid() != 0:
            return None
        return pwd.getpwnam(self.user)

    def process_env(self, extra: Mapping[str, Any], task_vars: Mapping[str, str], work_dir: str) -> dict[str, str]:
        env = {k: os.environ[k] for k in self.pass_env if k in os.environ}
        env.setdefault("PATH", os.defpath)
        env.update(self.set_env)
        env.update({str(k): str(v) for k, v in extra.items()})
        env.update({"HOME": work_dir, "TMPDIR": work_dir, "PWD": work_dir, "DAGFOLD_WORK_DIR": work_dir})
        env.update(task_vars)
        return env

    def hand_over(self, path: str | Path) -> None:
        """Make a folder the task's (owned by the task user, when tasks run as one): e.g. its output folder.

        A symlink there is never followed (a task could have left one in a folder it owns).
        """
        acct = self._account()
        if acct is not None:
            os.chown(path, acct.pw_uid, acct.pw_gid, follow_symlinks=False)

    def owner(self) -> int | None:
        """The user ID task processes run as, when it is not the service's (their outputs must be theirs)."""
        acct = self._account()
        return None if acct is None else acct.pw_uid

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None, *, stdout: Any, stderr: Any,
              text: bool = False, bufsize: int = -1) -> ReapedPopen:
        """Start a task process under its own reaper (``dagfold.services.worker.reaper``), in a new session,
        as the task user if any (no supplementary groups, umask 077).

        ``terminate`` the Popen to signal the task's process group, ``kill`` it to end every process of
        the task; its ``wait`` returns once all of them are gone, with the command's status.
        """
        acct = self._account()
        uid, gid = (str(acct.pw_uid), str(acct.pw_gid)) if acct is not None else ("-", "-")
        # the standard library only, no site packages, no PYTHON* variables: the task's environment
        # cannot steer the reaper
        head = [sys.executable, "-I", "-S", reaper.__file__, str(os.getpid()), uid, gid, "077", "--"]
        return ReapedPopen([*head, *argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=stdout,
                           stderr=stderr, text=text, bufsize=bufsize, start_new_session=True)

    @contextlib.contextmanager
    def attempt_dir(self, ctx: TaskContext) -> Iterator[str]:
        """A fresh folder for one attempt (owned by the task user), removed afterwards."""
        root = str(self.work_root) if self.work_root is not None else None
        path = tempfile.mkdtemp(prefix=f"dagfold-attempt-{ctx.attempt}-", dir=root)
        self.hand_over(path)
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


class ReapedPopen(subprocess.Popen):  # type: ignore[type-arg]
    """The Popen of a task's reaper: ``kill`` ends every process of the task (a SIGKILL would end the
    reaper alone and leave the task's processes to init); ``terminate``/``send_signal(SIGTERM)`` reach
    the command's process group; ``wait`` returns once they are all gone, with the command's status."""

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.send_signal(reaper.KILL_SIGNAL)


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
    traceparent: str = ""  # the attempt's W3C trace context (dagfold.tracing): TRACEPARENT of its process
    cancelled: threading.Event = field(default_factory=threading.Event)
    cancel_reason: str | None = None
    # Process handlers put the end of the process's output here; it goes into the report.
    stdout_tail: str = ""
    stderr_tail: str = ""
    # An empty folder for the attempt's outputs (when the worker has artifact storage): what the handler
    # or its process leaves there is uploaded when the attempt succeeds and listed in its report.
    output_dir: str | None = None
    on_heartbeat: HeartbeatFn | None = field(default=None, repr=False, compare=False)
    runtime: TaskRuntime = field(default_factory=TaskRuntime, repr=False, compare=False)

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
            **({"TRACEPARENT": self.traceparent} if self.traceparent else {}),
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
    args_check: ArgsCheck | None = None


class HandlerRegistry:
    """Handlers by name: the capabilities of the workers built with it (they run nothing else)."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._lock = threading.Lock()

    @classmethod
    def with_builtins(cls, *, shell: bool = False) -> HandlerRegistry:
        """A new registry holding ``noop`` and ``sleep``, and ``shell`` only when asked for."""
        reg = cls()
        reg.register("noop", noop, batched=True, args_check=check_noop)
        reg.register("sleep", sleep, args_check=check_sleep)
        if shell:
            reg.register("shell", shell_handler, args_check=check_shell)
        return reg

    def select(self, names: tuple[str, ...] | list[str]) -> HandlerRegistry:
        """A new registry with exactly ``names``: this registry's handlers, ``shell`` enabled if named.

        ValueError for a name that is neither registered here nor a built-in.
        """
        builtins = HandlerRegistry.with_builtins(shell=True)
        reg = HandlerRegistry()
        for name in names:
            h = self.find(name) or builtins.find(name)
            if h is None:
                raise ValueError(f"unknown handler {name!r} (registered: {', '.join(self.names()) or 'none'}; "
                                 "built-ins: noop, sleep, shell)")
            reg._handlers[name] = h
        return reg

    def register(self, name: str, fn: HandlerFn, *, batched: bool = False, replace: bool = False,
                 args_check: ArgsCheck | None = None) -> None:
        """Register ``fn`` under ``name``; ValueError if taken (unless ``replace``).

        ``args_check(args) -> reason | None`` refuses bad arguments at submission (where the API
        runs with this registry) and before each attempt.
        """
        if not name or not isinstance(name, str):
            raise ValueError("handler name must be a non-empty string")
        if not callable(fn):
            raise TypeError(f"handler {name!r} is not callable")
        with self._lock:
            if name in self._handlers and not replace:
                raise ValueError(f"handler {name!r} is already registered")
            self._handlers[name] = Handler(name, fn, batched, args_check)

    def handler(self, name: str, *, batched: bool = False, replace: bool = False,
                args_check: ArgsCheck | None = None) -> Callable[[F], F]:
        """Decorator form of ``register``: ``@registry.handler("name")``."""

        def deco(fn: F) -> F:
            self.register(name, fn, batched=batched, replace=replace, args_check=args_check)
            return fn

        return deco

    def check_args(self, name: str, args: Mapping[str, Any]) -> str | None:
        """Why ``args`` are wrong for handler ``name`` (its own check); None if fine or unchecked."""
        h = self._handlers.get(name)
        return None if h is None or h.args_check is None else h.args_check(args)

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
    """The process-wide registry: ``noop``, ``sleep`` and whatever ``register_handler`` added.

    ``shell`` is not in it: a stack or worker enables it explicitly (``--handlers``, ``select``).
    """
    global _default
    with _default_lock:
        if _default is None:
            _default = HandlerRegistry.with_builtins()
        return _default


def register_handler(name: str, fn: HandlerFn, *, batched: bool = False, replace: bool = False,
                     args_check: ArgsCheck | None = None) -> None:
    """Register a custom handler in the default registry (used by ``dagfold up`` / ``dagfold worker``).

    ``fn(ctx: TaskContext)`` returns None or a JSON-serialisable result, or
    raises (``NonRetryableError`` for failures that must not be retried). Use
    ``ctx.idempotency_key`` (stable across attempts) to deduplicate external
    side effects, e.g. with ``dagfold.services.worker.sideeffects.SideEffectLedger``.
    Set ``batched=True`` only for instant handlers (see ``Handler``). ``args_check(args)`` returns
    the reason arguments are wrong, or None.
    """
    default_registry().register(name, fn, batched=batched, replace=replace, args_check=args_check)


# -- built-ins -----------------------------------------------------------------


def noop(ctx: TaskContext) -> None:
    """Does nothing and succeeds (benchmarks, DAG plumbing)."""
    return None


def sleep(ctx: TaskContext) -> None:
    """Sleeps ``args.seconds`` (default 0); stops early, failing, when cancelled."""
    bad = check_sleep(ctx.args)
    if bad:
        raise NonRetryableError(bad)
    if ctx.cancelled.wait(float(ctx.args.get("seconds", 0))):
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


def _kill_task(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the task's process group, end every process of the task after ``grace_s``, reap the reaper."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)  # the reaper hands it to the command's group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    proc.kill()  # a ReapedPopen: every process of the task
    proc.wait()


def shell(ctx: TaskContext) -> None:
    """Runs ``args.cmd`` with ``/bin/sh -c`` under its own reaper, in a fresh work folder.

    The environment is ``ctx.runtime``'s minimal one (never the worker's own),
    plus ``args.env``, plus ``DAGFOLD_JOB_ID``, ``DAGFOLD_TASK_ID``,
    ``DAGFOLD_ATTEMPT``, ``DAGFOLD_IDEMPOTENCY_KEY`` and ``DAGFOLD_WORK_DIR``
    (also ``HOME``, ``TMPDIR`` and the working directory; ``args.cwd`` is a
    folder inside it). Exit 0 succeeds; another status raises ProcessFailed
    ("exit code N"). Both output streams are drained by threads (no pipe
    deadlock on big outputs) and their last ``TAIL_BYTES`` bytes are left in
    ``ctx.stdout_tail``/``stderr_tail``. On cancellation or after
    ``ctx.start_to_close_s`` the whole group gets SIGTERM, then SIGKILL after
    ``args.kill_grace_s`` (default 2 s). Every process the command leaves
    behind (in its group or not: ``setsid``, double forks) is killed when it
    exits, before its outputs are read (``reaper``).
    """
    bad = check_shell(ctx.args)
    if bad:
        raise NonRetryableError(bad)
    with ctx.runtime.attempt_dir(ctx) as work_dir:
        cwd = work_dir
        if ctx.args.get("cwd"):
            cwd = os.path.join(work_dir, ctx.args["cwd"])
            try:
                os.makedirs(cwd, exist_ok=True)
                ctx.runtime.hand_over(cwd)
            except OSError as exc:
                raise NonRetryableError(f"shell: cannot create args.cwd: {exc}") from exc
        env = ctx.runtime.process_env(ctx.args.get("env") or {}, ctx.env(), work_dir)
        _run_shell(ctx, ctx.args["cmd"], env, cwd, float(ctx.args.get("kill_grace_s", 2.0)))


shell_handler = shell  # with_builtins' keyword ``shell`` hides the function's name there


def _run_shell(ctx: TaskContext, cmd: str, env: dict[str, str], cwd: str, grace: float) -> None:
    started = time.monotonic()
    try:
        proc = ctx.runtime.spawn(["/bin/sh", "-c", cmd], env, cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
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
            _kill_task(proc, grace)
    # The reaper has exited: every process of the task is gone, and the pipes with them.
    for t in readers:
        t.join(timeout=2.0)
    ctx.stdout_tail, ctx.stderr_tail = out.text(), err.text()
    if stopped_by == "timeout":
        raise TaskTimeout()
    if stopped_by == "cancelled":
        raise TaskCancelled(f"cancelled: {ctx.cancel_reason or 'cancelled'}")
    if proc.returncode != 0:
        raise ProcessFailed(proc.returncode)
