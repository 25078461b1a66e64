"""Handlers, the registry and the side-effect ledger, without a worker."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from dagfold.services.worker.exceptions import (
    NonRetryableError,
    ProcessFailed,
    TaskCancelled,
    TaskTimeout,
    UnknownHandlerError,
)
from dagfold.services.worker.handlers import (
    TAIL_BYTES,
    HandlerRegistry,
    TaskContext,
    default_registry,
    register_handler,
    shell,
    sleep,
)
from dagfold.services.worker.sideeffects import SideEffectLedger


def ctx(**args: object) -> TaskContext:
    return TaskContext(job_id="job-1", task_id="t1", attempt=2, idempotency_key="job-1/t1", args=dict(args))


def _alive(pid: int) -> bool:
    """True if the process exists and is not a zombie (orphans may never be reaped in containers)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_dead(pid: int, timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


# -- registry --------------------------------------------------------------------


def test_registry_register_decorator_and_lookup() -> None:
    reg = HandlerRegistry()

    @reg.handler("double")
    def double(c: TaskContext) -> int:
        return int(c.args["x"]) * 2

    reg.register("inst", lambda c: None, batched=True)
    assert reg.get("double").fn is double
    assert not reg.get("double").batched
    assert reg.get("inst").batched
    assert "double" in reg and "nope" not in reg
    assert reg.names() == ["double", "inst"]
    assert double(ctx(x=4)) == 8  # the decorator returns the function unchanged


def test_registry_unknown_and_duplicate() -> None:
    reg = HandlerRegistry.with_builtins()
    assert reg.names() == ["noop", "sleep"]  # shell only when enabled: with_builtins(shell=True), select
    assert HandlerRegistry.with_builtins(shell=True).names() == ["noop", "shell", "sleep"]
    assert reg.get("noop").batched
    with pytest.raises(UnknownHandlerError) as ei:
        reg.get("x")
    assert str(ei.value) == "unknown handler 'x'"
    assert ei.value.retryable is False
    assert reg.find("x") is None
    with pytest.raises(ValueError, match="already registered"):
        reg.register("noop", lambda c: None)
    reg.register("noop", lambda c: 1, replace=True)
    assert reg.get("noop").fn(ctx()) == 1


def test_register_handler_uses_default_registry() -> None:
    def custom(c: TaskContext) -> str:
        return "ok"

    try:
        register_handler("test-custom-handler", custom)
        assert default_registry().get("test-custom-handler").fn is custom
        assert {"noop", "sleep"} <= set(default_registry().names())
        assert "shell" not in default_registry().names()
    finally:
        default_registry()._handlers.pop("test-custom-handler", None)


def test_context_heartbeat_and_env() -> None:
    seen: list[tuple[float | None, str | None]] = []
    c = ctx()
    c.heartbeat(0.5)  # no callback: a no-op
    c.on_heartbeat = lambda p, m: seen.append((p, m))
    c.heartbeat(0.5, "half")
    c.heartbeat(7)
    c.heartbeat(float("nan"))
    c.heartbeat()
    assert seen == [(0.5, "half"), (1.0, None), (None, None), (None, None)]
    assert c.env() == {"DAGFOLD_JOB_ID": "job-1", "DAGFOLD_TASK_ID": "t1", "DAGFOLD_ATTEMPT": "2",
                       "DAGFOLD_IDEMPOTENCY_KEY": "job-1/t1"}


# -- sleep -------------------------------------------------------------------------


def test_sleep_sleeps_and_is_interruptible() -> None:
    t0 = time.monotonic()
    sleep(ctx(seconds=0.05))
    assert time.monotonic() - t0 >= 0.05
    c = ctx(seconds=30)
    threading.Timer(0.1, c.cancel, args=("stopped: test",)).start()
    t0 = time.monotonic()
    with pytest.raises(TaskCancelled, match="stopped: test"):
        sleep(c)
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize("bad", [-1, "x", True, None])
def test_sleep_rejects_bad_seconds(bad: object) -> None:
    with pytest.raises(NonRetryableError):
        sleep(ctx(seconds=bad))


# -- shell -------------------------------------------------------------------------


def test_shell_success_keeps_stdout_and_env() -> None:
    c = ctx(cmd='echo "$DAGFOLD_JOB_ID $DAGFOLD_TASK_ID $DAGFOLD_ATTEMPT $DAGFOLD_IDEMPOTENCY_KEY $EXTRA"; '
                'echo warn >&2', env={"EXTRA": "extra-value"})
    shell(c)
    assert c.stdout_tail == "job-1 t1 2 job-1/t1 extra-value\n"
    assert c.stderr_tail == "warn\n"


def test_shell_nonzero_exit() -> None:
    c = ctx(cmd="echo partial; echo boom >&2; exit 3")
    with pytest.raises(ProcessFailed) as ei:
        shell(c)
    assert ei.value.exit_code == 3
    assert ei.value.reason == "exit code 3"
    assert ei.value.error_type() is None
    assert ei.value.retryable is True
    assert c.stdout_tail == "partial\n"
    assert c.stderr_tail == "boom\n"


def test_shell_killed_by_signal() -> None:
    c = ctx(cmd="kill -9 $$")
    with pytest.raises(ProcessFailed, match="killed by signal SIGKILL") as ei:
        shell(c)
    assert ei.value.exit_code == -9


def test_shell_big_outputs_do_not_deadlock_and_keep_the_tail() -> None:
    # 2 MiB on each stream, far beyond a pipe buffer, interleaved.
    cmd = ("i=0; while [ $i -lt 32 ]; do head -c 65536 /dev/zero | tr '\\0' a; "
           "head -c 65536 /dev/zero | tr '\\0' b >&2; i=$((i+1)); done; printf END; printf ERR >&2")
    c = ctx(cmd=cmd)
    t0 = time.monotonic()
    shell(c)
    assert time.monotonic() - t0 < 10
    assert len(c.stdout_tail) == TAIL_BYTES and c.stdout_tail.endswith("aaaEND")
    assert len(c.stderr_tail) == TAIL_BYTES and c.stderr_tail.endswith("bbbERR")


def test_shell_start_to_close_timeout() -> None:
    c = ctx(cmd="echo started; sleep 30")
    c.start_to_close_s = 0.3
    t0 = time.monotonic()
    with pytest.raises(TaskTimeout) as ei:
        shell(c)
    assert str(ei.value) == "start_to_close_timeout"
    assert time.monotonic() - t0 < 3
    assert c.stdout_tail == "started\n"


def test_shell_cancel_kills_the_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    c = ctx(cmd=f"sleep 30 & echo $! > {pidfile}; wait")
    threading.Timer(0.3, c.cancel, args=("stopped: lease_expired",)).start()
    t0 = time.monotonic()
    with pytest.raises(TaskCancelled, match="lease_expired"):
        shell(c)
    assert time.monotonic() - t0 < 3
    child = int(pidfile.read_text())
    assert _wait_dead(child), "background child of the shell survived cancellation"


def test_shell_kills_leftovers_holding_its_output(tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    c = ctx(cmd=f"sleep 30 & echo $! > {pidfile}; echo done")
    t0 = time.monotonic()
    shell(c)
    assert time.monotonic() - t0 < 3
    assert c.stdout_tail == "done\n"
    assert _wait_dead(int(pidfile.read_text()))


def test_shell_term_ignored_gets_killed_after_grace() -> None:
    c = ctx(cmd="trap '' TERM; sleep 30", kill_grace_s=0.2)
    c.start_to_close_s = 0.2
    t0 = time.monotonic()
    with pytest.raises(TaskTimeout):
        shell(c)
    assert time.monotonic() - t0 < 3


@pytest.mark.parametrize("args", [{}, {"cmd": ""}, {"cmd": 5}, {"cmd": "true", "env": [1]},
                                  {"cmd": "true", "cwd": "/nonexistent/dir"}])
def test_shell_bad_args_are_not_retryable(args: dict[str, object]) -> None:
    with pytest.raises(NonRetryableError):
        shell(ctx(**args))


# -- side-effect ledger ---------------------------------------------------------------


def test_ledger_runs_once_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "ledger" / "side.sqlite"
    calls: list[int] = []

    def effect() -> dict[str, int]:
        calls.append(1)
        return {"receipt": len(calls)}

    with SideEffectLedger(path) as ledger:
        assert ledger.once("k1", effect) == {"receipt": 1}
        assert ledger.once("k1", effect) == {"receipt": 1}
        assert "k1" in ledger and "k2" not in ledger
    with SideEffectLedger(path) as ledger:
        assert ledger.once("k1", effect) == {"receipt": 1}
        assert ledger.get("k1") == (True, {"receipt": 1})
        assert ledger.once("k2", effect) == {"receipt": 2}
    assert len(calls) == 2


def test_ledger_failure_is_not_recorded(tmp_path: Path) -> None:
    ledger = SideEffectLedger(tmp_path / "l.sqlite")

    def fail() -> None:
        raise RuntimeError("down")

    with pytest.raises(RuntimeError):
        ledger.once("k", fail)
    assert ledger.get("k") == (False, None)
    assert ledger.once("k", lambda: None) is None  # None results are recorded too
    assert ledger.once("k", lambda: 5) is None
    ledger.close()


def test_ledger_concurrent_same_key_runs_once(tmp_path: Path) -> None:
    ledger = SideEffectLedger(tmp_path / "l.sqlite")
    calls: list[int] = []
    lock = threading.Lock()

    def effect() -> int:
        with lock:
            calls.append(1)
        time.sleep(0.05)
        return 42

    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(ledger.once("same", effect))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [42] * 8
    assert len(calls) == 1
    assert ledger._key_locks == {}
    ledger.close()
